"""Soak: many fault cycles over simulated engines; the router's memory and index size must stay flat.

Run: python bench/bench_soak.py [--cycles N] [--cycle-seconds S] [--router-restart-every K] [--tracemalloc]

The engines run in a child process (so their caches, replay buffers and histories do not count
against the router's memory): a vLLM with 2 ranks, an SGLang with a shallow replay buffer and
an old vLLM (array form, old replay layout), each behind a discovery server the child can hide
or stop. The router process runs one `KvEventClient` following them through discovery.

Each cycle: 1-2 random faults (drop rate, restart on the same or new ports, silent restart,
replay killed or muted, publisher held back, discovery hidden or stopped), load for
``--cycle-seconds``, then every fault is undone and the router must catch up with every rank's
newest batch; its index is then checked against the engines' caches (equal, or a subset for
partial workers; any false claim stops the run). Every ``--router-restart-every`` cycles the
router snapshots, stops, and starts again from the snapshot (warm restart).

Printed every ``--report-every`` cycles: the router's resident memory (/proc/self/statm, after a
garbage collection), the index's entries and distinct keys beside the engines' cached blocks,
and the running totals of gaps, replays, resets; at the end the last/first ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import random
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import zmq

from kvroute import ClientStats, Cursor, DiscoveryOptions, KvEventClient, PrefixIndex, SubscriberConfig, WorkerKey
from kvroute._transports.zmq import sockets as _zmq
from kvroute.sim import FAULT_KINDS, DiscoveryServer, FaultDriver, FaultKind, RequestAbortedError, SimConfig, SimEngine

BS = 16
VOCAB = 2_000
_COMMON = {
    "block_size": BS,
    "capacity_blocks": 1024,
    "grpc_port": None,
    "http_port": None,
    "decode_time_per_step": 0.002,
    "prefill_time_per_token": 5e-6,
    "max_batch": 16,
}
ENGINES = [
    SimConfig(engine="vllm", name="v0", ranks=2, seed=1, **_COMMON),  # type: ignore[arg-type]
    SimConfig(engine="sglang", name="s1", buffer_steps=200, seed=2, **_COMMON),  # type: ignore[arg-type]
    SimConfig(engine="vllm", name="v2", form="array", reply_layout="old", seed=3, **_COMMON),  # type: ignore[arg-type]
]
FAULTS: list[FaultKind] = [k for k in FAULT_KINDS if k != "clear"]


def prompts(seed: int) -> list[list[int]]:
    """A pool of prompts sharing a few long system prompts: the caches fill, evict and share prefixes."""
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(32, 160))] for _ in range(8)]
    return [rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randrange(8, 200))] for _ in range(800)]


# --- the control channel between the router process and the engines' process -----------------------


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """What the router process asks the engines' process: ``op`` and its arguments."""

    op: str  # "fault", "load", "heal", "truth", "publish", "stop"
    kind: FaultKind = "drop"  # for op "fault"
    engine: int = 0
    rank: int = 0
    on: bool = False


class RankTruth(msgspec.Struct, frozen=True, array_like=True):
    """One rank's ground truth: its newest seq and ts, cached blocks, and the cached leading blocks per prompt."""

    target: str
    rank: int
    seq: int
    ts: float
    blocks: int
    matches: list[int]


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """The engines' process's answer: targets (its first message), truth (truth), or an error."""

    targets: list[tuple[str, int]] = []
    truth: list[RankTruth] = []
    error: str = ""


# --- the engines' process -----------------------------------------------------------------------------------


