"""A fleet that misbehaves: hostile or broken publishers beside honest engines, on real sockets.

Each case drives one kind of trouble at a running `KvEventClient` and asserts two things: the
outcome the bound promises (README "Security and limits"), and that the honest engines' index
stays exact throughout, compared with the simulated engines' own caches (`kvroute.sim.PrefixCache`),
not with anything kvroute computed.
"""

from __future__ import annotations

import math
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import msgspec
import pytest
import zmq
from _publisher_helpers import FAST, needs_ipv6, served

from kvroute import KvEventClient, PrefixIndex, SubscriberConfig, WorkerKey
from kvroute._models import EventSource
from kvroute._snapshot import Cursor
from kvroute._wire import BlockRemoved, BlockStored, EventBatch, encode_batch
from kvroute.sim import PrefixCache
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio

MiB = 1 << 20
BLOCK = 4
# The receiver as FAST's (the native thread; ``KVROUTE_TEST_RECEIVER=python`` runs these fleet tests on the Python one).
FLEET = SubscriberConfig(
    reconnect_ivl=0.02,
    reconnect_ivl_max=0.1,
    replay_timeout=0.5,
    quiet_interval=60.0,
    native_receive=FAST.native_receive,
)


class Honest:
    """An honest engine rank: a `PrefixCache` serving requests, publishing what it stores and evicts."""

    def __init__(self, seed: int, **publisher: object) -> None:
        self.rng = random.Random(seed)
        self.cache = PrefixCache(capacity_blocks=256, block_size=BLOCK)
        self.pub = EventPublisher(**publisher)  # type: ignore[arg-type]
        self.stems = [[self.rng.randrange(50_000) for _ in range(8 * BLOCK)] for _ in range(6)]
        self.prompts: list[list[int]] = []
        self._n = 0

    async def __aenter__(self) -> Honest:
        await self.pub.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pub.__aexit__(None, None, None)

    def source(self, name: str, **overrides: object) -> EventSource:
        return self.pub.source(name, **overrides)

    def step(self) -> None:
        """One request through the cache; its events (if any) published as one batch."""
        stem = self.rng.choice(self.stems)
        prompt = stem[: self.rng.randrange(1, len(stem))] + [self.rng.randrange(50_000) for _ in range(3 * BLOCK)]
        self._n += 1
        if self.cache.admit(self._n, prompt, max_tokens=0) is None:
            return
        self.cache.computed(self._n, prompt)
        self.cache.release(self._n)
        self.prompts.append(prompt)
        events = self.cache.drain_events()
        if events:
            self.pub.publish(events)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def exact(self, index: PrefixIndex, key: WorkerKey) -> bool:
        """The index holds exactly this engine's cache: block count and every prompt's match."""
        if index.num_blocks(key) != self.cache.num_cached_blocks:
            return False
        for prompt in self.prompts[-40:] + self.stems:
            if index.find_matches(prompt).get(key, 0) != served(self.cache, prompt):
                return False
        return True

    def within(self, index: PrefixIndex, key: WorkerKey) -> bool:
        """The index claims nothing this engine does not hold (a partial worker's guarantee)."""
        if index.num_blocks(key) > self.cache.num_cached_blocks:
            return False
        return all(
            index.find_matches(p).get(key, 0) <= self.cache.match_blocks(p) for p in self.prompts[-40:] + self.stems
        )

    def assert_exact(self, index: PrefixIndex, key: WorkerKey) -> None:
        assert index.num_blocks(key) == self.cache.num_cached_blocks, key
        for prompt in self.prompts[-40:] + self.stems:
            assert index.find_matches(prompt).get(key, 0) == served(self.cache, prompt), key


async def until(check: Callable[[], bool], limit: float = 20.0) -> float:
    """Seconds until ``check()`` holds, looking every 5 ms; fails the test after ``limit``."""
    start = time.perf_counter()
    with anyio.fail_after(limit):
        while not check():  # noqa: ASYNC110 (a condition on counters, not an event)
            await anyio.sleep(0.005)
    return time.perf_counter() - start


def _all_live(client: KvEventClient, honest: Honest) -> bool:
    """Whether every source took a live message yet; if not, ``honest`` takes one more step (for `until`).

    A synced source is not yet subscribed (a slow joiner: its subscription may reach the PUB
    later), and with FLEET's quiet probes off a tail the PUB dropped would stay lost: a test
    waiting for the exact state after some steps first steps until every SUB is taking them.
    """
    if all(st.messages > 0 for st in client.stats().sources.values()):
        return True
    honest.step()
    return False


def _seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _valid_payload(ts: float = 1.0, blocks: int = 1, tokens_per_block: int = BLOCK) -> bytes:
    # Stored and removed in the same batch: valid, and it leaves nothing in the index.
    hashes = list(range(10**12, 10**12 + blocks))
    ev_store = BlockStored(
        block_hashes=hashes, token_ids=[7] * (blocks * tokens_per_block), block_size=tokens_per_block
    )
    return encode_batch(EventBatch(ts=ts, events=[ev_store, BlockRemoved(block_hashes=hashes)]))


