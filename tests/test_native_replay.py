"""Replay requests carried out by the native receive thread, end to end over loopback sockets.

The thread opens the DEALER, reads and judges every reply, and applies an answer the recovery
machine's rules take whole (`ReplayAnswers.replay_terms`) itself, handing Python one summary;
any other answer (empty, cut short, with a hole, timed out) is handed over reply by reply and
judged by the machine as before. Each test checks the index against the engine's truth and that
the thread did the work (`SourceDriver.native_replays` / `native_replayed`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
import msgspec
import pytest
import zmq
from _publisher_helpers import (
    FAST,
    Workload,
    assert_index_equal,
    assert_index_subset,
    truth_index,
    wait_for,
)

from kvroute._client import KvEventClient
from kvroute._models import EventSource, WorkerKey
from kvroute._recovery import REPLAY_END_MARKER
from kvroute._transports.zmq import sockets as _zmq
from kvroute._transports.zmq.driver import SourceDriver
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio

NATIVE = msgspec.structs.replace(FAST, native_receive=True)


def _driver(client: KvEventClient, src: EventSource) -> SourceDriver:
    driver = client._subs[src.key].driver  # type: ignore[attr-defined]
    assert isinstance(driver, SourceDriver)
    return driver


async def _caught_up(client: KvEventClient, src: EventSource, last: int) -> None:
    def done() -> bool:
        st = client.stats().sources.get(src.key)
        return st is not None and st.last_seq == last and st.state == "synced"

    await wait_for(done, f"{src.key} applied through seq {last}")


@contextlib.asynccontextmanager
async def _router(
    pub: EventPublisher, answer: Callable[[int, int], list[int] | None], delay: float = 0.0
) -> AsyncIterator[str]:
    """A replay endpoint serving ``pub``'s buffer as ``answer(n, start)`` says for the n-th request, ``delay`` s late.

    ``answer`` lists the seqs to send (then the end marker), or None: send the first 5 from
    ``start`` and close the socket mid-answer (a disconnect; later requests find a new one bound
    on the same port). Yields its endpoint.
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"

    async def serve() -> None:
        nonlocal sock
        n = 0
        while True:
            for frames in await _zmq.recv_many(sock, 16):
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                await anyio.sleep(delay)
                buffered = dict(pub._buffer)  # type: ignore[attr-defined]
                seqs = answer(n, start)
                n += 1
                for seq in seqs if seqs is not None else range(start, start + 5):
                    sock.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), buffered[seq]])
                if seqs is None:
                    await anyio.sleep(0.05)
                    _zmq.close(sock)
                    sock = ctx.socket(zmq.ROUTER)
                    sock.setsockopt(zmq.LINGER, 0)
                    for _ in range(200):
                        try:
                            sock.bind(endpoint)
                            break
                        except zmq.ZMQError:
                            await anyio.sleep(0.01)  # libzmq releases the port in its own thread
                    break
                sock.send_multipart([ident, b"", b"", REPLAY_END_MARKER, b""])

    # The socket is closed only once `serve` has ended: closed under it, a wake-up already due returned
    # into `wait_readable`, which raised ClosedResourceError before the cancellation arrived (CI, asyncio).
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            try:
                yield endpoint
            finally:
                tg.cancel_scope.cancel()
    finally:
        _zmq.close(sock)


async def test_a_cold_answer_is_applied_whole_by_the_thread() -> None:
    wl = Workload(1)
    async with EventPublisher() as pub:
        for _ in range(50):
            pub.publish(wl.batch())
        src = pub.source("w")
        async with KvEventClient([src], config=NATIVE) as client:
            await client.wait_synced(10)
            driver = _driver(client, src)
            await _caught_up(client, src, 49)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert driver.native_replayed == 50 and driver.native_replays >= 1
            assert st.batches == 50 and st.resets == 0 and not st.partial
            assert st.replayed_batches >= 50


async def test_an_answer_that_starts_late_is_applied_and_marks_the_history_partial() -> None:
    # The buffer keeps the newest 10 of 30: the cold answer starts at seq 20 (rule 6).
    wl = Workload(2)
    async with EventPublisher(buffer_steps=10) as pub:
        for _ in range(30):
            pub.publish(wl.batch())
        src = pub.source("w")
        async with KvEventClient([src], config=NATIVE) as client:
            await client.wait_synced(10)
            driver = _driver(client, src)
            await _caught_up(client, src, 29)
            st = client.stats().sources[src.key]
            assert driver.native_replayed == 10
            assert st.partial and st.uncovered == 1 and st.resets == 0 and st.batches == 10
            assert_index_subset(client.index, truth_index({src.key: pub}), wl.queries)


