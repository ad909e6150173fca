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
instead from the softmax of ``-cost / temperature``, spreading load.

Trust: a worker's index overlap counts only when its state is "synced" (and, unless
``trust_partial``, not partial) — a worker not yet synced, resyncing or partial counts as
holding nothing. Workers the discovery layer removed are never chosen. *Approximate* workers
(engines with events off) are assumed to hold what was routed to them for ``approximate_ttl``
seconds; the index is not consulted for them.

Hot path: with the built-in `CostModel` and no approximate worker, one call into the compiled core
(`kvroute._core.select`) matches the prompt and prices every candidate with overlap or load;
otherwise one ``find_matches`` and per-worker Python work for workers with overlap, load or an
approximate store (the reference path). Every other candidate is *idle*: nothing cached, no load,
one shared cost — they are counted, and one is drawn at random only if the idle group wins.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import warnings
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from itertools import accumulate, islice
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec

import kvroute._core as _core

from ._errors import NoWorkersError, RouterError
from ._hashing import MultimodalItem, chain_keys
from ._index import OverlapScores, PrefixIndex
from ._load import EngineLoads
from ._models import CPU, DISK, EXTERNAL, GPU, WorkerKey, WorkerStates
from ._routed import RoutedPrefixes

__all__ = ["SELECT_BUCKETS", "CandidateScore", "CostModel", "Router", "RouterError", "RouterStats", "RoutingDecision"]

_log = logging.getLogger("kvroute.router")

# Costs computed by different paths (index overlap, approximate store, idle) can differ in the
# last bits for equal inputs; closer than this relative margin they are a tie.
_TIE_EPS = 1e-9


@runtime_checkable
class ReportsLoads(WorkerStates, Protocol):
    """`WorkerStates` that also carry the engines' reported load, as `KvEventClient` does.

    A `Router` given them as ``states`` prices that load unless it is given ``engine_loads``.
    """

    @property
    def engine_loads(self) -> EngineLoads:
        """The engines' newest load records."""
        ...


def _key(worker: WorkerKey) -> WorkerKey:
    try:
        return WorkerKey(*worker)
    except TypeError:
        raise RouterError(f"not a WorkerKey (worker_id, dp_rank): {worker!r}") from None


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise RouterError(f"block_size must be an int >= 1, got {block_size!r}")


