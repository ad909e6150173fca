"""Running ``kvroute demo``: simulated engines, a shared-prefix workload, kvroute against an oracle and baselines.

For each policy the demo starts a fresh, identical fleet of simulated engines on loopback (a mix of
vLLM- and SGLang-style engines, some with 2 data-parallel ranks), finds them only through their gRPC
discovery servers, subscribes with a KvEventClient, waits until every source is synced, then sends
the workload. Arrivals follow the workload's times (a conversation's next turn also waits for the
previous one to finish); every request is its own task, so requests overlap and load matters. The
policies: kvroute (the Router, learning only from the engines' KV events, with its load tracking);
oracle (the same cost model over the engines' true caches and the prompts they are computing);
session_affinity (consistent hashing of the prompt's first 1,024 tokens); least_load (fewest
requests in flight); round_robin and random. A request that dies with a restarting engine is routed
again (at most 3 times). Hit rates are given as a share of the oracle's (capacity-aware: this
fleet's caches, evictions and timing) and of the workload's infinite-cache bound (every earlier
prompt cached; no router can do better). Requests run concurrently, so two runs with the same
--seed place some requests differently and their figures differ by a few percent.

``faults=True`` injects, at the same points of every policy's run, live-message drops on one
engine (recovered through replay) and a restart of another (its index state is reset and
rebuilt), and reports when kvroute noticed and when the worker was synced again.

`run_demo` is the programmatic entry point; `_demo_report` renders what it returns.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from functools import partial
from typing import NamedTuple, Protocol, TextIO

import anyio
import msgspec

from kvroute import CostModel, Envelope, KvEventClient, Reset, SubscriberConfig, Synced, WorkerKey
from kvroute._load import EngineLoads, LoadPolicy, follow_engine_metrics
from kvroute.sim import CapacityError, Completion, InvalidRequestError, RequestAbortedError, SimConfig, SimEngine

from ._demo_policies import EXTRA_POLICIES, KVROUTE_POLICIES, POLICIES, Policy, make_policy
from ._demo_replica import LOAD_MODES, ReplicaPolicy, index_digest, nats_server
from ._demo_report import (
    DemoResult,
    FaultNote,
    PolicyResult,
    Reporter,
    RequestRecord,
    load_imbalance,
    make_reporter,
    percentile,
    with_oracle_shares,
)
from ._workload import (
    MOONCAKE_BLOCK_TOKENS,
    TRACE_SHAPES,
    WorkloadConfig,
    WorkloadRequest,
    distinct_blocks,
    generate_mooncake_trace,
    generate_workload,
    reachable_hits,
    read_mooncake_trace,
    trace_requests,
)

__all__ = ["POLICIES", "DemoOptions", "run_demo"]

# The fleet's shape, cycled: (engine style, data-parallel ranks). Both engines, both rank counts.
_FLEET = (("vllm", 2), ("sglang", 1), ("vllm", 1), ("sglang", 2))
# A request that died with its engine (restart) is routed again, as an HTTP router retries a 503.
_ATTEMPTS = 3
# Synthetic default: enough requests for conversations to come back several times, few enough
# to finish the six policies in ~60 s on two idle cores (115 s measured on two shared, loaded ones).
_DEFAULT_REQUESTS = 600
# 1,024 blocks of 16 tokens (16k tokens) per rank: about ten conversations' worth, so caches
# evict and where a prefix went matters.
_SYNTHETIC_CAPACITY = 1024
# A trace models production GPUs: 32,768 blocks of 16 tokens (512k tokens) per rank is what an
# 80 GB GPU serving an 8B model with grouped-query attention keeps (128 KiB per token). Mooncake's
# prompts average ~12k tokens: 8,192 blocks held ~10 of them, too few for the trace's reuse
# (minutes apart) to survive eviction.
_TRACE_CAPACITY = 32768
# A generated trace (--trace-shape) is a minute or two of one fleet's traffic, whose reuse comes 1-60 s
# apart. At 32,768 blocks per rank the fleet held twice everything the trace ever computed: nothing was
# evicted, session affinity sat at the infinite-cache bound and no policy could be told apart from it on
# hits. The demo's fleet carries the trace's 7-10 % load; a production rank runs several times busier, so
# its cache turns over within its sessions' reuse distance. The default scales the cache down instead:
# the fleet holds this share of the trace's distinct blocks (docs/routing-quality.md) ...
_TRACE_SHAPE_CACHE_SHARE = 0.5
# ... but a rank always holds this many mean-sized requests (prompt and output), so admission (a request
# waiting for free blocks) does not become the bottleneck where a real rank would still admit.
_TRACE_SHAPE_MIN_REQUESTS = 8
# A trace replays 10x faster than recorded, engines included (`DemoOptions.speedup`): minutes of
# trace in a demo's time, at the load the trace put on its fleet.
_TRACE_SPEEDUP = 10.0
# Records of a generated trace (--trace-shape): a minute or two of trace, ~15 s of demo per policy.
_DEFAULT_TRACE_RECORDS = 400
# Run names of kvroute with --replicas: kvroute_x<N>_<load>_load, one per `LOAD_MODES` entry.
_REPLICATED = "kvroute_x"


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `run_demo` runs; every field has a default (the README's first command).

    ``engines``: engines per fleet (cycling vLLM with 2 ranks, SGLang, vLLM, SGLang with 2 ranks).
    ``requests``: synthetic requests (default 600), or the first N trace records (default all).
    ``trace``: a Mooncake JSON-lines trace to replay instead of the synthetic workload, each
    hash id expanded to ``trace_block_tokens`` tokens. ``trace_shape``: replay a generated
    Mooncake-format trace of that shape instead (`generate_mooncake_trace`; ``requests`` records,
    default 400). ``speedup``: a trace runs that many
    times faster than recorded (default 10): inter-arrival times and the engines' prefill and
    decode step times are all divided by it, so the fleet carries the trace's own load.
    ``rate``: synthetic arrivals per second. ``max_tokens``: output tokens per synthetic
    request, and the cap on a trace's output lengths. ``capacity_blocks``: KV blocks per rank
    (default 1,024 synthetic; 32,768 for a trace, an 80 GB GPU's worth for an 8B model; for a
    generated trace `pressure_capacity`: the fleet holds half the trace's distinct blocks, a rank at
    least 8 mean-sized requests).
    ``replicas``: with more than 1, kvroute runs as that many router processes, the requests spread
    over them (`ReplicaPolicy`), twice: pricing only their own requests, then the engines' reported
    load too; the fleet serves gateway streams (the engines' load records) for both.
    ``overlap_weight``: `CostModel.overlap_weight` of the kvroute and oracle policies (prefill
    saved against load; default the SDK's; higher keeps a conversation on its cache through more load).
    ``jetstream``: with ``replicas``, one `JetStreamRelay` follows the engines and the replicas follow its
    NATS JetStream log (`KvEventClient` on the JetStream transport); a ``nats-server`` on PATH is started
    for the run (docs/replicas.md). ``gateway_stream``: the engines serve the gateway servicer's
    ``SubscribeKvEvents`` stream (`SimConfig.gateway`) and the routers subscribe to it instead of ZMQ (not
    with ``faults``, whose drops and restarts are ZMQ faults). ``quiet_interval``: the subscriber's probe
    interval (docs/recovery.md rules 7-8; short, so a restart is noticed within the run).
    """

    engines: int = 4
    requests: int | None = None
    seed: int = 0
    faults: bool = False
    gateway_stream: bool = False
    policies: tuple[str, ...] = POLICIES
    replicas: int = 1
    trace: str | None = None
    trace_shape: str | None = None
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    speedup: float | None = None
    rate: float = WorkloadConfig().rate
    max_tokens: int = 16
    block_size: int = 16
    overlap_weight: float = CostModel().overlap_weight
    capacity_blocks: int | None = None
    jetstream: bool = False
    quiet_interval: float = 0.5
    sync_timeout: float = 20.0

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"--engines must be >= 1, not {self.engines}")
        if self.trace is not None and self.trace_shape is not None:
            raise ValueError("--trace and --trace-shape are alternatives: give one")
        if self.trace_shape is not None and self.trace_shape not in TRACE_SHAPES:
            raise ValueError(f"--trace-shape must be one of {', '.join(TRACE_SHAPES)}, not {self.trace_shape!r}")
        if self.replicas < 1 or (self.replicas > 1 and self.faults):
            raise ValueError(f"--replicas must be >= 1 (and not with --faults), not {self.replicas}")
        if self.jetstream and self.replicas < 2:
            raise ValueError("--jetstream needs --replicas N (N >= 2)")
        if self.gateway_stream and self.faults:
            raise ValueError("--faults injects ZMQ faults (drops, restarts): not with --gateway-stream")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, not {self.requests}")
        unknown = [p for p in self.policies if p not in POLICIES + EXTRA_POLICIES]
        if unknown or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(
                f"policies must be distinct names among {', '.join(POLICIES + EXTRA_POLICIES)}, not {self.policies}"
            )
        if self.block_size < 1 or self.trace_block_tokens % self.block_size:
            raise ValueError(
                f"the trace block ({self.trace_block_tokens} tokens) must be a multiple of the engines' block size"
                f" ({self.block_size}), so equal hash ids fill equal engine blocks"
            )
        if not 0 <= self.overlap_weight < float("inf"):
            raise ValueError(f"--overlap-weight must be >= 0 and finite, not {self.overlap_weight}")
        if self.max_tokens < 1 or (self.capacity_blocks is not None and self.capacity_blocks < 1):
            raise ValueError("max_tokens and capacity_blocks must be >= 1")
        speedup = 1.0 if self.speedup is None else self.speedup
        if not (speedup > 0 and self.rate > 0 and self.quiet_interval > 0 and self.sync_timeout > 0):
            raise ValueError("speedup, rate, quiet_interval and sync_timeout must be > 0")


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


