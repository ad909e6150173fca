"""`SubscriberConfig`'s import path before the ZMQ transport moved into `kvroute._transports.zmq`.

Kept only for `kvroute._jetstream_relay`, which imports it from here; once that module imports
`kvroute._transports.zmq.config`, this module goes.
"""

from __future__ import annotations

from ._transports.zmq.config import SubscriberConfig

__all__ = ["SubscriberConfig"]
