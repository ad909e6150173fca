"""Filling an index from empty, this build against another, alternated in one run (issue 18).

Run: python bench/bench_fill.py --baseline /path/to/other/.venv/bin/python [--rounds 7] [--memory]

Each round runs one child process per build, in alternating order (the machine is shared: whichever build
runs second in a round meets a different load). A child builds the same payloads (seeded), then fills a
fresh ``PrefixIndex`` through ``apply_payload`` ``--repeat`` times and reports its best thread CPU time
(``time.thread_time``: preemption by other processes does not count; page faults do, in the kernel time
of the thread). Two fills:

- ``vs_dynamo``: ``bench_vs_dynamo.py``'s payloads, 16 workers x 12 sequences x 512 blocks (98,304 blocks);
- ``1M``: 64 workers x 31 x 512 blocks (1,015,808 entries), every block its own key;
- ``at1M``: what a JetStream replica pays per block once its index is big (issue 22): ``bench_e2e.py``'s batch
  shape (4 workers; 1-4 events of 1-32 blocks, 70 % chained on an earlier block, a removal once a worker's tail
  passes 64) fills an index to 1M entries untimed, then the next 131,072 blocks are timed (thread CPU per block).

With ``--memory``, each child also reports memory per (block, worker) entry at 1M entries as
``bench_core.py`` measures it live (C heap trimmed before and after) and ``memory_bytes()`` ÷ entries.
Printed: absolute figures per build, this build ÷ the baseline per round, and the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import time
from array import array

BS = 16
VOCAB = 150_000


def payloads(workers: int, seqs: int, blocks: int, seed: int) -> list[tuple[object, bytes]]:
    """One map-form vLLM batch per (worker, sequence): a ``BlockStored`` of ``blocks`` distinct blocks."""
    from kvroute import BlockStored, EventBatch, WorkerKey, encode_batch

    rng = random.Random(seed)
    out: list[tuple[object, bytes]] = []
    for w in range(workers):
        key = WorkerKey(f"engine-{w}", 0)
        for _ in range(seqs):
            # Random token ids below VOCAB, drawn in bulk (a randrange per token made setup take minutes).
            tokens = [t % VOCAB for t in array("I", rng.randbytes(4 * blocks * BS))]
            ev = BlockStored(block_hashes=[rng.getrandbits(64) for _ in range(blocks)], parent_block_hash=None,
                             token_ids=tokens, block_size=BS, medium="GPU")
            out.append((key, encode_batch(EventBatch(0.0, [ev], 0), form="map")))
    return out


def replica_payloads(fill: int, timed: int, seed: int) -> tuple[list[tuple[object, bytes]], int, int]:
    """``bench_e2e.make_payloads``' batch shape over 4 workers, round-robin: ``fill`` blocks, then ``timed`` more.

    Returns the batches, the index of the first timed one, and the blocks the timed ones store. Token ids come
    from ``randbytes`` (a ``randrange`` per token made 1.2M blocks take half a minute to build).
    """
    from kvroute import BlockRemoved, BlockStored, EventBatch, WorkerKey, encode_batch

    rng = random.Random(seed)
    keys = [WorkerKey(f"w{i}", 0) for i in range(4)]
    tails: list[list[int]] = [[] for _ in keys]
    out: list[tuple[object, bytes]] = []
    stored = 0
    timed_from = -1
    while stored < fill + timed:
        if timed_from < 0 and stored >= fill:
            timed_from, fill = len(out), stored
        s = len(out) % len(keys)
        events: list[BlockStored | BlockRemoved] = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 32)
            tail = tails[s]
            parent = rng.choice(tail) if tail and rng.random() < 0.7 else None
            hashes = [rng.getrandbits(64) for _ in range(n)]
            tokens = [t % VOCAB for t in array("I", rng.randbytes(4 * n * BS))]
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS))
            stored += n
            tail.append(hashes[-1])
            if len(tail) > 64:
                events.append(BlockRemoved(block_hashes=[tail.pop(rng.randrange(len(tail)))], medium="GPU"))
        out.append((keys[s], encode_batch(EventBatch(1_700_000_000.0 + len(out), events, 0))))
    return out, timed_from, stored - fill


def at_1m(stream: list[tuple[object, bytes]], timed_from: int, repeat: int) -> float:
    """Best thread CPU seconds of applying ``stream[timed_from:]`` to an index ``stream[:timed_from]`` filled."""
    from kvroute import PrefixIndex

    best = float("inf")
    for _ in range(repeat):
        idx = PrefixIndex()
        apply = idx.apply_payload
        for w, p in stream[:timed_from]:
            apply(w, p)
        gc.collect()
        t0 = time.thread_time()
        for w, p in stream[timed_from:]:
            apply(w, p)
        best = min(best, time.thread_time() - t0)
        del idx
    return best


def rss() -> int:
    """Resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill_cpu(stream: list[tuple[object, bytes]], repeat: int) -> float:
    """Best thread CPU seconds of filling a fresh index with ``stream`` through ``apply_payload``."""
    from kvroute import PrefixIndex

    best = float("inf")
    for _ in range(repeat):
        idx = PrefixIndex()
        apply = idx.apply_payload
        gc.collect()
        t0 = time.thread_time()
        for w, p in stream:
            apply(w, p)
        best = min(best, time.thread_time() - t0)
        del idx
    return best


