"""kvroute's wire decoder as it was in Python (msgspec), kept as an executable reference, not shipped.

kvroute/_wire.py now decodes through the compiled core (src/wire.rs); tests/test_wire_differential.py
feeds the same payloads to both and requires identical `EventBatch` results, or a `DecodeError` from
both. The decoder below is the one kvroute shipped before the core, unchanged except that the Structs
it builds are kvroute's own (so results compare with ==).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvroute._errors import DecodeError
from kvroute._wire import (
    FULL_KINDS,
    MAX_EVENTS_PER_BATCH,
    SKIP_BLOCK_SIZE,
    SKIP_EXTRA_KEYS,
    SKIP_HASH_RANGE,
    SKIP_LOOKAHEAD,
    SKIP_MALFORMED,
    SKIP_SHAPE,
    SKIP_UNKNOWN_TYPE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    Limits,
)

__all__ = ["BatchDecoder", "decode_batch"]

_MASK64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


def _normalize_hashes(hashes: list[BlockHash]) -> list[BlockHash]:
    """Fold signed int64 hashes (SGLang) onto uint64 so a block has one key whatever the form."""
    try:
        if not hashes or min(hashes) >= 0:  # type: ignore[operator]
            return hashes
    except TypeError:  # bytes mixed with ints: rare, take the slow path
        pass
    return [_normalize_hash(h) for h in hashes]


def _normalize_hash(h: BlockHash) -> BlockHash:
    if isinstance(h, int) and h < 0:
        if h < _INT64_MIN:
            raise DecodeError(f"block hash {h} out of 64-bit range")
        return h & _MASK64
    return h


# The wire's fields of a store: kvroute's `bigram` mark is set by the fold below, never read from a payload.
_WIRE_STORED = [f for f in msgspec.structs.fields(BlockStored) if f.name != "bigram"]
_MapBlockStored = msgspec.defstruct(
    "_MapBlockStored",
    [(f.name, f.type) if f.required else (f.name, f.type, f.default) for f in _WIRE_STORED],
    tag="BlockStored",
    tag_field="type",
    kw_only=True,
)
_MapEvent: Any = Union[_MapBlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 (runtime union)


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[_MapEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


# --- variants of the event Structs for the other encodings ----------------------------------


def _variant(cls: type[msgspec.Struct], required: int, **config: Any) -> type[msgspec.Struct]:
    """``cls``'s wire fields, in order, with the first ``required`` ones made required (no default)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, f in enumerate(msgspec.structs.fields(cls)):
        if f.name == "bigram":
            continue
        fields.append((f.name, f.type) if i < required else (f.name, f.type, f.default))
    return msgspec.defstruct(f"_{config.get('tag', cls.__name__)}Variant", fields, **config)


# The array form (old engines): positional fields, the trailing ones optional. The parent
# hash is always written (nil for a root), so BlockStored's first four fields are required.
_ArrBlockStored = _variant(BlockStored, 4, tag="BlockStored", array_like=True)
_ArrBlockRemoved = _variant(BlockRemoved, 1, tag="BlockRemoved", array_like=True)
_ArrAllBlocksCleared = _variant(AllBlocksCleared, 0, tag="AllBlocksCleared", array_like=True)
# SGLang with EAGLE speculative decoding sends token_ids as [token, next_token] cells.
_BigramBlockStored = msgspec.defstruct(
    "_BigramBlockStored",
    [
        (f.name, list[list[int]] if f.name == "token_ids" else f.type)
        if f.required
        else (f.name, f.type, f.default)
        for f in _WIRE_STORED
    ],
    tag="BlockStored",
    tag_field="type",
    kw_only=True,
)
_ArrBigramBlockStored = _variant(_BigramBlockStored, 4, tag="BlockStored", array_like=True)
_ArrEvent: Any = Union[_ArrBlockStored, _ArrBlockRemoved, _ArrAllBlocksCleared]  # noqa: UP007 (runtime union)

class _ArrEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[_ArrEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


class _RawArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str


_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARR_FIRST_BYTES = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])

_fast_decoder = msgspec.msgpack.Decoder(_WireBatch)
_arr_decoder = msgspec.msgpack.Decoder(_ArrEventBatch)
_raw_arr_decoder = msgspec.msgpack.Decoder(_RawArrBatch)
_raw_map_decoder = msgspec.msgpack.Decoder(_RawMapBatch)
_map_event_decoder = msgspec.msgpack.Decoder(_MapEvent)
_arr_event_decoder = msgspec.msgpack.Decoder(_ArrEvent)
_map_bigram_decoder = msgspec.msgpack.Decoder(_BigramBlockStored)
_arr_bigram_decoder = msgspec.msgpack.Decoder(_ArrBigramBlockStored)
_tag_decoder = msgspec.msgpack.Decoder(_Tag)
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_str_decoder = msgspec.msgpack.Decoder(str)

