"""Router replicas on NATS JetStream: relay throughput to three replicas, apply lag, replica cold start.

Run: python bench/bench_jetstream.py [--quick] [--backend asyncio|trio]   (needs ``nats-server`` on PATH)

One run, every figure with its baseline beside it (the machine is shared and noisy):

- baseline: decode + apply_batch, and apply_payload (what a replica does), of the same payloads in a
  loop (what one core can index), and the ceiling that puts on 2 cores for 4 copies of the index
  (the relay's client, three replicas);
- throughput: a separate publisher process sends pre-encoded payloads over ZMQ as fast as it can
  (bench_e2e's engines); one `JetStreamRelay` follows them and publishes to a real ``nats-server -js``
  (file storage); three replica processes apply the log (``--follower``: `KvEventClient` on the
  JetStream transport, the default, or `JetStreamReplica`). Figure: blocks per second from
  the first send to the last replica holding the last batch;
- apply lag: the same at a paced rate; lag = replica apply time - publisher send time, per batch,
  p50 / p90 / p99 over the three replicas, beside the part up to the relay's own client (timed in
  the relay's raw tap: engines -> client, no NATS). Followers are timed by the log's ``on_applied``
  hook (`JetStreamSource.on_applied` for a client), so nothing decodes a batch only for the bench;
  ``--listen`` times a client follower by an ``events()`` listener instead (as session 12 did: each
  follower then decodes every batch for it);
- cold start: a fresh replica process from the relay's snapshot (the whole index, >= 1M entries
  in a full run) plus the log after it, until synced;
- CPU: each part's process time in the throughput round, counted from where the process stood when
  the rounds began (not its start) and read before the bench fetches the round's send and apply times
  (their unpickling runs in the relay's process: counted there before session 14, a quarter of its
  samples), each replica's beside the CPU of `apply_payload` alone (one copy of the index), and a
  catch-up: a new follower reading the whole log with nothing else running.
"""

from __future__ import annotations

import argparse
import array
import cProfile
import faulthandler
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import nats.js  # noqa: F401 (kvroute imports nats-py lazily: a follower's timed start must not include it)
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import index_only, make_payloads

from kvroute import (
    BlockStored,
    Envelope,
    EventSource,
    EventStream,
    JetStreamRelay,
    JetStreamReplica,
    KvEventClient,
    PrefixIndex,
    SubscriberConfig,
    WorkerKey,
    decode_batch,
)
from kvroute._transports.jetstream import JetStreamSource  # the client's log source: its on_applied hook

STREAM = "BENCH"
GC_LOG = "KVROUTE_BENCH_GC_LOG"  # set by --gc-log; the spawned processes inherit it


