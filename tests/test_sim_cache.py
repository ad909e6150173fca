"""The simulated KV cache: capacity, events that reproduce its ground truth, LRU leaf-only eviction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvroute._wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvroute.sim._cache import CapacityError, InvalidRequestError, PrefixCache, hash_seed

Prefix = tuple[str | None, tuple[int, ...]]


class Mirror:
    """What a subscriber learns from the events alone: hash -> (parent hash, LoRA, full token prefix).

    It asserts the rules a correct engine stream obeys: a stored block's parent is held, a
    hash is never stored twice while held, a removed block is held and is a leaf.
    """

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, tuple[BlockHash | None, Prefix]] = {}
        self.children: dict[BlockHash, int] = {}

    def prefixes(self) -> set[Prefix]:
        return {p for _, p in self.blocks.values()}

    def store(self, ev: BlockStored) -> list[Prefix]:
        parent = ev.parent_block_hash
        if parent is None:
            base: tuple[int, ...] = ()
        else:
            assert parent in self.blocks, "BlockStored names a parent the engine does not hold"
            base = self.blocks[parent][1][1]
        bs = ev.block_size
        assert len(ev.token_ids) == bs * len(ev.block_hashes)
        out = []
        for i, h in enumerate(ev.block_hashes):
            assert h not in self.blocks, "a held block stored again"
            base = base + tuple(ev.token_ids[i * bs : (i + 1) * bs])
            prefix = (ev.lora_name, base)
            self.blocks[h] = (parent, prefix)
            self.children[h] = 0
            if parent is not None:
                self.children[parent] += 1
            parent = h
            out.append(prefix)
        return out

    def remove(self, h: BlockHash) -> Prefix:
        assert h in self.blocks, "BlockRemoved for a block the engine does not hold"
        assert self.children[h] == 0, "a block with cached children was evicted"
        parent, prefix = self.blocks.pop(h)
        del self.children[h]
        if parent is not None:
            self.children[parent] -= 1
        return prefix


@dataclass
class Req:
    lora: str | None
    prompt: list[int]
    max_tokens: int
    hits: int
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is computed (0 until its prefill)

    def computed_tokens(self) -> list[int]:
        return (self.prompt + self.generated)[: self.computed]

    def step(self) -> None:
        # The KV of every token but the last sampled one is computed.
        self.computed = max(len(self.prompt), len(self.prompt) + len(self.generated) - 1)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class CacheMachine(RuleBasedStateMachine):
    """Random admit / decode / release / reset sequences against a mirror fed only by the encoded events."""

    def __init__(self) -> None:
        super().__init__()
        self.mirror = Mirror()
        self.running: dict[int, Req] = {}
        self.next_id = 0
        self.clock = 0
        self.last_used: dict[Prefix, int] = {}

    @initialize(
        style=st.sampled_from(["vllm-int", "vllm-bytes", "sglang"]),
        form=st.sampled_from(["map", "array"]),
        block_size=st.integers(1, 4),
        capacity=st.integers(3, 24),
        seed=st.integers(0, 3),
    )
    def setup(self, style: str, form: Literal["map", "array"], block_size: int, capacity: int, seed: int) -> None:
        self.form: Literal["map", "array"] = form
        self.signed = style == "sglang"
        self.cache = PrefixCache(
            capacity_blocks=capacity,
            block_size=block_size,
            style="sglang" if style == "sglang" else "vllm",
            bytes_hashes=style == "vllm-bytes",
            seed=hash_seed(seed),
            new_fields=form == "map",
            lora_ids={"a": 1},
        )
        self.bs = block_size

    # --- the test's own model of references and recency --------------------------------

    def _full_prefixes(self, lora: str | None, tokens: list[int], n_blocks: int) -> list[Prefix]:
        return [(lora, tuple(tokens[: (i + 1) * self.bs])) for i in range(n_blocks)]

    def _chain_of(self, r: Req) -> list[Prefix]:
        n = max(r.hits, len(r.computed_tokens()) // self.bs)
        return self._full_prefixes(r.lora, r.computed_tokens(), n)

    def _referenced(self) -> set[Prefix]:
        return {p for r in self.running.values() for p in self._chain_of(r)}

    def _drain(self) -> None:
        """Encode the cache's events as the engine would, decode them, apply them to the mirror, check each rule."""
        events = self.cache.drain_events()
        if not events:
            return
        payload = encode_batch(EventBatch(1.0, events, 0), form=self.form, signed_hashes=self.signed)
        referenced = self._referenced()
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                for p in self.mirror.store(ev):
                    self.last_used[p] = self.clock
            elif isinstance(ev, BlockRemoved):
                (h,) = ev.block_hashes
                victim = self.mirror.blocks[h][1]
                assert victim not in referenced, "a block a running request uses was evicted"
                candidates = [
                    p
                    for bh, (_, p) in self.mirror.blocks.items()
                    if self.mirror.children[bh] == 0 and p not in referenced
                ]
                oldest = min(self.last_used[p] for p in candidates)
                assert self.last_used[victim] == oldest, "eviction is not least-recently-used"
                self.mirror.remove(h)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.mirror.blocks.clear()
                self.mirror.children.clear()

    # --- rules ----------------------------------------------------------------------------

    @rule(prompt=tokens_st, max_tokens=st.integers(0, 6), lora=st.sampled_from([None, None, "a"]))
    def admit(self, prompt: list[int], max_tokens: int, lora: str | None) -> None:
        before = self.mirror.prefixes()
        expected_hits = 0
        for p in self._full_prefixes(lora, prompt[:-1], (len(prompt) - 1) // self.bs):
            if p not in before:
                break
            expected_hits += 1
        rid = self.next_id
        self.next_id += 1
        self.clock += 1
        try:
            hits = self.cache.admit(rid, prompt, max_tokens=max_tokens, lora_name=lora)
        except CapacityError:
            assert -(-(len(prompt) + max_tokens) // self.bs) > self.cache.capacity_blocks
            return
        if hits is None:
            # Refused for now: only when the reservation cannot fit even after evicting all it may.
            assert self.cache.drain_events() == []
            return
        assert hits == expected_hits
        req = Req(lora, prompt, max_tokens, hits)
        for p in self._full_prefixes(lora, prompt, hits):
            self.last_used[p] = self.clock
        self.running[rid] = req
        self._drain()  # evictions made room
        req.step()
        self.cache.computed(rid, req.computed_tokens())
        self._drain()  # the prompt's blocks were stored

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if len(req.generated) >= req.max_tokens:
            return
        req.generated.append(data.draw(st.integers(0, 2)))
        req.step()
        self.cache.computed(rid, req.computed_tokens())
        self._drain()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.clock += 1
        for p in self._full_prefixes(req.lora, req.computed_tokens(), len(req.computed_tokens()) // self.bs):
            self.last_used[p] = self.clock
        self.cache.release(rid)
        self._drain()

    @rule()
    def reset(self) -> None:
        done = self.cache.reset()
        assert done == (not self.running)
        self._drain()

    @rule(query=tokens_st, lora=st.sampled_from([None, "a"]))
    def match(self, query: list[int], lora: str | None) -> None:
        held = self.mirror.prefixes()
        n = 0
        for p in self._full_prefixes(lora, query, len(query) // self.bs):
            if p not in held:
                break
            n += 1
        assert self.cache.match_blocks(query, lora_name=lora) == n

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def ground_truth_matches_events(self) -> None:
        if not hasattr(self, "cache"):
            return
        assert self.cache.block_hashes() == set(self.mirror.blocks)
        assert self.cache.held_prefixes() == self.mirror.prefixes()
        for info in self.cache.blocks():
            parent, prefix = self.mirror.blocks[info.block_hash]
            assert info.parent_block_hash == parent
            assert (info.lora_name, prefix[1][-self.bs :]) == (prefix[0], info.token_ids)

    @invariant()
    def capacity_respected(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        assert c.num_free_blocks >= 0
        assert c.num_cached_blocks + c.num_free_blocks <= c.capacity_blocks
        assert 0.0 <= c.usage <= 1.0
        referenced = self._referenced()
        assert c.num_unreferenced_blocks == len(self.mirror.prefixes() - referenced)
        assert c.num_running == len(self.running)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_repeat_prompt_hits_all_but_last_token() -> None:
    cache = PrefixCache(capacity_blocks=16, block_size=4, seed=hash_seed(1))
    prompt = list(range(10))
    assert cache.admit("a", prompt, max_tokens=2) == 0
    cache.computed("a", prompt)
    stored = cache.drain_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(range(8))
    cache.release("a")
    assert cache.admit("b", prompt, max_tokens=2) == 2
    # 8 tokens: both blocks are full, but the last prompt token must be computed: one block hits.
    assert cache.admit("c", prompt[:8], max_tokens=1) == 1


def test_hashes_differ_per_seed_for_vllm_only() -> None:
    def first_hash(style: Literal["vllm", "sglang"], seed: int) -> BlockHash:
        cache = PrefixCache(capacity_blocks=4, block_size=2, style=style, seed=hash_seed(seed))
        cache.admit(0, [5, 6, 7], max_tokens=0)
        cache.computed(0, [5, 6, 7])
        (ev,) = cache.drain_events()
        assert isinstance(ev, BlockStored)
        return ev.block_hashes[0]

    assert first_hash("vllm", 1) != first_hash("vllm", 2)
    assert first_hash("sglang", 1) == first_hash("sglang", 2)
    h = first_hash("sglang", 1)
    assert isinstance(h, int) and 0 <= h < 1 << 64


def test_bad_requests_are_typed_errors() -> None:
    cache = PrefixCache(capacity_blocks=2, block_size=4)
    with pytest.raises(CapacityError):
        cache.admit(1, list(range(8)), max_tokens=1)
    with pytest.raises(InvalidRequestError):
        cache.admit(1, [1, -2], max_tokens=1)
    with pytest.raises(InvalidRequestError):
        cache.admit(1, [1, 1 << 70], max_tokens=1)
    with pytest.raises(InvalidRequestError):
        cache.admit(1, [], max_tokens=1)
    assert cache.admit(1, [1, 2], max_tokens=1) == 0
    with pytest.raises(InvalidRequestError):
        cache.admit(1, [1, 2], max_tokens=1)
    with pytest.raises(InvalidRequestError):
        cache.computed(1, [9, 9, 9, 9, 9, 9, 9, 9, 9])  # beyond the reservation
    with pytest.raises(InvalidRequestError):
        cache.release(2)
    assert cache.stats.rejected == 1


def test_waits_when_full_then_fits_after_release() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=2)
    assert cache.admit("a", [1, 2, 3, 4, 5], max_tokens=2) == 0  # 4 blocks reserved
    assert cache.admit("b", [7, 8], max_tokens=1) is None
    cache.computed("a", [1, 2, 3, 4, 5])
    cache.release("a")
    assert cache.admit("b", [7, 8], max_tokens=1) == 0
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert removed == []  # two free blocks were enough: nothing evicted
    assert cache.num_cached_blocks == 2


def test_clear_forgets_silently() -> None:
    cache = PrefixCache(capacity_blocks=8, block_size=2)
    cache.admit("a", [1, 2, 3], max_tokens=1)
    cache.computed("a", [1, 2, 3])
    cache.clear()
    assert cache.drain_events() == []
    assert cache.num_cached_blocks == 0 and cache.num_running == 0 and cache.num_free_blocks == 8
