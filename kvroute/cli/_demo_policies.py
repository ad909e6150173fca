"""The routing policies ``kvroute demo`` compares: kvroute, an oracle, and the baselines deployments use.

- ``kvroute``: `kvroute.Router` over the client's index (learned from the engines' KV events only).
- ``oracle``: the same cost model and load tracking as the Router, but each worker's overlap is read
  from the simulated engine itself at the moment of the decision: what its cache holds
  (`PrefixCache.match_blocks`), or, where longer, what it is computing now (the prompts it runs or
  has queued, `SimEngine.in_flight`): no event lag, no loss, nothing the index or the router's own
  memory could get wrong. Its hit rate is what kvroute's policy could reach on this fleet, with its
  capacity, eviction and timing: the *capacity-aware* reachable.
- ``session_affinity``: consistent hashing on the prompt's leading tokens (a ring of virtual nodes, as
  Envoy's ring hash or a session-sticky gateway does): a conversation's turns, which share their
  leading blocks, land on one worker whatever its load.
- ``least_load``: the worker with the fewest requests in flight (ties at random).
- ``round_robin`` / ``random``: the naive baselines.

Each policy sees only what a router would (the live workers, its own in-flight requests), except the
oracle, which is allowed the engines' caches on purpose.
"""

from __future__ import annotations

import bisect
import random
from array import array
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol

import msgspec
import xxhash

from kvroute import CostModel, KvEventClient, Router, WorkerKey
from kvroute._load import EngineLoads
from kvroute.sim import SimEngine

__all__ = [
    "AFFINITY_TOKENS",
    "EXTRA_POLICIES",
    "KVROUTE_POLICIES",
    "POLICIES",
    "LeastLoadPolicy",
    "OracleDecision",
    "OraclePolicy",
    "Policy",
    "SessionAffinityPolicy",
    "make_policy",
]

POLICIES = ("kvroute", "oracle", "session_affinity", "least_load", "round_robin", "random")
#: Policies run only when named: ``kvroute_index_only`` is kvroute without its routing hint,
#: ``kvroute_no_footprint`` kvroute without its footprint (``CostModel(footprint=False)``),
#: ``kvroute_long_prefix`` kvroute with the long-prefix term (``CostModel(long_prefix=True)``),
#: ``kvroute_long_move`` kvroute pricing a move by what it recomputes over the best candidate (the default
#: since session 13: the same as ``kvroute`` unless the given cost model turns it off),
#: ``kvroute_no_long_move`` kvroute without it (``CostModel(long_move=False)``, the default before),
#: ``kvroute_hashed`` kvroute placing new sessions by a stable hash of their leading tokens (`HashedPlacementPolicy`).
EXTRA_POLICIES = (
    "kvroute_index_only",
    "kvroute_no_footprint",
    "kvroute_long_prefix",
    "kvroute_long_move",
    "kvroute_no_long_move",
    "kvroute_hashed",
)
#: The policies that are kvroute's `Router` (the demo follows the engines' ``/metrics`` for them on ZMQ fleets).
KVROUTE_POLICIES = ("kvroute", *EXTRA_POLICIES)
#: ``Router(routed_ttl=)`` of the demo's kvroute: the routing hint on (docs/routing-quality.md).
ROUTED_TTL = 10.0

#: Leading tokens session affinity hashes: two 512-token blocks of a Mooncake trace, the first of which
#: is often a system prompt every request shares; the second is the conversation's own.
AFFINITY_TOKENS = 1024
# Virtual nodes per worker on the hash ring: enough for an even split of keys over a few workers.
_VNODES = 160


class Policy(Protocol):
    """What the demo asks of a policy: a worker for a prompt, and word when that request ended."""

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey: ...

    def prefill_done(self, request_id: Hashable) -> None: ...

    def finished(self, request_id: Hashable) -> None: ...


class _Baseline:
    """A policy that tracks nothing past its choice."""

    def prefill_done(self, request_id: Hashable) -> None:
        return None

    def finished(self, request_id: Hashable) -> None:
        return None


