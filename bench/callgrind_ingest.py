"""Instructions per block of ingest through `PrefixIndex.apply_payload`, for callgrind (repeatable on a loaded machine).

Builds one of two payload streams and applies all of it to an empty index between two markers callgrind can
zero and dump its counters at, so the dump holds the fill alone::

    valgrind --tool=callgrind --zero-before=os_getppid --dump-before=os_getegid \\
        .venv/bin/python bench/callgrind_ingest.py dynamo
    callgrind_annotate callgrind.out.<pid>.1      # the fill's instructions: its total ÷ the blocks printed

Streams: ``dynamo`` is `bench_vs_dynamo.py`'s ingest (16 workers x 12 sequences x 512 blocks, one map-form
store a batch); ``core`` is `bench_core.py`'s (16 workers, 1-4 events of 1-32 blocks a batch, 70 % chained on an
earlier block). ``--msgspec`` marks a bare ``msgspec.msgpack.decode`` of the same payloads instead: the issue-18
ratio's denominator in instructions. The stream is generated with a fixed seed, so every build (another venv's
Python runs this file as well) sees the same bytes. Without valgrind it prints the fill's wall time (noisy).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import msgspec

from kvroute import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_index  # the `core` stream's shape
import bench_vs_dynamo  # the `dynamo` stream's shape


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
    ap.add_argument("stream", nargs="?", default="dynamo", choices=("dynamo", "core"))
    ap.add_argument("--msgspec", action="store_true", help="mark a bare msgspec decode of the payloads instead")
    args = ap.parse_args()
    pairs, blocks = stream(args.stream)
    decode = msgspec.msgpack.decode
    # A first fill: the allocator's arenas and the code's pages as a running process has them.
    warm = PrefixIndex()
    for w, p in pairs:
        warm.apply_payload(w, p)
        decode(p)
    del warm
    gc.collect()
    gc.disable()
    index = PrefixIndex()
    apply = index.apply_payload
    os.getppid()  # callgrind: --zero-before=os_getppid
    t0 = time.perf_counter()
    if args.msgspec:
        for _, p in pairs:
            decode(p)
    else:
        for w, p in pairs:
            apply(w, p)
    t1 = time.perf_counter()
    os.getegid()  # callgrind: --dump-before=os_getegid
    assert args.msgspec or index.num_blocks() == blocks, (index.num_blocks(), blocks)
    what = "msgspec decode" if args.msgspec else "apply_payload"
    print(f"{args.stream}: {blocks:,} blocks, {len(pairs):,} payloads; {what} {(t1 - t0) * 1e3:.1f} ms "
          f"({blocks / (t1 - t0) / 1e6:.2f}M blocks/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
