"""`KvEventClient`: subscribe to every source (static or discovered), keep the index current, fan events out.

One anyio task group owns everything the client runs: a driver per source (each in its own
cancel scope, so a source can leave at runtime; the transports come from
`kvroute._transports._registry`) and a discovery follower per target.
Leaving ``async with`` cancels them all; each closes its own sockets on the way out, and the
zmq Context is terminated if the client created it.

The index is fed by the drivers whether or not anyone iterates `events()`; each iterator has
its own bounded buffer (`kvroute._fanout`: a slow consumer loses events, counted, but never
slows indexing down).

Warm restart: `KvEventClient.snapshot` writes the index with each source's position; a client
given ``index=PrefixIndex.restore(path)`` resumes every source whose worker has a saved
position (identity check first, docs/recovery.md rule 7) and drops the restored state of the others
(the bookkeeping is `kvroute._restore.Restored`). `stats` is assembled by `kvroute._stats`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType

import anyio
import msgspec
import zmq

from ._discovery import DiscoveryOptions, diff_sources, follow_target, parse_target
from ._errors import ClientStateError, ConfigError, DiscoveryError, KvRouteError, NotSyncedError
from ._events import Envelope, Removed
from ._fanout import EventStream, Hub, RawTap
from ._index import PrefixIndex
from ._load import EngineLoads
from ._models import EventSource, Vouching, WorkerKey, WorkerStatus
from ._restore import Restored
from ._snapshot import Cursor
from ._stats import ClientStats, TotalStats, client_stats
from ._transports._base import Driver, RateLimitedLog, SourceStats, Transport
from ._transports._registry import client_transports
from ._transports.jetstream import JetStreamSource, SourceFeed
from ._transports.zmq.config import SubscriberConfig
from ._transports.zmq.sockets import DEFAULT_MAX_SOURCES, fit_sources

__all__ = ["ClientStats", "EventStream", "KvEventClient", "SourceStats", "SubscriberConfig", "TotalStats"]

log = logging.getLogger("kvroute.client")


def _check_target(target: str) -> None:
    """Refuse a target discovery could never ask (no port, a scheme, not a host name) up front."""
    try:
        parse_target(target)
    except DiscoveryError as exc:
        raise ConfigError(f"target {target!r}: {exc.cause}") from None


def _check_http_url(target: str, url: str | None) -> str | None:
    """A target's configured HTTP base URL, without a trailing slash; `ConfigError` unless ``http(s)://host[:port]``."""
    if url is None:
        return None
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    if scheme not in ("http", "https") or not sep or not rest.split("/", 1)[0]:
        raise ConfigError(f"target {target!r}: HTTP URL {url!r} is not http(s)://host[:port][/path]")
    return url.rstrip("/")


def _first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (task groups wrap what their tasks raise)."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not inner:
            return exc
        exc = inner[0]


class _Subscription:
    __slots__ = ("driver", "http_url", "origin", "scope")

    def __init__(self, driver: Driver, origin: str | None, scope: anyio.CancelScope) -> None:
        self.driver = driver
        self.origin = origin
        self.scope = scope
        # Where this worker's requests go: the source's, updated by each discovery round
        # (an engine's HTTP server may move without its publishers moving).
        self.http_url = driver.source.http_url


