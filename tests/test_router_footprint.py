"""The Router's footprint (`CostModel.footprint`): new sessions spread, cached prefixes kept within the band.

Cost alone sends a prompt nobody holds to any idle worker at random, so over a run some workers start
many more sessions than others and evict their histories (docs/routing-quality.md). Both scoring
paths are run: the built-in `CostModel` (the compiled core) and a subclass (the Python reference).
The last test routes sessions onto simulated engines over loopback ZMQ through a real `KvEventClient`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import anyio
import msgspec
import pytest

from kvroute._client import KvEventClient
from kvroute._footprint import Footprint
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey, WorkerStatus
from kvroute._router import CostModel, Router, RouterError
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._wire import BlockStored
from kvroute.sim._engine import SimConfig, SimEngine

BS = 16
WORKERS = [WorkerKey(f"w{i}", 0) for i in range(6)]


class _Subclass(CostModel, frozen=True, kw_only=True):
    """A `CostModel` subclass with the stock cost: it takes the Python reference path."""

    def cost(self, prefill_blocks: float, load_blocks: float) -> float:
        return self.overlap_weight * prefill_blocks + load_blocks


MODELS = {"compiled": CostModel, "reference": _Subclass}


def _router(kind: str, **fields: float | bool) -> Router:
    router = Router(PrefixIndex(), cost=MODELS[kind](**fields), seed=3)
    for w in WORKERS:
        router.add_worker(w)
    return router


def _session(n: int, blocks: int = 8) -> list[int]:
    """A new session's first prompt: ``blocks`` blocks nobody holds (a partial last block)."""
    return list(range(n * 300, n * 300 + blocks * BS + 5))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_burst_of_new_sessions_is_spread_evenly(kind: str) -> None:
    # Each request finishes before the next arrives: no load tells the workers apart, as in a fleet
    # whose requests are short beside the gaps between session starts.
    def starts(router: Router) -> Counter[WorkerKey]:
        placed: Counter[WorkerKey] = Counter()
        for n in range(60):
            d = router.select(_session(n), request_id=n)
            assert d.overlap_tokens == 0
            router.on_prefill_done(n)
            router.on_finish(n)
            placed[d.worker] += 1
        return placed

    spread = starts(_router(kind))
    assert sorted(spread.values()) == [10] * 6
    # Without the footprint each is drawn at random among the idle workers (from a set: the spread varies
    # run to run, 7-12 a worker in one); 60 draws land exactly 10 on each of 6 workers once in ~10^4 runs.
    off = starts(_router(kind, footprint=False))
    assert max(off.values()) - min(off.values()) >= 2


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_footprint_never_sends_a_new_session_to_a_busier_worker(kind: str) -> None:
    router = _router(kind)
    for n, w in enumerate(WORKERS[:3] * 2):  # two sessions started on each of w0-w2
        router.select(_session(n), request_id=("old", n), candidates=[w])
        router.on_finish(("old", n))
    # w3 started none, but it is busy (cost 2·P + L, P = 8.3 blocks, L = 4: within the band of the idle
    # workers' 2·P): the footprint trades no load, so an idle worker that started two sessions wins.
    d = router.select(_session(100), load={WORKERS[3]: 4.0}, candidates=WORKERS[:4])
    assert d.worker in WORKERS[:3]
    # Among workers equally busy, the one that started fewest wins.
    load = dict.fromkeys(WORKERS[:4], 4.0)
    d = router.select(_session(101), load=load, candidates=WORKERS[:4])
    assert d.worker == WORKERS[3]


