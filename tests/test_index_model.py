"""PrefixIndex against a brute-force model of what the engine's events say it holds.

The model knows nothing of content keys or of the index's tables: a worker holds, per engine
hash, the *identity* of the prefix that hash names — (adapter, salt, every token up to the
block's end, the lookahead tokens after it) — or None when the events cannot tell (an unknown
parent), and the tiers it is on. Namespaces travel the way vLLM sends them (the adapter in
``lora_name`` and first in each block's extra keys, the salt in the first block's extra keys),
or SGLang's (``cache_salt``). A hybrid worker adds a sliding-window group, scored with vLLM's
rule (SlidingWindowManager / HybridKVCacheCoordinator) written out from the engine's code.
Stores are idempotent per tier (a reuse report and a duplicate look alike: one removal drops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute import BlockRemoved, BlockStored, PrefixIndex, WorkerKey

BS = 2
WINDOW = 3  # cdiv(3 - 1, 2) = 1 block before the hit point
TIERS = ("GPU", "CPU")
Ident = tuple[object, ...]


@dataclass
class Held:
    ident: Ident | None
    tiers: set[str] = field(default_factory=set)


@dataclass
class MWorker:
    lookahead: int
    hybrid: bool
    sglang: bool
    full: dict[int, Held] = field(default_factory=dict)
    window: dict[int, Held] = field(default_factory=dict)


_HASHES: dict[Ident, int] = {}


def ehash(ident: Ident) -> int:
    """The engine's hash of a prefix: any injective naming will do."""
    return _HASHES.setdefault(ident, 1000 + len(_HASHES))


def ident(lora: str | None, salt: str | None, tokens: list[int], i: int, la: int) -> Ident | None:
    end = (i + 1) * BS
    if end + la > len(tokens):
        return None
    return (lora, salt, tuple(tokens[:end]), tuple(tokens[end : end + la]))


WORKERS = {
    WorkerKey("hybrid-2", 0): MWorker(0, True, False),
    WorkerKey("plain", 0): MWorker(0, False, False),
    WorkerKey("sglang", 0): MWorker(0, False, True),
    WorkerKey("lookahead", 0): MWorker(1, False, False),
    WorkerKey("hybrid", 0): MWorker(0, True, False),
}

tokens_st = st.lists(st.integers(1, 2), min_size=2, max_size=10)
ns_st = st.tuples(st.sampled_from([None, "ad"]), st.sampled_from([None, "salt"]))


class IndexModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model = {k: MWorker(v.lookahead, v.hybrid, v.sglang) for k, v in WORKERS.items()}
        self.queries: list[tuple[list[int], str | None, str | None]] = []

    @rule(
        w=st.sampled_from(sorted(WORKERS)),
        tokens=tokens_st,
        ns=ns_st,
        span=st.tuples(st.integers(0, 4), st.integers(1, 4)),
        tier=st.sampled_from(TIERS),
        mask=st.lists(st.booleans(), min_size=4, max_size=4),
    )
    def store(self, w: WorkerKey, tokens: list[int], ns: tuple[str | None, str | None],
              span: tuple[int, int], tier: str, mask: list[bool]) -> None:
        m = self.model[w]
        lora, salt = ns
        la = m.lookahead
        n_blocks = (len(tokens) - la) // BS
        first, count = span
        last = min(n_blocks, first + count)
        if first >= last:
            return
        self.queries.append((tokens, lora, salt))
        idents = [ident(lora, salt, tokens, i, la) for i in range(first, last)]
        hashes = [ehash(x) for x in idents if x is not None]
        parent = ehash(ident(lora, salt, tokens, first - 1, la)) if first else None  # type: ignore[arg-type]
        extra = None
        if not m.sglang and (lora or salt):
            extra = [[*([lora] if lora else []), *([salt] if salt and i == 0 else [])] or None
                     for i in range(first, last)]
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens[first * BS : last * BS],
            block_size=BS,
            medium=tier,
            lora_name=lora,
            extra_keys=extra,
            cache_salt=salt if m.sglang and first == 0 else None,
            group_idx=0 if m.hybrid else None,
            kv_cache_spec_kind="full_attention" if m.hybrid else None,
            lookahead_token_ids=[list(x[3]) for x in idents if x is not None] if la else None,  # type: ignore[misc]
        )
        fresh = not all(h in m.full for h in hashes)
        self.index.apply(w, event)
        known = parent is None or (parent in m.full and m.full[parent].ident is not None)
        for h, x in zip(hashes, idents):
            held = m.full.setdefault(h, Held(x if known else None))
            held.tiers.add(tier)
        if m.hybrid:
            # The window group stores the same range, skipping the blocks the mask nulls.
            # vLLM publishes the window group's store even when every block of it is null.
            # The newest block is kept (the window's null blocks are the older ones).
            keep = [i for i in range(first, last) if mask[i % 4] or i == last - 1]
            if first == 0 and len(keep) == last - first and not fresh:
                # vLLM's shape of a reuse report (a hit re-announced from block 0, every group
                # dense): the index takes it for one, whatever the engine meant (README, guarantees).
                keep = []
            sw_hashes = [ehash(idents[i - first]) for i in keep]  # type: ignore[arg-type]
            self.index.apply(w, BlockStored(
                block_hashes=sw_hashes, parent_block_hash=parent, token_ids=tokens[first * BS : last * BS],
                block_size=BS, medium=tier, lora_name=lora,
                extra_keys=[extra[i - first] for i in keep] if extra else None,
                group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=WINDOW,
            ))
            for h in sw_hashes:
                # The wire names each window block by the hash the full group keys: known when
                # the full group knows it.
                full = m.full.get(h)
                m.window.setdefault(h, Held(full.ident if full is not None else None)).tiers.add(tier)

    @precondition(lambda self: any(m.full or m.window for m in self.model.values()))
    @rule(data=st.data(), tier=st.sampled_from(TIERS), group=st.sampled_from([0, 1]))
    def remove(self, data: st.DataObject, tier: str, group: int) -> None:
        w = data.draw(st.sampled_from([k for k, m in self.model.items() if m.full or m.window]))
        m = self.model[w]
        table = m.window if group == 1 and m.hybrid else m.full
        if not table:
            return
        h = data.draw(st.sampled_from(sorted(table)))
        if tier not in table[h].tiers:
            return
        gidx = (1 if table is m.window else 0) if m.hybrid else None
        self.index.apply(w, BlockRemoved(block_hashes=[h], medium=tier, group_idx=gidx))
        table[h].tiers.discard(tier)
        if not table[h].tiers:
            del table[h]

    @precondition(lambda self: any(m.full for m in self.model.values()))
    @rule(data=st.data(), tier=st.sampled_from(TIERS), unknown=st.booleans())
    def placeholder(self, data: st.DataObject, tier: str, unknown: bool) -> None:
        """An offload connector's store: no tokens, block_size 0, names a tier."""
        w = data.draw(st.sampled_from([k for k, m in self.model.items() if m.full]))
        m = self.model[w]
        h = 999_999 if unknown else data.draw(st.sampled_from(sorted(m.full)))
        self.index.apply(w, BlockStored(block_hashes=[h], token_ids=[], block_size=0, medium=tier))
        m.full.setdefault(h, Held(None)).tiers.add(tier)

    @rule(w=st.sampled_from(sorted(WORKERS)))
    def clear(self, w: WorkerKey) -> None:
        self.index.remove_worker(w)
        self.model[w].full.clear()
        self.model[w].window.clear()

    @rule(tokens=tokens_st, ns=ns_st)
    def query_new(self, tokens: list[int], ns: tuple[str | None, str | None]) -> None:
        self.check(tokens, *ns)

    @precondition(lambda self: bool(self.queries))
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def query_known(self, data: st.DataObject, extra: list[int]) -> None:
        tokens, lora, salt = data.draw(st.sampled_from(self.queries))
        self.check(tokens + extra, lora, salt)

    def check(self, tokens: list[int], lora: str | None, salt: str | None) -> None:
        scores = self.index.find_matches(tokens, lora_name=lora, cache_salt=salt)
        for w, m in self.model.items():
            want = model_score(m, tokens, lora, salt, None)
            assert scores[w] == want, (w, tokens, lora, salt, scores[w], want)
            assert scores.tokens(w) == want * BS
            for tier in TIERS:
                got = scores.tier(tier).get(w, 0)
                assert got == model_score(m, tokens, lora, salt, tier), (w, tier, tokens)

    @invariant()
    def no_residue(self) -> None:
        if not any(m.full or m.window for m in self.model.values()):
            assert not self.index._holders and not self.index._gpu_missing and self.index.num_blocks() == 0


def _run(table: dict[int, Held], tokens: list[int], lora: str | None, salt: str | None, la: int,
         tier: str | None) -> list[bool]:
    held = {h.ident for h in table.values() if h.ident is not None and (tier is None or tier in h.tiers)}
    out = []
    for i in range((len(tokens) - la) // BS if len(tokens) > la else 0):
        out.append(ident(lora, salt, tokens, i, la) in held)
    return out


def model_score(m: MWorker, tokens: list[int], lora: str | None, salt: str | None, tier: str | None) -> int:
    full = _run(m.full, tokens, lora, salt, m.lookahead, tier)
    run = 0
    while run < len(full) and full[run]:
        run += 1
    # Every engine serves at most num_tokens - 1 tokens from cache (the last is computed for its logits).
    run = min(run, max(0, (len(tokens) - 1) // BS))
    if not m.hybrid or not run:
        return run
    # vLLM: the window group needs cdiv(WINDOW - 1, BS) held blocks just before the hit point,
    # else the run of held blocks from block 0.
    hit = run
    if tier is not None:
        hit = min(hit, model_score(m, tokens, lora, salt, None))
        return hit
    window = _run(m.window, tokens, lora, salt, m.lookahead, None)[:hit]
    need = -(-(WINDOW - 1) // BS)
    count = 0
    for i in range(len(window) - 1, -1, -1):
        if window[i]:
            count += 1
            if count >= need:
                return i + count
        else:
            count = 0
    return count


IndexModel.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestIndexModel = IndexModel.TestCase
