"""KvEventClient end to end over loopback sockets: every recovery case ends with the index checked against truth."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.lowlevel
import msgspec
import pytest
import zmq
from _publisher_helpers import (
    FAST,
    Workload,
    assert_index_equal,
    assert_index_subset,
    following_live,
    next_event,
    settle,
    truth_index,
    wait_for,
)

from kvroute._client import KvEventClient
from kvroute._discovery import DiscoveryOptions
from kvroute._events import Overflow, Removed, Reset
from kvroute._index import PrefixIndex
from kvroute._models import EventSource, WorkerKey
from kvroute._transports.zmq import sockets as _zmq
from kvroute._wire import BlockRemoved, BlockStored, EventBatch, encode_batch
from kvroute.sim._grpc import VllmControlService, serve_grpc
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _last(pub: EventPublisher) -> int:
    return pub.next_seq - 1


@contextlib.asynccontextmanager
async def _publishers(ctx: zmq.Context[zmq.Socket[bytes]], n: int) -> AsyncIterator[list[EventPublisher]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(EventPublisher(context=ctx)) for _ in range(n)]


@pytest.mark.parametrize(
    ("form", "signed", "layout"), [("map", False, "new"), ("array", True, "old")], ids=["new-engine", "old-engine"]
)
async def test_cold_start_with_history(form: str, signed: bool, layout: str) -> None:
    wl = Workload(1)
    async with EventPublisher(form=form, signed_hashes=signed, reply_layout=layout, topic="kv") as pub:  # type: ignore[arg-type]
        for _ in range(40):
            pub.publish(wl.batch())
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            # The hashes reach the stream as the engine meant them (SGLang's int64 folded to uint64).
            want = [h for b in pub.history for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
            assert any(h >= 1 << 63 for h in want)
            delivered: list[object] = []
            with anyio.fail_after(10):
                async for env in stream:
                    if isinstance(env.event, BlockStored):
                        delivered += env.event.block_hashes
                    if len(delivered) >= len(want):
                        break
            assert delivered == want
            await settle(client, stream, {src.key: 39})
            st = client.stats().sources[src.key]
            assert (st.replayed_batches, st.batches, st.partial, st.resets) == (40, 40, False, 0)
            for _ in range(10):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 49})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            status = client.worker_status(src.key)
            assert status is not None and status.synced and not status.partial


async def test_drops_inside_buffer_are_replayed() -> None:
    wl = Workload(2)
    async with EventPublisher(drop_rate=0.25, seed=3) as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await client.wait_synced(10)
            for _ in range(200):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            # Usually found as live gaps; if the burst beat the subscription to the PUB (slow
            # joiner), the quiet probe finds it as a lost tail. Either way replay covers it.
            assert pub.dropped > 0 and st.replayed_batches >= pub.dropped and st.resets == 0 and not st.partial


async def test_drops_past_the_buffer_reset_without_overclaiming() -> None:
    wl = Workload(3)
    async with EventPublisher(buffer_steps=8) as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(20):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 19})
            pub.drop_rate = 1.0
            for _ in range(30):
                pub.publish(wl.batch())
            pub.drop_rate = 0.0
            for _ in range(5):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: _last(pub)})
            st = client.stats().sources[src.key]
            assert st.resets >= 1 and st.partial
            truth = truth_index({src.key: pub})
            assert_index_subset(client.index, truth, wl.probes)
            # The lost stretch made the index strictly smaller than the truth.
            assert client.index.num_blocks(src.key) < truth.num_blocks(src.key)


async def test_restart_with_seq_reset() -> None:
    wl = Workload(4)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(20):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 19})
            pub.restart()
            wl = Workload(40)  # the new process's cache starts empty
            reset = await next_event(stream, "reset")
            assert isinstance(reset.event, Reset) and reset.event.reason == "restart"
            for _ in range(10):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 9})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            assert client.stats().sources[src.key].resets >= 1


async def test_killed_and_restarted_on_the_same_port_silently() -> None:
    # The new process publishes past the old one's last seq before the SUB reconnects, so no
    # seq ever goes back: only the identity check on reconnect can tell (docs/recovery.md rule 7).
    wl = Workload(5)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(10):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 9})
            pub.restart()
            wl = Workload(50)
            for _ in range(25):
                pub.publish(wl.batch())
            await next_event(stream, "reset")
            for _ in range(3):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


async def test_restart_while_the_subscriber_is_stalled() -> None:
    # The dead engine's messages sit unread in the SUB's queue ahead of the new engine's.
    wl = Workload(6)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(10):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 9})
            # From here to the next await nothing in this process reads: a stalled router.
            for _ in range(30):
                pub.publish(wl.batch())
            pub.restart()
            wl = Workload(60)
            time.sleep(0.3)  # noqa: ASYNC251 (deliberately stalls the event loop; libzmq reconnects meanwhile)
            for _ in range(12):
                pub.publish(wl.batch())
            time.sleep(0.1)  # noqa: ASYNC251 (let libzmq deliver them behind the dead engine's)
            await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            assert client.stats().sources[src.key].resets >= 1


async def test_slow_subscriber_past_hwm() -> None:
    wl = Workload(7, block_size=64)
    async with EventPublisher(hwm=20, sndbuf=4096) as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await client.wait_synced(10)
            # ~1.5 KB a batch, 400 in one burst that nothing reads: past both high-water
            # marks and the (small) kernel buffers, the PUB drops.
            for _ in range(400):
                pub.publish(wl.batch(max_blocks=8))
            await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert st.messages < 400 and st.replayed_batches >= 400 - st.messages and st.resets == 0


async def test_lost_tail_then_silence() -> None:
    wl = Workload(8)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(5):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 4})
            pub.drop_rate = 1.0
            for _ in range(4):
                pub.publish(wl.batch())
            # No later message shows a gap: only the quiet-tick probe finds these.
            await settle(client, stream, {src.key: 8})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            assert client.stats().sources[src.key].gaps == 0


async def test_dead_replay_endpoint() -> None:
    wl = Workload(9)
    async with EventPublisher() as pub:
        for _ in range(10):
            pub.publish(wl.batch())
        pub.kill_replay()
        src = pub.source("w", replay_endpoint=pub.replay_endpoint)
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await next_event(stream, "connected")
            await anyio.sleep(0.5)  # past the replay timeout: the cold start gives up
            for _ in range(5):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: _last(pub)})
            st = client.stats().sources[src.key]
            assert st.partial and st.replays >= 1
            assert_index_subset(client.index, truth_index({src.key: pub}), wl.probes)
            assert client.index.num_blocks(src.key) > 0


async def test_corrupt_payloads_and_wrong_frame_counts() -> None:
    wl = Workload(10)
    async with EventPublisher(corrupt_rate=0.2, seed=4, topic="kv") as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await client.wait_synced(10)
            await following_live(client, pub, src.key, wl)
            for i in range(60):
                pub.publish(wl.batch())
                if i % 20 == 0:
                    pub.publish_raw([b"kv"])
                    pub.publish_raw([b"kv", b"\x00\x01", b"\x90"])
                    pub.publish_raw([b"kv", b"", b"", b""])
            await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            # Live copies that arrived while a replay was in flight are read after it: their
            # verdicts may come after the replay has caught the source up.
            await wait_for(
                lambda: client.stats().sources[src.key].decode_errors >= pub.corrupted, "every live copy read"
            )
            st = client.stats().sources[src.key]
            assert st.decode_errors == pub.corrupted > 0
            assert st.skipped_frames == 9
            assert st.resets == 0


async def test_sixty_four_sources(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    workloads = [Workload(100 + i) for i in range(64)]
    async with _publishers(ctx, 64) as pubs:
        sources = [p.source(f"w{i // 2}", dp_rank=i % 2) for i, p in enumerate(pubs)]
        for p, wl in zip(pubs, workloads):
            for _ in range(3):
                p.publish(wl.batch())
        async with KvEventClient(sources, config=FAST, context=ctx) as client:
            stream = client.events()
            await settle(client, stream, {s.key: 2 for s in sources})
            for p, wl in zip(pubs, workloads):
                for _ in range(3):
                    p.publish(wl.batch())
            await settle(client, stream, {s.key: 5 for s in sources})
            truth = truth_index({s.key: p for s, p in zip(sources, pubs)})
            assert_index_equal(client.index, truth, [q for wl in workloads for q in wl.queries])
            assert client.live_workers() == {s.key for s in sources}
            assert client.stats().totals.synced == 64


async def test_clean_shutdown_mid_replay(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    wl = Workload(11)
    async with EventPublisher(context=ctx, buffer_steps=20_000) as pub:
        for _ in range(20_000):
            pub.publish(wl.batch())
        src = pub.source("w")
        # A replay timeout the test never reaches: nothing is applied before the end marker.
        cfg = msgspec.structs.replace(FAST, replay_timeout=60.0)
        with anyio.fail_after(10):
            async with KvEventClient([src], config=cfg, context=ctx) as client:
                stream = client.events()
                await wait_for(lambda: client.stats().sources[src.key].replays >= 1, "the cold replay is asked")
                st = client.stats().sources[src.key]
                # 20,000 replies take far longer than the few ms since the request went out.
                assert st.replays == 1 and st.batches == 0 and st.state == "syncing", st
        # Every socket the client opened is closed (the publisher's two are still open).
        open_sockets = [s for s in ctx._sockets if not s.closed]
        assert len(open_sockets) == 2
        with anyio.fail_after(1):
            rest = [e async for e in stream]  # the stream ended instead of waiting forever
        assert all(e.seq is None for e in rest)  # lifecycle events only: no batch was applied


async def test_iterators_and_overflow() -> None:
    wl = Workload(12)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            small = client.events(buffer=4)
            big = client.events()
            watch = client.events()
            async with client.events() as closed_early:
                pass
            await client.wait_synced(10)
            for _ in range(30):
                pub.publish(wl.batch())
            await settle(client, watch, {src.key: 29})
            dropped = small.dropped
            assert dropped > 0 and client.stats().events_dropped == dropped
        got_small = [e async for e in small]
        got_big = [e async for e in big]
        assert [e async for e in closed_early] == []
    first = got_small[0].event
    assert isinstance(first, Overflow) and first.dropped == dropped
    assert len(got_small) == 5
    seqs = [e.seq for e in got_big if e.seq is not None]
    assert seqs == sorted(seqs) and set(seqs) == set(range(30))
    engine = [e for e in got_big if e.seq is not None]
    assert sum(isinstance(e.event, BlockStored) for e in engine) == 30


async def test_add_and_remove_sources_at_runtime() -> None:
    wa, wb = Workload(13), Workload(14)
    async with EventPublisher() as pa, EventPublisher() as pb:
        a, b = pa.source("a"), pb.source("b")
        for _ in range(5):
            pa.publish(wa.batch())
            pb.publish(wb.batch())
        async with KvEventClient([a], config=FAST) as client:
            stream = client.events()
            await settle(client, stream, {a.key: 4})
            assert client.add_source(b)
            await settle(client, stream, {a.key: 4, b.key: 4})
            assert client.index.workers() == {a.key, b.key}
            assert_index_equal(client.index, truth_index({a.key: pa, b.key: pb}), wa.queries + wb.queries)
            assert client.remove_source(b.key)
            assert not client.remove_source(b.key)
            env = await next_event(stream, "removed")
            assert env.source == b and isinstance(env.event, Removed) and env.event.reason == "removed"
            assert client.index.workers() == {a.key}
            assert client.live_workers() == {a.key} and client.worker_status(b.key) is None
            # Its blocks are gone, not just hidden; adding it back rebuilds them by replay.
            assert client.index.num_blocks(b.key) == 0
            assert client.add_source(b)
            await settle(client, stream, {a.key: 4, b.key: 4})
            assert_index_equal(client.index, truth_index({a.key: pa, b.key: pb}), wa.queries + wb.queries)
            assert client.stats().removed_sources == 1


async def test_source_cap_refuses_extra_sources() -> None:
    cfg = msgspec.structs.replace(FAST, max_sources=1)
    async with EventPublisher() as pa, EventPublisher() as pb, KvEventClient([pa.source("a")], config=cfg) as client:
        assert not client.add_source(pb.source("b"))
        assert client.add_source(pa.source("a"))  # the same source again is a no-op
        stats = client.stats()
        assert stats.refused_sources == 1 and set(stats.sources) == {WorkerKey("a", 0)}


async def test_wait_synced_times_out() -> None:
    # No quiet probe: one still out when replay is muted would be the request ignored instead.
    cfg = msgspec.structs.replace(FAST, replay_timeout=5.0, quiet_interval=60.0)
    async with EventPublisher() as pub:
        pub.kill_replay()
        src = pub.source("w", replay_endpoint=pub.replay_endpoint)
        async with KvEventClient([src], config=cfg) as client:
            with pytest.raises(TimeoutError):
                await client.wait_synced(0.3)
            status = client.worker_status(src.key)
            assert status is not None and status.state == "syncing"


async def test_curve_end_to_end() -> None:
    server, mine = _zmq.curve_keypair(), _zmq.curve_keypair()
    cfg = msgspec.structs.replace(FAST, curve_public_key=mine.public, curve_secret_key=mine.secret)
    wl = Workload(15)
    async with EventPublisher(curve=server) as pub:
        src = pub.source("w")
        for _ in range(5):
            pub.publish(wl.batch())
        async with KvEventClient([src], config=cfg) as client:
            stream = client.events()
            await settle(client, stream, {src.key: 4})
            pub.publish(wl.batch())
            await settle(client, stream, {src.key: 5})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


async def test_discovery_targets() -> None:
    wa, wb = Workload(16), Workload(17)
    async with EventPublisher() as pa, EventPublisher(data_parallel_rank=1) as pb:
        advertised: list[EventSource] = []
        service = VllmControlService(lambda: advertised)
        async with serve_grpc([service]) as server:
            target = server.target
            advertised[:] = [pa.source(target, engine="vllm"), pb.source(target, engine="vllm")]
            keys = [WorkerKey(target, 0), WorkerKey(target, 1)]
            for _ in range(3):
                pa.publish(wa.batch())
                pb.publish(wb.batch())
            async with KvEventClient(
                targets=[target],
                config=FAST,
                discovery_interval=0.1,
                discovery_grace=0.3,
                discovery_options=DiscoveryOptions(timeout=1.0),
            ) as client:
                stream = client.events()
                await client.wait_synced(10)
                await settle(client, stream, {keys[0]: 2, keys[1]: 2})
                assert client.targets() == [target] and client.live_workers() == set(keys)
                # Rank 1 vanishes from discovery: unsubscribed and its blocks removed.
                advertised[:] = advertised[:1]
                env = await next_event(stream, "removed")
                assert env.source.key == keys[1] and env.event == Removed("gone from discovery")
                assert client.index.workers() == {keys[0]}
                # Rank 0 moves to another publisher (a new engine): the old state goes.
                advertised[:] = [pb.source(target, dp_rank=0, engine="vllm")]
                env = await next_event(stream, "removed")
                assert env.event == Removed("replaced")
                await settle(client, stream, {keys[0]: 2})
                assert_index_equal(client.index, truth_index({keys[0]: pb}), wb.queries)
                await server.stop()
                env = await next_event(stream, "removed")
                assert env.event == Removed("unreachable")
                assert client.live_workers() == set() and client.index.workers() == set()
                assert client.remove_target(target) and client.targets() == []


async def test_inproc_source_syncs_without_a_handshake(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    wl = Workload(18)
    async with EventPublisher(
        context=ctx, endpoint="inproc://kv-test", replay_endpoint="inproc://kv-test-replay"
    ) as pub:
        src = pub.source("w")
        for _ in range(4):
            pub.publish(wl.batch())
        async with KvEventClient([src], config=FAST, context=ctx) as client:
            stream = client.events()
            await settle(client, stream, {src.key: 3})
            pub.publish(wl.batch())
            await settle(client, stream, {src.key: 4})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


class _BrokenIndex(PrefixIndex):
    """An index that cannot take one worker's batches."""

    def apply_batch(self, worker: WorkerKey, batch: EventBatch) -> None:
        if worker.worker_id == "bad":
            raise RuntimeError("index refuses")
        super().apply_batch(worker, batch)


