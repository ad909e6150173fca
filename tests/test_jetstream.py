"""Router replicas on NATS JetStream (docs/replicas.md), against a real ``nats-server -js``.

Each test starts its own server on a free loopback port with a temporary storage directory
(Debian's ``nats-server``; `.ci/run` installs it). The fleet is kvroute.sim's simulated engines;
"identical" means the same snapshot digest and the same `find_matches` answer for every query.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import pytest
from _ports import free_port, refusing_port
from _publisher_helpers import FAST, Workload, wait_for
from anyio.streams.text import TextReceiveStream

from kvroute import EventSource, JetStreamRelay, JetStreamReplica, KvEventClient, PrefixIndex, WorkerKey
from kvroute._jetstream import (
    _Batches,
    _Partial,
    _Present,
    _Removed,
    _Reset,
    _Runs,
    decode_record,
    encode_record,
    ensure_stream,
    fetch_object,
    object_store,
    record_header,
    run_msg_id,
    runs_msg_id,
    runs_subject,
    worker_subject,
)
from kvroute._jetstream_nats import NatsLoop
from kvroute._jetstream_publish import _Publisher
from kvroute._snapshot import read_snapshot
from kvroute._wire import BlockStored, EventBatch, encode_batch
from kvroute.sim import EventPublisher, SimConfig, SimEngine

NATS = shutil.which("nats-server")


# --- a real server ------------------------------------------------------------------------------------


class NatsServer:
    """``nats-server -js`` on loopback with file storage in ``store``; restartable on the same port."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert NATS is not None
        self.proc = subprocess.Popen(
            [NATS, "-js", "-sd", str(self.store), "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh server per test (`.ci/run` installs Debian's nats-server; skipped where it is missing)."""
    if NATS is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server)")
    server = NatsServer(tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- comparing indexes --------------------------------------------------------------------------------


def digest(index: PrefixIndex) -> str:
    """The index's snapshot, canonical (workers and tables sorted, no timestamp, no cursors), hashed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snap"
        index.snapshot(path, cursors={})
        workers, _ = read_snapshot(path)
    canon = sorted(
        (
            w.worker_id,
            w.dp_rank,
            sorted(w.classes),
            w.primary,
            sorted(zip(w.hashes, w.keys), key=repr),
            sorted(w.special, key=repr),
        )
        for w in workers
    )
    return hashlib.sha256(msgspec.msgpack.encode(canon)).hexdigest()


def answers(index: PrefixIndex, queries: list[tuple[int, ...]]) -> list[dict[WorkerKey, int]]:
    return [{w: s for w, s in index.find_matches(q).items() if s} for q in queries]


def assert_same(a: PrefixIndex, b: PrefixIndex, queries: list[tuple[int, ...]], note: object = None) -> None:
    """Same workers, same snapshot digest, same answer to every query (``note`` is shown on failure)."""
    assert a.workers() == b.workers(), note
    assert digest(a) == digest(b), note
    assert answers(a, queries) == answers(b, queries), note


def assert_exact(
    replica: JetStreamReplica,
    direct: PrefixIndex,
    queries: list[tuple[int, ...]],
    note: object = None,
    *,
    no_duplicates: bool = False,
) -> None:
    """A replica at quiescence holds the direct client's index, with no chain or stream gap, nothing undecodable,
    no partial worker (and, with ``no_duplicates``, no overlapping batch skipped)."""
    st = replica.stats()
    assert_same(replica.index, direct, queries, note=(st, note))
    assert (st.gaps, st.stream_gaps, st.undecodable) == (0, 0, 0), st
    assert not no_duplicates or st.duplicates == 0, st
    assert not replica.partial_workers(), st


async def replica_at(replica: JetStreamReplica, last: Mapping[WorkerKey, int], timeout: float = 20.0) -> None:  # noqa: ASYNC109
    """Wait until the replica applied each worker's batch ``last[worker]``."""
    with anyio.fail_after(timeout):
        while True:
            cur = replica.cursors()
            if all(k in cur and cur[k].seq == s for k, s in last.items()):
                return
            await anyio.sleep(0.02)


async def client_at(client: KvEventClient, last: Mapping[WorkerKey, int], timeout: float = 20.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while True:
            cur = client.cursors()
            if all(k in cur and cur[k].seq == s for k, s in last.items()) and all(
                st.state == "synced" for st in client.stats().sources.values()
            ):
                return
            await anyio.sleep(0.02)


class Fleet:
    """Simulated engine ranks (one `EventPublisher` each) with a seeded workload."""

    def __init__(self, pubs: list[EventPublisher]) -> None:
        self.pubs = pubs
        self.loads = [Workload(seed=i) for i in range(len(pubs))]

    def sources(self) -> list:  # type: ignore[type-arg]
        return [p.source(f"w{i}") for i, p in enumerate(self.pubs)]

    def step(self, n: int) -> None:
        for _ in range(n):
            for p, wl in zip(self.pubs, self.loads):
                p.publish(wl.batch())

    def last(self) -> dict[WorkerKey, int]:
        return {WorkerKey(f"w{i}", 0): p.next_seq - 1 for i, p in enumerate(self.pubs)}

    def queries(self) -> list[tuple[int, ...]]:
        return [q for wl in self.loads for q in wl.probes]


async def _steady(fleet: Fleet, rounds: int, per_round: int = 5) -> None:
    for _ in range(rounds):
        fleet.step(per_round)
        await anyio.sleep(0.01)


# --- the replica's rules, record by record (no server needed) ---------------------------------------


def _payload(seq: int, hashes: list[int]) -> bytes:
    ev = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))), block_size=16
    )
    return encode_batch(EventBatch(ts=float(seq), events=[ev]))


