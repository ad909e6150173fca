"""The routing cost and what a decision reports: `CostModel`, `CandidateScore`, `RoutingDecision`.

The `Router` (kvroute._router) prices each candidate with a `CostModel`; its module docstring
gives the cost. The compiled core builds `CandidateScore`s positionally (src/py/router.rs), and a
`RoutingDecision` of the compiled path builds them only when read. The argument checks the
router shares with the cost model live here too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import msgspec

import kvroute._core as _core

from ._errors import RouterError
from ._models import WorkerKey

__all__ = ["CandidateScore", "CostModel", "RoutingDecision"]


def _key(worker: WorkerKey) -> WorkerKey:
    try:
        return WorkerKey(*worker)
    except TypeError:
        raise RouterError(f"not a WorkerKey (worker_id, dp_rank): {worker!r}") from None


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise RouterError(f"block_size must be an int >= 1, got {block_size!r}")


def _check_range(name: str, value: float, low: float, high: float = math.inf, *, low_open: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RouterError(f"{name} must be a finite number within {bound}, got {value!r}")


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """The weights of the routing cost; subclass and override `cost` / `credited_blocks` for another policy.

    ``overlap_weight`` (2.0): weight of the prefill still to do against the load; 0 ignores
    caches entirely (pure load balancing), larger favours cache hits over spread. A request leaves
    the worker holding its prefix only when the queue there exceeds the queue elsewhere by
    ``overlap_weight`` times the tokens it would recompute. Dynamo's 1.0 prices this request's wait
    alone, and a turn then leaves its history for any longer queue — though the recompute delays the
    requests queued behind it on the new worker, and its copy evicts something; 2 counts one such
    request. Measured in ``kvroute demo`` (docs/routing-quality.md): 1.0 lost 3-5 points of hit
    rate against session affinity on conversation traces; above 2, load imbalance passes 1.5.
    ``cpu_credit`` / ``disk_credit`` / ``external_credit``: the fraction of a block's prefill saved
    when it is cached on that tier instead of GPU (a GPU hit saves all of it). CPU 0.8 is llm-d's
    default weight for CPU-offloaded blocks; DISK and EXTERNAL (LMCache / Mooncake-style stores)
    default to 0.5: loading from them is slower than PCIe but still well below recomputing.
    ``temperature`` (0.0, Dynamo's default): 0 picks the cheapest worker; above 0 samples with
    probability ∝ exp(-cost / temperature), cost in blocks of the router's ``block_size``.
    ``eviction_weight`` (8.0): what a candidate's prefill evicts, `eviction`: each block it must
    compute there costs ``eviction_weight * usage`` more, ``usage`` the worker's engine-reported
    KV-cache usage in [0, 1] (`EngineLoads`: gateway streams, or `follow_engine_metrics` on plain
    engines; 0 where none is reported, so a router without reports prices as before). A move
    off the worker holding a conversation copies its history into a cache whose running requests
    leave it no free room, evicting another session's; the holder, with little to prefill, pays
    little. Measured in ``kvroute demo`` (docs/routing-quality.md): under cache pressure it kept
    the sessions that 2.0 alone moved for load. 0 turns it off.
    ``footprint`` (True): spread new sessions, `Router`'s footprint; False turns it off. A *new
    placement* is a prompt no candidate holds ``footprint_new_share`` (0.5) of, by the index's
    counted overlap or the routing hint. It goes to the candidate with the fewest recent new
    placements among those costing at most ``1 + footprint_band`` (1.5) times the cheapest
    (`footprint_limit`) and carrying no more load than the cheapest (ties: the cheaper, then at
    random), instead of the cheapest. Workers whose caches took the most new sessions evict the
    earlier sessions' histories before their next turn; cost alone sends a new session to whichever
    idle worker reports the least KV usage, or at random (in one demo run 25-71 a rank against
    41-43 with the footprint). The band trades only what the cost adds beside load: what the
    prefill evicts (`eviction`) and a short cached prefix (at equal load, under ``band / (1 +
    band)`` of the prompt: a third at 0.5); load balance is what it was. 0 chooses among the
    cheapest only. Counts decay by half every ``footprint_half_life`` (64) new placements the
    router makes. Applies at ``temperature`` 0. Measured in ``kvroute demo`` (docs/routing-quality.md).
    ``long_prefix`` (False): price a long recompute super-linearly. A prefill ``p`` of more than
    ``long_prefix_floor`` (128) blocks costs ``overlap_weight * p * (1 + (p - long_prefix_floor)
    / long_prefix_scale)`` (``long_prefix_scale`` 1,024, at least 1) instead of ``overlap_weight * p``, both in
    blocks of the router's ``block_size``; a prefill up to the floor is priced exactly as without
    it, so short prompts route as before. Why: a recompute of ``p`` blocks holds the new worker's
    prefill budget for time proportional to ``p``, and the requests arriving there meanwhile, also
    proportional to ``p``, each wait behind it (an M/G/1 queue's residual work): the delay a long
    move imposes on others grows as ``p**2``, while the holder's short prefill imposes almost none.
    So a conversation turn or a document's question leaves the worker holding its history only for
    a queue there several times the recompute. The eviction term and the footprint's band apply to
    this cost unchanged. Measured in ``kvroute demo`` (docs/routing-quality.md).
    ``long_move`` (True; ``False`` gives the cost without it, the default before this release): price
    what a move recomputes over the best candidate, super-linearly. With
    ``p_best`` the least prefill of any candidate (the holder's, for a turn whose history one worker
    holds; the whole prompt when nobody holds any of it), a candidate whose prefill ``p`` exceeds it
    by ``d = p - p_best`` of more than ``long_move_floor`` (64) blocks costs ``move(d) = overlap_weight
    * d * (d - long_move_floor) / long_move_scale`` (``long_move_scale`` 8, at least 1) more, on top of
    every other term (`move`). Why the difference and not ``p``: a move's extra cost to the fleet is
    the recompute it adds over keeping the request where its prefix is, and the delay that recompute
    imposes on the requests queued behind it grows as ``d**2`` (``long_prefix`` says why); the part
    every candidate must compute anyway (``p_best``) is no reason to stay. So a turn stays with its
    holder against a queue up to ``d * (1 + (d - floor) / scale)`` times ``overlap_weight`` longer,
    while a prompt nobody holds (``d`` 0 everywhere) or one whose best holder is within the floor of
    the rest (a shared system prompt held here and evicted there) is priced exactly as without it,
    and spread as before. The footprint's band then rarely reaches past the holder of a long history.
    Measured in ``kvroute demo`` (docs/routing-quality.md): the one setting above session affinity on
    hit rate and TTFT p50 on every trace shape's mean, hence the default. A long prefix many sessions
    share, held on one worker only, is priced like a session's own history and kept there, as session
    affinity keeps it.

    Overrides must be pure functions of their arguments: the router evaluates the cost of all
    idle workers once. The built-in model is priced in the compiled core (its weights read off
    the instance on every call); a subclass is priced in Python, the slower path, with the same
    rules and tie-breaks.
    """

    overlap_weight: float = 2.0
    cpu_credit: float = 0.8
    disk_credit: float = 0.5
    external_credit: float = 0.5
    temperature: float = 0.0
    eviction_weight: float = 8.0
    footprint: bool = True
    footprint_band: float = 0.5
    footprint_new_share: float = 0.5
    footprint_half_life: float = 64.0
    long_prefix: bool = False
    long_prefix_floor: float = 128.0
    long_prefix_scale: float = 1024.0
    long_move: bool = True
    long_move_floor: float = 64.0
    long_move_scale: float = 8.0

    def __post_init__(self) -> None:
        _check_range("overlap_weight", self.overlap_weight, 0.0)
        _check_range("cpu_credit", self.cpu_credit, 0.0, 1.0)
        _check_range("disk_credit", self.disk_credit, 0.0, 1.0)
        _check_range("external_credit", self.external_credit, 0.0, 1.0)
        _check_range("temperature", self.temperature, 0.0)
        _check_range("eviction_weight", self.eviction_weight, 0.0)
        if not isinstance(self.footprint, bool):
            raise RouterError(f"footprint must be a bool, got {self.footprint!r}")
        _check_range("footprint_band", self.footprint_band, 0.0)
        _check_range("footprint_new_share", self.footprint_new_share, 0.0, 1.0)
        _check_range("footprint_half_life", self.footprint_half_life, 0.0, low_open=True)
        if not isinstance(self.long_prefix, bool):
            raise RouterError(f"long_prefix must be a bool, got {self.long_prefix!r}")
        _check_range("long_prefix_floor", self.long_prefix_floor, 0.0)
        _check_range("long_prefix_scale", self.long_prefix_scale, 1.0)  # below a block, costs overflow
        if not isinstance(self.long_move, bool):
            raise RouterError(f"long_move must be a bool, got {self.long_move!r}")
        _check_range("long_move_floor", self.long_move_floor, 0.0)
        _check_range("long_move_scale", self.long_move_scale, 1.0)  # below a block, costs overflow

    @property
    def full_credit(self) -> bool:
        """True when every tier counts as a GPU hit (the per-tier split is then never needed)."""
        return self.cpu_credit == 1.0 and self.disk_credit == 1.0 and self.external_credit == 1.0

    def credited_blocks(self, overlap: int, gpu: int, cpu: int, disk: int, external: int) -> float:
        """Cached blocks as GPU-hit equivalents, from the leading run on any tier and on each tier.

        Block i of the run counts with the best credit among the tiers whose own leading run
        covers it; a block covered by no single tier's run (held on a mix) gets the lowest
        credit of the slower tiers, a lower bound of what it saves. The router calls it only
        for runs not wholly on GPU: a GPU run is credited in full.
        """
        runs = sorted(
            ((1.0, gpu), (self.cpu_credit, cpu), (self.disk_credit, disk), (self.external_credit, external)),
            reverse=True,
        )
        credited = 0.0
        covered = 0
        for credit, run in runs:
            run = min(run, overlap)
            if run > covered:
                credited += (run - covered) * credit
                covered = run
        if covered < overlap:
            credited += (overlap - covered) * min(self.cpu_credit, self.disk_credit, self.external_credit)
        return credited

    def cost(self, prefill_blocks: float, load_blocks: float) -> float:
        """A candidate's cost: ``overlap_weight * prefill_blocks + load_blocks`` (lower is better); with
        ``long_prefix`` on and ``prefill_blocks`` above ``long_prefix_floor``, ``overlap_weight *
        prefill_blocks * (1 + (prefill_blocks - long_prefix_floor) / long_prefix_scale) + load_blocks``."""
        if self.long_prefix:
            above = prefill_blocks - self.long_prefix_floor
            # at or below the floor the return below prices exactly as without the term
            if above > 0.0:
                return self.overlap_weight * prefill_blocks * (1.0 + above / self.long_prefix_scale) + load_blocks
        return self.overlap_weight * prefill_blocks + load_blocks

    def eviction(self, prefill_blocks: float, usage: float) -> float:
        """What computing ``prefill_blocks`` on a worker at KV ``usage`` (in [0, 1]) evicts, added to
        `cost` where the worker reports usage above 0: ``eviction_weight * usage * prefill_blocks``."""
        return self.eviction_weight * usage * prefill_blocks

    def move(self, extra_blocks: float) -> float:
        """What a candidate adds for the recompute ``extra_blocks`` over the best candidate's prefill
        (``p - p_best``, `long_move`): ``overlap_weight * extra_blocks * (extra_blocks - long_move_floor)
        / long_move_scale`` above the floor, 0 at or below it. The router adds it to `cost` (and
        `eviction`) only with ``long_move`` on."""
        above = extra_blocks - self.long_move_floor
        if above > 0.0:
            return self.overlap_weight * extra_blocks * above / self.long_move_scale
        return 0.0

    def footprint_limit(self, cheapest: float) -> float:
        """The highest cost a new placement may take to reach a worker with fewer recent new placements:
        ``(1 + footprint_band) * cheapest``, ``cheapest`` the lowest candidate cost (`Router`'s footprint)."""
        return (1.0 + self.footprint_band) * cheapest


class CandidateScore(msgspec.Struct, frozen=True, gc=False):
    """What the router weighed for one candidate.

    ``claimed_blocks``: leading blocks the index (or the approximate store) says the worker holds;
    ``overlap_blocks``: those it counted (0 when the worker's state cannot back the claim).
    Both are in the worker's own blocks of ``block_size`` tokens (None: nothing known of it);
    ``overlap_tokens`` is the counted overlap in tokens (at most the prompt), comparable across
    workers of different block sizes. ``routed_tokens``: the prompt's leading tokens the router
    itself recently sent to this worker in a request not yet finished (`kvroute._routed`, a routing
    hint, never an index claim); it is credited where it exceeds the index's overlap.
    ``prefill_blocks``, ``load_blocks`` and ``cost`` are in blocks of the router's ``block_size``.
    ``source``: "index" or "approximate".
    """

    worker: WorkerKey
    source: str
    claimed_blocks: int
    overlap_blocks: int
    block_size: int | None
    prefill_blocks: float
    load_blocks: float
    cost: float
    overlap_tokens: int = 0
    routed_tokens: int = 0


# The compiled select builds candidates positionally, in the field order above.
_core.set_candidate_type(CandidateScore)


@dataclasses.dataclass(frozen=True)
class _DecisionFields:
    """`RoutingDecision`'s fields, in order: what encoders (msgspec) and `dataclasses` read of it."""

    worker: WorkerKey
    overlap_blocks: int
    cost: float
    query_tokens: int
    candidates: tuple[CandidateScore, ...]
    idle_workers: int
    idle_cost: float
    block_size: int | None = None
    overlap_tokens: int = 0
    routed_tokens: int = 0


_DECISION_FIELDS = tuple(_DecisionFields.__dataclass_fields__)


class RoutingDecision:
    """The chosen worker and the figures it was chosen from (immutable).

    ``candidates`` lists every candidate that had a claim, an overlap or load, and the chosen
    worker; the ``idle_workers`` other candidates held nothing and had no load, each at
    ``idle_cost``. ``overlap_blocks``: the chosen worker's counted leading blocks, in its own
    ``block_size`` (None: nothing known of it); ``overlap_tokens``: the same in tokens (a fleet
    mixing 16-token vLLM and 64-token SGLang workers compares these); ``routed_tokens``: the
    chosen worker's credit from the router's own recently routed prompts (`CandidateScore`);
    ``query_tokens``: the prompt's length.

    A decision of the compiled path keeps its candidates' figures compact and builds the
    `CandidateScore` tuple the first time ``candidates`` is read (a loaded fleet of 1,024
    workers has 1,024 of them, and most routers read only ``worker``). Equality, hashing and repr
    are those of a frozen struct of the fields above, in that order; it encodes (msgspec) as one.
    """

    # Encoders and `dataclasses.fields` / `asdict` read a dataclass's fields by name through
    # getattr, so the lazily built ``candidates`` is read like any other field.
    __dataclass_fields__: ClassVar[dict[str, Any]] = _DecisionFields.__dataclass_fields__

    __slots__ = (
        "_candidates",
        "_scored",
        "_tail",
        "block_size",
        "cost",
        "idle_cost",
        "idle_workers",
        "overlap_blocks",
        "overlap_tokens",
        "query_tokens",
        "routed_tokens",
        "worker",
    )
    __match_args__ = (
        "worker",
        "overlap_blocks",
        "cost",
        "query_tokens",
        "candidates",
        "idle_workers",
        "idle_cost",
        "block_size",
        "overlap_tokens",
        "routed_tokens",
    )

    _candidates: tuple[CandidateScore, ...] | None
    _scored: _core.Scored | None
    _tail: CandidateScore | None
    worker: WorkerKey
    overlap_blocks: int
    cost: float
    query_tokens: int
    idle_workers: int
    idle_cost: float
    block_size: int | None
    overlap_tokens: int
    routed_tokens: int

    def __init__(
        self,
        *,
        worker: WorkerKey,
        overlap_blocks: int,
        cost: float,
        query_tokens: int,
        candidates: tuple[CandidateScore, ...],
        idle_workers: int,
        idle_cost: float,
        block_size: int | None = None,
        overlap_tokens: int = 0,
        routed_tokens: int = 0,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "worker", worker)
        setattr_(self, "overlap_blocks", overlap_blocks)
        setattr_(self, "cost", cost)
        setattr_(self, "query_tokens", query_tokens)
        setattr_(self, "_candidates", tuple(candidates))
        setattr_(self, "_scored", None)
        setattr_(self, "_tail", None)
        setattr_(self, "idle_workers", idle_workers)
        setattr_(self, "idle_cost", idle_cost)
        setattr_(self, "block_size", block_size)
        setattr_(self, "overlap_tokens", overlap_tokens)
        setattr_(self, "routed_tokens", routed_tokens)

    @property
    def candidates(self) -> tuple[CandidateScore, ...]:
        """Every candidate with a claim, an overlap or load, and the chosen worker."""
        got = self._candidates
        if got is None:
            assert self._scored is not None
            built: list[CandidateScore] = self._scored.build()
            if self._tail is not None:
                built.append(self._tail)
            got = tuple(built)
            # `_scored` stays: a thread reading `candidates` at the same time may still build from it.
            object.__setattr__(self, "_candidates", got)
        return got

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _DECISION_FIELDS)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("immutable type: 'RoutingDecision'")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("immutable type: 'RoutingDecision'")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingDecision) or type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={value!r}" for name, value in zip(_DECISION_FIELDS, self._values()))
        return f"RoutingDecision({body})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_decision, self._values())


def _decision(*values: Any) -> RoutingDecision:
    """Rebuild a pickled `RoutingDecision`."""
    return RoutingDecision(**dict(zip(_DECISION_FIELDS, values)))


#: Upper bounds (seconds) of the `select` latency histogram in `RouterStats`.
SELECT_BUCKETS: tuple[float, ...] = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3)