class BadEngine:
    """A publisher whose PUB sends nothing (or a flood) and whose ROUTER answers badly.

    ``replay``: "drip" sends one valid reply every ``drip`` seconds and never the end marker;
    "junk" sends a malformed frame every 20 ms; "silent" never answers.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], replay: str = "drip", drip: float = 0.5) -> None:
        self.ctx = ctx
        self.replay = replay
        self.drip = drip
        self.pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.requests = 0

    def source(self, name: str, **overrides: object) -> EventSource:
        fields: dict[str, object] = {
            "worker_id": name,
            "endpoint": f"tcp://127.0.0.1:{self.pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.router_port}",
        }
        fields.update(overrides)
        return EventSource(**fields)  # type: ignore[arg-type]

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        from kvroute._transports.zmq import sockets as _zmq

        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                for frames in await _zmq.recv_many(self.router, 64):
                    self.requests += 1
                    if len(frames) == 3 and len(frames[2]) == 8:
                        tg.start_soon(self._answer, frames[0], int.from_bytes(frames[2], "big"))

    async def _answer(self, ident: bytes, start: int) -> None:
        if self.replay == "silent":
            return
        seq = start
        for _ in range(2_000):  # bounded: ~17 min of drip, ~40 s of junk
            if self.router.closed:
                return
            try:
                if self.replay == "drip":
                    self.router.send_multipart([ident, b"", b"", _seq8(seq), _valid_payload()], zmq.NOBLOCK)
                    seq += 1
                else:
                    self.router.send_multipart([ident, b"junk"], zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            await anyio.sleep(self.drip if self.replay == "drip" else 0.02)

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


@asynccontextmanager
async def bad_fleet(n: int, replay: str, drip: float = 0.5) -> AsyncIterator[list[BadEngine]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    bad = [BadEngine(ctx, replay, drip) for _ in range(n)]
    try:
        async with anyio.create_task_group() as tg:
            for b in bad:
                await tg.start(b.serve)
            yield bad
            tg.cancel_scope.cancel()
    finally:
        for b in bad:
            b.close()
        ctx.term()


# --- row 1: replay endpoints that drip or send junk -----------------------------------------


async def _cold_start(honest: Honest, client: KvEventClient, name: str) -> float:
    src = honest.source(name)
    start = time.perf_counter()
    assert client.add_source(src)
    with anyio.fail_after(30):
        while True:
            st = client.worker_status(src.key)
            if st is not None and st.state == "synced" and honest.exact(client.index, src.key):
                break
            await anyio.sleep(0.002)
    elapsed = time.perf_counter() - start
    honest.assert_exact(client.index, src.key)
    client.remove_source(src)
    return elapsed


async def test_bad_replayers_cannot_starve_an_honest_cold_start() -> None:
    async with Honest(1) as honest:
        honest.steps(3000)  # a replay long enough that scheduling noise does not decide the ratio
        async with (
            bad_fleet(8, "drip", drip=0.1) as bad,
            KvEventClient(config=FLEET) as quiet,
            # 8 slots, so the 8 bad replayers take them all (the default has more).
            KvEventClient(
                [b.source(f"bad{i}") for i, b in enumerate(bad)],
                config=msgspec.structs.replace(FLEET, max_concurrent_replays=8),
            ) as client,
        ):
            # Every slot of `client` taken by a bad replay, for longer than a slice, and kept: each
            # drips a decodable reply every 0.1 s (well inside replay_timeout, so silence never
            # ends a turn; below the productive rate) and never the end marker, and the machine
            # asks again for the rest. Only a turn giving its slot up at its slice lets the honest
            # source in before a dripper's 30 s deadline. (With half of them sending junk, as
            # before, the junk turns failed within replay_timeout and their sources, knowing
            # nothing, asked no more: four slots stayed free and the test passed with every
            # slice hand-over disabled.)
            await until(lambda: all(b.requests for b in bad))
            await anyio.sleep(0.3)
            # Alone (a client of its own) and beside the bad replayers, taken in turns: both under
            # the same machine load, bad fleet included, so only the slots differ. (Measured one
            # side after the other, the load of the moment decided: at load 13-20 "alone" ranged
            # 52-303 ms run to run and the 3x bound failed 2 runs in 6 with no starvation.)
            alone, beside = [], []
            for i in range(5):
                alone.append(await _cold_start(honest, quiet, f"alone{i}"))
                beside.append(await _cold_start(honest, client, f"beside{i}"))
            st = client.stats()
            bad_stats = [st.sources[WorkerKey(f"bad{i}", 0)] for i in range(8)]
        print(
            f"honest cold start: alone {statistics.median(alone) * 1000:.0f} ms, beside 8 bad replayers "
            f"{statistics.median(beside) * 1000:.0f} ms (medians of 5; min {min(alone) * 1000:.0f} / "
            f"{min(beside) * 1000:.0f} ms)"
        )
        # The median of five on each side: starvation by the bad replayers would slow every run,
        # while the machine's other load moves single runs either way. (The best of three let one
        # lucky "alone" run decide: 0.13 s beside 0.40 and 0.35, then 3.1x, at load 15-30.)
        # The aim is 2x; in the full suite on a loaded 2-core machine trio runs have
        # measured up to 2.2x, so the test holds 3x and the figures are printed.
        assert statistics.median(beside) <= 3 * statistics.median(alone), (alone, beside)
        # The bad ones gave their slots up (junk: no decodable reply within replay_timeout;
        # drips: handed over what came at a slice boundary) instead of holding them.
        # The bad ones still got their turns: nothing here starves them either.
        assert all(s.replays >= 1 for s in bad_stats)


async def test_a_replay_ends_at_its_deadline_and_junk_never_keeps_it_open() -> None:
    # replay_timeout 0.6 s, 12 drip intervals: the drips come from this process, and on a loaded
    # machine a stall past 0.3 s ends the turn as silent, not at the deadline (the likely cause of
    # a full-suite run at load 20 that did not see two cutoffs in 10 s with 0.3 s).
    cfg = msgspec.structs.replace(FLEET, replay_deadline=1.0, replay_timeout=0.6)
    async with bad_fleet(2, "junk") as bad:
        bad[1].replay = "drip"
        bad[1].drip = 0.05
        async with KvEventClient([bad[0].source("junk"), bad[1].source("drip")], config=cfg) as client:
            junk, drip = WorkerKey("junk", 0), WorkerKey("drip", 0)
            # Junk every 20 ms: the request still fails after 0.6 s of no decodable reply (the
            # old timeout only ran between replies, so junk kept it open for ever).
            t = await until(lambda: client.stats().sources[junk].replay_failures >= 1, limit=10)
            assert t < 3.0, t
            assert client.stats().sources[junk].skipped_frames > 0
            # Valid drips every 50 ms, never an end marker: cut at the 1 s deadline, applied, asked again.
            await until(lambda: client.stats().sources[drip].replay_cutoffs >= 2, limit=10)
            st = client.stats().sources[drip]
            assert st.batches > 0 and st.replays >= 3
            assert client.index.num_blocks(drip) == 0  # each drip stores and removes its block


async def test_a_dripping_replay_gives_its_one_slot_up_at_the_slice() -> None:
    # One replay slot. A replayer drips a decodable reply every 50 ms (20/s: not "productive"),
    # never the end marker, so neither replay_timeout (each drip renews it) nor the 30 s deadline
    # ends its turn: only giving the slot up at replay_slice lets an honest cold start through.
    cfg = msgspec.structs.replace(
        FLEET, max_concurrent_replays=1, replay_slice=0.1, replay_timeout=5.0, replay_deadline=30.0
    )
    async with Honest(3) as honest, bad_fleet(1, "drip") as (dripper,):
        dripper.drip = 0.05
        honest.steps(300)
        async with KvEventClient([dripper.source("drip")], config=cfg) as client:
            drip = WorkerKey("drip", 0)
            await until(lambda: client.stats().sources[drip].replayed_batches >= 3)  # it holds the slot
            took = await _cold_start(honest, client, "honest")
            # Alone it takes well under a second; the dripper's turn ends at its slice (a waiter
            # wakes it), not at its 30 s deadline.
            assert took < 10.0, took
            assert client.stats().sources[drip].replays >= 1


async def test_a_waiter_that_comes_early_in_a_turn_gets_the_slot_at_its_slice() -> None:
    # One replay slot, held by a replayer that never answers (replay_timeout 5 s). The honest
    # source asks while that turn is a few ms old: no holder is past its slice, so its arrival
    # nudges nobody. The holder must look for waiters at its slice's end by itself; on the
    # native thread it did not, and the honest cold start waited the whole 5 s (CI: 0.5 s
    # beside eight junk replayers whose turns had all just begun, against 30 ms alone).
    cfg = msgspec.structs.replace(
        FLEET, max_concurrent_replays=1, replay_slice=0.1, replay_timeout=5.0, replay_deadline=30.0
    )
    async with Honest(3) as honest, bad_fleet(1, "silent") as (silent,):
        honest.steps(300)
        async with KvEventClient([silent.source("silent")], config=cfg) as client:
            await until(lambda: silent.requests >= 1)  # its turn just began: it holds the slot
            took = await _cold_start(honest, client, "honest")
            assert took < 2.5, took  # a slice (0.1 s) and the honest replay, not the 5 s timeout


async def test_junk_replies_count_against_the_reply_budget() -> None:
    # A replayer answering junk every 20 ms (50/s), never a decodable reply nor the end marker;
    # replay_timeout 30 s, so only the 20-reply budget, junk included, ends the request early.
    cfg = msgspec.structs.replace(FLEET, replay_budget=20, replay_timeout=30.0, replay_deadline=60.0)
    async with bad_fleet(1, "junk") as (junk,), KvEventClient([junk.source("junk")], config=cfg) as client:
        key = WorkerKey("junk", 0)
        t = await until(lambda: client.stats().sources[key].replay_cutoffs >= 1, limit=20)
        st = client.stats().sources[key]
        assert t < 10.0 and st.skipped_frames >= 20, (t, st)


# --- rows 2, 3 and 8: a flood of large valid batches; hwm 0, 2^31-1 and 2^32-1 advertised ----------

# A separate process floods, as fast as a PUB can send: the client's process is measured alone.
_FLOODER = r"""
import sys, time, zmq
from kvroute._wire import BlockRemoved, BlockStored, EventBatch, encode_batch
seconds = float(sys.argv[1])
hashes = list(range(10**12, 10**12 + 1024))
stored = BlockStored(block_hashes=hashes, token_ids=[70_000] * (1024 * 256), block_size=256)
payload = zmq.Frame(encode_batch(EventBatch(ts=1.0, events=[stored, BlockRemoved(block_hashes=hashes)])))
ctx = zmq.Context()
pubs = []
for _ in range(2):
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 64)  # past it the PUB drops: the flooder's own memory stays small
    pub.setsockopt(zmq.LINGER, 0)
    pubs.append((pub, pub.bind_to_random_port("tcp://127.0.0.1")))
