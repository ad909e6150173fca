"""The core's snapshot writer (`kvroute._snapshot.encode_snapshot`): the relay's and replica's snapshots, no file."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvroute import BlockRemoved, BlockStored, EventBatch, PrefixIndex, WorkerKey, encode_batch
from kvroute._snapshot import Cursor, _Snapshot, encode_snapshot


def _stored(hashes: list[int | bytes], parent: int | None, medium: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(4 * len(hashes))),
        block_size=4,
        medium=medium,
    )


def _index() -> PrefixIndex:
    index = PrefixIndex()
    events = [
        _stored([1, 2, 2**64 - 1], None),
        _stored([b"\x01" * 8], 2),
        _stored([1], None, medium="CPU"),  # an off-GPU copy of a block also held on GPU
        BlockRemoved(block_hashes=[2**64 - 1]),
    ]
    index.apply_payload(WorkerKey("a", 0), encode_batch(EventBatch(1.0, events, 0)))
    index.apply_payload(WorkerKey("b", 1), encode_batch(EventBatch(2.0, [_stored([5, 6], None)], 0)))
    return index


def test_the_core_writes_msgspecs_bytes_of_the_file_the_index_writes(tmp_path: Path) -> None:
    index = _index()
    cursors = {WorkerKey("a", 0): Cursor(41, 1.0), WorkerKey("b", 1): Cursor(2**63 + 5, 2.0)}
    data = encode_snapshot(index._core, cursors)
    snap = msgspec.msgpack.decode(data, type=_Snapshot)
    # Exactly msgspec's encoding of what it holds (every field, the same int and map forms).
    assert msgspec.msgpack.encode(snap) == data
    index.snapshot(tmp_path / "s", cursors=cursors)
    written = msgspec.msgpack.decode((tmp_path / "s").read_bytes(), type=_Snapshot)
    assert (snap.workers, snap.cursors) == (written.workers, written.cursors)
    assert (snap.format, snap.version, snap.hash_version) == (written.format, written.version, written.hash_version)
    assert sum(len(w.hashes) for w in snap.workers) == 5


def test_the_bytes_restore_the_same_index(tmp_path: Path) -> None:
    index = _index()
    cursors = {WorkerKey("a", 0): Cursor(3, 1.5)}
    path = tmp_path / "s"
    path.write_bytes(encode_snapshot(index._core, cursors))
    back = PrefixIndex.restore(path)
    assert back.restored_cursors == cursors
    assert back.stats().entries == index.stats().entries
    for w in (WorkerKey("a", 0), WorkerKey("b", 1)):
        assert back.num_blocks(w) == index.num_blocks(w)
    tokens = list(range(12))
    got, want = back.find_matches(tokens), index.find_matches(tokens)
    assert [got[w] for w in (WorkerKey("a", 0), WorkerKey("b", 1))] == [
        want[w] for w in (WorkerKey("a", 0), WorkerKey("b", 1))
    ]
    assert want[WorkerKey("a", 0)] > 0
