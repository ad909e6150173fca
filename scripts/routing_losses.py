"""Where a demo policy's prefix-cache hits went: each request's infinite-cache hits against what it got.

    python scripts/routing_losses.py conversation --seeds 0,1,2 --policies kvroute,session_affinity,oracle
    python scripts/routing_losses.py --trace conversation_trace.jsonl --requests 400 --seeds 0,1,2

Runs ``kvroute demo --trace-shape SHAPE`` (or ``--trace FILE``, a Mooncake-format trace such as the published
ones) in-process, once per seed, with every policy wrapped: at each decision it records
what each worker's engine truly holds of the prompt, what the index claims, and the longest prefix the
prompt shares with a request the policy has in flight on that worker. After the run each request's shortfall
(its infinite-cache hits, `reachable_hits`, minus the tokens the engine found cached) is split into:

- ``nowhere``: no worker held the prefix nor had it in flight (eviction, or never routed together);
- ``placement: index knew (load/weight)``: the best worker held it, the index said so, and the cost model
  sent the request elsewhere (the overlap-vs-load weight);
- ``placement: index lag``: the best worker held it but the index did not claim it yet;
- ``placement: only in flight``: no cache held it yet, but a request the policy had in flight was
  prefilling it on another worker (invisible to an index fed by the engines' events);
- ``engine-side``: the chosen worker had it (or had it in flight) and the engine still recomputed it:
  ``admitted before computed`` (only in flight there: admitted before the in-flight request's blocks were
  stored) or ``evicted before admitted`` (cached there when routed, evicted while the request queued).

The demo's kvroute credits its own in-flight prompts (`Router(routed_ttl=)`, the routing hint), which
addresses the last two; ``kvroute_index_only`` is kvroute without it. Figures are shares of the run's
prompt tokens. Concurrency makes runs differ by a few tenths of a point (several points on the conversation
shape), hence ``--seeds``: with more than one, a summary per policy follows (mean hit rate and TTFT p50, the range
of its ratios to the oracle, and the runs it was above session affinity on hits, and on hits and TTFT p50 both).

``kvroute_long_prefix`` is kvroute with `CostModel.long_prefix` on (``--long-prefix-floor`` /
``--long-prefix-scale`` set its figures); ``kvroute_long_move`` is kvroute with `CostModel.long_move` on
(``--long-move-floor`` / ``--long-move-scale``; on by default since session 13, as it is for ``kvroute`` and the
oracle), ``kvroute_no_long_move`` kvroute with it off (the default before). ``--record FILE`` appends each
run's figures to a JSON-lines file as it ends, and ``--summarize FILE...`` prints the summary of the runs
recorded there (runs made in several processes, or cut short, still add up).

Each policy's line also gives its new sessions per worker: requests no engine held nor was computing
half of when they were routed (the footprint's "new placement", `CostModel.footprint_band`, judged
by the engines' truth), counted per chosen worker. ``kvroute_no_footprint`` is kvroute without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from array import array
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import anyio
import xxhash

from kvroute import CostModel, KvEventClient, WorkerKey
from kvroute.cli import _demo_run
from kvroute.cli._demo_policies import KvRoutePolicy, Policy
from kvroute.cli._demo_policies import make_policy as _make_policy
from kvroute.cli._workload import TRACE_SHAPES, WorkloadRequest
from kvroute.sim import SimEngine

BS = 16
#: The key of an idle worker's figures in a decision's ``priced`` (idle workers are priced as one group).
_IDLE = WorkerKey("(idle)", -1)


def _lcp_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b)) // BS
    i = 0
    while i < n and a[i * BS : (i + 1) * BS] == b[i * BS : (i + 1) * BS]:
        i += 1
    return i


class _Recorder:
    """A policy wrapper recording, per decision, each worker's true, claimed and in-flight overlap (tokens)."""

    def __init__(self, inner: Policy, client: KvEventClient, engines: Sequence[SimEngine]) -> None:
        self.inner = inner
        self.client = client
        self.by_target = {e.grpc_target: e for e in engines}
        self.active: dict[Hashable, tuple[WorkerKey, Sequence[int]]] = {}
        self.log: dict[int, dict[str, Any]] = {}

    def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        n = len(token_ids)
        truth: dict[WorkerKey, int] = {}
        flight: dict[WorkerKey, int] = {}
        for w in self.client.live_workers():
            truth[w] = self.by_target[w.worker_id].cache(w.dp_rank).match_blocks(token_ids) * BS
            held = [_lcp_blocks(token_ids, t) for w2, t in self.active.values() if w2 == w]
            flight[w] = max(held, default=0) * BS
        claimed = {w: min(n, c * BS) for w, c in self.client.index.find_matches(token_ids).items()}
        priced: dict[WorkerKey, tuple[float, float, float]] = {}
        if type(self.inner) is KvRoutePolicy:  # a subclass chooses otherwise
            # What `KvRoutePolicy.choose` does, keeping the decision: each candidate's (prefill, load, cost).
            decision = self.inner.router.select(token_ids, request_id=request_id)
            worker = decision.worker
            priced = {c.worker: (c.prefill_blocks, c.load_blocks, c.cost) for c in decision.candidates}
            priced[_IDLE] = (n / BS, 0.0, decision.idle_cost)
        else:
            worker = self.inner.choose(request_id, token_ids)
        self.active[request_id] = (worker, token_ids)
        assert isinstance(request_id, tuple)  # the demo's ids: (request id, attempt)
        self.log[request_id[0]] = {
            "n": n,
            "truth": truth,
            "flight": flight,
            "claimed": claimed,
            "chosen": worker,
            "priced": priced,
        }
        return worker

    def prefill_done(self, request_id: Hashable) -> None:
        self.inner.prefill_done(request_id)

    def finished(self, request_id: Hashable) -> None:
        self.active.pop(request_id, None)
        self.inner.finished(request_id)


