"""A gateway stream's protobuf ``KvEventBatch`` as the Structs the msgpack decoder produces (`kvroute._wire`).

The gateway transport's half of the wire codec (docs/protocol.md §6): int64 hashes fold onto
uint64, ``tier`` (else the raw ``medium``, else the legacy ``cache_level``) becomes ``medium``,
extra keys become the msgpack shapes (text, bytes, int, ``[identifier, offset]``). An event that
cannot be mapped (blocks of different sizes, an extra key of unknown kind, too many blocks) is
skipped and counted; a batch that names no finite timestamp, or more events than the limits
allow, cannot be used at all.
"""

from __future__ import annotations

import math
from typing import Any, Final

from ._load import EngineLoad
from ._proto import smg_common_pb2 as pb
from ._wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EventBatch, Limits

__all__ = ["convert_batch", "convert_load"]

_MASK64: Final = (1 << 64) - 1

_TIER_MEDIUM: Final = {
    pb.KV_CACHE_TIER_DEVICE: "GPU",
    pb.KV_CACHE_TIER_HOST: "CPU",
    pb.KV_CACHE_TIER_DISK: "DISK",
    pb.KV_CACHE_TIER_EXTERNAL: "EXTERNAL",
}
_LEVEL_MEDIUM: Final = {0: "GPU", 1: "CPU", 2: "DISK", 3: "EXTERNAL"}
_LOCALITY: Final = {pb.KV_CACHE_LOCALITY_LOCAL: "LOCAL", pb.KV_CACHE_LOCALITY_REMOTE: "REMOTE"}


class _SkippedEvent(Exception):
    """One event that cannot be mapped; it is skipped and counted."""


def _medium(msg: Any, level: int | None) -> str | None:
    if msg.HasField("tier") and msg.tier in _TIER_MEDIUM:
        return _TIER_MEDIUM[msg.tier]
    if msg.HasField("medium") and msg.medium:
        return str(msg.medium)
    if level is not None:
        return _LEVEL_MEDIUM.get(level, "EXTERNAL")
    return None


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _extra_key(key: pb.KvBlockExtraKey) -> Any:
    kind = key.WhichOneof("key")
    if kind == "text":
        return key.text
    if kind == "blob":
        return bytes(key.blob)
    if kind == "number":
        return key.number
    if kind == "multimodal":
        return [key.multimodal.identifier, key.multimodal.offset]
    # A key kvroute cannot read would change what the block's content key means: dropping it
    # could make the block look like one without it, so the event goes instead.
    raise _SkippedEvent("extra key of unknown kind")


def _stored(ev: pb.KvBlocksStored, limits: Limits) -> BlockStored:
    blocks = ev.blocks
    if len(blocks) > limits.max_blocks_per_event:
        raise _SkippedEvent(f"{len(blocks)} blocks in one event")
    bs = blocks[0].block_size if blocks else 0
    if blocks and not 0 < bs <= limits.max_block_size:
        raise _SkippedEvent(f"block_size {bs}")
    tokens: list[int] = []
    hashes: list[int | bytes] = []
    keyed = False
    for i, b in enumerate(blocks):
        if b.block_size != bs:
            raise _SkippedEvent("blocks of different sizes in one event")
        n = len(b.token_ids)
        if n != bs and not (i == len(blocks) - 1 and 0 < n < bs):
            raise _SkippedEvent(f"block {i} has {n} tokens, block_size {bs}")
        tokens.extend(b.token_ids)
        hashes.append(b.block_hash & _MASK64)
        keyed = keyed or len(b.extra_keys) > 0
    extra = [[_extra_key(k) for k in b.extra_keys] or None for b in blocks] if keyed else None
    first = blocks[0] if blocks else None
    level = first.cache_level if first is not None and first.HasField("cache_level") else None
    parent = ev.parent_block_hash & _MASK64 if ev.HasField("parent_block_hash") else None
    locality = _LOCALITY.get(ev.locality) if ev.HasField("locality") else None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=first.lora_id if first is not None and first.HasField("lora_id") else None,
        medium=_medium(ev, level),
        lora_name=_opt(ev, "lora_name") or None,
        extra_keys=extra,
        group_idx=_opt(ev, "group_idx"),
        kv_cache_spec_kind=_opt(ev, "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt(ev, "kv_cache_spec_sliding_window"),
        locality=locality,
        ownership=_opt(ev, "ownership"),
        session_id=_opt(ev, "session_id"),
        cache_salt=_opt(ev, "cache_salt") or None,
    )


def _removed(ev: pb.KvBlocksRemoved, limits: Limits) -> BlockRemoved:
    if len(ev.block_hashes) > limits.max_blocks_per_event:
        raise _SkippedEvent(f"{len(ev.block_hashes)} hashes in one removal")
    level = ev.cache_level if ev.HasField("cache_level") else None
    return BlockRemoved(
        block_hashes=[h & _MASK64 for h in ev.block_hashes],
        medium=_medium(ev, level),
        group_idx=_opt(ev, "group_idx"),
        locality=_LOCALITY.get(ev.locality) if ev.HasField("locality") else None,
        ownership=_opt(ev, "ownership"),
    )


def convert_batch(msg: pb.KvEventBatch, limits: Limits) -> tuple[EventBatch | None, int, int]:
    """``msg`` as an `EventBatch`, with the counts of unknown and unusable events skipped.

    The batch is None when it cannot be used at all (a timestamp that is not finite, more
    events than ``limits`` allow): its seq is then lost to the rank.
    """
    if not math.isfinite(msg.timestamp) or len(msg.events) > limits.max_events_per_batch:
        return None, 0, 0
    events: list[EngineEvent] = []
    unknown = unusable = 0
    for ev in msg.events:
        kind = ev.WhichOneof("data")
        try:
            if kind == "stored":
                events.append(_stored(ev.stored, limits))
            elif kind == "removed":
                events.append(_removed(ev.removed, limits))
            elif kind == "cleared":
                events.append(AllBlocksCleared())
            else:
                unknown += 1
        except _SkippedEvent:
            unusable += 1
    rank = msg.dp_rank if msg.HasField("dp_rank") else None
    return EventBatch(ts=msg.timestamp, events=events, data_parallel_rank=rank), unknown, unusable


def convert_load(msg: pb.EngineLoad, received: float) -> EngineLoad:
    """A stream's load record as an `EngineLoad` (``received``: monotonic time of arrival)."""
    return EngineLoad(
        running_requests=msg.running_requests,
        waiting_requests=msg.waiting_requests,
        waiting_uncached_tokens=_opt(msg, "waiting_uncached_tokens"),
        token_usage=msg.token_usage,
        active_token_usage=_opt(msg, "active_token_usage"),
        gen_throughput=msg.gen_throughput,
        max_running_requests=msg.max_running_requests,
        age_ms=msg.age_ms,
        sample=msg.sample,
        engine_silence_ms=_opt(msg, "engine_silence_ms"),
        engine_reports_steps=_opt(msg, "engine_reports_steps"),
        prefill_pending_tokens=_opt(msg, "prefill_pending_tokens"),
        received=received,
    )
