"""Engine-reported load: what a gateway stream's ``EngineLoad`` records say, and how the Router prices it.

A gateway servicer puts its engine's load on every ``KvEventBatch`` (and on ``load_only``
heartbeats while the engine is idle, docs/protocol.md §6). `EngineLoads` keeps the newest record per
worker; `EngineLoads.blend` turns the records and the router's own in-flight tokens into the
load `Router.select` prices, and names the workers to veto.

Blend (the default): a worker's load is the larger of the router's own in-flight tokens on it
and the engine's queued prefill work (``waiting_uncached_tokens`` plus
``prefill_pending_tokens``, the figures the servicer reports). The engine's figure includes
what every router replica sent, so replicas that share nothing still see the same queue; the
router's own figure covers requests the engine has not reported yet. Taking the larger counts
neither twice. A record older than ``stale_after`` is not used (the router's own count is).

Engines without a gateway servicer (plain vLLM / SGLang, the ZMQ path) report load through their
Prometheus ``/metrics`` instead: requests running and waiting per data-parallel rank, and KV-cache
usage (`ENGINE_METRICS` names them as each engine's code does). `parse_engine_metrics` turns a
scrape into one `EngineLoad` per rank and `follow_engine_metrics` keeps an `EngineLoads` fed. Such
records carry request counts, not tokens: `blend` prices each request the engine holds at the mean
uncached tokens of the router's own in-flight requests (``LoadPolicy.request_tokens`` until the
router has had any), so N replicas each see the engine's whole queue, not 1/N of it.

Veto (a wedged engine): a worker is vetoed when its engine reports silence
(``engine_silence_ms``) past ``wedge_after`` plus the time its pending prefill may take at
``prefill_tokens_per_s``, or when its records stopped for longer than ``stale_after`` while the
router has requests in flight on it. The Router vetoes only while another candidate is left.

`EngineLoads.blend` is the reference: the Python scoring path (a `CostModel` subclass) calls it per
`select`. The compiled path reads the same records from the core (`EngineLoads.update` writes each
one there as it arrives) and blends them in the pass that prices the candidates, by these rules.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

import anyio
import msgspec

import kvroute._core as _core

from ._errors import MetricsError
from ._models import WorkerKey

__all__ = [
    "ENGINE_METRICS",
    "EngineLoad",
    "EngineLoads",
    "EngineMetricNames",
    "LoadPolicy",
    "MetricsError",
    "follow_engine_metrics",
    "parse_engine_metrics",
]

_log = logging.getLogger("kvroute.load")


class EngineMetricNames(msgspec.Struct, frozen=True, kw_only=True):
    """Where one engine's Prometheus metrics hold a rank's load: gauge names and the rank's label."""

    running: str
    waiting: str
    kv_usage: str
    rank_label: str


#: The load gauges of each engine, as their code names them. vLLM 0.34.0 (``vllm/v1/metrics/loggers.py``,
#: ``PrometheusStatLogger``): labels ``model_name`` and ``engine`` (the data-parallel rank's engine index).
#: SGLang 0.5.23 (``sglang/srt/observability/metrics_collector.py``, ``SchedulerMetricsCollector``): labels
#: ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` and, with data parallelism,
#: ``dp_rank``; every tensor-parallel rank reports, rank 0's series is the scheduler's.
ENGINE_METRICS: dict[str, EngineMetricNames] = {
    "vllm": EngineMetricNames(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage="vllm:kv_cache_usage_perc",
        rank_label="engine",
    ),
    "sglang": EngineMetricNames(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage="sglang:token_usage",
        rank_label="dp_rank",
    ),
}
_GAUGES = {
    name: (engine, field)
    for engine, names in ENGINE_METRICS.items()
    for field, name in (("running", names.running), ("waiting", names.waiting), ("kv_usage", names.kv_usage))
}
# Series of other parallel ranks than the scheduler's (SGLang reports per tensor/pipeline rank).
_SECONDARY = ("tp_rank", "pp_rank", "moe_ep_rank")


