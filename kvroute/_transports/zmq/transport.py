"""`ZmqTransport`: the ZMQ transport as the client asks it (which sources, why one is refused, a driver for one).

One per client: it holds the client's receive loops (the Python `Receiver`, and with
``native_receive`` the compiled core's `NativeReceiver`) and the replay slots every source shares.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

import zmq

from ..._index import PrefixIndex
from ..._models import EventSource
from ..._snapshot import Cursor
from .._base import Driver, EventSink
from . import sockets as _zmq
from .config import SubscriberConfig, curve_keys
from .driver import SourceDriver
from .native import NativeReceiver
from .receiver import Receiver
from .replay import ReplaySlots

__all__ = ["ZmqTransport", "source_problem"]


def source_problem(
    source: EventSource, context: zmq.Context[zmq.Socket[bytes]], config: SubscriberConfig
) -> str | None:
    """Why ``source`` cannot be subscribed with this config, or None when it can.

    Tries its endpoints and keys on a throwaway socket, so a malformed endpoint or key is
    refused up front instead of failing inside a running driver. A plaintext ``tcp://host:port``
    endpoint libzmq certainly accepts (`_plain_tcp`) skips the socket: opening one per source
    was ~7 % of a 4,096-rank cold sync. Anything else still meets libzmq itself, so a bad
    endpoint gets libzmq's own error as before.
    """
    if source.curve_server_key is not None and config.curve_public_key is None:
        return "the source requires CURVE, and no client key pair is configured"
    curve = curve_keys(source, config)
    for endpoint in (source.endpoint, source.replay_endpoint):
        if endpoint is None or (curve is None and _plain_tcp.fullmatch(endpoint)):
            continue
        try:
            sock = _zmq.connect(
                context, zmq.DEALER, endpoint, curve=curve, curve_server_key=source.curve_server_key if curve else None
            )
        except (zmq.ZMQError, ValueError) as exc:
            return f"cannot connect to {endpoint!r}: {exc}"
        sock.close(linger=0)
    return None


#: ``tcp://`` + a host name, IPv4 or bracketed IPv6 address + ``:`` + a numeric port: a strict subset
#: of what libzmq's tcp connect accepts (its check: the address's characters from a fixed set,
#: ending in ``:`` and a digit; the name is resolved only when it connects).
_plain_tcp: Final = re.compile(r"tcp://(?:[A-Za-z0-9][A-Za-z0-9.\-_]*|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")


class ZmqTransport:
    """ZMQ SUB + replay DEALER per source (`SourceDriver`): every source not claimed by another transport."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], config: SubscriberConfig) -> None:
        self._ctx = context
        self._config = config
        # The replay slots every source of the client shares (``max_concurrent_replays``).
        self._limiter = ReplaySlots(config.max_concurrent_replays, config.replay_slice)
        # One receive loop reads every source's SUB (`kvroute._transports.zmq.receiver.Receiver`).
        self._receiver = Receiver(config)
        # With ``native_receive``, the compiled core's thread reads the sources it can
        # (`kvroute._transports.zmq.native.NativeReceiver`); the others stay on the Python receiver.
        self._native = (
            NativeReceiver(config, config.max_sources or _zmq.DEFAULT_MAX_SOURCES) if config.native_receive else None
        )

    def hold(self) -> bool:
        """Hold the native receive thread, if any, with what it applied recorded (`NativeReceiver.hold`).

        True when this call held it; the Python receiver applies on the event loop (nothing to hold).
        """
        return self._native is not None and self._native.hold()

    def release(self) -> None:
        """Let a held native receive thread apply again."""
        if self._native is not None:
            self._native.release()

    def handles(self, source: EventSource) -> bool:
        """Every source: ZMQ is the default transport."""
        return True

    def problem(self, source: EventSource) -> str | None:
        """See `source_problem`."""
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
