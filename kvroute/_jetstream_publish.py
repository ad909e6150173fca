"""The relay's publishing: what its client applied → log records (`kvroute._jetstream`), published in order.

The client hands the relay a `_Tap` (`kvroute._fanout.RawTap`): each batch its ZMQ drivers applied
on their fast path comes as the engine's payload bytes, republished as they are (no decoding, no
re-encoding); a batch applied any other way (a replay, a held batch, another transport) comes as
its events, encoded back into one msgpack payload; lifecycle facts come as envelopes. Each worker's
consecutive batches taken in one turn go out as one `_Batches` record (a run), and every lifecycle
fact after that worker's pending run. `_Outbox` publishes records without waiting for each ack, in
order, at most `_WINDOW` unacknowledged; the first failure ends the session (`_Restart`), which
starts over from what the log holds.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Final

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
    encode_record,
    run_msg_id,
    worker_subject,
)
from ._jetstream_nats import NatsLoop
from ._models import EventSource, WorkerKey
from ._wire import BlockStored, EngineEvent

__all__ = ["_Publisher", "_Restart", "_Tap", "encode_payload"]

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


#: A run's payload bytes at most: it is then published and the next batch starts another (NATS's
#: default max_payload is 1 MB).
_RUN_BYTES: Final = 256 * 1024


class _Run:
    """One worker's batches taken in one turn, not yet published: one `_Batches` record."""

    __slots__ = ("items", "payloads", "prev", "size")

    def __init__(self, prev: int | None) -> None:
        self.prev = prev
        self.items: list[tuple[int, float, int]] = []
        self.payloads: list[bytes] = []
        self.size = 0


class _Publisher:
    """One session's ordered publishing: envelopes → log records (runs of batches, lifecycle facts), in order."""

    def __init__(
        self,
        nl: NatsLoop,
        stream: str,
        counts: dict[str, int],
        session: str,
        prev: dict[WorkerKey, int],
        named: set[WorkerKey],
        *,
        publish_timeout: float,
    ) -> None:
        self.nl = nl
        self.stream = stream
        #: The relay's counters (`RelayStats`), counted into here.
        self.counts = counts
        self.publish_timeout = publish_timeout
        self.session = session
        self.prev: dict[WorkerKey, int | None] = dict(prev)
        #: The workers the log names (a `_Present` is published for a synced one it does not).
        self.named = set(named)
        self.out: list[tuple[str, bytes, str]] = []
        self._serial = 0
        self._group: list[Envelope] = []
        self._runs: dict[WorkerKey, _Run] = {}
        self._kicked = False
        # The key of the source of the last raw batch: a driver hands over its batches in clumps.
        self._last_source: EventSource | None = None
        self._last_key = WorkerKey("", 0)

    def kick(self) -> None:
        """Records were queued from outside the pump: flush them with the next round."""
        self._kicked = True

    def _lifecycle(self, key: WorkerKey, rec: _Record) -> None:
        self._close_run(key)  # the worker's batches before the fact go first
        self._serial += 1
        msg_id = f"{key.worker_id}/{key.dp_rank}:{rec.__struct_config__.tag}:{self.session}:{self._serial}"
        self.out.append((worker_subject(self.stream, key), encode_record(rec), msg_id))
        self.counts["records"] += 1

    def removed(self, key: WorkerKey, reason: str) -> None:
        """Publish that ``key`` is gone (its state removed from every replica)."""
        self.prev.pop(key, None)
        self.named.discard(key)
        self.counts["removals"] += 1
        self._lifecycle(key, _Removed(key.worker_id, key.dp_rank, reason))

    def _close_run(self, key: WorkerKey) -> None:
        run = self._runs.pop(key, None)
        if run is None:
            return
        rec = _Batches(key.worker_id, key.dp_rank, run.prev, run.items)
        self.out.append(
            (worker_subject(self.stream, key), encode_record(rec, run.payloads), run_msg_id(key, run.items))
        )
        self.counts["records"] += 1

    def close_runs(self) -> None:
        """Every pending run becomes a record (the end of a turn)."""
        for key in list(self._runs):
            self._close_run(key)

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
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(self.prev.get(key))
            self.named.add(key)
        self.prev[key] = seq
        run.items.append((seq, ts, len(payload)))
        run.payloads.append(payload)
        run.size += len(payload)
        if run.size >= _RUN_BYTES:
            self._close_run(key)
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
            self.prev[key] = None
            self.counts["resets"] += 1
            self._lifecycle(key, _Reset(key.worker_id, key.dp_rank, ev.reason, ev.detail))
        elif isinstance(ev, Partial):
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
        outbox = _Outbox(nl, self.publish_timeout)
        duplicates_before = counts["duplicates"]
        try:
            while True:
                if not items and tap.overflowed:
                    raise _Restart(f"the relay fell behind its client ({tap.overflowed} batches and facts dropped)")
                if items or self._group or self._runs or self.out or self._kicked:
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
                else:
                    await tap.wait(0.5)
                    continue
                if not items:
                    # The buffer is empty: the batch being grouped is whole (a client publishes a batch's
                    # events at once). A turn cut short keeps it open: its other events come next turn.
                    self._flush_group()
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

    async def wait(self, timeout: float) -> None:  # noqa: ASYNC109 (a poll bound)
        """Wait until something is taken (at most ``timeout`` seconds)."""
        if self.items or self.overflowed:
            return
        self._wakeup = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._wakeup.wait()
        self._wakeup = None


#: Records published but not yet acknowledged, at most (the relay's publish pipeline depth; a
#: record is one batch when the relay keeps up, a run of up to `_RUN_BYTES` when it does not).
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

    def __init__(self, nl: NatsLoop, timeout: float) -> None:
        self.nl = nl
        self.timeout = timeout
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
                # No wait_stall: with one, nats-py runs its semaphore's acquire through asyncio.wait_for,
                # which (Python < 3.12) makes a Task and yields to the loop for every record, so a job of
                # n records took n turns of the loop (behind the client's and the mirror's slices):
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
        self.duplicates += sum(1 for a in acks if a.duplicate)
        self.acked += len(msgs)
        self.acked_bytes += sum(len(data) for _, data, _ in msgs)

    async def drain(self) -> None:
        """Wait for every posted job to be acknowledged or failed."""
        while self._acks:
            await asyncio.gather(*list(self._acks), return_exceptions=True)
