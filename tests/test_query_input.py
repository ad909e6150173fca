"""A query's token ids, checked up front (issue 18): every form the core reads them in.

Lists of exact ints are read straight from CPython's object layouts (src/py/index/convert.rs) and
typed uint32 buffers through the buffer protocol; anything else goes through the C API. Each form
must accept exactly the ints in [0, 2**32) and name the first bad position otherwise, every time,
whatever the index holds.
"""

from __future__ import annotations

import enum
import re
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._index import PrefixIndex, QueryError
from kvroute._models import WorkerKey
from kvroute._router import Router, RouterError
from kvroute._wire import BlockStored

W = WorkerKey("w", 0)
BOUNDARY = [0, 1, 255, 256, 2**15, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**32 - 2, 2**32 - 1]


def _index(tokens: list[int], block_size: int = 2) -> PrefixIndex:
    idx = PrefixIndex()
    n = len(tokens) // block_size
    idx.apply(W, BlockStored(block_hashes=list(range(1, n + 1)), token_ids=tokens[: n * block_size],
                             block_size=block_size))
    return idx


def test_ints_at_every_digit_boundary_read_as_their_values() -> None:
    idx = _index(BOUNDARY[:10])
    assert idx.find_matches(BOUNDARY) == {W: 5}
    assert idx.find_matches(array("I", BOUNDARY)) == {W: 5}
    assert idx.find_matches(np.array(BOUNDARY, dtype=np.uint32)) == {W: 5}
    # one token off in the last held block: the match stops before it
    assert idx.find_matches([*BOUNDARY[:9], 2**30 + 7]) == {W: 4}


@pytest.mark.parametrize("bad", [2**32, 2**32 + 1, 2**33, 2**60, 2**62, 2**64, 2**100, -1, -(2**30), -(2**64)])
@pytest.mark.parametrize("at", [0, 5, 4095])
def test_an_int_outside_uint32_is_refused_at_its_position(bad: int, at: int) -> None:
    tokens = list(range(4096))
    idx = _index(tokens[:64])
    tokens[at] = bad
    for _ in range(2):
        with pytest.raises(QueryError, match=re.escape(f"token_ids[{at}]")):
            idx.find_matches(tokens)


class _Tok(enum.IntEnum):
    A = 7


class _Index:
    """Not an int, but an index: accepted through the C API (as `array('I')` accepts it)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


@pytest.mark.parametrize(
    "odd",
    [True, _Tok.A, np.uint32(7), np.int64(7), _Index(7)],
    ids=["bool", "IntEnum", "np.uint32", "np.int64", "index"],
)
def test_int_like_tokens_take_the_checked_path(odd: Any) -> None:
    v = int(odd)
    idx = _index([1, 2, v, 3])
    # One token past the held blocks: the engines never serve a prompt's last token from cache.
    assert idx.find_matches([1, 2, odd, 3, 0]) == idx.find_matches([1, 2, v, 3, 0]) == {W: 2}


@pytest.mark.parametrize("bad", [1.0, "2", b"3", None, [4], np.float32(1), _Index(-1), _Index(2**32)])
def test_non_int_tokens_are_refused_at_their_position(bad: Any) -> None:
    with pytest.raises(QueryError, match=re.escape("token_ids[3]")):
        PrefixIndex().find_matches([1, 2, 3, bad, 5])


def test_a_list_changed_while_it_is_read_is_still_checked() -> None:
    tokens: list[Any] = [1, 2, 3, 4]

    class Grow:
        def __index__(self) -> int:
            tokens.extend([2**40] * 100)  # Python code run mid-read may grow the list
            return 9

    tokens.append(Grow())
    with pytest.raises(QueryError, match=re.escape("token_ids[5]")):
        PrefixIndex().find_matches(tokens)


def test_typed_buffers() -> None:
    held = list(range(100, 164))
    idx = _index(held)
    toks = [*held, 0]  # one token past the held blocks (the last token is never served from cache)
    want = {W: 32}
    assert idx.find_matches(array("I", toks)) == want
    assert idx.find_matches(np.asarray(toks, dtype=np.uint32)) == want
    assert idx.find_matches(memoryview(array("I", toks))) == want
    assert idx.find_matches(np.asarray(toks, dtype=np.int64)) == want  # other int buffers: one by one
    strided = np.asarray([t for t in toks for _ in range(2)], dtype=np.uint32)[::2]
    assert idx.find_matches(strided) == want  # not contiguous: read item by item
    with pytest.raises(QueryError, match=re.escape("token_ids[0]")):
        idx.find_matches(np.asarray(held, dtype=np.uint32).reshape(8, 8))  # 2-D: its rows are not tokens
    with pytest.raises(QueryError, match=re.escape("token_ids[1]")):
        idx.find_matches(np.asarray([5, -6], dtype=np.int32))
    with pytest.raises(QueryError, match="token_ids"):
        idx.find_matches(bytearray(b"\x01\x02\x03\x04"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(-(2**70), 2**70)), max_size=80))
def test_every_form_accepts_exactly_the_uint32_tokens(tokens: list[int]) -> None:
    held = [t for t in tokens if 0 <= t < 2**32][:16]
    idx = _index(held)
    router = Router(idx)
    router.add_worker(W)
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < 2**32), None)
    if bad is None:
        want = idx.find_matches(array("I", tokens))
        assert idx.find_matches(tokens) == idx.find_matches(tuple(tokens)) == want
        assert router.select(tokens).overlap_blocks == want.get(W, 0)
    else:
        for form in (tokens, tuple(tokens), iter(tokens)):
            with pytest.raises(QueryError, match=re.escape(f"token_ids[{bad}]")):
                idx.find_matches(form)
        with pytest.raises(RouterError, match=re.escape(f"token_ids[{bad}]")):
            router.select(tokens)


@pytest.mark.parametrize("offset", range(5))
def test_every_token_of_a_list_is_read_as_its_value_whatever_its_neighbours(offset: int) -> None:
    # Lists are read four tokens at a time while all four are one-digit ints, one at a time
    # otherwise (a zero, a two-digit int, the tail): every token must come out right in each case.
    pattern = [5, 0, 7, 2**30 + 3, 9, 11, 13, 2**32 - 1, 0, 0, 17, 19, 23, 29, 31, 37, 41]
    tokens = ([3] * offset + pattern * 4)[:64]
    idx = _index(tokens)
    # the whole prompt held: one block short of it (the engine never serves the last token)
    assert idx.find_matches(tokens) == idx.find_matches(array("I", tokens)) == {W: 31}
    for j in range(len(tokens) - 2):
        changed = list(tokens)
        changed[j] = tokens[j] + 1 if tokens[j] < 2**32 - 1 else 0
        assert idx.find_matches(changed) == ({W: j // 2} if j >= 2 else {}), j
