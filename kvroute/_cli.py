"""The ``kvroute`` command: one subcommand per job, each defined beside the code it drives."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand registered."""
    from ._cli_discover import register as register_discover
    from ._demo import register as register_demo
    from ._watch import register as register_watch
    from .sim._cli import register as register_sim

    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM and SGLang.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_demo(sub)
    register_discover(sub)
    register_watch(sub)
    register_sim(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command line; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
