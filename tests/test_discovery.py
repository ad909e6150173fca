"""Discovery against real gRPC servers on loopback: vLLM and SGLang answers, policy, retries, TLS, CLI."""

from __future__ import annotations

import argparse
import io
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import grpc
import pytest
import trustme
from _ports import free_port, refusing_port
from _publisher_helpers import needs_ipv6

from kvroute._discovery import (
    DiscoveryOptions,
    InvalidOptionsError,
    MalformedAnswerError,
    RpcRejectedError,
    SourceDiff,
    TargetUnreachableError,
    TlsConfig,
    TooManySourcesError,
    _Resolver,
    _Unusable,
    diff_sources,
    discover,
    follow_target,
)
from kvroute._errors import DiscoveryError, EventsDisabledError, KvRouteError, UnusableSourceError
from kvroute._models import EventSource, WorkerKey
from kvroute._proto import vllm_control_pb2 as vllm_pb
from kvroute.cli._discover import register
from kvroute.cli._display import (
    EXIT_EVENTS_DISABLED,
    EXIT_MALFORMED_ANSWER,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TOO_MANY_SOURCES,
    EXIT_UNREACHABLE,
    EXIT_UNUSABLE_SOURCE,
    EXIT_USAGE,
)
from kvroute.sim._grpc import ServerTls, SglangService, VllmControlService, serve_grpc, sglang_server_info

pytestmark = pytest.mark.anyio


def kv_source(rank: int = 0, endpoint: str | None = None, **fields: Any) -> vllm_pb.KvEventSource:
    """A KvEventSource as vLLM fills it (docs/protocol.md §1 defaults), with overrides."""
    values: dict[str, Any] = {
        "transport": "zmq",
        "endpoint": endpoint or f"tcp://*:{5557 + rank}",
        "topic": "",
        "replay_endpoint": "",
        "data_parallel_rank": rank,
        "encoding": "msgpack",
        "schema_version": 1,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
    }
    values.update(fields)
    return vllm_pb.KvEventSource(**values)


def sglang_kv(dp_size: Any = 1, **fields: Any) -> dict[str, Any]:
    """SGLang's kv_events descriptor (docs/protocol.md §1), with overrides."""
    kv: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 64,
        "dp_size": dp_size,
    }
    kv.update(fields)
    return kv


def vllm(sources: Sequence[vllm_pb.KvEventSource | EventSource], **kw: Any) -> VllmControlService:
    return VllmControlService(lambda: list(sources), **kw)


def sglang(json_info: str, **kw: Any) -> SglangService:
    return SglangService(lambda: json_info, **kw)


# --- vLLM ------------------------------------------------------------------------------------------


async def test_vllm_one_rank_wildcard_resolved_to_dialled_host() -> None:
    async with serve_grpc([vllm([kv_source(0)])]) as server:
        [src] = await discover(server.target)
    assert src == EventSource(
        worker_id=server.target,
        dp_rank=0,
        endpoint="tcp://127.0.0.1:5557",
        topic="",
        replay_endpoint=None,
        hwm=100000,
        buffer_steps=10000,
        block_size=None,
        engine="vllm",
        target=server.target,
    )


async def test_vllm_four_ranks_every_wildcard_spelling_sorted_by_rank() -> None:
    wildcards = ["*", "0.0.0.0", "[::]", "::"]
    answer = [
        kv_source(r, f"tcp://{w}:{6000 + r}", replay_endpoint=f"tcp://{w}:{6100 + r}", topic="kv")
        for r, w in reversed(list(enumerate(wildcards)))
    ]
    async with serve_grpc([vllm(answer)]) as server:
        sources = await discover(server.target, worker_id="engine-a")
    assert [s.key for s in sources] == [WorkerKey("engine-a", r) for r in range(4)]
    assert [s.endpoint for s in sources] == [f"tcp://127.0.0.1:{6000 + r}" for r in range(4)]
    assert [s.replay_endpoint for s in sources] == [f"tcp://127.0.0.1:{6100 + r}" for r in range(4)]
    assert {s.topic for s in sources} == {"kv"}


