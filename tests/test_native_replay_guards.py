"""The native thread's two guards on applying a replay answer whole, over loopback sockets.

The thread applies a clean, complete answer itself only while the recovery machine would still
take it whole (src/recv/replay.rs module doc): not once the source handed Python something since
the request that may change the machine's mind (a message, a disconnect: the request's
``consumed`` against the source's risky hand-overs), not when its fast path applied a batch Python
had not recorded when it worked out the terms (``applied_seen``), and not once Python disarmed the request
(``armed``, checked under the index's write lock). Each test drives the compiled receiver
(`kvroute._core.NativeReceiver`) directly, playing the engine's PUB and replay ROUTER, so the
interference lands exactly between the request and its answer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import zmq
from _publisher_helpers import plain_seqs

import kvroute._core as _core
from kvroute import BlockStored, EventBatch, WorkerKey, encode_batch
from kvroute._index import PrefixIndex
from kvroute._recovery import REPLAY_END_MARKER
from kvroute._wire import Limits

pytestmark = pytest.mark.anyio

_KEY = WorkerKey("w", 0)
_TOKEN = 5
_HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED


def _payload(seq: int) -> bytes:
    """A batch storing one block (4 tokens) of its own for ``seq``."""
    return encode_batch(
        EventBatch(
            ts=1.0 + seq,
            events=[
                BlockStored(
                    block_hashes=[seq + 1],
                    parent_block_hash=None,
                    token_ids=[seq * 10 + t for t in range(4)],
                    block_size=4,
                )
            ],
        )
    )


@contextlib.contextmanager
def _receiver(index: PrefixIndex) -> Iterator[Any]:
    lim = Limits()
    recv = _core.NativeReceiver(
        index._core,
        64,
        1 << 20,
        60.0,
        1 << 20,
        64,
        lim.max_events_per_batch,
        lim.max_blocks_per_event,
        lim.max_block_size,
        0,
    )
    try:
        yield recv
    finally:
        recv.close()


async def _drain_until(recv: Any, taken: list[Any], done: Any, applied: list[int] | None = None) -> None:
    """Drain ``recv``'s hand-overs into ``taken`` (and the seqs its fast path applied into
    ``applied``) until ``done(taken)`` (at most 10 s)."""
    until = time.monotonic() + 10
    while not done(taken):
        assert time.monotonic() < until, f"timed out; hand-overs so far: {taken}, applied: {applied}"
        plain, records, handovers, _, dead = recv.drain()
        assert dead is None
        taken.extend(handovers)
        if applied is not None:
            applied.extend(plain_seqs(plain))
            for _, seqs, *_ in records:
                applied.extend(seqs)
        await anyio.sleep(0.005)


async def _replay_answered(meanwhile: str) -> tuple[Any, int]:
    """One replay of seqs 0..2 the machine would take whole; ``meanwhile`` ("message", "disarm" or
    "nothing") happens after the request is read and before it is answered ("overtaken": before
    the request, the fast path applies live seq 9, which the request's ``applied_seen`` of 0 has
    not counted; "live": the fast path is open at seq 9 when the request comes, and seq 9 comes
    meanwhile). The request's outcome hand-over and the blocks the worker has in the index after it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    index = PrefixIndex()
    try:
        for sock in (pub, router):
            sock.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVTIMEO, 10_000)
        pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
        router_port = router.bind_to_random_port("tcp://127.0.0.1")
        with _receiver(index) as recv:
            recv.add(_TOKEN, _KEY, f"tcp://127.0.0.1:{pub_port}", b"", 1000, 1 << 20, 20, 100, False)
            taken: list[Any] = []
            # The handshake is handed over but is not risky: the request's ``consumed`` is 0.
            await _drain_until(recv, taken, lambda t: any(h[0] == 1 and h[2] == _HANDSHAKE for h in t))
            if meanwhile in ("overtaken", "live"):
                recv.open(_TOKEN, 9, len(taken))
                await anyio.sleep(0.2)  # the subscription reaches the PUB
            if meanwhile == "overtaken":
                pub.send_multipart([b"", (9).to_bytes(8, "big"), _payload(9)])
                applied_live: list[int] = []
                await _drain_until(recv, taken, lambda _: bool(applied_live), applied_live)
                assert applied_live == [9]
            recv.replay(
                11, _TOKEN, f"tcp://127.0.0.1:{router_port}", 1000, 1 << 20, 20, 100, False,
                0, True, None, False, 0, 0, 10.0, 20.0, 1000, 1000, 1 << 20,
            )  # fmt: skip
            request = await anyio.to_thread.run_sync(router.recv_multipart)
            assert int.from_bytes(request[2], "big") == 0
            if meanwhile in ("message", "live"):
                # Closed (never opened, or by the request), the fast path hands the message over
                # (and the SUB's subscription needs a moment to reach the PUB).
                await anyio.sleep(0.2)
                pub.send_multipart([b"", (9).to_bytes(8, "big"), _payload(9)])
                await _drain_until(recv, taken, lambda t: any(h[0] == 0 for h in t))
            elif meanwhile == "disarm":
                recv.disarm_replay(11)
            for seq in range(3):
                router.send_multipart([request[0], b"", seq.to_bytes(8, "big"), _payload(seq)])
            router.send_multipart([request[0], b"", REPLAY_END_MARKER, b""])
            await _drain_until(recv, taken, lambda t: any(h[0] == 3 for h in t))
            (outcome,) = [h for h in taken if h[0] == 3]
            return outcome, index.num_blocks(_KEY)
    finally:
        pub.close(linger=0)
        router.close(linger=0)


async def test_a_clean_answer_is_applied_whole() -> None:
    (_, token, rid, applied, items, complete, cut, cancelled, good, *_), blocks = await _replay_answered("nothing")
    assert (token, rid, complete, cut, cancelled, good) == (_TOKEN, 11, True, None, False, 3)
    assert applied is not None and applied[:2] == (0, 2) and items == []
    assert blocks == 3


async def test_an_answer_after_a_risky_hand_over_is_handed_over_not_applied() -> None:
    # The machine took a message the thread handed over after the request: it may no longer
    # take the answer whole, so the thread must not apply it (`risky` != `consumed`).
    (_, _, _, applied, items, complete, *_), blocks = await _replay_answered("message")
    assert applied is None and complete
    assert [(seq, payload is not None) for seq, _, payload in items] == [(0, True), (1, True), (2, True)]
    assert blocks == 0


async def test_an_answer_to_terms_the_fast_path_overtook_is_handed_over_not_applied() -> None:
    # Python worked out the terms before it recorded the thread's apply of seq 9: applied whole,
    # the answer would look applied off the machine's terms (a healthy source started over).
    (_, _, _, applied, items, complete, *_), blocks = await _replay_answered("overtaken")
    assert applied is None and complete and len(items) == 3
    assert blocks == 1


async def test_a_request_closes_the_fast_path() -> None:
    # While a replay is in flight the machine applies no live batch (rule 1's `in_order`): the
    # thread does not either. Seq 9 is handed over, and that hand-over makes the answer the machine's.
    (_, _, _, applied, items, complete, *_), blocks = await _replay_answered("live")
    assert applied is None and complete and len(items) == 3
    assert blocks == 0


async def test_a_disarmed_answer_is_handed_over_not_applied() -> None:
    (_, _, _, applied, items, complete, *_), blocks = await _replay_answered("disarm")
    assert applied is None and complete and len(items) == 3
    assert blocks == 0
