"""Where to send a worker's requests: a target carries its engine's HTTP base URL, or discovery learns it where
the engine's API says it (SGLang's ``GetServerInfo`` names its HTTP server; vLLM's ``Control`` service does not),
and `KvEventClient.http_url` maps a `WorkerKey` to it.

Real gRPC servers on 127.0.0.1 answering as the engines do, real ZMQ publishers, both anyio backends.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from kvroute import ConfigError, EventSource, KvEventClient, WorkerKey, discover
from kvroute._answers import _sglang_http_url, _SglangInfo
from kvroute._discovery import DiscoveryOptions
from kvroute._endpoints import _Resolver
from kvroute.sim import EventPublisher, SimConfig, SimEngine
from kvroute.sim._grpc import SglangService, serve_grpc, sglang_server_info

pytestmark = pytest.mark.anyio


def kv_events(port: int, dp_size: int = 1) -> dict[str, Any]:
    """SGLang's ``kv_events`` descriptor for a publisher on 127.0.0.1 (docs/protocol.md §1)."""
    return {
        "publisher": "zmq",
        "endpoint_host": "127.0.0.1",
        "endpoint_port_base": port,
        "topic": "",
        "block_size": 16,
        "dp_size": dp_size,
    }


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ({"host": "0.0.0.0", "port": 30000}, "http://127.0.0.1:30000"),  # a wildcard bind: the host dialled
        ({"host": "127.0.0.1", "port": 30001}, "http://127.0.0.1:30001"),  # SGLang's default bind, same host
        ({"host": "::", "port": 30002}, "http://127.0.0.1:30002"),
        ({"host": "127.0.0.1", "port": 8443, "ssl_certfile": "/etc/cert.pem"}, "https://127.0.0.1:8443"),
        ({"host": "127.0.0.1", "port": "30000"}, None),  # not a port: no URL, the sources stand
        ({"host": "127.0.0.1", "port": 70000}, None),
        ({"host": 7, "port": 30000}, None),
        ({}, None),  # an older SGLang, or a trimmed answer
    ],
)
async def test_sglang_discovery_learns_the_http_server(server: dict[str, Any], expected: str | None) -> None:
    info = sglang_server_info(kv_events(5557, dp_size=2), **server)
    async with serve_grpc([SglangService(lambda: info)]) as grpc_server:
        sources = await discover(grpc_server.target)
    assert [s.dp_rank for s in sources] == [0, 1]
    assert {s.http_url for s in sources} == {expected}


def test_sglang_http_server_bound_to_loopback_is_unreachable_from_a_remote_router() -> None:
    remote = _Resolver("10.1.2.3", DiscoveryOptions())
    loopback = _SglangInfo(kv_events=None, host="127.0.0.1", port=30000)
    assert _sglang_http_url("10.1.2.3:50051", remote, loopback) is None
    wildcard = _SglangInfo(kv_events=None, host="0.0.0.0", port=30000)
    assert _sglang_http_url("10.1.2.3:50051", remote, wildcard) == "http://10.1.2.3:30000"
    named = _SglangInfo(kv_events=None, host="engine-b.internal", port=30000)
    assert _sglang_http_url("10.1.2.3:50051", remote, named) == "http://engine-b.internal:30000"
    allow = _Resolver("10.1.2.3", DiscoveryOptions(allowed_hosts=["10.0.0.0/8"]))
    assert _sglang_http_url("10.1.2.3:50051", allow, named) is None  # the endpoint policy holds for URLs too


async def test_vllm_discovery_says_nothing_of_http() -> None:
    async with SimEngine(SimConfig(engine="vllm", ranks=2)) as eng:
        assert eng.grpc_target is not None
        sources = await discover(eng.grpc_target, timeout=30)
    assert len(sources) == 2 and all(s.http_url is None for s in sources)


async def test_configured_urls_map_every_worker_to_its_engine() -> None:
    async with (
        SimEngine(SimConfig(engine="vllm", name="v", ranks=2)) as v,
        SimEngine(SimConfig(engine="sglang", name="s")) as s,
        SimEngine(SimConfig(engine="vllm", name="late")) as late,
    ):
        assert v.grpc_target and v.http_url and s.grpc_target and s.http_url and late.grpc_target and late.http_url
        targets = {v.grpc_target: v.http_url + "/", s.grpc_target: s.http_url}
        async with KvEventClient(targets=targets, discovery_interval=0.2) as client:
            await client.wait_synced(timeout=30)
            assert client.http_url(WorkerKey(v.grpc_target, 0)) == v.http_url  # trailing slash dropped
            assert client.http_url(WorkerKey(v.grpc_target, 1)) == v.http_url
            assert client.http_url(WorkerKey(s.grpc_target, 0)) == s.http_url
            assert client.http_url(WorkerKey("nobody", 0)) is None
            client.add_target(late.grpc_target, http_url=late.http_url)
            await client.wait_synced(timeout=30)
            assert client.http_url(WorkerKey(late.grpc_target, 0)) == late.http_url
            client.remove_target(late.grpc_target)
            assert client.http_url(WorkerKey(late.grpc_target, 0)) is None


async def test_a_static_source_carries_its_own_url() -> None:
    async with EventPublisher() as pub:
        src = EventSource(worker_id="w", endpoint=pub.endpoint, http_url="http://w.internal:8000")
        async with KvEventClient([src]) as client:
            assert client.http_url(src.key) == "http://w.internal:8000"


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://x:1", "http://", "//x:1", 8000])
def test_a_malformed_url_is_a_config_error(url: Any) -> None:
    with pytest.raises(ConfigError, match="HTTP URL"):
        KvEventClient(targets={"127.0.0.1:50051": url})


async def test_a_moved_http_server_is_followed_without_resetting_the_worker() -> None:
    async with EventPublisher(replay_endpoint=None) as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        http = {"port": 30000}

        def answer() -> str:
            return json.dumps({**json.loads(sglang_server_info(kv_events(port))), "host": "0.0.0.0", **http})

        async with (
            serve_grpc([SglangService(answer)]) as server,
            KvEventClient(targets=[server.target], discovery_interval=0.1) as client,
        ):
            await client.wait_synced(timeout=30)
            key = WorkerKey(server.target, 0)
            assert client.http_url(key) == "http://127.0.0.1:30000"
            # The engine's HTTP server restarted on another port, its publisher where it was: the next
            # discovery round moves where requests go, and the worker's state stays.
            http["port"] = 30123
            with anyio.fail_after(30):
                while client.http_url(key) != "http://127.0.0.1:30123":  # noqa: ASYNC110 (a round, no event to wait on)
                    await anyio.sleep(0.05)
            assert client.stats().removed_sources == 0 and client.stats().totals.resets == 0
