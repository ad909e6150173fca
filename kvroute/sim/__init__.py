"""Simulated vLLM / SGLang engines: KV-event publishers, replay buffers, gRPC discovery, HTTP serving.

``async with SimEngine(SimConfig(engine="vllm", ranks=2)) as engine:`` runs a stand-in engine in
the current process: a paged prefix cache per data-parallel rank (`PrefixCache`) that publishes
exactly what the real engine would (`EventPublisher`), its gRPC discovery service, and an
OpenAI-style HTTP server (``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/metrics``). ``kvroute sim`` runs one from the command line.
The discovery servers also stand alone (`serve_grpc` / `start_grpc_server` with a
`VllmControlService` or `SglangService`), for a fleet whose discovery must fail or vanish.
"""

from __future__ import annotations

from ._cache import BlockInfo, CacheStats, CapacityError, InvalidRequestError, PrefixCache
from ._engine import Completion, RequestAbortedError, SimConfig, SimEngine, SimRequest
from ._faults import FAULT_KINDS, DiscoveryServer, FaultDriver, FaultKind
from ._gateway import GatewayKvService, LoadFigures
from ._grpc import (
    GrpcServer,
    ServerTls,
    SglangService,
    VllmControlService,
    serve_grpc,
    sglang_server_info,
    start_grpc_server,
)
from ._http import detokenize, render_chat, tokenize
from ._publisher import EventPublisher

__all__ = [
    "FAULT_KINDS",
    "BlockInfo",
    "CacheStats",
    "CapacityError",
    "Completion",
    "DiscoveryServer",
    "EventPublisher",
    "GrpcServer",
    "FaultDriver",
    "FaultKind",
    "GatewayKvService",
    "InvalidRequestError",
    "LoadFigures",
    "PrefixCache",
    "RequestAbortedError",
    "ServerTls",
    "SglangService",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "VllmControlService",
    "detokenize",
    "render_chat",
    "serve_grpc",
    "sglang_server_info",
    "start_grpc_server",
    "tokenize",
]