async def test_an_empty_identity_answer_is_a_restart() -> None:
    # After a restart on the same port the reconnect's identity check asks from seq 9; the new
    # engine never got that far and answers nothing: the machine resets and starts over cold.
    wl = Workload(3)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=NATIVE) as client:
            await client.wait_synced(10)
            driver = _driver(client, src)
            for _ in range(10):
                pub.publish(wl.batch())
            await _caught_up(client, src, 9)
            asked = driver.native_replays
            pub.restart()
            wl = Workload(30)  # the new process's cache starts empty
            await wait_for(lambda: client.stats().sources[src.key].restarts >= 1, "the restart is seen")
            for _ in range(5):
                pub.publish(wl.batch())
            await _caught_up(client, src, 4)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            assert driver.native_replays > asked


async def test_an_answer_cut_short_by_a_disconnect_is_applied_and_the_rest_asked_again() -> None:
    # The endpoint sends seqs 0-4 of 20 and drops the connection: no end marker. After the
    # silence the thread hands the five over, the machine applies them and asks from 5 (rule 4),
    # which the endpoint (bound again) answers whole.
    wl = Workload(4)
    async with EventPublisher() as pub:
        for _ in range(20):
            pub.publish(wl.batch())

        def answer(n: int, start: int) -> list[int] | None:
            return None if n == 0 else list(range(start, pub.next_seq))

        async with _router(pub, answer) as endpoint:
            src = pub.source("w", replay_endpoint=endpoint)
            async with KvEventClient([src], config=NATIVE) as client:
                await client.wait_synced(10)
                driver = _driver(client, src)
                await _caught_up(client, src, 19)
                assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
                st = client.stats().sources[src.key]
                assert st.resets == 0 and not st.partial and st.batches == 20
                # The five came reply by reply; the retry's 15 the thread applied whole.
                assert driver.native_replayed == 15


async def test_an_answer_with_a_hole_goes_to_the_machine() -> None:
    # Seq 3 is missing from the first answer (a ROUTER past its hwm drops replies silently):
    # it is not taken whole; the machine applies 0-2, holds 4.., asks from 3 (the retry, with
    # batches held, is the machine's too) and applies the rest, no reset.
    wl = Workload(5)
    async with EventPublisher() as pub:
        for _ in range(12):
            pub.publish(wl.batch())

        def answer(n: int, start: int) -> list[int]:
            seqs = list(range(start, pub.next_seq))
            return [s for s in seqs if s != 3] if n == 0 else seqs

        async with _router(pub, answer) as endpoint:
            src = pub.source("w", replay_endpoint=endpoint)
            async with KvEventClient([src], config=NATIVE) as client:
                await client.wait_synced(10)
                driver = _driver(client, src)
                await _caught_up(client, src, 11)
                assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
                st = client.stats().sources[src.key]
                assert st.resets == 0 and st.restarts == 0 and not st.partial
                assert driver.native_replays >= 2 and driver.native_replayed == 0


async def test_an_unanswered_request_times_out_on_the_thread() -> None:
    wl = Workload(6)
    async with EventPublisher() as pub:
        for _ in range(5):
            pub.publish(wl.batch())
        pub.replay_mute = True
        src = pub.source("w")
        async with KvEventClient([src], config=NATIVE) as client:
            driver = _driver(client, src)
            await wait_for(lambda: client.stats().sources[src.key].replay_failures >= 1, "the cold replay times out")
            assert driver.native_replays >= 1 and driver.native_replayed == 0
            # The cold replay failed: the first live seq starts the history, partial (rule 6).
            pub.replay_mute = False
            pub.publish(wl.batch())
            await _caught_up(client, src, 5)
            st = client.stats().sources[src.key]
            assert st.partial
            assert_index_subset(client.index, truth_index({src.key: pub}), wl.queries)


async def test_a_deferred_probe_asked_beside_an_open_fast_path_is_no_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    # One replay slot, which a's slow answers keep busy, so a quiet tick is deferred (rule 9):
    # each answer comes later than the quiet interval, so b's next tick after any probe of its
    # own finds a's holding the slot, whichever of them asked first. Just before that source's
    # deferred probe is asked, its engine publishes a batch and the
    # thread applies it on the fast path the source's last drain opened, the loop kept from
    # running. The probe's answer must not look applied "off the machine's terms" (a reset and a
    # cold replay of a healthy worker, found in review): the fast path is closed, and what it
    # applied recorded, first.
    cfg = msgspec.structs.replace(NATIVE, max_concurrent_replays=1, replay_timeout=1.5)
    forced: list[WorkerKey] = []
    armed: list[tuple[KvEventClient, dict[WorkerKey, tuple[EventPublisher, Workload]]]] = []
    original = SourceDriver._deferred_probe

    def deferred_probe(driver: SourceDriver) -> None:
        key = driver.source.key
        # Forced only beside an open fast path (the case under test). The thread may still hand the
        # batch over instead of applying it (a hand-over it queued before the open makes it ignore the
        # open: 6 == 7 at load 11-20); then this probe is no such case, and a later one is tried.
        if armed and not forced and driver._deferred_tick is not None and driver._native_opened is not None:
            client, engines = armed[0]
            pub, wl = engines[key]
            pub.publish(wl.batch())
            want = truth_index({key: pub}).num_blocks(key)
            deadline = time.monotonic() + 2
            while client.index.num_blocks(key) != want and time.monotonic() < deadline:
                time.sleep(0.0005)  # the loop does not run: only the thread can apply it
            if client.index.num_blocks(key) == want:
                forced.append(key)
        original(driver)

    monkeypatch.setattr(SourceDriver, "_deferred_probe", deferred_probe)
    async with EventPublisher() as pa, EventPublisher() as pb:
        wa, wb = Workload(50), Workload(51)
        for _ in range(3):
            pa.publish(wa.batch())
            pb.publish(wb.batch())
        async with _router(pa, lambda n, start: list(range(start, pa.next_seq)), delay=0.5) as endpoint:
            sa, sb = pa.source("a", replay_endpoint=endpoint), pb.source("b")
            async with KvEventClient([sa, sb], config=cfg) as client:
                await client.wait_synced(20)
                engines = {sa.key: (pa, wa), sb.key: (pb, wb)}
                armed.append((client, engines))
                await wait_for(lambda: bool(forced), "a deferred probe")
                for src, (pub, _) in zip((sa, sb), engines.values()):
                    await _caught_up(client, src, pub.next_seq - 1)
                st = client.stats().sources[forced[0]]
                assert (st.restarts, st.resets) == (0, 0)
                assert_index_equal(client.index, truth_index({sa.key: pa, sb.key: pb}), wa.queries + wb.queries)


