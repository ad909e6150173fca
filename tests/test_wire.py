"""The wire codec against docs/protocol.md §3: golden engine bytes, round trips of both forms, and fuzzing."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    KvRouteError,
    Limits,
    decode_batch,
    encode_batch,
)
from kvroute._wire import BatchDecoder

# docs/protocol.md §3: vLLM 0.33.0, map form, 291 bytes.
GOLDEN_VLLM = bytes.fromhex(
    "93cb41d954fc4020000093de000ba474797065ab426c6f636b53746f726564ac"
    "626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1b1"
    "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398010203"
    "0405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967"
    "726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c"
    "6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac62"
    "6c6f636b5f68617368657391cfd43b57df56b58fb1a66d656469756da3475055"
    "a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172"
    "656400"
)
GOLDEN_CLEARED_MAP = bytes.fromhex("93cb41d954fc400000009181a474797065b0416c6c426c6f636b73436c656172656401")
GOLDEN_CLEARED_ARRAY = bytes.fromhex("93cb41d954fc400000009191b0416c6c426c6f636b73436c656172656401")


def test_golden_vllm_map_form() -> None:
    assert len(GOLDEN_VLLM) == 291
    batch = decode_batch(GOLDEN_VLLM)
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [0x84B146B151D55111, 0xD43B57DF56B58FB1]
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert stored.block_size == 4 and stored.lora_id is None and stored.lora_name is None
    assert stored.medium == "GPU" and stored.extra_keys == [None, None]
    assert stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention"
    assert removed.block_hashes == [0xD43B57DF56B58FB1] and removed.medium == "GPU" and removed.group_idx == 0
    assert encode_batch(batch) == GOLDEN_VLLM


def test_golden_smallest_both_forms() -> None:
    m = decode_batch(GOLDEN_CLEARED_MAP)
    a = decode_batch(GOLDEN_CLEARED_ARRAY)
    assert m == a == EventBatch(1700000000.0, [AllBlocksCleared()], 1)
    assert encode_batch(m, form="map") == GOLDEN_CLEARED_MAP
    assert encode_batch(a, form="array") == GOLDEN_CLEARED_ARRAY


def test_array_batch_extra_trailing_elements_and_nil_rank() -> None:
    payload = msgspec.msgpack.encode([1.5, [["BlockRemoved", [1, 2], None]], None, "publisher-7", {"x": 1}])
    batch = decode_batch(payload)
    assert batch == EventBatch(1.5, [BlockRemoved(block_hashes=[1, 2])], None)


def test_map_shaped_batch() -> None:
    payload = msgspec.msgpack.encode(
        {"ts": 2.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 3, "new_key": [1]}
    )
    assert decode_batch(payload) == EventBatch(2.0, [AllBlocksCleared()], 3)


def test_unknown_event_type_is_skipped_and_counted() -> None:
    dec = BatchDecoder()
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "KVTransferDone", "x": 1}, {"type": "BlockRemoved", "block_hashes": [5]}, ["Mystery", 1]], 0]
    )
    batch = dec.decode(payload)
    assert batch.events == [BlockRemoved(block_hashes=[5])]
    assert dec.unknown_events == 2


def test_unknown_keys_ignored_and_newer_fields_kept() -> None:
    ev = {
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
        "lora_id": None, "medium": "CPU", "lora_name": "ad", "cache_salt": "s", "session_id": "x",
        "brand_new_field": {"nested": [1, 2]},
    }
    batch = decode_batch(msgspec.msgpack.encode([1.0, [ev], 0]))
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "ad" and stored.cache_salt == "s" and stored.medium == "CPU"


def test_hash_forms_normalise_to_one_key() -> None:
    """SGLang's signed int64 and vLLM's uint64 name the same 64-bit block the same way."""
    signed = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [-1, 5], "parent_block_hash": -2,
                                            "token_ids": [1, 2, 3, 4], "block_size": 2}], 0])
    removed = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [(1 << 64) - 1]}], 0])
    s = decode_batch(signed).events[0]
    r = decode_batch(removed).events[0]
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved)
    assert s.block_hashes[0] == r.block_hashes[0] == (1 << 64) - 1
    assert s.parent_block_hash == (1 << 64) - 2
    # 32-byte binary hashes (vLLM with non-int hashing) are kept as bytes.
    b = decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [b"\x01" * 32]]], 0])).events[0]
    assert isinstance(b, BlockRemoved) and b.block_hashes == [b"\x01" * 32]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty"),
        (GOLDEN_VLLM[:100], "truncated"),
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode(["x", [], 0]), "Expected"),
        (msgspec.msgpack.encode(42), "Expected"),
    ],
)
def test_malformed_envelope_is_a_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason) as info:
        decode_batch(payload)
    assert isinstance(info.value, KvRouteError)
    assert len(str(info.value)) <= 200


_GOOD_STORE = {"type": "BlockStored", "block_hashes": [9], "token_ids": [1, 2], "block_size": 2}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1, 2, 3], "block_size": 4}, "shape"),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}, "block-size"),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2,
          "extra_keys": [None, None]}, "extra-keys"),
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2,
          "lookahead_token_ids": [[1], [2]]}, "lookahead"),
        ({"type": "BlockStored", "block_hashes": "nope", "token_ids": [1, 2], "block_size": 2}, "malformed"),
        ({"type": "Heartbeat"}, "unknown-type"),
    ],
)
def test_a_bad_store_costs_that_store(bad: dict[str, object], reason: str) -> None:
    """A store kvroute cannot use is skipped and counted by reason; the rest of its batch decodes."""
    dec = BatchDecoder()
    batch = dec.decode(msgspec.msgpack.encode([1.0, [_GOOD_STORE, bad, {"type": "AllBlocksCleared"}], 0]))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "AllBlocksCleared"]
    assert batch.skipped == {reason: 1} and batch.untrusted is None
    assert dec.skipped_events == {reason: 1}


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "BlockRemoved", "block_hashes": "nope"},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        ["BlockRemoved", "not a list"],
        7,
    ],
)
def test_an_unreadable_removal_makes_the_batch_untrusted(bad: object) -> None:
    """A removal (or clear, or an event that may be one) that cannot be read: the worker's state is suspect."""
    batch = BatchDecoder().decode(msgspec.msgpack.encode([1.0, [_GOOD_STORE, bad], 0]))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored"]
    assert batch.untrusted is not None and sum(batch.skipped.values()) == 1


