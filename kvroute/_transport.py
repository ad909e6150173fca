"""The seam between `KvEventClient` and the ways KV events travel: ZMQ, or a gateway's gRPC stream.

A `Transport` says which sources it carries, why one cannot be subscribed, and builds the
`Driver` that follows one source (both interfaces live in `kvroute._transports._base`). Every
driver feeds a `kvroute._source.SourceMachine` (the one owner of the recovery rules) and carries
out its actions against the same index and listeners; only the bytes and the time differ. The
client asks each transport in turn and uses the first that `handles` the source.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from . import _zmq
from ._index import PrefixIndex
from ._models import EventSource
from ._snapshot import Cursor
from ._subscriber import NativeReceiver, Receiver, ReplaySlots, SourceDriver, SubscriberConfig, source_problem
from ._transports._base import Driver, EventSink, Transport

__all__ = ["Driver", "Transport", "ZmqTransport"]


class ZmqTransport:
    """ZMQ SUB + replay DEALER per source (`SourceDriver`): every source not claimed by another transport."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], config: SubscriberConfig, limiter: ReplaySlots) -> None:
        self._ctx = context
        self._config = config
        self._limiter = limiter
        # One receive loop reads every source's SUB (`kvroute._subscriber.Receiver`).
        self._receiver = Receiver(config)
        # With ``native_receive``, the compiled core's thread reads the sources it can
        # (`kvroute._subscriber.NativeReceiver`); the others stay on the Python receiver.
        self._native = (
            NativeReceiver(config, config.max_sources or _zmq.DEFAULT_MAX_SOURCES) if config.native_receive else None
        )

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
            receiver=self._receiver,
            native=self._native,
        )