async def test_vllm_explicit_hosts_kept_and_missing_rank_read_in_order() -> None:
    answer = [
        vllm_pb.KvEventSource(transport="zmq", endpoint="tcp://10.1.2.3:5557", encoding="msgpack", schema_version=1),
        vllm_pb.KvEventSource(transport="zmq", endpoint="tcp://engine-b:5558", encoding="msgpack", schema_version=1),
    ]
    async with serve_grpc([vllm(answer)]) as server:
        sources = await discover(server.target)
    assert [(s.dp_rank, s.endpoint) for s in sources] == [(0, "tcp://10.1.2.3:5557"), (1, "tcp://engine-b:5558")]


@needs_ipv6
async def test_vllm_over_ipv6_keeps_brackets() -> None:
    answer = [kv_source(0, "tcp://*:5557", replay_endpoint="tcp://[::]:5560"), kv_source(1, "tcp://[::1]:5558")]
    async with serve_grpc([vllm(answer)], host="::1") as server:
        assert server.target.startswith("[::1]:")
        sources = await discover(server.target)
    assert [s.endpoint for s in sources] == ["tcp://[::1]:5557", "tcp://[::1]:5558"]
    assert sources[0].replay_endpoint == "tcp://[::1]:5560"


async def test_vllm_without_sources_is_events_disabled() -> None:
    async with serve_grpc([vllm([])]) as server:
        with pytest.raises(EventsDisabledError, match="no KV-event sources") as info:
            await discover(server.target)
    assert info.value.target == server.target


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"transport": "nng"}, "transport 'nng' is not 'zmq'"),
        ({"encoding": "json"}, "encoding 'json' is not 'msgpack'"),
        ({"schema_version": 2}, "schema_version 2 is unknown"),
        ({"endpoint": "ipc:///tmp/kv0"}, "refused unless allow_ipc"),
        ({"endpoint": "inproc://kv"}, "transport inproc:// is not supported"),
        ({"endpoint": "tcp://*:*"}, "port in 1-65535"),
        ({"endpoint": "tcp://*:0"}, "port in 1-65535"),
        ({"endpoint": "5557"}, "not a ZMQ endpoint"),
        ({"endpoint": "tcp://bad host!:5557"}, "not an IP address or host name"),
        ({"replay_endpoint": "udp://*:5558"}, "transport udp:// is not supported"),
    ],
)
async def test_vllm_unusable_source_is_reported_with_reason(fields: dict[str, Any], reason: str) -> None:
    async with serve_grpc([vllm([kv_source(0), kv_source(1, **fields)])]) as server:
        with pytest.raises(UnusableSourceError) as info:
            await discover(server.target)
    assert info.value.cause.startswith("unusable KV-event source: rank 1: ")
    assert reason in info.value.cause
    assert "rank 0" not in info.value.cause


async def test_many_unusable_sources_are_summarised() -> None:
    answer = [kv_source(r, transport="nng") for r in range(6)]
    async with serve_grpc([vllm(answer)]) as server:
        with pytest.raises(UnusableSourceError, match=r"rank 2: .* \| \.\.\. and 3 more$"):
            await discover(server.target)


async def test_ipc_needs_opt_in_and_a_local_target() -> None:
    async with serve_grpc([vllm([kv_source(0, "ipc:///tmp/kvroute-test-0")])]) as server:
        with pytest.raises(UnusableSourceError, match="allow_ipc"):
            await discover(server.target)
        [src] = await discover(server.target, allow_ipc=True)
    assert src.endpoint == "ipc:///tmp/kvroute-test-0"


def test_remote_target_cannot_point_at_local_sockets() -> None:
    remote = _Resolver("10.0.0.7", DiscoveryOptions(allow_ipc=True))
    with pytest.raises(_Unusable, match=r"ipc:// is a path on the engine's host, and 10\.0\.0\.7 is remote"):
        remote.endpoint("ipc:///tmp/kv")
    for loopback in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557"):
        with pytest.raises(_Unusable, match=r"bound to loopback on 10\.0\.0\.7"):
            remote.endpoint(loopback)
    assert remote.endpoint("tcp://*:5557") == "tcp://10.0.0.7:5557"
    assert _Resolver("localhost", DiscoveryOptions()).endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


async def test_duplicate_rank_is_malformed() -> None:
    async with serve_grpc([vllm([kv_source(0), kv_source(1), kv_source(1, "tcp://*:6000")])]) as server:
        with pytest.raises(MalformedAnswerError, match="data_parallel_rank twice"):
            await discover(server.target)


