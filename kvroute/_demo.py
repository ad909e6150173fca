"""``kvroute demo``: simulated engines, a shared-prefix workload, kvroute against round-robin and random.

For each policy the demo starts a fresh, identical fleet of `SimEngine`s on loopback (a mix of
vLLM- and SGLang-style engines, some with 2 data-parallel ranks), finds them only through their
gRPC discovery servers, subscribes with a `KvEventClient`, waits until every source is synced,
then sends the workload. Arrivals follow the workload's times (a conversation's next turn also
waits for the previous one to finish); every request is its own task, so requests overlap and
load matters. A policy picks the worker (``kvroute``: `Router.select`, with its load tracking;
``round_robin`` / ``random``: the baselines), the request runs through the engine's real serving
path (`SimEngine.complete`), and the engine reports what it found cached and how long it took.
The router learns only from the engines' ZMQ events. A request that dies with a restarting
engine is routed again (at most `_ATTEMPTS` times).

``faults=True`` injects, at the same points of every policy's run, live-message drops on one
engine (recovered through replay) and a restart of another (its index state is reset and
rebuilt), and reports when kvroute noticed and when the worker was synced again.

`run_demo` is the programmatic entry point; `register` adds the subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, TextIO

import anyio
import msgspec

from ._client import KvEventClient
from ._errors import KvRouteError
from ._events import Envelope, Reset, Synced
from ._models import WorkerKey
from ._router import Router
from ._subscriber import SubscriberConfig
from ._workload import (
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    read_mooncake_trace,
)
from .sim._cache import CapacityError, InvalidRequestError
from .sim._engine import RequestAbortedError, SimConfig, SimEngine

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

__all__ = [
    "POLICIES",
    "DemoOptions",
    "DemoResult",
    "FaultNote",
    "PolicyResult",
    "RequestRecord",
    "plot",
    "register",
    "render",
    "run_demo",
]

POLICIES = ("kvroute", "round_robin", "random")

# The fleet's shape, cycled: (engine style, data-parallel ranks). Both engines, both rank counts.
_FLEET = (("vllm", 2), ("sglang", 1), ("vllm", 1), ("sglang", 2))
# A request that died with its engine (restart) is routed again, as an HTTP router retries a 503.
_ATTEMPTS = 3
# Synthetic default: enough requests for conversations to come back several times, few enough
# to finish three policies in ~30 s on two slow cores (the budget is 60 s).
_DEFAULT_REQUESTS = 600
# 1,024 blocks of 16 tokens (16k tokens) per rank: about ten conversations' worth, so caches
# evict and where a prefix went matters; trace prompts are longer (Mooncake's average ~8k).
_SYNTHETIC_CAPACITY = 1024
_TRACE_CAPACITY = 8192
# Columns of rich output written to a file or pipe (rich's default there, 80, wraps the table).
_LOG_WIDTH = 120
# Sliding window (completions) of the live hit rate in the plot.
_PLOT_WINDOW = 50


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `run_demo` runs; every field has a default (the README's first command).

    ``engines``: engines per fleet (cycling vLLM with 2 ranks, SGLang, vLLM, SGLang with 2 ranks).
    ``requests``: synthetic requests (default 600), or the first N trace records (default all).
    ``trace``: a Mooncake JSON-lines trace to replay instead of the synthetic workload, each
    hash id expanded to ``trace_block_tokens`` tokens, inter-arrivals divided by ``speedup``.
    ``rate``: synthetic arrivals per second. ``max_tokens``: output tokens per synthetic
    request, and the cap on a trace's output lengths. ``capacity_blocks``: KV blocks per rank
    (default 1,024 synthetic, 8,192 for a trace). ``quiet_interval``: the subscriber's probe
    interval (design.md rules 7-8; short, so a restart is noticed within the run).
    """

    engines: int = 4
    requests: int | None = None
    seed: int = 0
    faults: bool = False
    policies: tuple[str, ...] = POLICIES
    trace: str | None = None
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    speedup: float = 1.0
    rate: float = WorkloadConfig().rate
    max_tokens: int = 16
    block_size: int = 16
    capacity_blocks: int | None = None
    quiet_interval: float = 0.5
    sync_timeout: float = 20.0

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"--engines must be >= 1, not {self.engines}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, not {self.requests}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct names among {', '.join(POLICIES)}, not {self.policies}")
        if self.block_size < 1 or self.trace_block_tokens % self.block_size:
            raise ValueError(
                f"the trace block ({self.trace_block_tokens} tokens) must be a multiple of the engines' block size"
                f" ({self.block_size}), so equal hash ids fill equal engine blocks"
            )
        if self.max_tokens < 1 or (self.capacity_blocks is not None and self.capacity_blocks < 1):
            raise ValueError("max_tokens and capacity_blocks must be >= 1")
        if not (self.speedup > 0 and self.rate > 0 and self.quiet_interval > 0 and self.sync_timeout > 0):
            raise ValueError("speedup, rate, quiet_interval and sync_timeout must be > 0")


