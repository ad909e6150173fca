"""Reading a relay's log (docs/replicas.md): the replica rules, once, for every follower of a stream.

Two followers read the log: `kvroute._jetstream_replica.JetStreamReplica` (a standalone index, and
the relay's reading of the log when a session starts) and the JetStream transport of `KvEventClient`
(`kvroute._transports.jetstream`, whose per-worker drivers are the client's sources). Both apply
records with `LogRules`, which holds the rules (chain, duplicates, stream gaps, lifecycle records)
and changes the index; what a worker's state means to each follower is its `LogWorker`. Both read
the stream with `LogReader`: the latest snapshot, then an ordered consumer (`_Follower`) from the
sequence after it, applied in slices.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypedDict

import anyio
import anyio.lowlevel
import msgspec

from ._errors import ConfigError, SnapshotError
from ._index import PrefixIndex
from ._jetstream import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_KEY,
    JetStreamError,
    SnapshotInfo,
    _Batches,
    _Partial,
    _Present,
    _Removed,
    _Reset,
    _Runs,
    check_stream_name,
    decode_record,
    fetch_object,
    log,
    meta_bucket,
    nats_module,
    subject_prefix,
)
from ._jetstream_nats import NatsLoop, Signal
from ._models import WorkerKey
from ._snapshot import Cursor
from ._wire import Limits

__all__ = ["LogOptions", "LogReader", "LogRules", "LogSource", "LogWorker", "read_snapshot_object"]

#: Seconds of applying records before the apply loop yields to the event loop's other tasks.
_SLICE = 0.02


class LogOptions(TypedDict, total=False):
    """`LogSource`'s keyword options (what `JetStreamReplica` passes on)."""

    stream: str
    use_snapshot: bool
    connect_timeout: float
    name: str
    limits: Limits | None


class LogSource:
    """Where a follower reads a relay's log, and how: one set of options for every follower.

    ``servers`` / ``stream``: where the log is (docs/replicas.md); ``use_snapshot``: start from
    the newest snapshot (else read the whole log); ``connect_timeout``: of each connect;
    ``name``: the NATS connection's; ``limits``: the caps payloads are decoded under (give the
    relay client's ``config.limits`` when it raised them). Raises `ConfigError`.
    `JetStreamReplica` takes these options; the JetStream transport's `JetStreamSource` is one.
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
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers:
            raise ConfigError("a JetStream follower needs at least one NATS server URL")
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0, not {connect_timeout!r}")
        self.stream = stream
        self.use_snapshot = use_snapshot
        self.connect_timeout = connect_timeout
        self.name = name
        self.limits = limits or Limits()

    @property
    def endpoint(self) -> str:
        """``nats://host:port/<stream>``: the endpoint of the sources this log names (a client's name for it)."""
        return f"{self.servers[0].rstrip('/')}/{self.stream}"


class LogWorker(Protocol):
    """One worker as a follower keeps it; `LogRules` changes the index, then tells the worker what it did.

    ``last``: the worker's newest batch in the log (seq, ts) — the chain a batch's ``prev`` must
    continue, and the floor below which a batch is a duplicate; None right after a reset. `LogRules`
    sets it.
    """

    last: Cursor | None

    def applied(self, batches: list[tuple[int, float, int]], payloads: list[bytes], blocks: int) -> None:
        """Consecutive batches, each ``(seq, ts, payload length)``, were applied (``blocks`` stored by all)."""
        ...

    def reset(self, reason: str, detail: str) -> None:
        """The relay reset the worker: the index holds none of it; its history is whole again."""
        ...

    def lost(self, reason: str, detail: str, first_seq: int) -> None:
        """Part of the worker's history is gone: the index holds none of it, and it is partial."""
        ...

    def mark_partial(self, reason: str, first_seq: int) -> None:
        """The relay marked the worker partial (its engine's history before ``first_seq`` is unknown)."""
        ...

    def duplicate(self) -> None:
        """A batch at or below ``last`` was skipped."""
        ...


