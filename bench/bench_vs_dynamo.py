"""kvroute's index beside NVIDIA Dynamo's Rust indexer, in one run, on the same payload content.

How to run: from a checkout with its venv (``python3 -m venv .venv && .venv/bin/pip install -e
'.[test]'``), run ``.venv/bin/python bench/bench_vs_dynamo.py`` (``--quick`` for a short smoke run,
``--repeat N`` for the number of rounds each figure keeps the best of; default 3). Dynamo is an
optional, bench-only dependency, never one of the package or its tests: install its Python binding
into the same venv with ``.venv/bin/pip install ai-dynamo-runtime==1.6.1`` (or a downloaded wheel:
``.venv/bin/pip install ai_dynamo_runtime-1.6.1-cp310-abi3-manylinux_2_28_x86_64.whl``). Without it
the script prints kvroute's figures alone and says Dynamo was not found. Absolute numbers swing on
shared machines; read the ratios, which are taken within the run.

What is compared (issue 18, "Targets"):

1. ingest: 16 workers x 12 sequences x 512 blocks of 16 tokens, one vLLM map-form batch per
   sequence (kvroute's own `encode_batch`). kvroute: ``PrefixIndex.apply_payload(worker, bytes)``
   when the build has it, and ``decode_batch`` + ``PrefixIndex.apply_batch`` always; the
   ratio denominator is a bare ``msgspec.msgpack.decode`` of the same payloads into Python objects.
   Dynamo: ``dynamo._core.RadixTree.apply_event(worker_id, json_bytes)``, one call per sequence, fed
   the same blocks as Dynamo's own router receives them: a JSON ``KvCacheEvent``
   ``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}``
   whose per-block ``tokens_hash`` Dynamo's publisher computes on the worker side, so it is built
   (with ``compute_block_hash_for_seq``) before the clock starts. That is Dynamo's best case; the
   same blocks taken from the vLLM bytes through Python (decode, hash, JSON, apply) are printed too.
   Each path into an empty index (every table grows as it fills), and kvroute's ``apply_payload``
   and Dynamo's ``apply_event`` also into an index at its working size (`WorkingSize`,
   `DynamoWorkingSize`); each path in wall time and per second of the process's CPU time (Dynamo
   applies on a thread of its own).
2. find_matches p50 / p99 on the index ingest built: a full 512-block prompt held by one worker,
   and an 8k-token prompt of which one worker holds the first 32 blocks; kvroute given a list of
   ints and an ``array('I')``. Dynamo matches block hashes, not tokens, so its figure is what a
   router pays for a prompt: ``compute_block_hash_for_seq(tokens, 16)`` then
   ``RadixTree.find_matches(hashes)`` (the match alone is printed too).
3. kvroute / Dynamo ratios for each figure beside the issue's targets.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

import kvroute
from kvroute import BlockRemoved, BlockStored, EventBatch, PrefixIndex, WorkerKey, decode_batch, encode_batch

try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    DYNAMO_VERSION = importlib.metadata.version("ai-dynamo-runtime")
except ImportError:
    RadixTree = None
    compute_block_hash_for_seq = None
    DYNAMO_VERSION = ""

BS = 16
VOCAB = 150_000
SHARED = 32  # blocks of the 8k prompt one worker holds, in the "32 of 8k" query


@dataclass
class Workload:
    """The ingest stream in both indexes' input forms, and the two query prompts."""

    payloads: list[tuple[WorkerKey, int, bytes]]  # kvroute worker, Dynamo worker id, vLLM bytes
    dynamo_events: list[tuple[int, bytes]]  # the same blocks as Dynamo's JSON KvCacheEvent
    blocks: int
    full_prompt: list[int]  # a stored sequence, all 512 blocks held by `holder`
    short_prompt: list[int]  # its first 32 blocks, then tokens nobody holds
    holder: tuple[WorkerKey, int]