def parse_engine_metrics(text: str, *, received: float | None = None) -> dict[int, EngineLoad]:
    """One `EngineLoad` per data-parallel rank from a vLLM or SGLang ``/metrics`` body (`ENGINE_METRICS`).

    Parsed with prometheus_client's text parser (``pip install 'kvroute[prometheus]'``). A series
    without the rank label is rank 0 (SGLang without data parallelism); series of non-zero
    tensor / pipeline ranks are skipped. ``received`` stamps the records (default: now, monotonic).
    Raises `MetricsError` for text that is not Prometheus exposition format, or without prometheus_client.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise MetricsError("engine metrics need prometheus_client: pip install 'kvroute[prometheus]'") from None
    stamp = time.monotonic() if received is None else received
    figures: dict[int, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                hit = _GAUGES.get(sample.name)
                if hit is None or any(sample.labels.get(k, "0") != "0" for k in _SECONDARY):
                    continue
                engine, field = hit
                rank_text = sample.labels.get(ENGINE_METRICS[engine].rank_label, "0")
                if not rank_text.isdecimal() or not math.isfinite(sample.value) or sample.value < 0:
                    continue
                per = figures.setdefault(int(rank_text), {})
                per[field] = per.get(field, 0.0) + sample.value
    except ValueError as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from None
    return {
        rank: EngineLoad(
            running_requests=int(f.get("running", 0)),
            waiting_requests=int(f.get("waiting", 0)),
            token_usage=f.get("kv_usage", 0.0),
            received=stamp,
        )
        for rank, f in figures.items()
    }


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read(16 * 1024 * 1024)
        return body.decode("utf-8", "replace")


async def follow_engine_metrics(
    loads: EngineLoads,
    urls: Mapping[str, str],
    *,
    interval: float = 1.0,
    scrape_timeout: float = 2.0,
) -> None:
    """Scrape each engine's ``/metrics`` every ``interval`` seconds into ``loads``, until cancelled.

    ``urls``: worker id (the `WorkerKey.worker_id` of the engine's sources: its gRPC target when
    discovered, your ``EventSource.worker_id`` when static) -> the engine's metrics URL, e.g.
    ``http://engine-a:8000/metrics``; ``scrape_timeout`` bounds each request. Each rank's record
    goes to ``WorkerKey(worker_id, rank)``. A failed scrape or a body that is not Prometheus text
    is logged (at most once per engine per minute) and skipped: the records age and turn stale
    (``LoadPolicy.stale_after``), as a silent gateway's do. Run it in your task group:
    ``tg.start_soon(follow_engine_metrics, client.engine_loads, urls)``.
    """
    if not (0 < interval < math.inf and 0 < scrape_timeout < math.inf):
        raise ValueError("interval and scrape_timeout must be > 0 and finite")
    warned: dict[str, float] = {}
    while True:
        for worker_id, url in urls.items():
            try:
                text = await anyio.to_thread.run_sync(_get, url, scrape_timeout, abandon_on_cancel=True)
                records = parse_engine_metrics(text, received=loads.clock())
            except (OSError, urllib.error.URLError, MetricsError, UnicodeError) as exc:
                now = time.monotonic()
                if now - warned.get(worker_id, -math.inf) >= 60.0:
                    warned[worker_id] = now
                    _log.warning("engine metrics of %s at %s: %s", worker_id, url, exc)
                continue
            for rank, record in records.items():
                loads.update(WorkerKey(worker_id, rank), record)
        await anyio.sleep(interval)


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One engine load record, as a gateway stream reported it (``smg.grpc.common.EngineLoad``).

    Optional figures are None when the servicer did not report them (absent is not zero).
    ``received`` is the local monotonic time the record arrived.
    """

    running_requests: int = 0
    waiting_requests: int = 0
    waiting_uncached_tokens: int | None = None
    token_usage: float = 0.0
    active_token_usage: float | None = None
    gen_throughput: float = 0.0
    max_running_requests: int = 0
    age_ms: int = 0
    sample: int = 0
    engine_silence_ms: int | None = None
    engine_reports_steps: bool | None = None
    prefill_pending_tokens: int | None = None
    received: float = 0.0

    @property
    def queued_tokens(self) -> int:
        """Prefill work the engine holds and has not done: waiting uncached plus pending prompt tokens."""
        return (self.waiting_uncached_tokens or 0) + (self.prefill_pending_tokens or 0)