def _fleet(options: DemoOptions, capacity: int, speedup: float) -> list[SimConfig]:
    # The engines' clock runs ``speedup`` times faster too: prefill and decode keep their share
    # of the (compressed) time between arrivals, so a sped-up trace does not outrun them.
    default = SimConfig()
    configs = []
    for i in range(options.engines):
        engine, ranks = _FLEET[i % len(_FLEET)]
        configs.append(
            SimConfig(
                engine="vllm" if engine == "vllm" else "sglang",
                gateway=("vllm" if engine == "vllm" else "sglang")
                if options.gateway_stream or options.replicas > 1
                else None,
                name=f"{engine}-{i}",
                ranks=ranks,
                block_size=options.block_size,
                capacity_blocks=capacity,
                seed=options.seed,
                prefill_time_per_token=default.prefill_time_per_token / speedup,
                decode_time_per_step=default.decode_time_per_step / speedup,
            )
        )
    return configs


class AsyncPolicy(Protocol):
    """What a run asks of a policy; in-process policies are wrapped (`_InProcess`), replicas answer over pipes."""

    async def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey: ...

    async def prefill_done(self, request_id: Hashable) -> None: ...

    async def finished(self, request_id: Hashable) -> None: ...


class _InProcess:
    """A `Policy` of this process behind the async interface a run uses."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    async def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        return self.policy.choose(request_id, token_ids)

    async def prefill_done(self, request_id: Hashable) -> None:
        self.policy.prefill_done(request_id)

    async def finished(self, request_id: Hashable) -> None:
        self.policy.finished(request_id)


class _PolicyRun:
    """One policy's traffic on a running fleet: arrivals, retries, injected faults, and the tally.

    `run` sends every request at its arrival time (a turn also waits for the one it follows),
    each as its own task, and returns once all have finished. Lifecycle events are recorded
    meanwhile, for the fault notes.
    """

    def __init__(
        self,
        name: str,
        policy: AsyncPolicy,
        engines: Sequence[SimEngine],
        client: KvEventClient,
        reporter: Reporter,
    ) -> None:
        self.name = name
        self.policy = policy
        self.engines = engines
        self.client = client
        self.reporter = reporter
        self.by_target = {engine.grpc_target: engine for engine in engines}
        self.tally = _Tally()
        self.lifecycle: list[_Lifecycle] = []
        self.faults: list[tuple[float, _Fault]] = []
        self.finished: dict[int, anyio.Event] = {}
        self.t0 = 0.0

    async def run(
        self, workload: Sequence[WorkloadRequest], plan: dict[int, list[_Fault]], sync_timeout: float
    ) -> None:
        """Send ``workload``, injecting ``plan``'s faults before the arrival they are keyed by.

        Returns once every request finished and the client settled (lifecycle events are recorded
        until then, so a recovery that completes after the last request is still noted).
        """
        self.t0 = anyio.current_time()
        self.finished = {req.id: anyio.Event() for req in workload}
        self.reporter.start(self.name, len(workload))
        async with anyio.create_task_group() as background:
            background.start_soon(self._record_lifecycle)
            background.start_soon(self._refresh)
            async with anyio.create_task_group() as tg:
                for i, req in enumerate(workload):
                    await anyio.sleep_until(self.t0 + req.arrival)
                    for fault in plan.get(i, ()):
                        at = anyio.current_time() - self.t0
                        self.faults.append((at, fault))
                        self.reporter.note(f"t={at:.1f}s fault: {fault.label} on {fault.engine.config.name}")
                        tg.start_soon(_inject, fault)
                    tg.start_soon(self._request, req)
            # Quiescent now: let the last batches land and every source settle before counting.
            with contextlib.suppress(TimeoutError):
                await self.client.wait_synced(sync_timeout)
            with anyio.move_on_after(sync_timeout):
                # Polled: the client has no event per applied seq, and this runs once per demo run.
                while not self._applied_all():  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            background.cancel_scope.cancel()
        self._progress()

    def _applied_all(self) -> bool:
        """The client applied every batch the engines' ranks published (a rank it does not follow aside).

        A fixed pause after the last request was too short on a loaded machine: the index was
        counted 3 blocks short of the engines' caches (1,498 of 1,501) with the last batch on its way.
        """
        sources = self.client.stats().sources
        for engine in self.engines:
            for rank in range(engine.config.ranks):
                st = sources.get(WorkerKey(engine.grpc_target or "", rank))
                if st is not None and st.last_seq < engine.publisher(rank).next_seq - 1:
                    return False
        return True

    async def _record_lifecycle(self) -> None:
        async with self.client.events() as stream:
            async for env in stream:
                if env.seq is None:
                    self.lifecycle.append(_Lifecycle(anyio.current_time() - self.t0, env.source.key, _describe(env)))

    async def _refresh(self) -> None:
        while True:
            self.reporter.refresh()
            await anyio.sleep(0.25)

    async def _request(self, req: WorkloadRequest) -> None:
        try:
            if req.follows is not None:
                await self.finished[req.follows].wait()
                await anyio.sleep(req.think_time)
            await self._send(req)
        finally:
            self.finished[req.id].set()

    async def _send(self, req: WorkloadRequest) -> None:
        tally = self.tally
        for attempt in range(_ATTEMPTS):
            rid = (req.id, attempt)
            t = time.perf_counter_ns()
            worker = await self.policy.choose(rid, req.token_ids)
            tally.decisions_ns.append(time.perf_counter_ns() - t)
            engine = self.by_target[worker.worker_id]
            try:
                done = await self._stream(engine, worker, rid, req)
            except RequestAbortedError:
                tally.retried += 1
                continue
            except (CapacityError, InvalidRequestError):
                tally.rejected += 1
                return
            finally:
                await self.policy.finished(rid)
            tally.prompt += done.prompt_tokens
            tally.cached += done.cached_tokens
            tally.ttfts.append(done.ttft)
            tally.latencies.append(done.latency)
            tally.per_worker[worker] += 1
            tally.records.append(
                RequestRecord(
                    id=req.id,
                    done=anyio.current_time() - self.t0,
                    worker=worker,
                    prompt_tokens=done.prompt_tokens,
                    cached_tokens=done.cached_tokens,
                    ttft=done.ttft,
                    kind=req.kind,
                )
            )
            self._progress()
            return
        tally.failed += 1

    async def _stream(self, engine: SimEngine, worker: WorkerKey, rid: object, req: WorkloadRequest) -> Completion:
        """Run ``req`` on ``worker``, streamed: the first token tells the policy its prefill is done."""
        running = engine.submit(req.token_ids, req.max_tokens, rank=worker.dp_rank, stream=True)
        try:
            first = True
            async for _ in running.tokens():
                if first:
                    first = False
                    await self.policy.prefill_done(rid)
            return await running.result()
        finally:
            engine.abort(running)

    def _progress(self) -> None:
        tally = self.tally
        self.reporter.update(self.name, len(tally.records), tally.hit_rate, percentile(tally.ttfts, 50))


# How often kvroute scrapes the engines' /metrics on a ZMQ fleet, in the trace's time: a router's
# scrape interval (`follow_engine_metrics`' default).
_SCRAPE_INTERVAL = 1.0


async def _scraped_usage(stack: contextlib.AsyncExitStack, engines: Sequence[SimEngine], speedup: float) -> EngineLoads:
    """The engines' ``/metrics`` followed for kvroute on a ZMQ fleet, as a router on plain engines does
    (`follow_engine_metrics`), until ``stack`` closes: their KV usage prices eviction
    (`CostModel.eviction_weight`). Load stays the router's own ("router" mode), as without reports."""
    loads = EngineLoads(LoadPolicy(mode="router"))
    urls = {e.grpc_target: f"{e.http_url}/metrics" for e in engines if e.grpc_target and e.http_url}
    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)
    tg.start_soon(partial(follow_engine_metrics, loads, urls, interval=_SCRAPE_INTERVAL / speedup))
    return loads


