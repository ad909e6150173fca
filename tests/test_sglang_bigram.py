"""SGLang with EAGLE (bigram keys): the store is marked when its cells fold, and the worker is served as SGLang serves.

SGLang 0.5.23 matches at most ``input_len - 1`` raw tokens (`Req._compute_max_prefix_len`, `RadixKey.limit`),
takes their bigram view (one bigram fewer) and whole pages of that: floor((n - 2) / P) pages of an n-token
prompt. A vLLM lookahead-1 worker with the same blocks serves floor((n - 1) / P): the two differ by a page
when n - 1 is whole pages. The bytes are SGLang's own (`sglang-bigram` of tests/test_production_shapes.py:
one 4-token page, tokens 1..4, the next token 5).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from test_production_shapes import GOLDEN

from kvroute import BlockStored, EventBatch, PrefixIndex, WorkerKey, decode_batch, encode_batch
from kvroute._snapshot import Cursor

SGLANG = WorkerKey("sglang", 0)
VLLM = WorkerKey("vllm", 0)
PAYLOAD = bytes.fromhex(GOLDEN["sglang-bigram"])


def _vllm_twin() -> EventBatch:
    """The same page as vLLM with lookahead 1 publishes it: tokens and one lookahead token, no cells."""
    (ev,) = decode_batch(PAYLOAD).events
    assert isinstance(ev, BlockStored)
    return EventBatch(1.0, [msgspec.structs.replace(ev, bigram=False)])


def _served(idx: PrefixIndex, n: int) -> dict[WorkerKey, int]:
    return dict(idx.find_matches(list(range(1, n + 1))).items())


def test_cells_mark_the_store_and_encode_back_as_cells() -> None:
    batch = decode_batch(PAYLOAD)
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.bigram and ev.token_ids == [1, 2, 3, 4] and ev.lookahead_token_ids == [[5]]
    wire = msgspec.msgpack.decode(encode_batch(batch, signed_hashes=True))
    assert wire[1][0]["token_ids"] == [[1, 2], [2, 3], [3, 4], [4, 5]]
    assert "bigram" not in wire[1][0] and "lookahead_token_ids" not in wire[1][0]
    for form in ("map", "array"):
        assert decode_batch(encode_batch(batch, form=form)) == batch
    assert decode_batch(encode_batch(_vllm_twin())).events[0].bigram is False  # type: ignore[union-attr]


@pytest.mark.parametrize("path", ["apply_batch", "apply_payload"])
def test_an_sglang_eagle_worker_is_served_a_page_less_at_the_edge(path: str) -> None:
    idx = PrefixIndex()
    idx.apply_batch(VLLM, _vllm_twin())
    if path == "apply_payload":
        idx.apply_payload(SGLANG, PAYLOAD)
    else:
        idx.apply_batch(SGLANG, decode_batch(PAYLOAD))
    # n = 5: the prompt minus one token is the page; SGLang's bigram view of it is 3 bigrams, no page.
    assert _served(idx, 5) == {VLLM: 1}
    assert _served(idx, 6) == {VLLM: 1, SGLANG: 1}
    assert _served(idx, 4) == {}


def test_the_mark_survives_a_snapshot_and_an_older_file_restores_as_before(tmp_path: Path) -> None:
    idx = PrefixIndex()
    idx.apply_batch(VLLM, _vllm_twin())
    idx.apply_payload(SGLANG, PAYLOAD)
    path = tmp_path / "index.kvs"
    idx.snapshot(path, cursors={SGLANG: Cursor(7, 1.0)})
    assert _served(PrefixIndex.restore(path), 5) == {VLLM: 1}

    # A file written before the mark: its workers have one field fewer. It still restores, each worker
    # as it did then (the mark unknown: vLLM's lookahead rule).
    snap = msgspec.msgpack.decode(path.read_bytes())
    assert [w[-1] for w in snap["workers"]] == [False, True]
    snap["workers"] = [w[:-1] for w in snap["workers"]]
    old = tmp_path / "old.kvs"
    old.write_bytes(msgspec.msgpack.encode(snap))
    back = PrefixIndex.restore(old)
    assert back.restored_cursors == {SGLANG: Cursor(7, 1.0)}
    assert _served(back, 5) == {VLLM: 1, SGLANG: 1}
    assert _served(back, 6) == {VLLM: 1, SGLANG: 1}
