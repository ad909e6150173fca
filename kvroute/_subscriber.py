"""The per-source driver: one SUB (and a DEALER for replay) moving bytes and time for a `SourceMachine`.

The recovery rules live in the sans-I/O `kvroute._source.SourceMachine`; this module only feeds it
(live messages, replay results, socket monitor events, quiet ticks) and carries out what it
returns (apply batches to the index, ask for a replay, reset the worker, recreate the SUB, emit
lifecycle events). Every frame that is not what docs/protocol.md §2 and §4 describe is counted and
skipped, with a rate-limited log line: bad input never stops the pump.
"""

from __future__ import annotations

import abc
import itertools
import logging
import math
import selectors
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import msgspec
import zmq

import kvroute._core as _core

from . import _zmq
from ._errors import ClientStateError, ConfigError, DecodeError
from ._index import ApplyReport, PrefixIndex
from ._models import EventSource, WorkerKey
from ._snapshot import Cursor
from ._source import Action, Apply, RecreateSubscriber, RequestReplay
from ._transports._base import (
    COUNTER_FIELDS,
    DriverBase,
    EventSink,
    RateLimitedLog,
    SourceCounters,
    SourceStats,
    apply_items,
    described_fields,
    emit_lifecycle,
)
from ._wire import BatchDecoder, EventBatch, Limits

__all__ = [
    "EventSink",
    "NativeReceiver",
    "RateLimitedLog",
    "Receiver",
    "ReplaySlots",
    "SourceCounters",
    "SourceDriver",
    "SourceStats",
    "SubscriberConfig",
    "COUNTER_FIELDS",
    "apply_items",
    "emit_lifecycle",
    "described_fields",
    "source_problem",
]

log = logging.getLogger("kvroute.subscriber")

#: The replay end marker's seq (docs/protocol.md §4).
_END_SEQ = b"\xff" * 8

# Monitor events that change what the driver tells the machine. "Connected" is the completed
# ZMTP handshake, not the TCP connect: only then does the publisher see the subscription (and,
# with CURVE, only then is the peer known to hold the server key).
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
# libzmq schedules a reconnect (EVENT_CONNECT_RETRIED) within milliseconds of a disconnect,
# except when it dropped the connection itself for a message over ZMQ_MAXMSGSIZE: then it
# never reconnects. A disconnect with no retry scheduled this long after it gets a new SUB.
_RETRY_GRACE = 1.0

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

# What one replay reply was (`SourceDriver._on_reply`).
_END, _BATCH, _JUNK = object(), object(), object()


# A replay turn receiving decodable batches at least this fast (per second) is productive: it
# keeps its slot for _PRODUCTIVE_SLICES slices, not one, before giving way to a waiter.
_PRODUCTIVE_RATE = 200.0
_PRODUCTIVE_SLICES = 10


class _Turn:
    """One replay turn holding a slot: since when, how productive, and the scope of its current wait."""

    __slots__ = ("batches", "began", "nudged", "scope")

    def __init__(self) -> None:
        self.began = 0.0
        self.batches = 0
        self.nudged = False
        self.scope: anyio.CancelScope | None = None

    def limit(self, now: float, slice_seconds: float) -> float:
        """How long this turn may hold its slot while another source waits."""
        held = now - self.began
        productive = held > 0 and self.batches >= _PRODUCTIVE_RATE * held
        return slice_seconds * (_PRODUCTIVE_SLICES if productive else 1)


class ReplaySlots:
    """The replay slots every source of a client shares: first come, first served, and no slot kept.

    `turn` waits for a slot in arrival order. A turn that has held its slot for ``slice``
    seconds gives way as soon as another source waits (`contended`): the waiter wakes the
    oldest such holder at once, which ends its turn. A productive turn (decodable batches
    streaming in, as from an honest engine's buffer) keeps its slot for 10 slices instead, so
    slow or hostile endpoints yield first. So a few slow or hostile replay endpoints delay an
    honest source's replay by at most about one slice.
    """

    def __init__(self, capacity: int, slice_seconds: float) -> None:
        self._limiter = anyio.CapacityLimiter(capacity)
        self.slice = slice_seconds
        self._holders: dict[_Turn, None] = {}  # oldest first

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[_Turn]:
        """Hold one slot for the body of the ``async with``."""
        turn = _Turn()
        if self._limiter.available_tokens < 1:
            self._nudge()
        await self._limiter.acquire_on_behalf_of(turn)
        turn.began = anyio.current_time()
        self._holders[turn] = None
        try:
            yield turn
        finally:
            del self._holders[turn]
            self._limiter.release_on_behalf_of(turn)

    @property
    def contended(self) -> bool:
        """Some source waits for a slot."""
        return self._limiter.statistics().tasks_waiting > 0

    def _nudge(self) -> None:
        now = anyio.current_time()
        for turn in self._holders:
            if not turn.nudged and now - turn.began >= turn.limit(now, self.slice) and turn.scope is not None:
                turn.nudged = True
                turn.scope.cancel()
                return


class _ReplayRun:
    """One replay request across its turns: what came back and what it may still spend."""

    __slots__ = ("budget", "complete", "cut", "deadline", "item_bytes", "items", "replies", "silent_left")

    def __init__(self, deadline: float, budget: int, silent_left: float) -> None:
        self.deadline = deadline
        self.budget = budget
        #: Slot time left without a decodable reply before the request is given up.
        self.silent_left = silent_left
        self.replies = 0
        #: Payload bytes received: the items are bounded like held batches (``held_bytes``).
        self.item_bytes = 0
        self.items: list[tuple[int, float, EventBatch | None]] = []
        self.complete = False
        #: Why the request ended before its end marker (a deadline or budget), if it did.
        self.cut: str | None = None


_MiB = 1 << 20