def _run(prev: int | None, batches: list[tuple[int, bytes]], worker: str = "w") -> bytes:
    """A `_Batches` record of ``worker``'s (seq, payload) batches after ``prev``."""
    items = [(seq, float(seq), len(p)) for seq, p in batches]
    return encode_record(_Batches(worker, 0, prev, items), [p for _, p in batches])


def _batch(seq: int, prev: int | None, hashes: list[int], worker: str = "w") -> bytes:
    return _run(prev, [(seq, _payload(seq, hashes))], worker)


def test_replica_rules_chain_duplicates_gaps_and_lifecycle() -> None:
    r = JetStreamReplica(stream="T")
    w = WorkerKey("w", 0)
    r.apply_record(1, _batch(0, None, [1]))
    r.apply_record(2, _batch(1, 0, [2]))
    assert r.index.num_blocks(w) == 2 and r.cursors()[w].seq == 1 and not r.partial_workers()
    # A duplicate (a relay overlap older than the server's dedup window) is skipped.
    r.apply_record(3, _batch(1, 0, [2]))
    assert r.stats().duplicates == 1 and r.index.num_blocks(w) == 2
    # prev 3 but the replica holds up to 1: batches 2..3 are lost, the old state is not trusted.
    r.apply_record(4, _batch(4, 3, [5]))
    assert r.index.num_blocks(w) == 1 and w in r.partial_workers() and r.stats().gaps == 1
    # A reset clears the worker and its partial flag; a partial record sets the flag again.
    r.apply_record(5, encode_record(_Reset("w", 0, "restart", "")))
    assert r.index.num_blocks(w) == 0 and not r.partial_workers() and w not in r.cursors()
    r.apply_record(6, encode_record(_Partial("w", 0, "not-in-buffer", 7)))
    r.apply_record(7, _batch(7, None, [9]))
    assert w in r.partial_workers() and r.index.num_blocks(w) == 1
    # A jump in the stream's own sequence (records lost to retention): every worker reset, partial.
    r.apply_record(8, _batch(0, None, [11], worker="v"))
    r.apply_record(10, _batch(8, 7, [12]))
    assert r.stats().stream_gaps == 1 and r.index.num_blocks(WorkerKey("v", 0)) == 0
    assert r.partial_workers() == {w, WorkerKey("v", 0)}
    # Undecodable records are counted and skipped; removed drops the worker.
    r.apply_record(11, b"\xc1garbage")
    r.apply_record(12, encode_record(_Removed("w", 0, "gone")))
    assert r.stats().undecodable == 1 and w not in r.live_workers() and r.index.num_blocks(w) == 0
    # A redelivered sequence is ignored.
    r.apply_record(12, encode_record(_Reset("v", 0, "restart", "")))
    assert r.stats().resets == 1


