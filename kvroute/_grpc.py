"""gRPC plumbing shared by discovery and the gateway stream: channels, serialization, refusals.

grpc's asyncio API runs only on asyncio and kvroute supports trio as well, so every call uses
grpc's threaded client and waits for it in an anyio worker thread.
"""

from __future__ import annotations

from typing import Any, Final

import anyio.to_thread
import grpc

from ._tls import TlsConfig

__all__ = ["answer_ended", "open_channel", "serialize"]

#: How long after a call's headers its status may still arrive: a refusal (UNIMPLEMENTED,
#: OUT_OF_RANGE) comes as a trailers-only answer, whose headers grpc can hand out a moment
#: before it marks the call done.
_ANSWER_GRACE: Final = 0.2

# A fresh channel must not share (and wait out) another channel's reconnect backoff, which
# grpc's process-wide subchannel pool would otherwise impose.
_CHANNEL_OPTIONS: Final = (("grpc.use_local_subchannel_pool", 1),)


def serialize(message: Any) -> bytes:
    """A protobuf message's bytes (the request serializer of every call kvroute makes)."""
    data: bytes = message.SerializeToString()
    return data


def open_channel(address: str, tls: TlsConfig | None, *, name: str | None = None) -> grpc.Channel:
    """A channel to ``address`` (``host:port``), over TLS when ``tls`` is given.

    ``name``: what the server certificate is checked against when ``tls`` names no
    ``server_name`` (default: ``address``).
    """
    opts: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    creds = tls.credentials(name or address)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=opts)


async def answer_ended(call: Any) -> bool:
    """Whether a streaming call ended with its headers (a refusal) rather than starting to stream."""

    def wait() -> bool:
        try:
            call.exception(timeout=_ANSWER_GRACE)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            return True
        return True

    return await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
