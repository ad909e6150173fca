"""`JetStreamRelay`: follow engines like `KvEventClient` and republish what was applied to a JetStream stream.

The log's format is `kvroute._jetstream`'s. High availability: relays for one stream share a lease
(the meta bucket's ``leader`` key). The holder renews it (a revision-checked update) every sixth
of ``lease_ttl`` from a thread and NATS connection of its own (`_LeaseKeeper`), so a starved event
loop does not let it lapse (only a loop stalled for ``lease_stall`` seconds does). A standby that
sees the revision unchanged for ``lease_ttl`` takes it over with a revision-checked update (only
one standby can win). Each session of the holder starts by reading the whole log as a follower
does (a `JetStreamReplica`: the latest snapshot, then the records after it), then gives that index
and the positions it holds to its `KvEventClient` (warm restart: identity check, replay since
there), so no batch is lost (the engines' replay buffers cover the handover) and none is doubled
(message ids, and the replicas' seq rule).

Snapshots are the relay client's own index, encoded by the publisher inside one of its turns, after
it posted everything the client applied (the client's receive threads held for that turn only); the
acks of those records name the stream sequence it covers (`JetStreamRelay._take`). No second copy of
the index reads the log back.

Publishing (the relay client's raw tap → records, async acks) is `kvroute._jetstream_publish`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.abc
import msgspec

from ._client import KvEventClient
from ._discovery import DiscoveryOptions
from ._errors import ConfigError, JetStreamError
from ._jetstream import (
    LEASE_KEY,
    SNAPSHOT_FORMAT,
    SNAPSHOT_KEY,
    SNAPSHOTS_KEPT,
    SnapshotInfo,
    check_stream_name,
    ensure_stream,
    log,
    meta_bucket,
    nats_module,
    object_store,
)
from ._jetstream_nats import NatsLoop
from ._jetstream_publish import _Publisher, _Restart, _SnapshotRequest, _Tap
from ._jetstream_replica import JetStreamReplica
from ._models import EventSource, WorkerKey
from ._transports.zmq.config import SubscriberConfig

__all__ = ["JetStreamRelay", "RelayStats"]

#: Batches and facts the relay's client may apply ahead of its publisher before the session restarts.
_TAP_CAPACITY = 1_000_000
#: Seconds a snapshot waits for the pump to take it (besides ``publish_timeout`` for the acks).
_QUIESCE_TIMEOUT = 1.0
#: Seconds a session's start may take to read the log (snapshot + records after it) before it tries again.
_SEED_TIMEOUT = 60.0


# --- the relay ----------------------------------------------------------------------------------------


class RelayStats(msgspec.Struct, frozen=True, kw_only=True):
    """A `JetStreamRelay`'s counters.

    ``active``: it holds the lease; ``sessions``: times it started following the engines (a
    takeover, or a restart after a publish failure or an events overflow); ``batches`` (storing
    ``blocks``) and ``records`` (a run of batches or a lifecycle fact each): published
    (``duplicates`` of the records dropped by the server's dedup window);
    ``snapshots``: written to the object store, the newest covering ``snapshot_seq``;
    ``resets`` / ``partials`` / ``removals``: lifecycle records published.
    """

    active: bool
    sessions: int
    batches: int
    blocks: int
    records: int
    duplicates: int
    snapshots: int
    snapshot_seq: int
    publish_failures: int
    resets: int
    partials: int
    removals: int


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (task groups wrap what their tasks raise)."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


class _LeaseLost(Exception):
    """Another relay holds the lease now (or may: it could not be renewed within its ttl)."""


class _LeaseKeeper:
    """The active relay's lease renewals, on a NATS connection of their own in a thread of their own.

    Every sixth of ``lease_ttl`` it updates the lease (revision-checked; a slow answer may take until
    the lease's deadline). ``lost`` says why it
    stopped: another relay updated the lease, no renewal succeeded within ``lease_ttl`` (the server
    is away: a standby may hold it by now), or the relay's event loop has not called `beat` for
    ``lease_stall`` seconds. ``rev``: the lease's revision as last renewed.
    """

    def __init__(self, relay: JetStreamRelay, rev: int) -> None:
        self.relay = relay
        self.rev = rev
        self.lost: str | None = None
        self.renewals = 0
        self._beat = time.monotonic()
        self._nl = NatsLoop(relay._servers, f"{relay.name}-lease")
        self._task: concurrent.futures.Future[None] | None = None

    def beat(self) -> None:
        """The relay's event loop runs (called from it)."""
        self._beat = time.monotonic()

    async def start(self) -> None:
        """Connect (its own thread) and start renewing."""
        nl = self._nl
        await nl.start(self.relay._connect_timeout, own_thread=True)
        assert nl.loop is not None
        self._task = asyncio.run_coroutine_threadsafe(self._renew(), nl.loop)

    async def _renew(self) -> None:
        try:
            await self._renewals()
        except Exception as exc:  # the bucket is gone, or nats-py failed otherwise: the lease is not kept
            self.lost = f"renewals failed: {exc!r}"

    async def _renewals(self) -> None:
        nats = nats_module()
        relay, ttl = self.relay, self.relay._lease_ttl
        kv = await meta_bucket(self._nl.js, relay.stream, create=False)
        if kv is None:
            self.lost = "the lease bucket is gone"
            return
        # A standby takes over once the revision it saw has not moved for ttl; that revision was made
        # no earlier than the request that made it left here: the lease is ours until then + ttl.
        deadline = time.monotonic() + ttl
        while True:
            await asyncio.sleep(ttl / 6)
            if time.monotonic() - self._beat > relay._lease_stall:
                self.lost = f"the relay's event loop stalled for over {relay._lease_stall} s"
                return
            sent = time.monotonic()
            try:
                # A slow answer (a loaded server or machine) may take until the deadline, not a fixed share.
                rev = await asyncio.wait_for(
                    kv.update(LEASE_KEY, relay._lease_value(), last=self.rev), max(0.05, deadline - sent)
                )
            except nats.js.errors.APIError as exc:
                # Refused: another relay updated it, or an update of ours given up on landed after all.
                try:
                    rev = await asyncio.wait_for(self._ours(kv), max(0.05, deadline - time.monotonic()))
                except Exception:
                    rev = None
                if rev is None:
                    self.lost = f"another relay holds it ({exc!r})"
                    return
            except Exception as exc:
                # The server is away or slow: past the deadline another relay may hold it.
                if time.monotonic() >= deadline:
                    self.lost = f"not renewed within {ttl} s ({exc!r})"
                    return
                continue
            self.rev = int(rev)
            self.renewals += 1
            deadline = sent + ttl

    async def _ours(self, kv: Any) -> int | None:
        """The lease's revision when this relay wrote its value (names are unique), else None."""
        entry = await kv.get(LEASE_KEY)
        holder = json.loads(entry.value or b"{}").get("holder")
        return int(entry.revision) if holder == self.relay.name else None

    async def close(self) -> None:
        """Stop renewing and drop the connection (the lease is released, or not, by the relay)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        await self._nl.close()


#: The relay's client's settings when it is given none: `SubscriberConfig`'s defaults but ``receive_nice``
#: 0. A router's receive thread runs below its event loop so that requests go first; in a relay both
#: are ingest (the loop publishes what the thread applied), and a thread niced 5 got about a third of
#: its share beside the replicas and the NATS server on a shared machine: the relay's client's apply
#: lag p99 220-322 ms at 5 against 72-184 ms at 0 in `bench_jetstream.py`'s paced round
#: (docs/performance.md, "Session 18").
RELAY_CONFIG: Final = SubscriberConfig(receive_nice=0)


class JetStreamRelay:
    """Follows engines like `KvEventClient` and republishes what it applied to a JetStream stream.

    ``sources`` / ``targets`` / ``config`` / ``discovery_*`` are `KvEventClient`'s (no ``config``:
    `RELAY_CONFIG`, the defaults with the receive thread at the event loop's priority). Run it with
    ``async with JetStreamRelay(...) as relay:`` (or ``await relay.run()``). Several relays may run
    for one stream: the lease decides which one publishes (see the module docs). Leaving the block
    releases the lease, so a standby takes over at once; a relay that dies keeps it until
    ``lease_ttl`` passes (renewed from a thread of its own: a busy relay keeps it; one whose event
    loop has not run for ``lease_stall`` seconds, default ``max(30, 10 * lease_ttl)``, lets it go).
    The active relay writes a snapshot every ``snapshot_interval`` seconds (when the log moved).
    ``max_age`` bounds the stream's retention (0: unlimited); keep it well above
    ``snapshot_interval``. ``runs_records`` (True): the batches of several workers taken in one
    turn go out as one `runs` record; False publishes one `batches` record per worker instead, as
    relays before `runs` did, for a rolling upgrade: a follower older than `runs` skips a `runs`
    record it cannot decode and over-claims what its batches removed (docs/replicas.md).
    """

    def __init__(
        self,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        sources: Iterable[EventSource] = (),
        *,
        targets: Iterable[str] = (),
        stream: str = "KVROUTE",
        config: SubscriberConfig | None = None,
        discovery_interval: float = 10.0,
        discovery_grace: float = 30.0,
        discovery_options: DiscoveryOptions | None = None,
        snapshot_interval: float = 10.0,
        lease_ttl: float = 3.0,
        lease_stall: float | None = None,
        storage: str = "file",
        max_age: float = 24 * 3600.0,
        duplicate_window: float = 120.0,
        publish_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        name: str | None = None,
        runs_records: bool = True,
    ) -> None:
        check_stream_name(stream)
        if storage not in ("file", "memory"):
            raise ConfigError(f"storage must be 'file' or 'memory', not {storage!r}")
        if not snapshot_interval > 0 or not lease_ttl > 0 or not publish_timeout > 0 or max_age < 0:
            raise ConfigError("snapshot_interval, lease_ttl and publish_timeout must be > 0, max_age >= 0")
        # A wedged relay (alive, its loop not running) keeps the lease this long: 10 ttls, 30 s at least.
        lease_stall = max(30.0, 10 * lease_ttl) if lease_stall is None else lease_stall
        if not lease_stall >= lease_ttl:
            raise ConfigError("lease_stall must be >= lease_ttl")
        nats_module()
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self._sources = list(sources)
        self._targets = list(targets)
        self.stream = stream
        self._config = config or RELAY_CONFIG
        self._discovery = (discovery_interval, discovery_grace, discovery_options)
        self._snapshot_interval = snapshot_interval
        self._lease_ttl = lease_ttl
        self._lease_stall = lease_stall
        self._storage = storage
        self._max_age = max_age
        self._duplicate_window = duplicate_window
        self._publish_timeout = publish_timeout
        self._connect_timeout = connect_timeout
        self._runs_records = runs_records
        self.name = name or f"relay-{uuid.uuid4().hex[:8]}"
        self._counts = {
            "sessions": 0,
            "batches": 0,
            "blocks": 0,
            "records": 0,
            "duplicates": 0,
            "snapshots": 0,
            "snapshot_seq": 0,
            "publish_failures": 0,
            "resets": 0,
            "partials": 0,
            "removals": 0,
        }
        self.active = False
        self._lease_rev = 0
        self._nats: NatsLoop | None = None
        #: The current session's publisher and tap (None between sessions).
        self._pub: tuple[_Publisher, _Tap] | None = None
        self._snapshot_lock = anyio.Lock()
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._became_active: anyio.Event = anyio.Event()
        #: The `KvEventClient` of the current session (None while standby).
        self.client: KvEventClient | None = None

    async def __aenter__(self) -> JetStreamRelay:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        await tg.start(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._tg = self._tg, None
        assert tg is not None
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)

    async def run(self) -> None:
        """Run until cancelled (the command line's ``kvroute relay``)."""
        await self._run()

    async def wait_active(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once this relay holds the lease (TimeoutError after ``timeout``)."""
        with anyio.fail_after(timeout):
            await self._became_active.wait()

    async def wait_synced(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once this relay holds the lease and its sources are synced (TimeoutError after ``timeout``)."""
        with anyio.fail_after(timeout):
            while True:
                await self._became_active.wait()
                client = self.client
                if client is not None:
                    await client.wait_synced(timeout)
                    return
                await anyio.sleep(0.01)

    def stats(self) -> RelayStats:
        """A snapshot of the relay's counters."""
        return RelayStats(active=self.active, **self._counts)

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        nl = NatsLoop(self._servers, self.name)
        await nl.start(self._connect_timeout)
        self._nats = nl
        try:
            await nl.call(ensure_stream(nl.js, self.stream, self._storage, self._max_age, self._duplicate_window))
            self._kv = await nl.call(meta_bucket(nl.js, self.stream, create=True))
            self._store = await nl.call(object_store(nl.js, self.stream, create=True))
            task_status.started()
            while True:
                await self._standby()
                try:
                    await self._active_term()
                except _LeaseLost:
                    log.warning("relay %s: lost the lease, standing by", self.name)
        finally:
            self.active = False
            with anyio.CancelScope(shield=True):
                if self._lease_rev:
                    await self._release()
                self._nats = None
                await nl.close()

    # --- the lease ------------------------------------------------------------------------------

    def _lease_value(self) -> bytes:
        return json.dumps({"holder": self.name, "at": time.time()}).encode()

    async def _standby(self) -> None:
        """Wait for the lease: free, expired (its revision unchanged for lease_ttl), or released."""
        nl = self._nats
        assert nl is not None
        nats = nats_module()
        seen: tuple[int, float] | None = None
        kv = self._kv
        while True:

            async def attempt(seen_rev: int | None) -> tuple[bool, int]:
                try:
                    entry = await kv.get(LEASE_KEY)
                except nats.js.errors.KeyNotFoundError:
                    try:
                        return True, int(await kv.create(LEASE_KEY, self._lease_value()))
                    except nats.js.errors.APIError:
                        return False, 0
                rev = int(entry.revision)
                if seen_rev is None or rev != seen_rev:
                    return False, rev
                try:
                    return True, int(await kv.update(LEASE_KEY, self._lease_value(), last=rev))
                except nats.js.errors.APIError:
                    return False, 0

            now = anyio.current_time()
            expired = seen is not None and now - seen[1] >= self._lease_ttl
            try:
                won, rev = await nl.call(attempt(seen[0] if expired and seen is not None else None))
            except Exception as exc:  # the server is away: keep asking
                log.debug("relay %s: lease check failed: %r", self.name, exc)
                await anyio.sleep(self._lease_ttl / 4)
                continue
            if won:
                self._lease_rev = rev
                return
            if rev and (seen is None or seen[0] != rev):
                seen = (rev, now)
            await anyio.sleep(self._lease_ttl / 4)

    async def _keep_lease(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Renew the lease from its own thread while the term lasts; raise `_LeaseLost` once it is gone.

        The renewals run on their own NATS connection on an asyncio loop in a thread: a relay whose
        event loop is starved (a long apply, a loaded machine) keeps renewing, as it keeps being the
        only relay that publishes. This task only proves the loop alive (`_LeaseKeeper.beat`): a
        loop stalled for ``lease_stall`` seconds lets the lease lapse (the process is wedged, a
        standby should take over).
        """
        keeper = _LeaseKeeper(self, self._lease_rev)
        try:
            await keeper.start()
        except JetStreamError as exc:
            await keeper.close()
            raise _LeaseLost(f"cannot renew it: {exc}") from exc
        task_status.started()
        try:
            while True:
                keeper.beat()
                if keeper.lost is not None:
                    raise _LeaseLost(keeper.lost)
                await anyio.sleep(min(0.1, self._lease_ttl / 10))
        finally:
            with anyio.CancelScope(shield=True):
                await keeper.close()
                self._lease_rev = keeper.rev if keeper.lost is None else 0

    async def _release(self) -> None:
        nl, rev = self._nats, self._lease_rev
        self._lease_rev = 0
        if nl is None:
            return
        kv = self._kv
        with contextlib.suppress(Exception), anyio.move_on_after(2.0):
            await nl.call(kv.delete(LEASE_KEY, last=rev))

    # --- the active term ---------------------------------------------------------------------------

    async def _active_term(self) -> None:
        self.active = True
        self._became_active.set()
        log.info("relay %s: holds the lease of %s", self.name, self.stream)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._keep_lease)
                tg.start_soon(self._snapshots)
                while True:
                    try:
                        await self._session()
                    except Exception as exc:
                        why = _leaf(exc)
                        if not isinstance(why, _Restart):
                            raise
                        self._counts["publish_failures"] += 1
                        log.warning("relay %s: session restarts from the log: %s", self.name, why)
                        await anyio.sleep(0.2)
        except Exception as exc:
            # Task groups wrap what their tasks raise: surface a lost lease as itself.
            leaf = _leaf(exc)
            if isinstance(leaf, _LeaseLost):
                raise leaf from None
            raise
        finally:
            self.active = False
            self._became_active = anyio.Event()
            self.client = None

    async def _seed(self) -> JetStreamReplica:
        """The whole log read as a follower reads it (snapshot, then the records after it), stopped there.

        Nothing is published meanwhile (this relay holds the lease and has no session yet), so
        its index and workers are the log's up to its ``position``.
        """
        nl = self._nats
        assert nl is not None
        while True:
            try:
                info = await nl.call(nl.js.stream_info(self.stream))
                last = int(info.state.last_seq)
                # Under the client's limits: the payloads are the engines' own, read as the client read them.
                seed = JetStreamReplica(
                    self._servers, stream=self.stream, name=f"{self.name}-seed", limits=self._config.limits
                )
                async with seed:
                    await seed.wait_position(last, _SEED_TIMEOUT)
                return seed
            except Exception as exc:
                log.warning("relay %s: reading the log: %r", self.name, exc)
                await anyio.sleep(0.5)

    async def _session(self) -> None:
        """Follow the engines from where the log stands, publishing until something forces a restart."""
        seed = await self._seed()
        nl = self._nats
        assert nl is not None
        cursors = seed.cursors()
        known = seed.live_workers()
        # The log's index becomes the client's (a warm restart from it): the client then holds
        # what the log holds, and its index is the relay's snapshot.
        index = seed.index
        index.restored_cursors = dict(cursors)
        interval, grace, options = self._discovery
        self._counts["sessions"] += 1
        session = uuid.uuid4().hex[:12]
        pub = _Publisher(
            nl,
            self.stream,
            self._counts,
            session,
            cursors,
            known,
            seed.partial_workers(),
            seed.position,
            publish_timeout=self._publish_timeout,
            runs_records=self._runs_records,
        )
        client = KvEventClient(
            self._sources,
            targets=self._targets,
            index=index,
            config=self._config,
            discovery_interval=interval,
            discovery_grace=grace,
            discovery_options=options,
        )
        # Tapped before it starts: the log holds every batch the client applies, from its first.
        tap = _Tap(_TAP_CAPACITY)
        client.set_raw_tap(tap)
        async with client:
            self.client = client
            self._pub = (pub, tap)
            # Workers the log names that no static source feeds are gone (with targets, the
            # discovered sources are only known later: the reconciler below handles them).
            static = {s.key for s in self._sources}
            if not self._targets:
                for key in sorted(known - static):
                    pub.removed(key, "gone from discovery")
            async with anyio.create_task_group() as tg:
                if self._targets:
                    tg.start_soon(self._reconcile, client, pub, known)
                try:
                    await pub.pump(tap)
                finally:
                    self._pub = None

    async def _reconcile(self, client: KvEventClient, pub: _Publisher, known: set[WorkerKey]) -> None:
        """Once discovery answered: the log's workers no target feeds are removed from the log."""
        while True:
            try:
                await client.wait_synced(self._discovery[0])
                break
            except TimeoutError:
                continue
        for key in sorted(known - client.live_workers()):
            pub.removed(key, "gone from discovery")
        pub.kick()

    async def _snapshots(self) -> None:
        """Write a snapshot every ``snapshot_interval`` while the term lasts (when the relay published since)."""
        written = -1
        while True:
            await anyio.sleep(self._snapshot_interval)
            current = self._pub
            if current is None or current[0].outbox.posted == written:
                continue  # no session, or nothing published since the last snapshot
            posted = current[0].outbox.posted
            await self.write_snapshot()
            written = posted

    def _hold(self) -> Callable[[], None]:
        """Hold the session client's native receive threads (what they handed over is drained first)."""
        client = self.client
        held = [t for t in client._transports if t.hold()] if client is not None else []

        def release() -> None:
            for transport in held:
                transport.release()

        return release

    async def _take(self) -> tuple[bytes, SnapshotInfo] | None:
        """The relay client's index as the log's snapshot (see the module docs); None: not taken this time.

        The pump takes it at its next turn (`_Publisher._take_snapshot`: everything the client
        applied is posted, then the index is encoded, nothing applying in between); once the acks
        of those records are back they name the stream sequence it covers. If the stream holds
        records this relay did not publish since its session began (the acks' count and sequences
        do not add up: a relay that did not yet know it lost the lease), the index is not the
        log's: the session starts over from the log.
        """
        current, client = self._pub, self.client
        if current is None or client is None:
            return None
        pub, tap = current
        req = _SnapshotRequest(client.index, self._hold)
        pub.snapshot_request = req
        tap.wake()
        outbox = pub.outbox
        with anyio.move_on_after(_QUIESCE_TIMEOUT + self._publish_timeout):
            while req.data is None or outbox.marked is None:
                if self._pub is not current or req.refused is not None or outbox.failed is not None:
                    break
                await anyio.sleep(0.002)  # the pump's turn, then the NATS loop's acks
        if pub.snapshot_request is req:
            pub.snapshot_request = None
        marked = outbox.marked if req.data is not None else None
        if req.data is None or marked is None or self._pub is not current:
            log.info("relay %s: no snapshot this time (%s)", self.name, req.refused or "not taken in time")
            return None
        seq, stored = marked
        if outbox.start + stored != seq:
            why = f"the log holds {seq - outbox.start - stored} records since {outbox.start} this relay did not publish"
            log.warning("relay %s: no snapshot, the session restarts: %s", self.name, why)
            pub.stale = why
            tap.wake()
            return None
        info = SnapshotInfo(format=SNAPSHOT_FORMAT, stream_seq=seq, workers=req.workers, partial=req.partial)
        return req.data, info

    async def write_snapshot(self) -> int:
        """Write the relay's index to the object store now; the stream sequence it covers.

        Only the active relay writes one (between sessions, or when its client's index could not
        be taken in time, nothing is written and the last snapshot's sequence is returned).
        """
        nl = self._nats
        assert nl is not None
        async with self._snapshot_lock:
            taken = await self._take()
        if taken is None:
            return self._counts["snapshot_seq"]
        data, info = taken
        nats = nats_module()
        name = f"index-{info.stream_seq}"
        meta = nats.js.api.ObjectMeta(name=name, description=msgspec.json.encode(info).decode())
        store, kv = self._store, self._kv

        async def put() -> None:
            await store.put(name, data, meta=meta)
            await kv.put(SNAPSHOT_KEY, name.encode())
            # Older objects go once newer ones exist (a reader holds at most one of them, briefly).
            old = sorted(
                (o.name for o in await store.list() if o.name.startswith("index-") and not o.deleted),
                key=lambda n: int(n.split("-", 1)[1]),
            )
            for stale in old[:-SNAPSHOTS_KEPT]:
                await store.delete(stale)

        try:
            await nl.call(put())
        except Exception as exc:
            log.warning("relay %s: snapshot not written: %r", self.name, exc)
            return self._counts["snapshot_seq"]
        self._counts["snapshots"] += 1
        self._counts["snapshot_seq"] = info.stream_seq
        log.info("relay %s: snapshot at %d (%d bytes)", self.name, info.stream_seq, len(data))
        return info.stream_seq
