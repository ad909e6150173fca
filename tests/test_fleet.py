"""Fleet scale (issue 19): descriptors per source, one receive loop, quiet decided on the socket, apply lag.

Every test runs real ZMQ sockets over loopback, is bounded in time, and stops by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec
import pytest
import zmq
from _publisher_helpers import FAST, subscribed

from kvroute import BlockRemoved, BlockStored, EventBatch, EventSource, KvEventClient, WorkerKey, encode_batch
from kvroute._errors import ConfigError
from kvroute._recovery import REPLAY_END_MARKER
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._transports.zmq.driver import SourceDriver
from kvroute._transports.zmq.sockets import FDS_PER_SOURCE
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio


async def until(cond: Callable[[], bool], seconds: float = 20.0) -> None:
    """Poll ``cond`` every 20 ms; fail the test after ``seconds``."""
    with anyio.fail_after(seconds):
        while not cond():  # noqa: ASYNC110 (stats change without an event to wait on)
            await anyio.sleep(0.02)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _event(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i * 2 + 1], token_ids=list(range(16)), block_size=16)


async def test_an_idle_source_holds_four_descriptors_and_no_replay_socket() -> None:
    n = 12
    async with contextlib.AsyncExitStack() as stack:
        pubs = [await stack.enter_async_context(EventPublisher()) for _ in range(n)]
        for i, pub in enumerate(pubs):
            pub.publish([_event(i)])
        ctx: zmq.Context[zmq.Socket[bytes]] = stack.enter_context(zmq.Context())
        ctx.socket(zmq.PAIR).close()  # the context's I/O thread and reaper start with its first socket
        before = _fds()
        sources = [pub.source(f"w{i}") for i, pub in enumerate(pubs)]
        # The Python receiver's sockets, all in ``ctx`` (the native thread has its own context).
        python_receiver = msgspec.structs.replace(FAST, native_receive=False)
        async with KvEventClient(sources, config=python_receiver, context=ctx) as client:
            await client.wait_synced(20)
            for i, pub in enumerate(pubs):
                pub.publish([_event(100 + i)])
            await until(lambda: client.stats().totals.batches >= 2 * n)
            # The cold replays are over: their DEALERs are closed (libzmq reaps them in its
            # own thread, so allow it a moment). What is left per source: SUB, its TCP
            # connection, the monitor's two PAIR ends, and (the publishers run in this process)
            # the PUB's end of the connection; and the client's one selector.
            await until(lambda: _fds() - before <= n * (FDS_PER_SOURCE + 1) + 1, seconds=10)
            assert FDS_PER_SOURCE == 4
            assert all(s.driver._dealer is None for s in client._subs.values())  # type: ignore[attr-defined]


async def test_a_synced_source_keeps_one_task_and_no_replay_task() -> None:
    # A fleet's cold sync allocates per source whatever its tasks hold (task, context, events,
    # futures, coroutines), and the garbage collector walks all of it over and over: a source
    # starts a replay task when its machine asks a replay and that task ends with the last one,
    # so a synced source keeps only its own task (it was two, the replay one waiting for ever).
    n = 12
    config = msgspec.structs.replace(FAST, quiet_interval=60.0)  # no quiet probe while counting
    async with contextlib.AsyncExitStack() as stack:
        pubs = [await stack.enter_async_context(EventPublisher()) for _ in range(n)]
        for i, pub in enumerate(pubs):
            pub.publish([_event(i)])
        before = len(anyio.get_running_tasks())
        async with KvEventClient([pub.source(f"w{i}") for i, pub in enumerate(pubs)], config=config) as client:
            await client.wait_synced(20)
            assert all(st.replays >= 1 for st in client.stats().sources.values())  # each had its cold replay

            def one_task_a_source() -> bool:
                # The sources' tasks, and at most two of the client's own.
                return len(anyio.get_running_tasks()) - before <= n + 2

            await until(one_task_a_source, seconds=10)
            # And a replay asked later still runs (a gap): the task starts again, and ends again.
            # The gap must reach the SUB live: synced is not subscribed (a slow joiner), and with no
            # quiet probe a batch the PUB sent before the subscription would show no gap at all.
            key = WorkerKey("w0", 0)
            await subscribed(client, pubs[0], key)
            pubs[0].drop_rate = 1.0
            pubs[0].publish([_event(100)])  # lost on the wire, kept in the replay buffer
            pubs[0].drop_rate = 0.0
            pubs[0].publish([_event(101)])
            await until(lambda: client.stats().sources[key].gaps >= 1 and client.index.num_blocks(key) == 3)
            await until(one_task_a_source, seconds=10)


async def test_a_request_waiting_for_a_replay_slot_holds_no_task() -> None:
    # A 4,096-rank cold sync queues 4,064 requests behind 32 slots: each used to wait in a task of
    # its own (coroutines, scopes, events and futures the collector walked over and over). A
    # request that has not begun waits in the slots' line without one, and its task starts with
    # the slot it was given.
    n = 8
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    replayer = ctx.socket(zmq.ROUTER)  # every source's replay endpoint: silent until told to answer
    replayer.setsockopt(zmq.LINGER, 0)
    port = replayer.bind_to_random_port("tcp://127.0.0.1")
    config = msgspec.structs.replace(
        FAST, max_concurrent_replays=1, replay_slice=60.0, replay_timeout=30.0, quiet_interval=60.0
    )
    answering = anyio.Event()

    async def replay_endpoint() -> None:
        # Reads every request; once answering, ends each with the end marker (an empty buffer).
        while True:
            try:
                ident, _, _seq = replayer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.sleep(0.01)
                continue
            await answering.wait()
            replayer.send_multipart([ident, b"", REPLAY_END_MARKER, b""])

    try:
        async with contextlib.AsyncExitStack() as stack:
            pubs = [await stack.enter_async_context(EventPublisher()) for _ in range(n)]
            sources = [pub.source(f"w{i}", replay_endpoint=f"tcp://127.0.0.1:{port}") for i, pub in enumerate(pubs)]
            keys = [s.key for s in sources]
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(replay_endpoint)
            before = len(anyio.get_running_tasks())
            async with KvEventClient(sources, config=config) as client:
                requesters = [client._subs[k].driver._replays for k in keys]  # type: ignore[attr-defined]
                # Every source asked its cold replay: one holds the slot, the others wait in line.
                await until(lambda: all(client.stats().sources[k].replays >= 1 for k in keys), seconds=10)
                assert sum(r.holding for r in requesters) == 1
                # The sources' own tasks, the one replay task, and at most two of the client's.
                assert len(anyio.get_running_tasks()) - before <= n + 3
                assert sum(r.queued for r in requesters) == n - 1
                # The line moves on as each slot comes back: every source syncs.
                answering.set()
                await client.wait_synced(20)
                await until(lambda: not any(r.holding or r.queued for r in requesters), seconds=10)
            tg.cancel_scope.cancel()
    finally:
        replayer.close(0)
        ctx.term()


async def test_a_refused_source_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with EventPublisher() as a, EventPublisher() as b:
        config = msgspec.structs.replace(FAST, max_sources=1)
        with caplog.at_level(logging.WARNING, logger="kvroute.client"):
            async with KvEventClient([a.source("a"), b.source("b")], config=config) as client:
                assert client.stats().refused_sources == 1
        assert any("refused source" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


class _ThreadPublisher:
    """One rank published from a thread (PUB + ROUTER replay buffer): it keeps sending while the event loop is stuck."""

    def __init__(self, period: float) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        rport = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.source = EventSource(
            worker_id="thread", endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}"
        )
        self._period = period
        self._stop = threading.Event()
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=1000)
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        next_send = time.monotonic()
        while not self._stop.is_set():
            if dict(poller.poll(5)):
                frames = self._router.recv_multipart()
                if len(frames) == 3 and len(frames[2]) == 8:
                    start = int.from_bytes(frames[2], "big")
                    for seq8, payload in list(self._buffer):
                        if int.from_bytes(seq8, "big") >= start:
                            self._router.send_multipart([frames[0], b"", b"", seq8, payload])
                    self._router.send_multipart([frames[0], b"", b"", b"\xff" * 8, b""])
            if time.monotonic() >= next_send:
                next_send += self._period
                seq8 = self.sent.to_bytes(8, "big")
                payload = encode_batch(EventBatch(time.time(), [_event(self.sent)], 0))
                self._buffer.append((seq8, payload))
                self._pub.send_multipart([b"", seq8, payload])
                self.sent += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        self._router.close(0)
        self._ctx.term()


async def test_a_slow_event_loop_never_probes_a_source_that_kept_sending() -> None:
    # The source sends every 20 ms; the client's event loop is then stuck for 3 quiet
    # intervals at a time (kvroute, or the router sharing its loop, being slow). The socket
    # had messages all along: no quiet probe, and everything is applied in order.
    pub = _ThreadPublisher(0.02)
    try:
        config = msgspec.structs.replace(FAST, quiet_interval=0.3)
        async with KvEventClient([pub.source], config=config) as client:
            await client.wait_synced(20)
            # The baseline is taken once the client follows the live stream: a live message
            # received, applied past what was sent by then, nothing replayed or held. Before
            # that, a gap is legitimate: under load the SUB's subscription can reach the
            # publisher after the cold replay was answered, and what was published in between
            # never reached this subscriber (a slow joiner, docs/recovery.md rules 3 and 6).
            sent = pub.sent

            def following() -> bool:
                (st,) = client.stats().sources.values()
                return st.messages > 0 and st.last_seq >= sent and st.state == "synced"

            await until(following)
            base = client.stats().totals
            for _ in range(3):
                time.sleep(0.9)  # noqa: ASYNC251 (the point: the loop is stuck; the publisher thread keeps sending)
                await anyio.sleep(0.05)
            sent = pub.sent
            await until(lambda: client.stats().totals.batches >= sent)
            st = client.stats().totals
            assert st.probes == base.probes, "a source that kept sending was probed as quiet"
            assert st.gaps == base.gaps and st.resets == 0
            (source_stats,) = client.stats().sources.values()
            assert 0.0 <= source_stats.apply_lag < 5.0
    finally:
        pub.close()


async def test_a_quiet_source_is_still_probed() -> None:
    # The other half of the rule: a socket with nothing to read for the interval is probed.
    async with EventPublisher() as pub:
        pub.publish([_event(1)])
        config = msgspec.structs.replace(FAST, quiet_interval=0.2)
        async with KvEventClient([pub.source("w")], config=config) as client:
            await client.wait_synced(20)
            probes = client.stats().totals.probes
            await until(lambda: client.stats().totals.probes >= probes + 2, seconds=10)


def test_subscriber_config_rejects_wrong_types() -> None:
    with pytest.raises(ConfigError):
        SubscriberConfig(recv_batch="8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SubscriberConfig(quiet_interval="2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SubscriberConfig(tcp_keepalive=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SubscriberConfig(max_sources=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SubscriberConfig(limits={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SubscriberConfig(reconnect_ivl_max=float("nan"))


async def test_apply_lag_is_in_the_stats_and_the_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from kvroute import KvRouteCollector

    async with EventPublisher() as pub:
        config = msgspec.structs.replace(FAST, quiet_interval=5.0)
        async with KvEventClient([pub.source("w")], config=config) as client:
            await client.wait_synced(20)
            # The lag is the live stream's: synced is not subscribed (a slow joiner), and a batch the
            # PUB sent before the subscription would come by the quiet probe's replay, with no lag.
            await subscribed(client, pub, pub.source("w").key)
            # A batch stamped 2 s in the past is applied about 2 s "late" by the engine's clock.
            pub.publish([_event(1)], ts=time.time() - 2.0)
            await until(lambda: client.stats().totals.batches >= 1)
            lag = client.stats().sources[pub.source("w").key].apply_lag
            assert 1.5 < lag < 10.0
            registry = CollectorRegistry()
            KvRouteCollector(client).register(registry)
            top = registry.get_sample_value("kvroute_client_apply_lag_max_seconds")
            per = registry.get_sample_value("kvroute_source_apply_lag", {"worker_id": "w", "dp_rank": "0"})
            assert top is not None and per is not None and top >= per >= 1.5


async def test_wait_synced_names_the_refused_sources() -> None:
    async with EventPublisher() as a:
        ghost = EventSource(worker_id="ghost", endpoint="tcp://127.0.0.1:1")
        never = EventSource(worker_id="never", endpoint="not-an-endpoint")
        config = msgspec.structs.replace(FAST, max_sources=2)
        async with KvEventClient([a.source("a"), ghost, never], config=config) as client:
            assert client.stats().refused_sources == 1
            with pytest.raises(TimeoutError, match="1 sources refused") as err:
                await client.wait_synced(0.5)  # the ghost never connects
            assert "never" in str(err.value) and "max_sources (2) reached" in str(err.value)


async def test_the_receive_loop_outlives_the_source_that_ran_it() -> None:
    # The loop runs in the first source's session; removing that source (and recreating
    # another's SUB) hands it over: the others keep applying.
    async with EventPublisher() as a, EventPublisher() as b, EventPublisher() as c:
        for i, pub in enumerate((a, b, c)):
            pub.publish([_event(i)])
        # The Python receiver's loop (the native thread outlives every source by construction).
        python_receiver = msgspec.structs.replace(FAST, native_receive=False)
        async with KvEventClient([a.source("a"), b.source("b"), c.source("c")], config=python_receiver) as client:
            await client.wait_synced(20)
            receiver = client._subs[a.source("a").key].driver._receiver  # type: ignore[attr-defined]
            assert receiver._leading
            assert client.remove_source(a.source("a"))
            b.restart()  # a new engine process behind b: its SUB is recreated
            b.publish([_event(10)])
            c.publish([_event(11)])
            await until(lambda: client.index.num_blocks(c.source("c").key) == 2)
            await until(lambda: client.index.num_blocks(b.source("b").key) == 1)
            await client.wait_synced(20)
            assert receiver._leading and len(receiver._entries) == 2
        assert receiver._selector is None  # every source left: the selector is closed


class _HeldReplays:
    """One ROUTER serving many sources' replay endpoint: it answers nothing until ``want`` requests wait at once.

    Then (or after ``limit`` seconds, or once `release` is called) it answers every waiting request
    with the end marker alone (an empty buffer) and every later one at once. ``peak``: the most
    requests it held at once.
    """

    def __init__(self, want: int, limit: float = 15.0) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}"
        self._want, self._limit = want, limit
        self.peak = 0
        self._stop = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        held: list[bytes] = []
        release = time.monotonic() + self._limit
        released = False
        while not self._stop.is_set():
            if dict(poller.poll(5)):
                frames = self._router.recv_multipart()
                if len(frames) == 3 and len(frames[2]) == 8:
                    held.append(frames[0])
                    self.peak = max(self.peak, len(held))
            if not released and (
                len(held) >= self._want or time.monotonic() >= release or self._release.is_set()
            ):
                released = True
            if released:
                for ident in held:
                    self._router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
                held.clear()

    def release(self) -> None:
        """Answer the held requests now (and every later one at once)."""
        self._release.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)
        self._ctx.term()


@pytest.mark.parametrize("native", [False, True], ids=["python-receiver", "native-receiver"])
async def test_a_quiet_source_is_not_probed_behind_a_busy_replay_slot(native: bool) -> None:
    # docs/recovery.md rule 9. One replay slot. A quiet source is probed each quiet interval
    # while the slot is free. Then a second source starts cold and its replay endpoint holds
    # the request unanswered: the one slot is taken. The quiet source's ticks must ask nothing
    # (counted as deferred), not queue a probe behind the busy slot: under load every healthy
    # source looks quiet, and such probes lengthened the cold sync that held the slots. Once
    # the slot is free again, the probes resume.
    replays = _HeldReplays(want=1_000_000, limit=60.0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    busy_pub = ctx.socket(zmq.PUB)
    busy_pub.setsockopt(zmq.LINGER, 0)
    try:
        busy = EventSource(
            worker_id="busy",
            endpoint=f"tcp://127.0.0.1:{busy_pub.bind_to_random_port('tcp://127.0.0.1')}",
            replay_endpoint=replays.endpoint,
        )
        config = msgspec.structs.replace(
            FAST,
            quiet_interval=0.2,
            max_concurrent_replays=1,
            replay_timeout=30.0,  # the held request keeps its slot (no reply is not a failure yet) ...
            replay_slice=30.0,  # ... and does not yield it to a waiter
            native_receive=native,
        )
        async with EventPublisher() as pub:
            pub.publish([_event(1)])
            quiet = pub.source("quiet")
            async with KvEventClient([quiet], config=config) as client:
                await client.wait_synced(20)

                def counts() -> tuple[int, int]:
                    st = client.stats().sources[quiet.key]
                    return st.probes, st.probes_deferred

                await until(lambda: counts()[0] >= 1, seconds=10)  # probed while the slot is free
                assert client.add_source(busy)
                await until(lambda: replays.peak >= 1, seconds=10)  # its cold replay holds the only slot
                quiet_driver = client._subs[quiet.key].driver  # type: ignore[attr-defined]
                busy_driver = client._subs[busy.key].driver  # type: ignore[attr-defined]
                assert (quiet_driver._native is not None) == native
                probes, deferred = counts()
                await anyio.sleep(1.2)  # six quiet intervals
                assert busy_driver._replays.holding and not quiet_driver._replays.holding
                assert client.stats().sources[busy.key].state == "syncing"  # still unanswered: the slot stayed busy
                now_probes, now_deferred = counts()
                assert now_probes == probes, "a quiet source was probed behind a busy replay slot"
                assert now_deferred >= deferred + 2
                assert quiet_driver.machine.replay_in_flight is None
                replays.release()
                await client.wait_synced(20)
                await until(lambda: counts()[0] > probes, seconds=10)  # the slot is free: probed again
    finally:
        replays.close()
        busy_pub.close(0)
        ctx.term()


@pytest.mark.parametrize("native", [False, True], ids=["python-receiver", "native-receiver"])
async def test_a_deferred_probe_takes_the_next_free_slot(native: bool) -> None:
    # docs/recovery.md rule 9's other half. Quiet interval 2 s, one replay slot held by a second
    # source's unanswered cold replay: the quiet source's tick is deferred. The slot comes free
    # just after: the deferred probe is asked then, not a whole quiet interval later (sources
    # that synced together tick together; without this, all but the first few of such a burst
    # waited for their next tick).
    replays = _HeldReplays(want=1_000_000, limit=60.0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    busy_pub = ctx.socket(zmq.PUB)
    busy_pub.setsockopt(zmq.LINGER, 0)
    try:
        busy = EventSource(
            worker_id="busy",
            endpoint=f"tcp://127.0.0.1:{busy_pub.bind_to_random_port('tcp://127.0.0.1')}",
            replay_endpoint=replays.endpoint,
        )
        config = msgspec.structs.replace(
            FAST,
            quiet_interval=2.0,
            max_concurrent_replays=1,
            replay_timeout=30.0,
            replay_slice=30.0,
            native_receive=native,
        )
        async with EventPublisher() as pub:
            pub.publish([_event(1)])
            quiet = pub.source("quiet")
            async with KvEventClient([quiet], config=config) as client:
                await client.wait_synced(20)

                def counts() -> tuple[int, int]:
                    st = client.stats().sources[quiet.key]
                    return st.probes, st.probes_deferred

                assert client.add_source(busy)
                await until(lambda: replays.peak >= 1, seconds=10)  # the only slot is taken
                probes, deferred = counts()
                await until(lambda: counts()[1] > deferred, seconds=10)  # a tick was deferred
                assert counts()[0] == probes
                replays.release()
                # Well within the quiet interval the deferral left: the freed slot was offered.
                await until(lambda: counts()[0] > probes, seconds=1.0)
    finally:
        replays.close()
        busy_pub.close(0)
        ctx.term()


async def test_a_cold_fleet_replays_through_all_its_slots_at_once() -> None:
    # 24 sources start cold, each asking the one replay endpoint, which answers none until
    # 16 requests wait at once. With 24 slots they all run together (through the default 8,
    # 8 would be the most ever waiting and the endpoint would answer only after 15 s).
    # No slice yields and no timeouts here: only the slots bound how many run at once.
    n = 24
    replays = _HeldReplays(want=16)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pubs = []
    try:
        sources = []
        for i in range(n):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            pubs.append(pub)
            sources.append(
                EventSource(worker_id=f"w{i}", endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=replays.endpoint)
            )
        config = msgspec.structs.replace(
            FAST, replay_timeout=30.0, replay_slice=30.0, quiet_interval=30.0, max_concurrent_replays=n
        )
        async with KvEventClient(sources, config=config) as client:
            await client.wait_synced(30)
            assert replays.peak >= 16
            assert client.stats().totals.replay_failures == 0
    finally:
        replays.close()
        for pub in pubs:
            pub.close(0)
        ctx.term()


@pytest.mark.parametrize("native", [False, True], ids=["python-receiver", "native-receiver"])
async def test_replay_answers_are_applied_as_raw_payloads_by_the_machines_rules(native: bool) -> None:
    # Replay answers are judged by the core's verdict and applied by the raw-bytes ingest, no
    # batch object per event (nobody listens); the recovery rules decide as before.
    toks = list(range(16))
    async with EventPublisher() as pub:
        # In the engine's buffer before the client exists (their live copies reach nobody): the
        # cold sync replays both. Seq 1 holds a store kvroute cannot use: skipped and counted,
        # the rest of its batch applied.
        pub.publish([BlockStored(block_hashes=[1, 2], token_ids=toks[:8], block_size=4)])
        unusable = BlockStored(block_hashes=[5], token_ids=toks[:4], block_size=0)
        pub.publish([unusable, BlockStored(block_hashes=[7], token_ids=toks[12:16], block_size=4)])
        src = pub.source("w")
        key: WorkerKey = src.key
        config = msgspec.structs.replace(FAST, native_receive=native)
        async with KvEventClient([src], config=config) as client:
            await client.wait_synced(10)
            await until(lambda: client.stats().sources[key].last_seq == 1)
            driver = client._subs[key].driver  # type: ignore[attr-defined]
            assert isinstance(driver, SourceDriver)
            assert driver._decoder.skipped_events == {"block-size": 1}
            assert client.index.find_matches([*toks[:8], 0])[key] == 2
            assert client.index.find_matches([*toks[12:16], 0])[key] == 1
            # Seq 2 holds an unreadable removal, live and replayed: the replayed copy (judged on
            # the new path) is untrusted too, so the worker is reset (rule 3, then rule 5), never
            # left claiming blocks the engine may have dropped; seq 3 follows from a new history.
            bad = BlockRemoved(block_hashes=[1.5])  # type: ignore[list-item]
            pub.publish([BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=toks[8:12], block_size=4), bad])
            pub.publish([BlockStored(block_hashes=[9], token_ids=toks[8:12], block_size=4)])
            await until(lambda: client.stats().sources[key].last_seq == 3)
            st = client.stats().sources[key]
            assert st.resets == 1 and st.uncovered == 1 and st.partial and st.undecodable >= 1
            assert st.replayed_batches >= 4
            assert key not in client.index.find_matches([*toks[:8], 0])  # what seqs 0-1 stored is gone
            assert key not in client.index.find_matches([*toks[12:16], 0])
            assert client.index.find_matches([*toks[8:12], 0])[key] == 1  # seq 3
            assert client.index.num_blocks(key) == 1
