"""The prefix-block index: which worker holds how many leading blocks of a token sequence.

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

import os
from bisect import bisect_right
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from itertools import accumulate, repeat
from operator import and_, neg
from typing import Any

import msgspec

from ._hashing import block_keys, root_key, tokens_to_bytes
from ._models import CPU, DISK, EXTERNAL, GPU, WorkerKey, normalize_medium
from ._snapshot import Cursor, SnapWorker, read_snapshot, write_snapshot
from ._wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EngineEvent, EventBatch

__all__ = ["IndexStats", "OverlapScores", "PrefixIndex"]

# A (worker, key) presence is a tier mask: GPU 1, CPU 2, DISK 4, EXTERNAL 8.
_TIER_POS = {GPU: 0, CPU: 1, DISK: 2, EXTERNAL: 3}
_OFF_GPU_TIERS = ((CPU, 2), (DISK, 4), (EXTERNAL, 8))

# docs/protocol.md §3: only full-attention KV groups describe reusable prefixes; an absent kind is
# an engine that predates hybrid models, where every group was full attention.
_FULL_KINDS = frozenset({None, "full_attention", "mla_attention", "FullAttentionSpec", "MLAAttentionSpec"})

# find_matches converts the prompt to bytes lazily, in chunks that double: a short match never
# pays for converting an 8k-token prompt, a long one pays a handful of C calls.
_FIRST_CHUNK_BLOCKS = 8


class IndexStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of a `PrefixIndex`; see the README's observability section."""

    workers: int
    entries: int
    distinct_keys: int
    unknown_parent_blocks: int
    unhashable_blocks: int
    unknown_removals: int
    ignored_group_events: int


class _Worker:
    __slots__ = ("bit", "block_sizes", "blocks", "bs", "key", "multi", "nonfull_groups", "special")

    def __init__(self, key: WorkerKey, bit: int) -> None:
        self.key = key
        self.bit = bit
        # engine hash -> content key (b"": held, but never claimable)
        self.blocks: dict[BlockHash, bytes] = {}
        # engine hash -> copies per tier [GPU, CPU, DISK, EXTERNAL]; absent = exactly one GPU copy
        self.special: dict[BlockHash, list[int]] = {}
        # content key -> engine hashes present per tier, once two engine hashes map to one key
        self.multi: dict[bytes, list[int]] = {}
        self.block_sizes: set[int] = set()
        self.bs = 0  # max(block_sizes), read on the router's hot path
        self.nonfull_groups: set[int] = set()


def _mask(counts: list[int]) -> int:
    return (counts[0] > 0) | (counts[1] > 0) << 1 | (counts[2] > 0) << 2 | (counts[3] > 0) << 3


class OverlapScores(Mapping[WorkerKey, int]):
    """Leading full blocks of one query held by each worker (any tier); absent workers read as 0.

    ``tier(name)`` gives the same per storage tier ("GPU", "CPU", "DISK", "EXTERNAL"): the
    leading blocks all held on that tier. Per-tier detail of the off-GPU tiers is computed on
    first access, from the index as it is then.
    """

    __slots__ = ("_gpu", "_index", "_keys", "_n_blocks", "_scores", "_tiers")

    def __init__(
        self,
        scores: dict[WorkerKey, int],
        gpu: dict[WorkerKey, int] | None,
        keys: dict[int, list[bytes]],
        n_blocks: dict[int, int],
        index: PrefixIndex,
    ) -> None:
        self._scores = scores
        self._gpu = gpu
        self._keys = keys
        self._n_blocks = n_blocks
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

    def tier(self, tier: str) -> Mapping[WorkerKey, int]:
        """Leading blocks held on ``tier`` (a name from `kvroute.TIERS` or an engine's ``medium``)."""
        tier = normalize_medium(tier)
        if tier == GPU:
            return self._scores if self._gpu is None else self._gpu
        found = self._tiers.get(tier)
        if found is None:
            found = self._index._tier_scores(tier, self._scores, self._keys)
            self._tiers[tier] = found
        return found

    def query_blocks(self, worker: WorkerKey) -> int:
        """Full blocks the query has at ``worker``'s block size (0 when the index has no block size for it)."""
        sizes = self._index._block_sizes_of(worker)
        return max((self._n_blocks.get(bs, 0) for bs in sizes), default=0)