# What a SubscriberConfig field that is not a plain int must be, for the type error message.
_KIND = {
    "limits": "a kvroute.Limits",
    "tcp_keepalive": "a bool",
    "native_receive": "a bool",
    "curve_public_key": "a z85 str or None",
    "curve_secret_key": "a z85 str or None",
    "rcvhwm": "an int or None",
    "max_sources": "an int or None",
    **{
        name: "a number"
        for name in (
            "reconnect_ivl",
            "reconnect_ivl_max",
            "replay_timeout",
            "replay_deadline",
            "replay_slice",
            "quiet_interval",
        )
    },
}


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How `KvEventClient` subscribes: socket options, replay bounds, memory budgets, fan-out and decode limits.

    Times are in seconds, sizes in bytes. Defaults:

    - ``max_message_size`` 4 MiB: a step's batch is far smaller (a 65,536-token step is
      ~0.3 MB of msgpack); larger messages make libzmq drop the connection.
    - ``queue_bytes`` 64 MiB: what each socket (SUB, replay DEALER) may queue inside libzmq.
      Its receive high-water mark is at most ``queue_bytes // max_message_size`` messages
      (at least 1): past it the engine's side buffers (its PUB holds 100,000 batches).
    - ``rcvhwm`` None: use the source's advertised ``hwm``, else libzmq's 1,000; either way
      clamped to [1, ``queue_bytes // max_message_size``] (an advertised 0, libzmq's
      "unlimited", never is).
    - ``wakeup_bytes`` 4 MiB: payload bytes the receiver takes from one socket per visit
      (at least one message) before it turns to the next; it yields to the event loop every
      5 ms of work, so a flood never blocks the loop for long.
    - ``held_bytes`` 8 MiB: payload bytes of the live batches held while a replay is
      outstanding (decoded, an engine's batch takes ~7x its payload); past it the newest
      held batch is dropped (a replay fetches it again; counted in ``overflows``), as past
      ``max_held`` batches.
      One replay answer is read up to the same size before it is handed over.
    - ``reconnect_ivl`` 0.1 / ``reconnect_ivl_max`` 5.0: libzmq's 100 ms first retry, backing
      off to 5 s against an engine that stays down.
    - ``tcp_keepalive`` True: the OS probes idle connections, so a vanished host is noticed.
    - ``replay_timeout`` 1.0: the longest a replay holds a slot without a decodable reply (for
      the first one, and between replies; junk does not count); an idle engine may answer
      ~100 ms late (docs/protocol.md §4).
    - ``replay_deadline`` 30.0 / ``replay_budget`` 100,000: one replay request ends after
      this long or this many replies (malformed ones included), end marker or not; what
      came is applied and the rest asked again.
    - ``replay_slice`` 0.1: a replay holding a slot this long gives it up as soon as another
      source waits for one (its replies so far are applied; it queues again for the rest);
      one streaming decodable batches (>= 200/s) keeps it for 10 slices. So a few slow or
      hostile replay endpoints cannot starve the others.
    - ``max_concurrent_replays`` 8: replay slots shared by all sources; each engine serves
      one at a time, and a reconnect storm must not stall every pump at once.
    - ``quiet_interval`` 2.0: a source silent this long gets a replay probe (docs/recovery.md rules
      7-8: lost tail, silent restart); one small request per source per interval. Silent means
      its SUB had nothing to read: a client that is slow itself probes nobody for it.
    - ``recv_batch`` 1024: messages taken from one socket per visit, at most 64 (then the
      other ready sockets get their turn).
    - ``events_buffer`` 10,000: envelopes buffered per `events()` iterator before the
      oldest are dropped.
    - ``max_sources`` None: sources subscribed at once, more are refused (logged, counted).
      None = as many as the process's file descriptors and the zmq context's socket limit
      allow, at most 4,096 (checked when the client starts; an explicit value that does
      not fit raises `ConfigError` there).
    - ``curve_public_key`` / ``curve_secret_key``: the client's CURVE key pair (z85); used
      for every source that names a ``curve_server_key``. Never shown by ``repr``.
    - ``limits``: decode caps per batch (`Limits`).
    - ``native_receive`` False: read every plaintext tcp:// and ipc:// source's SUB on the
      compiled core's receive thread (`NativeReceiver`), which applies in-order batches itself
      and hands the rest to the recovery machine (docs/architecture.md, "The native loop");
      CURVE and inproc:// sources stay on the Python receiver. ``held_bytes`` then also bounds
      the messages the thread has handed over and Python has not taken yet, client-wide.

    Memory, per source, at most: ``queue_bytes`` queued in libzmq (SUB), ``held_bytes`` of
    payload held behind an outstanding replay (about 7x that decoded), and its index state;
    and per replay slot one answer of up to ``held_bytes`` (x7 decoded). Held batches exist
    only for a source with a gap or an identity check pending, never because the client
    is slow: a client past its ceiling leaves the backlog in the engines' PUB queues (which
    drop past their high-water mark: gaps, fetched again by replay within these bounds).

    Invalid values, wrong types included, raise `ConfigError` (a `KvRouteError` and a
    `ValueError`).
    """

    max_message_size: int = 4 * _MiB
    queue_bytes: int = 64 * _MiB
    rcvhwm: int | None = None
    wakeup_bytes: int = 4 * _MiB
    held_bytes: int = 8 * _MiB
    reconnect_ivl: float = 0.1
    reconnect_ivl_max: float = 5.0
    tcp_keepalive: bool = True
    replay_timeout: float = 1.0
    replay_deadline: float = 30.0
    replay_budget: int = 100_000
    replay_slice: float = 0.1
    max_concurrent_replays: int = 8
    quiet_interval: float = 2.0
    recv_batch: int = 1024
    events_buffer: int = 10_000
    max_sources: int | None = None
    curve_public_key: str | None = None
    curve_secret_key: str | None = None
    limits: Limits = msgspec.field(default_factory=Limits)
    native_receive: bool = False

    def __post_init__(self) -> None:
        # msgspec checks types when decoding, not when a Struct is built by hand: check here,
        # so a wrong type is a ConfigError now rather than a TypeError inside a running driver.
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            if f.name == "limits":
                ok = isinstance(value, Limits)
            elif f.name in ("tcp_keepalive", "native_receive"):
                ok = isinstance(value, bool)
            elif f.name.startswith("curve_"):
                ok = value is None or isinstance(value, str)
            elif value is None and f.name in ("rcvhwm", "max_sources"):
                ok = True
            elif isinstance(f.default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                raise ConfigError(f"{f.name} must be {_KIND.get(f.name, 'an int')}, not {value!r}")
        if (self.curve_public_key is None) != (self.curve_secret_key is None):
            raise ConfigError("curve_public_key and curve_secret_key go together")
        for name in ("replay_timeout", "quiet_interval", "reconnect_ivl", "replay_deadline", "replay_slice"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, not {value!r}")
        if not (math.isfinite(self.reconnect_ivl_max) and self.reconnect_ivl_max >= 0):
            raise ConfigError(f"reconnect_ivl_max must be a finite number >= 0, not {self.reconnect_ivl_max!r}")
        for name in (
            "max_concurrent_replays",
            "recv_batch",
            "events_buffer",
            "max_sources",
            "rcvhwm",
            "max_message_size",
            "queue_bytes",
            "wakeup_bytes",
            "held_bytes",
            "replay_budget",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, not {value!r}")
        if self.max_message_size >= 1 << 63:
            raise ConfigError(f"max_message_size must be < 2**63, not {self.max_message_size}")

    def __repr__(self) -> str:
        # The secret key never reaches a log line or a traceback through repr.
        fields = ", ".join(
            f"{name}={'<secret>' if name == 'curve_secret_key' and value is not None else repr(value)}"
            for name, value in msgspec.structs.asdict(self).items()
        )
        return f"SubscriberConfig({fields})"

    def sub_rcvhwm(self, advertised: int | None) -> int:
        """The receive high-water mark a socket gets: the configured or advertised one, within the byte budget."""
        cap = max(1, self.queue_bytes // self.max_message_size)
        wanted = self.rcvhwm if self.rcvhwm is not None else advertised if advertised is not None else 1000
        # An advertised 0 is libzmq's "unlimited" (and a negative one is nonsense): the cap.
        return cap if wanted < 1 else min(wanted, cap)


def source_problem(
    source: EventSource, context: zmq.Context[zmq.Socket[bytes]], config: SubscriberConfig
) -> str | None:
    """Why ``source`` cannot be subscribed with this config, or None when it can.

    Tries its endpoints and keys on a throwaway socket, so a malformed endpoint or key is
    refused up front instead of failing inside a running driver.
    """
    if source.curve_server_key is not None and config.curve_public_key is None:
        return "the source requires CURVE, and no client key pair is configured"
    curve = _curve_keys(source, config)
    for endpoint in (source.endpoint, source.replay_endpoint):
        if endpoint is None:
            continue
        try:
            sock = _zmq.connect(
                context, zmq.DEALER, endpoint, curve=curve, curve_server_key=source.curve_server_key if curve else None
            )
        except (zmq.ZMQError, ValueError) as exc:
            return f"cannot connect to {endpoint!r}: {exc}"
        sock.close(linger=0)
    return None


def _curve_keys(source: EventSource, config: SubscriberConfig) -> _zmq.CurveKeys | None:
    if config.curve_public_key is None or config.curve_secret_key is None or source.curve_server_key is None:
        return None
    return _zmq.CurveKeys(config.curve_public_key, config.curve_secret_key)


def _decode_checked(decoder: BatchDecoder, payload: bytes) -> tuple[EventBatch | None, str, str]:
    """A batch the machine may take as decodable, or None with the (kind, detail) of why not."""
    try:
        batch = decoder.decode(payload)
    except DecodeError as exc:
        return None, "undecodable payload", str(exc)
    if not math.isfinite(batch.ts):
        # A NaN or infinite ts cannot tell a duplicate from a restart, nor be saved as a
        # position: the batch is a hole, like any undecodable one.
        return None, "undecodable payload", f"ts {batch.ts!r} is not finite"
    if batch.untrusted is not None:
        # A removal or clear that could not be read: applying the rest could leave blocks
        # the engine dropped. As an undecodable batch the machine asks for a replay and,
        # when that cannot fix it, resets the worker ("undecodable").
        return None, "untrusted batch", batch.untrusted
    return batch, "", ""


def _fast_apply(index: PrefixIndex, key: WorkerKey, decoder: BatchDecoder, payload: bytes) -> ApplyReport:
    """Decode one in-order live payload and apply it to ``key``'s state: the per-message fast path.

    The compiled core's raw-bytes ingest (`PrefixIndex.apply_payload`: one call, off the GIL,
    no Python object per event); ``decoder`` only lends its `Limits` and keeps the source's
    skip counts. Everything around it, the seq check before and the machine's bookkeeping
    after, stays as it is.
    """
    report = index.apply_payload(key, payload, decoder.limits)
    decoder.count_skipped(report.skipped)
    return report


# The receiver: how long one round may work before it yields to the event loop (a visit to
# one socket may overrun it), how many messages one visit takes from a socket, and how often
# it looks for quiet sources (and wakes when nothing arrives).
_SLICE = 0.005
_VISIT = 64
_QUIET_SCAN = 0.25


class _Entry:
    """One source's SUB socket and its monitor, as the receiver watches them."""

    __slots__ = ("driver", "last_read", "mon", "mon_fd", "sub", "sub_fd")

    def __init__(self, driver: SourceDriver, sub: zmq.Socket[bytes], mon: zmq.Socket[bytes], now: float) -> None:
        self.driver = driver
        self.sub = sub
        self.mon = mon
        self.sub_fd: int = sub.FD
        self.mon_fd: int = mon.FD
        #: When the receiver last read a message from the SUB (or the entry was added).
        self.last_read = now


