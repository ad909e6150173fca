"""Type stubs of the compiled extension `kvroute._core` (the Rust crate at the repository root)."""

import random
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from ._hashing import MultimodalItem
from ._models import WorkerKey
from ._wire import EngineEvent, EventBatch

HASH_VERSION: int
MAX_DEPTH: int

def xxh128(data: bytes) -> bytes: ...

# --- the index (src/index, src/py/index.rs) -----------------------------------------------------

class Match:
    def tier(self, pos: int) -> dict[WorkerKey, int]: ...
    def hashed(self) -> dict[tuple[int, int], list[bytes]]: ...
    def query_blocks(self, worker: WorkerKey) -> int: ...

class Index:
    def __init__(
        self, max_block_sizes: int, max_entries_per_worker: int, max_groups_per_worker: int, max_cached_roots: int
    ) -> None: ...
    def apply_payload(
        self,
        worker: WorkerKey,
        payload: bytes,
        max_events_per_batch: int,
        max_blocks_per_event: int,
        max_block_size: int,
    ) -> tuple[float, str, str, int, list[tuple[str, int]]]: ...
    def apply_payloads(
        self,
        worker: WorkerKey,
        payloads: Sequence[bytes],
        max_events_per_batch: int,
        max_blocks_per_event: int,
        max_block_size: int,
    ) -> int: ...
    def apply_events(self, worker: WorkerKey, events: Iterable[EngineEvent]) -> None: ...
    def apply_event(self, worker: WorkerKey, event: EngineEvent) -> None: ...
    def remove_worker(self, worker: WorkerKey) -> None: ...
    def workers(self) -> list[WorkerKey]: ...
    def num_blocks(self, worker: WorkerKey | None = None) -> int: ...
    def block_size(self, worker: WorkerKey) -> int | None: ...
    def classes_of(self, worker: WorkerKey) -> list[tuple[int, int]]: ...
    def set_reuse_reports(self, on: bool) -> None: ...
    def stats(self) -> list[int]: ...
    def memory_bytes(self) -> int: ...
    def tables(self) -> dict[str, Any]: ...
    def find_matches(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        mm_items: Sequence[MultimodalItem],
        extra_keys: Sequence[Sequence[Any] | None] | None,
    ) -> tuple[dict[WorkerKey, int], dict[WorkerKey, int], dict[WorkerKey, int] | None, Match]: ...
    def export(
        self,
    ) -> list[
        tuple[
            WorkerKey,
            list[tuple[int, int]],
            int | None,
            int,
            list[int | bytes],
            list[bytes],
            list[tuple[int | bytes, list[int]]],
            list[tuple[int, str, int | None, int, list[int | bytes], list[bytes], list[int]]],
            bool,
        ]
    ]: ...
    def restore(
        self,
        data: bytes,
        key_type: Callable[[str, int], WorkerKey],
        check_header: Callable[[str, int, int], None],
        only: Collection[WorkerKey] | None = None,
    ) -> tuple[list[tuple[str, int, int, float]], list[tuple[WorkerKey, str]]]: ...
    # the JetStream relay's and replica's (kvroute/_snapshot.py's `encode_snapshot`)
    def snapshot_bytes(
        self, cursors: Sequence[tuple[str, int, int, float]], header: tuple[str, int, int, float]
    ) -> bytes: ...

def set_query_error(cls: type[Exception]) -> None: ...

# --- the router's compiled scoring (src/scoring.rs, src/py/router.rs) -------------------------

