"""`kvroute._core.decode_checked`: one core call gives the decoded batch and the apply verdict (the twin rule).

The rule (a ts that is not finite or an untrusted batch is not applied) lives in the core's `wire::verdict`,
which `PrefixIndex.apply_payload` uses too, and the ZMQ driver's `_decode_checked` takes it from there. These hold
all three to the rule's table, payload for payload.
"""

from __future__ import annotations

import math

import msgspec
import pytest

import kvroute._core as _core
from kvroute import BlockRemoved, BlockStored, EventBatch, WorkerKey
from kvroute._index import PrefixIndex
from kvroute._transports.zmq.payloads import _decode_checked
from kvroute._wire import BatchDecoder, Limits, encode_batch

_STORE = BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2)


def _payloads() -> list[tuple[bytes, str]]:
    """Each payload with the kind of refusal the rule gives it ("" = applicable)."""
    good = encode_batch(EventBatch(5.0, [_STORE], 0))
    # A removal whose hashes are unreadable: the batch is untrusted.
    untrusted = msgspec.msgpack.encode([5.0, [["BlockRemoved", "not hashes", None]], 0])
    return [
        (good, ""),
        (encode_batch(EventBatch(math.nan, [_STORE], 0)), "undecodable payload"),
        (encode_batch(EventBatch(math.inf, [_STORE], 0)), "undecodable payload"),
        (encode_batch(EventBatch(-math.inf, [BlockRemoved(block_hashes=[1])], 0)), "undecodable payload"),
        (untrusted, "untrusted batch"),
        (b"\xc1 not msgpack", "undecodable payload"),
        (b"", "undecodable payload"),
        (good[: len(good) // 2], "undecodable payload"),
        (encode_batch(EventBatch(6.0, [_STORE] * 5, 0)), "undecodable payload"),  # past max_events_per_batch
    ]


@pytest.mark.parametrize(("payload", "want_kind"), _payloads())
def test_the_core_verdict_is_the_drivers_and_apply_payloads(payload: bytes, want_kind: str) -> None:
    limits = Limits(max_events_per_batch=4)
    batch, kind, detail = _core.decode_checked(
        payload, limits.max_events_per_batch, limits.max_blocks_per_event, limits.max_block_size
    )
    assert kind == want_kind and (detail == "") == (kind == ""), (kind, detail)
    if not kind:
        assert batch is not None and batch.events == [_STORE]
    decoder = BatchDecoder(limits)
    assert _decode_checked(decoder, payload) == ((batch if not kind else None), kind, detail)
    if batch is not None:  # the skip counts the driver's decoder keeps come with the batch
        assert batch.skipped == BatchDecoder(limits).decode(payload).skipped
    # apply_payload applies exactly the payloads the verdict lets through, and says why not otherwise.
    report = PrefixIndex().apply_payload(WorkerKey("w", 0), payload, limits)
    assert (report.error_kind, report.error) == (kind, detail)
