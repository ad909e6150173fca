"""Router.select through the compiled scoring (issue 18), measured against same-run baselines.

Run: python bench/bench_select.py [--quick] [--repeat N]

Figures, each printed with absolute numbers and as a ratio within this run (the machines are noisy):

1. ``select`` ÷ ``find_matches``, 64 workers whose overlaps of an 8k-token prompt all differ (0 to 504
   blocks), p50 and p99, calls interleaved so drift hits both alike. Also the Python reference path (a
   `CostModel` subclass, which `Router` prices in Python) ÷ ``find_matches``. Target: compiled <= 1.1.
2. ``select`` p50 / p99 with 1,024 workers and 1M (block, worker) entries, an 8k-token prompt: a quarter of
   the workers hold a prefix of it at random depths (one all of it), every worker holds filler chains; on an
   idle fleet and with four requests tracked on every worker. Target: p99 <= 100 µs. Then the production
   path: a states provider built as `KvEventClient` is (`ClientLikeStates`: its kept ``live_set()`` and
   ``unvouched_workers()``, read once per call), alone and with every engine reporting load (`EngineLoads`, one
   record refreshed per call, as a stream of reports does; target ÷ ``find_matches`` <= 1.3), and reporting
   KV-cache usage too (priced by `CostModel.eviction`, as vLLM and SGLang engines report it); and "status per
   wkr", a provider without those two (``live_workers()`` a new set per call, ``worker_status`` a `WorkerStatus`
   per candidate), as before them.
3. ``select`` p99 while two threads ingest through ``PrefixIndex.apply_payload`` at full speed ÷ its p99 idle,
   64 workers; then the same with two more threads calling ``select`` concurrently, on routers of their own and
   on the measured router itself. Target: <= 3.

Times are wall-clock (``time.perf_counter``) per call; each figure keeps its best of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import kvroute
from kvroute import BlockStored, CostModel, KvEventClient, PrefixIndex, Router, WorkerKey, WorkerStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import make_stream  # vLLM-style payloads for the ingest threads

BS = 16
VOCAB = 150_000
PROMPT_TOKENS = 8192


class PythonPath(CostModel, frozen=True, kw_only=True):
    """The stock weights through the Python scoring path (every CostModel subclass takes it)."""


class _Source:
    """One source as `KvEventClient` keeps it: a status built from its machine's state per call."""

    def __init__(self) -> None:
        self._link = "up"
        self._held: list[object] = []
        self.partial = False

    @property
    def state(self) -> str:
        # the shape of `RecoveryMachine.state`: a few attribute reads per call
        if self._link != "up":
            return "syncing"
        return "resyncing" if self._held else "synced"

    def status(self) -> WorkerStatus:
        return WorkerStatus(state=self.state, partial=self.partial)  # type: ignore[arg-type]


class ClientLikeStates:
    """A states provider with `KvEventClient`'s per-call costs (its ``worker_status``,
    ``live_workers``, ``live_set`` and ``unvouched_workers`` bodies over a dict of sources), every worker synced;
    ``engine_loads`` when the engines report load. The real client needs a live source per worker;
    the router calls only these. ``vouching=False``: a provider without ``unvouched_workers`` and
    ``live_set`` (a router asks ``worker_status`` per candidate and copies ``live_workers``), as every
    provider was before them."""

    def __init__(self, workers: list[WorkerKey], engine_loads: object = None, vouching: bool = True) -> None:
        self._subs = {w: _Source() for w in workers}
        if engine_loads is not None:
            self.engine_loads = engine_loads
        # the client's published sets (`kvroute._models.Vouching`): every worker synced, none partial
        self._unvouched: frozenset[WorkerKey] = frozenset()
        self._live = frozenset(self._subs)
        if vouching:
            self.unvouched_workers = self._unvouched_workers
            self.live_set = self._live_set

    def _unvouched_workers(self, trust_partial: bool) -> frozenset[WorkerKey]:
        return self._unvouched

    def _live_set(self) -> frozenset[WorkerKey]:
        return self._live

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        sub = self._subs.get(worker)
        return sub.status() if sub is not None else None

    def live_workers(self) -> set[WorkerKey]:
        return set(self._subs)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def interruptions(seconds: float = 1.0, floor_us: float = 10.0) -> tuple[float, float, float]:
    """What takes this thread's core away while it runs: a spin of ``seconds`` reading the clock, and each gap
    over ``floor_us``. Returns the gaps a second, their median and their longest (µs).

    On the development VM a timer tick every ~4 ms costs a running thread ~25 µs (median; up to ~100, s24): a
    call of T µs meets one with probability ~T / 4 ms, so every call over ~40 µs has a p99 of its p50 plus one
    tick, whatever the code does. Printed beside the p99 figures so that they can be read on the machine that
    measured them.
    """
    gaps: list[float] = []
    clock = time.perf_counter
    start = last = clock()
    while last - start < seconds:
        now = clock()
        if now - last > floor_us * 1e-6:
            gaps.append((now - last) * 1e6)
        last = now
    if not gaps:
        return 0.0, 0.0, 0.0
    return len(gaps) / seconds, statistics.median(gaps), max(gaps)


