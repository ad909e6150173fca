"""Engine-reported load blended in the core (`kvroute._core.EngineTable`) against `EngineLoads.blend`.

`EngineLoads.update` writes each record into the core as it arrives; the compiled `Router.select`
blends those records with the router's own in-flight tokens in its pricing pass and applies the
vetoes there, while a `CostModel` subclass prices through `EngineLoads.blend` in Python, the
reference. Fed the same index, states, records, requests and seed, both must return the same
decisions (candidates in the same order with the same figures, floats bit for bit, the same random
draws), count the same vetoes and learn the same mean request.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._index import PrefixIndex
from kvroute._load import EngineLoad, EngineLoads, LoadPolicy
from kvroute._models import WorkerKey, WorkerStatus
from kvroute._router import CostModel, Router
from kvroute._wire import BlockStored

PROMPT_LEN = 200
PROMPT = [(i * 7919) % 50_000 for i in range(PROMPT_LEN)]


class _PythonModel(CostModel, frozen=True, kw_only=True):
    """The stock model through the Python path (any subclass of CostModel takes it)."""


class _States:
    """A provider with the client's kept sets (`live_set`, `unvouched_workers`), or without them."""

    def __init__(self, statuses: dict[WorkerKey, WorkerStatus], live: set[WorkerKey], vouching: bool) -> None:
        self.statuses = statuses
        self._live = frozenset(live)
        if vouching:
            self.live_set = lambda: self._live
            self.unvouched_workers = lambda trust_partial: frozenset(
                w for w in self._live if (s := statuses.get(w)) is None or s.state != "synced"
            )

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        return self.statuses.get(worker) if worker in self._live else None

    def live_workers(self) -> set[WorkerKey]:
        return set(self._live)


_record = st.one_of(
    st.none(),  # a worker without any report
    st.fixed_dictionaries(
        {
            # "tokens": queue in tokens; "count": a /metrics-style record (requests only); "zero": count 0
            "kind": st.sampled_from(["tokens", "tokens", "count", "zero"]),
            "queued": st.sampled_from([0, 0, 16, 100, 700, 3000]),
            "requests": st.integers(1, 5),
            "age": st.sampled_from([0.5, 1.0, 60.0]),  # 60 s: stale (stale_after 15)
            "silence": st.sampled_from([None, None, 1_000, 90_000]),  # 90 s: wedged (wedge_after 30)
            "pending": st.sampled_from([None, 0, 2_000_000]),  # 2M pending tokens allow 200 s more
            "usage": st.sampled_from([0.0, 0.0, 0.3, 1.5, math.nan]),
        }
    ),
)

_worker = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([4, 8, 16]),  # mixed block sizes across the fleet
        "held": st.integers(0, 40),
        "state": st.sampled_from(["synced", "synced", "syncing", "gone"]),
        "record": _record,
        "own": st.integers(0, 3),  # requests this router started there
    }
)


def _load_record(spec: dict, now: float) -> EngineLoad:
    """The record a spec of `_record` describes, received ``age`` seconds before ``now``."""
    kind = spec["kind"]
    return EngineLoad(
        running_requests=spec["requests"] if kind == "count" else 2,
        waiting_requests=0,
        waiting_uncached_tokens=spec["queued"] if kind == "tokens" else None,
        prefill_pending_tokens=spec["pending"] if kind == "tokens" else None,
        engine_silence_ms=spec["silence"],
        token_usage=spec["usage"],
        received=now - spec["age"],
    ) if kind != "zero" else EngineLoad(
        running_requests=0, waiting_requests=0, engine_silence_ms=spec["silence"], received=now - spec["age"]
    )


