"""What the production configurations need of the index: groups, reuse reports, bounds, snapshot checks."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import pytest
from _publisher_helpers import FAST, settle

from kvroute import BlockRemoved, BlockStored, Cursor, IndexLimits, PrefixIndex, Router, SnapshotError, WorkerKey
from kvroute._client import KvEventClient
from kvroute._index import IndexLimitsError
from kvroute._snapshot import _Snapshot
from kvroute.sim._publisher import EventPublisher

W = WorkerKey("w", 0)
TOKS = list(range(1, 17))


def _full(hashes: list[int], tokens: list[int], bs: int, parent: int | None = None, group: int = 0) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                       group_idx=group, kv_cache_spec_kind="full_attention")


def _window(hashes: list[int], tokens: list[int], bs: int, window: int, parent: int | None = None,
            group: int = 1) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                       group_idx=group, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window)


def test_a_reuse_report_never_outlives_the_engines_removal() -> None:
    """kv_cache_report_mode "full": a BlockStored again for a cached block, and no removal for it later."""
    idx = PrefixIndex()
    store = _full([1, 2], TOKS[:8], 4)
    idx.apply(W, store)
    idx.apply(W, store)  # the report
    assert idx.num_blocks(W) == 2 and idx.stats().repeated_stores == 2
    idx.apply(W, BlockRemoved(block_hashes=[2], group_idx=0))
    assert idx.find_matches(TOKS[:8])[W] == 1
    idx.apply(W, BlockRemoved(block_hashes=[1], group_idx=0))
    assert idx.find_matches(TOKS[:8]) == {} and idx.workers() == set()


def test_a_hybrid_reuse_report_does_not_fill_the_window() -> None:
    """vLLM reports a hit in every group from block 0, a window group's null blocks included."""
    idx = PrefixIndex()
    idx.apply(W, _full([1, 2, 3, 4], TOKS, 4))
    idx.apply(W, _window([3, 4], TOKS, 4, window=5))  # blocks 0 and 1 were null: sparse
    assert idx.find_matches([*TOKS, 0])[W] == 4
    # A prompt that diverges after block 1: the engine's window group holds neither block 0 nor 1.
    assert W not in idx.find_matches([*TOKS[:8], 0, 0, 0])
    # The report of the full hit: every group, from block 0, dense.
    idx.apply(W, _full([1, 2, 3, 4], TOKS, 4))
    idx.apply(W, _window([1, 2, 3, 4], TOKS, 4, window=5))
    assert W not in idx.find_matches([*TOKS[:8], 0, 0, 0])
    assert idx.find_matches([*TOKS, 0])[W] == 4


def test_window_rule_counts_the_blocks_before_the_hit_point() -> None:
    """cdiv(window - 1, block_size) blocks before the hit point (vLLM SlidingWindowManager)."""
    idx = PrefixIndex()
    idx.apply(W, _full([1, 2, 3, 4], TOKS, 4))
    idx.apply(W, _window([2, 3], TOKS[:12], 4, window=9))  # needs 2 blocks: [1, 3) held
    scores = idx.find_matches([*TOKS, 0])
    assert scores[W] == 3 and scores.tokens(W) == 12
    idx.apply(W, BlockRemoved(block_hashes=[2], group_idx=1))
    # Only block 2 in the window now: no 2-block run anywhere, and block 0 is not held.
    assert W not in idx.find_matches([*TOKS, 0])
    # A removal of the same hash value in group 1 never touched group 0.
    assert idx.num_blocks(W) == 5


