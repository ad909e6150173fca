"""The native receive loop (``SubscriberConfig(native_receive=True)``) end to end over loopback sockets.

The compiled core's thread owns the SUBs and applies in-order batches itself; every other case
(gaps, restarts, undecodable payloads, malformed messages, quiet ticks, listeners) is handed to
the Python recovery machine. Each test ends with the index checked against the engine's truth.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
import zmq
from _publisher_helpers import (
    FAST,
    Workload,
    assert_index_equal,
    assert_index_subset,
    first_batch_lands,
    following_live,
    needs_ipv6,
    plain_seqs,
    settle,
    subscribed,
    truth_index,
    wait_for,
)

from kvroute import AllBlocksCleared, BlockStored, EventBatch, WorkerKey, encode_batch
from kvroute._client import KvEventClient
from kvroute._models import EventSource
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._transports.zmq.driver import SourceDriver
from kvroute._transports.zmq.native import NativeReceiver
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
async def _following(
    pub: EventPublisher, src: EventSource, config: SubscriberConfig = NATIVE
) -> AsyncIterator[tuple[KvEventClient, SourceDriver]]:
    """A client following ``src`` of ``pub`` alone, synced, and the source's driver."""
    async with KvEventClient([src], config=config) as client:
        await client.wait_synced(10)
        yield client, _driver(client, src)


def test_native_receive_is_a_bool_option() -> None:
    assert SubscriberConfig().native_receive is True
    with pytest.raises(ValueError, match="native_receive must be a bool"):
        SubscriberConfig(native_receive=1)  # type: ignore[arg-type]


def test_receive_nice_is_a_nice_step() -> None:
    assert SubscriberConfig().receive_nice == 5
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=r"receive_nice must be in 0\.\.19"):
            SubscriberConfig(receive_nice=bad)
    with pytest.raises(ValueError, match="receive_nice must be an int"):
        SubscriberConfig(receive_nice=1.5)  # type: ignore[arg-type]


