"""``kvroute watch TARGET...``: discover engines, subscribe, and show what their KV caches do, live.

Usage::

    kvroute watch HOST:PORT [HOST:PORT ...] [--engine auto|vllm|sglang] [--json] [--duration S]
        [--interval S] [--quiet-interval S] [--timeout S]

The table (rich when installed, plain text otherwise) has one row per worker (engine, rank):
sync state, partial flag, blocks held per tier, blocks in the index, engine events per second,
last applied seq, gaps, replays, checks and resets; under the title, a line per target whose
discovery is failing, with its last error; under the table, what the columns mean (`LEGEND`).

Replays and checks are told apart: a replay recovers something (the cold start's history, a
gap, a retry), a check is routine — a quiet source is probed every ``--quiet-interval`` for a
lost tail, and a reconnect asks whether the engine is still the same process — so an idle
fleet's checks climb while its replays stay put. With ``--json`` every envelope of
`KvEventClient.events()` (engine and lifecycle events) is written to stdout as one JSON line,
``{"source": {...}, "seq": N|null, "ts": T, "event": {"type": ..., ...}}``.

Blocks per tier are tallied from the event stream itself (stored adds, removed subtracts,
cleared / reset / removed empties); a row whose stream overflowed is marked ``~`` (its tally
may be off; the index column is exact either way).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from typing import TextIO

import anyio
import msgspec

from kvroute import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DiscoveryOptions,
    Envelope,
    KvEventClient,
    KvRouteError,
    Overflow,
    Removed,
    Reset,
    SubscriberConfig,
    WorkerKey,
)
from kvroute._discovery import ENGINES, discover_with
from kvroute._load import EngineLoad
from kvroute._models import TIERS, normalize_medium
from kvroute._wire import BlockHash

from . import _display
from ._display import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error

__all__ = ["LEGEND", "TierTally", "WatchRow", "plain_table", "register", "watch"]


class WatchRow(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's line of the table."""

    worker_id: str
    dp_rank: int
    engine: str
    state: str
    partial: bool
    connected: bool
    tiers: dict[str, int]
    tiers_exact: bool
    index_blocks: int
    events_per_s: float
    last_seq: int
    gaps: int
    #: Recovery replays: cold start, gap, retry (`SourceStats.replays` less probes and identity checks).
    replays: int
    resets: int
    #: Routine replays that found nothing wrong or vouched for the engine: quiet probes and identity checks.
    checks: int = 0
    #: The engine's reported load (gateway streams): "running/waiting qQUEUED_TOKENS", "-" without one.
    load: str = "-"


class TierTally:
    """Blocks per worker per tier, followed from an envelope stream (module docstring)."""

    def __init__(self) -> None:
        self._held: dict[WorkerKey, dict[str, set[BlockHash]]] = {}
        self._events: dict[WorkerKey, int] = {}
        self._inexact: set[WorkerKey] = set()

    def feed(self, env: Envelope) -> None:
        """Account for one envelope."""
        key = env.source.key
        event = env.event
        if isinstance(event, BlockStored):
            self._tier(key, normalize_medium(event.medium)).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._tier(key, normalize_medium(event.medium)).difference_update(event.block_hashes)
        elif isinstance(event, (AllBlocksCleared, Reset, Removed)):
            self._held.pop(key, None)
            if not isinstance(event, AllBlocksCleared):
                self._inexact.discard(key)  # the index dropped the worker too: both start over
        elif isinstance(event, Overflow):
            # The stream lost envelopes of unknown sources: every tally may be off.
            self._inexact.update(self._held)
        if env.seq is not None:
            self._events[key] = self._events.get(key, 0) + 1

    def _tier(self, key: WorkerKey, tier: str) -> set[BlockHash]:
        return self._held.setdefault(key, {}).setdefault(tier, set())

    def tiers(self, key: WorkerKey) -> dict[str, int]:
        """Blocks ``key`` holds per tier (every tier present, 0 when none)."""
        held = self._held.get(key, {})
        return {tier: len(held.get(tier, ())) for tier in TIERS}

    def exact(self, key: WorkerKey) -> bool:
        """False once the stream overflowed after this worker's last reset."""
        return key not in self._inexact

    def events(self, key: WorkerKey) -> int:
        """Engine events seen from ``key`` in total."""
        return self._events.get(key, 0)