async def test_source_cap_is_enforced() -> None:
    """The refusal is the error; a followed target logs it (rate-limited, tests/test_hostile.py)."""
    async with serve_grpc([vllm([kv_source(r) for r in range(3)])]) as server:
        assert len(await discover(server.target, max_sources_per_target=3)) == 3
        with pytest.raises(TooManySourcesError, match="3 sources, more than max_sources_per_target=2"):
            await discover(server.target, max_sources_per_target=2)


# --- SGLang ----------------------------------------------------------------------------------------


async def test_sglang_dp1_without_replay() -> None:
    info = sglang_server_info(sglang_kv(1, topic="kv", block_size=16))
    async with serve_grpc([sglang(info)]) as server:
        [src] = await discover(server.target)
    assert src == EventSource(
        worker_id=server.target,
        dp_rank=0,
        endpoint="tcp://127.0.0.1:5557",
        topic="kv",
        replay_endpoint=None,
        hwm=None,
        buffer_steps=None,
        block_size=16,
        engine="sglang",
        target=server.target,
    )


async def test_sglang_real_dp2_example_warns_about_replay_overlap(caplog: pytest.LogCaptureFixture) -> None:
    # docs/protocol.md §1, real output of SGLang with dp_size 2 (its replay base collides with rank 1).
    kv = (
        '{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,"topic":"","block_size":64,'
        '"dp_size":2,"load_endpoint_port_base":5560,"load_topic":"load","replay_endpoint_port_base":5558}'
    )
    info = '{"model_path": "m", "unknown_future_key": [1, {"x": null}], "kv_events": ' + kv + "}"
    async with serve_grpc([sglang(info)]) as server:
        sources = await discover(server.target)
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint) for s in sources] == [
        (0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        (1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559"),
    ]
    assert {s.block_size for s in sources} == {64}
    assert any("overlap event ports 5557-5558" in r.message for r in caplog.records if r.levelno == logging.WARNING)


async def test_sglang_dp2_with_disjoint_replay_range_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    info = sglang_server_info(sglang_kv(2, replay_endpoint_port_base=5600))
    async with serve_grpc([sglang(info)]) as server:
        sources = await discover(server.target)
    assert [s.replay_endpoint for s in sources] == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "config",
    [
        '{"publisher": "zmq", "endpoint": "tcp://*:5557", "hwm": 5000, "buffer_steps": 300}',
        {"publisher": "zmq", "hwm": 5000, "buffer_steps": 300, "topic": ""},
    ],
)
async def test_sglang_hwm_and_buffer_steps_from_kv_events_config(config: str | dict[str, Any]) -> None:
    info = sglang_server_info(sglang_kv(1), kv_events_config=config)
    async with serve_grpc([sglang(info)]) as server:
        [src] = await discover(server.target)
    assert (src.hwm, src.buffer_steps) == (5000, 300)


@pytest.mark.parametrize("config", ['{"hwm": "lots"}', "not json", {"hwm": -1}, 7])
async def test_sglang_bad_kv_events_config_is_logged_and_ignored(config: Any, caplog: pytest.LogCaptureFixture) -> None:
    info = json.dumps({"kv_events": sglang_kv(1), "kv_events_config": config})
    async with serve_grpc([sglang(info)]) as server:
        [src] = await discover(server.target)
    assert (src.hwm, src.buffer_steps) == (None, None)
    assert any("ignoring SGLang kv_events_config" in r.message for r in caplog.records)


@needs_ipv6
async def test_sglang_ipv6_endpoint_host_is_bracketed() -> None:
    info = sglang_server_info(sglang_kv(2, endpoint_host="::1", replay_endpoint_port_base=5600))
    async with serve_grpc([sglang(info)], host="::1") as server:
        sources = await discover(server.target)
    assert [s.endpoint for s in sources] == ["tcp://[::1]:5557", "tcp://[::1]:5558"]
    assert sources[1].replay_endpoint == "tcp://[::1]:5601"


async def test_sglang_events_disabled() -> None:
    async with serve_grpc([sglang(sglang_server_info(None))]) as server:
        with pytest.raises(EventsDisabledError, match="kv_events null"):
            await discover(server.target)


@pytest.mark.parametrize(
    ("json_info", "complaint"),
    [
        ("{not json", "malformed"),
        ("", "truncated"),
        ("[1, 2]", "Expected `object`, got `array`"),
        ('{"model_path": "m"}', "missing required field `kv_events`"),
        ('{"kv_events": 5}', "at `$.kv_events`"),
        (sglang_server_info(sglang_kv("2")), "at `$.kv_events.dp_size`"),
        (sglang_server_info(sglang_kv(0)), "at `$.kv_events.dp_size`"),
        (sglang_server_info({k: v for k, v in sglang_kv(1).items() if k != "endpoint_host"}), "`endpoint_host`"),
        (sglang_server_info(sglang_kv(1, endpoint_port_base=70000)), "at `$.kv_events.endpoint_port_base`"),
        (sglang_server_info(sglang_kv(1, block_size=True)), "at `$.kv_events.block_size`"),
        (sglang_server_info(sglang_kv(10, endpoint_port_base=65530)), "runs past port 65535"),
    ],
)
async def test_sglang_malformed_json_names_the_problem(json_info: str, complaint: str) -> None:
    async with serve_grpc([sglang(json_info)]) as server:
        with pytest.raises(MalformedAnswerError, match="SGLang") as info:
            await discover(server.target)
    assert complaint in info.value.cause


async def test_sglang_unusable_publisher_and_huge_dp_size() -> None:
    async with serve_grpc([sglang(sglang_server_info(sglang_kv(1, publisher="kafka")))]) as server:
        with pytest.raises(UnusableSourceError, match="publisher 'kafka' is not 'zmq'"):
            await discover(server.target)
    async with serve_grpc([sglang(sglang_server_info(sglang_kv(10**9)))]) as server:
        with pytest.raises(TooManySourcesError, match="1000000000 sources"):
            await discover(server.target)


# --- engine selection and failures -----------------------------------------------------------------


async def test_auto_falls_through_to_sglang_on_unimplemented() -> None:
    service = sglang(sglang_server_info(sglang_kv(1)))
    async with serve_grpc([service]) as server:
        [src] = await discover(server.target, engine="auto")
        assert src.engine == "sglang"
        with pytest.raises(RpcRejectedError, match="UNIMPLEMENTED") as info:
            await discover(server.target, engine="vllm")
    assert info.value.code == "UNIMPLEMENTED"


async def test_auto_prefers_vllm_and_sglang_only_asks_sglang() -> None:
    vllm_service = vllm([kv_source(0)])
    sglang_service = sglang(sglang_server_info(sglang_kv(3)))
    async with serve_grpc([vllm_service, sglang_service]) as server:
        assert [s.engine for s in await discover(server.target)] == ["vllm"]
        assert len(await discover(server.target, engine="sglang")) == 3
    assert (vllm_service.calls, sglang_service.calls) == (1, 1)


async def test_a_server_with_neither_service_is_rejected() -> None:
    async with serve_grpc([]) as server:
        with pytest.raises(RpcRejectedError, match="serves none of"):
            await discover(server.target)


async def test_permanent_errors_are_not_retried_nor_masked() -> None:
    vllm_service = vllm([kv_source(0)])
    sglang_service = sglang(sglang_server_info(sglang_kv(1)))
    vllm_service.fail_next(grpc.StatusCode.PERMISSION_DENIED, details="go away")
    async with serve_grpc([vllm_service, sglang_service]) as server:
        with pytest.raises(RpcRejectedError, match="PERMISSION_DENIED: go away") as info:
            await discover(server.target, timeout=3)
    assert info.value.code == "PERMISSION_DENIED"
    assert (vllm_service.calls, sglang_service.calls) == (1, 0)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_transient_errors_are_retried(code: grpc.StatusCode) -> None:
    service = vllm([kv_source(0)])
    service.fail_next(code, count=2)
    async with serve_grpc([service]) as server:
        assert len(await discover(server.target, timeout=3)) == 1
    assert service.calls == 3


async def test_a_late_server_is_found_by_retrying() -> None:
    port = free_port()
    found: list[EventSource] = []
    answered = anyio.Event()

    async def ask() -> None:
        found.extend(await discover(f"127.0.0.1:{port}", timeout=5))
        answered.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        await anyio.sleep(0.4)
        assert not found
        async with serve_grpc([vllm([kv_source(0)])], port=port):
            with anyio.fail_after(4):
                await answered.wait()
    assert found[0].endpoint == "tcp://127.0.0.1:5557"


async def test_a_dead_port_fails_clearly_within_the_timeout() -> None:
    with refusing_port() as port:
        target = f"127.0.0.1:{port}"
        started = time.monotonic()
        with pytest.raises(
            TargetUnreachableError, match=r"no answer within 0.4s \(\d+ attempts; last: UNAVAILABLE"
        ) as info:
            await discover(target, timeout=0.4)
    # Slack for a loaded 2-core CI machine (0.96 s was seen there): channel setup and teardown are
    # outside the deadline, and a discovery that ignored its timeout would not stop at all.
    assert time.monotonic() - started < 0.4 + 1.6
    assert info.value.target == target


async def test_a_silent_server_times_out_and_cancellation_is_prompt() -> None:
    # A listening socket nobody accepts from: TCP connects, HTTP/2 never starts.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TargetUnreachableError, match="DEADLINE_EXCEEDED"):
            await discover(target, timeout=0.3)
        started = time.monotonic()
        with anyio.move_on_after(0.1) as scope:
            await discover(target, timeout=30)
        assert scope.cancelled_caught
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("target", ["nohost", "host:0", "host:65536", "::1:5", "[::1]5", "[::1]:x", "a b:1", ":80"])
async def test_bad_target_strings(target: str) -> None:
    with pytest.raises(DiscoveryError, match="target must be host:port"):
        await discover(target)


# --- TLS and metadata ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_tls(ca: trustme.CA, *names: str, client_ca: bytes | None = None) -> ServerTls:
    cert = ca.issue_cert(*names)
    return ServerTls(
        certificate_chain=b"".join(b.bytes() for b in cert.cert_chain_pems),
        private_key=cert.private_key_pem.bytes(),
        client_ca=client_ca,
    )


async def test_tls_with_generated_ca_given_as_bytes_or_path(ca: trustme.CA, tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    async with serve_grpc([vllm([kv_source(0)])], tls=server_tls(ca, "127.0.0.1")) as server:
        [a] = await discover(server.target, tls=TlsConfig(root_certificates=ca.cert_pem.bytes()))
        [b] = await discover(server.target, tls=TlsConfig(root_certificates=str(ca_file)))
        with pytest.raises(TargetUnreachableError):
            await discover(server.target, timeout=0.3)  # plaintext to a TLS port
    assert a == b


async def test_tls_server_name_override(ca: trustme.CA) -> None:
    async with serve_grpc([vllm([kv_source(0)])], tls=server_tls(ca, "engine.internal")) as server:
        roots = ca.cert_pem.bytes()
        [src] = await discover(server.target, tls=TlsConfig(root_certificates=roots, server_name="engine.internal"))
        with pytest.raises(TargetUnreachableError):
            await discover(server.target, timeout=0.3, tls=TlsConfig(root_certificates=roots))
    assert src.endpoint == "tcp://127.0.0.1:5557"


async def test_tls_client_certificate(ca: trustme.CA, tmp_path: Path) -> None:
    client = ca.issue_cert("router@example.org")
    key, chain = tmp_path / "key.pem", tmp_path / "chain.pem"
    client.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(b.bytes() for b in client.cert_chain_pems))
    tls = server_tls(ca, "127.0.0.1", client_ca=ca.cert_pem.bytes())
    async with serve_grpc([vllm([kv_source(0)])], tls=tls) as server:
        roots = ca.cert_pem.bytes()
        mutual = TlsConfig(root_certificates=roots, private_key=str(key), certificate_chain=str(chain))
        assert len(await discover(server.target, tls=mutual)) == 1
        with pytest.raises(TargetUnreachableError):
            await discover(server.target, timeout=0.3, tls=TlsConfig(root_certificates=roots))
        missing = TlsConfig(
            root_certificates=roots, private_key=str(tmp_path / "nope.pem"), certificate_chain=str(chain)
        )
        with pytest.raises(DiscoveryError, match="cannot read TLS private_key file"):
            await discover(server.target, tls=missing)


async def test_metadata_reaches_the_server() -> None:
    service = vllm([kv_source(0)], api_key="s3cret")
    async with serve_grpc([service]) as server:
        auth: list[tuple[str, str | bytes]] = [
            ("authorization", "Bearer s3cret"),
            ("x-tenant", "blue"),
            ("trace-bin", b"\x00\x01"),
        ]
        assert len(await discover(server.target, metadata=auth)) == 1
        with pytest.raises(RpcRejectedError, match="UNAUTHENTICATED") as info:
            await discover(server.target)
    assert info.value.code == "UNAUTHENTICATED"
    sent = dict(service.received_metadata[0])
    assert (sent["authorization"], sent["x-tenant"], sent["trace-bin"]) == ("Bearer s3cret", "blue", b"\x00\x01")


# --- options and endpoint policy -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"engine": "trtllm"}, "engine must be one of"),
        ({"timeout": 0}, "timeout must be > 0"),
        ({"timeout": "5"}, "timeout must be > 0"),
        ({"max_sources_per_target": 0}, "max_sources_per_target must be an int >= 1"),
        ({"max_sources_per_target": 2.5}, "max_sources_per_target must be an int >= 1"),
        ({"metadata": [("authorization",)]}, r"\(key, value\) pairs"),
        ({"worker_id": ""}, "worker_id must not be empty"),
        ({"metadata": [("Authorization", "x")]}, "lowercase"),
        ({"metadata": [("grpc-timeout", "1")]}, "not starting with 'grpc-'"),
        ({"metadata": [("trace-bin", "text")]}, "must be bytes"),
        ({"metadata": [("x-a", "line\nbreak")]}, "printable ASCII"),
        ({"allowed_hosts": ["10.0.0.0/33"]}, "neither an IP, a CIDR network nor a host name"),
        ({"allowed_hosts": [""]}, "empty"),
        ({"tls": {"private_key": b"k"}}, "go together"),
    ],
)
def test_invalid_options_are_rejected_before_sending(kwargs: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidOptionsError, match=complaint):
        if "tls" in kwargs:
            TlsConfig(**kwargs["tls"])
        else:
            DiscoveryOptions(**kwargs)