class FaultNote(msgspec.Struct, frozen=True, kw_only=True):
    """One injected fault: when (seconds into the run), where, what, and how recovery went.

    ``detected_after``: seconds until the client reset the worker (restarts); ``synced_after``:
    seconds until every rank of the engine was synced again (None: not within the run).
    """

    t: float
    engine: str
    action: str
    detected_after: float | None = None
    synced_after: float | None = None


class PolicyResult(msgspec.Struct, frozen=True, kw_only=True):
    """One policy's figures. Times in seconds unless the name says ``_us`` (microseconds).

    ``hit_rate``: prompt tokens the engines found cached / prompt tokens; ``prefill_tokens``:
    prompt tokens computed. TTFT and latency are the engines' (queueing included).
    ``load_imbalance``: requests on the busiest worker / mean per worker (1.0 is even).
    ``decision_*_us``: measured wall time of the policy's ``select``. ``index_*``: the client's
    index at the end: (block, worker) entries, deep memory size; ``engine_blocks``: what the
    engines' caches hold then (the index is a subset: equal wherever replay covered losses).
    ``batches_applied`` / ``blocks_stored``: events applied to the index, live or replayed.
    """

    policy: str
    requests: int
    completed: int
    failed: int
    retried: int
    rejected: int
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    load_imbalance: float
    decision_p50_us: float
    decision_p99_us: float
    index_blocks: int
    index_memory_bytes: int
    engine_blocks: int
    batches_applied: int
    blocks_stored: int
    gaps: int
    replays: int
    replayed_batches: int
    resets: int
    partial_workers: int
    workers: int
    wall_time: float
    faults: list[FaultNote] = msgspec.field(default_factory=list)


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request: when it finished (seconds into the run), where, and what it cost."""

    id: int
    done: float
    worker: WorkerKey
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    kind: str


class DemoResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `run_demo` returns: per-policy results (in run order), per-request records, the workload's shape."""

    policies: dict[str, PolicyResult]
    records: dict[str, list[RequestRecord]]
    workload: dict[str, int]
    wall_time: float


# --- policies -------------------------------------------------------------------------------------


class _Policy(Protocol):
    def choose(self, request_id: object, token_ids: Sequence[int]) -> WorkerKey: ...

    def finished(self, request_id: object) -> None: ...


class _KvRoutePolicy:
    def __init__(self, router: Router) -> None:
        self._router = router

    def choose(self, request_id: object, token_ids: Sequence[int]) -> WorkerKey:
        return self._router.select(token_ids, request_id=request_id).worker

    def finished(self, request_id: object) -> None:
        self._router.on_finish(request_id)


class _RoundRobinPolicy:
    def __init__(self, client: KvEventClient) -> None:
        self._client = client
        self._next = 0

    def choose(self, request_id: object, token_ids: Sequence[int]) -> WorkerKey:
        workers = sorted(self._client.live_workers())
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker

    def finished(self, request_id: object) -> None:
        return None


class _RandomPolicy:
    def __init__(self, client: KvEventClient, seed: int) -> None:
        self._client = client
        self._rng = random.Random(seed)

    def choose(self, request_id: object, token_ids: Sequence[int]) -> WorkerKey:
        return self._rng.choice(sorted(self._client.live_workers()))

    def finished(self, request_id: object) -> None:
        return None


# --- progress -------------------------------------------------------------------------------------


class _Reporter(Protocol):
    def start(self, policy: str, total: int) -> None: ...

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None: ...

    def refresh(self) -> None: ...

    def stop(self) -> None: ...

    def note(self, text: str) -> None: ...


