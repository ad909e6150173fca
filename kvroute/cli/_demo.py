"""``kvroute demo``: the flags, then run (`_demo_run`), report (`_demo_report`) and plot (`_demo_plot`)."""

from __future__ import annotations

import argparse
import sys

import anyio
import msgspec

from kvroute import CostModel, KvRouteError

from . import _demo_run
from ._demo_plot import plot
from ._demo_report import render
from ._demo_run import POLICIES, DemoOptions, run_demo
from ._display import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error
from ._workload import MOONCAKE_BLOCK_TOKENS, TRACE_SHAPES, TraceError, WorkloadConfig

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand to the ``kvroute`` parser."""
    p = sub.add_parser(
        "demo",
        help="route a shared-prefix workload over simulated engines: kvroute vs an oracle and the usual baselines",
        description=_demo_run.__doc__.split("\n\n")[1] if _demo_run.__doc__ else None,
    )
    p.add_argument("--engines", type=int, default=4, help="simulated engines per policy (default 4: 6 workers)")
    p.add_argument("--requests", type=int, default=None, help="requests (default 600; with --trace: all records)")
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed (default 0)")
    p.add_argument("--faults", action="store_true", help="inject message drops and an engine restart mid-run")
    p.add_argument(
        "--gateway-stream",
        action="store_true",
        help="engines serve the gateway servicer's SubscribeKvEvents stream; routers follow it instead of ZMQ",
    )
    p.add_argument("--plot", metavar="FILE.png", help="save hit rate and TTFT over time per policy (matplotlib)")
    p.add_argument("--trace", metavar="FILE.jsonl", help="replay a Mooncake-format trace instead")
    p.add_argument(
        "--trace-shape",
        choices=TRACE_SHAPES,
        help="replay a generated Mooncake-format trace of this shape instead (--requests records, default 400)",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="tokens per trace hash id (default 512, Mooncake's)",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="replay the trace this many times faster, engines included: arrivals and simulated prefill and"
        " decode times are divided by it, so the fleet carries the trace's own load; reported times are the"
        " run's, 1/SPEEDUP of the trace's (default 10)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=WorkloadConfig().rate,
        help=f"synthetic arrivals per second (default {WorkloadConfig().rate:g})",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (trace: the cap; default 16)")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="KV blocks per rank (default 1024: ten conversations, so caches evict; with --trace 32768 of 16 tokens,"
        " what an 80 GB GPU holds for an 8B model; with --trace-shape half the trace's distinct blocks over the"
        " fleet's ranks, at least 8 mean-sized requests a rank, so caches turn over within the sessions' reuse, as a"
        " busy fleet's do)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run kvroute as N router processes, requests spread over them, with router-only and with engine"
        " load (the fleet then serves gateway streams); default 1",
    )
    p.add_argument(
        "--jetstream",
        action="store_true",
        help="with --replicas N: one relay follows the engines and the N replicas follow its NATS JetStream log"
        " (starts a nats-server; docs/replicas.md)",
    )
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=CostModel().overlap_weight,
        help="CostModel.overlap_weight of kvroute and the oracle: prefill saved against load"
        f" (default {CostModel().overlap_weight:g}, the SDK's)",
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated policies to run, in order (default {','.join(POLICIES)}; also "
        "kvroute_index_only: kvroute without its routing hint; kvroute_no_footprint: without its footprint; "
        "kvroute_long_prefix: with CostModel.long_prefix on; kvroute_long_move: with CostModel.long_move on; "
        "kvroute_hashed: new sessions placed by a hash of "
        "their leading tokens instead of the footprint, a prototype)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object keyed by policy")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        options = DemoOptions(
            engines=args.engines,
            requests=args.requests,
            seed=args.seed,
            faults=args.faults,
            gateway_stream=args.gateway_stream,
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            trace=args.trace,
            trace_shape=args.trace_shape,
            trace_block_tokens=args.trace_block_tokens,
            speedup=args.speedup,
            rate=args.rate,
            max_tokens=args.max_tokens,
            capacity_blocks=args.capacity_blocks,
            overlap_weight=args.overlap_weight,
            replicas=args.replicas,
            jetstream=args.jetstream,
        )
    except ValueError as exc:
        return error("demo", exc, EXIT_USAGE)
    try:
        result = anyio.run(lambda: run_demo(options, progress=not args.json))
    except (TraceError, KvRouteError, OSError, TimeoutError) as exc:
        return error("demo", exc, EXIT_FAILED)
    if args.json:
        sys.stdout.write(msgspec.json.encode(result.policies).decode() + "\n")
    else:
        render(result, sys.stdout)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            return error("demo", "--plot needs matplotlib: pip install 'kvroute[demo]'", EXIT_FAILED)
        if not args.json:
            print(f"plot saved to {args.plot}")
    return EXIT_OK
