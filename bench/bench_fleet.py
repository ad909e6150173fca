"""Fleet scale: one `KvEventClient` on one core following N publisher ranks on the other (issue 19).

Run: python bench/bench_fleet.py [--ranks 256] [--rate 100000] [--duration 10] [--then RATE:SECONDS ...]

Setup (exactly the issue's, scaled by the options): ``--procs`` publisher processes
(multiprocessing, pinned to the other core) hold the ranks between them; each rank has a real
ZMQ PUB socket sending ``[topic, seq8, payload]`` with its own seq from 0 and a ROUTER replay
buffer (the newest ``--buffer`` batches) answering docs/protocol.md §4 requests. Payloads are
vLLM map-form batches of one 16-block ``BlockStored`` event (``--evict``: after 16 one-block ``BlockRemoved``
events, a full engine's steady state), precomputed per rank (a cycle of
``--distinct`` of them, so the index stays bounded); only the ts (the send time, 8 bytes) is
written into each copy at send time. The publishers offer ``--rate`` blocks/s between them, with
Python's cyclic GC off (their collections, run together, held their messages ~100 ms: see `_publisher`).

One `KvEventClient` (static sources, the default config) runs in this process, pinned to one
core. After every source is synced from cold (its time is reported; the publishers offer
``--sync-rate`` meanwhile, by default ``--rate``), ``--duration`` seconds are measured:
subscribed ranks, applied ÷ published, apply lag p50/p99 (the batch's ts, its send time,
against the time the index applied it), event-loop lag p99 (a task sleeping 5 ms and measuring
how late it wakes), client CPU (this process, libzmq's I/O thread included) and peak RSS, the
client CPU time per applied batch (the per-message cost, whatever share of its core the
machine left the client; a comment line splits it by thread: the event loop, the native receive
thread, and the rest, libzmq's I/O threads among them), the quiet probes sent to sources (all
healthy here: every probe is kvroute's own slowness) and what bounded the run. The client is
behind when it applied < 95 % of what the publishers sent (or its apply lag p50 is over 1 s);
then the bound is the replays when at least 1 % of the sources waited on one on average (their
SUBs are not read meanwhile), else the client's CPU when it used >= 90 % of its core, else its
share of the core (other processes on a loaded machine: the load average is printed); a client
that kept up says so.
Publishers that sent < 95 % of the offered rate are named beside it either way. A line after
each row counts what the recovery machines did in the phase (gaps, replays, probes, probes
deferred while every replay slot was busy, ...), and one more the replay requests the drivers
made, by purpose (cold, gap, retry, probe, identity) and whether a slot was free for each when
it was made ("at once") or it queued behind busy slots ("queued"); the sync line has the same
count for the cold sync.
``--then 50000:20`` adds a phase at another
rate (each measured the same way, with the apply lag p99 per second), e.g. 4x the ceiling for
20 s then 0.5x to see the client recover.

``--native`` runs the client with ``SubscriberConfig(native_receive=True)``: the compiled core's
receive thread applies in-order batches itself (its lags are taken from the (seq, ts, lag) records
it hands back, `SourceDriver._native_applied`). The thread shares the client's core.
``--receivers python,native`` runs one client after the other against the same publishers (each
syncs from cold; the publishers' seqs go on), so the two rows are a same-run comparison.
``--replay-paths raw,decoded`` does the same for how replay answers are taken: "raw" (kvroute's
path) judges each reply with the core's verdict and applies the answer's run as payload bytes
(`PrefixIndex.apply_payloads`); "decoded" (the path before it, and still the one with a listener)
decodes each reply to an `EventBatch` and applies it event by event. The cold sync is mostly
replay answers: its time is the figure to compare. ``--replay-readers native,python`` does the
same, on the native receiver, for who reads replay replies: "native" (kvroute's path: the
receive thread opens the DEALER, judges each reply with one decode and applies an answer the
recovery machine takes whole itself, `SourceDriver._native_fetch`) or "python" (the path before:
each reply received and judged in Python, the answer applied from the machine's `Apply`).

Each line is one row of docs/performance.md's fleet tables (the README keeps the latest figures).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import multiprocessing as mp
import os
import resource
import struct
import sys
import time
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import zmq

from kvroute import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventSource,
    KvEventClient,
    Limits,
    PrefixIndex,
    SubscriberConfig,
    WorkerKey,
    encode_batch,
)

BLOCKS = 16
_END = b"\xff" * 8
_TS_MARK = 1234567.890625  # a ts whose float64 bytes are found in the encoded payload and patched
# Where a batch puts them: it is an array [ts, events, rank]; its header and the float64 marker come first.
_TS_AT = 2


def _hashes(rank: int, distinct: int, k: int) -> list[int]:
    """The block hashes of rank ``rank``'s payload ``k``."""
    base = (rank * distinct + k) * BLOCKS
    return [(base + i) * 2654435761 % (1 << 63) + 1 for i in range(BLOCKS)]


