"""The ZMQ driver: one SUB per source (and its replay requests), moving bytes and time for its `RecoveryMachine`.

The recovery rules live in the sans-I/O `kvroute._source.RecoveryMachine`; this module only feeds it
(live messages, replay results, socket monitor events, quiet ticks) and carries out what it
returns (apply batches to the index, ask for a replay (`kvroute._transports.zmq.replay.ReplayRequester`
carries it out), reset the worker, recreate the SUB, emit lifecycle events). Every frame that is not what
docs/protocol.md §2 and §4 describe is counted and skipped, with a rate-limited log line: bad input never
stops the pump.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import msgspec
import zmq

from ..._index import PrefixIndex
from ..._models import EventSource
from ..._recovery import Payload
from ..._snapshot import Cursor
from ..._source import Action, Apply, RecreateSubscriber, RequestReplay
from ..._wire import BatchDecoder, EventBatch, Limits
from .._base import DriverBase, EventSink, SourceStats
from . import sockets as _zmq
from .config import SubscriberConfig, curve_keys
from .payloads import _decode_checked, _fast_apply, _judge
from .receiver import Entry, Receiver
from .replay import ReplayRequester, ReplaySlots

__all__ = ["NativeThread", "SourceDriver"]

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


class NativeThread(Protocol):
    """What a driver asks of the native receive thread (`kvroute._transports.zmq.native.NativeReceiver`)."""

    #: True while the thread's hand-overs are being fed to drivers (they open their fast paths after).
    draining: bool

    def eligible(self, source: EventSource) -> bool:
        """Whether the thread can follow ``source``."""
        ...

    def add(self, driver: SourceDriver) -> int:
        """Subscribe ``driver``'s source on the thread; its token."""
        ...

    def remove(self, token: int) -> None:
        """Stop following ``token``."""
        ...

    def stop(self, token: int) -> None:
        """Apply nothing more for ``token`` from now on."""
        ...

    def open(self, token: int, next_seq: int, consumed: int, keep: bool) -> None:
        """Let the thread apply ``token``'s batches from ``next_seq`` (``keep``: with their payloads, for a raw tap)."""
        ...

    def close_fast(self, token: int) -> None:
        """Hand every message of ``token`` over until it is opened again."""
        ...

    def park(self, token: int, parked: bool) -> None:
        """Leave ``token``'s messages unread while ``parked``, or read them again."""
        ...

    def hold(self) -> bool:
        """Stop the thread applying, with what it applied recorded; True when this call held it."""
        ...

    def release(self) -> None:
        """Let a held thread apply again."""
        ...

    def replay(
        self,
        driver: SourceDriver,
        from_seq: int,
        terms: tuple[float | None, bool] | None,
        *,
        silent: float,
        deadline: float,
        budget: int,
        max_items: int,
        max_bytes: int,
    ) -> int | None:
        """Send ``driver``'s replay request from ``from_seq`` to the thread (its id), or None when no thread runs."""
        ...

    def cancel_replay(self, request_id: int) -> None:
        """End replay ``request_id`` now, applying nothing (its outcome still comes)."""
        ...

    def replay_progress(self, request_id: int) -> int:
        """Decodable replies of replay ``request_id`` so far."""
        ...

    def disarm_replay(self, request_id: int) -> None:
        """Apply nothing of replay ``request_id`` from now on (hand its replies over)."""
        ...

    async def serve(self) -> None:
        """Run the thread's hand-over loop, or wait while another session runs it."""
        ...


class _NativeReplay:
    """A replay request the native thread carries out for a driver, until its outcome comes."""

    __slots__ = ("abandoned", "counted", "done", "error", "id", "replies", "yielded")

    def __init__(self, request_id: int) -> None:
        self.id = request_id
        self.done = anyio.Event()
        #: Cancelled because the machine will ignore the answer (it gets `on_replay_failed`).
        self.abandoned = False
        #: Ended with nothing to show to give its slot way, or with its thread: ask again.
        self.yielded = False
        #: Replies the thread read (the request's budget across turns).
        self.replies = 0
        #: What carrying out the machine's answer raised (the source fails, alone, in its task).
        self.error: Exception | None = None
        #: Decodable replies already counted in ``replayed_batches`` while it ran (`refresh_counters`).
        self.counted = 0