class PrefixIndex:
    """The prefix-block index: apply engine events per worker, ask who holds a prompt's prefix.

    Not thread-safe: feed it from one task (KvEventClient does) and query it from the same
    event loop.
    """

    def __init__(self) -> None:
        self._workers: dict[WorkerKey, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._holders: dict[bytes, int] = {}
        self._gpu_missing: dict[bytes, int] = {}
        self._tier_holders: dict[str, dict[bytes, int]] = {CPU: {}, DISK: {}, EXTERNAL: {}}
        self._bs_members: dict[int, int] = {}
        self._roots: dict[str | None, bytes] = {}
        self._entries = 0
        self._unknown_parent = 0
        self._unhashable = 0
        self._unknown_removals = 0
        self._ignored_group = 0
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
        for bs in w.block_sizes:
            members = self._bs_members[bs] & ~w.bit
            if members:
                self._bs_members[bs] = members
            else:
                del self._bs_members[bs]
        self._free_bits.append(w.bit)

    def workers(self) -> set[WorkerKey]:
        """Workers that hold at least one block."""
        return set(self._workers)

    def num_blocks(self, worker: WorkerKey | None = None) -> int:
        """Blocks held by ``worker``, or (block, worker) entries over all workers."""
        if worker is None:
            return self._entries
        w = self._workers.get(worker)
        return len(w.blocks) if w is not None else 0

    def block_size(self, worker: WorkerKey) -> int | None:
        """The block size ``worker``'s events use (the largest, should it use several)."""
        w = self._workers.get(worker)
        return w.bs if w is not None and w.bs else None

    def _block_sizes_of(self, worker: WorkerKey) -> set[int]:
        w = self._workers.get(worker)
        return w.block_sizes if w is not None else set()

    def stats(self) -> IndexStats:
        """A snapshot of the index's size and counters."""
        return IndexStats(
            workers=len(self._workers),
            entries=self._entries,
            distinct_keys=len(self._holders),
            unknown_parent_blocks=self._unknown_parent,
            unhashable_blocks=self._unhashable,
            unknown_removals=self._unknown_removals,
            ignored_group_events=self._ignored_group,
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
        self._entries -= len(w.blocks)
        self._release(w)

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

    def _root(self, lora_name: str | None) -> bytes:
        r = self._roots.get(lora_name)
        if r is None:
            r = self._roots[lora_name] = root_key(lora_name)
        return r

    def _store(self, worker: WorkerKey, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if ev.kv_cache_spec_kind not in _FULL_KINDS:
            self._ignored_group += 1
            # Remember the group so its removals are ignored too. A worker that holds no
            # full-attention block keeps no record (no residue); a removal it then misreads
            # can only make the index claim less, never more.
            known = self._workers.get(worker)
            if ev.group_idx is not None and known is not None:
                known.nonfull_groups.add(ev.group_idx)
            return
        if not n:
            return
        w = self._worker(worker)
        bs = ev.block_size
        if bs not in w.block_sizes:
            w.block_sizes.add(bs)
            w.bs = max(w.bs, bs)
            self._bs_members[bs] = self._bs_members.get(bs, 0) | w.bit
        blocks = w.blocks
        parent = ev.parent_block_hash
        if parent is None:
            key = self._root(ev.lora_name)
        else:
            key = blocks.get(parent, b"")
            if parent not in blocks:
                self._unknown_parent += n
        tokens = ev.token_ids
        full = len(tokens) // bs
        data = b""
        if key:
            try:
                data = tokens_to_bytes(tokens if full * bs == len(tokens) else tokens[: full * bs])
            except OverflowError:
                self._unhashable += n
                key = b""
        tier = normalize_medium(ev.medium)
        if key and tier == GPU and ev.extra_keys is None and full == n and blocks.keys().isdisjoint(hashes):
            # Hot path (nearly every event): n new engine hashes, one GPU copy each, chained
            # on a known parent. Hash in one tight loop, then map and mark with C-level
            # bulk updates; only content this worker already holds goes block by block.
            holders = self._holders
            bit = w.bit
            keys = block_keys(key, data, bs, n)
            before = len(blocks)
            blocks.update(zip(hashes, keys))
            if len(blocks) - before != n:
                # The same hash twice in one event (never from vLLM): undo, count copies below.
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
            keys = block_keys(key, data, bs, full, ev.extra_keys)
            if full < n:  # SGLang's short last page: held, but not a full block to match
                keys.append(b"")
        else:
            keys = [b""] * n
        pos = _TIER_POS[tier]
        for ehash, k in zip(hashes, keys):
            self._store_one(w, ehash, k, pos)

    def _store_one(self, w: _Worker, ehash: BlockHash, key: bytes, pos: int) -> None:
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
        # Another copy of a block the worker already holds (same engine hash): keep the
        # first content key and count the copy on its tier.
        counts = w.special.setdefault(ehash, [1, 0, 0, 0])
        counts[pos] += 1
        if counts[pos] == 1:
            self._presence(w, ehash, old_key, pos, 1, False)

    def _remove(self, worker: WorkerKey, ev: BlockRemoved) -> None:
        w = self._workers.get(worker)
        if w is None:
            self._unknown_removals += len(ev.block_hashes)
            return
        if ev.group_idx is not None and ev.group_idx in w.nonfull_groups:
            self._ignored_group += 1
            return
        pos = _TIER_POS[normalize_medium(ev.medium)]
        blocks = w.blocks
        special = w.special
        for ehash in ev.block_hashes:
            key = blocks.get(ehash)
            if key is None:
                self._unknown_removals += 1
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
            counts[pos] -= 1
            if not any(counts):
                del special[ehash]
                del blocks[ehash]
                self._entries -= 1
                self._presence(w, ehash, key, pos, -1, False)
            else:
                if counts == [1, 0, 0, 0]:
                    del special[ehash]
                if not counts[pos]:
                    self._presence(w, ehash, key, pos, -1, False)
        if not blocks:
            self._release(w)

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
                block_sizes=sorted(w.block_sizes),
                nonfull_groups=sorted(w.nonfull_groups),
                hashes=list(w.blocks.keys()),
                keys=list(w.blocks.values()),
                special=[(h, list(c)) for h, c in w.special.items()],
            )
            for w in self._workers.values()
        ]
        write_snapshot(path, workers, dict(cursors if cursors is not None else self.restored_cursors))

    @classmethod
    def restore(cls, path: str | os.PathLike[str]) -> PrefixIndex:
        """Load an index written by `snapshot`; its cursors are in ``restored_cursors``. Raises `SnapshotError`."""
        index = cls()
        workers, index.restored_cursors = read_snapshot(path)
        for sw in workers:
            index._load_worker(
                WorkerKey(sw.worker_id, sw.dp_rank),
                dict(zip(sw.hashes, sw.keys)),
                dict(sw.special),
                set(sw.block_sizes),
                set(sw.nonfull_groups),
            )
        return index

    def _load_worker(
        self,
        key: WorkerKey,
        blocks: dict[BlockHash, bytes],
        special: dict[BlockHash, list[int]],
        block_sizes: set[int],
        nonfull_groups: set[int],
    ) -> None:
        """Rebuild one worker from snapshot tables (the shared tables follow from them)."""
        if not blocks or key in self._workers:
            return
        w = self._worker(key)
        w.blocks = blocks
        w.special = {h: c for h, c in special.items() if h in blocks and len(c) == 4 and any(c)}
        w.nonfull_groups = nonfull_groups
        for bs in block_sizes:
            w.block_sizes.add(bs)
            w.bs = max(w.bs, bs)
            self._bs_members[bs] = self._bs_members.get(bs, 0) | w.bit
        self._entries += len(blocks)
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
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> OverlapScores:
        """How many leading full blocks of ``token_ids`` each worker holds.

        ``lora_name`` selects the adapter namespace (None = base model); ``extra_keys`` gives
        the per-block extra keys (images, cache salt) the engine hashed with, if any.
        """
        scores: dict[WorkerKey, int] = {}
        gm = self._gpu_missing
        gpu: dict[WorkerKey, int] | None = {} if gm else None
        keys_by_bs: dict[int, list[bytes]] = {}
        n_by_bs: dict[int, int] = {}
        get = self._holders.get
        by_bit = self._by_bit
        root = self._root(lora_name)
        ntok = len(token_ids)
        for bs, members in self._bs_members.items():
            n = ntok // bs
            n_by_bs[bs] = n
            keys: list[bytes] = []
            keys_by_bs[bs] = keys
            alive = alive_gpu = members
            key = root
            i = 0
            chunk = _FIRST_CHUNK_BLOCKS
            while i < n and alive:
                end = min(n, i + chunk)
                chunk *= 2
                try:
                    data = tokens_to_bytes(token_ids[i * bs : end * bs])
                except OverflowError:
                    break  # a token outside uint32 is never part of a held block
                extras = None if extra_keys is None else [
                    extra_keys[j] if j < len(extra_keys) else None for j in range(i, end)
                ]
                new_keys = block_keys(key, data, bs, end - i, extras)
                key = new_keys[-1]
                keys += new_keys
                # Holder sets of the chunk's blocks, ANDed along the prefix, all in C.
                holder_sets = list(map(get, new_keys, repeat(0, len(new_keys))))
                alive = _walk(alive, holder_sets, i, scores, by_bit)
                if gpu is not None:
                    gpu_sets = [h & ~gm.get(k, 0) for k, h in zip(new_keys, holder_sets)]
                    alive_gpu = _walk(alive_gpu, gpu_sets, i, gpu, by_bit)
                i = end
            if alive and i:
                _record(scores, by_bit, alive, i)
            if gpu is not None and alive_gpu and i:
                _record(gpu, by_bit, alive_gpu, i)
        return OverlapScores(scores, gpu, keys_by_bs, n_by_bs, self)

    def _tier_scores(
        self, tier: str, any_scores: Mapping[WorkerKey, int], keys: dict[int, list[bytes]]
    ) -> dict[WorkerKey, int]:
        table = self._tier_holders[tier]
        out: dict[WorkerKey, int] = {}
        if not table:
            return out
        by_bit = self._by_bit
        for bs, ks in keys.items():
            alive = 0
            for wk in any_scores:
                w = self._workers.get(wk)
                if w is not None and bs in w.block_sizes:
                    alive |= w.bit
            alive = _walk(alive, [table.get(k, 0) for k in ks], 0, out, by_bit)
            if alive and ks:
                _record(out, by_bit, alive, len(ks))
        return out


def _walk(
    alive: int, holder_sets: list[int], base: int, scores: dict[WorkerKey, int], by_bit: dict[int, _Worker]
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
            _record(scores, by_bit, v & ~nxt, base + j - 1)
        v = nxt
    return last


def _record(scores: dict[WorkerKey, int], by_bit: dict[int, _Worker], bits: int, value: int) -> None:
    """Give every worker in ``bits`` a score of ``value`` (keeping the best over block sizes)."""
    while bits:
        low = bits & -bits
        wk = by_bit[low].key
        if scores.get(wk, 0) < value:
            scores[wk] = value
        bits ^= low