def rows(client: KvEventClient, tally: TierTally, rates: dict[WorkerKey, float]) -> list[WatchRow]:
    """The table's rows for the client's current sources, by worker."""
    stats = client.stats().sources
    out = []
    for source in sorted(client.sources(), key=lambda s: s.key):
        key = source.key
        st = stats.get(key)
        if st is None:
            continue
        out.append(
            WatchRow(
                worker_id=key.worker_id,
                dp_rank=key.dp_rank,
                engine=source.engine,
                state=st.state,
                partial=st.partial,
                connected=st.connected,
                tiers=tally.tiers(key),
                tiers_exact=tally.exact(key),
                index_blocks=client.index.num_blocks(key),
                events_per_s=round(rates.get(key, 0.0), 1),
                last_seq=st.last_seq,
                gaps=st.gaps,
                replays=st.replays - st.probes - st.identity_checks,
                checks=st.probes + st.identity_checks,
                resets=st.resets,
                load=_load_cell(st.load),
            )
        )
    return out


def _load_cell(load: EngineLoad | None) -> str:
    if load is None:
        return "-"
    wedged = f" silent {load.engine_silence_ms / 1000:.0f}s" if load.engine_silence_ms else ""
    return f"{load.running_requests}/{load.waiting_requests} q{load.queued_tokens}{wedged}"


_HEADER = (
    *("worker", "rank", "engine", "state"),
    *("GPU", "CPU", "DISK", "EXT", "indexed"),
    *("ev/s", "seq", "gaps", "replays", "checks", "resets", "load"),
)

#: What the columns mean, shown under the table.
LEGEND = (
    "GPU..EXT: blocks per tier tallied from the event stream (~: the stream overflowed, may be off); "
    "indexed: blocks the index holds for the worker (exact); seq: last applied; "
    "replays: recoveries (cold start, gap, retry); checks: routine probes of a quiet source and identity "
    "checks after a reconnect, which climb while idle; load: the engine's running/waiting requests and "
    "queued tokens (gateway streams)"
)


def _cells(row: WatchRow) -> list[str]:
    mark = "" if row.tiers_exact else "~"
    state = row.state + (" partial" if row.partial else "") + ("" if row.connected else " (disconnected)")
    return [
        row.worker_id,
        str(row.dp_rank),
        row.engine,
        state,
        *(f"{mark}{row.tiers[t]:,}" for t in TIERS),
        f"{row.index_blocks:,}",
        f"{row.events_per_s:.1f}",
        str(row.last_seq),
        str(row.gaps),
        str(row.replays),
        str(row.checks),
        str(row.resets),
        row.load,
    ]


def plain_table(table_rows: Iterable[WatchRow]) -> str:
    """The table as aligned plain text."""
    return "\n".join(_display.align([list(_HEADER), *(_cells(r) for r in table_rows)], right_from=4))


class _PlainDisplay:
    """Plain-text snapshots: every refresh on a terminal, else only the final table (logs stay short)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def show(self, table_rows: list[WatchRow], title: str, final: bool = False) -> None:
        if final or self._out.isatty():
            print(f"{title}\n{plain_table(table_rows)}\n{LEGEND}\n", file=self._out, flush=True)

    def close(self) -> None:
        return None


class _RichDisplay:
    """A rich Live table, refreshed by `watch`'s own task (auto_refresh would start a thread)."""

    def __init__(self, out: TextIO) -> None:
        from rich.live import Live

        self._live = Live(console=_display.console(out), auto_refresh=False)
        self._live.start()

    def show(self, table_rows: list[WatchRow], title: str, final: bool = False) -> None:
        from rich.table import Table

        table = Table(title=title, caption=LEGEND)
        for i, name in enumerate(_HEADER):
            table.add_column(name, justify="left" if i < 4 else "right")
        for row in table_rows:
            table.add_row(*_cells(row))
        self._live.update(table, refresh=True)

    def close(self) -> None:
        self._live.stop()
        if not self._live.console.is_terminal:
            self._live.console.line()  # rich leaves the final table without its newline off a terminal


def _table_display(out: TextIO) -> _PlainDisplay | _RichDisplay:
    try:
        return _RichDisplay(out)
    except ImportError:
        return _PlainDisplay(out)


