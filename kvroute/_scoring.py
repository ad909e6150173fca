"""The Router's Python scoring: the reference the compiled select (src/py/router.rs) must equal.

`CostModel` subclasses and fleets with approximate workers take this path (`Router.select`
dispatches); the built-in model without approximate workers takes the compiled one, whose
decisions tests/test_router_scoring.py holds equal to these. `_pick_at` draws for both paths.
Also here: what an approximate worker is assumed to hold (`_Approx`) and one prompt's content
keys per block size (`_Query`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from itertools import islice
from typing import Any, Protocol

import msgspec

from ._cost import CandidateScore, CostModel, RoutingDecision
from ._errors import NoWorkersError, RouterError
from ._footprint import Footprint
from ._hashing import MultimodalItem, chain_keys
from ._index import OverlapScores, PrefixIndex
from ._load import EngineLoads
from ._models import CPU, DISK, EXTERNAL, GPU, WorkerKey, WorkerStates

#: A call's candidate set: a new set, or a states provider's own immutable one (`VouchingStates.live_set`).
Universe = set[WorkerKey] | frozenset[WorkerKey]

#: No worker: the unvouched set without a states provider (the index is trusted for every worker).
_NOBODY: frozenset[WorkerKey] = frozenset()

# Costs computed by different paths (index overlap, approximate store, idle) can differ in the
# last bits for equal inputs; closer than this relative margin they are a tie.
_TIE_EPS = 1e-9


def _price_moves(model: CostModel, entries: list[CandidateScore], idle_prefill: float, idle_cost: float) -> float:
    """`CostModel.long_move`: add to each entry's cost what its prefill recomputes over the least one
    (`CostModel.move`), in place; returns the idle group's cost with its own. The least prefill is
    taken over the entries and the idle group's whole prompt (never below any entry's: an entry's
    prefill is at most the prompt), so it is the same whether idle workers exist or not. The compiled
    select (src/py/router.rs) adds the same figures in the same order, after every other term."""
    best = min((e.prefill_blocks for e in entries), default=idle_prefill)
    if idle_prefill < best:
        best = idle_prefill
    move = model.move
    for i, e in enumerate(entries):
        extra = move(e.prefill_blocks - best)
        if extra:
            entries[i] = msgspec.structs.replace(e, cost=e.cost + extra)
    return idle_cost + move(idle_prefill - best)


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


class _RouterParts(Protocol):
    """What of a `Router` the reference path reads: the self type of `ReferenceScoring`'s methods."""

    index: PrefixIndex
    states: WorkerStates | None
    cost_model: CostModel
    engine_loads: EngineLoads | None
    block_size: int
    trust_partial: bool
    approximate_ttl: float
    _rng: random.Random
    _clock: Callable[[], float]
    _approx: dict[WorkerKey, _Approx]
    _registered: set[WorkerKey]
    _footprint: Footprint

    def _unvouched(self) -> AbstractSet[WorkerKey] | None: ...

    def _new_placement(self, ntok: int, best_overlap: int) -> bool: ...

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...

    def _universe(self, candidates: Iterable[WorkerKey] | None) -> Universe: ...

    def _usage(self) -> dict[WorkerKey, float] | None: ...

    def _routed_query(
        self, query: _Query, ntok: int, record: bool
    ) -> tuple[dict[WorkerKey, int] | None, list[bytes]]: ...

    def _loads(
        self, load: Mapping[WorkerKey, float] | None, universe: Universe
    ) -> tuple[Mapping[WorkerKey, float], float, Universe]: ...

    def _decide(
        self,
        started: float,
        chosen: CandidateScore,
        entries: list[CandidateScore],
        idle_count: int,
        idle_cost: float,
        ntok: int,
        request_id: Hashable | None,
        routed_keys: list[bytes],
    ) -> RoutingDecision: ...

    def _scored(
        self,
        out: list[CandidateScore],
        scores: OverlapScores,
        universe: Universe,
        seen: set[WorkerKey],
        ntok: int,
        idle_prefill: float,
        loads: Mapping[WorkerKey, float],
        scale: float,
        credits: dict[WorkerKey, int] | None,
        usage: dict[WorkerKey, float] | None,
    ) -> None: ...

    def _routed_only(
        self,
        out: list[CandidateScore],
        credits: dict[WorkerKey, int],
        universe: Universe,
        seen: set[WorkerKey],
        ntok: int,
        loads: Mapping[WorkerKey, float],
        scale: float,
        usage: dict[WorkerKey, float] | None,
    ) -> None: ...

    def _pick(
        self, entries: list[CandidateScore], idle_count: int, idle_cost: float, temperature: float
    ) -> CandidateScore | None: ...

    def _pick_at(self, costs: list[float], idle_count: int, idle_cost: float, temperature: float) -> int | None: ...