print(*[port for _, port in pubs], len(payload.bytes), flush=True)
sys.stdin.readline()  # go
seq, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    # ~2.5 GB/s offered per PUB, far past what any reader decodes; paced so that this process
    # leaves the (shared) CPU to the client it floods.
    for _ in range(64):
        for pub, _ in pubs:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
        seq += 1
    time.sleep(0.03)
print(seq, flush=True)
sys.stdin.readline()
"""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def per_source_bound(cfg: SubscriberConfig) -> int:
    """The worst-case memory of one source, as README "Security and limits" states it."""
    queues = 2 * cfg.queue_bytes + 2 * cfg.max_message_size  # SUB and DEALER: queued, and one being read
    wakeup = cfg.wakeup_bytes + cfg.max_message_size  # one wakeup's raw messages
    decoded = 8 * (cfg.max_message_size + 2 * (cfg.held_bytes + cfg.max_message_size))  # one batch, held, replay
    return queues + wakeup + decoded


@pytest.mark.parametrize("native", [False, True], ids=["python-receiver", "native-receiver"])
async def test_a_flood_of_large_batches_stays_in_its_memory_bound_and_never_stalls_the_loop(
    anyio_backend: str, native: bool
) -> None:
    if anyio_backend == "trio":
        pytest.skip("one backend is enough for a 6 s flood; the pump code is the same")

    # A loaded machine must not fail the drip. Both receivers: the Python one's pump (its
    # wakeup budget, below) and the native thread keep the same bounds.
    cfg = msgspec.structs.replace(FLEET, replay_timeout=2.0, native_receive=native)
    # Plain Popen: the flooder's lines are read before the client starts, and written in one call.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", _FLOODER, "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port0, port1, size = map(int, proc.stdout.readline().split())
        assert size > MiB
        async with Honest(3) as honest, bad_fleet(1, "drip") as (drip,):
            drip.drip = 0.1  # well inside replay_timeout: the cold replay stays open, never complete
            honest.steps(50)
            h = honest.source("honest")
            # hwm 0 (libzmq's "unlimited") and 2^31-1; the drip replay keeps the second one's
            # live batches held (cold replay never ends) until held_bytes is passed.
            floods = [
                EventSource(worker_id="flood0", endpoint=f"tcp://127.0.0.1:{port0}", hwm=0),
                EventSource(
                    worker_id="flood1",
                    endpoint=f"tcp://127.0.0.1:{port1}",
                    replay_endpoint=drip.source("x").replay_endpoint,
                    hwm=2**31 - 1,
                ),
            ]
            lags: list[float] = []
            cpu_lags: list[float] = []

            async def ticker() -> None:
                # Wall-clock lag includes the OS starving this process on a loaded machine; the
                # loop thread's CPU time between two ticks is the work that held the loop.
                while True:
                    t, c = time.perf_counter(), time.thread_time()
                    await anyio.sleep(0.005)
                    lags.append(time.perf_counter() - t - 0.005)
                    cpu_lags.append(time.thread_time() - c)

            base = _rss()
            peak = base
            async with KvEventClient([h, *floods], config=cfg) as client:
                await until(lambda: honest.exact(client.index, h.key) and client.worker_status(h.key).state == "synced")  # type: ignore[union-attr]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker)
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                    end = time.monotonic() + 5.5
                    while time.monotonic() < end:
                        honest.steps(5)
                        await until(lambda: honest.exact(client.index, h.key), limit=10)
                        peak = max(peak, _rss())
                        await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()
                st = client.stats()
                exit_start = time.perf_counter()
            exit_seconds = time.perf_counter() - exit_start
        lags.sort()
        cpu_lags.sort()
        p99, cpu_p99 = lags[int(len(lags) * 0.99)], cpu_lags[int(len(cpu_lags) * 0.99)]
        bound = 2 * per_source_bound(cfg)
        print(
            f"flood: RSS +{(peak - base) / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB for 2 flooded sources), "
            f"loop lag p99 {p99 * 1000:.1f} ms wall, {cpu_p99 * 1000:.1f} ms of loop-thread CPU, {len(lags)} ticks, "
            f"exit {exit_seconds * 1000:.0f} ms, messages {st.totals.messages}, overflows {st.totals.overflows}"
        )
        assert peak - base <= bound
        assert exit_seconds < 1.0
        # The pump yields between batches every 10 ms of work; one worst-case 1.3 MB batch (262k
        # tokens) costs ~30 ms to decode and index on a quiet machine (~100 ms at load 11), two
        # flooded sources take turns, and an overflow applies the held batches (<= held_bytes)
        # in one go. The aim is 50 ms; this bound only catches a pump that never yields (the
        # old one blocked the loop for 21 s).
        assert cpu_p99 < 1.5
        f0, f1 = st.sources[WorkerKey("flood0", 0)], st.sources[WorkerKey("flood1", 0)]
        # The Python pump cuts a wakeup at its byte budget (`wakeups_cut`); the thread reads
        # outside the loop and counts no such cut.
        assert f0.messages > 0 and (native or f0.wakeups_cut > 0)
        if native:
            # A source whose replay is in flight is parked: its live batches wait unread in
            # libzmq's and the engine's queues, never held (docs/architecture.md, "Parking").
            assert f1.overflows == 0
        else:
            assert f1.overflows >= 1  # held past held_bytes: the uncovered-gap path, counted
    finally:
        proc.kill()
        proc.wait()


# --- row 9: a batch with ts = NaN; row 10 (client side): a bad restored position ------------


async def test_a_nan_ts_is_undecodable_and_never_reaches_a_snapshot(tmp_path: Path) -> None:
    cfg = msgspec.structs.replace(FLEET, quiet_interval=0.2)
    async with Honest(4) as honest, Honest(5) as broken:
        honest.steps(20)
        broken.steps(20)
        h, b = honest.source("honest"), broken.source("broken")
        async with KvEventClient([h, b], config=cfg) as client:
            await until(lambda: honest.exact(client.index, h.key) and broken.exact(client.index, b.key))
            broken.pub.publish(broken.cache.drain_events(), ts=math.nan)  # an empty step, NaN ts
            broken.steps(5)
            honest.steps(5)
            await until(lambda: client.stats().sources[b.key].decode_errors >= 1)
            await until(lambda: honest.exact(client.index, h.key))
            # Its replayed copy is undecodable too: the worker is reset once ("undecodable").
            await until(lambda: client.stats().sources[b.key].resets >= 1)
            # Several quiet probes later: no reset on every probe (the NaN was never recorded).
            probes = client.stats().sources[b.key].probes
            await until(lambda: client.stats().sources[b.key].probes >= probes + 3, limit=10)
            assert client.stats().sources[b.key].resets == 1
            assert all(math.isfinite(c.ts) for c in client.cursors().values())
            assert broken.within(client.index, b.key)
            honest.assert_exact(client.index, h.key)
            client.snapshot(tmp_path / "fleet.kvs")
        index = PrefixIndex.restore(tmp_path / "fleet.kvs")
        assert all(math.isfinite(c.ts) for c in index.restored_cursors.values())
        # A forged position (NaN ts) for one worker costs that worker its state, not the client.
        index.restored_cursors[b.key] = Cursor(3, math.nan)
        async with KvEventClient([h, b], index=index, config=cfg) as client:
            honest.steps(3)
            await until(lambda: honest.exact(client.index, h.key))
            await client.wait_synced(20)
            assert broken.within(client.index, b.key)


# --- row 8: an advertised hwm of 2^31 or more --------------------------------------------------


async def test_an_advertised_hwm_past_int32_is_clamped_not_an_overflow() -> None:
    async with Honest(6) as honest:
        honest.steps(10)
        sources = [honest.source(f"w{i}", dp_rank=i, hwm=hwm) for i, hwm in enumerate((2**31, 2**32 - 1, 2**63))]
        async with KvEventClient(sources, config=FLEET) as client:
            await client.wait_synced(20)
            await until(lambda: _all_live(client, honest))
            honest.steps(5)
            for src in sources:
                await until(lambda src=src: honest.exact(client.index, src.key))  # type: ignore[misc]
            st = client.stats()
            assert st.failed_sources == 0 and st.removed_sources == 0 and st.totals.sources == 3


# --- row 5: hosts judged as addresses -----------------------------------------------------------

_LOOPBACK_SPELLINGS = [
    "tcp://127.1:5557",
    "tcp://2130706433:5557",
    "tcp://0x7f000001:5557",
    "tcp://0177.0.0.1:5557",
    "tcp://127.0.0.2:5557",
    "tcp://localhost.localdomain:5557",
    "tcp://[::ffff:127.0.0.1]:5557",
    "tcp://[::ffff:7f00:1]:5557",
    "tcp://[::127.0.0.1]:5557",
    "tcp://[0:0:0:0:0:0:0:1]:5557",
]


def test_a_remote_target_cannot_point_at_this_machine_in_any_spelling() -> None:
    from kvroute._discovery import DiscoveryOptions, _Resolver, _Unusable

    remote = _Resolver("10.0.0.7", DiscoveryOptions())
    for endpoint in _LOOPBACK_SPELLINGS:
        with pytest.raises(_Unusable, match="bound to loopback"):
            remote.endpoint(endpoint)
    # Unspecified in any spelling is a wildcard: the dialled host, never this machine.
    for wildcard in ("tcp://0:5557", "tcp://0.0:5557", "tcp://[::0]:5557", "tcp://[::ffff:0.0.0.0]:5557"):
        assert remote.endpoint(wildcard) == "tcp://10.0.0.7:5557"
    # What is connected to is the address judged, canonical: libzmq reads nothing else into it.
    assert remote.endpoint("tcp://10.1:5557") == "tcp://10.0.0.1:5557"
    assert remote.endpoint("tcp://[::ffff:10.0.0.9]:5557") == "tcp://10.0.0.9:5557"
    # A target on this machine may point at this machine.
    assert _Resolver("127.1", DiscoveryOptions()).endpoint("tcp://127.1:5557") == "tcp://127.0.0.1:5557"


async def test_a_host_name_is_resolved_to_judge_it_and_connected_to_as_judged() -> None:
    from kvroute._discovery import DiscoveryOptions, _pin_names, _Resolver
    from kvroute._errors import UnusableSourceError

    name = socket.gethostname()
    addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    if not any(a.startswith("127.") or a == "::1" for a in addresses):
        pytest.skip(f"{name} does not resolve to loopback here")
    remote = _Resolver("10.0.0.7", DiscoveryOptions())
    src = EventSource(worker_id="w", endpoint=remote.endpoint(f"tcp://{name}:5557"))
    with pytest.raises(UnusableSourceError, match="resolves to this machine"):
        await _pin_names("10.0.0.7:50051", [src], remote, time.monotonic() + 5, anyio.CapacityLimiter(1))
    local = _Resolver("127.0.0.1", DiscoveryOptions())
    assert await _pin_names("t", [src], local, time.monotonic() + 5, anyio.CapacityLimiter(1)) == [src]
    # A resolvable name from a remote target is connected to by its address.
    other = _Resolver("10.0.0.7", DiscoveryOptions())
    dotted = EventSource(worker_id="w", endpoint="tcp://localhost:5557")
    with pytest.raises(UnusableSourceError):
        await _pin_names("10.0.0.7:50051", [dotted], other, time.monotonic() + 5, anyio.CapacityLimiter(1))


# --- row 6: an engine on [::1] --------------------------------------------------------------------


@needs_ipv6
async def test_an_engine_on_ipv6_loopback_is_followed() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.IPV6, 1)
    try:
        async with Honest(7, endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0", context=ctx) as v6:
            v6.steps(20)
            src = v6.source("v6")
            assert src.endpoint.startswith("tcp://[::1]:")
            async with KvEventClient([src], config=FLEET) as client:  # the client's own context
                await client.wait_synced(10)
                await until(lambda: _all_live(client, v6))
                v6.steps(5)
                await until(lambda: v6.exact(client.index, src.key))
    finally:
        ctx.term()


# --- row 7: hundreds of sources -----------------------------------------------------------------


async def synced_while_progressing(client: KvEventClient, count: int, stall: float = 30.0) -> None:
    """Wait until ``count`` sources are synced, failing only if none syncs for ``stall`` seconds (a hang).

    The time 300 cold replays take through one publisher is the host's (3 s at load average 12, over
    a minute at 20+ when replays time out): what this bounds is progress, not speed.
    """
    done, since = -1, time.perf_counter()
    while (now := client.stats().totals.synced) < count:
        if now > done:
            done, since = now, time.perf_counter()
        assert time.perf_counter() - since < stall, f"no source synced in {stall} s: {client.stats().totals}"
        await anyio.sleep(0.05)


async def test_three_hundred_sources_fit_the_context_and_the_descriptors() -> None:
    # One publisher answers all 300 cold replays, one at a time: on a loaded host the 8th in line can
    # wait past FLEET's 0.5 s replay_timeout, and a cold replay that fails against an idle engine
    # waits for its next live batch or the quiet probe (60 s here, recovery.md rule 6). Replay
    # timeouts are not what this test is about (the descriptors and the context are), so it waits 10 s.
    config = msgspec.structs.replace(FLEET, replay_timeout=10.0)
    async with Honest(8) as honest:
        honest.steps(10)
        sources = [honest.source(f"w{i}") for i in range(300)]
        async with KvEventClient(sources, config=config) as client:
            await synced_while_progressing(client, len(sources))
            await until(lambda: _all_live(client, honest), limit=60)
            honest.steps(5)
            await until(lambda: all(honest.exact(client.index, s.key) for s in sources[::50]), limit=60)
            st = client.stats()
            assert st.failed_sources == 0 and st.refused_sources == 0 and st.totals.synced == 300


async def test_max_sources_is_checked_against_the_context_at_start() -> None:
    from kvroute import ConfigError
    from kvroute._transports.zmq.sockets import SOCKETS_PER_REPLAY, SOCKETS_PER_SOURCE

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 200)
    try:
        with pytest.raises(ConfigError, match="max_sources=100 does not fit"):
            async with KvEventClient(config=msgspec.structs.replace(FLEET, max_sources=100), context=ctx):
                pass
        async with Honest(9) as honest:
            honest.steps(3)
            # 64 sockets spare (16 replay slots' DEALERs among them); each slot past 16 is budgeted too.
            fit = (200 - 64 - (FLEET.max_concurrent_replays - 16) * SOCKETS_PER_REPLAY) // SOCKETS_PER_SOURCE
            sources = [honest.source(f"w{i}", replay_endpoint=None) for i in range(fit + 2)]
            async with KvEventClient(sources, config=FLEET, context=ctx) as client:
                st = client.stats()
                assert st.totals.sources == fit and st.refused_sources == 2
    finally:
        ctx.term()


# --- row 12: discovery targets that accept TCP and never answer ----------------------------------


async def test_silent_targets_do_not_hold_up_a_good_targets_discovery() -> None:
    from kvroute.sim._grpc import VllmControlService, serve_grpc

    listeners = []
    try:
        for _ in range(80):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)  # the kernel accepts; nobody ever answers
            listeners.append(s)
        silent = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
        async with Honest(10) as honest:
            honest.steps(5)
            src = honest.source("ignored")
            service = VllmControlService(lambda: [src])
            async with (
                serve_grpc([service]) as server,
                KvEventClient(targets=silent, config=FLEET) as client,
            ):
                await anyio.sleep(0.5)  # every silent discovery is waiting on its thread
                start = time.perf_counter()
                client.add_target(server.target)
                await until(lambda: any(s.target == server.target for s in client.sources()), limit=10)
                elapsed = time.perf_counter() - start
                print(f"good target discovered in {elapsed * 1000:.0f} ms beside 80 silent ones")
                assert elapsed < 1.0
                key = next(s.key for s in client.sources() if s.target == server.target)
                await until(lambda: honest.exact(client.index, key))
    finally:
        for s in listeners:
            s.close()


# --- row 13: Prometheus scrapes during source churn ---------------------------------------------


async def test_scrapes_during_source_churn_are_whole_and_consistent() -> None:
    import urllib.request

    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.parser import text_string_to_metric_families

    from kvroute._metrics import KvRouteCollector

    async with Honest(11) as honest:
        honest.steps(10)
        keep = honest.source("keep")
        churn = [honest.source(f"c{i}", replay_endpoint=None) for i in range(20)]
        async with KvEventClient([keep], config=FLEET) as client:
            registry = CollectorRegistry()
            KvRouteCollector(client).register(registry)
            server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            results: list[tuple[int, int, int]] = []

            def scrape(n: int) -> None:
                for _ in range(n):
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        body = resp.read().decode("utf-8")
                        fams = {f.name: f for f in text_string_to_metric_families(body)}
                        series = len(fams["kvroute_source_connected"].samples)
                        results.append((resp.status, series, int(fams["kvroute_client_sources"].samples[0].value)))

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, scrape, 50)
                    for _ in range(400):  # churn until the scrapes are done (bounded)
                        if len(results) >= 50:
                            break
                        for src in churn:
                            client.add_source(src)
                        await anyio.sleep(0.002)
                        for src in churn:
                            client.remove_source(src)
                        honest.step()
                        await anyio.sleep(0.002)
            finally:
                server.shutdown()
                server.server_close()
                thread.join(5)
            # Every scrape answered, and within each the per-source series match the source count.
            assert len(results) == 50 and all(status == 200 for status, _, _ in results)
            assert all(series == sources for _, series, sources in results), results
            assert {sources for _, _, sources in results} > {1}  # the churn was seen
            await until(lambda: honest.exact(client.index, keep.key))


# --- row 14: config mistakes are KvRouteErrors; secrets stay out of repr and off plaintext -----------


async def test_config_mistakes_are_kvroute_errors_and_secrets_stay_hidden() -> None:
    from kvroute import ConfigError, KvRouteError
    from kvroute._discovery import DiscoveryOptions, InvalidOptionsError, TlsConfig, discover_with
    from kvroute._errors import ClientStateError
    from kvroute._metrics import KvRouteCollector
    from kvroute._transports.zmq.sockets import curve_keypair

    bad_configs: list[dict[str, object]] = [
        {"replay_timeout": 0},
        {"replay_deadline": math.nan},
        {"replay_slice": math.inf},
        {"rcvhwm": 0},
        {"max_sources": 0},
        {"queue_bytes": -1},
        {"held_bytes": 0},
        {"curve_public_key": "x" * 40},
    ]
    for kwargs in bad_configs:
        with pytest.raises(ConfigError) as info:
            SubscriberConfig(**kwargs)  # type: ignore[arg-type]
        assert isinstance(info.value, KvRouteError) and isinstance(info.value, ValueError)
    with pytest.raises(ConfigError):
        KvEventClient(discovery_interval=0)
    with pytest.raises(ConfigError):
        KvRouteCollector()
    client = KvEventClient()
    with pytest.raises(ClientStateError):
        client.add_target("127.0.0.1:1")
    with pytest.raises(ClientStateError):
        client.add_source(EventSource(worker_id="w", endpoint="tcp://127.0.0.1:1"))
    # Secrets never in repr.
    keys = curve_keypair()
    cfg = SubscriberConfig(curve_public_key=keys.public, curve_secret_key=keys.secret)
    tls_key = b"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n"
    options = DiscoveryOptions(
        metadata=[("authorization", "Bearer hunter2"), ("x-tenant", "blue")],
        tls=TlsConfig(private_key=tls_key, certificate_chain=b"chain"),
    )
    for text in (repr(cfg), str(cfg), repr(options), str(options), repr(options.tls)):
        assert keys.secret not in text and "hunter2" not in text and "MIIEvQ" not in text, text
    assert keys.public in repr(cfg) and "blue" in repr(options)
    # A bearer token over plaintext to another host: refused before anything is sent (judged
    # without a connection: these tests touch loopback only)...
    plain = DiscoveryOptions(metadata=[("authorization", "Bearer hunter2")], timeout=0.5)
    with pytest.raises(InvalidOptionsError, match="plaintext"):
        plain.check_channel("10.255.255.1:50051", "10.255.255.1")
    # ...unless opted into, or sent over TLS, or the target is this machine (then the call goes out).
    msgspec.structs.replace(plain, allow_plaintext_credentials=True).check_channel("10.0.0.1:1", "10.0.0.1")
    msgspec.structs.replace(plain, tls=TlsConfig()).check_channel("10.0.0.1:1", "10.0.0.1")
    with pytest.raises(KvRouteError) as info2:
        await discover_with("127.0.0.1:1", plain)
    assert not isinstance(info2.value, InvalidOptionsError)


# --- row 15: CURVE with discovery ------------------------------------------------------------------


async def test_curve_works_with_discovery_through_per_target_server_keys() -> None:
    from kvroute._discovery import DiscoveryOptions
    from kvroute._transports.zmq.sockets import curve_keypair
    from kvroute.sim._grpc import VllmControlService, serve_grpc

    server_keys, client_keys = curve_keypair(), curve_keypair()
    cfg = msgspec.structs.replace(FLEET, curve_public_key=client_keys.public, curve_secret_key=client_keys.secret)
    async with Honest(12, curve=server_keys) as engine, Honest(13) as plain:
        engine.steps(20)
        plain.steps(20)
        # The engine advertises its sources without keys, as vLLM and SGLang do.
        advertised = [engine.source("e", dp_rank=0, curve_server_key=None)]
        async with serve_grpc([VllmControlService(lambda: advertised)]) as server:
            options = DiscoveryOptions(curve_server_keys={server.target: server_keys.public})
            async with KvEventClient(
                [plain.source("plain")], targets=[server.target], config=cfg, discovery_options=options
            ) as client:
                await client.wait_synced(20)
                (src,) = [s for s in client.sources() if s.target == server.target]
                assert src.curve_server_key == server_keys.public
                engine.steps(5)
                plain.steps(5)
                await until(lambda: engine.exact(client.index, src.key))
                await until(lambda: plain.exact(client.index, WorkerKey("plain", 0)))
                assert client.stats().sources[src.key].replayed_batches > 0  # the CURVE replay ROUTER too