async def test_a_failing_source_is_removed_and_the_rest_carry_on() -> None:
    wl, wb = Workload(19), Workload(21)
    async with EventPublisher() as pa, EventPublisher() as pb:
        good, bad = pa.source("good"), pb.source("bad")
        for _ in range(3):
            pa.publish(wl.batch())
            pb.publish(wb.batch())
        async with KvEventClient([good, bad], config=FAST, index=_BrokenIndex()) as client:
            stream = client.events()
            env = await next_event(stream, "removed")
            assert env.source == bad and env.event == Removed("failed: RuntimeError")
            await settle(client, stream, {good.key: 2})
            assert client.live_workers() == {good.key}
            assert client.stats().failed_sources == 1
            assert_index_equal(client.index, truth_index({good.key: pa}), wl.queries)


async def test_a_replay_made_moot_by_a_disconnect_is_not_waited_for() -> None:
    # The gap's replay is swallowed; the engine then restarts. Waiting out the 5 s replay
    # timeout would hold the new engine's state back: the driver drops the request at once.
    # No quiet probe: one still out when replay is muted would be the request ignored instead.
    # The gap must reach the SUB live: "synced" says the SUB connected, not that the PUB has its
    # subscription yet (a slow joiner, docs/recovery.md rule 8), and with quiet ticks off a batch
    # the PUB sent before it would show no gap at all (1 run in 30 so under CPU hogs, native thread).
    cfg = msgspec.structs.replace(FAST, replay_timeout=5.0, quiet_interval=60.0)
    wl = Workload(22)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=cfg) as client:
            stream = client.events()
            for _ in range(5):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 4})
            await following_live(client, pub, src.key, wl)
            await settle(client, stream, {src.key: _last(pub)})
            pub.replay_mute = True
            pub.drop_rate = 1.0
            pub.publish(wl.batch())
            pub.drop_rate = 0.0
            pub.publish(wl.batch())
            await next_event(stream, "gap")
            await wait_for(lambda: pub.replays_ignored >= 1, "the gap's request reached the muted endpoint")
            assert pub.replays_ignored == 1
            pub.replay_mute = False
            pub.restart()
            wl = Workload(23)
            for _ in range(3):
                pub.publish(wl.batch())
            with anyio.fail_after(3):
                await settle(client, stream, {src.key: _last(pub)})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