def _payloads(rank: int, distinct: int, evict: bool = False) -> list[tuple[bytes, bytes]]:
    """``distinct`` vLLM map-form payloads of rank ``rank``, each split around its 8 ts bytes.

    With ``evict``, payload ``k`` first removes the blocks of payload ``k + 1`` (cycled), the ones the rank stored
    longest ago, one ``BlockRemoved`` a block as vLLM's block pool evicts: a full engine's steady state, as many
    removals as stored blocks (the rank then holds ``distinct - 1`` payloads' blocks).
    """
    out = []
    mark = b"\xcb" + struct.pack(">d", _TS_MARK)
    for k in range(distinct):
        events: list[BlockStored | BlockRemoved] = []
        if evict:
            events += [
                BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
                for h in _hashes(rank, distinct, (k + 1) % distinct)
            ]
        base = (rank * distinct + k) * BLOCKS
        events.append(
            BlockStored(
                block_hashes=_hashes(rank, distinct, k),
                parent_block_hash=None,
                token_ids=[(base + i) % 150_000 for i in range(BLOCKS * 16)],
                block_size=16,
                group_idx=0 if evict else None,  # a full engine is a current vLLM (0.34): events name their group
            )
        )
        payload = encode_batch(EventBatch(_TS_MARK, events, rank % 8), form="map")
        at = payload.index(mark) + 1
        assert at == _TS_AT, "the batch's ts moved: _LagIndex.apply_payloads reads it there"
        out.append((payload[:at], payload[at + 8 :]))
    return out


