"""The compiled index (issue 18), measured against same-run baselines.

Run: python bench/bench_core.py [--quick]

Figures, each printed with its absolute numbers and as a ratio within this run (the machines are noisy):

- ingest: ``PrefixIndex.apply_payload`` (raw bytes decoded and applied in Rust, the subscriber's path) and
  ``decode_batch`` + ``PrefixIndex.apply_batch`` (Python events converted, applied in Rust), blocks/s, ÷ a bare
  ``msgspec.msgpack.decode`` of the same payloads; and ÷ the same through the pure-Python reference index
  (tests/reference, the index before the Rust core).
- ``find_matches`` p50 / p99: a full 512-block match and 32 shared blocks of an 8k-token prompt (a list of ints
  and an ``array("I")``), 64 workers, compiled ÷ the reference index holding the same entries.
- memory per (block, worker) entry at 1M entries: RSS growth ÷ entries (each entry a distinct block), as the
  allocator leaves it and with the C heap trimmed before and after (the pages the index holds), beside
  ``PrefixIndex.memory_bytes()`` (the tables' capacities) ÷ entries.
- ``Router.select`` p99 while two threads ingest at full speed ÷ its p99 idle.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import sys
import threading
import time
from array import array
from pathlib import Path

import msgspec

from kvroute import BlockStored, PrefixIndex, Router, WorkerKey, decode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import bench_index
from reference._index import PrefixIndex as ReferenceIndex

BS = 16
VOCAB = 150_000


def rss() -> int:
    """Resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def make_stream(n_blocks: int, n_workers: int, seed: int) -> list[tuple[WorkerKey, bytes, int]]:
    """bench_index's vLLM-style batches (1-4 events a batch, 1-32 blocks an event), without a medium."""
    return bench_index.make_stream(n_blocks, n_workers, seed, medium=None)


def bench_ingest(n_blocks: int) -> None:
    stream = make_stream(n_blocks, 16, 1)
    total = sum(n for _, _, n in stream)
    payloads = [p for _, p, _ in stream]
    raw, comp, ref, raw_bytes = [], [], [], []
    for _ in range(3):
        gc.collect()
        t0 = time.perf_counter()
        for p in payloads:
            msgspec.msgpack.decode(p)
        raw.append(time.perf_counter() - t0)
        idx = PrefixIndex()
        gc.collect()
        t0 = time.perf_counter()
        for w, p, _ in stream:
            idx.apply_payload(w, p)
        raw_bytes.append(time.perf_counter() - t0)
        for cls, out in ((PrefixIndex, comp), (ReferenceIndex, ref)):
            idx = cls()
            gc.collect()
            t0 = time.perf_counter()
            for w, p, _ in stream:
                idx.apply_batch(w, decode_batch(p))
            out.append(time.perf_counter() - t0)
    r, c, f, b = min(raw), min(comp), min(ref), min(raw_bytes)
    print(f"ingest, {total:,} blocks (16 workers, 1-32 blocks an event), best of 3:")
    print(f"  bare msgspec.msgpack.decode   {total / r / 1e6:6.2f} M blocks/s")
    print(f"  apply_payload (raw bytes)     {total / b / 1e6:6.2f} M blocks/s   ratio to bare decode {r / b:5.2f}")
    print(f"  decode_batch + apply (Rust)   {total / c / 1e6:6.2f} M blocks/s   ratio to bare decode {r / c:5.2f}")
    print(f"  decode_batch + apply (Python) {total / f / 1e6:6.2f} M blocks/s   ratio to bare decode {r / f:5.2f}")
    print(f"  compiled ÷ Python reference: {f / c:5.2f}x faster")


def shared_index(cls: type, n_workers: int, entries: int, prompt: list[int], held: list[int]) -> object:
    """``n_workers`` workers each holding the first ``held[i]`` blocks of ``prompt``, plus filler chains."""
    rng = random.Random(7)
    idx = cls()
    per_worker = entries // n_workers
    for i in range(n_workers):
        w = WorkerKey(f"w{i}", 0)
        n = held[i]
        hashes = [i << 32 | j for j in range(n)]
        if n:
            idx.apply(w, BlockStored(block_hashes=hashes, token_ids=prompt[: n * BS], block_size=BS))
        left = per_worker - n
        k = 0
        while left > 0:
            m = min(left, 512)
            toks = [rng.randrange(VOCAB) for _ in range(m * BS)]
            idx.apply(w, BlockStored(block_hashes=[i << 40 | k << 16 | j for j in range(m)], token_ids=toks,
                                     block_size=BS))
            left -= m
            k += 1
    return idx