def test_runs_of_batches_overlap_and_bad_payloads() -> None:
    r = JetStreamReplica(stream="T")
    w = WorkerKey("w", 0)
    r.apply_record(1, _run(None, [(0, _payload(0, [1])), (1, _payload(1, [2])), (2, _payload(2, [3]))]))
    assert r.index.num_blocks(w) == 3 and r.cursors()[w].seq == 2 and r.stats().batches == 3
    # The same batches cut into another run (a relay restart): the covered ones are skipped, the rest applied.
    r.apply_record(2, _run(1, [(2, _payload(2, [3])), (3, _payload(3, [4]))]))
    assert (r.stats().duplicates, r.stats().gaps, r.index.num_blocks(w), r.cursors()[w].seq) == (1, 0, 4, 3)
    # A payload the core cannot decode: nothing of the worker is trusted, the chain goes on after it.
    r.apply_record(3, _run(3, [(4, b"\xc1"), (5, _payload(5, [6]))]))
    st = r.stats()
    assert (st.undecodable, st.gaps, r.index.num_blocks(w), r.cursors()[w].seq) == (1, 0, 1, 5)
    assert w in r.partial_workers()
    # The same inside a run, after a batch the core took: the worker holds only what follows the refused one.
    r.apply_record(4, _run(5, [(6, _payload(6, [7])), (7, b"\xc1"), (8, _payload(8, [9])), (9, _payload(9, [10]))]))
    st = r.stats()
    assert (st.undecodable, st.batches, r.index.num_blocks(w), r.cursors()[w].seq) == (2, 8, 2, 9)
    # A body that does not match its items is an undecodable record, not a crash.
    good = _run(9, [(10, _payload(10, [11]))])
    r.apply_record(5, good[:-1])
    assert r.stats().undecodable == 3 and r.index.num_blocks(w) == 2
    rec, at = decode_record(good)
    assert isinstance(rec, _Batches) and at + rec.items[0][2] == len(good)
    # A worker the relay follows before any batch of it (an idle engine) is live, with nothing held.
    idle = WorkerKey("idle", 1)
    r.apply_record(6, encode_record(_Present("idle", 1)))
    assert idle in r.live_workers() and r.index.num_blocks(idle) == 0 and idle not in r.partial_workers()


def test_one_record_carries_the_runs_of_several_workers() -> None:
    w, v = WorkerKey("w", 0), WorkerKey("v", 3)
    # What the relay's publisher makes of one turn's batches of two workers: one `_Runs` record.
    pub = _Publisher(NatsLoop(["nats://127.0.0.1:1"], "t"), "T", defaultdict(int), "s", {}, set(), publish_timeout=1.0)
    sources = {k: EventSource(worker_id=k.worker_id, dp_rank=k.dp_rank, endpoint="tcp://127.0.0.1:1") for k in (w, v)}
    for src, seq, hashes in [(w, 0, [1]), (v, 0, [11]), (w, 1, [2]), (v, 1, [12])]:
        pub.take_raw(sources[src], seq, float(seq), _payload(seq, hashes), len(hashes))
    pub.close_runs()
    ((subject, data, msg_id),) = pub.out
    rec, _ = decode_record(data)
    assert subject == runs_subject("T") and isinstance(rec, _Runs) and len(rec.runs) == 2
    assert msg_id == runs_msg_id(record_header(data))
    r = JetStreamReplica(stream="T")
    r.apply_record(1, data)
    assert (r.index.num_blocks(w), r.index.num_blocks(v), r.cursors()[w].seq, r.cursors()[v].seq) == (2, 2, 1, 1)
    # Each run keeps its own worker's rules: w's overlap is skipped, v's gap resets v alone.
    runs = _Runs([("w", 0, 0, [(1, 1.0, len(_payload(1, [2]))), (2, 2.0, len(_payload(2, [3])))]), ("v", 3, 5, [])])
    runs.runs[1] = ("v", 3, 5, [(6, 6.0, len(_payload(6, [16])))])
    again = encode_record(runs, [_payload(1, [2]), _payload(2, [3]), _payload(6, [16])])
    r.apply_record(2, again)
    st = r.stats()
    assert (st.duplicates, st.gaps, st.batches) == (1, 1, 6)
    assert (r.index.num_blocks(w), r.index.num_blocks(v), r.partial_workers()) == (3, 1, {v})
    # The id names the runs: the same record published again is the same message; another ts is not.
    moved = _Runs([(*runs.runs[0][:3], [(1, 1.5, runs.runs[0][3][0][2]), runs.runs[0][3][1]]), runs.runs[1]])
    ids = [runs_msg_id(record_header(encode_record(x))) for x in (runs, runs, moved)]
    assert ids[0] == ids[1] != ids[2]
    # A body shorter than its runs say is an undecodable record.
    r.apply_record(3, again[:-1])
    assert r.stats().undecodable == 1 and r.index.num_blocks(v) == 1