def test_groups_of_different_block_sizes() -> None:
    """Full attention 8, window 4 (hash_block_size 4): vLLM names an 8-block by the hash at its
    last 4-token boundary (BlockHashListWithBlockSize); hits land on 8-token boundaries."""
    h = [41, 42, 43, 44]  # the 4-token hashes of TOKS
    idx = PrefixIndex()
    idx.apply(W, _full([h[1], h[3]], TOKS, 8))
    idx.apply(W, _window(h, TOKS, 4, window=5))  # dense (retention keeps every block)
    scores = idx.find_matches([*TOKS, 0])
    assert scores[W] == 2 and scores.block_size(W) == 8 and scores.tokens(W) == 16
    idx.apply(W, BlockRemoved(block_hashes=[h[3]], group_idx=1))
    # Window needs block 3 (tokens 12-16) for a hit at 16, block 1 for a hit at 8.
    scores = idx.find_matches([*TOKS, 0])
    assert scores[W] == 1 and scores.tokens(W) == 8
    # Sparse (vLLM's default retention): the hashes at 8-token boundaries are the full group's
    # and place themselves; one between two placed ones fills its gap exactly.
    other = WorkerKey("sparse", 0)
    idx.apply(other, _full([h[1], h[3]], TOKS, 8))
    idx.apply(other, _window([h[1], h[2], h[3]], TOKS, 4, window=9))  # block 0 null; 2 blocks needed
    assert idx.find_matches([*TOKS, 0]).tokens(other) == 16
    idx.apply(other, BlockRemoved(block_hashes=[h[2]], group_idx=1))
    assert idx.find_matches([*TOKS, 0]).tokens(other) == 0  # no 2-block run ends on an 8-token boundary
    # A hash just before a placed one: a gap between them would need a kept run ending on an
    # 8-token boundary, whose hash (h[1]) the full group holds and would be in the list.
    third = WorkerKey("before", 0)
    idx.apply(third, _full([h[1], h[3]], TOKS, 8))
    idx.apply(third, _window([h[2], h[3]], TOKS, 4, window=9))
    assert idx.find_matches([*TOKS, 0]).tokens(third) == 16
    assert idx.num_blocks(third) == 4


def test_unknown_group_kind_claims_nothing() -> None:
    idx = PrefixIndex()
    idx.apply(W, _full([1, 2], TOKS[:8], 4))
    idx.apply(W, BlockStored(block_hashes=[1], token_ids=TOKS[:4], block_size=4, group_idx=1,
                             kv_cache_spec_kind="cross_attention"))
    assert idx.find_matches([*TOKS[:8], 0]) == {}
    assert idx.stats().ignored_group_events == 1


def test_overlap_is_priced_in_its_own_block_size() -> None:
    """2 blocks of 16 and one unrelated block of 4,096 must not look like 2 x 4,096 cached tokens."""
    idx = PrefixIndex()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    prompt = list(range(5000))
    idx.apply(a, BlockStored(block_hashes=[1, 2], token_ids=prompt[:32], block_size=16))
    idx.apply(a, BlockStored(block_hashes=[9], token_ids=[7] * 4096, block_size=4096))
    idx.apply(b, BlockStored(block_hashes=[1, 2, 3], token_ids=prompt[:48], block_size=16))
    scores = idx.find_matches(prompt)
    assert scores[a] == 2 and scores.tokens(a) == 32 and scores.tokens(b) == 48
    decision = Router(idx, seed=1).select(prompt)
    assert decision.worker == b
    cand = {c.worker: c for c in decision.candidates}
    assert cand[a].prefill_blocks == (5000 - 32) / 16


def test_block_sizes_per_worker_are_bounded() -> None:
    """One batch of 8,191 block sizes: refused past the bound, and queries stay cheap."""
    idx = PrefixIndex(limits=IndexLimits(max_block_sizes=4))
    for bs in range(2, 8193):
        idx.apply(W, BlockStored(block_hashes=[bs], token_ids=[bs % 7] * bs, block_size=bs))
    assert idx.stats().refused_block_sizes == 8191 - 4
    assert len(idx._bs_members) == 4
    prompt = list(range(8192))
    start = time.perf_counter()
    for _ in range(10):
        idx.find_matches(prompt)
    assert (time.perf_counter() - start) / 10 < 0.01


