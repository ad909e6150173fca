"""When the client does not sync, it says why: bad targets refused up front, a typed timeout naming what is
pending, discovery errors readable at any time, and ``kvroute discover`` / ``kvroute --version`` as documented.

Real sockets on 127.0.0.1: a TCP listener that accepts and never answers, an HTTP/1 server, closed ports,
the simulated engines' gRPC servers; both anyio backends.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import anyio
import anyio.abc
import pytest
from _ports import refusing_port

import kvroute
from kvroute import ConfigError, EventSource, KvEventClient, KvRouteError, NotSyncedError, WorkerKey
from kvroute._discovery import DiscoveryOptions
from kvroute.cli._discover import register
from kvroute.cli._display import EXIT_REJECTED, EXIT_UNREACHABLE, EXIT_USAGE
from kvroute.cli._watch import _title
from kvroute.sim import SimConfig, SimEngine

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def silent_listener() -> AsyncIterator[str]:
    """A TCP port that accepts connections and never says a word (no HTTP/2 preface either)."""
    held: list[anyio.abc.SocketStream] = []

    async def hold(stream: anyio.abc.SocketStream) -> None:
        held.append(stream)
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http1_target() -> AsyncIterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# --- the client --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["localhost", "http://x:1", "grpc://127.0.0.1:50051", "h:0", "a b:1", ""])
def test_a_malformed_target_is_a_config_error_when_the_client_is_made(target: str) -> None:
    with pytest.raises(ConfigError, match="target"):
        KvEventClient(targets=[target])


async def test_add_target_refuses_a_malformed_target(anyio_backend: str) -> None:
    async with KvEventClient() as client:
        with pytest.raises(ConfigError):
            client.add_target("localhost")
        assert client.targets() == []


async def test_wait_synced_names_a_silent_target_and_its_discovery_error(anyio_backend: str) -> None:
    options = DiscoveryOptions(timeout=0.5)
    async with (
        silent_listener() as silent,
        SimEngine(SimConfig(http_port=None, block_size=4)) as eng,
        KvEventClient(targets=[silent, eng.grpc_target], discovery_options=options, discovery_interval=0.2) as client,
    ):
        with pytest.raises(NotSyncedError) as info:
            await client.wait_synced(3.0)
        err = info.value
        assert isinstance(err, TimeoutError) and isinstance(err, KvRouteError)
        # The silent target is pending, with why. (The engine beside it answers; on a loaded
        # machine one of its rounds may miss the short timeout too, and then it is named as well.)
        assert silent in err.targets and "no answer within" in err.targets[silent]
        assert silent in str(err) and "no answer within" in str(err)
        assert "no answer within" in client.discovery_errors()[silent]
        assert client.pending_targets()[silent] == client.discovery_errors()[silent]
        # `kvroute watch` shows it under its title.
        assert f"! {silent}: discovery failing: " in _title(client, [silent, eng.grpc_target], 1.0)
        client.remove_target(silent)
        await client.wait_synced(20)
        assert silent not in client.discovery_errors() and client.pending_targets() == {}


async def test_wait_synced_names_a_source_that_never_connects(anyio_backend: str) -> None:
    with refusing_port() as port:
        dead = EventSource(worker_id="w", endpoint=f"tcp://127.0.0.1:{port}")
        async with KvEventClient([dead]) as client:
            with pytest.raises(NotSyncedError) as info:
                await client.wait_synced(0.5)
            why = info.value.sources[WorkerKey("w", 0)]
            assert why.startswith("syncing") and f"not connected to {dead.endpoint}" in why
            assert info.value.targets == {} and client.pending_sources() == info.value.sources


async def test_an_error_raised_in_the_block_leaves_it_as_raised(anyio_backend: str) -> None:
    # The client's task group must not wrap the caller's own exceptions in an ExceptionGroup: the
    # documented way to wait is `except TimeoutError` around the whole block.
    with refusing_port() as port:
        dead = EventSource(worker_id="w", endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(TimeoutError) as info:
            async with KvEventClient([dead]) as client:
                await client.wait_synced(0.2)
        assert type(info.value) is NotSyncedError and WorkerKey("w", 0) in info.value.sources
        with pytest.raises(ValueError, match="the caller's own"):
            async with KvEventClient([dead]):
                raise ValueError("the caller's own")
        # Cancelling the block from outside still ends it quietly, every task stopped.
        with anyio.move_on_after(0.2) as scope:
            async with KvEventClient([dead]) as client:
                await anyio.sleep_forever()
        assert scope.cancelled_caught and client.stats().sources == {}


# --- kvroute discover ------------------------------------------------------------------------------------


async def cli(*argv: str) -> tuple[int, str, str, float]:
    """Run ``kvroute discover ARGV`` in a worker thread; (exit code, stdout, stderr, seconds)."""
    parser = argparse.ArgumentParser(prog="kvroute")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["discover", *argv])
    out, err = io.StringIO(), io.StringIO()
    began = time.monotonic()
    code = await anyio.to_thread.run_sync(lambda: args.func(args, out, err))
    return code, out.getvalue(), err.getvalue(), time.monotonic() - began


async def test_discover_at_a_closed_port_says_refused_at_once(anyio_backend: str) -> None:
    with refusing_port() as port:
        target = f"127.0.0.1:{port}"
        code, out, err, took = await cli(target, "--timeout", "20")
    assert code == EXIT_UNREACHABLE and out == ""
    assert err.startswith(f"kvroute discover: {target}: unreachable: connection refused"), err
    assert took < 10  # not the 20 s timeout's worth of retries


async def test_discover_at_an_http1_port_says_pass_the_grpc_port(anyio_backend: str, http1_target: str) -> None:
    code, _, err, took = await cli(http1_target, "--timeout", "20")
    assert code == EXIT_REJECTED, err
    assert "HTTP/1 server, not gRPC: pass the engine's gRPC port" in err and took < 10


async def test_discover_with_the_wrong_engine_hints_at_auto(anyio_backend: str) -> None:
    async with SimEngine(SimConfig(http_port=None)) as eng:  # a vLLM engine
        code, _, err, _ = await cli(eng.grpc_target, "--engine", "sglang")
        assert code == EXIT_REJECTED and "UNIMPLEMENTED" in err and "try engine auto" in err, err
    async with SimEngine(SimConfig(engine="sglang", http_port=None)) as eng:
        code, _, err, _ = await cli(eng.grpc_target, "--engine", "vllm")
        assert code == EXIT_REJECTED and "try engine auto" in err, err


async def test_discover_exit_codes_for_bad_targets(anyio_backend: str) -> None:
    code, _, err, _ = await cli("localhost")
    assert code == EXIT_USAGE and "target must be host:port" in err
    code, _, err, _ = await cli("http://x:1")
    assert code == EXIT_USAGE
    # A name that does not resolve: the target cannot be reached (not an advertised source's fault).
    code, _, err, _ = await cli("no-such-host.invalid:50051")
    assert code == EXIT_UNREACHABLE and "cannot resolve" in err, err


def test_kvroute_version() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from kvroute.cli import main; main(['--version'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == f"kvroute {kvroute.__version__}"