async def test_a_deferred_probe_whose_slot_the_drain_gave_away_waits_for_the_next(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # One replay slot, which a's slow answers keep busy, so b's and c's quiet ticks are deferred
    # (rule 9). When the slot comes free it is offered to the oldest deferred probe, whose hold of
    # the thread drains the hand-overs queued meanwhile: another source's quiet tick among them
    # takes the free slot first. The offered probe must then wait for the next slot, not take the
    # busy one: it raised WouldBlock inside the turn that freed the slot, and that source's driver
    # failed and was removed (a 4,096-rank cold sync lost 3 sources so). Here the loop is kept from
    # running (the thread goes on) for longer than the quiet interval before the offered probe
    # goes on, so the other sources' quiet ticks wait in the thread's outbox; the offered tick is
    # made as young as if it had just happened, and its own next tick is not yet due.
    cfg = msgspec.structs.replace(NATIVE, max_concurrent_replays=1)
    raced: list[WorkerKey] = []
    inside: list[SourceDriver] = []
    original_probe, original_quiet = SourceDriver._deferred_probe, SourceDriver._on_quiet

    def deferred_probe(driver: SourceDriver) -> None:
        if raced or driver._deferred_tick is None or driver._native_opened is None:
            original_probe(driver)  # (with its fast path closed, the probe holds nothing: no drain)
            return
        time.sleep(0.45)  # past FAST's 0.3 s quiet interval: the thread queues the quiet ticks
        driver._deferred_tick = (anyio.current_time(), driver._deferred_tick[1])
        inside.append(driver)
        try:
            original_probe(driver)
        finally:
            inside.clear()

    def on_quiet(driver: SourceDriver) -> None:
        if inside and driver is inside[0]:
            # The offered source's own next tick, queued in the same drain, would take the free
            # slot itself and settle its probe: the race needs another source's tick first, as
            # when the offered source's next tick is not yet due. Left for its next tick.
            return
        held = driver._replays.holding
        original_quiet(driver)
        if inside and driver is not inside[0] and not held and driver._replays.holding:
            raced.append(inside[0].source.key)  # another source took the slot inside the offered probe

    monkeypatch.setattr(SourceDriver, "_deferred_probe", deferred_probe)
    monkeypatch.setattr(SourceDriver, "_on_quiet", on_quiet)
    async with EventPublisher() as pa, EventPublisher() as pb, EventPublisher() as pc:
        wa, wb, wc = Workload(60), Workload(61), Workload(62)
        for _ in range(3):
            pa.publish(wa.batch())
            pb.publish(wb.batch())
            pc.publish(wc.batch())
        async with _router(pa, lambda n, start: list(range(start, pa.next_seq)), delay=0.15) as endpoint:
            sources = [pa.source("a", replay_endpoint=endpoint), pb.source("b"), pc.source("c")]
            async with KvEventClient(sources, config=cfg) as client:
                await client.wait_synced(20)
                await wait_for(lambda: bool(raced), "another source's quiet tick taking the offered slot")
                offered = client.stats().sources[raced[0]]
                # Nobody failed: every source is still followed, and each one's probes go on.
                for src, pub in zip(sources, (pa, pb, pc)):
                    pub.publish((wa, wb, wc)[sources.index(src)].batch())
                    await _caught_up(client, src, pub.next_seq - 1)
                stats = client.stats().sources
                assert set(stats) == {src.key for src in sources}
                assert offered.probes_deferred >= 2  # deferred at its tick, then again when the slot went
                assert all((st.restarts, st.resets) == (0, 0) for st in stats.values())
                assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
                truth = truth_index({sources[0].key: pa, sources[1].key: pb, sources[2].key: pc})
                assert_index_equal(client.index, truth, wa.queries + wb.queries + wc.queries)