def _publisher(
    ranks: list[int],
    distinct: int,
    evict: bool,
    buffer: int,
    rate: Any,
    stop: Any,
    published: Any,
    slot: int,
    endpoints: Any,
    core: int | None,
) -> None:
    """One publisher process: PUB + ROUTER per rank, sending at its share of ``rate`` until ``stop``."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * len(ranks) + 64)
    pubs, routers, bufs, seqs, templates = [], [], [], [], []
    eps = []
    for r in ranks:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        pubs.append(pub)
        routers.append(router)
        bufs.append(deque(maxlen=buffer))
        seqs.append(0)
        templates.append(_payloads(r, distinct, evict))
        eps.append((r, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"))
    endpoints.put(eps)
    poller = zmq.Poller()
    for router in routers:
        poller.register(router, zmq.POLLIN)
    owner = {router: i for i, router in enumerate(routers)}
    n = len(ranks)
    nprocs = len(published)
    # No cyclic GC here: the loop makes no cycles, and the eight publishers, started together and allocating alike
    # (a tuple a message into each rank's replay buffer), ran their cyclic collections together 2-3 s into a phase,
    # holding their messages, stamped with the send time, for ~100 ms while the client sat idle. Every run's worst
    # second (54-137 ms apply lag p99) was that, the client's own seconds around it 6-20 ms (docs/performance.md,
    # "Session 23").
    gc.disable()
    credit = 0.0
    last = time.time()
    nxt = 0
    sent = 0
    next_poll = 0.0
    while not stop.is_set():
        now = time.time()
        share = rate.value / BLOCKS / nprocs
        credit = min(credit + (now - last) * share, max(1.0, share * 0.05))  # at most 50 ms of backlog
        last = now
        burst = int(credit)
        if burst:
            credit -= burst
            tsb = struct.pack(">d", now)
            for _ in range(burst):
                i = nxt
                nxt = nxt + 1 if nxt + 1 < n else 0
                seq = seqs[i]
                seqs[i] = seq + 1
                head, tail = templates[i][seq % distinct]
                payload = b"".join((head, tsb, tail))
                seq8 = seq.to_bytes(8, "big")
                bufs[i].append((seq8, payload))
                pubs[i].send_multipart((b"", seq8, payload), zmq.NOBLOCK)
            sent += burst
            published[slot] = sent * BLOCKS
        if now >= next_poll:
            next_poll = now + 0.005
            for sock, _ in poller.poll(0):
                i = owner[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                        continue
                    start = int.from_bytes(frames[2], "big")
                    ident = frames[0]
                    for seq8, payload in list(bufs[i]):
                        if int.from_bytes(seq8, "big") >= start:
                            sock.send_multipart((ident, b"", b"", seq8, payload), zmq.NOBLOCK)
                    sock.send_multipart((ident, b"", b"", _END, b""), zmq.NOBLOCK)
        if not burst:
            time.sleep(0.0005)
    for s in pubs + routers:
        s.close(0)
    ctx.term()


class _LagIndex(PrefixIndex):
    """The index, timing each applied batch against its ts (the send time) while ``recording``."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.lags = array("d")
        self.applied_blocks = 0
        # Live batches applied by the Python fast path / by the native receive thread itself.
        self.python_live = 0
        self.thread_live = 0

    def apply_payload(self, worker: WorkerKey, payload: bytes, limits: Limits | None = None) -> Any:
        """Apply raw bytes (the subscriber's in-order fast path), and count the blocks and the lag."""
        report = super().apply_payload(worker, payload, limits)
        if report.ok:
            self.applied_blocks += BLOCKS
            self.python_live += 1
            if self.recording:
                self.lags.append(time.time() - report.ts)
        return report

    def apply_payloads(self, worker: WorkerKey, payloads: Sequence[bytes], limits: Limits | None = None) -> int:
        """Apply judged payloads (a replay answer's run), and count the blocks and the lags (ts read in place)."""
        stored = super().apply_payloads(worker, payloads, limits)
        self.applied_blocks += BLOCKS * len(payloads)
        if self.recording:
            now = time.time()
            self.lags.extend(now - struct.unpack_from(">d", p, _TS_AT)[0] for p in payloads)
        return stored

    def apply_batch(self, worker: WorkerKey, batch: EventBatch) -> None:
        """Apply a decoded batch (held live batches; replays with --replay-path decoded), count blocks and lag."""
        super().apply_batch(worker, batch)
        self.applied_blocks += BLOCKS
        if self.recording:
            self.lags.append(time.time() - batch.ts)