def make_workload(workers: int, seqs: int, blocks: int, seed: int) -> Workload:
    """One map-form vLLM batch per (worker, sequence): a `BlockStored` of ``blocks`` distinct blocks."""
    rng = random.Random(seed)
    payloads: list[tuple[WorkerKey, int, bytes]] = []
    prompts: list[list[int]] = []
    for w in range(workers):
        key = WorkerKey(f"engine-{w}", 0)
        for _ in range(seqs):
            tokens = [rng.randrange(VOCAB) for _ in range(blocks * BS)]
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS,
                             medium="GPU")
            payloads.append((key, w, encode_batch(EventBatch(time.time(), [ev], 0), form="map")))
            prompts.append(tokens)
    pick = len(payloads) // 2 + seqs // 2  # a sequence in the middle of the stream
    full = prompts[pick]
    short = full[: SHARED * BS] + [rng.randrange(VOCAB) for _ in range(len(full) - SHARED * BS)]
    dynamo_events = [(w, dynamo_json(p)) for _, w, p in payloads] if RadixTree is not None else []
    return Workload(payloads, dynamo_events, workers * seqs * blocks, full, short,
                    (payloads[pick][0], payloads[pick][1]))


def dynamo_json(payload: bytes, event_id: int = 0) -> bytes:
    """The vLLM batch's stored blocks as the JSON `KvCacheEvent` Dynamo's RadixTree ingests."""
    _ts, events, _rank = msgspec.msgpack.decode(payload)
    (ev,) = events
    local = compute_block_hash_for_seq(ev["token_ids"], ev["block_size"])
    blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(ev["block_hashes"], local, strict=True)]
    stored = {"parent_hash": ev.get("parent_block_hash"), "blocks": blocks}
    return json.dumps({"event_id": event_id, "data": {"stored": stored}}).encode()


