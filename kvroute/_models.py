"""Identities shared by every layer: which worker, which event source (and gateway stream endpoint), which tier."""

from __future__ import annotations

import threading
from collections.abc import Set as AbstractSet
from typing import Final, Literal, NamedTuple, Protocol, runtime_checkable

import msgspec


class WorkerKey(NamedTuple):
    """One data-parallel rank of one engine: the unit the index and the router reason about."""

    worker_id: str
    dp_rank: int


class EventSource(msgspec.Struct, frozen=True, kw_only=True):
    """One KV-event publisher (one data-parallel rank of one engine).

    Built by `discover` or by hand for static configuration. ``endpoint`` is connectable
    (wildcard bind hosts already replaced); ``replay_endpoint`` is None when the engine
    keeps no replay buffer. ``http_url``: the base URL of the engine's OpenAI-compatible HTTP
    server, where a router sends this worker's requests (the rank goes with each request:
    README "Where to send it"); None when unknown.
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
    #: The engine's HTTP base URL (``http://host:port``), given or learnt from discovery.
    http_url: str | None = None

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


@runtime_checkable
class VouchingStates(WorkerStates, Protocol):
    """`WorkerStates` that also keep the set of workers whose index claims a router must not believe.

    `KvEventClient` and `JetStreamReplica` implement it: a `Router` then reads one set per
    ``select`` instead of one `worker_status` per candidate with overlap, and the live workers
    without a copy of them. A provider without these keeps working through `worker_status` and
    `live_workers`.
    """

    def live_set(self) -> AbstractSet[WorkerKey]:
        """`live_workers` as an immutable set the provider keeps (no copy per call)."""
        ...

    def unvouched_workers(self, trust_partial: bool) -> AbstractSet[WorkerKey]:
        """The known workers not "synced", or (unless ``trust_partial``) partial: exactly those
        among `live_workers` whose `worker_status` a router would not trust. Current as of the call."""
        ...


class Vouching:
    """The unvouched workers of a states provider, kept as their sources' states change.

    A provider calls `update` for a worker whenever its ``(synced, partial)`` pair may have
    changed and `discard` when it stops knowing the worker; `unvouched` hands out the current
    set. A change only edits two private sets and marks the published pair stale; the first
    reader after it builds both frozensets at once, under the lock (a cold sync of 4,096
    sources changes states ~10,000 times: rebuilding per change was O(n²), 6 % of its profile).
    A router on another thread so reads one consistent pair and never a half-made change.
    """

    def __init__(self) -> None:
        # Writers run on the provider's event loop (a native thread's hand-overs are applied there too);
        # readers may be routers on other threads: the lock orders a build after the changes it saw.
        self._lock = threading.Lock()
        self._unsynced: set[WorkerKey] = set()
        self._partial: set[WorkerKey] = set()
        # (not synced, not synced or partial) as of the last build; None: a change since.
        self._published: tuple[frozenset[WorkerKey], frozenset[WorkerKey]] | None = (frozenset(), frozenset())

    def update(self, worker: WorkerKey, synced: bool, partial: bool) -> None:
        """Record ``worker``'s current pair."""
        with self._lock:
            changed = self._put(self._unsynced, worker, not synced)
            changed = self._put(self._partial, worker, partial) or changed
            if changed:
                self._published = None

    def discard(self, worker: WorkerKey) -> None:
        """Forget ``worker`` (its source was removed; an unknown worker is never trusted anyway)."""
        self.update(worker, True, False)

    def clear(self) -> None:
        """Forget every worker."""
        with self._lock:
            self._unsynced.clear()
            self._partial.clear()
            self._published = None

    @property
    def unsynced(self) -> frozenset[WorkerKey]:
        """The workers not synced (what ``trust_partial`` routers do not believe)."""
        return self._sets()[0]

    @property
    def untrusted(self) -> frozenset[WorkerKey]:
        """The workers not synced, or partial (what other routers do not believe)."""
        return self._sets()[1]

    def unvouched(self, trust_partial: bool) -> frozenset[WorkerKey]:
        """The workers not synced, or (unless ``trust_partial``) partial."""
        unsynced, untrusted = self._sets()
        return unsynced if trust_partial else untrusted

    def any_unsynced(self) -> WorkerKey | None:
        """One worker not synced, or None when all are: without building the published sets."""
        with self._lock:
            for worker in self._unsynced:
                return worker
        return None

    @staticmethod
    def _put(members: set[WorkerKey], worker: WorkerKey, present: bool) -> bool:
        """Make ``worker``'s membership of ``members`` be ``present``; whether that changed it."""
        if present == (worker in members):
            return False
        if present:
            members.add(worker)
        else:
            members.discard(worker)
        return True

    def _sets(self) -> tuple[frozenset[WorkerKey], frozenset[WorkerKey]]:
        """The published pair, built now if a change made it stale (kept until the next change)."""
        published = self._published
        if published is None:
            with self._lock:
                published = self._published
                if published is None:
                    published = self._published = (
                        frozenset(self._unsynced),
                        frozenset(self._unsynced | self._partial),
                    )
        return published


# --- gateway stream endpoints (docs/protocol.md §6) -------------------------------------------------

#: The gateway servicers' service names and the engine each fronts.
GATEWAY_SERVICES: Final = {
    "vllm.grpc.engine.VllmEngine": "vllm",
    "sglang.grpc.scheduler.SglangScheduler": "sglang",
    "trtllm.TrtllmService": "trtllm",
    "mlx.grpc.engine.MlxEngine": "mlx",
    "tokenspeed.grpc.scheduler.TokenSpeedScheduler": "tokenspeed",
}
#: The servicers whose ``GetLoads`` answers the data-parallel rank count.
RANK_COUNTING_SERVICES: Final = frozenset(
    s for s, e in GATEWAY_SERVICES.items() if e in ("vllm", "sglang", "tokenspeed")
)
_GATEWAY_SCHEME: Final = "grpc://"


def gateway_endpoint(address: str, service: str) -> str:
    """The `EventSource.endpoint` of a rank of ``service``'s stream at ``address`` (``host:port``)."""
    return f"{_GATEWAY_SCHEME}{address}/{service}"


def is_gateway_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` names a gateway stream (``grpc://…``), well-formed or not."""
    return endpoint.startswith(_GATEWAY_SCHEME)


def parse_gateway_endpoint(endpoint: str) -> tuple[str, str] | None:
    """``(address, service)`` of a gateway endpoint, or None when ``endpoint`` is not one."""
    if not endpoint.startswith(_GATEWAY_SCHEME):
        return None
    address, sep, service = endpoint[len(_GATEWAY_SCHEME) :].partition("/")
    if not sep or not address or service not in GATEWAY_SERVICES:
        return None
    return address, service


def gateway_sources(target: str, address: str, service: str, ranks: int, worker_id: str) -> list[EventSource]:
    """One `EventSource` per rank of ``service``'s stream at ``address``."""
    endpoint = gateway_endpoint(address, service)
    engine = GATEWAY_SERVICES[service]
    return [
        EventSource(worker_id=worker_id, dp_rank=r, endpoint=endpoint, engine=engine, target=target)
        for r in range(max(1, ranks))
    ]
