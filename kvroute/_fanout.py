"""The client's fan-out of envelopes to `events()` iterators, each with its own bounded buffer.

The drivers publish every envelope to one `_Hub` (their `EventSink`); it copies it to each live
`EventStream`. When a stream's buffer is full the oldest envelope is dropped and counted, and the
iterator yields an `Overflow` lifecycle event in its place, so a slow consumer loses events but
never slows indexing down. One `RawTap` (the JetStream relay's publisher) may listen too: while it
is the only listener, the ZMQ drivers keep their raw-bytes fast path and hand it each applied
payload (`Hub.raw`); everything else reaches it as envelopes, in the order the client applied it.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import anyio

from ._events import Envelope, Overflow
from ._models import EventSource

__all__ = ["EventStream", "Hub", "RawTap"]


class EventStream:
    """An async iterator over the client's `Envelope` stream, with its own bounded buffer.

    Overflow policy: when ``capacity`` envelopes are waiting, each new one drops the oldest;
    the iterator then yields one `Overflow` envelope (with the number dropped) before the
    next surviving envelope. It ends when the client stops or on `aclose` (also usable as
    ``async with client.events() as stream:``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: Envelopes this iterator lost to overflow, in total.
        self.dropped = 0
        self._buffer: deque[Envelope] = deque()
        self._unreported = 0
        self._last_dropped: Envelope | None = None
        self._wakeup: anyio.Event | None = None
        self._closed = False

    def _push(self, envelope: Envelope) -> bool:
        """Buffer one envelope; True when that dropped the oldest."""
        buf = self._buffer
        dropped = len(buf) >= self.capacity
        if dropped:
            self._last_dropped = buf.popleft()
            self.dropped += 1
            self._unreported += 1
        buf.append(envelope)
        if self._wakeup is not None:
            self._wakeup.set()
        return dropped

    def _close(self) -> None:
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def pending(self) -> int:
        """Envelopes waiting to be taken: that many `__anext__` calls return without waiting."""
        return len(self._buffer) + (1 if self._unreported else 0)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._unreported:
                dropped, self._unreported = self._unreported, 0
                last = self._last_dropped
                assert last is not None  # set with every drop
                return Envelope(source=last.source, seq=None, ts=time.time(), event=Overflow(dropped=dropped))
            if self._buffer:
                return self._buffer.popleft()
            if self._closed:
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
            self._wakeup = None

    async def aclose(self) -> None:
        """Stop receiving; envelopes already buffered are discarded."""
        self._closed = True
        self._buffer.clear()
        self._unreported = 0

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class RawTap(Protocol):
    """A listener that takes in-order batches as their engine payloads (the JetStream relay's publisher).

    ``raw(source, seq, ts, payload, blocks)``: a batch the ZMQ driver applied from ``payload`` on
    its fast path; every other envelope (events of batches applied elsewhere, lifecycle facts)
    goes to ``push``, in the order the client applied them.
    """

    def raw(self, source: EventSource, seq: int, ts: float, payload: bytes, blocks: int) -> None:
        """One batch, applied to the index, as the engine's payload bytes."""
        ...

    def push(self, envelope: Envelope) -> None:
        """Any other envelope."""
        ...


class Hub:
    """The drivers' `EventSink`: copies each envelope to every live `EventStream` (and to the raw tap)."""

    def __init__(self) -> None:
        # Weak references in a plain list: an iterator the caller dropped without closing stops
        # costing anything, and publishing walks a list (a WeakSet's iterator costs a guard object
        # and a set walk per envelope).
        self._streams: list[weakref.ref[EventStream]] = []
        self._tap: RawTap | None = None
        #: The tap's ``raw`` while it is the only listener (drivers then hand it payload bytes on
        #: their fast path instead of an envelope per event); None otherwise.
        self.raw: Callable[[EventSource, int, float, bytes, int], None] | None = None
        #: Envelopes dropped by full iterators, all of them (closed ones included).
        self.dropped = 0

    @property
    def active(self) -> bool:
        """Somebody listens (an iterator or the tap): drivers then publish every applied batch's events."""
        return bool(self._streams) or self._tap is not None

    @property
    def tap(self) -> RawTap | None:
        """The raw tap attached with `set_tap` (None: none)."""
        return self._tap

    def add(self, stream: EventStream) -> None:
        """Copy every envelope from now on to ``stream`` too."""
        self._streams.append(weakref.ref(stream))
        self._update_raw()

    def set_tap(self, tap: RawTap | None) -> None:
        """Attach (None: detach) the raw tap (one at a time)."""
        self._tap = tap
        self._update_raw()

    def _update_raw(self) -> None:
        self.raw = self._tap.raw if self._tap is not None and not self._streams else None

    def publish(self, envelope: Envelope) -> None:
        """Copy ``envelope`` to the tap and every live iterator (a full one drops its oldest)."""
        if self._tap is not None:
            self._tap.push(envelope)
        stale = False
        for ref in self._streams:
            stream = ref()
            if stream is None or stream._closed:
                stale = True
            elif stream._push(envelope):
                self.dropped += 1
        if stale:
            self._streams = [r for r in self._streams if (s := r()) is not None and not s._closed]
            self._update_raw()

    def close(self) -> None:
        """End every iterator (the client stopped); the tap stays attached."""
        for ref in self._streams:
            stream = ref()
            if stream is not None:
                stream._close()
        self._streams = []
        self._update_raw()