class _Silent:
    def start(self, policy: str, total: int) -> None:
        return None

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        return None

    def refresh(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def note(self, text: str) -> None:
        return None


class _PlainReporter:
    """Progress as a line per tenth of each policy's requests (no rich installed)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._total = 0
        self._shown = -1

    def start(self, policy: str, total: int) -> None:
        self._total = total
        self._shown = -1
        print(f"{policy}: {total} requests", file=self._out, flush=True)

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        tenth = done * 10 // max(1, self._total)
        if tenth > self._shown:
            self._shown = tenth
            print(
                f"  {policy}: {done}/{self._total} hit rate {hit_rate:.1%} TTFT p50 {ttft_p50 * 1e3:.0f} ms",
                file=self._out,
                flush=True,
            )

    def refresh(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def note(self, text: str) -> None:
        print(f"  {text}", file=self._out, flush=True)


class _RichReporter:
    """A rich progress bar per policy; refreshed by the demo's own task (auto_refresh would start a thread)."""

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(file=out, width=None if out.isatty() else _LOG_WIDTH)
        self._progress: Progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("hit rate {task.fields[hit]:>6}  TTFT p50 {task.fields[ttft]:>7}"),
            TimeElapsedColumn(),
            console=self.console,
            auto_refresh=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._progress.start()

    def start(self, policy: str, total: int) -> None:
        self._tasks[policy] = self._progress.add_task(policy, total=total, hit="-", ttft="-")
        self._progress.refresh()

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        self._progress.update(
            self._tasks[policy], completed=done, hit=f"{hit_rate:.1%}", ttft=f"{ttft_p50 * 1e3:.0f} ms"
        )

    def refresh(self) -> None:
        self._progress.refresh()

    def stop(self) -> None:
        self._progress.refresh()
        self._progress.stop()

    def note(self, text: str) -> None:
        self._progress.console.print(f"  {text}", highlight=False)


def _reporter(out: TextIO, quiet: bool) -> _Reporter:
    if quiet:
        return _Silent()
    try:
        return _RichReporter(out)
    except ImportError:
        return _PlainReporter(out)


# --- measuring ------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


_SKIP_SIZE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _deep_size(root: object) -> int:
    """Bytes of every object reachable from ``root`` (each once), classes and functions excluded."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP_SIZE):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


class _Lifecycle(msgspec.Struct, frozen=True):
    t: float
    worker: WorkerKey
    event: str


class _Tally:
    """Running figures of one policy's run."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.decisions_ns: list[int] = []
        self.ttfts: list[float] = []
        self.latencies: list[float] = []
        self.per_worker: Counter[WorkerKey] = Counter()
        self.prompt = 0
        self.cached = 0
        self.failed = 0
        self.retried = 0
        self.rejected = 0

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


# --- one policy's run -----------------------------------------------------------------------------


def _fleet(options: DemoOptions, capacity: int) -> list[SimConfig]:
    configs = []
    for i in range(options.engines):
        engine, ranks = _FLEET[i % len(_FLEET)]
        configs.append(
            SimConfig(
                engine="vllm" if engine == "vllm" else "sglang",
                name=f"{engine}-{i}",
                ranks=ranks,
                block_size=options.block_size,
                capacity_blocks=capacity,
                seed=options.seed,
            )
        )
    return configs


async def _run_policy(
    policy_name: str,
    options: DemoOptions,
    workload: Sequence[WorkloadRequest],
    capacity: int,
    reporter: _Reporter,
) -> tuple[PolicyResult, list[RequestRecord]]:
    started = time.perf_counter()
    tally = _Tally()
    lifecycle: list[_Lifecycle] = []
    faults: list[tuple[float, _Fault]] = []
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in _fleet(options, capacity)]
        by_target: dict[str, SimEngine] = {}
        for engine in engines:
            assert engine.grpc_target is not None  # gRPC is on by default
            by_target[engine.grpc_target] = engine
        config = SubscriberConfig(quiet_interval=options.quiet_interval, events_buffer=100_000)
        client = await stack.enter_async_context(KvEventClient(targets=list(by_target), config=config))
        await client.wait_synced(options.sync_timeout)
        policy: _Policy
        if policy_name == "kvroute":
            router = Router(client.index, states=client, block_size=options.block_size, seed=options.seed)
            policy = _KvRoutePolicy(router)
        elif policy_name == "round_robin":
            policy = _RoundRobinPolicy(client)
        else:
            policy = _RandomPolicy(client, options.seed)
        t0 = anyio.current_time()
        reporter.start(policy_name, len(workload))
        finished = {req.id: anyio.Event() for req in workload}

        async def record_lifecycle() -> None:
            async with client.events() as stream:
                async for env in stream:
                    if env.seq is None:
                        lifecycle.append(_Lifecycle(anyio.current_time() - t0, env.source.key, _describe(env)))

        async def refresh() -> None:
            while True:
                reporter.refresh()
                await anyio.sleep(0.25)

        async def run_request(req: WorkloadRequest) -> None:
            try:
                if req.follows is not None:
                    await finished[req.follows].wait()
                    await anyio.sleep(req.think_time)
                await _send(req)
            finally:
                finished[req.id].set()

        async def _send(req: WorkloadRequest) -> None:
            for attempt in range(_ATTEMPTS):
                rid = (req.id, attempt)
                t = time.perf_counter_ns()
                worker = policy.choose(rid, req.token_ids)
                tally.decisions_ns.append(time.perf_counter_ns() - t)
                engine = by_target[worker.worker_id]
                try:
                    done = await engine.complete(req.token_ids, req.max_tokens, rank=worker.dp_rank)
                except RequestAbortedError:
                    tally.retried += 1
                    continue
                except (CapacityError, InvalidRequestError):
                    tally.rejected += 1
                    return
                finally:
                    policy.finished(rid)
                tally.prompt += done.prompt_tokens
                tally.cached += done.cached_tokens
                tally.ttfts.append(done.ttft)
                tally.latencies.append(done.latency)
                tally.per_worker[worker] += 1
                tally.records.append(
                    RequestRecord(
                        id=req.id,
                        done=anyio.current_time() - t0,
                        worker=worker,
                        prompt_tokens=done.prompt_tokens,
                        cached_tokens=done.cached_tokens,
                        ttft=done.ttft,
                        kind=req.kind,
                    )
                )
                reporter.update(policy_name, len(tally.records), tally.hit_rate, _percentile(tally.ttfts, 50))
                return
            tally.failed += 1

        async with anyio.create_task_group() as background:
            background.start_soon(record_lifecycle)
            background.start_soon(refresh)
            async with anyio.create_task_group() as tg:
                plan = _fault_plan(engines, len(workload)) if options.faults else {}
                for i, req in enumerate(workload):
                    await anyio.sleep_until(t0 + req.arrival)
                    for fault in plan.get(i, ()):
                        at = anyio.current_time() - t0
                        faults.append((at, fault))
                        reporter.note(f"t={at:.1f}s fault: {fault.label} on {fault.engine.config.name}")
                        tg.start_soon(_inject, fault)
                    tg.start_soon(run_request, req)
            # Quiescent now: let the last batches land and every source settle before counting.
            with contextlib.suppress(TimeoutError):
                await client.wait_synced(options.sync_timeout)
            await anyio.sleep(0.1)
            stats = client.stats()
            index_memory = _deep_size(client.index)
            index_blocks = client.index.num_blocks()
            engine_blocks = sum(e.cache(r).num_cached_blocks for e in engines for r in range(e.config.ranks))
            workers = len(client.live_workers())
            background.cancel_scope.cancel()
    reporter.update(policy_name, len(tally.records), tally.hit_rate, _percentile(tally.ttfts, 50))
    totals = stats.totals
    mean_load = sum(tally.per_worker.values()) / workers if workers else 0.0
    result = PolicyResult(
        policy=policy_name,
        requests=len(workload),
        completed=len(tally.records),
        failed=tally.failed,
        retried=tally.retried,
        rejected=tally.rejected,
        hit_rate=round(tally.hit_rate, 4),
        prompt_tokens=tally.prompt,
        cached_tokens=tally.cached,
        prefill_tokens=tally.prompt - tally.cached,
        ttft_p50=round(_percentile(tally.ttfts, 50), 4),
        ttft_p99=round(_percentile(tally.ttfts, 99), 4),
        latency_p50=round(_percentile(tally.latencies, 50), 4),
        latency_p99=round(_percentile(tally.latencies, 99), 4),
        load_imbalance=round(max(tally.per_worker.values(), default=0) / mean_load, 3) if mean_load else 0.0,
        decision_p50_us=round(_percentile(tally.decisions_ns, 50) / 1e3, 1),
        decision_p99_us=round(_percentile(tally.decisions_ns, 99) / 1e3, 1),
        index_blocks=index_blocks,
        index_memory_bytes=index_memory,
        engine_blocks=engine_blocks,
        batches_applied=totals.batches,
        blocks_stored=totals.blocks,
        gaps=totals.gaps,
        replays=totals.replays,
        replayed_batches=totals.replayed_batches,
        resets=totals.resets,
        partial_workers=totals.partial,
        workers=workers,
        wall_time=round(time.perf_counter() - started, 2),
        faults=[_recovery(t, fault, lifecycle) for t, fault in faults],
    )
    return result, tally.records


