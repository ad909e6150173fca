"""What nats-py's ``pending_size`` costs a publisher: the relay's publishing, alone, against a real server.

Run: python bench/bench_nats_publish.py [--mb 200] [--record-kb 90] [--rounds 3]   (needs ``nats-server``)

A relay publishes its log records with ``publish_async`` (kvroute._jetstream_publish) and nats-py holds
up to ``pending_size`` bytes of commands before a publish waits for them to be written. Its flusher
joins everything held into one bytes object and asyncio copies the unsent rest into its transport
buffer, so the cap sets how large each of those copies gets. kvroute connects with 4 MiB (it used
64 MiB before session 13). Each round publishes the same records once per cap, alternating the caps,
acks awaited every 2,000 records as the relay's window does; the figure is the publisher's CPU time
(process time: robust on a loaded machine) as a ratio to the 64 MiB cap's in the same round, plus RSS
growth.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import nats

CAPS = (64 << 20, 16 << 20, 4 << 20, 2 << 20, 1 << 20)


async def _publish(port: int, cap: int, record: bytes, total: int) -> float:
    """CPU seconds to publish ``total`` bytes of ``record``s with nats-py's pending cap at ``cap``."""
    nc = await nats.connect(f"nats://127.0.0.1:{port}", pending_size=cap)
    js = nc.jetstream()
    stream = f"B{cap}"
    await js.add_stream(name=stream, subjects=[f"{stream}.>"], storage="memory")
    begin = time.process_time()
    futures = []
    for i in range(total // len(record)):
        futures.append(await js.publish_async(f"{stream}.{i % 64}", record, headers={"Nats-Msg-Id": str(i)}))
        if len(futures) >= 2_000:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)
    cpu = time.process_time() - begin
    await js.delete_stream(stream)
    await nc.close()
    return cpu


def _rss_mb() -> float:
    # bench_warm_start.rss_mb's figure (peak RSS), not imported from there: that would load kvroute in the
    # child, ~20 MB the publisher's own RSS does not hold.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_cap(port: int, cap: int, record_kb: int, mb: int) -> tuple[float, float]:
    """One cap in a child process (each starts with a fresh heap): (CPU seconds, peak RSS MB)."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(port), str(cap), str(record_kb), str(mb)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="megabytes published per cap and round")
    parser.add_argument("--record-kb", type=int, default=90, help="record size (a relay's records: up to 256 KB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        port, cap, record_kb, mb = args.child
        cpu = asyncio.run(_publish(port, cap, os.urandom(record_kb * 1000), mb * 1_000_000))
        print(cpu, _rss_mb())
        return
    server_bin = shutil.which("nats-server")
    if server_bin is None:
        raise SystemExit("nats-server is not installed (apt-get install nats-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tempfile.mkdtemp(prefix="kvroute-bench-nats-")
    server = subprocess.Popen(
        [server_bin, "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        print(f"{args.mb} MB of {args.record_kb} KB records per cap and round; load average {os.getloadavg()[0]:.1f}")
        for r in range(args.rounds):
            figures = {cap: _run_cap(port, cap, args.record_kb, args.mb) for cap in CAPS}
            base = figures[CAPS[0]][0]
            row = ", ".join(
                f"{cap >> 20} MiB {cpu:.2f} s ({cpu / base:.2f}x, RSS {rss:.0f} MB)"
                for cap, (cpu, rss) in figures.items()
            )
            print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}): {row}")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