def best_rates(runs: dict[str, Callable[[], float | tuple[float, float]]], blocks: int, repeat: int,
               cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Blocks per second of the fastest of ``repeat`` runs of each path (each returns its seconds, or its
    seconds and CPU seconds when it does untimed work too).

    The paths take turns within each round, so a stretch of load on the shared machine falls on all of
    them alike and the same-run ratios hold up better than when each path's rounds run back to back.
    ``cpu``, when given, gets each path's blocks per second of the process's CPU time (every thread's,
    best round): Dynamo applies on a thread of its own, so its wall figure leaves out the second core's work.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            gc.collect()
            c0 = time.process_time()
            got = run()
            wall, used = got if isinstance(got, tuple) else (got, time.process_time() - c0)
            times[name].append(wall)
            cpus[name].append(used)
    if cpu is not None:
        cpu.update({name: blocks / max(min(cs), 1e-9) for name, cs in cpus.items()})
    return {name: blocks / min(ts) for name, ts in times.items()}


# ---------------------------------------------------------------- figure 1: ingest


def ingest_figures(wl: Workload, repeat: int, cpu: dict[str, float]) -> tuple[dict[str, float], PrefixIndex, Any]:
    """Blocks/s of each ingest path (per CPU second into ``cpu``); returns the figures and the last runs' indexes."""
    out: dict[str, float] = {}
    last: dict[str, Any] = {}

    def bare_decode() -> float:
        decode = msgspec.msgpack.decode
        t0 = time.perf_counter()
        for _, _, payload in wl.payloads:
            decode(payload)
        return time.perf_counter() - t0

    def decode_apply() -> float:
        idx = PrefixIndex()
        decode, apply = decode_batch, idx.apply_batch
        t0 = time.perf_counter()
        for worker, _, payload in wl.payloads:
            apply(worker, decode(payload))
        took = time.perf_counter() - t0
        last["kvroute"] = idx
        return took

    def apply_payload() -> float:
        idx = PrefixIndex()
        apply = idx.apply_payload  # present only in builds with the compiled core (hasattr above)
        t0 = time.perf_counter()
        for worker, _, payload in wl.payloads:
            apply(worker, payload)
        took = time.perf_counter() - t0
        last["kvroute"] = idx
        return took

    runs: dict[str, Callable[[], float | tuple[float, float]]] = {
        "msgspec decode": bare_decode, "kvroute decode+apply_batch": decode_apply}
    if hasattr(PrefixIndex, "apply_payload"):
        runs["kvroute apply_payload"] = apply_payload
        runs[WORKING_SIZE] = WorkingSize(wl).run

    if RadixTree is not None:
        def dynamo_apply() -> float:
            tree = RadixTree()
            apply = tree.apply_event
            t0 = time.perf_counter()
            for w, event in wl.dynamo_events:
                apply(w, event)
            # The tree serves calls from its own thread: a query queued behind the last event
            # makes the clock include every event's application, not just its hand-off.
            tree.find_matches(compute_block_hash_for_seq(wl.full_prompt[:BS], BS))
            took = time.perf_counter() - t0
            last["dynamo"] = tree
            return took

        def dynamo_from_vllm_bytes() -> float:
            tree = RadixTree()
            apply = tree.apply_event
            t0 = time.perf_counter()
            for _, w, payload in wl.payloads:
                apply(w, dynamo_json(payload))
            tree.find_matches(compute_block_hash_for_seq(wl.full_prompt[:BS], BS))
            return time.perf_counter() - t0

        runs["dynamo apply_event"] = dynamo_apply
        dynamo_sized = DynamoWorkingSize(wl)
        runs[DYNAMO_WORKING_SIZE] = dynamo_sized.run
        runs["dynamo from vLLM bytes"] = dynamo_from_vllm_bytes
    out.update(best_rates(runs, wl.blocks, repeat, cpu))
    check_ingested(last["kvroute"], wl)
    if RadixTree is not None:
        check_dynamo_ingested(last["dynamo"], wl)
        check_dynamo_ingested(dynamo_sized.tree, wl)  # the last round's stores (each earlier one: `remove`)
    return out, last["kvroute"], last.get("dynamo")


#: The ingest path into an index whose tables are at their working size (`WorkingSize`).
WORKING_SIZE = "kvroute apply_payload, sized"
#: Dynamo's tree at its working size (`DynamoWorkingSize`).
DYNAMO_WORKING_SIZE = "dynamo apply_event, sized"


class Rounds:
    """Timed rounds of a workload's stores into an index kept at its working size: ``remove`` (untimed) takes the
    workload's blocks out, ``store`` puts them back."""

    def remove(self) -> None:
        """Take the workload's blocks out (each worker's own stays)."""
        raise NotImplementedError

    def store(self) -> None:
        """Apply the workload's stores (the blocks not held)."""
        raise NotImplementedError

    def run(self) -> tuple[float, float]:
        """One round: the removals untimed, then the stores' (wall, CPU) seconds."""
        self.remove()
        c0, t0 = time.process_time(), time.perf_counter()
        self.store()
        return time.perf_counter() - t0, time.process_time() - c0


class WorkingSize(Rounds):
    """The workload's stores applied to an index already at its working size, as a router's is after warm-up.

    A fill from empty (the figure above) grows every table as it goes: a worker's engine-hash table and the
    key index re-place their entries at each growth, about a third of that figure's time (session 24). Here
    each worker keeps one block of its own, so it and its tables stay; before each timed round the
    workload's blocks are removed (vLLM's `BlockRemoved`, untimed), and the round stores them again.
    """

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.index = PrefixIndex()
        own = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(BS)), block_size=BS,
                          medium="GPU")
        for worker in {w for w, _, _ in wl.payloads}:
            self.index.apply_payload(worker, encode_batch(EventBatch(time.time(), [own], 0), form="map"))
        self.kept = self.index.num_blocks()
        self.removals = []
        for worker, _, payload in wl.payloads:
            (stored,) = msgspec.msgpack.decode(payload)[1]
            removal = BlockRemoved(block_hashes=stored["block_hashes"], medium="GPU")
            self.removals.append((worker, encode_batch(EventBatch(time.time(), [removal], 0), form="map")))
        self.store()  # the tables grow to their working size

    def store(self) -> None:
        """Apply the workload's stores (the blocks not held)."""
        apply = self.index.apply_payload
        for worker, _, payload in self.wl.payloads:
            apply(worker, payload)
        assert self.index.num_blocks() == self.kept + self.wl.blocks, (self.index.num_blocks(), self.kept)

    def remove(self) -> None:
        """Remove the workload's blocks (each worker's own stays)."""
        apply = self.index.apply_payload
        for worker, payload in self.removals:
            apply(worker, payload)
        assert self.index.num_blocks() == self.kept, (self.index.num_blocks(), self.kept)


