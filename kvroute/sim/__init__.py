"""Simulated vLLM / SGLang engines: KV-event publishers, replay buffers, gRPC discovery, HTTP serving.

``async with SimEngine(SimConfig(engine="vllm", ranks=2)) as engine:`` runs a stand-in engine in
the current process: a paged prefix cache per data-parallel rank (`PrefixCache`) that publishes
exactly what the real engine would (`EventPublisher`), its gRPC discovery service, and an
OpenAI-style ``POST /v1/completions``. ``kvroute sim`` runs one from the command line.
"""

from __future__ import annotations

from ._cache import BlockInfo, CacheStats, CapacityError, InvalidRequestError, PrefixCache
from ._engine import Completion, RequestAbortedError, SimConfig, SimEngine, SimRequest
from ._gateway import GatewayKvService, LoadFigures
from ._http import detokenize, tokenize
from ._publisher import EventPublisher

__all__ = [
    "BlockInfo",
    "CacheStats",
    "CapacityError",
    "Completion",
    "EventPublisher",
    "GatewayKvService",
    "InvalidRequestError",
    "LoadFigures",
    "PrefixCache",
    "RequestAbortedError",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "detokenize",
    "tokenize",
]
