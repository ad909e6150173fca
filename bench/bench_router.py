"""Benchmark: Router.select against PrefixIndex.find_matches alone, over a 1,000,000-entry index.

For each fleet size the index is filled to ``--entries`` (block, worker) entries: a quarter of
the workers hold a prefix of the query prompt (random depths, one holding all of it, as a
shared system prompt or document would spread), and every worker holds random chains to fill
its share. Two queries of ``--tokens`` tokens: *deep* (some worker holds the whole prompt, so
find_matches hashes all of it) and *shallow* (no worker holds more than 16 blocks of it, so
find_matches stops early and the router's own overhead weighs most).

Measured per query, interleaved in one loop so drift hits all alike: find_matches alone;
select on an idle fleet (no load tracked); select with load tracked on every worker (the
steady state of a busy router). Times are this thread's CPU time per call (``--clock wall``
for elapsed time, which other processes on a shared machine disturb). Prints p50 / p99 in
microseconds and the ratio select / find_matches for each. The aim is select <= 1.20 x
find_matches at 64 workers.

Run: ``.venv/bin/python bench/bench_router.py [--workers 64 1024] [--entries 1000000]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from kvroute import BlockStored, PrefixIndex, Router, WorkerKey

BLOCK_SIZE = 16
CHAIN_BLOCKS = 128  # blocks per filler chain: a long prompt's worth
VOCAB = 128_000


def _fill(
    index: PrefixIndex, workers: list[WorkerKey], entries: int, query: list[int], max_depth: int, rng: random.Random
) -> None:
    """Give the workers ``entries`` blocks in all; a quarter hold a prefix of ``query`` up to ``max_depth`` blocks."""
    per_worker = entries // len(workers)
    holders = workers[: max(1, len(workers) // 4)]
    next_hash = 1
    for i, w in enumerate(workers):
        held = 0
        if w in holders:
            depth = max_depth if i == 0 else rng.randint(1, max_depth)
            depth = min(depth, per_worker)
            index.apply(
                w,
                BlockStored(
                    block_hashes=list(range(next_hash, next_hash + depth)),
                    token_ids=query[: depth * BLOCK_SIZE],
                    block_size=BLOCK_SIZE,
                ),
            )
            next_hash += depth
            held = depth
        while held < per_worker:
            n = min(CHAIN_BLOCKS, per_worker - held)
            index.apply(
                w,
                BlockStored(
                    block_hashes=list(range(next_hash, next_hash + n)),
                    token_ids=[rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)],
                    block_size=BLOCK_SIZE,
                ),
            )
            next_hash += n
            held += n


def _pct(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _measure(fns: dict[str, Callable[[], object]], iters: int, clock: Callable[[], int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            out[name].append(clock() - t0)
    return out


def run(n_workers: int, entries: int, tokens: int, iters: int, seed: int, clock: Callable[[], int]) -> None:
    rng = random.Random(seed)
    workers = [WorkerKey(f"engine-{i // 8}", i % 8) for i in range(n_workers)]
    deep_q = [rng.randrange(VOCAB) for _ in range(tokens)]
    shallow_q = [rng.randrange(VOCAB) for _ in range(tokens)]
    index = PrefixIndex()
    t0 = time.perf_counter()
    # The deep query's holders fill the index; the shallow one shares the first 16 blocks with a few.
    _fill(index, workers, entries, deep_q, tokens // BLOCK_SIZE, rng)
    next_hash = 1 << 62  # above every filler hash
    for w in workers[-max(1, n_workers // 16) :]:
        depth = rng.randint(1, 16)
        next_hash += depth
        index.apply(
            w,
            BlockStored(
                block_hashes=list(range(next_hash - depth, next_hash)),
                token_ids=shallow_q[: depth * BLOCK_SIZE],
                block_size=BLOCK_SIZE,
            ),
        )
    build = time.perf_counter() - t0
    idle = Router(index, block_size=BLOCK_SIZE, seed=seed)
    busy = Router(index, block_size=BLOCK_SIZE, seed=seed)
    for i, w in enumerate(workers):
        for j in range(4):  # four running requests per worker, of varied uncached lengths
            busy.on_start((i, j), w, deep_q[: rng.randrange(256, 4096)])
    print(
        f"\n{n_workers} workers, {index.num_blocks():,} entries "
        f"({index.stats().distinct_keys:,} distinct blocks), built in {build:.1f} s; "
        f"{tokens}-token prompt, {iters} iterations"
    )
    print(f"  {'query':8} {'measure':24} {'p50 us':>9} {'p99 us':>9} {'p50 x':>7} {'p99 x':>7}")
    for label, q in (("deep", deep_q), ("shallow", shallow_q)):
        fns: dict[str, Callable[[], object]] = {
            "find_matches": partial(index.find_matches, q),
            "select (idle fleet)": partial(idle.select, q),
            "select (loaded fleet)": partial(busy.select, q),
        }
        for fn in fns.values():  # warm-up
            fn()
        got = _measure(fns, iters, clock)
        base50, base99 = _pct(got["find_matches"], 0.5), _pct(got["find_matches"], 0.99)
        matched = max(index.find_matches(q).values(), default=0)
        for name, samples in got.items():
            p50, p99 = _pct(samples, 0.5), _pct(samples, 0.99)
            print(f"  {label:8} {name:24} {p50:9.1f} {p99:9.1f} {p50 / base50:7.2f} {p99 / base99:7.2f}")
        print(
            f"  {label:8} longest match {matched} blocks; mean find_matches "
            f"{statistics.fmean(got['find_matches']) / 1000:.1f} us"
        )


def main() -> None:
    """Parse arguments and run the benchmark for each fleet size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: this thread's CPU time per call (immune to other processes on a shared machine); wall: elapsed",
    )
    args = parser.parse_args()
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    print(f"clock: {args.clock}")
    for n in args.workers:
        run(n, args.entries, args.tokens, args.iters, args.seed, clock)


if __name__ == "__main__":
    main()
