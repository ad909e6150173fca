"""The gateway servicers' ``SubscribeKvEvents`` stream as a source transport (docs/protocol.md §6).

Real grpcio servers on 127.0.0.1 (the simulated servicer of `kvroute.sim`), both anyio backends.
Every index is compared with the simulated engines' own caches (`PrefixCache.match_blocks`,
ground truth kvroute did not compute): equal for a complete worker, never more for a partial one.
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Callable, Sequence

import anyio
import grpc
import msgspec
import pytest
from _publisher_helpers import served

from kvroute import KvEventClient, LoadPolicy, MultimodalItem, PrefixIndex, Router, WorkerKey, decode_batch, discover
from kvroute._load import EngineLoad, EngineLoads
from kvroute._models import GATEWAY_SERVICES
from kvroute._proto import smg_common_pb2 as pb
from kvroute._source import Apply, ResetWorker, SourceMachine
from kvroute._wire import AllBlocksCleared, BlockStored, EventBatch, Limits
from kvroute._wire_proto import convert_batch
from kvroute.cli._watch import TierTally, plain_table, rows
from kvroute.sim import SimConfig, SimEngine

pytestmark = pytest.mark.anyio

BS = 4
PROMPTS = [[(7 * i + j) % 97 + 1 for j in range(24 + (i % 5) * 4)] for i in range(24)]


def gw(**kw: object) -> SimEngine:
    fields: dict[str, object] = {"gateway": "vllm", "block_size": BS, "http_port": None, "capacity_blocks": 256}
    fields.update(kw)
    return SimEngine(SimConfig(**fields))  # type: ignore[arg-type]


async def traffic(eng: SimEngine, prompts: Sequence[list[int]], *, offset: int = 0) -> None:
    for i, p in enumerate(prompts):
        await eng.complete(p, 4, rank=(i + offset) % eng.config.ranks)


def mismatch(client: KvEventClient, eng: SimEngine) -> list[str]:
    """What disagrees with the engine's caches now (a partial worker may hold less, never more)."""
    out = []
    for src in client.sources():
        if src.target != eng.grpc_target:
            continue
        status = client.worker_status(src.key)
        assert status is not None
        cache = eng.cache(src.dp_rank)
        for p in PROMPTS:
            got, want = client.index.find_matches(p).get(src.key, 0), served(cache, p)
            if got > want:
                out.append(f"{src.key} claims {got} > {want} blocks (false claim)")
            elif got != want and not status.partial:
                out.append(f"{src.key}: {got} != {want}")
    return out


async def settled(client: KvEventClient, eng: SimEngine, seconds: float = 20.0) -> None:
    """Wait until the index agrees with every rank's cache (events in flight make it lag until then)."""
    bad: list[str] = []
    try:
        with anyio.fail_after(seconds):
            while True:
                bad = mismatch(client, eng)
                stats = [st for k, st in client.stats().sources.items() if k.worker_id == eng.grpc_target]
                if not bad and len(stats) == len(discovered(client, eng)) > 0 and all(st.connected for st in stats):
                    return
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"index never agreed with the caches: {bad}") from None


def discovered(client: KvEventClient, eng: SimEngine) -> list[WorkerKey]:
    return [s.key for s in client.sources() if s.target == eng.grpc_target]


async def until(cond: Callable[[], bool], seconds: float = 20.0) -> None:
    """Poll ``cond`` (state changed by gRPC threads and the engine: nothing to wait on) within ``seconds``."""
    with anyio.fail_after(seconds):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.02)


# --- discovery ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", sorted(GATEWAY_SERVICES.values()))
async def test_auto_discovery_finds_each_servicer(anyio_backend: str, label: str) -> None:
    async with gw(gateway=label, ranks=2) as eng:
        sources = await discover(eng.grpc_target)
        service = next(s for s, v in GATEWAY_SERVICES.items() if v == label)
        # vLLM, SGLang and TokenSpeed answer GetLoads with their rank count; TRT-LLM and MLX have none.
        ranks = 2 if label in ("vllm", "sglang", "tokenspeed") else 1
        assert [s.dp_rank for s in sources] == list(range(ranks))
        assert {s.endpoint for s in sources} == {f"grpc://{eng.grpc_target}/{service}"}
        assert {s.engine for s in sources} == {label}
        assert {s.replay_endpoint for s in sources} == {None}
        assert await discover(eng.grpc_target, engine="gateway") == sources