class ReferenceScoring:
    """`Router`'s Python scoring path (a mixin: its methods read the router through `_RouterParts`)."""

    def _unvouched(self: _RouterParts) -> AbstractSet[WorkerKey] | None:
        """The workers whose index claims this call does not believe (`Router`'s trust rule: a
        claim counts only from a worker whose status is "synced" and, unless ``trust_partial``,
        not partial), read once per call for both scoring paths: the provider's own set
        (`VouchingStates.unvouched_workers`, kept as its sources' states change) and the
        registered workers it does not know (no status). Empty without a provider; None when the
        provider keeps no such set: then each candidate's `worker_status` is read."""
        states = self.states
        if states is None:
            return _NOBODY
        unvouched_of = getattr(states, "unvouched_workers", None)
        if unvouched_of is None:
            return None
        unvouched: AbstractSet[WorkerKey] = unvouched_of(self.trust_partial)
        if self._registered:
            # a copy (one C call): another thread's `add_worker` may change the set meanwhile
            registered = self._registered.copy()
            live_set = getattr(states, "live_set", None)
            if live_set is not None:
                # the workers it gives a status are its live ones (`VouchingStates`): one set
                # difference, not a `worker_status` per registered worker
                unknown = registered.difference(live_set())
            else:
                unknown = {w for w in registered if states.worker_status(w) is None}
            if unknown:
                unvouched = unknown.union(unvouched)
        return unvouched

    def _usage(self: _RouterParts) -> dict[WorkerKey, float] | None:
        """Engine-reported KV usage per worker, for `CostModel.eviction` (`EngineLoads.usage`); None
        when the model prices no eviction or no engine reports. Both scoring paths price these
        figures (the compiled one gets them as ``usage``)."""
        loads = self.engine_loads
        if loads is None or not loads.reporting or not self.cost_model.eviction_weight:
            return None
        return loads.usage() or None

    def _new_placement(self: _RouterParts, ntok: int, best_overlap: int) -> bool:
        """Whether a prompt is a new placement for the footprint (`CostModel.footprint`): on, at
        temperature 0, and no candidate holds ``footprint_new_share`` of it (``best_overlap`` tokens). The
        compiled `select` decides the same in the core (src/py/router.rs)."""
        model = self.cost_model
        return model.footprint and model.temperature == 0.0 and best_overlap < model.footprint_new_share * ntok

    def _select_reference(
        self: _RouterParts,
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
        """`select` in Python: for `CostModel` subclasses, approximate workers, or another index."""
        model = self.cost_model
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
        # the pricing reads the router's bookkeeping (approximate stores, load, usage) as of one
        # moment and notes the chosen approximate store: under its lock, against other threads
        with self._lock:
            unit = self.block_size
            cost_of = model.cost
            idle_prefill = ntok / unit
            entries: list[CandidateScore] = []
            seen: set[WorkerKey] = set()  # listed by the approximate or the index pass
            loads, scale, universe = self._loads(load, universe)
            load_get = loads.get
            usage = self._usage()
            usage_get = usage.get if usage else None

            approx = self._approx
            if approx:
                now = self._clock()
                for w, store in approx.items():
                    if w not in universe:
                        continue
                    store.purge(now)
                    held = store.leading(query.keys(store.block_size)) if store.expiry else 0
                    w_load = load_get(w, 0) * scale
                    u = usage_get(w, 0.0) if usage_get else 0.0
                    if not held and not w_load and not u:
                        continue
                    bs = store.block_size
                    prefill = (ntok - held * bs) / unit
                    cost = cost_of(prefill, w_load)
                    if u > 0.0:
                        cost += model.eviction(prefill, u)
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
                            cost=cost,
                            overlap_tokens=min(ntok, held * bs),
                        )
                    )

            if scores:
                self._scored(entries, scores, universe, seen, ntok, idle_prefill, loads, scale, credits, usage)
            if credits:
                self._routed_only(entries, credits, universe, seen, ntok, loads, scale, usage)

            # Load-only workers: nothing claimed, so the prefill is the whole prompt. Approximate
            # workers with load were all listed above. The stock model's cost is inlined: this
            # loop runs for every busy worker (load is additive in it, long-prefix term or not).
            idle_cost = cost_of(idle_prefill, 0.0)
            stock = type(model) is CostModel
            for w, t in loads.items():
                if t and w in universe and w not in seen:
                    w_load = t * scale
                    cost = idle_cost + w_load if stock else cost_of(idle_prefill, w_load)
                    u = usage_get(w, 0.0) if usage_get else 0.0
                    if u > 0.0:
                        cost += model.eviction(idle_prefill, u)
                    seen.add(w)
                    entries.append(
                        CandidateScore(
                            worker=w,
                            source="index",
                            claimed_blocks=0,
                            overlap_blocks=0,
                            block_size=None,
                            prefill_blocks=idle_prefill,
                            load_blocks=w_load,
                            cost=cost,
                        )
                    )
            # Usage-only workers: a report above 0, nothing claimed, no load (as src/py/router.rs lists them).
            if usage:
                for w, u in usage.items():
                    if w in universe and w not in seen:
                        seen.add(w)
                        entries.append(
                            CandidateScore(
                                worker=w,
                                source="index",  # an approximate worker with usage was listed above
                                claimed_blocks=0,
                                overlap_blocks=0,
                                block_size=None,
                                prefill_blocks=idle_prefill,
                                load_blocks=0.0,
                                cost=idle_cost + model.eviction(idle_prefill, u),
                            )
                        )

            if model.long_move:
                idle_cost = _price_moves(model, entries, idle_prefill, idle_cost)

            idle_count = len(universe) - len(entries)
            best_overlap = max((max(e.overlap_tokens, e.routed_tokens) for e in entries), default=0)
            new = self._new_placement(ntok, best_overlap)
            if new:
                listed = [e.worker for e in entries]
                got = self._footprint.pick(
                    [e.cost for e in entries],
                    [e.load_blocks for e in entries],
                    listed,
                    idle_cost,
                    (lambda: universe.difference(listed)) if idle_count else None,
                    model.footprint_limit,
                    self._rng,
                )
                assert got is not None  # the universe is this call's own: idle_count > 0 means idle workers exist
                at, chosen_w = got
                pick = None if at is None else entries[at]
            else:
                pick = self._pick(entries, idle_count, idle_cost, model.temperature)
            if pick is None:
                if not new:
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
            if new and request_id is not None:
                self._footprint.add(worker, model.footprint_half_life)
            return self._decide(started, chosen, entries, idle_count, idle_cost, ntok, request_id, routed_keys)

    def _scored(
        self: _RouterParts,
        out: list[CandidateScore],
        scores: OverlapScores,
        universe: Universe,
        seen: set[WorkerKey],
        ntok: int,
        idle_prefill: float,
        loads: Mapping[WorkerKey, float],
        scale: float,
        credits: dict[WorkerKey, int] | None,
        usage: dict[WorkerKey, float] | None,
    ) -> None:
        """Append the figures of the workers the index claims overlap for (approximate ones excluded);
        ``credits``: the routing hint's tokens per worker, credited where they exceed the index's;
        ``usage``: engine-reported KV usage per worker (`CostModel.eviction`)."""
        unit = self.block_size
        model = self.cost_model
        cost_of = model.cost
        # the stock cost inlined, unless the long-prefix term makes it other than linear
        stock = type(model) is CostModel and not model.long_prefix
        weight = model.overlap_weight
        full_credit = model.full_credit
        gpu_runs = scores.tier(GPU)
        approx = self._approx
        block_size_of = scores.block_size
        load_get = loads.get
        states = self.states
        trust_partial = self.trust_partial
        unvouched = self._unvouched()
        for w, claimed in scores.items():
            # `seen` holds only approximate workers so far: `w in approx` covers it.
            if w in approx or w not in universe:
                continue
            w_load = load_get(w, 0) * scale
            bs = block_size_of(w)
            if unvouched is not None:
                trusted = not unvouched or w not in unvouched
            else:
                assert states is not None  # `_unvouched` answers a set without a provider
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
            cost = weight * prefill + w_load if stock else cost_of(prefill, w_load)
            u = usage.get(w, 0.0) if usage else 0.0
            if u > 0.0:
                cost += model.eviction(prefill, u)
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
                    cost=cost,
                    overlap_tokens=min(ntok, overlap * bs) if bs is not None else 0,
                    routed_tokens=routed,
                )
            )

    def _routed_only(
        self: _RouterParts,
        out: list[CandidateScore],
        credits: dict[WorkerKey, int],
        universe: Universe,
        seen: set[WorkerKey],
        ntok: int,
        loads: Mapping[WorkerKey, float],
        scale: float,
        usage: dict[WorkerKey, float] | None,
    ) -> None:
        """Append the workers only the routing hint credits (no index claim), in the hint's order."""
        unit = self.block_size
        model = self.cost_model
        # the stock cost inlined, unless the long-prefix term makes it other than linear
        stock = type(model) is CostModel and not model.long_prefix
        weight = model.overlap_weight
        load_get = loads.get
        for w, routed in credits.items():
            if w in seen or w not in universe or w in self._approx:
                continue
            w_load = load_get(w, 0) * scale
            prefill = (ntok - routed) / unit
            cost = weight * prefill + w_load if stock else model.cost(prefill, w_load)
            u = usage.get(w, 0.0) if usage else 0.0
            if u > 0.0:
                cost += model.eviction(prefill, u)
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
                    cost=cost,
                    routed_tokens=routed,
                )
            )

    def _pick(
        self: _RouterParts, entries: list[CandidateScore], idle_count: int, idle_cost: float, temperature: float
    ) -> CandidateScore | None:
        """The winning entry, or None when the idle group wins (the caller draws one idle worker)."""
        at = self._pick_at([e.cost for e in entries], idle_count, idle_cost, temperature)
        return None if at is None else entries[at]

    def _pick_at(
        self: _RouterParts, costs: list[float], idle_count: int, idle_cost: float, temperature: float
    ) -> int | None:
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
