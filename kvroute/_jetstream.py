"""Router replicas on NATS JetStream (docs/replicas.md): one relay follows the engines, replicas follow the log.

`JetStreamRelay` follows engines with a `KvEventClient` (discovery, recovery, every production
configuration) and republishes, per worker and in order, what that client applied: each engine
batch (its events regrouped into one payload by kvroute's encoder) and the lifecycle facts a
follower needs (reset, partial, removed). `JetStreamReplica` rebuilds the same index from the
latest snapshot plus the stream, and never talks to the engines.

The log (one JetStream stream, subject ``kvroute.<stream>.<worker>.<rank>``), record by record:

- ``batch``: worker, engine ``seq`` and ``ts``, ``prev`` (the seq of the worker's previous batch in
  the log, None right after a reset), the encoded batch. ``Nats-Msg-Id`` is worker + seq + ts: the
  ts tells a restarted engine's seq N from the old one's, so a relay restart or a second relay
  publishing the same batch is dropped by the server's duplicate window, and a replica skips any
  batch at or below the worker's last seq (a duplicate older than the window).
- ``reset`` / ``partial`` / ``removed``: what the relay's client did to the worker.

Replica rules (docs/recovery.md, applied to the log): a batch whose ``prev`` is not the worker's
last applied seq is an uncovered gap (a record the log lost): the worker is reset and marked
partial, then the batch applied. A jump in the stream's own sequence (records removed by retention
before the replica read them) resets every worker the same way. Nothing is ever over-claimed.

Snapshots: the relay keeps a replica of its own log (the mirror) and writes the mirror's index
(`PrefixIndex.snapshot`, kvroute's own format) to a JetStream object store at an interval, with the
stream sequence it covers; the mirror's index holds exactly the records up to that sequence, so a
replica restoring it and reading on from the next sequence is exact.

High availability: relays for one stream share a lease (a JetStream KV key). The holder renews it
(a revision-checked update) every third of ``lease_ttl``; a standby that sees the revision unchanged
for ``lease_ttl`` takes it over with a revision-checked update (only one standby can win). A new
holder waits until its mirror has read the whole log, then resumes its engines' sources from the
positions the log holds (`KvEventClient` warm restart: identity check, replay since there), so no
batch is lost (the engines' replay buffers cover the handover) and none is doubled (dedup ids).

nats-py is asyncio-only: under asyncio it runs on the caller's loop; under trio each relay and
replica runs its NATS connection on an asyncio loop in a thread (as grpcio runs behind worker
threads), so callers on both anyio backends work.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import sniffio

from ._client import KvEventClient
from ._discovery import DiscoveryOptions
from ._errors import ConfigError, DecodeError, KvRouteError, SnapshotError
from ._events import Envelope, Overflow, Partial, Removed, Reset
from ._index import PrefixIndex
from ._models import EventSource, WorkerKey, WorkerStatus
from ._snapshot import Cursor
from ._subscriber import SubscriberConfig
from ._wire import EventBatch, decode_batch, encode_batch

__all__ = ["JetStreamRelay", "JetStreamReplica", "ReplicaStats", "RelayStats"]

log = logging.getLogger("kvroute.jetstream")

T = TypeVar("T")

#: The meta bucket's key naming the newest snapshot object (objects are never rewritten in place: a
#: replica reading one while the relay writes the next would wait for chunks that are gone).
_SNAPSHOT_KEY: Final = "snapshot"
#: Snapshot objects kept: the newest and the ones before it, which a slow reader may still be reading.
_SNAPSHOTS_KEPT: Final = 3
_LEASE_KEY: Final = "leader"
_SNAPSHOT_FORMAT: Final = 1


class JetStreamError(KvRouteError):
    """The NATS server could not be reached or refused a JetStream request."""


# --- the log's records ------------------------------------------------------------------------------


class _Batch(msgspec.Struct, array_like=True, tag="b"):
    worker_id: str
    dp_rank: int
    seq: int
    ts: float
    prev: int | None
    payload: bytes


class _Reset(msgspec.Struct, array_like=True, tag="reset"):
    worker_id: str
    dp_rank: int
    reason: str
    detail: str


class _Partial(msgspec.Struct, array_like=True, tag="partial"):
    worker_id: str
    dp_rank: int
    reason: str
    first_seq: int


class _Removed(msgspec.Struct, array_like=True, tag="removed"):
    worker_id: str
    dp_rank: int
    reason: str


_Record = _Batch | _Reset | _Partial | _Removed
_decode_record = msgspec.msgpack.Decoder(_Record).decode
_encode_record = msgspec.msgpack.Encoder().encode


class _SnapshotInfo(msgspec.Struct):
    """What a snapshot object's description says: the stream sequence it covers and the workers' flags."""

    format: int
    stream_seq: int
    workers: list[tuple[str, int]]
    partial: list[tuple[str, int]]


def subject_prefix(stream: str) -> str:
    """The subjects of ``stream``'s records: ``kvroute.<stream>``."""
    return f"kvroute.{stream}"


