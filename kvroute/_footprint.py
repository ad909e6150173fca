"""The Router's footprint: where it recently placed new sessions, so the next one goes where fewest went.

A cost model prices one request: a new session (a prompt no worker holds much of) costs the same on
every idle worker, so the cheapest is any of them, drawn at random, and over a run some ranks start
several times the new sessions of others. Each new session then grows turn by turn in the cache it
started in; the ranks that took many evict the earlier sessions' histories before their next turn
(README, "Routing quality": the cause of kvroute's shortfall against session affinity on the
conversation shape). The footprint is a count per worker of the new placements the router made
there, each decaying by half every ``CostModel.footprint_half_life`` new placements (decay by
placements, not by time: the count compares workers, and a clock-free count means the same at any
request rate). `CostModel.footprint_band` bounds what it may override, and it never trades load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from itertools import islice

from ._models import WorkerKey

# Raw counts grow by the decay's inverse on every placement; past this they are rescaled (a float
# holds up to ~1e308, and the ratio between workers is all that is compared).
_RESCALE_AT = 1e100


class Footprint:
    """Decayed new-placement counts per worker (module docstring).

    Counts are kept unscaled: a placement adds ``self._unit``, which grows by ``2 ** (1 / half_life)``
    per placement, so every older count decays relative to it without touching the others.
    `count` divides that out.
    """

    __slots__ = ("_raw", "_unit")

    def __init__(self) -> None:
        self._raw: dict[WorkerKey, float] = {}
        self._unit = 1.0

    def count(self, worker: WorkerKey) -> float:
        """``worker``'s decayed count of new placements (1.0 for one made just now)."""
        return self._raw.get(worker, 0.0) / self._unit

    def add(self, worker: WorkerKey, half_life: float) -> None:
        """Count one new placement on ``worker``; every count decays by ``2 ** (-1 / half_life)``."""
        self._unit *= 2.0 ** (1.0 / half_life)
        self._raw[worker] = self._raw.get(worker, 0.0) + self._unit
        if self._unit > _RESCALE_AT:
            unit = self._unit
            self._raw = {w: v / unit for w, v in self._raw.items() if v / unit > 1e-12}
            self._unit = 1.0

    def discard(self, worker: WorkerKey) -> None:
        """Forget ``worker``'s count (it left the fleet)."""
        self._raw.pop(worker, None)

    def pick(
        self,
        costs: Sequence[float],
        loads: Sequence[float],
        workers: Sequence[WorkerKey],
        idle_cost: float,
        idle: Callable[[], set[WorkerKey]] | None,
        limit: Callable[[float], float],
        rng: random.Random,
    ) -> tuple[int | None, WorkerKey] | None:
        """The new placement's worker: fewest recent new placements among the candidates whose cost is
        within ``limit(cheapest)`` and whose load is no more than the cheapest's; ties go to the
        cheaper, then at random.

        The band trades what the cost adds beside load (prefill still to do: a short cached prefix;
        what the prefill evicts, `CostModel.eviction`), never load: a new session never goes to a
        busier worker than cost alone would send it to, so load balance is what it was.
        ``costs`` / ``loads`` / ``workers``: the priced candidates (load in cost blocks); ``idle``:
        the idle workers, all at ``idle_cost`` and no load (None: there are none), called only when
        eligible. Returns the winner's position in ``costs`` (None: an idle worker) and the worker;
        None when no worker is left (the idle group was the cheapest and ``idle`` found none:
        another thread changed the fleet meanwhile).
        """
        cheapest = min(costs, default=math.inf)
        if idle is not None:
            cheapest = min(cheapest, idle_cost)
        # Costs from different paths can differ in the last bits (kvroute._scoring's _TIE_EPS).
        tie = cheapest * (1.0 + 1e-9)
        # The cheapest's load (of several at that cost, the largest: each was eligible without the footprint).
        load_cap = max((x for c, x in zip(costs, loads) if c <= tie), default=0.0)
        bound = limit(cheapest) * (1.0 + 1e-9)
        raw = self._raw
        best: tuple[float, float] | None = None
        at: dict[WorkerKey, int] = {}  # the tied listed candidates' positions
        tied: list[WorkerKey] = []
        for i, (c, x, w) in enumerate(zip(costs, loads, workers)):
            if c <= bound and x <= load_cap:
                key = (raw.get(w, 0.0), c)
                if best is None or key < best:
                    best, tied, at = key, [w], {w: i}
                elif key == best:
                    tied.append(w)
                    at[w] = i
        group: set[WorkerKey] = set()
        if idle is not None and idle_cost <= bound:
            pool = idle()
            # Set operations, not a loop per worker: a fleet of 1,024 idle workers is the common case.
            group = pool.difference(raw)
            low = 0.0
            if not group and pool:
                low = min(raw[w] for w in pool)
                group = {w for w in pool if raw[w] == low}
            if group:
                key = (low, idle_cost)
                if best is None or key < best:
                    best, tied, at = key, [], {}
                elif key != best:
                    group = set()
        if not tied and not group:
            return None
        # The listed ties sorted (both scoring paths list candidates in their own order), then the idle
        # ones drawn as `Router` draws an idle worker: by position in the set both paths build alike.
        tied.sort()
        r = rng.randrange(len(tied) + len(group))
        if r < len(tied):
            return at[tied[r]], tied[r]
        return None, next(islice(iter(group), r - len(tied), None))