class _LoopLeader(abc.ABC):
    """A receive loop that runs inside the drivers' session tasks: one leads, the others wait.

    The first session to call `serve` runs `_loop`; the others wait, and one takes over when
    the leader's session ends, so the loop lives exactly as long as some source does and needs
    no task of its own.
    """

    def __init__(self) -> None:
        self._leading = False
        self._vacant = anyio.Event()

    @abc.abstractmethod
    async def _loop(self) -> None:
        """The receive loop itself (`Receiver`: the OS selector; `NativeReceiver`: the core thread's pipe)."""

    async def serve(self) -> None:
        """Run the receive loop, or wait while another session runs it and take over when it ends; never returns."""
        while True:
            if self._leading:
                await self._vacant.wait()
                continue
            self._leading = True
            try:
                await self._loop()
            finally:
                self._leading = False
                vacant, self._vacant = self._vacant, anyio.Event()
                vacant.set()


class Receiver(_LoopLeader):
    """One receive loop over every source's SUB and monitor socket (instead of a task per socket).

    Each socket's descriptor is registered in one OS selector (epoll, kqueue) whose own
    descriptor the loop waits on: one wakeup of the event loop serves every socket that has
    something, however many. A round takes at most 64 messages from each ready socket in turn
    (`SourceDriver._on_messages` applies them), and yields to the event loop every 5 ms of
    work; a socket left with messages queued is visited again next round without waiting.

    Quiet (docs/recovery.md rules 7-8) is decided on the socket, not on the clock: a source is
    quiet when the selector, as of its last look, has not reported its SUB for the quiet
    interval. A loop that is slow (overload) still visits every socket with messages each
    round, so it never probes a source for kvroute's own slowness.

    The loop runs inside one of the drivers' session tasks (`_LoopLeader.serve`). Where the OS
    selector has no descriptor to wait on, the loop looks every 2 ms instead.
    """

    def __init__(self, config: SubscriberConfig) -> None:
        self._visit = max(1, min(config.recv_batch, _VISIT))
        self._wakeup_bytes = config.wakeup_bytes
        self._quiet = config.quiet_interval
        self._selector: selectors.BaseSelector | None = None
        self._entries: dict[_Entry, None] = {}
        # Entries whose SUB has (or may have) messages queued, oldest first.
        self._backlog: dict[_Entry, None] = {}
        super().__init__()
        self._next_scan = 0.0

    def add(self, driver: SourceDriver, sub: zmq.Socket[bytes], mon: zmq.Socket[bytes]) -> _Entry:
        """Watch ``sub`` and its monitor ``mon`` for ``driver`` (until `remove`)."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
        entry = _Entry(driver, sub, mon, anyio.current_time())
        self._selector.register(entry.sub_fd, selectors.EVENT_READ, entry)
        try:
            self._selector.register(entry.mon_fd, selectors.EVENT_READ, entry)
        except BaseException:
            self._selector.unregister(entry.sub_fd)
            raise
        self._entries[entry] = None
        # Messages may already be queued: a socket's descriptor signals only after a read
        # found it empty. The SUB is read in the next round; the monitor now.
        self._backlog[entry] = None
        driver._poll_monitor()
        return entry

    def remove(self, entry: _Entry) -> None:
        """Stop watching ``entry``'s sockets (before they are closed: descriptor numbers are reused)."""
        if entry not in self._entries or self._selector is None:
            return
        del self._entries[entry]
        self._backlog.pop(entry, None)
        self._selector.unregister(entry.sub_fd)
        self._selector.unregister(entry.mon_fd)
        if not self._entries:
            # The client may be leaving: hold no descriptor while no source runs.
            fd = _waitable(self._selector)
            if fd is not None:
                anyio.notify_closing(fd)
            self._selector.close()
            self._selector = None

    async def _loop(self) -> None:
        clock = time.perf_counter
        backlog = self._backlog
        while True:
            selector = self._selector
            if selector is None:
                return  # every source left (the leader is leaving too)
            if backlog:
                await anyio.lowlevel.checkpoint()
            else:
                fd = _waitable(selector)
                if fd is None:
                    await anyio.sleep(0.002)
                else:
                    with anyio.move_on_after(_QUIET_SCAN):
                        await anyio.wait_readable(fd)
            selector = self._selector
            if selector is None:
                return
            now = anyio.current_time()
            for key, _ in selector.select(0):
                entry: _Entry = key.data
                if key.fd == entry.sub_fd:
                    backlog[entry] = None
                else:
                    entry.driver._poll_monitor()
            # Every SUB not reported now (and not in the backlog) had nothing to read as of
            # `now`: the quiet scan compares with this look, not with the time of the round.
            looked = now
            yield_at = clock() + _SLICE
            wall = time.time()
            for entry in list(backlog):
                if entry not in backlog:
                    continue  # removed meanwhile
                del backlog[entry]
                if self._read(entry, now, wall):
                    backlog[entry] = None  # more queued: next round, after the others
                if clock() > yield_at:
                    await anyio.lowlevel.checkpoint()
                    yield_at = clock() + _SLICE
                    wall = time.time()
                    now = anyio.current_time()
            if looked >= self._next_scan:
                self._next_scan = looked + _QUIET_SCAN
                self._scan(looked)

    def _read(self, entry: _Entry, now: float, wall: float) -> bool:
        """Hand one visit's worth of ``entry``'s messages to its driver; True when more may be queued."""
        driver = entry.driver
        if driver._recreate or entry not in self._entries:
            return False
        try:
            msgs, more = _zmq.drain_nowait(entry.sub, self._visit, self._wakeup_bytes)
        except zmq.ZMQError:
            return False  # closed under us: its session is ending
        if msgs:
            entry.last_read = now
            driver.counters.wakeups_cut += more
            driver._on_messages(msgs, wall)
        return more and not driver._recreate

    def _scan(self, looked: float) -> None:
        quiet = self._quiet
        backlog = self._backlog
        for entry in list(self._entries):
            if entry in backlog or looked - entry.last_read < quiet or entry not in self._entries:
                continue
            entry.last_read = looked
            entry.driver._on_quiet()