def test_entries_per_worker_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvroute.index")
    idx = PrefixIndex(limits=IndexLimits(max_entries_per_worker=3))
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4))
    idx.apply(W, BlockStored(block_hashes=[3, 4], parent_block_hash=2, token_ids=TOKS[8:], block_size=4))
    idx.apply(W, BlockStored(block_hashes=[5, 6], parent_block_hash=2, token_ids=TOKS[8:], block_size=4))
    assert idx.num_blocks(W) == 2 and idx.stats().refused_entries == 4
    assert idx.find_matches(TOKS)[W] == 2
    assert len([r for r in caplog.records if "entry bound" in r.getMessage()]) == 1


def test_namespace_root_cache_is_bounded() -> None:
    idx = PrefixIndex(limits=IndexLimits(max_cached_roots=16))
    idx.apply(W, BlockStored(block_hashes=[1], token_ids=TOKS[:4], block_size=4, lora_name="a"))
    for i in range(1000):
        idx.find_matches(TOKS, lora_name=f"adapter-{i}")
    assert len(idx._roots) <= 16 and idx.stats().uncached_roots >= 1000 - 16
    assert idx.find_matches(TOKS, lora_name="a")[W] == 1


@pytest.mark.parametrize("bad", [{"max_block_sizes": 0}, {"max_cached_roots": -1}, {"max_entries_per_worker": True}])
def test_index_limits_are_checked(bad: dict[str, int]) -> None:
    with pytest.raises(IndexLimitsError):
        IndexLimits(**bad)


def _forge(path: Path, edit: str) -> None:
    snap = msgspec.msgpack.decode(path.read_bytes(), type=_Snapshot)
    victim = next(sw for sw in snap.workers if sw.worker_id == "bad")
    if edit == "block-size-0":
        victim.classes = [(0, 0)]
    elif edit == "short-key":
        victim.keys[0] = b"\x01\x02"
    elif edit == "dangling-special":
        victim.special.append((12345, [0, 1, 0, 0]))
    elif edit == "duplicate-hash":
        victim.hashes.append(victim.hashes[0])
        victim.keys.append(victim.keys[0])
    path.write_bytes(msgspec.msgpack.encode(snap))


@pytest.mark.parametrize("edit", ["block-size-0", "short-key", "dangling-special", "duplicate-hash"])
def test_a_forged_worker_is_dropped_not_the_index(tmp_path: Path, edit: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvroute.index")
    idx = PrefixIndex()
    good, bad = WorkerKey("good", 0), WorkerKey("bad", 0)
    for w in (good, bad):
        idx.apply(w, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4))
    path = tmp_path / "index.kvs"

    idx.snapshot(path, cursors={good: Cursor(5, 1.0), bad: Cursor(7, 1.0)})
    _forge(path, edit)
    restored = PrefixIndex.restore(path)
    assert restored.find_matches([*TOKS[:8], 0]) == {good: 2}
    assert set(restored.restored_cursors) == {good}
    assert any("bad/0 dropped" in r.getMessage() for r in caplog.records)


def test_an_old_hash_version_snapshot_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "old.kvs"
    path.write_bytes(msgspec.msgpack.encode(
        {"format": "kvroute-index", "version": 1, "hash_version": 1, "created": 0.0, "workers": [], "cursors": []}
    ))
    with pytest.raises(SnapshotError, match="content hash v1"):
        PrefixIndex.restore(path)


def test_snapshot_round_trip_keeps_groups_and_lookahead(tmp_path: Path) -> None:
    idx = PrefixIndex()
    idx.apply(W, _full([1, 2, 3, 4], TOKS, 4))
    idx.apply(W, _window([3, 4], TOKS, 4, window=5))
    la = WorkerKey("la", 0)
    idx.apply(la, BlockStored(block_hashes=[1], token_ids=TOKS[:4], block_size=4, lookahead_token_ids=[[5]]))
    path = tmp_path / "index.kvs"
    idx.snapshot(path)
    restored = PrefixIndex.restore(path)
    for q in ([*TOKS, 0], [*TOKS[:8], 0, 0, 0], TOKS[:5], [*TOKS[:4], 9]):
        a, b = idx.find_matches(q), restored.find_matches(q)
        assert dict(a) == dict(b) and all(a.tokens(w) == b.tokens(w) for w in a), q
    assert restored.num_blocks(W) == idx.num_blocks(W)


