"""The Python receive loop: one OS selector over every source's SUB and monitor (`Receiver`).

Both receive loops (this one, and the compiled core's `kvroute._transports.zmq.native.NativeReceiver`) run
inside the drivers' session tasks: `_LoopLeader` is that shared leadership.
"""

from __future__ import annotations

import abc
import selectors
import time
from typing import Protocol

import anyio
import anyio.lowlevel
import zmq

from .._base import SourceCounters
from . import sockets as _zmq
from .config import SubscriberConfig

__all__ = ["Entry", "Reader", "Receiver"]


class Reader(Protocol):
    """What a receive loop hands its sockets' traffic to: the source's driver (`SourceDriver`)."""

    @property
    def counters(self) -> SourceCounters:
        """The source's counters (the receiver counts wakeups cut at the byte budget)."""
        ...

    @property
    def _recreate(self) -> bool:
        """The SUB is being recreated: read nothing more from it."""
        ...

    def _on_messages(self, msgs: list[list[bytes]], wall: float) -> None:
        """Live messages read from the SUB, in order; ``wall``: time.time() when read."""
        ...

    def _on_quiet(self) -> None:
        """Nothing was read from the SUB for the quiet interval."""
        ...

    def _poll_monitor(self) -> None:
        """Read every monitor event queued."""
        ...


# The receiver: how long one round may work before it yields to the event loop (a visit to
# one socket may overrun it), how many messages one visit takes from a socket, and how often
# it looks for quiet sources (and wakes when nothing arrives).
_SLICE = 0.005
_VISIT = 64
_QUIET_SCAN = 0.25


class Entry:
    """One source's SUB socket and its monitor, as the receiver watches them."""

    __slots__ = ("driver", "last_read", "mon", "mon_fd", "sub", "sub_fd")

    def __init__(self, driver: Reader, sub: zmq.Socket[bytes], mon: zmq.Socket[bytes], now: float) -> None:
        self.driver = driver
        self.sub = sub
        self.mon = mon
        self.sub_fd: int = sub.FD
        self.mon_fd: int = mon.FD
        #: When the receiver last read a message from the SUB (or the entry was added).
        self.last_read = now


class _LoopLeader(abc.ABC):
    """A receive loop that runs inside the drivers' session tasks: one leads, the others wait.

    The first session to call `serve` runs `_loop`; the others wait, and one takes over when
    the leader's session ends, so the loop lives exactly as long as some source does and needs
    no task of its own.
    """

    def __init__(self) -> None:
        self._leading = False
        self._vacant = anyio.Event()

    @abc.abstractmethod
    async def _loop(self) -> None:
        """The receive loop itself (`Receiver`: the OS selector; `NativeReceiver`: the core thread's pipe)."""

    async def serve(self) -> None:
        """Run the receive loop, or wait while another session runs it and take over when it ends; never returns."""
        while True:
            if self._leading:
                await self._vacant.wait()
                continue
            self._leading = True
            try:
                await self._loop()
            finally:
                self._leading = False
                vacant, self._vacant = self._vacant, anyio.Event()
                vacant.set()