def test_a_relay_for_older_followers_publishes_one_batches_record_per_worker() -> None:
    # `runs_records=False` (`kvroute relay --no-runs-records`): the same turn of two workers makes a
    # `batches` record each, on its worker's subject, as relays before `runs` records did; a
    # follower ends where the `runs` record would have left it.
    w, v = WorkerKey("w", 0), WorkerKey("v", 3)
    sources = {k: EventSource(worker_id=k.worker_id, dp_rank=k.dp_rank, endpoint="tcp://127.0.0.1:1") for k in (w, v)}
    replicas = []
    for runs_records in (True, False):
        pub = _Publisher(
            NatsLoop(["nats://127.0.0.1:1"], "t"), "T", defaultdict(int), "s", {}, set(),
            publish_timeout=1.0, runs_records=runs_records,
        )  # fmt: skip
        for src, seq, hashes in [(w, 0, [1]), (v, 0, [11]), (w, 1, [2]), (v, 1, [12]), (v, 2, [13])]:
            pub.take_raw(sources[src], seq, float(seq), _payload(seq, hashes), len(hashes))
        pub.close_runs()
        if not runs_records:
            assert [subject for subject, _, _ in pub.out] == [worker_subject("T", w), worker_subject("T", v)]
            recs = [decode_record(data)[0] for _, data, _ in pub.out]
            assert all(isinstance(rec, _Batches) for rec in recs)
            assert [msg_id for _, _, msg_id in pub.out] == [
                run_msg_id(WorkerKey(rec.worker_id, rec.dp_rank), rec.items) for rec in recs  # type: ignore[union-attr]
            ]
            assert pub.counts["records"] == 2
        r = JetStreamReplica(stream="T")
        for n, (_, data, _) in enumerate(pub.out, 1):
            r.apply_record(n, data)
        replicas.append(r)
    runs, batches = replicas
    assert batches.cursors() == runs.cursors() and batches.cursors()[v].seq == 2
    assert [batches.index.num_blocks(k) for k in (w, v)] == [runs.index.num_blocks(k) for k in (w, v)] == [2, 3]


@pytest.mark.anyio
@pytest.mark.parametrize("runs_records", [False, True])
async def test_a_follower_that_cannot_read_runs_records_is_exact_on_a_relay_that_writes_none(
    nats_server: NatsServer, runs_records: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A follower released before `runs` records: its header union has no `runs`, so such a record
    # does not decode (msgspec's error, as an unknown tag gives) and is skipped. On a relay run with
    # `runs_records=False` it holds exactly what a client following the engines holds; on the
    # default relay it skips records (whose removals it would then over-claim: docs/replicas.md).
    import kvroute._jetstream_log as log_rules

    def decode_as_before_runs(data: bytes) -> tuple[object, int]:
        rec, body = decode_record(data)
        if isinstance(rec, _Runs):
            raise msgspec.DecodeError("Invalid value 'runs' - at `$.kind`")
        return rec, body

    monkeypatch.setattr(log_rules, "decode_record", decode_as_before_runs)
    async with EventPublisher() as p0, EventPublisher() as p1, EventPublisher() as p2:
        fleet = Fleet([p0, p1, p2])
        fleet.step(5)
        relay_of = JetStreamRelay(nats_server.url, fleet.sources(), stream="T", config=FAST, runs_records=runs_records)
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            relay_of as relay,
            JetStreamReplica(nats_server.url, stream="T") as old,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 30)
            last = fleet.last()
            await client_at(direct, last)
            if runs_records:
                await wait_for(lambda: old.stats().undecodable > 0, "a runs record skipped by the old follower")
                return
            await replica_at(old, last)
            assert_exact(old, direct.index, fleet.queries())
            assert old.stats().undecodable == 0


def test_a_turn_of_thousands_of_workers_with_long_ids_stays_within_a_record_bound() -> None:
    # A cold sync's turn: 4,096 workers with 200-character ids, one small batch each. The bound
    # counted payloads only, so one `runs` record's header listed every worker (0.9 MB here), past
    # NATS's 1 MB default with the payloads: the publish failed and the session restarted, again.
    pub = _Publisher(NatsLoop(["nats://127.0.0.1:1"], "t"), "T", defaultdict(int), "s", {}, set(), publish_timeout=1.0)
    keys = [WorkerKey(('engine-' * 28)[:195] + f"{i:05d}", i % 8) for i in range(4096)]
    sources = {k: EventSource(worker_id=k.worker_id, dp_rank=k.dp_rank, endpoint="tcp://127.0.0.1:1") for k in keys}
    for i, k in enumerate(keys):
        pub.take_raw(sources[k], 0, 1.0, _payload(0, [i + 1]), 1)
    pub.close_runs()
    sizes = [len(data) for _, data, _ in pub.out]
    assert len(sizes) > 1 and max(sizes) < 300 * 1024, (len(sizes), max(sizes))
    r = JetStreamReplica(stream="T")
    for n, (_, data, _) in enumerate(pub.out, 1):
        r.apply_record(n, data)
    assert r.stats().undecodable == 0 and len(r.index.workers()) == 4096
    assert all(r.index.num_blocks(k) == 1 for k in keys[::97])


