"""The ZMQ seam, the simulated publisher, and the per-source subscriber driver — over real loopback sockets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import anyio
import msgspec
import pytest
import zmq
from _publisher_helpers import FAST, Workload, assert_index_equal, duplicates_arrive, nothing_arrives, recv_frames

from kvroute._events import Envelope
from kvroute._index import PrefixIndex
from kvroute._models import EventSource, WorkerStatus
from kvroute._transports.zmq import sockets as _zmq
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._transports.zmq.driver import SourceDriver
from kvroute._transports.zmq.replay import ReplaySlots
from kvroute._transports.zmq.transport import source_problem
from kvroute._wire import decode_batch, encode_batch
from kvroute.sim._publisher import END_SEQ, EventPublisher


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, **kw: object) -> zmq.Socket[bytes]:
    return _zmq.connect(ctx, zmq.SUB, endpoint, subscribe=b"", reconnect_ivl=0.01, **kw)


async def _until_connected(pub: EventPublisher, sub: zmq.Socket[bytes]) -> None:
    """PUB drops messages until the SUB's subscription arrives: probe with raw frames until one lands."""
    with anyio.fail_after(5):
        while True:
            pub.publish_raw([b"probe"])
            with anyio.move_on_after(0.02):
                msgs = await _zmq.recv_many(sub, 100)
                if any(m == [b"probe"] for m in msgs):
                    return


def _request(dealer: zmq.Socket[bytes], start: int) -> None:
    assert _zmq.send_nowait(dealer, [b"", start.to_bytes(8, "big")])


