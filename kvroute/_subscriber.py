"""The per-source driver: one SUB (and a DEALER for replay) moving bytes and time for a `SourceMachine`.

The recovery rules live in the sans-I/O `kvroute._source.SourceMachine`; this module only feeds it
(live messages, replay results, socket monitor events, quiet ticks) and carries out what it
returns (apply batches to the index, ask for a replay, reset the worker, recreate the SUB, emit
lifecycle events). Every frame that is not what docs/protocol.md §2 and §4 describe is counted and
skipped, with a rate-limited log line: bad input never stops the pump.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import msgspec
import zmq

from . import _zmq
from ._errors import DecodeError
from ._events import Envelope, LifecycleEvent, Partial, Reset
from ._index import PrefixIndex
from ._models import EventSource, SourceState, WorkerStatus
from ._snapshot import Cursor
from ._source import Action, Apply, Emit, RecreateSubscriber, RequestReplay, ResetWorker, SourceMachine
from ._wire import BatchDecoder, BlockStored, EventBatch, Limits

__all__ = ["EventSink", "RateLimitedLog", "SourceDriver", "SourceStats", "SubscriberConfig", "source_problem"]

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

# One warning per kind of trouble per source per 10 s: a publisher spewing garbage at line
# rate must not turn the router's log into the bottleneck (the counts are in the stats).
_LOG_EVERY = 10.0


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How `KvEventClient` subscribes: socket options, replay bounds, fan-out and decode limits.

    Times are in seconds. Defaults:

    - ``max_message_size`` 16 MiB: a step's batch is far smaller (a 65,536-token step is
      ~0.3 MB of msgpack); larger messages make libzmq drop the connection.
    - ``reconnect_ivl`` 0.1 / ``reconnect_ivl_max`` 5.0: libzmq's 100 ms first retry, backing
      off to 5 s against an engine that stays down.
    - ``tcp_keepalive`` True: the OS probes idle connections, so a vanished host is noticed.
    - ``rcvhwm`` None: use the source's advertised ``hwm`` (engines publish with 100,000),
      else libzmq's 1,000.
    - ``replay_timeout`` 1.0: the longest wait for the first reply and between replies; an
      idle engine may answer ~100 ms late (docs/protocol.md §4).
    - ``max_concurrent_replays`` 8: replays in flight across all sources; each engine
      serves one at a time, and a reconnect storm must not stall every pump at once.
    - ``quiet_interval`` 2.0: a source silent this long gets a replay probe (docs/recovery.md rules
      7-8: lost tail, silent restart); one small request per source per interval.
    - ``recv_batch`` 1024: messages drained per wakeup before yielding to other sources.
    - ``events_buffer`` 10,000: envelopes buffered per `events()` iterator before the
      oldest are dropped.
    - ``max_sources`` 4096: sources subscribed at once; more are refused (logged, counted).
    - ``curve_public_key`` / ``curve_secret_key``: the client's CURVE key pair (z85); used
      for every source that names a ``curve_server_key``.
    - ``limits``: decode caps per batch (`Limits`).
    """

    max_message_size: int = 16 * 1024 * 1024
    reconnect_ivl: float = 0.1
    reconnect_ivl_max: float = 5.0
    tcp_keepalive: bool = True
    rcvhwm: int | None = None
    replay_timeout: float = 1.0
    max_concurrent_replays: int = 8
    quiet_interval: float = 2.0
    recv_batch: int = 1024
    events_buffer: int = 10_000
    max_sources: int = 4096
    curve_public_key: str | None = None
    curve_secret_key: str | None = None
    limits: Limits = msgspec.field(default_factory=Limits)

    def __post_init__(self) -> None:
        if (self.curve_public_key is None) != (self.curve_secret_key is None):
            raise ValueError("curve_public_key and curve_secret_key go together")
        for name in ("replay_timeout", "quiet_interval", "reconnect_ivl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("max_concurrent_replays", "recv_batch", "events_buffer", "max_sources"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class SourceStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one source since it was added.

    ``messages``: live messages received; ``batches`` / ``blocks``: batches applied to the
    index (live or replayed) and the blocks they stored; ``decode_errors``: payloads that did
    not decode; ``unknown_events``: events of an unknown ``type``, skipped (docs/protocol.md §3);
    ``skipped_frames``: messages of the wrong shape (live or replay);
    ``gaps``: seq gaps seen; ``replays``: replay requests sent; ``replayed_batches``: batches
    received in replies; ``resets``: times the worker's index state was dropped;
    ``last_seq``: the last applied seq (-1 before any); ``connected``: the SUB has a
    publisher; ``partial`` / ``state``: as in `WorkerStatus`.
    """

    messages: int = 0
    batches: int = 0
    blocks: int = 0
    decode_errors: int = 0
    unknown_events: int = 0
    skipped_frames: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    resets: int = 0
    last_seq: int = -1
    connected: bool = False
    partial: bool = False
    state: SourceState = "syncing"


class EventSink(Protocol):
    """Where a driver sends envelopes (the client's fan-out to `events()` iterators)."""

    @property
    def active(self) -> bool:
        """True when someone listens; engine-event envelopes are built only then."""
        ...

    def publish(self, envelope: Envelope) -> None:
        """Deliver one envelope without blocking."""
        ...


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


class RateLimitedLog:
    """Warnings about one thing (a source, the client), at most one per kind per 10 s, with a count of the rest."""

    __slots__ = ("_logger", "_next", "_suppressed", "_who")

    def __init__(self, who: str, logger: logging.Logger = log) -> None:
        self._who = who
        self._logger = logger
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, detail: str) -> None:
        """Log ``detail`` under ``kind`` unless that kind was logged in the last 10 s (then count it)."""
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._next[kind] = now + _LOG_EVERY
        more = self._suppressed.pop(kind, 0)
        suffix = f" ({more} more since the last report)" if more else ""
        self._logger.warning("%s: %s: %s%s", self._who, kind, detail, suffix)


class SourceDriver:
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
        limiter: anyio.CapacityLimiter,
        on_change: Callable[[], None],
        resume: Cursor | None = None,
    ) -> None:
        self.source = source
        self.key = source.key
        self.machine = SourceMachine(has_replay=source.replay_endpoint is not None)
        # Resumed now, not in run(): the restored state is the machine's from the start, so
        # `cursor` reports it even before the task runs. Its actions are carried out in run().
        self._first_actions = self.machine.resume(resume.seq, resume.ts) if resume is not None else None
        self._ctx = context
        self._cfg = config
        self._index = index
        self._sink = sink
        self._limiter = limiter
        self._on_change = on_change
        self._decoder = BatchDecoder(config.limits)
        self._log = RateLimitedLog(f"{source.worker_id}[{source.dp_rank}] {source.endpoint}")
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
        # Set by stop(): the index and the listeners are no longer this driver's to touch.
        self._stopped = False
        self._last_activity = 0.0
        self.connected = False
        # counters (plain ints on the hot path; `stats()` snapshots them)
        self.messages = 0
        self.batches = 0
        self.blocks = 0
        self.decode_errors = 0
        self.skipped_frames = 0
        self.gaps = 0
        self.replays = 0
        self.replayed_batches = 0
        self.resets = 0

    # --- views ----------------------------------------------------------------------------------

    def status(self) -> WorkerStatus:
        """The worker's sync state as the router reads it."""
        return WorkerStatus(state=self.machine.state, partial=self.machine.partial)

    def stop(self) -> None:
        """Stop touching the index and the listeners at once; cancel `run` to close the sockets.

        Cancellation reaches a task only at its next checkpoint: a task already woken with
        messages would otherwise apply them after its worker was removed (or replaced by a
        new engine's source), leaving blocks no source will ever remove.
        """
        self._stopped = True

    def cursor(self) -> Cursor | None:
        """The newest applied seq and its ts while the index holds this source's run (`SourceMachine.applied`)."""
        applied = self.machine.applied
        return Cursor(*applied) if applied is not None else None

    def stats(self) -> SourceStats:
        """A snapshot of this source's counters."""
        m = self.machine
        return SourceStats(
            messages=self.messages,
            batches=self.batches,
            blocks=self.blocks,
            decode_errors=self.decode_errors,
            unknown_events=self._decoder.unknown_events,
            skipped_frames=self.skipped_frames,
            gaps=self.gaps,
            replays=self.replays,
            replayed_batches=self.replayed_batches,
            resets=self.resets,
            last_seq=m.last_seq,
            connected=self.connected,
            partial=m.partial,
            state=m.state,
        )

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and follow the source until cancelled; every socket is closed on the way out."""
        self._replay_wakeup = anyio.Event()
        self._last_activity = anyio.current_time()
        try:
            async with anyio.create_task_group() as tg:
                if self.source.replay_endpoint is not None:
                    # Quiet ticks only ever lead to a replay probe: no endpoint, no ticks.
                    tg.start_soon(self._replay_loop)
                    tg.start_soon(self._quiet_loop)
                first, self._first_actions = self._first_actions, None
                self._execute(first if first is not None else self.machine.start())
                while True:
                    await self._run_session()
        finally:
            self._close_dealer()
            self.connected = False

    async def _run_session(self) -> None:
        # One SUB socket's life: recreated on the machine's request (a restarted engine's
        # dead messages are still queued in the old one, docs/recovery.md rule 2).
        src, cfg = self.source, self._cfg
        sub = _zmq.socket(
            self._ctx,
            zmq.SUB,
            rcvhwm=cfg.rcvhwm if cfg.rcvhwm is not None else src.hwm,
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
        try:
            sub.connect(src.endpoint)
            async with anyio.create_task_group() as tg:
                self._session = tg.cancel_scope
                self._session_tg = tg
                self._monitor = mon
                tg.start_soon(self._watch, mon)
                if src.endpoint.startswith("inproc://"):
                    # inproc has no connection handshake, so its monitor never reports one:
                    # the pipe exists as soon as connect returns.
                    self._set_connected()
                await self._pump(sub)
                tg.cancel_scope.cancel()
        finally:
            self._session = None
            self._session_tg = None
            self._awaiting_retry = False
            self._monitor = None
            _zmq.close(sub, monitor=mon)
            if self.connected:
                self.connected = False
                self._on_change()

    async def _pump(self, sub: zmq.Socket[bytes]) -> None:
        # The hot loop: locals instead of attribute lookups, and the common outcome (one Apply
        # of an in-order batch, docs/recovery.md rule 1) applied without the general dispatch.
        batch_cap = self._cfg.recv_batch
        decode = self._decode
        on_live = self.machine.on_live
        apply, execute = self._apply, self._execute
        nan = math.nan
        poll_monitor = self._poll_monitor
        while not self._recreate:
            msgs = await _zmq.recv_many(sub, batch_cap)
            self._last_activity = anyio.current_time()
            self.messages += len(msgs)
            # A disconnect must reach the machine before any message that came after it (a
            # restarted engine's first seqs would pass for the old one's). libzmq emits the
            # event before it reconnects, so whatever is queued in the monitor now is older
            # than the newest message just read: report it first. Early is safe: the machine
            # then holds the batch until the identity check answers.
            poll_monitor()
            if self._recreate:
                return
            for frames in msgs:
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.skipped_frames += 1
                    self._log.warn("skipped message", f"{len(frames)} frames, expected [topic, seq8, payload]")
                    continue
                batch = decode(frames[2])
                actions = on_live(int.from_bytes(frames[1], "big"), batch.ts if batch is not None else nan, batch)
                if len(actions) == 1 and type(actions[0]) is Apply:
                    apply(actions[0].items)
                else:
                    execute(actions)
                    if self._recreate:
                        return  # the rest came from the engine process that just died

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            batch = self._decoder.decode(payload)
        except DecodeError as exc:
            self.decode_errors += 1
            self._log.warn("undecodable payload", str(exc))
            return None
        if batch.untrusted is not None:
            # A removal or clear that could not be read: applying the rest could leave blocks
            # the engine dropped. As an undecodable batch the machine asks for a replay and,
            # when that cannot fix it, resets the worker ("undecodable").
            self.decode_errors += 1
            self._log.warn("untrusted batch", batch.untrusted)
            return None
        return batch

    async def _watch(self, mon: zmq.Socket[bytes]) -> None:
        # Connection changes while no message flows; the pump and the replay task also read
        # this socket (without waiting) to keep events in order with what they feed.
        while True:
            for frames in await _zmq.recv_many(mon, 64):
                self._on_monitor(frames)

    def _poll_monitor(self) -> None:
        mon = self._monitor
        if mon is not None:
            for frames in _zmq.recv_nowait(mon, 64):
                self._on_monitor(frames)

    def _on_monitor(self, frames: list[bytes]) -> None:
        ev = _zmq.read_monitor(frames)
        if ev is None:
            return
        if ev.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_connected()
        elif ev.event == zmq.EVENT_DISCONNECTED:
            if not self._awaiting_retry and self._session_tg is not None:
                self._awaiting_retry = True
                self._session_tg.start_soon(self._expect_retry)
            if self.connected:
                self.connected = False
                self._execute(self.machine.on_disconnected())
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
        self._execute(self.machine.on_reconnected())
        self._on_change()

    async def _quiet_loop(self) -> None:
        interval = self._cfg.quiet_interval
        while True:
            due = self._last_activity + interval
            now = anyio.current_time()
            if now < due:
                await anyio.sleep(due - now)
                continue
            self._last_activity = now
            # A disconnected source has nothing new to tell, and a probe to a dead engine
            # would hold a replay slot for the whole timeout; reconnecting checks it anyway.
            if self.connected:
                self._execute(self.machine.on_quiet())

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
                async with self._limiter:
                    items, complete, failure = await self._replay(request.from_seq)
            self._replay_scope = None
            if scope.cancelled_caught:
                # The machine abandoned this request (restart, disconnect): stop waiting for
                # it; its late replies die with the DEALER.
                self._close_dealer()
                items, complete, failure = [], False, "abandoned"
            self._poll_monitor()  # a disconnect first, as for live messages
            if failure is not None:
                self._execute(self.machine.on_replay_failed(failure))
            else:
                self._execute(self.machine.on_replay(items, complete=complete))

    async def _replay(self, start: int) -> tuple[list[tuple[int, float, EventBatch | None]], bool, str | None]:
        """Ask for every buffered batch from ``start``; returns (items, end marker seen, failure)."""
        endpoint = self.source.replay_endpoint
        assert endpoint is not None  # the replay task runs only for sources with one
        if self._dealer is None:
            cfg = self._cfg
            self._dealer = _zmq.connect(
                self._ctx,
                zmq.DEALER,
                endpoint,
                max_message_size=cfg.max_message_size,
                reconnect_ivl=cfg.reconnect_ivl,
                reconnect_ivl_max=cfg.reconnect_ivl_max,
                tcp_keepalive=cfg.tcp_keepalive,
                curve=self._curve,
                curve_server_key=self.source.curve_server_key if self._curve is not None else None,
            )
        dealer = self._dealer
        self.replays += 1
        items: list[tuple[int, float, EventBatch | None]] = []
        if not _zmq.send_nowait(dealer, [b"", start.to_bytes(8, "big")]):
            self._close_dealer()
            return items, False, "replay request refused (queue full)"
        complete = False
        timeout = self._cfg.replay_timeout
        # The machine holds at most max_held batches; reading more than that from one answer
        # only buys memory a publisher that never sends the end marker could exhaust.
        cap = self.machine.max_held
        while not complete and len(items) < cap:
            msgs: list[list[bytes]] = []
            with anyio.move_on_after(timeout):
                msgs = await _zmq.recv_many(dealer, self._cfg.recv_batch)
            if not msgs:
                break
            for frames in msgs:
                if self._on_reply(frames, items):
                    complete = True
                    break
        if not complete:
            # Late replies to this request would pass for answers to the next one: start over
            # with a fresh DEALER (the engine answers each connection separately).
            self._close_dealer()
            if not items:
                return items, False, f"no reply within {timeout:g} s"
        return items, complete, None

    def _on_reply(self, frames: list[bytes], items: list[tuple[int, float, EventBatch | None]]) -> bool:
        # Newer engines reply [b"", topic, seq8, payload], older [b"", seq8, payload]; accept
        # both from every source (docs/protocol.md §4). Returns True at the end marker.
        n = len(frames)
        if n == 4 and not frames[0]:
            seq8, payload = frames[2], frames[3]
        elif n == 3 and not frames[0]:
            seq8, payload = frames[1], frames[2]
        else:
            self.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{n} frames")
            return False
        if len(seq8) != 8:
            self.skipped_frames += 1
            self._log.warn("skipped replay reply", f"{len(seq8)}-byte seq")
            return False
        if seq8 == _END_SEQ:
            return True
        self.replayed_batches += 1
        batch = self._decode(payload)
        items.append((int.from_bytes(seq8, "big"), batch.ts if batch is not None else math.nan, batch))
        return False

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            _zmq.close(self._dealer)
            self._dealer = None

    # --- actions --------------------------------------------------------------------------------

    def _execute(self, actions: Sequence[Action]) -> None:
        if self._stopped:
            return
        changed = False
        for action in actions:
            if isinstance(action, Apply):
                self._apply(action.items)
            elif isinstance(action, Emit):
                self._emit(action.event)
                changed = True  # every state change comes with a lifecycle event
            elif isinstance(action, RequestReplay):
                self._replay_request = action
                if self._replay_wakeup is not None:
                    self._replay_wakeup.set()
            elif isinstance(action, ResetWorker):
                self.resets += 1
                self._index.remove_worker(self.key)
            elif isinstance(action, RecreateSubscriber):
                self._recreate = True
                if self._session is not None:
                    self._session.cancel()
        if self._replay_scope is not None and self.machine.replay_abandoned:
            self._replay_scope.cancel()
        if changed:
            self._on_change()

    def _apply(self, items: Sequence[tuple[int, float, EventBatch]]) -> None:
        if self._stopped:
            return
        apply_batch, key = self._index.apply_batch, self.key
        sink = self._sink
        emit = sink.active
        src = self.source
        blocks = 0
        for seq, ts, batch in items:
            apply_batch(key, batch)
            for ev in batch.events:
                if type(ev) is BlockStored:
                    blocks += len(ev.block_hashes)
                if emit:
                    sink.publish(Envelope(source=src, seq=seq, ts=ts, event=ev))
        self.batches += len(items)
        self.blocks += blocks

    def _emit(self, event: LifecycleEvent) -> None:
        kind = event.kind
        if kind == "gap":
            self.gaps += 1
        elif isinstance(event, Reset):
            self._log.warn("index state reset", f"{event.reason}: {event.detail}")
        elif isinstance(event, Partial):
            self._log.warn("history incomplete", f"{event.reason}: blocks known from seq {event.first_seq} on")
        self._sink.publish(Envelope(source=self.source, seq=None, ts=time.time(), event=event))
