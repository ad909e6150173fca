"""gRPC discovery servers of simulated engines: vLLM ``vllm.Control`` and SGLang ``SglangService``.

Shape::

    vllm = VllmControlService(lambda: engine.sources())        # KvEventSource protos or EventSource structs
    sglang = SglangService(lambda: sglang_server_info(kv_events=...))
    async with serve_grpc([vllm], host="127.0.0.1") as server:  # port 0 = pick a free one
        await discover(server.target)
    # or, when the lifetime does not fit one block (an engine restarting):
    server = await start_grpc_server([vllm], host="127.0.0.1", port=0, tls=None)
    ...
    await server.stop()

A server registers only the services it is given, so the other engine's method answers
UNIMPLEMENTED (gRPC's default), which is how a real vLLM or SGLang server looks to ``engine="auto"``.

Threads: grpc's asyncio API (``grpc.aio``) runs only on asyncio, and kvroute supports trio too,
so the server is grpc's threaded one. Each handler hops back onto the event loop that started
the server (``anyio.from_thread.run_sync``) to call ``get_sources`` / ``get_json``, so those
callbacks may read engine state without locks. They must not block: the event loop answers.

Faults for tests and chaos runs: ``api_key`` (calls without ``authorization: Bearer <key>`` get
UNAUTHENTICATED), ``fail_next(code, count)`` (the next calls fail with that status), and
``received_metadata`` (what each call carried).
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent import futures
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import grpc
import msgspec

from .._models import EventSource
from .._proto import sglang_service_pb2 as sglang_pb
from .._proto import vllm_control_pb2 as vllm_pb
from ._ports import free_port

__all__ = [
    "GrpcServer",
    "ServerTls",
    "SglangService",
    "VllmControlService",
    "serve_grpc",
    "sglang_server_info",
    "source_to_proto",
    "start_grpc_server",
]

# vLLM's KVEventsConfig defaults (docs/protocol.md §1), advertised when an EventSource leaves them unset.
VLLM_DEFAULT_BUFFER_STEPS = 10_000
VLLM_DEFAULT_HWM = 100_000
VLLM_DEFAULT_MAX_QUEUE_SIZE = 100_000
# Discovery is a handful of small unary calls; a gateway stream holds a thread for its life.
_HANDLER_THREADS = 16

Metadata = tuple[tuple[str, str | bytes], ...]


class ServerTls(msgspec.Struct, frozen=True, kw_only=True):
    """TLS for a simulated server: PEM bytes; with ``client_ca`` set, clients must present a cert it signed."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None


def source_to_proto(source: EventSource) -> vllm_pb.KvEventSource:
    """Describe an `EventSource` the way vLLM's Control service does (zmq, msgpack, schema 1).

    ``endpoint`` and ``replay_endpoint`` are sent verbatim, so a simulated engine can advertise its
    bind address (``tcp://*:5557``) as vLLM does; unset hwm / buffer_steps get vLLM's defaults.
    """
    return vllm_pb.KvEventSource(
        transport="zmq",
        endpoint=source.endpoint,
        topic=source.topic,
        replay_endpoint=source.replay_endpoint or "",
        data_parallel_rank=source.dp_rank,
        encoding="msgpack",
        schema_version=1,
        buffer_steps=VLLM_DEFAULT_BUFFER_STEPS if source.buffer_steps is None else source.buffer_steps,
        hwm=VLLM_DEFAULT_HWM if source.hwm is None else source.hwm,
        max_queue_size=VLLM_DEFAULT_MAX_QUEUE_SIZE,
    )


def sglang_server_info(
    kv_events: Mapping[str, Any] | None,
    *,
    kv_events_config: str | Mapping[str, Any] | None = None,
    **extra: Any,
) -> str:
    """Build an SGLang ``GetServerInfo`` ``json_info`` string around a ``kv_events`` descriptor.

    ``kv_events`` None means events disabled (SGLang sends ``null``). A few of SGLang's other
    top-level keys are included so that clients prove they ignore what they do not know;
    ``extra`` adds or overrides top-level keys.
    """
    info: dict[str, Any] = {"model_path": "sim/model", "version": "0.5.23", "dp_size": 1}
    if kv_events is not None:
        info["dp_size"] = kv_events.get("dp_size", 1)
    info["kv_events"] = None if kv_events is None else dict(kv_events)
    if kv_events_config is not None:
        info["kv_events_config"] = kv_events_config if isinstance(kv_events_config, str) else dict(kv_events_config)
    info.update(extra)
    return json.dumps(info)


class _Abort(msgspec.Struct, frozen=True):
    """A call's answer when it must fail: the status to abort with."""

    code: grpc.StatusCode
    details: str


class _Service(abc.ABC):
    """What both services share: auth, fault injection, metadata recording, the hop to the event loop."""

    service_name = ""

    def __init__(self, *, api_key: str | None) -> None:
        self.api_key = api_key
        #: Invocation metadata of every call received, oldest first.
        self.received_metadata: list[Metadata] = []
        self._faults: list[_Abort] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None

    @property
    def calls(self) -> int:
        """Number of calls received so far (failed ones included)."""
        return len(self.received_metadata)

    def fail_next(self, code: grpc.StatusCode, count: int = 1, details: str = "injected fault") -> None:
        """Make the next ``count`` calls fail with ``code`` (e.g. UNAVAILABLE to exercise client retries)."""
        self._faults.extend([_Abort(code, details)] * count)

    def bind(self, token: anyio.lowlevel.EventLoopToken) -> None:
        """Attach the service to the event loop whose thread runs its callbacks (done by the server)."""
        self._token = token

    @abc.abstractmethod
    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The grpc handler serving this service's one method."""

    def _serve(self, context: grpc.ServicerContext, answer: Callable[[], Any]) -> Any:
        """Run ``answer`` on the event loop after the checks; abort the call as the checks say."""
        metadata: Metadata = tuple((key, value) for key, value in context.invocation_metadata())

        def on_loop() -> Any:
            self.received_metadata.append(metadata)
            if self._faults:
                return self._faults.pop(0)
            if self.api_key is not None and ("authorization", f"Bearer {self.api_key}") not in metadata:
                return _Abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            return answer()

        if self._token is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "service not started")
        try:
            result = anyio.from_thread.run_sync(on_loop, token=self._token)
        except anyio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "simulated engine is shutting down")
        if isinstance(result, _Abort):
            context.abort(result.code, result.details)
        return result