def worker_subject(stream: str, key: WorkerKey) -> str:
    """The subject of one worker's records (the worker id base64url-encoded: any text is a valid token)."""
    token = base64.urlsafe_b64encode(key.worker_id.encode()).rstrip(b"=").decode() or "_"
    return f"{subject_prefix(stream)}.{token}.{key.dp_rank}"


def _check_stream_name(stream: str) -> None:
    if not stream or any(c in stream for c in " .*>/\\\t\r\n"):
        raise ConfigError(f"stream name {stream!r} must be non-empty without spaces, '.', '*', '>' or slashes")


# --- the asyncio loop nats-py runs on -------------------------------------------------------------


def _nats() -> Any:
    """Import nats-py (the ``kvroute[jetstream]`` extra), or raise `ConfigError`."""
    try:
        import nats
        import nats.js.api
        import nats.js.errors
    except ImportError:  # pragma: no cover - the extra is installed wherever this runs in tests
        raise ConfigError("JetStream needs nats-py: pip install 'kvroute[jetstream]'") from None
    return nats


class _NatsLoop:
    """One NATS connection, callable from any anyio backend.

    On asyncio, nats-py runs on the caller's own loop (no thread: a second thread would hand the
    GIL back and forth on every wake-up). On trio, it runs on an asyncio loop in a daemon thread.
    """

    def __init__(self, servers: Sequence[str], name: str) -> None:
        self.servers = list(servers)
        self.name = name
        self.threaded = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.nc: Any = None
        self.js: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, connect_timeout: float) -> None:
        """Start the loop (trio) and connect (nats-py then reconnects on its own, forever)."""
        self.threaded = sniffio.current_async_library() != "asyncio"
        if self.threaded:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name=f"nats-{self.name}", daemon=True)
            self._thread.start()
        else:
            self.loop = asyncio.get_running_loop()
        nats = _nats()

        async def quiet(_exc: Exception) -> None:
            log.debug("nats %s: %s", self.name, _exc)

        async def connect() -> None:
            # Reconnects are unlimited once connected; the first connect is bounded (nats-py would
            # retry it forever too).
            self.nc = await asyncio.wait_for(
                nats.connect(
                    servers=self.servers,
                    name=self.name,
                    connect_timeout=connect_timeout,
                    reconnect_time_wait=0.2,
                    max_reconnect_attempts=-1,
                    error_cb=quiet,
                    pending_size=64 * 1024 * 1024,
                ),
                connect_timeout,
            )
            self.js = self.nc.jetstream(timeout=connect_timeout)

        try:
            await self.call(connect())
        except Exception as exc:
            await self.close()
            raise JetStreamError(f"cannot connect to NATS at {', '.join(self.servers)}: {exc!r}") from exc

    async def call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the NATS loop and wait for its result (cancelling the caller cancels it)."""
        if not self.threaded:
            return await coro
        assert self.loop is not None
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
        except BaseException:
            fut.cancel()
            raise

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Call ``fn(*args)`` soon on the NATS loop, without waiting (from the caller's thread)."""
        assert self.loop is not None
        if self.threaded:
            self.loop.call_soon_threadsafe(fn, *args)
        else:
            self.loop.call_soon(fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task on the NATS loop (call it from that loop), cancelled by `close`."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def signal(self) -> _Signal:
        """A wake-up the NATS loop sets and the caller's side waits on."""
        return _Signal(self.threaded)

    async def close(self) -> None:
        """Drop the connection (without waiting on a dead server) and stop the loop."""
        tasks = list(self._tasks)
        if tasks and self.loop is not None:

            async def cancel() -> None:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            with contextlib.suppress(Exception):
                await self.call(cancel())
        if self.nc is not None:
            nc, self.nc = self.nc, None
            with contextlib.suppress(Exception):
                await self.call(asyncio.wait_for(nc.close(), 2.0))
        if self._thread is not None and self.loop is not None:
            if self._thread.is_alive():
                with contextlib.suppress(Exception):
                    await self.call(asyncio.wait_for(_cancel_all(), 2.0))
                self.loop.call_soon_threadsafe(self.loop.stop)
                await anyio.to_thread.run_sync(self._thread.join, 5.0)
            if not self.loop.is_running():
                self.loop.close()


class _Signal:
    """Set on the NATS loop, awaited by the caller: a threading.Event across threads, an anyio.Event on one loop."""

    def __init__(self, threaded: bool) -> None:
        self._threaded = threaded
        self._event = threading.Event()
        self._flag = False
        self._waiter: anyio.Event | None = None

    def set(self) -> None:
        """Wake the waiter (from the NATS loop)."""
        if self._threaded:
            self._event.set()
        else:
            self._flag = True
            if self._waiter is not None:
                self._waiter.set()

    def clear(self) -> None:
        """Forget a past wake-up (the waiter then re-checks what it waits for)."""
        self._event.clear()
        self._flag = False

    async def wait(self, timeout: float) -> None:  # noqa: ASYNC109 (a short poll bound, not an API timeout)
        """Wait until set, at most ``timeout`` seconds."""
        if self._threaded:
            await anyio.to_thread.run_sync(self._event.wait, timeout, abandon_on_cancel=True)
            return
        if self._flag:
            return
        self._waiter = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._waiter.wait()
        self._waiter = None


async def _cancel_all() -> None:
    """Cancel what nats-py left running on this loop (a subscription's heartbeat checks), so it stops clean."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _ensure_stream(js: Any, stream: str, storage: str, max_age: float, duplicate_window: float) -> None:
    """Create the stream (and the snapshot store and lease bucket) unless they exist."""
    nats = _nats()
    api = nats.js.api
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        cfg = api.StreamConfig(
            name=stream,
            subjects=[f"{subject_prefix(stream)}.>"],
            storage=api.StorageType.FILE if storage == "file" else api.StorageType.MEMORY,
            max_age=max_age or None,
            duplicate_window=duplicate_window,
            discard=api.DiscardPolicy.OLD,
        )
        with contextlib.suppress(nats.js.errors.BadRequestError):  # another relay created it meanwhile
            await js.add_stream(cfg)
    await _object_store(js, stream, create=True)
    await _lease_bucket(js, stream, create=True)


async def _object_store(js: Any, stream: str, *, create: bool) -> Any:
    nats = _nats()
    try:
        return await js.object_store(f"{stream}_snapshots")
    except nats.js.errors.NotFoundError:
        if not create:
            return None
        return await js.create_object_store(f"{stream}_snapshots")


async def _lease_bucket(js: Any, stream: str, *, create: bool) -> Any:
    nats = _nats()
    try:
        return await js.key_value(f"{stream}_meta")
    except nats.js.errors.NotFoundError:
        if not create:
            return None
        return await js.create_key_value(bucket=f"{stream}_meta", history=1)


class _Follower:
    """An ordered push consumer of the whole stream, run on the NATS loop (nats-py's own answers flow control
    only every 250 ms, which stalls a busy stream; this one answers at once).

    Records go to ``queue`` as (stream sequence, data). A consumer sequence that skips, or silence
    (no record, no heartbeat) for three heartbeat intervals (the server restarted: the consumer,
    in memory, is gone), recreates the consumer from the sequence after the last record taken.
    """

    def __init__(self, nl: _NatsLoop, stream: str, queue: deque[tuple[int, bytes]], ready: _Signal) -> None:
        self.nl = nl
        self.stream = stream
        self.queue = queue
        self.ready = ready
        self.sseq = 0
        self.cseq = 0
        self.generation = 0
        self.seen = 0.0
        self.sub: Any = None
        self.consumer: str | None = None
        self.heartbeat = 1.0

    async def open(self, start: int) -> int:
        """Create the consumer from ``start`` and start the watchdog; the stream's last sequence now."""
        info = await self.nl.js.stream_info(self.stream)
        self.sseq = start - 1
        await self._create()
        self.nl.spawn(self._watchdog())
        return int(info.state.last_seq)

    async def _create(self) -> None:
        nats = _nats()
        api = nats.js.api
        nc = self.nl.nc
        self.generation += 1
        generation = self.generation
        old, self.sub = self.sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nl.js.delete_consumer(self.stream, consumer), 1.0)
        inbox = nc.new_inbox()

        async def on_msg(msg: Any) -> None:
            if generation != self.generation:
                return  # a message of a replaced consumer
            self.seen = asyncio.get_running_loop().time()
            reply = msg.reply
            if not reply or not reply.startswith("$JS.ACK."):
                hdr = msg.headers or {}
                if reply and hdr.get("Status") == "100":
                    await nc.publish(reply, b"")  # flow control: answered at once
                stalled = hdr.get("Nats-Consumer-Stalled")
                if stalled:
                    await nc.publish(stalled, b"")
                return
            meta = msg.metadata.sequence
            if meta.consumer != self.cseq + 1:
                await self._create()  # a delivery was lost: start over after the last one taken
                return
            self.cseq = meta.consumer
            self.sseq = meta.stream
            self.queue.append((meta.stream, msg.data))
            self.ready.set()

        self.cseq = 0
        self.seen = asyncio.get_running_loop().time()
        self.sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        cfg = api.ConsumerConfig(
            deliver_subject=inbox,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.sseq + 1,
            ack_policy=api.AckPolicy.NONE,
            filter_subject=f"{subject_prefix(self.stream)}.>",
            flow_control=True,
            idle_heartbeat=self.heartbeat,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=30.0,
        )
        info = await self.nl.js.add_consumer(self.stream, config=cfg)
        self.consumer = info.name

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat)
            if loop.time() - self.seen > 3 * self.heartbeat:
                try:
                    await self._create()
                except Exception as exc:  # the server is still away: try again next tick
                    log.debug("consumer of %s not recreated yet: %r", self.stream, exc)