class DynamoWorkingSize(Rounds):
    """`WorkingSize` for Dynamo's tree: each worker keeps a block of its own, the workload's blocks are removed
    (Dynamo's JSON ``removed`` event, untimed) before each round, and the round stores them again."""

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.tree = RadixTree()
        for n, worker in enumerate(sorted({w for w, _ in wl.dynamo_events})):
            own = {"parent_hash": None, "blocks": [{"block_hash": 1 << 62 | n, "tokens_hash": 1 << 62 | n}]}
            self.tree.apply_event(worker, json.dumps({"event_id": 0, "data": {"stored": own}}).encode())
        self.removals = []
        for worker, event in wl.dynamo_events:
            hashes = [b["block_hash"] for b in json.loads(event)["data"]["stored"]["blocks"]]
            self.removals.append((worker, json.dumps({"event_id": 0, "data": {"removed": {"block_hashes": hashes}}})
                                  .encode()))
        self.store()

    def sync(self) -> None:
        """Wait for the tree's thread to apply every event handed to it (a query queues behind them)."""
        self.tree.find_matches(compute_block_hash_for_seq(self.wl.full_prompt[:BS], BS))

    def store(self) -> None:
        """Apply the workload's stores and wait for them."""
        apply = self.tree.apply_event
        for worker, event in self.wl.dynamo_events:
            apply(worker, event)
        self.sync()

    def remove(self) -> None:
        """Check the last round's stores (untimed), then remove the workload's blocks and wait for it."""
        check_dynamo_ingested(self.tree, self.wl)
        apply = self.tree.apply_event
        for worker, event in self.removals:
            apply(worker, event)
        self.sync()
        assert not self.tree.find_matches(compute_block_hash_for_seq(self.wl.full_prompt, BS)).scores


def check_ingested(idx: PrefixIndex, wl: Workload) -> None:
    """Every block is in, and the query prompts score as designed (engine rule: at most n-1 tokens)."""
    assert idx.num_blocks() == wl.blocks, (idx.num_blocks(), wl.blocks)
    full, short = idx.find_matches(wl.full_prompt), idx.find_matches(wl.short_prompt)
    n = len(wl.full_prompt) // BS
    assert dict(full) in ({wl.holder[0]: n}, {wl.holder[0]: n - 1}), dict(full)
    assert dict(short) == {wl.holder[0]: SHARED}, dict(short)


def check_dynamo_ingested(tree: Any, wl: Workload) -> None:
    """Dynamo's tree answers the query prompts as kvroute's index does."""
    n = len(wl.full_prompt) // BS
    full = tree.find_matches(compute_block_hash_for_seq(wl.full_prompt, BS)).scores
    short = tree.find_matches(compute_block_hash_for_seq(wl.short_prompt, BS)).scores
    assert full == {(wl.holder[1], 0): n}, full
    assert short == {(wl.holder[1], 0): SHARED}, short


# ---------------------------------------------------------------- figure 2: find_matches


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def latency(call: Callable[[], object], iters: int, repeat: int) -> tuple[float, float]:
    """Best p50 and best p99 (µs) over ``repeat`` rounds of ``iters`` calls."""
    p50s, p99s = [], []
    for _ in range(repeat):
        gc.collect()
        took = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            took.append(time.perf_counter() - t0)
        p50s.append(percentile(took, 0.5) * 1e6)
        p99s.append(percentile(took, 0.99) * 1e6)
    return min(p50s), min(p99s)


def match_figures(wl: Workload, idx: PrefixIndex, tree: Any, iters: int,
                  repeat: int) -> dict[str, tuple[float, float]]:
    """p50 / p99 µs of each query, kvroute (list, array('I')) and Dynamo (hash + match, match alone)."""
    out: dict[str, tuple[float, float]] = {}
    for name, prompt in (("full 512", wl.full_prompt), (f"{SHARED} of 8k", wl.short_prompt)):
        out[f"kvroute {name} list"] = latency(lambda p=prompt: idx.find_matches(p), iters, repeat)
        typed = array("I", prompt)
        if dict(idx.find_matches(typed)) == dict(idx.find_matches(prompt)):
            out[f"kvroute {name} array"] = latency(lambda p=typed: idx.find_matches(p), iters, repeat)
        if tree is not None:
            hashes = compute_block_hash_for_seq(prompt, BS)
            out[f"dynamo {name}"] = latency(
                lambda p=prompt: tree.find_matches(compute_block_hash_for_seq(p, BS)), iters, repeat)
            out[f"dynamo {name} match only"] = latency(lambda h=hashes: tree.find_matches(h), iters, repeat)
    return out


