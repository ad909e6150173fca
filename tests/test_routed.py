"""The routing hint's store (kvroute/_routed.py) against a brute-force reading of its definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._hashing import chain_keys
from kvroute._models import WorkerKey
from kvroute._routed import RoutedPrefixes

# Prompts drawn from a few shared stems, so that they share prefixes of every length.
_STEMS = [[s * 1000 + i for i in range(64)] for s in range(3)]
_prompt = st.builds(
    lambda stem, n, tail: _STEMS[stem][:n] + tail,
    st.integers(0, 2),
    st.integers(0, 64),
    st.lists(st.integers(5000, 5003), max_size=12),
)
_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 9), st.integers(0, 3), _prompt),
    st.tuples(st.just("discard"), st.integers(0, 9)),
    st.tuples(st.just("worker"), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=30), queries=st.lists(_prompt, min_size=1, max_size=4), per_worker=st.integers(1, 3))
def test_credits_are_each_workers_longest_shared_prefix(ops: list[tuple], queries: list, per_worker: int) -> None:
    store = RoutedPrefixes(ttl=5.0, per_worker=per_worker)
    live: dict[int, tuple[WorkerKey, list[bytes], float]] = {}  # the model: request -> (worker, keys, expiry)
    now = 0.0
    for op in ops:
        if op[0] == "add":
            _, rid, w, prompt = op
            keys = chain_keys(prompt, 4)
            worker = WorkerKey("w", w)
            store.add(rid, worker, keys, now)
            live = {r: e for r, e in live.items() if e[2] > now and r != rid}
            if keys:
                mine = [r for r, e in live.items() if e[0] == worker]
                if len(mine) >= per_worker:
                    del live[mine[0]]
                live[rid] = (worker, keys, now + 5.0)
        elif op[0] == "discard":
            store.discard(op[1])
            live.pop(op[1], None)
        elif op[0] == "worker":
            store.discard_worker(WorkerKey("w", op[1]))
            live = {r: e for r, e in live.items() if e[0] != WorkerKey("w", op[1])}
        else:
            now += op[1]
    store.purge(now)
    live = {r: e for r, e in live.items() if e[2] > now}
    assert len(store) == len(live)
    for q in queries:
        qk = chain_keys(q, 4)
        want: dict[WorkerKey, int] = {}
        for worker, keys, _ in live.values():
            n = 0
            while n < min(len(qk), len(keys)) and qk[n] == keys[n]:
                n += 1
            if n:
                want[worker] = max(want.get(worker, 0), n)
        assert store.credits(qk) == want
    for rid in list(live):
        store.discard(rid)
    assert len(store) == 0 and store.longest() == 0
    assert not store._holders and not store._children and not store._ends  # nothing leaks


def test_a_store_with_no_time_or_room_keeps_nothing() -> None:
    keys = chain_keys(list(range(16)), 4)
    for store in (RoutedPrefixes(ttl=0.0, per_worker=4), RoutedPrefixes(ttl=5.0, per_worker=0)):
        assert not store.enabled
        store.add("r", WorkerKey("w", 0), keys, 0.0)
        assert len(store) == 0 and store.credits(keys) == {}
