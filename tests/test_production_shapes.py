"""The production shapes of docs/protocol.md §3.1, as the engines' own encoders wrote them, through decoder and index.

The bytes are ground truth independent of kvroute (vLLM 0.33/0.34 ``kv_events.py``, SGLang 0.5.23
``disaggregation/kv_events.py``). Each test says what the engine would serve for a prompt, and
checks the index claims exactly that — and never a block for a prompt outside the namespace.
"""

from __future__ import annotations

import pytest

from kvroute import BlockStored, MultimodalItem, PrefixIndex, WorkerKey
from kvroute._wire import BatchDecoder

GOLDEN: dict[str, str] = {
    "vllm-lora": (
        "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573926566b1"
        "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a65"
        "04a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b"
        "6579739291a873716c2d6c6f726191a873716c2d6c6f7261a967726f75705f69647800b26b765f63616368655f737065"
        "635f6b696e64ae66756c6c5f617474656e74696f6e00"
    ),
    "vllm-salt": (
        "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392ccc9cc"
        "cab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f7369"
        "7a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a8"
        "74656e616e742d61c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474"
        "656e74696f6e00"
    ),
    "vllm-mm": (
        "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd012d"
        "cd012eb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
        "9192a9696d672d7368612d31029192a9696d672d7368612d3102a967726f75705f69647800b26b765f63616368655f73"
        "7065635f6b696e64ae66756c6c5f617474656e74696f6e00"
    ),
    "vllm-hybrid": (
        "93cb41d954fc4020000092de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd0191"
        "cd0192b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
        "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ede"
        "000ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd0192b1706172656e745f626c6f63"
        "6b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a6"
        "6d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647801b26b76"
        "5f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f737065635f736c"
        "6964696e675f77696e646f770400"
    ),
    "vllm-hybrid-sparse": (
        "93cb41d954fc4020000092de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd019b"
        "cd019cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
        "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ede"
        "000ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657390b1706172656e745f626c6f636b5f68"
        "617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d6564"
        "69756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797390a967726f75705f69647801b26b765f636163"
        "68655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f737065635f736c6964696e"
        "675f77696e646f770400"
    ),
    "vllm-offload-placeholder": (
        "93cb41d954fc4020000092de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd01f5"
        "cd01f6b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
        "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ede"
        "0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd01f5b1706172656e745f626c6f63"
        "6b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da343"
        "5055a96c6f72615f6e616d65c000"
    ),
    "vllm-lookahead": (
        "93cb41d954fc4020000091de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd0259"
        "cd025ab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
        "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6eb3"
        "6c6f6f6b61686561645f746f6b656e5f6964739292050692090a00"
    ),
    "vllm-mamba": (
        "93cb41d954fc4020000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd02be"
        "b1706172656e745f626c6f636b5f68617368cd02bda9746f6b656e5f69647390aa626c6f636b5f73697a6504a76c6f72"
        "615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f69647801b26b765f63616368655f"
        "737065635f6b696e64a56d616d626100"
    ),
    "vllm-remote": (
        "93cb41d954fc4020000091de000da474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd0321"
        "cd0322b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f"
        "73697a6504a76c6f72615f6964c0a66d656469756da753544f52414745a96c6f72615f6e616d65c0aa65787472615f6b"
        "65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74"
        "696f6ea86c6f63616c697479a652454d4f5445a96f776e657273686970a46b76637200"
    ),
    "sglang-salt": (
        "93cb41d954fc402000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d09bd09ab1"
        "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a65"
        "04a76c6f72615f6964c0a66d656469756da3475055aa63616368655f73616c74a874656e616e742d6100"
    ),
    "sglang-bigram": (
        "93cb41d954fc402000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391d1ff37b170"
        "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394920102920203920304920405aa626c6f636b5f73"
        "697a6504a76c6f72615f6964c0a66d656469756da347505500"
    ),
    "sglang-lora": (
        "93cb41d954fc402000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391d1fed3b170"
        "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72"
        "615f696407a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f726100"
    ),
}

W = WorkerKey("w", 0)
TOKS = list(range(1, 9))


def _index(*names: str) -> PrefixIndex:
    idx = PrefixIndex()
    dec = BatchDecoder()
    for name in names:
        batch = dec.decode(bytes.fromhex(GOLDEN[name]))
        assert batch.skipped == {} and batch.untrusted is None, name
        idx.apply_batch(W, batch)
    return idx


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_every_shape_decodes_whole(name: str) -> None:
    batch = BatchDecoder().decode(bytes.fromhex(GOLDEN[name]))
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    assert batch.events and not batch.skipped and batch.untrusted is None


def test_vllm_lora_is_one_namespace() -> None:
    """vLLM sends the adapter in lora_name and first in every block's extra keys: one namespace."""
    idx = _index("vllm-lora")
    scores = idx.find_matches([*TOKS, 0], lora_name="sql-lora")
    assert scores[W] == 2 and scores.tokens(W) == 8 and scores.block_size(W) == 4
    assert W not in idx.find_matches(TOKS)
    assert W not in idx.find_matches(TOKS, lora_name="other")


@pytest.mark.parametrize("name", ["vllm-salt", "sglang-salt"])
def test_salted_blocks_only_for_the_salt(name: str) -> None:
    idx = _index(name)
    assert idx.find_matches([*TOKS, 0], cache_salt="tenant-a")[W] == 2
    assert W not in idx.find_matches(TOKS)
    assert W not in idx.find_matches(TOKS, cache_salt="tenant-b")


