"""The demo's policies on real simulated engines: the oracle is an oracle, affinity is sticky, least load spreads."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import anyio
import msgspec
import pytest

from kvroute import CostModel, KvEventClient, PrefixIndex, Router, SubscriberConfig, WorkerKey
from kvroute.cli._demo_policies import (
    POLICIES,
    HashedPlacementPolicy,
    KvRoutePolicy,
    LeastLoadPolicy,
    OraclePolicy,
    SessionAffinityPolicy,
    make_policy,
)
from kvroute.cli._demo_run import _scraped_usage
from kvroute.sim import SimConfig, SimEngine

pytestmark = pytest.mark.anyio

FAST = SubscriberConfig(quiet_interval=0.2)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(n)]


async def test_the_oracle_never_picks_a_worker_holding_fewer_blocks_at_equal_load() -> None:
    # Three engines, 40 requests over 8 shared prefixes, 6 at a time: caches differ, loads differ, and the
    # oracle is checked at every decision against what it saw (the engines' own caches).
    rng = random.Random(3)
    prefixes = [_tokens(rng, 16 * rng.randint(4, 20)) for _ in range(8)]
    configs = [SimConfig(name=f"e{i}", seed=i, prefill_time_per_token=2e-6) for i in range(3)]
    async with SimEngine(configs[0]) as a, SimEngine(configs[1]) as b, SimEngine(configs[2]) as c:
        engines = {e.grpc_target: e for e in (a, b, c) if e.grpc_target is not None}
        async with KvEventClient(targets=list(engines), config=FAST) as client:
            await client.wait_synced(20)
            oracle = OraclePolicy(client, engines, block_size=16, seed=1)
            limit = anyio.Semaphore(6)

            async def one(i: int) -> None:
                prompt = [*rng.choice(prefixes), *_tokens(rng, rng.randint(1, 40))]
                async with limit:
                    worker = oracle.choose(i, prompt)
                    try:
                        await engines[worker.worker_id].complete(prompt, 4, rank=worker.dp_rank)
                    finally:
                        oracle.finished(i)

            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i)
                    await anyio.sleep(0.005)

    assert len(oracle.decisions) == 40
    contested = 0
    for d in oracle.decisions:
        assert set(d.blocks) == {WorkerKey(t, 0) for t in engines}
        chosen_load = d.load.get(d.chosen, 0)
        for w, held in d.blocks.items():
            assert d.cached[w] <= held  # credited: the cache, or more where the engine computes more
            if d.load.get(w, 0) == chosen_load:
                assert held <= d.blocks[d.chosen], d
        contested += len(set(d.blocks.values())) > 1
    # The check above is not vacuous: most decisions saw workers holding different prefixes.
    assert contested >= 20, contested
    # Every decision's pick is the cheapest by the Router's cost (blocks of 16 tokens, the default weight).
    weight = CostModel().overlap_weight
    for d in oracle.decisions:
        costs = {w: -weight * held + d.load.get(w, 0) / 16 for w, held in d.blocks.items()}
        assert costs[d.chosen] == min(costs.values())


async def test_the_oracle_credits_what_an_engine_is_computing() -> None:
    # A prefix still being prefilled is in no cache yet: the oracle reads the engines' running and queued
    # prompts too (what the Router's routing hint remembers, known exactly) and sends a request sharing it
    # there, as kvroute with its hint would; the load it adds is still the prompt minus the true cache.
    rng = random.Random(5)
    slow = {"prefill_time_per_token": 2e-3, "max_batched_tokens": 256}
    async with (
        SimEngine(SimConfig(name="a", seed=1, **slow)) as a,
        SimEngine(SimConfig(name="b", seed=2, **slow)) as b,
    ):
        engines = {e.grpc_target: e for e in (a, b) if e.grpc_target is not None}
        async with KvEventClient(targets=list(engines), config=FAST) as client:
            await client.wait_synced(20)
            oracle = OraclePolicy(client, engines, block_size=16, seed=0)
            document = _tokens(rng, 16 * 50)
            first = oracle.choose("first", [*document, *_tokens(rng, 7)])
            engine = engines[first.worker_id]
            running = engine.submit([*document, *_tokens(rng, 7)], 4, rank=first.dp_rank)
            try:
                second = [*document, *_tokens(rng, 9)]
                assert oracle.in_flight_blocks(first, second) == 50
                assert oracle.choose("second", second) == first
                d = oracle.decisions[-1]
                assert d.cached == {w: 0 for w in d.blocks}  # nothing computed yet: caches hold none of it
                assert d.blocks[first] == 50 and sum(d.blocks.values()) == 50
                # Charged as uncached: the second request adds its whole prompt to the worker's load.
                assert oracle.decisions[-1].load == {first: 16 * 50 + 7}
                # A prompt sharing less than a block with it gets no credit; the prompt's last token never counts.
                assert oracle.in_flight_blocks(first, _tokens(rng, 16 * 50)) == 0
                assert oracle.in_flight_blocks(first, document[: 16 * 3]) == 2
            finally:
                engine.abort(running)


async def test_session_affinity_is_sticky_and_least_load_spreads() -> None:
    async with SimEngine(SimConfig(name="a", ranks=2)) as a, SimEngine(SimConfig(name="b", seed=1)) as b:
        targets = [e.grpc_target for e in (a, b) if e.grpc_target is not None]
        async with KvEventClient(targets=targets, config=FAST) as client:
            await client.wait_synced(20)
            rng = random.Random(0)
            sticky = SessionAffinityPolicy(client, affinity_tokens=64)
            sessions = [_tokens(rng, 64) for _ in range(60)]
            homes = [sticky.choose(i, s) for i, s in enumerate(sessions)]
            # A session's later turns (same leading 64 tokens, more after) go where its first went.
            assert [sticky.choose(i, [*s, *_tokens(rng, 50)]) for i, s in enumerate(sessions)] == homes
            # Consistent hashing spreads sessions over every worker.
            assert len(Counter(homes)) == 3 and min(Counter(homes).values()) >= 8

            least = LeastLoadPolicy(client, seed=0)
            first = [least.choose(i, [1, 2, 3]) for i in range(6)]
            assert Counter(first) == {w: 2 for w in client.live_workers()}
            least.finished(0)
            assert least.choose(99, [1]) == first[0]  # the one worker with a free slot

            for name in POLICIES:
                policy = make_policy(name, client, [a, b], block_size=16, seed=0)
                assert policy.choose(("x", name), [5] * 40) in client.live_workers()
                policy.finished(("x", name))
            # The comparison policies are kvroute's Router with one setting of the given cost model changed.
            given = CostModel(overlap_weight=1.5)
            for name, changed in (
                ("kvroute_no_footprint", {"footprint": False}),
                ("kvroute_long_prefix", {"long_prefix": True}),
                ("kvroute_long_move", {"long_move": True}),
                ("kvroute_no_long_move", {"long_move": False}),
            ):
                policy = make_policy(name, client, [a, b], block_size=16, seed=0, cost=given)
                assert isinstance(policy, KvRoutePolicy)
                assert policy.router.cost_model == msgspec.structs.replace(given, **changed)


async def test_kvroute_prices_the_kv_usage_the_engines_serve_on_a_zmq_fleet() -> None:
    # On a plain (ZMQ) fleet the demo's kvroute follows the engines' /metrics, as a router on plain vLLM /
    # SGLang would (`follow_engine_metrics`): a rank running a long prompt reports KV usage above 0, and the
    # Router gets it for `CostModel.eviction`; load stays the router's own.
    rng = random.Random(7)
    slow = {"prefill_time_per_token": 2e-3, "max_batched_tokens": 256}
    async with SimEngine(SimConfig(name="a", seed=1, **slow)) as a, contextlib.AsyncExitStack() as stack:
        loads = await _scraped_usage(stack, [a], 10.0)  # a scrape every 0.1 s
        assert loads.policy.mode == "router"
        worker = WorkerKey(str(a.grpc_target), 0)
        running = a.submit(_tokens(rng, 16 * 40), 2_000, rank=0, stream=True)  # runs until aborted
        try:
            with anyio.fail_after(20):
                while (rec := loads.get(worker)) is None or rec.token_usage <= 0.0:  # noqa: ASYNC110 (a scrape, no event)
                    await anyio.sleep(0.05)
            async with KvEventClient(targets=[str(a.grpc_target)], config=FAST) as client:
                await client.wait_synced(20)
                policy = make_policy("kvroute", client, [a], block_size=16, seed=0, engine_loads=loads)
                assert isinstance(policy, KvRoutePolicy)
                usage = policy.router._usage()
                assert usage is not None and 0.0 < usage[worker] <= 1.0
                d = policy.router.select(_tokens(rng, 64))
                (only,) = d.candidates
                # the whole prompt to prefill there, at the usage reported: cost = 2 x 4 + 8 x usage x 4
                assert only.cost > 2.0 * 4
        finally:
            a.abort(running)


def test_hashed_placement_keeps_prompts_with_one_lead_together_and_never_picks_a_busier_worker() -> None:
    # kvroute_hashed (a prototype, docs/routing-quality.md session 10): a new session goes to the eligible worker
    # its leading tokens hash to, so prompts sharing them land together; the footprint's load rule still holds.
    workers = [WorkerKey(f"w{i}", 0) for i in range(4)]
    router = Router(PrefixIndex(), block_size=16, seed=0, cost=CostModel(footprint=False), routed_ttl=10.0)
    for w in workers:
        router.add_worker(w)
    policy = HashedPlacementPolicy(router, affinity_tokens=64)
    rng = random.Random(5)
    leads = [_tokens(rng, 64) for _ in range(12)]
    homes = []
    for i, lead in enumerate(leads):
        picks = set()
        for j in range(3):  # three sessions sharing one lead, each finished before the next
            picks.add(policy.choose((i, j), [*lead, *_tokens(rng, 200)]))
            policy.finished((i, j))
        assert len(picks) == 1
        homes.append(picks.pop())
    assert len(set(homes)) >= 3  # different leads spread
    # While the lead's home is busy, a new session sharing its lead goes to an idle worker instead.
    first = policy.choose("busy", [*leads[0], *_tokens(rng, 200)])
    assert first == homes[0] and router.load_blocks(first) > 0
    assert policy.choose("next", [*leads[0], *_tokens(rng, 200)]) != first