def test_snapshot_objects_are_read_whole_and_checked(nats_server: NatsServer) -> None:
    import asyncio

    import nats

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            assert await fetch_object(js, "O", "index-1") is None  # no store yet
            await ensure_stream(js, "O", "file", 0.0, 120.0)
            assert await fetch_object(js, "O", "index-1") is None  # no such object
            store = await object_store(js, "O", create=False)
            data = random.Random(3).randbytes(3_000_000)  # ~23 chunks of 128 KiB
            meta = nats.js.api.ObjectMeta(name="index-1", description="d")
            await store.put("index-1", data, meta=meta)
            assert await fetch_object(js, "O", "index-1") == (data, "d")
        finally:
            await nc.close()

    asyncio.run(main())


# --- end to end ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_three_replicas_and_a_direct_client_agree(nats_server: NatsServer) -> None:
    async with EventPublisher() as p0, EventPublisher() as p1, EventPublisher() as p2:
        fleet = Fleet([p0, p1, p2])
        fleet.step(20)  # history before anything follows: replayed by the relay's cold start
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            JetStreamRelay(nats_server.url, fleet.sources(), stream="T", config=FAST, snapshot_interval=0.3) as relay,
            JetStreamReplica(nats_server.url, stream="T") as r1,
            JetStreamReplica(nats_server.url, stream="T") as r2,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 20)
            # The third replica starts later, from a snapshot and the rest of the log.
            await wait_for(lambda: relay.stats().snapshots > 0, "a snapshot was written")
            async with JetStreamReplica(nats_server.url, stream="T") as r3:
                await r3.wait_synced(10)
                assert r3.stats().snapshot_seq > 0
                await _steady(fleet, 10)
                last = fleet.last()
                await client_at(direct, last)
                for r in (r1, r2, r3):
                    await replica_at(r, last)
                    assert_exact(r, direct.index, fleet.queries())
                    assert r.worker_status(WorkerKey("w0", 0)) is not None
                assert relay.stats().duplicates == 0


@pytest.mark.anyio
async def test_snapshots_taken_while_the_engines_publish_are_exact(nats_server: NatsServer) -> None:
    # The relay's snapshot is its client's index, taken inside one turn of its publisher while batches keep
    # coming: it must hold exactly the records up to the sequence it names, so a replica starting from it
    # and reading on agrees with a client following the engines.
    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            JetStreamRelay(nats_server.url, fleet.sources(), stream="L", config=FAST, snapshot_interval=3600) as relay,
        ):
            await relay.wait_synced(10)
            seqs = []

            async def publish() -> None:
                while True:
                    fleet.step(1)
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish)
                for _ in range(3):
                    await anyio.sleep(0.2)
                    seqs.append(await relay.write_snapshot())
                tg.cancel_scope.cancel()
            assert 0 < seqs[0] < seqs[1] < seqs[2], seqs  # each one new, taken while the engines published
            async with JetStreamReplica(nats_server.url, stream="L") as late:
                await late.wait_synced(10)
                assert late.stats().snapshot_seq == seqs[-1]
                last = fleet.last()
                await client_at(direct, last)
                await replica_at(late, last)
                assert_exact(late, direct.index, fleet.queries(), relay.stats())


@pytest.mark.anyio
async def test_a_partial_worker_is_partial_in_the_relays_snapshot(nats_server: NatsServer) -> None:
    # The relay's snapshot is its client's index; the partial flags are the log's, kept by its publisher:
    # a replica starting from the snapshot must know what one that read the `partial` record knows.
    async with EventPublisher(buffer_steps=5) as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        fleet.step(20)  # w0's replay buffer no longer reaches its first batch: the relay's client marks it partial
        w0 = WorkerKey("w0", 0)
        async with (
            JetStreamRelay(nats_server.url, fleet.sources(), stream="P", config=FAST, snapshot_interval=3600) as relay,
            JetStreamReplica(nats_server.url, stream="P") as early,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 3)
            last = fleet.last()
            await replica_at(early, last)
            assert early.partial_workers() == {w0}, early.stats()
            assert await relay.write_snapshot() > 0
            async with JetStreamReplica(nats_server.url, stream="P") as late:
                await late.wait_synced(10)
                assert late.stats().snapshot_seq > 0
                await replica_at(late, last)
                assert late.partial_workers() == {w0}, late.stats()
                assert late.live_workers() == early.live_workers() == set(last)
                assert_same(late.index, early.index, fleet.queries())


