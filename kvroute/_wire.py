"""The wire format: msgpack KV-event batches decoded into typed Structs, and encoded back.

docs/protocol.md §3 is the spec. Two event encodings exist and both decode: the *map form*
(``{"type": "BlockStored", ...}``, vLLM ≥ 0.24, SGLang ≥ 0.5.21) and the *tagged-array form*
(``["BlockStored", f1, f2, ...]``, older releases), in an array- or a map-shaped batch. Decoding is
the compiled core's (src/wire.rs, through `kvroute._core`): one pass over the payload, each event on
its own, so an unknown ``type`` or a malformed event is skipped and counted instead of failing the
batch. The Structs here are what it builds, and what `encode_batch` writes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ._core import decode_batch as _decode_batch

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "EngineEvent",
    "EventBatch",
    "Limits",
    "decode_batch",
    "encode_batch",
]

#: A block hash as engines send it: uint64 (vLLM), int64 (SGLang) or raw bytes (vLLM with
#: non-int hashes). Decoded hashes are normalised: ints to the uint64 space, bytes kept.
BlockHash = int | bytes

# Hard ceilings, checked on each array's length header before anything is allocated, so a
# hostile message costs time and memory bounded by these, not by its size.
# `Limits` (checked after decoding) can only tighten them. A vLLM step stores at most
# max_num_batched_tokens / block_size blocks: even a 1M-token step of 16-token blocks is
# 65,536 blocks.
MAX_EVENTS_PER_BATCH = 65_536
MAX_BLOCKS_PER_EVENT = 65_536
MAX_TOKENS_PER_EVENT = 1 << 22
_Hashes = Annotated[list[int | bytes], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
_Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]

#: One element of a block's ``extra_keys`` (multimodal hashes, cache salt, LoRA name, ...):
#: engines put str, int, bytes and tuples of them here, so it is kept as decoded.
ExtraKey = Any


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, omit_defaults=True):
    """Blocks entered an engine's prefix cache (one event may carry a chain of several).

    Field names and order are the engines' (docs/protocol.md §3). ``token_ids`` holds
    ``block_size`` tokens per hash; SGLang's last page may be short. Shapes that are normal
    in production and decode as such (docs/protocol.md §3.1):

    - a non-full-attention group (``kv_cache_spec_kind`` sliding_window, mamba, ...) skips
      null blocks in ``block_hashes`` but not in ``token_ids``: fewer hashes than blocks;
    - a placeholder store (offload connectors): ``block_size`` 0 and no ``token_ids``;
    - a Mamba checkpoint: one hash and no ``token_ids``;
    - ``lookahead_token_ids``: per block, the tokens after it that the engine's hash covers
      (SGLang's EAGLE ``[token, next_token]`` cells are folded into this form on decoding, and
      ``bigram`` marks the store);
    - ``origin``: decoded when an engine says whether a store is a new copy or a report of a
      cached block (an open upstream change; vLLM 0.33 does not send it). Not interpreted:
      the index already treats every repeated store as one presence (README, guarantees).
    """

    block_hashes: _Hashes
    parent_block_hash: BlockHash | None = None
    token_ids: _Tokens
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[ExtraKey] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[list[int]] | None = None
    cache_salt: Any = None
    origin: Any = None
    #: kvroute's mark, not an engine field: ``token_ids`` came as SGLang EAGLE ``[token, next_token]``
    #: cells. SGLang serves such a worker the bigram view of the prompt minus one token (a page less
    #: than vLLM's lookahead-1 rule when that prefix is whole pages); `encode_batch` writes the cells.
    bigram: bool = False


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, omit_defaults=True):
    """Blocks left an engine's cache on one ``medium`` (nil = GPU), in KV-cache group ``group_idx``."""

    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    """The engine dropped its whole prefix cache (sent on reset_prefix_cache, not on restart)."""


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct):
    """One published message: the events of one engine step, with the engine's wall-clock ``ts``.

    ``events`` holds the events that decoded; ``skipped`` counts the ones that did not, per
    reason (a store kvroute cannot use costs that store: its descendants become unknown-parent
    and are never claimed). ``untrusted`` is set (to a reason) when an event that may have been
    a removal or a clear could not be read: the worker's state can no longer be trusted, and
    the subscriber resets it through the recovery machine.
    """

    ts: float
    events: list[EngineEvent]
    data_parallel_rank: int | None = None
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    untrusted: str | None = None


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Caps on what one decoded batch may hold.

    Past any of them the batch is a `DecodeError` (these guard against a hostile publisher;
    the shapes engines really send are decoded per event). Defaults are far above what engines send (vLLM publishes one
    step's events per batch; a step stores at most max_num_batched_tokens / block_size
    blocks) yet keep a hostile publisher from making kvroute hold or hash unbounded data. The
    event and block counts are also enforced while decoding, at these defaults
    (`MAX_EVENTS_PER_BATCH`, `MAX_BLOCKS_PER_EVENT`): a `Limits` can tighten them, not raise them.
    """

    max_events_per_batch: int = MAX_EVENTS_PER_BATCH
    max_blocks_per_event: int = MAX_BLOCKS_PER_EVENT
    max_block_size: int = 65_536


# --- variants of the event Structs for the other encodings ----------------------------------


def _variant(cls: type[msgspec.Struct], required: int, **config: Any) -> type[msgspec.Struct]:
    """``cls``'s wire fields (kvroute's ``bigram`` mark left out), in order, with the first ``required``
    ones made required (no default)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, f in enumerate(msgspec.structs.fields(cls)):
        if f.name == "bigram":
            continue
        fields.append((f.name, f.type) if i < required else (f.name, f.type, f.default))
    return msgspec.defstruct(f"_{config.get('tag', cls.__name__)}Variant", fields, **config)


