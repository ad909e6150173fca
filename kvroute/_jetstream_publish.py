"""The relay's publishing: what its client applied → log records (`kvroute._jetstream`), published in order.

The client hands the relay a `_Tap` (`kvroute._fanout.RawTap`): each batch its ZMQ drivers applied
on their fast path comes as the engine's payload bytes, republished as they are (no decoding, no
re-encoding); a batch applied any other way (a replay, a held batch, another transport) comes as
its events, encoded back into one msgpack payload; lifecycle facts come as envelopes. What the pump
took waits up to `_LINGER` for more, then goes out as one record: one worker's consecutive batches
as a `_Batches` record (a run), several workers' runs as one `_Runs` record; a lifecycle fact goes
out after every pending run. `_Outbox` publishes records without waiting for each ack, in
order, at most `_WINDOW` unacknowledged; the first failure ends the session (`_Restart`), which
starts over from what the log holds.

The publisher also keeps what a follower of the log knows of each worker (its newest batch, whether
the log names it, whether it is partial), seeded from the log at the session's start. With the relay
client's own index, encoded at the end of a turn that took everything the client applied, that is
the relay's snapshot (`_SnapshotRequest`), once the acks of that turn's records name the stream
sequence it covers: no second index reads the log back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Set
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel
import msgspec

from ._events import Envelope, Partial, Removed, Reset, Synced
from ._jetstream import (
    _Batches,
    _Partial,
    _Present,
    _Record,
    _Removed,
    _Reset,
    _Runs,
    encode_record,
    record_header,
    run_msg_id,
    runs_msg_id,
    runs_subject,
    worker_subject,
)
from ._jetstream_nats import NatsLoop
from ._models import EventSource, WorkerKey
from ._snapshot import Cursor, encode_snapshot
from ._wire import BlockStored, EngineEvent

if TYPE_CHECKING:
    from ._index import PrefixIndex

__all__ = ["_Publisher", "_Restart", "_SnapshotRequest", "_Tap", "encode_payload"]

_encode = msgspec.msgpack.Encoder().encode


def encode_payload(ts: float, events: list[EngineEvent]) -> bytes:
    """One batch's payload for the log: ``[ts, events, nil]``, the events as decoded, written as msgspec writes them.

    That is the engines' map form with default fields left out, which `decode_batch` and the core's
    `PrefixIndex.apply_payload` read as the same batch (tests/test_jetstream_client.py checks it), without
    `encode_batch`'s per-event conversion to an engine's exact field set (a third of the relay's encoding time).
    """
    return _encode([ts, events, None])


class _Restart(Exception):
    """The session must start over from what the log holds (publish failure, overflow)."""


#: A record's bytes at most, payloads and the header that lists them: it is then published and the
#: next batch starts another (NATS's default max_payload is 1 MB).
_RUN_BYTES: Final = 256 * 1024
#: Header bytes a run's entry may take beyond its worker id, and each batch's item (seq, ts, length),
#: both upper bounds of msgpack's encoding: counted so that a turn of thousands of workers with
#: long ids (a 4,096-rank cold sync) cannot make a `runs` header alone pass the server's limit,
#: which failed the publish and restarted the session, again and again.
_RUN_ENTRY_BYTES: Final = 32
_ITEM_BYTES: Final = 24
#: Seconds the batches taken may wait for more before they are published, at most: a relay that keeps
#: up takes one batch a turn, and a record each would cost a message, a server write and a delivery to
#: every follower per batch. Bounds what it adds to the apply lag.
_LINGER: Final = 0.005


class _Run:
    """One worker's batches taken and not yet published: a `_Batches` record, or one run of a `_Runs` record."""

    __slots__ = ("items", "payloads", "prev")

    def __init__(self, prev: int | None) -> None:
        self.prev = prev
        self.items: list[tuple[int, float, int]] = []
        self.payloads: list[bytes] = []


class _Publisher:
    """One session's ordered publishing: envelopes → log records (runs of batches, lifecycle facts), in order.

    ``last`` / ``named`` / ``partial`` / ``position``: the log as its followers read it when the
    session starts (`kvroute._jetstream_log.LogRules`' results: each worker's newest batch, the
    workers it names, the partial ones, its last sequence; none and 0 for an empty stream); the
    publisher moves them by the records it publishes, as the rules move a follower's.
    """

    def __init__(
        self,
        nl: NatsLoop,
        stream: str,
        counts: dict[str, int],
        session: str,
        last: dict[WorkerKey, Cursor],
        named: set[WorkerKey],
        partial: Set[WorkerKey] = frozenset(),
        position: int = 0,
        *,
        publish_timeout: float,
        runs_records: bool = True,
    ) -> None:
        self.nl = nl
        #: Several workers' runs of a turn go out as one `_Runs` record (else a `_Batches` each).
        self.runs_records = runs_records
        self.stream = stream
        #: The relay's counters (`RelayStats`), counted into here.
        self.counts = counts
        self.publish_timeout = publish_timeout
        self.session = session
        #: Each worker's newest batch in the log, (seq, ts): the ``prev`` of its next one, and a
        #: snapshot's cursor (none right after a reset).
        self.last: dict[WorkerKey, tuple[int, float]] = {k: (c.seq, c.ts) for k, c in last.items()}
        #: The workers the log names (a `_Present` is published for a synced one it does not).
        self.named = set(named)
        #: The workers the log marks partial.
        self.partial = set(partial & named)
        self.outbox = _Outbox(nl, publish_timeout, position)
        #: Why the session must start over from the log (set from outside the pump, which raises `_Restart`).
        self.stale: str | None = None
        #: A snapshot to take at the pump's next turn (set by the relay; cleared once taken).
        self.snapshot_request: _SnapshotRequest | None = None
        self.out: list[tuple[str, bytes, str]] = []
        self._serial = 0
        self._group: list[Envelope] = []
        self._runs: dict[WorkerKey, _Run] = {}
        #: The pending runs' payload bytes, and when the first of them was taken (`_LINGER`).
        self._run_bytes = 0
        self._runs_since = 0.0
        self._kicked = False
        # The key of the source of the last raw batch: a driver hands over its batches in clumps.
        self._last_source: EventSource | None = None
        self._last_key = WorkerKey("", 0)

    def kick(self) -> None:
        """Records were queued from outside the pump: flush them with the next round."""
        self._kicked = True

    def _lifecycle(self, key: WorkerKey, rec: _Record) -> None:
        self.close_runs()  # the worker's batches before the fact go first
        if not isinstance(rec, _Removed):
            self.named.add(key)  # a follower takes the worker at any record of it but a removal
        self._serial += 1
        msg_id = f"{key.worker_id}/{key.dp_rank}:{rec.__struct_config__.tag}:{self.session}:{self._serial}"
        self.out.append((worker_subject(self.stream, key), encode_record(rec), msg_id))
        self.counts["records"] += 1

    def _take_snapshot(self, req: _SnapshotRequest, tap: _Tap) -> None:
        """Everything the client applied becomes records (posted), then its index is encoded (``req``).

        Runs inside one turn of the pump, without yielding: the client's receive threads are held
        (their hand-overs drained into the tap first), every item is taken, and the index encoded,
        so it holds exactly the batches in the records posted so far (``req.mark``). A worker the
        client holds and the log does not name (its removal is published; the client drops it at
        its next turn) leaves the request for a later turn.
        """
        release = req.hold()
        try:
            items, pop = tap.items, tap.items.popleft
            while items:
                item = pop()
                if type(item) is tuple:
                    self.take_raw(*item)
                else:
                    self.take(item)  # type: ignore[arg-type]
            self._flush_group()
            self.close_runs()
            if self.out:
                out, self.out = self.out, []
                self.outbox.post(out)
            if tap.overflowed:
                req.refused = "the relay fell behind its client"
                self.snapshot_request = None
                return
            if not req.index.workers() <= self.named:
                return  # not at rest yet: the next turn tries again
            # A worker's blocks and its cursor from one instant (nothing applies during this call).
            req.data = encode_snapshot(req.index._core, {k: Cursor(*c) for k, c in self.last.items()})
            req.workers = [(k.worker_id, k.dp_rank) for k in sorted(self.named)]
            req.partial = [(k.worker_id, k.dp_rank) for k in sorted(self.partial)]
            req.mark = self.outbox.posted
            self.outbox.set_mark(req.mark)
        finally:
            release()
        self.snapshot_request = None

    def removed(self, key: WorkerKey, reason: str) -> None:
        """Publish that ``key`` is gone (its state removed from every replica)."""
        self.last.pop(key, None)
        self.named.discard(key)
        self.partial.discard(key)
        self.counts["removals"] += 1
        self._lifecycle(key, _Removed(key.worker_id, key.dp_rank, reason))

    def close_runs(self) -> None:
        """The pending runs become a record: one worker's a `_Batches` on its subject, several a `_Runs`."""
        runs = self._runs
        if not runs:
            return
        self._runs, self._run_bytes = {}, 0
        if len(runs) == 1 or not self.runs_records:
            for key, run in runs.items():
                rec = _Batches(key.worker_id, key.dp_rank, run.prev, run.items)
                data = encode_record(rec, run.payloads)
                self.out.append((worker_subject(self.stream, key), data, run_msg_id(key, run.items)))
            self.counts["records"] += len(runs)
        else:
            many = _Runs([(k.worker_id, k.dp_rank, run.prev, run.items) for k, run in runs.items()])
            data = encode_record(many, [p for run in runs.values() for p in run.payloads])
            self.out.append((runs_subject(self.stream), data, runs_msg_id(record_header(data))))
            self.counts["records"] += 1

    def runs_due(self) -> bool:
        """The pending runs have waited `_LINGER` (or there are none)."""
        return not self._runs or time.monotonic() - self._runs_since >= _LINGER

    def _flush_group(self) -> None:
        group = self._group
        if not group:
            return
        self._group = []
        first = group[0]
        seq = first.seq
        assert seq is not None
        events = [env.event for env in group]
        payload = encode_payload(first.ts, events)  # type: ignore[arg-type]
        blocks = sum(len(ev.block_hashes) for ev in events if type(ev) is BlockStored)
        self._add_batch(first.source.key, seq, first.ts, payload, blocks)

    def _add_batch(self, key: WorkerKey, seq: int, ts: float, payload: bytes, blocks: int) -> None:
        runs = self._runs
        run = runs.get(key)
        if run is None:
            if not runs:
                self._runs_since = time.monotonic()
            prev = self.last.get(key)
            run = runs[key] = _Run(prev[0] if prev is not None else None)
            self.named.add(key)
            self._run_bytes += len(key.worker_id.encode("utf-8")) + _RUN_ENTRY_BYTES
        self.last[key] = (seq, ts)
        run.items.append((seq, ts, len(payload)))
        run.payloads.append(payload)
        self._run_bytes += len(payload) + _ITEM_BYTES
        if self._run_bytes >= _RUN_BYTES:
            self.close_runs()
        counts = self.counts
        counts["batches"] += 1
        counts["blocks"] += blocks

    def take_raw(self, source: EventSource, seq: int, ts: float, payload: bytes, blocks: int) -> None:
        """One batch the client applied from ``payload`` (the engine's own bytes): republished as they are."""
        self._flush_group()
        if source is not self._last_source:
            self._last_source, self._last_key = source, source.key
        self._add_batch(self._last_key, seq, ts, payload, blocks)

    def take(self, env: Envelope) -> None:
        """Turn one envelope into records (a batch is closed by the next envelope of another batch)."""
        ev = env.event
        if env.seq is not None:
            group = self._group
            if group:
                head = group[0]
                # The seq first, then the source by identity (one driver's envelopes share it): no WorkerKey
                # is built per event.
                if head.seq != env.seq or (head.source is not env.source and head.source.key != env.source.key):
                    self._flush_group()
            self._group.append(env)
            return
        self._flush_group()
        key = env.source.key
        if isinstance(ev, Reset):
            self.last.pop(key, None)
            self.partial.discard(key)  # a reset starts a whole history again
            self.counts["resets"] += 1
            self._lifecycle(key, _Reset(key.worker_id, key.dp_rank, ev.reason, ev.detail))
        elif isinstance(ev, Partial):
            self.partial.add(key)
            self.counts["partials"] += 1
            self._lifecycle(key, _Partial(key.worker_id, key.dp_rank, ev.reason, ev.first_seq))
        elif isinstance(ev, Removed):
            self.removed(key, ev.reason)
        elif isinstance(ev, Synced) and key not in self.named:
            self.named.add(key)
            self._lifecycle(key, _Present(key.worker_id, key.dp_rank))

    async def pump(self, tap: _Tap) -> None:
        """Publish what the client applied (from ``tap``) in order; `_Restart` when the log may miss some."""
        nl, counts = self.nl, self.counts
        items = tap.items
        pop = items.popleft
        take, take_raw = self.take, self.take_raw
        outbox = self.outbox
        duplicates_before = counts["duplicates"]
        try:
            while True:
                if not items and tap.overflowed:
                    raise _Restart(f"the relay fell behind its client ({tap.overflowed} batches and facts dropped)")
                if self.stale is not None:
                    raise _Restart(self.stale)
                req = self.snapshot_request
                if req is not None:
                    self._take_snapshot(req, tap)
                if items or self._group or self.out or self._kicked:
                    # Take what is buffered without waiting (a batch ends where the buffer does). Bounded
                    # by count and time: the loop's other tasks run between turns.
                    taken, deadline = 0, time.monotonic() + _SLICE
                    while items and taken < _TURN:
                        item = pop()
                        if type(item) is tuple:
                            take_raw(*item)
                        else:
                            take(item)  # type: ignore[arg-type]
                        taken += 1
                        if not taken & 255 and time.monotonic() >= deadline:
                            break
                elif self._runs:
                    # Nothing more yet: the runs taken wait out their `_LINGER` for company.
                    await tap.wait(self._runs_since + _LINGER - time.monotonic())
                    if items:
                        continue
                else:
                    await tap.wait(0.5)
                    continue
                if not items:
                    # The buffer is empty: the batch being grouped is whole (a client publishes a batch's
                    # events at once). A turn cut short keeps it open: its other events come next turn.
                    self._flush_group()
                if self.runs_due():
                    self.close_runs()
                self._kicked = False
                if outbox.failed is not None:
                    raise _Restart(f"publish failed: {outbox.failed!r}")
                if self.out:
                    out, self.out = self.out, []
                    outbox.post(out)
                # Back-pressure: at most `_WINDOW` records (`_WINDOW_BYTES` bytes) await their acks.
                while (  # noqa: ASYNC110 (counters the NATS loop moves)
                    outbox.unacked > _WINDOW or outbox.unacked_bytes > _WINDOW_BYTES
                ) and outbox.failed is None:
                    await anyio.sleep(0.001)
                await anyio.lowlevel.checkpoint()
                counts["duplicates"] = duplicates_before + outbox.duplicates
        finally:
            # Whatever is still in flight lands (or fails) before the next session reads the log.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.publish_timeout + 1):
                await nl.call(outbox.drain())


class _SnapshotRequest:
    """A snapshot of the relay client's index, taken by the pump (`_Publisher._take_snapshot`).

    ``hold`` holds the client's receive threads and returns what releases them. Once taken:
    ``data`` (the index with each worker's newest batch in the log as its cursor), the workers
    the log names and the partial ones, and ``mark``, the number of the last record posted
    before it (its acks name the stream sequence the snapshot covers); ``refused`` says why it
    was not taken.
    """

    def __init__(self, index: PrefixIndex, hold: Callable[[], Callable[[], None]]) -> None:
        self.index = index
        self.hold = hold
        self.data: bytes | None = None
        self.workers: list[tuple[str, int]] = []
        self.partial: list[tuple[str, int]] = []
        self.mark = -1
        self.refused: str | None = None


class _Tap:
    """The relay client's raw tap (`kvroute._fanout.RawTap`): what it applied, in order, until the pump takes it.

    Raw batches are kept as ``(source, seq, ts, payload, blocks)``, anything else as its `Envelope`.
    Past ``capacity`` waiting items nothing more is taken (``overflowed`` counts what was not): the
    pump publishes what came before, then restarts the session from the log.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: deque[Envelope | tuple[EventSource, int, float, bytes, int]] = deque()
        self.overflowed = 0
        self._wakeup: anyio.Event | None = None

    def raw(self, source: EventSource, seq: int, ts: float, payload: bytes, blocks: int) -> None:
        """A batch the client applied from its engine's payload bytes."""
        self._add((source, seq, ts, payload, blocks))

    def push(self, envelope: Envelope) -> None:
        """An event of a batch applied off the fast path, or a lifecycle fact."""
        self._add(envelope)

    def _add(self, item: Envelope | tuple[EventSource, int, float, bytes, int]) -> None:
        if self.overflowed or len(self.items) >= self.capacity:
            self.overflowed += 1
        else:
            self.items.append(item)
        if self._wakeup is not None:
            self._wakeup.set()

    def wake(self) -> None:
        """Wake a pump waiting for items (a snapshot request)."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def wait(self, timeout: float) -> None:  # noqa: ASYNC109 (a poll bound)
        """Wait until something is taken (at most ``timeout`` seconds)."""
        if self.items or self.overflowed:
            return
        self._wakeup = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._wakeup.wait()
        self._wakeup = None


#: Records published but not yet acknowledged, at most (the relay's publish pipeline depth; a
#: record holds what the pump took in `_LINGER` or one turn, up to `_RUN_BYTES` with its header).
_WINDOW: Final = 4_000
#: Record bytes published but not yet acknowledged, at most.
_WINDOW_BYTES: Final = 8 * 1024 * 1024
#: Envelopes taken from the events buffer in one turn, at most, before what they make is published,
#: and seconds one turn may take.
_TURN: Final = 50_000
_SLICE: Final = 0.02


class _Outbox:
    """The relay's publisher on the NATS loop: records posted without waiting, published in order, acks checked.

    ``failed`` is set by the first record not acknowledged within ``timeout`` (or refused): the
    session must then start over from what the log holds.
    """

    def __init__(self, nl: NatsLoop, timeout: float, position: int) -> None:
        self.nl = nl
        self.timeout = timeout
        #: The stream's last sequence when the session started.
        self.start = position
        # Finished jobs are folded in the order they were posted (jobs are named by their last
        # record's number): ``folded`` is the highest stream sequence of a stored record and the
        # count of stored records (not duplicates) over every record up to ``acked_through``.
        self._lock = threading.Lock()
        self._order: deque[int] = deque()
        self._done: dict[int, tuple[int, int]] = {}
        self.acked_through = 0
        self.folded = (position, 0)
        self._mark = -1
        #: ``folded`` when ``acked_through`` reached the mark (`set_mark`); None until then.
        self.marked: tuple[int, int] | None = None
        self.posted = 0
        self.acked = 0
        self.posted_bytes = 0
        self.acked_bytes = 0
        self.duplicates = 0
        self.failed: BaseException | None = None
        self._tail_sent: asyncio.Event | None = None
        self._acks: set[asyncio.Task[None]] = set()

    @property
    def unacked(self) -> int:
        """Records posted and not yet acknowledged."""
        return self.posted - self.acked

    @property
    def unacked_bytes(self) -> int:
        """Bytes of the records posted and not yet acknowledged."""
        return self.posted_bytes - self.acked_bytes

    def post(self, msgs: list[tuple[str, bytes, str]]) -> None:
        """Queue ``msgs`` for publishing after everything posted before (returns at once; any thread)."""
        self.posted += len(msgs)
        self.posted_bytes += sum(len(data) for _, data, _ in msgs)
        with self._lock:
            self._order.append(self.posted)
        self.nl.post(self._start, msgs, self.posted)

    def set_mark(self, end: int) -> None:
        """Watch for the acks of every record up to number ``end``: then ``marked`` is (the highest stream
        sequence among them, how many were stored). ``end`` is ``posted`` as it is now (the caller's thread)."""
        with self._lock:
            self._mark = end
            self.marked = self.folded if self.acked_through == end else None

    def _finished(self, end: int, seq: int, stored: int) -> None:
        with self._lock:
            self._done[end] = (seq, stored)
            order, done = self._order, self._done
            while order and order[0] in done:
                first = order.popleft()
                job_seq, job_stored = done.pop(first)
                self.folded = (max(self.folded[0], job_seq), self.folded[1] + job_stored)
                self.acked_through = first
                if first == self._mark:
                    self.marked = self.folded

    def _start(self, msgs: list[tuple[str, bytes, str]], end: int) -> None:
        # Chained: a job hands its records to the connection only after the previous job did.
        prev, sent = self._tail_sent, asyncio.Event()
        self._tail_sent = sent
        task = asyncio.get_running_loop().create_task(self._publish(prev, sent, msgs, end))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _publish(
        self, prev: asyncio.Event | None, sent: asyncio.Event, msgs: list[tuple[str, bytes, str]], end: int
    ) -> None:
        js = self.nl.js
        futures = []
        try:
            if prev is not None:
                await prev.wait()
            for subject, data, msg_id in msgs:
                if self.failed is not None:
                    return  # the session restarts: publish nothing after a failure
                # No wait_stall: with one, nats-py runs its semaphore's acquire through asyncio.wait_for,
                # which (Python < 3.12) makes a Task and yields to the loop for every record, so a job of
                # n records took n turns of the loop (behind the client's slices):
                # that was most of the apply lag. The relay's window keeps the semaphore from blocking.
                futures.append(await js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id}))
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
        seq, stored = 0, 0
        for ack in acks:
            if ack.duplicate:
                self.duplicates += 1
            else:
                stored += 1
                seq = max(seq, int(ack.seq))
        self._finished(end, seq, stored)
        self.acked += len(msgs)
        self.acked_bytes += sum(len(data) for _, data, _ in msgs)

    async def drain(self) -> None:
        """Wait for every posted job to be acknowledged or failed."""
        while self._acks:
            await asyncio.gather(*list(self._acks), return_exceptions=True)
