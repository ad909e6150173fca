"""`KvEventClient`: subscribe to every source (static or discovered), keep the index current, fan events out.

One anyio task group owns everything the client runs: a `SourceDriver` per source (each in its
own cancel scope, so a source can leave at runtime) and a discovery follower per target.
Leaving ``async with`` cancels them all; each closes its own sockets on the way out, and the
zmq Context is terminated if the client created it.

The index is fed by the drivers whether or not anyone iterates `events()`. Each iterator has
its own bounded buffer; when it is full the oldest envelope is dropped and counted, and the
iterator yields an `Overflow` lifecycle event in its place, so a slow consumer loses events
but never slows indexing down.

Warm restart: `KvEventClient.snapshot` writes the index with each source's position; a client
given ``index=PrefixIndex.restore(path)`` resumes every source whose worker has a saved
position (identity check first, docs/recovery.md rule 7) and drops the restored state of the others.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from types import TracebackType

import anyio
import msgspec
import zmq

from ._discovery import DiscoveryOptions, diff_sources, follow_target
from ._errors import ClientStateError, ConfigError
from ._events import Envelope, Overflow, Removed
from ._grpc_stream import GatewayStream, GatewayTransport
from ._index import PrefixIndex
from ._load import EngineLoads
from ._models import EventSource, WorkerKey, WorkerStatus
from ._snapshot import Cursor
from ._subscriber import (
    COUNTER_FIELDS,
    RateLimitedLog,
    ReplaySlots,
    SourceCounters,
    SourceStats,
    SubscriberConfig,
)
from ._transport import Driver, Transport, ZmqTransport
from ._zmq import DEFAULT_MAX_SOURCES, fit_sources

__all__ = ["ClientStats", "EventStream", "KvEventClient", "SourceStats", "SubscriberConfig", "TotalStats"]

log = logging.getLogger("kvroute.client")


def _first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (task groups wrap what their tasks raise)."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not inner:
            return exc
        exc = inner[0]


class TotalStats(SourceCounters, frozen=True, kw_only=True):  # type: ignore[misc]  # see SourceStats
    """Every `SourceCounters` field summed over the current sources, and how many are connected / synced / partial."""

    sources: int = 0
    connected: int = 0
    synced: int = 0
    partial: int = 0


class ClientStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of `KvEventClient` counters.

    ``sources``: per current source; ``totals``: their sum; ``refused_sources``: times a
    source was refused (see `KvEventClient.add_source`; discovery offers one again each round); ``removed_sources``:
    sources removed so far; ``events_dropped``: envelopes dropped by full `events()` buffers.
    """

    sources: dict[WorkerKey, SourceStats]
    totals: TotalStats
    refused_sources: int = 0
    removed_sources: int = 0
    failed_sources: int = 0
    events_dropped: int = 0


class EventStream:
    """An async iterator over the client's `Envelope` stream, with its own bounded buffer.

    Overflow policy: when ``capacity`` envelopes are waiting, each new one drops the oldest;
    the iterator then yields one `Overflow` envelope (with the number dropped) before the
    next surviving envelope. It ends when the client stops or on `aclose` (also usable as
    ``async with client.events() as stream:``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: Envelopes this iterator lost to overflow, in total.
        self.dropped = 0
        self._buffer: deque[Envelope] = deque()
        self._unreported = 0
        self._last_dropped: Envelope | None = None
        self._wakeup: anyio.Event | None = None
        self._closed = False

    def _push(self, envelope: Envelope) -> bool:
        """Buffer one envelope; True when that dropped the oldest."""
        buf = self._buffer
        dropped = len(buf) >= self.capacity
        if dropped:
            self._last_dropped = buf.popleft()
            self.dropped += 1
            self._unreported += 1
        buf.append(envelope)
        if self._wakeup is not None:
            self._wakeup.set()
        return dropped

    def _close(self) -> None:
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def pending(self) -> int:
        """Envelopes waiting to be taken: that many `__anext__` calls return without waiting."""
        return len(self._buffer) + (1 if self._unreported else 0)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._unreported:
                dropped, self._unreported = self._unreported, 0
                last = self._last_dropped
                assert last is not None  # set with every drop
                return Envelope(source=last.source, seq=None, ts=time.time(), event=Overflow(dropped=dropped))
            if self._buffer:
                return self._buffer.popleft()
            if self._closed:
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
            self._wakeup = None

    async def aclose(self) -> None:
        """Stop receiving; envelopes already buffered are discarded."""
        self._closed = True
        self._buffer.clear()
        self._unreported = 0

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _Hub:
    """The drivers' `EventSink`: copies each envelope to every live `EventStream`."""

    def __init__(self) -> None:
        # Weak: an iterator the caller dropped without closing stops costing anything.
        self._streams: weakref.WeakSet[EventStream] = weakref.WeakSet()
        #: Envelopes dropped by full iterators, all of them (closed ones included).
        self.dropped = 0

    @property
    def active(self) -> bool:
        return bool(self._streams)

    def add(self, stream: EventStream) -> None:
        self._streams.add(stream)

    def publish(self, envelope: Envelope) -> None:
        closed: list[EventStream] = []
        for stream in self._streams:
            if stream._closed:
                closed.append(stream)
            elif stream._push(envelope):
                self.dropped += 1
        for stream in closed:  # not while iterating: a set must not change size under its iterator
            self._streams.discard(stream)

    def close(self) -> None:
        for stream in list(self._streams):
            stream._close()
        self._streams = weakref.WeakSet()


