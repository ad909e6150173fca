"""The Router: cost model, tier credit, ties, temperature, candidates, worker states, load, approximate mode.

The simulation routes a shared-prefix workload onto simulated engines
(`kvroute.sim._cache.PrefixCache`, whose real BlockStored / BlockRemoved events feed the index)
and compares the engines' own prefix-cache hit rate with round-robin's. The last test runs a
simulated engine over loopback ZMQ into a real `KvEventClient` and routes from its index and states.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._client import KvEventClient
from kvroute._errors import KvRouteError, NoWorkersError
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey, WorkerStatus
from kvroute._router import CandidateScore, CostModel, Router, RouterError, RoutingDecision
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._wire import BlockStored, EventBatch
from kvroute.sim._cache import PrefixCache
from kvroute.sim._engine import SimConfig, SimEngine

BS = 16
A, B, C, D, E = (WorkerKey(n, 0) for n in "abcde")
# Five full blocks and a partial one: 88 tokens.
PROMPT = list(range(1000, 1088))
# Dynamo's weight, which the cost arithmetic of some tests below is written in (the default is 2.0).
W1 = CostModel(overlap_weight=1.0)
SYNCED = WorkerStatus(state="synced")


class _States:
    """A static `WorkerStates` provider: the live set and each worker's status, set by the test."""

    def __init__(self, statuses: dict[WorkerKey, WorkerStatus | None], live: set[WorkerKey] | None = None) -> None:
        self.statuses = statuses
        self.live = set(statuses) if live is None else live

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        return self.statuses.get(worker)

    def live_workers(self) -> set[WorkerKey]:
        return set(self.live)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(index: PrefixIndex, worker: WorkerKey, blocks: int, *, medium: str | None = None) -> None:
    """Let ``worker`` hold the first ``blocks`` blocks of PROMPT."""
    index.apply(
        worker,
        BlockStored(
            block_hashes=[i + 1 for i in range(blocks)],
            token_ids=PROMPT[: blocks * BS],
            block_size=BS,
            medium=medium,
        ),
    )


def _entry(decision: RoutingDecision, worker: WorkerKey) -> CandidateScore:
    (found,) = [c for c in decision.candidates if c.worker == worker]
    return found


# --- the cost model -------------------------------------------------------------------------


def test_cost_is_prefill_still_to_do_and_the_breakdown_is_reported() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 1)
    router = Router(index, seed=1, cost=W1)
    router.add_worker(C)
    d = router.select(PROMPT)
    assert d.worker == A and d.overlap_blocks == 4 and d.query_tokens == 88
    # 88 tokens, 64 cached: 24 tokens = 1.5 blocks to prefill.
    assert d.cost == 1.5
    a, b = _entry(d, A), _entry(d, B)
    assert (a.claimed_blocks, a.overlap_blocks, a.block_size, a.prefill_blocks, a.cost) == (4, 4, BS, 1.5, 1.5)
    assert (b.overlap_blocks, b.prefill_blocks, b.cost) == (1, 4.5, 4.5)
    assert a.source == b.source == "index"
    assert d.idle_workers == 1 and d.idle_cost == 5.5
    assert msgspec.json.decode(msgspec.json.encode(d))["worker"] == ["a", 0]


@pytest.mark.parametrize(("weight", "winner"), [(1.0, B), (3.0, B), (4.0, A)])
def test_overlap_weight_trades_prefill_against_load(weight: float, winner: WorkerKey) -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 1)
    router = Router(index, cost=CostModel(overlap_weight=weight))
    # a: 1.5 w + 10, b: 4.5 w -> b wins while w < 10/3.
    d = router.select(PROMPT, load={A: 10.0})
    assert d.worker == winner
    assert _entry(d, A).cost == 1.5 * weight + 10.0
    assert _entry(d, A).load_blocks == 10.0


def test_zero_overlap_weight_is_pure_load_balancing() -> None:
    index = PrefixIndex()
    _store(index, A, 5)
    router = Router(index, cost=CostModel(overlap_weight=0.0))
    router.add_worker(B)
    assert router.select(PROMPT, load={A: 0.5}).worker == B


