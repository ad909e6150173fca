"""Warm start vs cold replay for a ~1,000,000-entry index, through real publishers and replay buffers.

Run: python bench/bench_warm_start.py [--entries N] [--sources S] [--gap G] [--backend asyncio|trio]

Four in-process `EventPublisher`s (loopback TCP, PUB + ROUTER replay buffers deep enough to hold
their whole history) publish vLLM-like batches (1-4 BlockStored events of 1-32 blocks of 16
tokens, 70% extending an open chain) until the history stores ``--entries`` blocks. Then:

1. a first router follows them from cold (replay of the whole buffer) and writes a snapshot;
2. it stops, and each engine publishes ``--gap`` more batches meanwhile;
3. warm start: `PrefixIndex.restore` + a client resuming every source (identity check against
   the live replay buffer, replay of the gap only) until every source is synced at its newest
   batch; timed from before the restore;
4. cold replay: a fresh client replays the same, complete history from the buffers; timed
   from construction to the same point.

The two indexes must come out equal (entries, distinct keys, scores of every open chain).
Prints both times, their ratio, and the snapshot's write time and size.

Restore alone (``--restore-only`` measures just this, on an index built in-process): the best of
three `PrefixIndex.restore` of the snapshot (and its process CPU time, which a loaded machine
stretches less than wall time), beside the best of three bare reads of the same file
(``Path.read_bytes``) and bare ``msgspec.msgpack.decode`` of its bytes into Python objects, as
same-run ratios.
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import msgspec

from kvroute import BlockStored, EventBatch, EventStream, KvEventClient, PrefixIndex, WorkerKey
from kvroute.sim import EventPublisher

BS = 16
VOCAB = 150_000
#: Open chains per source (conversations being extended), as in bench_e2e's generator.
OPEN_CHAINS = 64
#: A chain longer than this many tokens is closed and a new one started (a long context).
MAX_CHAIN_TOKENS = 32 * 1024


class Chains:
    """One source's seeded workload: batches of chained BlockStored events, and the open chains' tokens."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.open: list[tuple[int, list[int]]] = []  # (tail hash, every token of the chain)

    def batch(self, ts: float, rank: int) -> tuple[EventBatch, int]:
        """One engine step; returns it and the number of blocks it stores."""
        rng = self.rng
        events = []
        stored = 0
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 32)
            tokens = [rng.randrange(VOCAB) for _ in range(n * BS)]
            hashes = [rng.getrandbits(64) for _ in range(n)]
            pick = rng.randrange(len(self.open)) if self.open and rng.random() < 0.7 else None
            if pick is not None and len(self.open[pick][1]) + len(tokens) <= MAX_CHAIN_TOKENS:
                parent, chain = self.open[pick]
                self.open[pick] = (hashes[-1], chain + tokens)
            else:
                parent = None
                if len(self.open) >= OPEN_CHAINS:
                    self.open.pop(rng.randrange(len(self.open)))
                self.open.append((hashes[-1], tokens))
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS))
            stored += n
        return EventBatch(ts, events, rank), stored


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def settle(client: KvEventClient, stream: EventStream, last: dict[WorkerKey, int]) -> None:
    """Wait (reading ``stream``) until every source is synced at its seq in ``last``."""

    def done() -> bool:
        per = client.stats().sources
        return all(k in per and per[k].last_seq == s and per[k].state == "synced" for k, s in last.items())

    while not done():
        await stream.__anext__()


