"""How fast the native receive thread takes a flood back after an ``events()`` listener leaves (issue 19).

Run: python bench/bench_reopen.py [--sources 256] [--rate 40000] [--baseline DIR] [--rounds 2]

A publisher process on core 1 sends ``--rate`` batches/s (one 16-block vLLM store each, round-robin over
``--sources`` ranks, each a real ZMQ PUB with its own seqs); one `KvEventClient` (the native receiver) on core 0
follows them. After 2 s an ``events()`` iterator is opened for 1 s, which closes every source's fast path: the
thread hands every message to the event loop meanwhile, and a backlog of hand-overs builds up. Then the iterator
closes, and for 3 s the bench counts the live batches Python applied (the backlog, and whatever the thread handed
over until Python reopened each source's path) against those the thread applied, and when each source was back on
the thread. A reopen is exact only if Python took every hand-over of the source first; in a flood the thread used
to hand over faster than the loop took them, so every reopen was stale and the flood stayed on the slow path
(docs/architecture.md, "The native loop").

``--baseline DIR``: DIR holds another build's ``kvroute`` package (a checkout's ``kvroute/`` with its compiled
``_core``); the rounds alternate the two builds (a child process each, DIR first on its ``PYTHONPATH``) and the
last line gives this build's figures beside the baseline's, as ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Blocks in each batch (one store).
BLOCKS = 16


def publisher(n: int, rate: float, ports: Any, ready: Any, stop: Any) -> None:
    """Bind ``n`` PUBs, then send one batch per rank round-robin at ``rate`` batches/s until ``stop``."""
    import zmq

    from kvroute import BlockStored, EventBatch, encode_batch

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 100_000)
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
    tokens = list(range(BLOCKS * 16))
    payloads = [
        [
            encode_batch(
                EventBatch(
                    0.0,
                    [
                        BlockStored(
                            block_hashes=[r * 10**9 + k * 100 + j for j in range(BLOCKS)],
                            parent_block_hash=None,
                            token_ids=tokens,
                            block_size=16,
                        )
                    ],
                    0,
                )
            )
            for k in range(32)
        ]
        for r in range(n)
    ]
    ready.set()
    seq = [0] * n
    t0 = time.perf_counter()
    sent = 0
    while not stop.is_set():
        for r in range(n):
            socks[r].send_multipart([b"", seq[r].to_bytes(8, "big"), payloads[r][seq[r] % 32]])
            seq[r] += 1
        sent += n
        ahead = sent / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
    ctx.destroy(linger=0)


async def measure(n: int, rate: float) -> dict[str, float]:
    """One round: the flood, the listener's second, and the 3 s after it (see the module docstring)."""
    import anyio

    from kvroute import EventSource, KvEventClient, SubscriberConfig

    mgr = mp.Manager()
    ports = mgr.list()
    ready, stop = mp.Event(), mp.Event()
    proc = mp.Process(target=publisher, args=(n, rate, ports, ready, stop))
    proc.start()
    try:
        ready.wait()
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {0})
        sources = [
            EventSource(worker_id=f"w{i}", endpoint=f"tcp://127.0.0.1:{p}", replay_endpoint=None)
            for i, p in enumerate(list(ports))
        ]
        async with KvEventClient(sources, config=SubscriberConfig(native_receive=True)) as client:
            await client.wait_synced(30)
            await anyio.sleep(2)
            drivers: list[Any] = [s.driver for s in client._subs.values()]
            async with client.events() as stream:
                with anyio.move_on_after(1.0):
                    async for _ in stream:
                        pass
            t0 = time.perf_counter()
            before = [(d.counters.messages, d.native_batches) for d in drivers]
            back: list[float | None] = [None] * len(drivers)
            while time.perf_counter() - t0 < 3:
                await anyio.sleep(0.01)
                for i, (d, (_, n0)) in enumerate(zip(drivers, before)):
                    if back[i] is None and d.native_batches > n0:
                        back[i] = time.perf_counter() - t0
            after = [(d.counters.messages, d.native_batches) for d in drivers]
    finally:
        stop.set()
        proc.join()
    # Per source: messages (every live batch) and native_batches (those the thread applied), before and after.
    python = sum((m1 - m0) - (a1 - a0) for (m0, a0), (m1, a1) in zip(before, after))
    thread = sum(a1 - a0 for (_, a0), (_, a1) in zip(before, after))
    returned = sorted(b for b in back if b is not None)
    return {
        "python": python,
        "thread": thread,
        "returned": len(returned),
        "p50_ms": returned[len(returned) // 2] * 1000 if returned else float("nan"),
        "max_ms": returned[-1] * 1000 if returned else float("nan"),
    }


def line(name: str, n: int, r: dict[str, float]) -> str:
    """One build's round, as printed."""
    return (
        f"{name}: Python applied {r['python']:,.0f} live batches ({r['python'] / n:.1f} a source), the thread "
        f"{r['thread']:,.0f}; back on the thread {r['returned']:.0f}/{n} sources, p50 {r['p50_ms']:.0f} ms, "
        f"max {r['max_ms']:.0f} ms"
    )


def main() -> None:
    """Parse the options; run the rounds (alternating with ``--baseline``) and print them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, default=256)
    ap.add_argument("--rate", type=float, default=40_000, help="batches/s offered, all sources together")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="another build's kvroute package directory")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import anyio

    if args.child:
        print(json.dumps(anyio.run(measure, args.sources, args.rate)))
        return
    print(
        f"# {args.sources} sources, {args.rate:,.0f} batches/s ({args.rate * BLOCKS / 1e6:.2f}M blocks/s) offered; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    builds: list[tuple[str, str | None]] = [("this", None)]
    tmp = None
    if args.baseline:
        # Both builds load from a copy outside the checkout (as bench_ingest_ab.py does).
        tmp = tempfile.TemporaryDirectory()
        here = Path(__file__).resolve().parent.parent / "kvroute"
        shutil.copytree(here, Path(tmp.name) / "this" / "kvroute")
        shutil.copytree(args.baseline, Path(tmp.name) / "base" / "kvroute")
        builds = [("this", str(Path(tmp.name) / "this")), ("base", str(Path(tmp.name) / "base"))]
    got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in builds}
    for rnd in range(args.rounds):
        order = builds if rnd % 2 == 0 else builds[::-1]
        for name, path in order:
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = path
            cmd = [sys.executable, __file__, "--child", "--sources", str(args.sources), "--rate", str(args.rate)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            got[name].append(r)
            print(f"round {rnd + 1} {line(name, args.sources, r)}", flush=True)
    if "base" in got:

        def total(name: str, key: str) -> float:
            return sum(r[key] for r in got[name])

        ratio = total("this", "python") / max(1, total("base", "python"))
        print(
            f"this ÷ base: live batches Python applied {ratio:.2f}, "
            f"sources back on the thread {total('this', 'returned'):.0f} against {total('base', 'returned'):.0f}",
            flush=True,
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
