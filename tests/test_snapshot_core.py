"""The compiled core reads snapshot files itself (`PrefixIndex.restore`): what it refuses and how it says so.

The format's contract is tests/test_warm_restart.py's; these pin what the core's own reader adds: the
msgspec-style path of a bad value, the header's refusal taking precedence over a damaged body, and an
integer the index cannot keep refused as corruption instead of escaping as an OverflowError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvroute import BlockStored, PrefixIndex, WorkerKey
from kvroute._errors import SnapshotError
from kvroute._snapshot import Cursor, read_snapshot


def _snapshot(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    index = PrefixIndex()
    index.apply(WorkerKey("w", 0), BlockStored(block_hashes=[1, 2], token_ids=list(range(32)), block_size=16))
    index.apply(WorkerKey("v", 1), BlockStored(block_hashes=[3], token_ids=list(range(16)), block_size=16))
    path = tmp_path / "index.kvs"
    index.snapshot(path, cursors={WorkerKey("w", 0): Cursor(7, 2.5)})
    return path, msgspec.msgpack.decode(path.read_bytes())


def test_a_bad_value_is_named_with_its_path(tmp_path: Path) -> None:
    path, snap = _snapshot(tmp_path)
    snap["workers"][1][6][0] = 5  # a content key that is an int
    path.write_bytes(msgspec.msgpack.encode(snap))
    with pytest.raises(SnapshotError, match=r"corrupt: Expected `bytes`, got `int` - at `\$\.workers\[1\]\.keys\[0\]`"):
        PrefixIndex.restore(path)
    with pytest.raises(SnapshotError, match="corrupt"):
        read_snapshot(path)  # the Struct reader refuses it too


def test_the_header_is_judged_before_a_damaged_body(tmp_path: Path) -> None:
    path, snap = _snapshot(tmp_path)
    snap["workers"][0][5] = "not hashes"
    snap["hash_version"] = 1
    path.write_bytes(msgspec.msgpack.encode(snap))
    with pytest.raises(SnapshotError, match="content hash v1"):
        PrefixIndex.restore(path)


def test_an_int_past_int64_is_corrupt_not_an_overflow(tmp_path: Path) -> None:
    path, snap = _snapshot(tmp_path)
    snap["workers"][0][4] = 1 << 63  # lookahead
    path.write_bytes(msgspec.msgpack.encode(snap))
    with pytest.raises(SnapshotError, match=r"Integer value out of range - at `\$\.workers\[0\]\.lookahead`"):
        PrefixIndex.restore(path)


def test_an_inconsistent_worker_is_dropped_with_its_cursor_and_the_rest_restored(tmp_path: Path) -> None:
    path, snap = _snapshot(tmp_path)
    snap["workers"][0][6][1] = b"short"  # a malformed key of worker w
    path.write_bytes(msgspec.msgpack.encode(snap))
    index = PrefixIndex.restore(path)
    assert index.workers() == {WorkerKey("v", 1)}
    assert index.restored_cursors == {}
    assert index.num_blocks() == 1
