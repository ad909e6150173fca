"""``kvroute watch``: the live table and the JSON-lines stream, against real simulated engines."""

from __future__ import annotations

import io
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest

from kvroute._events import Envelope, Overflow, Reset
from kvroute._models import EventSource, WorkerKey
from kvroute._wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.cli import TierTally, WatchRow, main, plain_table, watch
from kvroute.sim._engine import SimConfig, SimEngine

# Fast steps: the tests check what is shown, not realistic timing.
FAST = {"decode_time_per_step": 0.001, "prefill_time_per_token": 1e-6}


@asynccontextmanager
async def fleet() -> AsyncIterator[tuple[SimEngine, SimEngine]]:
    async with (
        SimEngine(SimConfig(engine="vllm", name="v", ranks=2, **FAST)) as v,  # type: ignore[arg-type]
        SimEngine(SimConfig(engine="sglang", name="s", **FAST)) as s,  # type: ignore[arg-type]
    ):
        yield v, s


async def traffic(v: SimEngine, s: SimEngine) -> None:
    for i in range(6):
        prompt = [*range(1, 65), 100 + i]
        await v.complete(prompt, 4, rank=i % 2)
        await s.complete(prompt, 4)


async def watch_beside_traffic(
    v: SimEngine, s: SimEngine, targets: list[str], duration: float, **options: Any
) -> tuple[list[WatchRow], io.StringIO]:
    """`watch` for ``duration`` while `traffic` runs beside it; the rows and what it wrote.

    What is shown is compared with the engines' caches after the traffic, so the traffic must end
    inside the window, with time left for its events to arrive (half the window), and every worker
    must be synced by the end. On a loaded host either can take longer than the window: then again
    (a new watch, more traffic) with twice the window.

    An event can arrive late without any fault: the engine's PUB drops what it publishes before it has
    taken a new SUB's subscription, which it may take after the client's cold replay was answered. A
    rank's whole traffic here is one batch (the other requests hit its cache), so no later seq shows
    the loss: only the quiet probe finds it (docs/recovery.md rule 8), and it must come inside the
    half window, not after the 2 s default.
    """
    options.setdefault("quiet_interval", 0.1)
    workers = sum(e.config.ranks for e in (v, s) if e.grpc_target in targets)

    async def run(ended: list[float]) -> None:
        await traffic(v, s)
        ended.append(anyio.current_time())

    while True:
        out = io.StringIO()
        ended: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, ended)
            rows = await watch(targets, duration=duration, out=out, **options)
            stopped = anyio.current_time()
        synced = len(rows) == workers and all(r.state == "synced" and r.connected for r in rows)
        if ended[0] <= stopped - duration / 2 and synced:
            return rows, out
        duration *= 2
        assert duration <= 40, f"the traffic never ended inside the watch window, or a worker never synced: {rows}"


@pytest.mark.anyio
async def test_table_rows_match_the_engines() -> None:
    async with fleet() as (v, s):
        assert v.grpc_target is not None and s.grpc_target is not None
        targets = [v.grpc_target, s.grpc_target]
        rows, out = await watch_beside_traffic(v, s, targets, 1.2, interval=0.2)
        assert [(r.worker_id, r.dp_rank) for r in rows] == sorted(
            [(v.grpc_target, 0), (v.grpc_target, 1), (s.grpc_target, 0)]
        )
        truth = {(v.grpc_target, 0): v.cache(0), (v.grpc_target, 1): v.cache(1), (s.grpc_target, 0): s.cache(0)}
        for row in rows:
            held = truth[(row.worker_id, row.dp_rank)].num_cached_blocks
            assert row.state == "synced" and row.connected and not row.partial
            assert row.tiers == {"GPU": held, "CPU": 0, "DISK": 0, "EXTERNAL": 0} and row.tiers_exact
            assert row.index_blocks == held > 0
            assert row.last_seq >= 0 and row.gaps == 0 and row.resets == 0 and row.replays >= 1
            assert row.engine == ("vllm" if row.worker_id == v.grpc_target else "sglang")
        shown = out.getvalue()
        for text in ("worker", "GPU", "ev/s", "replays", "synced", v.grpc_target):
            assert text in shown
        assert "synced" in plain_table(rows)


