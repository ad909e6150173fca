"""Engine-reported load: what a gateway stream's ``EngineLoad`` records say, and how the Router prices it.

A gateway servicer puts its engine's load on every ``KvEventBatch`` (and on ``load_only``
heartbeats while the engine is idle, docs/protocol.md §6). `EngineLoads` keeps the newest record per
worker; `EngineLoads.blend` turns the records and the router's own in-flight tokens into the
load `Router.select` prices, and names the workers to veto.

Blend (the default): a worker's load is the larger of the router's own in-flight tokens on it
and the engine's queued prefill work (``waiting_uncached_tokens`` plus
``prefill_pending_tokens``, the figures the servicer reports). The engine's figure includes
what every router replica sent, so replicas that share nothing still see the same queue; the
router's own figure covers requests the engine has not reported yet. Taking the larger counts
neither twice. A record older than ``stale_after`` is not used (the router's own count is).

Veto (a wedged engine): a worker is vetoed when its engine reports silence
(``engine_silence_ms``) past ``wedge_after`` plus the time its pending prefill may take at
``prefill_tokens_per_s``, or when its records stopped for longer than ``stale_after`` while the
router has requests in flight on it. The Router vetoes only while another candidate is left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

import msgspec

from ._models import WorkerKey

__all__ = ["EngineLoad", "EngineLoads", "LoadPolicy"]


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One engine load record, as a gateway stream reported it (``smg.grpc.common.EngineLoad``).

    Optional figures are None when the servicer did not report them (absent is not zero).
    ``received`` is the local monotonic time the record arrived.
    """

    running_requests: int = 0
    waiting_requests: int = 0
    waiting_uncached_tokens: int | None = None
    token_usage: float = 0.0
    active_token_usage: float | None = None
    gen_throughput: float = 0.0
    max_running_requests: int = 0
    age_ms: int = 0
    sample: int = 0
    engine_silence_ms: int | None = None
    engine_reports_steps: bool | None = None
    prefill_pending_tokens: int | None = None
    received: float = 0.0

    @property
    def queued_tokens(self) -> int:
        """Prefill work the engine holds and has not done: waiting uncached plus pending prompt tokens."""
        return (self.waiting_uncached_tokens or 0) + (self.prefill_pending_tokens or 0)


class LoadPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How engine load is priced. ``mode``: "blend" (default), "engine" (engine figures only,
    the router's own count where no fresh record exists) or "router" (ignore the engine's).
    Times in seconds; ``prefill_tokens_per_s`` is the rate the veto allows pending prefill."""

    mode: str = "blend"
    stale_after: float = 15.0
    wedge_after: float = 30.0
    prefill_tokens_per_s: float = 10_000.0

    def __post_init__(self) -> None:
        if self.mode not in ("blend", "engine", "router"):
            raise ValueError(f"mode must be 'blend', 'engine' or 'router', not {self.mode!r}")
        for name in ("stale_after", "wedge_after", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise ValueError(f"{name} must be > 0 and finite, not {value!r}")


class EngineLoads:
    """The newest engine load record per worker, and the pricing `Router.select` asks for.

    Fed by the gateway transport; ``clock`` is the monotonic clock records are stamped with.
    """

    def __init__(self, policy: LoadPolicy | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy if policy is not None else LoadPolicy()
        self.clock = clock
        self._records: dict[WorkerKey, EngineLoad] = {}
        # Per worker, what `blend` reads: (received, queued tokens, silence ms (-1: none), the
        # silence allowed in ms before a veto).
        self._figures: dict[WorkerKey, tuple[float, int, float, float]] = {}
        self._version = 0
        self._zeros = False
        self._cache: tuple[tuple[int, int], float, dict[WorkerKey, float], set[WorkerKey], set[WorkerKey]] | None = None
        #: Veto decisions taken (a worker vetoed in one `blend` call counts once).
        self.vetoes = 0

    @property
    def reporting(self) -> bool:
        """Whether any worker has reported load."""
        return bool(self._records)

    def update(self, worker: WorkerKey, record: EngineLoad) -> None:
        """Keep ``record`` as ``worker``'s load unless an already-kept one has a newer ``sample``."""
        old = self._records.get(worker)
        if old is not None and record.sample and old.sample > record.sample:
            return
        self._records[worker] = record
        p = self.policy
        allowance = (p.wedge_after + (record.prefill_pending_tokens or 0) / p.prefill_tokens_per_s) * 1000.0
        silence = -1.0 if record.engine_silence_ms is None else float(record.engine_silence_ms)
        self._figures[worker] = (record.received, record.queued_tokens, silence, allowance)
        self._version += 1

    def remove(self, worker: WorkerKey) -> None:
        """Forget ``worker``'s records (its source was removed)."""
        self._records.pop(worker, None)
        self._figures.pop(worker, None)
        self._version += 1

    def get(self, worker: WorkerKey) -> EngineLoad | None:
        """The newest record of ``worker``, fresh or not."""
        return self._records.get(worker)

    def records(self) -> dict[WorkerKey, EngineLoad]:
        """Every worker's newest record."""
        return dict(self._records)

    def fresh(self, worker: WorkerKey, now: float | None = None) -> EngineLoad | None:
        """``worker``'s record if it is younger than ``stale_after``."""
        rec = self._records.get(worker)
        if rec is None:
            return None
        now = self.clock() if now is None else now
        return rec if now - rec.received <= self.policy.stale_after else None

    def wedged(self, worker: WorkerKey, own_tokens: int, now: float) -> bool:
        """Whether ``worker`` should be vetoed (see the module docstring)."""
        rec = self._records.get(worker)
        if rec is None:
            return False
        p = self.policy
        if now - rec.received > p.stale_after:
            return own_tokens > 0
        if rec.engine_silence_ms is None:
            return False
        allowance = p.wedge_after + (rec.prefill_pending_tokens or 0) / p.prefill_tokens_per_s
        return rec.engine_silence_ms / 1000.0 > allowance

    def _engine_part(self, unit: int, now: float) -> tuple[dict[WorkerKey, float], set[WorkerKey], set[WorkerKey]]:
        """(engine queue per fresh worker in blocks, wedged fresh workers, stale workers), cached
        until a record changes or the next fresh record turns stale."""
        cached = self._cache
        if cached is not None and cached[0] == (self._version, unit) and now < cached[1]:
            return cached[2], cached[3], cached[4]
        stale_after = self.policy.stale_after
        engine: dict[WorkerKey, float] = {}
        wedged: set[WorkerKey] = set()
        stale: set[WorkerKey] = set()
        until = math.inf
        zeros = False
        for w, (received, queued, silence, allowance) in self._figures.items():
            expires = received + stale_after
            if expires < now:
                stale.add(w)
                continue
            until = min(until, expires)
            engine[w] = queued / unit
            zeros = zeros or not queued
            if silence > allowance:
                wedged.add(w)
        self._cache = ((self._version, unit), until, engine, wedged, stale)
        self._zeros = zeros  # some fresh worker reports an empty queue: blend filters zeros out
        return engine, wedged, stale

    def blend(self, own_tokens: Mapping[WorkerKey, int], unit: int) -> tuple[dict[WorkerKey, float], set[WorkerKey]]:
        """Load per worker in blocks of ``unit`` tokens, and the workers to veto.

        ``own_tokens``: the router's in-flight tokens per worker. Runs on every `Router.select`:
        the engine side is cached between record updates, so a call costs a copy of it and a
        pass over the router's own (few) busy workers.
        """
        mode = self.policy.mode
        if mode == "router":
            return {w: t / unit for w, t in own_tokens.items() if t}, set()
        engine, wedged, stale = self._engine_part(unit, self.clock())
        loads = {w: v for w, v in engine.items() if v} if self._zeros else dict(engine)
        vetoed = set(wedged)
        for w, t in own_tokens.items():
            if not t:
                continue
            mine = t / unit
            if w in engine:  # a fresh record: its queue, or the router's count if larger (blend)
                if mode == "blend" and mine > engine[w]:
                    loads[w] = mine
            else:
                loads[w] = mine
                if w in stale:
                    vetoed.add(w)  # records stopped while it holds routed work
        self.vetoes += len(vetoed)
        return loads, vetoed