class _Subscription:
    __slots__ = ("driver", "origin", "scope")

    def __init__(self, driver: Driver, origin: str | None, scope: anyio.CancelScope) -> None:
        self.driver = driver
        self.origin = origin
        self.scope = scope


class KvEventClient:
    """Subscribes to KV-event sources, keeps a `PrefixIndex` current, and streams what happens.

    ``sources`` are static `EventSource`s; ``targets`` are engine gRPC addresses
    (``host:port``) followed by discovery every ``discovery_interval`` seconds (a target
    failing for longer than ``discovery_grace`` has its workers removed until it answers
    again). ``index`` defaults to a new `PrefixIndex`; ``context`` to a zmq Context the
    client creates and terminates. The client is also the router's `WorkerStates`.

    Sources and targets can be added and removed while the client runs (inside ``async
    with``); a source whose driver fails is removed (a `Removed` event, reason
    "failed: <error>") and the others carry on.

    Warm restart: `snapshot` saves the index and each source's position. An ``index`` from
    `PrefixIndex.restore` carries the saved positions in ``restored_cursors``; the client
    takes them over (and empties that attribute, so a later ``index.snapshot(path)`` cannot
    pair stale positions with a changed index). Each source whose worker has one resumes
    from it (`SourceMachine.resume`: identity check on first connect, then replay of what
    the engine published since; a restarted engine, or a buffer that no longer reaches
    back to the position, resets the worker first). A restored worker whose source starts
    without a usable position (none saved, or no replay endpoint to check it with) is reset
    before its source starts. Restored workers that no source claims are removed from the
    index as soon as every target has answered discovery once (or been given up on), which
    is at entry when there are no targets. Until their sources are synced, restored
    workers are not "synced", so a router does not trust them. Leaving ``async with`` keeps
    where each source stopped: entering again resumes from there, like a restored index.
    A restored position out of range (or a ts that is not finite) drops that worker's
    restored state, with a warning; the other workers keep theirs.
    """

    def __init__(
        self,
        sources: Iterable[EventSource] = (),
        *,
        targets: Iterable[str] = (),
        index: PrefixIndex | None = None,
        config: SubscriberConfig | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        discovery_interval: float = 10.0,
        discovery_grace: float = 30.0,
        discovery_options: DiscoveryOptions | None = None,
    ) -> None:
        if not discovery_interval > 0 or not discovery_grace >= 0:
            raise ConfigError(
                "discovery_interval must be > 0 and discovery_grace >= 0, "
                f"not {discovery_interval!r}, {discovery_grace!r}"
            )
        self._config = config or SubscriberConfig()
        self._index = index if index is not None else PrefixIndex()
        self._initial_sources = list(sources)
        self._initial_targets = list(targets)
        self._ctx = context
        self._own_ctx = context is None
        self._discovery_interval = discovery_interval
        self._discovery_grace = discovery_grace
        self._discovery_options = discovery_options or DiscoveryOptions()
        # Warm restart: positions not yet handed to a source, and the restored workers no
        # source has claimed yet (removed once discovery has had its first say).
        self._resume: dict[WorkerKey, Cursor] = {}
        for key, cursor in self._index.restored_cursors.items():
            if isinstance(cursor.seq, int) and 0 <= cursor.seq < 2**64 - 1 and math.isfinite(cursor.ts):
                self._resume[key] = cursor
            else:
                # One bad position costs that worker its restored state, never the fleet's.
                log.warning("%s: restored state dropped: invalid position seq %r, ts %r", key, cursor.seq, cursor.ts)
                self._index.remove_worker(key)
        self._index.restored_cursors = {}
        self._unclaimed: set[WorkerKey] = self._index.workers() | set(self._resume)
        self._subs: dict[WorkerKey, _Subscription] = {}
        self._targets: dict[str, anyio.CancelScope] = {}
        # Targets whose first discovery has not answered yet: not synced (see wait_synced).
        self._targets_pending: set[str] = set()
        self._hub = _Hub()
        self._tg: anyio.abc.TaskGroup | None = None
        self._limiter: ReplaySlots | None = None
        self._max_sources = self._config.max_sources or DEFAULT_MAX_SOURCES
        self._changed: anyio.Event | None = None
        self._refused = 0
        self._removed = 0
        self._failed = 0
        self._log = RateLimitedLog("KvEventClient", log)
        #: Engine load reported by gateway-stream sources; a `Router` given this client prices it.
        self.engine_loads = EngineLoads()
        self._transports: list[Transport] = []

    # --- lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> KvEventClient:
        if self._tg is not None:
            raise ClientStateError("KvEventClient is already running")
        if self._ctx is None:
            self._ctx = zmq.Context()
            # Engines may publish on IPv6 ([::1] or a global address); libzmq's default is IPv4 only.
            self._ctx.setsockopt(zmq.IPV6, 1)
        try:
            try:
                self._max_sources = fit_sources(self._ctx, self._config.max_sources, own_context=self._own_ctx)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot size the zmq context for max_sources: {exc}") from exc
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
                self._ctx = None
            raise
        self._limiter = ReplaySlots(self._config.max_concurrent_replays, self._config.replay_slice)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

        def spawn(stream: GatewayStream) -> None:
            tg.start_soon(stream.run)

        self._transports = [
            GatewayTransport(self._config, self._discovery_options, self.engine_loads, spawn),
            ZmqTransport(self._ctx, self._config, self._limiter),
        ]
        try:
            for src in self._initial_sources:
                self.add_source(src)
            for target in self._initial_targets:
                self.add_target(target)
            self._drop_unclaimed()
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        tg.cancel_scope.cancel()
        try:
            return await tg.__aexit__(exc_type, exc, tb)
        finally:
            # Where the sources stopped stays resumable: a snapshot taken after the block, or
            # entering it again, resumes from there (every driver is done: nothing moves now).
            self._resume = self._positions()
            self._unclaimed = self._index.workers() | set(self._resume)
            self._subs.clear()
            self._targets.clear()
            self._targets_pending.clear()
            self._hub.close()
            self._wake()
            if self._own_ctx and self._ctx is not None:
                self._ctx.term()
                self._ctx = None

    def _task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise ClientStateError("KvEventClient is not running (use `async with`)")
        return self._tg

    # --- sources ----------------------------------------------------------------------------------

    @property
    def index(self) -> PrefixIndex:
        """The index the client keeps current."""
        return self._index

    @property
    def config(self) -> SubscriberConfig:
        """The subscription settings in force."""
        return self._config

    def sources(self) -> list[EventSource]:
        """Every source currently subscribed."""
        return [s.driver.source for s in self._subs.values()]

    def add_source(self, source: EventSource) -> bool:
        """Subscribe to one more source; False (logged, counted) when it is refused.

        A source whose key is already subscribed replaces the old one (whose index state is
        removed: a different endpoint is a different engine) unless it is the very same.
        Refused: more than ``max_sources``, a key another target (or static config) feeds, a
        malformed endpoint or CURVE key, or a CURVE source while the client has no key pair.
        """
        return self._add(source, origin=None)

    def _add(self, source: EventSource, origin: str | None) -> bool:
        tg = self._task_group()
        old = self._subs.get(source.key)
        if old is not None:
            if old.origin != origin:
                return self._refuse(source, f"worker {source.key} is already fed by {old.origin or 'static config'}")
            if old.driver.source == source:
                return True
            self._remove(source.key, "replaced")
        elif len(self._subs) >= self._max_sources:
            return self._refuse(source, f"max_sources ({self._max_sources}) reached")
        transport = next(t for t in self._transports if t.handles(source))
        problem = transport.problem(source)
        if problem is not None:
            return self._refuse(source, problem)
        self._unclaimed.discard(source.key)
        cursor = self._resume.pop(source.key, None)
        if cursor is not None and source.replay_endpoint is None:
            log.info("%s: restored state dropped: no replay endpoint to check it against", source.key)
            cursor = None
        if cursor is None and self._index.num_blocks(source.key):
            # Restored without a position: SourceMachine.start() assumes an empty slate.
            self._index.remove_worker(source.key)
        driver = transport.driver(source, index=self._index, sink=self._hub, on_change=self._wake, resume=cursor)
        scope = anyio.CancelScope()
        self._subs[source.key] = _Subscription(driver, origin, scope)
        tg.start_soon(self._run_driver, driver, scope)
        self._wake()
        return True

    def _refuse(self, source: EventSource, why: str) -> bool:
        self._refused += 1
        # Rate-limited: discovery offers the same refused source again every interval.
        self._log.warn("refused source", f"{source.key} ({source.endpoint}): {why}")
        return False

    async def _run_driver(self, driver: Driver, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await driver.run()
            except Exception as exc:
                # Containment: one source failing (an index that raises, the process out of
                # file descriptors) must not take every other source down with it.
                log.exception("source %s (%s) failed and was removed", driver.key, driver.source.endpoint)
                self._failed += 1
                sub = self._subs.get(driver.key)
                if sub is not None and sub.driver is driver:
                    self._remove(driver.key, f"failed: {type(_first_leaf(exc)).__name__}")

    def remove_source(self, source: EventSource | WorkerKey, *, reason: str = "removed") -> bool:
        """Unsubscribe a source and remove its worker from the index (with a `Removed` event).

        Returns False when it was not subscribed.
        """
        key = source.key if isinstance(source, EventSource) else source
        return self._remove(key, reason)

    def _remove(self, key: WorkerKey, reason: str) -> bool:
        sub = self._subs.pop(key, None)
        if sub is None:
            return False
        sub.driver.stop()
        sub.scope.cancel()
        self._index.remove_worker(key)
        self._removed += 1
        self._hub.publish(Envelope(source=sub.driver.source, seq=None, ts=time.time(), event=Removed(reason=reason)))
        self._wake()
        return True

    # --- discovery ----------------------------------------------------------------------------------

    def targets(self) -> list[str]:
        """Every target currently followed."""
        return list(self._targets)

    def add_target(self, target: str) -> None:
        """Follow one more engine (``host:port`` of its gRPC server); no-op if already followed."""
        tg = self._task_group()
        if target in self._targets:
            return
        scope = anyio.CancelScope()
        self._targets[target] = scope
        self._targets_pending.add(target)
        tg.start_soon(self._follow, target, scope)

    def remove_target(self, target: str, *, reason: str = "target removed") -> bool:
        """Stop following a target and remove its workers; False if it was not followed."""
        scope = self._targets.pop(target, None)
        if scope is None:
            return False
        scope.cancel()
        self._targets_pending.discard(target)
        for key in self._keys_of(target):
            self._remove(key, reason)
        self._drop_unclaimed()
        self._wake()
        return True

    def _keys_of(self, target: str) -> list[WorkerKey]:
        return [k for k, s in self._subs.items() if s.origin == target]

    async def _follow(self, target: str, scope: anyio.CancelScope) -> None:
        async def on_sources(sources: list[EventSource]) -> None:
            self._on_discovered(target, sources)

        async def on_unreachable(err: BaseException) -> None:
            log.warning("target %s unreachable, removing its workers: %s", target, err)
            self._targets_pending.discard(target)
            for key in self._keys_of(target):
                self._remove(key, "unreachable")
            self._drop_unclaimed()
            self._wake()

        with scope:
            await follow_target(
                target,
                self._discovery_options,
                on_sources,
                on_unreachable,
                interval=self._discovery_interval,
                grace=self._discovery_grace,
            )

    def _on_discovered(self, target: str, sources: Sequence[EventSource]) -> None:
        if self._tg is None or target not in self._targets:
            # Leaving `async with` (cancellation has not reached this task yet), or the target
            # was removed while the answer was on its way.
            return
        current = [self._subs[k].driver.source for k in self._keys_of(target)]
        diff = diff_sources(current, list(sources))
        for src in diff.removed:
            self._remove(src.key, "gone from discovery")
        for new in diff.replaced:
            # A changed source is a new engine behind the same worker key: its state is gone.
            self._remove(new.key, "replaced")
            self._add(new, target)
        for src in diff.added:
            self._add(src, target)
        self._targets_pending.discard(target)
        self._drop_unclaimed()
        self._wake()

    def _drop_unclaimed(self) -> None:
        """Once every target has answered (or been given up on): forget restored workers no source feeds."""
        if self._targets_pending or not self._unclaimed:
            return
        for key in self._unclaimed:
            if key not in self._subs:
                log.info("%s: restored state dropped: no configured or discovered source feeds it", key)
                self._index.remove_worker(key)
                self._resume.pop(key, None)
        self._unclaimed.clear()

    # --- warm restart ---------------------------------------------------------------------------------

    def cursors(self) -> dict[WorkerKey, Cursor]:
        """Where each current source stands: its newest applied seq and that batch's ts.

        A worker is listed while the index holds the run of batches that ends there (none
        right after a reset until something is applied), partial ones included. Restored
        positions not yet taken by a source are not listed.
        """
        out: dict[WorkerKey, Cursor] = {}
        for key, sub in self._subs.items():
            cursor = sub.driver.cursor()
            if cursor is not None:
                out[key] = cursor
        return out

    def snapshot(self, path: str | os.PathLike[str]) -> None:
        """Write the index and every source's position to ``path`` (atomically; see `PrefixIndex.snapshot`).

        Runs synchronously, so the index and the positions are taken at one instant (it blocks
        the event loop for the write: ~0.3 s per million entries on a slow machine). Works
        inside ``async with`` and after it (then with where each source stopped). Partial
        workers are saved without a position, so a client resuming from the file resets
        them and replays what their buffers hold (their history before it is unknown either
        way). Restored positions no source has taken yet are written back as they were.
        """
        # Given none, PrefixIndex.snapshot falls back to the index's restored_cursors: the
        # client emptied those on construction, so an empty dict really writes none.
        self._index.snapshot(path, cursors=self._positions())

    def _positions(self) -> dict[WorkerKey, Cursor]:
        """The positions a snapshot saves: every non-partial source's, and restored ones not yet taken."""
        out = {k: c for k, c in self.cursors().items() if not self._subs[k].driver.machine.partial}
        for key, cursor in self._resume.items():
            out.setdefault(key, cursor)
        return out

    # --- state --------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _all_synced(self) -> bool:
        return not self._targets_pending and all(s.driver.machine.state == "synced" for s in self._subs.values())

    async def wait_synced(self, timeout: float) -> None:  # noqa: ASYNC109 (the public API names it, docs/architecture.md)
        """Return once every current source is caught up (cold-start replay done, no gap pending).

        Targets count too: each must have answered discovery once (or been given up on).
        Raises TimeoutError after ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while not self._all_synced():
                if self._tg is None:
                    raise ClientStateError("KvEventClient is not running (use `async with`)")
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        """The worker's sync state, or None when no current source feeds it."""
        sub = self._subs.get(worker)
        return sub.driver.status() if sub is not None else None

    def live_workers(self) -> set[WorkerKey]:
        """Every worker with a current source."""
        return set(self._subs)

    def events(self, *, buffer: int | None = None) -> EventStream:
        """A new iterator over every envelope from now on (engine and lifecycle events).

        ``buffer`` overrides the configured ``events_buffer`` for this iterator.
        """
        stream = EventStream(buffer if buffer is not None else self._config.events_buffer)
        if self._tg is None:
            stream._close()
        else:
            self._hub.add(stream)
        return stream

    def stats(self) -> ClientStats:
        """A snapshot of every source's counters, their totals, and the client's own."""
        # A copy first (one C call): a scrape from another thread must not iterate a dict
        # the event loop resizes under it.
        per = {k: s.driver.stats() for k, s in self._subs.copy().items()}
        sums = {name: sum(getattr(st, name) for st in per.values()) for name, _ in COUNTER_FIELDS}
        totals = TotalStats(
            sources=len(per),
            connected=sum(st.connected for st in per.values()),
            synced=sum(st.state == "synced" for st in per.values()),
            partial=sum(st.partial for st in per.values()),
            **sums,
        )
        return ClientStats(
            sources=per,
            totals=totals,
            refused_sources=self._refused,
            removed_sources=self._removed,
            failed_sources=self._failed,
            events_dropped=self._hub.dropped,
        )