def _check_record(record: EngineLoad) -> None:
    """Raise ValueError naming the figures of ``record`` that are negative (no engine reports one).

    A usage that is not a number is the engine's word that it has none, priced as such.
    """
    names = ("running_requests", "waiting_requests", "waiting_uncached_tokens", "prefill_pending_tokens")
    bad = [n for n in (*names, "engine_silence_ms") if (v := getattr(record, n)) is not None and v < 0]
    if bad:
        raise ValueError(f"engine load record with negative {', '.join(bad)}: {record!r}")


class LoadPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How engine load is priced. ``mode``: "blend" (default), "engine" (engine figures only,
    the router's own count where no fresh record exists) or "router" (ignore the engine's).
    Times in seconds; ``prefill_tokens_per_s`` is the rate the veto allows pending prefill.
    ``request_tokens``: what one request an engine reports by count only (``/metrics``) is priced
    at until the router has in-flight requests of its own to learn the mean from."""

    mode: str = "blend"
    stale_after: float = 15.0
    wedge_after: float = 30.0
    prefill_tokens_per_s: float = 10_000.0
    request_tokens: float = 1024.0

    def __post_init__(self) -> None:
        if self.mode not in ("blend", "engine", "router"):
            raise ValueError(f"mode must be 'blend', 'engine' or 'router', not {self.mode!r}")
        for name in ("stale_after", "wedge_after", "prefill_tokens_per_s", "request_tokens"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ValueError(f"{name} must be > 0 and finite, not {value!r}")


class EngineLoads:
    """The newest engine load record per worker, and the pricing `Router.select` asks for.

    Fed by the gateway transport; ``clock`` is the monotonic clock records are stamped with.
    Thread-safe: the client's thread may update it while routers price from it on others.
    """

    def __init__(self, policy: LoadPolicy | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy if policy is not None else LoadPolicy()
        self.clock = clock
        self._records: dict[WorkerKey, EngineLoad] = {}
        # Per worker, what `blend` reads: (received, queued tokens, requests held when the record
        # counts requests only (-1: priced in tokens), silence ms (-1: none), the silence allowed
        # in ms before a veto).
        self._figures: dict[WorkerKey, tuple[float, int, int, float, float]] = {}
        self._version = 0
        self._zeros = False
        self._counts: dict[WorkerKey, int] = {}
        self._cache: tuple[tuple[int, int], float, dict[WorkerKey, float], set[WorkerKey], set[WorkerKey]] | None = None
        # The same records in the core, written as each arrives: the compiled `Router.select` blends
        # them there in its pricing pass (no Python per worker), with `blend` below as its reference.
        # It also keeps what a request reported by count only is priced at (both paths learn it).
        self._core = _core.EngineTable(self.policy.request_tokens)
        # What `usage` answers, and until when: fresh reports above 0, in record order.
        self._usage: tuple[float, dict[WorkerKey, float]] | None = None
        #: Veto decisions taken (a worker vetoed in one `blend` call counts once).
        self.vetoes = 0
        # Records, the cached answers and their in-place patches change under it: a `blend` on a
        # router's thread must not iterate the figures while the client's thread adds a worker.
        self._lock = threading.Lock()

    @property
    def reporting(self) -> bool:
        """Whether any worker has reported load."""
        return bool(self._records)

    def update(self, worker: WorkerKey, record: EngineLoad) -> None:
        """Keep ``record`` as ``worker``'s load unless an already-kept one has a newer ``sample``.

        Raises ValueError for a record no engine reports (a negative count, queue or silence):
        kept, it would be priced into every `Router.select`.
        """
        _check_record(record)
        p = self.policy
        allowance = (p.wedge_after + (record.prefill_pending_tokens or 0) / p.prefill_tokens_per_s) * 1000.0
        silence = -1.0 if record.engine_silence_ms is None else float(record.engine_silence_ms)
        by_count = record.waiting_uncached_tokens is None and record.prefill_pending_tokens is None
        requests = record.running_requests + record.waiting_requests if by_count else -1
        received, queued = record.received, record.queued_tokens
        figures = (received, queued, requests, silence, allowance)
        with self._lock:
            old = self._records.get(worker)
            if old is not None and record.sample and old.sample > record.sample:
                return
            self._records[worker] = record
            self._figures[worker] = figures
            self._core.put(worker, received, float(queued), float(requests), silence, allowance, record.token_usage)
            self._version += 1
            if self._cache is not None and not self._patch(worker, figures):
                self._cache = None
            if self._usage is not None and not self._patch_usage(worker, record):
                self._usage = None

    def _patch(self, worker: WorkerKey, figures: tuple[float, int, int, float, float]) -> bool:
        """Carry one worker's new record into the cached engine part, if that is all that changed.

        A fleet of engines each reporting every second changes a record about as often as a router
        selects, so recomputing the engine part over every worker on each change would cost
        `blend` a pass over the fleet per call. Only a fresh worker that stays fresh and priced the
        same way (in tokens, or by request count) is patched, in place, so every dict keeps the
        order a recomputation would give it; anything else (new, stale, switching) says False.
        """
        assert self._cache is not None
        (_, unit), until, engine, wedged, stale = self._cache
        received, queued, requests, silence, allowance = figures
        expires = received + self.policy.stale_after
        now = self.clock()
        if expires < now or now >= until:
            return False
        if requests > 0:
            if worker not in self._counts:
                return False
            self._counts[worker] = requests
        else:
            if worker not in engine:
                return False
            engine[worker] = queued / unit
            # only ever set here: with no zero left, filtering them out is a copy all the same
            self._zeros = self._zeros or not queued
        if silence > allowance:
            wedged.add(worker)
        else:
            wedged.discard(worker)
        # `until` may stay earlier than needed (the replaced record's expiry): a recomputation then
        self._cache = ((self._version, unit), min(until, expires), engine, wedged, stale)
        return True

    def _patch_usage(self, worker: WorkerKey, record: EngineLoad) -> bool:
        """Carry one worker's new record into the cached `usage` answer, if that is all that changed.

        Engines report about as often as a router selects: recomputing over the fleet on every
        record would cost `select` a pass over 1,024 records (about a millisecond). Only a worker
        already listed whose fresh record still reports usage is patched in place, so the dict keeps
        the order a recomputation would give; anything else says False. A worker leaving the list
        leaves a copy: the dict `usage` handed out never changes size, so a router may iterate it
        on one thread while records arrive on another.
        """
        assert self._usage is not None
        until, usage = self._usage
        now = self.clock()
        if now >= until:
            return False
        fresh = now - record.received <= self.policy.stale_after
        if fresh and record.token_usage > 0.0:  # NaN is never > 0
            if worker not in usage:
                return False
            usage[worker] = min(1.0, record.token_usage)
        elif worker in usage:
            usage = {w: u for w, u in usage.items() if w != worker}
            self._usage = (until, usage)
        return True

    def usage(self) -> dict[WorkerKey, float]:
        """Engine-reported KV-cache usage per worker: fresh reports above 0 (capped at 1), in record
        order. Kept until a record changes in a way `update` cannot patch in place, or the first
        listed report turns stale: `Router.select` reads it on every call (`CostModel.eviction`).
        Its size never changes once returned (values may, as records arrive)."""
        now = self.clock()
        with self._lock:
            cached = self._usage
            if cached is not None and now < cached[0]:
                return cached[1]
            stale_after = self.policy.stale_after
            usage: dict[WorkerKey, float] = {}
            until = math.inf
            for w, rec in self._records.items():
                if now - rec.received <= stale_after and rec.token_usage > 0.0:
                    until = min(until, rec.received + stale_after)
                    usage[w] = min(1.0, rec.token_usage)
            self._usage = (until, usage)
            return usage

    def remove(self, worker: WorkerKey) -> None:
        """Forget ``worker``'s records (its source was removed)."""
        with self._lock:
            self._records.pop(worker, None)
            self._figures.pop(worker, None)
            self._core.remove(worker)
            self._version += 1
            self._usage = None  # recomputed (a new dict): the one handed out keeps its size

    def get(self, worker: WorkerKey) -> EngineLoad | None:
        """The newest record of ``worker``, fresh or not."""
        return self._records.get(worker)

    def records(self) -> dict[WorkerKey, EngineLoad]:
        """Every worker's newest record."""
        return dict(self._records)

    def fresh(self, worker: WorkerKey, now: float | None = None) -> EngineLoad | None:
        """``worker``'s record if it is younger than ``stale_after``."""
        rec = self._records.get(worker)
        if rec is None:
            return None
        now = self.clock() if now is None else now
        return rec if now - rec.received <= self.policy.stale_after else None

    def wedged(self, worker: WorkerKey, own_tokens: int, now: float) -> bool:
        """Whether ``worker`` should be vetoed (see the module docstring)."""
        rec = self._records.get(worker)
        if rec is None:
            return False
        p = self.policy
        if now - rec.received > p.stale_after:
            return own_tokens > 0
        if rec.engine_silence_ms is None:
            return False
        allowance = p.wedge_after + (rec.prefill_pending_tokens or 0) / p.prefill_tokens_per_s
        return rec.engine_silence_ms / 1000.0 > allowance

    def _engine_part(self, unit: int, now: float) -> tuple[dict[WorkerKey, float], set[WorkerKey], set[WorkerKey]]:
        """(engine queue per fresh worker in blocks, wedged fresh workers, stale workers), cached
        until a record changes or the next fresh record turns stale."""
        cached = self._cache
        if cached is not None and cached[0] == (self._version, unit) and now < cached[1]:
            return cached[2], cached[3], cached[4]
        stale_after = self.policy.stale_after
        engine: dict[WorkerKey, float] = {}
        counts: dict[WorkerKey, int] = {}
        wedged: set[WorkerKey] = set()
        stale: set[WorkerKey] = set()
        until = math.inf
        zeros = False
        for w, (received, queued, requests, silence, allowance) in self._figures.items():
            expires = received + stale_after
            if expires < now:
                stale.add(w)
                continue
            until = min(until, expires)
            if requests > 0:
                counts[w] = requests  # priced per request in `blend`: the estimate moves with the router's
            else:
                engine[w] = queued / unit
                zeros = zeros or not queued
            if silence > allowance:
                wedged.add(w)
        self._counts = counts
        self._cache = ((self._version, unit), until, engine, wedged, stale)
        self._zeros = zeros  # some fresh worker reports an empty queue: blend filters zeros out
        return engine, wedged, stale

    def blend(
        self, own_tokens: Mapping[WorkerKey, int], unit: int, own_requests: Mapping[WorkerKey, int] | None = None
    ) -> tuple[dict[WorkerKey, float], set[WorkerKey]]:
        """Load per worker in blocks of ``unit`` tokens, and the workers to veto.

        ``own_tokens``: the router's in-flight tokens per worker; ``own_requests``: how many requests
        those are (the mean prices the requests an engine reports by count only, `parse_engine_metrics`).
        Runs on every `Router.select`: the engine side is cached between record updates, so a call
        costs a copy of it and a pass over the router's own (few) busy workers.
        """
        with self._lock:
            mode = self.policy.mode
            if mode == "router":
                return {w: t / unit for w, t in own_tokens.items() if t}, set()
            engine, wedged, stale = self._engine_part(unit, self.clock())
            loads = {w: v for w, v in engine.items() if v} if self._zeros else dict(engine)
            if self._counts:
                held = sum(own_requests.values()) if own_requests else 0
                if held:
                    self._core.per_request = sum(own_tokens.values()) / held
                per = self._core.per_request / unit
                engine = dict(engine)
                for w, n in self._counts.items():
                    engine[w] = loads[w] = n * per
            vetoed = set(wedged)
            for w, t in own_tokens.items():
                if not t:
                    continue
                mine = t / unit
                if w in engine:  # a fresh record: its queue, or the router's count if larger (blend)
                    if mode == "blend" and mine > engine[w]:
                        loads[w] = mine
                else:
                    loads[w] = mine
                    if w in stale:
                        vetoed.add(w)  # records stopped while it holds routed work
            self.vetoes += len(vetoed)
            return loads, vetoed

    def _count_vetoes(self, n: int) -> None:
        """Count ``n`` veto decisions the compiled `Router.select` took from the core's records."""
        with self._lock:
            self.vetoes += n