class VllmControlService(_Service):
    """vLLM's ``vllm.Control`` service answering ``GetKvEventSources`` from ``get_sources()``."""

    service_name = "vllm.Control"

    def __init__(
        self,
        get_sources: Callable[[], Sequence[vllm_pb.KvEventSource | EventSource]],
        *,
        api_key: str | None = None,
    ) -> None:
        super().__init__(api_key=api_key)
        self.get_sources = get_sources

    def _answer(self) -> vllm_pb.GetKvEventSourcesResponse:
        sources = [s if isinstance(s, vllm_pb.KvEventSource) else source_to_proto(s) for s in self.get_sources()]
        return vllm_pb.GetKvEventSourcesResponse(sources=sources)

    def _get_kv_event_sources(
        self, request: vllm_pb.GetKvEventSourcesRequest, context: grpc.ServicerContext
    ) -> vllm_pb.GetKvEventSourcesResponse:
        response: vllm_pb.GetKvEventSourcesResponse = self._serve(context, self._answer)
        return response

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The grpc handler for ``/vllm.Control/GetKvEventSources``."""
        method = grpc.unary_unary_rpc_method_handler(
            self._get_kv_event_sources,
            request_deserializer=vllm_pb.GetKvEventSourcesRequest.FromString,
            response_serializer=vllm_pb.GetKvEventSourcesResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(self.service_name, {"GetKvEventSources": method})


class SglangService(_Service):
    """SGLang's ``sglang.runtime.v1.SglangService`` answering ``GetServerInfo`` with ``get_json()``."""

    service_name = "sglang.runtime.v1.SglangService"

    def __init__(self, get_json: Callable[[], str], *, api_key: str | None = None) -> None:
        super().__init__(api_key=api_key)
        self.get_json = get_json

    def _answer(self) -> sglang_pb.GetServerInfoResponse:
        return sglang_pb.GetServerInfoResponse(json_info=self.get_json())

    def _get_server_info(
        self, request: sglang_pb.GetServerInfoRequest, context: grpc.ServicerContext
    ) -> sglang_pb.GetServerInfoResponse:
        response: sglang_pb.GetServerInfoResponse = self._serve(context, self._answer)
        return response

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The grpc handler for ``/sglang.runtime.v1.SglangService/GetServerInfo``."""
        method = grpc.unary_unary_rpc_method_handler(
            self._get_server_info,
            request_deserializer=sglang_pb.GetServerInfoRequest.FromString,
            response_serializer=sglang_pb.GetServerInfoResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(self.service_name, {"GetServerInfo": method})


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """A running discovery server; ``target`` is the ``host:port`` a client dials."""

    def __init__(self, server: grpc.Server, executor: futures.ThreadPoolExecutor, host: str, port: int) -> None:
        self._server = server
        self._executor = executor
        self.host = host
        self.port = port
        self.target = _host_port(host, port)
        self._stopped = False

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds) and release the handler threads."""
        if self._stopped:
            return
        self._stopped = True
        done = self._server.stop(grace)

        def wait() -> None:
            done.wait()
            self._executor.shutdown(wait=True)

        # Shielded: a cancelled owner still leaves no server thread behind.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(wait)


async def start_grpc_server(
    services: Sequence[_Service],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ServerTls | None = None,
) -> GrpcServer:
    """Start serving ``services`` on ``host:port`` (0 = a free port); the caller must ``await server.stop()``.

    Raises OSError when the address cannot be bound (grpc reports it as a RuntimeError).
    """
    token = anyio.lowlevel.current_token()
    for service in services:
        service.bind(token)
    executor = futures.ThreadPoolExecutor(max_workers=_HANDLER_THREADS, thread_name_prefix="kvroute-sim-grpc")
    # so_reuseport off: a second server on a busy port must fail, not silently share it.
    server = grpc.server(executor, handlers=[s.handler() for s in services], options=[("grpc.so_reuseport", 0)])
    # Below the ephemeral range: a discovery server stopped and started on its port (`DiscoveryServer`)
    # finds it free.
    address = _host_port(host, port or free_port(host))
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(tls.private_key, tls.certificate_chain)],
                root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        executor.shutdown(wait=False)
        raise OSError(f"cannot bind gRPC server to {address}: {exc}") from exc
    server.start()
    return GrpcServer(server, executor, host.strip("[]"), bound)


@asynccontextmanager
async def serve_grpc(
    services: Sequence[_Service],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ServerTls | None = None,
) -> AsyncIterator[GrpcServer]:
    """Serve ``services`` for the duration of the block (see `start_grpc_server`)."""
    server = await start_grpc_server(services, host, port, tls)
    try:
        yield server
    finally:
        await server.stop()
