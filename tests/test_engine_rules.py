"""Two engine rules every worker follows: the last-token cap and what a repeated store from block 0 is.

- vLLM (`Request.get_max_cache_hit_length`) and SGLang (`Req._compute_max_prefix_len`) serve at most a
  prompt's first ``num_tokens - 1`` tokens from cache, in whole blocks: a worker holding a whole
  block-aligned prompt is credited one block less, plain or hybrid.
- `PrefixIndex.reuse_reports`: vLLM publishes a reuse report (a request sent with ``kv_cache_report_mode
  "full"``) as a store from block 0 with no parent, which adds no cache entry; every other store is a new
  entry. While reports may come (the default) a repeat from block 0 counts once; told that none come, the
  index counts it as the GPU copy it then is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute import BlockRemoved, BlockStored, ConfigError, EventSource, KvEventClient, PrefixIndex, WorkerKey

W = WorkerKey("w", 0)
TOKS = list(range(100, 116))


def _full(hashes: list[int], tokens: list[int], bs: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                       group_idx=0, kv_cache_spec_kind="full_attention")


def _window(hashes: list[int], tokens: list[int], bs: int, window: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, token_ids=tokens, block_size=bs, group_idx=1,
                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window)


# --- the last-token cap ------------------------------------------------------------------------


def test_a_plain_worker_holding_a_whole_aligned_prompt_is_credited_one_block_less() -> None:
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1, 2, 3, 4], token_ids=TOKS, block_size=4))
    assert idx.find_matches(TOKS)[W] == 3  # the engine recomputes the last block for the last token
    assert idx.find_matches(TOKS).tokens(W) == 12
    assert idx.find_matches([*TOKS, 7])[W] == 4
    assert idx.find_matches(TOKS[:15])[W] == 3
    assert W not in idx.find_matches(TOKS[:4])  # one block: nothing served from cache
    assert W not in idx.find_matches(TOKS[:1]) and idx.find_matches([]) == {}


def test_the_cap_is_the_same_for_plain_and_hybrid_workers() -> None:
    plain, hybrid = WorkerKey("plain", 0), WorkerKey("hybrid", 0)
    idx = PrefixIndex()
    idx.apply(plain, BlockStored(block_hashes=[1, 2, 3, 4], token_ids=TOKS, block_size=4))
    idx.apply(hybrid, _full([1, 2, 3, 4], TOKS, 4))
    idx.apply(hybrid, _window([1, 2, 3, 4], TOKS, 4, window=4))
    for k in range(len(TOKS) + 2):
        q = [*TOKS, 7][:k]
        scores = idx.find_matches(q)
        assert scores.get(plain) == scores.get(hybrid), k


def test_a_lookahead_worker_keeps_its_own_tighter_bound() -> None:
    """vLLM hashes a block with lookahead only once the tokens after it exist: that bound already
    leaves the last token out, so the cap changes nothing for it."""
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4,
                             lookahead_token_ids=[[TOKS[4]], [TOKS[8]]]))
    assert idx.find_matches(TOKS[:9])[W] == 2
    assert idx.find_matches(TOKS[:8])[W] == 1


def test_off_gpu_tiers_are_capped_with_the_rest() -> None:
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4))
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=[], block_size=0, medium="CPU"))
    assert idx.find_matches(TOKS[:8]).tier("CPU") == {W: 1}
    assert idx.find_matches(TOKS[:9]).tier("CPU") == {W: 2}


# --- reuse reports -----------------------------------------------------------------------------


def test_by_default_a_repeat_from_block_0_counts_once() -> None:
    idx = PrefixIndex()
    assert idx.reuse_reports is True
    store = BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4)
    idx.apply(W, store)
    idx.apply(W, store)  # a reuse report, or a recompute: the wire cannot tell
    assert idx.stats().repeated_stores == 2
    idx.apply(W, BlockRemoved(block_hashes=[1, 2]))
    assert idx.find_matches([*TOKS[:8], 0]) == {}  # never more than the engine holds


def test_without_reports_a_repeat_from_block_0_is_one_more_copy() -> None:
    idx = PrefixIndex(reuse_reports=False)
    store = BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4)
    idx.apply(W, store)
    idx.apply(W, store)  # a real recompute: the engine holds two cache entries of each block
    assert idx.stats().repeated_stores == 0 and idx.num_blocks(W) == 2
    idx.apply(W, BlockRemoved(block_hashes=[1, 2]))
    assert idx.find_matches([*TOKS[:8], 0])[W] == 2  # one copy left in the engine
    idx.apply(W, BlockRemoved(block_hashes=[1, 2]))
    assert idx.find_matches([*TOKS[:8], 0]) == {} and idx.workers() == set()


def test_without_reports_a_dense_window_store_from_block_0_keeps_every_block() -> None:
    """vLLM's recompute after a window miss: the full group stores the blocks it holds again and the
    window group stores them all (dense retention). By default only the blocks a hit would use are
    kept (a report lists the window's null blocks too); told there are no reports, each is real."""
    toks = list(range(100, 132))  # 8 blocks of 4
    hashes = list(range(1, 9))
    for rr, kept in ((True, 2), (False, 8)):
        idx = PrefixIndex(reuse_reports=rr)
        idx.apply(W, _full(hashes, toks, 4))
        idx.apply(W, _window(hashes[-2:], toks, 4, window=8))  # sparse: the last cdiv(7, 4) blocks
        idx.apply(W, _full(hashes, toks, 4))
        idx.apply(W, _window(hashes, toks, 4, window=8))
        # Evict the first store's window blocks: what is left is the second store's.
        idx.apply(W, BlockRemoved(block_hashes=hashes[-2:], group_idx=1))
        query = [*toks[:16], 0]  # a hit at block 4 needs window blocks 2 and 3
        assert idx.find_matches(query).get(W, 0) == (4 if kept == 8 else 0), rr


def test_the_setting_can_be_given_to_the_client_and_is_checked() -> None:
    src = EventSource(worker_id="w", endpoint="tcp://127.0.0.1:1", engine="static")
    assert KvEventClient([src], reuse_reports=False).index.reuse_reports is False
    assert KvEventClient([src]).index.reuse_reports is True
    given = PrefixIndex(reuse_reports=False)
    assert KvEventClient([src], index=given).index.reuse_reports is False  # None: the index's own
    assert KvEventClient([src], index=given, reuse_reports=True).index is given and given.reuse_reports
    with pytest.raises(ConfigError, match="reuse_reports"):
        PrefixIndex(reuse_reports=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reuse_reports"):
        KvEventClient([src], reuse_reports="no")  # type: ignore[arg-type]


def test_restore_takes_the_setting(tmp_path: Path) -> None:
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4))
    idx.snapshot(tmp_path / "s.kvs")
    restored = PrefixIndex.restore(tmp_path / "s.kvs", reuse_reports=False)
    assert restored.reuse_reports is False
    restored.apply(W, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=4))
    restored.apply(W, BlockRemoved(block_hashes=[1, 2]))
    assert restored.find_matches([*TOKS[:8], 0])[W] == 2
