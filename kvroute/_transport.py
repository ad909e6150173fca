"""The seam between `KvEventClient` and the ways KV events travel: ZMQ, or a gateway's gRPC stream.

A `Transport` says which sources it carries, why one cannot be subscribed, and builds the
`Driver` that follows one source. Every driver feeds a `kvroute._source.SourceMachine` (the one
owner of the recovery rules) and carries out its actions against the same index and listeners;
only the bytes and the time differ. The client asks each transport in turn and uses the first
that `handles` the source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import zmq

from ._index import PrefixIndex
from ._models import EventSource, WorkerKey, WorkerStatus
from ._snapshot import Cursor
from ._source import SourceMachine
from ._subscriber import EventSink, ReplaySlots, SourceDriver, SourceStats, SubscriberConfig, source_problem

__all__ = ["Driver", "Transport", "ZmqTransport"]


class Driver(Protocol):
    """Follows one source for the client (`SourceDriver` is the ZMQ one)."""

    source: EventSource
    key: WorkerKey
    machine: SourceMachine

    async def run(self) -> None:
        """Follow the source until cancelled; release everything on the way out."""
        ...

    def stop(self) -> None:
        """Stop touching the index and the listeners at once (cancellation follows)."""
        ...

    def status(self) -> WorkerStatus:
        """The worker's sync state."""
        ...

    def cursor(self) -> Cursor | None:
        """The newest applied position while the index holds this source's run."""
        ...

    def stats(self) -> SourceStats:
        """The source's counters."""
        ...


class Transport(Protocol):
    """Builds drivers for the sources it carries."""

    def handles(self, source: EventSource) -> bool:
        """Whether this transport carries ``source``."""
        ...

    def problem(self, source: EventSource) -> str | None:
        """Why ``source`` cannot be subscribed, or None."""
        ...

    def driver(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        resume: Cursor | None,
    ) -> Driver:
        """A driver for ``source`` (not yet running)."""
        ...


class ZmqTransport:
    """ZMQ SUB + replay DEALER per source (`SourceDriver`): every source not claimed by another transport."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], config: SubscriberConfig, limiter: ReplaySlots
    ) -> None:
        self._ctx = context
        self._config = config
        self._limiter = limiter

    def handles(self, source: EventSource) -> bool:
        """Every source: ZMQ is the default transport."""
        return True

    def problem(self, source: EventSource) -> str | None:
        """See `kvroute._subscriber.source_problem`."""
        return source_problem(source, self._ctx, self._config)

    def driver(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        resume: Cursor | None,
    ) -> Driver:
        """A `SourceDriver`."""
        return SourceDriver(
            source,
            context=self._ctx,
            config=self._config,
            index=index,
            sink=sink,
            limiter=self._limiter,
            on_change=on_change,
            resume=resume,
        )
