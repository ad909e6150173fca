"""Instructions per block of ingest through `PrefixIndex.apply_payload`, for callgrind (repeatable on a loaded machine).

Builds one of two payload streams and applies all of it to an empty index between two markers callgrind can
zero and dump its counters at, so the dump holds the fill alone::

    valgrind --tool=callgrind --zero-before=os_getppid --dump-before=os_getegid \\
        .venv/bin/python bench/callgrind_ingest.py dynamo
    callgrind_annotate callgrind.out.<pid>.1      # the fill's instructions: its total ÷ the blocks printed

Streams: ``dynamo`` is `bench_vs_dynamo.py`'s ingest (16 workers x 12 sequences x 512 blocks, one map-form store a
batch); ``sized`` the same stores into an index at its working size (`bench_vs_dynamo.WorkingSize`); ``core`` is
`bench_core.py`'s (16 workers, 1-4 events of 1-32 blocks a batch, 70 % chained on an earlier block); ``at1M`` is
`bench_fill.py`'s ``at1M`` case (4 workers, `bench_e2e.py`'s batch shape): its first 1M stored blocks fill the index
before the first marker (939,805 entries after the stream's removals), and only the next 131,116 blocks are marked.
Its payloads are built once and kept in ``--cache``: building them under valgrind takes many minutes. For cache
misses, run it under callgrind with ``--cache-sim=yes`` (cachegrind's simulator, with the markers) and
``--LL=33554432,16,64`` (valgrind misreads this machine's L3): ``DLmr + DLmw`` ÷ the blocks printed are last-level
misses a block. The simulator ignores prefetch instructions: it counts misses, not whether they overlap.
``--msgspec`` marks a bare ``msgspec.msgpack.decode`` of the same payloads instead: the issue-18 ratio's denominator
in instructions. The stream is generated with a fixed seed, so every build (another venv's Python runs this file as
well) sees the same bytes. Without valgrind it prints the fill's wall time (noisy).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time
from pathlib import Path

import msgspec

from kvroute import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_index  # the `core` stream's shape
import bench_vs_dynamo  # the `dynamo` stream's shape


def at1m(cache: str) -> tuple[list[tuple[object, bytes]], int, int]:
    """`bench_fill.py`'s ``at1M`` stream (read from ``cache`` when it exists): pairs, first timed one, timed blocks."""
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            got: tuple[list[tuple[object, bytes]], int, int] = pickle.load(f)
        return got
    import bench_fill

    got = bench_fill.replica_payloads(1_000_000, 131_072, 22)
    with open(cache, "wb") as f:
        pickle.dump(got, f)
    return got


def stream(name: str) -> tuple[list[tuple[object, bytes]], int]:
    """The named stream's (worker, payload) pairs and its blocks."""
    if name == "dynamo":
        wl = bench_vs_dynamo.make_workload(16, 12, 512, seed=1)
        return [(w, p) for w, _, p in wl.payloads], wl.blocks
    s = bench_index.make_stream(24_576, 16, 1, medium=None)
    return [(w, p) for w, p, _ in s], sum(n for _, _, n in s)


def main() -> None:
    """Parse the options, build the stream, warm up, and run the marked fill."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stream", nargs="?", default="dynamo", choices=("dynamo", "sized", "core", "at1M"))
    ap.add_argument("--msgspec", action="store_true", help="mark a bare msgspec decode of the payloads instead")
    ap.add_argument("--cache", default="/tmp/kvroute_at1M_payloads.pickle",
                    help="where the at1M stream's payloads are kept between runs")
    args = ap.parse_args()
    decode = msgspec.msgpack.decode
    if args.stream == "at1M":
        marked_at1m(args.cache, args.msgspec)
        return
    if args.stream == "sized":
        marked_sized(args.msgspec)
        return
    pairs, blocks = stream(args.stream)
    # A first fill: the allocator's arenas and the code's pages as a running process has them.
    warm = PrefixIndex()
    for w, p in pairs:
        warm.apply_payload(w, p)
        decode(p)
    del warm
    index = PrefixIndex()
    took = marked(index, pairs, args.msgspec)
    assert args.msgspec or index.num_blocks() == blocks, (index.num_blocks(), blocks)
    what = "msgspec decode" if args.msgspec else "apply_payload"
    print(f"{args.stream}: {blocks:,} blocks, {len(pairs):,} payloads; {what} {took * 1e3:.1f} ms "
          f"({blocks / took / 1e6:.2f}M blocks/s)", file=sys.stderr)


def marked(index: PrefixIndex, pairs: list[tuple[object, bytes]], bare: bool) -> float:
    """Apply ``pairs`` to ``index`` (or, ``bare``, only decode them) between callgrind's markers; wall seconds."""
    gc.collect()
    gc.disable()
    apply, decode = index.apply_payload, msgspec.msgpack.decode
    os.getppid()  # callgrind: --zero-before=os_getppid
    t0 = time.perf_counter()
    if bare:
        for _, p in pairs:
            decode(p)
    else:
        for w, p in pairs:
            apply(w, p)
    t1 = time.perf_counter()
    os.getegid()  # callgrind: --dump-before=os_getegid
    return t1 - t0


def marked_sized(bare: bool) -> None:
    """The ``dynamo`` stream into an index at its working size (`bench_vs_dynamo.WorkingSize`), marked."""
    wl = bench_vs_dynamo.make_workload(16, 12, 512, seed=1)
    sized = bench_vs_dynamo.WorkingSize(wl)
    sized.remove()
    pairs = [(w, p) for w, _, p in wl.payloads]
    took = marked(sized.index, pairs, bare)
    what = "msgspec decode" if bare else "apply_payload"
    print(f"sized: {wl.blocks:,} blocks, {len(pairs):,} payloads into an index at its working size; {what} "
          f"{took * 1e3:.1f} ms ({wl.blocks / took / 1e6:.2f}M blocks/s)", file=sys.stderr)


def marked_at1m(cache: str, bare: bool) -> None:
    """Fill an index to 1M entries, then apply (or, ``bare``, only decode) the next 131,072 blocks between markers."""
    pairs, timed_from, blocks = at1m(cache)
    index = PrefixIndex()
    apply = index.apply_payload
    for w, p in pairs[:timed_from]:
        apply(w, p)
    timed = pairs[timed_from:]
    entries = index.num_blocks()
    took = marked(index, timed, bare)
    what = "msgspec decode" if bare else "apply_payload"
    print(f"at1M: {blocks:,} blocks, {len(timed):,} payloads at {entries:,} entries; {what} "
          f"{took * 1e3:.1f} ms ({blocks / took / 1e6:.2f}M blocks/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
