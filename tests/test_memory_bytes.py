"""`PrefixIndex.memory_bytes()`: the compiled tables' own size, which `sys.getsizeof` cannot see."""

from __future__ import annotations

from kvroute import BlockStored, PrefixIndex, WorkerKey


def test_memory_bytes_follows_the_tables() -> None:
    index = PrefixIndex()
    empty = index.memory_bytes()
    w = WorkerKey("w", 0)
    n, per = 20_000, 32
    for first in range(1, n + 1, per):
        parent = first - 1 if first > 1 else None
        hashes = list(range(first, first + per))
        index.apply(w, BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(16 * per)),
                                   block_size=16))
    full = index.memory_bytes()
    # Each entry costs at least its key record (24 bytes), its id in the key index and its engine-hash entry
    # (12 bytes); no table may waste more than its growth slack (both ends double: at most ~2x the least).
    assert 40 * n < full - empty < 100 * n
    index.remove_worker(w)
    # The worker's maps are freed; the shared key table keeps its capacity for the next keys.
    assert index.memory_bytes() < full