def _check_range(name: str, value: float, low: float, high: float = math.inf, *, low_open: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RouterError(f"{name} must be a finite number within {bound}, got {value!r}")


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """The weights of the routing cost; subclass and override `cost` / `credited_blocks` for another policy.

    ``overlap_weight`` (2.0): weight of the prefill still to do against the load; 0 ignores
    caches entirely (pure load balancing), larger favours cache hits over spread. A request leaves
    the worker holding its prefix only when the queue there exceeds the queue elsewhere by
    ``overlap_weight`` times the tokens it would recompute. Dynamo's 1.0 prices this request's wait
    alone, and a turn then leaves its history for any longer queue — though the recompute delays the
    requests queued behind it on the new worker, and its copy evicts something; 2 counts one such
    request. Measured in ``kvroute demo`` (README, "Routing quality"): 1.0 lost 3-5 points of hit
    rate against session affinity on conversation traces; above 2, load imbalance passes 1.5.
    ``cpu_credit`` / ``disk_credit`` / ``external_credit``: the fraction of a block's prefill saved
    when it is cached on that tier instead of GPU (a GPU hit saves all of it). CPU 0.8 is llm-d's
    default weight for CPU-offloaded blocks; DISK and EXTERNAL (LMCache / Mooncake-style stores)
    default to 0.5: loading from them is slower than PCIe but still well below recomputing.
    ``temperature`` (0.0, Dynamo's default): 0 picks the cheapest worker; above 0 samples with
    probability ∝ exp(-cost / temperature), cost in blocks of the router's ``block_size``.

    Overrides must be pure functions of their arguments: the router evaluates the cost of all
    idle workers once. The built-in model is priced in the compiled core (its weights read off
    the instance on every call); a subclass is priced in Python, the slower path, with the same
    rules and tie-breaks.
    """

    overlap_weight: float = 2.0
    cpu_credit: float = 0.8
    disk_credit: float = 0.5
    external_credit: float = 0.5
    temperature: float = 0.0

    def __post_init__(self) -> None:
        _check_range("overlap_weight", self.overlap_weight, 0.0)
        _check_range("cpu_credit", self.cpu_credit, 0.0, 1.0)
        _check_range("disk_credit", self.disk_credit, 0.0, 1.0)
        _check_range("external_credit", self.external_credit, 0.0, 1.0)
        _check_range("temperature", self.temperature, 0.0)

    @property
    def full_credit(self) -> bool:
        """True when every tier counts as a GPU hit (the per-tier split is then never needed)."""
        return self.cpu_credit == 1.0 and self.disk_credit == 1.0 and self.external_credit == 1.0

    def credited_blocks(self, overlap: int, gpu: int, cpu: int, disk: int, external: int) -> float:
        """Cached blocks as GPU-hit equivalents, from the leading run on any tier and on each tier.

        Block i of the run counts with the best credit among the tiers whose own leading run
        covers it; a block covered by no single tier's run (held on a mix) gets the lowest
        credit of the slower tiers, a lower bound of what it saves. The router calls it only
        for runs not wholly on GPU: a GPU run is credited in full.
        """
        runs = sorted(
            ((1.0, gpu), (self.cpu_credit, cpu), (self.disk_credit, disk), (self.external_credit, external)),
            reverse=True,
        )
        credited = 0.0
        covered = 0
        for credit, run in runs:
            run = min(run, overlap)
            if run > covered:
                credited += (run - covered) * credit
                covered = run
        if covered < overlap:
            credited += (overlap - covered) * min(self.cpu_credit, self.disk_credit, self.external_credit)
        return credited

    def cost(self, prefill_blocks: float, load_blocks: float) -> float:
        """A candidate's cost: ``overlap_weight * prefill_blocks + load_blocks`` (lower is better)."""
        return self.overlap_weight * prefill_blocks + load_blocks


class CandidateScore(msgspec.Struct, frozen=True, gc=False):
    """What the router weighed for one candidate.

    ``claimed_blocks``: leading blocks the index (or the approximate store) says the worker holds;
    ``overlap_blocks``: those it counted (0 when the worker's state cannot back the claim).
    Both are in the worker's own blocks of ``block_size`` tokens (None: nothing known of it);
    ``overlap_tokens`` is the counted overlap in tokens (at most the prompt), comparable across
    workers of different block sizes. ``routed_tokens``: the prompt's leading tokens the router
    itself recently sent to this worker in a request not yet finished (`kvroute._routed`, a routing
    hint, never an index claim); it is credited where it exceeds the index's overlap.
    ``prefill_blocks``, ``load_blocks`` and ``cost`` are in blocks of the router's ``block_size``.
    ``source``: "index" or "approximate".
    """

    worker: WorkerKey
    source: str
    claimed_blocks: int
    overlap_blocks: int
    block_size: int | None
    prefill_blocks: float
    load_blocks: float
    cost: float
    overlap_tokens: int = 0
    routed_tokens: int = 0


# The compiled select builds candidates positionally, in the field order above.
_core.set_candidate_type(CandidateScore)


@dataclasses.dataclass(frozen=True)
class _DecisionFields:
    """`RoutingDecision`'s fields, in order: what encoders (msgspec) and `dataclasses` read of it."""

    worker: WorkerKey
    overlap_blocks: int
    cost: float
    query_tokens: int
    candidates: tuple[CandidateScore, ...]
    idle_workers: int
    idle_cost: float
    block_size: int | None = None
    overlap_tokens: int = 0
    routed_tokens: int = 0


_DECISION_FIELDS = tuple(_DecisionFields.__dataclass_fields__)


class RoutingDecision:
    """The chosen worker and the figures it was chosen from (immutable).

    ``candidates`` lists every candidate that had a claim, an overlap or load, and the chosen
    worker; the ``idle_workers`` other candidates held nothing and had no load, each at
    ``idle_cost``. ``overlap_blocks``: the chosen worker's counted leading blocks, in its own
    ``block_size`` (None: nothing known of it); ``overlap_tokens``: the same in tokens (a fleet
    mixing 16-token vLLM and 64-token SGLang workers compares these); ``routed_tokens``: the
    chosen worker's credit from the router's own recently routed prompts (`CandidateScore`);
    ``query_tokens``: the prompt's length.

    A decision of the compiled path keeps its candidates' figures compact and builds the
    `CandidateScore` tuple the first time ``candidates`` is read (a loaded fleet of 1,024
    workers has 1,024 of them, and most routers read only ``worker``). Equality, hashing and repr
    are those of a frozen struct of the fields above, in that order; it encodes (msgspec) as one.
    """

    # Encoders and `dataclasses.fields` / `asdict` read a dataclass's fields by name through
    # getattr, so the lazily built ``candidates`` is read like any other field.
    __dataclass_fields__: ClassVar[dict[str, Any]] = _DecisionFields.__dataclass_fields__

    __slots__ = (
        "_candidates",
        "_scored",
        "_tail",
        "block_size",
        "cost",
        "idle_cost",
        "idle_workers",
        "overlap_blocks",
        "overlap_tokens",
        "query_tokens",
        "routed_tokens",
        "worker",
    )
    __match_args__ = (
        "worker",
        "overlap_blocks",
        "cost",
        "query_tokens",
        "candidates",
        "idle_workers",
        "idle_cost",
        "block_size",
        "overlap_tokens",
        "routed_tokens",
    )

    _candidates: tuple[CandidateScore, ...] | None
    _scored: _core.Scored | None
    _tail: CandidateScore | None
    worker: WorkerKey
    overlap_blocks: int
    cost: float
    query_tokens: int
    idle_workers: int
    idle_cost: float
    block_size: int | None
    overlap_tokens: int
    routed_tokens: int

    def __init__(
        self,
        *,
        worker: WorkerKey,
        overlap_blocks: int,
        cost: float,
        query_tokens: int,
        candidates: tuple[CandidateScore, ...],
        idle_workers: int,
        idle_cost: float,
        block_size: int | None = None,
        overlap_tokens: int = 0,
        routed_tokens: int = 0,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "worker", worker)
        setattr_(self, "overlap_blocks", overlap_blocks)
        setattr_(self, "cost", cost)
        setattr_(self, "query_tokens", query_tokens)
        setattr_(self, "_candidates", tuple(candidates))
        setattr_(self, "_scored", None)
        setattr_(self, "_tail", None)
        setattr_(self, "idle_workers", idle_workers)
        setattr_(self, "idle_cost", idle_cost)
        setattr_(self, "block_size", block_size)
        setattr_(self, "overlap_tokens", overlap_tokens)
        setattr_(self, "routed_tokens", routed_tokens)

    @classmethod
    def _lazy(cls, scored: _core.Scored, tail: CandidateScore | None, **fields: Any) -> RoutingDecision:
        """A decision whose candidates are ``scored``'s (`kvroute._core.Scored`), then ``tail``."""
        d = cls(candidates=(), **fields)
        object.__setattr__(d, "_candidates", None)
        object.__setattr__(d, "_scored", scored)
        object.__setattr__(d, "_tail", tail)
        return d

    @property
    def candidates(self) -> tuple[CandidateScore, ...]:
        """Every candidate with a claim, an overlap or load, and the chosen worker."""
        got = self._candidates
        if got is None:
            assert self._scored is not None
            built: list[CandidateScore] = self._scored.build()
            if self._tail is not None:
                built.append(self._tail)
            got = tuple(built)
            # `_scored` stays: a thread reading `candidates` at the same time may still build from it.
            object.__setattr__(self, "_candidates", got)
        return got

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _DECISION_FIELDS)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("immutable type: 'RoutingDecision'")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("immutable type: 'RoutingDecision'")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingDecision) or type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={value!r}" for name, value in zip(_DECISION_FIELDS, self._values()))
        return f"RoutingDecision({body})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_decision, self._values())


