"""A gateway stream the client trusts: ranks it carries, snapshots it begins with, discovery it spares.

Real grpcio servers on 127.0.0.1 (the simulated servicer of `kvroute.sim`, and a scripted servicer
for shapes the simulator does not send), both anyio backends. Indexes are compared with the
simulated engines' own caches (`PrefixCache.match_blocks`: ground truth kvroute did not compute).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import anyio
import grpc
import pytest
from _publisher_helpers import served

from kvroute import KvEventClient, WorkerKey
from kvroute._proto import smg_common_pb2 as pb
from kvroute.sim import SimConfig, SimEngine

pytestmark = pytest.mark.anyio

BS = 4
PROMPTS = [[(13 * i + j) % 83 + 1 for j in range(20 + (i % 5) * 4)] for i in range(20)]


def gw(**kw: Any) -> SimEngine:
    fields: dict[str, Any] = {"gateway": "vllm", "block_size": BS, "http_port": None, "capacity_blocks": 256}
    fields.update(kw)
    return SimEngine(SimConfig(**fields))


async def until(cond: Callable[[], bool], seconds: float = 30.0) -> None:
    """Poll ``cond`` (state moved by gRPC threads and the engine: nothing to wait on) within ``seconds``."""
    with anyio.fail_after(seconds):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.02)


def differences(client: KvEventClient, eng: SimEngine) -> list[str]:
    """Where the index disagrees with a rank's cache (a partial worker may hold less, never more)."""
    out = []
    for src in client.sources():
        status = client.worker_status(src.key)
        assert status is not None
        for p in PROMPTS:
            got, want = client.index.find_matches(p).get(src.key, 0), served(eng.cache(src.dp_rank), p)
            if got > want or (got != want and not status.partial):
                out.append(f"{src.key}: {got} != {want}")
    return out


async def agrees(client: KvEventClient, eng: SimEngine, ranks: int) -> None:
    bad: list[str] = []
    try:
        with anyio.fail_after(30):
            while True:
                bad = differences(client, eng)
                stats = client.stats().sources
                if not bad and len(stats) == ranks and all(st.connected for st in stats.values()):
                    return
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"index never agreed with the caches: {bad}") from None


async def test_a_rank_getloads_leaves_out_is_followed_from_its_first_batch(anyio_backend: str) -> None:
    # The real vLLM servicer's GetLoads names a rank only once it has stats: at the moment a
    # router discovers a fresh engine, one rank of two. The stream carries both.
    async with gw(ranks=2) as eng:
        eng.gateway.ranks = 1  # GetLoads answers 1; both publishers feed the stream
        async with KvEventClient(targets=[eng.grpc_target], discovery_interval=0.2) as client:
            await until(lambda: len(client.sources()) == 1 and client.stats().totals.connected == 1)
            for i, p in enumerate(PROMPTS):
                await eng.complete(p, 4, rank=i % 2)
            await agrees(client, eng, ranks=2)
            stats = client.stats()
            assert stats.adopted_sources == 1
            rank1 = stats.sources[WorkerKey(eng.grpc_target, 1)]
            # Its history began at its seq 0 on a live stream: complete, not partial.
            assert rank1.batches > 0 and not rank1.partial and rank1.state == "synced"
            # Discovery keeps answering "1 rank" every 0.2 s: a rank the live stream carries stays.
            await anyio.sleep(1.0)
            assert len(client.sources()) == 2 and client.stats().removed_sources == 0
            await eng.complete(PROMPTS[0], 4, rank=1)
            await agrees(client, eng, ranks=2)


async def test_a_stream_that_begins_with_a_complete_snapshot_leaves_the_worker_exact(anyio_backend: str) -> None:
    # The servicer's history no longer reaches seq 0 (4 batches kept), but its record began at
    # seq 0: it sends a snapshot with unknown_before = 0, which vouches for the whole state.
    async with gw(ranks=1, gateway_history=4) as eng:
        for p in PROMPTS[:10]:
            await eng.complete(p, 4, rank=0)
        async with KvEventClient(targets=[eng.grpc_target]) as client:
            await client.wait_synced(30)
            await agrees(client, eng, ranks=1)
            assert eng.gateway.snapshots_served >= 1
            for p in PROMPTS[10:]:
                await eng.complete(p, 4, rank=0)  # live batches after the snapshot continue it
            await agrees(client, eng, ranks=1)
            (st,) = client.stats().sources.values()
            assert not st.partial and st.state == "synced"
            status = client.worker_status(WorkerKey(eng.grpc_target, 0))
            assert status is not None and status.synced and not status.partial