@pytest.mark.anyio
async def test_an_unreadable_removal_resets_the_worker() -> None:
    """The rest of the batch decodes, but the worker's state can no longer be trusted: reset, partial."""
    async with EventPublisher() as pub:
        src = pub.source("w")
        async with KvEventClient([src], config=FAST) as client:
            stream = client.events()
            await client.wait_synced(10)
            pub.publish([BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4)])
            await settle(client, stream, {src.key: 0})
            assert client.index.find_matches([*TOKS[:8], 0])[src.key] == 2
            # A float hash: the event cannot be read; the publisher replays the same bytes.
            bad = BlockRemoved(block_hashes=[1.5])  # type: ignore[list-item]
            pub.publish([BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=TOKS[8:12], block_size=4), bad])
            pub.publish([BlockStored(block_hashes=[9], token_ids=TOKS[8:12], block_size=4)])
            await settle(client, stream, {src.key: 2})
            st = client.stats().sources[src.key]
            assert st.resets == 1 and st.partial
            scores = client.index.find_matches(TOKS[:8])
            assert src.key not in scores  # what was held before the bad batch is gone
            assert client.index.find_matches([*TOKS[8:12], 0])[src.key] == 1


def test_sink_full_attention_is_full_attention() -> None:
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4, group_idx=0,
                             kv_cache_spec_kind="sink_full_attention"))
    assert idx.find_matches([*TOKS[:8], 0])[W] == 2


def test_multimodal_items_with_lookahead_key_the_window_past_the_block() -> None:
    """With lookahead hashing vLLM keys a block with the items overlapping it *or its lookahead tokens*."""
    from kvroute import MultimodalItem
    from kvroute._hashing import mm_extras

    item = MultimodalItem("img", 4, 2)  # tokens 4-5: past block 0 (0-3), inside its 1-token lookahead
    assert mm_extras([item], 4, 0, 2) == [None, [["img", 0]]]
    assert mm_extras([item], 4, 0, 2, lookahead=1) == [[["img", 4]], [["img", 0]]]
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1], token_ids=TOKS[:4], block_size=4, lookahead_token_ids=[[5]],
                             extra_keys=[[["img", 4]]]))
    assert idx.find_matches(TOKS[:6], mm_items=[item])[W] == 1
    assert W not in idx.find_matches(TOKS[:6])


def test_mamba_checkpoints_in_smaller_blocks_than_full_attention() -> None:
    """A state checkpoint's hash at a full-block boundary is the full group's: it places itself."""
    h = [41, 42, 43, 44]
    idx = PrefixIndex()
    idx.apply(W, _full([h[1], h[3]], TOKS, 8))
    idx.apply(W, BlockStored(block_hashes=[h[1]], token_ids=[], block_size=4, group_idx=1, kv_cache_spec_kind="mamba"))
    assert idx.find_matches([*TOKS, 0]).tokens(W) == 8
    idx.apply(W, BlockStored(block_hashes=[h[3]], token_ids=[], block_size=4, group_idx=1, kv_cache_spec_kind="mamba"))
    assert idx.find_matches([*TOKS, 0]).tokens(W) == 16


