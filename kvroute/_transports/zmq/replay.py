"""Replay requests: the slots a client's sources share (`ReplaySlots`) and one source's requests (`ReplayRequester`).

A source asks its engine's replay endpoint for what it missed (docs/protocol.md §4): its driver
(`kvroute._transports.zmq.driver.SourceDriver`) hands each request its machine makes to its
`ReplayRequester`, which opens a DEALER for it and carries it out in turns, each holding one of
the client's `ReplaySlots`, bounded in time, replies and bytes (`ReplayRun`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import zmq

from ..._models import EventSource
from ..._recovery import REPLAY_END_MARKER, Payload
from .._base import RateLimitedLog, SourceCounters
from . import sockets as _zmq
from .config import SubscriberConfig

__all__ = ["ReplayRequester", "ReplayRun", "ReplaySlots", "Turn"]

# A replay turn receiving decodable batches at least this fast (per second) is productive: it
# keeps its slot for _PRODUCTIVE_SLICES slices, not one, before giving way to a waiter.
_PRODUCTIVE_RATE = 200.0
_PRODUCTIVE_SLICES = 10


class Turn:
    """One replay turn holding a slot: since when, how productive, and the scope of its current wait."""

    __slots__ = ("batches", "began", "nudged", "progress", "scope")

    def __init__(self) -> None:
        self.began = 0.0
        self.batches = 0
        self.nudged = False
        self.scope: anyio.CancelScope | None = None
        #: The decodable replies so far of a turn carried out elsewhere (the native thread), read
        #: instead of ``batches``.
        self.progress: Callable[[], int] | None = None

    def limit(self, now: float, slice_seconds: float) -> float:
        """How long this turn may hold its slot while another source waits."""
        held = now - self.began
        batches = self.batches if self.progress is None else self.progress()
        productive = held > 0 and batches >= _PRODUCTIVE_RATE * held
        return slice_seconds * (_PRODUCTIVE_SLICES if productive else 1)


class ReplaySlots:
    """The replay slots every source of a client shares: first come, first served, and no slot kept.

    `turn` waits for a slot in arrival order; `queue` waits in the same line without a task (a
    source whose request waits only needs its task once a slot is its own: a 4,096-rank cold
    sync queued 4,064 tasks behind 32 slots, each a chain of coroutines, scopes and events the
    garbage collector walked over and over). A turn that has held its slot for ``slice``
    seconds gives way as soon as another source waits (`contended`): the waiter wakes the
    oldest such holder at once, which ends its turn. A productive turn (decodable batches
    streaming in, as from an honest engine's buffer) keeps its slot for 10 slices instead, so
    slow or hostile endpoints yield first. So a few slow or hostile replay endpoints delay an
    honest source's replay by at most about one slice.

    A quiet probe takes a slot only when one is `free`, and takes it at once (`reserve`), so
    it never queues behind busy slots (docs/recovery.md rule 9); a deferred one is offered the
    next slot that comes free with no source waiting for it (`defer`).
    """

    def __init__(self, capacity: int, slice_seconds: float) -> None:
        self._capacity = capacity
        # Slots taken: by turns, and reserved for turns about to begin.
        self._taken = 0
        self.slice = slice_seconds
        self._holders: dict[Turn, None] = {}  # oldest first
        # Who waits for a slot, oldest first: each is called once with the slot it got (a
        # reserved `Turn`), and from then holds it.
        self._waiting: dict[Callable[[Turn], None], None] = {}
        # Deferred quiet probes, oldest first: each is called once, when a slot is free.
        self._deferred: dict[Callable[[], None], None] = {}

    def free(self) -> bool:
        """A slot can be had now without waiting: one is idle and no source waits for one."""
        return self._taken < self._capacity and not self._waiting

    def reserve(self) -> Turn:
        """Take an idle slot now (`free` must be true) for a later `turn` to begin with (or `unreserve`)."""
        if not self.free():
            raise anyio.WouldBlock
        self._taken += 1
        return Turn()

    def unreserve(self, turn: Turn) -> None:
        """Give back a slot `reserve` took for a turn that never began."""
        self._release()

    def queue(self, grant: Callable[[Turn], None]) -> None:
        """Call ``grant`` with a reserved slot once one is its own, in arrival order; until then it holds nothing.

        ``grant`` then holds the slot: it begins a `turn` with it, or gives it back (`unreserve`).
        """
        if self.free():
            grant(self.reserve())
            return
        if self._taken >= self._capacity:
            self._nudge()
        self._waiting[grant] = None

    def withdraw(self, grant: Callable[[Turn], None]) -> None:
        """Drop ``grant`` if it still waits in `queue`."""
        self._waiting.pop(grant, None)

    def defer(self, retry: Callable[[], None]) -> None:
        """Call ``retry`` once, when a slot is next `free` (a deferred quiet probe); until then it holds nothing.

        Sources that synced together tick together: without this, the first few of a burst of
        quiet ticks would take the slots and the rest wait a whole quiet interval.
        """
        self._deferred[retry] = None

    def forget(self, retry: Callable[[], None]) -> None:
        """Drop ``retry`` if `defer` still holds it."""
        self._deferred.pop(retry, None)

    def _release(self) -> None:
        """A slot came back: the oldest waiter gets it, else the deferred probes are offered what is free."""
        self._taken -= 1
        while self._waiting and self._taken < self._capacity:
            grant = next(iter(self._waiting))
            del self._waiting[grant]
            self._taken += 1
            grant(Turn())
        self._offer()

    def _offer(self) -> None:
        """Hand free slots to the deferred probes, oldest first (a waiting source already got its slot)."""
        while self._deferred and self.free():
            retry = next(iter(self._deferred))
            del self._deferred[retry]
            retry()

    @asynccontextmanager
    async def turn(self, reserved: Turn | None = None) -> AsyncIterator[Turn]:
        """Hold one slot for the body of the ``async with``: ``reserved`` (from `reserve`), else one waited for."""
        if reserved is not None:
            turn = reserved
        else:
            turn = await self._acquire()
        turn.began = anyio.current_time()
        self._holders[turn] = None
        try:
            yield turn
        finally:
            del self._holders[turn]
            self._release()

    async def _acquire(self) -> Turn:
        """A slot of this task's own, waited for in line (a checkpoint either way, as anyio's limiters are)."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self.free():
            turn = self.reserve()
            try:
                await anyio.lowlevel.cancel_shielded_checkpoint()
            except BaseException:
                self._release()
                raise
            return turn
        got: list[Turn] = []
        event = anyio.Event()

        def grant(turn: Turn) -> None:
            got.append(turn)
            event.set()

        self.queue(grant)
        try:
            await event.wait()
        except BaseException:
            if got:
                self._release()  # given a slot as it was cancelled: the next in line gets it
            else:
                self.withdraw(grant)
            raise
        return got[0]

    @property
    def contended(self) -> bool:
        """Some source waits for a slot."""
        return bool(self._waiting)

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
        self.items: list[tuple[int, float, Payload | None]] = []
        self.complete = False
        #: Why the request ended before its end marker (a deadline or budget), if it did.
        self.cut: str | None = None


