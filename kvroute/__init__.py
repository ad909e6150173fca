"""kvroute: send each prompt to the worker whose KV cache already holds the longest prefix of it.

Discovery (gRPC) → transports (a ZMQ SUB per rank with replay recovery, or a gateway's gRPC stream)
→ wire codec → prefix index → router. The public names are the 45 below, each one a router author
touches; every module is private. Simulated engines for tests and demos live in `kvroute.sim`; the
``kvroute`` command line in `kvroute.cli`.

The client and its settings:

- `KvEventClient`: follows engines (static `EventSource`s or discovered targets), keeps a `PrefixIndex`
  current, streams `Envelope`s (`EventStream`); `ClientStats` are its counters.
- `SubscriberConfig` (sockets, replay, memory), `Limits` (decode caps), `DiscoveryOptions` and `TlsConfig`
  (how targets are asked), `discover` (ask one target), `IndexLimits` (the index's bounds).
- `EventSource` (one publisher), `WorkerKey` (an engine rank), `WorkerStatus` (what the
  router trusts), `Cursor` (a source's position, for warm restarts).

The index: `PrefixIndex`; `find_matches` answers `OverlapScores` (leading blocks per worker).

Routing: `Router` (`RoutingDecision`), `CostModel`, `LoadPolicy`, `MultimodalItem`, `chain_keys`;
`follow_engine_metrics` feeds the engines' own load (Prometheus) to the router.

Replicas: `JetStreamRelay` republishes what a client applied to NATS JetStream; `JetStreamReplica`, or a
`KvEventClient(jetstream="nats://host:4222/<stream>")`, follows it.

Events: `EventBatch` of events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), `decode_batch` /
`encode_batch`; lifecycle events a router reacts to: `Synced`, `Partial`, `Reset`, `Removed`,
`Disconnected`, `Overflow`. Metrics: `KvRouteCollector`.

Errors (all `KvRouteError`): `ConfigError`, `DecodeError`, `DiscoveryError`, `NoWorkersError`,
`NotSyncedError`, `SnapshotError`.

Names public before 0.2 and no longer (plumbing, type aliases, the finer error classes) still import from
here for one release, with a `DeprecationWarning` naming where they live now.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from ._client import ClientStats, EventStream, KvEventClient
from ._discovery import DiscoveryOptions, TlsConfig, discover
from ._errors import (
    ConfigError,
    DecodeError,
    DiscoveryError,
    KvRouteError,
    NotSyncedError,
    NoWorkersError,
    SnapshotError,
)
from ._events import Disconnected, Envelope, Overflow, Partial, Removed, Reset, Synced
from ._hashing import MultimodalItem, chain_keys
from ._index import IndexLimits, OverlapScores, PrefixIndex
from ._jetstream_relay import JetStreamRelay
from ._jetstream_replica import JetStreamReplica
from ._load import LoadPolicy, follow_engine_metrics
from ._metrics import KvRouteCollector
from ._models import EventSource, WorkerKey, WorkerStatus
from ._router import CostModel, Router, RoutingDecision
from ._snapshot import Cursor
from ._transports.zmq.config import SubscriberConfig
from ._wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Limits,
    decode_batch,
    encode_batch,
)

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClientStats",
    "ConfigError",
    "CostModel",
    "Cursor",
    "DecodeError",
    "Disconnected",
    "DiscoveryError",
    "DiscoveryOptions",
    "Envelope",
    "EventBatch",
    "EventSource",
    "EventStream",
    "IndexLimits",
    "JetStreamRelay",
    "JetStreamReplica",
    "KvEventClient",
    "KvRouteCollector",
    "KvRouteError",
    "Limits",
    "LoadPolicy",
    "MultimodalItem",
    "NoWorkersError",
    "NotSyncedError",
    "Overflow",
    "OverlapScores",
    "Partial",
    "PrefixIndex",
    "Removed",
    "Reset",
    "Router",
    "RoutingDecision",
    "SnapshotError",
    "SubscriberConfig",
    "Synced",
    "TlsConfig",
    "WorkerKey",
    "WorkerStatus",
    "chain_keys",
    "decode_batch",
    "discover",
    "encode_batch",
    "follow_engine_metrics",
]

# Public until 0.1, deprecated now: name -> the private module that holds it. Each still imports
# from `kvroute` for one release, with a DeprecationWarning (module __getattr__, PEP 562).
_DEPRECATED: dict[str, str] = {
    "BatchDecoder": "kvroute._wire",
    "BlockHash": "kvroute._wire",
    "CPU": "kvroute._models",
    "CandidateScore": "kvroute._router",
    "ClientStateError": "kvroute._errors",
    "Connected": "kvroute._events",
    "DEFAULT_MAX_SOURCES": "kvroute._discovery",
    "DISK": "kvroute._models",
    "ENGINES": "kvroute._discovery",
    "EXTERNAL": "kvroute._models",
    "EngineEvent": "kvroute._wire",
    "EngineLoad": "kvroute._load",
    "EngineLoads": "kvroute._load",
    "EventsDisabledError": "kvroute._errors",
    "GATEWAY_SERVICES": "kvroute._models",
    "GPU": "kvroute._models",
    "Gap": "kvroute._events",
    "GapReason": "kvroute._events",
    "HASH_VERSION": "kvroute._hashing",
    "IndexLimitsError": "kvroute._index",
    "IndexStats": "kvroute._index",
    "InvalidOptionsError": "kvroute._errors",
    "LifecycleEvent": "kvroute._events",
    "MalformedAnswerError": "kvroute._errors",
    "ReplayPurpose": "kvroute._events",
    "Replayed": "kvroute._events",
    "ResetReason": "kvroute._events",
    "RouterError": "kvroute._router",
    "RouterStats": "kvroute._router",
    "RpcRejectedError": "kvroute._errors",
    "SourceCounters": "kvroute._transports._base",
    "SourceDiff": "kvroute._discovery",
    "SourceState": "kvroute._models",
    "SourceStats": "kvroute._transports._base",
    "TIERS": "kvroute._models",
    "TargetUnreachableError": "kvroute._errors",
    "TooManySourcesError": "kvroute._errors",
    "TotalStats": "kvroute._client",
    "UnusableSourceError": "kvroute._errors",
    "WorkerStates": "kvroute._models",
    "diff_sources": "kvroute._discovery",
    "discover_with": "kvroute._discovery",
    "follow_target": "kvroute._discovery",
    "gateway_endpoint": "kvroute._models",
    "normalize_medium": "kvroute._models",
}


def __getattr__(name: str) -> Any:
    """A name public until 0.1: returned with a `DeprecationWarning` (it leaves the package in the next release)."""
    module = _DEPRECATED.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
    warnings.warn(
        f"kvroute.{name} is no longer public and will be removed in the next release "
        f"(it lives in the private {module}; see the CHANGELOG for what to use instead)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (and the deprecated ones, still importable for one release)."""
    return sorted({*__all__, *_DEPRECATED, "__version__"})
