"""The compiled core against its executable reference, on generated inputs.

- Content keys: `kvroute._core.block_keys` / `root_key` equal `kvroute._hashing`'s byte for byte
  (tokens, extras encoded as msgspec encodes them, lookahead).
- The index: `kvroute.PrefixIndex` (Rust) and tests/reference's pure-Python index are fed the same
  generated event streams — every production shape: KV-cache groups (full, sliding window with
  sparse stores, mamba checkpoints, unknown kinds), namespaces (adapter, salt the vLLM and the
  SGLang way, multimodal extras, lookahead, SGLang EAGLE bigram stores), tiers and placeholders,
  REMOTE, copies and reuse reports, unknown parents, duplicate hashes, IndexLimits, removals, clears, worker removal,
  snapshot and restore (each restoring the other's file) — and must give identical answers:
  per-worker counts in order, tokens(), block_size(), every tier(), and identical stats().
"""

from __future__ import annotations

import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference._index import IndexLimits as RefLimits
from reference._index import PrefixIndex as RefIndex

from kvroute import _core
from kvroute._hashing import MultimodalItem, block_keys, mm_extras, root_key, tokens_to_bytes
from kvroute._index import IndexLimits, PrefixIndex, QueryError
from kvroute._models import TIERS, WorkerKey
from kvroute._snapshot import Cursor
from kvroute._wire import AllBlocksCleared, BlockRemoved, BlockStored

# --- content keys ---------------------------------------------------------------------------------

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    parent=st.binary(min_size=16, max_size=16),
    bs=st.integers(1, 8),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    extras=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(_value, max_size=4)), max_size=10)),
    la=st.integers(0, 3),
)
def test_block_keys_equal_the_python_definition(
    parent: bytes, bs: int, tokens: list[int], extras: list[list[Any] | None] | None, la: int
) -> None:
    n = len(tokens) // bs
    rows = [tokens[i : i + la] for i in range(n)] if la else None
    want = block_keys(
        parent, tokens_to_bytes(tokens), bs, n, extras, [tokens_to_bytes(r) for r in rows] if rows is not None else None
    )
    assert _core.block_keys(parent, tokens, bs, n, extras, rows) == want


@given(lora=st.one_of(st.none(), st.text(max_size=20)), salt=st.one_of(st.none(), st.text(max_size=20)))
def test_root_keys_equal_the_python_definition(lora: str | None, salt: str | None) -> None:
    assert _core.root_key(lora, salt) == root_key(lora, salt)


def test_big_floats_and_nested_maps_encode_alike() -> None:
    extras: list[list[Any] | None] = [[1.5, float("inf"), {"a": [b"x", None]}, True, -33, 2**63], None, []]
    root = root_key(None)
    tokens = list(range(6))
    assert _core.block_keys(root, tokens, 2, 3, extras, None) == block_keys(root, tokens_to_bytes(tokens), 2, 3, extras)


# --- the index ------------------------------------------------------------------------------------

W = [WorkerKey(f"w{i}", 0) for i in range(4)]
PROMPTS = st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=20), min_size=1, max_size=3)
MEDIA = [None, None, None, "CPU", "cpu_pinned", "DISK", "STORAGE", "weird"]
# (adapter, salt, multimodal items), the plain namespace most often so that queries find blocks.
NAMESPACES: list[tuple[str | None, str | None, tuple[MultimodalItem, ...]]] = [
    (None, None, ()),
    (None, None, ()),
    (None, None, ()),
    ("ad", None, ()),
    (None, "s1", ()),
    ("ad", "s2", ()),
    (None, None, (MultimodalItem("img", 2, 3),)),
    ("ad", None, (MultimodalItem("img", 0, 8),)),
]
KINDS = [
    ("full_attention", None),
    ("sliding_window", 3),
    ("sliding_window", 5),
    ("sliding_window", None),
    ("mamba", None),
    ("chunked_local", None),
]


class _Hashes:
    """Engine hashes: one per (variant, prefix) as an engine names it, ints or bytes."""

    def __init__(self) -> None:
        self.names: dict[tuple[Any, ...], int | bytes] = {}

    def of(self, variant: int, ident: tuple[Any, ...]) -> int | bytes:
        key = (variant, *ident)
        got = self.names.get(key)
        if got is None:
            n = len(self.names) + 1
            got = self.names[key] = n.to_bytes(4, "big") if variant == 2 else (2**64 - n if variant == 1 else n)
        return got


