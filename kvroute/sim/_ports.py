"""Free ports for simulated engines, below the OS's ephemeral range.

A port the OS picks for ``:0`` comes from its ephemeral range, where it also picks the local ports
of outgoing connections. A simulated engine that restarts on the same port (as a real one does)
finds it free only if nothing took it meanwhile: a subscriber's reconnect, a discovery client, or
another process on the machine binding ``:0`` can. Chaos runs beside a 4,096-rank benchmark failed
so ("Address already in use" for 10 s, a ZMQ replay port and a gRPC discovery port). A port below
the ephemeral range (Linux's default starts at 32768) is taken only by a bind that names it.
"""

from __future__ import annotations

import random
import socket

import zmq

__all__ = ["bind_zmq", "free_port"]

_RANGE = (20_000, 32_767)
_TRIES = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port in the range that ``host`` can bind now (0 when none of a few hundred tries could: let the OS pick)."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    for _ in range(_TRIES):
        port = random.randint(*_RANGE)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((bare if bare not in ("*", "") else "", port))
            except OSError:
                continue
            return port
    return 0


def bind_zmq(sock: zmq.Socket[bytes], host: str) -> None:
    """Bind ``sock`` to a free port of the range on ``host`` (``tcp://HOST``), else one the OS picks."""
    try:
        sock.bind_to_random_port(host, min_port=_RANGE[0], max_port=_RANGE[1], max_tries=_TRIES)
    except zmq.ZMQBindError:
        sock.bind(f"{host}:0")  # the range is crowded