def test_slower_tiers_get_partial_credit() -> None:
    index = PrefixIndex()
    _store(index, A, 3)  # GPU
    _store(index, B, 4, medium="CPU_PINNED")
    query = PROMPT[:65]  # 4 whole blocks and a last token (never served from cache)
    d = Router(index).select(query)
    # b: 4 CPU blocks x 0.8 = 3.2 of 4 -> 0.8 to prefill (+ the last token, 1/16); a: 3 of 4 -> 1.0 (+ 1/16).
    assert d.worker == B and d.overlap_blocks == 4
    assert math.isclose(_entry(d, B).prefill_blocks, 0.8 + 1 / 16)
    d = Router(index, cost=CostModel(cpu_credit=0.5)).select(query)
    assert d.worker == A
    assert _entry(d, B).prefill_blocks == 2.0 + 1 / 16
    d = Router(index, cost=CostModel(cpu_credit=1.0)).select(query)
    assert d.worker == B and _entry(d, B).prefill_blocks == 1 / 16


def test_credited_blocks_takes_the_best_tier_covering_each_block() -> None:
    model = CostModel()
    # Blocks 0-1 on GPU, 2-3 on CPU (0.8), 4 on DISK (0.5), 5 on a mix (lowest slow credit, 0.5).
    assert math.isclose(model.credited_blocks(6, 2, 4, 5, 0), 2 + 2 * 0.8 + 0.5 + 0.5)
    assert model.credited_blocks(3, 3, 0, 0, 0) == 3.0
    assert math.isclose(CostModel(external_credit=0.25).credited_blocks(2, 0, 0, 0, 2), 0.5)
    assert not model.full_credit and CostModel(cpu_credit=1, disk_credit=1, external_credit=1).full_credit


@pytest.mark.parametrize(
    "bad",
    [
        {"overlap_weight": -1.0},
        {"overlap_weight": math.inf},
        {"cpu_credit": 1.5},
        {"disk_credit": -0.1},
        {"external_credit": math.nan},
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"temperature": "hot"},
        {"overlap_weight": True},
    ],
)
def test_cost_model_rejects_bad_settings(bad: dict[str, object]) -> None:
    with pytest.raises(RouterError) as info:
        CostModel(**bad)  # type: ignore[arg-type]
    assert isinstance(info.value, KvRouteError)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, CostModel)


def test_cost_model_loads_from_configuration() -> None:
    model = msgspec.convert({"overlap_weight": 2, "temperature": 0.5}, CostModel)
    assert model == CostModel(overlap_weight=2.0, temperature=0.5)


class _PrefillOnly(CostModel, frozen=True, kw_only=True):
    def cost(self, prefill_blocks: float, load_blocks: float) -> float:
        return prefill_blocks


def test_a_cost_model_subclass_replaces_the_policy() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 1)
    d = Router(index, cost=_PrefillOnly()).select(PROMPT, load={A: 100.0})
    assert d.worker == A and d.cost == 1.5


# --- ties and temperature -------------------------------------------------------------------


def test_ties_are_broken_at_random_among_equal_costs_only() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 4)
    router = Router(index, seed=7)
    router.add_worker(C)
    counts = Counter(router.select(PROMPT).worker for _ in range(400))
    assert set(counts) == {A, B}
    assert 120 <= counts[A] <= 280


def test_idle_workers_tie_with_each_other_and_with_equal_listed_ones() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    # a's claim is held back (syncing): it costs what an idle worker costs, and ties with them.
    states = _States({A: WorkerStatus(state="syncing"), B: SYNCED, C: SYNCED, D: SYNCED})
    router = Router(index, states=states, seed=3)
    counts = Counter(router.select(PROMPT).worker for _ in range(400))
    assert set(counts) == {A, B, C, D}
    assert all(50 <= n <= 150 for n in counts.values())
    d = router.select(PROMPT)
    assert d.idle_workers + len(d.candidates) == 4


def test_zero_temperature_is_deterministic() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 3)
    router = Router(index, seed=0)
    assert {router.select(PROMPT).worker for _ in range(50)} == {A}