def _waitable(selector: selectors.BaseSelector) -> int | None:
    """The selector's own descriptor, when the event loop can wait on it (epoll, kqueue, /dev/poll)."""
    fileno = getattr(selector, "fileno", None)
    if fileno is None or isinstance(selector, (selectors.SelectSelector, selectors.PollSelector)):
        return None
    fd: int = fileno()
    return fd


_tokens = itertools.count(1)
_index_log = logging.getLogger("kvroute.index")


class NativeReceiver(_LoopLeader):
    """The receive loop on the compiled core's own thread (`kvroute._core.NativeReceiver`), for every eligible source.

    The thread owns each source's SUB and monitor (the core's vendored libzmq, its own context),
    checks rule 1 against a mirror of the machine's state (``last_seq + 1`` and a fast-path
    flag only this side opens) and applies in-order batches to the index itself, the GIL
    released. It hands everything else over as it came: messages while the flag is closed
    (gaps, old seqs, undecodable or untrusted payloads, held batches, identity checks),
    monitor events and quiet ticks; each hand-over closes the flag. One pipe wakes the event
    loop once per batch of hand-overs: `serve` drains it, feeds ``on_applied`` with the
    thread's (seq, ts) records, passes each hand-over to its driver as the Python receiver
    would (`SourceDriver._on_messages`, `_on_monitor_event`, `_on_quiet`), and opens the flag
    again where `SourceMachine.in_order` holds. The thread opens it only once this side has
    taken every hand-over of that source, so it never applies what the machine would not have.

    Like `Receiver`, the loop runs inside one driver's session (`serve`). The thread starts with
    the first source and stops with the last. A thread that stops on its own is an error every
    serving session raises (`ClientStateError`), not a silent stall.
    """

    def __init__(self, config: SubscriberConfig, max_sources: int) -> None:
        self._cfg = config
        self._max_sockets = max_sources * _zmq.SOCKETS_PER_SOURCE + 1024
        self._core: _core.NativeReceiver | None = None
        self._fd = -1
        self._drivers: dict[int, SourceDriver] = {}
        super().__init__()
        self._dead: str | None = None
        # Set while `_drain` feeds drivers: they open their fast paths at its end, not per action.
        self.draining = False

    @staticmethod
    def eligible(source: EventSource) -> bool:
        """Sources the thread can follow: plaintext tcp:// and ipc:// (its libzmq has no CURVE, and
        inproc:// endpoints live in pyzmq's context)."""
        return source.curve_server_key is None and source.endpoint.startswith(("tcp://", "ipc://"))

    def add(self, driver: SourceDriver) -> int:
        """Subscribe ``driver``'s source on the thread (a new SUB); returns its token (OSError: libzmq refused)."""
        if self._dead is not None:
            raise ClientStateError(f"the native receive thread stopped: {self._dead}")
        core = self._core
        if core is None:
            cfg, lim = self._cfg, self._cfg.limits
            core = _core.NativeReceiver(
                driver._index._core,
                max(1, min(cfg.recv_batch, _VISIT)),
                cfg.wakeup_bytes,
                cfg.quiet_interval,
                cfg.held_bytes,
                self._max_sockets,
                lim.max_events_per_batch,
                lim.max_blocks_per_event,
                lim.max_block_size,
            )
            self._core, self._fd = core, core.fileno()
        src, cfg = driver.source, self._cfg
        token = next(_tokens)
        core.add(
            token,
            driver.key,
            src.endpoint,
            src.topic.encode("utf-8"),
            cfg.sub_rcvhwm(src.hwm),
            cfg.max_message_size,
            max(1, round(cfg.reconnect_ivl * 1000)),
            max(0, round(cfg.reconnect_ivl_max * 1000)),
            cfg.tcp_keepalive,
        )
        self._drivers[token] = driver
        return token

    def remove(self, token: int) -> None:
        """Stop following ``token`` (its sockets close on the thread; its later hand-overs are dropped)."""
        core = self._core
        if self._drivers.pop(token, None) is None or core is None:
            return
        core.remove(token)
        if not self._drivers:
            # The client may be leaving: no thread, no sockets while no source runs.
            anyio.notify_closing(self._fd)
            core.close()
            self._core, self._fd = None, -1

    def stop(self, token: int) -> None:
        """Apply nothing more for ``token`` from now on (synchronous: before its worker leaves the index)."""
        if self._core is not None and token in self._drivers:
            self._core.stop(token)

    def open(self, token: int, next_seq: int, consumed: int) -> None:
        """Let the thread apply ``token``'s batches from ``next_seq`` (see `kvroute._core.NativeReceiver.open`)."""
        if self._core is not None and token in self._drivers:
            self._core.open(token, next_seq, consumed)

    def close_fast(self, token: int) -> None:
        """Hand every message of ``token`` over until it is opened again."""
        if self._core is not None and token in self._drivers:
            self._core.close_fast(token)

    async def _loop(self) -> None:
        while True:
            if self._dead is not None:
                raise ClientStateError(f"the native receive thread stopped: {self._dead}")
            if self._core is None:
                return  # every source left (the leader is leaving too)
            try:
                await anyio.wait_readable(self._fd)
            except anyio.ClosedResourceError:
                return
            self._drain()

    def _drain(self) -> None:
        core = self._core
        if core is None:
            return
        applied, handovers, logs, dead = core.drain()
        drivers = self._drivers
        for token, seqs, tss, lags, elided, blocks, skipped in applied:
            d = drivers.get(token)
            if d is not None:
                d._native_applied(seqs, tss, lags, elided, blocks, skipped)
        for msg in logs:
            _index_log.warning("%s", msg)
        touched: dict[SourceDriver, None] = {}
        wall = time.time()
        self.draining = True
        try:
            for h in handovers:
                d = drivers.get(h[1])
                if d is None or d._recreate:
                    continue  # a removed source's, or a SUB's being recreated (a dead engine's stream)
                d._native_consumed += 1
                kind = h[0]
                if kind == 0:
                    d._on_messages([h[2]], wall)
                elif kind == 1:
                    d._on_monitor_event(_zmq.MonitorEvent(h[2], h[3], h[4]))
                else:
                    d._on_quiet()
                touched[d] = None
        finally:
            self.draining = False
        for d in touched:
            d._sync_fast()
        if dead is not None:
            log.error("the native receive thread stopped: %s", dead)
            self._dead = dead


