"""The Prometheus collector: scraped from a fresh registry while a real client follows simulated publishers."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import anyio
import msgspec
import pytest
from _publisher_helpers import FAST, Workload, following_live, settle, truth_index
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from kvroute._client import ClientStats, KvEventClient, TotalStats
from kvroute._index import IndexStats, PrefixIndex
from kvroute._load import EngineLoad
from kvroute._metrics import (
    CLIENT_FIELDS,
    INDEX_FIELDS,
    LOAD_FIELDS,
    ROUTER_FIELDS,
    SELECT_HISTOGRAM,
    SOURCE_FIELDS,
    SOURCE_SYNCED,
    TOTAL_FIELDS,
    KvRouteCollector,
    _read,
)
from kvroute._models import WorkerKey
from kvroute._router import Router, RouterStats
from kvroute._source import RecoveryStats
from kvroute._transports._base import SourceCounters, SourceStats
from kvroute.sim._publisher import EventPublisher

# No quiet-tick probes during a test: they bump `replays` between two reads of the stats.
QUIET = msgspec.structs.replace(FAST, quiet_interval=60.0)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, sorted labels), and every family's type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def _scrape(registry: CollectorRegistry) -> tuple[Samples, dict[str, str]]:
    return _samples(generate_latest(registry).decode("utf-8"))


def _sample_name(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


def _labels(key: WorkerKey) -> tuple[tuple[str, str], ...]:
    return (("dp_rank", str(key.dp_rank)), ("worker_id", key.worker_id))


def _assert_source(samples: Samples, key: WorkerKey, st: SourceStats) -> None:
    for name, field, kind, _ in SOURCE_FIELDS:
        assert samples[(_sample_name(name, kind), _labels(key))] == float(getattr(st, field)), name
    assert samples[("kvroute_source_synced", _labels(key))] == float(st.state == "synced")


def _assert_flat(samples: Samples, fields: tuple[tuple[str, str, str, str], ...], stats: object) -> None:
    for name, field, kind, _ in fields:
        assert samples[(_sample_name(name, kind), ())] == float(getattr(stats, field)), name


@pytest.mark.anyio
async def test_scrape_matches_the_stats_end_to_end() -> None:
    wa, wb = Workload(31), Workload(32)
    async with EventPublisher() as pa, EventPublisher(data_parallel_rank=1) as pb:
        a, b = pa.source("a"), pb.source("b")
        for _ in range(4):  # history before the client starts: cold-start replay
            pa.publish(wa.batch())
            pb.publish(wb.batch())
        async with KvEventClient([a, b], config=QUIET) as client:
            router = Router(client.index, states=client, block_size=4)
            registry = CollectorRegistry()
            collector = KvRouteCollector(client, router).register(registry)
            assert collector.index is client.index
            stream = client.events()
            await settle(client, stream, {a.key: 3, b.key: 3})
            # Synced is not subscribed (a slow joiner): the garbage below must reach the SUB live.
            await following_live(client, pa, a.key, wa)
            # Garbage on a stale seq (counted, dropped) and a message of the wrong shape.
            pa.publish_raw([b"", (0).to_bytes(8, "big"), b"\xc1"])
            pa.publish_raw([b"only one frame"])
            pa.publish(wa.batch())
            last_a = pa.next_seq - 1
            await settle(client, stream, {a.key: last_a})
            # A query a holds (by the engine-side truth, not kvroute's index): the newest full chain.
            truth = truth_index({a.key: pa, b.key: pb})
            query = list(next(q for q in reversed(wa.queries) if truth.find_matches(q).get(a.key)))
            decision = router.select(query, request_id="r1")

            samples, types = _scrape(registry)
            stats, index_stats, router_stats = client.stats(), client.index.stats(), router.stats()
            for key, st in stats.sources.items():
                _assert_source(samples, key, st)
            _assert_flat(samples, CLIENT_FIELDS, stats)
            _assert_flat(samples, TOTAL_FIELDS, stats.totals)
            _assert_flat(samples, INDEX_FIELDS, index_stats)
            _assert_flat(samples, ROUTER_FIELDS, router_stats)
            # ... and the stats themselves say what happened.
            la, lb = _labels(a.key), _labels(b.key)
            assert samples[("kvroute_source_decode_errors_total", la)] == 1
            assert samples[("kvroute_source_skipped_frames_total", la)] == 1
            assert samples[("kvroute_source_decode_errors_total", lb)] == 0
            assert samples[("kvroute_source_last_seq", la)] == last_a and samples[("kvroute_source_last_seq", lb)] == 3
            assert samples[("kvroute_source_batches_total", la)] == last_a + 1
            assert samples[("kvroute_source_replayed_batches_total", lb)] >= 4
            assert samples[("kvroute_source_synced", la)] == samples[("kvroute_source_connected", la)] == 1
            assert samples[("kvroute_client_sources", ())] == samples[("kvroute_client_sources_synced", ())] == 2
            assert samples[("kvroute_index_workers", ())] == 2
            assert samples[("kvroute_index_entries", ())] == client.index.num_blocks() > 0
            assert samples[("kvroute_router_selections_total", ())] == 1
            assert samples[("kvroute_router_active_requests", ())] == 1
            assert decision.worker == a.key and decision.overlap_blocks > 0
            assert types["kvroute_source_messages"] == "counter" and types["kvroute_source_connected"] == "gauge"
            # A scrape from another thread (prometheus_client's HTTP server) while events flow.
            server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
            try:
                url = f"http://127.0.0.1:{server.server_port}/metrics"
                before = client.stats().sources[a.key].messages
                for _ in range(50):
                    pa.publish(wa.batch())
                body = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=10).read())
            finally:
                server.shutdown()
                server.server_close()
                thread.join(5)
            http, _ = _samples(body.decode("utf-8"))
            # Counters read from the HTTP thread while batches are in flight: never behind what was counted.
            assert http[("kvroute_source_messages_total", la)] >= before
            # A removed source's series go; the removal is counted.
            assert client.remove_source(b)
            samples, _ = _scrape(registry)
            assert ("kvroute_source_messages_total", lb) not in samples
            assert samples[("kvroute_client_removed_sources_total", ())] == 1
            assert samples[("kvroute_client_sources", ())] == 1
            assert samples[("kvroute_index_workers", ())] == 1


def test_every_stats_field_is_exported() -> None:
    """A field added to a stats struct fails here until it gets a metric (or a reason not to)."""

    def fields(table: tuple[tuple[str, str, str, str], ...]) -> set[str]:
        return {f for _, f, _, _ in table}

    # `load` (gateway sources only) is the LOAD_FIELDS families.
    assert fields((*SOURCE_FIELDS, SOURCE_SYNCED)) == set(SourceStats.__struct_fields__) - {"load"}
    assert fields(LOAD_FIELDS) <= set(EngineLoad.__struct_fields__) | {"queued_tokens"}
    # `sources` is the per-source families, `totals` the TOTAL_FIELDS gauges.
    assert fields(CLIENT_FIELDS) == set(ClientStats.__struct_fields__) - {"sources", "totals"}
    # TotalStats' counters are the per-source counters summed: sum() them in PromQL.
    counters = set(SourceCounters.__struct_fields__)
    assert fields(TOTAL_FIELDS) == set(TotalStats.__struct_fields__) - counters
    assert counters <= fields(SOURCE_FIELDS)
    assert fields(INDEX_FIELDS) == set(IndexStats.__struct_fields__)
    # The select_seconds_* fields are the SELECT_HISTOGRAM family.
    histogram = {"select_seconds_sum", "select_seconds_buckets"}
    assert fields(ROUTER_FIELDS) == set(RouterStats.__struct_fields__) - histogram
    names = [n for n, *_ in (*SOURCE_FIELDS, SOURCE_SYNCED, *LOAD_FIELDS, *CLIENT_FIELDS, *TOTAL_FIELDS, *INDEX_FIELDS,
                             *ROUTER_FIELDS)]  # fmt: skip
    assert len(names) == len(set(names)) and all(n.startswith("kvroute_") for n in names)
    assert not any(n.endswith("_total") for n in names)  # prometheus_client adds it to counters


def test_one_definition_of_the_per_source_counters() -> None:
    """Recovery counters are RecoveryStats' fields, I/O counters SourceCounters' own: each defined once."""
    recovery = set(RecoveryStats.__struct_fields__)
    assert {"duplicates", "stale", "restarts", "uncovered", "overflows"} <= recovery
    io = set(SourceCounters.__struct_fields__) - recovery
    assert io and not io & recovery
    # SourceStats and TotalStats carry every counter; every counter is a Prometheus counter
    # whose help is the field's description.
    for cls in (SourceStats, TotalStats):
        assert set(SourceCounters.__struct_fields__) <= set(cls.__struct_fields__)
    exported = {f: (kind, doc) for _, f, kind, doc in SOURCE_FIELDS}
    for name in SourceCounters.__struct_fields__:
        kind, doc = exported[name]
        assert kind == "counter" and doc, name


def test_describe_names_what_collect_yields() -> None:
    index = PrefixIndex()
    router = Router(index, block_size=4)
    registry = CollectorRegistry()
    collector = KvRouteCollector(router=router).register(registry)
    assert collector.index is index
    described = [(m.name, m.type, m.documentation) for m in collector.describe()]
    collected = list(collector.collect())
    assert described == [(m.name, m.type, m.documentation) for m in collected]
    assert all(not m.samples for m in collector.describe())
    assert all(len(m.samples) == 1 for m in collected if m.name != SELECT_HISTOGRAM)
    assert {m.name for m in collected} == {n for n, *_ in (*INDEX_FIELDS, *ROUTER_FIELDS)} | {SELECT_HISTOGRAM}
    # The registry checks names with describe(): a second collector of the same names is refused.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        KvRouteCollector(index=index).register(registry)
    # Only the index given: index families only.
    alone = CollectorRegistry()
    KvRouteCollector(index=index).register(alone)
    samples, _ = _scrape(alone)
    assert {name for name, _ in samples} == {n + "_total" if k == "counter" else n for n, _, k, _ in INDEX_FIELDS}


def test_needs_something_to_read_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="client, a router or an index"):
        KvRouteCollector()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"kvroute\[prometheus\]"):
        KvRouteCollector(index=PrefixIndex())


def test_importing_kvroute_metrics_leaves_prometheus_client_alone() -> None:
    # prometheus_client builds its global registry (and process collectors) on import: a
    # router that does not use metrics must not pay for it.
    code = "import sys, kvroute._metrics; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_snapshot_caught_mid_resize_is_read_again() -> None:
    table = {0: 0}
    calls = 0

    def snapshot() -> int:
        nonlocal calls
        calls += 1
        for k in table:
            if calls == 1:
                table[k + 1] = 0  # the event loop's thread resizing it under a scrape
        return len(table)

    assert _read(snapshot) == 2 and calls == 2

    def always_resized() -> int:
        for k in table:
            table[k + 100] = 0
        return 0

    with pytest.raises(RuntimeError):
        _read(always_resized)