async def test_discovery_rounds_do_not_open_a_stream_while_one_is_live(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng:
        async with KvEventClient(targets=[eng.grpc_target], discovery_interval=0.1) as client:
            await until(lambda: client.stats().totals.connected == 2)
            # A round that began before the stream was live may still be opening its probe: rounds are
            # sequential, and such a round makes at most two calls (probe, GetLoads), so three more calls
            # mean it is over (a loaded machine once counted its probe after this point).
            calls = eng.gateway.calls
            await until(lambda: eng.gateway.calls >= calls + 3)
            opened = eng.gateway.streams_opened
            await anyio.sleep(1.5)  # ~15 discovery rounds
            assert eng.gateway.streams_opened == opened
            assert len(client.sources()) == 2
        # Without a live stream a round still finds the target, by opening one (the probe).
        async with KvEventClient(targets=[eng.grpc_target]) as client:
            await client.wait_synced(30)
            assert len(client.sources()) == 2


# --- a scripted servicer: snapshots the simulator sends only at a stream's start --------------------

SERVICE = "vllm.grpc.engine.VllmEngine"


class Scripted:
    """``SubscribeKvEvents`` streaming whatever the test queues (None ends the stream), ``GetLoads`` = 1 rank."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def subscribe(self, request: pb.SubscribeKvEventsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.send_initial_metadata(())
        while context.is_active():
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    def get_loads(self, request: pb.RankCountRequest, context: grpc.ServicerContext) -> pb.RankCountResponse:
        return pb.RankCountResponse(dp_rank_count=1)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(
                    self.subscribe, request_deserializer=pb.SubscribeKvEventsRequest.FromString
                ),
                "GetLoads": grpc.unary_unary_rpc_method_handler(
                    self.get_loads,
                    request_deserializer=pb.RankCountRequest.FromString,
                    response_serializer=pb.RankCountResponse.SerializeToString,
                ),
            },
        )


def store(batch: pb.KvEventBatch, hashes: list[int], tokens: list[int]) -> None:
    ev = batch.events.add().stored
    ev.tier = pb.KV_CACHE_TIER_DEVICE
    for i, h in enumerate(hashes):
        ev.blocks.add(block_hash=h, token_ids=tokens[i * BS : (i + 1) * BS], block_size=BS)


async def test_a_snapshot_mid_stream_replaces_what_the_worker_held(anyio_backend: str) -> None:
    # A snapshot is the rank's whole state: blocks the client held that it leaves out are gone
    # (chunk 0 here carries no AllBlocksCleared: replacing the state is the snapshot's meaning).
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[servicer.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        a_tokens, b_tokens = list(range(1, 9)), list(range(50, 54))
        async with KvEventClient(targets=[target]) as client:
            key = WorkerKey(target, 0)
            await until(lambda: client.stats().totals.connected == 1)
            live = pb.KvEventBatch(sequence_number=0, timestamp=time.time(), dp_rank=0)
            store(live, [11, 12], a_tokens)
            store(live, [21], b_tokens)
            servicer.queue.put(live.SerializeToString())
            await until(lambda: client.index.find_matches([*a_tokens, 0]).get(key, 0) == 2)
            assert client.index.find_matches([*b_tokens, 0]).get(key, 0) == 1
            snap = pb.KvEventBatch(sequence_number=1, timestamp=time.time(), dp_rank=0)
            snap.snapshot.CopyFrom(pb.KvSnapshotChunk(index=0, count=1, blocks=1, unknown_before=0))
            store(snap, [21], b_tokens)
            servicer.queue.put(snap.SerializeToString())
            await until(lambda: client.stats().sources[key].last_seq == 1)
            assert client.index.find_matches([*a_tokens, 0]).get(key, 0) == 0  # left out: no longer claimed
            assert client.index.find_matches([*b_tokens, 0]).get(key, 0) == 1
            status = client.worker_status(key)
            assert status is not None and status.synced and not status.partial
            servicer.queue.put(None)
    finally:
        server.stop(None)