# What the recovery machines did in a phase (every one of them is a cost the fast path avoids).
_RECOVERY_COUNTERS = (
    "gaps",
    "replays",
    "probes",
    "probes_deferred",
    "identity_checks",
    "replay_failures",
    "overflows",
    "duplicates",
    "stale",
    "restarts",
    "resets",
    "replay_cutoffs",
)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _thread_cpu() -> dict[str, float]:
    """This process's CPU seconds so far by thread group: the event loop (the main thread), the
    native receive thread, and every other thread (libzmq's I/O threads, the interpreter's)."""
    tick = os.sysconf("SC_CLK_TCK")
    pid = os.getpid()
    out = dict.fromkeys(("event loop", "receive thread", "other threads"), 0.0)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # a thread that ended meanwhile
        # comm is in parentheses and may hold spaces; utime and stime are fields 14 and 15.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        group = "event loop" if int(tid) == pid else "receive thread" if comm == "kvroute-recv" else "other threads"
        out[group] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _pct(values: list[float] | array[float], q: float, *, ordered: bool = False) -> float:
    """The ``q`` quantile of ``values`` (NaN for none); ``ordered``: they are sorted already."""
    if not len(values):
        return math.nan
    s = values if ordered else sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _count_replays(client: KvEventClient, counts: Counter[tuple[str, str]]) -> Any:
    """Count the replay requests the client's ZMQ drivers are asked into ``counts`` by (purpose, "at once" | "queued").

    Call it as the client starts, before its sources' tasks first run. Each request is counted
    when its source's machine asks it (a `RequestReplay` action, by its ``purpose``): "at once"
    when the source held a slot for it (a quiet probe reserves one) or one was free then,
    "queued" when every slot was taken or waited for. Returns the function that undoes it.
    """
    driver: Any = next(iter(client._subs.values())).driver
    driver_type: Any = type(driver)  # the ZMQ driver class (`SourceDriver`)
    on_action = driver_type.on_action

    def asked(driver: Any, action: Any) -> None:
        purpose = getattr(action, "purpose", None)  # only a RequestReplay has one
        if purpose is not None:
            requester = driver._replays
            how = "at once" if requester.holding or requester.slot_free() else "queued"
            counts[purpose, how] += 1
        on_action(driver, action)

    driver_type.on_action = asked

    def undo() -> None:
        driver_type.on_action = on_action

    return undo


def _replay_line(counts: Counter[tuple[str, str]], before: Counter[tuple[str, str]]) -> str:
    """The replay requests counted since ``before``, by purpose: "gap 12 (10 at once, 2 queued), ..."."""
    diff = counts - before
    order = ("cold", "gap", "retry", "probe", "identity", "?")
    purposes = sorted({p for p, _ in diff}, key=order.index)
    if not purposes:
        return "none"
    return ", ".join(
        f"{p} {diff[p, 'at once'] + diff[p, 'queued']:,} ({diff[p, 'at once']:,} at once, {diff[p, 'queued']:,} queued)"
        for p in purposes
    )


def _live_line(python: int, thread: int) -> str:
    """Where the phase's live in-order batches were applied: on the receive thread (native) or by Python."""
    if not thread:
        return ""
    share = thread / (python + thread)
    return f"; live batches applied by Python {python:,}, by the receive thread {thread:,} ({share:.1%})"


def _ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"