def tick_floor(p50_us: float) -> str:
    """What this machine's interruptions (measured now, for a second) do to the p99 of a call of ``p50_us``."""
    per_s, median, longest = interruptions()
    return (f"{per_s:.0f} interruptions a second of a spinning thread, median {median:.0f} µs, longest "
            f"{longest:.0f} µs: a call of {p50_us:.0f} µs meets one in {100 * per_s * p50_us * 1e-6:.1f} % of calls "
            f"(over 1 %: its p99 is its p50 plus one, ~{p50_us + median:.0f} µs)")


def interleaved(
    fns: dict[str, Callable[[], object]], iters: int, repeat: int, qs: tuple[float, ...] = (0.5, 0.99)
) -> dict[str, tuple[float, ...]]:
    """Each quantile ``qs`` (µs) of each call, the best over ``repeat`` rounds, the calls interleaved."""
    best: dict[str, tuple[float, ...]] = {}
    for _ in range(repeat):
        gc.collect()
        took: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(iters):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                took[name].append(time.perf_counter() - t0)
        for name, xs in took.items():
            now = tuple(pct(xs, q) * 1e6 for q in qs)
            old = best.get(name)
            best[name] = now if old is None else tuple(min(a, b) for a, b in zip(old, now))
    return best


def fill(index: PrefixIndex, workers: list[WorkerKey], entries: int, prompt: list[int], depths: list[int]) -> None:
    """Worker i holds the first ``depths[i]`` blocks of ``prompt``; filler chains bring it to its share."""
    rng = random.Random(11)
    per_worker = entries // len(workers)
    h = 1
    for w, depth in zip(workers, depths):
        if depth:
            index.apply(w, BlockStored(block_hashes=list(range(h, h + depth)), token_ids=prompt[: depth * BS],
                                       block_size=BS))
            h += depth
        left = per_worker - depth
        while left > 0:
            n = min(left, 128)
            index.apply(w, BlockStored(block_hashes=list(range(h, h + n)),
                                       token_ids=[rng.randrange(VOCAB) for _ in range(n * BS)], block_size=BS))
            h += n
            left -= n


def figure_ratio(iters: int, repeat: int, entries: int) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    workers = [WorkerKey(f"w{i}", 0) for i in range(64)]
    index = PrefixIndex()
    fill(index, workers, entries, prompt, [i * 8 for i in range(64)])  # 0, 8, ..., 504 blocks: all differ
    compiled = Router(index, seed=0)
    python = Router(index, cost=PythonPath(), seed=0)
    assert compiled.select(prompt).worker == python.select(prompt).worker == workers[-1]
    got = interleaved({"find_matches": lambda: index.find_matches(prompt),
                       "select (compiled)": lambda: compiled.select(prompt),
                       "select (Python path)": lambda: python.select(prompt)}, iters, repeat)
    b50, b99 = got["find_matches"]
    print(f"\n1. select ÷ find_matches, 64 workers with overlaps 0..504 blocks, {index.num_blocks():,} entries, "
          f"{PROMPT_TOKENS}-token prompt (µs, best of {repeat})")
    for name, (p50, p99) in got.items():
        print(f"  {name:22} p50 {p50:8.1f}  p99 {p99:8.1f}   ÷ find_matches p50 {p50 / b50:5.2f}  p99 {p99 / b99:5.2f}")
    print(f"  target: select (compiled) ÷ find_matches <= 1.1; now {got['select (compiled)'][0] / b50:.2f} (p50)")