def _describe(env: Envelope) -> str:
    event = env.event
    if isinstance(event, Reset):
        return f"reset:{event.reason}"
    if isinstance(event, Synced):
        return "synced"
    return str(getattr(event, "kind", type(event).__name__))


class _Fault(NamedTuple):
    engine: SimEngine
    #: True: restart the engine; False: set its live-message drop rate to ``drop_rate``.
    restart: bool
    drop_rate: float = 0.0

    @property
    def label(self) -> str:
        return "restart" if self.restart else f"drop {self.drop_rate:.0%}"


def _fault_plan(engines: Sequence[SimEngine], n: int) -> dict[int, list[_Fault]]:
    """Faults keyed by the arrival index they happen at, the same for every policy.

    Engine 0 drops 30% of its live messages from 20% to 50% of the run (recovered by replay);
    at 55% another engine (the last with the most ranks) restarts: its state is gone, the client
    resets the worker and rebuilds it from the new process's events.
    """
    others = engines[1:] or engines
    victim = max(reversed(others), key=lambda e: e.config.ranks)
    plan: dict[int, list[_Fault]] = {}
    for at, fault in (
        (n * 20 // 100, _Fault(engines[0], restart=False, drop_rate=0.3)),
        (n * 50 // 100, _Fault(engines[0], restart=False, drop_rate=0.0)),
        (n * 55 // 100, _Fault(victim, restart=True)),
    ):
        plan.setdefault(at, []).append(fault)
    return plan


async def _inject(fault: _Fault) -> None:
    if fault.restart:
        await fault.engine.restart()
    else:
        fault.engine.drop_rate = fault.drop_rate


def _recovery(t: float, fault: _Fault, lifecycle: Sequence[_Lifecycle]) -> FaultNote:
    engine = fault.engine
    name = engine.config.name
    if not fault.restart:
        return FaultNote(t=round(t, 3), engine=name, action=fault.label)
    target = engine.grpc_target
    ranks = set(range(engine.config.ranks))
    detected: float | None = None
    synced: dict[int, float] = {}
    for item in lifecycle:
        if item.t < t or item.worker.worker_id != target:
            continue
        if item.event.startswith("reset") and detected is None:
            detected = item.t - t
        elif item.event == "synced" and detected is not None and item.worker.dp_rank not in synced:
            synced[item.worker.dp_rank] = item.t - t
    back = max(synced.values()) if set(synced) == ranks else None
    return FaultNote(
        t=round(t, 3),
        engine=name,
        action=fault.label,
        detected_after=round(detected, 3) if detected is not None else None,
        synced_after=round(back, 3) if back is not None else None,
    )


# --- the whole demo -------------------------------------------------------------------------------


def _workload(options: DemoOptions) -> tuple[list[WorkloadRequest], int]:
    if options.trace is not None:
        workload = read_mooncake_trace(
            options.trace,
            block_tokens=options.trace_block_tokens,
            limit=options.requests,
            speedup=options.speedup,
            max_tokens=options.max_tokens,
        )
        return workload, options.capacity_blocks or _TRACE_CAPACITY
    config = WorkloadConfig(
        requests=options.requests or _DEFAULT_REQUESTS,
        seed=options.seed,
        rate=options.rate,
        max_tokens=options.max_tokens,
    )
    return generate_workload(config), options.capacity_blocks or _SYNTHETIC_CAPACITY


async def run_demo(
    options: DemoOptions | None = None, *, out: TextIO | None = None, progress: bool = False
) -> DemoResult:
    """Run the demo (module docstring) and return every policy's figures.

    With ``progress`` a live progress display (rich when installed) goes to ``out`` (stdout).
    Raises `TraceError` for an unreadable trace and `KvRouteError` subclasses from the
    components; engines and clients are closed whatever happens.
    """
    options = options or DemoOptions()
    workload, capacity = _workload(options)
    reporter = _reporter(out or sys.stdout, quiet=not progress)
    started = time.perf_counter()
    results: dict[str, PolicyResult] = {}
    records: dict[str, list[RequestRecord]] = {}
    try:
        for name in options.policies:
            results[name], records[name] = await _run_policy(name, options, workload, capacity, reporter)
    finally:
        reporter.stop()
    kinds = Counter(r.kind for r in workload)
    shape = {"requests": len(workload), "prompt_tokens": sum(len(r.token_ids) for r in workload), **kinds}
    return DemoResult(
        policies=results, records=records, workload=shape, wall_time=round(time.perf_counter() - started, 2)
    )


# --- output ---------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]  # int becomes float on purpose
    return f"{n:.1f} GiB"


_ROWS: tuple[tuple[str, Callable[[PolicyResult], str]], ...] = (
    ("prefix-cache hit rate", lambda r: f"{r.hit_rate:.1%}"),
    ("prefill tokens computed", lambda r: f"{r.prefill_tokens:,}"),
    ("TTFT p50 / p99 (simulated)", lambda r: f"{r.ttft_p50 * 1e3:.0f} / {r.ttft_p99 * 1e3:.0f} ms"),
    ("latency p50 / p99", lambda r: f"{r.latency_p50 * 1e3:.0f} / {r.latency_p99 * 1e3:.0f} ms"),
    ("load imbalance (max/mean)", lambda r: f"{r.load_imbalance:.2f}"),
    ("decision p50 / p99 (measured)", lambda r: f"{r.decision_p50_us:.0f} / {r.decision_p99_us:.0f} µs"),
    ("index blocks (engines hold)", lambda r: f"{r.index_blocks:,} ({r.engine_blocks:,})"),
    ("index memory", lambda r: _fmt_bytes(r.index_memory_bytes)),
    ("events applied (batches / blocks)", lambda r: f"{r.batches_applied:,} / {r.blocks_stored:,}"),
    ("gaps / replays / resets", lambda r: f"{r.gaps} / {r.replays} / {r.resets}"),
    ("completed / retried / failed", lambda r: f"{r.completed} / {r.retried} / {r.failed + r.rejected}"),
    ("wall time", lambda r: f"{r.wall_time:.1f} s"),
)


def render(result: DemoResult, out: TextIO) -> None:
    """Print the results table (and the fault recovery, if any) to ``out``; rich when installed."""
    policies = list(result.policies.values())
    header = ["", *(p.policy for p in policies)]
    rows = [[label, *(fmt(p) for p in policies)] for label, fmt in _ROWS]
    fault_lines = [
        f"{p.policy}: t={f.t:.1f}s {f.action} {f.engine}"
        + (f" → reset after {f.detected_after * 1e3:.0f} ms" if f.detected_after is not None else "")
        + (f", synced again after {f.synced_after * 1e3:.0f} ms" if f.synced_after is not None else "")
        for p in policies
        for f in p.faults
    ]
    shape = ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in result.workload.items())
    title = f"kvroute demo — {shape}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        print(title, file=out)
        for row in [header, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)), file=out)
        for line in fault_lines:
            print(line, file=out)
    else:
        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console = Console(file=out, width=None if out.isatty() else _LOG_WIDTH)
        console.print(table)
        for line in fault_lines:
            console.print(line, highlight=False)
    summary = _summary(result)
    if summary:
        print(summary, file=out)