def _reach(workload: Sequence[WorkloadRequest]) -> dict[int, int]:
    """Each request's hits in an infinite cache that saw every earlier request (as `reachable_hits` counts)."""
    stored: set[bytes] = set()
    out = {}
    for req in sorted(workload, key=lambda r: r.arrival):
        t, key, hits, matching = req.token_ids, b"", 0, True
        for s in range(0, len(t) - BS + 1, BS):
            key = xxhash.xxh3_128_digest(key + array("I", t[s : s + BS]).tobytes())
            if matching and s + BS <= len(t) - 1 and key in stored:
                hits += 1
            else:
                matching = False
            stored.add(key)
        out[req.id] = hits * BS
    return out


class _Figures(NamedTuple):
    """One policy's figures in one run."""

    hit_rate: float
    ttft_p50: float
    oracle_share: float | None
    oracle_ttft_ratio: float | None
    load_imbalance: float


def _one_run(args: argparse.Namespace, seed: int) -> dict[str, _Figures]:
    """Run the demo once (every policy on fresh identical fleets), print each policy's shortfall by cause."""
    recorders: dict[str, _Recorder] = {}

    def make_policy(name: str, client: KvEventClient, engines: Sequence[SimEngine], **kw: Any) -> _Recorder:
        kw["cost"] = CostModel(
            overlap_weight=args.overlap_weight,
            footprint_band=args.footprint_band,
            long_prefix_floor=args.long_prefix_floor,
            long_prefix_scale=args.long_prefix_scale,
            long_move_floor=args.long_move_floor,
            long_move_scale=args.long_move_scale,
        )
        inner = _make_policy(name, client, engines, **kw)
        rec = recorders[name] = _Recorder(inner, client, engines)
        return rec

    _demo_run.make_policy = make_policy  # type: ignore[attr-defined]  # the demo builds its policies through this name
    options = _demo_run.DemoOptions(
        trace_shape=args.shape,
        trace=args.trace,
        requests=args.requests,
        seed=seed,
        policies=tuple(args.policies.split(",")),
        overlap_weight=args.overlap_weight,
        capacity_blocks=args.capacity_blocks,
    )
    workload, capacity, _ = _demo_run._workload(options)
    reach = _reach(workload)
    load_before = os.getloadavg()[0]
    result = anyio.run(lambda: _demo_run.run_demo(options))
    print(
        f"== {args.trace or args.shape} seed {seed}: {len(workload)} records, {capacity} blocks a rank, "
        f"load average {load_before:.1f}-{os.getloadavg()[0]:.1f}"
    )
    figures = {}
    moved: dict[str, list[int]] = {}  # per policy, the requests it moved off a worker the index knew held more
    for name, records in result.records.items():
        log = recorders[name].log
        total = sum(r.prompt_tokens for r in records)
        lost: collections.Counter[str] = collections.Counter()
        starts: collections.Counter[WorkerKey] = collections.Counter({w: 0 for w in log[records[0].id]["truth"]})
        moves = 0
        # kvroute's moves, as its Router priced them: (the holder's load above the chosen's, the recompute
        # at the chosen worker, both in blocks of BS tokens; whether the chosen cost more: the footprint's pick)
        priced_moves: list[tuple[float, float, bool]] = []
        for r in records:
            d = log[r.id]
            n = d["n"]

            def cap(v: int, n: int = n) -> int:
                return min(v, n - 1) // BS * BS  # engines never count the last prompt token as cached

            def anywhere(w: WorkerKey, d: dict[str, Any] = d) -> int:
                return cap(max(d["truth"][w], d["flight"][w]))

            best = max(d["truth"], key=anywhere)
            chosen = d["chosen"]
            if max(max(d["truth"][w], d["flight"][w]) for w in d["truth"]) < n / 2:
                starts[chosen] += 1
            lost["nowhere"] += max(0, reach[r.id] - anywhere(best))
            gap = anywhere(best) - anywhere(chosen)
            if gap > 0:
                if cap(d["truth"][best]) < anywhere(best):
                    lost["placement: only in flight"] += gap
                elif d["claimed"].get(best, 0) >= cap(d["truth"][best]) - BS:
                    lost["placement: index knew (load/weight)"] += gap
                    moves += 1
                    moved.setdefault(name, []).append(r.id)
                    priced = d["priced"]
                    if priced:
                        p_c, load_c, cost_c = priced.get(chosen, priced[_IDLE])
                        _, load_b, cost_b = priced.get(best, priced[_IDLE])
                        priced_moves.append((load_b - load_c, p_c, cost_c > cost_b))
                else:
                    lost["placement: index lag"] += gap
            short = anywhere(chosen) - r.cached_tokens
            # Held in the chosen cache when routed: evicted before the engine admitted it; otherwise only
            # in flight there: admitted before the request computing it had stored those blocks.
            held = cap(d["truth"][chosen]) >= anywhere(chosen)
            side = "evicted before admitted" if held else "admitted before computed"
            lost[f"engine-side: {side}"] += short
        res = result.policies[name]
        share = f"{res.oracle_share:.2f}" if res.oracle_share is not None else "-"
        ratio = f"{res.oracle_ttft_ratio:.2f}" if res.oracle_ttft_ratio is not None else "-"
        print(
            f"{name}: hit rate {res.hit_rate:.1%} (÷ oracle {share}), infinite cache {res.reachable_hit_rate:.1%}, "
            f"TTFT p50 {res.ttft_p50 * 1e3:.2f} ms (÷ oracle {ratio}); {moves} requests moved off a worker the "
            f"index knew held more; new sessions per worker {sorted(starts.values())}"
        )
        figures[name] = _Figures(
            res.hit_rate, res.ttft_p50, res.oracle_share, res.oracle_ttft_ratio, res.load_imbalance
        )
        for cause, tokens in sorted(lost.items()):
            print(f"  {cause:<40} {tokens / total:7.2%}")
        if priced_moves:
            queue = sorted(m[0] * BS for m in priced_moves)
            redo = sorted(m[1] * BS for m in priced_moves)
            print(
                f"  moves as priced: the holder's queue above the chosen's {queue[len(queue) // 2]:,.0f} tokens "
                f"(median; {queue[0]:,.0f} to {queue[-1]:,.0f}), recomputing {redo[len(redo) // 2]:,.0f} "
                f"({redo[0]:,.0f} to {redo[-1]:,.0f}); {sum(m[2] for m in priced_moves)} of {len(priced_moves)} "
                "cost more than the holder (the footprint's pick of a new placement)"
            )

    if "session_affinity" in result.records:
        sticky = {r.id: r for r in result.records["session_affinity"]}
        for name, ids in moved.items():
            if name == "session_affinity":
                continue
            mine = {r.id: r for r in result.records[name]}
            both = [i for i in ids if i in sticky]
            if not both:
                continue
            # The same requests under session affinity, which kept them: what each move bought and cost.
            ttft_m = sorted(mine[i].ttft for i in both)
            ttft_s = sorted(sticky[i].ttft for i in both)
            print(
                f"{name}'s {len(both)} moved requests: TTFT median {ttft_m[len(both) // 2] * 1e3:.1f} ms "
                f"against {ttft_s[len(both) // 2] * 1e3:.1f} under session affinity; cached "
                f"{sum(mine[i].cached_tokens for i in both):,} against {sum(sticky[i].cached_tokens for i in both):,} "
                f"tokens (of {sum(mine[i].prompt_tokens for i in both):,})"
            )
    return figures


