"""The replay slots a client's sources share (`ReplaySlots`), and one replay request's bookkeeping across its turns.

A source asks its engine's replay endpoint for what it missed (docs/protocol.md §4); the
request is carried out by the source's driver (`kvroute._transports.zmq.driver.SourceDriver`), in turns,
each holding one of these slots.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from ..._wire import EventBatch

__all__ = ["ReplayRun", "ReplaySlots", "Turn"]

# A replay turn receiving decodable batches at least this fast (per second) is productive: it
# keeps its slot for _PRODUCTIVE_SLICES slices, not one, before giving way to a waiter.
_PRODUCTIVE_RATE = 200.0
_PRODUCTIVE_SLICES = 10


class Turn:
    """One replay turn holding a slot: since when, how productive, and the scope of its current wait."""

    __slots__ = ("batches", "began", "nudged", "scope")

    def __init__(self) -> None:
        self.began = 0.0
        self.batches = 0
        self.nudged = False
        self.scope: anyio.CancelScope | None = None

    def limit(self, now: float, slice_seconds: float) -> float:
        """How long this turn may hold its slot while another source waits."""
        held = now - self.began
        productive = held > 0 and self.batches >= _PRODUCTIVE_RATE * held
        return slice_seconds * (_PRODUCTIVE_SLICES if productive else 1)


class ReplaySlots:
    """The replay slots every source of a client shares: first come, first served, and no slot kept.

    `turn` waits for a slot in arrival order. A turn that has held its slot for ``slice``
    seconds gives way as soon as another source waits (`contended`): the waiter wakes the
    oldest such holder at once, which ends its turn. A productive turn (decodable batches
    streaming in, as from an honest engine's buffer) keeps its slot for 10 slices instead, so
    slow or hostile endpoints yield first. So a few slow or hostile replay endpoints delay an
    honest source's replay by at most about one slice.
    """

    def __init__(self, capacity: int, slice_seconds: float) -> None:
        self._limiter = anyio.CapacityLimiter(capacity)
        self.slice = slice_seconds
        self._holders: dict[Turn, None] = {}  # oldest first

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Turn]:
        """Hold one slot for the body of the ``async with``."""
        turn = Turn()
        if self._limiter.available_tokens < 1:
            self._nudge()
        await self._limiter.acquire_on_behalf_of(turn)
        turn.began = anyio.current_time()
        self._holders[turn] = None
        try:
            yield turn
        finally:
            del self._holders[turn]
            self._limiter.release_on_behalf_of(turn)

    @property
    def contended(self) -> bool:
        """Some source waits for a slot."""
        return self._limiter.statistics().tasks_waiting > 0

    def _nudge(self) -> None:
        now = anyio.current_time()
        for turn in self._holders:
            if not turn.nudged and now - turn.began >= turn.limit(now, self.slice) and turn.scope is not None:
                turn.nudged = True
                turn.scope.cancel()
                return


class ReplayRun:
    """One replay request across its turns: what came back and what it may still spend."""

    __slots__ = ("budget", "complete", "cut", "deadline", "item_bytes", "items", "replies", "silent_left")

    def __init__(self, deadline: float, budget: int, silent_left: float) -> None:
        self.deadline = deadline
        self.budget = budget
        #: Slot time left without a decodable reply before the request is given up.
        self.silent_left = silent_left
        self.replies = 0
        #: Payload bytes received: the items are bounded like held batches (``held_bytes``).
        self.item_bytes = 0
        self.items: list[tuple[int, float, EventBatch | None]] = []
        self.complete = False
        #: Why the request ended before its end marker (a deadline or budget), if it did.
        self.cut: str | None = None