async def _run_policy(
    policy_name: str,
    options: DemoOptions,
    workload: Sequence[WorkloadRequest],
    capacity: int,
    speedup: float,
    reachable: float,
    reporter: Reporter,
    nats: str | None = None,
) -> tuple[PolicyResult, list[RequestRecord]]:
    """A fresh fleet and client, the policy's traffic through them, then the figures once quiescent.

    ``nats``: the NATS server replicas follow a relay's log on (``options.jetstream``).
    """
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in _fleet(options, capacity, speedup)]
        targets = [engine.grpc_target for engine in engines if engine.grpc_target is not None]
        config = SubscriberConfig(quiet_interval=options.quiet_interval, events_buffer=100_000)
        client = await stack.enter_async_context(KvEventClient(targets=targets, config=config))
        await client.wait_synced(options.sync_timeout)
        replicas: ReplicaPolicy | None = None
        policy: AsyncPolicy
        if policy_name.startswith(_REPLICATED):
            load = policy_name.rsplit("_", 2)[-2]  # kvroute_xN_<load>_load
            replicas = await stack.enter_async_context(
                ReplicaPolicy(
                    targets,
                    replicas=options.replicas,
                    load=load,
                    block_size=options.block_size,
                    overlap_weight=options.overlap_weight,
                    seed=options.seed,
                    nats=nats,
                )
            )
            policy = replicas
        else:
            scraped = None
            if policy_name in KVROUTE_POLICIES and not options.gateway_stream:
                scraped = await _scraped_usage(stack, engines, speedup)
            policy = _InProcess(
                make_policy(
                    policy_name,
                    client,
                    engines,
                    block_size=options.block_size,
                    seed=options.seed,
                    cost=CostModel(overlap_weight=options.overlap_weight),
                    engine_loads=scraped,
                )
            )
        run = _PolicyRun(policy_name, policy, engines, client, reporter)
        await run.run(workload, _fault_plan(engines, len(workload)) if options.faults else {}, options.sync_timeout)
        digests: list[str] = []
        if replicas is not None:
            # Quiescent: the last batches may still be on their way to some index. Asked again until they
            # agree, for at most 10 s; digests that still differ then are reported as they are.
            prompts = [r.token_ids for r in workload]
            with anyio.move_on_after(10):
                while len(set(digests)) != 1:
                    if digests:
                        await anyio.sleep(0.2)
                    digests = [d for d, _ in await replicas.digests(prompts)]
                    digests.append(index_digest(client.index, prompts)[0])
        stats = client.stats()
        # The compiled index's own figure: sys.getsizeof cannot see its Rust tables.
        index_memory = client.index.memory_bytes()
        index_blocks = client.index.num_blocks()
        engine_blocks = sum(e.cache(r).num_cached_blocks for e in engines for r in range(e.config.ranks))
        live = client.live_workers()
    workers = len(live)
    tally, lifecycle, faults = run.tally, run.lifecycle, run.faults
    totals = stats.totals
    result = PolicyResult(
        policy=policy_name,
        requests=len(workload),
        completed=len(tally.records),
        failed=tally.failed,
        retried=tally.retried,
        rejected=tally.rejected,
        hit_rate=round(tally.hit_rate, 4),
        reachable_hit_rate=round(reachable, 4),
        reachable_share=round(tally.hit_rate / reachable, 4) if reachable else 0.0,
        prompt_tokens=tally.prompt,
        cached_tokens=tally.cached,
        prefill_tokens=tally.prompt - tally.cached,
        ttft_p50=round(percentile(tally.ttfts, 50), 6),
        ttft_p99=round(percentile(tally.ttfts, 99), 6),
        latency_p50=round(percentile(tally.latencies, 50), 4),
        latency_p99=round(percentile(tally.latencies, 99), 4),
        load_imbalance=load_imbalance(tally.per_worker, live),
        decision_p50_us=round(percentile(tally.decisions_ns, 50) / 1e3, 1),
        decision_p99_us=round(percentile(tally.decisions_ns, 99) / 1e3, 1),
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
        transport="gateway" if options.gateway_stream or options.replicas > 1 else "zmq",
        replicas=options.replicas if replicas is not None else 1,
        index_digests=digests,
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


def pressure_capacity(workload: Sequence[WorkloadRequest], options: DemoOptions) -> int:
    """KV blocks per rank for a generated trace: the fleet holds half the workload's distinct blocks.

    Never below `_TRACE_SHAPE_MIN_REQUESTS` of the workload's mean request (prompt and output), nor below
    its largest request.
    """
    bs = options.block_size
    distinct = distinct_blocks(workload, bs)
    ranks = sum(cfg.ranks for cfg in _fleet(options, 1, 1.0))
    sizes = [-(-(len(r.token_ids) + r.max_tokens) // bs) for r in workload] or [1]
    floor = max(math.ceil(_TRACE_SHAPE_MIN_REQUESTS * sum(sizes) / len(sizes)), max(sizes))
    return max(math.ceil(_TRACE_SHAPE_CACHE_SHARE * distinct / ranks), floor)


def _workload(options: DemoOptions) -> tuple[list[WorkloadRequest], int, float]:
    """The requests, KV blocks per rank, and how much faster than recorded the run goes."""
    speedup = options.speedup or _TRACE_SPEEDUP
    if options.trace is not None:
        workload = read_mooncake_trace(
            options.trace,
            block_tokens=options.trace_block_tokens,
            limit=options.requests,
            speedup=speedup,
            max_tokens=options.max_tokens,
        )
        return workload, options.capacity_blocks or _TRACE_CAPACITY, speedup
    if options.trace_shape is not None:
        records = generate_mooncake_trace(
            options.trace_shape, options.requests or _DEFAULT_TRACE_RECORDS, seed=options.seed
        )
        workload = trace_requests(
            records, block_tokens=options.trace_block_tokens, speedup=speedup, max_tokens=options.max_tokens
        )
        return workload, options.capacity_blocks or pressure_capacity(workload, options), speedup
    config = WorkloadConfig(
        requests=options.requests or _DEFAULT_REQUESTS,
        seed=options.seed,
        rate=options.rate,
        max_tokens=options.max_tokens,
    )
    return generate_workload(config), options.capacity_blocks or _SYNTHETIC_CAPACITY, 1.0


async def run_demo(
    options: DemoOptions | None = None, *, out: TextIO | None = None, progress: bool = False
) -> DemoResult:
    """Run the demo (module docstring) and return every policy's figures.

    With ``progress`` a live progress display (rich when installed) goes to ``out`` (stdout).
    Raises `TraceError` for an unreadable trace and `KvRouteError` subclasses from the
    components; engines and clients are closed whatever happens.
    """
    options = options or DemoOptions()
    workload, capacity, speedup = _workload(options)
    reachable = reachable_hits(workload, options.block_size).hit_rate
    display = make_reporter(out or sys.stdout, quiet=not progress)
    started = time.perf_counter()
    results: dict[str, PolicyResult] = {}
    records: dict[str, list[RequestRecord]] = {}
    runs = [
        r
        for name in options.policies
        for r in (
            [f"{_REPLICATED}{options.replicas}_{load}_load" for load in LOAD_MODES]
            if name == "kvroute" and options.replicas > 1
            else [name]
        )
    ]
    try:
        with contextlib.ExitStack() as stack:
            # One NATS server for the run; each replicated policy's relay writes a stream of its own.
            nats = stack.enter_context(nats_server()) if options.jetstream else None
            for name in runs:
                results[name], records[name] = await _run_policy(
                    name, options, workload, capacity, speedup, reachable, display, nats
                )
    finally:
        display.stop()
    results = with_oracle_shares(results)
    kinds = Counter(r.kind for r in workload)
    shape = {"requests": len(workload), "prompt_tokens": sum(len(r.token_ids) for r in workload), **kinds}
    return DemoResult(
        policies=results, records=records, workload=shape, wall_time=round(time.perf_counter() - started, 2)
    )
