"""The JetStream transport: `KvEventClient` follows a relay's log instead of the engines (docs/replicas.md).

``KvEventClient(jetstream="nats://nats:4222/KVROUTE")`` (a `JetStreamSource`) starts from the
stream's latest snapshot (imported into the client's own index), replays the log from the sequence
it covers, then follows it live; it never talks to the engines. Unlike the other transports it
names its sources itself: each worker the log names becomes an `EventSource` of the client
(endpoint ``nats://host:port/<stream>``, no replay endpoint) the moment its first record is read,
and a ``removed`` record removes it. One `JetStreamTransport` per client reads the stream (the way
`kvroute._transports.gateway` reads one stream for every rank) and hands each worker's records to
its `JetStreamWorkerDriver`.

Why a driver per worker on the shared base (`DriverBase`), not a separate object: the client's
views (``wait_synced``, ``stats``, ``cursors``, ``worker_status``, ``events()``, the router's
`WorkerStates`) are built from drivers and their `RecoveryMachine`, so a log-backed worker is one
more driver and every view works unchanged. The rules are the log's (`kvroute._jetstream_log.LogRules`,
shared with `JetStreamReplica`): they change the index and tell the driver what happened, and the
driver moves its machine by its public inputs — `RecoveryMachine.on_applied` for each batch,
`on_data_loss` for a reset (the relay's, or an uncovered gap in the log: then also partial),
`on_reconnected` once the transport has read everything the stream held when it subscribed (until
then, and so until the client's pending stream is settled, the workers are "syncing").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, get_args

import anyio
import anyio.to_thread

from .._errors import ConfigError, JetStreamError, SnapshotError
from .._events import Connected, Envelope, Partial, ResetReason
from .._index import PrefixIndex
from .._jetstream import SnapshotInfo
from .._jetstream_log import LogReader, LogRules, LogSource, LogWorker
from .._jetstream_nats import NatsLoop
from .._jetstream_replica import ReplicaStats, restore_into
from .._models import EventSource, WorkerKey
from .._snapshot import Cursor
from .._source import Action, Emit, RecreateSubscriber
from .._wire import Limits, decode_batch
from ._base import DriverBase, EventSink, emit_lifecycle

__all__ = ["JetStreamSource", "JetStreamTransport", "JetStreamWorkerDriver", "SourceFeed"]

log = logging.getLogger("kvroute.jetstream")

_REASONS: frozenset[str] = frozenset(get_args(ResetReason))


def _reason(reason: str) -> ResetReason:
    """The relay's reset reason as a lifecycle token (a log written by another version may name others)."""
    return reason if reason in _REASONS else "data-loss"  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class SourceFeed:
    """What `KvEventClient` lends a transport that names its own sources (passed through `client_transports`).

    ``add(source)`` subscribes a source (False: refused, e.g. ``max_sources``); ``remove(key, reason)``
    removes one; ``pending(name, why)`` keeps the client from being synced while ``name`` is pending
    (``why`` names what it waits for; None settles it); ``spawn(run)`` starts a task in the client's
    task group.
    """

    index: PrefixIndex
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object]
    add: Callable[[EventSource], bool]
    remove: Callable[[WorkerKey, str], bool]
    pending: Callable[[str, str | None], None]


class JetStreamSource(LogSource):
    """A relay's JetStream log as the source of a `KvEventClient` (``KvEventClient(jetstream=...)``).

    The client's public form is a URL, ``jetstream="nats://host:4222/KVROUTE"`` (`from_url`); this
    object is that URL's meaning, with the options a test or benchmark may set (`LogSource`'s:
    ``servers``, ``stream``, ``use_snapshot``, ``connect_timeout``, ``name``, ``limits``). One
    client at a time uses a source; `stats` are the log's counters of the client currently (or
    last) using it.
    """

    _transport: JetStreamTransport | None = None
    _on_applied: Callable[[int, WorkerKey, int | None], None] | None = None

    @classmethod
    def from_url(cls, url: str, *, limits: Limits | None = None) -> JetStreamSource:
        """``nats://host:port/<stream>`` (``tls://`` too; no path: the stream ``KVROUTE``), or `ConfigError`."""
        scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
        host, _, stream = rest.partition("/")
        if scheme not in ("nats", "tls") or not sep or not host:
            raise ConfigError(f"jetstream {url!r} is not nats://host[:port][/stream]")
        return cls(f"{scheme}://{host}", stream=stream.rstrip("/") or "KVROUTE", limits=limits)

    def attach(self, feed: SourceFeed) -> JetStreamTransport:
        """The transport of one client run (`KvEventClient` calls this on entering ``async with``)."""
        transport = JetStreamTransport(self, feed)
        transport.rules.on_applied = self._on_applied
        self._transport = transport
        # Pending from the start: the client is not synced before the log has been read.
        feed.pending(self.endpoint, "connecting to NATS")
        feed.spawn(transport.run)
        return transport

    @property
    def on_applied(self) -> Callable[[int, WorkerKey, int | None], None] | None:
        """Called after each applied record: stream sequence, worker, engine seq (None for lifecycle records)."""
        return self._on_applied

    @on_applied.setter
    def on_applied(self, fn: Callable[[int, WorkerKey, int | None], None] | None) -> None:
        self._on_applied = fn
        if self._transport is not None:
            self._transport.rules.on_applied = fn

    def stats(self) -> ReplicaStats:
        """The log's counters: position, the snapshot started from, chain gaps, stream gaps, duplicates."""
        t = self._transport
        if t is None:
            return ReplicaStats(position=0, snapshot_seq=0, synced=False, workers=0)
        return ReplicaStats(
            position=t.rules.position,
            snapshot_seq=t.snapshot_seq,
            synced=t.reader.synced,
            workers=len(t.drivers),
            **t.rules.counts,
        )


