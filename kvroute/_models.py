"""Identities shared by every layer: which worker, which event source, which storage tier."""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import msgspec


class WorkerKey(NamedTuple):
    """One data-parallel rank of one engine: the unit the index and the router reason about."""

    worker_id: str
    dp_rank: int


class EventSource(msgspec.Struct, frozen=True, kw_only=True):
    """One KV-event publisher (one data-parallel rank of one engine).

    Built by `discover` or by hand for static configuration. ``endpoint`` is connectable
    (wildcard bind hosts already replaced); ``replay_endpoint`` is None when the engine
    keeps no replay buffer.
    """

    worker_id: str
    dp_rank: int = 0
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    hwm: int | None = None
    buffer_steps: int | None = None
    block_size: int | None = None
    engine: str = "static"
    #: The gRPC target this source was discovered from (None for static sources).
    target: str | None = None
    #: Optional ZMQ CURVE server public key (z85, 40 chars) of the publisher.
    curve_server_key: str | None = None

    @property
    def key(self) -> WorkerKey:
        """The `WorkerKey` this source feeds."""
        return WorkerKey(self.worker_id, self.dp_rank)


# Storage tiers. vLLM and SGLang name them differently; `normalize_medium` maps every
# spelling onto these four (docs/protocol.md §3: nil = GPU).
GPU = "GPU"
CPU = "CPU"
DISK = "DISK"
EXTERNAL = "EXTERNAL"
TIERS: tuple[str, ...] = (GPU, CPU, DISK, EXTERNAL)

_MEDIUM_ALIASES = {
    None: GPU,
    "GPU": GPU,
    "CPU": CPU,
    "CPU_PINNED": CPU,
    "DISK": DISK,
    "STORAGE": DISK,
    "EXTERNAL": EXTERNAL,
}


def normalize_medium(medium: str | None) -> str:
    """Map an engine's ``medium`` string onto one of `TIERS`; unknown spellings count as EXTERNAL."""
    tier = _MEDIUM_ALIASES.get(medium)
    if tier is None:
        tier = _MEDIUM_ALIASES.get(medium.upper() if medium else None, EXTERNAL)
    return tier


#: A source's sync state (`WorkerStatus.state`); the recovery machine defines when each holds.
SourceState = Literal["syncing", "synced", "resyncing"]


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What the subscriber knows of one worker's index state, as the router reads it.

    ``state``: "syncing" (connecting, cold-start replay, or an identity check in flight),
    "synced" (caught up: the index holds what the worker holds, as far as the replay buffer
    reached), "resyncing" (a gap or restart is being recovered; claims are held back).
    ``partial``: the worker's history before its replay buffer is unknown, so the index
    holds only a subset of what it caches.
    """

    state: SourceState
    partial: bool = False

    @property
    def synced(self) -> bool:
        """True when the index is caught up with this worker."""
        return self.state == "synced"


class WorkerStates(Protocol):
    """Where a router learns which workers exist and whether their index state can be trusted.

    `KvEventClient` implements it; tests and static setups may supply their own.
    """

    def worker_status(self, worker: WorkerKey) -> WorkerStatus | None:
        """The worker's status, or None when it is not (or no longer) known."""
        ...

    def live_workers(self) -> set[WorkerKey]:
        """Every worker currently subscribed (discovered and not removed)."""
        ...
