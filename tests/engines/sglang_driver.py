"""Drives SGLang's own radix cache on CPU and judges kvroute on it.

What runs is SGLang's code: `RadixCache` (match, insert with node splits, LRU eviction of leaves,
reset), its `KVCacheEventRecorder` (page chunking, namespaced hashes, LoRA names through
`KvEventLoraNames`, cache salts, EAGLE bigram pages) and `ZmqEventPublisher`. Two modules that the
cache's base class imports only for a type hint (`mem_cache.memory_pool`: `ReqToTokenPool`) and for
optional metrics (`observability.metrics_collector`) are replaced by empty stand-ins before import:
importing the real ones pulls in GPU kernels. Nothing of the cache logic is replaced.

The token-slot allocator is a small pool that counts slots (the cache frees into it on eviction); a
request's KV values are the tree's own fallback (token positions). The scheduling follows SGLang's:
`match_prefix`, lock the matched node, evict leaves when the pool is short, insert prompt + output
when the request finishes, unlock; the recorder's events are published once per request.
"""

from __future__ import annotations

import sys
import time
import types
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any


def _stand_in(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


_stand_in("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=type("ReqToTokenPool", (), {}))
_stand_in(
    "sglang.srt.observability.metrics_collector",
    STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
    RadixCacheMetricsCollector=type("RadixCacheMetricsCollector", (), {}),
    radix_cache_metric_labels=lambda *a, **k: {},
    resolve_collector_class=lambda *a, **k: None,
)

from importlib.metadata import version as _version  # noqa: E402

from harness import Judge, Tally, judge  # noqa: E402
from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.events import KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from workload import Namespaces, Req, Workload  # noqa: E402

VERSION = _version("sglang")


class SlotPool:
    """The token-slot allocator the cache frees into on eviction: counts what it got back (the KV
    memory itself is not needed to decide what is cached; the pool's size bound is `Config.slots`)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices)


@dataclass
class Config:
    """One SGLang configuration of the suite."""

    name: str
    page_size: int = 16
    slots: int = 2400  # token slots: small enough to evict
    ns: Namespaces = field(default_factory=Namespaces)
    requests: int = 300
    eagle: bool = False  # EAGLE-family speculative decoding: bigram keys
    # Every prompt one token past a page boundary (the prompt minus its last token whole pages): where
    # the bigram view of that prefix is a page short of it.
    page_plus_one: bool = False
    reset_at: int | None = None
    seed: int = 1


class Engine:
    """One SGLang worker: its radix cache and event publisher."""

    def __init__(self, cfg: Config, endpoint: str, replay: str, tally: Tally) -> None:
        self.cfg = cfg
        self.tally = tally
        self.pool = SlotPool()
        self.lora_names = KvEventLoraNames()
        self.lora_ids: dict[str, str] = {}
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.pool,
                                 page_size=cfg.page_size, is_eagle=cfg.eagle, enable_kv_cache_events=True,
                                 kv_event_lora_names=self.lora_names)
        self.cache = RadixCache(params)
        # The constructor's reset() already recorded an AllBlocksCleared: it goes out with the first batch,
        # as from a starting SGLang scheduler.
        self.publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay,
                                           buffer_steps=100_000, bind=True)
        self.published = -1

    def flush(self) -> None:
        events = self.cache.kv_events.take()
        for e in events:
            self.tally.saw(type(e).__name__)
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def key(self, req: Req, tokens: list[int], limit: int | None = None) -> RadixKey:
        """The request's radix key, as SGLang's Req builds it (the LoRA id closes ``extra_key``);
        ``limit``: the raw tokens a match may use (the scheduler's ``Req._compute_max_prefix_len``)."""
        extra_key = None
        if req.lora is not None:
            if req.lora not in self.lora_ids:
                self.lora_ids[req.lora] = uuid.uuid5(uuid.NAMESPACE_DNS, req.lora).hex
            lora_id = self.lora_ids[req.lora]
            extra_key = lora_id
            # The scheduler registers each request's namespace with its adapter's public name.
            self.lora_names.register(types.SimpleNamespace(extra_key=extra_key, lora_id=lora_id),
                                     lora_name=req.lora)
        return RadixKey(array("q", tokens), extra_key, is_bigram=self.cfg.eagle, limit=limit, cache_salt=req.salt)

    def close(self) -> None:
        self.publisher.shutdown()


def run(cfg: Config, backend: str = "asyncio") -> Tally:
    """Replay ``cfg``'s workload on a fresh SGLang radix cache; return kvroute's verdict."""
    endpoint = f"tcp://127.0.0.1:{_port()}"
    replay = f"tcp://127.0.0.1:{_port()}"
    tally = Tally(f"sglang-{VERSION} {cfg.name}")
    engine = Engine(cfg, endpoint, replay, tally)
    try:
        with judge(backend, endpoint, replay, worker_id=f"sglang-{cfg.name}", block_size=cfg.page_size) as j:
            _drive(cfg, engine, j, tally)
            tally.kvroute = j.kvroute_counters()
    finally:
        engine.close()
    return tally


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drive(cfg: Config, engine: Engine, j: Judge, tally: Tally) -> None:
    align = cfg.page_size if cfg.page_plus_one else 0
    wl = Workload(cfg.seed, cfg.ns, align=align, past=1 if align else 0)
    cache = engine.cache
    for n in range(cfg.requests):
        if cfg.reset_at is not None and n == cfg.reset_at:
            cache.reset()
            engine.flush()
        req = wl.next()
        engine.flush()
        j.wait_seq(engine.published)
        kv = j.tokens(req.prompt, lora_name=req.lora, cache_salt=req.salt, mm=req.mm)
        # The engine's answer: what it serves, matched as its scheduler does (`match_kv_cache`): the
        # prompt minus its last token, which is always computed (`Req._compute_max_prefix_len`).
        key = engine.key(req, req.prompt, limit=len(req.prompt) - 1)
        hit = cache.match_prefix(MatchPrefixParams(key=key))
        tally.record(req.rid, kv, hit.device_prefix_len)
        # Run the request: hold its prefix, make room for the rest, cache prompt + output at the end.
        cache.inc_lock_ref(hit.last_device_node)
        out = wl.output(req.max_tokens)
        tokens = req.prompt + out
        excess = cache.total_size() + len(tokens) - hit.device_prefix_len - cfg.slots
        if excess > 0:
            cache.evict(EvictParams(num_tokens=excess))
        cache.insert(InsertParams(key=engine.key(req, tokens), value=None))
        cache.dec_lock_ref(hit.last_device_node)
        wl.finish(req, tokens)
    engine.flush()
    j.wait_seq(engine.published)
