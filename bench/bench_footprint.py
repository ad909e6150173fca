"""What the footprint (`CostModel.footprint`) costs a new placement, against the same router without it.

Run: python bench/bench_footprint.py [--repeat N]

A new session's prompt (nothing cached anywhere) routed with a ``request_id`` and finished at once, so every
worker is idle and the footprint's pick runs over all of them: 8 workers and 1,024. Printed per fleet: µs per
``select`` + ``on_finish`` with the footprint off and on (each the best of ``--repeat`` rounds, rounds
alternating), their ratio, and the load average beside them (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import os
import time

from kvroute import CostModel, PrefixIndex, Router, WorkerKey


def _round(on: bool, workers: int, prompts: list[list[int]]) -> float:
    """µs per new placement on a fresh router of ``workers`` registered workers."""
    router = Router(PrefixIndex(), cost=CostModel(footprint=on), seed=0)
    for i in range(workers):
        router.add_worker(WorkerKey(f"w{i}", 0))
    started = time.perf_counter()
    for k, prompt in enumerate(prompts):
        router.select(prompt, request_id=k)
        router.on_finish(k)
    return (time.perf_counter() - started) / len(prompts) * 1e6


def main() -> None:
    """Measure and print the figures of the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    prompts = [list(range(k * 50 % 30_000, k * 50 % 30_000 + 300)) for k in range(2_000)]
    for workers in (8, 1024):
        off, on = float("inf"), float("inf")
        for _ in range(args.repeat):
            off = min(off, _round(False, workers, prompts))
            on = min(on, _round(True, workers, prompts))
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"{workers:>5} idle workers: footprint off {off:7.1f} µs, on {on:7.1f} µs a new placement; "
            f"on ÷ off {on / off:.2f} (load average {load})"
        )


if __name__ == "__main__":
    main()
