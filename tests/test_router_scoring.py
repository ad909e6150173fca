"""The compiled scoring (src/scoring.rs, src/py/router.rs) against the Python reference path.

`Router.select` prices candidates in the core when its model is exactly `CostModel`; a subclass
of `CostModel` (here one that overrides nothing) goes through `Router._scored` / `Router._pick`
in Python. Fed the same index, fleet, states, loads and seed, both must return the same
decisions: the same candidates in the same order with the same figures (floats bit for bit),
the same ties, the same random draws.
"""

from __future__ import annotations

import math
import time
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute._core as _core
from kvroute._index import PrefixIndex
from kvroute._load import EngineLoad, EngineLoads
from kvroute._models import WorkerKey, WorkerStatus
from kvroute._router import CostModel, Router, RouterError, RoutingDecision
from kvroute._wire import BlockRemoved, BlockStored

PROMPT_LEN = 200


class _PythonModel(CostModel, frozen=True, kw_only=True):
    """The stock model through the Python path (any subclass of CostModel takes it)."""


class _States:
    def __init__(self, statuses: dict[WorkerKey, WorkerStatus | None], live: set[WorkerKey]) -> None:
        self.statuses = statuses
        self.live = live

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        return self.statuses.get(worker)

    def live_workers(self) -> set[WorkerKey]:
        return set(self.live)


# `CostModel.long_prefix` off, or on with (floor, scale): floors low enough that this file's prompts
# (at most 50 blocks) cross them, scales from steep to the default's gentle 1,024.
_long_prefix = st.sampled_from([None, None, (0.0, 1.0), (4.0, 8.0), (12.5, 3.0), (16.0, 1024.0)])


def _long(long_prefix: tuple[float, float] | None) -> dict:
    """`CostModel` fields for one draw of `_long_prefix`."""
    if long_prefix is None:
        return {}
    floor, scale = long_prefix
    return {"long_prefix": True, "long_prefix_floor": floor, "long_prefix_scale": scale}


# `CostModel.long_move` off, or on with a floor and scale: floors this file's prompts (at most 50 blocks)
# cross, from none to 16 blocks, scales steep and gentle.
_long_move = st.sampled_from(
    [
        {},
        {},
        {"long_move": True, "long_move_floor": 0.0, "long_move_scale": 1.0},
        {"long_move": True, "long_move_floor": 3.0, "long_move_scale": 8.0},
        {"long_move": True, "long_move_floor": 7.5, "long_move_scale": 2.0},
        {"long_move": True, "long_move_floor": 16.0, "long_move_scale": 1.0},
        {"long_move": True, "long_move_floor": 0.0, "long_move_scale": 2.0},
    ]
)


def _move(long_move: dict) -> dict:
    """`CostModel` fields for one draw of `_long_move`."""
    return long_move