class KvEventClient:
    """Subscribes to KV-event sources, keeps a `PrefixIndex` current, and streams what happens.

    ``sources`` are static `EventSource`s; ``targets`` are engine gRPC addresses
    (``host:port``) followed by discovery every ``discovery_interval`` seconds (a target
    failing for longer than ``discovery_grace`` has its workers removed until it answers
    again). ``targets`` may map each address to the engine's HTTP base URL (None: learn it
    from discovery where the engine says it, SGLang); `http_url` then answers, per worker,
    where to send its requests. ``index`` defaults to a new `PrefixIndex`; ``context`` to a zmq Context the
    client creates and terminates. ``reuse_reports``, when given, sets the index's
    `PrefixIndex.reuse_reports`: pass False when no request the engines serve asks for
    prefix-cache reuse reports (vLLM's ``kv_cache_report_mode "full"``), so repeated stores
    count as the GPU copies they then are; None leaves the index's own setting (True: reports
    may come). The client is also the router's `WorkerStates`. ``jetstream``: follow a relay's
    JetStream log (``"nats://host:4222/<stream>"``, docs/replicas.md) instead of (or beside)
    engines: its workers become the client's sources, named by the log.

    Sources and targets can be added and removed while the client runs (inside ``async
    with``); a source whose driver fails is removed (a `Removed` event, reason
    "failed: <error>") and the others carry on.

    Warm restart: `snapshot` saves the index and each source's position. An ``index`` from
    `PrefixIndex.restore` carries the saved positions in ``restored_cursors``; the client
    takes them over (and empties that attribute, so a later ``index.snapshot(path)`` cannot
    pair stale positions with a changed index). Each source whose worker has one resumes
    from it (`RecoveryMachine.resume`: identity check on first connect, then replay of what
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
        targets: Iterable[str] | Mapping[str, str | None] = (),
        index: PrefixIndex | None = None,
        config: SubscriberConfig | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        discovery_interval: float = 10.0,
        discovery_grace: float = 30.0,
        discovery_options: DiscoveryOptions | None = None,
        reuse_reports: bool | None = None,
        jetstream: str | JetStreamSource | None = None,
    ) -> None:
        if not discovery_interval > 0 or not discovery_grace >= 0:
            raise ConfigError(
                "discovery_interval must be > 0 and discovery_grace >= 0, "
                f"not {discovery_interval!r}, {discovery_grace!r}"
            )
        self._config = config or SubscriberConfig()
        self._index = index if index is not None else PrefixIndex()
        if reuse_reports is not None:
            self._index.reuse_reports = reuse_reports
        self._initial_sources = list(sources)
        self._initial_targets = list(targets)
        # Each target's configured HTTP base URL: it wins over what discovery learns.
        self._target_urls: dict[str, str] = {}
        for target in self._initial_targets:
            _check_target(target)
            url = _check_http_url(target, targets.get(target) if isinstance(targets, Mapping) else None)
            if url is not None:
                self._target_urls[target] = url
        self._ctx = context
        self._own_ctx = context is None
        self._discovery_interval = discovery_interval
        self._discovery_grace = discovery_grace
        self._discovery_options = discovery_options or DiscoveryOptions()
        self._subs: dict[WorkerKey, _Subscription] = {}
        # The subscribed workers a router must not believe (not synced, or partial), kept by
        # each source's machine as its state changes (`unvouched_workers`).
        self._vouching = Vouching()
        # `_subs`' keys as one immutable set (`live_set`), built by the first reader after a change
        # (None: not built since): a start adding 4,096 sources builds it once, not once per
        # source. The lock orders a reader's build against a change (`_live_changed`).
        self._live: frozenset[WorkerKey] | None = frozenset()
        self._live_lock = threading.Lock()
        self._targets: dict[str, anyio.CancelScope] = {}
        # Targets whose first discovery has not answered yet: not synced (see wait_synced).
        self._targets_pending: set[str] = set()
        # The last discovery error of each target whose latest round failed.
        self._discovery_errors: dict[str, str] = {}
        self._hub = Hub()
        # Warm restart: positions not yet handed to a source, and the restored workers no
        # source has claimed yet (removed once discovery has had its first say). Restored state
        # a source cannot resume is announced on the hub (a Reset), so a republisher passes it on.
        self._restored = Restored(self._index, self._hub.publish)
        self._tg: anyio.abc.TaskGroup | None = None
        self._max_sources = self._config.max_sources or DEFAULT_MAX_SOURCES
        self._changed: anyio.Event | None = None
        self._refused = 0
        # Sources refused and not subscribed since, with why: wait_synced names them.
        self._refused_keys: dict[WorkerKey, str] = {}
        self._removed = 0
        self._failed = 0
        self._adopted = 0
        self._log = RateLimitedLog("KvEventClient", log)
        #: Engine load reported by gateway-stream sources; a `Router` given this client prices it.
        self.engine_loads = EngineLoads()
        self._transports: list[Transport] = []
        # --- JetStream transport (kvroute._transports.jetstream): a relay's log names its own sources.
        if isinstance(jetstream, str):
            jetstream = JetStreamSource.from_url(jetstream, limits=self._config.limits)
        self._jetstream = jetstream

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
                self._max_sources = fit_sources(
                    self._ctx,
                    self._config.max_sources,
                    own_context=self._own_ctx,
                    replays=self._config.max_concurrent_replays,
                )
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot size the zmq context for max_sources: {exc}") from exc
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
                self._ctx = None
            raise
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

        log = None
        if self._jetstream is not None:
            # A relay's log names its own sources: the client lends it these (kvroute._transports.jetstream).
            origin = self._jetstream.endpoint
            add = lambda s: self._add(s, origin)  # noqa: E731
            log = (self._jetstream, SourceFeed(self._index, tg.start_soon, add, self._remove, self._feed_pending))
        self._transports = client_transports(
            context=self._ctx,
            config=self._config,
            channel_options=self._discovery_options,
            loads=self.engine_loads,
            spawn=tg.start_soon,
            adopt=self._adopt,
            jetstream=log,
        )
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
        try:
            # A receive thread applies a batch (or a whole replay answer) before the event loop records
            # it, and a source's records still in its outbox are dropped with the source: held (and
            # drained) before any source stops, the positions kept for a snapshot or the next entry
            # name what the index holds, and nothing more is applied off the loop while they stop.
            with self._receivers_held():
                tg.cancel_scope.cancel()
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    # A cancellation may be the task group's own (a task failed, or the scope was
                    # cancelled): only the group can absorb it and raise what failed.
                    return await tg.__aexit__(exc_type, exc, tb)
                # Anything else the block raised leaves exactly as raised: handed to the group, it
                # would come out wrapped in an ExceptionGroup, and `except NotSyncedError` / `except
                # TimeoutError` around the block would miss `wait_synced`'s timeout.
                try:
                    await tg.__aexit__(None, None, None)
                except BaseException as failure:
                    # a task failed while stopping: its error leaves, the block's own stays attached
                    if exc is not None and failure.__context__ is None:
                        failure.__context__ = exc
                    raise
                return None
        finally:
            # Where the sources stopped stays resumable: a snapshot taken after the block, or
            # entering it again, resumes from there (every driver is done: nothing moves now).
            self._restored.restart_from(self._positions())
            for sub in self._subs.values():
                sub.driver.machine.on_vouching = None
            self._subs.clear()
            self._live_changed()
            self._vouching.clear()
            self._targets.clear()
            self._targets_pending.clear()
            self._discovery_errors.clear()
            self._hub.close()
            self._wake()
            if self._own_ctx and self._ctx is not None:
                self._ctx.term()
                self._ctx = None

    def _feed_pending(self, name: str, why: str | None) -> None:
        """A transport that names its own sources (JetStream) is reading them: not synced until ``why`` is None."""
        if why is None:
            self._targets_pending.discard(name)
            self._discovery_errors.pop(name, None)
            self._drop_unclaimed()
        else:
            self._targets_pending.add(name)
            self._discovery_errors[name] = why
        self._wake()

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
        self._refused_keys.pop(source.key, None)
        cursor = self._restored.take(source)
        driver = transport.driver(source, index=self._index, sink=self._hub, on_change=self._wake, resume=cursor)
        scope = anyio.CancelScope()
        # Unvouched before it is live: a router on another thread that sees the worker among the
        # live ones (`live_set` reads `_subs`) must already see it unsynced (a warm restart's
        # index holds its restored state).
        self._track(driver)
        self._subs[source.key] = _Subscription(driver, origin, scope)
        self._live_changed()
        tg.start_soon(self._run_driver, driver, scope)
        self._wake()
        return True

    def _track(self, driver: Driver) -> None:
        """Keep ``driver``'s worker in `unvouched_workers` as its machine's state changes, from now."""
        key, machine, vouching = driver.key, driver.machine, self._vouching

        def changed() -> None:
            vouching.update(key, *machine.vouching)

        machine.on_vouching = changed
        changed()

    def _adopt(self, source: EventSource, like: EventSource) -> bool:
        """Follow ``source``, a rank a gateway stream carries unannounced, as ``like`` is followed (same origin)."""
        sub = self._subs.get(like.key)
        if self._tg is None or sub is None or sub.driver.source != like or source.key in self._subs:
            return False
        adopted = self._add(source, sub.origin)
        self._adopted += adopted
        return adopted

    def _refuse(self, source: EventSource, why: str) -> bool:
        self._refused += 1
        self._refused_keys[source.key] = why  # named in wait_synced's error
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
        self._live_changed()
        sub.driver.stop()
        # a stopped driver's machine may still take inputs until its task is cancelled
        sub.driver.machine.on_vouching = None
        sub.scope.cancel()
        self._index.remove_worker(key)
        # Vouched for only once its blocks are gone: a router that read the live set before this
        # removal must not find the worker trusted while the index still holds what it claimed.
        self._vouching.discard(key)
        self._removed += 1
        self._hub.publish(Envelope(source=sub.driver.source, seq=None, ts=time.time(), event=Removed(reason=reason)))
        self._wake()
        return True

    # --- discovery ----------------------------------------------------------------------------------

    def targets(self) -> list[str]:
        """Every target currently followed."""
        return list(self._targets)

    def add_target(self, target: str, *, http_url: str | None = None) -> None:
        """Follow one more engine (``host:port`` of its gRPC server); no-op if already followed.

        ``http_url``: the engine's HTTP base URL, where its workers' requests go (`http_url`);
        None learns it from discovery where the engine says it. A malformed target (no port, a
        scheme) or URL raises `ConfigError`.
        """
        _check_target(target)
        url = _check_http_url(target, http_url)
        tg = self._task_group()
        if target in self._targets:
            return
        if url is not None:
            self._target_urls[target] = url
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
        self._discovery_errors.pop(target, None)
        self._target_urls.pop(target, None)
        for key in self._keys_of(target):
            self._remove(key, reason)
        self._drop_unclaimed()
        self._wake()
        return True

    def _keys_of(self, target: str) -> list[WorkerKey]:
        return [k for k, s in self._subs.items() if s.origin == target]

    async def _follow(self, target: str, scope: anyio.CancelScope) -> None:
        async def on_sources(sources: list[EventSource]) -> None:
            self._discovery_errors.pop(target, None)
            self._on_discovered(target, sources)

        def on_failure(exc: KvRouteError) -> None:
            if target in self._targets:
                self._discovery_errors[target] = str(exc)

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
                streaming=lambda: self._streaming(target),
                on_failure=on_failure,
            )

    def _streaming(self, target: str) -> str | None:
        """The gateway service whose stream from ``target`` is live, if any: discovery then opens none."""
        for key in self._keys_of(target):
            service = self._subs[key].driver.streaming()
            if service is not None:
                return service
        return None

    def _on_discovered(self, target: str, sources: Sequence[EventSource]) -> None:
        if self._tg is None or target not in self._targets:
            # Leaving `async with` (cancellation has not reached this task yet), or the target
            # was removed while the answer was on its way.
            return
        url = self._target_urls.get(target)
        if url is not None:
            sources = [msgspec.structs.replace(s, http_url=url) for s in sources]
        current = [self._subs[k].driver.source for k in self._keys_of(target)]
        diff = diff_sources(current, list(sources))
        for src in sources:
            sub = self._subs.get(src.key)
            if sub is not None and sub.origin == target:
                sub.http_url = src.http_url  # the connection is the same; where requests go may move
        for src in diff.removed:
            # A rank a live stream carries exists, whatever the engine's rank count says.
            if not self._subs[src.key].driver.vouched():
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
        if not self._targets_pending and self._restored.pending:
            self._restored.drop_unclaimed(self._subs)

    # --- warm restart ---------------------------------------------------------------------------------

    def cursors(self) -> dict[WorkerKey, Cursor]:
        """Where each current source stands: its newest applied seq and that batch's ts.

        A worker is listed while the index holds the run of batches that ends there (none
        right after a reset until something is applied), partial ones included. Restored
        positions not yet taken by a source are not listed.
        """
        # A receive thread (`native_receive`) applies outside the event loop: it is held
        # until the loop's next turn, so code that reads these positions and then the index,
        # without awaiting in between, sees the index as of these positions, as it would with
        # every batch applied on the event loop.
        tg = self._tg
        held = [t for t in self._transports if t.hold()]
        try:
            return self._cursors()
        finally:
            if tg is None:
                for transport in held:
                    transport.release()
            elif held:
                tg.start_soon(self._release_receivers, held)

    @staticmethod
    async def _release_receivers(held: list[Transport]) -> None:
        """Release the receive threads `cursors` held, at the event loop's next turn."""
        for transport in held:
            transport.release()

    def _cursors(self) -> dict[WorkerKey, Cursor]:
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
        with self._receivers_held():
            self._index.snapshot(path, cursors=self._positions())

    @contextlib.contextmanager
    def _receivers_held(self) -> Iterator[None]:
        """Hold every receive thread (`SubscriberConfig.native_receive`) with what it applied recorded.

        The thread applies to the index before the source's machine records the seq; held,
        the index and the positions agree (a snapshot does not re-apply a batch on restore).
        """
        # A thread `cursors` held stays held for it (its release comes at the loop's next turn).
        held = [t for t in self._transports if t.hold()]
        try:
            yield
        finally:
            for transport in held:
                transport.release()

    def _positions(self) -> dict[WorkerKey, Cursor]:
        """The positions a snapshot saves: every non-partial source's, and restored ones not yet taken."""
        return self._restored.saved(
            {k: c for k, c in self._cursors().items() if not self._subs[k].driver.machine.partial}
        )

    # --- state --------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _all_synced(self) -> bool:
        if self._targets_pending:
            return False
        # `wait_synced` asks at every change: a pass over every source each time is O(n²) over a
        # cold sync (11 % of a 4,096-source one). A source the vouching set names unsynced is
        # looked at first (taken from its private set: building the published one per change
        # would be O(n) again); found unsynced, that is the answer. Only a yes takes the whole pass.
        key = self._vouching.any_unsynced()
        if key is not None:
            sub = self._subs.get(key)
            if sub is not None and sub.driver.machine.state != "synced":
                return False
        return all(s.driver.machine.state == "synced" for s in self._subs.values())

    async def wait_synced(self, timeout: float) -> None:  # noqa: ASYNC109 (the public API names it, docs/architecture.md)
        """Return once every current source is caught up (cold-start replay done, no gap pending).

        Targets count too: each must have answered discovery once (or been given up on).
        Raises `NotSyncedError` (a `TimeoutError`) after ``timeout`` seconds, naming the targets
        and sources still pending and why (`pending_targets`, `pending_sources`), and the sources
        refused meanwhile (`refused_sources`): a refused source is never waited for.
        """
        with anyio.move_on_after(timeout):
            while not self._all_synced():
                if self._tg is None:
                    raise ClientStateError("KvEventClient is not running (use `async with`)")
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
            return
        raise NotSyncedError(timeout, self.pending_targets(), self.pending_sources(), self.refused_sources())

    def discovery_errors(self) -> dict[str, str]:
        """The last discovery error of each followed target whose most recent discovery round failed."""
        return dict(self._discovery_errors)

    def refused_sources(self) -> dict[WorkerKey, str]:
        """Each source refused (over ``max_sources``, no descriptors, unusable) and not subscribed since, with why."""
        return dict(self._refused_keys)

    def pending_targets(self) -> dict[str, str]:
        """Each target that has not answered discovery yet, with its last discovery error (or that none came back)."""
        return {t: self._discovery_errors.get(t, "no discovery answer yet") for t in sorted(self._targets_pending)}

    def pending_sources(self) -> dict[WorkerKey, str]:
        """Each source that is not synced, with its state and what it waits for."""
        out: dict[WorkerKey, str] = {}
        for key, sub in self._subs.copy().items():
            machine = sub.driver.machine
            if machine.state == "synced":
                continue
            why: list[str] = [machine.state]
            if not sub.driver.connected:
                why.append(f"not connected to {sub.driver.source.endpoint}")
            request = machine.replay_in_flight
            if request is not None:
                why.append(f"{request.purpose} replay from seq {request.from_seq} in flight")
            if machine.held:
                why.append(f"{machine.held} batches held")
            out[key] = ", ".join(why)
        return out

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        """The worker's sync state, or None when no current source feeds it."""
        sub = self._subs.get(worker)
        return sub.driver.status() if sub is not None else None

    def unvouched_workers(self, trust_partial: bool) -> frozenset[WorkerKey]:
        """The subscribed workers whose `worker_status` is not "synced", or (unless ``trust_partial``)
        partial: those whose index claims a router does not believe (`VouchingStates`). One set,
        kept as the sources' states change: a `Router` reads it once per ``select``."""
        return self._vouching.unvouched(trust_partial)

    def http_url(self, worker: WorkerKey) -> str | None:
        """Where to send ``worker``'s requests: its engine's HTTP base URL, or None when unknown.

        The target's configured URL, else the one discovery learnt (SGLang names its HTTP
        server; vLLM does not), else a static source's own ``http_url``. The worker's rank
        goes with each request (README "Where to send it": the ``X-data-parallel-rank``
        header, which vLLM and SGLang both read).
        """
        sub = self._subs.get(worker)
        return sub.http_url if sub is not None else None

    def live_workers(self) -> set[WorkerKey]:
        """Every worker with a current source."""
        return set(self._subs)

    def live_set(self) -> frozenset[WorkerKey]:
        """`live_workers` as one immutable set, kept until sources come or go: a `Router` reads it per
        ``select`` without copying every key (`VouchingStates`)."""
        live = self._live
        if live is None:
            with self._live_lock:
                live = self._live
                if live is None:
                    # `_subs` as of now: a change after this read marks the set stale again, once
                    # this build is stored (both under the lock), so no build outlives a change
                    live = self._live = frozenset(self._subs)
        return live

    def _live_changed(self) -> None:
        """`_subs` changed: the next `live_set` builds the set again."""
        with self._live_lock:
            self._live = None

    def events(self, *, buffer: int | None = None) -> EventStream:
        """A new iterator over every envelope from now on (engine and lifecycle events).

        ``buffer`` overrides the configured ``events_buffer`` for this iterator.
        """
        stream = EventStream(buffer if buffer is not None else self._config.events_buffer)
        if self._tg is None:
            stream._close()
        else:
            self._hub.add(stream)
            # A receive thread applies in-order batches without envelopes while nobody listens:
            # held once, it closes those fast paths before it applies again (`NativeReceiver.hold`).
            for t in self._transports:
                if t.hold():
                    t.release()
        return stream

    @property
    def raw_tap(self) -> RawTap | None:
        """The raw tap attached with `set_raw_tap` (None: none)."""
        return self._hub.tap

    def set_raw_tap(self, tap: RawTap | None) -> None:
        """Attach (None: detach) one `RawTap`: every batch the client applies, in order, as its engine's bytes.

        For a republisher (the JetStream relay): while the tap is the only listener (no ``events()``
        iterator open), the ZMQ drivers keep their fast path and hand ``tap.raw`` each applied
        payload as the engine sent it; anything applied another way, and every lifecycle fact,
        reaches ``tap.push`` as envelopes, in the order applied. Attach it before entering the
        client to see every batch from the first. One tap at a time; it must not block.
        """
        self._hub.set_tap(tap)
        if self._tg is not None:
            # A receive thread's fast paths opened for the previous listeners (without payloads
            # for a tap, say) close before it applies again (`NativeReceiver.hold`).
            for t in self._transports:
                if t.hold():
                    t.release()

    def stats(self) -> ClientStats:
        """A snapshot of every source's counters, their totals, and the client's own."""
        # A copy first (one C call): a scrape from another thread must not iterate a dict
        # the event loop resizes under it.
        per = {k: s.driver.stats() for k, s in self._subs.copy().items()}
        return client_stats(
            per,
            refused=self._refused,
            removed=self._removed,
            failed=self._failed,
            adopted=self._adopted,
            events_dropped=self._hub.dropped,
        )
