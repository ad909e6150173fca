"""The wire format: msgpack KV-event batches decoded straight into typed Structs, and encoded back.

docs/protocol.md §3 is the spec. Two event encodings exist and both decode: the *map form*
(``{"type": "BlockStored", ...}``, vLLM ≥ 0.24, SGLang ≥ 0.5.21) and the *tagged-array form*
(``["BlockStored", f1, f2, ...]``, older releases). The common case — an array batch of
map-form events of known types — decodes in one msgspec call into `EventBatch`; anything
else (array-form events, a map-shaped batch, an unknown event type) takes a slower path
that decodes event by event, so an unknown ``type`` is skipped and counted instead of
failing the batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from ._errors import DecodeError

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

_MASK64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)

#: A block hash as engines send it: uint64 (vLLM), int64 (SGLang) or raw bytes (vLLM with
#: non-int hashes). Decoded hashes are normalised: ints to the uint64 space, bytes kept.
BlockHash = int | bytes

# Hard ceilings, checked by msgspec on each array's length header before anything is
# allocated, so a hostile message costs time and memory bounded by these, not by its size.
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
      (SGLang's EAGLE ``[token, next_token]`` cells are folded into this form on decoding);
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


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[EngineEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


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
    """``cls``'s fields, in order, with the first ``required`` ones made required (no default)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, f in enumerate(msgspec.structs.fields(cls)):
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
        for f in msgspec.structs.fields(BlockStored)
    ],
    tag="BlockStored",
    tag_field="type",
    kw_only=True,
)
_ArrBigramBlockStored = _variant(_BigramBlockStored, 4, tag="BlockStored", array_like=True)
_ArrEvent: Any = Union[_ArrBlockStored, _ArrBlockRemoved, _ArrAllBlocksCleared]  # noqa: UP007 (runtime union)

# vLLM writes these BlockStored / BlockRemoved fields even when nil (docs/protocol.md §3), so the
# map-form encoder uses twins where they have no default and omit_defaults skips only the
# rest — this is what makes re-encoding the golden payloads byte-exact.
_OutBlockStored = _variant(BlockStored, 7, tag="BlockStored", tag_field="type", omit_defaults=True)
# SGLang writes lora_name only when set (its msgspec types omit None defaults after medium).
_SglOutBlockStored = _variant(BlockStored, 6, tag="BlockStored", tag_field="type", omit_defaults=True)
_OutBlockRemoved = _variant(BlockRemoved, 2, tag="BlockRemoved", tag_field="type", omit_defaults=True)


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


_BS_FIELDS = BlockStored.__struct_fields__
_BR_FIELDS = BlockRemoved.__struct_fields__
# The array form of the oldest engines stops after lora_name (7 fields); later fields are
# written only as far as the last non-nil one, the way each newer release appended them.
_ARR_MIN_BS_FIELDS = 7
_ARR_MIN_BR_FIELDS = 2

_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARR_FIRST_BYTES = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])

_fast_decoder = msgspec.msgpack.Decoder(_WireBatch)
_arr_decoder = msgspec.msgpack.Decoder(_ArrEventBatch)
_raw_arr_decoder = msgspec.msgpack.Decoder(_RawArrBatch)
_raw_map_decoder = msgspec.msgpack.Decoder(_RawMapBatch)
_map_event_decoder = msgspec.msgpack.Decoder(EngineEvent)
_arr_event_decoder = msgspec.msgpack.Decoder(_ArrEvent)
_map_bigram_decoder = msgspec.msgpack.Decoder(_BigramBlockStored)
_arr_bigram_decoder = msgspec.msgpack.Decoder(_ArrBigramBlockStored)
_tag_decoder = msgspec.msgpack.Decoder(_Tag)
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_str_decoder = msgspec.msgpack.Decoder(str)
_encoder = msgspec.msgpack.Encoder()

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
    return BlockStored(**fields)


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
            return EventBatch(batch.ts, batch.events, batch.data_parallel_rank)
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
                return _map_event_decoder.decode(data), False
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


def _signed(h: BlockHash | None) -> BlockHash | None:
    if isinstance(h, int) and h > 0x7FFF_FFFF_FFFF_FFFF:
        return h - (1 << 64)
    return h


def _to_wire(ev: EngineEvent, form: Literal["map", "array"], signed: bool) -> Any:
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"] if form == "array" else ev
    values = list(msgspec.structs.astuple(ev))
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
