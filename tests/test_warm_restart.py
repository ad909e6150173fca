"""Warm restart: `SourceMachine.resume` rule by rule and as a model, then snapshot -> restore -> resume over sockets."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import pytest
from _publisher_helpers import (
    FAST,
    Workload,
    assert_index_equal,
    assert_index_subset,
    next_event,
    settle,
    subscribed,
    truth_index,
    wait_for,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_source import (
    World,
    applied,
    events,
    item,
    items,
    live,
    requests,
    resets,
    run_world,
    step,
    synced_machine,
    ts_of,
)

from kvroute._client import KvEventClient
from kvroute._errors import SnapshotError
from kvroute._events import Envelope, Partial, Replayed, Reset
from kvroute._index import PrefixIndex
from kvroute._models import EventSource, WorkerKey
from kvroute._snapshot import Cursor
from kvroute._source import RecreateSubscriber, RequestReplay, SourceMachine
from kvroute.sim._publisher import EventPublisher

# --- the machine ----------------------------------------------------------------------------------


def resumed(seq: int, *, has_replay: bool = True, ts_ring: int = 4096) -> SourceMachine:
    m = SourceMachine(has_replay=has_replay, ts_ring=ts_ring)
    assert m.resume(seq, ts_of(seq)) == []
    return m


def test_resume_asks_nothing_until_the_first_connect_then_checks_identity() -> None:
    m = resumed(9)
    assert m.state == "syncing" and m.applied == (9, ts_of(9)) and m.last_seq == 9
    # Live batches of whichever engine is there wait for the answer.
    assert requests(m.on_live(12, ts_of(12), item(12)[2])) == [] and m.held == 1
    assert m.on_quiet() == []
    out = m.on_reconnected()
    assert requests(out) == [RequestReplay(9, "identity")]
    out = m.on_replay(items(range(9, 14)), complete=True)
    assert applied(out) == [10, 11, 12, 13] and resets(out) == []
    assert Replayed(9, 4, "identity") in events(out)
    assert m.state == "synced" and not m.partial and m.applied == (13, ts_of(13))


def test_resume_against_a_restarted_engine_resets_and_starts_cold() -> None:
    m = resumed(9)
    m.on_reconnected()
    out = m.on_replay(items(range(9, 12), epoch=1), complete=True)
    assert resets(out) == ["restart"] and any(isinstance(a, RecreateSubscriber) for a in out)
    assert requests(out) == [RequestReplay(0, "cold")] and m.applied is None
    m.on_reconnected()
    out = m.on_replay(items(range(12), epoch=1), complete=True)
    assert applied(out) == list(range(12)) and m.state == "synced" and not m.partial


def test_resume_against_an_engine_that_never_got_that_far_resets() -> None:
    m = resumed(9)
    m.on_reconnected()
    assert resets(m.on_replay([], complete=True)) == ["restart"]


def test_resume_with_a_dead_replay_endpoint_resets_after_two_failures() -> None:
    m = resumed(9)
    m.on_reconnected()
    out = m.on_replay_failed("timeout")
    assert resets(out) == [] and requests(out) == [RequestReplay(9, "identity")]
    assert resets(m.on_replay_failed("timeout")) == ["restart"]


def test_resume_past_the_buffer_resets_then_the_cold_replay_is_partial() -> None:
    m = resumed(9)
    m.on_reconnected()
    out = m.on_replay(items(range(15, 30)), complete=True)
    assert resets(out) == ["restart"] and requests(out) == [RequestReplay(0, "cold")]
    m.on_reconnected()
    out = m.on_replay(items(range(15, 30)), complete=True)
    assert applied(out) == list(range(15, 30))
    assert Partial("not-in-buffer", 15) in events(out) and m.partial and m.state == "synced"


def test_resume_without_replay_resets_at_once_and_starts_like_start() -> None:
    m = SourceMachine(has_replay=False)
    out = m.resume(9, ts_of(9))
    assert resets(out) == ["no-replay"] and isinstance(events(out)[0], Reset) and m.applied is None
    m.on_reconnected()
    out = m.on_live(20, ts_of(20), item(20)[2])
    assert applied(out) == [20] and m.partial


def test_resume_is_only_a_first_input_and_checks_its_position() -> None:
    m = SourceMachine(has_replay=True)
    m.start()
    with pytest.raises(RuntimeError):
        m.resume(1, 1.0)
    for seq, ts in ((-1, 1.0), (2**64 - 1, 1.0), (3, math.nan), (3, math.inf)):
        with pytest.raises(ValueError, match="cannot resume"):
            SourceMachine(has_replay=True).resume(seq, ts)


def test_applied_follows_the_run_the_index_holds() -> None:
    m = SourceMachine(has_replay=True)
    assert m.applied is None
    m = synced_machine(5)
    assert m.applied == (5, ts_of(5))
    # A restart resets the worker: nothing is held, so there is no position to save.
    m.on_live(3, ts_of(3, epoch=1), item(3, epoch=1)[2])
    assert m.applied is None


def test_resume_then_a_disconnect_before_the_connect_report_still_checks_identity() -> None:
    # The disconnect proves a connection the monitor had not reported yet: the next connect is
    # a reconnect, and the resumed state is still vouched for by an identity check (rule 7).
    m = resumed(9)
    assert applied(live(m, 12)) == [] and m.held == 1  # maybe the old engine's, maybe not: held
    m.on_disconnected()
    assert m.state == "syncing"
    out = m.on_reconnected()
    assert requests(out) == [RequestReplay(9, "identity")] and resets(out) == []
    # A restarted engine: reset, and the held seq 12 goes with the old SUB.
    out = m.on_replay(items(range(3), epoch=1), complete=True)
    assert resets(out) == ["restart"] and RecreateSubscriber() in out and m.held == 0
    m.on_reconnected()
    out = m.on_replay(items(range(3), epoch=1), complete=True)
    assert applied(out) == [0, 1, 2] and m.state == "synced" and not m.partial


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.lists(step, max_size=40),
    after=st.lists(step, max_size=40),
    restart=st.booleans(),
    down=st.integers(0, 25),
    depth=st.one_of(st.just(10_000), st.integers(1, 30)),
    ts_ring=st.integers(1, 64),
    final=st.integers(0, 4),
    lost_tail=st.integers(0, 2),
    faults=st.booleans(),
)
# Found by this model: the first life ends partial (its seq 0 undecodable), so the second starts
# cold; the old engine's undecodable seq 2 is delivered, then the SUB disconnects before its
# connect was reported, and the engine restarts. The machine took the next connect for the
# first, kept seq 2 held into the new engine's history and ended "synced" with nothing applied;
# a disconnect now makes the next connect a reconnect, which starts over on a fresh SUB.
@example(
    before=[("publish", False, 0)],
    after=[("publish", True, 0), ("outage", True, 0, False)],
    restart=False,
    down=0,
    depth=10_000,
    ts_ring=1,
    final=0,
    lost_tail=0,
    faults=True,
)
# Found by this model (a model bug, not the machine's): the first life ends partial after an
# "undecodable" reset at seq 1; restored without a position, the second life's cold replay applies
# seq 1 again, and the model judged that against the first life's reset point.
@example(
    before=[("publish", False, 0), ("publish", True, 1), ("publish", False, 0), ("answer", frozenset(), False, 0)],
    after=[("answer", frozenset([2]), False, 1)],
    restart=False,
    down=0,
    depth=10_000,
    ts_ring=1,
    final=0,
    lost_tail=0,
    faults=True,
)
def test_model_resume_keeps_the_index_a_true_contiguous_run(
    before: list[tuple[object, ...]],
    after: list[tuple[object, ...]],
    restart: bool,
    down: int,
    depth: int,
    ts_ring: int,
    final: int,
    lost_tail: int,
    faults: bool,
) -> None:
    """Run, snapshot, router down (engine restarts or not, publishes meanwhile), resume, run: the oracle holds."""
    world = World(has_replay=True, depth=depth, ts_ring=ts_ring)
    run_world(world, before, final=final, faults=faults, lost_tail=lost_tail)
    saved = world.m.applied
    if saved is not None:
        assert world.run[-1] == (world.epoch, saved[0]), "the position is not where the index's run ends"
    if world.m.partial:
        saved = None  # KvEventClient.snapshot saves no position for a partial worker
    # The router goes down: its machine, SUB queue and replay request die with it.
    world.m = SourceMachine(has_replay=True, ts_ring=ts_ring)
    world.req = None
    world.queue.clear()
    world.seen = set()
    world.shown_epochs = set()
    world.identity_trouble = False
    world.connected = False
    if restart:
        world.epoch += 1
        world.head = -1
    for _ in range(down):
        world.publish(deliver=False, corrupt=False)
    world.connected = True
    if saved is None:
        # Restored without a position: the client resets the worker, so the first life's last
        # reset says nothing about what this life's machine skips.
        world.run = []
        world.reset_from = None
        world.handle(world.m.start())
    else:
        world.handle(world.m.resume(*saved))
    world.monitor_pending = True  # the first connect is reported when run_world says so
    resets_before = len(world.resets)
    run_world(world, after, final=final, faults=faults, lost_tail=lost_tail)
    restarted_after = any(s[0] == "outage" and s[1] for s in after)
    if not faults and not restart and not restarted_after and depth == 10_000 and saved is not None:
        # A deep, faithful buffer covers the outage: the restored run goes on, no reset at all.
        assert world.resets[resets_before:] == [] and world.run[0] == (world.epoch, 0)


# --- over sockets -------------------------------------------------------------------------------------


async def _run_and_snapshot(
    pub: EventPublisher, src: EventSource, wl: Workload, n: int, path: Path, *, after_exit: bool = False
) -> None:
    """A first router life: follow ``src`` through ``n`` batches, snapshot (while running or after), stop."""
    for _ in range(n):
        pub.publish(wl.batch())
    async with KvEventClient([src], config=FAST) as client:
        stream = client.events()
        await settle(client, stream, {src.key: pub.next_seq - 1})
        assert client.cursors() == {src.key: Cursor(pub.next_seq - 1, pub.history[-1].ts)}
        if not after_exit:
            client.snapshot(path)
    if after_exit:
        client.snapshot(path)  # where the source stopped


@pytest.mark.anyio
async def test_warm_resume_replays_only_the_gap(tmp_path: Path) -> None:
    wl = Workload(31)
    path = tmp_path / "index.kvs"
    async with EventPublisher() as pub:
        src = pub.source("w")
        await _run_and_snapshot(pub, src, wl, 30, path)
        for _ in range(12):  # published while the router is down
            pub.publish(wl.batch())
        index = PrefixIndex.restore(path)
        assert index.restored_cursors == {src.key: Cursor(29, pub.history[29].ts)}
        async with KvEventClient([src], config=FAST, index=index) as client:
            assert index.restored_cursors == {}  # taken over by the client
            stream = client.events()
            await settle(client, stream, {src.key: pub.next_seq - 1})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            # The anchor plus the 12 missed batches came back; nothing was applied twice.
            assert (st.resets, st.batches, st.partial) == (0, 12, False)
            pub.publish(wl.batch())
            await settle(client, stream, {src.key: pub.next_seq - 1})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


@pytest.mark.anyio
async def test_engine_restarted_while_the_router_was_down(tmp_path: Path) -> None:
    path = tmp_path / "index.kvs"
    async with EventPublisher() as pub:
        src = pub.source("w")
        await _run_and_snapshot(pub, src, Workload(32), 20, path, after_exit=True)
        pub.restart()
        wl = Workload(33)
        for _ in range(25):  # past the old seq: only the ts tells the engines apart
            pub.publish(wl.batch())
        async with KvEventClient([src], config=FAST, index=PrefixIndex.restore(path)) as client:
            stream = client.events()
            reset = await next_event(stream, "reset")
            assert isinstance(reset.event, Reset) and reset.event.reason == "restart"
            await settle(client, stream, {src.key: pub.next_seq - 1})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert st.resets == 1 and not st.partial


@pytest.mark.anyio
async def test_gap_past_the_buffer_resets_and_is_partial(tmp_path: Path) -> None:
    wl = Workload(34)
    path = tmp_path / "index.kvs"
    async with EventPublisher(buffer_steps=8) as pub:
        src = pub.source("w")
        await _run_and_snapshot(pub, src, wl, 6, path)
        for _ in range(20):
            pub.publish(wl.batch())
        async with KvEventClient([src], config=FAST, index=PrefixIndex.restore(path)) as client:
            stream = client.events()
            await settle(client, stream, {src.key: pub.next_seq - 1})
            st = client.stats().sources[src.key]
            assert st.resets == 1 and st.partial
            truth = truth_index({src.key: pub})
            assert_index_subset(client.index, truth, wl.queries)
            assert 0 < client.index.num_blocks(src.key) < truth.num_blocks(src.key)
            # A partial worker is saved without a position: resuming from it would hide that.
            client.snapshot(path)
        assert PrefixIndex.restore(path).restored_cursors == {}


@pytest.mark.anyio
async def test_a_batch_applied_off_the_event_loop_as_the_client_leaves_is_in_its_position(tmp_path: Path) -> None:
    # The native receive thread applies a batch before the event loop records its seq. A
    # client left right after such an apply must still record it: a snapshot (or a re-entry)
    # that saved the older seq would resume with the batch in the index ahead of its position
    # (chaos caught it: a "complete" worker holding one block more than its position implies).
    if not FAST.native_receive:
        pytest.skip("the Python receiver records each batch as it applies it, on the event loop")
    wl = Workload(40)
    path = tmp_path / "index.kvs"
    async with EventPublisher() as pub:
        src = pub.source("w")
        for _ in range(5):
            pub.publish(wl.batch())
        # No quiet probes: a replay in flight closes the thread's fast path (as the machine's
        # `in_order` does), and the likely reason the full suite beside a CPU hog saw "never
        # applied a batch on its own" is a probe in flight at each attempt (each failed attempt
        # blocks the loop 2 s, which makes the next probe likelier).
        client = KvEventClient([src], config=msgspec.structs.replace(FAST, quiet_interval=60.0))
        async with client:
            async with client.events() as stream:
                await settle(client, stream, {src.key: pub.next_seq - 1})
            # Synced is not subscribed (a slow joiner): with no quiet probe, a batch the PUB sent before
            # the subscription would never be recorded (the loop below publishes the next only then).
            await subscribed(client, pub, src.key)
            # No listener now: the fast path reopens at the next hand-over, then applies on the thread.
            applied_off_loop = False
            for _ in range(200):
                # The count before the publish: the thread may apply the batch before `want` is worked
                # out (a comparison with the count after it then skipped the very case looked for).
                before = client.index.num_blocks(src.key)
                seq = pub.next_seq
                pub.publish(wl.batch())
                want = truth_index({src.key: pub}).num_blocks(src.key)
                if want != before:
                    deadline = time.monotonic() + 2
                    # Not awaiting: only the thread can apply it, and the loop cannot record it.
                    while client.index.num_blocks(src.key) != want and time.monotonic() < deadline:
                        time.sleep(0.001)  # noqa: ASYNC251 (an await would let the loop record it)
                    if client.index.num_blocks(src.key) == want and seq not in _recorded(client, src.key):
                        applied_off_loop = True
                        break
                await wait_for(lambda seq=seq: seq in _recorded(client, src.key), f"seq {seq} recorded")
            assert applied_off_loop, "the thread never applied a batch on its own"
        # Left without an await since the apply: the position saved names the batch the index holds.
        client.snapshot(path)
        restored = PrefixIndex.restore(path)
        assert restored.restored_cursors == {src.key: Cursor(pub.next_seq - 1, pub.history[-1].ts)}
        assert_index_equal(restored, truth_index({src.key: pub}), wl.queries)


def _recorded(client: KvEventClient, key: WorkerKey) -> range:
    """The seqs ``key``'s source has recorded (the event loop's side of the thread's applies).

    Read from its stats, not `KvEventClient.cursors`, which would hold the thread until the
    event loop's next turn.
    """
    return range(client.stats().sources[key].last_seq + 1)


@pytest.mark.anyio
async def test_entering_the_same_client_again_resumes_where_it_stopped() -> None:
    wl = Workload(39)
    async with EventPublisher() as pub:
        src = pub.source("w")
        client = KvEventClient([src], config=FAST)
        for _ in range(15):
            pub.publish(wl.batch())
        async with client:
            await settle(client, client.events(), {src.key: 14})
        for _ in range(5):
            pub.publish(wl.batch())
        async with client:
            await settle(client, client.events(), {src.key: 19})
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)
            st = client.stats().sources[src.key]
            assert (st.batches, st.resets) == (5, 0)  # stats are per source life: the gap only


@pytest.mark.anyio
async def test_restored_workers_without_a_source_or_position_are_dropped(tmp_path: Path) -> None:
    wa, wb = Workload(35), Workload(36)
    path = tmp_path / "index.kvs"
    async with EventPublisher() as pa, EventPublisher() as pb:
        a, b = pa.source("a"), pb.source("b")
        for _ in range(10):
            pa.publish(wa.batch())
            pb.publish(wb.batch())
        async with KvEventClient([a, b], config=FAST) as client:
            stream = client.events()
            await settle(client, stream, {a.key: 9, b.key: 9})
            client.snapshot(path)
        # a: saved without a position (as a partial worker is); b: no longer configured.
        index = PrefixIndex.restore(path)
        index.restored_cursors.pop(a.key)
        gone = WorkerKey("gone", 0)
        index.restored_cursors[gone] = Cursor(3, 1.0)
        assert index.workers() == {a.key, b.key}
        async with KvEventClient([a], config=FAST, index=index) as client:
            assert client.index.workers() <= {a.key}  # b dropped at entry: no target can bring it back
            stream = client.events()
            await settle(client, stream, {a.key: 9})
            st = client.stats().sources[a.key]
            assert st.batches == 10 and st.resets == 0  # a cold start from an empty slate
            assert_index_equal(client.index, truth_index({a.key: pa}), wa.queries)
            client.snapshot(path)
        assert set(PrefixIndex.restore(path).restored_cursors) == {a.key}


@pytest.mark.anyio
async def test_restored_state_of_a_source_without_replay_is_dropped(tmp_path: Path) -> None:
    wl = Workload(37)
    path = tmp_path / "index.kvs"
    async with EventPublisher(replay_endpoint=None) as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await subscribed(client, pub, src.key)
            for _ in range(5):
                pub.publish(wl.batch())
            await settle(client, stream, {src.key: 4})
            assert not client.stats().sources[src.key].partial
            client.snapshot(path)
        index = PrefixIndex.restore(path)
        assert index.num_blocks(src.key) > 0 and src.key in index.restored_cursors
        async with KvEventClient([src], config=FAST, index=index) as client:
            assert client.index.num_blocks(src.key) == 0
            stream = client.events()
            await subscribed(client, pub, src.key)
            pub.publish(wl.batch())
            await settle(client, stream, {src.key: 5})
            assert client.stats().sources[src.key].partial
            assert_index_subset(client.index, truth_index({src.key: pub}), wl.queries)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "not a kvroute snapshot"),
        (b"\xc1 not msgpack", "not a kvroute snapshot"),
        (msgspec.msgpack.encode({"format": "other", "version": 1}), "format 'other'"),
        (msgspec.msgpack.encode({"format": "kvroute-index", "version": 99}), "snapshot version 99"),
        (msgspec.msgpack.encode({"format": "kvroute-index", "version": 1}), "corrupt"),
    ],
    ids=["empty", "garbage", "other-format", "future-version", "missing-tables"],
)
def test_corrupt_snapshots_raise_snapshot_error(tmp_path: Path, payload: bytes, message: str) -> None:
    path = tmp_path / "bad.kvs"
    path.write_bytes(payload)
    with pytest.raises(SnapshotError, match=message):
        PrefixIndex.restore(path)


def test_truncated_and_missing_snapshots_raise_snapshot_error(tmp_path: Path) -> None:
    index = PrefixIndex()
    wl = Workload(38)
    for _ in range(20):
        for ev in wl.batch():
            index.apply(WorkerKey("w", 0), ev)
    path = tmp_path / "index.kvs"
    index.snapshot(path, cursors={WorkerKey("w", 0): Cursor(19, 5.0)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="truncated"):
        PrefixIndex.restore(path)
    with pytest.raises(SnapshotError, match="cannot read"):
        PrefixIndex.restore(tmp_path / "missing.kvs")


def test_another_hash_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "index.kvs"
    PrefixIndex().snapshot(path)
    snap = msgspec.msgpack.decode(path.read_bytes())
    snap["hash_version"] += 1
    path.write_bytes(msgspec.msgpack.encode(snap))
    with pytest.raises(SnapshotError, match="content hash"):
        PrefixIndex.restore(path)


def test_an_invalid_restored_position_drops_that_worker_only(tmp_path: Path) -> None:
    path = tmp_path / "index.kvs"
    good, bad = WorkerKey("good", 0), WorkerKey("w", 0)
    PrefixIndex().snapshot(path, cursors={bad: Cursor(-5, 1.0), good: Cursor(3, 1.0)})
    client = KvEventClient(index=PrefixIndex.restore(path))  # no error for the whole fleet
    client.snapshot(tmp_path / "again.kvs")
    assert PrefixIndex.restore(tmp_path / "again.kvs").restored_cursors == {good: Cursor(3, 1.0)}


@pytest.mark.anyio
async def test_a_forged_restored_position_leaves_the_other_sources_resuming_where_they_were(tmp_path: Path) -> None:
    # Over sockets: two engines followed, snapshotted, one more worker's position forged into the file.
    # The forged worker's state is dropped; the two real sources resume from their own positions
    # (only what they published while the router was down is replayed), not cold from seq 0.
    wl_a, wl_b = Workload(41), Workload(42)
    path, forged_path = tmp_path / "index.kvs", tmp_path / "forged.kvs"
    async with EventPublisher() as pa, EventPublisher() as pb:
        a, b = pa.source("a"), pb.source("b")
        for _ in range(20):
            pa.publish(wl_a.batch())
            pb.publish(wl_b.batch())
        async with KvEventClient([a, b], config=FAST) as client:
            stream = client.events()
            await settle(client, stream, {a.key: pa.next_seq - 1, b.key: pb.next_seq - 1})
            client.snapshot(path)
        saved = PrefixIndex.restore(path)
        forged = WorkerKey("forged", 0)
        saved.snapshot(forged_path, cursors={**saved.restored_cursors, forged: Cursor(-5, math.nan)})
        for _ in range(7):  # published while the router is down
            pa.publish(wl_a.batch())
            pb.publish(wl_b.batch())
        index = PrefixIndex.restore(forged_path)
        assert set(index.restored_cursors) == {a.key, b.key, forged}
        async with KvEventClient([a, b], config=FAST, index=index) as client:
            # Taken over at once: the real positions are the sources' from the start.
            assert client.cursors() == {a.key: Cursor(19, pa.history[19].ts), b.key: Cursor(19, pb.history[19].ts)}
            stream = client.events()
            await settle(client, stream, {a.key: pa.next_seq - 1, b.key: pb.next_seq - 1})
            assert_index_equal(client.index, truth_index({a.key: pa, b.key: pb}), wl_a.queries + wl_b.queries)
            for key in (a.key, b.key):
                st = client.stats().sources[key]
                assert (st.resets, st.batches, st.partial) == (0, 7, False), (key, st)
            assert forged not in client.index.workers()


class _RecordingTap:
    """A raw tap (`kvroute._fanout.RawTap`) that keeps what it is handed, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[WorkerKey, object]] = []

    def raw(self, source: EventSource, seq: int, ts: float, payload: bytes, blocks: int) -> None:
        self.items.append((source.key, seq))

    def push(self, envelope: Envelope) -> None:
        self.items.append((envelope.source.key, envelope.seq if envelope.seq is not None else envelope.event))


