"""Test helpers for socket tests: a seeded engine workload, ground-truth indexes, and index comparisons."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import anyio
import zmq

from kvroute import _zmq
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey
from kvroute._wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent
from kvroute.sim._publisher import EventPublisher

BLOCK_SIZE = 4


class Workload:
    """A seeded stand-in for an engine's cache activity: chains stored, leaves evicted.

    Every batch it makes is valid for an engine to send (removals name held blocks). It
    remembers each stored chain's full token prefix as a query for index comparisons.
    """

    def __init__(self, seed: int, *, block_size: int = BLOCK_SIZE, evict_rate: float = 0.2) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.evict_rate = evict_rate
        # engine hash -> (token prefix up to and including that block)
        self.held: dict[int, tuple[int, ...]] = {}
        self.queries: list[tuple[int, ...]] = []

    def batch(self, max_blocks: int = 4) -> list[EngineEvent]:
        """One engine step: store a chain (extending a held block half the time), sometimes evict one."""
        rng = self.rng
        events: list[EngineEvent] = []
        parent: int | None = None
        prefix: tuple[int, ...] = ()
        if self.held and rng.random() < 0.5:
            parent = rng.choice(list(self.held))
            prefix = self.held[parent]
        n = rng.randint(1, max_blocks)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        tokens = [rng.randrange(50_000) for _ in range(n * self.block_size)]
        events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                medium="GPU",
            )
        )
        for i, h in enumerate(hashes):
            self.held[h] = prefix + tuple(tokens[: (i + 1) * self.block_size])
        self.queries.append(self.held[hashes[-1]])
        if self.held and rng.random() < self.evict_rate:
            victim = rng.choice(list(self.held))
            del self.held[victim]
            events.append(BlockRemoved(block_hashes=[victim], medium="GPU"))
        return events

    def clear(self) -> list[EngineEvent]:
        """An AllBlocksCleared step."""
        self.held.clear()
        return [AllBlocksCleared()]


def truth_index(publishers: Mapping[WorkerKey, EventPublisher]) -> PrefixIndex:
    """The index each publisher's full history (its current process) implies: the ground truth."""
    index = PrefixIndex()
    for key, pub in publishers.items():
        for batch in pub.history:
            index.apply_batch(key, batch)
    return index


def _scores(index: PrefixIndex, query: Sequence[int]) -> dict[WorkerKey, int]:
    return {w: s for w, s in index.find_matches(query).items() if s}


def assert_index_equal(index: PrefixIndex, truth: PrefixIndex, queries: Iterable[Sequence[int]]) -> None:
    """Same workers, same block counts, same scores for every query."""
    assert index.workers() == truth.workers()
    for w in truth.workers():
        assert index.num_blocks(w) == truth.num_blocks(w), w
    for q in queries:
        assert _scores(index, q) == _scores(truth, q), q


def assert_index_subset(index: PrefixIndex, truth: PrefixIndex, queries: Iterable[Sequence[int]]) -> None:
    """The index claims nothing the truth does not: never more blocks, never a longer match."""
    assert index.workers() <= truth.workers()
    for w in index.workers():
        assert index.num_blocks(w) <= truth.num_blocks(w), w
    for q in queries:
        got, want = _scores(index, q), _scores(truth, q)
        for w, s in got.items():
            assert s <= want.get(w, 0), (w, q)


async def recv_frames(sock: zmq.Socket[bytes], count: int) -> list[list[bytes]]:
    """Read exactly ``count`` messages from a raw socket (fails the test after 5 s)."""
    out: list[list[bytes]] = []
    with anyio.fail_after(5):
        while len(out) < count:
            out.extend(await _zmq.recv_many(sock, count - len(out)))
    return out


async def nothing_arrives(sock: zmq.Socket[bytes], wait: float) -> bool:
    """True when no message reaches ``sock`` within ``wait`` seconds."""
    with anyio.move_on_after(wait):
        await _zmq.wait_readable(sock)
        return False
    return True
