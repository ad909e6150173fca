"""The production shapes (protocol §3.1) re-encoded by the engine installed in this venv.

The main suite decodes these bytes (`tests/test_production_shapes.py`, `GOLDEN`); here the engine's
own msgspec types and encoder produce them again, so the bytes kvroute is tested on are proven to be
the engine's, release by release. Runs in every engine venv, for that engine's shapes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

_spec = importlib.util.spec_from_file_location(
    "production_shapes", Path(__file__).resolve().parents[1] / "test_production_shapes.py")
assert _spec is not None and _spec.loader is not None
_shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shapes)
GOLDEN: dict[str, str] = _shapes.GOLDEN

TS = 1700000000.5
TOKS = list(range(1, 9))
ENGINE = "vllm" if importlib.util.find_spec("vllm") else "sglang"


def _vllm_shapes() -> dict[str, Callable[[], Any]]:
    from vllm.distributed.kv_events import BlockStored as S
    from vllm.distributed.kv_events import KVEventBatch

    full = dict(group_idx=0, kv_cache_spec_kind="full_attention")
    plain = dict(parent_block_hash=None, token_ids=TOKS, block_size=4, lora_id=None, medium="GPU",
                 lora_name=None)

    def batch(*events: Any) -> Any:
        return KVEventBatch(ts=TS, events=list(events), data_parallel_rank=0)

    return {
        "vllm-lora": lambda: batch(S(block_hashes=[101, 102], **{**plain, "lora_id": 1, "lora_name": "sql-lora"},
                                     extra_keys=[("sql-lora",), ("sql-lora",)], **full)),
        "vllm-salt": lambda: batch(S(block_hashes=[201, 202], **plain, extra_keys=[("tenant-a",), None], **full)),
        "vllm-mm": lambda: batch(S(block_hashes=[301, 302], **plain,
                                   extra_keys=[(("img-sha-1", 2),), (("img-sha-1", 2),)], **full)),
        "vllm-hybrid": lambda: batch(
            S(block_hashes=[401, 402], **plain, extra_keys=[None, None], **full),
            S(block_hashes=[402], **plain, extra_keys=[None], group_idx=1, kv_cache_spec_kind="sliding_window",
              kv_cache_spec_sliding_window=4)),
        "vllm-hybrid-sparse": lambda: batch(
            S(block_hashes=[411, 412], **plain, extra_keys=[None, None], **full),
            S(block_hashes=[], **plain, extra_keys=[], group_idx=1, kv_cache_spec_kind="sliding_window",
              kv_cache_spec_sliding_window=4)),
        "vllm-offload-placeholder": lambda: batch(
            S(block_hashes=[501, 502], **plain, extra_keys=[None, None], **full),
            S(block_hashes=[501], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None, medium="CPU",
              lora_name=None)),
        "vllm-lookahead": lambda: batch(S(block_hashes=[601, 602], **plain, extra_keys=[None, None], **full,
                                          lookahead_token_ids=[[5, 6], [9, 10]])),
        "vllm-mamba": lambda: batch(S(block_hashes=[702], parent_block_hash=701, token_ids=[], block_size=4,
                                      lora_id=None, medium="CPU", lora_name=None, group_idx=1,
                                      kv_cache_spec_kind="mamba")),
        "vllm-remote": lambda: batch(S(block_hashes=[801, 802], **{**plain, "medium": "STORAGE"},
                                       extra_keys=[None, None], **full, locality="REMOTE", ownership="kvcr")),
    }


def _sglang_shapes() -> dict[str, Callable[[], Any]]:
    from sglang.srt.disaggregation.kv_events import BlockStored as S
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    def batch(*events: Any) -> Any:
        return KVEventBatch(ts=TS, events=list(events), attn_dp_rank=0)

    return {
        "sglang-salt": lambda: batch(S(block_hashes=[-101, -102], parent_block_hash=None, token_ids=TOKS,
                                       block_size=4, lora_id=None, medium="GPU", cache_salt="tenant-a")),
        "sglang-bigram": lambda: batch(S(block_hashes=[-201], parent_block_hash=None,
                                         token_ids=[(1, 2), (2, 3), (3, 4), (4, 5)], block_size=4, lora_id=None,
                                         medium="GPU")),
        "sglang-lora": lambda: batch(S(block_hashes=[-301], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                       block_size=4, lora_id=7, medium="GPU", lora_name="sql-lora")),
    }


SHAPES = _vllm_shapes() if ENGINE == "vllm" else _sglang_shapes()


def test_every_engine_shape_is_covered() -> None:
    """Every golden shape of this engine is re-encoded here (a shape added to GOLDEN needs a builder)."""
    assert set(SHAPES) == {n for n in GOLDEN if n.startswith(ENGINE + "-")}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_engine_encodes_the_golden_bytes(name: str) -> None:
    """The engine's own types and encoder write exactly the bytes the docs and main suite hold."""
    got = msgspec.msgpack.Encoder().encode(SHAPES[name]())
    assert got.hex() == GOLDEN[name]
