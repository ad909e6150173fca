"""When the index's tables grow during `bench_jetstream.py`'s paced round: the same payloads, in one process.

Run: python bench/growth_points.py

Builds the bench's payloads (same seeds: the throughput round's 26,000 batches, then the 10-s paced round's
128,000 at ``--lag-batches 32000``), applies them in order to one `PrefixIndex`, and prints each jump of
`memory_bytes()` of 3 % or more during the paced part, with the entry count and the second of a 10.24-s round it
falls in (a worker's table grows by half: a jump of about an eighth with four workers; the key table's id index
grows by half; its records double). Every copy of the index in that bench (the relay's client, three replicas)
holds the same entries, so each growth falls in the same second in all four (docs/performance.md, "Session 18").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import make_payloads

from kvroute import PrefixIndex, WorkerKey

ROUND_S = 10.24  # the paced round at 12,500 batches/s


def main() -> None:
    """Apply the throughput round's payloads, then print the growths the paced round's bring."""
    burst, _ = make_payloads(6_500 * 4, 4, seed=1)
    paced, paced_blocks = make_payloads(32_000 * 4, 4, seed=2)
    index = PrefixIndex()
    keys = [WorkerKey(f"w{i}", 0) for i in range(4)]
    for i in range(len(burst[0])):
        for key, ps in zip(keys, burst):
            index.apply_payload(key, ps[i])
    stored, memory = 0, index.memory_bytes()
    for i in range(len(paced[0])):
        for key, ps in zip(keys, paced):
            stored += index.apply_payload(key, ps[i]).stored_blocks
            now = index.memory_bytes()
            if now > memory * 1.03:
                print(
                    f"second {stored / paced_blocks * ROUND_S:5.2f}: {memory / 1e6:.0f} -> {now / 1e6:.0f} MB"
                    f" at {index.stats().entries:,} entries"
                )
            memory = now


if __name__ == "__main__":
    main()
