"""Issue 18's ingest ratios for two builds of kvroute, alternated in one run (the machine is shared and noisy).

Run: python bench/bench_ingest_ab.py --baseline DIR [--rounds 6] [--repeat 5] [--stream dynamo|core]

``DIR`` holds the other build's ``kvroute`` package (a copy of a checkout's ``kvroute/`` with its compiled
``_core``); it is put first on ``PYTHONPATH`` of that build's child processes, and a temporary copy of this
build's package first on this build's, so both builds run under this interpreter and its packages (msgspec, and
Dynamo's binding when installed) and load from the same kind of place. Each round starts one child per
build, alternating which goes first; a child builds the stream (fixed seed: the same bytes for both builds) and
times ``repeat`` turns of a bare ``msgspec.msgpack.decode`` of the payloads, ``PrefixIndex.apply_payload`` into an
empty index, and (when ``dynamo._core`` imports) Dynamo's ``RadixTree.apply_event`` on the same blocks, taking
turns as `bench_vs_dynamo.py` does, best of each. Printed per round: each build's ingest ÷ msgspec and ÷ Dynamo,
and this build's ingest ÷ the baseline's; then the medians, beside the load average. ``--cpu`` times thread CPU
time instead of wall time (`bench_fill.py`'s clock: a preempted turn does not count), without Dynamo.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(stream: str, repeat: int, cpu: bool) -> None:
    """Time the paths in turns and print their best blocks/s as JSON (``cpu``: thread CPU time, no Dynamo)."""
    import msgspec

    sys.path.insert(0, str(HERE))
    import bench_vs_dynamo as bvd
    import callgrind_ingest

    import kvroute

    pairs, blocks = callgrind_ingest.stream(stream)
    decode = msgspec.msgpack.decode
    clock = time.thread_time if cpu else time.perf_counter

    def bare() -> float:
        t0 = clock()
        for _, p in pairs:
            decode(p)
        return clock() - t0

    def ingest() -> float:
        idx = kvroute.PrefixIndex()
        apply = idx.apply_payload
        t0 = clock()
        for w, p in pairs:
            apply(w, p)
        return clock() - t0

    runs = {"msgspec": bare, "apply_payload": ingest}
    if bvd.RadixTree is not None and stream == "dynamo" and not cpu:
        wl = bvd.make_workload(16, 12, 512, seed=1)

        def dynamo() -> float:
            tree = bvd.RadixTree()
            apply = tree.apply_event
            t0 = time.perf_counter()
            for w, event in wl.dynamo_events:
                apply(w, event)
            tree.find_matches(bvd.compute_block_hash_for_seq(wl.full_prompt[: bvd.BS], bvd.BS))
            return time.perf_counter() - t0

        runs["dynamo"] = dynamo
    rates = bvd.best_rates(runs, blocks, repeat)
    rates["core"] = str(Path(kvroute.__file__).parent)  # type: ignore[assignment]
    print(json.dumps(rates))


def main() -> None:
    """Alternate the two builds' children and print the same-run ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="directory holding the other build's kvroute package")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5, help="turns per child, the best kept (default 5)")
    ap.add_argument("--stream", default="dynamo", choices=("dynamo", "core"))
    ap.add_argument("--cpu", action="store_true",
                    help="thread CPU time instead of wall time (preemption not counted; Dynamo, which applies on "
                         "its own thread, left out)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        gc.collect()
        child(args.stream, args.repeat, args.cpu)
        return
    if not args.baseline:
        ap.error("--baseline DIR is required")
    # This build runs from a copy too, beside the baseline's: with the same compiled core on both sides, the
    # checkout's own package (an editable install under /work) against a copy under /tmp measured 0.93 (session 17).
    import kvroute

    this_dir = tempfile.mkdtemp(prefix="kvroute-ab-")
    shutil.copytree(Path(kvroute.__file__).parent, Path(this_dir) / "kvroute")

    def run(base: bool) -> dict[str, float]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.baseline if base else this_dir, env.get("PYTHONPATH")]))
        cmd = [sys.executable, __file__, "--child", "--stream", args.stream, "--repeat", str(args.repeat)]
        cmd += ["--cpu"] if args.cpu else []
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    ratios: dict[str, list[float]] = {"this": [], "base": [], "this/dyn": [], "base/dyn": [], "this/base": []}
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {("base" if b else "this"): run(b) for b in order}
        this, base = got["this"], got["base"]
        ratios["this"].append(this["apply_payload"] / this["msgspec"])
        ratios["base"].append(base["apply_payload"] / base["msgspec"])
        ratios["this/base"].append(this["apply_payload"] / base["apply_payload"])
        line = (f"round {r + 1} ({'this' if not order[0] else 'base'} first, load {os.getloadavg()[0]:.1f}): "
                f"ingest ÷ msgspec this {ratios['this'][-1]:.2f} base {ratios['base'][-1]:.2f}; "
                f"this ÷ base {ratios['this/base'][-1]:.2f} ({this['apply_payload'] / 1e6:.2f}M against "
                f"{base['apply_payload'] / 1e6:.2f}M blocks/s)")
        if "dynamo" in this:
            ratios["this/dyn"].append(this["apply_payload"] / this["dynamo"])
            ratios["base/dyn"].append(base["apply_payload"] / base["dynamo"])
            line += f"; ÷ Dynamo this {ratios['this/dyn'][-1]:.2f} base {ratios['base/dyn'][-1]:.2f}"
        print(line, flush=True)
    print("medians: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in ratios.items() if v))
    shutil.rmtree(this_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