class Fleet:
    """The engines, their discovery servers, the load and the fault knobs (child process side)."""

    def __init__(
        self, engines: list[SimEngine], discos: list[DiscoveryServer], pool: list[list[int]], seed: int
    ) -> None:
        self.engines = engines
        self.discos = discos
        self.pool = pool
        self.rng = random.Random(seed)
        self.load_on = anyio.Event()
        self.inflight = 0
        self.idle = anyio.Event()
        self.faults = FaultDriver(engines, discos, self.rng)
        self.fresh = 0

    async def fault(self, kind: FaultKind, i: int, rank: int) -> None:
        await self.faults.inject(kind, i, rank)  # lasting faults are lifted by `heal`

    async def heal(self) -> None:
        await self.faults.heal()

    async def stop_load(self) -> None:
        """Stop sending requests and wait for the running ones: a cache mid-step holds unpublished changes."""
        self.load_on = anyio.Event()
        if self.inflight:
            self.idle = anyio.Event()
            await self.idle.wait()

    async def serve_load(self) -> None:
        async def client(eng: SimEngine, rng: random.Random) -> None:
            while True:
                await self.load_on.wait()
                self.inflight += 1
                try:
                    with contextlib.suppress(RequestAbortedError):
                        await eng.complete(rng.choice(self.pool), rng.randint(1, 8))
                finally:
                    self.inflight -= 1
                    if not self.inflight:
                        self.idle.set()

        async with anyio.create_task_group() as tg:
            for i, eng in enumerate(self.engines):
                for k in range(4):
                    tg.start_soon(client, eng, random.Random(i * 101 + k))

    def truth(self) -> list[RankTruth]:
        out = []
        for eng, disco in zip(self.engines, self.discos):
            for r in range(eng.config.ranks):
                pub = eng.publisher(r)
                seq = pub.next_seq - 1
                cache = eng.cache(r)
                out.append(
                    RankTruth(
                        target=f"127.0.0.1:{disco.port}",
                        rank=r,
                        seq=seq,
                        ts=pub.history[seq].ts if seq >= 0 else 0.0,
                        blocks=cache.num_cached_blocks,
                        matches=[cache.match_blocks(p) for p in self.pool],
                    )
                )
        return out

    async def publish(self, i: int, rank: int) -> None:
        """One request of tokens no prompt uses: it stores a block, so the rank publishes a batch."""
        self.fresh += 1
        await self.engines[i].complete([VOCAB + self.fresh * 7 % 20_000 + k for k in range(BS)], 1, rank=rank)


async def engines_main(control: str, seed: int) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _zmq.connect(ctx, zmq.PAIR, control)
    try:
        async with contextlib.AsyncExitStack() as stack:
            engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in ENGINES]
            discos = [DiscoveryServer(e) for e in engines]
            for d in discos:
                stack.push_async_callback(d.stop)
                await d.start()
            fleet = Fleet(engines, discos, prompts(seed), seed)
            # The bound side of a PAIR can send only once the peer connected: the child (the
            # connecting side, whose pipe exists at once) speaks first.
            hello = Reply(targets=[(f"127.0.0.1:{d.port}", e.config.ranks) for d, e in zip(discos, engines)])
            if not _zmq.send_nowait(sock, [msgspec.msgpack.encode(hello)]):
                raise RuntimeError("cannot reach the router process")
            async with anyio.create_task_group() as tg:
                tg.start_soon(fleet.serve_load)
                while True:
                    [frames] = await _zmq.recv_many(sock, 1)
                    cmd = msgspec.msgpack.decode(frames[0], type=Command)
                    reply = Reply()
                    if cmd.op == "stop":
                        tg.cancel_scope.cancel()
                        _zmq.send_nowait(sock, [msgspec.msgpack.encode(reply)])
                        break
                    if cmd.op == "fault":
                        await fleet.fault(cmd.kind, cmd.engine, cmd.rank)
                    elif cmd.op == "load":
                        if cmd.on:
                            fleet.load_on.set()
                        else:
                            await fleet.stop_load()
                    elif cmd.op == "heal":
                        await fleet.heal()
                    elif cmd.op == "truth":
                        reply = Reply(truth=fleet.truth())
                    elif cmd.op == "publish":
                        await fleet.publish(cmd.engine, cmd.rank)
                    else:
                        reply = Reply(error=f"unknown op {cmd.op!r}")
                    _zmq.send_nowait(sock, [msgspec.msgpack.encode(reply)])
    finally:
        _zmq.close(sock)
        ctx.term()


def engines_process(control: str, seed: int, backend: str) -> None:
    anyio.run(engines_main, control, seed, backend=backend)


# --- the router process --------------------------------------------------------------------------------------