@pytest.mark.anyio
async def test_a_record_the_relay_did_not_publish_is_never_under_its_snapshot(nats_server: NatsServer) -> None:
    # The relay's snapshots are its client's own index, which holds the log only while this relay wrote
    # every record since its session began. A record of another publisher (a relay that did not yet know
    # it lost the lease) must not be covered by a snapshot of an index without it: the relay writes none
    # and starts its session over from the log, whose follower rules then hold that record too.
    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        async with (
            JetStreamRelay(nats_server.url, fleet.sources(), stream="G", config=FAST, snapshot_interval=3600) as relay,
            JetStreamReplica(nats_server.url, stream="G") as early,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 5)
            ghost = WorkerKey("ghost", 0)
            other = NatsLoop([nats_server.url], "another-relay")
            await other.start(5.0)
            try:
                await other.call(other.js.publish(worker_subject("G", ghost), _batch(1, None, [7, 8], "ghost")))
            finally:
                await other.close()
            await wait_for(lambda: early.index.num_blocks(ghost) == 2, "the early replica applied the record")
            # The relay's records after the ghost's: a snapshot would cover it, and the index lacks it.
            await _steady(fleet, 2)
            await replica_at(early, fleet.last())
            assert await relay.write_snapshot() == 0  # not written
            await wait_for(lambda: relay.stats().sessions >= 2, "the session started over from the log")
            await wait_for(lambda: ghost not in early.live_workers(), "the new session removed the ghost")
            await _steady(fleet, 5)
            last = fleet.last()
            client = relay.client
            assert client is not None
            await client_at(client, last)
            assert await relay.write_snapshot() > 0
            async with JetStreamReplica(nats_server.url, stream="G") as late:
                await late.wait_synced(10)
                assert late.stats().snapshot_seq > 0
                for r in (early, late):
                    await replica_at(r, last)
                    assert r.live_workers() == set(last), r.stats()
                    assert_same(r.index, client.index, fleet.queries(), note=(r.stats(), relay.stats()))


@pytest.mark.anyio
async def test_a_new_relay_resets_what_it_cannot_resume_on_every_replica(nats_server: NatsServer) -> None:
    # Sources without a replay endpoint: a relay that takes over cannot check the log's positions, so
    # its client starts them from nothing (`Restored.take`). The replicas must drop the log's state of
    # those workers too: the batches between the two relays are lost, and may have removed blocks.
    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        sources = [msgspec.structs.replace(s, replay_endpoint=None) for s in fleet.sources()]
        async with JetStreamReplica(nats_server.url, stream="N") as replica:
            async with JetStreamRelay(nats_server.url, sources, stream="N", config=FAST) as first:
                await first.wait_synced(10)
                await _steady(fleet, 10)
                await replica_at(replica, fleet.last())
                assert replica.index.num_blocks(WorkerKey("w0", 0)) > 0
            fleet.step(10)  # nobody follows the engines: these batches are lost
            async with JetStreamRelay(nats_server.url, sources, stream="N", config=FAST) as second:
                await second.wait_synced(10)
                await _steady(fleet, 10)
                last = fleet.last()
                client = second.client
                assert client is not None
                await client_at(client, last)
                await replica_at(replica, last)
                st = second.stats()
                assert st.resets >= 2, st
                # The replica holds what the relay's client holds: nothing from before the handover.
                assert_same(replica.index, client.index, fleet.queries(), note=(replica.stats(), st))


@pytest.mark.anyio
async def test_nats_server_restart_loses_and_doubles_nothing(nats_server: NatsServer) -> None:
    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            JetStreamRelay(
                nats_server.url,
                fleet.sources(),
                stream="R",
                config=FAST,
                snapshot_interval=0.5,
                lease_ttl=1.0,
                publish_timeout=1.0,
            ) as relay,
            JetStreamReplica(nats_server.url, stream="R") as r1,
            JetStreamReplica(nats_server.url, stream="R") as r2,
            JetStreamReplica(nats_server.url, stream="R") as r3,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 10)
            for replica in (r1, r2, r3):
                await replica_at(replica, fleet.last())
            # The server goes away (file storage) while the engines keep publishing; their replay
            # buffers hold what the relay could not publish meanwhile.
            await anyio.to_thread.run_sync(nats_server.stop)
            await _steady(fleet, 10)
            await anyio.sleep(2.0)  # longer than the publish timeout: the relay's session fails
            await anyio.to_thread.run_sync(nats_server.start)
            await _steady(fleet, 10)
            last = fleet.last()
            await client_at(direct, last)
            # Three replicas and the direct client, identical at quiescence through the outage.
            for replica in (r1, r2, r3):
                await replica_at(replica, last, timeout=40)
                assert_exact(replica, direct.index, fleet.queries(), relay.stats(), no_duplicates=True)
            assert relay.stats().sessions >= 2  # the relay resumed from the log after the outage
            # A replica started after the restart reads the same from the persisted snapshot + log.
            async with JetStreamReplica(nats_server.url, stream="R") as late:
                try:
                    await late.wait_synced(20)
                except TimeoutError:
                    print("late replica not synced:", late.stats(), relay.stats(), r1.stats())
                    raise
                assert_same(late.index, direct.index, fleet.queries())