def _hold(index: PrefixIndex, worker: WorkerKey, prompt: list[int], blocks: int, first_hash: int) -> None:
    """Let ``worker`` hold the first ``blocks`` blocks of ``prompt`` (engine block hashes from ``first_hash``)."""
    hashes = list(range(first_hash, first_hash + blocks))
    index.apply(worker, BlockStored(block_hashes=hashes, token_ids=prompt[: blocks * BS], block_size=BS))


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(
    ("held", "moved"),
    [
        (1, False),  # at band 0 any cached prefix wins (the others: the default 0.5)
        (2, True),  # 2 of 12.3 blocks: 2·10.3 = 20.6, 1.5 x that = 30.9 ≥ 2·12.3 = 24.6, within the band
        (4, True),  # 2·8.3 = 16.6, 1.5 x that = 24.9 ≥ 24.6: within the band still (a third of the prompt)
        (5, False),  # 2·7.3 = 14.6, 1.5 x that = 21.9 < 24.6: the holder's prefix wins
        (7, False),  # over footprint_new_share of the prompt: not a new placement at all
    ],
)
def test_the_footprint_moves_a_cached_prefix_only_within_the_band(kind: str, held: int, moved: bool) -> None:
    router = _router(kind) if held > 1 else _router(kind, footprint_band=0.0)
    holder = WORKERS[0]
    for n in range(30):  # the holder started many sessions: the footprint would send anything elsewhere
        router.select(_session(n), request_id=n, candidates=[holder])
        router.on_finish(n)
    prompt = _session(99, blocks=12)
    _hold(router.index, holder, prompt, held, 1)
    d = router.select(prompt)
    assert (d.worker != holder) is moved


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("band", [0.0, 0.5])
def test_the_chosen_cost_stays_within_the_band_of_the_cheapest(kind: str, band: float) -> None:
    rng = random.Random(7)
    router = _router(kind, footprint_band=band)
    model = router.cost_model
    for n in range(300):
        prompt = _session(n, blocks=rng.randint(1, 20))
        if rng.random() < 0.5:  # a prefix of it cached somewhere
            _hold(router.index, rng.choice(WORKERS), prompt, rng.randint(1, len(prompt) // BS), n * 100)
        load = {w: float(rng.choice([0, 0, 1, 3, 8, 20])) for w in WORKERS}
        d = router.select(prompt, load=load, request_id=n)
        router.on_finish(n)
        cheapest = min(min(c.cost for c in d.candidates), d.idle_cost if d.idle_workers else float("inf"))
        new = max(max(c.overlap_tokens, c.routed_tokens) for c in d.candidates) < 0.5 * len(prompt)
        if new:
            assert d.cost <= model.footprint_limit(cheapest) * (1 + 1e-9)
            at_cheapest = [c.load_blocks for c in d.candidates if c.cost <= cheapest * (1 + 1e-9)]
            chosen = next(c for c in d.candidates if c.worker == d.worker)
            assert chosen.load_blocks <= max(at_cheapest, default=0.0)  # the footprint trades no load
        else:
            assert d.cost == pytest.approx(cheapest)


def test_both_scoring_paths_place_alike() -> None:
    # Same seed, same history: the compiled and the reference path choose the same workers.
    chosen = {}
    for kind in MODELS:
        router = _router(kind, footprint_band=0.5)
        rng = random.Random(11)
        picks = []
        for n in range(120):
            prompt = _session(n % 40, blocks=rng.randint(1, 10))
            d = router.select(prompt, request_id=n, load={w: float(rng.randint(0, 6)) for w in WORKERS})
            if rng.random() < 0.7:
                router.on_finish(n)
            picks.append(d.worker)
        chosen[kind] = picks
    assert chosen["compiled"] == chosen["reference"]


class _States:
    """Every worker live; the ``unsynced`` ones resyncing (their index claims count for nothing)."""

    def __init__(self, live: list[WorkerKey], unsynced: set[WorkerKey]) -> None:
        self._live = set(live)
        self._unsynced = unsynced

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        if worker not in self._live:
            return None
        return WorkerStatus(state="resyncing" if worker in self._unsynced else "synced", partial=False)

    def live_workers(self) -> set[WorkerKey]:
        return set(self._live)


# Registered in an order other than key order: a draw by position in either path's own list or set differs.
SHUFFLED = [WorkerKey("m", 1), WorkerKey("b", 0), WorkerKey("x", 0), WorkerKey("m", 0), WorkerKey("a", 7)]


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("seed", range(6))
def test_the_footprint_draws_among_its_ties_in_worker_key_order(kind: str, seed: int) -> None:
    # m/1 and x/0 hold a block of the prompt but resync: listed candidates at the idle workers' cost, and no
    # worker has a count, so all five tie. Both paths draw one with the router's rng, in WorkerKey order.
    unsynced = {SHUFFLED[0], SHUFFLED[2]}
    router = Router(PrefixIndex(), states=_States(SHUFFLED, unsynced), cost=MODELS[kind](), seed=seed)
    prompt = _session(0)
    for n, w in enumerate(unsynced):
        _hold(router.index, w, prompt, 1, 1 + n * 10)
    d = router.select(prompt)
    assert {c.worker for c in d.candidates if c.claimed_blocks == 1 and c.overlap_blocks == 0} == unsynced
    assert d.idle_cost == d.cost
    assert d.worker == sorted(SHUFFLED)[random.Random(seed).randrange(len(SHUFFLED))]


def test_the_pick_never_answers_a_key_object_that_is_gone() -> None:
    # The pick keeps each worker object's key by address (a states provider's live set holds the same objects
    # call after call); objects made and freed round after round land at freed ones' addresses.
    def fleets() -> Iterator[set[WorkerKey]]:
        for n in range(200):
            yield {WorkerKey(f"r{n}-{i}", i) for i in range(3)}

    assert len({id(w) for fleet in fleets() for w in fleet}) < 600  # addresses are reused
    fp = Footprint()
    for n, fleet in enumerate(fleets()):
        got = fp.pick([], [], [], 1.0, lambda fleet=fleet: fleet, lambda c: c, random.Random(n))
        assert got is not None and got[1] in fleet


def test_counts_decay_by_half_every_half_life() -> None:
    fp = Footprint()
    fp.add(WORKERS[0], 4.0)
    assert fp.count(WORKERS[0]) == pytest.approx(1.0)
    for _ in range(4):
        fp.add(WORKERS[1], 4.0)
    assert fp.count(WORKERS[0]) == pytest.approx(0.5)
    for _ in range(2_000):  # past the rescaling point the ratio holds
        fp.add(WORKERS[1], 4.0)
    assert fp.count(WORKERS[1]) == pytest.approx(1.0 / (1.0 - 2.0 ** (-1 / 4)), rel=1e-6)
    fp.discard(WORKERS[1])
    assert fp.count(WORKERS[1]) == 0.0


def test_the_footprint_settings_are_checked_and_load_from_configuration() -> None:
    for bad in (
        {"footprint": 1},
        {"footprint_band": -0.1},
        {"footprint_new_share": 1.5},
        {"footprint_half_life": 0.0},
    ):
        with pytest.raises(RouterError):
            CostModel(**bad)  # type: ignore[arg-type]
    model = msgspec.json.decode(b'{"footprint": false, "footprint_band": 0.5}', type=CostModel)
    assert not model.footprint and model.footprint_limit(10.0) == 15.0


@pytest.mark.anyio
async def test_sessions_started_on_live_engines_spread_over_their_ranks() -> None:
    config = SimConfig(ranks=3, grpc_port=None, http_port=None, decode_time_per_step=0.001, prefill_time_per_token=1e-6)
    fast = SubscriberConfig(reconnect_ivl=0.02, reconnect_ivl_max=0.1, replay_timeout=0.3, quiet_interval=0.3)
    async with SimEngine(config) as engine, KvEventClient(engine.sources(), config=fast) as client:
        await client.wait_synced(5.0)
        router = Router(client.index, states=client, seed=1)
        placed: Counter[int] = Counter()
        for n in range(12):
            prompt = _session(n)
            d = router.select(prompt, request_id=n)
            await engine.complete(prompt, max_tokens=1, rank=d.worker.dp_rank)
            router.on_finish(n)
            placed[d.worker.dp_rank] += 1
        assert sorted(placed.values()) == [4, 4, 4]
        # A session's next turn still goes to the rank holding its history, whatever its footprint.
        stream = client.events()
        turn = [*_session(11), *range(7, 40)]
        with anyio.fail_after(5.0):
            while max(client.index.find_matches(turn).values(), default=0) < 8:
                await stream.__anext__()
        assert router.select(turn).worker == d.worker