def test_options_normalise_sequences_to_tuples() -> None:
    options = DiscoveryOptions(metadata=[("a", "b")], allowed_hosts=["10.0.0.0/8"])
    assert options.metadata == (("a", "b"),)
    assert options.allowed_hosts == ("10.0.0.0/8",)
    assert hash(options) == hash(DiscoveryOptions(metadata=(("a", "b"),), allowed_hosts=("10.0.0.0/8",)))


async def test_allowed_hosts_restrict_where_answers_point() -> None:
    answer = [kv_source(0), kv_source(1, "tcp://engine-b:5558", replay_endpoint="tcp://10.9.9.9:5600")]
    async with serve_grpc([vllm(answer)]) as server:
        sources = await discover(server.target, allowed_hosts=["127.0.0.0/8", "ENGINE-B", "10.9.9.9"])
        assert [s.endpoint for s in sources] == ["tcp://127.0.0.1:5557", "tcp://engine-b:5558"]
        with pytest.raises(
            UnusableSourceError, match=r"rank 1: tcp://10\.9\.9\.9:5600: host 10\.9\.9\.9 is not in allowed"
        ):
            await discover(server.target, allowed_hosts=["127.0.0.1", "engine-b"])
        with pytest.raises(UnusableSourceError, match=r"rank 0: .*host 127\.0\.0\.1 is not in allowed_hosts"):
            await discover(server.target, allowed_hosts=["10.0.0.0/8", "::1"])


