"""Engine-reported load from Prometheus ``/metrics`` (plain vLLM / SGLang): parsed, followed, priced by the Router."""

from __future__ import annotations

import anyio
import pytest
from _publisher_helpers import wait_for

from kvroute import KvEventClient, Router, SubscriberConfig, WorkerKey
from kvroute._load import (
    ENGINE_METRICS,
    EngineLoad,
    EngineLoads,
    MetricsError,
    follow_engine_metrics,
    parse_engine_metrics,
)
from kvroute.sim import SimConfig, SimEngine

# What vLLM 0.34.0's PrometheusStatLogger exposes for two data-parallel engines (other families trimmed).
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""

# SGLang 0.5.23's SchedulerMetricsCollector with dp_size 2 and tp_size 2: every TP rank reports.
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 2.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
"""


def test_engine_metrics_are_read_per_rank_by_each_engine_s_own_names() -> None:
    vllm = parse_engine_metrics(VLLM_TEXT, received=7.0)
    assert vllm == {
        0: EngineLoad(running_requests=3, waiting_requests=5, token_usage=0.75, received=7.0),
        1: EngineLoad(running_requests=0, waiting_requests=1, token_usage=0.125, received=7.0),
    }
    sglang = parse_engine_metrics(SGLANG_TEXT, received=1.0)
    # TP rank 1's copy of rank 0's figures is not added in.
    assert sglang[0] == EngineLoad(running_requests=2, received=1.0)
    assert sglang[1] == EngineLoad(running_requests=7, waiting_requests=4, token_usage=0.5, received=1.0)
    # Without data parallelism SGLang has no dp_rank label: rank 0.
    single = SGLANG_TEXT.replace('dp_rank="1",', "").split("sglang:num_queue_reqs")[0]
    assert set(parse_engine_metrics(single)) == {0}
    assert parse_engine_metrics("") == {}
    with pytest.raises(MetricsError):
        parse_engine_metrics("vllm:num_requests_running{engine=0 3\n")
    assert set(ENGINE_METRICS) == {"vllm", "sglang"}


def test_requests_reported_by_count_are_priced_at_the_router_s_mean_request() -> None:
    loads = EngineLoads(clock=lambda: 10.0)
    a, b = WorkerKey("a", 0), WorkerKey("a", 1)
    loads.update(a, EngineLoad(running_requests=2, waiting_requests=2, received=10.0))
    loads.update(b, EngineLoad(received=10.0))
    # No request of its own yet: LoadPolicy.request_tokens (1,024) each.
    assert loads.blend({}, 16) == ({a: 4 * 1024 / 16}, set())
    # The router's own: 2 requests of 320 uncached tokens on b: 160 per request prices a's 4.
    blended, _ = loads.blend({b: 320}, 16, {b: 2})
    assert blended == {a: 4 * 160 / 16, b: 20.0}
    # The router's own tokens on a (960) beat a's 4 requests at the mean (1,280 / 8 = 160 each): blend takes it.
    blended, _ = loads.blend({a: 960, b: 320}, 16, {a: 1, b: 7})
    assert blended == {a: 60.0, b: 20.0}


@pytest.mark.anyio
async def test_metrics_derived_load_reaches_the_router() -> None:
    # Another router replica (played by direct submits) has queued work on vllm rank 0 and sglang rank 1;
    # this router has sent nothing, so only the engines' /metrics can tell it.
    slow = {"prefill_time_per_token": 5e-3, "max_batch": 1}
    v_cfg = SimConfig(engine="vllm", name="v", ranks=2, **slow)  # type: ignore[arg-type]
    s_cfg = SimConfig(engine="sglang", name="s", ranks=2, seed=1, **slow)  # type: ignore[arg-type]
    async with SimEngine(v_cfg) as v, SimEngine(s_cfg) as s:
        assert v.grpc_target is not None and s.grpc_target is not None
        busy = {WorkerKey(v.grpc_target, 0), WorkerKey(s.grpc_target, 1)}
        prompt = list(range(1, 600))
        queued = [(v, v.submit(prompt, 4, rank=0)) for _ in range(3)] + [
            (s, s.submit(prompt, 4, rank=1)) for _ in range(3)
        ]
        targets = [v.grpc_target, s.grpc_target]
        async with KvEventClient(targets=targets, config=SubscriberConfig(quiet_interval=0.2)) as client:
            await client.wait_synced(20)
            urls = {e.grpc_target or "": f"{e.http_url}/metrics" for e in (v, s)}
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: follow_engine_metrics(client.engine_loads, urls, interval=0.1))
                await wait_for(lambda: len(client.engine_loads.records()) == 4, "a record per rank")
                records = client.engine_loads.records()
                for w in busy:
                    assert records[w].running_requests + records[w].waiting_requests == 3
                router = Router(client.index, states=client, seed=0)
                assert router.engine_loads is client.engine_loads
                for i in range(20):
                    d = router.select([7, 8, 9] * 20 + [i])  # no overlap anywhere: load alone decides
                    assert d.worker not in busy
                    priced = {c.worker: c.load_blocks for c in d.candidates}
                    assert all(priced[w] == 3 * 1024 / 16 for w in busy)
                tg.cancel_scope.cancel()
        for engine, req in queued:
            engine.abort(req)