def _nice_of_threads() -> dict[int, tuple[str, int]]:
    """This process's threads: id → (name, nice)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        rest = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (stat[stat.index("(") + 1 : stat.rindex(")")], int(rest[16]))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
@pytest.mark.parametrize("nice", [0, 6])
async def test_the_receive_side_threads_run_receive_nice_below_the_event_loop(nice: int) -> None:
    # The thread applying batches and libzmq's threads of its two contexts (started by it) yield
    # to the event loop's thread, which keeps its own priority.
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = _nice_of_threads()
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src, msgspec.structs.replace(NATIVE, receive_nice=nice)) as (_, driver):
            assert driver._native is not None
            new = {tid: v for tid, v in _nice_of_threads().items() if tid not in before}
            names = sorted(name for name, _ in new.values())
            assert "kvroute-recv" in names
            # kvroute-recv, an I/O thread and a reaper per context (the sources' and the replays')
            assert len(new) >= 5, names
            expected = min(19, own + nice)
            mine = {tid: v for tid, v in new.items() if v[1] == expected}
            assert len(mine) >= 5, new
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_only_plaintext_tcp_and_ipc_sources_are_eligible() -> None:
    assert NativeReceiver.eligible(EventSource(worker_id="w", endpoint="tcp://127.0.0.1:5557"))
    assert NativeReceiver.eligible(EventSource(worker_id="w", endpoint="ipc:///tmp/kv.sock"))
    assert not NativeReceiver.eligible(EventSource(worker_id="w", endpoint="inproc://kv"))
    assert not NativeReceiver.eligible(
        EventSource(worker_id="w", endpoint="tcp://127.0.0.1:5557", curve_server_key="x" * 40)
    )


async def test_the_thread_applies_in_order_batches_and_python_fills_the_gaps() -> None:
    wl = Workload(2)
    async with EventPublisher(drop_rate=0.2, seed=3) as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, driver):
            assert driver._native is not None
            # In 30 rounds of 10, each sent once the last is caught up: a replay covers everything
            # queued behind its gap (the SUB is parked meanwhile), so 300 batches sent at once to a
            # client a loaded host delays may all come by replay and none in order.
            for _ in range(30):
                for _ in range(10):
                    pub.publish(wl.batch())
                await _caught_up(client, src, pub.next_seq - 1)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert pub.dropped > 0 and st.replayed_batches >= pub.dropped and st.resets == 0 and not st.partial
            # Most batches came in order and the thread applied them; the rest Python did.
            assert 0 < driver.native_batches < 300
            assert st.batches >= 300 - pub.dropped


async def test_the_stats_follow_what_the_thread_applied_without_a_hand_over() -> None:
    # Batches the thread applies itself reach Python's bookkeeping (rule 1's last_seq, the
    # counters) within its note delay (2 ms), though no hand-over or quiet tick (60 s here)
    # wakes the event loop: `stats()` trails the index by no more.
    wl = Workload(5)
    quiet = msgspec.structs.replace(NATIVE, quiet_interval=60.0)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src, quiet) as (client, driver):
            assert driver._native is not None
            await first_batch_lands(client, pub, src.key, wl)  # then the fast path is open
            before = driver.native_batches
            for _ in range(10):
                pub.publish(wl.batch())
            truth = truth_index({src.key: pub})
            await wait_for(lambda: client.index.num_blocks(src.key) == truth.num_blocks(src.key), "indexed")
            with anyio.fail_after(2):
                await _caught_up(client, src, pub.next_seq - 1)
            assert driver.native_batches == before + 10


async def test_a_batch_applied_hundreds_of_seqs_ago_is_a_duplicate_when_it_comes_again() -> None:
    # The thread's records come to the machine several a source (`RecoveryMachine.on_applied_many`); its
    # ts ring must grow with them as with one at a time, or an old seq coming again (a PUB's resend)
    # would cost an identity check instead of being known for a duplicate (rule 2).
    wl = Workload(6)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, driver):
            await first_batch_lands(client, pub, src.key, wl)
            sent = {}
            for _ in range(300):
                batch = EventBatch(time.time(), wl.batch(), 0)
                sent[pub.publish_batch(batch)] = batch
            await _caught_up(client, src, pub.next_seq - 1)
            assert driver.native_batches >= 250  # in order, so the thread applied them
            st0 = msgspec.structs.replace(driver.machine.stats)
            old = pub.next_seq - 250
            pub.publish_raw([b"", old.to_bytes(8, "big"), encode_batch(sent[old], form=pub.form)])
            await wait_for(lambda: driver.machine.stats.duplicates == st0.duplicates + 1, "the resend is seen")
            st = driver.machine.stats
            assert (st.identity_checks, st.stale, st.resets) == (st0.identity_checks, st0.stale, st0.resets)


async def test_a_restart_is_handed_to_the_machine() -> None:
    wl = Workload(4)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, _):
            for _ in range(20):
                pub.publish(wl.batch())
            await _caught_up(client, src, 19)
            pub.restart()
            wl = Workload(40)  # the new process's cache starts empty
            for _ in range(10):
                pub.publish(wl.batch())
            await wait_for(lambda: client.stats().sources[src.key].resets >= 1, "the restart is seen")
            await _caught_up(client, src, 9)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


async def test_bad_payloads_and_frames_are_counted_and_the_rest_applied() -> None:
    wl = Workload(10)
    async with EventPublisher(corrupt_rate=0.2, seed=4, topic="kv") as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, _):
            await following_live(client, pub, src.key, wl)
            for i in range(60):
                pub.publish(wl.batch())
                if i % 20 == 0:
                    pub.publish_raw([b"kv"])
                    pub.publish_raw([b"kv", b"\x00\x01", b"\x90"])
                    pub.publish_raw([b"kv", b"", b"", b""])
            await _caught_up(client, src, pub.next_seq - 1)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            # Live copies that arrived while a replay was in flight are read after it (the SUB
            # was parked): their verdicts may come after the replay has caught the source up.
            await wait_for(
                lambda: client.stats().sources[src.key].decode_errors >= pub.corrupted, "every live copy read"
            )
            st = client.stats().sources[src.key]
            assert st.decode_errors == pub.corrupted > 0
            assert st.skipped_frames == 9
            assert st.resets == 0


async def test_a_lost_tail_is_found_by_the_threads_quiet_tick() -> None:
    wl = Workload(8)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, _):
            # Synced is not subscribed (a slow joiner): a first batch the PUB sent before the
            # subscription, then one after it, would be a gap.
            await subscribed(client, pub, src.key)
            for _ in range(5):
                pub.publish(wl.batch())
            await _caught_up(client, src, 4)
            pub.drop_rate = 1.0
            for _ in range(4):
                pub.publish(wl.batch())
            # No later message shows a gap: only the quiet tick's probe finds these.
            await _caught_up(client, src, 8)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert st.gaps == 0 and st.probes >= 1


async def test_a_listener_gets_every_batch_and_the_thread_resumes_without_one() -> None:
    wl = Workload(12)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, driver):
            for _ in range(10):
                pub.publish(wl.batch())
            await _caught_up(client, src, 9)
            stream = client.events()
            # Every batch applied after `events()` returned comes as events (test below).
            pub.publish(wl.batch())
            await _caught_up(client, src, 10)
            for _ in range(10):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 20})
            await stream.aclose()
            # The next message is handed over (the fast path is closed); its drain reopens it.
            pub.publish(wl.batch())
            await _caught_up(client, src, 21)
            before = driver.native_batches
            for _ in range(10):
                pub.publish(wl.batch())
            await _caught_up(client, src, 31)
            assert driver.native_batches > before
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


async def test_every_batch_after_events_returns_comes_with_its_envelope() -> None:
    # The thread applies in-order batches without envelopes while nobody listens. A listener that
    # came between two hand-overs once lost the batches the thread applied before it next handed
    # one over (a live engine's first store after `events()` never reached the iterator).
    wl = Workload(13)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src) as (client, _):
            for _ in range(10):
                pub.publish(wl.batch())
            await _caught_up(client, src, 9)
            assert _driver(client, src)._native_opened is not None  # the fast path is open
            stream = client.events()
            for _ in range(5):
                pub.publish(wl.batch())
            seen: set[int] = set()
            with anyio.fail_after(10):
                async for env in stream:
                    if env.source.key == src.key and env.seq is not None:
                        seen.add(env.seq)
                    if 14 in seen:
                        break
            assert seen == set(range(10, 15))
            await stream.aclose()


async def test_a_removed_source_touches_the_index_no_more() -> None:
    wl = Workload(24)
    async with EventPublisher() as pub, KvEventClient([], config=NATIVE) as client:
        src = pub.source("w")
        assert client.add_source(src)
        await client.wait_synced(10)
        # One at a time: the first may reach Python (the path opens at its hand-over); a burst sent at
        # once on a loaded host could all be handed over before Python's open arrives.
        for seq in range(5):
            pub.publish(wl.batch())
            await _caught_up(client, src, seq)
        assert _driver(client, src).native_batches > 0
        # A flood in flight while the source leaves: the thread stops applying at once.
        for _ in range(500):
            pub.publish(wl.batch())
        assert client.remove_source(src)
        await anyio.sleep(0.2)
        assert client.index.workers() == set() and client.index.num_blocks() == 0


async def test_many_sources_on_one_thread_and_drops_past_the_buffer() -> None:
    workloads = [Workload(100 + i) for i in range(16)]
    async with contextlib.AsyncExitStack() as stack:
        lossy = await stack.enter_async_context(EventPublisher(buffer_steps=8))
        pubs = [lossy] + [await stack.enter_async_context(EventPublisher()) for _ in range(15)]
        sources = [p.source(f"w{i}") for i, p in enumerate(pubs)]
        client = await stack.enter_async_context(KvEventClient(sources, config=NATIVE))
        await client.wait_synced(10)
        # Synced is not subscribed (a slow joiner): a burst the PUB sent before a source's
        # subscription would all come by replay, none applied by the thread.
        for s, p in zip(sources, pubs):
            await subscribed(client, p, s.key)
        for _ in range(20):
            for p, wl in zip(pubs, workloads):
                p.publish(wl.batch())
        lossy.drop_rate = 1.0
        for _ in range(30):
            lossy.publish(workloads[0].batch())
        lossy.drop_rate = 0.0
        for _ in range(5):
            lossy.publish(workloads[0].batch())
        for s, p in zip(sources, pubs):
            await _caught_up(client, s, p.next_seq - 1)
        truth = truth_index({s.key: p for s, p in zip(sources, pubs)})
        assert_index_subset(client.index, truth, [q for wl in workloads for q in wl.probes])
        assert client.stats().sources[sources[0].key].partial
        for s in sources[1:]:
            assert client.index.num_blocks(s.key) == truth.num_blocks(s.key)
        assert all(_driver(client, s).native_batches > 0 for s in sources[1:])


def _hog_payloads() -> tuple[bytes, bytes]:
    """A batch of 400,000 blocks (most of a second under the index's write lock) and the clear that undoes it."""
    n = 50_000
    events = [
        BlockStored(
            block_hashes=list(range(k * n + 1, (k + 1) * n + 1)),
            parent_block_hash=None,
            token_ids=[i % 50_000 for i in range(16 * n * k, 16 * n * (k + 1))],
            block_size=16,
        )
        for k in range(8)
    ]
    return encode_batch(EventBatch(1.0, events)), encode_batch(EventBatch(2.0, [AllBlocksCleared()]))


async def test_a_busy_thread_probes_no_source_that_keeps_sending() -> None:
    # The receive thread held up for several quiet intervals (here: another writer keeps the
    # index lock, as a flood or a busy core would keep the thread from its sockets) while
    # every source keeps sending: none of them is quiet, so none is probed (the overload rule:
    # never probe a source for kvroute's own slowness). Each still ends applied in order.
    config = msgspec.structs.replace(NATIVE, quiet_interval=0.5)
    workloads = [Workload(300 + i) for i in range(8)]
    hog, clear = _hog_payloads()
    hog_worker = WorkerKey("hog", 0)
    async with contextlib.AsyncExitStack() as stack:
        pubs = [await stack.enter_async_context(EventPublisher()) for _ in workloads]
        sources = [p.source(f"w{i}") for i, p in enumerate(pubs)]
        client = await stack.enter_async_context(KvEventClient(sources, config=config))
        await client.wait_synced(10)
        probes = {s.key: client.stats().sources[s.key].probes for s in sources}
        index = client.index
        held = 0.0

        def hold_the_lock() -> None:
            # Two applies under the index's write lock, the GIL released: the thread waits.
            index.apply_payload(hog_worker, hog)
            index.apply_payload(hog_worker, clear)

        async def publish(stop: anyio.Event) -> None:
            while not stop.is_set():
                for p, wl in zip(pubs, workloads):
                    p.publish(wl.batch())
                await anyio.sleep(0.02)

        start = anyio.current_time()
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(publish, stop)
            await anyio.sleep(0.5)
            while anyio.current_time() < start + 5.0:
                t = anyio.current_time()
                await anyio.to_thread.run_sync(hold_the_lock)
                held += anyio.current_time() - t
            # The sources still send while the thread catches up past what they sent meanwhile
            # (its hand-overs from the held spell drained with those applies); only then do they
            # stop. A source quiet after that is quiet, and a probe of it is due: on a loaded
            # machine the checks below can take longer than the quiet interval.
            for s, mark in [(s, p.next_seq - 1) for s, p in zip(sources, pubs)]:
                await wait_for(
                    lambda s=s, mark=mark: client.stats().sources[s.key].last_seq >= mark,  # type: ignore[misc]
                    f"{s.key} past seq {mark}",
                )
            probed = {s.key: client.stats().sources[s.key].probes for s in sources}
            stop.set()
        assert held > 3.0  # the thread was kept from its sockets for six quiet intervals and more
        assert probed == probes
        for s, p in zip(sources, pubs):
            await _caught_up(client, s, p.next_seq - 1)
        index.remove_worker(hog_worker)
        assert_index_equal(
            index, truth_index({s.key: p for s, p in zip(sources, pubs)}), [q for wl in workloads for q in wl.queries]
        )
        assert all(_driver(client, s).native_batches > 0 for s in sources)


async def test_a_source_waiting_for_its_replay_is_not_read_and_holds_nothing() -> None:
    # A gap, and the engine's replay endpoint slow to answer (down: the request waits in the
    # DEALER until it is back, within the replay timeout). Meanwhile the engine publishes 200 more batches. The
    # Python receiver would read, decode and hold every one of them behind the replay (up to
    # held_bytes per source, for every source of a cold fleet at once); the thread parks the
    # SUB instead, so they wait in libzmq's and the engine's queues. Once the retry answers,
    # they are read again: duplicates of the replayed run are dropped (rule 2), the rest applied.
    config = msgspec.structs.replace(NATIVE, replay_timeout=2.0)
    wl = Workload(31)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with _following(pub, src, config) as (client, driver):
            for _ in range(5):
                pub.publish(wl.batch())
            await _caught_up(client, src, 4)
            pub.drop_rate = 1.0
            pub.publish(wl.batch())
            pub.drop_rate = 0.0
            pub.kill_replay()
            pub.publish(wl.batch())
            await wait_for(lambda: driver.machine.replay_in_flight is not None, "the gap's replay is asked")
            await anyio.sleep(0.1)
            for _ in range(200):
                pub.publish(wl.batch())
            await anyio.sleep(0.5)
            assert driver.machine.replay_in_flight is not None  # still unanswered
            assert driver.machine.held <= 2  # the gap's own message, at most one more
            pub.revive_replay()
            await _caught_up(client, src, pub.next_seq - 1)
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert st.resets == 0 and st.overflows == 0 and not st.partial
            assert driver.machine.held == 0
            # The parked messages (duplicates of the replayed run, read after it) are handed
            # over one by one; one more batch comes after them. Then the fast path is back.
            pub.publish(wl.batch())
            await _caught_up(client, src, pub.next_seq - 1)
            assert driver.machine.stats.duplicates >= 200
            before = driver.native_batches
            for _ in range(10):
                pub.publish(wl.batch())
            await _caught_up(client, src, pub.next_seq - 1)
            assert driver.native_batches >= before + 10


@needs_ipv6
async def test_an_engine_on_ipv6_loopback_is_followed_by_the_thread() -> None:
    # The thread's SUBs are its own libzmq's (IPv4 only unless told): an engine on [::1] never connected.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.IPV6, 1)
    wl = Workload(41)
    try:
        async with EventPublisher(endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0", context=ctx) as pub:
            src = pub.source("v6")
            assert src.endpoint.startswith("tcp://[::1]:")
            async with _following(pub, src) as (client, driver):
                # Rounds until the thread applies one itself: on a loaded host a round can come by
                # replay while the source is parked. An IPv4-only thread never applies one.
                for _ in range(30):
                    for _ in range(10):
                        pub.publish(wl.batch())
                    await _caught_up(client, src, pub.next_seq - 1)
                    if driver.native_batches > 0:
                        break
                assert driver.native_batches > 0
                assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
    finally:
        ctx.term()


async def test_cursors_match_the_index_while_the_thread_applies() -> None:
    # The thread applies outside the event loop, before the source's machine records the seq.
    # `cursors()` holds it (until the loop's next turn) with every applied seq recorded, so
    # code that reads the positions and then the index sees the index as of those positions:
    # each batch stores one new block, so the worker holds exactly seq + 1 blocks.
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=NATIVE) as client:
            await client.wait_synced(20)
            driver = _driver(client, src)
            seq = -1
            checks = 0
            for burst in range(20):
                for i in range(50):
                    n = burst * 50 + i
                    seq = pub.publish(
                        [BlockStored(block_hashes=[n + 1], token_ids=list(range(n * 16, n * 16 + 16)), block_size=16)]
                    )
                while True:
                    cursor = client.cursors().get(src.key)
                    if cursor is not None:
                        assert client.index.num_blocks(src.key) == cursor.seq + 1
                        checks += 1
                    if cursor is not None and cursor.seq == seq:
                        break
                    await anyio.sleep(0.001)
            assert checks >= 20
            assert driver.native_batches > 0


async def test_sources_churning_on_a_shared_endpoint_leave_the_kept_one_followed() -> None:
    # Regression (issue 19): 20 sources on the kept source's endpoint are added and removed every
    # few ms, so most close before (or just as) their handshake completes. The thread used to
    # close a SUB with its monitor still attached: the handshake (or disconnect) event libzmq's
    # I/O thread then reported went to a monitor PAIR whose reader was gone, and that blocking
    # send stalled the I/O thread for good. Every SUB of the thread's context then stopped
    # receiving, the kept one included: synced, open, never applied again.
    wl = Workload(7)
    async with EventPublisher() as pub:
        keep = pub.source("keep")
        churn = [pub.source(f"c{i}", replay_endpoint=None) for i in range(20)]
        async with _following(pub, keep) as (client, driver):
            for _ in range(60):
                for src in churn:
                    client.add_source(src)
                await anyio.sleep(0.002)
                for src in churn:
                    client.remove_source(src)
                pub.publish(wl.batch())
                await anyio.sleep(0.002)
            before = driver.native_batches
            for _ in range(20):
                pub.publish(wl.batch())
            await _caught_up(client, keep, pub.next_seq - 1)
            # Applied by the thread itself, not only by the recovery machine's replays.
            assert driver.native_batches >= before + 20
            assert_index_equal(client.index, truth_index({keep.key: pub}), wl.queries)


async def test_a_stale_open_leaves_the_source_unread_until_python_takes_the_rest() -> None:
    """The thread's side of rule 1's mirror in a flood, on the binding (`kvroute._core.NativeReceiver`).

    An open that lands while hand-overs Python has not taken are queued is stale: the thread does
    not open, and leaves the source unread (its messages wait in libzmq's queue) until Python's
    next command. Read on, it would hand over faster than a busy event loop takes them, and every
    open after it would be stale too (the source stayed on the slow path for a whole flood).
    """
    from kvroute import _core
    from kvroute._index import PrefixIndex

    def batch(seq: int) -> list[bytes]:
        stored = BlockStored(block_hashes=[seq + 1], parent_block_hash=None, token_ids=[seq] * 4, block_size=4)
        return [b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(1.0 + seq, [stored], 0))]

    async def drained(until: float = 0.0, *, want: int = 0) -> tuple[list[int], list[int]]:
        """Applied seqs and handed-over message seqs, drained for ``until`` s or until ``want`` of either came."""
        applied: list[int] = []
        handed: list[int] = []
        deadline = time.monotonic() + (until or 10.0)
        while time.monotonic() < deadline:
            plain, got, handovers, _, dead = core.drain()
            assert dead is None
            applied += plain_seqs(plain) + [s for a in got for s in a[1]]
            handed += [int.from_bytes(h[2][1], "big") for h in handovers if h[0] == 0]
            taken[0] += len(handovers)
            if want and len(applied) + len(handed) >= want:
                break
            await anyio.sleep(0.01)
        return applied, handed

    cfg = SubscriberConfig()
    index = PrefixIndex()
    core = _core.NativeReceiver(
        index._core, 64, cfg.wakeup_bytes, 60.0, cfg.held_bytes, 1024,
        cfg.limits.max_events_per_batch, cfg.limits.max_blocks_per_event, cfg.limits.max_block_size, 0,
    )  # fmt: skip
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    taken = [0]  # hand-overs "Python" took so far
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        key = WorkerKey("w", 0)
        core.add(1, key, f"tcp://127.0.0.1:{port}", b"", 1000, -1, 100, 1000, False)
        # Closed: messages are handed over. Seq 0 until one arrives (a slow joiner), then 1-3.
        while not (await drained(0.05))[1]:
            pub.send_multipart(batch(0))
        await drained(0.2)
        for seq in (1, 2, 3):
            pub.send_multipart(batch(seq))
        assert await drained(want=3) == ([], [1, 2, 3])
        # An open that has not seen those three: stale (sent while the thread is held, so it is carried
        # out before the thread reads again, whatever the load). Nothing is read meanwhile.
        core.hold()
        core.open(1, 1, taken[0] - 3)
        core.release()
        for seq in (4, 5):
            pub.send_multipart(batch(seq))
        assert await drained(0.3) == ([], [])
        # Python took the three: its open is exact, and what waited in libzmq's queue is applied.
        core.open(1, 4, taken[0])
        assert await drained(want=2) == ([4, 5], [])
        assert index.num_blocks(key) == 2
    finally:
        core.close()
        pub.close(linger=0)
        ctx.term()
