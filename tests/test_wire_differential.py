"""The compiled wire decoder against the Python one it replaced (tests/reference/wire.py).

The same payloads go to both: valid batches of every shape (encode_batch, both forms, signed
hashes), hand-built msgpack that mixes engine-shaped events with wrong types, repeated and unknown
keys, SGLang bigram cells, untyped values (ext, timestamps, unhashable keys, bad UTF-8), map-shaped
batches, then those mutated, truncated, or plain random bytes. Each must give the same
`EventBatch` (compared field by field, types included) and the same decoder counters, or a
`DecodeError` from both.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import wire as ref

from kvroute import DecodeError
from kvroute._wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Limits,
    encode_batch,
)

E = msgspec.msgpack.encode
I64, U64 = -(1 << 63), (1 << 64) - 1
# KVROUTE_DIFF_EXAMPLES raises the example count for a long local run.
SETTINGS = settings(
    max_examples=int(os.environ.get("KVROUTE_DIFF_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _hdr(fix: int, b16: int, b32: int, n: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([b16]) + n.to_bytes(2, "big")
    return bytes([b32]) + n.to_bytes(4, "big")


def arr(items: list[bytes]) -> bytes:
    """A msgpack array of already-encoded items."""
    return _hdr(0x90, 0xDC, 0xDD, len(items)) + b"".join(items)


def mp(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map of already-encoded pairs, in order (repeats and any key type allowed)."""
    return _hdr(0x80, 0xDE, 0xDF, len(pairs)) + b"".join(k + v for k, v in pairs)