# --- the stream through the client -------------------------------------------------------------------


async def test_an_idle_engine_is_synced_without_a_batch(anyio_backend: str) -> None:
    # The relay streams live events only: an engine that publishes nothing has no history to
    # wait for, so wait_synced returns (its worker holds nothing, and claims nothing).
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await client.wait_synced(20)
        stats = client.stats().sources
        assert len(stats) == 2 and all(st.state == "synced" and st.batches == 0 for st in stats.values())
        assert client.index.num_blocks() == 0
        await traffic(eng, PROMPTS[:4])
        await settled(client, eng)


async def test_multi_rank_live_stream_matches_the_caches(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: len(client.sources()) == 2 and all(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS)
        await settled(client, eng)
        stats = client.stats().sources
        assert all(st.state == "synced" and not st.partial for st in stats.values())
        assert sum(st.batches for st in stats.values()) > 10
        assert all(st.load is not None for st in stats.values())  # every batch carries the engine's load
        await until(lambda: eng.gateway.subscribers == 1)  # one stream for both ranks (the discovery probe ended)
        assert client.index.num_blocks() > 0


async def test_a_late_subscriber_gets_the_history_and_then_a_snapshot(anyio_backend: str) -> None:
    async with gw(ranks=2, gateway_history=1_000) as eng:
        await traffic(eng, PROMPTS[:12])
        # The history still reaches seq 0: replayed in full, complete.
        async with KvEventClient(targets=[eng.grpc_target]) as client:
            await settled(client, eng)
            assert not any(st.partial for st in client.stats().sources.values())
        assert eng.gateway.snapshots_served == 0
    async with gw(ranks=2, gateway_history=3) as eng:
        await traffic(eng, PROMPTS)
        # History rolled: a snapshot per rank; the servicer saw everything, so it is complete.
        async with KvEventClient(targets=[eng.grpc_target]) as client:
            await settled(client, eng)
            assert not any(st.partial for st in client.stats().sources.values())
            assert eng.gateway.snapshots_served >= 2  # (the discovery probe was served one too)
            await traffic(eng, PROMPTS[::-1], offset=1)  # live batches continue the snapshot's seqs
            await settled(client, eng)
            assert all(st.gaps == 0 for st in client.stats().sources.values())


async def test_servicer_restart_resume_refused_then_partial_snapshot(anyio_backend: str) -> None:
    async with gw(ranks=1, gateway_history=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: any(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS[:8])
        await settled(client, eng)
        await eng.restart_gateway()  # history and record lost; the engine keeps its cache
        # The client tries to resume (one rank) and is refused (OUT_OF_RANGE): the new record holds
        # nothing yet. (Traffic first would race the reconnect: a record that already holds the
        # resume seq serves it, and the run continues exactly, neither partial nor reset.)
        await until(lambda: eng.gateway.refusals >= 1)
        await traffic(eng, PROMPTS[8:16])
        await settled(client, eng)
        (st,) = client.stats().sources.values()
        assert st.partial and st.resets >= 1
        # A second router joining now gets a snapshot of a record that began mid-life: partial.
        async with KvEventClient(targets=[eng.grpc_target]) as late:
            await until(lambda: any(s.batches for s in late.stats().sources.values()))
            await settled(late, eng)
            (st2,) = late.stats().sources.values()
            assert st2.partial
        assert eng.gateway.snapshots_served >= 1


async def test_a_single_rank_stream_resumes_where_it_stopped(anyio_backend: str) -> None:
    async with gw(ranks=1) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: any(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS[:8])
        await settled(client, eng)
        eng.gateway.end_streams(grpc.StatusCode.UNAVAILABLE)
        await traffic(eng, PROMPTS[8:])  # published while the stream is down: served from history
        await settled(client, eng)
        (st,) = client.stats().sources.values()
        assert (st.resets, st.partial, st.gaps) == (0, False, 0)
        assert eng.gateway.refusals == 0 and eng.gateway.streams_opened >= 2


async def test_data_loss_clears_the_rank_and_resubscribes(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: len(client.sources()) == 2 and all(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS[:10])
        await settled(client, eng)
        eng.gateway.lose(0)  # a gap rank 0's relay could not fill
        await traffic(eng, PROMPTS[10:], offset=0)
        await settled(client, eng)
        stats = client.stats().sources
        r0 = next(st for k, st in stats.items() if k.dp_rank == 0)
        r1 = next(st for k, st in stats.items() if k.dp_rank == 1)
        assert r0.partial and r0.resets >= 1  # its record starts over mid-life
        assert not r1.partial  # the other rank's record reaches seq 0: replayed in full
        assert eng.gateway.data_losses >= 1


async def test_engine_restart_is_data_loss_then_complete_again(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: len(client.sources()) == 2 and all(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS[:10])
        await settled(client, eng)
        await eng.restart()  # seqs start over; no AllBlocksCleared
        await traffic(eng, PROMPTS[10:])
        await settled(client, eng)
        # The servicer saw the new processes from seq 0: complete again, old blocks gone.
        stats = client.stats().sources
        assert not any(st.partial for st in stats.values())
        assert all(st.resets >= 1 for st in stats.values() if st.batches)
        assert eng.gateway.data_losses >= 1


async def test_load_only_heartbeats_admit_nothing(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(
            lambda: all(s.load is not None for s in client.stats().sources.values()) and len(client.sources()) == 2
        )
        stats = client.stats().sources
        assert all(st.batches == 0 and st.messages >= 1 and st.last_seq == -1 for st in stats.values())
        assert client.index.num_blocks() == 0
        first = {k: st.load.sample for k, st in stats.items() if st.load is not None}
        await until(lambda: all((s.load.sample if s.load else 0) > first[k] for k, s in client.stats().sources.items()))


async def test_malformed_messages_are_counted_and_the_stream_goes_on(anyio_backend: str) -> None:
    async with gw(ranks=1) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(lambda: any(s.connected for s in client.stats().sources.values()))
        eng.gateway.inject(b"\x0a\xff\xff\xff")  # not a KvEventBatch
        stray = pb.KvEventBatch(sequence_number=3, timestamp=1.0, dp_rank=9)  # a rank nobody announced
        eng.gateway.inject(stray.SerializeToString())
        # The stream is the truth about which ranks exist (issue 20): the stray batch starts rank 9,
        # a source whose history begins at its seq 3 (partial), counted in the client's stats.
        # Adoption is counted when the stream meets the rank; the new source's driver applies the
        # stray batch when its task first runs (later, on a loaded host): wait for that, not for the count.
        stray_key = WorkerKey(eng.grpc_target, 9)

        def stray_is_partial() -> bool:
            stats = client.stats()
            return stats.adopted_sources == 1 and stray_key in stats.sources and stats.sources[stray_key].partial

        await until(stray_is_partial)
        client.remove_source(stray_key)  # the simulated engine has no rank 9 to compare with
        await traffic(eng, PROMPTS[:8])
        await settled(client, eng)
        (st,) = client.stats().sources.values()
        assert st.skipped_frames == 1 and st.resets == 0 and not st.partial


async def test_engine_load_reaches_the_router_and_vetoes_a_wedged_engine(anyio_backend: str) -> None:
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target]) as client:
        await until(
            lambda: len(client.sources()) == 2 and all(s.load is not None for s in client.stats().sources.values())
        )
        router = Router(client.index, states=client, block_size=BS)
        assert router.engine_loads is client.engine_loads
        keys = sorted(client.live_workers())
        eng.silence_ms = 120_000  # both ranks report a wedged engine
        await until(lambda: all((client.engine_loads.get(k) or EngineLoad()).engine_silence_ms for k in keys))
        decision = router.select(PROMPTS[0])  # every candidate vetoed: the veto does not empty the field
        assert decision.worker in keys
        eng.silence_ms = None
        await until(lambda: not any((client.engine_loads.get(k) or EngineLoad()).engine_silence_ms for k in keys))
        assert router.select(PROMPTS[0]).worker in keys
        # `kvroute watch` shows the reported load per worker.
        table = rows(client, TierTally(), {})
        assert [r.load.split()[0] for r in table] == ["0/0", "0/0"] and "load" in plain_table(table)


# --- pure parts: the mapping, the load model, the machine's new inputs ---------------------------------


def test_proto_events_map_onto_the_msgpack_structs() -> None:
    # The vllm-mm production shape (docs/protocol.md §3.1) through the msgpack decoder ...
    golden = decode_batch(
        bytes.fromhex(
            "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd012d"
            "cd012eb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
            "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
            "9192a9696d672d7368612d31029192a9696d672d7368612d3102a967726f75705f69647800b26b765f63616368655f73"
            "7065635f6b696e64ae66756c6c5f617474656e74696f6e00"
        )
    )
    (want,) = golden.events
    # ... and the same store as a servicer streams it.
    mm = pb.KvBlockExtraKey(multimodal=pb.KvMultimodalKey(identifier="img-sha-1", offset=2))
    stored = pb.KvBlocksStored(
        tier=pb.KV_CACHE_TIER_DEVICE,
        medium="GPU",
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        locality=pb.KV_CACHE_LOCALITY_LOCAL,
    )
    stored.blocks.add(block_hash=301, token_ids=[1, 2, 3, 4], block_size=4, extra_keys=[mm])
    stored.blocks.add(block_hash=302, token_ids=[5, 6, 7, 8], block_size=4, extra_keys=[mm])
    msg = pb.KvEventBatch(sequence_number=0, timestamp=1700000000.5, dp_rank=0)
    msg.events.add(stored=stored)
    batch, unknown, unusable = convert_batch(msg, Limits())
    assert batch is not None and (unknown, unusable) == (0, 0)
    (got,) = batch.events
    assert isinstance(got, BlockStored) and isinstance(want, BlockStored)
    for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "extra_keys", "group_idx"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.kv_cache_spec_kind == want.kv_cache_spec_kind and got.medium == "GPU" and got.locality == "LOCAL"
    # Both paths index it alike.
    a, b = PrefixIndex(), PrefixIndex()
    w = WorkerKey("w", 0)
    a.apply(w, want)
    b.apply(w, got)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    answers = [
        (a.find_matches(tokens, mm_items=q).get(w, 0), b.find_matches(tokens, mm_items=q).get(w, 0))
        for q in ([], *([MultimodalItem("img-sha-1", 2, n)] for n in range(1, 7)))
    ]
    assert all(x == y for x, y in answers) and answers[0] == (0, 0) and max(x for x, _ in answers) >= 1


def test_a_relayed_salted_store_keys_like_the_msgpack_one() -> None:
    # vllm-salt (docs/protocol.md §3.1) as vLLM publishes it, and as the relay forwards it: the salt
    # stays in block 0's extra keys and is also named in cache_salt.
    golden = decode_batch(
        bytes.fromhex(
            "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392ccc9cc"
            "cab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f7369"
            "7a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a8"
            "74656e616e742d61c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474"
            "656e74696f6e00"
        )
    )
    stored = pb.KvBlocksStored(tier=pb.KV_CACHE_TIER_DEVICE, group_idx=0, kv_cache_spec_kind="full_attention")
    stored.cache_salt = "tenant-a"
    stored.blocks.add(
        block_hash=201, token_ids=[1, 2, 3, 4], block_size=4, extra_keys=[pb.KvBlockExtraKey(text="tenant-a")]
    )
    stored.blocks.add(block_hash=202, token_ids=[5, 6, 7, 8], block_size=4)
    msg = pb.KvEventBatch(sequence_number=0, timestamp=1.0)
    msg.events.add(stored=stored)
    batch, _, _ = convert_batch(msg, Limits())
    assert batch is not None
    a, b, w = PrefixIndex(), PrefixIndex(), WorkerKey("w", 0)
    a.apply_batch(w, golden)
    b.apply_batch(w, batch)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 2 whole blocks and a last token
    for index in (a, b):
        assert index.find_matches(tokens, cache_salt="tenant-a").get(w) == 2
        assert index.find_matches(tokens).get(w, 0) == 0


def test_tiers_hashes_namespaces_and_legacy_cache_level() -> None:
    msg = pb.KvEventBatch(sequence_number=5, timestamp=2.0)
    legacy = pb.KvBlocksStored(parent_block_hash=-1, lora_name="sql-lora", cache_salt="tenant-a", ownership="engine")
    legacy.blocks.add(block_hash=-101, token_ids=[1, 2, 3], block_size=4, cache_level=1)  # short last page
    msg.events.add(stored=legacy)
    msg.events.add(removed=pb.KvBlocksRemoved(block_hashes=[-101], tier=pb.KV_CACHE_TIER_DISK, group_idx=2))
    msg.events.add(removed=pb.KvBlocksRemoved(block_hashes=[7], cache_level=3))
    msg.events.add(cleared=pb.KvCacheCleared())
    msg.events.add()  # an event of a kind this kvroute does not know
    bad = pb.KvBlocksStored()
    bad.blocks.add(block_hash=1, token_ids=[1, 2, 3, 4], block_size=4)
    bad.blocks.add(block_hash=2, token_ids=[1, 2], block_size=2)  # blocks of different sizes
    msg.events.add(stored=bad)
    odd = pb.KvBlocksStored()
    odd.blocks.add(block_hash=3, token_ids=[1, 2, 3, 4], block_size=4, extra_keys=[pb.KvBlockExtraKey()])
    msg.events.add(stored=odd)  # an extra key of no known kind: the event goes, not a guess
    batch, unknown, unusable = convert_batch(msg, Limits())
    assert batch is not None and (unknown, unusable) == (1, 2)
    st, rm, rm2, clr = batch.events
    assert isinstance(st, BlockStored)
    assert st.block_hashes == [(1 << 64) - 101] and st.parent_block_hash == (1 << 64) - 1
    assert (st.medium, st.lora_name, st.cache_salt, st.ownership, st.token_ids) == (
        "CPU",
        "sql-lora",
        "tenant-a",
        "engine",
        [1, 2, 3],
    )
    assert (rm.medium, rm.group_idx, rm2.medium) == ("DISK", 2, "EXTERNAL")  # type: ignore[union-attr]
    assert isinstance(clr, AllBlocksCleared)
    assert convert_batch(pb.KvEventBatch(timestamp=math.nan), Limits())[0] is None
    too_many = pb.KvEventBatch(timestamp=1.0)
    for _ in range(3):
        too_many.events.add(cleared=pb.KvCacheCleared())
    assert convert_batch(too_many, Limits(max_events_per_batch=2))[0] is None


def test_blend_takes_the_larger_queue_and_vetoes_wedged_or_silent_workers() -> None:
    now = [100.0]
    loads = EngineLoads(
        LoadPolicy(stale_after=5.0, wedge_after=10.0, prefill_tokens_per_s=1000.0), clock=lambda: now[0]
    )
    a, b, c = WorkerKey("a", 0), WorkerKey("b", 0), WorkerKey("c", 0)
    loads.update(a, EngineLoad(waiting_uncached_tokens=64, prefill_pending_tokens=16, sample=2, received=100.0))
    loads.update(a, EngineLoad(waiting_uncached_tokens=999, sample=1, received=100.0))  # older sample: ignored
    loads.update(b, EngineLoad(engine_silence_ms=12_000, prefill_pending_tokens=4000, received=100.0))
    loads.update(c, EngineLoad(engine_silence_ms=11_000, received=100.0))
    blended, vetoed = loads.blend({a: 16, b: 400}, 16)
    # a: the engine's queue (80 tokens) beats the router's 16; b: its 4,000 pending beat the router's 400.
    assert blended == {a: 5.0, b: 250.0}
    # b is silent 12 s but has 4 s of prefill pending (< 14 s allowed); c is silent past 10 s.
    assert vetoed == {c}
    now[0] = 106.0  # every record stale: only the router's own count, and a silent worker holding work
    blended, vetoed = loads.blend({a: 16}, 16)
    assert blended == {a: 1.0} and vetoed == {a}
    assert EngineLoads(LoadPolicy(mode="router")).blend({a: 32}, 16) == ({a: 2.0}, set())
    with pytest.raises(ValueError):
        LoadPolicy(mode="sum")


def _batch(ts: float) -> EventBatch:
    return EventBatch(ts=ts, events=[BlockStored(block_hashes=[1], token_ids=[1, 2, 3, 4], block_size=4)])


def test_machine_resync_replaces_the_state_and_continues_from_the_snapshot() -> None:
    m = SourceMachine(has_replay=False)
    m.start()
    m.on_reconnected()
    assert any(isinstance(a, Apply) for a in m.on_live(3, 1.0, _batch(1.0))) and m.partial  # joined mid-life
    out = m.on_resync(10, 2.0, _batch(2.0), partial=False)
    assert isinstance(out[0], ResetWorker) and any(isinstance(a, Apply) for a in out)
    assert not m.partial and m.last_seq == 10 and m.state == "synced"
    assert m.on_live(11, 2.0, _batch(2.0)) == [Apply([(11, 2.0, _batch(2.0))])]  # the next chunk / batch
    m.on_resync(20, 3.0, _batch(3.0), partial=True)
    assert m.partial and m.applied == (20, 3.0)
    assert m.on_resync(2**64 - 1, 3.0, _batch(3.0), partial=False) == [] and m.stats.invalid == 1


def test_machine_data_loss_and_a_vouched_reconnect() -> None:
    m = SourceMachine(has_replay=False)
    m.start()
    m.on_reconnected()
    m.on_live(0, 1.0, _batch(1.0))
    m.on_live(1, 1.0, _batch(1.0))
    m.on_disconnected()
    # A resumed stream: the server vouches for the continuation, nothing is reset.
    out = m.on_reconnected(continued=True)
    assert not any(isinstance(a, ResetWorker) for a in out)
    assert m.on_live(2, 1.0, _batch(1.0)) == [Apply([(2, 1.0, _batch(1.0))])]
    # DATA_LOSS: reset, and the next stream starts over (mid-life: partial).
    out = m.on_data_loss("DATA_LOSS: gap")
    assert any(isinstance(a, ResetWorker) for a in out) and m.applied is None
    m.on_reconnected()
    m.on_live(7, 2.0, _batch(2.0))
    assert m.partial and m.last_seq == 7
    assert msgspec.structs.asdict(m.stats)["uncovered"] == 1


# --- the command line ----------------------------------------------------------------------------------


async def test_kvroute_sim_serves_the_gateway_stream(anyio_backend: str) -> None:
    args = ["-m", "kvroute.cli", "sim", "--engine", "sglang", "--ranks", "2"]
    args += ["--gateway-stream", "sglang", "--block-size", "8"]
    async with await anyio.open_process([sys.executable, *args]) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        text = ""
        with anyio.fail_after(30):
            while text.count("\n") < 6:
                try:
                    text += (await proc.stdout.receive()).decode()
                except anyio.EndOfStream:
                    err = b"".join([chunk async for chunk in proc.stderr]).decode()
                    raise AssertionError(f"kvroute sim exited ({await proc.wait()}): {text}{err}") from None
        lines = text.splitlines()
        assert "sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents" in lines[2]
        target = lines[2].split()[1]
        found = await discover(target)
        assert [(s.engine, s.dp_rank) for s in found] == [("sglang", 0), ("sglang", 1)]
        proc.send_signal(signal.SIGINT)
        with anyio.fail_after(20):
            assert await proc.wait() == 0


class _FlakyIndex(PrefixIndex):
    """An index whose next ``apply_batch`` raises once (a bug, or memory exhaustion, mid-stream)."""

    fail_next = False

    def apply_batch(self, worker: WorkerKey, batch: EventBatch) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("index failed")
        super().apply_batch(worker, batch)


async def test_a_failure_inside_the_stream_is_contained_and_recovered(anyio_backend: str) -> None:
    index = _FlakyIndex()
    async with gw(ranks=2) as eng, KvEventClient(targets=[eng.grpc_target], index=index) as client:
        await until(lambda: len(client.sources()) == 2 and all(s.connected for s in client.stats().sources.values()))
        await traffic(eng, PROMPTS[:6])
        await settled(client, eng)
        index.fail_next = True
        await traffic(eng, PROMPTS[6:12])
        await until(lambda: not index.fail_next)
        await settled(client, eng)  # resubscribed from 0: the servicer's history rebuilt both ranks
        stats = client.stats().sources
        assert len(stats) == 2 and all(st.resets >= 1 for st in stats.values())
