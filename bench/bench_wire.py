"""Wire decode benchmark: the compiled decoder against msgspec, in one run.

Run: python bench/bench_wire.py [--quick]

Payloads are what vLLM publishes for a fleet prefilling long prompts: 16 workers x 12 sequences x
512 blocks of 16 tokens, one map-form batch per sequence (issue 18's ingest shape). Measured on the
same payloads, best of several rounds (the machines are noisy, so ratios within the run matter):

- ``msgspec.msgpack.decode``: bare msgpack to Python objects, the baseline of issue 18's targets;
- the Python decoder kvroute had (tests/reference/wire.py: msgspec Structs, per-event checks);
- the compiled decoder to Python objects (`kvroute.decode_batch`: the `EventBatch` API);
- the compiled decoder into Rust (`kvroute._core.decode_count`: what the raw-bytes ingest path pays
  before it applies; no Python object per event).

Aim (issue 18): the decode into Rust >= 6x the bare msgspec decode, so that decode + apply stays
>= 3x it.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvroute import BlockStored, EventBatch, Limits, _core, decode_batch, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference.wire import decode_batch as reference_decode

BS = 16
VOCAB = 150_000


def make_payloads(workers: int, sequences: int, blocks: int, seed: int = 1) -> list[bytes]:
    """One vLLM map-form batch per sequence: a BlockStored of ``blocks`` full blocks, uint64 hashes."""
    rng = random.Random(seed)
    out = []
    for w in range(workers):
        for _ in range(sequences):
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            tokens = [rng.randrange(VOCAB) for _ in range(blocks * BS)]
            ev = BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BS, medium="GPU")
            out.append(encode_batch(EventBatch(time.time(), [ev], w % 2)))
    return out


def measure(fns: list[Callable[[bytes], object]], payloads: list[bytes], rounds: int) -> list[tuple[float, float]]:
    """Best (wall, CPU) seconds of one pass of each function over every payload.

    Rounds interleave the functions, so a burst of load on a shared machine hits them alike; CPU
    time (this process only) is the steadier figure there.
    """
    best = [(float("inf"), float("inf"))] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            for p in payloads:
                fn(p)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            best[i] = (min(best[i][0], w), min(best[i][1], c))
    return best


def main() -> None:
    """Measure and print each decoder's blocks/s and its ratio to the bare msgspec decode."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 workers instead of 16, fewer rounds")
    args = ap.parse_args()
    workers, rounds = (4, 5) if args.quick else (16, 7)
    payloads = make_payloads(workers, 12, 512)
    blocks = workers * 12 * 512
    mb = sum(map(len, payloads)) / 1e6
    lim = Limits()
    caps = (lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size)

    # The decoders agree before they are timed.
    for p in payloads[:3]:
        assert decode_batch(p) == reference_decode(p)
        assert _core.decode_count(p, *caps)[2] == 512

    def rust_count(p: bytes) -> object:
        return _core.decode_count(p, *caps)

    names = [
        "msgspec.msgpack.decode (baseline)",
        "Python decoder (reference)",
        "Rust decode -> Python EventBatch",
        "Rust decode -> Rust (decode_count)",
    ]
    times = measure([msgspec.msgpack.decode, reference_decode, decode_batch, rust_count], payloads, rounds)
    (base_w, base_c) = times[0]
    print(f"{len(payloads)} payloads, {blocks:,} blocks, {blocks * BS:,} tokens, {mb:.1f} MB; best of {rounds}")
    print(f"{'decoder':<38}{'wall ms':>9}{'cpu ms':>9}{'Mblocks/s':>11}{'x msgspec (wall)':>18}{'(cpu)':>7}")
    for name, (w, c) in zip(names, times):
        print(f"{name:<38}{w * 1e3:>9.1f}{c * 1e3:>9.1f}{blocks / c / 1e6:>11.2f}{base_w / w:>18.2f}{base_c / c:>7.2f}")

if __name__ == "__main__":
    main()