@pytest.mark.anyio
async def test_an_idle_fleet_climbs_in_checks_not_replays() -> None:
    # Probes of a quiet source are routine: shown apart, so an idle fleet does not look like trouble.
    async with fleet() as (v, s):
        assert v.grpc_target is not None and s.grpc_target is not None
        await traffic(v, s)
        # Probes start once a source is synced, which a loaded host delays past a short window: a
        # window without two probes per source is watched again, twice as long (the rest holds each time).
        duration = 2.0
        while True:
            out = io.StringIO()
            rows = await watch(
                [v.grpc_target, s.grpc_target], duration=duration, interval=0.5, quiet_interval=0.2, out=out
            )
            assert len(rows) == 3
            for row in rows:
                assert row.replays == 1, row  # the cold start's, nothing since
                assert row.gaps == 0 and row.resets == 0
            if all(row.checks >= 2 for row in rows):  # a probe per quiet interval, as the engine stays idle
                break
            duration *= 2
            assert duration <= 16, rows
        shown = out.getvalue()
        assert "checks" in shown and "indexed" in shown and "routine probes" in shown  # the legend


@pytest.mark.anyio
async def test_json_lines_stream_every_event() -> None:
    async with fleet() as (v, s):
        assert v.grpc_target is not None
        _, out = await watch_beside_traffic(v, s, [v.grpc_target], 1.0, json_lines=True, interval=0.2)
        decoder = msgspec.json.Decoder(Envelope)
        envelopes = [decoder.decode(line) for line in out.getvalue().splitlines()]
        kinds = [getattr(e.event, "kind", type(e.event).__name__) for e in envelopes]
        assert kinds.count("connected") == 2 and kinds.count("synced") >= 2
        stored = [e for e in envelopes if isinstance(e.event, BlockStored)]
        assert stored and all(e.seq is not None for e in stored)
        assert {e.source.dp_rank for e in stored} == {0, 1}
        assert sum(len(e.event.block_hashes) for e in stored if isinstance(e.event, BlockStored)) >= (
            v.cache(0).num_cached_blocks + v.cache(1).num_cached_blocks
        )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the CLI under test runs in its own process
async def test_cli_runs_for_the_duration() -> None:
    async with fleet() as (v, _):
        assert v.grpc_target is not None
        # A loaded host can take longer than the window to sync the engine: then again, twice as long.
        duration = 0.5
        while True:
            cmd = [sys.executable, "-m", "kvroute.cli", "watch", v.grpc_target, "--interval", "0.2"]
            proc = await anyio.run_process([*cmd, "--duration", str(duration)], check=False)
            assert proc.returncode == 0, proc.stderr.decode()
            shown = proc.stdout.decode()
            assert "kvroute watch" in shown
            if "synced" in shown:
                break
            duration *= 2
            assert duration <= 8, shown


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["nonsense", "--duration", "1"], 1, "host:port"),
        (["127.0.0.1:1", "--duration", "1", "--timeout", "0.3"], 1, "127.0.0.1:1"),
        (["127.0.0.1:1", "--duration", "0"], 2, "--duration"),
        (["127.0.0.1:1", "--interval", "-1"], 2, "--interval"),
    ],
)
def test_bad_targets_and_options(args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", *args]) == code
    assert message in capsys.readouterr().err


def test_tier_tally_follows_stores_removals_and_resets() -> None:
    src = EventSource(worker_id="w", endpoint="tcp://127.0.0.1:1")
    key = WorkerKey("w", 0)
    tally = TierTally()

    def feed(event: object, seq: int | None = 0) -> None:
        tally.feed(Envelope(source=src, seq=seq, ts=0.0, event=event))  # type: ignore[arg-type]

    feed(BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=list(range(12)), block_size=4))
    feed(
        BlockStored(
            block_hashes=[2, 3], parent_block_hash=None, token_ids=list(range(8)), block_size=4, medium="CPU_PINNED"
        )
    )
    feed(BlockRemoved(block_hashes=[1], medium=None))
    feed(
        BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=list(range(4)), block_size=4, medium="STORAGE")
    )
    assert tally.tiers(key) == {"GPU": 2, "CPU": 2, "DISK": 1, "EXTERNAL": 0}
    assert tally.events(key) == 4 and tally.exact(key)
    feed(Overflow(dropped=3), seq=None)
    assert not tally.exact(key) and tally.events(key) == 4
    feed(AllBlocksCleared())
    assert tally.tiers(key)["GPU"] == 0 and not tally.exact(key)
    feed(BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=list(range(4)), block_size=4))
    feed(Reset(reason="restart"), seq=None)
    assert tally.tiers(key) == {"GPU": 0, "CPU": 0, "DISK": 0, "EXTERNAL": 0} and tally.exact(key)
