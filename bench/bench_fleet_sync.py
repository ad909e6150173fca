"""`bench_fleet.py`'s cold sync, split: the client's CPU per thread, its garbage collector, optionally perf.

Run: python bench/bench_fleet_sync.py bench/bench_fleet.py [--perf OUT] -- --native --ranks 4096 --rate 10000 ...

Runs ``bench_fleet.py``'s ``main`` (the path given: alternate two builds' venvs on one bench file) and prints, once
the first ``wait_synced`` returns, one ``# threads:`` line measured from that call's entry to its return: wall and
process CPU, the CPU seconds of each thread by name (``main``: the event loop; ``kvroute-recv``: the native receive
thread; ``python``: libzmq's I/O and reaper threads, which keep the process's name), the CPU the client's
``__aenter__`` took before it (its sources added), the garbage collector's CPU (``gc.callbacks``, the event loop's
thread time), its collections (full ones apart) and the objects it tracks at synced. Then ``# full gc pause``: one
full collection's CPU once synced (best of 3), what the router process pays per tracked object at every later full
collection. The pause is taken before ``bench_fleet.py`` stops its clock, so its own "sync from cold" line includes
it: read the ``# threads:`` line for the sync. ``--perf OUT``: ``perf record -g -p`` on this process from the
client's start to synced (the publishers are other processes).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

argv = sys.argv[1:]
bench = argv.pop(0)
perf_out = None
if argv and argv[0] == "--perf":
    argv.pop(0)
    perf_out = argv.pop(0)
if argv and argv[0] == "--":
    argv.pop(0)

sys.path.insert(0, os.path.dirname(bench))
sys.argv = [bench, *argv]
import bench_fleet  # noqa: E402

import kvroute  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def threads() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by name (the main thread as "main")."""
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        rest = s[s.rindex(")") + 2 :].split()
        if int(tid) == os.getpid():
            name = "main"
        out[name] += (int(rest[11]) + int(rest[12])) / TICK
    return out


gc_time = [0.0, 0.0, 0.0]  # CPU seconds, collections, full collections
_gc_t0 = [0.0]


def _gc_cb(phase: str, info: dict[str, int]) -> None:
    # The collector's CPU on the thread that runs it (the event loop's), not the process's.
    if phase == "start":
        _gc_t0[0] = time.thread_time()
    else:
        gc_time[0] += time.thread_time() - _gc_t0[0]
        gc_time[1] += 1
        gc_time[2] += info["generation"] == 2


gc.callbacks.append(_gc_cb)

perf_proc: list[subprocess.Popen[bytes]] = []
marks: dict[str, float] = {}
before: dict[str, dict[str, float]] = {}
orig_enter = kvroute.KvEventClient.__aenter__
orig_wait = kvroute.KvEventClient.wait_synced


async def enter(self: kvroute.KvEventClient) -> kvroute.KvEventClient:
    """The client's ``__aenter__``, timed (and perf attached first, with time to settle)."""
    if perf_out and not perf_proc:
        cmd = ["perf", "record", "-q", "-F", "499", "-g", "-p", str(os.getpid()), "-o", perf_out]
        # Blocking on purpose: before the client starts, perf attaches to a process doing nothing else.
        perf_proc.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # noqa: ASYNC220
        time.sleep(1.5)  # noqa: ASYNC251
    marks["enter_cpu"] = time.process_time()
    marks["enter_wall"] = time.perf_counter()
    client = await orig_enter(self)
    marks["entered_cpu"] = time.process_time()
    marks["entered_wall"] = time.perf_counter()
    return client


async def wait_synced(self: kvroute.KvEventClient, timeout: float) -> None:
    """The first call measured (per thread, GC); later calls as they are."""
    if before:
        return await orig_wait(self, timeout)
    before["threads"] = threads()
    g0 = list(gc_time)
    c0 = time.process_time()
    w0 = time.perf_counter()
    try:
        return await orig_wait(self, timeout)
    finally:
        w1 = time.perf_counter()
        c1 = time.process_time()
        t1 = threads()
        if perf_proc:
            perf_proc[0].send_signal(signal.SIGINT)
        t0 = before["threads"]
        used = {n: t1.get(n, 0.0) - t0.get(n, 0.0) for n in set(t0) | set(t1)}
        parts = [f"{n} {cpu:.2f}" for n, cpu in sorted(used.items(), key=lambda item: -item[1]) if cpu >= 0.005]
        construct = marks["entered_cpu"] - marks["enter_cpu"]
        construct_wall = marks["entered_wall"] - marks["enter_wall"]
        print(
            f"# threads: wall {w1 - w0:.2f} s, cpu {c1 - c0:.2f} s; construct {construct:.2f} s cpu "
            f"({construct_wall:.2f} wall); gc {gc_time[0] - g0[0]:.2f} s ({gc_time[1] - g0[1]:.0f} collections, "
            f"{gc_time[2] - g0[2]:.0f} full, {len(gc.get_objects())} tracked); "
            f"load {os.getloadavg()[0]:.1f}; " + ", ".join(parts),
            flush=True,
        )
        if perf_proc:
            perf_proc[0].wait(30)
        # A full collection's pause once synced (the event loop's thread CPU, best of 3).
        pauses = []
        for _ in range(3):
            t = time.thread_time()
            gc.collect()
            pauses.append(time.thread_time() - t)
        tracked = len(gc.get_objects())
        print(f"# full gc pause after sync: {min(pauses) * 1000:.0f} ms (best of 3; {tracked} tracked)", flush=True)


kvroute.KvEventClient.__aenter__ = enter  # type: ignore[method-assign]
kvroute.KvEventClient.wait_synced = wait_synced  # type: ignore[method-assign]
bench_fleet.main()