class KvRoutePolicy:
    """`Router.select` with the router's own load tracking (`on_finish` when the request ends)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        return self.router.select(token_ids, request_id=request_id).worker

    def prefill_done(self, request_id: Hashable) -> None:
        self.router.on_prefill_done(request_id)

    def finished(self, request_id: Hashable) -> None:
        self.router.on_finish(request_id)


class HashedPlacementPolicy(KvRoutePolicy):
    """kvroute, with a new session placed by a stable hash of its leading tokens instead of the footprint.

    A prototype measured by ``scripts/routing_losses.py`` (docs/routing-quality.md, session 10): session
    affinity's strength is that prompts sharing their leading ``affinity_tokens`` land together even
    when no cache holds them yet, or holds too little of them to count. Here a *new placement* (no
    candidate holds ``footprint_new_share`` of the prompt, by counted overlap or routing hint, as the
    footprint judges it) goes, among the workers the footprint could pick (cost within
    `CostModel.footprint_limit` of the cheapest, load no more than the cheapest's), to the one
    whose rendezvous hash with the prompt's leading tokens is highest; any other prompt goes where
    the Router's cost sends it. The Router runs with the footprint off, and `Router.on_start` records
    the pick as `select` would.
    """

    def __init__(self, router: Router, *, affinity_tokens: int = AFFINITY_TOKENS) -> None:
        super().__init__(router)
        self._tokens = affinity_tokens

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        router = self.router
        model = router.cost_model
        d = router.select(token_ids)
        ntok = len(token_ids)
        scored = d.candidates
        worker, cached = d.worker, d.overlap_tokens
        if max((max(c.overlap_tokens, c.routed_tokens) for c in scored), default=0) < model.footprint_new_share * ntok:
            cheapest = min([c.cost for c in scored] + ([d.idle_cost] if d.idle_workers else []))
            limit = model.footprint_limit(cheapest) * (1.0 + 1e-9)
            # the footprint's rule: never a busier worker than the cheapest (the largest load at that cost)
            cap = max((c.load_blocks for c in scored if c.cost <= cheapest * (1.0 + 1e-9)), default=0.0)
            eligible = {c.worker: c.overlap_tokens for c in scored if c.cost <= limit and c.load_blocks <= cap}
            if d.idle_workers and d.idle_cost <= limit:
                listed = {c.worker for c in scored}
                eligible.update((w, 0) for w in router.workers() if w not in listed)
            key = array("I", token_ids[: self._tokens]).tobytes()
            worker = max(eligible, key=lambda w: _ring_hash(key + f"#{w.worker_id}#{w.dp_rank}".encode()))
            cached = eligible[worker]
        router.on_start(request_id, worker, token_ids, cached_tokens=cached)
        return worker


class OracleDecision(msgspec.Struct, frozen=True):
    """One oracle decision: every candidate's credited and cached blocks, tracked load (tokens), and the pick.

    ``blocks``: the leading blocks of the prompt the worker's engine holds or is computing (the
    larger), which the oracle prices; ``cached``: those its cache holds now.
    """

    blocks: dict[WorkerKey, int]
    load: dict[WorkerKey, int]
    chosen: WorkerKey
    cached: dict[WorkerKey, int]


class OraclePolicy:
    """kvroute's cost model and load tracking over the engines' true caches (module docstring).

    Cost per worker = ``cost.cost(prefill_blocks, load_blocks)`` as `Router` prices it: prefill is the
    prompt minus the worker's credited leading blocks (cached, or being computed there, whichever is
    longer: the Router's index overlap and routing hint, known exactly), load the tokens its in-flight
    requests did not find cached (until their first token, `Router.on_prefill_done`), both in blocks
    of ``block_size``. Lowest wins; exact ties at random. ``decisions`` keeps every decision's
    figures (`OracleDecision`), so a test can check it.
    """

    def __init__(
        self,
        client: KvEventClient,
        engines: Mapping[str, SimEngine],
        *,
        block_size: int,
        cost: CostModel | None = None,
        seed: int | None = None,
    ) -> None:
        self._client = client
        self._engines = engines
        self._unit = block_size
        self._cost = cost if cost is not None else CostModel()
        self._rng = random.Random(seed)
        self._load: dict[WorkerKey, int] = {}
        self._active: dict[Hashable, tuple[WorkerKey, int]] = {}
        self.decisions: list[OracleDecision] = []

    def cached_blocks(self, worker: WorkerKey, token_ids: Sequence[int]) -> tuple[int, int]:
        """(leading blocks ``worker``'s engine holds for the prompt now, that engine's block size)."""
        engine = self._engines[worker.worker_id]
        return engine.cache(worker.dp_rank).match_blocks(token_ids), engine.config.block_size

    def in_flight_blocks(self, worker: WorkerKey, token_ids: Sequence[int]) -> int:
        """Leading blocks of the prompt a request ``worker``'s engine runs or has queued shares (engine blocks).

        Capped below the prompt's last token, as an engine caps a hit: what this request could find
        there once the engine has computed them.
        """
        engine = self._engines[worker.worker_id]
        bs = engine.config.block_size
        prompt = token_ids if isinstance(token_ids, list) else list(token_ids)
        most = 0
        for other in engine.in_flight(worker.dp_rank):
            n = min(len(prompt) - 1, len(other)) // bs
            i = most
            # Only a longer shared run can change the answer: compare from the best so far.
            if n <= most or prompt[: most * bs] != other[: most * bs]:
                continue
            while i < n and prompt[i * bs : (i + 1) * bs] == other[i * bs : (i + 1) * bs]:
                i += 1
            most = i
        return most

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        ntok = len(token_ids)
        unit = self._unit
        best: list[tuple[WorkerKey, int]] = []
        best_cost = 0.0
        blocks: dict[WorkerKey, int] = {}
        cached_blocks: dict[WorkerKey, int] = {}
        for w in sorted(self._client.live_workers()):
            held, bs = self.cached_blocks(w, token_ids)
            credited = max(held, self.in_flight_blocks(w, token_ids))
            blocks[w], cached_blocks[w] = credited, held
            cost = self._cost.cost((ntok - min(ntok, credited * bs)) / unit, self._load.get(w, 0) / unit)
            # The load it adds is what the cache does not hold now, as the Router counts it.
            cached = min(ntok, held * bs)
            if not best or cost < best_cost:
                best, best_cost = [(w, cached)], cost
            elif cost == best_cost:
                best.append((w, cached))
        worker, cached = best[self._rng.randrange(len(best))]
        self.decisions.append(OracleDecision(blocks, dict(self._load), worker, cached_blocks))
        tokens = ntok - cached
        self._active[request_id] = (worker, tokens)
        self._load[worker] = self._load.get(worker, 0) + tokens
        return worker

    def prefill_done(self, request_id: Hashable) -> None:
        worker, tokens = self._active[request_id]
        self._active[request_id] = (worker, 0)
        self._release(worker, tokens)

    def finished(self, request_id: Hashable) -> None:
        worker, tokens = self._active.pop(request_id)
        self._release(worker, tokens)

    def _release(self, worker: WorkerKey, tokens: int) -> None:
        left = self._load.get(worker, 0) - tokens
        if left:
            self._load[worker] = left
        else:
            self._load.pop(worker, None)


def _ring_hash(data: bytes) -> int:
    return int(xxhash.xxh64_intdigest(data))


class SessionAffinityPolicy(_Baseline):
    """Consistent hashing of the prompt's first ``affinity_tokens`` tokens onto a ring of the live workers.

    Each worker owns ``_VNODES`` points of a 64-bit ring; a prompt goes to the owner of the first point at
    or after its key's hash. A worker leaving moves only its own keys. Load plays no part.
    """

    def __init__(self, client: KvEventClient, *, affinity_tokens: int = AFFINITY_TOKENS) -> None:
        self._client = client
        self._tokens = affinity_tokens
        self._members: frozenset[WorkerKey] = frozenset()
        self._points: list[int] = []
        self._owners: list[WorkerKey] = []

    def _ring(self) -> None:
        live = frozenset(self._client.live_workers())
        if live == self._members:
            return
        ring = sorted((_ring_hash(f"{w.worker_id}#{w.dp_rank}#{v}".encode()), w) for w in live for v in range(_VNODES))
        self._members = live
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        self._ring()
        key = _ring_hash(array("I", token_ids[: self._tokens]).tobytes())
        i = bisect.bisect_left(self._points, key)
        return self._owners[i % len(self._owners)]


class LeastLoadPolicy:
    """The live worker with the fewest requests in flight through this policy; ties at random."""

    def __init__(self, client: KvEventClient, seed: int | None = None) -> None:
        self._client = client
        self._rng = random.Random(seed)
        self._count: dict[WorkerKey, int] = {}
        self._active: dict[Hashable, WorkerKey] = {}

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        workers = sorted(self._client.live_workers())
        least = min(self._count.get(w, 0) for w in workers)
        worker = self._rng.choice([w for w in workers if self._count.get(w, 0) == least])
        self._count[worker] = self._count.get(worker, 0) + 1
        self._active[request_id] = worker
        return worker

    def prefill_done(self, request_id: Hashable) -> None:
        return None  # least outstanding requests: a request counts until it ends

    def finished(self, request_id: Hashable) -> None:
        worker = self._active.pop(request_id)
        self._count[worker] -= 1


class RoundRobinPolicy(_Baseline):
    """The live workers in turn."""

    def __init__(self, client: KvEventClient) -> None:
        self._client = client
        self._next = 0

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        workers = sorted(self._client.live_workers())
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


class RandomPolicy(_Baseline):
    """A live worker uniformly at random."""

    def __init__(self, client: KvEventClient, seed: int | None = None) -> None:
        self._client = client
        self._rng = random.Random(seed)

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        return self._rng.choice(sorted(self._client.live_workers()))


def make_policy(
    name: str,
    client: KvEventClient,
    engines: Sequence[SimEngine],
    *,
    block_size: int,
    seed: int | None,
    cost: CostModel | None = None,
    engine_loads: EngineLoads | None = None,
) -> Policy:
    """The policy called ``name`` (one of `POLICIES`) for a fleet of ``engines`` followed by ``client``.

    ``cost``: the cost model of ``kvroute`` and ``oracle`` (default `CostModel()`). ``kvroute_index_only``
    is kvroute without its routing hint (the `Router` default): the index alone, for comparison;
    ``kvroute_no_footprint`` kvroute with ``cost``'s ``footprint`` off (new sessions not spread);
    ``kvroute_long_prefix`` kvroute with ``cost``'s ``long_prefix`` on (a long recompute priced super-linearly).
    ``kvroute_long_move`` kvroute with ``cost``'s ``long_move`` on (a move priced by what it recomputes over the best
    candidate; on by default), ``kvroute_no_long_move`` with it off.
    ``engine_loads``: the engines' reports kvroute's `Router` reads (default: the client's, which a
    gateway stream fills); the demo passes the engines' scraped ``/metrics`` on plain ZMQ fleets.
    """
    if name in KVROUTE_POLICIES:
        ttl = 0.0 if name == "kvroute_index_only" else ROUTED_TTL
        if name in ("kvroute_no_footprint", "kvroute_hashed"):
            cost = msgspec.structs.replace(cost or CostModel(), footprint=False)
        elif name == "kvroute_long_prefix":
            cost = msgspec.structs.replace(cost or CostModel(), long_prefix=True)
        elif name == "kvroute_long_move":
            cost = msgspec.structs.replace(cost or CostModel(), long_move=True)
        elif name == "kvroute_no_long_move":
            cost = msgspec.structs.replace(cost or CostModel(), long_move=False)
        kind = HashedPlacementPolicy if name == "kvroute_hashed" else KvRoutePolicy
        return kind(
            Router(
                client.index,
                states=client,
                block_size=block_size,
                seed=seed,
                cost=cost,
                routed_ttl=ttl,
                engine_loads=engine_loads,
            )
        )
    if name == "oracle":
        by_target = {e.grpc_target: e for e in engines if e.grpc_target is not None}
        return OraclePolicy(client, by_target, block_size=block_size, seed=seed, cost=cost)
    if name == "session_affinity":
        return SessionAffinityPolicy(client)
    if name == "least_load":
        return LeastLoadPolicy(client, seed)
    if name == "round_robin":
        return RoundRobinPolicy(client)
    if name == "random":
        return RandomPolicy(client, seed)
    raise ValueError(f"unknown policy {name!r}; choose among {', '.join(POLICIES + EXTRA_POLICIES)}")