def set_candidate_type(cls: type[Any]) -> None: ...
def select(
    index: Index,
    token_ids: Sequence[int],
    lora_name: str | None,
    cache_salt: str | None,
    mm_items: Sequence[MultimodalItem],
    extra_keys: Sequence[Sequence[Any] | None] | None,
    model: Any,
    unit: int,
    universe: AbstractSet[WorkerKey] | None,
    registered: set[WorkerKey],
    states: Any,
    trust_partial: bool,
    loads: Mapping[WorkerKey, float] | Loads,
    scale: float,
    routed: dict[WorkerKey, int] | None,
    usage: dict[WorkerKey, float] | None = None,
    footprint: Footprint | None = None,
    rng: random.Random | None = None,
    record: bool = False,
    unvouched: AbstractSet[WorkerKey] | None = None,
    engine: tuple[EngineTable, float, float, str, int] | None = None,
    members: Members | None = None,
) -> tuple[
    Scored,
    int,
    float,
    list[int],
    int,
    int,
    tuple[int | None, WorkerKey | None] | None,
    list[WorkerKey],
    int,
]:
    """Match and price for `Router.select`:
    ``(scored, idle_count, idle_cost, tied, idle_tied, query_tokens, placed, vetoed, vetoes)``.

    ``universe`` None: every worker the index holds blocks for, plus ``registered``. ``placed``: the
    footprint's pick for a new placement (None: not one; ``(None, None)``: the idle group won but
    was emptied meanwhile); ``record`` counts it. ``unvouched``: the workers whose claims are not
    believed (None: ask ``states.worker_status`` per worker with overlap). ``engine``: ``(records,
    now, stale_after, mode, requests in flight)`` blended with ``loads`` (the router's `Loads`) as
    `EngineLoads.blend` does, ``usage`` then read from the records; ``vetoed`` the workers its
    vetoes took out of ``universe``, ``vetoes`` how many it vetoed. ``members``: the router's copy
    of its provider's live set."""

class EngineTable:
    """The engines' newest load records per worker, in arrival order (`EngineLoads` writes them)."""

    per_request: float
    def __init__(self, request_tokens: float) -> None: ...
    def __len__(self) -> int: ...
    def put(
        self,
        worker: WorkerKey,
        received: float,
        queued: float,
        requests: float,
        silence: float,
        allowance: float,
        usage: float,
    ) -> None:
        """Keep ``worker``'s newest record (a worker present keeps its place)."""
    def remove(self, worker: WorkerKey) -> None:
        """Forget ``worker``'s record."""

class Members:
    """A router's copy of its states provider's live set, as keys (kept while it is the same frozenset)."""

    def __init__(self) -> None: ...

class Footprint:
    """Decayed new-placement counts per worker and the pick of a new session's worker (kvroute._footprint)."""

    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def count(self, worker: WorkerKey) -> float:
        """``worker``'s decayed count of new placements (1.0 for one made just now)."""
    def add(self, worker: WorkerKey, half_life: float) -> None:
        """Count one new placement on ``worker``; every count decays by ``2 ** (-1 / half_life)``."""
    def discard(self, worker: WorkerKey) -> None:
        """Forget ``worker``'s count."""
    def pick(
        self,
        costs: Sequence[float],
        loads: Sequence[float],
        workers: Sequence[WorkerKey],
        idle_cost: float,
        idle: Callable[[], Iterable[WorkerKey]] | None,
        limit: Callable[[float], float],
        rng: random.Random,
    ) -> tuple[int | None, WorkerKey] | None:
        """The new placement's worker: ``(position in costs, or None for an idle worker, worker)``;
        None when the idle group won and ``idle`` found none."""

class SelectTimes:
    """`Router.select`'s call count and latency histogram, counted with atomics."""

    def __init__(self, bounds: list[float]) -> None: ...
    def record(self, seconds: float) -> None: ...
    def read(self) -> tuple[int, float, list[int]]:
        """``(calls, seconds, counts per bucket with the slower calls last)``."""