def test_temperature_samples_the_softmax_of_negative_costs() -> None:
    index = PrefixIndex()
    _store(index, A, 4)  # cost 1.5
    _store(index, B, 3)  # cost 2.5
    router = Router(index, cost=CostModel(overlap_weight=1.0, temperature=1.0), seed=11)
    router.add_worker(C)
    router.add_worker(D)  # c, d idle: cost 5.5
    n = 3000
    counts = Counter(router.select(PROMPT).worker for _ in range(n))
    weights = {A: 1.0, B: math.exp(-1.0), C: math.exp(-4.0), D: math.exp(-4.0)}
    total = sum(weights.values())
    for w, wgt in weights.items():
        # ±5 binomial standard deviations
        p = wgt / total
        assert abs(counts[w] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (w, counts)


def test_high_temperature_spreads_over_every_candidate() -> None:
    index = PrefixIndex()
    _store(index, A, 5)
    router = Router(index, cost=CostModel(temperature=1000.0), seed=5)
    for w in (B, C, D):
        router.add_worker(w)
    assert set(Counter(router.select(PROMPT).worker for _ in range(200))) == {A, B, C, D}


# --- candidates and worker states -----------------------------------------------------------


def test_candidates_restrict_the_choice() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    _store(index, B, 1)
    router = Router(index)
    d = router.select(PROMPT, candidates=[B, C])
    assert d.worker == B
    assert {c.worker for c in d.candidates} == {B}
    assert d.idle_workers == 1
    assert router.select(PROMPT, candidates=iter([C])).worker == C


def test_no_candidate_left_is_a_clear_error() -> None:
    index = PrefixIndex()
    with pytest.raises(NoWorkersError, match="no live or registered worker"):
        Router(index).select(PROMPT)
    _store(index, A, 2)
    with pytest.raises(NoWorkersError, match="none of the given candidates"):
        Router(index).select(PROMPT, candidates=[])
    states = _States({A: SYNCED}, live=set())
    with pytest.raises(NoWorkersError):
        Router(index, states=states).select(PROMPT)
    with pytest.raises(NoWorkersError):
        Router(index, states=_States({A: SYNCED})).select(PROMPT, candidates=[B])


def test_only_synced_complete_workers_may_use_their_overlap() -> None:
    index = PrefixIndex()
    for w in (A, B, C, D):
        _store(index, w, 4)
    _store(index, E, 1)
    statuses: dict[WorkerKey, WorkerStatus | None] = {
        A: WorkerStatus(state="syncing"),
        B: WorkerStatus(state="synced", partial=True),
        C: WorkerStatus(state="resyncing"),
        D: None,  # live but with no status yet
        E: SYNCED,
    }
    router = Router(index, states=_States(statuses), cost=W1)
    d = router.select(PROMPT)
    assert d.worker == E and d.overlap_blocks == 1
    for w in (A, B, C, D):
        held_back = _entry(d, w)
        assert (held_back.claimed_blocks, held_back.overlap_blocks, held_back.cost) == (4, 0, 5.5)
    d = Router(index, states=_States(statuses), trust_partial=True, cost=W1).select(PROMPT)
    assert d.worker == B and d.overlap_blocks == 4


def test_workers_removed_from_discovery_are_never_chosen() -> None:
    index = PrefixIndex()
    _store(index, A, 5)  # the best overlap, but no longer live
    states = _States({A: SYNCED, B: SYNCED}, live={B})
    router = Router(index, states=states)
    for _ in range(20):
        d = router.select(PROMPT)
        assert d.worker == B
        assert A not in {c.worker for c in d.candidates}
    assert router.select(PROMPT, candidates=[A, B]).worker == B
    assert router.workers() == {B}


def test_a_registered_worker_stays_a_candidate_beside_discovered_ones() -> None:
    states = _States({A: SYNCED})
    router = Router(PrefixIndex(), states=states)
    router.add_worker(B)
    assert router.workers() == {A, B}
    router.remove_worker(B)
    assert router.workers() == {A}


# --- load -----------------------------------------------------------------------------------


def test_select_records_load_and_on_finish_releases_it() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    router = Router(index)
    router.add_worker(B)
    d = router.select(PROMPT, request_id="r1")
    assert d.worker == A
    # Only the part it did not find cached adds KV there: 24 tokens.
    assert router.load_blocks(A) == 1.5
    d = router.select(PROMPT, request_id="r2")
    assert d.worker == A and _entry(d, A).load_blocks == 1.5 and router.load_blocks(A) == 3.0
    assert router.stats().active_requests == 2
    assert router.on_finish("r1") and router.on_finish("r2")
    assert router.load_blocks(A) == 0.0
    assert not router.on_finish("r1")
    stats = router.stats()
    assert (stats.active_requests, stats.unknown_finishes, stats.selections) == (0, 1, 2)


def test_tracked_load_spreads_uncached_prompts() -> None:
    router = Router(PrefixIndex(), seed=2)
    for w in (A, B, C):
        router.add_worker(w)
    chosen = [router.select([i] * 160, request_id=i).worker for i in range(9)]
    assert Counter(chosen) == {A: 3, B: 3, C: 3}
    for i in range(3):
        router.on_finish(i)
    assert sum(router.load_blocks(w) for w in (A, B, C)) == 6 * 10.0


def test_on_start_moves_a_restarted_request_and_remove_worker_drops_load() -> None:
    router = Router(PrefixIndex())
    router.on_start("x", A, PROMPT)
    assert router.load_blocks(A) == 5.5
    router.on_start("x", B, PROMPT, cached_tokens=80)
    assert router.load_blocks(A) == 0.0 and router.load_blocks(B) == 0.5
    router.on_start("y", B, PROMPT)
    router.remove_worker(B)
    assert router.load_blocks(B) == 0.0
    assert router.stats().active_requests == 0
    assert not router.on_finish("y")


def test_supplied_load_replaces_the_tracked_one() -> None:
    index = PrefixIndex()
    _store(index, A, 4)
    router = Router(index, cost=W1)
    router.add_worker(B)
    router.on_start("big", A, [7] * 1600)
    assert router.select(PROMPT).worker == B
    assert router.select(PROMPT, load={}).worker == A
    assert router.select(PROMPT, load={A: 5.0}).worker == B


# --- approximate mode -----------------------------------------------------------------------


def test_approximate_worker_holds_what_was_routed_to_it_until_the_ttl() -> None:
    clock = _Clock()
    router = Router(PrefixIndex(), approximate_ttl=120.0, clock=clock, seed=4)
    router.add_worker(A, approximate=True)
    router.add_worker(B, approximate=True)
    first = router.select(PROMPT).worker
    other = B if first == A else A
    assert router.is_approximate(first)
    clock.now += 100.0
    d = router.select(PROMPT)
    assert d.worker == first and d.overlap_blocks == 5
    assert _entry(d, first).source == "approximate"
    assert router.stats().approximate_blocks == 5
    # Routing refreshed the entry at t+100: still held at t+200, forgotten after t+220.
    clock.now += 100.0
    assert router.select(PROMPT[:32]).overlap_blocks == 2
    clock.now += 200.0
    d = router.select(PROMPT, candidates=[other, first])
    assert d.overlap_blocks == 0
    assert router.stats().approximate_blocks == 5  # what that last select routed, nothing older


def test_mixed_fleet_uses_events_for_some_and_routing_history_for_others() -> None:
    index = PrefixIndex()
    _store(index, A, 2)
    _store(index, B, 5)  # b turns approximate below: its index claim is not used
    states = _States({A: SYNCED})
    router = Router(index, states=states)
    router.add_worker(B, approximate=True, block_size=32)
    d = router.select(PROMPT)
    assert d.worker == A and d.overlap_blocks == 2
    router.on_start("r", B, PROMPT)
    d = router.select(PROMPT, load={})
    b = _entry(d, B)
    # 88 tokens at b's 32-token blocks: two full blocks assumed held.
    assert (b.source, b.block_size, b.overlap_blocks) == ("approximate", 32, 2)
    assert d.worker == B and b.prefill_blocks == (88 - 64) / BS
    router.add_worker(B, approximate=False)
    assert not router.is_approximate(B)
    d = router.select(PROMPT, load={})
    assert d.worker == A
    assert _entry(d, B).overlap_blocks == 0  # no status from the states provider: not trusted


def test_approximate_mode_separates_adapters() -> None:
    router = Router(PrefixIndex(), seed=1)
    router.add_worker(A, approximate=True)
    router.select(PROMPT, lora_name="sql")
    assert router.select(PROMPT, lora_name="sql").overlap_blocks == 5
    assert router.select(PROMPT).overlap_blocks == 0


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_gets_a_typed_error() -> None:
    index = PrefixIndex()
    _store(index, A, 2)
    router = Router(index)
    router.add_worker(B, approximate=True)
    with pytest.raises(RouterError):
        router.select(["x"] * 48)  # type: ignore[list-item]
    with pytest.raises(RouterError):
        router.select(PROMPT, load={A: -1.0})
    with pytest.raises(RouterError):
        router.select(PROMPT, load={A: math.nan})
    with pytest.raises(RouterError):
        router.select(PROMPT, load={A: "busy"})  # type: ignore[dict-item]
    with pytest.raises(RouterError):
        router.select(PROMPT, candidates=[[1, 2]])  # type: ignore[list-item]
    with pytest.raises(RouterError):
        router.select(PROMPT, request_id=[1])  # type: ignore[arg-type]
    with pytest.raises(RouterError):
        router.add_worker("nope")  # type: ignore[arg-type]
    with pytest.raises(RouterError):
        router.add_worker(C, block_size=0)
    with pytest.raises(RouterError):
        router.on_start("r", A, PROMPT, cached_tokens=-1)
    with pytest.raises(RouterError):
        router.on_start("r", A, 5)  # type: ignore[arg-type]
    with pytest.raises(RouterError):
        router.on_start("r", B, ["x"] * 32)  # type: ignore[list-item]
    assert router.stats().active_requests == 0  # nothing half-recorded
    for kwargs in ({"block_size": 0}, {"block_size": True}, {"approximate_ttl": 0.0}, {"approximate_ttl": "1"}):
        with pytest.raises(RouterError):
            Router(index, **kwargs)
    assert not router.on_finish([1])  # type: ignore[arg-type]


def test_odd_prompts_route_without_claims() -> None:
    index = PrefixIndex()
    _store(index, A, 2)
    router = Router(index)
    router.add_worker(B, approximate=True)
    # No tokenizer has such ids: every token is checked up front (issue 18), whatever the index holds.
    with pytest.raises(RouterError, match=r"token_ids\[0\]"):
        router.select([2**40] * 48)
    d = router.select([], load={A: 1.0})
    assert d.worker == B and d.cost == 0.0


# --- a property: the decision is the brute-force minimum ------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    fleet=st.lists(
        st.tuples(
            st.integers(0, 5),  # blocks held
            st.sampled_from(["synced", "syncing", "partial", "gone"]),
            st.integers(0, 12),  # load in blocks
        ),
        min_size=1,
        max_size=6,
    ),
    weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_the_chosen_worker_has_the_least_cost(fleet: list[tuple[int, str, int]], weight: float) -> None:
    index = PrefixIndex()
    statuses: dict[WorkerKey, WorkerStatus | None] = {}
    live: set[WorkerKey] = set()
    expected: dict[WorkerKey, float] = {}
    load: dict[WorkerKey, float] = {}
    for i, (held, state, w_load) in enumerate(fleet):
        w = WorkerKey(f"w{i}", i % 2)
        if held:
            _store(index, w, held)
        statuses[w] = WorkerStatus(state="syncing" if state == "syncing" else "synced", partial=state == "partial")
        if state != "gone":
            live.add(w)
        load[w] = float(w_load)
        trusted = held if state == "synced" else 0
        if state != "gone":
            expected[w] = weight * (88 - trusted * BS) / BS + w_load
    router = Router(index, states=_States(statuses, live), cost=CostModel(overlap_weight=weight))
    if not expected:
        with pytest.raises(NoWorkersError):
            router.select(PROMPT, load=load)
        return
    d = router.select(PROMPT, load=load)
    assert math.isclose(d.cost, min(expected.values()), abs_tol=1e-9)
    assert math.isclose(expected[d.worker], d.cost, abs_tol=1e-9)
    assert d.worker in {c.worker for c in d.candidates}
    assert len(d.candidates) + d.idle_workers == len(expected)


