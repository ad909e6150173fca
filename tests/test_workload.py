"""The workload generator and the Mooncake trace reader: shape, determinism, sharing, bad input."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._errors import KvRouteError
from kvroute.cli import (
    Reachable,
    TraceError,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    reachable_hits,
    read_mooncake_trace,
)
from kvroute.cli._demo_run import DemoOptions, _workload
from kvroute.cli._workload import TRACE_SHAPES, distinct_blocks

SMALL = WorkloadConfig(requests=300, seed=7)


def test_deterministic_under_a_seed() -> None:
    assert generate_workload(SMALL) == generate_workload(SMALL)
    other = generate_workload(WorkloadConfig(requests=300, seed=8))
    assert [r.token_ids for r in other] != [r.token_ids for r in generate_workload(SMALL)]


def test_mix_has_every_kind_and_arrivals_grow() -> None:
    reqs = generate_workload(SMALL)
    assert len(reqs) == 300
    assert [r.id for r in reqs] == list(range(300))
    kinds = {r.kind for r in reqs}
    assert kinds == {"tenant", "turn", "oneoff"}
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # Poisson at the configured rate: the mean inter-arrival is 1/rate, within sampling error.
    assert 0.7 / SMALL.rate < arrivals[-1] / len(reqs) < 1.3 / SMALL.rate
    assert all(0 <= t < SMALL.vocab_size for r in reqs for t in r.token_ids)
    assert all(r.max_tokens == SMALL.max_tokens for r in reqs)


def test_tenants_share_their_system_prompt() -> None:
    reqs = generate_workload(SMALL)
    by_tenant: dict[int, list[WorkloadRequest]] = {}
    for r in reqs:
        if r.kind in ("tenant", "turn"):
            assert r.tenant is not None
            by_tenant.setdefault(r.tenant, []).append(r)
    low = SMALL.system_tokens[0]
    for group in by_tenant.values():
        heads = {tuple(r.token_ids[:low]) for r in group}
        assert len(heads) == 1  # one system prompt per tenant
    assert len({tuple(g[0].token_ids[:low]) for g in by_tenant.values()}) == len(by_tenant)
    # Zipf-like popularity: tenant 0 is the most requested.
    counts = {t: len(g) for t, g in by_tenant.items()}
    assert max(counts, key=lambda t: counts[t]) == 0


def test_turns_extend_the_previous_turn_and_follow_it() -> None:
    reqs = generate_workload(SMALL)
    by_id = {r.id: r for r in reqs}
    sessions: dict[int, list[WorkloadRequest]] = {}
    for r in reqs:
        if r.kind == "turn":
            assert r.session is not None
            sessions.setdefault(r.session, []).append(r)
    assert sum(len(s) > 1 for s in sessions.values()) >= 10
    for turns in sessions.values():
        assert turns[0].follows is None and turns[0].think_time == 0.0
        for prev, cur in itertools.pairwise(turns):
            assert cur.follows == prev.id and by_id[cur.follows] is prev
            assert cur.think_time == SMALL.think_time
            assert len(cur.token_ids) > len(prev.token_ids)
            assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
        assert len(turns) <= SMALL.turns[1]


def test_oneoffs_share_nothing() -> None:
    reqs = generate_workload(SMALL)
    heads = [tuple(r.token_ids[:32]) for r in reqs]
    for r, head in zip(reqs, heads):
        if r.kind == "oneoff":
            assert heads.count(head) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"requests": -1},
        {"tenants": 0},
        {"system_tokens": (10, 5)},
        {"turns": (0, 3)},
        {"conversation_share": 0.8, "oneoff_share": 0.3},
        {"rate": 0.0},
        {"rate": float("inf")},
        {"turn_gap": 0.5},
        {"think_time": -1.0},
        {"max_tokens": 0},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    requests=st.integers(0, 60),
    conversation_share=st.floats(0.0, 0.6),
    oneoff_share=st.floats(0.0, 0.4),
)
def test_any_config_gives_consistent_requests(
    seed: int, requests: int, conversation_share: float, oneoff_share: float
) -> None:
    cfg = WorkloadConfig(
        requests=requests,
        seed=seed,
        tenants=3,
        system_tokens=(16, 64),
        question_tokens=(1, 8),
        user_tokens=(1, 8),
        reply_tokens=(1, 8),
        oneoff_tokens=(1, 32),
        conversation_share=conversation_share,
        oneoff_share=oneoff_share,
    )
    reqs = generate_workload(cfg)
    assert len(reqs) == requests
    ids = {r.id for r in reqs}
    for r in reqs:
        assert r.token_ids and all(0 <= t < cfg.vocab_size for t in r.token_ids)
        if r.follows is not None:
            assert r.follows in ids and r.follows < r.id


# --- Mooncake traces ------------------------------------------------------------------------------


def _write(path: Path, records: list[dict[str, object]], extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_hash_ids_expand_to_equal_blocks(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3], "extra": "ignored"},
            {"timestamp": 3000, "input_length": 700, "output_length": 0, "hash_ids": [4, 5]},
        ],
    )
    a, b, c = read_mooncake_trace(trace)
    assert [len(r.token_ids) for r in (a, b, c)] == [1024, 1300, 700]
    assert b.token_ids[:1024] == a.token_ids  # shared hash ids: shared tokens, block for block
    assert c.token_ids[:512] != a.token_ids[:512]
    assert [r.arrival for r in (a, b, c)] == [0.0, 0.5, 2.0]  # ms -> s from the first record
    assert [r.max_tokens for r in (a, b, c)] == [10, 5, 1]
    assert {r.kind for r in (a, b, c)} == {"trace"}
    assert [r.id for r in (a, b, c)] == [0, 1, 2]
    # Deterministic across reads, and a block's tokens depend on its id alone.
    assert read_mooncake_trace(trace) == [a, b, c]
    other = _write(tmp_path / "o.jsonl", [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [2]}])
    assert read_mooncake_trace(other)[0].token_ids == a.token_ids[512:1024]


def test_trace_options(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 4000, "input_length": 100, "output_length": 300, "hash_ids": [9]},
            {"timestamp": 0, "input_length": 64, "output_length": 3, "hash_ids": [9]},
            {"timestamp": 2000, "input_length": 200, "output_length": 3, "hash_ids": [9]},
        ],
        extra_lines=("", "   "),
    )
    reqs = read_mooncake_trace(trace, block_tokens=64, speedup=4.0, max_tokens=32)
    # Sorted by timestamp; 4x faster; output capped.
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0]
    assert [r.max_tokens for r in reqs] == [3, 3, 32]
    first, second, third = reqs
    assert second.token_ids[:64] == first.token_ids
    # Past its blocks a prompt continues with tokens unique to it.
    assert len(second.token_ids) == 200 and len(third.token_ids) == 100
    assert second.token_ids[64:100] != third.token_ids[64:100]
    assert len(read_mooncake_trace(trace, limit=2)) == 2
    assert read_mooncake_trace(_write(tmp_path / "empty.jsonl", [])) == []


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 0, "input_length": 10, "output_length": 1}',
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
        '{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1e30]}',
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [36893488147419103232]}',
        '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
        "[1, 2, 3]",
    ],
)
def test_bad_trace_lines_raise_with_their_line(tmp_path: Path, line: str) -> None:
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    trace = _write(tmp_path / "bad.jsonl", [good], extra_lines=(line,))
    with pytest.raises(TraceError, match=r"bad\.jsonl:2") as info:
        read_mooncake_trace(trace)
    assert isinstance(info.value, KvRouteError)


def test_missing_trace_and_bad_options(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        read_mooncake_trace(tmp_path / "nope.jsonl")
    trace = _write(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}])
    with pytest.raises(ValueError):
        read_mooncake_trace(trace, block_tokens=0)
    with pytest.raises(ValueError):
        read_mooncake_trace(trace, speedup=0.0)


def _req(i: int, tokens: list[int], arrival: float | None = None) -> WorkloadRequest:
    return WorkloadRequest(
        id=i, arrival=float(i) if arrival is None else arrival, token_ids=tokens, max_tokens=1, kind="x"
    )


def test_reachable_hits_count_whole_blocks_an_earlier_request_stored() -> None:
    a = list(range(100, 132))  # 4 blocks of 8
    same_prefix = a[:16] + list(range(500, 516))  # shares 2 blocks with a, then diverges
    got = reachable_hits([_req(0, a), _req(1, [*a, 7]), _req(2, same_prefix), _req(3, [1] * 5)], block_size=8)
    # a: nothing before it; a + [7]: all 4 of a's blocks; same_prefix: 2; the short prompt: no full block.
    assert got == Reachable(prompt_tokens=32 + 33 + 32 + 5, cached_tokens=(4 + 2) * 8)
    assert got.hit_rate == pytest.approx(48 / 102)


def test_reachable_hits_never_count_the_last_token_and_follow_arrival_order() -> None:
    a = list(range(16))  # exactly 2 blocks of 8: a repeat can hit only the first (the engine computes the last)
    assert reachable_hits([_req(0, a), _req(1, a)], block_size=8).cached_tokens == 8
    # Listed out of order, the earlier arrival stores and the later one hits.
    assert (
        reachable_hits([_req(0, [*a, 1], arrival=5.0), _req(1, [*a, 2], arrival=1.0)], block_size=8).cached_tokens == 16
    )
    # A block is its content and its whole prefix: the same block after a different first block is new.
    assert reachable_hits([_req(0, [1] * 8 + [2] * 9), _req(1, [3] * 8 + [2] * 9)], block_size=8).cached_tokens == 0
    assert reachable_hits([], block_size=8).hit_rate == 0.0
    with pytest.raises(ValueError, match="block_size"):
        reachable_hits([], block_size=0)


def test_reachable_hits_of_a_trace_follow_its_hash_ids(tmp_path: Path) -> None:
    # Two documents, each asked three times: every repeat can reuse the document's 4 blocks of 64 tokens.
    lines = [
        json.dumps(
            {
                "timestamp": i,
                "input_length": 5 * 64,
                "output_length": 1,
                "hash_ids": [d * 10 + b for b in range(4)] + [100 + i],
            }
        )
        for i, d in enumerate([0, 1, 0, 1, 0, 1])
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    got = reachable_hits(read_mooncake_trace(trace, block_tokens=64), block_size=16)
    assert got == Reachable(prompt_tokens=6 * 320, cached_tokens=4 * 256)


@pytest.mark.parametrize("shape", ["conversation", "toolagent", "synthetic"])
def test_generated_mooncake_traces_round_trip_and_have_their_shape(shape: str, tmp_path: Path) -> None:
    from kvroute.cli._workload import generate_mooncake_trace, trace_requests, write_mooncake_trace

    records = generate_mooncake_trace(shape, 300, seed=1)
    assert records == generate_mooncake_trace(shape, 300, seed=1) != generate_mooncake_trace(shape, 300, seed=2)
    assert len(records) == 300
    assert [r.timestamp for r in records] == sorted(r.timestamp for r in records)
    for r in records:
        assert r.hash_ids[0] == 0  # the shared system prompt, as in Mooncake's published traces
        assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512
    path = tmp_path / f"{shape}.jsonl"
    write_mooncake_trace(path, records)
    assert read_mooncake_trace(path) == trace_requests(records)
    reach = reachable_hits(trace_requests(records), 16).hit_rate
    # Each shape's reuse: conversations reuse their history; agents and documents reuse more, sooner.
    low, high = {"conversation": (0.4, 0.8), "toolagent": (0.75, 0.97), "synthetic": (0.75, 0.97)}[shape]
    assert low < reach < high, reach
    if shape != "synthetic":
        # A later turn extends an earlier prompt: its hash ids start with another record's whole list.
        prefixes = {tuple(r.hash_ids) for r in records}
        assert sum(any(tuple(r.hash_ids[:k]) in prefixes for k in range(2, len(r.hash_ids))) for r in records) > 100


def test_generated_trace_rejects_an_unknown_shape() -> None:
    from kvroute.cli._workload import generate_mooncake_trace

    with pytest.raises(ValueError, match="shape"):
        generate_mooncake_trace("bursty")


def test_distinct_blocks_count_each_prefix_once() -> None:
    def req(i: int, tokens: list[int]) -> WorkloadRequest:
        return WorkloadRequest(id=i, arrival=float(i), token_ids=tokens, max_tokens=1, kind="trace")

    a, b, c = [1] * 4, [2] * 4, [3] * 4
    # Blocks of 4: [a], [a b], [a b c] (a partial tail never counts), then [b] — a prefix names its whole chain,
    # so b after a and b at the start are two blocks.
    workload = [req(0, [*a, *b]), req(1, [*a, *b, *c, 9]), req(2, [*b, 5, 5])]
    assert distinct_blocks(workload, 4) == 4
    assert distinct_blocks([], 4) == 0
    with pytest.raises(ValueError):
        distinct_blocks(workload, 0)


@pytest.mark.parametrize("shape", TRACE_SHAPES)
def test_generated_traces_run_on_caches_under_pressure(shape: str) -> None:
    # The demo's default for a generated trace: the fleet holds half the trace's distinct blocks, or 8 mean-sized
    # requests a rank where that is more (the tool-agent and document shapes: few long prefixes); never less than
    # its largest request.
    options = DemoOptions(trace_shape=shape, seed=1)
    workload, capacity, _ = _workload(options)
    ranks = 6  # the default fleet: 4 engines, 2 of them with 2 ranks
    sizes = [-(-(len(r.token_ids) + r.max_tokens) // 16) for r in workload]
    distinct = distinct_blocks(workload, 16)
    assert capacity == max(math.ceil(distinct / 2 / ranks), math.ceil(8 * sum(sizes) / len(sizes)), max(sizes))
    # The old default (32,768 a rank) held every shape whole, twice over.
    assert distinct < 32768 * ranks / 2
    if shape == "conversation":
        # Sessions keep coming: the fleet holds about half of what the trace computes.
        assert capacity * ranks < 0.6 * distinct
    assert _workload(DemoOptions(trace_shape=shape, capacity_blocks=999))[1] == 999
