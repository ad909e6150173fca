"""PrefixIndex against a brute-force model: per worker, the set of stored prefixes and their copies per tier."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PrefixIndex,
    SnapshotError,
    WorkerKey,
    decode_batch,
    encode_batch,
)
from kvroute._hashing import chain_keys
from kvroute._models import TIERS, normalize_medium
from kvroute._snapshot import Cursor

W = [WorkerKey("a", 0), WorkerKey("a", 1), WorkerKey("b", 0), WorkerKey("c", 0)]
BLOCK_SIZE = {W[0]: 2, W[1]: 2, W[2]: 4, W[3]: 2}
MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL"]


@dataclass
class MBlock:
    """One engine hash as the model sees it: its full identity (None = unclaimable) and copies per tier."""

    ident: tuple[object, ...] | None
    copies: dict[str, int] = field(default_factory=dict)


def held_idents(blocks: dict[int, MBlock], tier: str | None) -> set[tuple[object, ...]]:
    """Identities the worker holds (on ``tier``, or on any tier)."""
    out = set()
    for b in blocks.values():
        if b.ident is None:
            continue
        if (tier is None and any(b.copies.values())) or (tier is not None and b.copies.get(tier, 0) > 0):
            out.add(b.ident)
    return out


def model_score(blocks: dict[int, MBlock], bs: int, tokens: list[int], lora: str | None, tier: str | None) -> int:
    """Leading full blocks of ``tokens`` whose whole prefix identity the worker holds, within the
    prompt minus its last token (which every engine computes, for its logits)."""
    held = held_idents(blocks, tier)
    n = 0
    for i in range(max(0, len(tokens) - 1) // bs):
        if (lora, bs, tuple(tokens[: (i + 1) * bs])) not in held:
            break
        n += 1
    return n


class IndexMachine(RuleBasedStateMachine):
    """Random store / remove / clear / query sequences; the index must agree with the model exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[WorkerKey, dict[int, MBlock]] = {w: {} for w in W}
        self.next_hash = 1
        # Every prefix ever stored, as (adapter, tokens), whether still held or not: queries
        # drawn from it reach removed, cleared and reset workers' old chains, and an
        # unknown-parent chain's tokens as if it were rooted (what an index that let it
        # claim would match).
        self.seen: list[tuple[str | None, tuple[int, ...]]] = []

    def _fresh_hash(self) -> int:
        self.next_hash += 1
        return self.next_hash * 0x9E3779B97F4A7C15 % (1 << 64)

    @rule(
        w=st.sampled_from(W),
        parent_pick=st.integers(0, 1000),
        parent_mode=st.sampled_from(["root", "known", "unknown"]),
        nblocks=st.integers(1, 3),
        alphabet=st.lists(st.integers(0, 3), min_size=12, max_size=12),
        lora=st.sampled_from([None, "ad1"]),
        medium=st.sampled_from(MEDIA),
        reuse_hash=st.booleans(),
        # Sliding-window groups change the hit rule: tests/test_index_groups.py covers them.
        kind=st.sampled_from([None, "full_attention"]),
    )
    def store(
        self,
        w: WorkerKey,
        parent_pick: int,
        parent_mode: str,
        nblocks: int,
        alphabet: list[int],
        lora: str | None,
        medium: str | None,
        reuse_hash: bool,
        kind: str | None,
    ) -> None:
        bs = BLOCK_SIZE[w]
        blocks = self.model[w]
        parent_hash: int | None = None
        prefix: tuple[int, ...] | None = ()
        plora = lora
        if parent_mode == "known" and blocks:
            parent_hash = sorted(blocks)[parent_pick % len(blocks)]
            ident = blocks[parent_hash].ident
            prefix = None if ident is None else ident[2]  # type: ignore[assignment]
            plora = None if ident is None else ident[0]  # type: ignore[assignment]
        elif parent_mode == "unknown":
            parent_hash = self._fresh_hash()
            prefix = None
        tokens = alphabet[: bs * nblocks]
        hashes = []
        idents: list[tuple[object, ...] | None] = []
        cur = prefix
        for i in range(nblocks):
            if reuse_hash and blocks and i == 0:
                hashes.append(sorted(blocks)[parent_pick % len(blocks)])
            else:
                hashes.append(self._fresh_hash())
            cur = None if cur is None else cur + tuple(tokens[i * bs : (i + 1) * bs])
            # The block's chain starts with the adapter of the event that rooted it.
            idents.append(None if cur is None else (plora if parent_hash is not None else lora, bs, cur))
        self.seen.append((lora, tuple(tokens)) if prefix is None else (plora, (prefix or ()) + tuple(tokens)))
        ev = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_hash,
            token_ids=tokens,
            block_size=bs,
            lora_name=lora,
            medium=medium,
            kv_cache_spec_kind=kind,
            group_idx=0,
        )
        self.index.apply_batch(w, EventBatch(1.0, [ev], 0))
        tier = normalize_medium(medium)
        for h, ident in zip(hashes, idents):
            b = blocks.get(h)
            if b is None:
                blocks[h] = b = MBlock(ident)
            if parent_hash is not None and tier == "GPU" and b.copies.get("GPU", 0):
                # A store that names a parent is a new cache entry (vLLM's reuse reports start at block 0
                # with no parent): one more GPU copy, removed by a removal of its own.
                b.copies[tier] += 1
                continue
            # From block 0 a store of a hash already held on that tier is no copy of its own: the wire
            # cannot tell a reuse report from a real duplicate, and only the first removal is sure to come.
            # Nor does it take a copy away: a reuse report leaves the engine's entries as they were
            # (vLLM 0.34 BlockPool.emit_cached_block_events: "does NOT modify block state"), and each
            # entry a store with a parent added still gets its own BlockRemoved (BlockHashToBlockMap.pop
            # drops one block id per eviction). Held copies stay; an unheld tier becomes one copy.
            b.copies[tier] = max(b.copies.get(tier, 0), 1)

    @precondition(lambda self: any(self.model.values()))
    @rule(w=st.sampled_from(W), picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3),
          medium=st.sampled_from(MEDIA), unknown=st.booleans())
    def remove(self, w: WorkerKey, picks: list[int], medium: str | None, unknown: bool) -> None:
        blocks = self.model[w]
        hashes = [sorted(blocks)[p % len(blocks)] for p in picks] if blocks else []
        if unknown or not hashes:
            hashes.append(self._fresh_hash())
        self.index.apply(w, BlockRemoved(block_hashes=hashes, medium=medium))
        tier = normalize_medium(medium)
        for h in hashes:
            b = blocks.get(h)
            if b is None or b.copies.get(tier, 0) == 0:
                continue
            b.copies[tier] -= 1
            if not any(b.copies.values()):
                del blocks[h]

    @rule(w=st.sampled_from(W))
    def clear(self, w: WorkerKey) -> None:
        self.index.apply(w, AllBlocksCleared())
        self.model[w] = {}

    @rule(w=st.sampled_from(W))
    def remove_worker(self, w: WorkerKey) -> None:
        self.index.remove_worker(w)
        self.model[w] = {}

    @rule()
    def snapshot_and_restore(self) -> None:
        """A restored index behaves exactly like the original from then on (later rules keep using it)."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "index.snap"
            cursors = {w: Cursor(i, float(i)) for i, w in enumerate(W)}
            self.index.snapshot(path, cursors=cursors)
            self.index = PrefixIndex.restore(path)
        assert self.index.restored_cursors == cursors
        # Extra GPU copies are not in snapshots (README "Copies"): a restored block is one copy.
        for blocks in self.model.values():
            for b in blocks.values():
                if b.copies.get("GPU", 0) > 1:
                    b.copies["GPU"] = 1

    @rule(w=st.sampled_from(W), pick=st.integers(0, 1000), extra=st.lists(st.integers(0, 3), max_size=6),
          lora=st.sampled_from([None, "ad1"]), from_seen=st.booleans())
    def query(self, w: WorkerKey, pick: int, extra: list[int], lora: str | None, from_seen: bool) -> None:
        """Query a held chain, or any chain ever stored (unknown-parent, removed, cleared ones too)."""
        blocks = self.model[w]
        idents = [b.ident for b in blocks.values() if b.ident is not None]
        if from_seen and self.seen:
            lora, seen = self.seen[pick % len(self.seen)]
            tokens = list(seen) + extra
        elif idents:
            ident = sorted(idents, key=repr)[pick % len(idents)]
            tokens = list(ident[2]) + extra  # type: ignore[call-overload]
            lora = ident[0]  # type: ignore[assignment]
        else:
            tokens = extra
        self.check_query(tokens, lora)

    def check_query(self, tokens: list[int], lora: str | None) -> None:
        scores = self.index.find_matches(tokens, lora_name=lora)
        for w in W:
            bs = BLOCK_SIZE[w]
            assert scores[w] == model_score(self.model[w], bs, tokens, lora, None), (w, tokens, lora)
            for tier in TIERS:
                assert scores.tier(tier).get(w, 0) == model_score(self.model[w], bs, tokens, lora, tier), (w, tier)

    @invariant()
    def sizes_agree(self) -> None:
        for w in W:
            assert self.index.num_blocks(w) == len(self.model[w])
        assert self.index.workers() == {w for w in W if self.model[w]}
        assert self.index.num_blocks() == sum(len(b) for b in self.model.values())

    @invariant()
    def no_residue(self) -> None:
        idx = self.index
        if not any(self.model.values()):
            assert not idx._holders and not idx._gpu_missing and not idx._bs_members
            assert not any(idx._tier_holders.values())
            assert not idx._workers and not idx._by_bit


TestIndexModel = IndexMachine.TestCase
TestIndexModel.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_chain_and_lora_namespaces() -> None:
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2, lora_name="x"))
    assert idx.find_matches([1, 2, 3, 4, 5], lora_name="x")[w] == 2
    assert idx.find_matches([1, 2, 3, 4, 5])[w] == 0
    assert idx.find_matches([1, 2, 9, 9], lora_name="x")[w] == 1


def test_extra_keys_match_only_the_same_keys() -> None:
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2, extra_keys=[None, ["img1"]]))
    assert idx.find_matches([1, 2, 3, 4, 5])[w] == 1
    # The extra_keys= argument is deprecated (cache_salt= and mm_items= replace it): it warns, and still works.
    with pytest.warns(DeprecationWarning, match=r"find_matches\(extra_keys=\.\.\.\) is deprecated"):
        assert idx.find_matches([1, 2, 3, 4, 5], extra_keys=[None, ["img2"]])[w] == 1
    with pytest.warns(DeprecationWarning, match=r"find_matches\(extra_keys=\.\.\.\) is deprecated"):
        assert idx.find_matches([1, 2, 3, 4, 5], extra_keys=[None, ["img1"]])[w] == 2


def test_unknown_parent_never_claims_and_descendants_stay_unclaimable() -> None:
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[7], parent_block_hash=99, token_ids=[3, 4], block_size=2))
    idx.apply(w, BlockStored(block_hashes=[8], parent_block_hash=7, token_ids=[5, 6], block_size=2))
    assert idx.find_matches([3, 4, 5, 6]) == {}
    assert idx.num_blocks(w) == 2
    assert idx.stats().unknown_parent_blocks == 1
    idx.apply(w, BlockRemoved(block_hashes=[7, 8]))
    assert idx.workers() == set()


def test_a_second_store_of_a_held_block_is_no_second_copy() -> None:
    """A reuse report and a real duplicate look alike on the wire; the first removal drops the block."""
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    ev = BlockStored(block_hashes=[5], token_ids=[1, 2], block_size=2)
    idx.apply(w, ev)
    idx.apply(w, ev)
    assert idx.find_matches([1, 2, 3])[w] == 1
    idx.apply(w, BlockRemoved(block_hashes=[5]))
    assert idx.find_matches([1, 2]) == {}
    idx.apply(w, BlockRemoved(block_hashes=[5]))
    assert idx.stats().unknown_removals == 1


def test_a_store_from_block_0_keeps_the_copies_a_store_with_a_parent_added() -> None:
    """vLLM: request A caches blocks 1, 2; request B caches its own entry of block 2 (chunked prefill:
    a store naming parent 1, a second entry); request C hits the prefix and its reuse report lists 1, 2
    from block 0 (``emit_cached_block_events`` adds no entry). The engine holds two entries of block 2
    and removes each with its own BlockRemoved: after the first, block 2 is still held."""
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[1, 2], token_ids=[0, 0, 0, 0], block_size=2))
    idx.apply(w, BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=[0, 0], block_size=2))
    idx.apply(w, BlockStored(block_hashes=[1, 2], token_ids=[0, 0, 0, 0], block_size=2))
    idx.apply(w, BlockRemoved(block_hashes=[2]))
    assert idx.num_blocks(w) == 2 and idx.find_matches([0, 0, 0, 0, 0])[w] == 2
    idx.apply(w, BlockRemoved(block_hashes=[2]))
    assert idx.num_blocks(w) == 1 and idx.find_matches([0, 0, 0, 0, 0])[w] == 1
    assert idx.stats().unknown_removals == 0


def test_model_steps_a_store_from_block_0_after_a_copy() -> None:
    """The sequence hypothesis shrank when the model reset a block's GPU copies to one on a store from
    block 0 (step 15 adds a copy of a0's block with a parent, step 16 stores it again from block 0, step
    19 removes it once): the index rightly kept it, the model dropped it. Replayed rule by rule."""
    a0, a1, b0, c0 = W
    zeros = [0] * 12
    m = IndexMachine()

    def store(w: WorkerKey, nblocks: int, parent_mode: str, parent_pick: int, reuse_hash: bool) -> None:
        m.store(w=w, parent_pick=parent_pick, parent_mode=parent_mode, nblocks=nblocks, alphabet=zeros,
                lora=None, medium=None, reuse_hash=reuse_hash, kind=None)

    steps = [
        lambda: m.remove_worker(w=a0), lambda: m.remove_worker(w=a0), lambda: m.remove_worker(w=a0),
        lambda: m.remove_worker(w=a0), lambda: m.remove_worker(w=b0),
        lambda: store(a0, 1, "root", 0, False),
        lambda: store(b0, 3, "root", 0, False),
        lambda: store(a0, 1, "root", 0, False),
        lambda: m.remove(w=a1, picks=[0], medium=None, unknown=False),
        lambda: m.remove_worker(w=c0),
        lambda: m.remove(w=a0, picks=[0], medium=None, unknown=True),
        lambda: m.remove(w=c0, picks=[0], medium=None, unknown=False),
        lambda: m.remove_worker(w=c0),
        lambda: m.remove(w=c0, picks=[0], medium=None, unknown=True),
        lambda: store(a1, 3, "root", 0, False),
        lambda: store(a0, 1, "known", 0, True),
        lambda: store(a0, 2, "root", 23, True),
        lambda: store(a1, 2, "root", 858, False),
        lambda: store(a0, 2, "root", 0, False),
        lambda: m.remove(w=a0, picks=[3], medium=None, unknown=False),
    ]
    for step in steps:
        step()
        m.no_residue()
        m.sizes_agree()
    assert m.index.num_blocks(a0) == 4
    m.teardown()


def test_same_hash_twice_in_one_event_is_one_block_and_leaves_no_orphan() -> None:
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[5, 5], token_ids=[1, 2, 3, 4], block_size=2))
    assert idx.num_blocks(w) == 1 and idx.find_matches([1, 2, 3, 4])[w] == 1
    idx.apply(w, BlockRemoved(block_hashes=[5]))
    assert idx.find_matches([1, 2]) == {}
    assert idx.workers() == set() and not idx._holders


def test_block_sizes_and_hybrid_groups() -> None:
    idx = PrefixIndex()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    toks = list(range(32))
    idx.apply(a, BlockStored(block_hashes=[1, 2], token_ids=toks[:32], block_size=16))
    idx.apply(b, BlockStored(block_hashes=[1, 2, 3, 4], token_ids=toks[:16], block_size=4, group_idx=0,
                             kv_cache_spec_kind="full_attention"))
    # A sliding-window group's removal of the same engine hash must not touch the full group.
    idx.apply(b, BlockStored(block_hashes=[1], token_ids=toks[:4], block_size=4, group_idx=1,
                             kv_cache_spec_kind="sliding_window"))
    idx.apply(b, BlockRemoved(block_hashes=[1], group_idx=1))
    assert idx.num_blocks(b) == 4  # the full-attention group kept every block
    scores = idx.find_matches([*toks, 0])
    # b is hybrid and its window group now holds nothing: its engine cannot serve the prefix.
    assert scores[a] == 2 and scores[b] == 0
    assert scores.query_blocks(a) == 2 and scores.query_blocks(b) == 8


def test_sglang_short_last_page_is_held_not_claimed() -> None:
    """SGLang: signed hashes on the wire, a short last page; removed later by the uint64 spelling."""
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    stored = BlockStored(block_hashes=[(1 << 64) - 1, (1 << 64) - 2], token_ids=[1, 2, 3], block_size=2)
    idx.apply_batch(w, decode_batch(encode_batch(EventBatch(1.0, [stored], 0), signed_hashes=True)))
    assert idx.find_matches([1, 2, 3, 4])[w] == 1
    assert idx.num_blocks(w) == 2
    idx.apply(w, BlockRemoved(block_hashes=[(1 << 64) - 1, (1 << 64) - 2]))
    assert idx.workers() == set()


def test_find_matches_stops_early() -> None:
    """Lazy hashing: a mismatch at block 0 of a huge prompt costs one chunk, not the prompt."""
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    idx.apply(w, BlockStored(block_hashes=[1], token_ids=[1] * 16, block_size=16))
    scores = idx.find_matches([2] * 8192)
    assert scores == {}
    assert len(scores._query.keys[(16, 0)]) == 8  # one chunk of the 512 blocks was hashed


@pytest.mark.parametrize("seed", range(3))
def test_leak_after_churn(seed: int) -> None:
    rng = random.Random(seed)
    idx = PrefixIndex()
    workers = [WorkerKey(f"w{i}", i % 2) for i in range(20)]
    held: dict[WorkerKey, list[int]] = {w: [] for w in workers}
    h = 0
    for _ in range(3000):
        w = rng.choice(workers)
        if held[w] and rng.random() < 0.45:
            victims = [held[w].pop(rng.randrange(len(held[w]))) for _ in range(min(3, len(held[w])))]
            idx.apply(w, BlockRemoved(block_hashes=victims, medium=rng.choice(["GPU", None])))
        else:
            n = rng.randint(1, 4)
            hashes = list(range(h, h + n))
            h += n
            idx.apply(w, BlockStored(block_hashes=hashes, token_ids=[rng.randrange(50) for _ in range(4 * n)],
                                     block_size=4, medium=rng.choice(["GPU", "CPU"])))
            held[w].extend(hashes)
    for w in workers:
        if rng.random() < 0.5:
            idx.apply(w, AllBlocksCleared())
        else:
            idx.remove_worker(w)
    assert idx.num_blocks() == 0
    assert not idx._holders and not idx._gpu_missing and not idx._workers and not idx._bs_members
    assert not any(idx._tier_holders.values())


def test_chain_keys_are_stable() -> None:
    """The content hash is part of the snapshot format and shared across replicas: pin its values."""
    assert chain_keys([1, 2, 3, 4], 2) == chain_keys([1, 2, 3, 4, 5], 2)
    assert chain_keys([1, 2, 3, 4], 2, lora_name="x") != chain_keys([1, 2, 3, 4], 2)
    # Computed once from the definition in kvroute/_hashing.py; a change here breaks snapshots.
    assert chain_keys([1, 2], 2)[0] == bytes.fromhex("b1dc9e602379f1a059dc9a853d9fa07a")  # HASH_VERSION 2


def test_snapshot_errors(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="cannot read"):
        PrefixIndex.restore(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"\x00garbage")
    with pytest.raises(SnapshotError, match="not a kvroute snapshot"):
        PrefixIndex.restore(tmp_path / "junk")
    idx = PrefixIndex()
    idx.apply(WorkerKey("w", 0), BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2))
    idx.snapshot(tmp_path / "ok")
    data = (tmp_path / "ok").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError):
        PrefixIndex.restore(tmp_path / "cut")
    restored = PrefixIndex.restore(tmp_path / "ok")
    assert restored.find_matches([1, 2, 3])[WorkerKey("w", 0)] == 1


def test_every_block_is_found_while_the_tables_grow_a_few_entries_at_a_time(tmp_path: Path) -> None:
    """Past 65,536 keys (and engine hashes in a worker's table) a growth moves entries a few per store
    instead of all at once (docs/architecture.md): checked after every store, through several growths of
    the key table and of the worker's table, with tails removed and sequences continued on the way (a
    continuation finds its parent's engine hash wherever it is), and a snapshot taken while entries are
    moving holds every block."""
    idx = PrefixIndex()
    w = WorkerKey("w", 0)
    rng = random.Random(5)
    seqs: list[tuple[list[int], int]] = []  # (tokens, leading blocks still held)
    roots: list[tuple[list[int], int]] = []  # whole sequences with no parent: (tokens, last engine hash)
    stored = 0
    for s in range(400):  # 400 x 512 blocks stored, ~85 % kept: the key table grows at ~69k, ~104k, ~155k keys
        tokens = [rng.randrange(1, 50_000) for _ in range(2 * 512)]
        hashes = list(range(1 + 512 * s, 1 + 512 * (s + 1)))
        base: list[int] = []
        if roots and rng.random() < 0.3:
            base, parent = rng.choice(roots)
            idx.apply(w, BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=2))
        else:
            idx.apply(w, BlockStored(block_hashes=hashes, token_ids=tokens, block_size=2))
        held = 512
        if rng.random() < 0.3:
            held = rng.randrange(1, 512)
            idx.apply(w, BlockRemoved(block_hashes=hashes[held:]))
        elif not base:
            roots.append((tokens, hashes[-1]))
        stored += held
        seqs.append((base + tokens, len(base) // 2 + held))
        for toks, n in [seqs[-1], *rng.sample(seqs, min(3, len(seqs)))]:
            assert idx.find_matches([*toks, 0])[w] == n, s
        if s in (140, 210, 330):
            idx.snapshot(tmp_path / "mid.snap")
            back = PrefixIndex.restore(tmp_path / "mid.snap")
            assert back.num_blocks(w) == idx.num_blocks(w), s
            for toks, n in rng.sample(seqs, 20):
                assert back.find_matches([*toks, 0])[w] == n, s
    assert idx.num_blocks(w) == stored
    for toks, n in seqs:
        assert idx.find_matches([*toks, 0])[w] == n