def memory(stream: list[tuple[object, bytes]]) -> dict[str, float]:
    """Live bytes per entry (C heap trimmed before and after) and ``memory_bytes()`` per entry."""
    from kvroute import PrefixIndex

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    gc.collect()
    trim(0)
    before = rss()
    idx = PrefixIndex()
    for w, p in stream:
        idx.apply_payload(w, p)
    gc.collect()
    trim(0)
    n = idx.num_blocks()
    return {"live_B": (rss() - before) / n, "memory_bytes_B": idx.memory_bytes() / n, "entries": n}


def child(repeat: int, with_memory: bool) -> None:
    small = payloads(16, 12, 512, 18)
    big = payloads(64, 31, 512, 5)
    out: dict[str, float] = {"vs_dynamo_blocks": 16 * 12 * 512, "1M_blocks": 64 * 31 * 512}
    out["vs_dynamo_s"] = fill_cpu(small, repeat)
    out["1M_s"] = fill_cpu(big, max(1, repeat // 2))
    if with_memory:
        out.update(memory(big))
    del big
    replica, timed_from, timed = replica_payloads(1_000_000, 131_072, 22)
    out["at1M_blocks"] = timed
    out["at1M_s"] = at_1m(replica, timed_from, max(1, repeat // 2))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the other build's Python (its venv's bin/python)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="fills per child (best taken; half for the 1M fill)")
    ap.add_argument("--memory", action="store_true", help="also memory per entry at 1M entries")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.repeat, args.memory)
        return
    if not args.baseline:
        ap.error("--baseline is required")
    builds = {"this": sys.executable, "baseline": args.baseline}
    cmd = [os.path.abspath(__file__), "--child", "--repeat", str(args.repeat)] + (["--memory"] if args.memory else [])
    got: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for r in range(args.rounds):
        order = ["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]
        for name in order:
            res = subprocess.run([builds[name], *cmd], capture_output=True, text=True, check=True)
            got[name].append(json.loads(res.stdout))
        t, b = got["this"][-1], got["baseline"][-1]
        line = (f"round {r + 1} ({order[0]} first), load {os.getloadavg()[0]:.1f}: "
                f"vs_dynamo fill {t['vs_dynamo_blocks'] / t['vs_dynamo_s'] / 1e6:.2f} / "
                f"{b['vs_dynamo_blocks'] / b['vs_dynamo_s'] / 1e6:.2f} M blocks/s (this ÷ baseline CPU "
                f"{t['vs_dynamo_s'] / b['vs_dynamo_s']:.3f}); 1M fill {t['1M_blocks'] / t['1M_s'] / 1e6:.2f} / "
                f"{b['1M_blocks'] / b['1M_s'] / 1e6:.2f} M blocks/s (ratio {t['1M_s'] / b['1M_s']:.3f}); "
                f"at 1M {t['at1M_s'] / t['at1M_blocks'] * 1e6:.3f} / {b['at1M_s'] / b['at1M_blocks'] * 1e6:.3f} "
                f"CPU µs per block (ratio {t['at1M_s'] / b['at1M_s']:.3f})")
        if args.memory:
            line += (f"; live {t['live_B']:.1f} / {b['live_B']:.1f} B per entry, memory_bytes "
                     f"{t['memory_bytes_B']:.1f} / {b['memory_bytes_B']:.1f}")
        print(line, flush=True)
    for key, blocks in (("vs_dynamo_s", "vs_dynamo_blocks"), ("1M_s", "1M_blocks"), ("at1M_s", "at1M_blocks")):
        t = min(x[key] for x in got["this"])
        b = min(x[key] for x in got["baseline"])
        n = got["this"][0][blocks]
        print(f"best {key[:-2]} fill: this {n / t / 1e6:.2f}M blocks/s, baseline {n / b / 1e6:.2f}M blocks/s, "
              f"CPU this ÷ baseline {t / b:.3f}")


if __name__ == "__main__":
    main()
