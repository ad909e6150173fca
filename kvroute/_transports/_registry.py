"""The one place `KvEventClient` takes its transports from, in the order they are asked."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from .._load import EngineLoads
from .._models import EventSource
from ._base import Transport
from .gateway import ChannelOptions, GatewayTransport
from .jetstream import JetStreamSource, SourceFeed
from .zmq.config import SubscriberConfig
from .zmq.transport import ZmqTransport

__all__ = ["client_transports"]


def client_transports(
    *,
    context: zmq.Context[zmq.Socket[bytes]],
    config: SubscriberConfig,
    channel_options: ChannelOptions,
    loads: EngineLoads,
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object],
    adopt: Callable[[EventSource, EventSource], bool],
    jetstream: tuple[JetStreamSource, SourceFeed] | None = None,
) -> list[Transport]:
    """Every transport a client uses; the first that `Transport.handles` a source carries it.

    The gateway stream claims ``grpc://`` endpoints; ZMQ (SUB + replay DEALER) takes every
    other source. ``spawn(run)`` starts a task in the client's task group (a shared stream's);
    ``loads`` receives engine load records; ``adopt(source, like)`` follows a rank a stream
    carries unannounced the way ``like`` is followed. ``jetstream``: a relay's log and what the
    client lends it (`SourceFeed`); first, so it claims the sources it names itself.
    """
    log = [jetstream[0].attach(jetstream[1])] if jetstream is not None else []
    return [
        *log,
        GatewayTransport(config.limits, channel_options, loads, spawn, adopt),
        ZmqTransport(context, config),
    ]