def _from_map(ev: msgspec.Struct) -> EngineEvent:
    """A map-form event as kvroute's (a store through its wire twin)."""
    if isinstance(ev, _MapBlockStored):
        return BlockStored(**msgspec.structs.asdict(ev))
    return ev  # type: ignore[return-value]


def _from_array(ev: msgspec.Struct) -> EngineEvent:
    if isinstance(ev, _ArrBlockStored):
        return BlockStored(**msgspec.structs.asdict(ev))
    if isinstance(ev, _ArrBlockRemoved):
        return BlockRemoved(**msgspec.structs.asdict(ev))
    return AllBlocksCleared()


def _fold_bigrams(ev: msgspec.Struct) -> BlockStored:
    """SGLang EAGLE stores: ``[token, next_token]`` cells become the tokens, and each page's last
    ``next_token`` its one lookahead token (the engine's key covers it: a prompt that differs
    right after the page does not match it)."""
    fields = msgspec.structs.asdict(ev)
    cells: list[list[int]] = fields["token_ids"]
    if any(len(c) != 2 for c in cells):
        raise DecodeError("token_ids cells are neither ints nor [token, next_token] pairs")
    bs = fields["block_size"]
    fields["token_ids"] = [c[0] for c in cells]
    if fields.get("lookahead_token_ids") is None and bs > 0:
        fields["lookahead_token_ids"] = [[cells[min(len(cells), i + bs) - 1][1]] for i in range(0, len(cells), bs)]
    return BlockStored(**fields, bigram=True)


def _reason(exc: Exception) -> str:
    msg = str(exc)
    return msg if len(msg) <= 200 else msg[:197] + "..."


class BatchDecoder:
    """Decodes payloads into `EventBatch`, remembering which form a source speaks.

    One per source. A bad event costs that event, never the batch (docs/protocol.md §3): it is
    left out of ``events`` and counted per reason in the batch's ``skipped`` and in this
    decoder's cumulative ``skipped_events``; ``unknown_events`` counts events of a ``type``
    this kvroute does not know. An unreadable event that may have been a removal or a clear
    makes the batch ``untrusted``. Only an unreadable envelope (ts, the event array) or a
    batch past a `Limits` cap is a `DecodeError`. Array-form sources are detected on their first
    batch and decoded on their own fast path from then on.
    """

    __slots__ = ("_array_form", "limits", "skipped_events", "unknown_events")

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.unknown_events = 0
        #: Events left out of their batch so far, per reason token.
        self.skipped_events: dict[str, int] = {}
        self._array_form = False

    def decode(self, payload: bytes | memoryview) -> EventBatch:
        """Decode one payload; raises `DecodeError` with a short reason when its envelope is malformed."""
        try:
            batch = self._decode(payload)
        except DecodeError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
            raise DecodeError(_reason(exc)) from None
        self._check(batch)
        if batch.skipped:
            total = self.skipped_events
            for reason, n in batch.skipped.items():
                total[reason] = total.get(reason, 0) + n
        return batch

    def _decode(self, payload: bytes | memoryview) -> EventBatch:
        fast = _arr_decoder if self._array_form else _fast_decoder
        try:
            batch = fast.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            if isinstance(batch, _ArrEventBatch):
                return EventBatch(batch.ts, [_from_array(e) for e in batch.events], batch.data_parallel_rank)
            return EventBatch(batch.ts, [_from_map(e) for e in batch.events], batch.data_parallel_rank)
        if not payload:
            raise DecodeError("empty payload")
        if payload[0] in _MAP_FIRST_BYTES:
            raw: _RawArrBatch | _RawMapBatch = _raw_map_decoder.decode(payload)
        else:
            raw = _raw_arr_decoder.decode(payload)
        out = EventBatch(raw.ts, [], raw.data_parallel_rank)
        events = out.events
        array_events = 0
        for item in raw.events:
            ev = self._decode_event(item, out)
            if ev is None:
                continue
            if ev[1]:
                array_events += 1
            events.append(ev[0])
        if array_events and array_events == len(events):
            self._array_form = True
        elif events and not array_events:
            self._array_form = False
        return out

    def _decode_event(self, item: msgspec.Raw, batch: EventBatch) -> tuple[EngineEvent, bool] | None:
        data = bytes(item)
        tag: str | None = None
        try:
            first = data[0] if data else -1
            if first in _MAP_FIRST_BYTES:
                tag = _tag_decoder.decode(data).type
                array = False
            elif first in _ARR_FIRST_BYTES:
                parts = _raw_list_decoder.decode(data)
                tag = _str_decoder.decode(parts[0]) if parts else None
                array = True
            if tag is None:
                raise DecodeError("no event type")
            if tag not in _KNOWN_TAGS:
                self.unknown_events += 1
                _skip(batch, SKIP_UNKNOWN_TYPE)
                return None
            try:
                if array:
                    return _from_array(_arr_event_decoder.decode(data)), True
                return _from_map(_map_event_decoder.decode(data)), False
            except (msgspec.DecodeError, msgspec.ValidationError):
                if tag != "BlockStored":
                    raise
            # token_ids as [token, next_token] cells (SGLang with EAGLE)
            return _fold_bigrams((_arr_bigram_decoder if array else _map_bigram_decoder).decode(data)), array
        except (msgspec.DecodeError, msgspec.ValidationError, DecodeError, ValueError, TypeError, RecursionError,
                IndexError) as exc:
            if tag == "BlockStored":
                _skip(batch, SKIP_MALFORMED)
            else:
                # A removal or clear (or an event whose type is unreadable, which may be one)
                # was lost: the index may now hold blocks the engine dropped.
                _skip(batch, SKIP_MALFORMED)
                batch.untrusted = f"unreadable {tag or 'event'}: {_reason(exc)}"
            return None

    def _check(self, batch: EventBatch) -> None:
        """Validate what the types cannot say, normalise hashes, and apply the caps: one pass, per event."""
        lim = self.limits
        if len(batch.events) > lim.max_events_per_batch:
            raise DecodeError(f"{len(batch.events)} events in one batch exceed the cap of {lim.max_events_per_batch}")
        events = batch.events
        bad: list[int] | None = None
        for i, ev in enumerate(events):
            if isinstance(ev, AllBlocksCleared):
                continue
            reason = _check_stored(ev, lim) if isinstance(ev, BlockStored) else _check_removed(ev, lim)
            if reason is not None:
                if bad is None:
                    bad = []
                bad.append(i)
                _skip(batch, reason)
                if isinstance(ev, BlockRemoved):
                    batch.untrusted = f"unusable BlockRemoved ({reason})"
        if bad is not None:
            drop = set(bad)
            batch.events = [ev for i, ev in enumerate(events) if i not in drop]