# --- the replica --------------------------------------------------------------------------------------


class _WorkerState:
    __slots__ = ("last", "partial")

    def __init__(self, last: Cursor | None = None, partial: bool = False) -> None:
        self.last = last
        self.partial = partial


class ReplicaStats(msgspec.Struct, frozen=True, kw_only=True):
    """A `JetStreamReplica`'s counters.

    ``position``: the last stream sequence applied; ``snapshot_seq``: the sequence the snapshot
    it started from covered (0: none); ``batches``: batches applied; ``duplicates``: batches at
    or below their worker's last seq, skipped; ``gaps``: chain breaks (a worker reset, partial);
    ``stream_gaps``: jumps in the stream's sequence (every worker reset, partial);
    ``undecodable``: records or batches that failed to decode (the worker reset, partial).
    """

    position: int
    snapshot_seq: int
    synced: bool
    workers: int
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    stream_gaps: int = 0
    undecodable: int = 0
    resets: int = 0


class JetStreamReplica:
    """A router replica: an index rebuilt from a relay's JetStream log, never talking to the engines.

    ``async with JetStreamReplica("nats://host:4222") as replica:`` loads the latest snapshot of
    ``stream`` (when there is one), reads the log from the sequence after the one it covers, then
    follows it live. ``await replica.wait_synced(t)`` returns once it has applied everything the
    log held when it subscribed. It is a router's `WorkerStates` (``Router(replica.index,
    replica)``): every worker named by the log is live; a worker's ``partial`` flag is the relay's
    (or set by a gap in the log). The NATS connection reconnects by itself; its consumer is
    recreated from the next sequence after a skipped delivery or a silent server (`_Follower`).
    A replica started before any relay created the stream waits for it.
    """

    def __init__(
        self,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        stream: str = "KVROUTE",
        use_snapshot: bool = True,
        connect_timeout: float = 5.0,
        name: str = "kvroute-replica",
    ) -> None:
        _check_stream_name(stream)
        _nats()
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self.stream = stream
        self._use_snapshot = use_snapshot
        self._connect_timeout = connect_timeout
        self._name = name
        self.index = PrefixIndex()
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self.position = 0
        self._snapshot_seq = 0
        self._target: int | None = None
        self._counts = {"batches": 0, "duplicates": 0, "gaps": 0, "stream_gaps": 0, "undecodable": 0, "resets": 0}
        self._queue: deque[tuple[int, bytes]] = deque()
        self._ready = _Signal(threaded=True)  # replaced by the connection's kind in start()
        self._nats: _NatsLoop | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed: anyio.Event | None = None
        #: Called after each applied record: its stream sequence, worker and engine seq (None for a
        #: lifecycle record); for measuring apply lag (bench/bench_jetstream.py).
        self.on_applied: Callable[[int, WorkerKey, int | None], None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> JetStreamReplica:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, load the latest snapshot, subscribe from the sequence after it and start applying."""
        nl = _NatsLoop(self._servers, self._name)
        await nl.start(self._connect_timeout)
        self._nats = nl
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._follow, nl)

    async def _follow(self, nl: _NatsLoop) -> None:
        """Wait for the stream (a replica may start before any relay), load the snapshot, subscribe, apply."""
        nats = _nats()
        while True:
            try:
                if self._use_snapshot:
                    await self._load_snapshot(nl)
                await self._subscribe(nl)
                break
            except JetStreamError as exc:
                if not isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                    log.warning("replica %s: %s; retrying", self._name, exc)
                await anyio.sleep(0.25)
        await self._apply_loop()

    async def stop(self) -> None:
        """Stop following the log (the index keeps what it holds)."""
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        nl, self._nats = self._nats, None
        if nl is not None:
            await nl.close()
        self._wake()

    async def _load_snapshot(self, nl: _NatsLoop) -> None:
        async def fetch() -> tuple[bytes, str] | None:
            nats = _nats()
            meta = await _lease_bucket(nl.js, self.stream, create=False)
            store = await _object_store(nl.js, self.stream, create=False)
            if meta is None or store is None:
                return None
            try:
                name = (await meta.get(_SNAPSHOT_KEY)).value.decode()
                res = await store.get(name)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.ObjectNotFoundError):
                return None
            return bytes(res.data), res.info.description or ""

        try:
            # Bounded: an object deleted while it is read (three snapshots later) would never complete.
            got = await nl.call(asyncio.wait_for(fetch(), 60.0))
        except Exception as exc:
            raise JetStreamError(f"cannot read the snapshot of {self.stream}: {exc!r}") from exc
        if got is None:
            return
        data, description = got
        try:
            info = msgspec.json.decode(description, type=_SnapshotInfo)
            if info.format != _SNAPSHOT_FORMAT:
                raise SnapshotError(f"snapshot format {info.format}; this kvroute reads {_SNAPSHOT_FORMAT}")
            index, cursors = _restore(data)
        except (msgspec.DecodeError, msgspec.ValidationError, SnapshotError) as exc:
            # Cold from the whole log instead: it is exact when the log still holds everything.
            log.warning("replica %s: snapshot unusable, reading the log from its start: %s", self._name, exc)
            return
        partial = {WorkerKey(*k) for k in info.partial}
        self.index = index
        self._workers = {
            WorkerKey(*k): _WorkerState(cursors.get(WorkerKey(*k)), WorkerKey(*k) in partial) for k in info.workers
        }
        self.position = self._snapshot_seq = info.stream_seq

    async def _subscribe(self, nl: _NatsLoop) -> None:
        self._ready = nl.signal()
        follower = _Follower(nl, self.stream, self._queue, self._ready)
        try:
            self._target = await nl.call(follower.open(self.position + 1))
        except Exception as exc:
            raise JetStreamError(f"cannot subscribe to stream {self.stream}: {exc!r}") from exc

    # --- applying -------------------------------------------------------------------------------

    async def _take(self) -> list[tuple[int, bytes]]:
        queue, ready = self._queue, self._ready
        while True:
            if queue:
                out = []
                pop = queue.popleft
                for _ in range(min(len(queue), 20_000)):
                    out.append(pop())
                return out
            ready.clear()
            if queue:
                continue
            await ready.wait(0.5)

    async def _apply_loop(self) -> None:
        if self.synced:
            self._wake()
        while True:
            for sseq, data in await self._take():
                self.apply_record(sseq, data)
            self._wake()
            await anyio.lowlevel.checkpoint()

    def apply_record(self, sseq: int, data: bytes) -> None:
        """Apply one log record at stream sequence ``sseq`` (exposed for the relay's mirror and tests)."""
        if sseq <= self.position:
            return  # redelivered by a consumer reset
        if sseq != self.position + 1 and self.position >= 0:
            self._counts["stream_gaps"] += 1
            log.warning(
                "replica %s: stream records %d..%d are gone: every worker reset",
                self._name,
                self.position + 1,
                sseq - 1,
            )
            for lost, ws in self._workers.items():
                self.index.remove_worker(lost)
                ws.last, ws.partial = None, True
        self.position = sseq
        try:
            rec = _decode_record(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Its worker cannot be known; that worker's next batch breaks the chain (prev), which resets it.
            self._counts["undecodable"] += 1
            log.warning("replica %s: undecodable record at %d skipped", self._name, sseq)
            return
        key = WorkerKey(rec.worker_id, rec.dp_rank)
        if isinstance(rec, _Batch):
            st = self._workers.get(key)
            if st is None:
                st = self._workers[key] = _WorkerState()
            last = st.last
            if last is not None and rec.seq <= last.seq:
                self._counts["duplicates"] += 1
                return
            if rec.prev != (last.seq if last is not None else None):
                # An uncovered gap: what the log lost may have removed blocks; claim none of the old ones.
                self._counts["gaps"] += 1
                self.index.remove_worker(key)
                st.partial = True
            try:
                batch = decode_batch(rec.payload)
            except DecodeError:
                self._counts["undecodable"] += 1
                self.index.remove_worker(key)
                st.last, st.partial = None, True
                return
            self.index.apply_batch(key, batch)
            st.last = Cursor(rec.seq, rec.ts)
            self._counts["batches"] += 1
        elif isinstance(rec, _Reset):
            self.index.remove_worker(key)
            self._counts["resets"] += 1
            self._workers[key] = _WorkerState()
        elif isinstance(rec, _Partial):
            self._workers.setdefault(key, _WorkerState()).partial = True
        else:
            self.index.remove_worker(key)
            self._workers.pop(key, None)
        if self.on_applied is not None:
            self.on_applied(sseq, key, rec.seq if isinstance(rec, _Batch) else None)

    # --- state ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def synced(self) -> bool:
        """True once everything the log held at subscription is applied."""
        return self._target is not None and self.position >= self._target

    async def wait_synced(self, timeout: float) -> None:  # noqa: ASYNC109 (the same API as KvEventClient)
        """Return once everything the log held at subscription is applied (TimeoutError after ``timeout``)."""
        with anyio.fail_after(timeout):
            while not self.synced:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    async def wait_position(self, seq: int, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the stream sequence ``seq`` is applied (TimeoutError after ``timeout``)."""
        with anyio.fail_after(timeout):
            while self.position < seq or self._target is None:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        """The worker's status: synced once the replica caught up with the log; partial as the log says."""
        st = self._workers.get(worker)
        if st is None:
            return None
        return WorkerStatus(state="synced" if self.synced else "syncing", partial=st.partial)

    def live_workers(self) -> set[WorkerKey]:
        """Every worker the log names (not removed)."""
        return set(self._workers)

    def cursors(self) -> dict[WorkerKey, Cursor]:
        """Each worker's last applied engine batch (seq, ts); none right after a reset."""
        return {k: st.last for k, st in self._workers.items() if st.last is not None}

    def partial_workers(self) -> set[WorkerKey]:
        """The workers whose history before some point is unknown."""
        return {k for k, st in self._workers.items() if st.partial}

    def stats(self) -> ReplicaStats:
        """A snapshot of the replica's counters."""
        return ReplicaStats(
            position=self.position,
            snapshot_seq=self._snapshot_seq,
            synced=self.synced,
            workers=len(self._workers),
            **self._counts,
        )

    def snapshot_bytes(self) -> tuple[bytes, _SnapshotInfo]:
        """The index in kvroute's snapshot format, with the stream sequence it covers (taken at one instant)."""
        with tempfile.TemporaryDirectory(prefix="kvroute-js-") as tmp:
            path = Path(tmp) / "index.snapshot"
            self.index.snapshot(path, cursors=self.cursors())
            data = path.read_bytes()
        info = _SnapshotInfo(
            format=_SNAPSHOT_FORMAT,
            stream_seq=self.position,
            workers=[(k.worker_id, k.dp_rank) for k in self._workers],
            partial=[(k.worker_id, k.dp_rank) for k in self.partial_workers()],
        )
        return data, info


def _restore(data: bytes) -> tuple[PrefixIndex, dict[WorkerKey, Cursor]]:
    with tempfile.TemporaryDirectory(prefix="kvroute-js-") as tmp:
        path = Path(tmp) / "index.snapshot"
        path.write_bytes(data)
        index = PrefixIndex.restore(path)
    cursors, index.restored_cursors = index.restored_cursors, {}
    return index, cursors


# --- the relay ----------------------------------------------------------------------------------------


class RelayStats(msgspec.Struct, frozen=True, kw_only=True):
    """A `JetStreamRelay`'s counters.

    ``active``: it holds the lease; ``sessions``: times it started following the engines (a
    takeover, or a restart after a publish failure or an events overflow); ``batches`` and
    ``records``: published (``duplicates`` of them dropped by the server's dedup window);
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


class _Restart(Exception):
    """The session must start over from what the log holds (publish failure, overflow)."""


class _LeaseLost(Exception):
    """Another relay holds the lease now."""


class JetStreamRelay:
    """Follows engines like `KvEventClient` and republishes what it applied to a JetStream stream.

    ``sources`` / ``targets`` / ``config`` / ``discovery_*`` are `KvEventClient`'s. Run it with
    ``async with JetStreamRelay(...) as relay:`` (or ``await relay.run()``). Several relays may run
    for one stream: the lease decides which one publishes (see the module docs). Leaving the block
    releases the lease, so a standby takes over at once; a relay that dies keeps it until
    ``lease_ttl`` passes. The active relay writes a snapshot every ``snapshot_interval`` seconds
    (when the log moved). ``max_age`` bounds the stream's retention (0: unlimited); keep it well
    above ``snapshot_interval``.
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
        storage: str = "file",
        max_age: float = 24 * 3600.0,
        duplicate_window: float = 120.0,
        publish_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        name: str | None = None,
    ) -> None:
        _check_stream_name(stream)
        if storage not in ("file", "memory"):
            raise ConfigError(f"storage must be 'file' or 'memory', not {storage!r}")
        if not snapshot_interval > 0 or not lease_ttl > 0 or not publish_timeout > 0 or max_age < 0:
            raise ConfigError("snapshot_interval, lease_ttl and publish_timeout must be > 0, max_age >= 0")
        _nats()
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self._sources = list(sources)
        self._targets = list(targets)
        self.stream = stream
        self._config = config or SubscriberConfig()
        self._discovery = (discovery_interval, discovery_grace, discovery_options)
        self._snapshot_interval = snapshot_interval
        self._lease_ttl = lease_ttl
        self._storage = storage
        self._max_age = max_age
        self._duplicate_window = duplicate_window
        self._publish_timeout = publish_timeout
        self._connect_timeout = connect_timeout
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
        self._nats: _NatsLoop | None = None
        self._mirror: JetStreamReplica | None = None
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
        nl = _NatsLoop(self._servers, self.name)
        await nl.start(self._connect_timeout)
        self._nats = nl
        try:
            await nl.call(_ensure_stream(nl.js, self.stream, self._storage, self._max_age, self._duplicate_window))
            self._kv = await nl.call(_lease_bucket(nl.js, self.stream, create=True))
            self._store = await nl.call(_object_store(nl.js, self.stream, create=True))
            mirror = JetStreamReplica(self._servers, stream=self.stream, name=f"{self.name}-mirror")
            async with mirror:
                self._mirror = mirror
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
        nats = _nats()
        seen: tuple[int, float] | None = None
        kv = self._kv
        while True:

            async def attempt(seen_rev: int | None) -> tuple[bool, int]:
                try:
                    entry = await kv.get(_LEASE_KEY)
                except nats.js.errors.KeyNotFoundError:
                    try:
                        return True, int(await kv.create(_LEASE_KEY, self._lease_value()))
                    except nats.js.errors.APIError:
                        return False, 0
                rev = int(entry.revision)
                if seen_rev is None or rev != seen_rev:
                    return False, rev
                try:
                    return True, int(await kv.update(_LEASE_KEY, self._lease_value(), last=rev))
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

    async def _renew(self) -> None:
        nl = self._nats
        assert nl is not None
        nats = _nats()
        kv = self._kv
        deadline = anyio.current_time() + self._lease_ttl
        while True:
            await anyio.sleep(self._lease_ttl / 3)
            try:
                rev = await nl.call(
                    asyncio.wait_for(
                        kv.update(_LEASE_KEY, self._lease_value(), last=self._lease_rev), self._lease_ttl / 3
                    )
                )
            except nats.js.errors.APIError as exc:
                raise _LeaseLost() from exc
            except Exception as exc:
                # The server is away: the lease cannot be renewed; past its ttl another relay may hold it.
                if anyio.current_time() >= deadline:
                    raise _LeaseLost() from exc
                continue
            self._lease_rev = int(rev)
            deadline = anyio.current_time() + self._lease_ttl

    async def _release(self) -> None:
        nl, rev = self._nats, self._lease_rev
        self._lease_rev = 0
        if nl is None:
            return
        kv = self._kv
        with contextlib.suppress(Exception), anyio.move_on_after(2.0):
            await nl.call(kv.delete(_LEASE_KEY, last=rev))

    # --- the active term ---------------------------------------------------------------------------

    async def _active_term(self) -> None:
        self.active = True
        self._became_active.set()
        log.info("relay %s: holds the lease of %s", self.name, self.stream)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._renew)
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

    async def _caught_up(self) -> int:
        """Wait until the mirror read the whole log (nothing is published meanwhile); its last sequence."""
        nl, mirror = self._nats, self._mirror
        assert nl is not None and mirror is not None
        while True:
            try:
                info = await nl.call(nl.js.stream_info(self.stream))
                last = int(info.state.last_seq)
                await mirror.wait_position(last, 10.0)
                return last
            except Exception as exc:
                log.warning("relay %s: waiting for the log: %r", self.name, exc)
                await anyio.sleep(0.5)

    async def _session(self) -> None:
        """Follow the engines from where the log stands, publishing until something forces a restart."""
        await self._caught_up()
        mirror = self._mirror
        assert mirror is not None
        cursors = mirror.cursors()
        known = mirror.live_workers()
        index = PrefixIndex()
        index.restored_cursors = dict(cursors)
        interval, grace, options = self._discovery
        self._counts["sessions"] += 1
        session = uuid.uuid4().hex[:12]
        pub = _Publisher(self, session, {k: c.seq for k, c in cursors.items()})
        async with KvEventClient(
            self._sources,
            targets=self._targets,
            index=index,
            config=self._config,
            discovery_interval=interval,
            discovery_grace=grace,
            discovery_options=options,
        ) as client:
            self.client = client
            stream = client.events(buffer=1_000_000)
            # Workers the log names that no static source feeds are gone (with targets, the
            # discovered sources are only known later: the reconciler below handles them).
            static = {s.key for s in self._sources}
            if not self._targets:
                for key in sorted(known - static):
                    pub.removed(key, "gone from discovery")
            async with anyio.create_task_group() as tg:
                if self._targets:
                    tg.start_soon(self._reconcile, client, pub, known)
                await pub.pump(stream)

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
        nl, mirror = self._nats, self._mirror
        assert nl is not None and mirror is not None
        written = -1
        while True:
            await anyio.sleep(self._snapshot_interval)
            if mirror.position == written:
                continue
            await self.write_snapshot()
            written = self._counts["snapshot_seq"]

    async def write_snapshot(self) -> int:
        """Write the mirror's index to the object store now; the stream sequence it covers."""
        nl, mirror = self._nats, self._mirror
        assert nl is not None and mirror is not None
        data, info = mirror.snapshot_bytes()
        nats = _nats()
        name = f"index-{info.stream_seq}"
        meta = nats.js.api.ObjectMeta(name=name, description=msgspec.json.encode(info).decode())
        store, kv = self._store, self._kv

        async def put() -> None:
            await store.put(name, data, meta=meta)
            await kv.put(_SNAPSHOT_KEY, name.encode())
            # Older objects go once newer ones exist (a reader holds at most one of them, briefly).
            old = sorted(
                (o.name for o in await store.list() if o.name.startswith("index-") and not o.deleted),
                key=lambda n: int(n.split("-", 1)[1]),
            )
            for stale in old[:-_SNAPSHOTS_KEPT]:
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


class _Publisher:
    """One session's ordered publishing: envelopes → log records, posted to an `_Outbox` in order."""

    def __init__(self, relay: JetStreamRelay, session: str, prev: dict[WorkerKey, int]) -> None:
        self.relay = relay
        self.session = session
        self.prev: dict[WorkerKey, int | None] = dict(prev)
        self.out: list[tuple[str, bytes, str]] = []
        self._serial = 0
        self._group: list[Envelope] = []
        self._kicked = False

    def kick(self) -> None:
        """Records were queued from outside the pump: flush them with the next round."""
        self._kicked = True

    def _lifecycle(self, key: WorkerKey, rec: _Record) -> None:
        self._serial += 1
        msg_id = f"{key.worker_id}/{key.dp_rank}:{rec.__struct_config__.tag}:{self.session}:{self._serial}"
        self.out.append((worker_subject(self.relay.stream, key), _encode_record(rec), msg_id))
        self.relay._counts["records"] += 1

    def removed(self, key: WorkerKey, reason: str) -> None:
        self.prev.pop(key, None)
        self.relay._counts["removals"] += 1
        self._lifecycle(key, _Removed(key.worker_id, key.dp_rank, reason))

    def _flush_group(self) -> None:
        group = self._group
        if not group:
            return
        self._group = []
        first = group[0]
        key = first.source.key
        seq = first.seq
        assert seq is not None
        events = [env.event for env in group]
        payload = encode_batch(EventBatch(ts=first.ts, events=events))  # type: ignore[arg-type]
        prev = self.prev.get(key)
        self.prev[key] = seq
        rec = _Batch(key.worker_id, key.dp_rank, seq, first.ts, prev, payload)
        self.out.append(
            (
                worker_subject(self.relay.stream, key),
                _encode_record(rec),
                f"{key.worker_id}/{key.dp_rank}:{seq}:{first.ts!r}",
            )
        )
        counts = self.relay._counts
        counts["batches"] += 1
        counts["records"] += 1
        counts["blocks"] += sum(len(getattr(ev, "block_hashes", ())) for ev in events)

    def take(self, env: Envelope) -> None:
        """Turn one envelope into records (a batch is closed by the next envelope of another batch)."""
        ev = env.event
        if env.seq is not None:
            group = self._group
            if group and (group[0].source.key != env.source.key or group[0].seq != env.seq):
                self._flush_group()
            self._group.append(env)
            return
        self._flush_group()
        key = env.source.key
        if isinstance(ev, Overflow):
            raise _Restart(f"events buffer overflowed ({ev.dropped} dropped)")
        if isinstance(ev, Reset):
            self.prev[key] = None
            self.relay._counts["resets"] += 1
            self._lifecycle(key, _Reset(key.worker_id, key.dp_rank, ev.reason, ev.detail))
        elif isinstance(ev, Partial):
            self.relay._counts["partials"] += 1
            self._lifecycle(key, _Partial(key.worker_id, key.dp_rank, ev.reason, ev.first_seq))
        elif isinstance(ev, Removed):
            self.removed(key, ev.reason)

    async def pump(self, stream: Any) -> None:
        """Read envelopes, publish them in order; raises `_Restart` when the log may have missed one."""
        relay = self.relay
        nl = relay._nats
        assert nl is not None
        outbox = _Outbox(nl, relay._publish_timeout)
        duplicates_before = relay._counts["duplicates"]
        try:
            while True:
                if self._group or self.out or self._kicked:
                    # Take what is buffered without waiting (a batch ends where the buffer does).
                    while stream.pending and len(self.out) < 20_000:
                        self.take(await stream.__anext__())
                else:
                    with anyio.move_on_after(0.5):
                        self.take(await stream.__anext__())
                    continue
                self._flush_group()
                self._kicked = False
                if outbox.failed is not None:
                    raise _Restart(f"publish failed: {outbox.failed!r}")
                if self.out:
                    out, self.out = self.out, []
                    outbox.post(out)
                # Back-pressure: at most `_WINDOW` records await their acks.
                while outbox.unacked > _WINDOW and outbox.failed is None:  # noqa: ASYNC110 (a thread's counter)
                    await anyio.sleep(0.001)
                relay._counts["duplicates"] = duplicates_before + outbox.duplicates
        finally:
            # Whatever is still in flight lands (or fails) before the next session reads the log.
            with anyio.CancelScope(shield=True), anyio.move_on_after(relay._publish_timeout + 1):
                await nl.call(outbox.drain())


#: Records published but not yet acknowledged, at most (the relay's publish pipeline depth).
_WINDOW: Final = 50_000


class _Outbox:
    """The relay's publisher on the NATS loop: records posted without waiting, published in order, acks checked.

    ``failed`` is set by the first record not acknowledged within ``timeout`` (or refused): the
    session must then start over from what the log holds.
    """

    def __init__(self, nl: _NatsLoop, timeout: float) -> None:
        self.nl = nl
        self.timeout = timeout
        self.posted = 0
        self.acked = 0
        self.duplicates = 0
        self.failed: BaseException | None = None
        self._tail_sent: asyncio.Event | None = None
        self._acks: set[asyncio.Task[None]] = set()

    @property
    def unacked(self) -> int:
        """Records posted and not yet acknowledged."""
        return self.posted - self.acked

    def post(self, msgs: list[tuple[str, bytes, str]]) -> None:
        """Queue ``msgs`` for publishing after everything posted before (returns at once; any thread)."""
        self.posted += len(msgs)
        self.nl.post(self._start, msgs)

    def _start(self, msgs: list[tuple[str, bytes, str]]) -> None:
        # Chained: a job hands its records to the connection only after the previous job did.
        prev, sent = self._tail_sent, asyncio.Event()
        self._tail_sent = sent
        task = asyncio.get_running_loop().create_task(self._publish(prev, sent, msgs))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _publish(
        self, prev: asyncio.Event | None, sent: asyncio.Event, msgs: list[tuple[str, bytes, str]]
    ) -> None:
        js = self.nl.js
        futures = []
        try:
            if prev is not None:
                await prev.wait()
            for subject, data, msg_id in msgs:
                if self.failed is not None:
                    return  # the session restarts: publish nothing after a failure
                futures.append(
                    await js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id}, wait_stall=self.timeout)
                )
            sent.set()
            acks = await asyncio.wait_for(asyncio.gather(*futures), self.timeout)
        except Exception as exc:
            for f in futures:
                f.cancel()
            if self.failed is None:
                self.failed = exc
            return
        finally:
            sent.set()
        self.duplicates += sum(1 for a in acks if a.duplicate)
        self.acked += len(msgs)

    async def drain(self) -> None:
        """Wait for every posted job to be acknowledged or failed."""
        while self._acks:
            await asyncio.gather(*list(self._acks), return_exceptions=True)