def _summary(result: DemoResult) -> str:
    kv = result.policies.get("kvroute")
    others = [p for p in result.policies.values() if p.policy != "kvroute"]
    if kv is None or not others:
        return ""
    best = max(others, key=lambda p: p.hit_rate)
    ttft = f"TTFT p50 {kv.ttft_p50 * 1e3:.0f} ms vs {best.ttft_p50 * 1e3:.0f} ms" if best.ttft_p50 else ""
    return (
        f"kvroute: {kv.hit_rate:.1%} of prompt tokens cached vs {best.hit_rate:.1%} for {best.policy}"
        f" ({best.prefill_tokens - kv.prefill_tokens:,} fewer tokens prefilled); {ttft}."
        f" Total {result.wall_time:.1f} s."
    )


def plot(result: DemoResult, path: str) -> None:
    """Save hit rate and TTFT over time per policy to ``path`` (matplotlib, imported here: the demo extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, recs in result.records.items():
        ordered = sorted(recs, key=lambda r: r.done)
        times, hits, ttfts = [], [], []
        for i in range(len(ordered)):
            window = ordered[max(0, i - _PLOT_WINDOW + 1) : i + 1]
            prompt = sum(r.prompt_tokens for r in window)
            times.append(ordered[i].done)
            hits.append(100.0 * sum(r.cached_tokens for r in window) / prompt if prompt else 0.0)
            ttfts.append(1e3 * _percentile([r.ttft for r in window], 50))
        ax_hit.plot(times, hits, label=name)
        ax_ttft.plot(times, ttfts, label=name)
    first = next(iter(result.policies.values()), None)
    for fault in first.faults if first is not None else ():
        for ax in (ax_hit, ax_ttft):
            ax.axvline(fault.t, color="grey", linestyle=":", linewidth=1)
        ax_hit.annotate(f"{fault.action} {fault.engine}", (fault.t, 2), rotation=90, fontsize=7, color="grey")
    ax_hit.set_ylabel(f"hit rate, % (last {_PLOT_WINDOW} requests)")
    ax_ttft.set_ylabel(f"TTFT p50, ms (last {_PLOT_WINDOW})")
    ax_ttft.set_xlabel("seconds into the run")
    ax_hit.legend()
    ax_hit.grid(alpha=0.3)
    ax_ttft.grid(alpha=0.3)
    fig.suptitle("kvroute demo: prefix-cache hit rate and time to first token per routing policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI ------------------------------------------------------------------------------------------

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand to the ``kvroute`` parser."""
    p = sub.add_parser(
        "demo",
        help="route a shared-prefix workload over simulated engines: kvroute vs round-robin vs random",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--engines", type=int, default=4, help="simulated engines per policy (default 4: 6 workers)")
    p.add_argument("--requests", type=int, default=None, help="requests (default 600; with --trace: all records)")
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed (default 0)")
    p.add_argument("--faults", action="store_true", help="inject message drops and an engine restart mid-run")
    p.add_argument("--plot", metavar="FILE.png", help="save hit rate and TTFT over time per policy (matplotlib)")
    p.add_argument("--trace", metavar="FILE.jsonl", help="replay a Mooncake-format trace instead")
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="tokens per trace hash id (default 512, Mooncake's)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="divide the trace's inter-arrival times (default 1)")
    p.add_argument("--rate", type=float, default=WorkloadConfig().rate, help="synthetic arrivals per second")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (trace: the cap)")
    p.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per rank (default 1024; trace 8192)")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated policies to run, in order (default {','.join(POLICIES)})",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object keyed by policy")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        options = DemoOptions(
            engines=args.engines,
            requests=args.requests,
            seed=args.seed,
            faults=args.faults,
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            trace=args.trace,
            trace_block_tokens=args.trace_block_tokens,
            speedup=args.speedup,
            rate=args.rate,
            max_tokens=args.max_tokens,
            capacity_blocks=args.capacity_blocks,
        )
    except ValueError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = anyio.run(lambda: run_demo(options, progress=not args.json))
    except (TraceError, KvRouteError, OSError, TimeoutError) as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        sys.stdout.write(msgspec.json.encode(result.policies).decode() + "\n")
    else:
        render(result, sys.stdout)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            print("kvroute demo: --plot needs matplotlib: pip install 'kvroute[demo]'", file=sys.stderr)
            return EXIT_FAILED
        if not args.json:
            print(f"plot saved to {args.plot}")
    return EXIT_OK