def _summary(runs: Sequence[dict[str, _Figures]]) -> None:
    """Each policy over the runs: mean hit rate and TTFT p50, the oracle ratios' mean and range, the load
    imbalance, and the runs above session affinity (on hits; on hits and TTFT p50 both)."""
    print(f"== summary over {len(runs)} runs: mean hit rate / TTFT p50; ÷ oracle mean (min-max); runs above affinity")
    for name in runs[0]:
        figs = [run[name] for run in runs if name in run]
        hits = sum(f.hit_rate for f in figs) / len(figs)
        ttft = sum(f.ttft_p50 for f in figs) / len(figs)
        imbalance = [f.load_imbalance for f in figs]
        line = f"  {name:<22} {hits:6.1%} / {ttft * 1e3:7.2f} ms; imbalance {min(imbalance):.2f}-{max(imbalance):.2f}"
        shares = [f.oracle_share for f in figs if f.oracle_share is not None]
        ratios = [f.oracle_ttft_ratio for f in figs if f.oracle_ttft_ratio is not None]
        if shares and ratios:
            line += (
                f"; ÷ oracle hits {sum(shares) / len(shares):.2f} ({min(shares):.2f}-{max(shares):.2f}),"
                f" TTFT {sum(ratios) / len(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}),"
                f" TTFT ≤ 1.1 in {sum(r <= 1.1 for r in ratios)}/{len(ratios)}"
            )
        if name != "session_affinity" and "session_affinity" in runs[0]:
            pairs = [(run[name], run["session_affinity"]) for run in runs if name in run]
            on_hits = sum(f.hit_rate > a.hit_rate for f, a in pairs)
            both = sum(f.hit_rate > a.hit_rate and f.ttft_p50 < a.ttft_p50 for f, a in pairs)
            diff = [(f.hit_rate - a.hit_rate) * 100 for f, a in pairs]
            line += (
                f"; above affinity on hits {on_hits}/{len(pairs)}, on both {both}/{len(pairs)}"
                f" (mean {sum(diff) / len(diff):+.2f} points, {min(diff):+.1f} to {max(diff):+.1f})"
            )
        if name not in ("kvroute", "session_affinity") and "kvroute" in runs[0]:
            pairs = [(run[name], run["kvroute"]) for run in runs if name in run]
            diff = [(f.hit_rate - k.hit_rate) * 100 for f, k in pairs]
            per = [f.ttft_p50 / k.ttft_p50 for f, k in pairs if k.ttft_p50]
            line += (
                f"; vs kvroute on hits mean {sum(diff) / len(diff):+.2f} points ({min(diff):+.1f} to {max(diff):+.1f},"
                f" above in {sum(d > 0 for d in diff)}/{len(diff)})"
            )
            if per:
                line += f", TTFT p50 ÷ kvroute's {sum(per) / len(per):.3f} ({min(per):.2f}-{max(per):.2f})"
        print(line)