def restore_figure(path: Path, index: PrefixIndex) -> float:
    """Print restore's best time and its ratios to a bare read and a bare decode of the same file; returns it."""
    reads, decodes, restores, cpu = [], [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        data = path.read_bytes()
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        msgspec.msgpack.decode(data)
        decodes.append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.process_time()
        restored = PrefixIndex.restore(path)
        restores.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        assert restored.stats().entries == index.stats().entries
        del restored
    r, d, s = min(reads), min(decodes), min(restores)
    print(
        f"restore ({index.num_blocks():,} entries, {path.stat().st_size / 1e6:.1f} MB, best of 3): {s:.3f} s;"
        f" (CPU {min(cpu):.3f} s); bare read {r:.3f} s, bare msgspec decode {d:.3f} s;"
        f" restore / read {s / r:.1f}, restore / decode {s / d:.2f}"
    )
    return s


def restore_only(args: argparse.Namespace) -> None:
    """The restore figure alone, on an index built in-process from bench_index's stream."""
    import bench_index

    index = PrefixIndex()
    for worker, payload, _ in bench_index.make_stream(args.entries, 16, args.seed, medium=None):
        index.apply_payload(worker, payload)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index.kvs"
        t0 = time.perf_counter()
        index.snapshot(path)
        print(f"snapshot: written in {time.perf_counter() - t0:.2f} s")
        restore_figure(path, index)


def same(a: PrefixIndex, b: PrefixIndex, queries: Sequence[Sequence[int]]) -> None:
    """Fail loudly unless both indexes hold the same entries and answer every query alike."""
    assert a.stats() == b.stats(), (a.stats(), b.stats())
    for w in a.workers() | b.workers():
        assert a.num_blocks(w) == b.num_blocks(w), w
    for q in queries:
        assert dict(a.find_matches(q)) == dict(b.find_matches(q)), "indexes disagree"


async def main(args: argparse.Namespace) -> None:
    n_src = args.sources
    per_source = args.entries // n_src
    async with AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(
                EventPublisher(buffer_steps=args.buffer_steps, data_parallel_rank=r, keep_history=False)
            )
            for r in range(n_src)
        ]
        sources = [p.source(f"engine-{i}", dp_rank=0) for i, p in enumerate(pubs)]
        chains = [Chains(args.seed + i) for i in range(n_src)]
        t0 = time.perf_counter()
        stored = [0] * n_src
        ts = 1_700_000_000.0
        for i, (pub, ch) in enumerate(zip(pubs, chains)):
            while stored[i] < per_source:
                ts += 0.001
                batch, n = ch.batch(ts, 0)
                pub.publish_batch(batch)
                stored[i] += n
        batches = [p.next_seq for p in pubs]
        if max(batches) > args.buffer_steps:
            raise SystemExit(
                f"{max(batches)} batches do not fit a {args.buffer_steps}-batch buffer: raise --buffer-steps"
            )
        print(
            f"history: {sum(stored):,} blocks in {sum(batches):,} batches over {n_src} sources"
            f" (built in {time.perf_counter() - t0:.1f} s)"
        )

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "index.kvs"
            # 1. A first router life: cold start, then a snapshot.
            t0 = time.perf_counter()
            async with KvEventClient(sources) as client:
                stream = client.events(buffer=16)
                await settle(client, stream, {s.key: p.next_seq - 1 for s, p in zip(sources, pubs)})
                first_cold = time.perf_counter() - t0
                entries = client.index.num_blocks()
                t0 = time.perf_counter()
                client.snapshot(path)
                snap_s = time.perf_counter() - t0
            print(f"first router: cold start {first_cold:.2f} s, {entries:,} entries, RSS peak {rss_mb():.0f} MB")
            print(f"snapshot: written in {snap_s:.2f} s, {path.stat().st_size / 1e6:.1f} MB")
            restore_figure(path, client.index)

            # 2. The router is down; the engines carry on.
            for pub, ch in zip(pubs, chains):
                for _ in range(args.gap):
                    ts += 0.001
                    pub.publish_batch(ch.batch(ts, 0)[0])
            last = {s.key: p.next_seq - 1 for s, p in zip(sources, pubs)}
            queries = [chain for ch in chains for _, chain in ch.open]

            # 3. Warm start.
            t0 = time.perf_counter()
            index = PrefixIndex.restore(path)
            restore_s = time.perf_counter() - t0
            async with KvEventClient(sources, index=index) as client:
                stream = client.events(buffer=16)
                await settle(client, stream, last)
                warm_s = time.perf_counter() - t0
                st = client.stats().totals
                assert st.resets == 0 and st.partial == 0, st
                assert st.batches == args.gap * n_src, st  # only the gap was applied
            warm = index

            # 4. Cold replay of the same, complete history.
            t0 = time.perf_counter()
            async with KvEventClient(sources) as client:
                stream = client.events(buffer=16)
                await settle(client, stream, last)
                cold_s = time.perf_counter() - t0
                cold = client.index
                st = client.stats().totals
                assert st.batches == sum(last.values()) + n_src, st
            same(warm, cold, queries)

    print(f"index after the gap: {cold.num_blocks():,} entries, {cold.stats().distinct_keys:,} distinct keys")
    print(f"warm start: {warm_s:.2f} s (restore {restore_s:.2f} s + identity check and {args.gap} batches/source)")
    print(f"cold replay: {cold_s:.2f} s ({sum(last.values()) + n_src:,} batches)")
    print(f"cold / warm: {cold_s / warm_s:.1f}x; indexes equal; RSS peak {rss_mb():.0f} MB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000, help="blocks stored in the history (default 1e6)")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--gap", type=int, default=100, help="batches per source published while the router is down")
    parser.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer depth (vLLM's default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--restore-only", action="store_true", help="only the restore figure (no publishers)")
    args = parser.parse_args()
    if args.restore_only:
        restore_only(args)
    else:
        anyio.run(main, args, backend=args.backend)