class LogRules:
    """The replica rules (docs/replicas.md "Chain"): log records → index changes and `LogWorker` calls.

    ``worker(key)`` gives the follower's worker for ``key`` (creating it; None: the follower does
    not take it, and its records are skipped, counted); ``workers()`` every current one;
    ``remove(key, reason)`` drops one (a ``removed`` record; the follower removes it from the index).
    ``counts`` are `ReplicaStats`'s counters.
    """

    def __init__(
        self,
        index: PrefixIndex,
        limits: Limits,
        name: str,
        *,
        worker: Callable[[WorkerKey], LogWorker | None],
        workers: Callable[[], list[tuple[WorkerKey, LogWorker]]],
        remove: Callable[[WorkerKey, str], None],
    ) -> None:
        self.index = index
        self.limits = limits
        self.name = name
        self._worker = worker
        self._workers = workers
        self._remove = remove
        #: The last stream sequence applied.
        self.position = 0
        self.counts = {
            "batches": 0,
            "duplicates": 0,
            "gaps": 0,
            "stream_gaps": 0,
            "undecodable": 0,
            "resets": 0,
            "refused": 0,
        }
        #: Called after each applied record: its stream sequence, worker and engine seq (None for a
        #: lifecycle record); for measuring apply lag (bench/bench_jetstream.py).
        self.on_applied: Callable[[int, WorkerKey, int | None], None] | None = None

    def apply_record(self, sseq: int, data: bytes) -> None:
        """Apply one log record at stream sequence ``sseq``."""
        if sseq <= self.position:
            return  # redelivered by a consumer reset
        if sseq != self.position + 1 and self.position >= 0:
            self.counts["stream_gaps"] += 1
            detail = f"stream records {self.position + 1}..{sseq - 1} are gone"
            log.warning("%s: %s: every worker reset", self.name, detail)
            for lost, w in self._workers():
                self.index.remove_worker(lost)
                w.last = None
                w.lost("stream-gap", detail, 0)
        self.position = sseq
        try:
            rec, body = decode_record(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Its worker cannot be known; that worker's next batch breaks the chain (prev), which resets it.
            self.counts["undecodable"] += 1
            log.warning("%s: undecodable record at %d skipped", self.name, sseq)
            return
        if isinstance(rec, _Runs):
            for worker_id, dp_rank, prev, items in rec.runs:
                body = self._apply_run(sseq, WorkerKey(worker_id, dp_rank), prev, items, data, body)
            return
        key = WorkerKey(rec.worker_id, rec.dp_rank)
        if isinstance(rec, _Batches):
            self._apply_run(sseq, key, rec.prev, rec.items, data, body)
            return
        if isinstance(rec, _Removed):
            self._remove(key, rec.reason)
        else:
            worker = self._worker(key)
            if worker is None:
                self.counts["refused"] += 1
                return
            if isinstance(rec, _Reset):
                self.index.remove_worker(key)
                self.counts["resets"] += 1
                worker.last = None
                worker.reset(rec.reason, rec.detail)
            elif isinstance(rec, _Partial):
                worker.mark_partial(rec.reason, rec.first_seq)
            else:
                assert isinstance(rec, _Present)  # the follower took the worker: that is all
        if self.on_applied is not None:
            self.on_applied(sseq, key, None)

    def _apply_run(
        self, sseq: int, key: WorkerKey, prev: int | None, items: list[tuple[int, float, int]], data: bytes, at: int
    ) -> int:
        """Apply a run of ``key``'s batches from ``data`` at ``at`` (the core decodes them); where the run ends.

        The chain and duplicate rules are checked per batch; the batches that pass them between two
        breaks (a run that continues its worker's chain: all of them) go to the core in one
        `apply_payloads` call and to the worker in one `LogWorker.applied` (per batch, both cost more
        than the rules: 16 % of a follower's CPU in session 10's profile).
        """
        w = self._worker(key)
        if w is None:
            self.counts["refused"] += 1
            return at + sum(length for _, _, length in items)
        counts = self.counts
        last = w.last
        last_seq = last.seq if last is not None else None
        batches: list[tuple[int, float, int]] = []
        payloads: list[bytes] = []
        for item in items:
            seq, _, length = item
            end = at + length
            item_prev, prev = prev, seq
            if last_seq is not None and seq <= last_seq:
                at = end
                counts["duplicates"] += 1
                w.duplicate()
                continue
            if item_prev != last_seq:
                # An uncovered gap: what the log lost may have removed blocks; claim none of the old ones.
                self._apply_batches(sseq, key, w, batches, payloads)
                batches, payloads = [], []
                counts["gaps"] += 1
                self.index.remove_worker(key)
                w.lost("gap", f"the log lost batches between seq {item_prev} and {seq}", seq)
            batches.append(item)
            payloads.append(data[at:end])
            at, last_seq = end, seq
        self._apply_batches(sseq, key, w, batches, payloads)
        return at

    def _apply_batches(
        self, sseq: int, key: WorkerKey, w: LogWorker, batches: list[tuple[int, float, int]], payloads: list[bytes]
    ) -> None:
        """Apply consecutive batches of ``key`` that continue its chain: one core call, one worker update."""
        if not batches:
            return
        lim = self.limits
        try:
            stored = self.index._core.apply_payloads(
                key, payloads, lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size
            )
        except RuntimeError:
            # A payload the core refused (rare); those before it were applied. Batch by batch from the
            # first: applying those again is harmless, as the refused one then empties the worker.
            self._apply_each(sseq, key, w, batches, payloads)
            return
        seq, ts, _ = batches[-1]
        w.last = Cursor(seq, ts)
        self.counts["batches"] += len(batches)
        w.applied(batches, payloads, stored)
        on_applied = self.on_applied
        if on_applied is not None:
            for seq, _, _ in batches:
                on_applied(sseq, key, seq)

    def _apply_each(
        self, sseq: int, key: WorkerKey, w: LogWorker, batches: list[tuple[int, float, int]], payloads: list[bytes]
    ) -> None:
        """`_apply_batches` a batch at a time: a payload the core refuses resets the worker, the chain goes on."""
        apply, lim, counts = self.index._core.apply_payload, self.limits, self.counts
        caps = (lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size)
        for batch, payload in zip(batches, payloads):
            seq, ts, _ = batch
            w.last = Cursor(seq, ts)
            _, error_kind, error, stored, _ = apply(key, payload, *caps)
            if error_kind:
                # Nothing of it was applied: blocks it removed may still be held, so none are trusted.
                # The chain goes on from it (what follows is applied to the emptied worker).
                counts["undecodable"] += 1
                self.index.remove_worker(key)
                w.lost("undecodable", f"seq {seq}: {error_kind}: {error}", seq + 1)
                continue
            counts["batches"] += 1
            w.applied([batch], [payload], stored)
            if self.on_applied is not None:
                self.on_applied(sseq, key, seq)


# --- reading the stream ------------------------------------------------------------------------------


def ack_sequences(reply: str) -> tuple[int, int] | None:
    """A JetStream delivery's (stream, consumer) sequences, from its ack subject; None when it is not one.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending>`` (9 tokens), or with
    ``<domain>.<account hash>`` after ``$JS.ACK`` and a trailing token (11 or 12): what nats-py's
    ``Msg.metadata`` reads, without its dataclasses and datetime (35 µs a record, a tenth of that here).
    """
    tokens = reply.split(".")
    n = len(tokens)
    at = 5 if n == 9 else 7 if n >= 11 else 0
    if not at or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    try:
        return int(tokens[at]), int(tokens[at + 1])
    except ValueError:
        return None


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
            got = ack_sequences(reply)
            if got is None:
                return  # not a delivery of this consumer (nats-py's `metadata` would refuse it too)
            sseq, cseq = got
            if cseq != self.cseq + 1:
                await self._create()  # a delivery was lost: start over after the last one taken
                return
            self.cseq = cseq
            self.sseq = sseq
            self.queue.append((sseq, msg.data))
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


async def read_snapshot_object(nl: NatsLoop, stream: str) -> tuple[bytes, SnapshotInfo] | None:
    """The newest snapshot of ``stream`` and what it covers; None when there is none or it is unusable.

    Raises `JetStreamError` when it cannot be read (the server is away); an object of another
    format, or whose description does not decode, is logged and None (the log is read whole then).
    """

    async def fetch() -> tuple[bytes, str] | None:
        nats = nats_module()
        meta = await meta_bucket(nl.js, stream, create=False)
        if meta is None:
            return None
        try:
            name = (await meta.get(SNAPSHOT_KEY)).value.decode()
        except nats.js.errors.KeyNotFoundError:
            return None
        return await fetch_object(nl.js, stream, name)

    try:
        # Bounded: an object deleted while it is read (three snapshots later) would never complete.
        got = await nl.call(asyncio.wait_for(fetch(), 60.0))
    except Exception as exc:
        raise JetStreamError(f"cannot read the snapshot of {stream}: {exc!r}") from exc
    if got is None:
        return None
    data, description = got
    try:
        info = msgspec.json.decode(description, type=SnapshotInfo)
        if info.format != SNAPSHOT_FORMAT:
            raise SnapshotError(f"snapshot format {info.format}; this kvroute reads {SNAPSHOT_FORMAT}")
    except (msgspec.DecodeError, msgspec.ValidationError, SnapshotError) as exc:
        log.warning("%s: snapshot unusable, reading the log from its start: %s", stream, exc)
        return None
    return data, info


class LogReader:
    """Follows one stream for a follower: the latest snapshot, then the log from the sequence after it.

    `follow` waits for the stream (a follower may start before any relay created it), hands the
    snapshot to ``restore`` (which returns the stream sequence it covers, or None when it could
    not use it), subscribes from the next sequence, and applies records with ``rules`` a slice
    at a time, calling ``progress`` after each slice. ``target``: the stream's last sequence when
    it subscribed (None before).
    """

    def __init__(self, stream: str, name: str, rules: LogRules, *, use_snapshot: bool) -> None:
        self.stream = stream
        self.name = name
        self.rules = rules
        self.use_snapshot = use_snapshot
        self.target: int | None = None
        self.queue: deque[tuple[int, bytes]] = deque()
        self._ready = Signal(threaded=True)  # replaced by the connection's kind in `follow`

    @property
    def synced(self) -> bool:
        """True once everything the log held at subscription is applied."""
        return self.target is not None and self.rules.position >= self.target

    async def follow(
        self,
        nl: NatsLoop,
        restore: Callable[[bytes, SnapshotInfo], Awaitable[int | None]],
        progress: Callable[[], None],
    ) -> None:
        """Read the stream until cancelled (see the class docs)."""
        nats = nats_module()
        while True:
            # The start's phases, logged once synced (a cold follower's time to ready, where it goes).
            phases: list[tuple[str, float]] = []
            t = start = time.monotonic()
            try:
                if self.use_snapshot:
                    got = await read_snapshot_object(nl, self.stream)
                    t, was = time.monotonic(), t
                    phases.append((f"snapshot read ({len(got[0]):,} bytes)" if got else "no snapshot", t - was))
                    if got is not None:
                        covered = await restore(*got)
                        t, was = time.monotonic(), t
                        phases.append(("restored", t - was))
                        if covered is not None:
                            self.rules.position = covered
                await self._subscribe(nl)
                t, was = time.monotonic(), t
                phases.append(("subscribed", t - was))
                break
            except JetStreamError as exc:
                if not isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                    log.warning("%s: %s; retrying", self.name, exc)
                await anyio.sleep(0.25)
        progress()
        queue = self.queue
        pop = queue.popleft
        apply_record = self.rules.apply_record
        from_seq = self.rules.position
        while True:
            await self._wait_records()
            # A slice at a time: the loop's other tasks (a relay's lease renewal, a router) run in between.
            deadline = time.monotonic() + _SLICE
            while queue and time.monotonic() < deadline:
                apply_record(*pop())
            progress()
            if phases and self.synced:
                now = time.monotonic()
                phases.append((f"records {from_seq + 1}..{self.target} applied", now - t))
                log.info(
                    "%s: synced in %.2f s: %s",
                    self.name,
                    now - start,
                    ", ".join(f"{what} {took:.2f} s" for what, took in phases),
                )
                phases = []
            await anyio.lowlevel.checkpoint()

    async def _subscribe(self, nl: NatsLoop) -> None:
        self._ready = nl.signal()
        follower = _Follower(nl, self.stream, self.queue, self._ready)
        try:
            self.target = await nl.call(follower.open(self.rules.position + 1))
        except Exception as exc:
            raise JetStreamError(f"cannot subscribe to stream {self.stream}: {exc!r}") from exc

    async def _wait_records(self) -> None:
        queue, ready = self.queue, self._ready
        while not queue:
            ready.clear()
            if queue:
                return
            await ready.wait(0.5)