_worker = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([4, 8, 16]),
        "held": st.integers(0, 40),  # leading blocks of the prompt stored
        "tiers": st.lists(st.sampled_from([None, "GPU", "CPU", "DISK", "EXTERNAL"]), min_size=1, max_size=3),
        "evict": st.integers(0, 6),  # GPU copies of the last blocks removed (the run moves off GPU)
        "state": st.sampled_from(["synced", "synced", "partial", "syncing", "unknown", "gone"]),
        "load": st.one_of(st.none(), st.integers(0, 300)),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(_worker, min_size=1, max_size=7),
    unit=st.sampled_from([4, 8, 16, 32]),
    weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    credits=st.tuples(*[st.sampled_from([0.0, 0.5, 0.8, 1.0])] * 3),
    temperature=st.sampled_from([0.0, 0.0, 0.7]),
    use_states=st.booleans(),
    trust_partial=st.booleans(),
    supplied_load=st.booleans(),
    prompt_len=st.integers(0, PROMPT_LEN),
    seed=st.integers(0, 3),
    restrict=st.booleans(),
    long_prefix=_long_prefix,
    long_move=_long_move,
)
def test_compiled_scoring_picks_what_the_python_path_picks(
    fleet: list[dict],
    unit: int,
    weight: float,
    credits: tuple[float, float, float],
    temperature: float,
    use_states: bool,
    trust_partial: bool,
    supplied_load: bool,
    prompt_len: int,
    seed: int,
    restrict: bool,
    long_prefix: tuple[float, float] | None,
    long_move: dict,
) -> None:
    prompt = [(i * 7919) % 50_000 for i in range(PROMPT_LEN)]
    index = PrefixIndex()
    statuses: dict[WorkerKey, WorkerStatus | None] = {}
    live: set[WorkerKey] = set()
    load: dict[WorkerKey, float] = {}
    for i, spec in enumerate(fleet):
        w = WorkerKey(f"w{i}", i % 2)
        bs, held = spec["block_size"], spec["held"]
        held = min(held, PROMPT_LEN // bs)
        if held:
            hashes = [i * 1000 + j for j in range(held)]
            for medium in spec["tiers"]:
                index.apply(
                    w, BlockStored(block_hashes=hashes, token_ids=prompt[: held * bs], block_size=bs, medium=medium)
                )
            evict = min(spec["evict"], held)
            if evict and len(spec["tiers"]) > 1:
                index.apply(w, BlockRemoved(block_hashes=hashes[held - evict :], medium="GPU"))
        state = spec["state"]
        if state != "unknown":
            statuses[w] = WorkerStatus(state="syncing" if state == "syncing" else "synced", partial=state == "partial")
        if state != "gone":
            live.add(w)
        if spec["load"] is not None:
            load[w] = spec["load"] / 4
    cpu, disk, external = credits
    params = dict(
        overlap_weight=weight,
        cpu_credit=cpu,
        disk_credit=disk,
        external_credit=external,
        **_long(long_prefix),
        **_move(long_move),
    )
    routers = []
    for model in (CostModel(**params, temperature=temperature), _PythonModel(**params, temperature=temperature)):
        states = _States(statuses, live) if use_states else None
        r = Router(index, states=states, cost=model, block_size=unit, seed=seed, trust_partial=trust_partial)
        for i, spec in enumerate(fleet):
            w = WorkerKey(f"w{i}", i % 2)
            if not supplied_load and spec["load"]:
                r.on_start(("busy", i), w, prompt[: spec["load"] % PROMPT_LEN])
        routers.append(r)
    query = prompt[:prompt_len]
    for _ in range(3):  # several draws: the random state must advance alike
        kwargs: dict = {"load": load} if supplied_load else {}
        if restrict:  # a candidates restriction: every other worker, and one unknown to all
            kwargs["candidates"] = [WorkerKey(f"w{i}", i % 2) for i in range(0, len(fleet), 2)] + [WorkerKey("x", 9)]
        got = [_decide(r, query, kwargs) for r in routers]
        assert got[0] == got[1]


def _decide(router: Router, query: list[int], kwargs: dict) -> object:
    try:
        d = router.select(query, **kwargs)
    except Exception as exc:  # both paths must fail alike too
        return (type(exc), str(exc))
    # Candidates in the same order with the same figures; the decision itself likewise.
    return d


def test_the_compiled_path_reads_the_models_weights() -> None:
    index = PrefixIndex()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    prompt = list(range(65))  # one token past the 4 held blocks: all 4 are served
    index.apply(a, BlockStored(block_hashes=[1, 2, 3, 4], token_ids=prompt[:64], block_size=16))
    # A's cached prefix outweighs B's lighter load at weight 1, not at weight 0.
    for weight, want in ((1.0, a), (0.0, b)):
        router = Router(index, cost=CostModel(overlap_weight=weight), seed=0)
        d = router.select(prompt, load={a: 2.0, b: 1.0}, candidates=[a, b])
        assert d.worker == want
        # Prefill left, in blocks: A recomputes only the token past its 4 blocks; B all 65.
        assert d.cost == weight * (1 / 16 if want == a else 65 / 16) + (2.0 if want == a else 1.0)


@pytest.mark.parametrize(
    ("tokens", "where"),
    [
        ("hello world", "str"),
        (b"\x01\x02", "bytes"),
        ([1, 2, 3.0], r"token_ids\[2\]"),
        ([1, -1], r"token_ids\[1\]"),
        ([0, 1, 2**32], r"token_ids\[2\]"),
        ([1, "2"], r"token_ids\[1\]"),
        (array("q", [1, -5]), r"token_ids\[1\]"),
    ],
)
@pytest.mark.parametrize("held", [0, 4])
def test_select_checks_every_token_whatever_the_index_holds(tokens: object, where: str, held: int) -> None:
    index = PrefixIndex()
    a = WorkerKey("a", 0)
    if held:
        index.apply(a, BlockStored(block_hashes=list(range(held)), token_ids=list(range(16 * held)), block_size=16))
    for model in (CostModel(), _PythonModel()):
        router = Router(index, cost=model)
        router.add_worker(a)
        for _ in range(2):  # every time, not only while nothing is cached
            with pytest.raises(RouterError, match=where):
                router.select(tokens)  # type: ignore[arg-type]
            with pytest.raises(RouterError, match=where):
                router.select(tokens, candidates=[])  # type: ignore[arg-type]


def test_select_on_threads_while_other_threads_ingest() -> None:
    """The compiled select keeps the GIL for short queries: threads selecting and threads applying
    payloads all make progress (no deadlock between the GIL and the index lock), every answer right."""
    import threading

    from kvroute._wire import EventBatch, encode_batch

    index = PrefixIndex()
    a = WorkerKey("a", 0)
    prompt = list(range(65))  # one token past the 16 held blocks: all 16 are served
    index.apply(a, BlockStored(block_hashes=list(range(1, 17)), token_ids=prompt[:64], block_size=4))
    stop = threading.Event()
    wrong: list[object] = []
    done = [0, 0, 0, 0]

    def ingest(t: int) -> None:
        w = WorkerKey(f"ingest{t}", 0)
        n = 0
        while not stop.is_set():
            n += 1
            ev = BlockStored(block_hashes=[n], token_ids=[n % 1000, 1, 2, 3], block_size=4)
            report = index.apply_payload(w, encode_batch(EventBatch(ts=float(n), events=[ev])))
            if not report.ok:
                wrong.append(report)
            if n % 50 == 0:
                index.remove_worker(w)
            done[t] += 1

    def query(t: int) -> None:
        router = Router(index, seed=t)  # one Router per thread; the index is shared
        while not stop.is_set():
            d = router.select(prompt, candidates=[a])
            if d.worker != a or d.overlap_blocks != 16:
                wrong.append(d)
            done[t] += 1

    threads = [threading.Thread(target=ingest, args=(t,)) for t in (0, 1)]
    threads += [threading.Thread(target=query, args=(t,)) for t in (2, 3)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 30
    while min(done) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads)
    assert not wrong
    assert min(done) >= 50, done


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(
        st.fixed_dictionaries(
            {
                "block_size": st.sampled_from([4, 8, 16]),
                "held": st.integers(0, 40),
                "state": st.sampled_from(["synced", "syncing", "gone"]),
                "routed": st.lists(st.integers(0, PROMPT_LEN), max_size=3),  # prompts started there
                "load": st.one_of(st.none(), st.integers(0, 300)),
            }
        ),
        min_size=1,
        max_size=6,
    ),
    unit=st.sampled_from([4, 8, 16]),
    weight=st.sampled_from([0.5, 1.0, 2.0]),
    temperature=st.sampled_from([0.0, 0.0, 0.7]),
    per_worker=st.integers(0, 3),
    finish=st.integers(0, 4),
    prompt_lens=st.lists(st.integers(0, PROMPT_LEN), min_size=1, max_size=4),
    supplied_load=st.booleans(),
    seed=st.integers(0, 3),
    long_prefix=_long_prefix,
    long_move=_long_move,
)
def test_the_routing_hint_is_priced_alike_on_both_paths(
    fleet: list[dict],
    unit: int,
    weight: float,
    temperature: float,
    per_worker: int,
    finish: int,
    prompt_lens: list[int],
    supplied_load: bool,
    seed: int,
    long_prefix: tuple[float, float] | None,
    long_move: dict,
) -> None:
    """Prompts started on workers (`on_start`, and `select` with a request id, decision after
    decision) credit the next prompts sharing their prefix, on both paths alike."""
    prompt = [(i * 7919) % 50_000 for i in range(PROMPT_LEN)]
    index = PrefixIndex()
    statuses: dict[WorkerKey, WorkerStatus | None] = {}
    live: set[WorkerKey] = set()
    load: dict[WorkerKey, float] = {}
    workers = [WorkerKey(f"w{i}", 0) for i in range(len(fleet))]
    for w, spec in zip(workers, fleet):
        bs = spec["block_size"]
        held = min(spec["held"], PROMPT_LEN // bs)
        if held:
            index.apply(w, BlockStored(block_hashes=list(range(held)), token_ids=prompt[: held * bs], block_size=bs))
        statuses[w] = WorkerStatus(state="syncing" if spec["state"] == "syncing" else "synced", partial=False)
        if spec["state"] != "gone":
            live.add(w)
        if spec["load"] is not None:
            load[w] = spec["load"] / 4
    routers = []
    for model in (
        CostModel(overlap_weight=weight, temperature=temperature, **_long(long_prefix), **_move(long_move)),
        _PythonModel(overlap_weight=weight, temperature=temperature, **_long(long_prefix), **_move(long_move)),
    ):
        r = Router(
            index, states=_States(statuses, live), cost=model, block_size=unit, seed=seed, routed_per_worker=per_worker
        )
        for i, (w, spec) in enumerate(zip(workers, fleet)):
            for j, n in enumerate(spec["routed"]):
                r.on_start(("started", i, j), w, prompt[:n])
        for i in range(finish):  # some of them finished: their hint is gone
            r.on_finish(("started", i % len(fleet), 0))
        routers.append(r)
    for k, n in enumerate(prompt_lens):
        kwargs: dict = {"request_id": ("q", k)}
        if supplied_load:
            kwargs["load"] = load
        got = [_decide(r, prompt[:n], kwargs) for r in routers]
        assert got[0] == got[1]


def test_a_second_request_follows_the_first_while_it_prefills() -> None:
    """Nothing is in the index yet: the hint sends a prompt sharing a started one's prefix to its
    worker, on both paths; once that request finishes, or with the hint off, it is only load."""
    index = PrefixIndex()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    doc = list(range(1000, 1000 + 640))  # 40 blocks
    for model in (CostModel(), _PythonModel()):
        router = Router(index, cost=model, seed=0, routed_ttl=10.0)
        for w in (a, b):
            router.add_worker(w)
        first = router.select([*doc, 1, 2, 3], request_id="first")
        other = b if first.worker == a else a
        assert first.routed_tokens == 0
        # a second question on the document: the first's worker is busier, yet it wins
        second = router.select([*doc, 7, 8, 9], request_id="second")
        assert second.worker == first.worker
        assert second.routed_tokens == 640 and second.overlap_blocks == 0 and second.overlap_tokens == 0
        by = {c.worker: c for c in second.candidates}
        assert by[first.worker].claimed_blocks == 0  # never an index claim
        # load counts what the index says is cached there: nothing yet
        assert router.load_blocks(first.worker) == (643 + 643) / 16
        router.on_finish("first")
        router.on_finish("second")
        third = router.select([*doc, 4, 5, 6], candidates=[first.worker, other], load={first.worker: 1.0})
        assert third.worker == other and third.routed_tokens == 0
    off = Router(index, seed=0)  # the hint is off by default
    off.add_worker(a)
    off.add_worker(b)
    first = off.select([*doc, 1], request_id=1)
    assert off.select([*doc, 2], request_id=2).worker != first.worker


def test_the_routing_hint_expires_and_is_bounded() -> None:
    """After ``routed_ttl`` seconds, or beyond ``routed_per_worker`` newer prompts, a prompt is forgotten."""
    index = PrefixIndex()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    now = [0.0]
    docs = [[d * 10_000 + i for i in range(320)] for d in range(3)]
    for model in (CostModel(), _PythonModel()):
        router = Router(index, cost=model, seed=0, clock=lambda: now[0], routed_ttl=5.0, routed_per_worker=2)
        now[0] = 0.0
        for rid, doc in enumerate(docs):
            router.on_start(rid, a, doc)
        # docs 1 and 2 remembered on a; doc 0 pushed out by the bound
        for d, want in ((0, 0), (1, 320), (2, 320)):
            got = router.select(docs[d] + [1], candidates=[a, b], load={a: 0.0, b: 0.0})
            assert (got.worker, got.routed_tokens) == ((a, want) if want else (got.worker, 0))
        now[0] = 5.0
        got = router.select(docs[2] + [1], candidates=[a, b], load={a: 0.0, b: 0.0})
        assert got.routed_tokens == 0
        router.remove_worker(a)
    with pytest.raises(RouterError, match="routed_ttl"):
        Router(index, routed_ttl=-1)
    with pytest.raises(RouterError, match="routed_per_worker"):
        Router(index, routed_per_worker=True)


def test_a_decision_with_lazy_candidates_reads_as_an_eager_one() -> None:
    """The compiled path's decision builds its candidates when read; it equals, hashes, prints, pickles and
    encodes as the Python path's (eager) decision, and stays immutable."""
    import pickle

    import msgspec

    index = PrefixIndex()
    workers = [WorkerKey(f"w{i}", 0) for i in range(5)]
    prompt = list(range(100, 300))
    for i, w in enumerate(workers[:3]):
        index.apply(
            w,
            BlockStored(
                block_hashes=[i * 100 + j for j in range(i + 1)], token_ids=prompt[: 16 * (i + 1)], block_size=16
            ),
        )
    decisions = []
    for model in (CostModel(), _PythonModel()):
        router = Router(index, cost=model, seed=3)
        for w in workers:
            router.add_worker(w)
        router.on_start("busy", workers[4], prompt[:40])
        decisions.append(router.select(prompt))
    lazy, eager = decisions
    assert repr(lazy) == repr(eager) and hash(lazy) == hash(eager)
    assert lazy == eager and lazy.candidates == eager.candidates
    assert len(lazy.candidates) == 4 and lazy.idle_workers == 1
    assert msgspec.json.encode(lazy) == msgspec.json.encode(eager)
    assert pickle.loads(pickle.dumps(lazy)) == lazy
    with pytest.raises(AttributeError):
        lazy.worker = workers[0]  # type: ignore[misc]
    # an idle worker drawn by the compiled path is the last candidate, built on read too
    router = Router(index, seed=0)
    d = router.select(list(range(5000, 5100)), candidates=[workers[3], workers[4]])
    assert [c.worker for c in d.candidates] == [d.worker] and d.idle_workers == 1


def test_a_frozen_decision_needs_a_value_for_every_name() -> None:
    """`Router._decide` builds the compiled path's decision through `_core.new_frozen`, one value per slot
    of `RoutingDecision` (`_LAZY_SLOTS` is its ``__slots__``): a slot without a value is refused, not
    left unset for a reader to trip over."""
    names = RoutingDecision.__slots__
    with pytest.raises(ValueError, match=f"{len(names)} names for {len(names) - 1} values"):
        _core.new_frozen(RoutingDecision, names, (None,) * (len(names) - 1))
    decision = _core.new_frozen(RoutingDecision, names, tuple(range(len(names))))
    assert [getattr(decision, n) for n in names] == list(range(len(names)))


_pressured = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([4, 8, 16]),
        "held": st.integers(0, 40),
        "usage": st.one_of(st.none(), st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0, 1.5, float("nan")])),
        "queued": st.one_of(st.none(), st.integers(0, 300)),  # engine-reported waiting uncached tokens
        "stale": st.booleans(),
        "own": st.integers(0, 3),  # requests this router started there
        "state": st.sampled_from(["synced", "synced", "syncing", "gone"]),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(_pressured, min_size=1, max_size=7),
    unit=st.sampled_from([4, 8, 16]),
    weight=st.sampled_from([0.0, 1.0, 2.0]),
    eviction=st.sampled_from([0.0, 1.0, 8.0]),
    temperature=st.sampled_from([0.0, 0.0, 0.7]),
    prompt_len=st.integers(0, PROMPT_LEN),
    hint=st.booleans(),
    restrict=st.booleans(),
    seed=st.integers(0, 3),
    long_prefix=_long_prefix,
    long_move=_long_move,
)
def test_eviction_is_priced_alike_on_both_paths(
    fleet: list[dict],
    unit: int,
    weight: float,
    eviction: float,
    temperature: float,
    prompt_len: int,
    hint: bool,
    restrict: bool,
    seed: int,
    long_prefix: tuple[float, float] | None,
    long_move: dict,
) -> None:
    """Engine-reported KV usage (`CostModel.eviction`) is priced alike on both paths: on scored,
    hint-only, load-only and usage-only workers, stale and out-of-range reports included."""
    prompt = [(i * 7919) % 50_000 for i in range(PROMPT_LEN)]
    index = PrefixIndex()
    statuses: dict[WorkerKey, WorkerStatus | None] = {}
    live: set[WorkerKey] = set()
    now = [100.0]
    loads = EngineLoads(clock=lambda: now[0])
    workers = [WorkerKey(f"w{i}", i % 2) for i in range(len(fleet))]
    for i, (w, spec) in enumerate(zip(workers, fleet)):
        bs = spec["block_size"]
        held = min(spec["held"], PROMPT_LEN // bs)
        if held:
            hashes = [i * 1000 + j for j in range(held)]
            index.apply(w, BlockStored(block_hashes=hashes, token_ids=prompt[: held * bs], block_size=bs))
        statuses[w] = WorkerStatus(state="syncing" if spec["state"] == "syncing" else "synced", partial=False)
        if spec["state"] != "gone":
            live.add(w)
        if spec["usage"] is not None:
            received = now[0] - (60.0 if spec["stale"] else 1.0)
            loads.update(
                w,
                EngineLoad(token_usage=spec["usage"], waiting_uncached_tokens=spec["queued"], received=received),
            )
    routers = []
    terms = {**_long(long_prefix), **_move(long_move)}
    for model in (
        CostModel(overlap_weight=weight, eviction_weight=eviction, temperature=temperature, **terms),
        _PythonModel(overlap_weight=weight, eviction_weight=eviction, temperature=temperature, **terms),
    ):
        r = Router(
            index,
            states=_States(statuses, live),
            cost=model,
            block_size=unit,
            seed=seed,
            engine_loads=loads,
            routed_ttl=10.0 if hint else 0.0,
        )
        for i, (w, spec) in enumerate(zip(workers, fleet)):
            for j in range(spec["own"]):
                r.on_start(("own", i, j), w, prompt[: 17 * (j + 1) + i])
        routers.append(r)
    kwargs: dict = {}
    if restrict:
        kwargs["candidates"] = [*workers[::2], WorkerKey("x", 9)]
    for k in range(3):
        got = [_decide(r, prompt[:prompt_len], {**kwargs, "request_id": ("q", k)}) for r in routers]
        assert got[0] == got[1]


def test_a_move_onto_a_busy_cache_pays_for_what_it_evicts() -> None:
    """The worker holding a conversation's history keeps its next turn when the only other
    worker is free of queue but runs a cache full of other requests; with that worker's cache
    empty, or the term off, the same queue gap moves the turn."""
    prompt = list(range(1_000, 1_640))  # 40 blocks of 16
    index = PrefixIndex()
    holder, other = WorkerKey("holder", 0), WorkerKey("other", 0)
    index.apply(holder, BlockStored(block_hashes=list(range(30)), token_ids=prompt[:480], block_size=16))
    index.apply(other, BlockStored(block_hashes=[9_999], token_ids=prompt[:16], block_size=16))
    # The holder's queue: 60 blocks, past twice the 29 blocks a move recomputes (2 * 29 = 58).
    for usage, eviction, expected in ((0.9, 8.0, holder), (0.0, 8.0, other), (0.9, 0.0, other)):
        for model in (CostModel(eviction_weight=eviction), _PythonModel(eviction_weight=eviction)):
            loads = EngineLoads(clock=lambda: 5.0)
            loads.update(holder, EngineLoad(waiting_uncached_tokens=960, token_usage=0.2, received=5.0))
            loads.update(other, EngineLoad(waiting_uncached_tokens=0, token_usage=usage, received=5.0))
            r = Router(index, cost=model, engine_loads=loads, seed=0)
            d = r.select(prompt)
            assert d.worker == expected, (usage, eviction, type(model).__name__, d)
            by_worker = {c.worker: c for c in d.candidates}
            # the holder's 10 blocks to prefill and the mover's 39, each at its own usage
            assert by_worker[holder].cost == 2.0 * 10 + 60 + eviction * 0.2 * 10
            move = 2.0 * 39 + (eviction * usage * 39 if usage else 0.0)
            assert by_worker[other].cost == move


def test_the_usage_read_follows_new_and_stale_reports() -> None:
    """`Router._usage` is kept between selects, and still follows a new record and one turning stale."""
    now = [10.0]
    loads = EngineLoads(clock=lambda: now[0])
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    loads.update(a, EngineLoad(token_usage=0.5, received=10.0))
    loads.update(b, EngineLoad(token_usage=0.0, received=5.0))
    r = Router(PrefixIndex(), engine_loads=loads)
    assert r._usage() == {a: 0.5}
    loads.update(b, EngineLoad(token_usage=2.0, received=10.0))  # above 1: read as a full cache
    assert r._usage() == {a: 0.5, b: 1.0}
    now[0] = 10.0 + loads.policy.stale_after + 1.0  # both records stale now
    assert r._usage() is None
    assert Router(PrefixIndex(), engine_loads=loads, cost=CostModel(eviction_weight=0.0))._usage() is None


_HOLDER, _OTHER, _APPROX = WorkerKey("holder", 0), WorkerKey("other", 0), WorkerKey("approx", 0)


def _a_turn_held_elsewhere(known: str, path: str, cost: dict[str, bool]) -> RoutingDecision:
    """The decision for a 200-block turn whose holder holds 190 blocks under a queue of 400 blocks, beside
    an idle worker knowing its first block by the index or only by the routing hint (``known``), priced
    by ``CostModel(**cost)`` on ``path``: compiled, a subclass's Python path, or the stock model's Python
    path (a fleet with an approximate worker, loaded so that it is never picked)."""
    prompt = list(range(1_000, 1_000 + 200 * 16))
    index = PrefixIndex()
    index.apply(_HOLDER, BlockStored(block_hashes=list(range(190)), token_ids=prompt[: 190 * 16], block_size=16))
    if known == "index":
        index.apply(_OTHER, BlockStored(block_hashes=[9_999], token_ids=prompt[:16], block_size=16))
    kind = _PythonModel if path == "python" else CostModel
    r = Router(index, cost=kind(**cost), seed=0, routed_ttl=10.0)
    r.add_worker(_HOLDER)
    r.add_worker(_OTHER)
    if path == "approximate":
        r.add_worker(_APPROX, approximate=True)
    if known == "hint":
        r.on_start("started", _OTHER, prompt[:16])
    return r.select(prompt, load={_HOLDER: 400.0, _OTHER: 0.0, _APPROX: 1_000.0})


@pytest.mark.parametrize("known", ["index", "hint"])
@pytest.mark.parametrize("path", ["compiled", "python", "approximate"])
def test_a_long_recompute_stays_with_its_holder_under_the_long_prefix_term(known: str, path: str) -> None:
    """A 200-block turn whose holder has 10 blocks left to prefill and a queue of 400: the linear cost
    moves it to a worker holding one block (2 * 199 = 398 < 420), the long-prefix term keeps it (2 *
    199 * (1 + 71 / 1,024) = 425.6). The other worker knows its block by the index or only by the
    routing hint; on every path: compiled, a subclass's Python path, and the stock model's Python path
    (a fleet with an approximate worker), whose inlined linear cost must give way to the term."""
    holder, other = _HOLDER, _OTHER
    for on, expected in ((False, other), (True, holder)):
        # the long-move term (on by default) would keep it too: this is the long-prefix term alone
        d = _a_turn_held_elsewhere(known, path, {"long_prefix": on, "long_move": False})
        assert d.worker == expected, (on, d)
        by_worker = {c.worker: c for c in d.candidates}
        assert by_worker[holder].cost == 2.0 * 10 + 400.0
        assert by_worker[other].prefill_blocks == 199.0
        assert by_worker[other].cost == (2.0 * 199 * (1.0 + 71.0 / 1024.0) if on else 2.0 * 199)


def test_the_long_prefix_settings_are_checked() -> None:
    for bad in (
        {"long_prefix": 1},
        {"long_prefix_floor": -1.0},
        {"long_prefix_floor": math.inf},
        {"long_prefix_scale": 0.0},
        {"long_prefix_scale": 5e-324},  # a subnormal scale: every long prefill's cost would overflow
        {"long_prefix_scale": 0.5},
        {"long_prefix_scale": math.nan},
        {"long_prefix_scale": True},
    ):
        with pytest.raises(RouterError):
            CostModel(**bad)  # type: ignore[arg-type]
    model = msgspec.json.decode(
        b'{"long_prefix": true, "long_prefix_floor": 4, "long_prefix_scale": 8}', type=CostModel
    )
    # 12 blocks, 8 above the floor of 4: 2 * 12 * (1 + 8 / 8) + 1; at the floor, the linear cost
    assert model.cost(12.0, 1.0) == 2.0 * 12 * 2.0 + 1.0
    assert model.cost(4.0, 1.0) == CostModel().cost(4.0, 1.0)


@pytest.mark.parametrize("known", ["index", "hint"])
@pytest.mark.parametrize("path", ["compiled", "python", "approximate"])
def test_a_turn_stays_with_its_holder_under_the_long_move_term(known: str, path: str) -> None:
    """A 200-block turn whose holder has 10 blocks left to prefill and a queue of 400 blocks: the plain
    cost moves it to an idle worker holding one block (2 * 199 = 398 < 2 * 10 + 400); the long-move term
    prices the 189 blocks that move recomputes over the holder, 125 above the floor of 64, at 2 * 189 *
    125 / 8 = 5,906.25 more, and keeps it. The holder (nothing over the best) pays nothing more. The other
    worker is known by the index or only by the routing hint; on the compiled path, a subclass's Python
    path, and the stock model's Python path (a fleet with an approximate worker)."""
    holder, other = _HOLDER, _OTHER
    for on, expected in ((False, other), (True, holder)):
        d = _a_turn_held_elsewhere(known, path, {"long_move": on})
        assert d.worker == expected, (on, d)
        by_worker = {c.worker: c for c in d.candidates}
        assert by_worker[holder].cost == 2.0 * 10 + 400.0
        assert by_worker[other].prefill_blocks == 199.0
        assert by_worker[other].cost == 2.0 * 199 + (2.0 * 189 * 125 / 8 if on else 0.0)


@pytest.mark.parametrize("path", ["compiled", "python", "approximate"])
def test_a_turn_stays_with_its_holder_by_default(path: str) -> None:
    """The default `CostModel` prices a move by what it recomputes over the holder (`long_move`): the
    200-block turn of the test above, whose holder has 10 blocks left and a queue of 400, stays there
    against an idle worker holding one block (2 * 199 + 5,906.25 against 2 * 10 + 400); the cost without
    the term (``long_move=False``, the default before) moved it. On every path."""
    assert _a_turn_held_elsewhere("index", path, {}).worker == _HOLDER
    assert _a_turn_held_elsewhere("index", path, {"long_move": False}).worker == _OTHER


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_new_sessions_are_spread_alike_with_the_long_move_term(path: str) -> None:
    """Fresh prompts are priced as without the term, so the footprint spreads them as before: here each
    starts with a 32-block system prompt one worker still holds and the other three evicted, so the holder
    is 32 blocks cheaper than the rest. Priced on the whole prompt, a super-linear term herds new sessions
    onto that worker (docs/routing-quality.md, session 10); priced on what each recomputes over the holder
    (32 blocks, under the floor of 64), they go where they went without it: the same decisions, every
    worker taking some."""
    system = list(range(100_000, 100_000 + 32 * 16))
    index = PrefixIndex()
    workers = [WorkerKey(f"w{i}", 0) for i in range(4)]
    index.apply(workers[0], BlockStored(block_hashes=list(range(32)), token_ids=system, block_size=16))
    kind = _PythonModel if path == "python" else CostModel
    picks = []
    for on in (False, True):
        r = Router(index, cost=kind(long_move=on), seed=3)
        for w in workers:
            r.add_worker(w)
        got = []
        for k in range(16):
            prompt = system + [200_000 + 1_000 * k + j for j in range(300 * 16)]
            got.append(r.select(prompt, request_id=("s", k)).worker)
            r.on_finish(("s", k))
        picks.append(got)
    assert picks[0] == picks[1]
    assert set(picks[1]) == set(workers)


def test_the_long_move_settings_are_checked() -> None:
    for bad in (
        {"long_move": 1},
        {"long_move_floor": -1.0},
        {"long_move_floor": math.inf},
        {"long_move_scale": 0.0},
        {"long_move_scale": 0.5},
        {"long_move_scale": math.nan},
        {"long_move_scale": True},
    ):
        with pytest.raises(RouterError):
            CostModel(**bad)  # type: ignore[arg-type]
    model = msgspec.json.decode(b'{"long_move": true, "long_move_floor": 4, "long_move_scale": 8}', type=CostModel)
    # 12 blocks over the best, 8 above the floor of 4: 2 * 12 * 8 / 8; at or below the floor, nothing
    assert model.move(12.0) == 2.0 * 12 * 8 / 8
    assert model.move(4.0) == 0.0
    assert CostModel().long_move is True  # the default since session 13 (docs/routing-quality.md)