class _GcPauses:
    """This process's generation-2 collections (``--gc-log``): when each began and how long it held the GIL."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self._began = 0.0
        if os.environ.get(GC_LOG):
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._began = time.perf_counter()
            else:
                self.pauses.append((self._began, time.perf_counter() - self._began))

    def report(self, who: str, since: float) -> None:
        """Print the collections since ``since`` (a ``perf_counter`` time: the round's start)."""
        if os.environ.get(GC_LOG):
            ps = [(t - since, d) for t, d in self.pauses if t >= since]
            longest = max((d for _, d in ps), default=0.0)
            print(
                f"#   gc {who}: {len(ps)} generation-2 collections in the round, longest {longest * 1e3:.0f} ms"
                f" ({gc.get_count()}, {len(gc.get_objects())} tracked objects): "
                + ", ".join(f"{d * 1e3:.0f} ms at {t:.1f} s" for t, d in ps),
                flush=True,
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _publisher(payloads: list[list[bytes]], conn: multiprocessing.connection.Connection, slack: float = 0.0) -> None:
    """Engines: one PUB per source; each round sends ``payloads[s][lo:hi]`` at ``rate`` batches/s (0: flat out).

    ``slack``: a paced batch due less than this many seconds from now goes at once (one sleep per
    ``slack`` instead of one per batch: at 12,500 batches/s a sleep per batch cost the publisher
    13-18 % of a core in wake-ups, on the two cores the pipeline is measured on). Each batch's send
    time is taken when it is sent, so the lag is measured from it either way.
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = []
    for _ in payloads:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        socks.append(sock)
    # With the CPU used so far (imports, the payloads): the first round counts only its own sending.
    conn.send(([s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in socks], time.process_time()))  # type: ignore[union-attr]
    pauses = _GcPauses()
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        lo, hi, rate = cmd
        c_round = time.process_time()
        # Send times per source, by seq - lo: floats in arrays, so the bench's own records are no objects the
        # collector walks (a list of tuples grew by 128k in a 10-s round, and each generation-2 pass walked it).
        sent = [array.array("d") for _ in payloads]
        t0 = time.perf_counter()
        n = 0
        for i in range(lo, hi):
            seq8 = i.to_bytes(8, "big")
            for s, (sock, ps) in enumerate(zip(socks, payloads)):
                if rate:
                    # Slept, not spun: a spinning publisher would take a core from what is measured.
                    wait = t0 + n / rate - time.perf_counter()
                    if wait > slack:
                        time.sleep(wait)
                sent[s].append(time.time())
                sock.send_multipart([b"", seq8, ps[i]])
                n += 1
        # The round's CPU at once, the send times when asked: unpickling tens of thousands of tuples in the
        # relay's process while the pipeline still drains would be counted as the relay's and hold its GIL.
        conn.send(time.process_time() - c_round)
        pauses.report("engines", t0)
        if conn.recv() == "sent":
            conn.send((lo, sent))
    for sock in socks:
        sock.close()
    ctx.term()


def _replica_process(
    url: str,
    conn: multiprocessing.connection.Connection,
    backend: str,
    kind: str,
    listen: bool = False,
    profile: str | None = None,
    profile_sync: bool = False,
) -> None:
    """A replica in its own process: reports apply times per (worker, seq) until told to stop.

    ``kind``: "client" is a `KvEventClient` on the JetStream transport, "replica" a `JetStreamReplica`;
    apply times come from the log's ``on_applied`` hook, or with ``listen`` (a client only) from an
    ``events()`` listener attached for rounds that measure lag (listening costs a decode per batch).
    ``profile``: cProfile (CPU time) the first round into that file, or with ``profile_sync`` the
    reading up to synced.
    """

    # Each follower's start, phase by phase (snapshot read, restore, subscribe, records), once synced.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kvroute.jetstream").setLevel(logging.INFO)

    async def main() -> None:
        # Per worker, seq -> apply time: dicts of numbers, untracked by the collector (tuple keys were 128k
        # objects each generation-2 pass walked, 30-45 ms each).
        applied: dict[WorkerKey, dict[int, float]] = {}
        profile_to = [profile] if profile is not None else []

        # The round's last seq per worker: the hook sees each worker reach it (no polling), and when the last did.
        want: dict[WorkerKey, int] = {}
        done_at: list[float] = []
        reached = anyio.Event()
        wall = time.time

        def on_applied(_sseq: int, key: WorkerKey, seq: int | None) -> None:
            # Per batch in the measured process: as little as it can be (keys turned into numbers after the round).
            if seq is not None:
                times = applied.get(key)
                if times is None:
                    times = applied[key] = {}
                t = times[seq] = wall()
                last = want.get(key)
                if last is not None and seq >= last:
                    del want[key]
                    if not want:
                        done_at.append(t)
                        reached.set()

        async def record_applies(stream: EventStream) -> None:
            async for env in stream:
                if env.seq is not None:
                    applied.setdefault(env.source.key, {}).setdefault(env.seq, time.time())

        pauses = _GcPauses()
        t0, c0 = time.perf_counter(), time.process_time()
        sync_profiler = cProfile.Profile(time.process_time) if profile is not None and profile_sync else None
        if sync_profiler is not None:
            profile_to.clear()
            sync_profiler.enable()
        follower: KvEventClient | JetStreamReplica
        if kind == "client":
            source = JetStreamSource.from_url(f"{url}/{STREAM}")
            if not listen:  # the hook, unless an events() listener times it
                source.on_applied = on_applied
            follower = KvEventClient(jetstream=source)
        else:
            follower = JetStreamReplica(url, stream=STREAM)
            follower.on_applied = on_applied
        async with follower as replica, anyio.create_task_group() as tg:
            await replica.wait_synced(120)
            ready = time.perf_counter() - t0
            if sync_profiler is not None:
                sync_profiler.disable()
                sync_profiler.dump_stats(profile)
            snapshot_seq = replica.stats().snapshot_seq if isinstance(replica, JetStreamReplica) else -1
            # With the CPU used so far (imports, connecting, the snapshot): rounds count only their own work.
            now = time.process_time()
            conn.send(("synced", ready, replica.index.stats().entries, snapshot_seq, now - c0, now))
            while True:
                got = await anyio.to_thread.run_sync(conn.recv)
                if got is None:
                    tg.cancel_scope.cancel()
                    return
                round_want, lag = got
                c_round, t_round = time.process_time(), time.perf_counter()
                hooked = not listen or kind != "client"
                reached = anyio.Event()
                done_at.clear()
                want.clear()
                want.update({WorkerKey(f"w{s}", 0): last for s, last in round_want.items()})
                profiler = cProfile.Profile(time.process_time) if profile_to else None
                if profiler is not None:
                    profiler.enable()
                stream = replica.events(buffer=1_000_000) if lag and listen and kind == "client" else None
                if stream is not None:
                    tg.start_soon(record_applies, stream)
                # Wait until every worker holds its last seq, then report this round's apply times.
                # With the hook: woken by it, and a rare poll of the cursors besides (a last seq applied before
                # this round's `want` arrived). A listener's round polls every 20 ms, as before.
                with anyio.fail_after(600):
                    while True:
                        cur = replica.cursors()
                        if all(
                            cur.get(WorkerKey(f"w{s}", 0)) and cur[WorkerKey(f"w{s}", 0)].seq >= last
                            for s, last in round_want.items()
                        ):
                            break
                        with anyio.move_on_after(0.1 if hooked else 0.02):
                            await reached.wait()
                done = done_at[0] if done_at else time.time()
                while stream is not None and stream.pending:  # noqa: ASYNC110 (the listener's last apply times)
                    await anyio.sleep(0.005)
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(profile_to.pop())
                if stream is not None:
                    await stream.aclose()
                # The CPU first; the apply times (tens of thousands) only once the bench has read every process's CPU.
                conn.send((done, time.process_time() - c_round))
                pauses.report(f"replica {os.getpid()}", t_round)
                if await anyio.to_thread.run_sync(conn.recv) == "applied":
                    conn.send(
                        {(int(k.worker_id[1:]), seq): t for k, times in applied.items() for seq, t in times.items()}
                    )
                applied = {}

    anyio.run(main, backend=backend)


def _spawn_replica(
    url: str, backend: str, kind: str, listen: bool, profile: str | None = None, profile_sync: bool = False
) -> tuple[mp.process.BaseProcess, multiprocessing.connection.Connection]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_replica_process, args=(url, child, backend, kind, listen, profile, profile_sync)
    )
    proc.start()
    return proc, parent


def _py_spy(out: str | None, pid: int) -> subprocess.Popen[bytes] | None:
    """py-spy sampling ``pid`` (native frames too) into ``out`` as folded stacks, until stopped; None without ``out``.

    A sampler rather than cProfile: cProfile's per-call cost inflates Python's share several times over.
    """
    if out is None:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen(
        [exe, "record", "--native", "-r", "200", "-f", "raw", "-o", out, "-p", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop(spy: subprocess.Popen[bytes] | None) -> None:
    """Stop a py-spy sampler (it writes its file on SIGINT)."""
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


def _apply_payload_only(payloads: list[list[bytes]]) -> tuple[float, float]:
    """Seconds, and CPU seconds, to apply every payload with `PrefixIndex.apply_payload` (round-robin over sources).

    The CPU seconds are what one copy of the index costs (a replica's floor): a loaded machine
    inflates the wall time, far less the process time.
    """
    index = PrefixIndex()
    keys = [WorkerKey(f"w{i}", 0) for i in range(len(payloads))]
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(max(map(len, payloads))):
        for key, ps in zip(keys, payloads):
            if i < len(ps):
                index.apply_payload(key, ps[i])
    return time.perf_counter() - t0, time.process_time() - c0


def _stored_blocks(payloads: list[list[bytes]]) -> int:
    """Blocks the payloads store (every source, every batch)."""
    return sum(
        len(event.block_hashes)
        for ps in payloads
        for payload in ps
        for event in decode_batch(payload).events
        if isinstance(event, BlockStored)
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")  # none timed (a relay that lost its lease under load: its new client has no tap)
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> None:
    nats = shutil.which("nats-server")
    if nats is None:
        raise SystemExit("nats-server is not installed (apt-get install nats-server)")
    n_sources = 4
    n_batches = 2_000 if args.quick else 6_500  # per source, ~40 blocks each: >= 1M index entries
    paced = args.lag_batches or (200 if args.quick else 500)  # per source
    if args.engine_blocks:
        # One stream per engine across both rounds: the engines are full (evicting) from the first paced second.
        both, _ = make_payloads((n_batches + paced) * n_sources, n_sources, seed=1, capacity=args.engine_blocks)
        payloads = [ps[:n_batches] for ps in both]
        paced_payloads = [ps[n_batches:] for ps in both]
        blocks, paced_blocks = _stored_blocks(payloads), _stored_blocks(paced_payloads)
    else:
        payloads, blocks = make_payloads(n_batches * n_sources, n_sources, seed=1)
        paced_payloads, paced_blocks = make_payloads(paced * n_sources, n_sources, seed=2)
    all_payloads = [a + b for a, b in zip(payloads, paced_payloads)]
    base = index_only(payloads)
    raw, raw_cpu = _apply_payload_only(payloads)
    print(
        f"baseline: decode + apply of {blocks:,} blocks in one loop: {blocks / base:,.0f} blocks/s;"
        f" apply_payload (what each replica does per batch): {blocks / raw:,.0f} blocks/s. Every block is"
        f" applied 4 times (the relay's client, 3 replicas): on 2 cores at most"
        f" {2 * blocks / raw / 4:,.0f} blocks/s before any I/O; apply_payload CPU per 100k blocks"
        f" {raw_cpu * 1e5 / blocks:.3f} s (one copy of the index: on 2 cores 4 copies allow at most"
        f" {2 * blocks / raw_cpu / 4:,.0f} blocks/s)"
    )

    store = Path(tempfile.mkdtemp(prefix="kvroute-bench-js-"))
    port = _free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything runs)
        [nats, "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    parent, child = mp.Pipe()
    pub = mp.get_context("spawn").Process(target=_publisher, args=(all_payloads, child, args.pace_slack))
    pub.start()
    replicas: list[tuple[mp.process.BaseProcess, multiprocessing.connection.Connection]] = []
    try:
        await anyio.sleep(0.5)
        endpoints, _ = parent.recv()
        sources = [EventSource(worker_id=f"w{i}", endpoint=ep, hwm=0) for i, ep in enumerate(endpoints)]
        # As the relay's own default (`RELAY_CONFIG`): its receive thread at the event loop's priority.
        config = SubscriberConfig(quiet_interval=3600.0, native_receive=not args.python_receive, receive_nice=0)
        # The default lease (3 s): renewed from its own thread, a loaded machine does not make it lapse.
        async with JetStreamRelay(url, sources, stream=STREAM, config=config, snapshot_interval=3600.0) as relay:
            await relay.wait_active(20)
            replicas = [
                _spawn_replica(
                    url,
                    args.backend,
                    args.follower,
                    args.listen,
                    f"{args.profile}.replica" if args.profile and i == 0 else None,
                )
                for i in range(3)
            ]
            # CPU seconds each part used in a round (process times: robust on a loaded machine, unlike wall time),
            # counted from the round's start (not a process's start: imports, connecting, subscribing).
            cpu_at: dict[str, float] = {}
            for _, conn in replicas:
                await anyio.to_thread.run_sync(conn.recv)  # synced on the empty log
            client = relay.client
            assert client is not None
            with anyio.fail_after(30):
                while client.stats().totals.connected < n_sources:  # noqa: ASYNC110 (a bench may poll)
                    await anyio.sleep(0.01)
            await anyio.sleep(0.3)  # subscriptions travel after the handshake

            # When the relay's own client applied each batch: the engines -> client part of the lag, without
            # NATS, in the same run. Timed inside the relay's raw tap (an events() listener would take the
            # client off the fast path the relay uses).
            # Per worker id, seq -> time: dicts of numbers, which the collector does not track.
            at_relay: dict[str, dict[int, float]] = {}

            def relay_applied(worker_id: str, seq: int) -> None:
                times = at_relay.get(worker_id)
                if times is None:
                    times = at_relay[worker_id] = {}
                times.setdefault(seq, time.time())

            relay_tap = client.raw_tap
            assert relay_tap is not None

            class TimedTap:
                def raw(self, source: EventSource, seq: int, ts: float, payload: bytes, blocks: int) -> None:
                    relay_applied(source.worker_id, seq)
                    relay_tap.raw(source, seq, ts, payload, blocks)

                def push(self, env: Envelope) -> None:
                    if env.seq is not None:
                        relay_applied(env.source.worker_id, env.seq)
                    relay_tap.push(env)

            def cpu_round(part: str, now: float) -> float:
                before, cpu_at[part] = cpu_at.get(part, 0.0), now
                return now - before

            def nats_cpu() -> float:
                fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

            def relay_cpu() -> float:
                ru = resource.getrusage(resource.RUSAGE_SELF)
                return ru.ru_utime + ru.ru_stime

            cpu_round("relay", relay_cpu())
            cpu_round("nats", nats_cpu())
            cpu: dict[str, float] = {}
            pauses = _GcPauses()

            async def round_(lo: int, hi: int, rate: float) -> tuple[float, list[float], list[float], list[str]]:
                # Each process's CPU in this round only (the publisher and the replicas count their own from the
                # round's command: a snapshot, the catch-up or the last round's result transfer between rounds is
                # not this round's).
                cpu_round("relay", relay_cpu())
                cpu_round("nats", nats_cpu())
                want = {s: hi - 1 for s in range(n_sources)}
                for _, conn in replicas:
                    conn.send((want, rate > 0))  # apply times (a listener) for the paced round
                at_relay.clear()
                t0, t_round = time.time(), time.perf_counter()
                parent.send((lo, hi, rate))
                cpu["engines"] = await anyio.to_thread.run_sync(parent.recv)
                done = t0
                for _, conn in replicas:
                    end, cpu[f"replica {id(conn)}"] = await anyio.to_thread.run_sync(conn.recv)
                    done = max(done, end)
                # Every process's CPU is read before the bench fetches the send and apply times: their unpickling
                # (and the garbage collections it brings) ran in the relay's process, counted as the relay's CPU
                # (a quarter of its samples in session 14's py-spy) and holding its GIL while the pipeline drained.
                cpu["relay"] = cpu_round("relay", relay_cpu())
                cpu["nats-server"] = cpu_round("nats", nats_cpu())
                pauses.report("relay", t_round)
                parent.send("sent")
                first, sent = await anyio.to_thread.run_sync(parent.recv)
                sent_at = {(s, first + i): t for s, times in enumerate(sent) for i, t in enumerate(times)}
                lags = []
                # (second of the round it was sent in, lag): the tail second by second, for --per-second
                by_second: dict[int, list[float]] = {}
                for _, conn in replicas:
                    conn.send("applied")
                    applied = await anyio.to_thread.run_sync(conn.recv)
                    for k in applied:
                        if k in sent_at:
                            lag = applied[k] - sent_at[k]
                            lags.append(lag)
                            by_second.setdefault(int(sent_at[k] - t0), []).append(lag)
                relay_lags = []
                relay_by_second: dict[int, list[float]] = {}
                for (s, i), t in sent_at.items():
                    if i in at_relay.get(f"w{s}", {}):
                        lag = at_relay[f"w{s}"][i] - t
                        relay_lags.append(lag)
                        relay_by_second.setdefault(int(t - t0), []).append(lag)
                seconds = [
                    f"{_pct(by_second[k], 0.99) * 1e3:.0f}"
                    + (f" ({_pct(relay_by_second[k], 0.99) * 1e3:.0f})" if k in relay_by_second else "")
                    for k in sorted(by_second)
                ]
                return done - t0, lags, relay_lags, seconds

            profiler = cProfile.Profile(time.process_time) if args.profile else None
            if profiler is not None:
                profiler.enable()
            spies = [
                _py_spy(f"{args.py_spy}.{part}" if args.py_spy else None, pid)
                for part, pid in (("relay", os.getpid()), ("replica", replicas[0][0].pid or 0))
            ]
            elapsed, lags, _, _ = await round_(0, n_batches, 0)
            for spy in spies:
                _stop(spy)
            replica_cpu = [v for k, v in cpu.items() if k.startswith("replica")]
            total_cpu = cpu["relay"] + cpu["nats-server"] + cpu["engines"] + sum(replica_cpu)
            per = 1e5 / blocks
            print(
                f"CPU seconds per 100k blocks in that round: relay process {cpu['relay'] * per:.3f}, each replica"
                f" {' / '.join(f'{c * per:.3f}' for c in replica_cpu)}, nats-server {cpu['nats-server'] * per:.3f},"
                f" engines {cpu['engines'] * per:.3f}; total {total_cpu * per:.3f}: 2 cores carry at most"
                f" {2 * blocks / total_cpu:,.0f} blocks/s of this pipeline (the run reached"
                f" {blocks / elapsed / (2 * blocks / total_cpu):.2f} x that); each replica"
                f" {' / '.join(f'{c / raw_cpu:.2f}' for c in replica_cpu)} x the CPU of apply_payload alone"
                f" (what is not the index: NATS, the rules, the client's bookkeeping)"
            )
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)
            print(
                f"throughput: {blocks:,} blocks ({n_batches * n_sources:,} batches) engines -> relay -> NATS ->"
                f" 3 replicas in {elapsed:.2f} s: {blocks / elapsed:,.0f} blocks/s"
                f" ({blocks / elapsed / (blocks / base):.2f} x the one-loop baseline,"
                f" {blocks / elapsed / (2 * blocks / raw / 4):.2f} x the 2-core ceiling)"
                + (
                    f"; lag at full speed p50 {_pct(lags, 0.5) * 1e3:.0f} ms, p99 {_pct(lags, 0.99) * 1e3:.0f} ms"
                    if lags
                    else ""
                )
            )
            # A follower reading the log alone (no snapshot yet; the relay and the three replicas idle beside it):
            # its CPU per block beside one copy's apply_payload, without the contention of the throughput round
            # (five busy processes on 2 cores evict each other's caches).
            catchup = _spawn_replica(
                url,
                args.backend,
                args.follower,
                args.listen,
                f"{args.profile}.catchup" if args.profile else None,
                profile_sync=True,
            )
            spy = _py_spy(f"{args.py_spy}.catchup" if args.py_spy else None, catchup[0].pid or 0)
            _, ready, _, _, catchup_cpu, _ = await anyio.to_thread.run_sync(catchup[1].recv)
            _stop(spy)
            catchup[1].send(None)
            catchup[0].join(10)
            print(
                f"catch-up: a new follower read the whole log ({blocks:,} blocks) in {ready:.2f} s,"
                f" {catchup_cpu * per:.3f} CPU s per 100k blocks ({catchup_cpu / raw_cpu:.2f} x apply_payload alone)"
            )
            t0 = time.perf_counter()
            seq = await relay.write_snapshot()
            snap_s = time.perf_counter() - t0
            # batches/s: a quarter of the measured maximum, or a fixed rate (comparable across loads)
            rate = args.lag_rate or 0.25 * n_batches * n_sources / elapsed
            client.set_raw_tap(TimedTap())
            paced_s, lags, relay_lags, seconds = await round_(n_batches, n_batches + paced, rate)
            client.set_raw_tap(relay_tap)
            # The paced round's CPU too: at the rate the pipeline runs near what 2 cores carry, so every
            # process's share (the paced publisher's wake-ups included) is what the lag is made of.
            paced_cpu = {k: v * 1e5 / paced_blocks for k, v in cpu.items()}
            paced_replicas = [v for k, v in paced_cpu.items() if k.startswith("replica")]
            print(
                f"CPU seconds per 100k blocks in the paced round: relay process {paced_cpu['relay']:.3f}, each replica"
                f" {' / '.join(f'{c:.3f}' for c in paced_replicas)}, nats-server {paced_cpu['nats-server']:.3f},"
                f" engines {paced_cpu['engines']:.3f}; total {sum(paced_cpu.values()):.3f}"
                f" ({sum(cpu.values()) / paced_s / 2:.2f} of 2 cores over the round's {paced_s:.2f} s)"
            )
            print(
                f"apply lag at {rate:,.0f} batches/s (~{rate * blocks / (n_batches * n_sources):,.0f} blocks/s):"
                f" p50 {_pct(lags, 0.5) * 1e3:.1f} ms, p90 {_pct(lags, 0.9) * 1e3:.1f} ms,"
                f" p99 {_pct(lags, 0.99) * 1e3:.1f} ms,"
                f" max {max(lags) * 1e3:.1f} ms"
                f" over {len(lags):,} applies; of which engines -> the relay's client (no NATS):"
                f" p50 {_pct(relay_lags, 0.5) * 1e3:.1f} ms, p90 {_pct(relay_lags, 0.9) * 1e3:.1f} ms,"
                f" p99 {_pct(relay_lags, 0.99) * 1e3:.1f} ms"
            )
            print(
                "#   apply lag p99 per second of the paced round (ms, by send time; in brackets the relay's client's):"
                f" {', '.join(seconds)}"
            )
            for proc, conn in replicas:
                conn.send(None)
                proc.join(10)
            replicas = []
            t0 = time.perf_counter()
            cold = _spawn_replica(url, args.backend, args.follower, args.listen)
            _, ready, entries, _, _, _ = await anyio.to_thread.run_sync(cold[1].recv)
            wall = time.perf_counter() - t0
            cold[1].send(None)
            cold[0].join(10)
            mirror = relay.stats()
            print(
                f"cold start: snapshot at seq {seq} ({entries:,} index entries, written in {snap_s:.2f} s) + "
                f"{mirror.records - seq:,} records after it: synced {ready:.2f} s after start"
                f" ({wall:.2f} s with the process spawn and imports)"
            )
            print(f"relay: {mirror}")
    finally:
        for proc, _conn in replicas:
            proc.kill()
        parent.send(None)
        pub.join(10)
        if pub.is_alive():
            pub.kill()
        server.terminate()
        server.wait(10)
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument(
        "--follower",
        choices=("client", "replica"),
        default="client",
        help="the three replicas: KvEventClient(jetstream=...) (default) or JetStreamReplica",
    )
    parser.add_argument(
        "--python-receive",
        action="store_true",
        help="the relay's client reads the engines in Python (native_receive=False; the default is the product's"
        " default, the compiled core's receive thread)",
    )
    parser.add_argument(
        "--listen",
        action="store_true",
        help="time client followers by an events() listener (each then decodes every batch for it) instead of"
        " the log's on_applied hook",
    )
    parser.add_argument(
        "--lag-rate",
        type=float,
        default=0.0,
        metavar="N",
        help="pace the lag round at N batches/s (default: a quarter of the throughput round's rate)",
    )
    parser.add_argument(
        "--lag-batches",
        type=int,
        default=0,
        metavar="N",
        help="batches per source in the paced lag round (default 500, 200 with --quick: under a second at the"
        " issue's 500k blocks/s, a burst's figures; a few thousand give a steady state's)",
    )
    parser.add_argument(
        "--engine-blocks",
        type=int,
        default=0,
        metavar="N",
        help="each simulated engine holds at most N blocks and evicts its oldest to store more, as a full engine"
        " does (default 0: engines never fill, the index grows all run long)",
    )
    parser.add_argument(
        "--pace-slack",
        type=float,
        default=0.0,
        metavar="S",
        help="the paced publisher sends a batch due within S seconds at once, sleeping once per S rather than once"
        " per batch (default 0: a sleep before every batch that is not yet due)",
    )
    parser.add_argument(
        "--gc-log",
        action="store_true",
        help="print each process's generation-2 garbage collections per round (when, how long)",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="cProfile (CPU time) the relay's process (FILE) and one replica's (FILE.replica) during the throughput"
        " round, and the catch-up follower until synced (FILE.catchup)",
    )
    parser.add_argument(
        "--py-spy",
        metavar="FILE",
        help="py-spy (sampling, native frames) the relay's process (FILE.relay) and one replica's (FILE.replica)"
        " during the throughput round, and the catch-up follower until synced (FILE.catchup): folded stacks",
    )
    args = parser.parse_args()
    if args.gc_log:
        os.environ[GC_LOG] = "1"
    # The relay's warnings (a session restart, a lost lease) explain a slow or stuck round.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: where a stuck run waits
    anyio.run(run, args, backend=args.backend)


if __name__ == "__main__":
    main()