# --- diff_sources ----------------------------------------------------------------------------------


def src(rank: int, port: int | None = None, **kw: Any) -> EventSource:
    return EventSource(worker_id="w", dp_rank=rank, endpoint=f"tcp://h:{port or 5557 + rank}", **kw)


def test_diff_sources() -> None:
    old = [src(0), src(1), src(2, topic="a"), src(3, hwm=1)]
    new = [src(4), src(3, hwm=2), src(2, topic="b"), src(1, 6000), src(0)]
    diff = diff_sources(old, new)
    assert diff == SourceDiff(added=[src(4)], removed=[], replaced=[src(2, topic="b"), src(1, 6000)])
    assert diff_sources(new, old[:1]).removed == [src(4), src(3, hwm=2), src(2, topic="b"), src(1, 6000)]
    assert not diff_sources(old, old)
    changed = diff_sources([src(0)], [src(0, replay_endpoint="tcp://h:1"), src(1, block_size=16)])
    assert changed.replaced == [src(0, replay_endpoint="tcp://h:1")] and changed.added == [src(1, block_size=16)]
    assert diff_sources([src(0)], [src(0, block_size=32)]).replaced == [src(0, block_size=32)]
    with pytest.raises(KvRouteError, match="new lists a WorkerKey more than once"):
        diff_sources([], [src(0), src(0, 6000)])


