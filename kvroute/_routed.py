"""The Router's routing hint: prompts it routed recently, credited as overlap until the engines' events catch up.

An engine publishes a prompt's blocks only once it has prefilled them. A second request sharing
that prefix (the next question on a document, a session's next turn) that arrives meanwhile finds
nothing in any index, and a cache-aware router sends it to the least-loaded worker, which
recomputes the prefix — where a sticky router would have sent both to one worker. SGLang's
cache-aware router avoids this by inserting each prompt into its own tree at routing time; this
is the same idea, bounded:

- a prompt is remembered for the worker it was started on (`Router.select` with a
  ``request_id``, or `Router.on_start`), as its content keys in blocks of the router's
  ``block_size``, under the request's namespaces;
- it is forgotten when the request finishes (`Router.on_finish`) — by then its blocks are in
  the engine's events, or evicted, which only the index can tell — after ``ttl`` seconds
  (a request never finished), beyond ``per_worker`` prompts a worker (the oldest goes), and when
  its worker is removed;
- a worker's credit is the longest leading run of the query's blocks one of its remembered
  prompts shares; it counts only where it exceeds the worker's index overlap.

It is a hint about what the router itself did, not what any engine holds: it is never reported
as an index claim (`CandidateScore.claimed_blocks` / ``overlap_blocks`` stay the index's) and
the index never over-claims because of it. It lives in `CandidateScore.routed_tokens`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ._models import WorkerKey

__all__ = ["RoutedPrefixes"]


class RoutedPrefixes:
    """Recently routed prompts per worker, as chained content keys (see the module docstring).

    ``ttl``: seconds a prompt is remembered at most (0: the hint is off, nothing is kept);
    ``per_worker``: prompts remembered per worker at most. Times are the caller's monotonic clock.
    """

    __slots__ = ("_by_worker", "_children", "_ends", "_entries", "_holders", "_longest", "per_worker", "ttl")

    def __init__(self, ttl: float, per_worker: int) -> None:
        self.ttl = ttl
        self.per_worker = per_worker
        # request id -> (worker, keys, expiry); one TTL and a monotonic clock make insertion
        # order expiry order, so expired entries are always at the front.
        self._entries: dict[Hashable, tuple[WorkerKey, list[bytes], float]] = {}
        self._by_worker: dict[WorkerKey, dict[Hashable, None]] = {}
        # The remembered prompts as a trie over their chained keys (a key names its whole prefix):
        # key -> {worker: prompts through it}, key -> {next key: prompts}, last key -> {worker: prompts}.
        self._holders: dict[bytes, dict[WorkerKey, int]] = {}
        self._children: dict[bytes, dict[bytes, int]] = {}
        self._ends: dict[bytes, dict[WorkerKey, int]] = {}
        self._longest = 0  # blocks of the longest prompt kept since the store was last empty

    @property
    def enabled(self) -> bool:
        """Whether prompts are remembered at all."""
        return self.ttl > 0.0 and self.per_worker > 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self) -> int:
        """An upper bound of the blocks any credit can reach (0 when nothing is remembered)."""
        return self._longest if self._entries else 0

    def add(self, request_id: Hashable, worker: WorkerKey, keys: list[bytes], now: float) -> None:
        """Remember ``keys`` (a prompt's content keys) routed to ``worker`` as request ``request_id``."""
        self.purge(now)
        self.discard(request_id)
        if not keys or not self.enabled:
            return
        mine = self._by_worker.setdefault(worker, {})
        if len(mine) >= self.per_worker:
            self.discard(next(iter(mine)))
            mine = self._by_worker.setdefault(worker, {})
        mine[request_id] = None
        self._entries[request_id] = (worker, keys, now + self.ttl)
        holders, children = self._holders, self._children
        parent = None
        for k in keys:
            _bump(holders.setdefault(k, {}), worker, 1)
            if parent is not None:
                _bump(children.setdefault(parent, {}), k, 1)
            parent = k
        _bump(self._ends.setdefault(keys[-1], {}), worker, 1)
        self._longest = max(self._longest, len(keys))

    def discard(self, request_id: Hashable) -> None:
        """Forget request ``request_id``'s prompt (nothing when it is not remembered)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        worker, keys, _ = entry
        mine = self._by_worker[worker]
        del mine[request_id]
        if not mine:
            del self._by_worker[worker]
        holders, children = self._holders, self._children
        parent = None
        for k in keys:
            _drop(holders, k, worker)
            if parent is not None:
                _drop(children, parent, k)
            parent = k
        _drop(self._ends, keys[-1], worker)
        if not self._entries:
            self._longest = 0

    def discard_worker(self, worker: WorkerKey) -> None:
        """Forget every prompt remembered for ``worker``."""
        for rid in list(self._by_worker.get(worker, ())):
            self.discard(rid)

    def purge(self, now: float) -> None:
        """Forget the prompts whose time is up."""
        entries = self._entries
        while entries:
            first = next(iter(entries))
            if entries[first][2] > now:
                return
            self.discard(first)

    def credits(self, keys: list[bytes]) -> dict[WorkerKey, int]:
        """Per worker, the leading blocks of ``keys`` one of its remembered prompts shares (> 0 only).

        One walk down the query's path: a worker is credited where its prompts leave the path
        (they end there, or go on to another block), and a deeper credit replaces a shallower
        one; the work is the path's length plus the prompts that leave it, not workers times depth.
        """
        holders, children, ends = self._holders, self._children, self._ends
        out: dict[WorkerKey, int] = {}
        prev: bytes | None = None
        depth = 0
        for k in keys:
            if k not in holders:
                break
            if prev is not None:
                # the prompts through `prev` that do not go on to `k` share `depth` blocks
                for w in ends.get(prev, ()):
                    out[w] = depth
                for child in children.get(prev, ()):
                    if child != k:
                        for w in holders[child]:
                            out[w] = depth
            prev = k
            depth += 1
        if prev is not None:
            for w in holders[prev]:
                out[w] = depth
        return out


def _bump(counts: dict[Any, int], item: Any, by: int) -> None:
    counts[item] = counts.get(item, 0) + by


def _drop(table: dict[bytes, dict[Any, int]], key: bytes, item: Any) -> None:
    """One fewer ``item`` under ``key``; empty counts leave the table."""
    counts = table[key]
    left = counts[item] - 1
    if left:
        counts[item] = left
        return
    del counts[item]
    if not counts:
        del table[key]