def canon(x: Any) -> Any:
    """A comparable form that keeps types (1, 1.0, True differ; NaN equals NaN; list is not tuple)."""
    if isinstance(x, msgspec.Struct):
        return (type(x).__name__, tuple((f, canon(getattr(x, f))) for f in x.__struct_fields__))
    if isinstance(x, bool):
        return ("bool", x)
    if isinstance(x, int):
        return ("int", x)
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x)
    if isinstance(x, list):
        return ("list", tuple(canon(i) for i in x))
    if isinstance(x, tuple):
        return ("tuple", tuple(canon(i) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((canon(k), canon(v)) for k, v in x.items()))
    if isinstance(x, msgspec.msgpack.Ext):
        return ("ext", x.code, x.data)
    if isinstance(x, datetime.datetime):
        return ("datetime", x.isoformat())
    assert x is None or isinstance(x, (str, bytes)), type(x)
    return (type(x).__name__, x)


def check_same(payload: bytes, limits: Limits | None = None) -> EventBatch | None:
    """Decode with both; require the same batch and counters, or DecodeError from both."""
    old, new = ref.BatchDecoder(limits), BatchDecoder(limits)
    try:
        want = old.decode(payload)
    except DecodeError:
        with pytest.raises(DecodeError):
            new.decode(payload)
        return None
    got = new.decode(payload)
    assert canon(got) == canon(want), (payload.hex(), got, want)
    assert (new.unknown_events, new.skipped_events) == (old.unknown_events, old.skipped_events)
    return got


# --- untyped values and their fragments ---------------------------------------------------------

ints = st.one_of(st.integers(0, 200), st.integers(I64, U64), st.sampled_from([I64, -1, 1 << 63, U64, (1 << 63) - 1]))
ts_data = st.one_of(
    st.binary(min_size=4, max_size=4),
    st.integers(0, (1 << 64) - 1).map(lambda v: v.to_bytes(8, "big")),
    st.tuples(st.integers(0, 1_100_000_000), st.integers(-(1 << 40), 1 << 40)).map(
        lambda t: t[0].to_bytes(4, "big") + t[1].to_bytes(8, "big", signed=True)
    ),
    st.binary(max_size=13),
)
ext_frag = st.one_of(
    ts_data.map(lambda d: E(msgspec.msgpack.Ext(-1, d))),
    st.tuples(st.integers(-128, 127), st.binary(max_size=20)).map(lambda t: E(msgspec.msgpack.Ext(*t))),
)
scalar_frag = st.one_of(
    st.none().map(E),
    st.booleans().map(E),
    ints.map(E),
    st.floats(allow_nan=True, allow_infinity=True).map(E),
    st.floats(width=32).map(lambda f: b"\xca" + __import__("struct").pack(">f", f)),
    st.text(max_size=8).map(E),
    st.binary(max_size=8).map(E),
    st.sampled_from([b"\xa1\xff", b"\xa2\xed\xa0", b"\xa3\xe2\x82"]),  # not UTF-8
    ext_frag,
)
any_frag = st.recursive(
    scalar_frag,
    lambda c: st.lists(c, max_size=4).map(arr) | st.lists(st.tuples(c, c), max_size=3).map(mp),
    max_leaves=8,
)
hash_frag = st.one_of(ints.map(E), st.binary(max_size=8).map(E))


def maybe(good: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Mostly a well-typed value, sometimes anything."""
    return st.one_of(good, good, good, any_frag)


TYPES = ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
KINDS = [None, "full_attention", "sliding_window", "mamba", "MLAAttentionSpec"]
MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "DISK", "gpu", "LocalDisk", "ssd\u00e9"]


@st.composite
def store_fields(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    """A store's fields, engine-shaped or off by a little: counts, cells, sizes, kinds, types."""
    n = draw(st.integers(0, 4))
    bs = draw(st.sampled_from([0, 1, 2, 3, -1, 1 << 20, U64]))
    nb = max(bs, 0) if bs < 100 else 2
    nt = draw(st.sampled_from([n * nb, max(n * nb - 1, 0), n * nb + 1, 0, draw(st.integers(0, 12))]))
    hashes = arr([draw(hash_frag) for _ in range(n)])
    toks = [draw(st.one_of(st.integers(0, 50_000), ints)) for _ in range(nt)]
    if draw(st.integers(0, 5)) == 0:  # SGLang EAGLE cells
        width = draw(st.sampled_from([2, 2, 2, 1, 3]))
        tokens = arr([arr([E(t)] + [E(draw(st.integers(0, 300))) for _ in range(width - 1)]) for t in toks])
    else:
        tokens = E(toks)
    fields: list[tuple[str, bytes]] = [
        ("block_hashes", draw(maybe(st.just(hashes)))),
        ("parent_block_hash", draw(maybe(st.one_of(st.none().map(E), hash_frag)))),
        ("token_ids", draw(maybe(st.just(tokens)))),
        ("block_size", draw(maybe(st.just(E(bs))))),
    ]
    optional = {
        "lora_id": st.one_of(st.none(), ints).map(E),
        # The names kvroute's tiers know are kept without a copy; any other (case kept) is copied as sent.
        "medium": st.sampled_from(MEDIA).map(E),
        "lora_name": st.sampled_from([None, "ad"]).map(E),
        "extra_keys": st.one_of(
            st.none().map(E),
            st.lists(st.one_of(st.none().map(E), st.lists(any_frag, max_size=3).map(arr)), max_size=5).map(arr),
        ),
        "group_idx": st.one_of(st.none(), ints).map(E),
        "kv_cache_spec_kind": st.sampled_from(KINDS).map(E),
        "kv_cache_spec_sliding_window": st.one_of(st.none(), ints).map(E),
        "locality": any_frag,
        "ownership": any_frag,
        "session_id": any_frag,
        "lookahead_token_ids": st.one_of(
            st.none().map(E),
            st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=2), max_size=5).map(E),
        ),
        "cache_salt": any_frag,
        "origin": any_frag,
    }
    for name, strat in optional.items():
        if draw(st.integers(0, 2)) == 0:
            fields.append((name, draw(maybe(strat))))
    return fields


removed_fields = st.lists(
    st.tuples(
        st.sampled_from(["block_hashes", "medium", "group_idx", "locality", "ownership"]),
        st.one_of(st.lists(hash_frag, max_size=4).map(arr), any_frag),
    ),
    max_size=5,
)