# vLLM writes these BlockStored / BlockRemoved fields even when nil (docs/protocol.md §3), so the
# map-form encoder uses twins where they have no default and omit_defaults skips only the
# rest — this is what makes re-encoding the golden payloads byte-exact.
_OutBlockStored = _variant(BlockStored, 7, tag="BlockStored", tag_field="type", omit_defaults=True)
# SGLang writes lora_name only when set (its msgspec types omit None defaults after medium).
_SglOutBlockStored = _variant(BlockStored, 6, tag="BlockStored", tag_field="type", omit_defaults=True)
_OutBlockRemoved = _variant(BlockRemoved, 2, tag="BlockRemoved", tag_field="type", omit_defaults=True)


_encoder = msgspec.msgpack.Encoder()

# The array form of the oldest engines stops after lora_name (7 fields); later fields are
# written only as far as the last non-nil one, the way each newer release appended them.
_ARR_MIN_BS_FIELDS = 7
_ARR_MIN_BR_FIELDS = 2

# Reason tokens of skipped events (EventBatch.skipped, BatchDecoder.skipped_events).
SKIP_UNKNOWN_TYPE = "unknown-type"
SKIP_MALFORMED = "malformed"
SKIP_SHAPE = "shape"
SKIP_BLOCK_SIZE = "block-size"
SKIP_HASH_RANGE = "hash-range"
SKIP_EXTRA_KEYS = "extra-keys"
SKIP_LOOKAHEAD = "lookahead"

#: Full-attention KV-cache group kinds (an absent kind: an engine from before hybrid models). Other
#: kinds' stores may skip null blocks (fewer hashes than blocks) or carry no tokens at all.
FULL_KINDS = frozenset(
    {None, "full_attention", "mla_attention", "sink_full_attention", "FullAttentionSpec", "MLAAttentionSpec",
     "SinkFullAttentionSpec"}
)