def new_frozen(cls: type[Any], names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    """An instance of ``cls`` with ``names`` set to ``values`` through `object.__setattr__` (no ``__init__``)."""

class Loads(MutableMapping[WorkerKey, int]):
    """The router's tracked load in tokens per worker, in insertion order (read by `select` without Python calls)."""

    def __init__(self) -> None: ...
    def __getitem__(self, worker: WorkerKey) -> int: ...
    def __setitem__(self, worker: WorkerKey, tokens: int) -> None: ...
    def __delitem__(self, worker: WorkerKey) -> None: ...
    def __iter__(self) -> Iterator[WorkerKey]: ...
    def __len__(self) -> int: ...

class Scored:
    """The candidates `select` priced, kept compact until `RoutingDecision.candidates` is read."""

    def __len__(self) -> int: ...
    def candidate(self, i: int) -> Any:
        """Candidate ``i`` as a `CandidateScore`."""
    def build(self) -> list[Any]:
        """Every candidate as a `CandidateScore`, in order."""
    def workers(self) -> list[WorkerKey]:
        """The candidates' workers, in order."""
    def costs(self) -> list[float]:
        """The candidates' costs, in order."""

def block_keys(
    parent: bytes,
    tokens: Sequence[int],
    block_size: int,
    n: int,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
    lookahead: Sequence[Sequence[int]] | None = None,
) -> list[bytes]: ...
def root_key(lora_name: str | None, cache_salt: str | None = None) -> bytes: ...

# --- wire (src/py/wire.rs) ---------------------------------------------------------------------
def decode_batch(payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int) -> Any:
    """Decode one payload into kvroute._wire.EventBatch; raises kvroute.DecodeError."""

def decode_count(
    payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int
) -> tuple[float, int, int, int, int, str | None, dict[str, int]]:
    """Decode one payload to ``(ts, events, stored_blocks, removed_blocks, clears, untrusted, skipped)``."""
def decode_checked(
    payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int
) -> tuple[EventBatch | None, str, str]:
    """Decode and judge one payload as ``apply_payload`` does: ``(batch, kind, detail)``, kind "" when applicable.

    ``batch`` is None only when the bytes did not decode; a refused batch is returned for its skip counts.
    """

def judge(
    payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int
) -> tuple[float, str, str, dict[str, int]]:
    """``decode_checked``'s verdict with no Python object per event: ``(ts, kind, detail, skipped)``."""

# --- the native receive loop (src/recv, src/py/recv.rs) -----------------------------------------

class NativeReceiver:
    def __init__(
        self,
        index: Index,
        visit: int,
        wakeup_bytes: int,
        quiet: float,
        outbox_bytes: int,
        max_sockets: int,
        max_events_per_batch: int,
        max_blocks_per_event: int,
        max_block_size: int,
        nice: int,
    ) -> None: ...
    def fileno(self) -> int: ...
    def add(
        self,
        token: int,
        worker: WorkerKey,
        endpoint: str,
        topic: bytes,
        rcvhwm: int,
        max_message_size: int,
        reconnect_ivl_ms: int,
        reconnect_ivl_max_ms: int,
        tcp_keepalive: bool,
    ) -> None: ...
    def stop(self, token: int) -> None: ...
    def remove(self, token: int) -> None: ...
    def open(self, token: int, next_seq: int, consumed: int, keep: bool = False) -> None: ...
    def close_fast(self, token: int) -> None: ...
    def park(self, token: int, parked: bool) -> None: ...
    def replay(
        self,
        id: int,
        token: int,
        endpoint: str,
        rcvhwm: int,
        max_message_size: int,
        reconnect_ivl_ms: int,
        reconnect_ivl_max_ms: int,
        tcp_keepalive: bool,
        from_seq: int,
        whole: bool,
        anchor: float | None,
        late_ok: bool,
        consumed: int,
        applied_seen: int,
        silent: float,
        deadline: float,
        budget: int,
        max_items: int,
        max_bytes: int,
    ) -> None: ...
    def disarm_replay(self, id: int) -> None: ...
    def replay_progress(self, id: int) -> int: ...
    def cancel_replay(self, id: int) -> None: ...
    def drain(
        self,
    ) -> tuple[
        # chunks of plain records, native u64 / f64: token, n, elided, blocks, n seqs / n ts, n lags
        list[tuple[bytes, bytes]],
        list[
            tuple[
                int,
                list[int],
                list[float],
                list[float],
                int,
                int,
                dict[str, int] | None,
                list[tuple[int, float, int, bytes]] | None,
            ]
        ],
        list[tuple[Any, ...]],
        list[str],
        str | None,
    ]: ...
    def hold(self) -> None: ...
    def release(self) -> None: ...
    def close(self) -> None: ...