@st.composite
def event_frag(draw: st.DrawFn) -> bytes:
    """One event, map form or tagged-array form, well-formed or not."""
    tag = draw(st.sampled_from([*TYPES, *TYPES, "Unknown", ""]))
    fields = draw(store_fields()) if tag == "BlockStored" else draw(removed_fields)
    if tag == "BlockRemoved" and draw(st.booleans()):
        fields = [("block_hashes", draw(st.lists(hash_frag, max_size=4).map(arr))), *fields]
    if draw(st.booleans()):
        pairs = [(E(k), v) for k, v in fields]
        tag_frag = draw(st.one_of(st.just(E(tag)), st.just(E(tag)), any_frag))
        pairs.insert(draw(st.integers(0, len(pairs))), (E("type"), tag_frag))
        if draw(st.integers(0, 6)) == 0:  # a repeated type key, same or not
            pairs.insert(draw(st.integers(0, len(pairs))), (E("type"), E(draw(st.sampled_from([*TYPES, "X"])))))
        if draw(st.integers(0, 4)) == 0:  # an unknown or non-str key
            key = draw(st.one_of(st.just(E("zz")), any_frag))
            pairs.insert(draw(st.integers(0, len(pairs))), (key, draw(any_frag)))
        if draw(st.integers(0, 8)) == 0:  # a repeated field
            key = draw(st.sampled_from(pairs))[0] if pairs else E("x")
            pairs.append((key, draw(any_frag)))
        return mp(pairs)
    values = [v for _, v in fields] if tag == "BlockStored" else [v for _, v in fields][:5]
    values = values[: draw(st.integers(0, len(values)))] if draw(st.integers(0, 3)) == 0 else values
    if draw(st.integers(0, 5)) == 0:
        values.append(draw(any_frag))
    head = draw(st.one_of(st.just(E(tag)), st.just(E(tag)), any_frag))
    return arr([head, *values]) if draw(st.integers(0, 20)) else arr([])


@st.composite
def batch_frag(draw: st.DrawFn) -> bytes:
    """An envelope around events: array batch or map batch, with optional extras."""
    events = arr(draw(st.lists(st.one_of(event_frag(), event_frag(), event_frag(), any_frag), max_size=5)))
    ts = draw(st.one_of(st.floats().map(E), ints.map(E), st.floats(width=32).map(E), any_frag))
    dpr = draw(st.one_of(st.none().map(E), ints.map(E), any_frag))
    if draw(st.booleans()):
        items = [ts, events]
        if draw(st.booleans()):
            items.append(dpr)
        if draw(st.integers(0, 5)) == 0:
            items.append(draw(any_frag))
        return arr(items)
    pairs = [(E("ts"), ts), (E("events"), events)]
    if draw(st.booleans()):
        pairs.append((E("data_parallel_rank"), dpr))
    if draw(st.integers(0, 5)) == 0:
        pairs.append((E(draw(st.sampled_from(["events", "ts", "other"]))), draw(any_frag)))
    return mp(draw(st.permutations(pairs)))


limits_st = st.one_of(
    st.none(),
    st.builds(
        Limits,
        max_events_per_batch=st.integers(-1, 6),
        max_blocks_per_event=st.integers(-1, 6),
        max_block_size=st.integers(-1, 1 << 64),
    ),
)


@SETTINGS
@given(batch_frag(), limits_st)
def test_hand_built_batches_decode_the_same(payload: bytes, limits: Limits | None) -> None:
    check_same(payload, limits)


@SETTINGS
@given(batch_frag(), st.data())
def test_mutated_batches_decode_the_same(payload: bytes, data: st.DataObject) -> None:
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and buf:
            del buf[i]
        else:
            del buf[i:]
    check_same(bytes(buf))


@SETTINGS
@given(st.binary(max_size=64))
def test_random_bytes_decode_the_same(payload: bytes) -> None:
    check_same(payload)


# --- valid batches of every shape, through encode_batch -----------------------------------------

hash_val = st.one_of(st.integers(0, U64), st.binary(min_size=1, max_size=8))


@st.composite
def stored_event(draw: st.DrawFn) -> BlockStored:
    """A store as engines publish it (full, sparse, placeholder, lookahead, extras, namespaces)."""
    n = draw(st.integers(0, 4))
    bs = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(KINDS))
    shape = draw(st.sampled_from(["full", "short", "placeholder", "sparse"]))
    nt = {"full": n * bs, "short": max(n * bs - 1, 0), "placeholder": 0, "sparse": (n + 1) * bs}[shape]
    return BlockStored(
        block_hashes=[draw(hash_val) for _ in range(n)],
        parent_block_hash=draw(st.one_of(st.none(), hash_val)),
        token_ids=draw(st.lists(st.integers(0, 200_000), min_size=nt, max_size=nt)),
        block_size=0 if shape == "placeholder" else bs,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 9))),
        medium=draw(st.sampled_from(MEDIA)),
        lora_name=draw(st.sampled_from([None, "adapter"])),
        extra_keys=draw(
            st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=4))), min_size=n, max_size=n))
        ),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(1, 128))),
        lookahead_token_ids=draw(
            st.one_of(st.none(), st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=1), min_size=n, max_size=n))
        ),
        cache_salt=draw(st.sampled_from([None, "salt"])),
    )


