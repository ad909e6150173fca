"""`KvEventClient` on the JetStream transport (docs/replicas.md): a relay's log as the client's sources.

Against a real ``nats-server -js`` on loopback (`test_jetstream.NatsServer`). The client follows the log,
never the engines; it must hold what a client following the engines directly holds, name its sources
by the log's workers, and carry the log's resets, partial histories, gaps and removals into its own
views (worker status, stats, events) as it does for engines.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest
from _publisher_helpers import FAST
from test_jetstream import Fleet, NatsServer, _batch, _steady, assert_same, client_at, nats_server

from kvroute import (
    BlockStored,
    ConfigError,
    JetStreamRelay,
    JetStreamReplica,
    KvEventClient,
    NotSyncedError,
    Partial,
    Removed,
    Reset,
    Router,
    WorkerKey,
)
from kvroute._jetstream import _Partial, _Removed, _Reset, encode_record, ensure_stream, worker_subject
from kvroute._transports.jetstream import JetStreamSource
from kvroute.sim import EventPublisher

__all__ = ["nats_server"]  # the fixture, imported for this module's tests


@pytest.mark.anyio
async def test_a_client_on_the_log_holds_what_a_direct_client_holds(nats_server: NatsServer) -> None:
    async with EventPublisher() as p0, EventPublisher() as p1, EventPublisher() as p2:
        fleet = Fleet([p0, p1, p2])
        fleet.step(20)
        source = JetStreamSource.from_url(f"{nats_server.url}/C")
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            JetStreamRelay(nats_server.url, fleet.sources(), stream="C", config=FAST, snapshot_interval=0.3) as relay,
            KvEventClient(jetstream=source) as follower,
        ):
            events = follower.events()
            await relay.wait_synced(10)
            await follower.wait_synced(10)
            await _steady(fleet, 20)
            last = fleet.last()
            await client_at(direct, last)
            # The log named the sources: one per worker, on the stream's endpoint, no replay endpoint.
            await client_at(follower, last)
            assert {s.key for s in follower.sources()} == set(last)
            assert {s.endpoint for s in follower.sources()} == {source.endpoint}
            assert_same(follower.index, direct.index, fleet.queries())
            stats = follower.stats()
            assert stats.totals.synced == 3 and stats.totals.resets == 0 and stats.totals.uncovered == 0
            assert stats.totals.batches == sum(s + 1 for s in last.values())
            for key in last:
                status = follower.worker_status(key)
                assert status is not None and status.state == "synced" and not status.partial
            log_stats = source.stats()
            assert (log_stats.gaps, log_stats.stream_gaps, log_stats.undecodable, log_stats.workers) == (0, 0, 0, 3)
            # A router on the follower routes as on the direct client.
            query = fleet.queries()[0]
            chosen = Router(follower.index, states=follower, seed=1).select(query)
            assert chosen == Router(direct.index, states=direct, seed=1).select(query)
            # Listeners get the engines' events (decoded for them only).
            with anyio.fail_after(10):
                async for env in events:
                    if isinstance(env.event, BlockStored):
                        assert env.source.endpoint == source.endpoint and env.seq is not None
                        break
            # A client started later starts from the newest snapshot, then the log after it.
            await anyio.sleep(0.5)
            assert relay.stats().snapshots > 0
            late_source = JetStreamSource(nats_server.url, stream="C")
            async with KvEventClient(jetstream=late_source) as late:
                await late.wait_synced(10)
                assert late_source.stats().snapshot_seq > 0
                # A restored worker's position is not a batch applied here.
                assert late.stats().totals.batches < sum(s + 1 for s in last.values())
                await _steady(fleet, 5)
                last = fleet.last()
                await client_at(direct, last)
                await client_at(late, last)
                assert_same(late.index, direct.index, fleet.queries())
                assert late.cursors() == {k: c for k, c in direct.cursors().items()}
                assert late.stats().totals.synced == 3


async def _publish(url: str, stream: str, records: list[tuple[WorkerKey, bytes]]) -> None:
    """Write records to the log by hand (what a relay would write), on a plain nats-py connection."""
    import nats

    async def main() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            await ensure_stream(js, stream, "memory", 0.0, 120.0)
            for key, data in records:
                await js.publish(worker_subject(stream, key), data)
        finally:
            await nc.close()

    # nats-py is asyncio-only: its own loop in a thread, so the test runs on trio too.
    await anyio.to_thread.run_sync(asyncio.run, main())


@pytest.mark.anyio
async def test_the_logs_resets_gaps_and_removals_reach_the_clients_views(nats_server: NatsServer) -> None:
    w, v = WorkerKey("w", 0), WorkerKey("v", 0)
    source = JetStreamSource(nats_server.url, stream="L")
    # Before the stream exists the client waits for it, and says so.
    async with KvEventClient(jetstream=source) as client:
        with pytest.raises(NotSyncedError) as info:
            await client.wait_synced(0.5)
        assert source.endpoint in info.value.targets and source.endpoint in str(info.value)
        events = client.events()
        await _publish(nats_server.url, "L", [(w, _batch(0, None, [1])), (w, _batch(1, 0, [2]))])
        await _publish(nats_server.url, "L", [(v, _batch(0, None, [7], worker="v"))])
        await client.wait_synced(10)
        with anyio.fail_after(10):
            while client.index.num_blocks(w) != 2:  # noqa: ASYNC110 (the log's records, polled)
                await anyio.sleep(0.02)
        assert client.cursors()[w].seq == 1 and not client.worker_status(w).partial  # type: ignore[union-attr]
        # prev 3 while the client holds up to 1: the log lost batches, the old blocks are not trusted.
        await _publish(nats_server.url, "L", [(w, _batch(4, 3, [5]))])
        with anyio.fail_after(10):
            while client.cursors().get(w, None) is None or client.cursors()[w].seq != 4:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert client.index.num_blocks(w) == 1 and client.worker_status(w).partial  # type: ignore[union-attr]
        assert source.stats().gaps == 1 and client.stats().sources[w].resets == 1
        # The relay's reset: nothing held, a whole history again; then its partial mark.
        await _publish(nats_server.url, "L", [(w, encode_record(_Reset("w", 0, "restart", "engine restarted")))])
        with anyio.fail_after(10):
            while client.index.num_blocks(w):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert w not in client.cursors() and not client.worker_status(w).partial  # type: ignore[union-attr]
        await _publish(nats_server.url, "L", [(w, encode_record(_Partial("w", 0, "not-in-buffer", 9)))])
        with anyio.fail_after(10):
            while not client.worker_status(w).partial:  # type: ignore[union-attr]  # noqa: ASYNC110
                await anyio.sleep(0.02)
        # A removal removes the source, as discovery losing an engine does.
        await _publish(nats_server.url, "L", [(v, encode_record(_Removed("v", 0, "gone from discovery")))])
        with anyio.fail_after(10):
            while v in client.live_workers():  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert client.index.num_blocks(v) == 0 and {s.key for s in client.sources()} == {w}
        seen: list[object] = []
        with anyio.move_on_after(1.0):
            async for env in events:
                seen.append(env.event)
        kinds = [type(e) for e in seen]
        assert Reset in kinds and Partial in kinds and Removed in kinds
        removed = [e for e in seen if isinstance(e, Removed)]
        assert removed[0].reason == "gone from discovery"


def test_the_jetstream_url() -> None:
    src = JetStreamSource.from_url("nats://nats:4222/LOG")
    assert (src.servers, src.stream, src.endpoint) == (["nats://nats:4222"], "LOG", "nats://nats:4222/LOG")
    assert JetStreamSource.from_url("tls://nats:4222").stream == "KVROUTE"
    for bad in ("http://nats:4222/LOG", "nats:///LOG", "nats://nats:4222/a.b", "nats4222"):
        with pytest.raises(ConfigError):
            KvEventClient(jetstream=bad)


@pytest.mark.anyio
async def test_the_replica_class_and_the_client_read_the_same_log(nats_server: NatsServer) -> None:
    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        async with (
            JetStreamRelay(nats_server.url, fleet.sources(), stream="S", config=FAST, snapshot_interval=0.3) as relay,
            JetStreamReplica(nats_server.url, stream="S") as replica,
            KvEventClient(jetstream=f"{nats_server.url}/S") as client,
        ):
            await relay.wait_synced(10)
            await _steady(fleet, 10)
            last = fleet.last()
            await client_at(client, last)
            with anyio.fail_after(20):
                while {k: c.seq for k, c in replica.cursors().items()} != last:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            assert_same(client.index, replica.index, fleet.queries())
            assert client.cursors() == replica.cursors()


def test_the_relays_payloads_are_the_engines_batches() -> None:
    # What the relay writes for a decoded batch (`encode_payload`) reads back as that batch, in Python and in
    # the core, whichever engine form it arrived in: map, tagged array, SGLang's signed hashes.
    from _publisher_helpers import Workload
    from test_jetstream import digest

    from kvroute import PrefixIndex, decode_batch, encode_batch
    from kvroute._jetstream_publish import encode_payload
    from kvroute._wire import BlockRemoved, EventBatch

    extra = EventBatch(
        ts=5.5,
        events=[
            BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=7,
                lora_name="adapter",
                medium="CPU",
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
                extra_keys=[None, [3]],
            ),
            BlockRemoved(block_hashes=[1], medium="CPU", group_idx=1),
        ],
    )
    wl = Workload(seed=11)
    batches = [EventBatch(ts=float(i), events=wl.batch()) for i in range(300)] + [extra]
    engine, relayed = PrefixIndex(), PrefixIndex()
    w = WorkerKey("w", 0)
    for i, batch in enumerate(batches):
        form = ("map", "array")[i % 2]
        wire = encode_batch(batch, form=form, signed_hashes=i % 3 == 0)
        decoded = decode_batch(wire)
        ours = encode_payload(decoded.ts, decoded.events)
        assert decode_batch(ours) == decoded
        a, b = engine.apply_payload(w, wire), relayed.apply_payload(w, ours)
        assert a.ok and b.ok and a.stored_blocks == b.stored_blocks
    assert digest(engine) == digest(relayed)


def test_the_replica_and_the_transport_take_one_set_of_options() -> None:
    from kvroute import Limits
    from kvroute._jetstream_log import LogSource

    limits = Limits(max_events_per_batch=7)
    replica = JetStreamReplica(
        ["nats://a:4222", "nats://b:4222"], stream="S", use_snapshot=False, connect_timeout=2.0, name="r", limits=limits
    )
    source = JetStreamSource(
        ["nats://a:4222", "nats://b:4222"], stream="S", use_snapshot=False, connect_timeout=2.0, name="r", limits=limits
    )
    assert isinstance(replica.source, LogSource) and isinstance(source, LogSource)
    assert vars(replica.source) == {k: v for k, v in vars(source).items() if not k.startswith("_")}
    assert replica.stream == source.stream == "S" and source.endpoint == "nats://a:4222/S"
    for kind in (JetStreamReplica, JetStreamSource):
        with pytest.raises(ConfigError):
            kind("nats://a:4222", stream="bad.name")
        with pytest.raises(ConfigError):
            kind([])
        with pytest.raises(ConfigError):
            kind("nats://a:4222", connect_timeout=0)