# What one replay reply was (`ReplayRequester._on_reply`).
_END, _BATCH, _JUNK = object(), object(), object()


class ReplayRequester:
    """One source's replay requests: a DEALER to its replay endpoint, carried out in turns of the shared slots.

    The source's driver (`kvroute._transports.zmq.driver.SourceDriver`) asks `fetch` for what
    its machine requested and hands the answer back to the machine; ``judge`` is the driver's
    (a reply's payload as the machine takes it: ``(ts, batch or payload)``, None when it must not
    be applied, counted and logged), ``max_held`` its machine's bound on held batches.
    """

    def __init__(
        self,
        source: EventSource,
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        config: SubscriberConfig,
        slots: ReplaySlots,
        curve: _zmq.CurveKeys | None,
        counters: SourceCounters,
        log: RateLimitedLog,
        judge: Callable[[bytes], tuple[float, Payload | None]],
        max_held: int,
    ) -> None:
        self._source = source
        self._ctx = context
        self._cfg = config
        self._slots = slots
        self._curve = curve
        self._counters = counters
        self._log = log
        self._judge = judge
        self._max_held = max_held
        self._dealer: zmq.Socket[bytes] | None = None
        # A slot taken for the next request (`reserve`), and the turn holding one now.
        self._reserved: Turn | None = None
        self._turn: Turn | None = None
        # The driver's deferred-probe callback while the slots hold it (`defer`).
        self._retry: Callable[[], None] | None = None
        # Its place in the slots' line while the next request waits there without a task (`queue`).
        self._queued: Callable[[Turn], None] | None = None

    @property
    def dealer(self) -> zmq.Socket[bytes] | None:
        """The DEALER, open only while a request runs."""
        return self._dealer

    @property
    def holding(self) -> bool:
        """This source holds a replay slot now: reserved for its next request, or in a turn."""
        return self._reserved is not None or self._turn is not None

    def slot_free(self) -> bool:
        """A request made now would get a slot at once (`ReplaySlots.free`)."""
        return self._slots.free()

    def reserve(self) -> None:
        """Take an idle slot now for the next request (`slot_free` must be true).

        For a quiet probe, which runs at once or not at all: the driver reserves before it
        asks the machine for the probe, so no other source's request can take the slot in
        between and queue the probe behind it (docs/recovery.md rule 9).
        """
        if self._reserved is None:
            self._reserved = self._slots.reserve()

    def defer(self, retry: Callable[[], None]) -> None:
        """Have ``retry`` called once when a slot is next free (`ReplaySlots.defer`), until `close`."""
        self._retry = retry
        self._slots.defer(retry)

    @property
    def queued(self) -> bool:
        """The next request waits in the slots' line (`queue`), no task holding it."""
        return self._queued is not None

    def queue(self, start: Callable[[], None]) -> None:
        """Wait in the slots' line for the next request without a task; ``start`` once a slot is reserved for it.

        ``start`` begins the request's task, whose first turn takes the slot (`turn`, `fetch`);
        `close` leaves the line, or gives the slot back if the task never took it.
        """
        if self._reserved is not None:
            start()
            return

        def grant(turn: Turn) -> None:
            self._queued = None
            self._reserved = turn
            start()

        self._queued = grant
        self._slots.queue(grant)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Turn]:
        """Hold a replay slot for a turn of a request carried out elsewhere (the native thread,
        `SourceDriver._native_fetch`): the slot reserved for it, else one waited for."""
        reserved, self._reserved = self._reserved, None
        async with self._slots.turn(reserved) as turn:
            self._turn = turn
            try:
                yield turn
            finally:
                self._turn = None

    async def hold(self, turn: Turn, done: anyio.Event) -> None:
        """Wait in ``turn`` (from `turn`) for ``done``, or until the turn should give its slot up.

        For a request carried out elsewhere, as `_take_turn` does for its own: within its slice
        the turn wakes at the slice's end to look for waiters; past it, a waiter's nudge
        (`ReplaySlots`) cancels it. A waiter that came while every holder was still within its
        slice nudged nobody, and without this wake it waited out a holder's whole
        ``replay_timeout`` (CI: an honest cold start took 0.5 s beside eight junk replayers whose
        turns had all just begun, 30 ms alone).
        """
        slots = self._slots
        while not done.is_set():
            now = anyio.current_time()
            ends = turn.began + turn.limit(now, slots.slice)
            if now < ends:
                with anyio.move_on_after(ends - now):
                    await done.wait()
            elif slots.contended:
                return  # had its slice and another source waits: give way
            else:
                await done.wait()  # past the slice: a waiter's nudge cancels the caller's scope

    async def fetch(self, start: int) -> tuple[list[tuple[int, float, Payload | None]], bool, str | None]:
        """Ask for every buffered batch from ``start``; returns (items, end marker seen, failure).

        Fair and bounded (README "Security and limits"): the request is carried out in turns,
        each holding one of the client's replay slots. A turn ends at the end marker; when
        other sources wait for a slot and it has held its own for ``replay_slice`` (with
        replies so far, the machine gets them and asks for the rest; with none, the request
        goes to the back of the queue and is sent again); or when the request as a whole
        passes ``replay_deadline`` (counted from its first turn), ``replay_budget`` replies (malformed ones count), or
        ``replay_timeout`` of slot time without a decodable reply (junk does not keep it open).
        """
        cfg = self._cfg
        # The deadline runs from the first turn: a request queued behind a cold fleet's
        # thousands of others is not the endpoint's slowness (it was cut at 30 s of waiting).
        run = ReplayRun(math.inf, cfg.replay_budget, cfg.replay_timeout)
        while True:
            reserved, self._reserved = self._reserved, None
            async with self._slots.turn(reserved) as turn:
                self._turn = turn
                try:
                    yielded = await self._take_turn(start, run, turn)
                finally:
                    self._turn = None
            if not yielded:
                break
            # Gave the slot up with nothing to show: re-queue behind whoever waited (FIFO).
            self._counters.replay_yields += 1
        # The DEALER lives only while its request runs: 4,096 idle sources hold no replay
        # socket (descriptors, `kvroute._transports.zmq.sockets.FDS_PER_SOURCE`), and late replies to this request
        # cannot pass for answers to the next one (the engine answers each connection apart).
        self.close()
        if not run.complete:
            if run.cut is not None:
                self._counters.replay_cutoffs += 1
                self._log.warn("replay cut short", run.cut)
            if not run.items:
                return run.items, False, run.cut or f"no reply within {cfg.replay_timeout:g} s"
        return run.items, run.complete, None

    async def _take_turn(self, start: int, run: ReplayRun, turn: Turn) -> bool:
        """One turn holding a replay slot; True when it yielded the slot with no reply to hand over."""
        endpoint = self._source.replay_endpoint
        assert endpoint is not None  # the replay task runs only for sources with one
        cfg = self._cfg
        if run.deadline == math.inf:
            run.deadline = anyio.current_time() + cfg.replay_deadline
        if self._dealer is None:
            try:
                self._dealer = _zmq.connect(
                    self._ctx,
                    zmq.DEALER,
                    endpoint,
                    rcvhwm=cfg.sub_rcvhwm(None),
                    max_message_size=cfg.max_message_size,
                    reconnect_ivl=cfg.reconnect_ivl,
                    reconnect_ivl_max=cfg.reconnect_ivl_max,
                    tcp_keepalive=cfg.tcp_keepalive,
                    curve=self._curve,
                    curve_server_key=self._source.curve_server_key if self._curve is not None else None,
                )
            except zmq.ZMQError as exc:
                # Out of sockets or descriptors for a moment (libzmq reaps closed sockets in
                # its own thread, late on a starved machine): a failed replay, asked again
                # by the machine's rules, not a failed source.
                run.cut = f"cannot open the replay socket: {exc}"
                return False
        dealer = self._dealer
        if not _zmq.send_nowait(dealer, [b"", start.to_bytes(8, "big")]):
            self.close()
            run.cut = "replay request refused (queue full)"
            return False
        clock = anyio.current_time
        began = last = clock()
        slots = self._slots
        # The machine holds at most max_held batches; reading more than that from one answer
        # only buys memory a publisher that never sends the end marker could exhaust.
        cap = self._max_held
        items = run.items
        while len(items) < cap and run.item_bytes < cfg.held_bytes:
            now = clock()
            run.silent_left -= now - last
            last = now
            if now >= run.deadline:
                run.cut = f"past the replay deadline ({cfg.replay_deadline:g} s)"
                return False
            if run.replies >= run.budget:
                run.cut = f"past the reply budget ({run.budget} replies)"
                return False
            if run.silent_left <= 0:
                return False
            turn_limit = turn.limit(now, cfg.replay_slice)
            past_slice = now - began >= turn_limit
            if past_slice and slots.contended:
                if items:
                    return False  # the machine applies these and asks for the rest, in its turn
                self.close()
                return True
            # Within the slice, wake at its end to look for waiters; past it, a waiter wakes us.
            until = min(run.deadline, now + run.silent_left)
            if not past_slice:
                until = min(until, began + turn_limit)
            msgs: list[list[bytes]] = []
            with anyio.CancelScope(deadline=until) as scope:
                turn.scope = scope
                msgs, _ = await _zmq.recv_budget(
                    dealer, min(cfg.recv_batch, run.budget - run.replies), cfg.wakeup_bytes
                )
            turn.scope = None
            for frames in msgs:
                run.replies += 1
                run.item_bytes += len(frames[-1])
                outcome = self._on_reply(frames, items)
                if outcome is _END:
                    run.complete = True
                    return False
                if outcome is _BATCH:
                    turn.batches += 1
                    run.silent_left = cfg.replay_timeout
                    last = clock()
        return False

    def _on_reply(self, frames: list[bytes], items: list[tuple[int, float, Payload | None]]) -> object:
        # Newer engines reply [b"", topic, seq8, payload], older [b"", seq8, payload]; accept
        # both from every source (docs/protocol.md §4). Returns _END, _BATCH (decodable) or _JUNK.
        n = len(frames)
        if n == 4 and not frames[0]:
            seq8, payload = frames[2], frames[3]
        elif n == 3 and not frames[0]:
            seq8, payload = frames[1], frames[2]
        else:
            self._counters.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{n} frames")
            return _JUNK
        if len(seq8) != 8:
            self._counters.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{len(seq8)}-byte seq")
            return _JUNK
        if seq8 == REPLAY_END_MARKER:
            return _END
        self._counters.replayed_batches += 1
        ts, batch = self._judge(payload)
        items.append((int.from_bytes(seq8, "big"), ts, batch))
        return _BATCH if batch is not None else _JUNK

    def close(self) -> None:
        """Close the DEALER, if a request left it open (late replies die with it); drop a deferred probe and give
        back an unused reserved slot or the place in line."""
        if self._retry is not None:
            self._slots.forget(self._retry)
            self._retry = None
        if self._queued is not None:
            self._slots.withdraw(self._queued)
            self._queued = None
        if self._reserved is not None:
            reserved, self._reserved = self._reserved, None
            self._slots.unreserve(reserved)
        if self._dealer is not None:
            _zmq.close(self._dealer)
            self._dealer = None
