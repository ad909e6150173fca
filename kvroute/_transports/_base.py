"""What every transport shares: the driver interface and base, counters, stats, logging, applying.

A transport moves bytes and time; the recovery rules live in one place, the sans-I/O
`kvroute._source.RecoveryMachine`. Each driver feeds its source's machine and carries out what it
returns through `DriverBase.execute`: apply batches to the index (and fan their events out),
reset the worker, emit lifecycle events; the transport-specific actions (ask a replay, recreate
the subscriber) go to the driver's `DriverBase.on_action`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Protocol, get_args

import msgspec
from msgspec import Meta

from .._events import Envelope, LifecycleEvent, Partial, Reset
from .._index import PrefixIndex
from .._load import EngineLoad
from .._models import EventSource, SourceState, WorkerKey, WorkerStatus
from .._recovery import Payload
from .._snapshot import Cursor
from .._source import Action, Apply, Emit, RecoveryMachine, RecoveryStats, ResetWorker
from .._wire import BatchDecoder, BlockStored, Limits

__all__ = [
    "COUNTER_FIELDS",
    "Driver",
    "DriverBase",
    "EventSink",
    "FleetWarning",
    "RateLimitedLog",
    "SourceCounters",
    "SourceStats",
    "Transport",
    "apply_items",
    "described_fields",
    "emit_lifecycle",
]

log = logging.getLogger("kvroute.subscriber")

# One warning per kind of trouble per source per 10 s: a publisher spewing garbage at line
# rate must not turn the router's log into the bottleneck (the counts are in the stats).
_LOG_EVERY = 10.0


class SourceCounters(RecoveryStats, kw_only=True):
    """Every counter of one source: the machine's recovery counters plus the driver's I/O counters.

    The one definition of the I/O counters (the recovery ones are `RecoveryStats`'s): the
    driver counts into one instance of this, which its machine shares; `SourceStats` and
    `kvroute.TotalStats` extend it and the Prometheus per-source families are derived from
    its fields, each field's description being the metric's help. Adding a counter is adding
    a field here (or to `RecoveryStats`) and counting it.
    """

    messages: Annotated[int, Meta(description="Live messages received, of any shape.")] = 0
    blocks: Annotated[int, Meta(description="Blocks stored by the applied batches.")] = 0
    decode_errors: Annotated[
        int, Meta(description="Payloads that did not decode (malformed, non-finite ts, or past a Limits cap).")
    ] = 0
    unknown_events: Annotated[int, Meta(description="Events of an unknown type, skipped.")] = 0
    skipped_frames: Annotated[
        int, Meta(description="Messages or replay replies of the wrong frame shape, skipped.")
    ] = 0
    replayed_batches: Annotated[int, Meta(description="Batches received in replay replies.")] = 0
    replay_yields: Annotated[
        int, Meta(description="Replay turns that gave their slot up to a waiting source before any reply.")
    ] = 0
    probes_deferred: Annotated[
        int,
        Meta(
            description="Quiet ticks that asked no probe because every replay slot was taken or waited for "
            "(docs/recovery.md rule 9)."
        ),
    ] = 0
    replay_cutoffs: Annotated[
        int, Meta(description="Replays ended by the replay deadline or reply budget, end marker unseen.")
    ] = 0
    wakeups_cut: Annotated[
        int, Meta(description="Pump wakeups that stopped at the wakeup byte budget with messages still queued.")
    ] = 0


# msgspec lets a frozen Struct extend a mutable one; mypy applies dataclass rules, which do not.
class SourceStats(SourceCounters, frozen=True, kw_only=True):  # type: ignore[misc]
    """A snapshot of one source: its counters since it was added (`SourceCounters`) and its condition.

    The counter fields are described in `SourceCounters` and `kvroute._source.RecoveryStats`
    (e.g. ``messages``, ``batches``, ``gaps``, ``replays``, ``resets``, ``duplicates``,
    ``stale``, ``restarts``, ``uncovered``, ``overflows``).
    """

    last_seq: Annotated[int, Meta(description="The last applied seq (-1 before any).")] = -1
    connected: Annotated[bool, Meta(description="1 while the SUB socket has a publisher.")] = False
    partial: Annotated[bool, Meta(description="1 when the worker's history before its replay buffer is unknown.")] = (
        False
    )
    state: SourceState = "syncing"
    apply_lag: Annotated[
        float,
        Meta(description="Seconds from the newest applied live batch's ts (the engine's clock) to its apply."),
    ] = 0.0
    #: The engine's newest load record (gateway streams only).
    load: EngineLoad | None = None


def described_fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, str], ...]:
    """(name, description) of every field of ``cls``, in definition order ("" when undescribed)."""
    out = []
    for f in msgspec.structs.fields(cls):
        meta = [m for m in get_args(f.type)[1:] if isinstance(m, Meta)]
        out.append((f.name, (meta[0].description or "") if meta else ""))
    return tuple(out)


#: (name, description) of every per-source counter, in definition order (`SourceCounters`).
COUNTER_FIELDS = described_fields(SourceCounters)


class EventSink(Protocol):
    """Where a driver sends envelopes (the client's fan-out to `events()` iterators)."""

    @property
    def active(self) -> bool:
        """True when someone listens; engine-event envelopes are built only then."""
        ...

    def publish(self, envelope: Envelope) -> None:
        """Deliver one envelope without blocking."""
        ...


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

    def now(self, level: int, kind: str, detail: str) -> None:
        """Log ``detail`` under ``kind`` at ``level`` now, not rate-limited (a `FleetWarning` limits its own)."""
        self._logger.log(level, "%s: %s: %s", self._who, kind, detail)


class FleetWarning:
    """One kind of warning every source of a fleet may raise at once: one WARNING per 10 s across
    all of them, naming the first source and counting the others; each source's own line at DEBUG.

    A cold sync of 4,096 ranks whose replay buffers have wrapped makes every source's history
    partial together: a line per source was 4,096 WARNING lines and ~10 % of the sync's CPU. Per
    process, not per client (each driver's own `RateLimitedLog` is per source); the lock is for
    clients running on several threads.
    """

    __slots__ = ("_kind", "_lock", "_next", "_suppressed")

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._lock = threading.Lock()
        self._next = 0.0
        self._suppressed = 0

    def warn(self, source_log: RateLimitedLog, detail: str) -> None:
        """Log ``detail`` for the source of ``source_log`` at DEBUG; at WARNING unless another source
        was warned of in the last 10 s (then count it for the next warning)."""
        source_log.now(logging.DEBUG, self._kind, detail)
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._suppressed += 1
                return
            self._next = now + _LOG_EVERY
            more, self._suppressed = self._suppressed, 0
        suffix = f" (and {more} more sources since the last report: each at DEBUG, in its stats)" if more else ""
        source_log.now(logging.WARNING, self._kind, f"{detail}{suffix}")


#: Partial histories (`Partial`): a fleet's cold sync may make every source's partial at once.
_HISTORY_INCOMPLETE = FleetWarning("history incomplete")


def apply_items(
    index: PrefixIndex,
    source: EventSource,
    sink: EventSink,
    items: Sequence[tuple[int, float, Payload]],
    limits: Limits | None = None,
) -> int:
    """Apply a machine's `Apply` run to the index, fan its events out; the blocks stored (any transport).

    A run of judged payloads (`kvroute._recovery.Payload`, the ZMQ driver's replay answers) goes
    through the raw-bytes ingest in one call (``limits``: the ones they were judged with) while
    nobody listens; with a listener each is decoded here, for its events.
    """
    apply_batch, key = index.apply_batch, source.key
    emit = sink.active
    blocks = 0
    run: list[bytes] = []
    for seq, ts, batch in items:
        if isinstance(batch, bytes):
            if not emit:
                run.append(batch)
                continue
            # A listener came after the payload was judged: it gets the events all the same.
            batch = BatchDecoder(limits).decode(batch)
        if run:
            blocks += index.apply_payloads(key, run, limits)
            run = []
        apply_batch(key, batch)
        for ev in batch.events:
            if type(ev) is BlockStored:
                blocks += len(ev.block_hashes)
            if emit:
                sink.publish(Envelope(source=source, seq=seq, ts=ts, event=ev))
    if run:
        blocks += index.apply_payloads(key, run, limits)
    return blocks


def emit_lifecycle(log: RateLimitedLog, sink: EventSink, source: EventSource, event: LifecycleEvent) -> None:
    """Log a reset (rate-limited per source) or a partial history (per fleet: `FleetWarning`), and fan
    the lifecycle event out (any transport)."""
    if isinstance(event, Reset):
        log.warn("index state reset", f"{event.reason}: {event.detail}")
    elif isinstance(event, Partial):
        _HISTORY_INCOMPLETE.warn(log, f"{event.reason}: blocks known from seq {event.first_seq} on")
    sink.publish(Envelope(source=source, seq=None, ts=time.time(), event=event))


class Driver(Protocol):
    """Follows one source for the client (every transport's driver is a `DriverBase`)."""

    source: EventSource
    key: WorkerKey
    machine: RecoveryMachine
    #: While the transport has a live connection to the publisher (or stream).
    connected: bool

    async def run(self) -> None:
        """Follow the source until cancelled; release everything on the way out."""
        ...

    def stop(self) -> None:
        """Stop touching the index and the listeners at once (cancellation follows)."""
        ...

    def status(self) -> WorkerStatus:
        """The worker's sync state."""
        ...

    def cursor(self) -> Cursor | None:
        """The newest applied position while the index holds this source's run."""
        ...

    def stats(self) -> SourceStats:
        """The source's counters."""
        ...

    def vouched(self) -> bool:
        """The transport itself shows the source exists now (discovery keeps it whatever it hears)."""
        ...

    def streaming(self) -> str | None:
        """The gateway service whose stream carries this source live now, else None."""
        ...


class Transport(Protocol):
    """Builds drivers for the sources it carries."""

    def handles(self, source: EventSource) -> bool:
        """Whether this transport carries ``source``."""
        ...

    def problem(self, source: EventSource) -> str | None:
        """Why ``source`` cannot be subscribed, or None."""
        ...

    def driver(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        resume: Cursor | None,
    ) -> Driver:
        """A driver for ``source`` (not yet running)."""
        ...

    def hold(self) -> bool:
        """Stop applying outside the event loop, with everything applied recorded by its source's machine.

        For a reader of the index and the positions together (`KvEventClient.cursors`, a
        snapshot). True when this call held something, which the caller then `release`s; False
        when there is nothing to hold (every batch is applied on the event loop, as by the
        gateway and JetStream transports) or it was held already (its holder releases it).
        """
        ...

    def release(self) -> None:
        """Let what `hold` held apply again (nothing when nothing is held)."""
        ...


class DriverBase:
    """The part of a driver every transport shares: its machine, counters, views and action loop.

    A transport's driver subclasses this, implements ``run`` (feeding ``machine`` and passing
    what it returns to `execute`), and handles its own actions in `on_action`. ``resume``: the
    index already holds this worker's state through that position (a restored snapshot); the
    machine resumes from it (`RecoveryMachine.resume`) instead of starting cold, and `first_actions`
    hands the driver what resuming asked for.
    """

    def __init__(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        has_replay: bool,
        max_held_bytes: int | None = None,
        resume: Cursor | None = None,
    ) -> None:
        self.source = source
        self.key = source.key
        #: Every counter of this source; the machine counts its recovery ones into it too.
        self.counters = SourceCounters()
        self.machine = RecoveryMachine(has_replay=has_replay, max_held_bytes=max_held_bytes, stats=self.counters)
        # Resumed now, not in run(): the restored state is the machine's from the start, so
        # `cursor` reports it even before the task runs. Its actions are carried out in run().
        self._first_actions = self.machine.resume(resume.seq, resume.ts) if resume is not None else None
        self._index = index
        self._sink = sink
        self._on_change = on_change
        self._log = RateLimitedLog(f"{source.worker_id}[{source.dp_rank}] {source.endpoint}")
        # Set by stop(): the index and the listeners are no longer this driver's to touch.
        self._stopped = False
        self.connected = False

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
        """The newest applied seq and its ts while the index holds this source's run (`RecoveryMachine.applied`)."""
        applied = self.machine.applied
        return Cursor(*applied) if applied is not None else None

    def stats(self) -> SourceStats:
        """A snapshot of this source's counters and condition."""
        self.refresh_counters()
        m = self.machine
        return SourceStats(
            **msgspec.structs.asdict(self.counters),
            last_seq=m.last_seq,
            connected=self.connected,
            partial=m.partial,
            state=m.state,
            load=self.load(),
        )

    def refresh_counters(self) -> None:
        """Bring counters kept elsewhere (a decoder's, a shared stream's) into ``counters``; none by default."""

    def load(self) -> EngineLoad | None:
        """The engine's newest load record, for transports that carry one (None by default)."""
        return None

    def vouched(self) -> bool:
        """The transport itself shows the source exists now: discovery keeps it whatever it hears (default False)."""
        return False

    def streaming(self) -> str | None:
        """The gateway service whose stream carries this source live now (None by default).

        Such a stream is its target's proof of life: discovery then asks the rank count only.
        """
        return None

    # --- actions --------------------------------------------------------------------------------

    def first_actions(self) -> list[Action]:
        """What the machine asks for first: resuming a restored position, else starting (once)."""
        first, self._first_actions = self._first_actions, None
        return first if first is not None else self.machine.start()

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out the machine's actions, in order; the transport's own go to `on_action`."""
        if self._stopped:
            return
        changed = False
        for action in actions:
            if type(action) is Apply:
                self.apply(action.items)
            elif type(action) is Emit:
                emit_lifecycle(self._log, self._sink, self.source, action.event)
                changed = True  # every state change comes with a lifecycle event
            elif type(action) is ResetWorker:
                self._index.remove_worker(self.key)
            else:
                self.on_action(action)
        self.after_actions()
        if changed:
            self._on_change()

    def on_action(self, action: Action) -> None:
        """A transport-specific action (`RequestReplay`, `RecreateSubscriber`); the subclass says what it means."""
        raise NotImplementedError(f"{type(self).__name__} cannot carry out {type(action).__name__}")

    def after_actions(self) -> None:
        """Called after each `execute` run of actions, before ``on_change``; nothing by default."""

    def apply(self, items: Sequence[tuple[int, float, Payload]]) -> None:
        """Apply an `Apply` run to the index and fan its events out (nothing once stopped)."""
        if self._stopped:
            return
        self.counters.blocks += apply_items(self._index, self.source, self._sink, items, self.limits)

    @property
    def limits(self) -> Limits | None:
        """The `Limits` this driver judges payloads with (None: the defaults; see `apply_items`)."""
        return None