def _store(draw: Any, hashes: _Hashes, prompts: list[list[int]]) -> BlockStored:
    tokens_all = draw(st.sampled_from(prompts))
    bs = draw(st.sampled_from([2, 2, 4, 1]))
    la = draw(st.sampled_from([0, 0, 0, 1]))
    nblocks = (len(tokens_all) - la) // bs
    if nblocks < 1:
        nblocks = 1
        tokens_all = tokens_all + [0] * (bs + la)
    start = draw(st.one_of(st.just(0), st.integers(0, nblocks - 1)))
    n = draw(st.integers(1, nblocks - start))
    lora, salt, mm = draw(st.sampled_from(NAMESPACES))
    style = draw(st.sampled_from(["vllm", "sglang"]))
    variant = draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
    ident = (lora, salt, tuple(mm), la)

    def h(i: int) -> int | bytes:
        return hashes.of(variant, (*ident, bs, tuple(tokens_all[: (i + 1) * bs])))

    parent_mode = draw(st.sampled_from(["natural", "natural", "none", "unknown"]))
    if start == 0 or parent_mode == "none":
        parent = None
    elif parent_mode == "unknown":
        parent = hashes.of(9, (draw(st.integers(0, 3)),))
    else:
        parent = h(start - 1)
    toks = tokens_all[start * bs : (start + n) * bs]
    block_hashes = [h(i) for i in range(start, start + n)]
    group = draw(st.sampled_from([None, None, None, 0, 1, 2]))
    kind, window = (None, None)
    gbs = bs
    if group is not None:
        kind, window = draw(st.sampled_from(KINDS)) if group else ("full_attention", None)
    lookahead = [tokens_all[(i + 1) * bs : (i + 1) * bs + la] for i in range(start, start + n)] if la else None
    extras: list[list[Any] | None] | None = None
    per_block = mm_extras(mm, bs, start, start + n, la) if mm else None
    if style == "vllm" and (lora or (salt and parent is None) or per_block):
        extras = []
        for j in range(n):
            ek: list[Any] = []
            if lora:
                ek.append(lora)
            if j == 0 and parent is None and salt:
                ek.append(salt)
            if per_block and per_block[j]:
                ek.extend(per_block[j])  # type: ignore[union-attr]
            extras.append(ek or None)
    shape = draw(st.sampled_from(["dense", "dense", "dense", "sparse", "placeholder", "short", "dup", "remote"]))
    medium = draw(st.sampled_from(MEDIA))
    kw: dict[str, Any] = {
        "block_hashes": block_hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": gbs,
        "medium": medium,
        "lora_name": lora,
        "extra_keys": extras,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": window,
        "lookahead_token_ids": lookahead,
    }
    if style == "sglang":
        kw["cache_salt"] = salt
        # EAGLE: the store came as [token, next_token] cells (one lookahead token per page)
        kw["bigram"] = la == 1 and draw(st.booleans())
    if shape == "sparse" and group and n > 1 and kind != "full_attention":
        skip = draw(st.integers(1, n - 1))
        kw["block_hashes"] = block_hashes[skip:]
        if extras is not None:
            kw["extra_keys"] = extras[skip:]
        if lookahead is not None:
            kw["lookahead_token_ids"] = lookahead[skip:]
    elif shape == "placeholder":
        kw.update(token_ids=[], block_size=0, extra_keys=None, lookahead_token_ids=None, kv_cache_spec_kind=None)
        if draw(st.booleans()):
            kw["group_idx"] = None
    elif shape == "short" and group is None and la == 0 and bs > 1 and extras is None:
        kw["token_ids"] = toks[: len(toks) - 1]  # SGLang's short last page
    elif shape == "dup" and n > 1:
        kw["block_hashes"] = [block_hashes[0]] * n
    elif shape == "remote":
        kw["locality"] = draw(st.sampled_from(["REMOTE", "remote", "LOCAL"]))
    if group is not None and kind == "mamba" and draw(st.booleans()):
        kw.update(token_ids=[], block_hashes=kw["block_hashes"][-1:], extra_keys=None, lookahead_token_ids=None)
    return BlockStored(**kw)


OPS = ["store"] * 8 + ["repeat"] * 3 + ["remove"] * 3 + ["query"] * 3 + ["clear", "drop", "snapshot"]


