"""Chaos: simulated engines under drops, restarts, publisher and replay outages and flapping discovery.

Four `SimEngine`s (vLLM with 2 ranks; SGLang with a shallow replay buffer; an old vLLM: array
form, old reply layout, bytes hashes; SGLang with 2 ranks and no replay at all) serve
requests while a fault driver (`kvroute.sim.FaultDriver`), its plan drawn from the seed alone,
sets drop rates, restarts engines (same or new ports),
kills, mutes and revives replay endpoints, holds publishers back, and hides or stops each
engine's discovery server; every router life has a prefix-cache clear and a silent restart.
A `KvEventClient` follows them through discovery.

Checkpoints, every 100-200 ms while the faults run: the index must never claim what the
engine does not hold. The index lags the engine (an eviction is claimed until its event
arrives), so each worker is compared with the engine's truth *as of the last batch the
client applied*: the client's position (`KvEventClient.cursors`: seq and ts) names one
engine process (the publisher whose history has that ts at that seq; one that matches no
process fails the test), and what that process's history up to that seq says it holds is the
truth (`EngineTruth`, a model of the engine's cache computed without kvroute's index). A worker must then be
equal to it (not partial) or a subset of it (partial: leading-block scores and block counts
never larger); a worker without a position must hold nothing, and the index must hold no
worker that no source feeds. Any false claim fails at once.

Halfway, the router restarts warm: every fault is undone, the router stops and snapshots,
the engines serve on for 200 ms, and a new router resumes from the snapshot (the checkpoints
hold for the restored state too; vLLM workers, whose buffers cover the downtime, must resume
without a reset). Then faults again.

After the faults stop and a last request per rank has published, the client must catch up
with every engine's newest batch and be synced; then each worker is compared with the
engine's cache itself (`PrefixCache.match_blocks`, `num_cached_blocks`): equal where the
replay buffers covered every loss, a subset for partial workers.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import anyio.abc
import pytest
from _publisher_helpers import EngineTruth, served

from kvroute._client import KvEventClient
from kvroute._discovery import DiscoveryOptions
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey
from kvroute._snapshot import Cursor
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute.sim import (
    DiscoveryServer,
    EventPublisher,
    FaultDriver,
    FaultKind,
    RequestAbortedError,
    SimConfig,
    SimEngine,
    SimRequest,
)

pytestmark = pytest.mark.anyio

SEED = 7
#: Faults per backend (~125 ms apart): the whole test stays under ~25 s on a slow 2-core machine.
CHAOS_FAULTS = {"asyncio": 56, "trio": 36}
VOCAB = 50
MAX_TOKENS = 3

_COMMON = {
    "block_size": 4,
    "capacity_blocks": 48,  # small: prompts evict each other all the time
    "grpc_port": None,  # each engine gets a discovery server the fault driver can stop and start
    "http_port": None,
    "decode_time_per_step": 0.002,
    "prefill_time_per_token": 2e-5,
    "max_batch": 8,
}
ENGINES = [
    SimConfig(engine="vllm", name="v0", ranks=2, seed=1, **_COMMON),  # type: ignore[arg-type]
    SimConfig(engine="sglang", name="s1", buffer_steps=40, seed=2, **_COMMON),  # type: ignore[arg-type]
    SimConfig(
        engine="vllm",
        name="v2",
        form="array",
        reply_layout="old",
        bytes_hashes=True,
        seed=3,
        **_COMMON,  # type: ignore[arg-type]
    ),
    SimConfig(engine="sglang", name="s3", ranks=2, replay_port=None, seed=4, **_COMMON),  # type: ignore[arg-type]
]

CONFIG = SubscriberConfig(
    reconnect_ivl=0.02, reconnect_ivl_max=0.1, replay_timeout=0.25, quiet_interval=0.3, max_concurrent_replays=4
)


class Truth:
    """Every engine process each worker ever had, and the index each one's history implies up to a seq."""

    def __init__(self) -> None:
        self.engines: dict[WorkerKey, tuple[SimEngine, int]] = {}
        self.procs: dict[WorkerKey, list[EventPublisher]] = {}
        self._shadows: dict[int, tuple[EngineTruth, int]] = {}

    def track(self, worker: WorkerKey, eng: SimEngine, rank: int) -> None:
        self.engines[worker] = (eng, rank)
        self.procs[worker] = []
        self.note(worker)

    def note_engine(self, eng: SimEngine) -> None:
        """Record the new process of every worker of ``eng`` (called after each restart)."""
        for w, (e, _) in self.engines.items():
            if e is eng:
                self.note(w)

    def note(self, worker: WorkerKey) -> None:
        """Record the worker's current process (none while its engine is restarting)."""
        eng, rank = self.engines[worker]
        with contextlib.suppress(RuntimeError):
            pub = eng.publisher(rank)
            if pub not in self.procs[worker]:
                self.procs[worker].append(pub)

    def process(self, worker: WorkerKey, cursor: Cursor) -> EventPublisher | None:
        """The process that published the client's newest applied batch (seq and ts), if any did."""
        self.note(worker)
        for pub in reversed(self.procs[worker]):
            history = pub.history
            if cursor.seq < len(history) and history[cursor.seq].ts == cursor.ts:
                return pub
        return None

    def at(self, worker: WorkerKey, pub: EventPublisher, seq: int) -> EngineTruth:
        """What ``pub``'s history up to ``seq`` says the worker holds (kept per process, advanced lazily).

        `EngineTruth` models the engine's cache from its events without kvroute's index.
        """
        model, pos = self._shadows.get(id(pub), (EngineTruth(), -1))
        if pos > seq:  # the client went back (a source re-added): start over
            model, pos = EngineTruth(), -1
        for batch in pub.history[pos + 1 : seq + 1]:
            model.apply(worker, batch)
        self._shadows[id(pub)] = (model, seq)
        return model


