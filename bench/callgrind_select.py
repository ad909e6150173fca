"""Instructions per call of one `bench_select.py` fleet call, for callgrind (repeatable on a loaded machine).

Restores the fleet snapshot ``bench_select.py --baseline`` writes (1,024 workers, 1M entries; built here when
missing), builds the fleet figure's routers and calls the one named ``N`` times between two markers callgrind
can zero and dump its counters at, so the dump holds the loop alone::

    valgrind --tool=callgrind --zero-before=os_getppid --dump-before=os_getegid \\
        .venv/bin/python bench/callgrind_select.py "select, client+loads" 200
    callgrind_annotate callgrind.out.<pid>.1      # the loop's instructions: its total ÷ N per call

Run it for each build (another venv's Python runs this file as well) to compare them call by call. Without
valgrind it prints the loop's mean wall time per call (noisy: use ``bench_select.py --baseline`` for time).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

from kvroute import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_select as bs  # the fleet figure's shape and calls


def main() -> None:
    """Parse the options, restore the fleet and run the marked loop."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("call", nargs="?", default="select, client+loads", help="a fleet call's name (bench_select.py)")
    ap.add_argument("n", nargs="?", type=int, default=200, help="calls in the marked loop (default 200)")
    ap.add_argument("--snapshot", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "bench_select_fleet_1024_1000000.snap"))
    args = ap.parse_args()
    rng, prompt, workers, depths = bs.fleet_shape(1024)
    if not os.path.exists(args.snapshot):
        index = PrefixIndex()
        bs.fill(index, workers, 1_000_000, prompt, depths)
        index.snapshot(args.snapshot)
    index = PrefixIndex.restore(args.snapshot)
    calls = bs.fleet_calls(index, rng, prompt, workers)
    if args.call not in calls:
        ap.error(f"no such call; one of: {', '.join(calls)}")
    fn = calls[args.call]
    # the setup's objects out of the collector's way: a full collection inside the loop is ~36 ms
    gc.collect()
    gc.freeze()
    for _ in range(50):  # warm: the kept live set and the records' adopted keys, as in a running router
        fn()
    os.getppid()  # callgrind: --zero-before=os_getppid
    t0 = time.perf_counter()
    for _ in range(args.n):
        fn()
    t1 = time.perf_counter()
    os.getegid()  # callgrind: --dump-before=os_getegid
    print(f"{args.call}: {(t1 - t0) / args.n * 1e6:.1f} µs a call (mean of {args.n})", file=sys.stderr)


if __name__ == "__main__":
    main()