@pytest.mark.anyio
async def test_a_replica_back_after_the_engines_buffers_wrapped_is_exact(nats_server: NatsServer) -> None:
    # Engines that keep 8 batches: a client following them directly that starts late is partial.
    async with EventPublisher(buffer_steps=8) as p0, EventPublisher(buffer_steps=8) as p1:
        fleet = Fleet([p0, p1])
        async with (
            JetStreamRelay(nats_server.url, fleet.sources(), stream="B", config=FAST, snapshot_interval=0.3) as relay,
        ):
            await relay.wait_synced(10)
            async with JetStreamReplica(nats_server.url, stream="B") as replica:
                await _steady(fleet, 4)
                await replica_at(replica, fleet.last())
            # Stopped for 60 batches per worker: 7 times what the engines' buffers hold.
            await _steady(fleet, 12)
            async with (
                KvEventClient(fleet.sources(), config=FAST) as late_direct,
                JetStreamReplica(nats_server.url, stream="B") as back,
            ):
                last = fleet.last()
                await client_at(late_direct, last)
                await replica_at(back, last)
                assert all(late_direct.worker_status(k).partial for k in last)  # type: ignore[union-attr]
                assert not back.partial_workers() and back.stats().gaps == 0, (back.stats(), relay.stats())
                truth = PrefixIndex()
                for i, pub in enumerate(fleet.pubs):
                    for batch in pub.history:
                        truth.apply_batch(WorkerKey(f"w{i}", 0), batch)
                assert_same(back.index, truth, fleet.queries())


async def _read_lines(proc: anyio.abc.Process, lines: list[str], eof: anyio.Event) -> None:
    """Append each whole line ``proc`` writes to ``lines``; set ``eof`` once its stdout is closed and read out."""
    assert proc.stdout is not None
    partial = ""
    try:
        async for chunk in TextReceiveStream(proc.stdout):
            # A chunk may end mid-line: the rest comes with the next one.
            *whole, partial = (partial + chunk).split("\n")
            lines.extend(whole)
    finally:
        eof.set()


async def converged(replica: JetStreamReplica, direct: KvEventClient, timeout: float = 30.0) -> None:  # noqa: ASYNC109
    """Wait until the replica stands where the direct client stands, for every worker, and both are synced."""
    with anyio.fail_after(timeout):
        while True:
            want = {k: c.seq for k, c in direct.cursors().items()}
            got = {k: c.seq for k, c in replica.cursors().items()}
            if want and want == got and direct.stats().totals.synced == len(want):
                return
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_standby_relay_takes_over_when_the_active_one_is_killed(nats_server: NatsServer) -> None:
    def config(name: str) -> SimConfig:
        return SimConfig(name=name, http_port=None, prefill_time_per_token=0.0, decode_time_per_step=0.0)

    rng = random.Random(7)
    prompts: list[tuple[int, ...]] = []

    async def traffic(engines: list[SimEngine], n: int) -> None:
        for i in range(n):
            prompt = tuple(rng.randrange(32_000) for _ in range(16 * rng.randint(1, 6)))
            prompts.append(prompt)
            await engines[i % len(engines)].complete(prompt, max_tokens=1)

    async with SimEngine(config("a")) as ea, SimEngine(config("b")) as eb:
        targets = [t for t in (ea.grpc_target, eb.grpc_target) if t is not None]
        relay_cmd = [sys.executable, "-m", "kvroute.cli", "relay", *targets, "--nats", nats_server.url, "--stream", "H"]
        relay_cmd += ["--lease-ttl", "1", "--snapshot-interval", "0.5", "--status-interval", "0.1"]
        lines: dict[str, list[str]] = {"ra": [], "rb": []}
        read_out = {"ra": anyio.Event(), "rb": anyio.Event()}

        def active() -> str | None:
            for name, out in lines.items():
                if out and out[-1].startswith(f"{name} active"):
                    return name
            return None

        async with (
            await anyio.open_process([*relay_cmd, "--name", "ra"]) as ra,
            await anyio.open_process([*relay_cmd, "--name", "rb"]) as rb,
            anyio.create_task_group() as tg,
        ):
            procs = {"ra": ra, "rb": rb}
            tg.start_soon(_read_lines, ra, lines["ra"], read_out["ra"])
            tg.start_soon(_read_lines, rb, lines["rb"], read_out["rb"])
            try:
                async with (
                    KvEventClient(targets=targets, config=FAST) as direct,
                    JetStreamReplica(nats_server.url, stream="H") as r1,
                    JetStreamReplica(nats_server.url, stream="H") as r2,
                    JetStreamReplica(nats_server.url, stream="H") as r3,
                ):
                    with anyio.move_on_after(30):
                        while active() is None:  # noqa: ASYNC110 (a subprocess's output, polled)
                            await anyio.sleep(0.05)
                    first = active()
                    assert first is not None, {name: out[-3:] for name, out in lines.items()}
                    await traffic([ea, eb], 30)
                    await converged(r1, direct)
                    # SIGKILL: the lease is not released; the standby waits out its ttl (1 s) and takes over.
                    procs[first].kill()
                    killed = anyio.current_time()
                    # Its pipe may still hold status lines it wrote while active: read them out before
                    # forgetting its output, or one read after the clear shows the dead relay active.
                    with anyio.fail_after(10):
                        await procs[first].wait()
                        await read_out[first].wait()
                    lines[first].clear()
                    await traffic([ea, eb], 30)  # the engines' replay buffers carry these over the handover
                    with anyio.fail_after(15):
                        while active() is None:  # noqa: ASYNC110 (a subprocess's output, polled)
                            await anyio.sleep(0.05)
                    takeover = anyio.current_time() - killed
                    print(f"standby took over {takeover:.2f} s after the SIGKILL (lease ttl 1 s)")
                    assert active() != first
                    assert takeover < 10.0
                    await traffic([ea, eb], 30)
                    for r in (r1, r2, r3):
                        await converged(r, direct)
                        assert_exact(r, direct.index, prompts, no_duplicates=True)
                    async with JetStreamReplica(nats_server.url, stream="H") as late:
                        await late.wait_synced(20)
                        assert_same(late.index, direct.index, prompts)
            finally:
                tg.cancel_scope.cancel()
                for p in procs.values():
                    if p.returncode is None:
                        p.kill()