def test_salt_is_the_same_key_on_both_engines() -> None:
    """A salted prompt cached on vLLM and on SGLang is one identity: the router asks once."""
    idx = PrefixIndex()
    v, s = WorkerKey("vllm", 0), WorkerKey("sglang", 0)
    for w, name in ((v, "vllm-salt"), (s, "sglang-salt")):
        idx.apply_batch(w, BatchDecoder().decode(bytes.fromhex(GOLDEN[name])))
    scores = idx.find_matches([*TOKS, 0], cache_salt="tenant-a")
    assert scores[v] == scores[s] == 2


def test_lora_is_the_same_key_on_both_engines() -> None:
    idx = PrefixIndex()
    v, s = WorkerKey("vllm", 0), WorkerKey("sglang", 0)
    for w, name in ((v, "vllm-lora"), (s, "sglang-lora")):
        idx.apply_batch(w, BatchDecoder().decode(bytes.fromhex(GOLDEN[name])))
    scores = idx.find_matches([*TOKS, 0], lora_name="sql-lora")
    assert scores[v] == 2 and scores[s] == 1


def test_multimodal_blocks_need_the_item() -> None:
    """vLLM keys a block with (identifier, item offset - block start) of each item overlapping it
    (kv_cache_utils._gen_mm_extra_hash_keys). This payload keys both blocks with offset 2: a
    request's item at token 2 gives block 0 that key; block 1 (start 4) would get -2, so no
    request can reach it and it is never claimed."""
    idx = _index("vllm-mm")
    assert idx.find_matches([*TOKS, 0], mm_items=[MultimodalItem("img-sha-1", 2, 4)])[W] == 1
    assert W not in idx.find_matches(TOKS)
    assert W not in idx.find_matches(TOKS, mm_items=[MultimodalItem("img-sha-2", 2, 4)])
    assert W not in idx.find_matches(TOKS, mm_items=[MultimodalItem("img-sha-1", 1, 4)])


def test_hybrid_needs_the_window_group() -> None:
    """Window 4, blocks of 4: a hit at h blocks needs the window group's block h-1 (cdiv(4-1, 4) = 1)."""
    idx = _index("vllm-hybrid")
    # 9 tokens: the engine may serve 8 (both blocks); the window group holds block 1 (hash 402).
    scores = idx.find_matches([*TOKS, 9])
    assert scores[W] == 2 and scores.tokens(W) == 8
    # 8 tokens: the engine computes the last one, so at most 1 block, and the window group
    # does not hold block 0 (it was null): nothing.
    assert W not in idx.find_matches(TOKS)


def test_hybrid_sparse_window_serves_nothing() -> None:
    idx = _index("vllm-hybrid-sparse")
    assert W not in idx.find_matches([*TOKS, 9])
    assert idx.num_blocks(W) == 2


def test_offload_placeholder_adds_a_tier() -> None:
    idx = _index("vllm-offload-placeholder")
    scores = idx.find_matches([*TOKS, 0])
    assert scores[W] == 2 and scores.tier("GPU")[W] == 2 and scores.tier("CPU")[W] == 1


def test_placeholder_of_an_unknown_hash_is_held_never_claimed() -> None:
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[77], token_ids=[], block_size=0, medium="CPU"))
    assert idx.num_blocks(W) == 1 and idx.find_matches(TOKS) == {}


def test_lookahead_tokens_are_part_of_the_key() -> None:
    """The engine's hash covers the 2 tokens after each block: a prompt that differs there does not match."""
    idx = _index("vllm-lookahead")
    assert idx.find_matches([*TOKS, 9, 10])[W] == 2
    assert idx.find_matches([*TOKS, 9, 11])[W] == 1
    assert idx.find_matches(TOKS)[W] == 1  # block 1 has no lookahead tokens in this prompt
    assert W not in idx.find_matches([1, 2, 3, 4, 5, 7])


def test_mamba_checkpoint_at_the_boundary() -> None:
    """A Mamba group serves a hit only where it holds a state checkpoint (hash 702 = block 1)."""
    idx = PrefixIndex()
    idx.apply(W, BlockStored(block_hashes=[701, 702], token_ids=TOKS, block_size=4, group_idx=0,
                             kv_cache_spec_kind="full_attention"))
    assert idx.find_matches([*TOKS, 9])[W] == 2
    idx.apply_batch(W, BatchDecoder().decode(bytes.fromhex(GOLDEN["vllm-mamba"])))
    assert idx.find_matches([*TOKS, 9])[W] == 2
    assert W not in idx.find_matches(TOKS)  # at most 1 block: no checkpoint after block 0
    assert W not in idx.find_matches([*TOKS[:4], 0, 0, 0, 0, 0])


def test_remote_is_not_the_workers_own() -> None:
    idx = _index("vllm-remote")
    assert idx.find_matches(TOKS) == {}
    assert idx.stats().remote_blocks == 2


def test_sglang_bigrams_fold_to_tokens_with_one_lookahead() -> None:
    """[token, next_token] cells: the page is tokens 1..4, and the engine's key covers token 5 too.

    SGLang serves the bigram view of the prompt minus one token: a 5-token prompt's 4 tokens are 3
    bigrams, no whole page; a 6-token prompt's 5 tokens are 4 bigrams, the page.
    """
    idx = _index("sglang-bigram")
    assert idx.find_matches([1, 2, 3, 4, 5, 6])[W] == 1
    assert W not in idx.find_matches([1, 2, 3, 4, 5])
    assert W not in idx.find_matches([1, 2, 3, 4, 6, 7])
    assert W not in idx.find_matches([1, 2, 3, 4])


def test_sglang_lora() -> None:
    idx = _index("sglang-lora")
    assert idx.find_matches([1, 2, 3, 4, 5], lora_name="sql-lora")[W] == 1
    assert W not in idx.find_matches([1, 2, 3, 4])