@st.composite
def _streams(draw: Any) -> tuple[list[list[int]], list[tuple[Any, ...]]]:
    prompts = draw(PROMPTS)
    hashes = _Hashes()
    ops: list[tuple[Any, ...]] = []
    held: dict[WorkerKey, list[tuple[list[int | bytes], int | None]]] = {w: [] for w in W}
    for _ in range(draw(st.integers(1, 40))):
        w = draw(st.sampled_from(W))
        kind = draw(st.sampled_from(OPS))
        stores = [op for op in ops if op[0] == "apply" and isinstance(op[2], BlockStored)]
        if kind == "repeat" and stores:
            # The same store again: a copy (it names a parent) or a reuse report (from block 0).
            _, was, ev = draw(st.sampled_from(stores))
            w = draw(st.sampled_from([was, was, w]))
            held[w].append((list(ev.block_hashes), ev.group_idx))
            ops.append(("apply", w, ev))
        elif kind in ("store", "repeat"):
            ev = _store(draw, hashes, prompts)
            held[w].append((list(ev.block_hashes), ev.group_idx))
            ops.append(("apply", w, ev))
        elif kind == "remove":
            if held[w] and draw(st.booleans()):
                got, group = draw(st.sampled_from(held[w]))
                chosen = draw(st.lists(st.sampled_from(got), min_size=1, max_size=4))
            else:
                chosen, group = [hashes.of(0, (draw(st.integers(0, 5)),))], None
            group = draw(st.sampled_from([group, group, None, 1]))
            medium = draw(st.sampled_from(MEDIA))
            locality = draw(st.sampled_from([None, None, None, "REMOTE"]))
            ev = BlockRemoved(block_hashes=chosen, medium=medium, group_idx=group, locality=locality)
            ops.append(("apply", w, ev))
        elif kind == "clear":
            ops.append(("apply", w, AllBlocksCleared()))
        elif kind == "drop":
            ops.append(("drop", w))
        elif kind == "snapshot":
            ops.append(("snapshot",))
        else:
            base = draw(st.sampled_from(prompts))
            cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
            tail = draw(st.lists(st.integers(0, 3), max_size=6))
            lora, salt, mm = draw(st.sampled_from(NAMESPACES))
            ops.append(("query", base[:cut] + tail, lora, salt, mm))
    return prompts, ops


def _answers(idx: Any, tokens: list[int], lora: str | None, salt: str | None, mm: Any) -> dict[str, Any]:
    s = idx.find_matches(tokens, lora_name=lora, cache_salt=salt, mm_items=mm)
    return {
        "scores": list(s.items()),
        "tokens": {w: s.tokens(w) for w in s},
        "block_size": {w: s.block_size(w) for w in s},
        "tiers": {t: dict(s.tier(t)) for t in TIERS},
        "query_blocks": {w: s.query_blocks(w) for w in W},
    }


def _state(idx: Any) -> dict[str, Any]:
    return {
        "stats": msgspec.structs.asdict(idx.stats()),
        "workers": idx.workers(),
        "num_blocks": [idx.num_blocks(w) for w in W] + [idx.num_blocks()],
        "block_size": [idx.block_size(w) for w in W],
    }


def _check(ref: Any, new: Any, queries: list[tuple[Any, ...]], *, ordered: bool = True) -> None:
    assert _state(new) == _state(ref)
    for q in queries:
        got, want = _answers(new, *q), _answers(ref, *q)
        if not ordered:
            got["scores"], want["scores"] = dict(got["scores"]), dict(want["scores"])
        assert got == want, q