engine_event = st.one_of(
    stored_event(),
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(hash_val, max_size=4),
        medium=st.sampled_from(MEDIA),
        group_idx=st.one_of(st.none(), st.integers(0, 3)),
    ),
    # vLLM's own removal, one a block (the decoder compares its fixed bytes: `Dec::vllm_removal`), and the
    # hashes and groups at the edges of that path's forms.
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(st.one_of(st.integers(2**32, 2**64 - 1), st.integers(0, 2**32)), min_size=1, max_size=1),
        medium=st.just("GPU"),
        group_idx=st.integers(0, 130),
    ),
    st.just(AllBlocksCleared()),
)


@SETTINGS
@given(
    st.builds(
        EventBatch,
        ts=st.floats(allow_nan=True),
        events=st.lists(engine_event, max_size=6),
        data_parallel_rank=st.one_of(st.none(), st.integers(0, 7)),
    ),
    st.sampled_from(["map", "array"]),
    st.booleans(),
    limits_st,
)
def test_engine_batches_decode_the_same(batch: EventBatch, form: Any, signed: bool, limits: Limits | None) -> None:
    check_same(encode_batch(batch, form=form, signed_hashes=signed), limits)


# --- the edges a generator rarely reaches -------------------------------------------------------


def _removal(**fields: bytes) -> bytes:
    return mp([(E("type"), E("BlockRemoved")), (E("block_hashes"), E([1])), *((E(k), v) for k, v in fields.items())])


@pytest.mark.parametrize(
    "event",
    [
        _removal(locality=b"\x81\x80\x01"),  # unhashable key: the byte offset is in the message
        _removal(locality=b"\x81\x91\xd4\xff\x00\x01"),  # a bad timestamp inside a key
        _removal(locality=b"\x91\x81\x81\xd4\xff\x00\x01\x01"),
        _removal(ownership=E(msgspec.msgpack.Ext(-1, (10**9 << 34).to_bytes(8, "big")))),
        _removal(ownership=b"\xc7\x0c\xff" + bytes(4) + (1 << 62).to_bytes(8, "big")),
        _removal(ownership=b"\xc7\x0c\xff" + (999_999_999).to_bytes(4, "big") + (253402300799).to_bytes(8, "big")),
        _removal(ownership=b"\xc7\x0c\xff" + (2500).to_bytes(4, "big") + (-1).to_bytes(8, "big", signed=True)),
        _removal(medium=b"\xa1\xff"),
        mp([(E("type"), E("AllBlocksCleared")), (E("type"), E("BlockRemoved"))]),
        mp([(E("type"), E("BlockStored")), (E("token_ids"), E("x")), (E("type"), E("BlockRemoved"))]),
        mp([(E("type"), E("it's \"odd\"\t")), (E("type"), E("BlockRemoved"))]),
        mp([(E("type"), E("x" * 300)), (E("type"), E("AllBlocksCleared"))]),
        arr([E("BlockRemoved")]),
        arr([E("BlockRemoved"), arr([E("x")])]),
        arr([E(7)]),
        b"\x07",
        mp([(E("block_hashes"), E([]))]),
        mp([(E(1), E(2))]),
        mp([(E(None), E(2))]),  # msgspec names a nil key `null`
    ],
)
def test_unreadable_events_are_reported_the_same(event: bytes) -> None:
    got = check_same(arr([E(1.0), arr([event])]))
    assert got is not None


@pytest.mark.parametrize("depth", [10, 400, 2_000, 100_000])
def test_deep_nesting(depth: int) -> None:
    """Nesting past the recursion cap is a DecodeError in both (in between, msgspec's cap depended
    on the caller's stack, so the differential stays away from it)."""
    nested = b"\x91" * depth + b"\x00"
    check_same(arr([E(0.0), arr([_removal(locality=nested)])]))
    check_same(arr([E(0.0), arr([]), E(None), nested]))