class JetStreamTransport:
    """One client's reading of the log: the shared consumer, the rules, and a driver per worker it names."""

    def __init__(self, source: JetStreamSource, feed: SourceFeed) -> None:
        self.source = source
        self.feed = feed
        self.drivers: dict[WorkerKey, JetStreamWorkerDriver] = {}
        self.rules = LogRules(
            feed.index,
            source.limits,
            f"jetstream {source.endpoint}",
            worker=self._worker,
            workers=lambda: list(self.drivers.items()),
            remove=self._remove,
        )
        self.reader = LogReader(
            source.stream, f"jetstream {source.endpoint}", self.rules, use_snapshot=source.use_snapshot
        )
        self.snapshot_seq = 0
        #: The stream is read up to where it stood when subscribed: the drivers are connected.
        self.caught_up = False

    # --- Transport ------------------------------------------------------------------------------

    def handles(self, source: EventSource) -> bool:
        """The sources this log names (endpoint ``nats://host:port/<stream>``)."""
        return source.endpoint == self.source.endpoint

    def problem(self, source: EventSource) -> str | None:
        """Nothing: a worker of the log needs no socket."""
        return None

    def hold(self) -> bool:
        """Nothing to hold: the log's records are applied on the event loop (`Transport.hold`). False."""
        return False

    def release(self) -> None:
        """Nothing was held (`Transport.release`)."""

    def driver(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        resume: Cursor | None,
    ) -> JetStreamWorkerDriver:
        """A worker's driver (``resume`` is ignored: the log, not a restored file, is the worker's history)."""
        drv = JetStreamWorkerDriver(source, self, index=index, sink=sink, on_change=on_change)
        self.drivers[source.key] = drv
        return drv

    # --- the log's workers ----------------------------------------------------------------------

    def _worker(self, key: WorkerKey) -> LogWorker | None:
        drv = self.drivers.get(key)
        if drv is None and self.feed.add(
            EventSource(worker_id=key.worker_id, dp_rank=key.dp_rank, endpoint=self.source.endpoint, engine="jetstream")
        ):
            drv = self.drivers.get(key)
        return drv

    def _remove(self, key: WorkerKey, reason: str) -> None:
        # Detached first: nothing of the log reaches a removed worker's driver between here and its cancellation.
        self.drivers.pop(key, None)
        if not self.feed.remove(key, reason):
            self.feed.index.remove_worker(key)

    def detach(self, drv: JetStreamWorkerDriver) -> None:
        """A driver stopped (removed by the log, the caller, or the client leaving)."""
        if self.drivers.get(drv.key) is drv:
            del self.drivers[drv.key]

    # --- reading ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying while NATS is away), then read the stream until the client leaves."""
        name, feed = self.source.endpoint, self.feed
        nl = NatsLoop(self.source.servers, self.source.name)
        try:
            while True:
                try:
                    await nl.start(self.source.connect_timeout)
                    break
                except JetStreamError as exc:
                    feed.pending(name, str(exc))
                    await anyio.sleep(1.0)
            feed.pending(name, "reading the snapshot and the log")
            await self.reader.follow(nl, self._restore, self._progress)
        finally:
            with anyio.CancelScope(shield=True):
                await nl.close()

    async def _restore(self, data: bytes, info: SnapshotInfo) -> int | None:
        """Import the snapshot into the client's index: a source per worker, each at its position."""
        partial = {WorkerKey(*k) for k in info.partial}
        keys = [WorkerKey(*k) for k in info.workers]
        # Sources first: a source added later would drop a restored worker it has no replay endpoint to check.
        taken = [(k, w) for k in keys if (w := self._worker(k)) is not None]
        try:
            cursors = await anyio.to_thread.run_sync(restore_into, self.feed.index, data, [k for k, _ in taken])
        except SnapshotError as exc:
            log.warning("%s: snapshot unusable, reading the log from its start: %s", self.source.endpoint, exc)
            return None
        for key, w in taken:
            assert isinstance(w, JetStreamWorkerDriver)
            w.restored(cursors.get(key), key in partial)
        self.snapshot_seq = info.stream_seq
        return info.stream_seq

    def _progress(self) -> None:
        """After each slice of records: once caught up, every worker is connected and the stream settled."""
        if self.caught_up or not self.reader.synced:
            return
        self.caught_up = True
        for drv in list(self.drivers.values()):
            drv.connect()
        self.feed.pending(self.source.endpoint, None)


