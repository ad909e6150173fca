"""kvroute: send each prompt to the worker whose KV cache already holds the longest prefix of it.

Discovery (gRPC) → subscriber (ZMQ, one SUB per rank, with replay recovery) → wire codec (msgpack)
→ prefix index → router. Everything public is re-exported here; every other module is private.
Simulated engines for tests and demos live in `kvroute.sim`.
"""

from __future__ import annotations

from ._client import ClientStats, EventStream, KvEventClient, TotalStats
from ._discovery import (
    DiscoveryOptions,
    InvalidOptionsError,
    MalformedAnswerError,
    RpcRejectedError,
    SourceDiff,
    TargetUnreachableError,
    TlsConfig,
    TooManySourcesError,
    diff_sources,
    discover,
    discover_with,
    follow_target,
)
from ._errors import (
    DecodeError,
    DiscoveryError,
    EventsDisabledError,
    KvRouteError,
    NoWorkersError,
    SnapshotError,
    UnusableSourceError,
)
from ._events import (
    Connected,
    Disconnected,
    Envelope,
    Gap,
    LifecycleEvent,
    Overflow,
    Partial,
    Removed,
    Replayed,
    Reset,
    Synced,
)
from ._grpc_stream import GATEWAY_SERVICES, gateway_endpoint
from ._hashing import HASH_VERSION, MultimodalItem
from ._index import IndexLimits, IndexLimitsError, IndexStats, OverlapScores, PrefixIndex
from ._load import EngineLoad, EngineLoads, LoadPolicy
from ._metrics import KvRouteCollector
from ._models import CPU, DISK, EXTERNAL, GPU, TIERS, EventSource, WorkerKey, WorkerStates, WorkerStatus
from ._router import CandidateScore, CostModel, Router, RouterError, RouterStats, RoutingDecision
from ._snapshot import Cursor
from ._subscriber import SourceStats, SubscriberConfig
from ._wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    Limits,
    decode_batch,
    encode_batch,
)

__version__ = "0.1.0"

__all__ = [
    "CPU",
    "DISK",
    "EXTERNAL",
    "GATEWAY_SERVICES",
    "GPU",
    "TIERS",
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "CandidateScore",
    "ClientStats",
    "Connected",
    "CostModel",
    "Cursor",
    "DecodeError",
    "Disconnected",
    "DiscoveryError",
    "DiscoveryOptions",
    "EngineEvent",
    "EngineLoad",
    "EngineLoads",
    "Envelope",
    "EventBatch",
    "EventSource",
    "EventStream",
    "EventsDisabledError",
    "Gap",
    "HASH_VERSION",
    "IndexLimits",
    "IndexLimitsError",
    "IndexStats",
    "InvalidOptionsError",
    "KvEventClient",
    "KvRouteCollector",
    "KvRouteError",
    "LifecycleEvent",
    "Limits",
    "LoadPolicy",
    "MalformedAnswerError",
    "NoWorkersError",
    "MultimodalItem",
    "OverlapScores",
    "Overflow",
    "Partial",
    "PrefixIndex",
    "Removed",
    "Replayed",
    "Reset",
    "Router",
    "RouterError",
    "RouterStats",
    "RoutingDecision",
    "RpcRejectedError",
    "SnapshotError",
    "SourceDiff",
    "SourceStats",
    "SubscriberConfig",
    "Synced",
    "TargetUnreachableError",
    "TlsConfig",
    "TooManySourcesError",
    "TotalStats",
    "UnusableSourceError",
    "WorkerKey",
    "WorkerStates",
    "WorkerStatus",
    "__version__",
    "decode_batch",
    "diff_sources",
    "discover",
    "discover_with",
    "follow_target",
    "encode_batch",
    "gateway_endpoint",
]