def test_a_store_with_a_parent_is_a_real_copy() -> None:
    """vLLM's reuse reports (BlockPool.emit_cached_block_events) always start at block 0 with no
    parent; a store that names a parent is a new cache entry, and each entry gets its own
    BlockRemoved. The shape of vLLM's evicting run (2 requests in chunked prefill on one prefix):
    the second request's chunk stores block 4 again under block 3, the pool later evicts each copy."""
    toks = list(range(1, 21))
    idx = PrefixIndex()
    idx.apply(W, _full([1, 2], toks[:8], 4))
    idx.apply(W, _full([3, 4, 5], toks[8:20], 4, parent=2))
    idx.apply(W, _full([5], toks[16:20], 4, parent=4))  # the concurrent request's copy
    assert idx.num_blocks(W) == 5 and idx.stats().repeated_stores == 0
    idx.apply(W, BlockRemoved(block_hashes=[5], group_idx=0))
    assert idx.find_matches([*toks, 0])[W] == 5  # one copy left in the engine
    idx.apply(W, BlockRemoved(block_hashes=[5], group_idx=0))
    assert idx.find_matches([*toks, 0])[W] == 4
    # From block 0 (a report or a copy: the wire cannot tell), a repeat counts once.
    idx.apply(W, _full([1, 2], toks[:8], 4))
    idx.apply(W, BlockRemoved(block_hashes=[1], group_idx=0))
    assert W not in idx.find_matches(toks)
    # The same in a window group: a copy under a parent needs its own removal.
    hy = WorkerKey("hybrid", 0)
    idx.apply(hy, _full([1, 2, 3], toks[:12], 4))
    idx.apply(hy, _window([1, 2, 3], toks[:12], 4, window=5))
    idx.apply(hy, _window([3], toks[8:12], 4, window=5, parent=2))
    idx.apply(hy, BlockRemoved(block_hashes=[3], group_idx=1))
    assert idx.find_matches([*toks[:12], 0]).tokens(hy) == 12
    idx.apply(hy, BlockRemoved(block_hashes=[3], group_idx=1))
    assert idx.find_matches([*toks[:12], 0]).tokens(hy) == 8  # a run from block 0


# vLLM 0.33 mixed block sizes (full attention 32, window 64 in blocks of 16, hash_block_size 16):
# the hashes of a prompt at 16 and 32 tokens, as the engine published them.
_H16, _H32 = 10263331205468525389, 16982933130722732143
_T32 = list(range(100, 132))


def _mixed_first_chunk(idx: PrefixIndex, w: WorkerKey, window_hashes: list[int]) -> None:
    """One request's first 32 tokens: the full group's block, its partial entry at the prompt's
    last 16-token boundary (cache_partial_block), the window group's blocks."""
    idx.apply(w, _full([_H32], _T32, 32))
    idx.apply(w, _full([_H16], _T32[:16], 16))
    idx.apply(w, _window(window_hashes, _T32, 16, window=64))


def test_a_window_store_over_held_content_keeps_the_blocks_a_hit_uses() -> None:
    """A window group's dense store from block 0 of content the full group already holds is a reuse
    report or a real recompute (after a window miss); the wire cannot tell. A report lists the blocks
    the engine nulled before its hit, but the last cdiv(window - 1, block) blocks of either are held
    (vLLM run r19: the engine served 32 tokens, kvroute dropped the whole store and claimed 0)."""
    idx = PrefixIndex()
    _mixed_first_chunk(idx, W, [])  # sparse retention: no window block was reachable then
    prompt = [*_T32, *range(500, 542)]  # 74 tokens
    assert W not in idx.find_matches(prompt)
    # A later request recomputes the same 32 tokens; its window blocks are now reachable.
    idx.apply(W, _full([_H32], _T32, 32))
    idx.apply(W, _window([_H16, _H32], _T32, 16, window=64))
    assert idx.find_matches(prompt).tokens(W) == 32
    # A long report still keeps only its tail: the blocks a hit of the window group needs.
    toks = list(range(1, 21))
    other = WorkerKey("report", 0)
    idx.apply(other, _full([1, 2, 3, 4, 5], toks, 4))
    idx.apply(other, _window([4, 5], toks, 4, window=5, parent=3))
    idx.apply(other, _full([1, 2, 3, 4, 5], toks, 4))
    idx.apply(other, _window([1, 2, 3, 4, 5], toks, 4, window=5))  # blocks 0-3 were null
    assert other not in idx.find_matches([*toks[:8], 0, 0, 0])