async def test_a_removed_source_touches_the_index_no_more() -> None:
    # The driver is woken with messages queued, then its source is removed before it runs:
    # on asyncio the woken driver resumes from its await and reaches the apply before any
    # checkpoint, so only its own stopped check keeps the messages out of the index. (On trio a
    # task cancelled while scheduled raises at that very await, so the race cannot occur there;
    # the test runs there too, for the rest of what it checks.)
    wl = Workload(24)
    async with EventPublisher() as pub, KvEventClient([], config=FAST) as client:
        src = pub.source("w")
        assert client.add_source(src)

        def applying() -> bool:
            if client.index.num_blocks(src.key) > 0:
                return True
            pub.publish(wl.batch())  # until the SUB has joined and the driver applies
            return False

        await wait_for(applying, "the source applies")
        for _ in range(20):
            pub.publish(wl.batch())
        time.sleep(0.1)  # noqa: ASYNC251 (blocks the loop: the SUB's queue fills, its FD turns readable)
        # Two rounds of the loop: the FD's callback runs, then the driver's step is due.
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        assert client.remove_source(src)
        await anyio.wait_all_tasks_blocked()  # the driver ran whatever it was due to run
        assert client.index.workers() == set() and client.index.num_blocks() == 0


async def test_clear_drops_everything_the_engine_held() -> None:
    # reset_prefix_cache: the engine drops its whole cache and says so with AllBlocksCleared.
    wl = Workload(25)
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            for _ in range(15):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 14})
            before = client.index.num_blocks(src.key)
            pub.publish(wl.clear())
            for _ in range(3):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: _last(pub)})
            truth = truth_index({src.key: pub})
            assert 0 < truth.num_blocks(src.key) < before
            assert_index_equal(client.index, truth, wl.queries)


