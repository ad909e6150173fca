"""The router's tracked load in the core (`kvroute._core.Loads`) and `select` without a universe set.

`Router` keeps the tokens its active requests added per worker in a core table that the compiled
`select` reads without a Python call per worker; with neither a states provider nor a
``candidates`` restriction, the core also decides who is a candidate (every worker the index
holds, plus the registered ones) instead of being handed the set. Both must decide exactly as
the Python reference path (a `CostModel` subclass), which reads the same table as a mapping.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute._core as _core
from kvroute._errors import NoWorkersError
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey
from kvroute._router import CostModel, Router, RouterError
from kvroute._wire import BlockRemoved, BlockStored

A, B, C = WorkerKey("a", 0), WorkerKey("b", 1), WorkerKey("c", 0)


class _PythonModel(CostModel, frozen=True, kw_only=True):
    """The stock model through the Python path."""


def test_the_load_table_is_a_mapping_in_insertion_order() -> None:
    t = _core.Loads()
    t[A] = 5
    t[B] = 7
    t[C] = 0
    assert list(t) == [A, B, C] and t.items() == [(A, 5), (B, 7), (C, 0)] and len(t) == 3
    assert t[A] == 5 and t.get(WorkerKey("x", 0)) is None and t.get(WorkerKey("x", 0), 0) == 0
    assert ("a", 0) in t and WorkerKey("x", 0) not in t and "not a key" not in t
    t[A] = 6  # an update keeps the worker's place
    assert list(t) == [A, B, C] and t[A] == 6
    del t[A]
    t[A] = 1  # removed then added again: last, as a dict orders it
    assert list(t) == [B, C, A] and t.values() == [7, 0, 1]
    assert t.pop(B) == 7 and t.pop(B, None) is None and t.pop(B, 3) == 3
    with pytest.raises(KeyError):
        t.pop(B)
    with pytest.raises(KeyError):
        del t[B]
    with pytest.raises(KeyError):
        t[B]
    with pytest.raises(TypeError):
        t[(1, 2)] = 3  # type: ignore[index]  # the index's key shape: (str, int)


def test_a_router_refuses_a_worker_it_cannot_key_before_recording_anything() -> None:
    r = Router(PrefixIndex())
    with pytest.raises(RouterError, match="not a WorkerKey"):
        r.on_start("r1", (7, 0), [1, 2, 3])  # type: ignore[arg-type]
    assert r.stats().active_requests == 0 and not r.on_finish("r1")


def _fleet(index: PrefixIndex, prompt: list[int], held: list[tuple[WorkerKey, int]]) -> None:
    for i, (w, n) in enumerate(held):
        if n:
            hashes = [i * 1000 + j for j in range(n)]
            index.apply(w, BlockStored(block_hashes=hashes, token_ids=prompt[: n * 16], block_size=16))


@settings(max_examples=120, deadline=None)
@given(
    held=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    emptied=st.sets(st.integers(0, 5)),
    registered=st.sets(st.integers(0, 8)),
    loaded=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 200)), max_size=10),
    finished=st.sets(st.integers(0, 9)),
    prompt_len=st.integers(0, 100),
    seed=st.integers(0, 3),
)
def test_select_without_a_universe_set_decides_as_the_python_path(
    held: list[int],
    emptied: set[int],
    registered: set[int],
    loaded: list[tuple[int, int]],
    finished: set[int],
    prompt_len: int,
    seed: int,
) -> None:
    # Workers 0-5 may hold blocks (some emptied again: they leave `workers()`), 6-8 never do; any
    # may be registered, and any may carry load, so load falls on index workers, registered ones
    # and workers in neither (not candidates).
    workers = [WorkerKey(f"w{i}", i % 2) for i in range(9)]
    prompt = [(i * 7919) % 50_000 for i in range(100)]
    index = PrefixIndex()
    _fleet(index, prompt, list(zip(workers, held)))
    for i in emptied:
        if i < len(held) and held[i]:
            index.apply(workers[i], BlockRemoved(block_hashes=[i * 1000 + j for j in range(held[i])]))
    decisions = []
    for model in (CostModel(), _PythonModel()):
        r = Router(index, cost=model, seed=seed)
        for i in registered:
            r.add_worker(workers[i])
        for n, (i, tokens) in enumerate(loaded):
            r.on_start(("req", n), workers[i], prompt[: tokens % 100])
        for n in finished:
            r.on_finish(("req", n))
        got: list[object] = []
        for _ in range(3):  # several draws: the random state must advance alike
            try:
                got.append(r.select(prompt[:prompt_len]))
            except NoWorkersError as exc:
                got.append((type(exc), str(exc)))
        decisions.append(got)
    assert decisions[0] == decisions[1]


def test_an_empty_fleet_reports_bad_input_first_then_no_workers() -> None:
    r = Router(PrefixIndex())
    with pytest.raises(RouterError, match=r"token_ids\[1\]"):
        r.select([1, -2, 3])
    with pytest.raises(NoWorkersError, match="no live or registered worker"):
        r.select([1, 2, 3])
    # load alone does not make a worker a candidate: only the index or a registration does
    r.on_start("r", A, [1, 2, 3])
    with pytest.raises(NoWorkersError):
        r.select([1, 2, 3])
    r.add_worker(A)
    d = r.select([1, 2, 3])
    assert d.worker == A and d.candidates[0].load_blocks == 3 / 16 and d.idle_workers == 0


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["store", "remove", "load", "finish"]), st.integers(0, 7), st.integers(1, 6)),
        min_size=1,
        max_size=25,
    ),
    seed=st.integers(0, 3),
)
def test_select_finds_loaded_workers_again_as_the_fleet_changes(steps: list[tuple[str, int, int]], seed: int) -> None:
    # The core keeps where it last found each loaded worker in the index (its slot) to skip the
    # lookup by name; workers leaving the index free slots that others then take. After every
    # change both paths must still agree, selecting between changes (so kept slots go stale).
    workers = [WorkerKey(f"w{i}", i % 3) for i in range(8)]
    prompt = [(i * 7919) % 50_000 for i in range(96)]
    index = PrefixIndex()
    routers = [Router(index, cost=model, seed=seed) for model in (CostModel(), _PythonModel())]
    routers[0].add_worker(workers[7])
    routers[1].add_worker(workers[7])
    started = 0
    for op, i, n in steps:
        w = workers[i]
        if op == "store":
            index.apply(w, BlockStored(block_hashes=[i * 1000 + j for j in range(n)], token_ids=prompt[: n * 16],
                                       block_size=16))
        elif op == "remove":
            index.remove_worker(w)
        elif op == "load":
            for r in routers:
                r.on_start(("req", started), w, prompt[: n * 10])
            started += 1
        else:
            for r in routers:
                r.on_finish(("req", n % max(1, started)))
        got = []
        for r in routers:
            try:
                got.append(r.select(prompt))
            except NoWorkersError as exc:
                got.append((type(exc), str(exc)))  # type: ignore[arg-type]
        assert got[0] == got[1]


def _step_both(pair: tuple[Any, Any], now: list[float], op: str, worker: WorkerKey, record: Any, ms: int) -> None:
    """One step of a patched-versus-recomputed `EngineLoads` test, on both: a record (``update``),
    ``remove``, or the clock moved on by up to 4 s (``tick``: records go stale after a few)."""
    for loads in pair:
        if op == "update":
            loads.update(worker, record)
        elif op == "remove":
            loads.remove(worker)
    if op == "tick":
        now[0] += ms / 1000.0


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["update", "update", "remove", "tick"]),
            st.integers(0, 3),
            st.integers(0, 2),
            st.sampled_from([0.0, 0.2, 0.7, 1.5, float("nan")]),
            st.integers(0, 4000),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_engine_loads_usage_patched_in_place_as_recomputed(steps: list[tuple[str, int, int, float, int]]) -> None:
    # `EngineLoads.update` carries a listed worker's new usage into the cached `usage` answer
    # instead of dropping it; every answer must equal one computed from scratch, order included.
    from kvroute._load import EngineLoad, EngineLoads

    now = [100.0]
    patched, fresh = EngineLoads(clock=lambda: now[0]), EngineLoads(clock=lambda: now[0])
    workers = [WorkerKey(f"e{i}", 0) for i in range(4)]
    for op, i, kind, usage, ms in steps:
        rec = EngineLoad(token_usage=usage, received=now[0] - [0.0, 5.0, 20.0][kind])  # 20 s: stale
        _step_both((patched, fresh), now, op, workers[i], rec, ms)
        fresh._usage = None  # the reference recomputes every time
        assert list(patched.usage().items()) == list(fresh.usage().items())


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["update", "update", "remove", "tick"]),
            st.integers(0, 3),
            st.integers(0, 3),
            st.integers(0, 4000),
            st.sampled_from([None, 0, 40_000]),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_engine_loads_patched_in_place_blend_as_recomputed(steps: list[tuple[str, int, int, int, int | None]]) -> None:
    # `EngineLoads.update` carries a fresh worker's new record into the cached engine part instead
    # of dropping the cache; every `blend` must equal one computed from scratch, order included.
    from kvroute._load import EngineLoad, EngineLoads

    now = [100.0]
    patched, fresh = EngineLoads(clock=lambda: now[0]), EngineLoads(clock=lambda: now[0])
    workers = [WorkerKey(f"e{i}", 0) for i in range(4)]
    own = {workers[0]: 64, workers[3]: 160}
    for op, i, kind, tokens, silence in steps:
        age = [0.0, 5.0, 20.0, 0.0][kind]  # 20 s: already stale (stale_after 15)
        rec = EngineLoad(
            running_requests=kind,
            waiting_requests=1,
            waiting_uncached_tokens=tokens if kind != 3 else None,  # 3: priced by request count
            engine_silence_ms=silence,
            received=now[0] - age,
        )
        _step_both((patched, fresh), now, op, workers[i], rec, tokens)
        # a blend after every step: the patched side always has a cache for the next update
        fresh._cache = None  # the reference recomputes the engine part every time
        got, want = patched.blend(own, 16), fresh.blend(own, 16)
        assert list(got[0].items()) == list(want[0].items()) and got[1] == want[1]