def test_a_partial_entry_is_not_a_hit_below_the_scheduler_block() -> None:
    """vLLM hits a hybrid prefix on scheduler-block boundaries (the LCM of the groups' block sizes)
    unless Mamba "align" mode enables partial hash hits: the full group's partial entry at 16 tokens
    serves nothing under a 32-token block (vLLM run r44, a 24-token prompt: the engine found 0)."""
    idx = PrefixIndex()
    _mixed_first_chunk(idx, W, [_H16, _H32])
    assert W not in idx.find_matches(_T32[:24])
    assert idx.find_matches([*_T32, 0]).tokens(W) == 32


def test_a_sparse_window_store_proves_the_full_groups_store_real() -> None:
    """A window group's store from block 0 with fewer blocks than its tokens skipped null or
    unreachable blocks: only BlockPool.cache_full_blocks does that (a reuse report lists every
    block), so the full group's store of the same tokens just before it, from the same
    cache_blocks call, made new copies. vLLM run (mixed sizes, default retention): two requests
    each computed the first 32 tokens; the pool evicted one copy of the 32-token block."""
    idx = PrefixIndex()
    _mixed_first_chunk(idx, W, [])
    _mixed_first_chunk(idx, W, [])  # the second copy (the partial entry comes in between)
    idx.apply(W, BlockRemoved(block_hashes=[_H32], group_idx=0))
    idx.apply(W, _window([_H16, _H32], _T32, 16, window=64))
    assert idx.find_matches([*_T32, *range(500, 542)]).tokens(W) == 32
    # A report (dense in every group) stays one copy.
    rep = WorkerKey("report", 0)
    _mixed_first_chunk(idx, rep, [_H16, _H32])
    idx.apply(rep, _full([_H32], _T32, 32))
    idx.apply(rep, _window([_H16, _H32], _T32, 16, window=64))
    idx.apply(rep, BlockRemoved(block_hashes=[_H32], group_idx=0))
    assert rep not in idx.find_matches([*_T32, 0])


def test_sparse_window_hashes_before_a_known_boundary_are_placed() -> None:
    """vLLM run r26 (full attention 32, window 64 in blocks of 16, default retention): the second
    chunk's window store keeps the 4 blocks before the 192-token replay boundary, [144, 160, 176,
    192] by end token; 160 and 192 are the full group's hashes too. The unknown hash before 160 is
    at 144 (a gap would need a run ending on a 32-token boundary the index does not know); the
    engine served 192 tokens of a 228-token prompt, kvroute had claimed 0."""
    toks = list(range(1000, 1228))
    h = {t: 9000 + t for t in range(16, 240, 16)}  # the engine's hash at each 16-token boundary
    idx = PrefixIndex()
    for w in (W, WorkerKey("unknown-boundary", 0)):
        idx.apply(w, _full([h[32], h[64], h[96]], toks[:96], 32))
        idx.apply(w, _window([], toks[:96], 16, window=64))
        idx.apply(w, _full([h[128], h[160], h[192]], toks[96:192], 32, parent=h[96]))
    assert idx.find_matches(toks).tokens(W) == 0  # no window block yet
    # The other worker's full group lost its 160 block: 144 could then be at 112 or 128.
    other = WorkerKey("unknown-boundary", 0)
    idx.apply(other, BlockRemoved(block_hashes=[h[160]], group_idx=0))
    for w in (W, other):
        idx.apply(w, _window([h[144], h[160], h[176], h[192]], toks[96:192], 16, window=64, parent=h[96]))
    scores = idx.find_matches(toks)
    assert scores.tokens(W) == 192
    assert idx.num_blocks(other) == 9 and other not in scores