def fleet_shape(n_workers: int) -> tuple[random.Random, list[int], list[WorkerKey], list[int]]:
    """The fleet figure's seeded prompt, workers and prefix depths (and the generator, drawn on after them)."""
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    workers = [WorkerKey(f"engine-{i // 8}", i % 8) for i in range(n_workers)]
    full = PROMPT_TOKENS // BS
    depths = [full if i == 0 else (rng.randint(1, full) if i < n_workers // 4 else 0) for i in range(n_workers)]
    return rng, prompt, workers, depths


def fleet_calls(index: PrefixIndex, rng: random.Random, prompt: list[int],
                workers: list[WorkerKey]) -> dict[str, Callable[[], object]]:
    """The fleet figure's calls on ``index``, by name (routers and states built once, here)."""
    idle = Router(index, seed=0)
    busy = Router(index, seed=0)
    python = Router(index, cost=PythonPath(), seed=0)
    for i, w in enumerate(workers):
        for j in range(4):
            busy.on_start((i, j), w, prompt[: rng.randrange(256, 4096)])
    client = Router(index, states=ClientLikeStates(workers), seed=0)
    per_status = Router(index, states=ClientLikeStates(workers, vouching=False), seed=0)
    loads = KvEventClient(index=index).engine_loads  # the client's own record table (never started here)
    with warnings.catch_warnings():
        # the gateway transport builds these records; a bench can only name their class as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        EngineLoad = kvroute.EngineLoad
    # the same, each engine also reporting its KV-cache usage (as vLLM and SGLang always do: priced
    # by `CostModel.eviction`)
    used = KvEventClient(index=index).engine_loads
    now = time.monotonic()
    for i, w in enumerate(workers):
        loads.update(w, EngineLoad(running_requests=4, waiting_requests=i % 3, waiting_uncached_tokens=(i % 7) * 512,
                                   received=now))
        used.update(w, EngineLoad(running_requests=4, waiting_requests=i % 3, waiting_uncached_tokens=(i % 7) * 512,
                                  token_usage=0.05 + (i % 10) / 20, received=now))
    reporting = Router(index, states=ClientLikeStates(workers, loads), seed=0)
    reporting_usage = Router(index, states=ClientLikeStates(workers, used), seed=0)
    tick = [0]

    def select_reported(router: Router = reporting, table: object = loads) -> object:
        # one engine's record refreshed per call, as a stream of load reports does
        tick[0] += 1
        w = workers[tick[0] % len(workers)]
        usage = 0.05 + (tick[0] % 10) / 20 if table is used else 0.0
        table.update(w, EngineLoad(running_requests=4, waiting_requests=tick[0] % 3,  # type: ignore[attr-defined]
                                   waiting_uncached_tokens=(tick[0] % 7) * 512, token_usage=usage,
                                   received=time.monotonic()))
        return router.select(prompt)

    return {"find_matches": lambda: index.find_matches(prompt),
            "select, idle fleet": lambda: idle.select(prompt),
            "select, loaded fleet": lambda: busy.select(prompt),
            "select, Python path": lambda: python.select(prompt),
            "select, client states": lambda: client.select(prompt),
            "select, status per wkr": lambda: per_status.select(prompt),
            "select, client+loads": select_reported,
            "select, +loads+usage": lambda: select_reported(reporting_usage, used)}


def figure_fleet(iters: int, repeat: int, n_workers: int, entries: int) -> None:
    rng, prompt, workers, depths = fleet_shape(n_workers)
    index = PrefixIndex()
    t0 = time.perf_counter()
    fill(index, workers, entries, prompt, depths)
    built = time.perf_counter() - t0
    calls = fleet_calls(index, rng, prompt, workers)
    got = interleaved(calls, iters, repeat, (0.5, 0.99, 0.1, 0.9))
    # The p99 target is one call's tail: the interleaved rounds (fair for the ratios) put the Python path's
    # allocations and cache traffic between its calls, so it is also timed alone, ten times as many calls.
    alone = interleaved({"select, idle fleet": calls["select, idle fleet"]}, 10 * iters, repeat,
                        (0.5, 0.99, 0.999))["select, idle fleet"]
    print(f"\n2. {n_workers:,} workers, {index.num_blocks():,} (block, worker) entries (built in {built:.0f} s), "
          f"{PROMPT_TOKENS}-token prompt, {n_workers // 4} workers hold a prefix of it (µs, best of {repeat}; "
          "p10 and p90 beside p50 and p99, which a loaded machine's preemptions set)")
    b50 = got["find_matches"][0]
    for name, (p50, p99, p10, p90) in got.items():
        print(f"  {name:22} p10 {p10:8.1f}  p50 {p50:8.1f}  p90 {p90:8.1f}  p99 {p99:8.1f}   "
              f"÷ find_matches p50 {p50 / b50:5.2f}")
    p50_idle = got["select, idle fleet"][0]
    print(f"  this machine: {tick_floor(p50_idle)}")
    print(f"  select, idle fleet, alone ({10 * iters:,} calls a round): p50 {alone[0]:.1f}  p99 {alone[1]:.1f}  "
          f"p99.9 {alone[2]:.1f}")
    print(f"  target: select p99 <= 100 µs; now idle {alone[1]:.0f} µs alone, {got['select, idle fleet'][1]:.0f} µs "
          "interleaved; "
          f"loaded {got['select, loaded fleet'][1]:.0f} µs, with client states "
          f"{got['select, client states'][1]:.0f} µs, client states and engine loads "
          f"{got['select, client+loads'][1]:.0f} µs")
    print(f"  target: client states and engine loads ÷ find_matches p50 <= 1.3; now "
          f"{got['select, client+loads'][0] / b50:.2f} (with usage reported too "
          f"{got['select, +loads+usage'][0] / b50:.2f})")


# The calls the alternated fleet figure times (`--baseline`): the match, an idle fleet's select, and the
# production path with every engine reporting load.
ALTERNATED = ("find_matches", "select, idle fleet", "select, client states", "select, client+loads")


def fleet_child(snapshot: str, n_workers: int, iters: int, repeat: int) -> None:
    """One build's fleet figures from ``snapshot``, printed as JSON: per call, wall p10 / p50 / p99 and thread
    CPU p10 (µs), each the best of ``repeat`` rounds of ``iters`` interleaved calls."""
    rng, prompt, workers, _ = fleet_shape(n_workers)
    index = PrefixIndex.restore(snapshot)
    calls = {n: f for n, f in fleet_calls(index, rng, prompt, workers).items() if n in ALTERNATED}
    best: dict[str, list[float]] = {}
    for _ in range(repeat):
        gc.collect()
        wall: dict[str, list[float]] = {n: [] for n in calls}
        cpu: dict[str, list[float]] = {n: [] for n in calls}
        for _ in range(iters):
            for name, fn in calls.items():
                c0 = time.thread_time()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                cpu[name].append(time.thread_time() - c0)
                wall[name].append(t1 - t0)
        for name in calls:
            now = [pct(wall[name], 0.1) * 1e6, pct(wall[name], 0.5) * 1e6, pct(wall[name], 0.99) * 1e6,
                   pct(cpu[name], 0.1) * 1e6]
            best[name] = now if name not in best else [min(a, b) for a, b in zip(best[name], now)]
    print(json.dumps({"entries": index.num_blocks(), "figures": best}))


def figure_fleet_alternated(baseline: str, rounds: int, iters: int, repeat: int, n_workers: int, entries: int,
                            snapshot: str | None) -> None:
    """The fleet figure, this build against ``baseline`` (another venv's Python), one child per build per round,
    in alternating order, both restoring one snapshot of the fleet (built here unless ``snapshot`` exists)."""
    path = snapshot or os.path.join(tempfile.gettempdir(), f"bench_select_fleet_{n_workers}_{entries}.snap")
    if not os.path.exists(path):
        _, prompt, workers, depths = fleet_shape(n_workers)
        index = PrefixIndex()
        t0 = time.perf_counter()
        fill(index, workers, entries, prompt, depths)
        index.snapshot(path)
        print(f"fleet built and written to {path} in {time.perf_counter() - t0:.0f} s", flush=True)
        del index
    builds = {"this": sys.executable, "baseline": baseline}
    cmd = [os.path.abspath(__file__), "--child-fleet", path, "--workers", str(n_workers), "--iters", str(iters),
           "--repeat", str(repeat)]
    got: dict[str, list[dict[str, list[float]]]] = {"this": [], "baseline": []}
    print(f"\n2'. {n_workers:,} workers, {entries:,} entries, this build and the baseline alternated, {rounds} rounds "
          f"of one child each (best of {repeat} x {iters} interleaved calls; µs: wall p10 / p50 / p99, thread CPU p10)")
    for r in range(rounds):
        order = ["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]
        loads = []
        for name in order:
            loads.append(os.getloadavg()[0])
            res = subprocess.run([builds[name], *cmd], capture_output=True, text=True, check=True)
            got[name].append(json.loads(res.stdout)["figures"])
        print(f"round {r + 1} ({order[0]} first; load average {loads[0]:.1f}, {loads[1]:.1f}):")
        for call in ALTERNATED:
            t, b = got["this"][-1][call], got["baseline"][-1][call]
            print(f"  {call:22} this {t[0]:6.1f} / {t[1]:6.1f} / {t[2]:6.1f}, cpu {t[3]:6.1f}   "
                  f"baseline {b[0]:6.1f} / {b[1]:6.1f} / {b[2]:6.1f}, cpu {b[3]:6.1f}   "
                  f"this ÷ baseline p50 {t[1] / b[1]:.3f} cpu p10 {t[3] / b[3]:.3f}", flush=True)
    print("median over rounds (this / baseline): p50, p99, thread CPU p10; ratio to find_matches p50")
    for call in ALTERNATED:
        row = []
        for name in ("this", "baseline"):
            med = [statistics.median(x[call][i] for x in got[name]) for i in range(4)]
            fm = statistics.median(x["find_matches"][1] for x in got[name])
            row.append(f"{med[1]:6.1f} / {med[2]:6.1f} / {med[3]:6.1f} ({med[1] / fm:.2f}x)")
        print(f"  {call:22} this {row[0]}   baseline {row[1]}")


def figure_ingest(seconds: float, repeat: int) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    index = PrefixIndex()
    for i in range(64):
        n = rng.randrange(0, 64)
        if n:
            index.apply(WorkerKey(f"w{i}", 0), BlockStored(block_hashes=[i << 32 | j for j in range(n)],
                                                           token_ids=prompt[: n * BS], block_size=BS))
    router = Router(index, seed=1)
    streams = [[(WorkerKey(f"ingest{t}-{w.worker_id}", w.dp_rank), p) for w, p, _ in make_stream(60_000, 8, 20 + t)]
               for t in range(2)]

    def select_p99(duration: float, r: Router) -> tuple[float, int, float]:
        xs = []
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            r.select(prompt)
            xs.append(time.perf_counter() - t0)
        return pct(xs, 0.99), len(xs), pct(xs, 0.5)

    def ingest(t: int, stop: threading.Event, applied: list[int]) -> None:
        while not stop.is_set():
            for w, p in streams[t]:
                if stop.is_set():
                    return
                index.apply_payload(w, p)
                applied[t] += 1
            for w, _ in streams[t]:
                index.remove_worker(w)

    def querying(stop: threading.Event, done: list[int], shared: bool) -> None:
        # its own Router on the shared index, or the measured one (one Router serves several threads)
        r = router if shared else Router(index, seed=2)
        while not stop.is_set():
            r.select(prompt)
            done[0] += 1

    print(f"\n3. select p99 while two threads ingest via apply_payload ÷ idle p99, 64 workers, "
          f"{PROMPT_TOKENS}-token prompt ({seconds:.1f} s a round, best of {repeat})")
    cases = (("ingest only", 0, False), ("ingest + 2 threads selecting", 2, False),
             ("ingest + 2 threads, same Router", 2, True))
    for label, extra_queriers, shared in cases:
        ratios = []
        for _ in range(repeat):
            idle, n_idle, idle50 = select_p99(seconds, router)
            stop = threading.Event()
            applied = [0, 0]
            queried = [0]
            threads = [threading.Thread(target=ingest, args=(t, stop, applied)) for t in range(2)]
            threads += [threading.Thread(target=querying, args=(stop, queried, shared)) for _ in range(extra_queriers)]
            for th in threads:
                th.start()
            busy, n_busy, busy50 = select_p99(seconds, router)
            stop.set()
            for th in threads:
                th.join()
            ratios.append((busy / idle, idle, busy, n_idle, n_busy, sum(applied), queried[0], idle50, busy50))
        r, idle, busy, n_idle, n_busy, n_applied, n_q, idle50, busy50 = min(ratios)
        print(f"  {label:30} idle p50 {idle50 * 1e6:4.0f} p99 {idle * 1e6:6.0f} µs ({n_idle} selects), "
              f"busy p50 {busy50 * 1e6:4.0f} p99 {busy * 1e6:6.0f} µs "
              f"({n_busy} selects, {n_applied} payloads applied, {n_q} selects by other threads): "
              f"ratio {r:.2f} (all rounds: {', '.join(f'{x[0]:.2f}' for x in ratios)})")
        print(f"    busy, this machine: {tick_floor(busy50 * 1e6)}")
    print("  target: <= 3")


def main() -> None:
    """Parse the options and print every figure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller fleets and fewer calls (a smoke run)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per figure, the best kept (default 3)")
    ap.add_argument("--only", choices=["ratio", "fleet", "ingest"], nargs="*", help="run only these figures")
    ap.add_argument("--baseline", help="another build's Python (its venv's bin/python): run the fleet figure "
                    "for both builds, alternated, restoring one snapshot of the fleet (--rounds of them)")
    ap.add_argument("--rounds", type=int, default=4, help="alternations with --baseline (default 4)")
    ap.add_argument("--snapshot", help="with --baseline: the fleet's snapshot file (written when missing)")
    ap.add_argument("--iters", type=int, default=1000, help="calls per round with --baseline (default 1000)")
    ap.add_argument("--workers", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--child-fleet", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_fleet:
        fleet_child(args.child_fleet, args.workers, args.iters, args.repeat)
        return
    q = args.quick
    if args.baseline:
        fleet_alternated_entries = 100_000 if q else 1_000_000
        figure_fleet_alternated(args.baseline, args.rounds, args.iters, args.repeat, 128 if q else 1024,
                                fleet_alternated_entries, args.snapshot)
        return
    only = set(args.only or ["ratio", "fleet", "ingest"])
    if "ratio" in only:
        figure_ratio(50 if q else 400, args.repeat, 64 * 600 if q else 256_000)
    if "fleet" in only:
        figure_fleet(50 if q else 300, args.repeat, 128 if q else 1024, 100_000 if q else 1_000_000)
    if "ingest" in only:
        figure_ingest(0.5 if q else 2.0, args.repeat)


if __name__ == "__main__":
    main()
