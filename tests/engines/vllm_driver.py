"""Drives vLLM's own KV-cache manager the way its scheduler does, on CPU, and judges kvroute on it.

What runs is vLLM's code: `KVCacheManager` (with the `UnitaryKVCacheCoordinator` or the
`HybridKVCacheCoordinator` it picks for the configured groups), its `BlockPool` and event recording,
`Request` with vLLM's request block hasher (`get_request_block_hasher`, the engine's configured hash
function), and `ZmqEventPublisher`. The only thing emulated is the model: a scheduled chunk is "computed"
at once and decode tokens come from the workload. The scheduling steps follow
`vllm.v1.core.sched.scheduler.Scheduler`: `get_computed_blocks` then `allocate_slots` for a new request,
`allocate_slots` per step for a running one, `num_computed_tokens` advanced by what was scheduled,
output appended, `free` on finish, `take_events` once per step and published when non-empty.

At every admission, before the engine's own lookup, kvroute (a real `KvEventClient` subscribed to the
publisher, caught up with every batch published so far) is asked the router's question, and its answer
is compared with what the engine then serves from its cache for the same request (`get_computed_blocks`:
its longest cache hit within the prompt minus one token).

With ``ranks`` > 1 the engine is data-parallel: one cache manager and one publisher per rank (rank r
binds the base ports + r, as vLLM's publisher does), one client subscribed to every rank, and each
request routed by session (a new session to the next rank in turn, a turn to its session's rank, an
exact repeat to the rank that served the request it repeats).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm
import zmq
from harness import Judge, Tally, enable_ipv6, judges, offset_port, rank_endpoints
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from workload import Namespaces, Req, Workload

VERSION = vllm.__version__
_LORA_IDS: dict[str, int] = {}


@dataclass
class Group:
    """One KV-cache group: full attention, or a sliding window of ``window`` tokens."""

    block_size: int
    window: int | None = None

    def spec(self) -> KVCacheSpec:
        common: dict[str, Any] = dict(block_size=self.block_size, num_kv_heads=1, head_size=8,
                                      dtype=torch.float16)
        if self.window is None:
            return FullAttentionSpec(**common)
        return SlidingWindowSpec(**common, sliding_window=self.window)


@dataclass
class Config:
    """One engine configuration of the suite."""

    name: str
    groups: tuple[Group, ...] = (Group(16),)
    num_blocks: int = 160
    ns: Namespaces = field(default_factory=Namespaces)
    requests: int = 300
    lookahead: int = 0
    report_full: float = 0.0  # share of requests asking kv_cache_report_mode "full"
    # KVCacheConfig.prefix_cache_retention_interval: vLLM's default (CacheConfig) is 0, sparse
    # sliding-window / Mamba checkpoints; None retains them densely.
    retention: int | None = 0
    reset_at: int | None = None  # reset the prefix cache (when idle) after this many admissions
    max_running: int = 4
    chunk: int = 96  # chunked prefill: tokens per step
    seed: int = 1
    ranks: int = 1  # data-parallel ranks (one cache manager and publisher each)
    aligned: bool = False  # every prompt a whole number of scheduler blocks
    # The judged client's `reuse_reports` (None: kvroute's default). False only where no request asks
    # for reports (report_full 0): the router's promise that a repeated store is a real copy.
    reuse_reports: bool | None = None


def _kv_cache_config(cfg: Config) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=g.spec())
              for i, g in enumerate(cfg.groups)]
    return KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=cfg.retention)


def _hash_block_size(cfg: Config) -> int:
    # vLLM hashes at the GCD of the groups' block sizes (resolve_kv_cache_block_sizes).
    from math import gcd
    h = 0
    for g in cfg.groups:
        h = gcd(h, g.block_size)
    return h


def _scheduler_block_size(cfg: Config) -> int:
    from math import lcm
    s = 1
    for g in cfg.groups:
        s = lcm(s, g.block_size)
    return s


class Engine:
    """One vLLM worker: its cache manager, block hasher and event publisher."""

    def __init__(self, cfg: Config, endpoint: str, replay: str, tally: Tally, rank: int = 0) -> None:
        self.cfg = cfg
        self.tally = tally
        hash_fn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(hash_fn)
        self.hash_block_size = _hash_block_size(cfg)
        self.hasher = get_request_block_hasher(self.hash_block_size, hash_fn, cfg.lookahead)
        self.mgr = KVCacheManager(
            kv_cache_config=_kv_cache_config(cfg),
            max_model_len=4096,
            scheduler_block_size=_scheduler_block_size(cfg),
            hash_block_size=self.hash_block_size,
            enable_caching=True,
            num_hash_lookahead_tokens=cfg.lookahead,
            enable_kv_cache_events=True,
        )
        # The publisher binds on the process-wide zmq context; IPv6 lets it bind ``[::1]`` (loopback).
        enable_ipv6(zmq.Context.instance())
        self.publisher = ZmqEventPublisher(data_parallel_rank=rank, endpoint=endpoint, replay_endpoint=replay,
                                           buffer_steps=100_000)
        self.published = -1  # seq of the last published batch (the publisher counts from 0)

    def flush(self) -> None:
        """Publish what the cache manager recorded this step (as the scheduler does: only if any)."""
        events = self.mgr.take_events()
        for e in events:
            self.tally.saw(type(e).__name__)
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def request(self, req: Req) -> Request:
        lora = None
        if req.lora is not None:
            lora_id = _LORA_IDS.setdefault(req.lora, len(_LORA_IDS) + 1)
            lora = LoRARequest(lora_name=req.lora, lora_int_id=lora_id, lora_path=f"/adapters/{req.lora}")
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=m.identifier,
                                    mm_position=PlaceholderRange(offset=m.offset, length=m.length))
              for m in req.mm] or None
        extra = {"kv_cache_report_mode": "full"} if req.report else None
        return Request(request_id=req.rid, prompt_token_ids=list(req.prompt),
                       sampling_params=SamplingParams(max_tokens=req.max_tokens, extra_args=extra),
                       pooling_params=None, lora_request=lora, cache_salt=req.salt, mm_features=mm,
                       block_hasher=self.hasher)

    def close(self) -> None:
        self.publisher.shutdown()


def run(cfg: Config, backend: str = "asyncio") -> Tally:
    """Replay ``cfg``'s workload on a fresh engine (every rank); return kvroute's verdict."""
    endpoint, replay = rank_endpoints(cfg.ranks)
    tally = Tally(f"vllm-{VERSION} {cfg.name}")
    engines: list[Engine] = []
    try:
        for r in range(cfg.ranks):
            engines.append(Engine(cfg, endpoint, replay, tally, rank=r))
        ranks = [(offset_port(endpoint, r), offset_port(replay, r)) for r in range(cfg.ranks)]
        with judges(backend, ranks, worker_id=f"vllm-{cfg.name}", block_size=_scheduler_block_size(cfg),
                    reuse_reports=cfg.reuse_reports) as js:
            _drive(cfg, engines, js, tally)
            for j in js:
                for k, v in j.kvroute_counters().items():
                    tally.kvroute[k] = tally.kvroute.get(k, 0) + v
    finally:
        for e in engines:
            e.close()
    return tally


@dataclass
class _Rank:
    """One rank's scheduler state."""

    engine: Engine
    judge: Judge
    waiting: deque[tuple[Req, Request]] = field(default_factory=deque)
    running: list[tuple[Req, Request]] = field(default_factory=list)
    admitted: int = 0
    reset_done: bool = False