# --- follow_target ---------------------------------------------------------------------------------


class Recorder:
    """follow_target's callbacks, recording what they were given and waking whoever waits on a change."""

    def __init__(self, fail_on_sources: bool = False) -> None:
        self.seen: list[list[EventSource]] = []
        self.lost: list[BaseException] = []
        self.fail_on_sources = fail_on_sources
        self._changed = anyio.Event()

    async def on_sources(self, sources: list[EventSource]) -> None:
        assert not self.fail_on_sources, "nothing should answer"
        self.seen.append(sources)
        self._poke()

    async def on_unreachable(self, error: BaseException) -> None:
        self.lost.append(error)
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, condition: Callable[[], bool], seconds: float = 5.0) -> None:
        with anyio.fail_after(seconds):
            while not condition():
                await self._changed.wait()


async def test_follow_target_reports_changes_and_unreachability() -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    answer = [kv_source(0), kv_source(1)]
    rec = Recorder()
    options = DiscoveryOptions(timeout=0.2)

    async def follow() -> None:
        await follow_target(target, options, rec.on_sources, rec.on_unreachable, interval=0.05, grace=0.3)

    async with anyio.create_task_group() as tg:
        async with serve_grpc([vllm(answer)], port=port):
            tg.start_soon(follow)
            await rec.until(lambda: len(rec.seen) >= 1)
            assert [s.dp_rank for s in rec.seen[-1]] == [0, 1]
            answer[1] = kv_source(1, "tcp://*:7000")
            answer.append(kv_source(2))
            await rec.until(lambda: len(rec.seen[-1]) == 3)
            diff = diff_sources(rec.seen[0], rec.seen[-1])
            assert [s.dp_rank for s in diff.added] == [2]
            assert [s.endpoint for s in diff.replaced] == ["tcp://127.0.0.1:7000"]
        await rec.until(lambda: len(rec.lost) == 1)
        assert isinstance(rec.lost[0], TargetUnreachableError)
        answered = len(rec.seen)
        await anyio.sleep(0.5)  # still down: no second notice
        assert len(rec.lost) == 1 and len(rec.seen) == answered
        async with serve_grpc([vllm(answer[:1])], port=port):
            await rec.until(lambda: len(rec.seen) > answered and len(rec.seen[-1]) == 1)
        await rec.until(lambda: len(rec.lost) == 2)  # it answered in between, so it is reported again
        tg.cancel_scope.cancel()


