"""`JetStreamReplica`: a router's index rebuilt from a relay's JetStream log, never talking to the engines.

The log's format is `kvroute._jetstream`'s; the rules a follower applies it by, and the reading of the
stream, are `kvroute._jetstream_log`'s (shared with the JetStream transport of `KvEventClient`,
`kvroute._transports.jetstream`, the way a router follows a log). This class is the standalone form:
an index and a router's `WorkerStates` without a client, which the relay reads the log with when a
session starts (the index and positions its client resumes from).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from ._errors import SnapshotError
from ._index import PrefixIndex
from ._jetstream import SNAPSHOT_FORMAT, SnapshotInfo, log
from ._jetstream_log import LogOptions, LogReader, LogRules, LogSource, LogWorker
from ._jetstream_nats import NatsLoop
from ._models import WorkerKey, WorkerStatus
from ._snapshot import Cursor, check_header, encode_snapshot, refuse_unreadable

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["JetStreamReplica", "ReplicaStats"]


class _WorkerState:
    """A worker as the standalone replica keeps it (`LogWorker`): its chain position and partial flag.

    ``partials``: the replica's set of partial workers, which ``partial`` keeps ``key`` in or out
    of (`JetStreamReplica.unvouched_workers` reads it without a pass over every worker).
    """

    __slots__ = ("_key", "_partial", "_partials", "last")

    def __init__(
        self, key: WorkerKey, partials: set[WorkerKey], last: Cursor | None = None, partial: bool = False
    ) -> None:
        self._key = key
        self._partials = partials
        self.last = last
        self._partial = False
        self.partial = partial

    @property
    def partial(self) -> bool:
        """The worker's history before some point is unknown."""
        return self._partial

    @partial.setter
    def partial(self, value: bool) -> None:
        self._partial = value
        if value:
            self._partials.add(self._key)
        else:
            self._partials.discard(self._key)

    def applied(self, batches: list[tuple[int, float, int]], payloads: list[bytes], blocks: int) -> None:
        """Nothing to keep beyond ``last`` (set by the rules)."""

    def reset(self, reason: str, detail: str) -> None:
        """A reset starts a whole history again."""
        self.partial = False

    def lost(self, reason: str, detail: str, first_seq: int) -> None:
        """Part of the history is gone."""
        self.partial = True

    def mark_partial(self, reason: str, first_seq: int) -> None:
        """The relay says the history is partial."""
        self.partial = True

    def duplicate(self) -> None:
        """Counted by the rules (`ReplicaStats.duplicates`)."""


