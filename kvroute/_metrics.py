"""Prometheus metrics: a collector that turns the stats snapshots into metric families on each scrape.

Optional: it needs the ``prometheus`` extra (``pip install 'kvroute[prometheus]'``).
Importing this module does not import prometheus_client (which builds its global registry as
a side effect); creating a `KvRouteCollector` does, and fails with an ImportError naming the
extra when it is missing.

Nothing is counted twice: every value is read from ``KvEventClient.stats()``,
``PrefixIndex.stats()`` and ``Router.stats()`` when Prometheus scrapes, so the hot paths pay
nothing for metrics. The README's "Observability" section lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from ._client import ClientStats, KvEventClient
from ._errors import ConfigError
from ._index import IndexStats, PrefixIndex
from ._router import SELECT_BUCKETS, Router, RouterStats
from ._transports._base import COUNTER_FIELDS, SourceStats, described_fields

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = ["KvRouteCollector"]

_T = TypeVar("_T")

#: Labels of the per-source families: the source's `WorkerKey`.
SOURCE_LABELS = ("worker_id", "dp_rank")

# A stats field exported as a metric: (metric name, stats field, "counter" | "gauge", help).
# Counters get the ``_total`` suffix in the exposition. Each only ever grows over its object's
# life (a source removed and added again starts from 0, which Prometheus reads as a reset).
_Field = tuple[str, str, str, str]

# Derived from the stats Structs' fields, each field's description its help: a counter added
# to `SourceCounters` (or `RecoveryStats`) is exported with no edit here.
SOURCE_FIELDS: tuple[_Field, ...] = tuple(
    (f"kvroute_source_{name}", name, "counter", doc) for name, doc in COUNTER_FIELDS
) + tuple(
    (f"kvroute_source_{name}", name, "gauge", doc)
    for name, doc in described_fields(SourceStats)
    if name not in {n for n, _ in COUNTER_FIELDS} and doc
)
#: The engine load a gateway-stream source reports (`SourceStats.load`, `kvroute.EngineLoad`):
#: exported only for sources that carry it. Optional figures the engine did not report are absent.
LOAD_FIELDS: tuple[_Field, ...] = (
    ("kvroute_engine_running_requests", "running_requests", "gauge", "Requests the engine runs (reported)."),
    ("kvroute_engine_waiting_requests", "waiting_requests", "gauge", "Requests queued in the engine (reported)."),
    (
        "kvroute_engine_queued_tokens",
        "queued_tokens",
        "gauge",
        "Prefill work the engine holds: waiting uncached plus pending prompt tokens (reported).",
    ),
    ("kvroute_engine_token_usage", "token_usage", "gauge", "KV-cache utilization in [0, 1] (reported)."),
    ("kvroute_engine_silence_ms", "engine_silence_ms", "gauge", "Milliseconds since the engine last produced output."),
)

#: ``SourceStats.state`` becomes this 0/1 gauge (the other states are "syncing" and "resyncing").
SOURCE_SYNCED: _Field = ("kvroute_source_synced", "state", "gauge", "1 when the source is caught up (state 'synced').")
CLIENT_FIELDS: tuple[_Field, ...] = (
    (
        "kvroute_client_refused_sources",
        "refused_sources",
        "counter",
        "Sources refused (a cap, a malformed endpoint or key, a worker another origin feeds).",
    ),
    (
        "kvroute_client_removed_sources",
        "removed_sources",
        "counter",
        "Sources removed (by the caller, by discovery, or after a failure).",
    ),
    ("kvroute_client_failed_sources", "failed_sources", "counter", "Sources whose driver failed (then removed)."),
    (
        "kvroute_client_adopted_sources",
        "adopted_sources",
        "counter",
        "Ranks a gateway stream carried unannounced, followed from their first batch.",
    ),
    ("kvroute_client_events_dropped", "events_dropped", "counter", "Envelopes dropped by full events() buffers."),
)
# From `TotalStats`: how many sources, in which condition. Its counters are the per-source
# ones summed (sum() them in PromQL), so they are not exported twice.
TOTAL_FIELDS: tuple[_Field, ...] = (
    ("kvroute_client_sources", "sources", "gauge", "Sources subscribed now."),
    ("kvroute_client_sources_connected", "connected", "gauge", "Sources whose SUB socket has a publisher."),
    ("kvroute_client_sources_synced", "synced", "gauge", "Sources caught up."),
    ("kvroute_client_sources_partial", "partial", "gauge", "Sources with an incomplete history."),
)

INDEX_FIELDS: tuple[_Field, ...] = (
    ("kvroute_index_workers", "workers", "gauge", "Workers holding at least one block."),
    ("kvroute_index_entries", "entries", "gauge", "(block, worker) entries."),
    ("kvroute_index_distinct_keys", "distinct_keys", "gauge", "Distinct content keys held by any worker."),
    (
        "kvroute_index_unknown_parent_blocks",
        "unknown_parent_blocks",
        "counter",
        "Blocks stored under a parent the index never saw (never claimable).",
    ),
    (
        "kvroute_index_unhashable_blocks",
        "unhashable_blocks",
        "counter",
        "Blocks with a token outside uint32 (never claimable).",
    ),
    ("kvroute_index_unknown_removals", "unknown_removals", "counter", "Removals of blocks the index did not hold."),
    (
        "kvroute_index_ignored_group_events",
        "ignored_group_events",
        "counter",
        "Stores of a KV-cache group kind with no hit rule, or past the group bound.",
    ),
    ("kvroute_index_remote_blocks", "remote_blocks", "counter", "Blocks of locality REMOTE, not credited."),
    ("kvroute_index_repeated_stores", "repeated_stores", "counter", "Stores of a block already held on that tier."),
    ("kvroute_index_refused_block_sizes", "refused_block_sizes", "counter", "Stores refused: block-size bound."),
    ("kvroute_index_refused_entries", "refused_entries", "counter", "Blocks refused: entry bound."),
    ("kvroute_index_uncached_roots", "uncached_roots", "counter", "Queries whose namespace root was not cached."),
)

ROUTER_FIELDS: tuple[_Field, ...] = (
    ("kvroute_router_selections", "selections", "counter", "Routing decisions made."),
    (
        "kvroute_router_unknown_finishes",
        "unknown_finishes",
        "counter",
        "on_finish calls for requests the router did not know.",
    ),
    ("kvroute_router_active_requests", "active_requests", "gauge", "Requests started and not finished."),
    ("kvroute_router_approximate_workers", "approximate_workers", "gauge", "Workers routed in approximate mode."),
    (
        "kvroute_router_approximate_blocks",
        "approximate_blocks",
        "gauge",
        "Blocks the approximate workers are assumed to hold.",
    ),
)

# A scrape from another thread (prometheus_client's start_http_server) can catch the event
# loop resizing a dict the stats walk, which raises RuntimeError; reading again is safe. Five
# tries: each is a few microseconds per source, and back-to-back resizes are rare.
_READ_ATTEMPTS = 5


def _read(snapshot: Callable[[], _T]) -> _T:
    """Call ``snapshot`` again if it caught a dict or set changing size under it."""
    for _ in range(_READ_ATTEMPTS - 1):
        try:
            return snapshot()
        except RuntimeError:
            continue
    return snapshot()


def _family(spec: _Field, labels: Sequence[str] = ()) -> CounterMetricFamily | GaugeMetricFamily:
    # Imported here: kvroute imports this module whether or not the extra is installed.
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    name, _, kind, doc = spec
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


def _flat(fields: Sequence[_Field], stats: object | None) -> Iterator[Metric]:
    """One unlabelled family per field of ``stats``; without stats, empty ones (for describe)."""
    for spec in fields:
        fam = _family(spec)
        if stats is not None:
            fam.add_metric([], float(getattr(stats, spec[1])))
        yield fam


def _per_source(stats: ClientStats | None) -> Iterator[Metric]:
    families = [_family(spec, SOURCE_LABELS) for spec in SOURCE_FIELDS]
    synced = _family(SOURCE_SYNCED, SOURCE_LABELS)
    loads = [_family(spec, SOURCE_LABELS) for spec in LOAD_FIELDS]
    if stats is not None:
        for key, st in stats.sources.items():
            labels = [key.worker_id, str(key.dp_rank)]
            for fam, spec in zip(families, SOURCE_FIELDS):
                fam.add_metric(labels, float(getattr(st, spec[1])))
            synced.add_metric(labels, float(st.state == "synced"))
            for fam, spec in zip(loads, LOAD_FIELDS):
                value = getattr(st.load, spec[1]) if st.load is not None else None
                if value is not None:
                    fam.add_metric(labels, float(value))
    yield from families
    yield synced
    yield from loads


#: The client's worst apply lag: the largest `SourceStats.apply_lag` of its current sources.
APPLY_LAG_MAX: _Field = (
    "kvroute_client_apply_lag_max_seconds",
    "apply_lag",
    "gauge",
    "Largest apply lag over the sources: seconds from a batch's ts (engine clock) to its apply, newest batch each.",
)


def _apply_lag_max(stats: ClientStats | None) -> Metric:
    fam = _family(APPLY_LAG_MAX)
    if stats is not None:
        fam.add_metric([], max((st.apply_lag for st in stats.sources.values()), default=0.0))
    return fam


#: The `select` latency histogram, from RouterStats' ``select_seconds_*`` fields.
SELECT_HISTOGRAM = "kvroute_router_select_seconds"


def _select_histogram(stats: RouterStats | None) -> Metric:
    from prometheus_client.core import HistogramMetricFamily

    fam = HistogramMetricFamily(SELECT_HISTOGRAM, "Wall time of Router.select calls.")
    if stats is not None:
        buckets = [(repr(b), float(n)) for b, n in zip(SELECT_BUCKETS, stats.select_seconds_buckets)]
        buckets.append(("+Inf", float(stats.selections)))
        fam.add_metric([], buckets, stats.select_seconds_sum)
    return fam


class KvRouteCollector:
    """A prometheus_client collector of kvroute's stats: per source, client, index and router.

    Give any of ``client``, ``router`` and ``index``; ``index`` defaults to the client's
    index, else the router's. Every scrape reads their ``stats()`` afresh. Register it with
    `register` (or ``registry.register(collector)``). Safe to scrape from the event loop's
    thread or from prometheus_client's HTTP server thread.
    """

    def __init__(
        self, client: KvEventClient | None = None, router: Router | None = None, index: PrefixIndex | None = None
    ) -> None:
        if client is None and router is None and index is None:
            raise ConfigError("KvRouteCollector needs a client, a router or an index to read")
        try:
            import prometheus_client  # noqa: F401 (fail here, not at the first scrape)
        except ImportError as exc:
            raise ImportError(
                "kvroute's Prometheus metrics need prometheus-client: pip install 'kvroute[prometheus]'"
            ) from exc
        if index is None:
            index = client.index if client is not None else router.index if router is not None else None
        self.client = client
        self.router = router
        self.index = index

    def register(self, registry: CollectorRegistry | None = None) -> KvRouteCollector:
        """Register on ``registry`` (default: prometheus_client's global ``REGISTRY``); returns self."""
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        registry.register(self)
        return self

    def describe(self) -> Iterator[Metric]:
        """The families `collect` yields, without samples (the registry checks names with it)."""
        return self._families(None, None, None)

    def collect(self) -> Iterator[Metric]:
        """Read every stats snapshot and yield its metric families."""
        client = _read(self.client.stats) if self.client is not None else None
        index = _read(self.index.stats) if self.index is not None else None
        router = _read(self.router.stats) if self.router is not None else None
        return self._families(client, index, router)

    def _families(
        self, client: ClientStats | None, index: IndexStats | None, router: RouterStats | None
    ) -> Iterator[Metric]:
        if self.client is not None:
            yield from _per_source(client)
            yield from _flat(CLIENT_FIELDS, client)
            yield from _flat(TOTAL_FIELDS, client.totals if client is not None else None)
            yield _apply_lag_max(client)
        if self.index is not None:
            yield from _flat(INDEX_FIELDS, index)
        if self.router is not None:
            yield from _flat(ROUTER_FIELDS, router)
            yield _select_histogram(router)