def _run(
    prompts: list[list[int]], ops: list[tuple[Any, ...]], limits: dict[str, int], reuse_reports: bool = True
) -> None:
    rr = reuse_reports
    ref = RefIndex(limits=RefLimits(**limits), reuse_reports=rr)
    new = PrefixIndex(limits=IndexLimits(**limits), reuse_reports=rr)
    queries = [(p, None, None, ()) for p in prompts]
    ordered = True
    with tempfile.TemporaryDirectory() as tmp:
        for op in ops:
            if op[0] == "apply":
                ref.apply(op[1], op[2])
                new.apply(op[1], op[2])
            elif op[0] == "drop":
                ref.remove_worker(op[1])
                new.remove_worker(op[1])
            elif op[0] == "query":
                queries.append(op[1:])
                _check(ref, new, [op[1:]], ordered=ordered)
            else:
                cursors = {W[0]: Cursor(3, 1.5)}
                ref.snapshot(Path(tmp) / "ref.kvs", cursors=cursors)
                new.snapshot(Path(tmp) / "new.kvs", cursors=cursors)
                # Each restores the other's file (the format is shared), and its own.
                a = PrefixIndex.restore(Path(tmp) / "ref.kvs", limits=IndexLimits(**limits), reuse_reports=rr)
                b = RefIndex.restore(Path(tmp) / "new.kvs", limits=RefLimits(**limits))
                b.reuse_reports = rr
                _check(b, a, queries, ordered=False)
                assert a.restored_cursors == b.restored_cursors
                ref = RefIndex.restore(Path(tmp) / "ref.kvs", limits=RefLimits(**limits))
                ref.reuse_reports = rr
                new = PrefixIndex.restore(Path(tmp) / "ref.kvs", limits=IndexLimits(**limits), reuse_reports=rr)
        _check(ref, new, queries, ordered=ordered)


_LIMITS = st.sampled_from(
    [
        {},
        {},
        {"max_block_sizes": 1, "max_entries_per_worker": 6, "max_groups_per_worker": 1, "max_cached_roots": 2},
        {"max_block_sizes": 2, "max_entries_per_worker": 12},
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream=_streams(), limits=_LIMITS)
def test_event_streams_give_identical_answers_and_stats(
    stream: tuple[list[list[int]], list[tuple[Any, ...]]], limits: dict[str, int]
) -> None:
    _run(*stream, limits)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream=_streams(), limits=_LIMITS)
def test_event_streams_without_reuse_reports_give_identical_answers_and_stats(
    stream: tuple[list[list[int]], list[tuple[Any, ...]]], limits: dict[str, int]
) -> None:
    """Told that no reuse reports come (every repeat from block 0 is a copy), both indexes agree too."""
    _run(*stream, limits, reuse_reports=False)