# --- simulation: shared-prefix workload on simulated engines --------------------------------

_SIM_WORKERS = 8
_SIM_GROUPS = 16  # system prompts, popularity skewed
_SIM_PREFIX = 512  # tokens of each system prompt
_SIM_CAPACITY = 160  # blocks per engine: under half of all system prompts (256 blocks)
_SIM_STEPS = 300
_SIM_ARRIVALS = 4  # requests per step
_SIM_DURATION = 6  # steps a request runs once admitted


def _simulate(policy: str, seed: int) -> tuple[float, float]:
    """Route a shared-prefix workload; return (engines' prefix-cache hit rate, load imbalance).

    Imbalance: the busiest worker's outstanding request-steps (queued or running) over the
    mean worker's. Events of every engine step go through the index before the next step.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30000) for _ in range(_SIM_PREFIX)] for _ in range(_SIM_GROUPS)]
    keys = [WorkerKey(f"engine{i}", 0) for i in range(_SIM_WORKERS)]
    caches = {k: PrefixCache(capacity_blocks=_SIM_CAPACITY, block_size=BS, seed=bytes([i])) for i, k in enumerate(keys)}
    index = PrefixIndex()
    router = Router(index, block_size=BS, seed=seed)
    for k in keys:
        router.add_worker(k)
    queues: dict[WorkerKey, deque[tuple[int, list[int]]]] = {k: deque() for k in keys}
    running: dict[WorkerKey, list[tuple[int, int]]] = {k: [] for k in keys}
    outstanding = dict.fromkeys(keys, 0)
    n = 0
    for step in range(_SIM_STEPS):
        for _ in range(_SIM_ARRIVALS):
            hot = min(int(rng.paretovariate(1.2)) - 1, _SIM_GROUPS - 1)
            group = hot if rng.random() < 0.5 else rng.randrange(_SIM_GROUPS)
            tokens = prompts[group] + [rng.randrange(1, 30000) for _ in range(rng.randrange(32, 160))]
            worker = router.select(tokens, request_id=n).worker if policy == "router" else keys[n % _SIM_WORKERS]
            queues[worker].append((n, tokens))
            n += 1
        for k in keys:
            cache = caches[k]
            still = []
            for end, rid in running[k]:
                if end <= step:
                    cache.release(rid)
                    router.on_finish(rid)
                else:
                    still.append((end, rid))
            running[k] = still
            while queues[k]:
                rid, tokens = queues[k][0]
                if cache.admit(rid, tokens, max_tokens=32) is None:
                    break  # waits for room, like an engine's scheduler queue
                queues[k].popleft()
                cache.computed(rid, tokens)
                running[k].append((step + _SIM_DURATION, rid))
            events = cache.drain_events()
            if events:
                index.apply_batch(k, EventBatch(float(step), events))
            outstanding[k] += len(running[k]) + len(queues[k])
    hit = sum(c.stats.hit_tokens for c in caches.values()) / sum(c.stats.query_tokens for c in caches.values())
    imbalance = max(outstanding.values()) / (sum(outstanding.values()) / _SIM_WORKERS)
    return hit, imbalance


def test_router_beats_round_robin_on_a_shared_prefix_workload() -> None:
    rr_hit, rr_imbalance = _simulate("round-robin", seed=0)
    hit, imbalance = _simulate("router", seed=0)
    # Measured: round-robin 0.36, router 0.76 (over seeds 0-15: 0.33-0.39 vs 0.69-0.77).
    assert hit >= 1.6 * rr_hit and hit - rr_hit >= 0.25, (hit, rr_hit)
    # The stated bound: the busiest worker carries at most 1.5x the mean outstanding work.
    # Measured 1.18 (over seeds 0-15: at most 1.29); round-robin is 1.0 by construction.
    assert imbalance <= 1.5, imbalance
    assert rr_imbalance < 1.05


# --- end to end: a simulated engine over loopback ZMQ, the client's index and worker states --


@pytest.mark.anyio
async def test_router_follows_a_live_engine_through_the_client() -> None:
    config = SimConfig(ranks=2, grpc_port=None, http_port=None, decode_time_per_step=0.001, prefill_time_per_token=1e-6)
    fast = SubscriberConfig(reconnect_ivl=0.02, reconnect_ivl_max=0.1, replay_timeout=0.3, quiet_interval=0.3)
    prompt = list(range(100, 356))  # 16 blocks of 16
    async with SimEngine(config) as engine, KvEventClient(engine.sources(), config=fast) as client:
        await client.wait_synced(5.0)
        router = Router(client.index, states=client, seed=0)
        assert router.workers() == {WorkerKey(s.worker_id, s.dp_rank) for s in engine.sources()}
        first = router.select(prompt, request_id="r1")
        assert first.overlap_blocks == 0
        stream = client.events()
        await engine.complete(prompt, max_tokens=1, rank=first.worker.dp_rank)
        router.on_finish("r1")
        query = [*prompt, *range(7, 23)]
        with anyio.fail_after(5.0):
            while client.index.find_matches(query)[first.worker] < 16:
                await stream.__anext__()  # every applied batch comes with an envelope
        for _ in range(5):
            d = router.select(query)
            assert d.worker == first.worker and d.overlap_blocks == 16
        # Discovery drops the worker: its cache no longer counts, it is never chosen.
        assert client.remove_source(first.worker)
        other = router.select(query)
        assert other.worker != first.worker and other.overlap_blocks == 0
        assert router.workers() == {other.worker}