async def test_follow_target_never_raises_discovery_errors(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder(fail_on_sources=True)

    async def follow() -> None:
        await follow_target(
            "bad target", DiscoveryOptions(), rec.on_sources, rec.on_unreachable, interval=0.02, grace=0
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        await rec.until(lambda: bool(rec.lost))
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert len(rec.lost) == 1 and "target must be host:port" in str(rec.lost[0])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "bad target" in r.message]
    assert len(warnings) == 1  # the same failure again within a minute is not logged again
    with pytest.raises(InvalidOptionsError):
        await follow_target("h:1", DiscoveryOptions(), rec.on_sources, rec.on_unreachable, interval=0, grace=1)


# --- CLI -------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute")
    register(p.add_subparsers(dest="command", required=True))
    return p


async def cli(*argv: str) -> tuple[int, str, str]:
    """Run ``kvroute discover ARGV`` in a worker thread (it runs its own event loop) beside our servers."""
    args = parser().parse_args(["discover", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = await anyio.to_thread.run_sync(lambda: args.func(args, out, err))
    return code, out.getvalue(), err.getvalue()


async def test_cli_table_and_json() -> None:
    async with (
        serve_grpc([vllm([kv_source(0, replay_endpoint="tcp://*:5600"), kv_source(1)])]) as a,
        serve_grpc([sglang(sglang_server_info(sglang_kv(1, topic="kv")))]) as b,
    ):
        code, out, err = await cli(a.target, b.target)
        assert (code, err) == (EXIT_OK, "")
        lines = out.splitlines()
        assert lines[0].split() == ["WORKER", "RANK", "ENGINE", "ENDPOINT", "REPLAY", "TOPIC", "BLOCK", "HWM", "BUFFER"]
        replay = "tcp://127.0.0.1:5600"
        assert lines[1].split() == [a.target, "0", "vllm", "tcp://127.0.0.1:5557", replay, "-", "-", "100000", "10000"]
        assert lines[3].split() == [b.target, "0", "sglang", "tcp://127.0.0.1:5557", "-", "kv", "64", "-", "-"]
        code, out, _ = await cli(a.target, "--json", "--worker-id", "")
        assert code == EXIT_USAGE
        code, out, _ = await cli(a.target, "--json", "--worker-id", "a")
        report = json.loads(out)
        assert code == EXIT_OK and report["errors"] == []
        assert [(s["worker_id"], s["dp_rank"], s["endpoint"]) for s in report["sources"]] == [
            ("a", 0, "tcp://127.0.0.1:5557"),
            ("a", 1, "tcp://127.0.0.1:5558"),
        ]


async def test_cli_exit_code_per_failure_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    with refusing_port() as port:
        await _cli_exit_codes(f"127.0.0.1:{port}", monkeypatch)


async def _cli_exit_codes(dead: str, monkeypatch: pytest.MonkeyPatch) -> None:
    disabled = sglang(sglang_server_info(None))
    unusable = vllm([kv_source(0, transport="nng")])
    malformed = sglang("{")
    many = vllm([kv_source(r) for r in range(3)])
    guarded = vllm([kv_source(0)], api_key="tok")
    async with (
        serve_grpc([disabled]) as s1,
        serve_grpc([unusable]) as s2,
        serve_grpc([malformed]) as s3,
        serve_grpc([many]) as s4,
        serve_grpc([guarded]) as s5,
    ):
        for argv, expected, kind in [
            ((dead, "--timeout", "0.3"), EXIT_UNREACHABLE, "unreachable"),
            ((s1.target,), EXIT_EVENTS_DISABLED, "events disabled"),
            ((s2.target,), EXIT_UNUSABLE_SOURCE, "unusable source"),
            ((s3.target,), EXIT_MALFORMED_ANSWER, "malformed answer"),
            ((s4.target, "--max-sources", "2"), EXIT_TOO_MANY_SOURCES, "too many sources"),
            ((s5.target,), EXIT_REJECTED, "rejected"),
        ]:
            code, out, err = await cli(*argv)
            assert (code, out) == (expected, ""), argv
            assert err.startswith(f"kvroute discover: {argv[0]}: {kind}: "), err
        code, out, err = await cli(s2.target, s4.target, "--json")
        assert code == EXIT_UNUSABLE_SOURCE  # the first failing target in command-line order decides
        report = json.loads(out)
        assert [e["kind"] for e in report["errors"]] == ["unusable_source"] and len(report["sources"]) == 3
        monkeypatch.setenv("KVROUTE_TEST_TOKEN", "tok")
        assert (await cli(s5.target, "--token-env", "KVROUTE_TEST_TOKEN"))[0] == EXIT_OK
        assert (await cli(s5.target, "--header", "Authorization=Bearer tok"))[0] == EXIT_OK
        for bad in (("--header", "novalue"), ("--token-env", "KVROUTE_UNSET_VAR"), ("--allow-host", "1.2.3.4/99")):
            code, _, err = await cli(s5.target, *bad)
            assert code == EXIT_USAGE and err.startswith("kvroute discover: "), bad
        assert (await cli(s1.target, s2.target, "--worker-id", "w"))[0] == EXIT_USAGE
        # A malformed target is a usage error (issue 20: it exited 1), and nothing is asked.
        code, _, err = await cli("nohost")
        assert code == EXIT_USAGE and err.startswith("kvroute discover: nohost: target must be host:port"), err


async def test_cli_tls(ca: trustme.CA, tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    async with serve_grpc([vllm([kv_source(0)])], tls=server_tls(ca, "engine.internal")) as server:
        code, out, err = await cli(server.target, "--ca", str(ca_file), "--server-name", "engine.internal")
        assert (code, err) == (EXIT_OK, "") and "tcp://127.0.0.1:5557" in out


def test_cli_argument_errors_use_argparse_exit_code() -> None:
    for argv in (["discover"], ["discover", "h:1", "--engine", "trtllm"], ["discover", "h:1", "--timeout", "x"]):
        with pytest.raises(SystemExit) as info:
            parser().parse_args(argv)
        assert info.value.code == EXIT_USAGE


@pytest.fixture(autouse=True)
def _discovery_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO, logger="kvroute.discovery")
    yield