def test_limits() -> None:
    dec = BatchDecoder(Limits(max_events_per_batch=2, max_blocks_per_event=3, max_block_size=8))
    many = EventBatch(1.0, [AllBlocksCleared()] * 3, 0)
    with pytest.raises(DecodeError, match="events"):
        dec.decode(encode_batch(many))
    wide = EventBatch(1.0, [BlockRemoved(block_hashes=[1, 2, 3, 4])], 0)
    with pytest.raises(DecodeError, match="blocks"):
        dec.decode(encode_batch(wide))
    big = EventBatch(1.0, [BlockStored(block_hashes=[1], token_ids=list(range(16)), block_size=16)], 0)
    with pytest.raises(DecodeError, match="block_size"):
        dec.decode(encode_batch(big))


def test_hostile_nesting_is_bounded() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}], 0])[:-1]
    with pytest.raises(DecodeError):
        decode_batch(payload[:-1] + deep)
    ev = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [1], "locality": None})[:-1]
    with pytest.raises(DecodeError):
        decode_batch(b"\x93\xcb" + b"\x00" * 8 + b"\x91" + ev + deep + b"\x00")
    # A length prefix that claims 4 GiB of data is rejected without allocating it.
    with pytest.raises(DecodeError):
        decode_batch(b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff")


# --- property tests ------------------------------------------------------------------------

hashes = st.one_of(st.integers(0, (1 << 64) - 1), st.binary(min_size=32, max_size=32))
media = st.sampled_from([None, "GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL"])
opt_str = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(0, 4))
    bs = draw(st.integers(1, 4))
    extra = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=2)),
                                                 min_size=n, max_size=n)))
    return BlockStored(
        block_hashes=draw(st.lists(hashes, min_size=n, max_size=n)),
        parent_block_hash=draw(st.one_of(st.none(), hashes)),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 100))),
        medium=draw(media),
        lora_name=draw(opt_str),
        extra_keys=extra,
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention", "sliding_window"])),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(1, 4096))),
    )


@st.composite
def removed(draw: st.DrawFn) -> BlockRemoved:
    return BlockRemoved(block_hashes=draw(st.lists(hashes, max_size=4)), medium=draw(media),
                        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))))


events = st.one_of(stored(), removed(), st.just(AllBlocksCleared()))
batches = st.builds(
    EventBatch,
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(events, max_size=5),
    st.one_of(st.none(), st.integers(0, 64)),
)


@settings(max_examples=300, deadline=None)
@given(batch=batches, form=st.sampled_from(["map", "array"]), signed=st.booleans())
def test_round_trip(batch: EventBatch, form: str, signed: bool) -> None:
    payload = encode_batch(batch, form=form, signed_hashes=signed)  # type: ignore[arg-type]
    assert decode_batch(payload) == batch


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.6 and b:
            del b[rng.randrange(len(b)):]
        elif op < 0.8:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif b:
            pos = rng.randrange(len(b))
            del b[pos : pos + rng.randint(1, 8)]
    return bytes(b)


def test_fuzz_random_and_mutated_payloads() -> None:
    """>= 10,000 hostile payloads: each yields a valid batch or DecodeError, nothing else."""
    rng = random.Random(1234)
    seeds = [GOLDEN_VLLM, GOLDEN_CLEARED_MAP, GOLDEN_CLEARED_ARRAY,
             encode_batch(decode_batch(GOLDEN_VLLM), form="array"),
             encode_batch(decode_batch(GOLDEN_VLLM), signed_hashes=True)]
    outcomes = {"ok": 0, "error": 0}
    dec = BatchDecoder()
    for i in range(12_000):
        if i % 4 == 0:
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:
            payload = _mutate(rng, rng.choice(seeds))
        try:
            batch = dec.decode(payload)
        except DecodeError:
            outcomes["error"] += 1
        else:
            assert isinstance(batch, EventBatch)
            outcomes["ok"] += 1
    assert outcomes["ok"] > 100 and outcomes["error"] > 1000
