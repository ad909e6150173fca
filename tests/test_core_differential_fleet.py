"""The compiled index against its executable reference on a fleet: many workers share prefixes.

tests/test_core_differential.py drives four workers, so no key there has more than four holders. The
compiled table keeps a key held by many workers as a bit set over worker slots (src/index/table.rs) and
the match intersects those sets word by word (src/index/query.rs): these streams make keys move between
one holder, a holder list and a bit set and back, across several 64-slot words, with off-GPU tiers on
some holders (the set's exceptions), removals, clears and dropped workers whose slots are reused, and
require the same answers — per-worker counts in order, tokens, every tier — and the same stats as the
pure-Python reference.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from reference._index import PrefixIndex as RefIndex

from kvroute._index import PrefixIndex
from kvroute._models import TIERS, WorkerKey
from kvroute._wire import AllBlocksCleared, BlockRemoved, BlockStored

FLEET = [WorkerKey(f"f{i // 2}", i % 2) for i in range(150)]
MEDIA = [None] * 6 + ["CPU", "DISK", "weird"]


def _answers(idx: Any, tokens: list[int]) -> dict[str, Any]:
    s = idx.find_matches(tokens)
    return {
        "scores": list(s.items()),
        "tokens": {w: s.tokens(w) for w in s},
        "tiers": {t: dict(s.tier(t)) for t in TIERS},
    }


def _state(idx: Any) -> dict[str, Any]:
    return {
        "stats": msgspec.structs.asdict(idx.stats()),
        "workers": sorted(idx.workers(), key=str),
        "num_blocks": [idx.num_blocks(w) for w in FLEET] + [idx.num_blocks()],
    }


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([1, 2, 4]), reuse_reports=st.booleans())
def test_a_fleet_sharing_prefixes_gives_identical_answers(seed: int, bs: int, reuse_reports: bool) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(2, 12) * bs)] for _ in range(3)]
    # A block's engine hash is the same on every worker (same content, same engine seed).
    hashes = [[p * 1000 + i + 1 for i in range(len(q) // bs)] for p, q in enumerate(prompts)]
    ref, new = RefIndex(reuse_reports=reuse_reports), PrefixIndex(reuse_reports=reuse_reports)
    # A working set of the fleet, so keys gather many holders; it drifts over the stream.
    active = rng.sample(FLEET, rng.randint(20, len(FLEET)))
    queries = [list(p) for p in prompts] + [[*p[: rng.randint(0, len(p))], rng.randrange(3)] for p in prompts]
    for step in range(rng.randint(200, 900)):
        w = rng.choice(active)
        op = rng.random()
        p = rng.randrange(len(prompts))
        n = len(hashes[p])
        ev: Any
        if op < 0.62:
            start = 0 if rng.random() < 0.8 else rng.randrange(n)
            end = rng.randint(start + 1, n)
            ev = BlockStored(
                block_hashes=hashes[p][start:end],
                parent_block_hash=hashes[p][start - 1] if start else None,
                token_ids=prompts[p][start * bs : end * bs],
                block_size=bs,
                medium=rng.choice(MEDIA),
            )
        elif op < 0.85:
            chosen = rng.sample(hashes[p], rng.randint(1, min(4, n)))
            ev = BlockRemoved(block_hashes=chosen, medium=rng.choice(MEDIA))
        elif op < 0.9:
            ev = AllBlocksCleared()
        elif op < 0.93:
            ref.remove_worker(w)
            new.remove_worker(w)
            continue
        else:
            if rng.random() < 0.3:
                active = rng.sample(FLEET, rng.randint(20, len(FLEET)))
            assert _state(new) == _state(ref), step
            for q in queries:
                assert _answers(new, q) == _answers(ref, q), (step, q)
            continue
        ref.apply(w, ev)
        new.apply(w, ev)
    assert _state(new) == _state(ref)
    for q in queries:
        assert _answers(new, q) == _answers(ref, q), q