async def _replay(dealer: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    """Every reply to one request, end marker included."""
    _request(dealer, start)
    out: list[list[bytes]] = []
    with anyio.fail_after(5):
        while not out or out[-1][-2] != END_SEQ:
            out.extend(await _zmq.recv_many(dealer, 1000))
    return out


# --- the publisher alone --------------------------------------------------------------------


@pytest.mark.anyio
async def test_publisher_live_frames_and_seq(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    wl = Workload(1)
    async with EventPublisher(topic="kv", context=ctx, data_parallel_rank=3) as pub:
        sub = _sub(ctx, pub.endpoint)
        try:
            await _until_connected(pub, sub)
            seqs = [pub.publish(wl.batch(), ts=100.0 + i) for i in range(5)]
            assert seqs == [0, 1, 2, 3, 4]
            msgs = await recv_frames(sub, 5)
        finally:
            _zmq.close(sub)
    for i, frames in enumerate(msgs):
        topic, seq8, payload = frames
        assert topic == b"kv"
        assert int.from_bytes(seq8, "big") == i
        assert decode_batch(payload) == pub.history[i]
        assert pub.history[i].ts == 100.0 + i
        assert pub.history[i].data_parallel_rank == 3
    assert pub.source("w").key == ("w", 3)


@pytest.mark.anyio
@pytest.mark.parametrize("layout", ["new", "old"])
async def test_publisher_replay_layouts_and_bounds(ctx: zmq.Context[zmq.Socket[bytes]], layout: str) -> None:
    wl = Workload(2)
    async with EventPublisher(context=ctx, buffer_steps=4, reply_layout=layout, topic="t") as pub:  # type: ignore[arg-type]
        for _ in range(10):
            pub.publish(wl.batch())
        assert pub.replay_endpoint is not None
        dealer = _zmq.connect(ctx, zmq.DEALER, pub.replay_endpoint)
        try:
            replies = await _replay(dealer, 7)
            # A start older than the buffer silently starts at the oldest (seq 6 of 0..9).
            old = await _replay(dealer, 0)
            future = await _replay(dealer, 50)
            # Malformed requests get no reply at all; a good one after them still does.
            assert _zmq.send_nowait(dealer, [b"", b"\x00\x01"])
            assert _zmq.send_nowait(dealer, [b"x", (0).to_bytes(8, "big")])
            assert _zmq.send_nowait(dealer, [(0).to_bytes(8, "big")])
            assert await nothing_arrives(dealer, 0.2)
            after = await _replay(dealer, 9)
        finally:
            _zmq.close(dealer)
    width = 4 if layout == "new" else 3
    assert all(len(r) == width and r[0] == b"" for r in replies)
    if layout == "new":
        assert [r[1] for r in replies] == [b"t", b"t", b"t", b""]
    assert [int.from_bytes(r[-2], "big") for r in replies[:-1]] == [7, 8, 9]
    assert [decode_batch(r[-1]) for r in replies[:-1]] == pub.history[7:]
    assert replies[-1][-2:] == [END_SEQ, b""]
    assert [int.from_bytes(r[-2], "big") for r in old[:-1]] == [6, 7, 8, 9]
    assert len(future) == 1 and future[0][-2] == END_SEQ
    assert [int.from_bytes(r[-2], "big") for r in after[:-1]] == [9]


@pytest.mark.anyio
async def test_publisher_drops_stay_replayable(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    wl = Workload(3)
    async with EventPublisher(context=ctx, drop_rate=0.3, seed=7) as pub:
        sub = _sub(ctx, pub.endpoint)
        assert pub.replay_endpoint is not None
        dealer = _zmq.connect(ctx, zmq.DEALER, pub.replay_endpoint)
        try:
            await _until_connected(pub, sub)
            for _ in range(50):
                pub.publish(wl.batch())
            live = await recv_frames(sub, 50 - pub.dropped)
            assert await nothing_arrives(sub, 0.1)
            replayed = await _replay(dealer, 0)
        finally:
            _zmq.close(sub)
            _zmq.close(dealer)
    assert 0 < pub.dropped < 50
    assert len(live) == 50 - pub.dropped
    assert [int.from_bytes(r[-2], "big") for r in replayed[:-1]] == list(range(50))


@pytest.mark.anyio
async def test_publisher_restart_kill_and_pause(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    wl = Workload(4)
    async with EventPublisher(context=ctx) as pub:
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        assert replay is not None
        for _ in range(3):
            pub.publish(wl.batch())
        pub.restart()
        assert (pub.endpoint, pub.replay_endpoint) == (endpoint, replay)
        assert pub.next_seq == 0 and pub.history == []
        sub = _sub(ctx, pub.endpoint)
        dealer = _zmq.connect(ctx, zmq.DEALER, replay)
        try:
            await _until_connected(pub, sub)
            pub.pause()
            assert pub.publish(wl.batch()) == 0
            assert pub.publish(wl.batch()) == 1
            assert await nothing_arrives(sub, 0.1)
            pub.resume()
            assert [int.from_bytes(m[1], "big") for m in await recv_frames(sub, 2)] == [0, 1]
            pub.kill_replay()
            _request(dealer, 0)
            assert await nothing_arrives(dealer, 0.3)
            pub.revive_replay()
            # The request sent into the dead endpoint may or may not survive the reconnect
            # (it can die in the kernel's buffers): only a fresh request is sure of an answer.
            replies = await _replay(dealer, 0)
            assert [int.from_bytes(r[-2], "big") for r in replies[-3:-1]] == [0, 1]
            pub.restart(new_ports=True)
            assert pub.endpoint != endpoint and pub.replay_endpoint != replay
        finally:
            _zmq.close(sub)
            _zmq.close(dealer)


@pytest.mark.anyio
async def test_publisher_curve(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    server, client = _zmq.curve_keypair(), _zmq.curve_keypair()
    async with EventPublisher(context=ctx, curve=server) as pub:
        src = pub.source()
        assert src.curve_server_key == server.public
        sub = _sub(ctx, pub.endpoint, curve=client, curve_server_key=server.public)
        plain = _sub(ctx, pub.endpoint)
        try:
            await _until_connected(pub, sub)
            pub.publish(Workload(5).batch())
            assert len(await recv_frames(sub, 1)) == 1
            # A plaintext subscriber never completes the handshake: nothing reaches it.
            assert await nothing_arrives(plain, 0.2)
        finally:
            _zmq.close(sub)
            _zmq.close(plain)
    with pytest.raises(ValueError):
        _zmq.connect(ctx, zmq.SUB, "tcp://127.0.0.1:1", curve=client)


# --- the driver ----------------------------------------------------------------------------------


class _ListSink:
    """An EventSink that keeps everything."""

    active = True

    def __init__(self) -> None:
        self.got: list[Envelope] = []
        self._wake: anyio.Event | None = None

    def publish(self, envelope: Envelope) -> None:
        self.got.append(envelope)
        if self._wake is not None:
            self._wake.set()

    async def until(self, cond: Callable[[], bool]) -> None:
        """Wait for ``cond`` to hold, re-checking after each envelope; fails the test after 5 s."""
        with anyio.fail_after(5):
            while not cond():
                self._wake = anyio.Event()
                await self._wake.wait()

    def kinds(self) -> list[str]:
        return [getattr(e.event, "kind", "engine") for e in self.got]


async def _serve_bad_replays(router: zmq.Socket[bytes], payloads: list[bytes]) -> None:
    """A replay endpoint that answers every request with three malformed replies, then the truth (old layout)."""
    while True:
        for ident, _, seq8 in await _zmq.recv_many(router, 16):
            start = int.from_bytes(seq8, "big")
            _zmq.send_nowait(router, [ident, b"x", b"\x00" * 8, b""])
            _zmq.send_nowait(router, [ident, b"", b"1234567", b"p"])
            _zmq.send_nowait(router, [ident, b"", b"a", b"b", b"c", b"d"])
            for seq in range(start, len(payloads)):
                _zmq.send_nowait(router, [ident, b"", seq.to_bytes(8, "big"), payloads[seq]])
            _zmq.send_nowait(router, [ident, b"", END_SEQ, b""])


@pytest.mark.anyio
async def test_driver_counts_malformed_replies_and_follows_the_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    wl = Workload(20)
    index = PrefixIndex()
    sink = _ListSink()
    changes: list[int] = []
    router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    replay = router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    try:
        async with EventPublisher(context=ctx, replay_endpoint=None) as pub:
            for _ in range(5):
                pub.publish(wl.batch())
            src = pub.source("w", replay_endpoint=replay)
            assert source_problem(src, ctx, FAST) is None
            driver = SourceDriver(
                src,
                context=ctx,
                config=FAST,
                index=index,
                sink=sink,
                limiter=ReplaySlots(1, 0.1),
                on_change=lambda: changes.append(1),
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve_bad_replays, router, [encode_batch(b) for b in pub.history])
                tg.start_soon(driver.run)
                await sink.until(lambda: "synced" in sink.kinds())
                # What follows must arrive live: this endpoint's replay knows only seqs 0-4.
                await duplicates_arrive(pub, lambda: driver.stats().messages)
                # Garbage on the live stream too: counted, logged once, never fatal.
                with caplog.at_level(logging.WARNING, logger="kvroute.subscriber"):
                    for _ in range(50):
                        pub.publish_raw([b"", b"short"])
                    pub.publish(wl.batch())
                    await sink.until(lambda: driver.stats().last_seq == 5)
                assert sum("skipped message" in r.getMessage() for r in caplog.records) == 1
                st = driver.stats()
                assert st.skipped_frames >= 53 and st.connected and st.state == "synced"
                assert driver.status() == WorkerStatus(state="synced")
                truth = PrefixIndex()
                for b in pub.history:
                    truth.apply_batch(src.key, b)
                assert_index_equal(index, truth, wl.queries)
                tg.cancel_scope.cancel()
        assert "connected" in sink.kinds() and changes
    finally:
        router.close(linger=0)


@pytest.mark.anyio
async def test_source_problems_are_refused_up_front(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    ok = EventSource(worker_id="w", endpoint="tcp://127.0.0.1:5557")
    assert source_problem(ok, ctx, SubscriberConfig()) is None
    bad = msgspec.structs.replace(ok, endpoint="nonsense://x")
    problem = source_problem(bad, ctx, SubscriberConfig())
    assert problem is not None and "nonsense://x" in problem
    curve = msgspec.structs.replace(ok, curve_server_key=_zmq.curve_keypair().public)
    assert "CURVE" in (source_problem(curve, ctx, SubscriberConfig()) or "")
    with pytest.raises(ValueError):
        SubscriberConfig(curve_public_key="x" * 40)
    with pytest.raises(ValueError):
        SubscriberConfig(replay_timeout=0)