async def _run(args: argparse.Namespace, sources: list[EventSource], rate: Any, published: Any) -> None:
    index = _LagIndex()
    loop_lags: list[float] = []
    ticking = [False]
    peak_rss = [0]
    peak_held = [0]
    # Sources with a replay asked and not answered yet (queued for a slot or running), one
    # count per sample: their SUBs are parked meanwhile (native), so a long queue is lag.
    waiting: list[int] = []
    subs: dict[Any, Any] = {}

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.005)
            if ticking[0]:
                loop_lags.append(time.perf_counter() - t - 0.005)

    async def rss_sampler() -> None:
        while True:
            peak_rss[0] = max(peak_rss[0], _rss())
            # Live batches the recovery machines hold behind replays (decoded: ~7x their payload).
            drivers = [s.driver for s in list(subs.values())]
            peak_held[0] = max(peak_held[0], sum(d.machine.held for d in drivers))
            if ticking[0]:
                waiting.append(sum(d.machine.replay_in_flight is not None for d in drivers))
            await anyio.sleep(0.25)

    config = SubscriberConfig(native_receive=args.native, receive_nice=args.receive_nice)
    if args.replays is not None:
        config = msgspec.structs.replace(config, max_concurrent_replays=args.replays)

    def flush(client: KvEventClient) -> None:
        """Feed the sources' machines every record a receive thread has not handed them yet (its hold drains it)."""
        for t in client._transports:
            if t.hold():
                t.release()

    def count_native(client: KvEventClient) -> Any:
        """Count what the native thread applied (and its lags): it bypasses the index's Python methods.

        Returns the function that undoes it (the next client of the same run counts afresh).
        """
        driver_type: Any = type(next(iter(client._subs.values())).driver)  # the ZMQ driver class
        native_applied = driver_type._native_applied

        def counted(
            driver: Any,
            seqs: list[int],
            tss: list[float],
            lags: list[float],
            elided: int,
            blocks: int,
            skipped: dict[str, int] | None,
            payloads: Any = None,
        ) -> None:
            # The thread applied these to the index itself: count them and their lags here.
            index.applied_blocks += BLOCKS * (len(seqs) + elided)
            index.thread_live += len(seqs) + elided
            if index.recording:
                index.lags.extend(lags)
            native_applied(driver, seqs, tss, lags, elided, blocks, skipped, payloads)

        # (Builds of sessions 22-23 had a lane for a source's one batch of a drain; this one has not, but
        # bench_fleet.py runs against such a build for a same-run pair.)
        native_applied_one = getattr(driver_type, "_native_applied_one", None)

        def counted_one(driver: Any, seq: int, ts: float, lag: float, blocks: int) -> None:
            # The same for a source's one batch of a drain, in such a build.
            index.applied_blocks += BLOCKS
            index.thread_live += 1
            if index.recording:
                index.lags.append(lag)
            assert native_applied_one is not None
            native_applied_one(driver, seq, ts, lag, blocks)

        native_replay_done = driver_type._native_replay_done

        def replay_counted(driver: Any, rid: int, applied: Any, *rest: Any) -> None:
            # A replay answer the thread applied whole: counted here too (its lags from the ts).
            if applied is not None:
                index.applied_blocks += BLOCKS * applied[4]
                if index.recording:
                    now = time.time()
                    index.lags.extend(now - ts for ts in applied[3])
            native_replay_done(driver, rid, applied, *rest)

        driver_type._native_applied = counted
        if native_applied_one is not None:
            driver_type._native_applied_one = counted_one
        driver_type._native_replay_done = replay_counted

        def undo() -> None:
            driver_type._native_applied = native_applied
            if native_applied_one is not None:
                driver_type._native_applied_one = native_applied_one
            driver_type._native_replay_done = native_replay_done

        return undo

    replay_counts: Counter[tuple[str, str]] = Counter()
    undo_replays = None
    try:
        async with KvEventClient(sources, index=index, config=config) as client, anyio.create_task_group() as tg:
            # Before the first await: no source's task has run yet, so the cold requests are counted.
            undo_replays = _count_replays(client, replay_counts)
            if args.replay_path == "decoded":
                _decoded_replies(client)
            if args.replay_reader == "python":
                for sub in client._subs.values():
                    sub.driver._native_replays = False  # the path before: replies read in Python
            subs = client._subs
            if args.native:
                tg.start_soon(_undo_at_exit, count_native(client))
            tg.start_soon(ticker)
            tg.start_soon(rss_sampler)
            t_start = time.perf_counter()
            cpu_start = time.process_time()
            try:
                await client.wait_synced(args.sync_timeout)
                sync = f"{time.perf_counter() - t_start:.1f} s"
            except Exception as exc:
                sync = f"not synced after {args.sync_timeout:g} s ({type(exc).__name__})"
            # The client's CPU time for the sync (its thread's included): on a loaded machine the
            # wall time is mostly other processes' share of the core.
            sync_cpu = time.process_time() - cpu_start
            st = client.stats()
            print(
                f"# sync from cold: {sync} (client CPU {sync_cpu:.1f} s); "
                f"subscribed {st.totals.sources}/{len(sources)}, synced {st.totals.synced}, "
                f"refused {st.refused_sources}; fds {len(os.listdir('/proc/self/fd'))}; "
                f"peak RSS {peak_rss[0] / 1e9:.2f} GB, peak held batches {peak_held[0]:,}",
                flush=True,
            )
            print(
                f"#   replay requests during the sync: {_replay_line(replay_counts, Counter())}; "
                f"quiet probes {st.totals.probes:,}, deferred while every slot was busy {st.totals.probes_deferred:,}",
                flush=True,
            )
            phases = [(args.rate, args.duration)] + [(float(r), float(d)) for r, d in (p.split(":") for p in args.then)]
            for phase, (offered, seconds) in enumerate(phases):
                rate.value = offered
                peak_rss[0] = _rss()
                peak_held[0] = 0
                st0 = client.stats().totals
                replays0 = Counter(replay_counts)
                pub0 = sum(published)
                app0 = index.applied_blocks
                live0 = (index.python_live, index.thread_live)
                cpu0 = time.process_time()
                threads0 = _thread_cpu()
                # The receive thread's records reach Python up to 500 ms after their apply (src/recv,
                # `NOTE_MAX`): drained at the window's edges, what it applied inside is what is counted.
                flush(client)
                index.lags = array("d")
                loop_lags.clear()
                waiting.clear()
                index.recording = ticking[0] = True
                t0 = time.perf_counter()
                # Where each second's lags begin; their percentiles are worked out after the phase:
                # sorting a second's lags (62k of them at 1M blocks/s) on the event loop took ~20 ms of
                # the client's core each second, its receive thread's share among it.
                marks = [0]
                while (elapsed := time.perf_counter() - t0) < seconds:
                    await anyio.sleep(min(1.0, seconds - elapsed))
                    marks.append(len(index.lags))
                flush(client)
                wall = time.perf_counter() - t0
                cpu = (time.process_time() - cpu0) / wall
                threads = _thread_cpu()
                index.recording = ticking[0] = False
                per_second = [_ms(_pct(index.lags[a:b], 0.99)) for a, b in itertools.pairwise(marks)]
                pub = sum(published) - pub0
                applied_in_window = index.applied_blocks - app0
                st1 = client.stats()
                probes = st1.totals.probes - st0.probes
                asked = replay_counts - replays0
                queued = sum(n for (_, how), n in asked.items() if how == "queued")
                subscribed = st1.totals.sources
                offered_real = pub / wall
                # The client is behind when it applied < 95 % of what was sent (or is working off a
                # backlog), whatever the publishers managed. Then what held it: sources waiting on
                # replays (their SUBs unread meanwhile), its CPU, or, when it used neither, its share
                # of the core (other processes on a loaded machine), which this process cannot see.
                # Sorted once: the client runs on meanwhile, and its next phase's first second would
                # wait behind each sort of a phase's lags (~0.15 s each at 1M blocks/s).
                lags = sorted(index.lags)
                behind = applied_in_window < 0.95 * pub or _pct(lags, 0.5, ordered=True) > 1.0
                mean_waiting = sum(waiting) / max(1, len(waiting))
                if not behind:
                    bound = "nothing (kept up)"
                elif mean_waiting >= 0.01 * len(sources):
                    bound = f"replays (mean {mean_waiting:,.0f} sources waiting on one, CPU {cpu * 100:.0f} %)"
                elif cpu >= 0.9:
                    bound = f"client CPU ({cpu * 100:.0f} % of its core)"
                else:
                    bound = f"client's share of its core ({cpu * 100:.0f} % CPU, load average {os.getloadavg()[0]:.1f})"
                if offered_real < 0.95 * offered:
                    bound += f"; publishers sent {offered_real / offered:.2f} of the offered rate"
                print(
                    f"| {len(sources):,} ({subscribed:,}) | {offered / 1000:,.0f}k (sent {offered_real / 1000:,.0f}k) "
                    f"| {applied_in_window / wall / 1000:,.0f}k, ÷ sent {applied_in_window / max(1, pub):.2f} "
                    f"| {_ms(_pct(lags, 0.5, ordered=True))} / {_ms(_pct(lags, 0.99, ordered=True))} "
                    f"| {_ms(_pct(loop_lags, 0.99))} "
                    f"| {cpu * 100:.0f} % / {peak_rss[0] / 1e9:.2f} GB "
                    f"| {cpu * wall / max(1, applied_in_window // BLOCKS) * 1e6:.0f} µs | {probes} "
                    f"| {asked.total():,} ({queued:,} queued) | {bound} |",
                    flush=True,
                )
                if len(phases) > 1:
                    print(f"#   phase {phase}: apply lag p99 per second: {', '.join(per_second)}", flush=True)
                t1 = st1.totals
                print(
                    "#   recovery in this phase: "
                    + ", ".join(f"{name} {getattr(t1, name) - getattr(st0, name):,}" for name in _RECOVERY_COUNTERS)
                    + f"; peak held batches {peak_held[0]:,}"
                    + _live_line(index.python_live - live0[0], index.thread_live - live0[1]),
                    flush=True,
                )
                print(f"#   replay requests in this phase: {_replay_line(replay_counts, replays0)}", flush=True)
                batches = max(1, applied_in_window // BLOCKS)
                print(
                    "#   client CPU per applied batch by thread: "
                    + ", ".join(f"{g} {(threads[g] - threads0[g]) / batches * 1e6:.1f} µs" for g in threads)
                    + " (libzmq's I/O threads are among the others)",
                    flush=True,
                )
            tg.cancel_scope.cancel()
    finally:
        if undo_replays is not None:
            undo_replays()


def _decoded_replies(client: KvEventClient) -> None:
    """Replay answers the way kvroute took them before the raw path: each reply decoded to an `EventBatch`.

    The same-run baseline of ``--replay-paths raw,decoded``: each ZMQ driver's replay requester
    judges a reply by the driver's decode instead (the path it still takes for a client with a
    listener), so the machine holds batch objects and applies them event by event. Call it as
    the client starts, before its sources' tasks first run; it dies with the client.
    """
    for sub in client._subs.values():
        driver: Any = sub.driver

        def decoded(payload: bytes, decode: Any = driver._decode) -> tuple[float, Any]:
            batch = decode(payload)
            return (batch.ts if batch is not None else math.nan), batch

        driver._replays._judge = decoded


async def _undo_at_exit(undo: Any) -> None:
    """Call ``undo`` when cancelled (the end of the run)."""
    try:
        await anyio.sleep_forever()
    finally:
        undo()


def main() -> None:
    """Parse the options, start the publishers, run the client, print the table rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--rate", type=float, default=100_000, help="offered blocks/s (all ranks together)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds after sync")
    ap.add_argument("--then", nargs="*", default=[], metavar="RATE:SECONDS", help="further phases")
    ap.add_argument("--procs", type=int, default=8, help="publisher processes")
    ap.add_argument("--distinct", type=int, default=8, help="distinct payloads per rank (cycled)")
    ap.add_argument(
        "--evict",
        action="store_true",
        help="each batch first removes the 16 blocks its rank stored longest ago (a full engine's steady state: one"
        " BlockRemoved a block, as many removals as stores)",
    )
    ap.add_argument("--buffer", type=int, default=256, help="replay buffer per rank (batches)")
    ap.add_argument("--sync-rate", type=float, default=None, help="offered blocks/s until synced (default --rate)")
    ap.add_argument("--sync-timeout", type=float, default=60.0)
    ap.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    ap.add_argument("--header", action="store_true", help="print the table header first")
    ap.add_argument("--native", action="store_true", help="SubscriberConfig(native_receive=True)")
    ap.add_argument(
        "--receive-nice", type=int, default=SubscriberConfig().receive_nice, help="SubscriberConfig.receive_nice"
    )
    ap.add_argument(
        "--replays", type=int, default=None, help="SubscriberConfig.max_concurrent_replays (default: the config's)"
    )
    ap.add_argument(
        "--receivers",
        default=None,
        help="e.g. python,native: one client after the other against the same publishers (same-run ratios)",
    )
    ap.add_argument(
        "--replay-paths",
        default="raw",
        help="raw (replay answers judged and applied as bytes), decoded (each reply decoded to an EventBatch, "
        "the path before), or both, e.g. raw,decoded: one client after the other (same-run ratios)",
    )
    ap.add_argument(
        "--replay-readers",
        default="native",
        help="with the native receiver, who reads replay replies: native (its thread: judged, and applied "
        "whole when the machine's terms allow), python (the path before: every reply read and judged in "
        "Python), or both, e.g. native,python: one client after the other (same-run ratios)",
    )
    args = ap.parse_args()
    receivers = (args.receivers or ("native" if args.native else "python")).split(",")
    if not set(receivers) <= {"python", "native"}:
        ap.error(f"--receivers takes python and native, not {args.receivers!r}")
    readers = args.replay_readers.split(",")
    if not set(readers) <= {"python", "native"}:
        ap.error(f"--replay-readers takes python and native, not {args.replay_readers!r}")
    paths = args.replay_paths.split(",")
    if not set(paths) <= {"raw", "decoded"}:
        ap.error(f"--replay-paths takes raw and decoded, not {args.replay_paths!r}")

    cores = sorted(os.sched_getaffinity(0))
    client_core, pub_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if args.header:
        print(
            "| ranks (subscribed) | offered blocks/s | applied blocks/s | apply lag p50 / p99 | event-loop lag p99 "
            "| client CPU / RSS | client CPU per batch | quiet probes | replay requests (queued) | bound |\n"
            "|---|---|---|---|---|---|---|---|---|---|"
        )
    mpctx = mp.get_context("fork")
    rate = mpctx.Value("d", args.rate if args.sync_rate is None else args.sync_rate, lock=False)
    stop = mpctx.Event()
    published = mpctx.Array("q", args.procs, lock=False)
    endpoints = mpctx.Queue()
    procs = []
    for p in range(args.procs):
        mine = list(range(p, args.ranks, args.procs))
        proc = mpctx.Process(
            target=_publisher,
            args=(mine, args.distinct, args.evict, args.buffer, rate, stop, published, p, endpoints, pub_core),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    eps: list[tuple[int, str, str]] = []
    for _ in procs:
        eps.extend(endpoints.get(timeout=120))
    eps.sort()
    sources = [
        EventSource(worker_id=f"engine-{r // 8}", dp_rank=r % 8, endpoint=ep, replay_endpoint=rep, hwm=100_000)
        for r, ep, rep in eps
    ]
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        for receiver in receivers:
            # Who reads replay replies matters only on the native receiver with the raw path.
            runs = [(p, r) for p in paths for r in (readers if receiver == "native" and p == "raw" else ["python"])]
            for path, reader in runs:
                args.native = receiver == "native"
                args.replay_path = path
                args.replay_reader = reader
                rate.value = args.rate if args.sync_rate is None else args.sync_rate
                print(
                    f"# {args.ranks} ranks, {args.procs} publisher processes, fd limit {soft}/{hard}, "
                    f"load average {os.getloadavg()[0]:.1f}, Python {sys.version.split()[0]}, receiver {receiver}, "
                    f"replay answers {path}, replay replies read by {reader}",
                    flush=True,
                )
                anyio.run(_run, args, sources, rate, published, backend=args.backend)
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


if __name__ == "__main__":
    main()
