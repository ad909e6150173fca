"""Every program in examples/ runs against its own simulated engines, exits 0, and shows it did its job in numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _http_router(out: str) -> None:
    # Every later turn went where its conversation's earlier turns are cached: a routed hit.
    assert re.search(r"later turns that found their whole history cached: 12 of 12", out)
    rate = float(re.findall(r"prefix-cache hit rate through the router: ([\d.]+)%", out)[-1])
    assert rate > 60  # 69 % when every turn after the first hits (the first turn shares the system prompt)
    # Through the ASGI router with the openai client: streamed (SSE passed through) and whole answers both
    # report the engine's usage, and later turns found their history whatever the mode.
    turns = re.findall(r"user \d \((streamed|whole) *\): +(\d+) tokens, +(\d+) cached", out)
    assert len(turns) == 18 and {mode for mode, _, _ in turns} == {"streamed", "whole"}
    assert all(int(cached) > 0 for mode, _, cached in turns[6:])


def _trio_events(out: str) -> None:
    assert "lifecycle Synced()" in out
    stored, held = map(int, re.findall(r"blocks stored per the stream: (\d+); in the index now: (\d+)", out)[-1])
    assert stored == held > 0  # nothing evicted: the index holds every block the stream announced


def _lifecycle_failover(out: str) -> None:
    assert "restarting vllm-b" in out and "-> route elsewhere" in out and "back in rotation" in out
    per = dict(re.findall(r"'(vllm-[ab])': (\d+)", out.split("requests per engine:")[-1]))
    assert set(per) == {"vllm-a", "vllm-b"} and all(int(n) > 0 for n in per.values())
    assert "workers out of rotation at the end: 0" in out


def _static_config(out: str) -> None:
    assert "subscribed to 2 static sources" in out
    # From round 1 on, the router sends each prompt where the index holds it, and the engine agrees.
    later = re.findall(r"round [12] +\w+: -> [\w-]+ \(index: (\d+) blocks cached; engine found (\d+) tokens\)", out)
    assert len(later) == 4 and all(int(blocks) * 16 == int(tokens) == 320 for blocks, tokens in later)
    blocks, workers = map(int, re.findall(r"index: (\d+) blocks over (\d+) workers", out)[-1])
    assert blocks > 0 and workers == 2


# What each example must show (besides exiting 0): values, not only labels.
EXPECTED: dict[str, Callable[[str], None]] = {
    "http_router.py": _http_router,
    "trio_events.py": _trio_events,
    "lifecycle_failover.py": _lifecycle_failover,
    "static_config.py": _static_config,
}


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=60,  # each takes ~1-3 s here; a hang must fail, not stall CI
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    EXPECTED[name](proc.stdout)
