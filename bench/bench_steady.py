"""A full engine's steady state in one process: this build ÷ another, alternated (issues 18 and 22).

Run: python bench/bench_steady.py --baseline DIR [--rounds 4] [--blocks 300000] [--batches 80000]

A full vLLM evicts a cached block for every block it stores (one `BlockRemoved` a block), so a router at steady
state applies as many removals as stored blocks. The stream is `bench_e2e.make_payloads(capacity=...)`'s: 4 engines,
each holding at most ``--blocks`` blocks (300,000: 1.2M index entries), vLLM 0.34.0's events byte for byte. Each
round starts one child per build, alternating which goes first; a child applies the stream's first half
(`PrefixIndex.apply_payload`, the engines fill and start evicting), then times the second half in thread CPU.
``DIR`` holds the other build's ``kvroute`` package (a copy of a checkout's ``kvroute/`` with its compiled
``_core``), put first on that child's ``PYTHONPATH``. Printed per round: each build's CPU seconds and this ÷ the
baseline; then the median ratio, beside the load average.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(path: str) -> None:
    """Apply the stream at ``path``: its first half untimed, its second half timed; print the thread CPU."""
    from kvroute import PrefixIndex, WorkerKey

    with open(path, "rb") as f:
        payloads: list[list[bytes]] = pickle.load(f)
    keys = [WorkerKey(f"engine-{s}", 0) for s in range(len(payloads))]
    index = PrefixIndex()
    n = len(payloads[0])
    for i in range(n // 2):
        for key, ps in zip(keys, payloads):
            index.apply_payload(key, ps[i])
    t0 = time.thread_time()
    for i in range(n // 2, n):
        for key, ps in zip(keys, payloads):
            index.apply_payload(key, ps[i])
    print(time.thread_time() - t0)


def _run(path: str, pythonpath: str | None) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", path],
        env=env,
        cwd=tempfile.gettempdir(),  # not the checkout: each child imports its own build
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--baseline", help="the other build's package directory (holding kvroute/)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=300_000, help="blocks each engine holds at most")
    parser.add_argument("--batches", type=int, default=80_000, help="batches in the stream (all engines)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    if not args.baseline:
        parser.error("--baseline DIR is required")
    sys.path.insert(0, str(HERE))
    from bench_e2e import make_payloads

    this = str(HERE.parent)  # this checkout's package, ahead of whatever is installed
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stream.pkl")
        payloads, blocks = make_payloads(args.batches, 4, 1, capacity=args.blocks)
        with open(path, "wb") as f:
            pickle.dump(payloads, f)
        print(f"stream: {args.batches:,} batches, {blocks:,} stored blocks, engines of {args.blocks:,} blocks")
        ratios = []
        for r in range(args.rounds):
            order = [("this", this), ("base", args.baseline)]
            if r % 2:
                order.reverse()
            cpu = {name: _run(path, pp) for name, pp in order}
            ratios.append(cpu["this"] / cpu["base"])
            load = os.getloadavg()[0]
            print(
                f"round {r + 1} ({order[0][0]} first, load {load:.1f}): second half this {cpu['this']:.3f} s,"
                f" base {cpu['base']:.3f} s; this ÷ base {ratios[-1]:.3f}"
            )
        print(f"median this ÷ base: {statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
