"""kvroute: send each prompt to the worker whose KV cache already holds the longest prefix of it.

Discovery (gRPC) → subscriber (ZMQ, one SUB per rank, with replay recovery) → wire codec (msgpack)
→ prefix index → router. Everything public is re-exported here; every other module is private.
"""

from __future__ import annotations

from ._errors import DecodeError, DiscoveryError, KvRouteError, NoWorkersError, SnapshotError
from ._index import IndexStats, OverlapScores, PrefixIndex
from ._models import CPU, DISK, EXTERNAL, GPU, TIERS, EventSource, WorkerKey, WorkerStatus
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
    "GPU",
    "TIERS",
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "DiscoveryError",
    "EngineEvent",
    "EventBatch",
    "EventSource",
    "IndexStats",
    "KvRouteError",
    "Limits",
    "NoWorkersError",
    "OverlapScores",
    "PrefixIndex",
    "SnapshotError",
    "WorkerKey",
    "WorkerStatus",
    "__version__",
    "decode_batch",
    "encode_batch",
]
