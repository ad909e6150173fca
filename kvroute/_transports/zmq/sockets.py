"""The one async ZMQ seam: waiting on sockets under anyio (asyncio and trio), socket setup, monitors, CURVE.

pyzmq's own async integration is asyncio-only, so kvroute uses plain (sync) pyzmq sockets and
waits on their file descriptor with `anyio.wait_readable`. That descriptor is edge-triggered
(libzmq signals a state change, not a level): always read ``zmq.EVENTS`` before waiting, and
drain with ``NOBLOCK`` until EAGAIN or a batch cap, or a wakeup is missed and the reader hangs.
Reading ``zmq.EVENTS`` before every wait makes that safe: when it says "nothing to read", any
later arrival signals the descriptor again. An idle socket costs nothing: no polling.

Only one task may wait on a socket at a time (anyio raises BusyResourceError otherwise). A task
that closes a socket another task may be waiting on calls `close` here, which notifies the
waiter (it gets `anyio.ClosedResourceError`) before the descriptor goes away.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from typing import Any, NamedTuple, cast

import anyio
import anyio.lowlevel
import zmq

from ..._errors import ConfigError

__all__ = [
    "DEFAULT_MAX_SOURCES",
    "FDS_PER_SOURCE",
    "FDS_PER_REPLAY",
    "SOCKETS_PER_REPLAY",
    "SOCKETS_PER_SOURCE",
    "CurveKeys",
    "MonitorEvent",
    "close",
    "connect",
    "curve_keypair",
    "drain_nowait",
    "fit_sources",
    "open_monitor",
    "read_monitor",
    "recv_budget",
    "recv_many",
    "recv_nowait",
    "send_nowait",
    "socket",
    "wait_readable",
]

#: libzmq's monitor message: 16-bit event id and 32-bit value, native byte order, no padding
#: (zmq_socket_monitor(3)).
_MONITOR_HEAD = struct.Struct("=hi")
_monitor_ids = itertools.count()

log = logging.getLogger("kvroute.client")


class CurveKeys(NamedTuple):
    """A CURVE key pair, both halves z85-encoded (40 characters)."""

    public: str
    secret: str


def curve_keypair() -> CurveKeys:
    """A fresh CURVE key pair (for tests, the simulator, or a one-off deployment)."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public.decode("ascii"), secret.decode("ascii"))


class MonitorEvent(NamedTuple):
    """One socket monitor notification: the ``zmq.EVENT_*`` id, its value and the peer endpoint."""

    event: int
    value: int
    endpoint: str


async def wait_readable(sock: zmq.Socket[bytes]) -> None:
    """Return once ``sock`` has a message to read; raises anyio.ClosedResourceError if it is closed."""
    while True:
        if sock.closed:
            raise anyio.ClosedResourceError
        if cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            return
        await anyio.wait_readable(sock.FD)


def _drain(sock: zmq.Socket[bytes], max_messages: int, out: list[list[bytes]], max_bytes: int | None = None) -> bool:
    """Append queued messages to ``out``; True when it stopped at a cap with more possibly queued."""
    recv = sock.recv_multipart
    size = 0
    try:
        while len(out) < max_messages:
            msg = recv(zmq.NOBLOCK)
            out.append(msg)
            if max_bytes is not None:
                size += sum(len(f) for f in msg)
                if size >= max_bytes:
                    return True
    except zmq.Again:
        return False
    return True


def drain_nowait(
    sock: zmq.Socket[bytes], max_messages: int, max_bytes: int | None = None
) -> tuple[list[list[bytes]], bool]:
    """The messages queued on ``sock`` now (up to the caps), and whether it stopped at a cap, without waiting.

    Draining to EAGAIN re-arms the socket's descriptor: a later arrival signals it again.
    After a capped drain more may be queued with no new signal: read again without waiting.
    """
    out: list[list[bytes]] = []
    capped = _drain(sock, max_messages, out, max_bytes)
    return out, capped


def recv_nowait(sock: zmq.Socket[bytes], max_messages: int) -> list[list[bytes]]:
    """Every message queued on ``sock`` right now (up to ``max_messages``), without waiting."""
    out: list[list[bytes]] = []
    _drain(sock, max_messages, out)
    return out


async def recv_many(sock: zmq.Socket[bytes], max_messages: int) -> list[list[bytes]]:
    """Wait for at least one message, then take every queued one (up to ``max_messages``) without blocking.

    Each message is its list of frames. Yields to the event loop first, so one busy socket
    never starves the other tasks: a reader that loops on this is fair by construction.
    """
    msgs, _ = await recv_budget(sock, max_messages)
    return msgs