def _hybrid_session(bs_full: int, bs_window: int, window: int, repeats: int) -> list[BlockStored]:
    """vLLM's hybrid coordinator's stores for a multi-turn session: the full group's chain, then the
    window group's sparse store (null blocks skipped), and reuse reports from block 0."""
    tokens = [i % 7 for i in range(8 * bs_full)]
    out: list[BlockStored] = []
    names: dict[tuple[int, int], int] = {}

    def h(bs: int, end: int) -> int:
        return names.setdefault((bs, end), 10_000 + len(names))

    for turn in range(1, 1 + repeats):
        if turn > 1:
            # A prefix-cache hit reported from block 0 in every group (kv_cache_report_mode "full"),
            # the window group's null blocks included; the hit is a shorter prefix than the last turn's.
            upto = min(len(tokens), turn * bs_full)
            out.append(BlockStored(block_hashes=[h(bs_full, (i + 1) * bs_full) for i in range(upto // bs_full)],
                                   token_ids=tokens[:upto], block_size=bs_full, group_idx=0,
                                   kv_cache_spec_kind="full_attention"))
            out.append(BlockStored(block_hashes=[h(bs_window, (i + 1) * bs_window) for i in range(upto // bs_window)],
                                   token_ids=tokens[:upto], block_size=bs_window, group_idx=1,
                                   kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window))
        upto = min(len(tokens), (turn + 2) * bs_full)
        full = [h(bs_full, (i + 1) * bs_full) for i in range(upto // bs_full)]
        out.append(BlockStored(block_hashes=full, token_ids=tokens[:upto], block_size=bs_full, group_idx=0,
                               kv_cache_spec_kind="full_attention"))
        win = [h(bs_window, (i + 1) * bs_window) for i in range(upto // bs_window)]
        keep = max(1, -(-(window - 1) // bs_window))
        out.append(BlockStored(block_hashes=win[-keep:], token_ids=tokens[:upto], block_size=bs_window, group_idx=1,
                               kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window))
    return out


@pytest.mark.parametrize(("bs_full", "bs_window", "window"), [(4, 4, 5), (8, 4, 9), (8, 2, 3), (4, 4, 128)])
@pytest.mark.parametrize("reuse_reports", [True, False])
def test_hybrid_sessions_give_identical_answers(bs_full: int, bs_window: int, window: int, reuse_reports: bool) -> None:
    ref, new = RefIndex(reuse_reports=reuse_reports), PrefixIndex(reuse_reports=reuse_reports)
    w = W[0]
    for ev in _hybrid_session(bs_full, bs_window, window, 5):
        ref.apply(w, ev)
        new.apply(w, ev)
    tokens = [i % 7 for i in range(8 * bs_full)]
    queries = [(tokens[:k], None, None, ()) for k in range(len(tokens) + 1)]
    _check(ref, new, queries)


@pytest.mark.parametrize("reuse_reports", [True, False])
def test_copies_and_removals_give_identical_answers(reuse_reports: bool) -> None:
    """A store naming a parent is a new copy each time; each removal drops one copy."""
    ref, new = RefIndex(reuse_reports=reuse_reports), PrefixIndex(reuse_reports=reuse_reports)
    w = W[0]
    tokens = [1, 2, 3, 4, 5, 6]
    events: list[Any] = [BlockStored(block_hashes=[1, 2], token_ids=tokens[:4], block_size=2)]
    events += [BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[4:], block_size=2)] * 3
    events += [BlockStored(block_hashes=[1, 2], token_ids=tokens[:4], block_size=2)] * 2  # reports: counted once
    queries = [(tokens, None, None, ())]
    for ev in events:
        ref.apply(w, ev)
        new.apply(w, ev)
        _check(ref, new, queries)
    for hashes in ([3], [3], [1], [3], [3], [2], [1]):
        ev = BlockRemoved(block_hashes=hashes)
        ref.apply(w, ev)
        new.apply(w, ev)
        _check(ref, new, queries)


@pytest.mark.parametrize(
    ("bad", "where"),
    [(["x"], "token_ids[0]"), ([1, -1], "token_ids[1]"), ([1, 2, 2**32], "token_ids[2]"), ([1.0], "token_ids[0]")],
)
def test_a_bad_token_is_a_typed_error_naming_its_position(bad: list[Any], where: str) -> None:
    idx = PrefixIndex()
    with pytest.raises(QueryError, match=re.escape(where)):
        idx.find_matches(bad)


@pytest.mark.parametrize("bad", ["hello world", b"\x01\x02", 7])
def test_a_prompt_that_is_not_a_sequence_of_ints_is_refused(bad: Any) -> None:
    with pytest.raises(QueryError, match="token_ids"):
        PrefixIndex().find_matches(bad)


def test_a_typed_buffer_answers_as_the_list_does() -> None:
    from array import array

    idx = PrefixIndex()
    idx.apply(W[0], BlockStored(block_hashes=[1, 2], token_ids=[5, 6, 7, 8], block_size=2))
    assert idx.find_matches(array("I", [5, 6, 7, 8, 9])) == idx.find_matches([5, 6, 7, 8, 9]) == {W[0]: 2}
    assert idx.find_matches(array("q", [5, 6, 7, 8, 9])) == {W[0]: 2}  # other int buffers: checked one by one
    with pytest.raises(QueryError, match=r"token_ids\[1\]"):
        idx.find_matches(array("q", [5, -6]))


def test_queries_on_threads_run_while_other_threads_ingest() -> None:
    """find_matches from two threads while two threads apply and remove: no deadlock, every answer right."""
    idx = PrefixIndex()
    prompt = list(range(64))
    idx.apply(W[0], BlockStored(block_hashes=list(range(1, 17)), token_ids=prompt, block_size=4))
    stop = threading.Event()
    wrong: list[object] = []

    def ingest(t: int) -> None:
        w = WorkerKey(f"ingest{t}", 0)
        n = 0
        while not stop.is_set():
            hashes = [10_000 * (n + 1) + j for j in range(32)]
            idx.apply(w, BlockStored(block_hashes=hashes, token_ids=[(n + j) % 50 for j in range(128)], block_size=4))
            idx.remove_worker(w)
            n += 1

    def query() -> None:
        for _ in range(500):
            s = idx.find_matches([*prompt, 0])
            if s.get(W[0]) != 16 or s.tier("CPU"):
                wrong.append(dict(s))

    ingesters = [threading.Thread(target=ingest, args=(t,)) for t in range(2)]
    queriers = [threading.Thread(target=query) for _ in range(2)]
    for th in ingesters + queriers:
        th.start()
    for th in queriers:
        th.join(timeout=60)
    stop.set()
    for th in ingesters:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in ingesters + queriers), "a thread is stuck"
    assert wrong == []
    assert idx.workers() == {W[0]}