def test_buffers_other_than_bytes() -> None:
    payload = encode_batch(EventBatch(1.0, [BlockRemoved(block_hashes=[1, b"x"])]))
    want = BatchDecoder().decode(payload)
    assert BatchDecoder().decode(memoryview(payload)) == want
    assert BatchDecoder().decode(bytearray(payload)) == want  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        BatchDecoder().decode("not bytes")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(st.lists(st.integers(256, 150_000), min_size=0, max_size=60), min_size=1, max_size=5),
    odd=st.lists(st.one_of(st.integers(0, 255), st.sampled_from([-1, -300, I64, 1 << 63, U64, (1 << 32) + 5])),
                 max_size=4),
)
def test_long_token_lists_with_other_forms_between_runs_decode_as_the_reference(
    runs: list[list[int]], odd: list[int]
) -> None:
    """Token ids past a window's length (the decoder reads 64 bytes of uint 16 / 32 ids at a time) with ids of
    other forms between the runs: small, negative, past uint32 or int64; the ids after each come through the
    window reading again."""
    toks: list[int] = []
    for i, run in enumerate(runs):
        toks += run
        if i < len(odd):
            toks.append(odd[i])
    assume(toks)
    ev = mp([(E("type"), E("BlockStored")), (E("block_hashes"), E([1])), (E("token_ids"), E(toks)),
             (E("block_size"), E(max(len(toks), 1)))])
    got = check_same(arr([E(0.0), arr([ev])]))
    assert got is not None and got.events[0].token_ids == toks


@pytest.mark.parametrize("block_size", [0, 2])
@pytest.mark.parametrize(
    "forms",
    [
        ([[1, 2], [3, 4]], []),
        ([], [[1, 2], [3, 4]]),
        ([[1, 2]], [[5, 6], [7, 8]]),
        ([1, 2], [[1, 2]]),
        ([[1, 2]], [1, 2]),
        ([1, 2], []),
        ([], [1, 2]),
        ([[1, 2]], [], [3]),
    ],
)
def test_a_repeated_token_ids_key_decodes_as_the_reference(forms: tuple[list[Any], ...], block_size: int) -> None:
    """A store whose map repeats `token_ids` (no engine sends one; hypothesis built it): msgspec read the map against
    one schema, ints or (when any of them is cells) SGLang EAGLE cells, the last key winning, so an empty one after
    cells is empty cells (a bigram store) and ints beside cells make the store malformed."""
    ev = mp([(E("type"), E("BlockStored")), (E("block_hashes"), E([])),
             *((E("token_ids"), E(f)) for f in forms), (E("block_size"), E(block_size))])
    check_same(arr([E(0.0), arr([ev])]))


def test_wide_ints_keep_their_value() -> None:
    """Ints past int64 in int fields come back exact (the Rust batch holds them saturated)."""
    ev = mp(
        [
            (E("type"), E("BlockStored")),
            (E("block_hashes"), E([1])),
            (E("token_ids"), E([U64, 1 << 63])),
            (E("block_size"), E(2)),
            (E("lora_id"), E(U64)),
            (E("group_idx"), E(1 << 63)),
            (E("kv_cache_spec_sliding_window"), E(U64)),
            (E("lookahead_token_ids"), E([[U64]])),
        ]
    )
    got = check_same(arr([E(0.0), arr([ev]), E(U64)]))
    assert got is not None and got.data_parallel_rank == U64 and got.events[0].token_ids == [U64, 1 << 63]
    cells = mp([(E("type"), E("BlockStored")), (E("block_hashes"), E([1])), (E("token_ids"), E([[U64, U64]])),
                (E("block_size"), E(1))])
    check_same(arr([E(0.0), arr([cells])]))
    removal = mp([(E("type"), E("BlockRemoved")), (E("block_hashes"), E([1])), (E("group_idx"), E(U64))])
    got = check_same(arr([E(0.0), arr([removal, arr([E("BlockRemoved"), E([2]), E(None), E(1 << 63)])])]))
    assert got is not None and [e.group_idx for e in got.events] == [U64, 1 << 63]
    big = mp([(E("type"), E("BlockStored")), (E("block_hashes"), E([])), (E("token_ids"), E([])),
              (E("block_size"), E(U64))])
    check_same(arr([E(0.0), arr([big])]), Limits(max_block_size=1 << 70))