async def recv_budget(
    sock: zmq.Socket[bytes], max_messages: int, max_bytes: int | None = None
) -> tuple[list[list[bytes]], bool]:
    """`recv_many`, also stopping once ``max_bytes`` of frames are taken (at least one message).

    Returns the messages and whether it stopped at a cap (more may be queued).
    """
    await anyio.lowlevel.checkpoint()
    out: list[list[bytes]] = []
    while True:
        capped = _drain(sock, max_messages, out, max_bytes)
        if out:
            return out, capped
        await wait_readable(sock)


def send_nowait(sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
    """Send one message without blocking; False when the socket refused it (past its high-water mark).

    PUB and (non-mandatory) ROUTER sockets never refuse: they drop silently past the mark,
    which is what engines do (docs/protocol.md §2, §4).
    """
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    rcvhwm: int | None = None,
    max_message_size: int | None = None,
    reconnect_ivl: float | None = None,
    reconnect_ivl_max: float | None = None,
    tcp_keepalive: bool = True,
    curve: CurveKeys | None = None,
    curve_server_key: str | None = None,
    subscribe: bytes | None = None,
) -> zmq.Socket[bytes]:
    """Create a socket for connecting, with its options set (intervals in seconds).

    ``subscribe`` applies to SUB sockets (b"" = everything). CURVE needs both the client key
    pair and the server's public key; with only one of them this raises ValueError, so a
    half-configured secure deployment never silently falls back to plaintext.
    """
    if (curve is None) != (curve_server_key is None):
        raise ValueError("CURVE needs both the client key pair and the server public key")
    sock: zmq.Socket[bytes] = ctx.socket(socket_type)
    try:
        # Unsent replay requests must not hold shutdown up: close at once (linger 0).
        sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if max_message_size is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        if reconnect_ivl is not None:
            sock.setsockopt(zmq.RECONNECT_IVL, max(1, round(reconnect_ivl * 1000)))
        if reconnect_ivl_max is not None:
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(0, round(reconnect_ivl_max * 1000)))
        if tcp_keepalive:
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if curve is not None and curve_server_key is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public.encode("ascii"))
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode("ascii"))
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key.encode("ascii"))
        if subscribe is not None:
            sock.setsockopt(zmq.SUBSCRIBE, subscribe)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect(ctx: zmq.Context[zmq.Socket[bytes]], socket_type: int, endpoint: str, **options: Any) -> zmq.Socket[bytes]:
    """`socket` with ``options``, connected to ``endpoint``."""
    sock = socket(ctx, socket_type, **options)
    try:
        sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def open_monitor(sock: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
    """Start monitoring ``sock`` for ``events`` (a zmq.EVENT_* mask); returns the PAIR socket to read.

    Call it before connecting: libzmq reports only what happens after, and a loopback
    handshake can complete before the next line of Python runs.
    """
    # pyzmq's default address is derived from the socket's descriptor number, which the next
    # socket reuses while libzmq may still hold the old inproc name: a recreated socket's
    # monitor then never connects. A process-wide counter never repeats.
    mon: zmq.Socket[bytes] = sock.get_monitor_socket(events, addr=f"inproc://kvroute-monitor-{next(_monitor_ids)}")
    mon.setsockopt(zmq.LINGER, 0)
    return mon


def read_monitor(frames: list[bytes]) -> MonitorEvent | None:
    """Parse one monitor message; None if it is not the two-frame shape libzmq documents."""
    if len(frames) != 2 or len(frames[0]) != _MONITOR_HEAD.size:
        return None
    event, value = _MONITOR_HEAD.unpack(frames[0])
    return MonitorEvent(event, value, frames[1].decode("utf-8", "replace"))


def close(sock: zmq.Socket[bytes], *, monitor: zmq.Socket[bytes] | None = None) -> None:
    """Close a socket (and its monitor) at once, waking any task still waiting on either.

    Must run in the event loop's thread. Waking waiters first matters: the descriptor number
    is reused by the next socket, and a stale registration would swallow its wakeups.
    """
    if monitor is not None and not monitor.closed:
        if not sock.closed:
            sock.disable_monitor()
        anyio.notify_closing(monitor.FD)
        monitor.close(linger=0)
    if not sock.closed:
        anyio.notify_closing(sock.FD)
        sock.close(linger=0)


#: Sockets one source holds for its whole life: its SUB and the SUB monitor's two PAIR ends.
#: Its replay DEALER exists only while one of the client's replay slots is carrying out its
#: request (``max_concurrent_replays`` at once), so it is budgeted per slot, not per source.
SOCKETS_PER_SOURCE = 3
#: File descriptors one source holds: one mailbox per socket, plus the SUB's TCP connection.
FDS_PER_SOURCE = SOCKETS_PER_SOURCE + 1
#: Sockets and descriptors of one replay slot: a DEALER (mailbox, TCP connection).
SOCKETS_PER_REPLAY, FDS_PER_REPLAY = 1, 2
#: ``max_sources`` when the process has room for them.
DEFAULT_MAX_SOURCES = 4096
# Left for everything else: up to _SPARE_REPLAYS replay slots' DEALERs, the throwaway socket
# `source_problem` tries endpoints on, discovery's gRPC channels, logging, sockets libzmq has
# yet to reap. Replay slots past _SPARE_REPLAYS are budgeted on top.
_SPARE = 64
_SPARE_REPLAYS = 16
# Socket slots an own context gets beyond the budget (see fit_sources).
_REAP_ROOM = 1024


def fit_sources(ctx: zmq.Context[zmq.Socket[bytes]], wanted: int | None, *, own_context: bool, replays: int = 8) -> int:
    """How many sources this context and process can hold: ``wanted``, or what fits when it is None.

    ``replays``: the client's replay slots (``max_concurrent_replays``), each holding a DEALER
    while it runs. A context the caller did not give (``own_context``) gets a socket limit
    sized for the sources (libzmq's default, 1,023, holds ~300); the soft file-descriptor
    limit is raised towards the hard one when it is too low (4,096 sources take ~16,500
    descriptors). An explicit ``wanted`` that still does not fit raises `ConfigError` naming
    the limit, instead of "Too many open files" later; with ``wanted`` None, fewer than 4,096
    is logged at WARNING (sources past it are refused, each with a warning).
    """
    target = wanted if wanted is not None else DEFAULT_MAX_SOURCES
    extra = max(0, replays - _SPARE_REPLAYS)
    fixed_sockets = _SPARE + extra * SOCKETS_PER_REPLAY
    fixed_fds = _SPARE + extra * FDS_PER_REPLAY
    sockets_needed = target * SOCKETS_PER_SOURCE + fixed_sockets
    limit = ctx.get(zmq.MAX_SOCKETS)
    if own_context and limit < sockets_needed + _REAP_ROOM:
        # Room above the budget for closed replay DEALERs libzmq has not reaped yet (a socket
        # slot costs libzmq a pointer; the budget below still counts only the live ones).
        ctx.set(zmq.MAX_SOCKETS, min(sockets_needed + _REAP_ROOM, ctx.get(zmq.SOCKET_LIMIT)))
        limit = ctx.get(zmq.MAX_SOCKETS) - _REAP_ROOM
    fds = _fd_room(target * FDS_PER_SOURCE + fixed_fds)
    fit = max(0, min((limit - fixed_sockets) // SOCKETS_PER_SOURCE, (fds - fixed_fds) // FDS_PER_SOURCE))
    if wanted is None:
        if fit < DEFAULT_MAX_SOURCES:
            log.warning(
                "max_sources %d: what the zmq socket limit (%d) and file descriptors (%d) allow; more sources are "
                "refused (raise ulimit -n to follow up to %d)",
                fit,
                limit,
                fds,
                DEFAULT_MAX_SOURCES,
            )
        return max(1, min(DEFAULT_MAX_SOURCES, fit))
    if wanted > fit:
        raise ConfigError(
            f"max_sources={wanted} does not fit: the zmq context allows {limit} sockets and the process "
            f"{fds} more file descriptors ({SOCKETS_PER_SOURCE} sockets and {FDS_PER_SOURCE} descriptors a "
            f"source, {FDS_PER_REPLAY} a replay slot); raise the limits (ulimit -n, zmq.MAX_SOCKETS) or lower "
            "max_sources"
        )
    return wanted


def _fd_room(needed: int) -> int:
    """File descriptors this process may still open, after raising the soft limit towards ``needed`` more."""
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return needed
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = _SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return needed
    if soft - in_use < needed and soft != hard:
        new = in_use + needed if hard == resource.RLIM_INFINITY else min(hard, in_use + needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            log.info("raised the soft file-descriptor limit from %d to %d", soft, new)
            soft = new
        except (ValueError, OSError):
            pass
    return max(0, soft - in_use)