def test_relay_command_exit_codes() -> None:
    from kvroute.cli import main

    assert main(["relay", "127.0.0.1:1", "--lease-ttl", "0"]) == 2
    # No NATS server there: the first connect is bounded and reported, not retried forever.
    with refusing_port() as port:
        assert main(["relay", "127.0.0.1:1", "--nats", f"nats://127.0.0.1:{port}", "--duration", "1"]) == 1


def test_relay_command_takes_lease_stall() -> None:
    from kvroute.cli import main

    # Below the ttl it is refused as usage, like JetStreamRelay(lease_stall=) refuses it.
    assert main(["relay", "127.0.0.1:1", "--lease-ttl", "3", "--lease-stall", "2"]) == 2
    # Accepted, and handed to the relay (which then fails on the absent server as without it).
    with refusing_port() as port:
        assert main(["relay", "127.0.0.1:1", "--nats", f"nats://127.0.0.1:{port}", "--lease-stall", "40"]) == 1


def test_relay_command_takes_no_runs_records(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvroute.cli._relay as relay_cli
    from kvroute.cli import main

    made: list[bool] = []

    def relay(*args: object, runs_records: bool = True, **kwargs: object) -> JetStreamRelay:
        made.append(runs_records)  # the real relay, which then fails on the absent server
        return JetStreamRelay(*args, runs_records=runs_records, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(relay_cli, "JetStreamRelay", relay)
    with refusing_port() as port:
        assert main(["relay", "127.0.0.1:1", "--nats", f"nats://127.0.0.1:{port}", "--no-runs-records"]) == 1
        assert main(["relay", "127.0.0.1:1", "--nats", f"nats://127.0.0.1:{port}"]) == 1
    assert made == [False, True]


def test_demo_replicas_follow_one_relay_over_jetstream(capsys: pytest.CaptureFixture[str]) -> None:
    if NATS is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server)")
    from kvroute.cli import main

    args = ["demo", "--json", "--engines", "2", "--requests", "40", "--replicas", "2", "--jetstream"]
    code = main([*args, "--policies", "kvroute"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.splitlines()[-1])
    assert list(result) == ["kvroute_x2_router_load", "kvroute_x2_engine_load"]
    for r in result.values():
        assert r["completed"] == 40 and r["failed"] == 0
        # Two replicas of the relay's log and the demo's own client following the engines: one digest.
        assert len(r["index_digests"]) == 3 and len(set(r["index_digests"])) == 1, r["index_digests"]
        assert r["index_blocks"] == r["engine_blocks"] > 0
    assert main(["demo", "--jetstream", "--replicas", "1"]) == 2
