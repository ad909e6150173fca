"""The Router: send a prompt to the worker where prefill still to do plus load already there costs least.

Cost of a candidate (the model of NVIDIA Dynamo's KV router; its defaults are kept but for
``overlap_weight``, 2 here, see `CostModel`)::

    cost = overlap_weight * prefill_blocks + load_blocks

- ``prefill_blocks``: the prompt's tokens the worker would still have to prefill — all of them
  minus its cached leading blocks, a block on a slower tier credited only in part
  (`CostModel`) — divided by the router's ``block_size``, the unit of every figure here.
- ``load_blocks``: the worker's active load: the KV the requests routed to it and not yet
  finished added there (tracked by `Router.on_start` / `Router.on_finish`), or what the caller
  supplies. A request adds the prompt tokens it did not find cached on its worker: the cached
  prefix was resident already and is shared, as an engine's block pool shares it (Dynamo counts
  a worker's active blocks deduplicated the same way). It is an estimate: when the request that
  brought a shared prefix ends first, the prefix stays pinned by the others but leaves the count.

Lowest cost wins; exact ties are broken uniformly at random; a positive ``temperature`` samples
instead from the softmax of ``-cost / temperature``, spreading load. A new session (a prompt no
candidate holds half of) goes instead where the fewest new sessions started recently, within
`CostModel.footprint_band` of the lowest cost and never to a busier worker (`kvroute._footprint`).

Trust: a worker's index overlap counts only when its state is "synced" (and, unless
``trust_partial``, not partial) — a worker not yet synced, resyncing or partial counts as
holding nothing. Workers the discovery layer removed are never chosen. *Approximate* workers
(engines with events off) are assumed to hold what was routed to them for ``approximate_ttl``
seconds; the index is not consulted for them.

Hot path: with the built-in `CostModel` and no approximate worker, one call into the compiled core
(`kvroute._core.select`) matches the prompt and prices every candidate with overlap or load, the
engines' reported load blended in the same pass (their records are kept in the core as they arrive,
`EngineLoads`; the blend's rules are `EngineLoads.blend`'s);
otherwise one ``find_matches`` and per-worker Python work for workers with overlap, load or an
approximate store (the reference path, `kvroute._scoring`). Every other candidate is *idle*:
nothing cached, no load, one shared cost — they are counted, and one is drawn at random only if the idle group wins.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import accumulate, islice
from typing import Any, Protocol, runtime_checkable

import msgspec

import kvroute._core as _core

from ._cost import CandidateScore, CostModel, RoutingDecision, _check_block_size, _check_range, _key
from ._errors import NoWorkersError, RouterError
from ._hashing import MultimodalItem
from ._index import PrefixIndex
from ._load import EngineLoads
from ._models import WorkerKey, WorkerStates
from ._routed import RoutedPrefixes
from ._scoring import ReferenceScoring, Universe, _Approx, _Query

__all__ = ["SELECT_BUCKETS", "CandidateScore", "CostModel", "Router", "RouterError", "RouterStats", "RoutingDecision"]

_log = logging.getLogger("kvroute.router")

# The core's load table is a mapping in every way `EngineLoads.blend` and the reference path use it.
MutableMapping.register(_core.Loads)

#: Every slot of `RoutingDecision`, in the order `Router._decide` gives the compiled path's values
#: to `_core.new_frozen` (the lazily built candidates: None, their `Scored`, the idle worker drawn);
#: a slot added there without a value here fails every compiled decision (`new_frozen` checks).
_LAZY_SLOTS: tuple[str, ...] = RoutingDecision.__slots__


@runtime_checkable
class ReportsLoads(WorkerStates, Protocol):
    """`WorkerStates` that also carry the engines' reported load, as `KvEventClient` does.

    A `Router` given them as ``states`` prices that load unless it is given ``engine_loads``.
    """

    @property
    def engine_loads(self) -> EngineLoads:
        """The engines' newest load records."""
        ...


#: Upper bounds (seconds) of the `select` latency histogram in `RouterStats`.
SELECT_BUCKETS: tuple[float, ...] = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3)