class Engines:
    """The router side of the control channel."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.targets: list[tuple[str, int]] = []

    async def read(self) -> Reply:
        with anyio.fail_after(60):
            [frames] = await _zmq.recv_many(self.sock, 1)
        reply = msgspec.msgpack.decode(frames[0], type=Reply)
        if reply.error:
            raise RuntimeError(reply.error)
        return reply

    async def ask(self, op: str, **args: object) -> Reply:
        if not _zmq.send_nowait(self.sock, [msgspec.msgpack.encode(Command(op=op, **args))]):  # type: ignore[arg-type]
            raise RuntimeError("the engines' process is gone")
        return await self.read()


def rss_mb() -> float:
    """This process's resident memory now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


@contextlib.asynccontextmanager
async def engines_child(seed: int, backend: str) -> AsyncIterator[Engines]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _zmq.socket(ctx, zmq.PAIR)
    sock.bind("tcp://127.0.0.1:0")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    proc = mp.get_context("spawn").Process(target=engines_process, args=(endpoint, seed, backend), daemon=True)
    proc.start()
    try:
        engines = Engines(sock)
        engines.targets = (await engines.read()).targets
        yield engines
        with contextlib.suppress(TimeoutError):
            await engines.ask("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        _zmq.close(sock)
        ctx.term()


_SUMMED = ("gaps", "replays", "resets", "replayed_batches", "batches", "messages")


def add_totals(a: dict[str, int], b: ClientStats) -> dict[str, int]:
    """The running totals ``a`` plus one client's (a client per warm restart: its counters start at 0)."""
    return {f: a[f] + getattr(b.totals, f) for f in _SUMMED}


async def settle(client: KvEventClient, engines: Engines, index_of: dict[WorkerKey, int]) -> list[RankTruth]:
    """Until every source is synced at its rank's newest batch: publish on the lagging ranks, wait."""
    with anyio.fail_after(60):
        while True:
            truth = (await engines.ask("truth")).truth
            cursors = client.cursors()
            behind = []
            for t in truth:
                w = WorkerKey(t.target, t.rank)
                status = client.worker_status(w)
                want = Cursor(t.seq, t.ts) if t.seq >= 0 else None
                if status is None or not status.synced or cursors.get(w) != want:
                    behind.append(t)
            if not behind:
                return truth
            for t in behind:
                await engines.ask("publish", engine=index_of[WorkerKey(t.target, 0)], rank=t.rank)
            await anyio.sleep(0.3)


def verify(client: KvEventClient, truth: list[RankTruth], pool: list[list[int]]) -> None:
    """The index against the caches: equal for complete workers, never more for partial ones."""
    index = client.index
    scores = [index.find_matches(p) for p in pool]
    assert index.workers() <= client.live_workers()
    for t in truth:
        w = WorkerKey(t.target, t.rank)
        status = client.worker_status(w)
        assert status is not None
        got = [s.get(w, 0) for s in scores]
        if status.partial:
            assert index.num_blocks(w) <= t.blocks, (w, index.num_blocks(w), t.blocks)
            assert all(g <= m for g, m in zip(got, t.matches)), f"false claim on {w}"
        else:
            assert index.num_blocks(w) == t.blocks, (w, index.num_blocks(w), t.blocks)
            assert got == t.matches, f"{w} differs from its cache"


async def main(args: argparse.Namespace) -> None:
    config = SubscriberConfig(reconnect_ivl=0.02, reconnect_ivl_max=0.2, replay_timeout=0.3, quiet_interval=0.5)
    rng = random.Random(args.seed)
    pool = prompts(args.seed)
    async with engines_child(args.seed, args.backend) as engines:
        index_of = {WorkerKey(target, 0): i for i, (target, _) in enumerate(engines.targets)}
        targets = [target for target, _ in engines.targets]

        def new_client(index: PrefixIndex | None = None) -> KvEventClient:
            return KvEventClient(
                targets=targets,
                config=config,
                index=index,
                discovery_interval=0.2,
                discovery_grace=0.5,
                discovery_options=DiscoveryOptions(timeout=1.0),
            )

        totals = dict.fromkeys(_SUMMED, 0)
        rows = []
        traces: list[tracemalloc.Snapshot] = []
        if args.tracemalloc:
            tracemalloc.start(1)
        start = time.perf_counter()
        warm_restarts = 0
        faults_done: dict[str, int] = {}
        print(
            f"{'cycle':>5} {'RSS MB':>7} {'entries':>8} {'keys':>7} {'cached':>7}"
            f" {'gaps':>6} {'replays':>7} {'resets':>6} {'partial':>7} {'s':>6}"
        )
        with tempfile.TemporaryDirectory() as tmp:
            snap = Path(tmp) / "index.kvs"
            index: PrefixIndex | None = None
            cycle = 0
            while cycle < args.cycles:
                async with new_client(index) as client:
                    while cycle < args.cycles:
                        cycle += 1
                        for _ in range(rng.randint(1, 2)):
                            kind = rng.choice(FAULTS)
                            faults_done[kind] = faults_done.get(kind, 0) + 1
                            await engines.ask(
                                "fault", kind=kind, engine=rng.randrange(len(targets)), rank=rng.randrange(2)
                            )
                        await engines.ask("load", on=True)
                        await anyio.sleep(args.cycle_seconds)
                        await engines.ask("load", on=False)
                        await engines.ask("heal")
                        truth = await settle(client, engines, index_of)
                        verify(client, truth, pool)
                        if cycle % args.report_every == 0 or cycle == args.cycles:
                            gc.collect()
                            st = client.index.stats()
                            now = add_totals(totals, client.stats())
                            row = (rss_mb(), st.entries, st.distinct_keys, sum(t.blocks for t in truth))
                            rows.append(row)
                            if args.tracemalloc:
                                traces.append(tracemalloc.take_snapshot())
                            partial = client.stats().totals.partial
                            print(
                                f"{cycle:>5} {row[0]:>7.1f} {row[1]:>8,} {row[2]:>7,} {row[3]:>7,}"
                                f" {now['gaps']:>6} {now['replays']:>7} {now['resets']:>6} {partial:>7}"
                                f" {time.perf_counter() - start:>6.1f}"
                            )
                        if args.router_restart_every and cycle % args.router_restart_every == 0:
                            client.snapshot(snap)
                            break
                    totals = add_totals(totals, client.stats())
                if cycle < args.cycles:
                    index = PrefixIndex.restore(snap)
                    warm_restarts += 1
    (rss0, entries0, keys0, cached0), (rss1, entries1, keys1, cached1) = rows[0], rows[-1]
    print(
        f"\n{args.cycles} cycles in {time.perf_counter() - start:.0f} s, {warm_restarts} warm router restarts;"
        f" faults {dict(sorted(faults_done.items()))}"
    )
    print(
        f"totals: gaps {totals['gaps']}, replays {totals['replays']} ({totals['replayed_batches']} batches),"
        f" resets {totals['resets']}, batches applied {totals['batches']}"
    )
    print(
        f"last/first: RSS {rss1 / rss0:.3f} ({rss0:.1f} -> {rss1:.1f} MB), entries {entries1 / entries0:.3f},"
        f" distinct keys {keys1 / keys0:.3f} (engines' cached blocks {cached1 / cached0:.3f})"
    )
    if len(traces) >= 2:
        first, last = traces[0], traces[-1]
        growth = last.compare_to(first, "traceback")
        total = sum(d.size_diff for d in growth)
        print(f"\nPython heap (tracemalloc), first -> last report: {total / 1e6:+.2f} MB; largest changes:")
        for d in growth[:8]:
            frame = d.traceback[0]
            print(f"  {d.size_diff / 1e3:+9.1f} KB {d.count_diff:+7} blocks  {frame.filename}:{frame.lineno}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=150)
    parser.add_argument("--cycle-seconds", type=float, default=0.6, help="load per cycle, faults active")
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--router-restart-every", type=int, default=10, help="0: never restart the router")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--tracemalloc", action="store_true", help="also report the Python heap's growth by site")
    args = parser.parse_args()
    anyio.run(main, args, backend=args.backend)
