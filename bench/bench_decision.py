"""Benchmark: what `Router.select` costs beyond `find_matches` at 1,024 workers, candidates read or not.

`bench/bench_select.py`'s figure 2 fleet (1,024 workers, 1M (block, worker) entries, an 8k-token
prompt a quarter of the workers hold a prefix of), with load tracked on every worker. Measured
interleaved in one loop, so drift hits all alike:

- ``find_matches``: the match alone;
- ``select``: the decision, its ``candidates`` not read (built lazily: `RoutingDecision`);
- ``select + candidates``: the same, then ``candidates`` read — what every select cost while the
  decision built one `CandidateScore` per loaded worker eagerly;
- ``select, routing hint``: a router whose loaded workers each also have 4 started prompts
  remembered (`Router(routed_ttl=)`, kvroute/_routed.py) sharing a prefix with the query.

Prints p50 / p99 (µs, best of ``--repeat`` rounds) and each one's excess over ``find_matches``.

Run: ``.venv/bin/python bench/bench_decision.py [--workers 1024] [--entries 1000000]``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_select import BS, PROMPT_TOKENS, VOCAB, fill, interleaved

from kvroute import PrefixIndex, Router, WorkerKey


def main() -> None:
    """Build the fleet, time the calls, print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    n = args.workers
    workers = [WorkerKey(f"engine-{i // 8}", i % 8) for i in range(n)]
    full = PROMPT_TOKENS // BS
    depths = [full if i == 0 else (rng.randint(1, full) if i < n // 4 else 0) for i in range(n)]
    index = PrefixIndex()
    fill(index, workers, args.entries, prompt, depths)
    plain = Router(index, seed=0)
    hinted = Router(index, seed=0, routed_ttl=10.0)
    for i, w in enumerate(workers):
        for j in range(4):
            started = prompt[: rng.randrange(256, 4096)]
            plain.on_start((i, j), w, started)
            hinted.on_start((i, j), w, started)
    got = interleaved(
        {
            "find_matches": lambda: index.find_matches(prompt),
            "select": lambda: plain.select(prompt),
            "select + candidates": lambda: plain.select(prompt).candidates,
            "select, routing hint": lambda: hinted.select(prompt),
        },
        args.iters,
        args.repeat,
    )
    b50, b99 = got["find_matches"]
    print(
        f"{n:,} workers, {index.num_blocks():,} (block, worker) entries, {PROMPT_TOKENS}-token prompt, "
        f"load on every worker (µs, best of {args.repeat})"
    )
    for name, (p50, p99) in got.items():
        print(
            f"  {name:22} p50 {p50:8.1f}  p99 {p99:8.1f}   "
            f"over find_matches: p50 {p50 - b50:+8.1f}  p99 {p99 - b99:+8.1f}"
        )


if __name__ == "__main__":
    main()