class SourceDriver(DriverBase):
    """Subscribes to one `EventSource` and keeps its worker's index state per the recovery rules.

    `run` owns every socket and task of the source and closes them all when cancelled.
    ``limiter`` bounds replays across sources; ``on_change`` is called (synchronously)
    whenever the source's sync state or connection changes. ``resume``: the index already
    holds this worker's state through that position (a restored snapshot); the source
    resumes from it (`SourceMachine.resume`) instead of starting cold.
    """

    def __init__(
        self,
        source: EventSource,
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        config: SubscriberConfig,
        index: PrefixIndex,
        sink: EventSink,
        limiter: ReplaySlots,
        on_change: Callable[[], None],
        resume: Cursor | None = None,
        receiver: Receiver | None = None,
        native: NativeReceiver | None = None,
    ) -> None:
        super().__init__(
            source,
            index=index,
            sink=sink,
            on_change=on_change,
            has_replay=source.replay_endpoint is not None,
            max_held_bytes=config.held_bytes,
            resume=resume,
        )
        self._ctx = context
        self._cfg = config
        self._limiter = limiter
        self._decoder = BatchDecoder(config.limits)
        self._curve = _curve_keys(source, config)
        self._dealer: zmq.Socket[bytes] | None = None
        self._replay_request: RequestReplay | None = None
        self._replay_wakeup: anyio.Event | None = None
        self._session: anyio.CancelScope | None = None
        self._session_tg: anyio.abc.TaskGroup | None = None
        self._awaiting_retry = False
        self._monitor: zmq.Socket[bytes] | None = None
        self._replay_scope: anyio.CancelScope | None = None
        self._recreate = False
        # The client's transport shares one receiver among its drivers; a lone driver has its own.
        self._receiver = receiver if receiver is not None else Receiver(config)
        # The client's native receive thread, when configured and this source is one it can follow.
        self._native = native if native is not None and NativeReceiver.eligible(source) else None
        # This SUB's token on the thread, the hand-overs taken for it, and the last fast-path open sent.
        self._native_token: int | None = None
        self._native_consumed = 0
        self._native_opened: tuple[int, int] | None = None
        #: Batches the native thread applied for this source.
        self.native_batches = 0
        #: Seconds from the newest applied live batch's ts (the engine's clock) to its apply.
        self.apply_lag = 0.0

    def stop(self) -> None:
        """`DriverBase.stop`, and the native thread applies nothing more for this source from now on."""
        super().stop()
        if self._native is not None and self._native_token is not None:
            self._native.stop(self._native_token)

    def refresh_counters(self) -> None:
        """The decoder counts unknown event types itself."""
        self.counters.unknown_events = self._decoder.unknown_events

    def stats(self) -> SourceStats:
        """A snapshot of this source's counters and condition, with its apply lag."""
        return msgspec.structs.replace(super().stats(), apply_lag=self.apply_lag)

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and follow the source until cancelled; every socket is closed on the way out."""
        self._replay_wakeup = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                if self.source.replay_endpoint is not None:
                    tg.start_soon(self._replay_loop)
                self.execute(self.first_actions())
                while True:
                    await self._run_session()
        finally:
            self._close_dealer()
            self.connected = False

    async def _run_session(self) -> None:
        if self._native is not None:
            await self._run_native_session(self._native)
            return
        # One SUB socket's life: recreated on the machine's request (a restarted engine's
        # dead messages are still queued in the old one, docs/recovery.md rule 2). The
        # client's `Receiver` reads it (and its monitor) with every other source's.
        src, cfg = self.source, self._cfg
        sub = _zmq.socket(
            self._ctx,
            zmq.SUB,
            rcvhwm=cfg.sub_rcvhwm(src.hwm),
            max_message_size=cfg.max_message_size,
            reconnect_ivl=cfg.reconnect_ivl,
            reconnect_ivl_max=cfg.reconnect_ivl_max,
            tcp_keepalive=cfg.tcp_keepalive,
            curve=self._curve,
            curve_server_key=src.curve_server_key if self._curve is not None else None,
            subscribe=src.topic.encode("utf-8"),
        )
        try:
            mon = _zmq.open_monitor(sub, _MONITOR_EVENTS)
        except BaseException:
            _zmq.close(sub)
            raise
        self._recreate = False
        entry: _Entry | None = None
        try:
            sub.connect(src.endpoint)
            async with anyio.create_task_group() as tg:
                self._session = tg.cancel_scope
                self._session_tg = tg
                self._monitor = mon
                entry = self._receiver.add(self, sub, mon)
                if src.endpoint.startswith("inproc://"):
                    # inproc has no connection handshake, so its monitor never reports one:
                    # the pipe exists as soon as connect returns.
                    self._set_connected()
                if not self._recreate:
                    # Returns never: cancelled when the source leaves or its SUB is recreated.
                    await self._receiver.serve()
                tg.cancel_scope.cancel()
        finally:
            self._session = None
            self._session_tg = None
            self._awaiting_retry = False
            self._monitor = None
            if entry is not None:
                self._receiver.remove(entry)
            _zmq.close(sub, monitor=mon)
            if self.connected:
                self.connected = False
                self._on_change()

    async def _run_native_session(self, native: NativeReceiver) -> None:
        # As `_run_session`, with the SUB and its monitor on the native thread.
        self._recreate = False
        self._native_consumed = 0
        self._native_opened = None
        token: int | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._session = tg.cancel_scope
                self._session_tg = tg
                token = self._native_token = native.add(self)
                self._sync_fast()
                if not self._recreate:
                    await native.serve()
                tg.cancel_scope.cancel()
        finally:
            self._session = None
            self._session_tg = None
            self._awaiting_retry = False
            self._native_token = None
            if token is not None:
                native.remove(token)
            if self.connected:
                self.connected = False
                self._on_change()

    def _native_applied(
        self, seqs: list[int], tss: list[float], lags: list[float], elided: int, blocks: int, skipped: dict[str, int]
    ) -> None:
        """What the native thread applied for this source since the last drain: rule 1's bookkeeping, in bulk.

        ``seqs``/``tss``: the newest applied batches in order (at most the ts ring's worth);
        ``elided`` older ones only counted; ``lags``: wall clock at apply minus ts.
        """
        if self._stopped:
            return
        self.native_batches += len(seqs) + elided
        on_applied = self.machine.on_applied
        for seq, ts in zip(seqs, tss):
            on_applied(seq, ts)
        self.counters.batches += elided
        self.counters.messages += len(seqs) + elided
        self.counters.blocks += blocks
        if skipped:
            self._decoder.count_skipped(skipped)
        if lags:
            self.apply_lag = max(0.0, lags[-1])
        if self._sink.active and self._native is not None and self._native_token is not None:
            # A listener wants every batch as an event: the general path from here on.
            self._native.close_fast(self._native_token)
            self._native_opened = None

    def _sync_fast(self) -> None:
        """Open the native fast path where rule 1 holds now (the thread closes it itself at each hand-over)."""
        native, token = self._native, self._native_token
        if native is None or token is None:
            return
        m = self.machine
        if self._stopped or self._recreate or self._sink.active or not m.in_order(m.last_seq + 1):
            return
        want = (m.last_seq + 1, self._native_consumed)
        if want != self._native_opened:
            self._native_opened = want
            native.open(token, *want)

    def _on_messages(self, msgs: list[list[bytes]], wall: float) -> None:
        """Live messages the receiver read from the SUB, in order; ``wall``: time.time() when read.

        The hot path (docs/recovery.md rule 1): a message the machine says is in order is
        decoded and applied here, through `_fast_apply`, and reported with `on_applied`;
        everything else (gaps, restarts, holes, held batches, events() listeners) goes
        through `SourceMachine.on_live` and `execute`.
        """
        counters = self.counters
        counters.messages += len(msgs)
        # A disconnect must reach the machine before any message that came after it (a
        # restarted engine's first seqs would pass for the old one's). libzmq emits the
        # event before it reconnects, so whatever is queued in the monitor now is older
        # than the newest message just read: report it first. Early is safe: the machine
        # then holds the batch until the identity check answers.
        self._poll_monitor()
        if self._recreate:
            return
        machine = self.machine
        in_order, on_applied, on_live = machine.in_order, machine.on_applied, machine.on_live
        # The fast path builds no EventBatch for listeners: with an events() iterator (or
        # once stopped) every message takes the general path.
        fast = not self._sink.active and not self._stopped
        index, key, decoder = self._index, self.key, self._decoder
        nan = math.nan
        newest_ts = nan
        for frames in msgs:
            if len(frames) != 3 or len(frames[1]) != 8:
                counters.skipped_frames += 1
                self._log.warn("skipped message", f"{len(frames)} frames, expected [topic, seq8, payload]")
                continue
            payload = frames[2]
            seq = int.from_bytes(frames[1], "big")
            if fast and in_order(seq):
                report = _fast_apply(index, key, decoder, payload)
                if report.ok:
                    on_applied(seq, report.ts)
                    counters.blocks += report.stored_blocks
                    newest_ts = report.ts
                    continue
                self._bad_payload(report.error_kind, report.error)
                actions = on_live(seq, nan, None, len(payload))
            else:
                batch = self._decode(payload)
                actions = on_live(seq, batch.ts if batch is not None else nan, batch, len(payload))
                if batch is not None:
                    newest_ts = batch.ts
            if len(actions) == 1 and type(actions[0]) is Apply:
                self.apply(actions[0].items)
            else:
                self.execute(actions)
                if self._recreate:
                    break  # the rest came from the engine process that just died
        if newest_ts == newest_ts:  # not NaN: something was read with a ts
            self.apply_lag = max(0.0, wall - newest_ts)

    def _bad_payload(self, kind: str, detail: str) -> None:
        self.counters.decode_errors += 1
        self._log.warn(kind, detail)

    def _on_quiet(self) -> None:
        """The receiver saw nothing on the SUB for the quiet interval (docs/recovery.md rules 7-8)."""
        # A disconnected source has nothing new to tell, and a probe to a dead engine would
        # hold a replay slot for the whole timeout; reconnecting checks it anyway. Quiet
        # ticks only ever lead to a replay probe: no endpoint, no ticks.
        if self.connected and self.source.replay_endpoint is not None:
            self.execute(self.machine.on_quiet())

    def _decode(self, payload: bytes) -> EventBatch | None:
        batch, kind, detail = _decode_checked(self._decoder, payload)
        if batch is None:
            self._bad_payload(kind, detail)
        return batch

    def _poll_monitor(self) -> None:
        # Drained to EAGAIN: only then does the monitor's descriptor signal the next event
        # (the receiver waits on it).
        while (mon := self._monitor) is not None:
            events = _zmq.recv_nowait(mon, 64)
            for frames in events:
                self._on_monitor(frames)
            if len(events) < 64:
                return

    def _on_monitor(self, frames: list[bytes]) -> None:
        ev = _zmq.read_monitor(frames)
        if ev is not None:
            self._on_monitor_event(ev)

    def _on_monitor_event(self, ev: _zmq.MonitorEvent) -> None:
        if ev.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_connected()
        elif ev.event == zmq.EVENT_DISCONNECTED:
            if not self._awaiting_retry and self._session_tg is not None:
                self._awaiting_retry = True
                self._session_tg.start_soon(self._expect_retry)
            if self.connected:
                self.connected = False
                self.execute(self.machine.on_disconnected())
                self._on_change()
        elif ev.event == zmq.EVENT_CONNECT_RETRIED:
            self._awaiting_retry = False
        elif ev.event & _HANDSHAKE_FAILED:
            self._log.warn("handshake failed", f"zmq event {ev.event} from {ev.endpoint} (CURVE keys?)")

    async def _expect_retry(self) -> None:
        await anyio.sleep(_RETRY_GRACE)
        if self._awaiting_retry and self._session is not None:
            self._log.warn(
                "connection dropped for good", "libzmq scheduled no reconnect (a message over max_message_size?)"
            )
            self._recreate = True
            self._session.cancel()

    def _set_connected(self) -> None:
        self._awaiting_retry = False
        self.connected = True
        self.execute(self.machine.on_reconnected())
        self._on_change()

    # --- replay -------------------------------------------------------------------------------

    async def _replay_loop(self) -> None:
        while True:
            assert self._replay_wakeup is not None  # created by run()
            await self._replay_wakeup.wait()
            self._replay_wakeup = anyio.Event()
            request, self._replay_request = self._replay_request, None
            if request is None:
                continue
            with anyio.CancelScope() as scope:
                self._replay_scope = scope
                items, complete, failure = await self._replay(request.from_seq)
            self._replay_scope = None
            if scope.cancelled_caught:
                # The machine abandoned this request (restart, disconnect): stop waiting for
                # it; its late replies die with the DEALER.
                self._close_dealer()
                items, complete, failure = [], False, "abandoned"
            self._poll_monitor()  # a disconnect first, as for live messages
            if failure is not None:
                self.execute(self.machine.on_replay_failed(failure))
            else:
                self.execute(self.machine.on_replay(items, complete=complete))

    async def _replay(self, start: int) -> tuple[list[tuple[int, float, EventBatch | None]], bool, str | None]:
        """Ask for every buffered batch from ``start``; returns (items, end marker seen, failure).

        Fair and bounded (README "Security and limits"): the request is carried out in turns,
        each holding one of the client's replay slots. A turn ends at the end marker; when
        other sources wait for a slot and it has held its own for ``replay_slice`` (with
        replies so far, the machine gets them and asks for the rest; with none, the request
        goes to the back of the queue and is sent again); or when the request as a whole
        passes ``replay_deadline``, ``replay_budget`` replies (malformed ones count), or
        ``replay_timeout`` of slot time without a decodable reply (junk does not keep it open).
        """
        cfg = self._cfg
        run = _ReplayRun(anyio.current_time() + cfg.replay_deadline, cfg.replay_budget, cfg.replay_timeout)
        while True:
            async with self._limiter.turn() as turn:
                yielded = await self._replay_turn(start, run, turn)
            if not yielded:
                break
            # Gave the slot up with nothing to show: re-queue behind whoever waited (FIFO).
            self.counters.replay_yields += 1
        # The DEALER lives only while its request runs: 4,096 idle sources hold no replay
        # socket (descriptors, `kvroute._zmq.FDS_PER_SOURCE`), and late replies to this request
        # cannot pass for answers to the next one (the engine answers each connection apart).
        self._close_dealer()
        if not run.complete:
            if run.cut is not None:
                self.counters.replay_cutoffs += 1
                self._log.warn("replay cut short", run.cut)
            if not run.items:
                return run.items, False, run.cut or f"no reply within {cfg.replay_timeout:g} s"
        return run.items, run.complete, None

    async def _replay_turn(self, start: int, run: _ReplayRun, turn: _Turn) -> bool:
        """One turn holding a replay slot; True when it yielded the slot with no reply to hand over."""
        endpoint = self.source.replay_endpoint
        assert endpoint is not None  # the replay task runs only for sources with one
        cfg = self._cfg
        if self._dealer is None:
            try:
                self._dealer = _zmq.connect(
                    self._ctx,
                    zmq.DEALER,
                    endpoint,
                    rcvhwm=cfg.sub_rcvhwm(None),
                    max_message_size=cfg.max_message_size,
                    reconnect_ivl=cfg.reconnect_ivl,
                    reconnect_ivl_max=cfg.reconnect_ivl_max,
                    tcp_keepalive=cfg.tcp_keepalive,
                    curve=self._curve,
                    curve_server_key=self.source.curve_server_key if self._curve is not None else None,
                )
            except zmq.ZMQError as exc:
                # Out of sockets or descriptors for a moment (libzmq reaps closed sockets in
                # its own thread, late on a starved machine): a failed replay, asked again
                # by the machine's rules, not a failed source.
                run.cut = f"cannot open the replay socket: {exc}"
                return False
        dealer = self._dealer
        if not _zmq.send_nowait(dealer, [b"", start.to_bytes(8, "big")]):
            self._close_dealer()
            run.cut = "replay request refused (queue full)"
            return False
        clock = anyio.current_time
        began = last = clock()
        slots = self._limiter
        # The machine holds at most max_held batches; reading more than that from one answer
        # only buys memory a publisher that never sends the end marker could exhaust.
        cap = self.machine.max_held
        items = run.items
        while len(items) < cap and run.item_bytes < cfg.held_bytes:
            now = clock()
            run.silent_left -= now - last
            last = now
            if now >= run.deadline:
                run.cut = f"past the replay deadline ({cfg.replay_deadline:g} s)"
                return False
            if run.replies >= run.budget:
                run.cut = f"past the reply budget ({run.budget} replies)"
                return False
            if run.silent_left <= 0:
                return False
            turn_limit = turn.limit(now, cfg.replay_slice)
            past_slice = now - began >= turn_limit
            if past_slice and slots.contended:
                if items:
                    return False  # the machine applies these and asks for the rest, in its turn
                self._close_dealer()
                return True
            # Within the slice, wake at its end to look for waiters; past it, a waiter wakes us.
            until = min(run.deadline, now + run.silent_left)
            if not past_slice:
                until = min(until, began + turn_limit)
            msgs: list[list[bytes]] = []
            with anyio.CancelScope(deadline=until) as scope:
                turn.scope = scope
                msgs, _ = await _zmq.recv_budget(
                    dealer, min(cfg.recv_batch, run.budget - run.replies), cfg.wakeup_bytes
                )
            turn.scope = None
            for frames in msgs:
                run.replies += 1
                run.item_bytes += len(frames[-1])
                outcome = self._on_reply(frames, items)
                if outcome is _END:
                    run.complete = True
                    return False
                if outcome is _BATCH:
                    turn.batches += 1
                    run.silent_left = cfg.replay_timeout
                    last = clock()
        return False

    def _on_reply(self, frames: list[bytes], items: list[tuple[int, float, EventBatch | None]]) -> object:
        # Newer engines reply [b"", topic, seq8, payload], older [b"", seq8, payload]; accept
        # both from every source (docs/protocol.md §4). Returns _END, _BATCH (decodable) or _JUNK.
        n = len(frames)
        if n == 4 and not frames[0]:
            seq8, payload = frames[2], frames[3]
        elif n == 3 and not frames[0]:
            seq8, payload = frames[1], frames[2]
        else:
            self.counters.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{n} frames")
            return _JUNK
        if len(seq8) != 8:
            self.counters.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{len(seq8)}-byte seq")
            return _JUNK
        if seq8 == _END_SEQ:
            return _END
        self.counters.replayed_batches += 1
        batch = self._decode(payload)
        items.append((int.from_bytes(seq8, "big"), batch.ts if batch is not None else math.nan, batch))
        return _BATCH if batch is not None else _JUNK

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            _zmq.close(self._dealer)
            self._dealer = None

    # --- actions --------------------------------------------------------------------------------

    def on_action(self, action: Action) -> None:
        """Ask a replay (the replay task carries it out) or recreate the SUB socket."""
        if isinstance(action, RequestReplay):
            self._replay_request = action
            if self._replay_wakeup is not None:
                self._replay_wakeup.set()
        elif isinstance(action, RecreateSubscriber):
            self._recreate = True
            if self._session is not None:
                self._session.cancel()

    def after_actions(self) -> None:
        """Stop waiting for a replay the machine abandoned (restart, disconnect); reopen the native fast path."""
        if self._replay_scope is not None and self.machine.replay_abandoned:
            self._replay_scope.cancel()
        if self._native is not None and not self._native.draining:
            # A replay answer (or a timer) moved the machine outside a drain: the thread may
            # take over again (within a drain, `NativeReceiver._drain` opens at its end).
            self._sync_fast()
