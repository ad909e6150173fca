"""The ``kvroute`` command line, built on the `kvroute` and `kvroute.sim` APIs (and, like httpx's, free to use
kvroute's private modules: it ships and is tested with them).

One module per subcommand, each registering its own flags beside the code it drives:

- ``discover`` (`_discover`): ask engines' gRPC servers for their KV-event sources;
- ``watch`` (`_watch`): follow engines' KV events, a live table per worker or JSON lines;
- ``sim`` (`_sim`): run one simulated engine in the foreground;
- ``relay`` (`_relay`): republish engines' KV events to NATS JetStream for router replicas;
- ``demo``: routing policies over simulated engines, in three steps: `_demo_run` (fleet,
  policies, measurement, faults; `run_demo`), `_demo_report` (progress and the results table)
  and `_demo_plot` (the matplotlib figure); `_demo` holds its flags. `_workload` builds the
  requests it sends (synthetic, or a Mooncake trace) and what any router could reach with them.

`_display` holds what they share: exit codes, error lines, table alignment, the rich console.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvroute import __version__

from ._demo_plot import plot
from ._demo_report import DemoResult, FaultNote, PolicyResult, RequestRecord, render
from ._demo_run import POLICIES, DemoOptions, run_demo
from ._display import EXIT_INTERRUPTED
from ._watch import TierTally, WatchRow, plain_table, watch
from ._workload import (
    MOONCAKE_BLOCK_TOKENS,
    Reachable,
    TraceError,
    TraceRecord,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    iter_mooncake_records,
    reachable_hits,
    read_mooncake_trace,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "POLICIES",
    "DemoOptions",
    "DemoResult",
    "FaultNote",
    "PolicyResult",
    "Reachable",
    "RequestRecord",
    "TierTally",
    "TraceError",
    "TraceRecord",
    "WatchRow",
    "WorkloadConfig",
    "WorkloadRequest",
    "build_parser",
    "generate_workload",
    "iter_mooncake_records",
    "main",
    "plain_table",
    "plot",
    "reachable_hits",
    "read_mooncake_trace",
    "render",
    "run_demo",
    "watch",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand registered."""
    from ._demo import register as register_demo
    from ._discover import register as register_discover
    from ._relay import register as register_relay
    from ._sim import register as register_sim
    from ._watch import register as register_watch

    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM and SGLang.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_demo(sub)
    register_discover(sub)
    register_watch(sub)
    register_sim(sub)
    register_relay(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command line; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return code
