"""`JetStreamReplica`: a router's index rebuilt from a relay's JetStream log, never talking to the engines.

The log's format and the rules a replica applies it by are in `kvroute._jetstream`; the relay
that writes it is `kvroute._jetstream_relay.JetStreamRelay` (which keeps one of these as its
mirror, the source of its snapshots and of the positions a new active relay resumes from).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from ._errors import SnapshotError
from ._index import PrefixIndex
from ._jetstream import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_KEY,
    JetStreamError,
    SnapshotInfo,
    _Batches,
    _Partial,
    _Present,
    _Reset,
    check_stream_name,
    decode_record,
    fetch_object,
    log,
    meta_bucket,
    nats_module,
    subject_prefix,
)
from ._jetstream_nats import NatsLoop, Signal
from ._models import WorkerKey, WorkerStatus
from ._snapshot import Cursor
from ._wire import Limits

__all__ = ["JetStreamReplica", "ReplicaStats"]

#: Seconds of applying records before the apply loop yields to the event loop's other tasks.
_SLICE = 0.02


class _Follower:
    """An ordered push consumer of the whole stream, run on the NATS loop (nats-py's own answers flow control
    only every 250 ms, which stalls a busy stream; this one answers at once).

    Records go to ``queue`` as (stream sequence, data). A consumer sequence that skips, or silence
    (no record, no heartbeat) for three heartbeat intervals (the server restarted: the consumer,
    in memory, is gone), recreates the consumer from the sequence after the last record taken.
    """

    def __init__(self, nl: NatsLoop, stream: str, queue: deque[tuple[int, bytes]], ready: Signal) -> None:
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
        nats = nats_module()
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
    A replica started before any relay created the stream waits for it. ``limits``: the caps
    payloads are decoded under (give the relay client's ``config.limits`` when it raised them).
    """

    def __init__(
        self,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        stream: str = "KVROUTE",
        use_snapshot: bool = True,
        connect_timeout: float = 5.0,
        name: str = "kvroute-replica",
        limits: Limits | None = None,
    ) -> None:
        check_stream_name(stream)
        nats_module()
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self.stream = stream
        self._use_snapshot = use_snapshot
        self._connect_timeout = connect_timeout
        self._name = name
        self._limits = limits or Limits()
        self.index = PrefixIndex()
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self.position = 0
        self._snapshot_seq = 0
        self._target: int | None = None
        self._counts = {"batches": 0, "duplicates": 0, "gaps": 0, "stream_gaps": 0, "undecodable": 0, "resets": 0}
        self._queue: deque[tuple[int, bytes]] = deque()
        self._ready = Signal(threaded=True)  # replaced by the connection's kind in start()
        self._nats: NatsLoop | None = None
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
        nl = NatsLoop(self._servers, self._name)
        await nl.start(self._connect_timeout)
        self._nats = nl
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._follow, nl)

    async def _follow(self, nl: NatsLoop) -> None:
        """Wait for the stream (a replica may start before any relay), load the snapshot, subscribe, apply."""
        nats = nats_module()
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

    async def _load_snapshot(self, nl: NatsLoop) -> None:
        async def fetch() -> tuple[bytes, str] | None:
            nats = nats_module()
            meta = await meta_bucket(nl.js, self.stream, create=False)
            if meta is None:
                return None
            try:
                name = (await meta.get(SNAPSHOT_KEY)).value.decode()
            except nats.js.errors.KeyNotFoundError:
                return None
            return await fetch_object(nl.js, self.stream, name)

        try:
            # Bounded: an object deleted while it is read (three snapshots later) would never complete.
            got = await nl.call(asyncio.wait_for(fetch(), 60.0))
        except Exception as exc:
            raise JetStreamError(f"cannot read the snapshot of {self.stream}: {exc!r}") from exc
        if got is None:
            return
        data, description = got
        try:
            info = msgspec.json.decode(description, type=SnapshotInfo)
            if info.format != SNAPSHOT_FORMAT:
                raise SnapshotError(f"snapshot format {info.format}; this kvroute reads {SNAPSHOT_FORMAT}")
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

    async def _subscribe(self, nl: NatsLoop) -> None:
        self._ready = nl.signal()
        follower = _Follower(nl, self.stream, self._queue, self._ready)
        try:
            self._target = await nl.call(follower.open(self.position + 1))
        except Exception as exc:
            raise JetStreamError(f"cannot subscribe to stream {self.stream}: {exc!r}") from exc

    # --- applying -------------------------------------------------------------------------------

    async def _wait_records(self) -> None:
        queue, ready = self._queue, self._ready
        while not queue:
            ready.clear()
            if queue:
                return
            await ready.wait(0.5)

    async def _apply_loop(self) -> None:
        if self.synced:
            self._wake()
        queue = self._queue
        pop = queue.popleft
        while True:
            await self._wait_records()
            # A slice at a time: the loop's other tasks (a relay's lease renewal, a router) run in between.
            deadline = time.monotonic() + _SLICE
            while queue and time.monotonic() < deadline:
                self.apply_record(*pop())
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
            rec, body = decode_record(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Its worker cannot be known; that worker's next batch breaks the chain (prev), which resets it.
            self._counts["undecodable"] += 1
            log.warning("replica %s: undecodable record at %d skipped", self._name, sseq)
            return
        key = WorkerKey(rec.worker_id, rec.dp_rank)
        if isinstance(rec, _Batches):
            self._apply_run(sseq, key, rec, data, body)
            return
        if isinstance(rec, _Reset):
            self.index.remove_worker(key)
            self._counts["resets"] += 1
            self._workers[key] = _WorkerState()
        elif isinstance(rec, _Partial):
            self._workers.setdefault(key, _WorkerState()).partial = True
        elif isinstance(rec, _Present):
            self._workers.setdefault(key, _WorkerState())
        else:
            self.index.remove_worker(key)
            self._workers.pop(key, None)
        if self.on_applied is not None:
            self.on_applied(sseq, key, None)

    def _apply_run(self, sseq: int, key: WorkerKey, rec: _Batches, data: bytes, at: int) -> None:
        """Apply a run of ``key``'s batches, each payload straight from the record's body (the core decodes it)."""
        st = self._workers.get(key)
        if st is None:
            st = self._workers[key] = _WorkerState()
        counts, index, limits, on_applied = self._counts, self.index, self._limits, self.on_applied
        prev = rec.prev
        for seq, ts, length in rec.items:
            payload = data[at : at + length]
            at += length
            item_prev, prev = prev, seq
            last = st.last
            if last is not None and seq <= last.seq:
                counts["duplicates"] += 1
                continue
            if item_prev != (last.seq if last is not None else None):
                # An uncovered gap: what the log lost may have removed blocks; claim none of the old ones.
                counts["gaps"] += 1
                index.remove_worker(key)
                st.partial = True
            st.last = Cursor(seq, ts)
            if not index.apply_payload(key, payload, limits).ok:
                # Nothing of it was applied: blocks it removed may still be held, so none are trusted.
                # The chain goes on from it (what follows is applied to the emptied worker).
                counts["undecodable"] += 1
                index.remove_worker(key)
                st.partial = True
                continue
            counts["batches"] += 1
            if on_applied is not None:
                on_applied(sseq, key, seq)

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

    def snapshot_bytes(self) -> tuple[bytes, SnapshotInfo]:
        """The index in kvroute's snapshot format, with the stream sequence it covers (taken at one instant)."""
        with tempfile.TemporaryDirectory(prefix="kvroute-js-") as tmp:
            path = Path(tmp) / "index.snapshot"
            self.index.snapshot(path, cursors=self.cursors())
            data = path.read_bytes()
        info = SnapshotInfo(
            format=SNAPSHOT_FORMAT,
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