async def watch(
    targets: list[str],
    *,
    engine: str = "auto",
    json_lines: bool = False,
    duration: float | None = None,
    interval: float = 1.0,
    quiet_interval: float = 2.0,
    timeout: float = 5.0,  # noqa: ASYNC109 (discovery's own overall timeout, retries included)
    out: TextIO | None = None,
) -> list[WatchRow]:
    """Follow ``targets`` until ``duration`` seconds have passed (forever when None); returns the last rows.

    ``json_lines``: write every envelope to ``out`` as a JSON line instead of showing the table.
    ``timeout``: for each target's first discovery, which must succeed (`DiscoveryError` otherwise).
    """
    out = out or sys.stdout
    tally = TierTally()
    config = SubscriberConfig(quiet_interval=quiet_interval)
    options = DiscoveryOptions(engine=engine, timeout=timeout)
    encode = msgspec.json.Encoder().encode
    rates: dict[WorkerKey, float] = {}
    for target in targets:
        # Fail fast on a target that is not an engine (the client would only log and retry).
        await discover_with(target, options)
    display = None if json_lines else _table_display(out)
    started = time.monotonic()
    try:
        async with KvEventClient(targets=targets, config=config, discovery_options=options) as client:

            async def consume() -> None:
                async with client.events() as stream:
                    async for env in stream:
                        tally.feed(env)
                        if json_lines:
                            out.write(encode(env).decode() + "\n")

            async def refresh() -> None:
                seen: dict[WorkerKey, int] = {}
                last = time.monotonic()
                while True:
                    await anyio.sleep(interval)
                    now = time.monotonic()
                    for source in client.sources():
                        key = source.key
                        total = tally.events(key)
                        rates[key] = (total - seen.get(key, 0)) / (now - last)
                        seen[key] = total
                    last = now
                    if json_lines:
                        out.flush()
                    elif display is not None:
                        display.show(rows(client, tally, rates), _title(client, targets, now - started))

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                tg.start_soon(refresh)
                await (anyio.sleep(duration) if duration is not None else anyio.sleep_forever())
                final = rows(client, tally, rates)
                tg.cancel_scope.cancel()
                if display is not None:
                    display.show(final, _title(client, targets, time.monotonic() - started), final=True)
    finally:
        if display is not None:
            display.close()
    out.flush()
    return final


def _title(client: KvEventClient, targets: list[str], elapsed: float) -> str:
    """The table's title, with a line per target whose discovery is failing and why."""
    lines = [f"kvroute watch {' '.join(targets)} — {elapsed:.0f} s"]
    lines += [f"! {target}: discovery failing: {why}" for target, why in client.discovery_errors().items()]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``watch`` subcommand to the ``kvroute`` parser."""
    p = sub.add_parser(
        "watch",
        help="follow engines' KV events: a live table per worker, or JSON lines",
        description="Discover the engines at TARGET (host:port of their gRPC servers), subscribe to every"
        " rank's KV events, and show blocks per tier, events/s, last seq, gaps, replays, checks and resets.",
        epilog="Columns: " + LEGEND + ".",
    )
    p.add_argument("targets", nargs="+", metavar="TARGET", help="an engine's gRPC address, host:port")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="discovery protocol (default auto)")
    p.add_argument("--json", action="store_true", help="stream every engine and lifecycle event as JSON lines")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="table refresh (default 1 s)")
    p.add_argument(
        "--quiet-interval", type=float, default=2.0, metavar="S", help="probe a silent source after S (default 2 s)"
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="discovery timeout (default 5 s)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.duration is not None and not args.duration > 0:
        return error("watch", "--duration must be > 0", EXIT_USAGE)
    if not (args.interval > 0 and args.quiet_interval > 0 and args.timeout > 0):
        return error("watch", "--interval, --quiet-interval and --timeout must be > 0", EXIT_USAGE)
    try:
        anyio.run(
            lambda: watch(
                args.targets,
                engine=args.engine,
                json_lines=args.json,
                duration=args.duration,
                interval=args.interval,
                quiet_interval=args.quiet_interval,
                timeout=args.timeout,
            )
        )
    except (KvRouteError, ValueError) as exc:
        return error("watch", exc, EXIT_FAILED)
    return EXIT_OK
