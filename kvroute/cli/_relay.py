"""``kvroute relay``: follow engines and republish what was applied to a NATS JetStream stream (docs/replicas.md).

Any number of relays may run for one stream: one holds the lease and publishes, the others stand by
(each keeps a replica of the log) and take over within ``--lease-ttl`` seconds when it dies.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import anyio

from kvroute import DiscoveryOptions, JetStreamRelay, KvRouteError
from kvroute._discovery import ENGINES

from ._display import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error


async def relay(
    targets: list[str],
    *,
    servers: list[str],
    stream: str = "KVROUTE",
    engine: str = "auto",
    name: str | None = None,
    snapshot_interval: float = 10.0,
    lease_ttl: float = 3.0,
    lease_stall: float | None = None,
    storage: str = "file",
    max_age: float = 24 * 3600.0,
    status_interval: float = 5.0,
    timeout: float = 5.0,  # noqa: ASYNC109 (discovery's own per-call timeout)
    duration: float | None = None,
    runs_records: bool = True,
    out: TextIO | None = None,
) -> None:
    """Run one relay for ``targets`` until cancelled (or ``duration`` seconds); a status line every interval."""
    out = out or sys.stdout
    async with JetStreamRelay(
        servers,
        targets=targets,
        stream=stream,
        discovery_options=DiscoveryOptions(engine=engine, timeout=timeout),
        snapshot_interval=snapshot_interval,
        lease_ttl=lease_ttl,
        lease_stall=lease_stall,
        storage=storage,
        max_age=max_age,
        name=name,
        runs_records=runs_records,
    ) as r:
        print(f"kvroute relay {r.name}: stream {stream} on {', '.join(servers)}", file=out, flush=True)
        started = time.monotonic()
        while duration is None or time.monotonic() - started < duration:
            await anyio.sleep(status_interval if duration is None else min(status_interval, duration))
            st = r.stats()
            print(
                f"{r.name} {'active' if st.active else 'standby'}: {st.batches} batches ({st.blocks} blocks),"
                f" {st.records} records, {st.duplicates} duplicates, sessions {st.sessions},"
                f" snapshot at {st.snapshot_seq}",
                file=out,
                flush=True,
            )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``relay`` subcommand to the ``kvroute`` parser."""
    p = sub.add_parser(
        "relay",
        help="follow engines and republish their KV events to NATS JetStream for router replicas",
        description="Discover the engines at TARGET, follow every rank's KV events as KvEventClient does, and"
        " republish what was applied (batches, resets, partial histories, removals) to a JetStream stream,"
        " with index snapshots in its object store. Run two for high availability.",
    )
    p.add_argument("targets", nargs="+", metavar="TARGET", help="an engine's gRPC address, host:port")
    p.add_argument("--nats", action="append", metavar="URL", help="NATS server URL (repeatable; default local)")
    p.add_argument("--stream", default="KVROUTE", help="JetStream stream name (default KVROUTE)")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="discovery protocol (default auto)")
    p.add_argument("--name", default=None, help="this relay's name in the lease (default: random)")
    p.add_argument("--snapshot-interval", type=float, default=10.0, metavar="S", help="default 10 s")
    p.add_argument("--lease-ttl", type=float, default=3.0, metavar="S", help="takeover after S s (default 3)")
    p.add_argument(
        "--lease-stall",
        type=float,
        default=None,
        metavar="S",
        help="let the lease go when this relay's event loop has not run for S s (>= --lease-ttl;"
        " default max(30, 10 x ttl))",
    )
    p.add_argument("--storage", choices=("file", "memory"), default="file", help="stream storage (default file)")
    p.add_argument("--max-age", type=float, default=24 * 3600.0, metavar="S", help="retention (default 1 day)")
    p.add_argument("--status-interval", type=float, default=5.0, metavar="S", help="status line every S s")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="discovery timeout (default 5 s)")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    p.add_argument(
        "--no-runs-records",
        dest="runs_records",
        action="store_false",
        help="one batches record per worker, as relays before runs records: while followers older than "
        "them still read the stream (they skip runs records and over-claim; docs/replicas.md)",
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if not (args.snapshot_interval > 0 and args.lease_ttl > 0 and args.status_interval > 0 and args.timeout > 0):
        return error("relay", "--snapshot-interval, --lease-ttl, --status-interval, --timeout must be > 0", EXIT_USAGE)
    if args.lease_stall is not None and not args.lease_stall >= args.lease_ttl:
        return error("relay", "--lease-stall must be >= --lease-ttl", EXIT_USAGE)
    try:
        anyio.run(
            lambda: relay(
                args.targets,
                servers=args.nats or ["nats://127.0.0.1:4222"],
                stream=args.stream,
                engine=args.engine,
                name=args.name,
                snapshot_interval=args.snapshot_interval,
                lease_ttl=args.lease_ttl,
                lease_stall=args.lease_stall,
                storage=args.storage,
                max_age=args.max_age,
                status_interval=args.status_interval,
                timeout=args.timeout,
                duration=args.duration,
                runs_records=args.runs_records,
            )
        )
    except (KvRouteError, ValueError) as exc:
        return error("relay", exc, EXIT_FAILED)
    return EXIT_OK