def _skip(batch: EventBatch, reason: str) -> None:
    batch.skipped[reason] = batch.skipped.get(reason, 0) + 1


def _over_cap(n: int, bs: int, lim: Limits) -> None:
    """The caps guard against hostile publishers, not production shapes: past one, the batch is refused."""
    if n > lim.max_blocks_per_event:
        raise DecodeError(f"{n} blocks in one event exceed the cap of {lim.max_blocks_per_event}")
    if bs > lim.max_block_size:
        raise DecodeError(f"block_size {bs} exceeds the cap of {lim.max_block_size}")


def _check_removed(ev: BlockRemoved, lim: Limits) -> str | None:
    _over_cap(len(ev.block_hashes), 0, lim)
    try:
        ev.block_hashes = _normalize_hashes(ev.block_hashes)
    except DecodeError:
        return SKIP_HASH_RANGE
    return None


def _check_stored(ev: BlockStored, lim: Limits) -> str | None:
    """None when ``ev`` is usable (hashes normalised in place), else the reason to skip it."""
    hashes = ev.block_hashes
    n = len(hashes)
    _over_cap(n, ev.block_size, lim)
    try:
        ev.block_hashes = _normalize_hashes(hashes)
        if ev.parent_block_hash is not None:
            ev.parent_block_hash = _normalize_hash(ev.parent_block_hash)
    except DecodeError:
        return SKIP_HASH_RANGE
    bs = ev.block_size
    nt = len(ev.token_ids)
    # Group and kind first: sparse and token-less stores are normal outside full attention.
    if nt == 0 and (bs == 0 or ev.kv_cache_spec_kind not in FULL_KINDS):
        # A placeholder (offload tier, block_size 0) or a state checkpoint (Mamba): hashes only.
        return None if bs >= 0 else SKIP_BLOCK_SIZE
    if bs < 1:
        return SKIP_BLOCK_SIZE
    if ev.kv_cache_spec_kind in FULL_KINDS:
        # Full blocks: exactly bs tokens each. SGLang's last page may be short (docs/protocol.md §3).
        if nt != bs * n and not (n and bs * (n - 1) < nt < bs * n):
            return SKIP_SHAPE
    elif nt % bs or n > nt // bs:
        # A sparse group's store spans every block of its range, null ones included.
        return SKIP_SHAPE
    if ev.extra_keys is not None and len(ev.extra_keys) != n:
        return SKIP_EXTRA_KEYS
    la = ev.lookahead_token_ids
    if la is not None and (len(la) != n or any(len(t) != len(la[0]) for t in la)):
        return SKIP_LOOKAHEAD
    return None


_default_decoder = BatchDecoder()


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode one msgpack payload (either event form) into an `EventBatch`.

    Raises `DecodeError` on malformed input. Unknown event types are skipped; use a
    `BatchDecoder` to count them.
    """
    return _default_decoder.decode(payload)