def _decision(*values: Any) -> RoutingDecision:
    """Rebuild a pickled `RoutingDecision`."""
    return RoutingDecision(**dict(zip(_DECISION_FIELDS, values)))


#: Upper bounds (seconds) of the `select` latency histogram in `RouterStats`.
SELECT_BUCKETS: tuple[float, ...] = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3)


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


class _Approx:
    """What an approximate worker is assumed to hold: content key -> expiry, oldest first.

    One TTL for all and a monotonic clock make insertion order expiry order, so expired keys
    are always at the front and purging is amortised O(1) per key.
    """

    __slots__ = ("block_size", "expiry")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.expiry: dict[bytes, float] = {}

    def purge(self, now: float) -> None:
        expiry = self.expiry
        while expiry:
            first = next(iter(expiry))
            if expiry[first] > now:
                return
            del expiry[first]

    def leading(self, keys: list[bytes]) -> int:
        expiry = self.expiry
        n = 0
        for k in keys:
            if k not in expiry:
                break
            n += 1
        return n

    def note(self, keys: list[bytes], until: float) -> None:
        expiry = self.expiry
        pop = expiry.pop
        for k in keys:
            pop(k, None)  # re-inserting moves the key to the back: expiry order stays insertion order
            expiry[k] = until


class _Query:
    """One prompt with its content keys per block size, hashed only when an approximate worker asks."""

    __slots__ = ("_keys", "cache_salt", "extra_keys", "lora_name", "mm_items", "token_ids")

    def __init__(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        extra_keys: Sequence[Sequence[Any] | None] | None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultimodalItem] = (),
    ) -> None:
        self.token_ids = token_ids
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_items = mm_items
        self.extra_keys = extra_keys
        self._keys: dict[int, list[bytes]] = {}

    def keys(self, block_size: int) -> list[bytes]:
        got = self._keys.get(block_size)
        if got is None:
            try:
                got = chain_keys(
                    self.token_ids,
                    block_size,
                    lora_name=self.lora_name,
                    cache_salt=self.cache_salt,
                    mm_items=self.mm_items,
                    extra_keys=self.extra_keys,
                )
            except OverflowError:
                got = []  # a token outside uint32 is never a held block (kvroute._hashing)
            except (TypeError, AttributeError, msgspec.EncodeError) as exc:
                raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
            self._keys[block_size] = got
        return got