class ReplicaStats(msgspec.Struct, frozen=True, kw_only=True):
    """A `JetStreamReplica`'s counters (the JetStream transport's `JetStreamSource.stats` too).

    ``position``: the last stream sequence applied; ``snapshot_seq``: the sequence the snapshot
    it started from covered (0: none); ``batches``: batches applied; ``duplicates``: batches at
    or below their worker's last seq, skipped; ``gaps``: chain breaks (a worker reset, partial);
    ``stream_gaps``: jumps in the stream's sequence (every worker reset, partial);
    ``undecodable``: records or batches that failed to decode (the worker reset, partial);
    ``refused``: records of workers the follower did not take (a client's ``max_sources``).
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
    refused: int = 0


class JetStreamReplica:
    """A router replica: an index rebuilt from a relay's JetStream log, never talking to the engines.

    ``async with JetStreamReplica("nats://host:4222") as replica:`` loads the latest snapshot of
    ``stream`` (when there is one), reads the log from the sequence after the one it covers, then
    follows it live. ``await replica.wait_synced(t)`` returns once it has applied everything the
    log held when it subscribed. It is a router's `WorkerStates` (``Router(replica.index,
    replica)``): every worker named by the log is live; a worker's ``partial`` flag is the relay's
    (or set by a gap in the log). The NATS connection reconnects by itself; its consumer is
    recreated from the next sequence after a skipped delivery or a silent server.
    A replica started before any relay created the stream waits for it. ``limits``: the caps
    payloads are decoded under (give the relay client's ``config.limits`` when it raised them).
    The same follower inside a `KvEventClient` (its sources, stats and events):
    ``KvEventClient(jetstream="nats://host:4222/<stream>")``.
    """

    def __init__(self, servers: str | Sequence[str] = "nats://127.0.0.1:4222", **options: Unpack[LogOptions]) -> None:
        #: Where the log is and how it is read (`LogSource`: ``stream``, ``use_snapshot``,
        #: ``connect_timeout``, ``name``, ``limits``; the JetStream transport's options too).
        self.source = LogSource(servers, **options)
        self.stream = self.source.stream
        self._name = name = self.source.name
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self._partials: set[WorkerKey] = set()  # the partial ones among them (`_WorkerState.partial`)
        self._live: frozenset[WorkerKey] = frozenset()  # their keys (`live_set`), republished on a change
        self._rules = LogRules(
            PrefixIndex(),
            self.source.limits,
            f"replica {name}",
            worker=self._worker,
            workers=lambda: list(self._workers.items()),
            remove=self._remove,
        )
        self._reader = LogReader(self.stream, f"replica {name}", self._rules, use_snapshot=self.source.use_snapshot)
        self._snapshot_seq = 0
        self._nats: NatsLoop | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed: anyio.Event | None = None

    @property
    def index(self) -> PrefixIndex:
        """The index the replica keeps (replaced by the snapshot it starts from)."""
        return self._rules.index

    @property
    def position(self) -> int:
        """The last stream sequence applied."""
        return self._rules.position

    @property
    def on_applied(self) -> Callable[[int, WorkerKey, int | None], None] | None:
        """Called after each applied record: its stream sequence, worker and engine seq (None for a
        lifecycle record); for measuring apply lag (bench/bench_jetstream.py)."""
        return self._rules.on_applied

    @on_applied.setter
    def on_applied(self, fn: Callable[[int, WorkerKey, int | None], None] | None) -> None:
        self._rules.on_applied = fn

    def _worker(self, key: WorkerKey) -> LogWorker:
        st = self._workers.get(key)
        if st is None:
            st = self._workers[key] = _WorkerState(key, self._partials)
            self._live = frozenset(self._workers)
        return st

    def _remove(self, key: WorkerKey, reason: str) -> None:
        self._rules.index.remove_worker(key)
        self._workers.pop(key, None)
        self._partials.discard(key)
        self._live = frozenset(self._workers)

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
        nl = NatsLoop(self.source.servers, self._name)
        await nl.start(self.source.connect_timeout)
        self._nats = nl
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._reader.follow, nl, self._restore, self._wake)

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

    async def _restore(self, data: bytes, info: SnapshotInfo) -> int | None:
        """Start from a snapshot: its index, workers and positions; the stream sequence it covers."""
        try:
            index, cursors = await anyio.to_thread.run_sync(_restore, data)
        except SnapshotError as exc:
            # Cold from the whole log instead: it is exact when the log still holds everything.
            log.warning("replica %s: snapshot unusable, reading the log from its start: %s", self._name, exc)
            return None
        partial = {WorkerKey(*k) for k in info.partial}
        self._rules.index = index
        partials: set[WorkerKey] = set()
        self._partials = partials
        self._workers = {
            WorkerKey(*k): _WorkerState(WorkerKey(*k), partials, cursors.get(WorkerKey(*k)), WorkerKey(*k) in partial)
            for k in info.workers
        }
        self._live = frozenset(self._workers)
        self._snapshot_seq = info.stream_seq
        return info.stream_seq

    def apply_record(self, sseq: int, data: bytes) -> None:
        """Apply one log record at stream sequence ``sseq`` (exposed for tests; `kvroute._jetstream_log`)."""
        self._rules.apply_record(sseq, data)

    # --- state ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def synced(self) -> bool:
        """True once everything the log held at subscription is applied."""
        return self._reader.synced

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
            while self.position < seq or self._reader.target is None:
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

    def live_set(self) -> frozenset[WorkerKey]:
        """`live_workers` as one immutable set, kept as the log names and removes workers."""
        return self._live

    def unvouched_workers(self, trust_partial: bool) -> frozenset[WorkerKey]:
        """The workers whose `worker_status` a router does not trust: every one until the replica
        has caught up with the log, then the partial ones (none with ``trust_partial``)."""
        if not self.synced:
            return self._live
        return frozenset() if trust_partial else frozenset(self._partials)

    def cursors(self) -> dict[WorkerKey, Cursor]:
        """Each worker's last applied engine batch (seq, ts); none right after a reset."""
        return {k: st.last for k, st in self._workers.items() if st.last is not None}

    def partial_workers(self) -> set[WorkerKey]:
        """The workers whose history before some point is unknown."""
        return set(self._partials)

    def stats(self) -> ReplicaStats:
        """A snapshot of the replica's counters."""
        return ReplicaStats(
            position=self.position,
            snapshot_seq=self._snapshot_seq,
            synced=self.synced,
            workers=len(self._workers),
            **self._rules.counts,
        )

    def snapshot_bytes(self) -> tuple[bytes, SnapshotInfo]:
        """The index in kvroute's snapshot format, with the stream sequence it covers (taken at one instant)."""
        data = encode_snapshot(self.index._core, self.cursors())
        info = SnapshotInfo(
            format=SNAPSHOT_FORMAT,
            stream_seq=self.position,
            workers=[(k.worker_id, k.dp_rank) for k in self._workers],
            partial=[(k.worker_id, k.dp_rank) for k in self.partial_workers()],
        )
        return data, info


def _restore(data: bytes) -> tuple[PrefixIndex, dict[WorkerKey, Cursor]]:
    """A new index from a snapshot's bytes (read by the core, no file), and its workers' positions."""
    index = PrefixIndex()
    return index, restore_into(index, data, None)


def restore_into(index: PrefixIndex, data: bytes, keys: Collection[WorkerKey] | None) -> dict[WorkerKey, Cursor]:
    """Import the snapshot's workers among ``keys`` (None: all of them) into ``index``.

    Each is replaced whole; one whose tables are inconsistent is dropped with a warning, as
    `PrefixIndex.restore` drops it. Returns the imported workers' positions. Raises `SnapshotError`.
    """
    where = "a JetStream snapshot"
    try:
        # The core reads the bytes (GIL released) and replaces each kept worker whole.
        only = set(keys) if keys is not None else None
        saved, dropped = index._core.restore(data, WorkerKey, functools.partial(check_header, where), only)
    except ValueError as exc:
        refuse_unreadable(where, data, str(exc))
    for key, problem in dropped:
        log.warning("snapshot: worker %s/%d dropped: %s", *key, problem)
    refused = {key for key, _ in dropped}
    return {WorkerKey(w, r): Cursor(seq, ts) for w, r, seq, ts in saved if WorkerKey(w, r) not in refused}