@settings(max_examples=200, deadline=None)
@given(
    fleet=st.lists(_worker, min_size=1, max_size=7),
    outside=st.one_of(st.none(), _record),  # a live worker the index does not hold (None: none)
    mode=st.sampled_from(["blend", "blend", "engine", "router"]),
    unit=st.sampled_from([4, 8, 16]),
    weight=st.sampled_from([0.0, 1.0, 2.0]),
    eviction=st.sampled_from([0.0, 8.0]),
    temperature=st.sampled_from([0.0, 0.0, 0.7]),
    footprint=st.booleans(),
    prompt_len=st.integers(0, PROMPT_LEN),
    hint=st.booleans(),
    restrict=st.booleans(),
    vouching=st.booleans(),
    seed=st.integers(0, 3),
)
def test_engine_loads_are_blended_alike_on_both_paths(
    fleet: list[dict],
    outside: dict | None,
    mode: str,
    unit: int,
    weight: float,
    eviction: float,
    temperature: float,
    footprint: bool,
    prompt_len: int,
    hint: bool,
    restrict: bool,
    vouching: bool,
    seed: int,
) -> None:
    index = PrefixIndex()
    statuses: dict[WorkerKey, WorkerStatus] = {}
    live: set[WorkerKey] = set()
    now = [100.0]
    workers = [WorkerKey(f"w{i}", i % 2) for i in range(len(fleet))]
    specs = list(zip(workers, fleet))
    if outside is not None:
        specs.append((WorkerKey("x", 0), {"held": 0, "block_size": 16, "state": "synced", "record": outside, "own": 2}))
    for i, (w, spec) in enumerate(specs):
        bs = spec["block_size"]
        held = min(spec["held"], PROMPT_LEN // bs)
        if held:
            hashes = [i * 1000 + j for j in range(held)]
            index.apply(w, BlockStored(block_hashes=hashes, token_ids=PROMPT[: held * bs], block_size=bs))
        statuses[w] = WorkerStatus(state="syncing" if spec["state"] == "syncing" else "synced", partial=False)
        if spec["state"] != "gone":
            live.add(w)
    routers = []
    for model_type in (CostModel, _PythonModel):
        # one record table per router: each path's vetoes and learnt mean request are its own to compare
        loads = EngineLoads(LoadPolicy(mode=mode), clock=lambda: now[0])
        for w, spec in specs:
            if spec["record"] is not None:
                loads.update(w, _load_record(spec["record"], now[0]))
        model = model_type(
            overlap_weight=weight, eviction_weight=eviction, temperature=temperature, footprint=footprint
        )
        r = Router(
            index,
            states=_States(statuses, live, vouching),
            cost=model,
            block_size=unit,
            seed=seed,
            engine_loads=loads,
            routed_ttl=10.0 if hint else 0.0,
        )
        for i, (w, spec) in enumerate(specs):
            for j in range(spec["own"]):
                r.on_start(("own", i, j), w, PROMPT[: 17 * (j + 1) + i])
        routers.append(r)
    kwargs: dict = {}
    if restrict:
        kwargs["candidates"] = [*workers[::2], WorkerKey("x", 0), WorkerKey("y", 9)]
    for k in range(3):  # several draws: the random state (and the requests started) must advance alike
        got = []
        for r in routers:
            try:
                got.append(r.select(PROMPT[:prompt_len], request_id=("q", k), **kwargs))
            except Exception as exc:  # both paths must fail alike too
                got.append((type(exc), str(exc)))
        assert got[0] == got[1]
        compiled, python = (r.engine_loads for r in routers)
        assert compiled is not None and python is not None
        assert compiled.vetoes == python.vetoes
        assert compiled._core.per_request == python._core.per_request
        now[0] += 0.25


def _fleet(index: PrefixIndex, held: dict[WorkerKey, int]) -> None:
    for i, (w, n) in enumerate(held.items()):
        index.apply(w, BlockStored(block_hashes=[i * 1000 + j for j in range(n)], token_ids=PROMPT[: n * 16],
                                   block_size=16))


def test_a_wedged_engine_is_vetoed_while_another_candidate_is_left() -> None:
    """The worker holding the whole prompt loses it while its engine is wedged (and the veto is
    counted); it wins again once the engine speaks, and when it is the only candidate."""
    a, b, c = WorkerKey("a", 0), WorkerKey("b", 0), WorkerKey("c", 0)
    index = PrefixIndex()
    _fleet(index, {a: 12, b: 2})
    for model in (CostModel(), _PythonModel()):
        loads = EngineLoads(clock=lambda: 10.0)
        loads.update(a, EngineLoad(waiting_uncached_tokens=0, engine_silence_ms=60_000, received=10.0))
        loads.update(c, EngineLoad(waiting_uncached_tokens=0, engine_silence_ms=60_000, received=10.0))
        r = Router(index, cost=model, engine_loads=loads, seed=0)
        for _ in range(5):
            d = r.select(PROMPT)
            # c, wedged too and holding nothing, is never the idle pick
            assert d.worker == b and d.idle_workers == 0, (type(model).__name__, d)
        assert loads.vetoes == 10
        assert r.select(PROMPT, candidates=[a]).worker == a  # the only candidate: not vetoed
        loads.update(a, EngineLoad(waiting_uncached_tokens=0, engine_silence_ms=10, received=10.0))
        assert r.select(PROMPT).worker == a


def test_a_worker_whose_reports_stopped_is_vetoed_only_while_it_holds_requests() -> None:
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    index = PrefixIndex()
    _fleet(index, {a: 12, b: 2})
    now = [100.0]
    for model in (CostModel(), _PythonModel()):
        loads = EngineLoads(clock=lambda: now[0])
        loads.update(a, EngineLoad(waiting_uncached_tokens=0, received=now[0] - 60.0))  # stale
        r = Router(index, cost=model, engine_loads=loads, seed=0)
        assert r.select(PROMPT).worker == a  # stale but nothing routed there: no veto
        r.on_start("r1", a, PROMPT[:40])
        d = r.select(PROMPT)
        assert d.worker == b and loads.vetoes == 1, type(model).__name__
        r.on_finish("r1")
        assert r.select(PROMPT).worker == a


def test_counted_requests_are_priced_at_the_routers_mean_request() -> None:
    """A /metrics record (requests, no tokens) is priced at the mean of the router's own in-flight
    requests, learnt when it has some and kept after they finish; the same on both paths."""
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    index = PrefixIndex()
    _fleet(index, {a: 4, b: 4})
    for model in (CostModel(), _PythonModel()):
        loads = EngineLoads(clock=lambda: 5.0)
        loads.update(a, EngineLoad(running_requests=3, waiting_requests=1, received=5.0))
        r = Router(index, cost=model, engine_loads=loads, block_size=16, seed=0)
        by = {c.worker: c for c in r.select(PROMPT).candidates}
        assert by[a].load_blocks == 4 * 1024 / 16  # LoadPolicy.request_tokens until the router has requests
        r.on_start("r1", b, PROMPT[:96])
        r.on_start("r2", b, PROMPT[:32])
        by = {c.worker: c for c in r.select(PROMPT).candidates}
        assert by[a].load_blocks == 4 * 64 / 16 and by[b].load_blocks == 128 / 16
        r.on_finish("r1")
        r.on_finish("r2")
        by = {c.worker: c for c in r.select(PROMPT).candidates}
        assert by[a].load_blocks == 4 * 64 / 16, type(model).__name__  # the mean learnt last


def test_a_record_with_negative_or_non_finite_figures_is_refused_and_select_carries_on() -> None:
    # Kept, a negative queue would be priced into every select (the footprint's tie arithmetic
    # assumes costs are not negative: every select failed, found in review).
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    index = PrefixIndex()
    _fleet(index, {a: 12, b: 2})
    loads = EngineLoads(clock=lambda: 10.0)
    loads.update(a, EngineLoad(waiting_uncached_tokens=0, received=10.0))
    for bad in (
        EngineLoad(waiting_uncached_tokens=-5, received=10.0),
        EngineLoad(running_requests=-1, received=10.0),
        EngineLoad(prefill_pending_tokens=-1, received=10.0),
        EngineLoad(engine_silence_ms=-1, received=10.0),
    ):
        with pytest.raises(ValueError, match="negative"):
            loads.update(a, bad)
    for model in (CostModel(), _PythonModel()):
        assert Router(index, cost=model, engine_loads=loads, seed=0).select(PROMPT).worker == a


def test_the_idle_draw_beside_a_vetoed_worker_is_the_same_on_both_paths() -> None:
    # Both paths draw the idle worker from one seed, so each must build the idle set the same way
    # (the reference narrows the universe by the vetoed first): built otherwise, the same members
    # iterate in another order and one seed picks another worker (found in review: 30 of 192).
    differing = []
    for n in range(2, 8):
        workers = [WorkerKey(f"w{i}", i % 2) for i in range(n)]
        statuses = {w: WorkerStatus(state="synced", partial=False) for w in workers}
        for wedged in range(n):
            for seed in range(4):
                for vouching in (False, True):
                    picks = []
                    for model in (CostModel, _PythonModel):
                        loads = EngineLoads(LoadPolicy(mode="blend"), clock=lambda: 100.0)
                        silent = EngineLoad(waiting_uncached_tokens=0, engine_silence_ms=90_000, received=99.5)
                        loads.update(workers[wedged], silent)
                        r = Router(
                            PrefixIndex(),
                            states=_States(statuses, set(workers), vouching),
                            cost=model(overlap_weight=0.0, eviction_weight=0.0, temperature=0.0, footprint=False),
                            block_size=4,
                            seed=seed,
                            engine_loads=loads,
                        )
                        picks.append([r.select([], request_id=("q", k)).worker for k in range(3)])
                    if picks[0] != picks[1]:
                        differing.append((n, wedged, seed, vouching, picks))
    assert differing == []


def test_load_only_candidates_follow_records_that_come_and_go_between_selects() -> None:
    # The compiled path lists a load-only candidate by its place among the records' keys, a list kept
    # from one select to the next while the records keep their keys: an engine reporting for the first
    # time, or a record removed, since the last select must move every candidate after it (a stale list
    # names other workers, or places past its end).
    workers = [WorkerKey(f"w{i}", 0) for i in range(6)]
    index = PrefixIndex()
    _fleet(index, {workers[0]: 4})
    statuses = {w: WorkerStatus(state="synced", partial=False) for w in workers}
    runs = []
    for model in (CostModel(), _PythonModel()):
        loads = EngineLoads(clock=lambda: 10.0)
        r = Router(index, states=_States(statuses, set(workers), True), cost=model, engine_loads=loads, seed=0)
        got = []
        for step, w in enumerate([*workers[1:], workers[2], workers[4]]):
            if step < 5:
                loads.update(w, EngineLoad(waiting_uncached_tokens=64 * (step + 1), received=10.0))
            else:
                loads.remove(w)
            for _ in range(2):  # the second select reads the kept list
                got.append([(c.worker, c.load_blocks) for c in r.select(PROMPT).candidates])
        runs.append(got)
    assert runs[0] == runs[1]
    assert [w for w, _ in runs[0][-1]] == [workers[0], workers[1], workers[3], workers[5]]
    assert [w for w, _ in runs[0][9]] == workers  # all six, before the removals



def test_scored_workers_records_and_membership_follow_the_fleet_between_selects() -> None:
    # The compiled path finds a scored worker's record where the last select found it for that index
    # slot, believing the place only while the record there holds the index's own key object for that
    # worker, and reads the worker's live-set membership from that record's note, kept per generation
    # of the kept live set. Records removed (the later ones move up), a worker leaving the index and
    # another taking its slot, and the live set changing between selects must all be seen: the
    # Python path, which looks everything up by name, is the reference.
    workers = [WorkerKey(f"w{i}", 0) for i in range(7)]
    statuses = {w: WorkerStatus(state="synced", partial=False) for w in workers}
    runs = []
    for model in (CostModel(), _PythonModel()):
        index = PrefixIndex()
        _fleet(index, {w: 2 + i for i, w in enumerate(workers[:6])})  # w6 holds nothing yet
        states = _States(statuses, set(workers), True)
        loads = EngineLoads(clock=lambda: 10.0)
        for i, w in enumerate(workers[:6]):  # each its own queue: a record read for another shows
            loads.update(w, EngineLoad(waiting_uncached_tokens=48 * (i + 1), received=10.0))
        r = Router(index, states=states, cost=model, engine_loads=loads, seed=0)
        got = []
        for step in range(5):
            if step == 1:
                loads.remove(workers[1])  # the records after w1's move up a place
            elif step == 2:
                # w2 leaves the index (its slot free for the next worker to arrive) and w6 arrives,
                # with a record
                index.remove_worker(workers[2])
                index.apply(workers[6], BlockStored(block_hashes=[9000, 9001, 9002], token_ids=PROMPT[:48],
                                                    block_size=16))
                loads.update(workers[6], EngineLoad(waiting_uncached_tokens=16, received=10.0))
            elif step == 3:
                states._live = frozenset(w for w in workers if w != workers[3])  # w3 held, not live
            elif step == 4:
                states._live = frozenset(workers)
            for _ in range(3):  # a new live set is kept from its second select, read from the notes on the third
                d = r.select(PROMPT)
                got.append([(c.worker, c.overlap_blocks, c.load_blocks, c.cost) for c in d.candidates])
        runs.append(got)
    assert runs[0] == runs[1]
    assert all(workers[3] not in [c[0] for c in cands] for cands in runs[0][9:12])
    assert all(workers[3] in [c[0] for c in cands] for cands in runs[0][12:])
    # each worker with its own record's queue (w1's record gone, w2 load-only out of the index)
    w = workers
    loads_seen = [(c[0], c[2]) for c in runs[0][-1]]
    assert loads_seen == [(w[0], 3.0), (w[1], 0.0), (w[6], 1.0), (w[3], 12.0), (w[4], 15.0), (w[5], 18.0), (w[2], 9.0)]