def _drive(cfg: Config, engines: list[Engine], js: list[Judge], tally: Tally) -> None:
    wl = Workload(cfg.seed, cfg.ns, align=_scheduler_block_size(cfg) if cfg.aligned else 0)
    rng = wl._rng
    ranks = [_Rank(e, j, reset_done=cfg.reset_at is None) for e, j in zip(engines, js)]
    session_rank: dict[int, int] = {}
    served_by: dict[str, int] = {}
    issued = 0
    for _step in range(cfg.requests * 200):
        if issued >= cfg.requests and not any(rk.waiting or rk.running for rk in ranks):
            break
        for rk in ranks:
            rk.engine.mgr.new_step_starts()
        # New arrivals: up to two a step, routed by session.
        for _ in range(2):
            if issued < cfg.requests:
                req = wl.next()
                req.report = rng.random() < cfg.report_full
                if req.of is not None:
                    r = served_by[req.of]
                elif req.session in session_rank:
                    r = session_rank[req.session]
                else:
                    r = session_rank[req.session] = len(session_rank) % len(ranks)
                served_by[req.rid] = r
                ranks[r].waiting.append((req, ranks[r].engine.request(req)))
                issued += 1
        for rk in ranks:
            _step_rank(cfg, rk, wl, tally)
    else:
        raise AssertionError(f"{cfg.name}: workload did not finish")
    for rk in ranks:
        rk.judge.wait_seq(rk.engine.published)
        if cfg.reset_at is not None:
            assert rk.reset_done, "the mid-run reset never happened"


def _step_rank(cfg: Config, rk: _Rank, wl: Workload, tally: Tally) -> None:
    """One scheduler step of one rank: running requests, admissions (judged), "execution"."""
    engine, j, waiting, running = rk.engine, rk.judge, rk.waiting, rk.running
    mgr = engine.mgr
    # The mid-run reset: admissions pause until nothing runs (vLLM refuses to reset otherwise).
    draining = not rk.reset_done and rk.admitted >= (cfg.reset_at or 0)
    if draining and not running:
        assert mgr.reset_prefix_cache()
        rk.reset_done, draining = True, False
        engine.flush()
    # Running requests first (as vLLM's scheduler does): a prefill chunk or one decode token.
    scheduled: list[tuple[Req, Request, int]] = []
    for req, r in list(running):
        n = min(cfg.chunk, r.num_tokens - r.num_computed_tokens)
        if mgr.allocate_slots(r, n) is None:
            # Out of blocks: preempt (free and start over later), as the scheduler does.
            mgr.free(r)
            r.num_computed_tokens = 0
            running.remove((req, r))
            waiting.appendleft((req, r))
            continue
        scheduled.append((req, r, n))
    # Admissions: the judged moment.
    while waiting and len(running) < cfg.max_running and not draining:
        req, r = waiting[0]
        engine.flush()
        j.wait_seq(engine.published)
        tokens = list(r.all_token_ids)
        kv = j.tokens(tokens, lora_name=req.lora, cache_salt=req.salt, mm=req.mm)
        # The engine's answer: what it serves from cache, its longest hit within the prompt minus
        # one token (the last token is always computed, for its logits).
        blocks, n_hit, _ = mgr.get_computed_blocks(r)
        tally.record(req.rid, kv, n_hit)
        n = min(cfg.chunk, r.num_tokens - n_hit)
        if mgr.allocate_slots(r, n, num_new_computed_tokens=n_hit, new_computed_blocks=blocks) is None:
            break
        waiting.popleft()
        rk.admitted += 1
        r.num_computed_tokens = n_hit
        running.append((req, r))
        scheduled.append((req, r, n))
    # "Execute" the step: advance, sample a token where a prefill completes or decode ran.
    for req, r, n in scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens >= r.num_tokens:
            r.append_output_token_ids(wl.output(1))
            if len(r.output_token_ids) >= req.max_tokens:
                mgr.free(r)
                running.remove((req, r))
                wl.finish(req, list(r.all_token_ids))
    engine.flush()