class SourceDriver(DriverBase):
    """Subscribes to one `EventSource` and keeps its worker's index state per the recovery rules.

    `run` owns every socket and task of the source and closes them all when cancelled.
    ``limiter`` bounds replays across sources; ``on_change`` is called (synchronously)
    whenever the source's sync state or connection changes. ``resume``: the index already
    holds this worker's state through that position (a restored snapshot); the source
    resumes from it (`RecoveryMachine.resume`) instead of starting cold.
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
        native: NativeThread | None = None,
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
        self._decoder = BatchDecoder(config.limits)
        self._curve = curve_keys(source, config)
        self._replays = ReplayRequester(
            source,
            context=context,
            config=config,
            slots=limiter,
            curve=self._curve,
            counters=self.counters,
            log=self._log,
            judge=self._judge_reply,
            max_held=self.machine.max_held,
        )
        self._replay_request: RequestReplay | None = None
        # The task group `run` holds, where a replay task is started when the machine asks for
        # one (`on_action`), and whether that task runs now: it ends when no request is left, so
        # a synced source keeps no task, event or future for replays (a 4,096-rank cold sync's
        # garbage collector walked ~20 such objects per source).
        self._run_tg: anyio.abc.TaskGroup | None = None
        self._replaying = False
        # When a quiet tick was deferred (rule 9) and the live messages counted then.
        self._deferred_tick: tuple[float, int] | None = None
        # The current SUB session's scope: cancelled to end it (the source leaves, or its SUB is
        # recreated). A plain scope, not a task group: a session starts no task of its own (the
        # retry timer runs in `run`'s group), one task group fewer per source to collect.
        self._session: anyio.CancelScope | None = None
        self._awaiting_retry = False
        self._monitor: zmq.Socket[bytes] | None = None
        self._replay_scope: anyio.CancelScope | None = None
        self._recreate = False
        # The client's transport shares one receiver among its drivers; a lone driver has its own.
        self._receiver = receiver if receiver is not None else Receiver(config)
        # The client's native receive thread, when configured and this source is one it can follow.
        self._native = native if native is not None and native.eligible(source) else None
        # This SUB's token on the thread, the hand-overs taken for it, and the last fast-path open sent.
        self._native_token: int | None = None
        self._native_consumed = 0
        # Of those, the ones that may change the machine's mind about a replay answer (the
        # thread applies one whole only if none came since the request: `NativeReceiver.replay`).
        self._native_risky = 0
        # The batches the thread's fast path applied this session that the machine has recorded
        # (a replay answer is applied whole only if that was all of them: `NativeReceiver.replay`).
        self._native_fast_seen = 0
        # What the fast path was last opened with: (next_seq, hand-overs consumed, payloads kept).
        self._native_opened: tuple[int, int, bool] | None = None
        # Whether this side last asked the thread to park the SUB (a replay in flight).
        self._native_parked = False
        # An open was sent and no park or unpark since: if the thread found it stale, the source
        # waits unread for the next command (`src/recv`, `Source::awaiting_open`).
        self._native_open_sent = False
        # Replay requests go to the thread too when its endpoint is one the thread can reach.
        rep = source.replay_endpoint
        self._native_replays = self._native is not None and rep is not None and rep.startswith(("tcp://", "ipc://"))
        # The request the thread carries out now, if any.
        self._native_replay: _NativeReplay | None = None
        #: Batches the native thread applied for this source (live; its replay answers below).
        self.native_batches = 0
        #: Replay requests the native thread carried out, and the batches it applied of their answers.
        self.native_replays = 0
        self.native_replayed = 0
        #: Seconds from the newest applied live batch's ts (the engine's clock) to its apply.
        self.apply_lag = 0.0

    def stop(self) -> None:
        """`DriverBase.stop`, and the native thread applies nothing more for this source from now on."""
        super().stop()
        if self._native is not None and self._native_token is not None:
            self._native.stop(self._native_token)

    def refresh_counters(self) -> None:
        """The decoder counts unknown event types itself; a native replay's replies count as they come."""
        self.counters.unknown_events = self._decoder.unknown_events
        pending = self._native_replay
        if pending is not None and self._native is not None:
            got = self._native.replay_progress(pending.id)
            if got > pending.counted:
                self.counters.replayed_batches += got - pending.counted
                pending.counted = got

    def stats(self) -> SourceStats:
        """A snapshot of this source's counters and condition, with its apply lag."""
        return msgspec.structs.replace(super().stats(), apply_lag=self.apply_lag)

    @property
    def _dealer(self) -> zmq.Socket[bytes] | None:
        """The replay DEALER, open only while a replay request runs (an idle source holds none)."""
        return self._replays.dealer

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and follow the source until cancelled; every socket is closed on the way out."""
        try:
            async with anyio.create_task_group() as tg:
                self._run_tg = tg
                try:
                    self.execute(self.first_actions())
                    while True:
                        await self._run_session()
                finally:
                    # No task starts in a group that is closing (trio refuses it): a replay slot
                    # given to this source from now on goes back (`_begin_replays`).
                    self._run_tg = None
        finally:
            self._replays.close()
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
        entry: Entry | None = None
        try:
            sub.connect(src.endpoint)
            with anyio.CancelScope() as session:
                self._session = session
                self._monitor = mon
                entry = self._receiver.add(self, sub, mon)
                if src.endpoint.startswith("inproc://"):
                    # inproc has no connection handshake, so its monitor never reports one:
                    # the pipe exists as soon as connect returns.
                    self._set_connected()
                if not self._recreate:
                    # Returns never: cancelled when the source leaves or its SUB is recreated.
                    await self._receiver.serve()
        finally:
            self._session = None
            self._awaiting_retry = False
            self._monitor = None
            if entry is not None:
                self._receiver.remove(entry)
            _zmq.close(sub, monitor=mon)
            if self.connected:
                self.connected = False
                self._on_change()

    async def _run_native_session(self, native: NativeThread) -> None:
        # As `_run_session`, with the SUB and its monitor on the native thread.
        self._recreate = False
        self._native_consumed = 0
        self._native_risky = 0
        self._native_fast_seen = 0
        self._native_opened = None
        self._native_parked = False
        self._native_open_sent = False
        token: int | None = None
        try:
            with anyio.CancelScope() as session:
                self._session = session
                token = self._native_token = native.add(self)
                self._sync_fast()
                if not self._recreate:
                    await native.serve()
        finally:
            self._session = None
            self._awaiting_retry = False
            self._native_token = None
            if token is not None:
                native.remove(token)
            if self.connected:
                self.connected = False
                self._on_change()

    def _native_applied(
        self,
        seqs: Sequence[int],
        tss: Sequence[float],
        lags: Sequence[float],
        elided: int,
        blocks: int,
        skipped: dict[str, int] | None,
        payloads: list[tuple[int, float, int, bytes]] | None = None,
    ) -> None:
        """What the native thread applied for this source since the last drain: rule 1's bookkeeping, in bulk.

        ``seqs``/``tss``: the newest applied batches in order (at most the ts ring's worth);
        ``elided`` older ones only counted; ``lags``: wall clock at apply minus ts; ``skipped``:
        events left out of those batches, per reason (None: none); ``payloads``: with the fast
        path opened for a raw tap, every one of those batches as ``(seq, ts, blocks, payload)``,
        handed to the tap as the Python fast path hands it each payload.
        """
        applied = len(seqs) + elided
        self._native_fast_seen += applied
        if self._stopped:
            return
        self.native_batches += applied
        if seqs:
            self.machine.on_applied_many(seqs, tss)
        self.counters.batches += elided
        self.counters.messages += applied
        self.counters.blocks += blocks
        if skipped:
            self._decoder.count_skipped(skipped)
        if lags:
            self.apply_lag = max(0.0, lags[-1])
        if payloads:
            # Applied, so the tap takes them even if an iterator came meanwhile (the tap must see
            # every applied batch; the iterator sees envelopes from its first drain on).
            tap = getattr(self._sink, "tap", None)
            if tap is not None:
                source, raw = self.source, tap.raw
                for seq, ts, stored, payload in payloads:
                    raw(source, seq, ts, payload, stored)
        keep = self._native_opened is not None and self._native_opened[2]
        # (the common case, nobody listening and no payloads kept, without a call: per source per drain)
        if keep or self._sink.active:
            self._refit_native(keep)

    def _refit_native(self, keep: bool) -> None:
        """Close the fast path opened with ``keep`` if the sink no longer fits it (`_native_fits`)."""
        if not self._native_fits(keep) and self._native is not None and self._native_token is not None:
            # A listener wants every batch as an event (or a raw tap its payload, or nobody the
            # payloads kept): the general path from here on, until `_sync_fast` opens it as the
            # sink needs.
            self._native.close_fast(self._native_token)
            self._native_opened = None

    def _sink_raw(self) -> Callable[[EventSource, int, float, bytes, int], None] | None:
        """The raw tap's ``raw`` while it is the sink's only listener (`kvroute._fanout.Hub.raw`), else None."""
        raw: Callable[[EventSource, int, float, bytes, int], None] | None = getattr(self._sink, "raw", None)
        return raw

    def _native_fits(self, keep: bool) -> bool:
        """A fast path open with ``keep`` is what the sink needs now: payloads kept for a raw tap that is the
        only listener, none for no listener (an ``events()`` iterator needs the general path)."""
        return self._sink_raw() is not None if keep else not self._sink.active

    def _sync_fast(self) -> None:
        """Open the native fast path where rule 1 holds now (the thread closes it itself at each hand-over).

        While a replay is in flight the SUB is parked instead: its live messages would only be
        decoded and held (up to ``held_bytes`` per source, ~7x that decoded, for thousands of
        sources at once during a cold sync); unread, they wait in libzmq's and the engine's
        queues, and after the replay the duplicates among them are dropped by rule 2.
        """
        native, token = self._native, self._native_token
        if native is None or token is None:
            return
        m = self.machine
        if self._stopped or self._recreate:
            return
        # A raw tap alone keeps the fast path, its batches' payloads kept for it (as the Python
        # fast path hands it each payload); an iterator needs the envelopes of the general path.
        keep = self._sink_raw() is not None
        if not self._native_fits(keep) or not m.in_order(m.last_seq + 1):
            park = m.replay_in_flight is not None
            # After an open the thread may have found stale, it leaves the source unread until
            # the next command for it: this (un)park is it.
            if park != self._native_parked or self._native_open_sent:
                self._native_parked = park
                self._native_open_sent = False
                native.park(token, park)
            return
        if self._native_parked:
            self._native_parked = False
            native.park(token, False)
        want = (m.last_seq + 1, self._native_consumed, keep)
        if want != self._native_opened:
            self._native_opened = want
            self._native_open_sent = True
            native.open(token, *want)

    def _on_messages(self, msgs: list[list[bytes]], wall: float) -> None:
        """Live messages the receiver read from the SUB, in order; ``wall``: time.time() when read.

        The hot path (docs/recovery.md rule 1): a message the machine says is in order is
        decoded and applied here, through `_fast_apply`, and reported with `on_applied`;
        everything else (gaps, restarts, holes, held batches, events() listeners) goes
        through `RecoveryMachine.on_live` and `execute`.
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
        # once stopped) every message takes the general path. A raw tap alone (the JetStream
        # relay, `kvroute._fanout.Hub.raw`) keeps it and is handed each applied payload as is.
        raw = self._sink_raw()
        fast = (raw is not None or not self._sink.active) and not self._stopped
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
                    if raw is not None:
                        raw(self.source, seq, report.ts, payload, report.stored_blocks)
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
        """The receiver saw nothing on the SUB for the quiet interval (docs/recovery.md rules 7-9)."""
        # A disconnected source has nothing new to tell, and a probe to a dead engine would
        # hold a replay slot for the whole timeout; reconnecting checks it anyway. Quiet
        # ticks only ever lead to a replay probe: no endpoint, no ticks.
        if self._stopped or not self.connected or self.source.replay_endpoint is None or not self.machine.probe_due:
            return
        replays = self._replays
        if not replays.slot_free():
            # Rule 9: every slot is taken or waited for. Under load kvroute's own slowness
            # makes healthy sources look quiet, and a probe queued behind the slots would
            # only lengthen the replays (a cold sync) that hold them. The next slot that comes
            # free with no source waiting is offered to it (`_deferred_probe`), else the next
            # quiet tick asks again.
            self.counters.probes_deferred += 1
            self._deferred_tick = (anyio.current_time(), self.counters.messages)
            replays.defer(self._deferred_probe)
            return
        replays.reserve()
        self.execute(self.machine.on_quiet())

    def _deferred_probe(self) -> None:
        """A replay slot came free after this source's quiet tick was deferred (rule 9): probe now if still quiet."""
        tick, self._deferred_tick = self._deferred_tick, None
        # Still due and quiet: nothing received since the tick, and within one quiet interval of it
        # (past that, a message may wait unread behind a slow loop: the next tick decides). Asked
        # before the hold too, which it needs not: when the last cold replays of a fleet end, every
        # source deferred meanwhile is offered a slot in one burst, most of them long past their
        # tick, and holding the thread for each was O(n) holds at once. Asked again after it: the
        # hold's drain may have handed this source something that settles its probe.
        if tick is None or not self._still_quiet(*tick):
            return
        self._close_native_fast()
        if not self._still_quiet(*tick):
            return
        if not self._replays.slot_free():
            # The hold drained the thread's hand-overs, and another source's quiet tick among
            # them took the slot offered to this one (rule 9: a probe never queues behind busy
            # slots). Taken regardless, it raised WouldBlock inside the turn that freed the slot,
            # and that source's driver failed (a 4,096-rank cold sync lost 3 sources so).
            self.counters.probes_deferred += 1
            if self._deferred_tick is None:  # (the drain may have deferred a newer tick of its own)
                self._deferred_tick = tick
            self._replays.defer(self._deferred_probe)
            return
        self._replays.reserve()
        self.execute(self.machine.on_quiet())

    def _still_quiet(self, at: float, messages: int) -> bool:
        """A probe is due, and nothing was received since a quiet tick at ``at`` (``messages`` then) in one interval."""
        return (
            not self._stopped
            and self.connected
            and self.machine.probe_due
            and self.counters.messages == messages
            and anyio.current_time() - at <= self._cfg.quiet_interval
        )

    def _close_native_fast(self) -> None:
        """Close the thread's fast path for this source, with what it applied on it recorded.

        A deferred probe is asked outside any hand-over of this source, so the fast path its last
        drain opened may still be open: a live batch the thread applied (or applies) meanwhile,
        recorded after the probe was asked, would make the probe's whole answer look applied off
        the machine's terms (a spurious restart). Held, the thread's applies so far are drained
        (``counters.messages`` moves, so the tick no longer counts as quiet), and the close is
        carried out before it applies again.
        """
        native, token = self._native, self._native_token
        if native is None or token is None or self._native_opened is None:
            return
        held = native.hold()
        try:
            if self._native_token == token:
                native.close_fast(token)
                self._native_opened = None
        finally:
            if held:
                native.release()

    def _decode(self, payload: bytes) -> EventBatch | None:
        batch, kind, detail = _decode_checked(self._decoder, payload)
        if batch is None:
            self._bad_payload(kind, detail)
        return batch

    def _judge_reply(self, payload: bytes) -> tuple[float, Payload | None]:
        """A replayed payload as the machine takes it: ``(ts, the payload itself)``, or ``(nan, None)`` when refused.

        The cold sync of a fleet is thousands of replay answers: each payload is judged by the
        core's verdict without building a batch, held as bytes and applied by the raw-bytes
        ingest (`apply_items`), no Python object per event. A listener wants the events: then
        it is decoded, as a live batch off the fast path is.
        """
        if self._sink.active:
            batch = self._decode(payload)
            return (batch.ts if batch is not None else math.nan), batch
        ts, kind, detail = _judge(self._decoder, payload)
        if kind:
            self._bad_payload(kind, detail)
            return math.nan, None
        return ts, payload

    @property
    def limits(self) -> Limits:
        """The `Limits` payloads are judged and applied with (`SubscriberConfig.limits`)."""
        return self._decoder.limits

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
            if not self._awaiting_retry and self._session is not None and self._run_tg is not None:
                self._awaiting_retry = True
                self._run_tg.start_soon(self._expect_retry, self._session)
            if self.connected:
                self.connected = False
                self.execute(self.machine.on_disconnected())
                self._on_change()
        elif ev.event == zmq.EVENT_CONNECT_RETRIED:
            self._awaiting_retry = False
        elif ev.event & _HANDSHAKE_FAILED:
            self._log.warn("handshake failed", f"zmq event {ev.event} from {ev.endpoint} (CURVE keys?)")

    async def _expect_retry(self, session: anyio.CancelScope) -> None:
        await anyio.sleep(_RETRY_GRACE)
        # Only for the session that saw the disconnect (a later one waits for its own).
        if self._awaiting_retry and self._session is session:
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

    def _start_replays(self) -> None:
        """Start the replay task for the request just asked, unless it runs (it takes the newest one next).

        With no slot to be had now, the request waits in the slots' line with no task
        (`ReplayRequester.queue`): the task starts once a slot is reserved for it.
        """
        tg = self._run_tg
        if tg is None or self._replaying or self.source.replay_endpoint is None:
            return
        self._replaying = True
        replays = self._replays
        if not replays.holding and replays.slot_free():
            # Taken now: every source of a cold start asks in the same loop turn, before any
            # replay task runs, and each would see the slot free.
            replays.reserve()
        replays.queue(self._begin_replays)

    def _begin_replays(self) -> None:
        """A slot is reserved for the request that waited in line: its task starts now (leaving: the slot goes back)."""
        tg = self._run_tg
        if tg is None:
            self._replaying = False
            self._replays.close()
            return
        tg.start_soon(self._replay_loop)

    async def _replay_loop(self) -> None:
        # Carries out the machine's replay requests, one after the other (a request asked while one
        # runs waits for it; a newer one replaces it), and ends when none is left.
        try:
            while (request := self._replay_request) is not None:
                self._replay_request = None
                await self._replay_once(request)
        finally:
            self._replaying = False

    async def _replay_once(self, request: RequestReplay) -> None:
        if self.machine.replay_abandoned:
            # Made moot before it began (while it waited in line): never sent.
            self._replays.close()
            self.execute(self.machine.on_replay_failed("abandoned"))
            return
        if self._native_replays and await self._native_fetch(request.from_seq):
            return
        with anyio.CancelScope() as scope:
            self._replay_scope = scope
            items, complete, failure = await self._replays.fetch(request.from_seq)
        self._replay_scope = None
        if scope.cancelled_caught:
            # The machine abandoned this request (restart, disconnect): stop waiting for
            # it; its late replies die with the DEALER.
            self._replays.close()
            items, complete, failure = [], False, "abandoned"
        self._poll_monitor()  # a disconnect first, as for live messages
        if failure is not None:
            self.execute(self.machine.on_replay_failed(failure))
        else:
            self.execute(self.machine.on_replay(items, complete=complete))

    async def _native_fetch(self, from_seq: int) -> bool:
        """Carry out the machine's replay request on the native thread, in turns of the shared slots.

        As `ReplayRequester.fetch`, with the DEALER, its replies and their verdicts on the thread:
        a turn sends the request with what the request may still spend (time, replies) and waits
        for its outcome, which `_native_replay_done` feeds the machine in the thread's hand-over
        order. A turn that has held its slot for its slice while others wait is cancelled: with
        replies, the machine takes them and asks for the rest; with none, the request goes to
        the back of the queue. False when no thread runs (the Python requester asks instead).
        """
        try:
            return await self._native_turns(from_seq)
        finally:
            # As after `ReplayRequester.fetch`: no deferred probe or reserved slot outlives it.
            self._replays.close()

    async def _native_turns(self, from_seq: int) -> bool:
        native, cfg, replays = self._native, self._cfg, self._replays
        assert native is not None  # _native_replays
        deadline = math.inf
        replies = 0
        while True:
            async with replays.turn() as turn:
                now = anyio.current_time()
                if deadline == math.inf:
                    deadline = now + cfg.replay_deadline
                m = self.machine
                if m.replay_abandoned:
                    # Made moot while it waited for a slot: never sent.
                    self.execute(m.on_replay_failed("abandoned"))
                    return True
                terms = None if self._sink.active else m.replay_terms()
                rid = native.replay(
                    self,
                    from_seq,
                    terms,
                    silent=cfg.replay_timeout,
                    deadline=deadline - now,
                    budget=cfg.replay_budget - replies,
                    max_items=m.max_held,
                    max_bytes=cfg.held_bytes,
                )
                if rid is None:
                    return False
                pending = self._native_replay = _NativeReplay(rid)
                turn.progress = functools.partial(native.replay_progress, rid)
                try:
                    with anyio.CancelScope() as scope:
                        turn.scope = scope
                        await self._replays.hold(turn, pending.done)
                    turn.scope = None
                    if not pending.done.is_set():
                        # Another source waits and this turn had its slice: give way.
                        native.cancel_replay(rid)
                        with anyio.move_on_after(cfg.replay_timeout + 1.0, shield=True):
                            await pending.done.wait()
                finally:
                    if not pending.done.is_set():
                        # Cancelled (the source leaves) or the outcome never came: end it there.
                        native.cancel_replay(rid)
                        self._native_replay = None
            if not pending.done.is_set():
                self.execute(self.machine.on_replay_failed("the native receive thread did not answer"))
                return True
            if pending.error is not None:
                raise pending.error
            if not pending.yielded:
                return True
            replies += pending.replies
            self.counters.replay_yields += 1

    def _native_replay_done(
        self,
        request_id: int,
        applied: tuple[int, int, list[int], list[float], int, int] | None,
        items: list[tuple[int, float, bytes | None]],
        complete: bool,
        cut: str | None,
        cancelled: bool,
        good: int,
        junk_frames: int,
        bad: list[tuple[str, str]],
        bad_count: int,
        skipped: dict[str, int],
        replies: int,
    ) -> None:
        """A replay request the thread carried out ended (`kvroute._core.NativeReceiver.drain`'s hand-over).

        Fed to the machine here, in the thread's order: applied whole (`on_replay_applied`), or
        its replies judged by the machine (`on_replay`), or no answer (`on_replay_failed`).
        """
        pending = self._native_replay
        if pending is None or pending.id != request_id:
            return  # a request given up (its source left, or the wait for it ended)
        self._native_replay = None
        pending.replies = replies
        self.native_replays += 1
        counters = self.counters
        counters.replayed_batches += good + bad_count - pending.counted
        if junk_frames:
            counters.skipped_frames += junk_frames
            self._log.warn("skipped replay reply", f"{junk_frames} malformed")
        for kind, detail in bad:
            self._bad_payload(kind, detail)
        counters.decode_errors += bad_count - len(bad)
        if skipped:
            self._decoder.count_skipped(skipped)
        m = self.machine
        if applied is not None:
            first, last, seqs, tss, count, blocks = applied
            counters.blocks += blocks
            self.native_replayed += count
            actions = m.on_replay_applied(first, last, list(zip(seqs, tss)), count)
        elif pending.abandoned:
            actions = m.on_replay_failed("abandoned")
        elif cancelled and not items:
            pending.yielded = True  # gave way with nothing to show: asked again in a later turn
            pending.done.set()
            return
        else:
            if not complete and cut is not None:
                counters.replay_cutoffs += 1
                self._log.warn("replay cut short", cut)
            if not items and not complete:
                actions = m.on_replay_failed(cut or f"no reply within {self._cfg.replay_timeout:g} s")
            else:
                payloads: list[tuple[int, float, Payload | None]] = list(items)
                actions = m.on_replay(payloads, complete=complete)
        pending.done.set()
        try:
            self.execute(actions)
        except Exception as exc:
            # Raised in the replay task (the source fails alone), not in the thread's drain,
            # which every source shares.
            pending.error = exc

    def _native_replay_gone(self, request_id: int) -> None:
        """The thread that carried out ``request_id`` is gone (its last source left): ask again."""
        pending = self._native_replay
        if pending is not None and pending.id == request_id:
            self._native_replay = None
            pending.yielded = True
            pending.done.set()

    def _disarm_native_replay(self) -> None:
        """The machine will not take the answer in flight whole any more: the thread applies none of it."""
        pending = self._native_replay
        if pending is not None and self._native is not None:
            self._native.disarm_replay(pending.id)

    # --- actions --------------------------------------------------------------------------------

    def execute(self, actions: Sequence[Action]) -> None:
        """`DriverBase.execute`; first, a native replay the machine abandoned is disarmed and ended.

        Before any action runs: a reset (`ResetWorker`) must not be followed by the thread
        applying the abandoned answer.
        """
        pending = self._native_replay
        if pending is not None and not pending.abandoned and self.machine.replay_abandoned:
            pending.abandoned = True
            assert self._native is not None  # a native replay runs
            self._native.cancel_replay(pending.id)
        super().execute(actions)

    def on_action(self, action: Action) -> None:
        """Ask a replay (the replay task carries it out) or recreate the SUB socket."""
        if isinstance(action, RequestReplay):
            self._replay_request = action
            self._start_replays()
        elif isinstance(action, RecreateSubscriber):
            self._recreate = True
            if self._session is not None:
                self._session.cancel()

    def after_actions(self) -> None:
        """Stop waiting for a replay the machine abandoned (restart, disconnect); reopen the native fast path."""
        if self.machine.replay_abandoned:
            if self._replay_scope is not None:
                self._replay_scope.cancel()
            elif self._replays.queued:
                # Waiting in line: it need not wait for a slot to fail (`_replay_once`).
                self._replays.close()
                self._begin_replays()
        if self._native is not None and not self._native.draining:
            # A replay answer (or a timer) moved the machine outside a drain: the thread may
            # take over again (within a drain, `NativeReceiver._drain` opens at its end).
            self._sync_fast()