def _record(path: str, label: str, seed: int, figures: dict[str, _Figures]) -> None:
    """Append one run's figures to the JSON-lines file ``path``."""
    with open(path, "a") as f:
        row = {"label": label, "seed": seed, "load": os.getloadavg()[0]}
        row["figures"] = {name: fig._asdict() for name, fig in figures.items()}
        f.write(json.dumps(row) + "\n")


def _recorded(paths: Sequence[str]) -> dict[str, list[dict[str, _Figures]]]:
    """The runs recorded in ``paths`` (`_record`), by label."""
    by_label: dict[str, list[dict[str, _Figures]]] = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                by_label[row["label"]].append({n: _Figures(**v) for n, v in row["figures"].items()})
    return by_label


def main() -> None:
    """Parse the flags, run the demo once per seed with every policy recorded, print the shortfalls and a summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("shape", nargs="?", choices=TRACE_SHAPES, help="a generated trace shape (or --trace)")
    p.add_argument("--trace", help="a Mooncake-format JSON-lines trace file instead of a generated shape")
    p.add_argument("--requests", type=int, default=None, help="records (default: the demo's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, help="comma-separated seeds, one run each (overrides --seed)")
    p.add_argument("--policies", default="kvroute,session_affinity,oracle")
    p.add_argument("--overlap-weight", type=float, default=CostModel().overlap_weight)
    p.add_argument("--footprint-band", type=float, default=CostModel().footprint_band, help="CostModel.footprint_band")
    p.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per rank (default: the demo's)")
    p.add_argument(
        "--long-prefix-floor",
        type=float,
        default=CostModel().long_prefix_floor,
        help="CostModel.long_prefix_floor (of every policy's cost model; kvroute_long_prefix turns the term on)",
    )
    p.add_argument(
        "--long-prefix-scale", type=float, default=CostModel().long_prefix_scale, help="CostModel.long_prefix_scale"
    )
    p.add_argument(
        "--long-move-floor",
        type=float,
        default=CostModel().long_move_floor,
        help="CostModel.long_move_floor (of every policy's cost model; the term is on by default)",
    )
    p.add_argument(
        "--long-move-scale", type=float, default=CostModel().long_move_scale, help="CostModel.long_move_scale"
    )
    p.add_argument("--record", help="append each run's figures to this JSON-lines file")
    p.add_argument("--summarize", nargs="+", metavar="FILE", help="print the summary of the runs recorded in FILEs")
    args = p.parse_args()
    if args.summarize:
        for label, runs in sorted(_recorded(args.summarize).items()):
            print(f"# {label}")
            _summary(runs)
        return
    if (args.shape is None) == (args.trace is None):
        p.error("give a trace shape or --trace FILE (one of them)")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    runs = []
    for seed in seeds:
        runs.append(_one_run(args, seed))
        if args.record:
            _record(args.record, os.path.basename(args.trace) if args.trace else args.shape, seed, runs[-1])
    if len(runs) > 1:
        _summary(runs)


if __name__ == "__main__":
    main()
