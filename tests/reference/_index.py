"""The pure-Python prefix-block index, kept as the executable reference for kvroute's compiled one.

kvroute/_index.py (before the Rust core) verbatim, its imports made absolute: tests/test_core_differential.py
feeds both the same event streams and requires identical answers and stats. Not shipped.

The prefix-block index: which worker holds how many leading blocks of a token sequence.

Layout (docs/architecture.md, "Index notes"):

- Each worker gets a bit; ``_holders`` maps a block's content key (`kvroute._hashing`) to the
  bit set of workers holding it on any tier. A query walks the prompt's chained keys and ANDs
  bit sets, stopping as soon as no worker continues the prefix, so its cost grows with the
  match, not the prompt.
- Per worker, ``blocks`` maps the engine's block hash to the content key. Engine hashes are
  salted per engine; they only find a stored block's parent and apply removals. A block whose
  parent is unknown gets key 0 (never claimed), and so do its descendants: the index cannot
  claim a prefix through a block it never saw.
- The common state of a block is "one copy, on GPU". Anything else — several copies, other
  tiers — lives in small side tables (``special``, ``multi``, ``_gpu_missing``,
  ``_tier_holders``), so the hot path touches two dicts per block. When a worker's last
  block goes, its bit and every side entry go with it: no residue.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from bisect import bisect_right
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from itertools import accumulate, pairwise, repeat
from operator import and_, neg
from typing import Any

import msgspec

from kvroute._errors import KvRouteError
from kvroute._hashing import MultimodalItem, block_keys, mm_extras, root_key, tokens_to_bytes, xxh128
from kvroute._models import CPU, DISK, EXTERNAL, GPU, WorkerKey, normalize_medium
from kvroute._snapshot import Cursor, SnapGroup, SnapWorker, read_snapshot, write_snapshot
from kvroute._wire import FULL_KINDS, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EngineEvent, EventBatch

__all__ = ["IndexLimits", "IndexStats", "OverlapScores", "PrefixIndex"]

_log = logging.getLogger("kvroute.index")

# A (worker, key) presence is a tier mask: GPU 1, CPU 2, DISK 4, EXTERNAL 8.
_TIER_POS = {GPU: 0, CPU: 1, DISK: 2, EXTERNAL: 3}
_OFF_GPU_TIERS = ((CPU, 2), (DISK, 4), (EXTERNAL, 8))

# Kinds of the other KV-cache groups, by the hit rule the engine applies to them (vLLM's
# single_type_kv_cache_manager): a window of blocks before the hit point, or one state
# checkpoint at it. Any other kind cannot be checked: the worker's hits become 0.
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla", "SlidingWindowSpec", "SlidingWindowMLASpec"})
_STATE_KINDS = frozenset({"mamba", "MambaSpec"})
# A (block size, lookahead tokens) pair: how a worker's content keys are chained.
_Class = tuple[int, int]

# find_matches converts the prompt to bytes lazily, in chunks that double: a short match never
# pays for converting an 8k-token prompt, a long one pays a handful of C calls.
_FIRST_CHUNK_BLOCKS = 8


class IndexStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of a `PrefixIndex`; see the README's observability section.

    ``ignored_group_events``: stores of a KV-cache group whose kind kvroute has no hit rule for
    (that worker's hits become 0) or past ``max_groups_per_worker``; ``remote_blocks``: blocks
    stored or removed with ``locality "REMOTE"`` (a shared tier, not the worker's own);
    ``repeated_stores``: stores of a block already held on that tier, taken as no new copy
    (from block 0 a prefix-cache reuse report and a real copy look alike; the README's
    "Copies" says which repeats are known copies and count as such);
    ``refused_block_sizes`` / ``refused_entries``: stores refused by `IndexLimits`;
    ``uncached_roots``: queries whose namespace root did not fit the root cache.
    """

    workers: int
    entries: int
    distinct_keys: int
    unknown_parent_blocks: int
    unhashable_blocks: int
    unknown_removals: int
    ignored_group_events: int
    remote_blocks: int = 0
    repeated_stores: int = 0
    refused_block_sizes: int = 0
    refused_entries: int = 0
    uncached_roots: int = 0


class IndexLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds that keep one worker (or one caller) from making the index grow or slow without bound.

    ``max_block_sizes``: distinct (block size, lookahead) pairs a worker may store under — a
    query hashes the prompt once per pair in use, so one worker must not make every query
    hash it thousands of times; a store of a new pair past the bound is refused (counted,
    logged). ``max_entries_per_worker``: blocks one worker may hold; stores past it are refused
    (counted, logged; refusing a store is safe: its descendants are never claimed).
    ``max_groups_per_worker``: KV-cache groups per worker. ``max_cached_roots``: namespace
    roots (adapter, salt) kept between queries; past it a root is computed per query
    (counted) instead of being kept.
    """

    max_block_sizes: int = 8
    max_entries_per_worker: int = 1 << 24
    max_groups_per_worker: int = 64
    max_cached_roots: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_block_sizes", "max_entries_per_worker", "max_groups_per_worker", "max_cached_roots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise IndexLimitsError(f"{name} must be an int >= 1, got {v!r}")


class IndexLimitsError(KvRouteError, ValueError):
    """An `IndexLimits` setting is not usable."""


class _Group:
    """A KV-cache group of a worker other than its primary full-attention group.

    ``blocks``: engine hash -> [content key (b"": held, never claimable), tier mask];
    ``held``: claimable content key -> engine hashes holding it. A hit needs this group too
    (vLLM's HybridKVCacheCoordinator), by ``kind``: "full" (every block of the prefix),
    "window" (the ``cdiv(window - 1, block_size)`` blocks before the hit point), "state" (a
    checkpoint at the hit point), "unknown" (no rule: the worker's hits are 0).
    """

    __slots__ = ("block_size", "blocks", "copies", "held", "kind", "window")

    def __init__(self, kind: str, window: int | None, block_size: int) -> None:
        self.kind = kind
        self.window = window
        self.block_size = block_size
        self.blocks: dict[BlockHash, list[Any]] = {}
        self.held: dict[bytes, int] = {}
        # engine hash -> GPU copies beyond the first (see _Worker.copies)
        self.copies: dict[BlockHash, int] = {}


def _group_kind(kind: str | None) -> str:
    if kind in FULL_KINDS:
        return "full"
    if kind in _WINDOW_KINDS:
        return "window"
    if kind in _STATE_KINDS:
        return "state"
    return "unknown"


class _Worker:
    __slots__ = (
        "bit",
        "blocks",
        "bs",
        "classes",
        "copies",
        "fresh_root",
        "groups",
        "key",
        "lookahead",
        "multi",
        "pending",
        "primary",
        "special",
        "warned",
    )

    def __init__(self, key: WorkerKey, bit: int) -> None:
        self.key = key
        self.bit = bit
        # engine hash -> content key (b"": held, but never claimable), primary group
        self.blocks: dict[BlockHash, bytes] = {}
        # engine hash -> presence per tier [GPU, CPU, DISK, EXTERNAL] (0/1); absent = one GPU copy
        self.special: dict[BlockHash, list[int]] = {}
        # content key -> engine hashes present per tier, once two engine hashes map to one key
        self.multi: dict[bytes, list[int]] = {}
        # engine hash -> GPU copies beyond the first, primary group. Only a store that names a
        # parent adds one: vLLM reports a prefix-cache reuse (kv_cache_report_mode "full") as a
        # store from block 0 without a parent (BlockPool.emit_cached_block_events), so a store
        # with a parent is always a new cache entry, and each entry gets its own BlockRemoved.
        # Not in snapshots: a restored worker may under-claim, never over-claim.
        self.copies: dict[BlockHash, int] = {}
        # The last event was a primary store from block 0 naming blocks already held on GPU:
        # (its tokens, those hashes). A report or real copies; see PrefixIndex._store_group.
        self.pending: tuple[list[int], list[BlockHash]] | None = None
        self.classes: set[_Class] = set()
        self.bs = 0  # the largest block size in use
        # group_idx of the primary full-attention group (None: events carry no group)
        self.primary: int | None = None
        self.groups: dict[int, _Group] = {}
        self.lookahead = 0
        self.warned: set[str] = set()
        # Hashes of the last primary store from block 0 that brought new blocks. vLLM reports
        # a prefix-cache hit (kv_cache_report_mode "full") as stores from block 0 in every
        # group, a sliding window's null blocks included; a window group's dense store from
        # block 0 of blocks the primary group held before this store is such a report.
        self.fresh_root: frozenset[BlockHash] = frozenset()

    def holds_nothing(self) -> bool:
        return not self.blocks and not any(g.blocks for g in self.groups.values())


def _mask(counts: list[int]) -> int:
    return (counts[0] > 0) | (counts[1] > 0) << 1 | (counts[2] > 0) << 2 | (counts[3] > 0) << 3


class _Query:
    """One prompt's namespaces, with its content keys per class computed on demand."""

    __slots__ = ("extra_keys", "keys", "mm_items", "root", "token_ids")

    def __init__(
        self,
        token_ids: Sequence[int],
        root: bytes,
        mm_items: Sequence[MultimodalItem],
        extra_keys: Sequence[Sequence[Any] | None] | None,
    ) -> None:
        self.token_ids = token_ids
        self.root = root
        self.mm_items = mm_items
        self.extra_keys = extra_keys
        self.keys: dict[_Class, list[bytes]] = {}

    def extras(self, cls: _Class, first: int, end: int) -> list[Any] | None:
        if self.extra_keys is not None:
            ek = self.extra_keys
            return [ek[j] if j < len(ek) else None for j in range(first, end)]
        if self.mm_items:
            return mm_extras(self.mm_items, cls[0], first, end, cls[1])
        return None

    def lookahead(self, cls: _Class, first: int, end: int) -> list[bytes] | None:
        bs, la = cls
        if not la:
            return None
        toks = self.token_ids
        return [tokens_to_bytes(toks[(j + 1) * bs : (j + 1) * bs + la]) for j in range(first, end)]

    def n_blocks(self, cls: _Class) -> int:
        bs, la = cls
        return max(0, (len(self.token_ids) - la) // bs)

    def chain(self, cls: _Class, first: int, end: int, parent: bytes) -> list[bytes]:
        """Keys of blocks first..end-1 chained on ``parent`` (raises OverflowError for ids outside uint32)."""
        bs = cls[0]
        data = tokens_to_bytes(self.token_ids[first * bs : end * bs])
        return block_keys(parent, data, bs, end - first, self.extras(cls, first, end), self.lookahead(cls, first, end))

    def upto(self, cls: _Class, n: int) -> list[bytes]:
        """The first ``n`` keys of class ``cls`` (fewer when the prompt has fewer, or a token is not uint32)."""
        got = self.keys.get(cls)
        if got is None:
            got = self.keys[cls] = []
        n = min(n, self.n_blocks(cls))
        if len(got) < n:
            with contextlib.suppress(OverflowError):  # a token outside uint32: no key from there on
                got += self.chain(cls, len(got), n, got[-1] if got else self.root)
        return got[:n]


class OverlapScores(Mapping[WorkerKey, int]):
    """Leading full blocks of one query held by each worker (any tier); absent workers read as 0.

    ``scores[w]`` is in ``w``'s own block size (`block_size`); `tokens` gives the same in
    tokens, whatever the block size — compare workers by that. For a hybrid worker (several
    KV-cache groups) both are the engine's own answer: the longest prefix every group can
    serve, at most the prompt's length minus one token (the engine always computes the last
    token). ``tier(name)`` gives the leading blocks all held on that tier ("GPU", "CPU",
    "DISK", "EXTERNAL"); off-GPU tiers are computed on first access, from the index as it is
    then.
    """

    __slots__ = ("_block_sizes", "_gpu", "_index", "_query", "_scores", "_tiers")

    def __init__(
        self,
        scores: dict[WorkerKey, int],
        block_sizes: dict[WorkerKey, int],
        gpu: dict[WorkerKey, int] | None,
        query: _Query,
        index: PrefixIndex,
    ) -> None:
        self._scores = scores
        self._block_sizes = block_sizes
        self._gpu = gpu
        self._query = query
        self._index = index
        self._tiers: dict[str, dict[WorkerKey, int]] = {}

    def __getitem__(self, worker: WorkerKey) -> int:
        return self._scores.get(worker, 0)

    def __contains__(self, worker: object) -> bool:
        return worker in self._scores

    def __iter__(self) -> Iterator[WorkerKey]:
        return iter(self._scores)

    def __len__(self) -> int:
        return len(self._scores)

    # The Mapping mixins go through __getitem__ per key; the router reads every score, so
    # hand out the underlying dict's views directly.
    def items(self) -> ItemsView[WorkerKey, int]:
        """(worker, leading blocks) pairs, workers with no match left out."""
        return self._scores.items()

    def keys(self) -> KeysView[WorkerKey]:
        """Workers with a match."""
        return self._scores.keys()

    def values(self) -> ValuesView[int]:
        """Their leading-block counts."""
        return self._scores.values()

    def get(self, worker: WorkerKey, default: Any = None) -> Any:
        """The worker's leading blocks, or ``default`` when it has no match."""
        return self._scores.get(worker, default)

    def __repr__(self) -> str:
        return f"OverlapScores({self._scores!r})"

    def block_size(self, worker: WorkerKey) -> int | None:
        """The block size ``worker``'s score is counted in (None when it has no match)."""
        return self._block_sizes.get(worker)

    def tokens(self, worker: WorkerKey) -> int:
        """Leading prompt tokens ``worker`` holds (0 when it has no match); block-size agnostic.

        What an engine reports as its prefix-cache hit (vLLM's ``num_computed_tokens``,
        SGLang's match length), except that for a non-hybrid worker it may include the
        prompt's last block, which an engine recomputes.
        """
        n = self._scores.get(worker)
        return n * self._block_sizes[worker] if n else 0

    def tier(self, tier: str) -> Mapping[WorkerKey, int]:
        """Leading blocks held on ``tier`` (a name from `kvroute.TIERS` or an engine's ``medium``)."""
        tier = normalize_medium(tier)
        if tier == GPU:
            return self._scores if self._gpu is None else self._gpu
        found = self._tiers.get(tier)
        if found is None:
            found = self._index._tier_scores(tier, self._scores, self._block_sizes, self._query)
            self._tiers[tier] = found
        return found

    def query_blocks(self, worker: WorkerKey) -> int:
        """Full blocks the query has at ``worker``'s block size (0 when the index has no block size for it)."""
        classes = self._index._classes_of(worker)
        return max((self._query.n_blocks(c) for c in classes), default=0)


class PrefixIndex:
    """The prefix-block index: apply engine events per worker, ask who holds a prompt's prefix.

    ``limits``: an `IndexLimits` (the defaults bound block sizes, entries and groups per
    worker and the namespace-root cache). Not thread-safe: feed it from one task
    (KvEventClient does) and query it from the same event loop.
    """

    def __init__(self, *, limits: IndexLimits | None = None, reuse_reports: bool = True) -> None:
        self.limits = limits if limits is not None else IndexLimits()
        #: Whether the engines may publish reuse reports (kvroute/_index.py: `PrefixIndex.reuse_reports`).
        self.reuse_reports = reuse_reports
        self._workers: dict[WorkerKey, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._holders: dict[bytes, int] = {}
        self._gpu_missing: dict[bytes, int] = {}
        self._tier_holders: dict[str, dict[bytes, int]] = {CPU: {}, DISK: {}, EXTERNAL: {}}
        self._bs_members: dict[_Class, int] = {}
        self._hybrid_bits = 0
        # SGLang EAGLE workers (stores marked `bigram`: they came as [token, next_token] cells)
        self._bigram_bits = 0
        self._roots: dict[tuple[str | None, str | None], bytes] = {}
        self._entries = 0
        self._unknown_parent = 0
        self._unhashable = 0
        self._unknown_removals = 0
        self._ignored_group = 0
        self._remote = 0
        self._repeated = 0
        self._refused_bs = 0
        self._refused_entries = 0
        self._uncached_roots = 0
        #: Cursors read by `restore` (empty otherwise): where each source stood at snapshot time.
        self.restored_cursors: dict[WorkerKey, Cursor] = {}

    # --- workers -------------------------------------------------------------------------

    def _worker(self, key: WorkerKey) -> _Worker:
        w = self._workers.get(key)
        if w is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            w = _Worker(key, bit)
            self._workers[key] = w
            self._by_bit[bit] = w
        return w

    def _release(self, w: _Worker) -> None:
        """Forget a worker that holds nothing any more (its bit is reused)."""
        del self._workers[w.key]
        del self._by_bit[w.bit]
        for cls in w.classes:
            members = self._bs_members[cls] & ~w.bit
            if members:
                self._bs_members[cls] = members
            else:
                del self._bs_members[cls]
        self._hybrid_bits &= ~w.bit
        self._bigram_bits &= ~w.bit
        self._free_bits.append(w.bit)

    def _maybe_release(self, w: _Worker) -> None:
        if w.holds_nothing() and self._workers.get(w.key) is w:
            self._release(w)

    def workers(self) -> set[WorkerKey]:
        """Workers that hold at least one block."""
        return {k for k, w in self._workers.items() if not w.holds_nothing()}

    def num_blocks(self, worker: WorkerKey | None = None) -> int:
        """Blocks held by ``worker`` (every KV-cache group), or (block, worker) entries over all workers."""
        if worker is None:
            return self._entries
        w = self._workers.get(worker)
        return _entries_of(w) if w is not None else 0

    def block_size(self, worker: WorkerKey) -> int | None:
        """The block size ``worker``'s events use (the largest, should it use several).

        To price a query's overlap, use `OverlapScores.block_size` / `OverlapScores.tokens`:
        the block size that overlap was measured in.
        """
        w = self._workers.get(worker)
        return w.bs if w is not None and w.bs else None

    def _classes_of(self, worker: WorkerKey) -> set[_Class]:
        w = self._workers.get(worker)
        return w.classes if w is not None else set()

    def stats(self) -> IndexStats:
        """A snapshot of the index's size and counters."""
        return IndexStats(
            workers=sum(1 for w in self._workers.values() if not w.holds_nothing()),
            entries=self._entries,
            distinct_keys=len(self._holders),
            unknown_parent_blocks=self._unknown_parent,
            unhashable_blocks=self._unhashable,
            unknown_removals=self._unknown_removals,
            ignored_group_events=self._ignored_group,
            remote_blocks=self._remote,
            repeated_stores=self._repeated,
            refused_block_sizes=self._refused_bs,
            refused_entries=self._refused_entries,
            uncached_roots=self._uncached_roots,
        )

    def remove_worker(self, worker: WorkerKey) -> None:
        """Forget everything ``worker`` holds (a reset, a restart, a worker gone)."""
        w = self._workers.get(worker)
        if w is not None:
            self._clear(w)

    def _clear(self, w: _Worker) -> None:
        bit = w.bit
        notbit = ~bit
        if not w.special and not w.multi:
            # Every claimable block is one GPU copy under a key of its own.
            holders = self._holders
            for key in w.blocks.values():
                if key:
                    h = holders[key] & notbit
                    if h:
                        holders[key] = h
                    else:
                        del holders[key]
        else:
            for key in set(w.blocks.values()):
                if key:
                    self._set_mask(bit, notbit, key, self._worker_mask(w, key), 0)
        self._entries -= _entries_of(w)
        self._release(w)

    def _warn(self, w: _Worker, what: str, detail: str) -> None:
        """Log a refusal once per worker and kind: a misbehaving engine must not flood the log."""
        if what not in w.warned:
            w.warned.add(what)
            _log.warning("worker %s/%d: %s (%s); further ones are counted, not logged", *w.key, what, detail)

    # --- the shared tables ---------------------------------------------------------------

    def _set_mask(self, bit: int, notbit: int, key: bytes, old: int, new: int) -> None:
        """Move one worker's presence on ``key`` from tier mask ``old`` to ``new``."""
        if old == new:
            return
        holders = self._holders
        if not old:
            h = holders.get(key, 0)
            holders[key] = h | bit if h else bit
        elif not new:
            h = holders[key] & notbit
            if h:
                holders[key] = h
            else:
                del holders[key]
        old_off = bool(old) and not old & 1
        new_off = bool(new) and not new & 1
        if old_off != new_off:
            gm = self._gpu_missing
            g = gm.get(key, 0) ^ bit
            if g:
                gm[key] = g
            else:
                del gm[key]
        changed = (old ^ new) & 14
        if changed:
            for tier, tbit in _OFF_GPU_TIERS:
                if changed & tbit:
                    table = self._tier_holders[tier]
                    t = table.get(key, 0) ^ bit
                    if t:
                        table[key] = t
                    else:
                        del table[key]

    def _worker_mask(self, w: _Worker, key: bytes) -> int:
        """The worker's current tier mask on ``key``, read back from the shared tables."""
        bit = w.bit
        if not self._holders.get(key, 0) & bit:
            return 0
        mask = 0 if self._gpu_missing.get(key, 0) & bit else 1
        for tier, tbit in _OFF_GPU_TIERS:
            if self._tier_holders[tier].get(key, 0) & bit:
                mask |= tbit
        return mask

    def _presence(self, w: _Worker, ehash: BlockHash, key: bytes, pos: int, delta: int, new_ehash: bool) -> None:
        """An engine hash mapping to ``key`` became present (+1) or absent (-1) on tier ``pos``."""
        if not key:
            return
        bit = w.bit
        m = w.multi.get(key)
        if m is None and new_ehash and self._holders.get(key, 0) & bit:
            # A second engine hash for content this worker already holds: count per tier.
            m = [0, 0, 0, 0]
            old = self._worker_mask(w, key)
            for i in range(4):
                m[i] = (old >> i) & 1
            w.multi[key] = m
        if m is not None:
            old = _mask(m)
            m[pos] += delta
            new = _mask(m)
            if not any(m):
                del w.multi[key]
        else:
            counts = w.special.get(ehash)
            new = _mask(counts) if counts is not None else (1 if ehash in w.blocks else 0)
            old = new ^ (1 << pos)
        self._set_mask(bit, ~bit, key, old, new)

    # --- applying events -----------------------------------------------------------------

    def apply_batch(self, worker: WorkerKey, batch: EventBatch) -> None:
        """Apply every event of one batch, in order."""
        apply = self.apply
        for ev in batch.events:
            apply(worker, ev)

    def apply(self, worker: WorkerKey, event: EngineEvent) -> None:
        """Apply one engine event of ``worker``."""
        if isinstance(event, BlockStored):
            self._store(worker, event)
        elif isinstance(event, BlockRemoved):
            self._remove(worker, event)
        elif isinstance(event, AllBlocksCleared):
            self.remove_worker(worker)
        else:
            raise TypeError(f"not an engine event: {type(event).__name__}")

    def _root(self, lora_name: str | None, cache_salt: str | None = None) -> bytes:
        ns = (lora_name or None, cache_salt or None)
        r = self._roots.get(ns)
        if r is None:
            r = root_key(*ns)
            if len(self._roots) < self.limits.max_cached_roots:
                self._roots[ns] = r
            else:
                self._uncached_roots += 1
        return r

    def _namespaces(
        self, ev: BlockStored
    ) -> tuple[str | None, str | None, list[Any] | None]:
        """The event's adapter, salt and per-block extras, the way `kvroute._hashing` keys them.

        vLLM sends the adapter first in every block's extra keys as well as in ``lora_name``
        (one namespace) and the salt as the first block's only string; SGLang sends the salt
        in ``cache_salt``. What is left (multimodal pairs, prompt-embedding digests) stays
        per block. Anything not understood stays in the extras: a query never builds it, so
        such a block is held but never claimed.
        """
        lora = ev.lora_name or None
        salt = ev.cache_salt if isinstance(ev.cache_salt, str) and ev.cache_salt else None
        extras = ev.extra_keys
        if extras is None:
            return lora, salt, None
        out: list[Any] = []
        found = False
        for i, ek in enumerate(extras):
            if not ek:
                out.append(None)
                continue
            keys = list(ek)
            if lora is not None and keys and keys[0] == lora:
                del keys[0]
            if i == 0 and ev.parent_block_hash is None:
                strs = [k for k in keys if isinstance(k, str)]
                if len(strs) == 1 and salt in (None, strs[0]):
                    salt = strs[0]
                    keys = [k for k in keys if not isinstance(k, str)]
            if keys:
                found = True
                out.append(keys)
            else:
                out.append(None)
        return lora, salt, out if found else None

    def _admit(self, w: _Worker, cls: _Class, n: int) -> bool:
        """Apply the per-worker bounds to a store of ``n`` blocks of class ``cls``."""
        lim = self.limits
        if cls not in w.classes:
            if len(w.classes) >= lim.max_block_sizes:
                self._refused_bs += 1
                self._warn(w, "store refused: too many block sizes", f"{cls[0]} past {sorted(w.classes)}")
                return False
            w.classes.add(cls)
            w.bs = max(w.bs, cls[0])
            self._bs_members[cls] = self._bs_members.get(cls, 0) | w.bit
        if _entries_of(w) + n > lim.max_entries_per_worker:
            self._refused_entries += n
            self._warn(w, "store refused: entry bound reached", f"max_entries_per_worker={lim.max_entries_per_worker}")
            return False
        return True

    def _group_of(self, w: _Worker, ev: BlockStored) -> _Group | bool | None:
        """Where a store goes: None = the primary group, a `_Group`, or False = refused (counted)."""
        g = ev.group_idx
        kind = _group_kind(ev.kv_cache_spec_kind)
        if g is None or (ev.block_size == 0 and not ev.token_ids and ev.kv_cache_spec_kind is None):
            # No group fields (older engines, SGLang, offload placeholders): the primary group.
            return None
        if kind == "full" and (w.primary is None or w.primary == g) and g not in w.groups:
            w.primary = g
            return None
        grp = w.groups.get(g)
        if grp is None:
            if len(w.groups) >= self.limits.max_groups_per_worker:
                self._ignored_group += 1
                self._warn(w, "store refused: too many KV-cache groups", f"group {g}")
                return False
            grp = w.groups[g] = _Group(kind, ev.kv_cache_spec_sliding_window, ev.block_size)
            self._hybrid_bits |= w.bit
            if kind == "unknown":
                self._ignored_group += 1
                self._warn(w, "no hit rule for KV-cache group kind", f"{ev.kv_cache_spec_kind!r}: its hits are 0")
        elif ev.block_size and ev.token_ids:
            grp.block_size = ev.block_size
            if ev.kv_cache_spec_sliding_window is not None:
                grp.window = ev.kv_cache_spec_sliding_window
        return grp

    def _store(self, worker: WorkerKey, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if _remote(ev.locality):
            # A shared pool (filesystem, object store): not this worker's own cache.
            self._remote += n
            return
        w = self._worker(worker)
        pending, w.pending = w.pending, None
        la = ev.lookahead_token_ids
        if la:
            w.lookahead = len(la[0])
        if ev.bigram:
            self._bigram_bits |= w.bit
        grp = self._group_of(w, ev)
        if grp is False:
            self._maybe_release(w)
            return
        if grp is not None:
            assert isinstance(grp, _Group)
            self._store_group(w, grp, ev, pending)
            self._maybe_release(w)
            return
        if not n:
            self._maybe_release(w)
            return
        tier = normalize_medium(ev.medium)
        pos = _TIER_POS[tier]
        bs = ev.block_size
        tokens = ev.token_ids
        blocks = w.blocks
        if n == 1 and 0 < bs < w.bs and tokens:
            # vLLM's partial entry (cache_partial_block) comes between the full group's store
            # and the other groups' stores of one cache_blocks call.
            w.pending = pending
        elif ev.parent_block_hash is None and not pos and tokens and not self._root_repeat_is_copy():
            special = w.special
            again = [h for h in hashes if h in blocks and (h not in special or special[h][0])]
            if again:
                w.pending = (tokens, again)
        if not tokens:
            # A placeholder (offload connectors): names a tier for hashes the worker holds;
            # an unknown hash is held on that tier but never claimable.
            if _entries_of(w) + n > self.limits.max_entries_per_worker:
                self._refused_entries += n
                self._maybe_release(w)
                return
            for ehash in hashes:
                self._store_one(w, ehash, blocks.get(ehash, b""), pos)
            self._maybe_release(w)
            return
        if ev.parent_block_hash is None:
            w.fresh_root = frozenset() if all(h in blocks for h in hashes) else frozenset(hashes)
        cls = (bs, len(la[0]) if la else 0)
        if not self._admit(w, cls, n):
            self._maybe_release(w)
            return
        lora, salt, extras = self._namespaces(ev)
        parent = ev.parent_block_hash
        if parent is None:
            key = self._root(lora, salt)
        else:
            key = blocks.get(parent, b"")
            if parent not in blocks:
                self._unknown_parent += n
        full = len(tokens) // bs
        data = b""
        lookahead: list[bytes] | None = None
        if key:
            try:
                data = tokens_to_bytes(tokens if full * bs == len(tokens) else tokens[: full * bs])
                if la:
                    lookahead = [tokens_to_bytes(t) for t in la]
            except OverflowError:
                self._unhashable += n
                key = b""
        if key and pos == 0 and extras is None and la is None and full == n and blocks.keys().isdisjoint(hashes):
            # Hot path (nearly every event): n new engine hashes, one GPU copy each, chained
            # on a known parent. Hash in one tight loop, then map and mark with C-level
            # bulk updates; only content this worker already holds goes block by block.
            holders = self._holders
            bit = w.bit
            keys = block_keys(key, data, bs, n)
            before = len(blocks)
            blocks.update(zip(hashes, keys))
            if len(blocks) - before != n:
                # The same hash twice in one event (never from vLLM): undo, store one by one.
                for ehash in hashes:
                    blocks.pop(ehash, None)
                for ehash, k in zip(hashes, keys):
                    self._store_one(w, ehash, k, 0)
                return
            self._entries += n
            held = list(map(holders.get, keys, repeat(0, n)))
            if not any(held):
                holders.update(zip(keys, repeat(bit, n)))
            elif not any(h & bit for h in held):
                holders.update(zip(keys, [h | bit if h else bit for h in held]))
            else:
                for ehash, k, h in zip(hashes, keys, held):
                    if h & bit:  # content it already holds under another engine hash
                        self._presence(w, ehash, k, 0, 1, True)
                    else:
                        holders[k] = h | bit if h else bit
            return
        if key:
            keys = block_keys(key, data, bs, full, extras, lookahead[:full] if lookahead is not None else None)
            if full < n:  # SGLang's short last page: held, but not a full block to match
                keys.append(b"")
        else:
            keys = [b""] * n
        copy = (parent is not None or self._root_repeat_is_copy()) and pos == 0
        for ehash, k in zip(hashes, keys):
            self._store_one(w, ehash, k, pos, copy)

    def _store_one(self, w: _Worker, ehash: BlockHash, key: bytes, pos: int, copy: bool = False) -> None:
        blocks = w.blocks
        old_key = blocks.get(ehash)
        if old_key is None:
            blocks[ehash] = key
            self._entries += 1
            if pos:
                counts = [0, 0, 0, 0]
                counts[pos] = 1
                w.special[ehash] = counts
            self._presence(w, ehash, key, pos, 1, True)
            return
        # A block the worker already holds (same engine hash). With a parent it is a real
        # duplicate copy (``copy``, see _Worker.copies). From block 0 a prefix-cache reuse
        # report and a real copy look the same on the wire; counting it as a copy would keep
        # a report's block claimed after the engine's one removal, so it counts once: the
        # index never claims more than the engine holds.
        got = w.special.get(ehash)
        if copy and (got is None or got[0]):
            w.copies[ehash] = w.copies.get(ehash, 0) + 1
            return
        if got is None:
            if pos == 0:
                self._repeated += 1
                return
            got = w.special[ehash] = [1, 0, 0, 0]
        counts = got
        if counts[pos]:
            self._repeated += 1
            return
        counts[pos] = 1
        self._presence(w, ehash, old_key, pos, 1, False)

    def _lookup(self, w: _Worker, grp: _Group, ehash: BlockHash, *, anchored: bool = False) -> bytes | None:
        """The content key of an engine hash in a group of the worker with ``grp``'s block size.

        vLLM hashes every group alike, so one value names one prefix in every group; content
        keys are chained per block size, so only a group of the same block size can lend one —
        or, for a group keyed by `_anchored_ids`, the primary group (its keys are those
        identities at its own boundaries).
        """
        got = grp.blocks.get(ehash)
        if got is not None:
            return got[0]  # type: ignore[no-any-return]
        bs = grp.block_size
        if anchored or all(c[0] == bs for c in w.classes):
            key = w.blocks.get(ehash)
            if key is not None:
                return key
        for other in w.groups.values():
            if other is not grp and other.block_size == bs:
                got = other.blocks.get(ehash)
                if got is not None:
                    return got[0]  # type: ignore[no-any-return]
        return None

    def _store_group(
        self, w: _Worker, grp: _Group, ev: BlockStored, pending: tuple[list[int], list[BlockHash]] | None = None
    ) -> None:
        """A store of a non-primary group: dense ones are hashed; sparse ones (null blocks
        skipped) and token-less ones (checkpoints, placeholders) take each hash's content
        from the worker's other groups, or hold it unclaimable."""
        hashes = ev.block_hashes
        n = len(hashes)
        tokens = ev.token_ids
        # vLLM reports a reuse with every block from block 0, a window's null ones included
        # (n * block_size == len(token_ids)); a store with fewer blocks than its tokens skipped
        # null or unreachable blocks, so it is a real one (BlockPool.cache_full_blocks), and so
        # was the primary group's store of the same tokens just before it, from the same call.
        sparse = ev.parent_block_hash is None and n * ev.block_size < len(tokens) and grp.kind != "full"
        if sparse and pending is not None and pending[0] == tokens:
            self._add_copies(w, pending[1])
        if not n:
            return
        skip = 0
        if (
            ev.parent_block_hash is None
            and not self._root_repeat_is_copy()
            and grp.kind != "full"
            and n * ev.block_size == len(ev.token_ids)
            and all(h in w.blocks for h in hashes)
            and not w.fresh_root.issuperset(hashes)
        ):
            # Maybe a reuse report (see _Worker.fresh_root), maybe a real store of content the
            # primary group holds already (a recompute after a window miss): the wire cannot
            # tell. A report lists the blocks the engine nulled before its hit, but the blocks
            # its hit used — the last `_hit_tail` — are held either way: keep those only.
            skip = n - min(n, _hit_tail(grp))
            self._repeated += skip
            if skip == n:
                return
        if _entries_of(w) + n > self.limits.max_entries_per_worker:
            self._refused_entries += n
            self._warn(w, "store refused: entry bound reached", f"max_entries_per_worker={_lim(self)}")
            return
        bs = ev.block_size
        keys: list[bytes] | None = None
        anchor_p = _anchor(w, grp)
        if anchor_p and tokens and bs == grp.block_size:
            keys = self._anchored_keys(w, ev, anchor_p)
        elif tokens and bs and len(tokens) == n * bs:
            lora, salt, extras = self._namespaces(ev)
            parent = ev.parent_block_hash
            key = self._root(lora, salt) if parent is None else (self._lookup(w, grp, parent) or b"")
            if key:
                try:
                    la = ev.lookahead_token_ids
                    keys = block_keys(
                        key, tokens_to_bytes(tokens), bs, n, extras, [tokens_to_bytes(t) for t in la] if la else None
                    )
                except OverflowError:
                    self._unhashable += n
        if keys is None:
            keys = [self._lookup(w, grp, h, anchored=bool(anchor_p)) or b"" for h in hashes]
        bit = 1 << _TIER_POS[normalize_medium(ev.medium)]
        blocks = grp.blocks
        held = grp.held
        # a real copy (see _Worker.copies)
        copy = (ev.parent_block_hash is not None or sparse or self._root_repeat_is_copy()) and bit == 1
        for ehash, k in zip(hashes[skip:], keys[skip:]):
            cur = blocks.get(ehash)
            if cur is not None:
                if copy and cur[1] & 1:
                    grp.copies[ehash] = grp.copies.get(ehash, 0) + 1
                    continue
                if cur[1] & bit:
                    self._repeated += 1
                cur[1] |= bit
                continue
            blocks[ehash] = [k, bit]
            self._entries += 1
            if k:
                held[k] = held.get(k, 0) + 1

    # --- the reuse-report rule (issue 18; src/index/store.rs `root_repeat_is_copy`) -------------

    def _root_repeat_is_copy(self) -> bool:
        """Whether a store naming no parent, of blocks the worker holds, is one more GPU copy.

        vLLM publishes one store per new cache entry, except a reuse report (a request sent with
        ``kv_cache_report_mode "full"``): a hit's blocks from block 0, no new entry. Where
        reports may come the two look alike and the repeat counts once; where the router says
        none come, it is a copy.
        """
        return not self.reuse_reports

    def _add_copies(self, w: _Worker, hashes: list[BlockHash]) -> None:
        """One more GPU copy of each of ``hashes`` that the primary group still holds on GPU."""
        special = w.special
        for h in hashes:
            if h in w.blocks and (h not in special or special[h][0]):
                w.copies[h] = w.copies.get(h, 0) + 1

    def _anchored_keys(self, w: _Worker, ev: BlockStored, p: int) -> list[bytes] | None:
        """Keys of a store of a group with blocks smaller than the primary's (``p`` tokens).

        vLLM names a ``p``-token block by the hash at its last ``hash_block_size`` boundary, so
        this group's hashes at ``p`` boundaries are the primary group's, and their content keys
        say where they are. The store must start on a ``p`` boundary the primary group knows;
        each of its blocks is keyed by `_anchored_ids`; a sparse store's hashes (null blocks
        skipped, in order) are placed between the known ones only where they fill a gap
        exactly, and held unclaimable otherwise. None: the store cannot be placed this way.
        """
        lora, salt, extras = self._namespaces(ev)
        s_bs = ev.block_size
        tokens = ev.token_ids
        if extras is not None or ev.lookahead_token_ids or len(tokens) % s_bs:
            return None
        parent = ev.parent_block_hash
        anchor = self._root(lora, salt) if parent is None else w.blocks.get(parent)
        if not anchor:
            return None
        try:
            ids = _anchored_ids(anchor, tokens_to_bytes(tokens), s_bs, p, len(tokens) // s_bs)
        except OverflowError:
            self._unhashable += len(ev.block_hashes)
            return None
        hashes = ev.block_hashes
        n, slots = len(hashes), len(ids)
        if n == slots:
            return ids
        where = {k: j for j, k in enumerate(ids)}
        pos: list[int | None] = []
        for h in hashes:
            k = w.blocks.get(h)
            pos.append(where.get(k) if k else None)
        known = [j for j in pos if j is not None]
        if any(b <= a for a, b in pairwise(known)):
            return [b""] * n  # out of order: nothing can be placed
        # vLLM keeps a window group's blocks (BlockPool.cache_full_blocks skips null and masked
        # ones) in runs that end on a scheduler-block boundary, here every ``p`` tokens
        # (SlidingWindowManager.reachable_block_mask; null blocks are only ever a head), or at
        # the store's end. A run ends on a boundary slot, and a boundary block the full group
        # holds has a hash the index knows (the same value in both groups). So the unknown
        # hashes just before a known one (or the store's end) are the slots right before it,
        # when every boundary slot they could spread over is held by the full group: a gap
        # among them would need a run ending on a boundary the index does not know.
        per = p // s_bs
        holders = self._holders
        bit = w.bit
        prev_i, prev_j = -1, -1
        for i in range(n + 1):
            j = slots if i == n else pos[i]
            if j is None:
                continue
            gap = i - prev_i - 1
            if gap and (
                gap == j - prev_j - 1
                or (
                    gap < j - prev_j - 1
                    and all(holders.get(ids[b], 0) & bit for b in range(prev_j + 1, j) if (b + 1) % per == 0)
                )
            ):
                for d in range(gap):
                    pos[prev_i + 1 + d] = j - gap + d
            prev_i, prev_j = i, j
        return [ids[j] if j is not None else b"" for j in pos]

    def _remove(self, worker: WorkerKey, ev: BlockRemoved) -> None:
        if _remote(ev.locality):
            self._remote += len(ev.block_hashes)
            return
        w = self._workers.get(worker)
        if w is None:
            self._unknown_removals += len(ev.block_hashes)
            return
        w.pending = None
        g = ev.group_idx
        if g is not None and g != w.primary:
            grp = w.groups.get(g)
            if grp is None:
                self._unknown_removals += len(ev.block_hashes)
            else:
                self._remove_group(grp, ev)
            self._maybe_release(w)
            return
        pos = _TIER_POS[normalize_medium(ev.medium)]
        blocks = w.blocks
        special = w.special
        copies = w.copies
        for ehash in ev.block_hashes:
            key = blocks.get(ehash)
            if key is None:
                self._unknown_removals += 1
                continue
            if not pos and ehash in copies:
                _drop_copy(copies, ehash)
                continue
            counts = special.get(ehash)
            if counts is None:
                if pos:
                    self._unknown_removals += 1
                    continue
                del blocks[ehash]
                self._entries -= 1
                self._presence(w, ehash, key, 0, -1, False)
                continue
            if not counts[pos]:
                self._unknown_removals += 1
                continue
            counts[pos] = 0
            if not any(counts):
                del special[ehash]
                del blocks[ehash]
                self._entries -= 1
                self._presence(w, ehash, key, pos, -1, False)
            else:
                if counts == [1, 0, 0, 0]:
                    del special[ehash]
                self._presence(w, ehash, key, pos, -1, False)
        self._maybe_release(w)

    def _remove_group(self, grp: _Group, ev: BlockRemoved) -> None:
        bit = 1 << _TIER_POS[normalize_medium(ev.medium)]
        blocks = grp.blocks
        held = grp.held
        copies = grp.copies
        for ehash in ev.block_hashes:
            cur = blocks.get(ehash)
            if cur is None or not cur[1] & bit:
                self._unknown_removals += 1
                continue
            if bit == 1 and ehash in copies:
                _drop_copy(copies, ehash)
                continue
            cur[1] &= ~bit
            if cur[1]:
                continue
            del blocks[ehash]
            self._entries -= 1
            k = cur[0]
            if k:
                left = held[k] - 1
                if left:
                    held[k] = left
                else:
                    del held[k]

    # --- warm restart ----------------------------------------------------------------------

    def snapshot(self, path: str | os.PathLike[str], *, cursors: Mapping[WorkerKey, Cursor] | None = None) -> None:
        """Write the index (and each source's last applied seq, when given) to ``path``, atomically.

        ``KvEventClient.snapshot`` passes its sources' cursors; a client later started with
        ``index=PrefixIndex.restore(path)`` resumes each source from there.
        """
        workers = [
            SnapWorker(
                worker_id=w.key.worker_id,
                dp_rank=w.key.dp_rank,
                classes=sorted(w.classes),
                primary=w.primary,
                lookahead=w.lookahead,
                hashes=list(w.blocks.keys()),
                keys=list(w.blocks.values()),
                special=[(h, list(c)) for h, c in w.special.items()],
                groups=[
                    SnapGroup(
                        group_idx=g,
                        kind=grp.kind,
                        window=grp.window,
                        block_size=grp.block_size,
                        hashes=list(grp.blocks.keys()),
                        keys=[v[0] for v in grp.blocks.values()],
                        masks=[v[1] for v in grp.blocks.values()],
                    )
                    for g, grp in w.groups.items()
                ],
                bigram=bool(self._bigram_bits & w.bit),
            )
            for w in self._workers.values()
            if not w.holds_nothing()
        ]
        write_snapshot(path, workers, dict(cursors if cursors is not None else self.restored_cursors))

    @classmethod
    def restore(cls, path: str | os.PathLike[str], *, limits: IndexLimits | None = None) -> PrefixIndex:
        """Load an index written by `snapshot`; its cursors are in ``restored_cursors``.

        Raises `SnapshotError` when the file is unreadable, of another format or content-hash
        version. Each worker's tables are checked on the way in: a worker whose state is
        inconsistent (block sizes < 1, malformed keys, duplicate or dangling entries, more than
        the limits allow) is dropped with its cursor and a warning — its source then starts
        cold — never the whole index.
        """
        index = cls(limits=limits)
        workers, index.restored_cursors = read_snapshot(path)
        for sw in workers:
            key = WorkerKey(sw.worker_id, sw.dp_rank)
            problem = _snapshot_problem(sw, index.limits)
            if problem is None and key in index._workers:
                problem = "listed twice"
            if problem is not None:
                _log.warning("snapshot %s: worker %s/%d dropped: %s", path, *key, problem)
                index.restored_cursors.pop(key, None)
                continue
            index._load_worker(key, sw)
        return index

    def _load_worker(self, key: WorkerKey, sw: SnapWorker) -> None:
        """Rebuild one (validated) worker from snapshot tables (the shared tables follow from them)."""
        blocks = dict(zip(sw.hashes, sw.keys))
        w = self._worker(key)
        w.blocks = blocks
        w.special = {h: list(c) for h, c in sw.special if any(c)}
        w.primary = sw.primary
        w.lookahead = sw.lookahead
        if sw.bigram:
            self._bigram_bits |= w.bit
        for cls in sw.classes:
            c = (cls[0], cls[1])
            w.classes.add(c)
            w.bs = max(w.bs, c[0])
            self._bs_members[c] = self._bs_members.get(c, 0) | w.bit
        for sg in sw.groups:
            grp = _Group(sg.kind, sg.window, sg.block_size)
            for h, k, m in zip(sg.hashes, sg.keys, sg.masks):
                grp.blocks[h] = [k, m]
                if k:
                    grp.held[k] = grp.held.get(k, 0) + 1
            w.groups[sg.group_idx] = grp
            self._hybrid_bits |= w.bit
        self._entries += _entries_of(w)
        bit = w.bit
        if not w.special:
            keys = [k for k in blocks.values() if k]
            if len(set(keys)) == len(keys):
                # The common worker: one GPU copy per block, one engine hash per key. Mark
                # its bit with bulk updates, as the ingest hot path does.
                holders = self._holders
                held = list(map(holders.get, keys, repeat(0, len(keys))))
                holders.update(zip(keys, [h | bit if h else bit for h in held]))
                return
        per_key: dict[bytes, list[int]] = {}
        for ehash, ckey in blocks.items():
            if not ckey:
                continue
            counts = w.special.get(ehash)
            mask = _mask(counts) if counts is not None else 1
            tiers = per_key.get(ckey)
            if tiers is None:
                per_key[ckey] = [mask & 1, mask >> 1 & 1, mask >> 2 & 1, mask >> 3 & 1, 1]
            else:
                for i in range(4):
                    tiers[i] += mask >> i & 1
                tiers[4] += 1
        for ckey, tiers in per_key.items():
            if tiers[4] > 1:
                w.multi[ckey] = tiers[:4]
            self._set_mask(bit, ~bit, ckey, 0, _mask(tiers))

    # --- queries -------------------------------------------------------------------------

    def find_matches(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultimodalItem] = (),
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> OverlapScores:
        """How many leading full blocks of ``token_ids`` each worker holds.

        The namespaces are the request's, as the engine hashed them: ``lora_name`` (the
        adapter, None = base model), ``cache_salt`` (the tenant salt, None = unsalted) and
        ``mm_items`` (its multimodal items, `MultimodalItem`: identifier, token offset, length).
        Each worker's keys are built with the lookahead it was seen to hash with. A hybrid
        worker's answer is its engine's rule over every KV-cache group (`OverlapScores`).

        ``extra_keys`` is deprecated: per-block extras given directly (instead of
        ``mm_items``) — it bypasses the adapter/salt handling and will be removed.
        """
        if extra_keys is not None:
            warnings.warn(
                "find_matches(extra_keys=...) is deprecated: pass cache_salt= and mm_items=",
                DeprecationWarning,
                stacklevel=2,
            )
        query = _Query(token_ids, self._root(lora_name, cache_salt), mm_items, extra_keys)
        scores: dict[WorkerKey, int] = {}
        sizes: dict[WorkerKey, int] = {}
        gm = self._gpu_missing
        gpu: dict[WorkerKey, int] | None = {} if gm else None
        gpu_sizes: dict[WorkerKey, int] = {}
        get = self._holders.get
        by_bit = self._by_bit
        qkeys = query.keys
        plain = extra_keys is None and not mm_items
        ntok = len(token_ids)
        for cls, members in self._bs_members.items():
            bs, la = cls
            n = _served_blocks(ntok, bs, la)
            keys: list[bytes] = []
            qkeys[cls] = keys
            alive = alive_gpu = members
            key = query.root
            i = 0
            chunk = _FIRST_CHUNK_BLOCKS
            while i < n and alive:
                end = min(n, i + chunk)
                chunk *= 2
                try:
                    if plain and not la:
                        new_keys = block_keys(key, tokens_to_bytes(token_ids[i * bs : end * bs]), bs, end - i)
                    else:
                        new_keys = query.chain(cls, i, end, key)
                except OverflowError:
                    break  # a token outside uint32 is never part of a held block
                key = new_keys[-1]
                keys += new_keys
                # Holder sets of the chunk's blocks, ANDed along the prefix, all in C.
                holder_sets = list(map(get, new_keys, repeat(0, len(new_keys))))
                alive = _walk(alive, holder_sets, i, bs, scores, sizes, by_bit)
                if gpu is not None:
                    gpu_sets = [h & ~gm.get(k, 0) for k, h in zip(new_keys, holder_sets)]
                    alive_gpu = _walk(alive_gpu, gpu_sets, i, bs, gpu, gpu_sizes, by_bit)
                i = end
            if alive and i:
                _record(scores, sizes, by_bit, alive, i, bs)
            if gpu is not None and alive_gpu and i:
                _record(gpu, gpu_sizes, by_bit, alive_gpu, i, bs)
        if self._bigram_bits:
            _bigram_cap(scores, sizes, ntok, self._bigram_bits, self._workers)
            if gpu is not None:
                _bigram_cap(gpu, gpu_sizes, ntok, self._bigram_bits, self._workers)
        if self._hybrid_bits and scores:
            self._hybrid_rule(query, scores, sizes, gpu)
        return OverlapScores(scores, sizes, gpu, query, self)

    def _hybrid_rule(
        self,
        query: _Query,
        scores: dict[WorkerKey, int],
        sizes: dict[WorkerKey, int],
        gpu: dict[WorkerKey, int] | None,
    ) -> None:
        """Cut each hybrid worker's run to what every KV-cache group serves (vLLM's HybridKVCacheCoordinator)."""
        hybrid = self._hybrid_bits
        for wk in [wk for wk in scores if self._workers[wk].bit & hybrid]:
            w = self._workers[wk]
            bs = sizes[wk]
            align = math.lcm(bs, w.bs)  # the engine schedules in its largest block, not a partial entry's
            for grp in w.groups.values():
                if grp.block_size:
                    align = math.lcm(align, grp.block_size)
            # Hits land on boundaries every group shares (the run is already within the
            # prompt minus one token: `_served_blocks`).
            hit = scores[wk] * bs
            hit -= hit % align
            while hit:
                before = hit
                for grp in w.groups.values():
                    hit = _group_hit(grp, query, (grp.block_size or bs, w.lookahead), hit, align, _anchor(w, grp))
                    if not hit:
                        break
                if hit == before:
                    break
            if hit:
                scores[wk] = hit // bs
                if gpu is not None and wk in gpu:
                    gpu[wk] = min(gpu[wk], hit // bs)
            else:
                del scores[wk]
                del sizes[wk]
                if gpu is not None:
                    gpu.pop(wk, None)

    def _tier_scores(
        self, tier: str, any_scores: Mapping[WorkerKey, int], sizes: Mapping[WorkerKey, int], query: _Query
    ) -> dict[WorkerKey, int]:
        table = self._tier_holders[tier]
        out: dict[WorkerKey, int] = {}
        if not table:
            return out
        out_sizes: dict[WorkerKey, int] = {}
        by_bit = self._by_bit
        for wk, n in any_scores.items():
            w = self._workers.get(wk)
            if w is None:
                continue
            bs = sizes[wk]
            for cls in w.classes:
                if cls[0] != bs:
                    continue
                ks = query.upto(cls, n)
                alive = _walk(w.bit, [table.get(k, 0) for k in ks], 0, bs, out, out_sizes, by_bit)
                if alive and ks:
                    _record(out, out_sizes, by_bit, alive, len(ks), bs)
            if wk in out:
                out[wk] = min(out[wk], n)  # a hybrid worker's run is already cut to its groups
        return out


# --- the engines' last-token rule (issue 18; src/index/query.rs `served_blocks`) -----------------


def _served_blocks(ntok: int, bs: int, la: int) -> int:
    """Leading blocks of size ``bs`` (lookahead ``la``) any worker can serve a prompt of ``ntok`` tokens.

    The engine always computes the prompt's last token (for its logits), so it serves at most
    the prompt minus one token from cache, in whole blocks: vLLM's
    ``Request.get_max_cache_hit_length`` and SGLang's ``Req._compute_max_prefix_len``. A
    lookahead class's own bound (its last block needs ``la`` tokens after it) is the tighter
    one whenever ``la`` >= 1.
    """
    n = (ntok - la) // bs if ntok > la else 0
    return min(n, max(0, (ntok - 1) // bs))


def _bigram_cap(
    scores: dict[WorkerKey, int], sizes: dict[WorkerKey, int], ntok: int, bits: int, workers: dict[WorkerKey, _Worker]
) -> None:
    """Cut SGLang EAGLE workers (``bits``) to what they serve (src/index/query.rs `bigram_cap`): SGLang takes
    the bigram view of the prompt minus one token (one bigram fewer than those tokens), then whole pages:
    ``(ntok - 2) // page`` pages, a page less than `_served_blocks` when ``ntok - 1`` is whole pages."""
    for wk in list(scores):
        cap = max(0, (ntok - 2) // sizes[wk])
        if scores[wk] > cap and workers[wk].bit & bits:
            if cap:
                scores[wk] = cap
            else:
                del scores[wk]
                del sizes[wk]


def _hit_tail(grp: _Group) -> int:
    """Blocks a hit of ``grp`` needs just before the hit point (vLLM's SlidingWindowManager
    ``_contiguous_blocks_for_hit``, a Mamba checkpoint), 0 when its kind has no such rule."""
    if grp.kind == "state":
        return 1
    if grp.kind == "window" and grp.window and grp.window > 1 and grp.block_size:
        return -(-(grp.window - 1) // grp.block_size)
    return 0


def _drop_copy(copies: dict[BlockHash, int], ehash: BlockHash) -> None:
    """One of several GPU copies of ``ehash`` left: the block is still held."""
    n = copies[ehash] - 1
    if n:
        copies[ehash] = n
    else:
        del copies[ehash]


def _remote(locality: object) -> bool:
    """``locality`` "REMOTE" (any case): a shared tier, not the worker's own cache."""
    return isinstance(locality, str) and locality.upper() == "REMOTE"


def _lim(index: PrefixIndex) -> int:
    return index.limits.max_entries_per_worker


def _entries_of(w: _Worker) -> int:
    return len(w.blocks) + sum(len(g.blocks) for g in w.groups.values()) if w.groups else len(w.blocks)


def _anchor(w: _Worker, grp: _Group) -> int:
    """The primary block size when ``grp``'s blocks are keyed by `_anchored_ids` (a window or state
    group with smaller blocks that divide it, no lookahead), else 0."""
    s_bs, p = grp.block_size, w.bs
    if grp.kind == "full" or not s_bs or p <= s_bs or p % s_bs or w.lookahead:
        return 0
    return p


def _anchored_ids(anchor: bytes, data: bytes, s_bs: int, p: int, count: int) -> list[bytes]:
    """Identities of ``count`` blocks of ``s_bs`` tokens after a ``p``-token boundary whose key is ``anchor``.

    At a ``p`` boundary: the primary group's content key there (chained in blocks of ``p``);
    between two: XXH3-128(key at the last ``p`` boundary + 0xfd + the tokens since). Both the
    index and a query can compute them; blocks keyed this way match only through this path.
    """
    out: list[bytes] = []
    step = 4 * s_bs
    per = p // s_bs
    key = anchor
    for j in range(1, count + 1):
        end = j * step
        if j % per == 0:
            key = xxh128(key + data[end - 4 * p : end])
            out.append(key)
        else:
            out.append(xxh128(key + b"\xfd" + data[end - (j % per) * step : end]))
    return out


def _group_hit(grp: _Group, query: _Query, cls: _Class, max_tokens: int, align: int, anchor_p: int = 0) -> int:
    """The longest hit (tokens, <= ``max_tokens``) group ``grp`` serves, by the engine's rule for its kind."""
    kind = grp.kind
    if kind == "unknown":
        return 0
    bs = cls[0]
    if anchor_p:
        count = min(max_tokens // bs, query.n_blocks((bs, 0)))
        try:
            keys = _anchored_ids(query.root, tokens_to_bytes(query.token_ids[: count * bs]), bs, anchor_p, count)
        except OverflowError:
            keys = []
    else:
        keys = query.upto(cls, max_tokens // bs)
    held = grp.held
    m = len(keys)
    if kind == "full":
        run = 0
        while run < m and keys[run] in held:
            run += 1
        t = run * bs
        return t - t % align
    if kind == "state":
        need = 1
    elif grp.window is None or grp.window < 1:
        need = m + 1  # no window known: only a run from the start can be trusted
    else:
        need = -(-(grp.window - 1) // bs)
    if need <= 0:
        return max_tokens - max_tokens % align
    # vLLM's SlidingWindowManager.find_longest_cache_hit: from the right, the first run of
    # `need` held blocks ending on an aligned boundary; else the run from block 0.
    count = 0
    for i in range(m - 1, -1, -1):
        if keys[i] in held:
            if count == 0 and bs != align and ((i + 1) * bs) % align:
                continue
            count += 1
            if count >= need:
                return (i + count) * bs
        else:
            count = 0
    t = count * bs
    return t - t % align


def _snapshot_problem(sw: SnapWorker, lim: IndexLimits) -> str | None:
    """Why a snapshot worker cannot be restored (None: it can)."""
    if not sw.hashes and not any(g.hashes for g in sw.groups):
        return "holds nothing"
    if len(sw.hashes) != len(sw.keys):
        return "mismatched tables"
    if len(set(sw.hashes)) != len(sw.hashes):
        return "duplicate engine hashes"
    if not sw.classes or len(sw.classes) > lim.max_block_sizes:
        return f"{len(sw.classes)} block sizes"
    for cls in sw.classes:
        if len(cls) != 2 or not 1 <= cls[0] <= 1 << 20 or not 0 <= cls[1] <= 1 << 16:
            return f"block size / lookahead {cls!r}"
    if not 0 <= sw.lookahead <= 1 << 16:
        return f"lookahead {sw.lookahead}"
    if any(len(k) not in (0, 16) for k in sw.keys):
        return "malformed content keys"
    present = set(sw.hashes)
    seen: set[BlockHash] = set()
    for h, c in sw.special:
        if h not in present or h in seen or len(c) != 4 or any(v not in (0, 1) for v in c):
            return "inconsistent tier entries"
        seen.add(h)
    total = len(sw.hashes)
    if len(sw.groups) > lim.max_groups_per_worker:
        return f"{len(sw.groups)} groups"
    gids: set[int] = set()
    for g in sw.groups:
        if g.group_idx in gids or g.group_idx == sw.primary:
            return f"group {g.group_idx} listed twice"
        gids.add(g.group_idx)
        if g.kind not in ("full", "window", "state", "unknown") or not 0 <= g.block_size <= 1 << 20:
            return f"group {g.group_idx}: kind {g.kind!r} / block size {g.block_size}"
        if not len(g.hashes) == len(g.keys) == len(g.masks) or len(set(g.hashes)) != len(g.hashes):
            return f"group {g.group_idx}: inconsistent tables"
        if any(len(k) not in (0, 16) for k in g.keys) or any(not 1 <= m <= 15 for m in g.masks):
            return f"group {g.group_idx}: malformed entries"
        total += len(g.hashes)
    if total > lim.max_entries_per_worker:
        return f"{total} entries exceed max_entries_per_worker"
    return None


def _walk(
    alive: int,
    holder_sets: list[int],
    base: int,
    bs: int,
    scores: dict[WorkerKey, int],
    sizes: dict[WorkerKey, int],
    by_bit: dict[int, _Worker],
) -> int:
    """AND ``holder_sets`` along the prefix from block ``base``; score the workers that drop out; return who is left.

    The running AND only ever loses bits, so as an integer it never grows: each drop is found
    by bisection over the accumulated sets instead of a Python step per block.
    """
    acc = list(accumulate(holder_sets, and_, initial=alive))
    last = acc[-1]
    j = 0
    v = alive
    while v != last:
        # first index whose set is smaller than v: workers in v minus it stop just before it
        j = bisect_right(acc, -v, lo=j, key=neg)
        nxt = acc[j]
        if base + j - 1 > 0:
            _record(scores, sizes, by_bit, v & ~nxt, base + j - 1, bs)
        v = nxt
    return last


def _record(
    scores: dict[WorkerKey, int],
    sizes: dict[WorkerKey, int],
    by_bit: dict[int, _Worker],
    bits: int,
    value: int,
    bs: int,
) -> None:
    """Give every worker in ``bits`` a score of ``value`` blocks of ``bs``; its best in tokens over block sizes wins."""
    tokens = value * bs
    while bits:
        low = bits & -bits
        wk = by_bit[low].key
        old = scores.get(wk)
        if old is None or old * sizes[wk] < tokens:
            scores[wk] = value
            sizes[wk] = bs
        bits ^= low
