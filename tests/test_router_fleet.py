"""Router-level tests on real simulated fleets: mixed block sizes priced per worker, a wedged worker avoided.

Each would notice a bug the unit tests of the pieces miss: an overlap priced in the router's block size
instead of the worker's, and a wedge veto turned upside down.
"""

from __future__ import annotations

import pytest
from _publisher_helpers import served, wait_for

from kvroute import KvEventClient, PrefixIndex, Router, SubscriberConfig, WorkerKey
from kvroute._load import EngineLoad
from kvroute.sim import SimConfig, SimEngine

pytestmark = pytest.mark.anyio

FAST = SubscriberConfig(quiet_interval=0.2)
PROMPT = [(i * 7919) % 31_000 + 1 for i in range(300)]


async def _settled(client: KvEventClient, engines: list[SimEngine], prompt: list[int]) -> None:
    """Wait until the index claims, for every worker, what its engine's cache holds of ``prompt``."""

    def caught_up() -> bool:
        scores = client.index.find_matches(prompt)
        for e in engines:
            for r in range(e.config.ranks):
                want = served(e.cache(r), prompt)
                if scores.get(WorkerKey(e.grpc_target or "", r), 0) != want:
                    return False
        return True

    await wait_for(caught_up, "the index to hold what the engines hold")


@pytest.mark.parametrize("router_block_size", [16, 64])
async def test_a_mixed_block_size_fleet_is_priced_in_each_worker_s_own_blocks(router_block_size: int) -> None:
    # vLLM with 16-token blocks holds 10 blocks (160 tokens) of the prompt; SGLang with 64-token pages holds
    # 4 (256 tokens). Fewer blocks, more tokens: SGLang is the better choice, whatever the router's unit.
    vllm = SimConfig(engine="vllm", name="v16", block_size=16)
    sglang = SimConfig(engine="sglang", name="s64", block_size=64, seed=1)
    async with SimEngine(vllm) as v, SimEngine(sglang) as s:
        assert v.grpc_target is not None and s.grpc_target is not None
        await v.complete(PROMPT[:170], 1)
        await s.complete(PROMPT[:260], 1)
        assert (v.cache().match_blocks(PROMPT), s.cache().match_blocks(PROMPT)) == (10, 4)
        async with KvEventClient(targets=[v.grpc_target, s.grpc_target], config=FAST) as client:
            await client.wait_synced(20)
            await _settled(client, [v, s], PROMPT)
            router = Router(client.index, states=client, block_size=router_block_size, seed=0)
            for _ in range(5):
                d = router.select(PROMPT)
                assert d.worker == WorkerKey(s.grpc_target, 0)
                assert (d.overlap_blocks, d.block_size, d.overlap_tokens) == (4, 64, 256)
                by_worker = {c.worker: c for c in d.candidates}
                other = by_worker[WorkerKey(v.grpc_target, 0)]
                assert (other.overlap_blocks, other.block_size, other.overlap_tokens) == (10, 16, 160)
                # Prefill priced in the router's unit: the prompt minus what each worker holds, in tokens.
                assert by_worker[d.worker].prefill_blocks == (300 - 256) / router_block_size
                assert other.prefill_blocks == (300 - 160) / router_block_size


async def test_a_wedged_worker_is_avoided_though_it_holds_the_prompt() -> None:
    # Two engines behind gateway streams; the one holding the prompt reports a wedged engine (silent past
    # LoadPolicy.wedge_after): the Router sends the prompt to the other, and back once it recovers.
    cfg = {"engine": "vllm", "gateway": "vllm"}
    async with (
        SimEngine(SimConfig(name="held", **cfg)) as held,  # type: ignore[arg-type]
        SimEngine(SimConfig(name="other", seed=1, **cfg)) as other,  # type: ignore[arg-type]
    ):
        assert held.grpc_target is not None and other.grpc_target is not None
        async with KvEventClient(targets=[held.grpc_target, other.grpc_target], config=FAST) as client:
            keys = {WorkerKey(held.grpc_target, 0), WorkerKey(other.grpc_target, 0)}
            await wait_for(lambda: all(client.engine_loads.get(k) is not None for k in keys), "load records")
            await held.complete(PROMPT, 1)
            await _settled(client, [held, other], PROMPT)
            router = Router(client.index, states=client, seed=0)
            wedged = WorkerKey(held.grpc_target, 0)
            assert router.select(PROMPT).worker == wedged  # healthy: the cache wins

            held.silence_ms = 120_000

            def silent() -> bool:
                return bool((client.engine_loads.get(wedged) or EngineLoad()).engine_silence_ms)

            await wait_for(silent, "the wedge to be reported")
            for _ in range(10):
                d = router.select(PROMPT)
                assert d.worker == WorkerKey(other.grpc_target, 0)
                assert wedged not in {c.worker for c in d.candidates}
            assert client.engine_loads.vetoes >= 10

            held.silence_ms = None
            await wait_for(lambda: not silent(), "the engine to speak again")
            assert router.select(PROMPT).worker == wedged


def test_a_request_leaves_the_load_at_its_first_token_and_the_router_at_its_end() -> None:
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    router = Router(PrefixIndex(), seed=0)
    router.add_worker(a)
    router.add_worker(b)
    first = router.select(PROMPT, request_id=1)
    assert router.load_blocks(first.worker) == 300 / 16
    # Load steers the next request away; once the first is past its prefill, nothing does.
    assert router.select(PROMPT, request_id=2).worker != first.worker
    assert router.on_prefill_done(1) and router.load_blocks(first.worker) == 0.0
    assert router.stats().active_requests == 2  # still active until on_finish
    assert router.on_finish(1) and router.on_finish(2) and router.stats().active_requests == 0
    assert not router.on_prefill_done(1) and not router.on_prefill_done(["unhashable"])