# ---------------------------------------------------------------- figure 3: the table


def report(ingest: dict[str, float], cpu: dict[str, float], match: dict[str, tuple[float, float]], wl: Workload,
           dynamo: bool) -> None:
    """Absolute figures, then kvroute's ratios to the same run's baselines beside the targets."""
    print(f"\ningest: {len(wl.payloads)} vLLM map-form batches, {wl.blocks:,} blocks of {BS} tokens "
          "(wall; per second of the process's CPU time, every thread)")
    for name, rate in ingest.items():
        print(f"  {name:28} {rate:12,.0f} blocks/s   {cpu[name]:12,.0f} blocks/CPU-s")
    print("\nfind_matches (µs, best p50 / best p99)")
    for name, (p50, p99) in match.items():
        print(f"  {name:28} p50 {p50:8.1f}   p99 {p99:8.1f}")

    kv_ingest_name = "kvroute apply_payload" if "kvroute apply_payload" in ingest else "kvroute decode+apply_batch"
    kv_ingest = ingest[kv_ingest_name]
    rows: list[tuple[str, str, str]] = [
        (f"ingest ({kv_ingest_name.removeprefix('kvroute ')}) / bare msgspec decode",
         f"{kv_ingest / ingest['msgspec decode']:.2f}", ">= 3"),
    ]
    if WORKING_SIZE in ingest:
        rows.append(("  the same into an index at its working size",
                     f"{ingest[WORKING_SIZE] / ingest['msgspec decode']:.2f}", ">= 3"))
    if not dynamo:
        print("\nDynamo was not found (pip install ai-dynamo-runtime==1.6.1): kvroute's figures only.")
    else:
        rows.append((f"ingest ({kv_ingest_name.removeprefix('kvroute ')}) / Dynamo apply_event",
                     f"{kv_ingest / ingest['dynamo apply_event']:.2f}", ">= 5"))
        rows.append(("  the same per CPU second (Dynamo's apply thread counted)",
                     f"{cpu[kv_ingest_name] / cpu['dynamo apply_event']:.2f}", ">= 5"))
        if WORKING_SIZE in ingest:
            rows.append(("  each at its working size | per CPU second",
                         f"{ingest[WORKING_SIZE] / ingest[DYNAMO_WORKING_SIZE]:.2f} | "
                         f"{cpu[WORKING_SIZE] / cpu[DYNAMO_WORKING_SIZE]:.2f}", ">= 5"))
        targets = {("full 512", "list"): "<= 0.25", ("full 512", "array"): "<= 0.25",
                   (f"{SHARED} of 8k", "list"): "<= 0.1", (f"{SHARED} of 8k", "array"): "<= 0.05"}
        for (name, form), target in targets.items():
            d50, d99 = match[f"dynamo {name}"]
            if (key := f"kvroute {name} {form}") in match:
                k50, k99 = match[key]
                rows.append((f"find_matches {name} ({form}) / Dynamo, p50 | p99",
                             f"{k50 / d50:.2f} | {k99 / d99:.2f}", target))
    print(f"\n{'kvroute ratio (same run)':58} {'now':>13}   target")
    for name, value, target in rows:
        print(f"  {name:56} {value:>13}   {target}")


def main() -> None:
    """Parse the options, build the workload, measure every figure and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 workers and 50 queries a round: a smoke run")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per figure, the best kept (default 3)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    workers, iters = (4, 50) if args.quick else (16, 300)
    print(f"kvroute {getattr(kvroute, '__version__', '?')}; Dynamo "
          f"{f'ai-dynamo-runtime {DYNAMO_VERSION} RadixTree' if RadixTree is not None else 'not found'}; "
          f"apply_payload {'present' if hasattr(PrefixIndex, 'apply_payload') else 'absent'}; "
          f"best of {args.repeat} rounds")
    wl = make_workload(workers, 12, 512, seed=18)
    cpu: dict[str, float] = {}
    ingest, idx, tree = ingest_figures(wl, args.repeat, cpu)
    match = match_figures(wl, idx, tree, iters, args.repeat)
    report(ingest, cpu, match, wl, tree is not None)


if __name__ == "__main__":
    main()