def timed(fn: object, arg: object, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(arg)  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return out


def bench_find_matches(entries: int, iters: int) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(8192)]
    n_workers = 64
    for label, held, ntok in (
        ("full 512-block match", [512 - (i % 8) for i in range(n_workers)], 8192),
        ("32 shared blocks of an 8k prompt", [32 - (i % 32) for i in range(n_workers)], 8192),
    ):
        print(f"find_matches, {label}, {n_workers} workers, {entries:,} entries:")
        q = prompt[:ntok]
        qa = array("I", q)
        idxs = {cls: shared_index(cls, n_workers, entries, prompt, held) for cls in (PrefixIndex, ReferenceIndex)}
        assert dict(idxs[PrefixIndex].find_matches(q)) == dict(idxs[ReferenceIndex].find_matches(q))  # type: ignore[attr-defined]
        rows = {}
        for name, cls, arg in (("Rust, list", PrefixIndex, q), ("Rust, array('I')", PrefixIndex, qa),
                               ("Python reference", ReferenceIndex, q)):
            fm = idxs[cls].find_matches  # type: ignore[attr-defined]
            timed(fm, arg, 20)
            xs = timed(fm, arg, iters)
            rows[name] = (pct(xs, 0.5), pct(xs, 0.99))
            print(f"  {name:18} p50 {rows[name][0] * 1e6:8.1f} us   p99 {rows[name][1] * 1e6:8.1f} us")
        ref50 = rows["Python reference"][0]
        ratios = ", ".join(f"{name} {rows[name][0] / ref50:5.3f}" for name in rows if name != "Python reference")
        print(f"  p50 ratio to the reference: {ratios}")
        del idxs
        gc.collect()


def malloc_trim() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``); False where there is none."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def bench_memory(entries: int) -> None:
    """RSS growth ÷ entries two ways, beside ``memory_bytes()``.

    As measured so far: RSS before and after, as the allocator leaves it. That figure moves with how
    much of the memory the setup freed (the payloads) the index's allocations happen to reuse, and
    with the freed buckets of tables that grew, which stay resident until reused. So it is printed
    beside the live figure: the C heap trimmed (``malloc_trim``) before and after, which counts only
    the pages the index holds.
    """
    stream = make_stream(entries, 64, 5)
    batches = [(w, decode_batch(p)) for w, p, _ in stream]
    del stream
    gc.collect()
    before = rss()
    idx = PrefixIndex()
    for w, b in batches:
        idx.apply_batch(w, b)
    gc.collect()
    used = rss() - before
    n = idx.num_blocks()
    tables = idx.memory_bytes()
    print(f"memory: {n:,} (block, worker) entries, RSS growth {used / 1e6:.1f} MB = {used / n:.1f} B per entry; "
          f"the index's own figure (memory_bytes) {tables / 1e6:.1f} MB = {tables / n:.1f} B per entry")
    del idx
    gc.collect()
    if not malloc_trim():
        return
    before = rss()
    idx = PrefixIndex()
    for w, b in batches:
        idx.apply_batch(w, b)
    gc.collect()
    malloc_trim()
    live = rss() - before
    print(f"  live (C heap trimmed before and after): RSS growth {live / 1e6:.1f} MB = {live / n:.1f} B per entry")


def bench_select_under_ingest(seconds: float) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(VOCAB) for _ in range(8192)]
    idx = PrefixIndex()
    held = [rng.randrange(0, 64) for _ in range(64)]
    for i, n in enumerate(held):
        if n:
            idx.apply(WorkerKey(f"w{i}", 0), BlockStored(block_hashes=[i << 32 | j for j in range(n)],
                                                         token_ids=prompt[: n * BS], block_size=BS))
    router = Router(idx, seed=1)
    # The ingest threads take the subscriber's path: raw payloads through apply_payload.
    streams = [[(WorkerKey(f"ingest{t}-{w.worker_id}", w.dp_rank), p)
                for w, p, _ in make_stream(60_000, 8, 20 + t)] for t in range(2)]

    def select_p99(duration: float) -> tuple[float, int]:
        xs = []
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            router.select(prompt)
            xs.append(time.perf_counter() - t0)
        return pct(xs, 0.99), len(xs)

    idle, n_idle = select_p99(seconds)
    stop = threading.Event()
    applied = [0, 0]

    def ingest(t: int) -> None:
        while not stop.is_set():
            for w, p in streams[t]:
                if stop.is_set():
                    return
                idx.apply_payload(w, p)
                applied[t] += 1
            for w, _ in streams[t]:
                idx.remove_worker(w)

    threads = [threading.Thread(target=ingest, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    busy, n_busy = select_p99(seconds)
    stop.set()
    for th in threads:
        th.join()
    print(f"select p99 idle {idle * 1e6:.0f} us ({n_idle} selects), while two threads ingest {busy * 1e6:.0f} us "
          f"({n_busy} selects, {sum(applied)} batches applied): ratio {busy / idle:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = ap.parse_args()
    q = args.quick
    bench_ingest(20_000 if q else 200_000)
    bench_find_matches(64 * 600 if q else 256_000, 50 if q else 400)
    bench_memory(100_000 if q else 1_000_000)
    bench_select_under_ingest(0.5 if q else 3.0)


if __name__ == "__main__":
    main()