def check(client: KvEventClient, truth: Truth, queries: Sequence[Sequence[int]]) -> None:
    """The checkpoint invariant (module docstring); raises AssertionError on any false claim."""
    index = client.index
    live = client.live_workers()
    assert index.workers() <= live, f"index holds workers no source feeds: {index.workers() - live}"
    cursors = client.cursors()
    scores = [index.find_matches(q) for q in queries]
    for w in sorted(live):
        status = client.worker_status(w)
        assert status is not None
        cursor = cursors.get(w)
        if cursor is None:
            assert index.num_blocks(w) == 0, f"{w} holds {index.num_blocks(w)} blocks with nothing applied"
            continue
        pub = truth.process(w, cursor)
        assert pub is not None, f"{w} applied seq {cursor.seq} (ts {cursor.ts}): no process of that engine sent it"
        shadow = truth.at(w, pub, cursor.seq)
        compare(w, status.partial, index.num_blocks(w), shadow.num_blocks(w), "blocks at seq", cursor.seq)
        for q, got in zip(queries, scores):
            compare(w, status.partial, got.get(w, 0), shadow.find_matches(q).get(w, 0), "leading blocks of", q)


def compare(w: WorkerKey, partial: bool, got: int, want: int, what: str, of: object) -> None:
    if partial:
        assert got <= want, f"false claim: {w} (partial) {what} {of}: index {got} > truth {want}"
    else:
        assert got == want, f"{w} (complete) {what} {of}: index {got} != truth {want}"