@pytest.mark.anyio
async def test_restored_state_a_source_cannot_resume_is_announced_with_a_reset(tmp_path: Path) -> None:
    # A republisher (the JetStream relay) sees every index change through its tap: restored state
    # dropped because the source has no replay endpoint, or because its position was invalid, comes
    # as a Reset before that source's first batch, not silently.
    wl_a, wl_b = Workload(43), Workload(44)
    path, forged_path = tmp_path / "index.kvs", tmp_path / "forged.kvs"
    async with EventPublisher(replay_endpoint=None) as pa, EventPublisher() as pb:
        a, b = pa.source("a"), pb.source("b")
        async with KvEventClient([a, b], config=FAST) as client:
            stream = client.events()
            await subscribed(client, pa, a.key)
            await subscribed(client, pb, b.key)
            for _ in range(5):
                pa.publish(wl_a.batch())
                pb.publish(wl_b.batch())
            await settle(client, stream, {a.key: pa.next_seq - 1, b.key: pb.next_seq - 1})
            client.snapshot(path)
        saved = PrefixIndex.restore(path)
        saved.snapshot(forged_path, cursors={**saved.restored_cursors, b.key: Cursor(-5, math.nan)})
        index = PrefixIndex.restore(forged_path)
        assert index.num_blocks(a.key) > 0 and a.key in index.restored_cursors
        client = KvEventClient([a, b], config=FAST, index=index)
        tap = _RecordingTap()
        client.set_raw_tap(tap)
        async with client:
            assert client.index.num_blocks(a.key) == 0 and client.index.num_blocks(b.key) == 0
            for key in (a.key, b.key):
                first = next(ev for k, ev in tap.items if k == key)
                assert isinstance(first, Reset) and first.reason == "no-replay", (key, tap.items)
            # One each, at entry (nothing else reset them).
            assert sum(isinstance(ev, Reset) for _, ev in tap.items) == 2, tap.items