def _unvetoed(universe: Universe, vetoed: AbstractSet[WorkerKey]) -> Universe:
    """``universe`` less the ``vetoed`` workers, unless that leaves none (a fleet all wedged keeps them all).

    Both `select` paths narrow through this one function: the idle draw takes the n-th member of
    the set, so the two must build it alike to draw the same worker from one seed.
    """
    if not vetoed:
        return universe
    return universe - vetoed or universe

class RouterStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of a `Router`.

    ``select_seconds_*``: the measured wall time of every `select` call — their sum, and
    cumulative counts at or under each bound of `SELECT_BUCKETS` (a Prometheus histogram's
    shape; the count of all calls is ``selections``).
    """

    selections: int
    active_requests: int
    approximate_workers: int
    approximate_blocks: int
    unknown_finishes: int
    select_seconds_sum: float = 0.0
    select_seconds_buckets: tuple[int, ...] = ()


class Router(ReferenceScoring):
    """Picks a worker for each prompt from the prefix index, worker states and load; see the module docstring.

    ``index``: the `PrefixIndex` to read. ``states``: where live workers and their sync state
    come from (a `KvEventClient`); None trusts the index for every worker it holds.
    ``cost``: a `CostModel` (or subclass). ``block_size`` (16, vLLM's default block size): tokens
    per cost block, the unit of prefill, load, cost and temperature — set it to the fleet's
    engine block size. ``trust_partial`` (False): count the overlap of a synced worker whose
    history the replay buffer did not cover; its index is a subset of its cache, so this only
    ever under-claims. ``approximate_ttl`` (120 s, Dynamo's default for routers without KV
    events): how long an approximate worker is assumed to keep what was routed to it.
    ``seed``: seeds tie-breaking and temperature sampling. ``clock``: a monotonic clock in seconds.
    ``engine_loads``: engine-reported load (`kvroute.EngineLoads`, default: the ``states``
    client's ``engine_loads`` when it has one): when ``select`` is given no ``load``, each
    worker's load is the blend of `EngineLoads.blend`, and wedged workers are vetoed while
    another candidate is left. ``routed_ttl`` (0: off) / ``routed_per_worker`` (4): the routing
    hint (`kvroute._routed`): with ``routed_ttl`` > 0 a prompt started on a worker (``select`` with
    a ``request_id``, or ``on_start``) counts as overlap there for the next prompts sharing its
    prefix, until the request finishes, ``routed_ttl`` seconds pass, or the worker has
    ``routed_per_worker`` newer ones — so a session's second request follows the first while the
    engine is still prefilling it and no event has told the index yet (10 s is a good value: see
    the README's routing section for what it gains and costs).

    New sessions are spread by the footprint (`CostModel.footprint`, `kvroute._footprint`): a prompt
    no candidate holds half of goes to the worker with the fewest recent new placements among those
    within ``footprint_band`` of the cheapest cost and no busier than it; a `select` given a
    ``request_id`` counts its placement (`on_start` does not: it cannot tell a new session).

    Threads: one Router may serve several threads. `select` may run on worker threads while
    the client ingests and others call `on_start` / `on_finish`; concurrent `select` calls do
    not wait for each other while they match and price (the core does that with the GIL
    released for long prompts, from its own copy of the tracked load). The router's own
    bookkeeping (requests, load, registrations) changes under one lock, which a `select`
    without a ``request_id`` never takes (it counts itself with atomics in the core). The
    footprint's counts and its pick for a new session are in the core too (`kvroute._footprint`):
    a new placement runs no Python per candidate.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        states: WorkerStates | None = None,
        cost: CostModel | None = None,
        block_size: int = 16,
        trust_partial: bool = False,
        approximate_ttl: float = 120.0,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        engine_loads: EngineLoads | None = None,
        routed_ttl: float = 0.0,
        routed_per_worker: int = 4,
    ) -> None:
        _check_block_size(block_size)
        _check_range("approximate_ttl", approximate_ttl, 0.0, low_open=True)
        _check_range("routed_ttl", routed_ttl, 0.0)
        if isinstance(routed_per_worker, bool) or not isinstance(routed_per_worker, int) or routed_per_worker < 0:
            raise RouterError(f"routed_per_worker must be an int >= 0, got {routed_per_worker!r}")
        self.index = index
        self.states = states
        self.cost_model = cost if cost is not None else CostModel()
        self.block_size = block_size
        self.trust_partial = trust_partial
        self.approximate_ttl = float(approximate_ttl)
        self._rng = random.Random(seed)
        self._clock = clock
        found = states.engine_loads if isinstance(states, ReportsLoads) else None
        self.engine_loads = engine_loads if engine_loads is not None else found
        self._registered: set[WorkerKey] = set()
        self._approx: dict[WorkerKey, _Approx] = {}
        # tokens the active requests added per worker: a table in the core, which `select` reads
        # without a Python call per worker (a dict in insertion order otherwise)
        self._load = _core.Loads()
        self._active: dict[WorkerKey, dict[Hashable, int]] = {}
        self._request_worker: dict[Hashable, WorkerKey] = {}
        self._routed = RoutedPrefixes(float(routed_ttl), routed_per_worker)
        self._footprint = _core.Footprint()  # new placements per worker (`CostModel.footprint`)
        # the states provider's live set as keys, kept while it is the same set (`_core.Members`)
        self._members = _core.Members()
        self._unknown_finishes = 0
        # `select` calls and their times per SELECT_BUCKETS bound (plus one for slower calls),
        # counted in the core without the lock below (see `_core.SelectTimes`)
        self._select_times = _core.SelectTimes(list(SELECT_BUCKETS))
        # Guards the bookkeeping above against threads: each change of it is several steps
        # (read, add, write back; a request in two tables) that another thread must not split.
        # Re-entrant: `_start` finishes a request id that is started again. Never held while the
        # core matches, so concurrent `select` calls run side by side.
        self._lock = threading.RLock()

    # --- workers -------------------------------------------------------------------------

    def add_worker(self, worker: WorkerKey, *, approximate: bool = False, block_size: int | None = None) -> None:
        """Make ``worker`` a candidate (again, to change its settings).

        ``approximate``: the engine publishes no KV events; assume it holds what was routed to
        it for ``approximate_ttl`` seconds. Switching it off forgets that store. ``block_size``:
        the engine's block size, for approximate hashing (default: the router's ``block_size``).
        A registered worker stays a candidate, whatever the states provider says, until
        `remove_worker`.
        """
        if block_size is not None:
            _check_block_size(block_size)
        worker = _key(worker)
        bs = block_size or self.block_size
        with self._lock:
            self._registered.add(worker)
            store = self._approx.get(worker)
            if approximate != (store is not None):
                self._routed.discard_worker(worker)  # a worker is routed by its index or its history, not both
            if not approximate:
                self._approx.pop(worker, None)
            elif store is None or store.block_size != bs:
                self._approx[worker] = _Approx(bs)

    def remove_worker(self, worker: WorkerKey) -> None:
        """Forget a registered worker: its registration, approximate store and tracked load."""
        worker = _key(worker)
        with self._lock:
            self._registered.discard(worker)
            self._approx.pop(worker, None)
            self._load.pop(worker, None)
            self._routed.discard_worker(worker)
            self._footprint.discard(worker)
            for rid in self._active.pop(worker, {}):
                del self._request_worker[rid]

    def is_approximate(self, worker: WorkerKey) -> bool:
        """Whether ``worker`` is routed in approximate mode."""
        return worker in self._approx

    def workers(self) -> set[WorkerKey]:
        """The current candidate universe (before any ``candidates`` restriction), as a new set."""
        return set(self._universe(None))

    # --- load ----------------------------------------------------------------------------

    def on_start(
        self,
        request_id: Hashable,
        worker: WorkerKey,
        token_ids: Sequence[int],
        *,
        cached_tokens: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultimodalItem] = (),
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> None:
        """Record that request ``request_id`` with prompt ``token_ids`` runs on ``worker`` (routed elsewhere).

        Its prompt tokens beyond the first ``cached_tokens`` (those already cached on ``worker``,
        e.g. the chosen candidate's ``overlap_blocks`` times its ``block_size``) count as load on
        ``worker`` until `on_finish`; an approximate worker is assumed to cache the prompt
        (under the request's namespaces ``lora_name``, ``cache_salt``, ``mm_items``, as for
        `select`). Starting an id that is still active moves it. Its prompt is remembered as routed
        to ``worker`` (the routing hint, see `Router`) until `on_finish`.
        """
        worker = _key(worker)
        if isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int) or cached_tokens < 0:
            raise RouterError(f"cached_tokens must be an int >= 0, got {cached_tokens!r}")
        try:
            ntok = len(token_ids)
        except TypeError:
            raise RouterError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}") from None
        store = self._approx.get(worker)
        # Hash before recording anything: bad tokens must leave no half-recorded request.
        query = _Query(token_ids, lora_name, extra_keys, cache_salt, mm_items)
        keys = query.keys(store.block_size) if store is not None else None
        # an approximate worker's own store already assumes it holds the prompt
        routed = query.keys(self.block_size) if self._routed.enabled and store is None else []
        with self._lock:
            self._start(request_id, worker, max(0, ntok - cached_tokens))
            if store is not None and keys is not None:
                store.note(keys, self._clock() + self.approximate_ttl)
            if routed:
                self._routed.add(request_id, worker, routed, self._clock())

    def _start(self, request_id: Hashable, worker: WorkerKey, tokens: int) -> None:
        """Record a started request's tokens as load on ``worker`` (the caller holds ``_lock``)."""
        try:
            known = request_id in self._request_worker
        except TypeError:
            raise RouterError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        if known:
            self.on_finish(request_id)
        try:
            self._load[worker] = self._load.get(worker, 0) + tokens
        except TypeError:  # the table keys workers as the index does: (str, int)
            raise RouterError(f"not a WorkerKey (worker_id, dp_rank): {worker!r}") from None
        self._request_worker[request_id] = worker
        self._active.setdefault(worker, {})[request_id] = tokens

    def on_prefill_done(self, request_id: Hashable) -> bool:
        """The request's prompt is prefilled (its first token came out): its tokens leave the worker's load.

        A request only delays the requests behind it while its prompt is being prefilled; decoding,
        it costs a newcomer one token of each step's budget. So a router that sees first tokens (a
        streamed response's first chunk) prices only prefill still to do, as Dynamo's router does
        (``mark_prefill_completed``); the request stays active until `on_finish`. Returns False,
        changing nothing, when the id is not active.
        """
        with self._lock:
            try:
                worker = self._request_worker.get(request_id)
            except TypeError:
                return False
            if worker is None:
                return False
            active = self._active[worker]
            self._load[worker] -= active[request_id]
            active[request_id] = 0
            return True

    def on_finish(self, request_id: Hashable) -> bool:
        """Release a request's load; False (counted, logged at debug) when the id is not active."""
        with self._lock:
            try:
                worker = self._request_worker.pop(request_id, None)
            except TypeError:
                worker = None
            if worker is None:
                self._unknown_finishes += 1
                _log.debug("on_finish for unknown request %r ignored", request_id)
                return False
            self._routed.discard(request_id)
            active = self._active[worker]
            left = self._load[worker] - active.pop(request_id)
            if active:
                self._load[worker] = left
            else:
                del self._active[worker]
                del self._load[worker]
            return True

    def load_blocks(self, worker: WorkerKey) -> float:
        """The load tracked on ``worker``, in blocks of ``block_size`` tokens."""
        return self._load.get(worker, 0) / self.block_size

    def stats(self) -> RouterStats:
        """A snapshot of the router's counters."""
        selections, seconds, counts = self._select_times.read()
        with self._lock:
            return RouterStats(
                selections=selections,
                active_requests=len(self._request_worker),
                approximate_workers=len(self._approx),
                approximate_blocks=sum(len(s.expiry) for s in self._approx.values()),
                unknown_finishes=self._unknown_finishes,
                select_seconds_sum=seconds,
                select_seconds_buckets=tuple(accumulate(counts[:-1])),
            )

    # --- selection -----------------------------------------------------------------------

    def _live(self) -> Universe:
        """The states provider's live workers: its kept immutable set when it has one
        (`VouchingStates.live_set`, no copy of 1,024 keys per call), else `live_workers`."""
        states = self.states
        assert states is not None
        live_set = getattr(states, "live_set", None)
        found: Universe = live_set() if live_set is not None else states.live_workers()
        return found

    def _universe(self, candidates: Iterable[WorkerKey] | None) -> Universe:
        if candidates is None:
            found = self._live() if self.states is not None else self.index.workers()
            return found | self._registered if self._registered else found
        try:
            wanted = set(candidates)
        except TypeError as exc:
            raise RouterError(f"candidates must be an iterable of WorkerKey: {exc}") from None
        if self.states is None:
            return wanted  # the caller vouches for them: there is no discovery to contradict it
        return (wanted & self._live()) | (wanted & self._registered)

    def select(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultimodalItem] = (),
        candidates: Iterable[WorkerKey] | None = None,
        load: Mapping[WorkerKey, float] | None = None,
        request_id: Hashable | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> RoutingDecision:
        """Choose the worker for a prompt; see the module docstring for the cost.

        ``lora_name`` / ``cache_salt`` / ``mm_items``: the request's namespaces as the engine
        hashes them (`PrefixIndex.find_matches`; ``extra_keys`` is deprecated there too).
        Each worker's overlap is priced in the block size it was measured in. ``candidates``:
        restrict the choice to these workers (removed ones still never win). ``load``: active
        load per worker in blocks of ``block_size`` tokens, replacing the tracked load for this
        call (absent = 0). ``request_id``: record the prompt (the part not cached there) as load on
        the chosen worker until `on_finish`. A chosen approximate
        worker is assumed to cache the prompt either way. Raises `NoWorkersError` when no
        candidate is left, `RouterError` on bad input.
        """
        started = time.perf_counter()
        model = self.cost_model
        if type(model) is CostModel and type(self.index) is PrefixIndex and not self._approx:
            return self._select_compiled(
                started, token_ids, lora_name, cache_salt, mm_items, candidates, load, request_id, extra_keys
            )
        return self._select_reference(
            started, token_ids, lora_name, cache_salt, mm_items, candidates, load, request_id, extra_keys
        )

    def _routed_query(self, query: _Query, ntok: int, record: bool) -> tuple[dict[WorkerKey, int] | None, list[bytes]]:
        """The routing hint for this prompt: its credit per worker in tokens (None: no credit), and
        its content keys to remember for the chosen worker (``record``: a request is started).

        The credit stops a token short of the prompt, as an engine never serves the last token
        from cache. A prompt the router cannot hash gets neither: the index's check names the
        bad argument.
        """
        routed = self._routed
        unit = self.block_size
        with self._lock:
            if routed:
                routed.purge(self._clock())
            look = min((ntok - 1) // unit, routed.longest()) if ntok else 0
        record = record and routed.enabled
        if not look and not record:
            return None, []
        try:
            keys = query.keys(unit)
        except RouterError:
            return None, []
        with self._lock:
            credits = routed.credits(keys[:look]) if look else None
        return ({w: b * unit for w, b in credits.items()} if credits else None), (keys if record else [])

    def _decide(
        self,
        started: float,
        chosen: CandidateScore,
        entries: list[CandidateScore] | tuple[_core.Scored, CandidateScore | None],
        idle_count: int,
        idle_cost: float,
        ntok: int,
        request_id: Hashable | None,
        routed_keys: list[bytes],
    ) -> RoutingDecision:
        """Record the chosen worker's request (its load, and its prompt for the routing hint) and the
        call's time; the decision. ``entries``: the candidates, or the compiled path's (`Scored`,
        the idle worker drawn or None), built into candidates only when read."""
        worker = chosen.worker
        if request_id is not None:
            with self._lock:
                # Load counts what the index says is cached there: the hint guides the choice only
                # (the shared prefix is already counted on the request that brought it).
                self._start(request_id, worker, ntok - chosen.overlap_tokens)
                if routed_keys and worker not in self._approx:
                    self._routed.add(request_id, worker, routed_keys, self._clock())
        self._select_times.record(time.perf_counter() - started)
        if isinstance(entries, tuple):
            # the compiled path's decision, its slots set in the core (in `_LAZY_SLOTS`' order)
            values = (
                None,
                entries[0],
                entries[1],
                chosen.block_size,
                chosen.cost,
                idle_cost,
                idle_count,
                chosen.overlap_blocks,
                chosen.overlap_tokens,
                ntok,
                chosen.routed_tokens,
                worker,
            )
            decision: RoutingDecision = _core.new_frozen(RoutingDecision, _LAZY_SLOTS, values)
            return decision
        return RoutingDecision(
            worker=worker,
            overlap_blocks=chosen.overlap_blocks,
            cost=chosen.cost,
            query_tokens=ntok,
            candidates=tuple(entries),
            idle_workers=idle_count,
            idle_cost=idle_cost,
            block_size=chosen.block_size,
            overlap_tokens=chosen.overlap_tokens,
            routed_tokens=chosen.routed_tokens,
        )

    def _loads(
        self, load: Mapping[WorkerKey, float] | None, universe: Universe
    ) -> tuple[Mapping[WorkerKey, float], float, Universe]:
        """Load per worker, the factor that turns it into cost blocks, and the universe left.

        Tracked load is kept in tokens (valid by construction); supplied load is in blocks,
        checked once here; engine-reported load is blended in and may veto wedged workers.
        """
        unit = self.block_size
        if load is None and self.engine_loads is not None and self.engine_loads.reporting:
            # Engines report load: blend it in (a fleet without reports keeps the plain path).
            with self._lock:  # the requests and their tokens as of one moment
                in_flight = {w: len(active) for w, active in self._active.items()}
                loads, vetoed = self.engine_loads.blend(self._load, unit, in_flight)
            return loads, 1.0, _unvetoed(universe, vetoed)
        if load is None:
            return self._load, 1.0 / unit, universe
        try:
            bad = [(w, v) for w, v in load.items() if not (0.0 <= v < math.inf)]
        except TypeError:
            raise RouterError("load must map workers to numbers") from None
        if bad:
            raise RouterError(f"load must be finite and >= 0; got {bad[0][1]!r} for {bad[0][0]}")
        return load, 1.0, universe

    def _select_compiled(
        self,
        started: float,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        mm_items: Sequence[MultimodalItem],
        candidates: Iterable[WorkerKey] | None,
        load: Mapping[WorkerKey, float] | None,
        request_id: Hashable | None,
        extra_keys: Sequence[Sequence[Any] | None] | None,
    ) -> RoutingDecision:
        """`select` for the built-in `CostModel` and no approximate worker: one call into the core
        matches, prices every candidate and finds the least-cost ties (src/py/router.rs); the
        Python path (`_scored`, `_pick`) is its reference and serves `CostModel` subclasses."""
        if extra_keys is not None:
            warnings.warn(
                "find_matches(extra_keys=...) is deprecated: pass cache_salt= and mm_items=",
                DeprecationWarning,
                stacklevel=3,
            )
        try:
            ntok = len(token_ids)
        except TypeError as exc:
            raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
        universe: Universe | None
        loads: Mapping[WorkerKey, float] | _core.Loads
        # the engines' records to blend in the core (`EngineLoads.blend`'s rules): None, or
        # (their table, now, stale_after, mode, requests in flight)
        engine: tuple[_core.EngineTable, float, float, str, int] | None = None
        usage: dict[WorkerKey, float] | None = None
        if candidates is None and self.states is None and (load is None and not self._engine_reporting()):
            # Every worker the index holds, plus the registered ones: the core reads that
            # membership under its lock instead of this call building the set (~60 µs at 1,024
            # workers). No candidate and no idle worker back means the universe was empty.
            universe, loads, scale = None, self._load, 1.0 / self.block_size
        else:
            universe = self._universe(candidates)
            if not universe:
                # bad input is reported before the fleet's state
                self._check_query(token_ids, lora_name, cache_salt, mm_items, extra_keys)
                self._no_workers(candidates)
            reported = self.engine_loads
            if load is None and reported is not None and reported.reporting:
                # blended in the core's pricing pass, vetoes too: no Python per worker
                policy = reported.policy
                loads, scale = self._load, 1.0 / self.block_size
                in_flight = len(self._request_worker)
                engine = (reported._core, reported.clock(), policy.stale_after, policy.mode, in_flight)
            else:
                loads, scale, universe = self._loads(load, universe)
                usage = self._usage()  # engine KV usage, for `CostModel.eviction`
        model = self.cost_model
        credits: dict[WorkerKey, int] | None = None
        routed_keys: list[bytes] = []
        if self._routed.enabled and (request_id is not None or self._routed):
            query = _Query(token_ids, lora_name, extra_keys, cache_salt, mm_items)
            credits, routed_keys = self._routed_query(query, ntok, request_id is not None)
        # the footprint picks in the core for a new placement (`kvroute._footprint`)
        footprint = self._footprint if model.footprint and model.temperature == 0.0 else None
        try:
            scored, idle_count, idle_cost, tied, idle_tied, _, placed, vetoed, vetoes = _core.select(
                self.index._core,
                token_ids,
                lora_name,
                cache_salt,
                mm_items,
                extra_keys,
                model,
                self.block_size,
                universe,
                self._registered,
                self.states,
                self.trust_partial,
                loads,
                scale,
                credits,
                usage,
                footprint,
                self._rng,
                request_id is not None,  # count the placement
                self._unvouched(),  # whose claims are not believed (read once, not per candidate)
                engine,
                self._members,
            )
        except (TypeError, AttributeError, msgspec.EncodeError) as exc:
            raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
        if vetoes:
            assert self.engine_loads is not None  # only its records veto
            self.engine_loads._count_vetoes(vetoes)
        if not idle_count and not len(scored):
            self._no_workers(candidates)
        chosen_w: WorkerKey | None = None  # the footprint's idle worker, when it picks one
        if placed is not None:
            at, chosen_w = placed
            if chosen_w is None:
                # another thread's ingest changed the fleet between the core's read and now
                return self._select_reference(
                    started, token_ids, lora_name, cache_salt, mm_items, candidates, load, request_id, extra_keys
                )
        elif model.temperature > 0.0:
            at = self._pick_at(scored.costs(), idle_count, idle_cost, model.temperature)
        else:
            r = self._rng.randrange(len(tied) + idle_tied)  # as `_pick` draws
            at = tied[r] if r < len(tied) else None
        tail = None
        if at is None:
            if chosen_w is None:
                if universe is None:
                    universe = self._universe(None)  # the idle group won: the set is built only now
                idle = _unvetoed(universe, set(vetoed)).difference(scored.workers())
                if not idle:
                    # another thread's ingest changed the fleet between the core's read and now
                    return self._select_reference(
                        started, token_ids, lora_name, cache_salt, mm_items, candidates, load, request_id, extra_keys
                    )
                chosen_w = next(islice(iter(idle), self._rng.randrange(len(idle)), None))
            pick: CandidateScore = CandidateScore(
                worker=chosen_w,
                source="index",
                claimed_blocks=0,
                overlap_blocks=0,
                block_size=None,
                prefill_blocks=ntok / self.block_size,
                load_blocks=0.0,
                cost=idle_cost,
            )
            tail = pick
            idle_count -= 1
        else:
            pick = scored.candidate(at)
        return self._decide(started, pick, (scored, tail), idle_count, idle_cost, ntok, request_id, routed_keys)

    def _engine_reporting(self) -> bool:
        """Whether `_loads` blends engine-reported load in (it may veto workers)."""
        return self.engine_loads is not None and self.engine_loads.reporting

    @staticmethod
    def _no_workers(candidates: Iterable[WorkerKey] | None) -> None:
        """Raise `NoWorkersError`: the universe is empty."""
        if candidates is None:
            raise NoWorkersError("no live or registered worker to route to")
        raise NoWorkersError("none of the given candidates is a live or registered worker")

    def _check_query(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        mm_items: Sequence[MultimodalItem],
        extra_keys: Sequence[Sequence[Any] | None] | None,
    ) -> None:
        """Raise `RouterError` when the query's arguments are bad (the index checks them)."""
        try:
            self.index._core.find_matches(token_ids, lora_name, cache_salt, mm_items, extra_keys)
        except (TypeError, AttributeError, msgspec.EncodeError) as exc:
            raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