def workload(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts sharing a few system prompts, and the queries covering every block they can make.

    The sim's "model" is deterministic (token i depends on the prompt and i only), so the
    prompt plus its first MAX_TOKENS outputs is the deepest sequence any process caches.
    """
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    prompts = [rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))] for _ in range(40)]
    queries = []
    for p in prompts:
        req = SimRequest("q", 0, p, MAX_TOKENS, None, 0.0, False)
        for _ in range(MAX_TOKENS):
            req.emit(req.next_token(32_000))
        queries.append(req.seq)
    return prompts, queries


@contextlib.asynccontextmanager
async def fleet() -> AsyncIterator[tuple[list[SimEngine], list[DiscoveryServer]]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in ENGINES]
        discos = [DiscoveryServer(e) for e in engines]
        for d in discos:
            stack.push_async_callback(d.stop)
            await d.start()
        yield engines, discos


#: The faults drawn, by weight; every half of every run also has a clear and a silent restart.
KINDS: list[FaultKind] = ["drop"] * 3 + ["restart", "restart-new-ports"] + ["kill-replay"] * 2
KINDS += ["silent-restart"] * 2 + ["mute-replay", "pause", "hide", "down", "clear"]
EVERY_RUN: tuple[FaultKind, ...] = ("clear", "silent-restart")


async def run_faults(driver: FaultDriver, count: int) -> None:
    """``count`` faults planned from the seed, one every 50-200 ms, each lifted after 0.1-0.8 s."""
    rng = driver.rng
    for kind, i, rank in driver.plan(count, KINDS, every_run=EVERY_RUN):
        await anyio.sleep(rng.uniform(0.05, 0.2))
        await driver.undo_due()
        await driver.inject(kind, i, rank, undo_at=anyio.current_time() + rng.uniform(0.1, 0.8))


async def serve_load(
    engines: list[SimEngine], prompts: list[list[int]], seed: int, calm: anyio.Event, done: anyio.Event
) -> None:
    """Three clients per engine sending prompts back to back until ``calm``; ``done`` once all finished.

    Comparing with a cache mid-step would be wrong: admitting a request evicts blocks whose
    events are published only at the step's end.
    """

    async def client(eng: SimEngine, rng: random.Random) -> None:
        while not calm.is_set():
            with contextlib.suppress(RequestAbortedError):  # the engine restarted under it
                await eng.complete(rng.choice(prompts), rng.randint(1, MAX_TOKENS))
            await anyio.sleep(rng.uniform(0.0, 0.02))

    async with anyio.create_task_group() as tg:
        for i, eng in enumerate(engines):
            for k in range(3):
                tg.start_soon(client, eng, random.Random(seed * 31 + i * 7 + k))
    done.set()


async def checkpoints(
    client: KvEventClient, truth: Truth, queries: list[list[int]], rng: random.Random, count: list[int]
) -> None:
    while True:
        await anyio.sleep(rng.uniform(0.1, 0.2))
        check(client, truth, queries)
        count[0] += 1


def lagging(client: KvEventClient, truth: Truth) -> list[WorkerKey]:
    """Workers whose source is not yet synced at its engine's newest batch."""
    cursors = client.cursors()
    out = []
    for w, (eng, rank) in truth.engines.items():
        status = client.worker_status(w)
        pub = eng.publisher(rank)
        newest = pub.next_seq - 1
        want = Cursor(newest, pub.history[newest].ts) if newest >= 0 else None
        if status is None or not status.synced or cursors.get(w) != want:
            out.append(w)
    return out


async def settle_fleet(client: KvEventClient, truth: Truth, queries: list[list[int]], rng: random.Random) -> None:
    """Publish after the faults until every source has caught up with its engine's newest batch.

    A new request on a lagging rank gives a source without replay a batch after its lost
    tail (which it then sees as a gap), and one whose SUB was just recreated a batch it
    subscribed in time for; sources with replay also find a lost tail by their quiet probe.
    """
    with anyio.fail_after(20):
        behind = list(truth.engines)
        while behind:
            for w in behind:
                eng, rank = truth.engines[w]
                fresh = [1000 + rng.randrange(1000) for _ in range(8)]  # unseen: it stores a block
                queries.append(fresh)
                await eng.complete(fresh, 1, rank=rank)
            for _ in range(8):
                await anyio.sleep(0.05)
                behind = lagging(client, truth)
                if not behind:
                    return


def router(targets: list[str], index: PrefixIndex | None = None) -> KvEventClient:
    return KvEventClient(
        targets=targets,
        index=index,
        config=CONFIG,
        discovery_interval=0.1,
        discovery_grace=0.3,
        discovery_options=DiscoveryOptions(timeout=0.5),
    )


async def all_live(client: KvEventClient, truth: Truth) -> None:
    """Until every worker has a source (not wait_synced: a source without replay syncs at its first batch)."""
    async with client.events() as stream:
        with anyio.fail_after(10):
            while client.live_workers() != set(truth.engines):
                await stream.__anext__()


async def test_chaos(anyio_backend: str, tmp_path: Path) -> None:
    seed = SEED + list(CHAOS_FAULTS).index(anyio_backend) * 100  # each backend its own fault sequence
    rng = random.Random(seed)
    prompts, queries = workload(seed)
    truth = Truth()
    half = CHAOS_FAULTS[anyio_backend] // 2
    async with fleet() as (engines, discos), anyio.create_task_group() as load:
        for d in discos:
            for rank in range(d.eng.config.ranks):
                truth.track(WorkerKey(d.target, rank), d.eng, rank)
        targets = [d.target for d in discos]
        faults = FaultDriver(engines, discos, random.Random(seed + 1), on_restart=truth.note_engine)
        calm, idle = anyio.Event(), anyio.Event()
        load.start_soon(serve_load, engines, prompts, seed, calm, idle)
        checks = [0]

        # The first router's life: faults, checkpoints; then every fault is undone.
        async with router(targets) as client:
            await all_live(client, truth)
            async with anyio.create_task_group() as tg:
                tg.start_soon(checkpoints, client, truth, queries, random.Random(seed + 2), checks)
                await run_faults(faults, half)
                tg.cancel_scope.cancel()
            await faults.heal()
            # On a loaded host a healed vLLM source may still be replaying: the snapshot saves only
            # whole positions, so give every deep-buffered worker the time to have one again (the
            # assertion after the restart still decides). 30 s was not enough once in a CI run on a
            # machine loaded to 10-15 by fleet benchmarks beside it: no deep worker was resumed.
            deep_workers = {w for w in truth.engines if truth.engines[w][0].config.buffer_steps >= 10_000}
            async with client.events() as stream:
                with anyio.move_on_after(90) as waited:
                    while not deep_workers <= set(client._positions()):
                        await stream.__anext__()
            first = client.stats()
            # What the deep workers were when the snapshot was taken, for the assertion below.
            before = {
                w: (client.worker_status(w), first.sources[w].resets, first.sources[w].last_seq) for w in deep_workers
            }
            before_note = f"(wait for positions timed out: {waited.cancelled_caught}; at the snapshot: {before})"
        # Warm restart: the engines serve on while the router is down.
        path = tmp_path / "index.kvs"
        client.snapshot(path)
        await anyio.sleep(0.2)
        index = PrefixIndex.restore(path)
        resumed = set(index.restored_cursors)
        async with router(targets, index) as client:
            await all_live(client, truth)
            check(client, truth, queries)  # the restored state, before and while it is checked
            await client.wait_synced(10)
            check(client, truth, queries)
            per = client.stats().sources
            deep = {w for w in resumed if truth.engines[w][0].config.buffer_steps >= 10_000}
            # vLLM's buffers (10,000 batches) cover the downtime: resumed without a reset.
            assert deep and all(per[w].resets == 0 for w in deep), ({w: per[w] for w in deep}, before_note)
            async with anyio.create_task_group() as tg:
                tg.start_soon(checkpoints, client, truth, queries, random.Random(seed + 3), checks)
                await run_faults(faults, half)
                calm.set()
                await idle.wait()
                await faults.heal()
                await settle_fleet(client, truth, queries, rng)
                tg.cancel_scope.cancel()
            check(client, truth, queries)
            # Quiescent: compare with the engines' caches themselves.
            stats = client.stats()
            assert client.index.workers() <= client.live_workers() == set(truth.engines)
            scores = [client.index.find_matches(q) for q in queries]
            for w, (eng, rank) in truth.engines.items():
                cache = eng.cache(rank)
                partial = stats.sources[w].partial
                compare(w, partial, client.index.num_blocks(w), cache.num_cached_blocks, "blocks", "in cache")
                for q, got in zip(queries, scores):
                    compare(w, partial, got.get(w, 0), served(cache, q), "cached leading blocks of", q)
            # The chaos was real: every kind of trouble happened, in the two router lives together.
            a, b = first.totals, stats.totals
            gaps, replays, resets = a.gaps + b.gaps, a.replays + b.replays, a.resets + b.resets
            removed = first.removed_sources + stats.removed_sources
            assert checks[0] >= 10
            done = faults.done
            assert done.get("restart", 0) + done.get("restart-new-ports", 0) >= 2 and done.get("kill-replay", 0) >= 1
            assert done.get("clear", 0) >= 2 and done.get("silent-restart", 0) >= 2  # one each per router life
            assert gaps > 0 and replays > 0 and resets > 0 and removed > 0
            print(
                f"\nchaos[{anyio_backend}]: {checks[0]} checkpoints, faults {faults.done}, {len(deep)} workers"
                f" resumed without reset; gaps {gaps}, replays {replays}, resets {resets}, sources removed"
                f" {removed}; partial workers at the end {b.partial}/{b.sources}, {client.index.num_blocks()} entries"
            )