class BatchDecoder:
    """Decodes payloads into `EventBatch`, counting what it skips.

    One per source. A bad event costs that event, never the batch (docs/protocol.md §3): it is
    left out of ``events`` and counted per reason in the batch's ``skipped`` and in this
    decoder's cumulative ``skipped_events``; ``unknown_events`` counts events of a ``type``
    this kvroute does not know. An unreadable event that may have been a removal or a clear
    makes the batch ``untrusted``. Only an unreadable envelope (ts, the event array) or a
    batch past a `Limits` cap is a `DecodeError`.
    """

    __slots__ = ("limits", "skipped_events", "unknown_events")

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.unknown_events = 0
        #: Events left out of their batch so far, per reason token.
        self.skipped_events: dict[str, int] = {}

    def decode(self, payload: bytes | memoryview) -> EventBatch:
        """Decode one payload; raises `DecodeError` with a short reason when its envelope is malformed."""
        lim = self.limits
        batch: EventBatch = _decode_batch(
            payload, lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size
        )
        self.count_skipped(batch.skipped)
        return batch

    def count_skipped(self, skipped: dict[str, int]) -> None:
        """Add one batch's per-reason skips to this decoder's counters (also for batches decoded elsewhere)."""
        if skipped:
            self.unknown_events += skipped.get(SKIP_UNKNOWN_TYPE, 0)
            total = self.skipped_events
            for reason, n in skipped.items():
                total[reason] = total.get(reason, 0) + n


_default_decoder = BatchDecoder()


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode one msgpack payload (either event form) into an `EventBatch`.

    Raises `DecodeError` on malformed input. Unknown event types are skipped; use a
    `BatchDecoder` to count them.
    """
    return _default_decoder.decode(payload)


def _signed(h: BlockHash | None) -> BlockHash | None:
    if isinstance(h, int) and h > 0x7FFF_FFFF_FFFF_FFFF:
        return h - (1 << 64)
    return h


def _cells(ev: BlockStored) -> list[list[int]] | None:
    """A folded bigram store's ``[token, next_token]`` cells again, as SGLang sends them: each page's last
    ``next_token`` is its lookahead token, every other one the token after it (None: the store has not
    the fold's shape, one lookahead token per page, so it is written as it is)."""
    toks, la, bs = ev.token_ids, ev.lookahead_token_ids, ev.block_size
    if not toks or bs <= 0 or la is None or len(la) != -(-len(toks) // bs) or any(len(r) != 1 for r in la):
        return None
    nxt = [*toks[1:], la[-1][0]]
    for p, row in enumerate(la):
        nxt[min(len(toks), (p + 1) * bs) - 1] = row[0]
    return [[t, n] for t, n in zip(toks, nxt, strict=True)]


def _to_wire(ev: EngineEvent, form: Literal["map", "array"], signed: bool) -> Any:
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"] if form == "array" else ev
    values = list(msgspec.structs.astuple(ev))
    if isinstance(ev, BlockStored):
        values.pop()  # the bigram mark: not a wire field
        cells = _cells(ev) if ev.bigram else None
        if cells is not None:
            values[2], values[14] = cells, None
    if signed:
        values[0] = [_signed(h) for h in values[0]]
        if isinstance(ev, BlockStored):
            values[1] = _signed(values[1])
    if form == "map":
        if isinstance(ev, BlockStored):
            return _SglOutBlockStored(*values) if signed else _OutBlockStored(*values)
        return _OutBlockRemoved(*values)
    floor = _ARR_MIN_BS_FIELDS if isinstance(ev, BlockStored) else _ARR_MIN_BR_FIELDS
    end = len(values)
    while end > floor and values[end - 1] is None:
        end -= 1
    return [type(ev).__name__, *values[:end]]


def encode_batch(
    batch: EventBatch,
    *,
    form: Literal["map", "array"] = "map",
    signed_hashes: bool = False,
) -> bytes:
    """Encode a batch the way an engine publishes it.

    ``form="map"`` is vLLM ≥ 0.24 / SGLang ≥ 0.5.21; ``form="array"`` the tagged-array form
    of older releases. ``signed_hashes=True`` writes int hashes as int64 and leaves a nil
    ``lora_name`` out, as SGLang does.
    ``decode_batch(encode_batch(b, ...)) == b`` for every form.
    """
    if form not in ("map", "array"):
        raise ValueError(f"unknown form {form!r}")
    events = [_to_wire(e, form, signed_hashes) for e in batch.events]
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