def _forward(ctx: zmq.Context[zmq.Socket[bytes]], upstream: str, xpub: zmq.Socket[bytes]) -> None:
    """A PUB/SUB forwarder (as a fan-out proxy runs): XSUB connected upstream, ``xpub`` downstream."""
    xsub = ctx.socket(zmq.XSUB)
    xsub.linger = 0
    xsub.connect(upstream)
    try:
        zmq.proxy(xsub, xpub)
    except zmq.ContextTerminated:
        pass
    finally:
        xsub.close()
        xpub.close()


async def test_a_restart_behind_a_forwarder_is_told_from_duplicates_by_its_ts() -> None:
    # Behind a forwarder the SUB never disconnects, so no identity check runs: the new
    # process's seqs 0.. arrive live, equal to seqs already applied, and only their ts tells
    # them from duplicates (rule 2). Taken as duplicates, the old blocks would stay claimed.
    wl = Workload(26)
    fwd_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    async with EventPublisher() as pub:
        xpub = fwd_ctx.socket(zmq.XPUB)
        xpub.linger = 0
        port = xpub.bind_to_random_port("tcp://127.0.0.1")
        thread = threading.Thread(target=_forward, args=(fwd_ctx, pub.endpoint, xpub), daemon=True)
        thread.start()
        try:
            src = msgspec.structs.replace(pub.source("w"), endpoint=f"tcp://127.0.0.1:{port}")
            async with KvEventClient([src], config=FAST) as client:
                stream = client.events()
                with anyio.fail_after(10):
                    while client.stats().sources[src.key].batches < 10:  # until the chain is joined
                        pub.publish(wl.batch())
                        await anyio.sleep(0.02)
                # A long old run: the new process's seqs must reach the client while they are
                # still below its end (a first seq past it would look like a plain gap).
                while _last(pub) < 400:
                    pub.publish(wl.batch())
                await settle(client, stream, {src.key: _last(pub)})
                old_last = _last(pub)
                pub.restart()
                wl = Workload(27)
                with anyio.fail_after(20):
                    # The forwarder's XSUB rejoins the new PUB; publish until the client saw the restart.
                    while client.stats().sources[src.key].resets == 0:
                        assert _last(pub) < old_last, "the forwarder took too long to rejoin"
                        pub.publish(wl.batch())
                        await anyio.sleep(0.03)
                while _last(pub) <= old_last + 3:  # past the old run, so seqs alone look fine
                    pub.publish(wl.batch())
                await settle(client, stream, {src.key: _last(pub)})
                assert client.stats().sources[src.key].connected
                assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
        finally:
            await anyio.to_thread.run_sync(fwd_ctx.term)
            thread.join(5)


