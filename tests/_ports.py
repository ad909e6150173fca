"""Loopback ports for tests: one to start a server on later, and one that refuses connections."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A port nobody listens on right now (bound then released), for a server a test starts on it later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound, never listening.

    A released `free_port` is the OS's to give again: a gRPC server the same test then started on
    port 0 got it, and the "dead" target answered as that server (CI: exit 5, unusable source, where
    3, unreachable, was expected); a NATS server beside the test could take it too.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])