class Receiver(_LoopLeader):
    """One receive loop over every source's SUB and monitor socket (instead of a task per socket).

    Each socket's descriptor is registered in one OS selector (epoll, kqueue) whose own
    descriptor the loop waits on: one wakeup of the event loop serves every socket that has
    something, however many. A round takes at most 64 messages from each ready socket in turn
    (`SourceDriver._on_messages` applies them), and yields to the event loop every 5 ms of
    work; a socket left with messages queued is visited again next round without waiting.

    Quiet (docs/recovery.md rules 7-8) is decided on the socket, not on the clock: a source is
    quiet when the selector, as of its last look, has not reported its SUB for the quiet
    interval. A loop that is slow (overload) still visits every socket with messages each
    round, so it never probes a source for kvroute's own slowness.

    The loop runs inside one of the drivers' session tasks (`_LoopLeader.serve`). Where the OS
    selector has no descriptor to wait on, the loop looks every 2 ms instead.
    """

    def __init__(self, config: SubscriberConfig) -> None:
        self._visit = max(1, min(config.recv_batch, _VISIT))
        self._wakeup_bytes = config.wakeup_bytes
        self._quiet = config.quiet_interval
        self._selector: selectors.BaseSelector | None = None
        self._entries: dict[Entry, None] = {}
        # Entries whose SUB has (or may have) messages queued, oldest first.
        self._backlog: dict[Entry, None] = {}
        super().__init__()
        self._next_scan = 0.0

    def add(self, driver: Reader, sub: zmq.Socket[bytes], mon: zmq.Socket[bytes]) -> Entry:
        """Watch ``sub`` and its monitor ``mon`` for ``driver`` (until `remove`)."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
        entry = Entry(driver, sub, mon, anyio.current_time())
        self._selector.register(entry.sub_fd, selectors.EVENT_READ, entry)
        try:
            self._selector.register(entry.mon_fd, selectors.EVENT_READ, entry)
        except BaseException:
            self._selector.unregister(entry.sub_fd)
            raise
        self._entries[entry] = None
        # Messages may already be queued: a socket's descriptor signals only after a read
        # found it empty. The SUB is read in the next round; the monitor now.
        self._backlog[entry] = None
        driver._poll_monitor()
        return entry

    def remove(self, entry: Entry) -> None:
        """Stop watching ``entry``'s sockets (before they are closed: descriptor numbers are reused)."""
        if entry not in self._entries or self._selector is None:
            return
        del self._entries[entry]
        self._backlog.pop(entry, None)
        self._selector.unregister(entry.sub_fd)
        self._selector.unregister(entry.mon_fd)
        if not self._entries:
            # The client may be leaving: hold no descriptor while no source runs.
            fd = _waitable(self._selector)
            if fd is not None:
                anyio.notify_closing(fd)
            self._selector.close()
            self._selector = None

    async def _loop(self) -> None:
        clock = time.perf_counter
        backlog = self._backlog
        while True:
            selector = self._selector
            if selector is None:
                return  # every source left (the leader is leaving too)
            if backlog:
                await anyio.lowlevel.checkpoint()
            else:
                fd = _waitable(selector)
                if fd is None:
                    await anyio.sleep(0.002)
                else:
                    with anyio.move_on_after(_QUIET_SCAN):
                        await anyio.wait_readable(fd)
            selector = self._selector
            if selector is None:
                return
            now = anyio.current_time()
            for key, _ in selector.select(0):
                entry: Entry = key.data
                if key.fd == entry.sub_fd:
                    backlog[entry] = None
                else:
                    entry.driver._poll_monitor()
            # Every SUB not reported now (and not in the backlog) had nothing to read as of
            # `now`: the quiet scan compares with this look, not with the time of the round.
            looked = now
            yield_at = clock() + _SLICE
            wall = time.time()
            for entry in list(backlog):
                if entry not in backlog:
                    continue  # removed meanwhile
                del backlog[entry]
                if self._read(entry, now, wall):
                    backlog[entry] = None  # more queued: next round, after the others
                if clock() > yield_at:
                    await anyio.lowlevel.checkpoint()
                    yield_at = clock() + _SLICE
                    wall = time.time()
                    now = anyio.current_time()
            if looked >= self._next_scan:
                self._next_scan = looked + _QUIET_SCAN
                self._scan(looked)

    def _read(self, entry: Entry, now: float, wall: float) -> bool:
        """Hand one visit's worth of ``entry``'s messages to its driver; True when more may be queued."""
        driver = entry.driver
        if driver._recreate or entry not in self._entries:
            return False
        try:
            msgs, more = _zmq.drain_nowait(entry.sub, self._visit, self._wakeup_bytes)
        except zmq.ZMQError:
            return False  # closed under us: its session is ending
        if msgs:
            entry.last_read = now
            driver.counters.wakeups_cut += more
            driver._on_messages(msgs, wall)
        return more and not driver._recreate

    def _scan(self, looked: float) -> None:
        quiet = self._quiet
        backlog = self._backlog
        for entry in list(self._entries):
            if entry in backlog or looked - entry.last_read < quiet or entry not in self._entries:
                continue
            entry.last_read = looked
            entry.driver._on_quiet()


def _waitable(selector: selectors.BaseSelector) -> int | None:
    """The selector's own descriptor, when the event loop can wait on it (epoll, kqueue, /dev/poll)."""
    fileno = getattr(selector, "fileno", None)
    if fileno is None or isinstance(selector, (selectors.SelectSelector, selectors.PollSelector)):
        return None
    fd: int = fileno()
    return fd