async def test_a_removal_from_another_tier_leaves_the_gpu_block_claimed() -> None:
    # The engine's medium reaches the index as sent: a removal of a block's CPU copy (none was stored) is an
    # unknown removal and the GPU copy stays claimed, over real sockets and the compiled decoder.
    tokens = list(range(32))
    async with EventPublisher() as pub:
        pub.publish_batch(EventBatch(1.0, [BlockStored(block_hashes=[10, 11], token_ids=tokens, block_size=16)]))
        pub.publish_batch(EventBatch(2.0, [BlockRemoved(block_hashes=[10], medium="CPU")]))
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            await client.wait_synced(10)
            assert client.stats().sources[src.key].last_seq == 1
            assert dict(client.index.find_matches([*tokens, 1]).items()) == {src.key: 2}
            assert client.index.stats().unknown_removals == 1


async def test_vllm_removals_byte_for_byte_drop_exactly_their_blocks() -> None:
    # A full vLLM (0.33 / 0.34) evicts a block for each one it stores: one removal a block, written as its block
    # pool writes it (one uint64 hash, medium "GPU", group_idx), which the compiled decoder reads by its fixed
    # bytes. Over real sockets, exactly the blocks removed stop being claimed, and no removal goes unknown.
    tokens = list(range(64))
    hashes = [(0x9E37_79B9 << 32) + i for i in range(4)]
    removal = EventBatch(2.0, [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in hashes[2:]])
    vllm_bytes = b"\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf"
    assert encode_batch(removal).count(vllm_bytes) == 2, "the removals are no longer vLLM's bytes"
    async with EventPublisher() as pub:
        stored = BlockStored(block_hashes=hashes, token_ids=tokens, block_size=16, medium="GPU", group_idx=0)
        pub.publish_batch(EventBatch(1.0, [stored]))
        pub.publish_batch(removal)
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            await client.wait_synced(10)
            assert client.stats().sources[src.key].last_seq == 1
            assert dict(client.index.find_matches([*tokens, 1]).items()) == {src.key: 2}
            assert client.index.num_blocks(src.key) == 2
            assert client.index.stats().unknown_removals == 0