class Router:
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

    Not thread-safe: use it from one thread (or one event loop), like the index it reads.
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
        self._load: dict[WorkerKey, int] = {}  # tokens the active requests added per worker
        self._active: dict[WorkerKey, dict[Hashable, int]] = {}
        self._request_worker: dict[Hashable, WorkerKey] = {}
        self._routed = RoutedPrefixes(float(routed_ttl), routed_per_worker)
        self._selections = 0
        self._unknown_finishes = 0
        self._select_seconds = 0.0
        # One count per SELECT_BUCKETS bound, plus one for slower calls.
        self._select_buckets = [0] * (len(SELECT_BUCKETS) + 1)

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
        self._registered.add(worker)
        bs = block_size or self.block_size
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
        self._registered.discard(worker)
        self._approx.pop(worker, None)
        self._load.pop(worker, None)
        self._routed.discard_worker(worker)
        for rid in self._active.pop(worker, {}):
            del self._request_worker[rid]

    def is_approximate(self, worker: WorkerKey) -> bool:
        """Whether ``worker`` is routed in approximate mode."""
        return worker in self._approx

    def workers(self) -> set[WorkerKey]:
        """The current candidate universe (before any ``candidates`` restriction)."""
        found = self.states.live_workers() if self.states is not None else self.index.workers()
        return found | self._registered if self._registered else found

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
        self._start(request_id, worker, max(0, ntok - cached_tokens))
        if store is not None and keys is not None:
            store.note(keys, self._clock() + self.approximate_ttl)
        if routed:
            self._routed.add(request_id, worker, routed, self._clock())

    def _start(self, request_id: Hashable, worker: WorkerKey, tokens: int) -> None:
        try:
            known = request_id in self._request_worker
        except TypeError:
            raise RouterError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        if known:
            self.on_finish(request_id)
        self._request_worker[request_id] = worker
        self._active.setdefault(worker, {})[request_id] = tokens
        self._load[worker] = self._load.get(worker, 0) + tokens

    def on_prefill_done(self, request_id: Hashable) -> bool:
        """The request's prompt is prefilled (its first token came out): its tokens leave the worker's load.

        A request only delays the requests behind it while its prompt is being prefilled; decoding,
        it costs a newcomer one token of each step's budget. So a router that sees first tokens (a
        streamed response's first chunk) prices only prefill still to do, as Dynamo's router does
        (``mark_prefill_completed``); the request stays active until `on_finish`. Returns False,
        changing nothing, when the id is not active.
        """
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
        return RouterStats(
            selections=self._selections,
            active_requests=len(self._request_worker),
            approximate_workers=len(self._approx),
            approximate_blocks=sum(len(s.expiry) for s in self._approx.values()),
            unknown_finishes=self._unknown_finishes,
            select_seconds_sum=self._select_seconds,
            select_seconds_buckets=tuple(accumulate(self._select_buckets[:-1])),
        )

    # --- selection -----------------------------------------------------------------------

    def _universe(self, candidates: Iterable[WorkerKey] | None) -> set[WorkerKey]:
        if candidates is None:
            return self.workers()
        try:
            wanted = set(candidates)
        except TypeError as exc:
            raise RouterError(f"candidates must be an iterable of WorkerKey: {exc}") from None
        if self.states is None:
            return wanted  # the caller vouches for them: there is no discovery to contradict it
        return (wanted & self.states.live_workers()) | (wanted & self._registered)

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
        try:
            ntok = len(token_ids)
            if extra_keys is None:
                scores = self.index.find_matches(
                    token_ids, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items
                )
            else:
                scores = self.index.find_matches(
                    token_ids, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items, extra_keys=extra_keys
                )
        except (TypeError, AttributeError, msgspec.EncodeError) as exc:
            raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
        universe = self._universe(candidates)
        if not universe:
            if candidates is None:
                raise NoWorkersError("no live or registered worker to route to")
            raise NoWorkersError("none of the given candidates is a live or registered worker")
        query = _Query(token_ids, lora_name, extra_keys, cache_salt, mm_items)
        credits, routed_keys = self._routed_query(query, ntok, request_id is not None)
        unit = self.block_size
        cost_of = model.cost
        idle_prefill = ntok / unit
        entries: list[CandidateScore] = []
        seen: set[WorkerKey] = set()  # listed by the approximate or the index pass
        loads, scale, universe = self._loads(load, universe)
        load_get = loads.get

        approx = self._approx
        if approx:
            now = self._clock()
            for w, store in approx.items():
                if w not in universe:
                    continue
                store.purge(now)
                held = store.leading(query.keys(store.block_size)) if store.expiry else 0
                w_load = load_get(w, 0) * scale
                if not held and not w_load:
                    continue
                bs = store.block_size
                prefill = (ntok - held * bs) / unit
                seen.add(w)
                entries.append(
                    CandidateScore(
                        worker=w,
                        source="approximate",
                        claimed_blocks=held,
                        overlap_blocks=held,
                        block_size=bs,
                        prefill_blocks=prefill,
                        load_blocks=w_load,
                        cost=cost_of(prefill, w_load),
                        overlap_tokens=min(ntok, held * bs),
                    )
                )

        if scores:
            self._scored(entries, scores, universe, seen, ntok, idle_prefill, loads, scale, credits)
        if credits:
            self._routed_only(entries, credits, universe, seen, ntok, loads, scale)

        # Load-only workers: nothing claimed, so the prefill is the whole prompt. Approximate
        # workers with load were all listed above. The stock model's cost is inlined: this
        # loop runs for every busy worker.
        idle_cost = cost_of(idle_prefill, 0.0)
        stock = type(model) is CostModel
        for w, t in loads.items():
            if t and w in universe and w not in seen:
                w_load = t * scale
                entries.append(
                    CandidateScore(
                        worker=w,
                        source="index",
                        claimed_blocks=0,
                        overlap_blocks=0,
                        block_size=None,
                        prefill_blocks=idle_prefill,
                        load_blocks=w_load,
                        cost=idle_cost + w_load if stock else cost_of(idle_prefill, w_load),
                    )
                )

        idle_count = len(universe) - len(entries)
        pick = self._pick(entries, idle_count, idle_cost, model.temperature)
        if pick is None:
            idle = universe.difference([e.worker for e in entries])
            chosen_w = next(islice(iter(idle), self._rng.randrange(len(idle)), None))
            chosen = CandidateScore(
                worker=chosen_w,
                source="approximate" if chosen_w in approx else "index",
                claimed_blocks=0,
                overlap_blocks=0,
                block_size=approx[chosen_w].block_size if chosen_w in approx else None,
                prefill_blocks=idle_prefill,
                load_blocks=0.0,
                cost=idle_cost,
            )
            entries.append(chosen)
            idle_count -= 1
        else:
            chosen = pick
        worker = chosen.worker

        chosen_store = approx.get(worker)
        if chosen_store is not None:
            chosen_store.note(query.keys(chosen_store.block_size), self._clock() + self.approximate_ttl)
        return self._decide(started, chosen, entries, idle_count, idle_cost, ntok, request_id, routed_keys)

    def _routed_query(self, query: _Query, ntok: int, record: bool) -> tuple[dict[WorkerKey, int] | None, list[bytes]]:
        """The routing hint for this prompt: its credit per worker in tokens (None: no credit), and
        its content keys to remember for the chosen worker (``record``: a request is started).

        The credit stops a token short of the prompt, as an engine never serves the last token
        from cache. A prompt the router cannot hash gets neither: the index's check names the
        bad argument.
        """
        routed = self._routed
        if routed:
            routed.purge(self._clock())
        unit = self.block_size
        look = min((ntok - 1) // unit, routed.longest()) if ntok else 0
        record = record and routed.enabled
        if not look and not record:
            return None, []
        try:
            keys = query.keys(unit)
        except RouterError:
            return None, []
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
            # Load counts what the index says is cached there: the hint guides the choice only
            # (the shared prefix is already counted on the request that brought it).
            self._start(request_id, worker, ntok - chosen.overlap_tokens)
            if routed_keys and worker not in self._approx:
                self._routed.add(request_id, worker, routed_keys, self._clock())
        self._selections += 1
        took = time.perf_counter() - started
        self._select_seconds += took
        self._select_buckets[bisect_left(SELECT_BUCKETS, took)] += 1
        fields: dict[str, Any] = dict(
            worker=worker,
            overlap_blocks=chosen.overlap_blocks,
            cost=chosen.cost,
            query_tokens=ntok,
            idle_workers=idle_count,
            idle_cost=idle_cost,
            block_size=chosen.block_size,
            overlap_tokens=chosen.overlap_tokens,
            routed_tokens=chosen.routed_tokens,
        )
        if isinstance(entries, tuple):
            return RoutingDecision._lazy(entries[0], entries[1], **fields)
        return RoutingDecision(candidates=tuple(entries), **fields)

    def _loads(
        self, load: Mapping[WorkerKey, float] | None, universe: set[WorkerKey]
    ) -> tuple[Mapping[WorkerKey, float], float, set[WorkerKey]]:
        """Load per worker, the factor that turns it into cost blocks, and the universe left.

        Tracked load is kept in tokens (valid by construction); supplied load is in blocks,
        checked once here; engine-reported load is blended in and may veto wedged workers.
        """
        unit = self.block_size
        if load is None and self.engine_loads is not None and self.engine_loads.reporting:
            # Engines report load: blend it in (a fleet without reports keeps the plain path).
            in_flight = {w: len(active) for w, active in self._active.items()}
            loads, vetoed = self.engine_loads.blend(self._load, unit, in_flight)
            if vetoed and universe - vetoed:
                universe = universe - vetoed
            return loads, 1.0, universe
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
        universe = self._universe(candidates)
        if not universe:
            # bad input is reported before the fleet's state
            self._check_query(token_ids, lora_name, cache_salt, mm_items, extra_keys)
            if candidates is None:
                raise NoWorkersError("no live or registered worker to route to")
            raise NoWorkersError("none of the given candidates is a live or registered worker")
        loads, scale, universe = self._loads(load, universe)
        model = self.cost_model
        credits: dict[WorkerKey, int] | None = None
        routed_keys: list[bytes] = []
        if self._routed.enabled and (request_id is not None or self._routed):
            query = _Query(token_ids, lora_name, extra_keys, cache_salt, mm_items)
            credits, routed_keys = self._routed_query(query, ntok, request_id is not None)
        try:
            scored, idle_count, idle_cost, tied, idle_tied, _ = _core.select(
                self.index._core,
                token_ids,
                lora_name,
                cache_salt,
                mm_items,
                extra_keys,
                model,
                self.block_size,
                universe,
                self.states,
                self.trust_partial,
                loads,
                scale,
                credits,
            )
        except (TypeError, AttributeError, msgspec.EncodeError) as exc:
            raise RouterError(f"token_ids / mm_items / extra_keys: not ints, items, keys: {exc}") from None
        if model.temperature > 0.0:
            at = self._pick_at(scored.costs(), idle_count, idle_cost, model.temperature)
        else:
            r = self._rng.randrange(len(tied) + idle_tied)  # as `_pick` draws
            at = tied[r] if r < len(tied) else None
        tail = None
        if at is None:
            idle = universe.difference(scored.workers())
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

    def _scored(
        self,
        out: list[CandidateScore],
        scores: OverlapScores,
        universe: set[WorkerKey],
        seen: set[WorkerKey],
        ntok: int,
        idle_prefill: float,
        loads: Mapping[WorkerKey, float],
        scale: float,
        credits: dict[WorkerKey, int] | None,
    ) -> None:
        """Append the figures of the workers the index claims overlap for (approximate ones excluded);
        ``credits``: the routing hint's tokens per worker, credited where they exceed the index's."""
        unit = self.block_size
        model = self.cost_model
        cost_of = model.cost
        stock = type(model) is CostModel
        weight = model.overlap_weight
        full_credit = model.full_credit
        gpu_runs = scores.tier(GPU)
        approx = self._approx
        block_size_of = scores.block_size
        load_get = loads.get
        states = self.states
        trust_partial = self.trust_partial
        for w, claimed in scores.items():
            # `seen` holds only approximate workers so far: `w in approx` covers it.
            if w in approx or w not in universe:
                continue
            w_load = load_get(w, 0) * scale
            bs = block_size_of(w)
            if states is None:
                trusted = True  # no states provider: the index is trusted for every worker
            else:
                status = states.worker_status(w)
                trusted = status is not None and status.state == "synced" and (trust_partial or not status.partial)
            if bs is not None and trusted:
                overlap = claimed
                gpu = gpu_runs.get(w, 0)
                if full_credit or gpu >= claimed:
                    credited: float = claimed
                else:
                    credited = model.credited_blocks(
                        claimed,
                        gpu,
                        scores.tier(CPU).get(w, 0),
                        scores.tier(DISK).get(w, 0),
                        scores.tier(EXTERNAL).get(w, 0),
                    )
                # The overlap is in the block size it was measured in (a worker may store
                # under several); never let a claim exceed the prompt.
                prefill = max(0.0, ntok - credited * bs) / unit
            else:
                overlap = 0
                prefill = idle_prefill
            routed = credits.get(w, 0) if credits else 0
            if routed:
                prefill = min(prefill, (ntok - routed) / unit)
            seen.add(w)
            out.append(
                CandidateScore(
                    worker=w,
                    source="index",
                    claimed_blocks=claimed,
                    overlap_blocks=overlap,
                    block_size=bs,
                    prefill_blocks=prefill,
                    load_blocks=w_load,
                    cost=weight * prefill + w_load if stock else cost_of(prefill, w_load),
                    overlap_tokens=min(ntok, overlap * bs) if bs is not None else 0,
                    routed_tokens=routed,
                )
            )

    def _routed_only(
        self,
        out: list[CandidateScore],
        credits: dict[WorkerKey, int],
        universe: set[WorkerKey],
        seen: set[WorkerKey],
        ntok: int,
        loads: Mapping[WorkerKey, float],
        scale: float,
    ) -> None:
        """Append the workers only the routing hint credits (no index claim), in the hint's order."""
        unit = self.block_size
        model = self.cost_model
        stock = type(model) is CostModel
        weight = model.overlap_weight
        load_get = loads.get
        for w, routed in credits.items():
            if w in seen or w not in universe or w in self._approx:
                continue
            w_load = load_get(w, 0) * scale
            prefill = (ntok - routed) / unit
            seen.add(w)
            out.append(
                CandidateScore(
                    worker=w,
                    source="index",
                    claimed_blocks=0,
                    overlap_blocks=0,
                    block_size=None,
                    prefill_blocks=prefill,
                    load_blocks=w_load,
                    cost=weight * prefill + w_load if stock else model.cost(prefill, w_load),
                    routed_tokens=routed,
                )
            )

    def _pick(
        self, entries: list[CandidateScore], idle_count: int, idle_cost: float, temperature: float
    ) -> CandidateScore | None:
        """The winning entry, or None when the idle group wins (the caller draws one idle worker)."""
        at = self._pick_at([e.cost for e in entries], idle_count, idle_cost, temperature)
        return None if at is None else entries[at]

    def _pick_at(self, costs: list[float], idle_count: int, idle_cost: float, temperature: float) -> int | None:
        """The winning entry's position among ``costs``, or None when the idle group wins."""
        best = min(costs, default=math.inf)
        if idle_count:
            best = min(best, idle_cost)
        rng = self._rng
        if temperature > 0.0:
            weights = [math.exp((best - c) / temperature) for c in costs]
            total = math.fsum(weights)
            idle_weight = idle_count * math.exp((best - idle_cost) / temperature) if idle_count else 0.0
            r = rng.random() * (total + idle_weight)
            for i, wgt in enumerate(weights):
                r -= wgt
                if r < 0.0:
                    return i
            if idle_count:
                return None
            return len(costs) - 1  # rounding left r a hair above zero: the last entry's share
        margin = _TIE_EPS * max(1.0, abs(best))
        tied = [i for i, c in enumerate(costs) if c - best <= margin]
        idle_tied = idle_count if idle_count and idle_cost - best <= margin else 0
        r = rng.randrange(len(tied) + idle_tied)
        return tied[r] if r < len(tied) else None