class JetStreamWorkerDriver(DriverBase):
    """One worker of the log for the client (the `kvroute._transports._base.Driver` of JetStream; a `LogWorker`)."""

    def __init__(
        self,
        source: EventSource,
        transport: JetStreamTransport,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
    ) -> None:
        super().__init__(source, index=index, sink=sink, on_change=on_change, has_replay=False)
        self._transport = transport
        #: The worker's newest batch in the log (`LogWorker.last`; set by the rules).
        self.last: Cursor | None = None
        # Started at once: the log's records reach the driver before its task runs.
        self.execute(self.first_actions())

    async def run(self) -> None:
        """Nothing to read here (the transport reads the stream): wait to be cancelled, then detach."""
        try:
            if self._transport.caught_up:
                self.connect()
            await anyio.sleep_forever()
        finally:
            self._transport.detach(self)
            self.connected = False

    def stop(self) -> None:
        """Stop at once: no record of the log reaches this driver any more."""
        super().stop()
        self._transport.detach(self)

    def on_action(self, action: Action) -> None:
        """`RecreateSubscriber` after a reset: nothing to recreate (the log goes on in order)."""
        if not isinstance(action, RecreateSubscriber):
            super().on_action(action)

    def connect(self) -> None:
        """The log is read up to where it stood at subscription: this worker is as current as the log."""
        if not self.connected:
            self.connected = True
            self.execute(self.machine.on_reconnected())

    def restored(self, cursor: Cursor | None, partial: bool) -> None:
        """The snapshot's state of this worker is in the index, through ``cursor``."""
        self.last = cursor
        if cursor is not None:
            self.machine.on_applied(cursor.seq, cursor.ts)
            self.counters.batches -= 1  # a restored position, not a batch applied here
        if partial:
            self._partial("snapshot", cursor.seq + 1 if cursor is not None else 0)

    # --- LogWorker: what the rules did ------------------------------------------------------------

    def applied(self, batches: list[tuple[int, float, int]], payloads: list[bytes], blocks: int) -> None:
        """Consecutive batches, each ``(seq, ts, payload length)``, are in the index (``blocks`` stored)."""
        if self._stopped:
            return
        on_applied = self.machine.on_applied
        for seq, ts, _ in batches:
            on_applied(seq, ts)
        c = self.counters
        c.messages += len(batches)
        c.blocks += blocks
        sink = self._sink
        if sink.active:  # listeners get the events, as from engines (decoded only for them)
            source = self.source
            for (seq, ts, _), payload in zip(batches, payloads):
                for ev in decode_batch(payload).events:
                    sink.publish(Envelope(source=source, seq=seq, ts=ts, event=ev))

    def reset(self, reason: str, detail: str) -> None:
        """The relay reset the worker (its engine restarted, its buffer did not reach back...)."""
        self._reset(f"{reason} (relay): {detail}")
        self.counters.uncovered -= 1  # the relay's reset: the log lost nothing

    def lost(self, reason: str, detail: str, first_seq: int) -> None:
        """The log lost part of the worker's history (or a batch did not decode): reset, partial from ``first_seq``."""
        if reason == "undecodable":
            self.counters.undecodable += 1
        self._reset(f"{reason}: {detail}")
        self._partial(_reason(reason), first_seq)

    def mark_partial(self, reason: str, first_seq: int) -> None:
        """The relay marked the worker partial."""
        self._partial(_reason(reason), first_seq)

    def duplicate(self) -> None:
        """A batch at or below the worker's newest one (an overlap of two relays' runs) was skipped."""
        self.counters.duplicates += 1

    def _reset(self, detail: str) -> None:
        if self._stopped:
            return
        # on_data_loss resets (ResetWorker: the rules emptied the worker already) and starts the
        # machine over; the reconnect that follows is this driver's, not a connection's: no event.
        actions = self.machine.on_data_loss(detail)
        if self.connected:
            actions += [
                a for a in self.machine.on_reconnected() if not (type(a) is Emit and isinstance(a.event, Connected))
            ]
        self.execute(actions)

    def _partial(self, reason: ResetReason, first_seq: int) -> None:
        if self._stopped or self.machine.partial:
            return
        self.machine.partial = True
        emit_lifecycle(self._log, self._sink, self.source, Partial(reason, first_seq))
        self._on_change()
