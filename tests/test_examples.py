"""Every program in examples/ runs against its own simulated engines and exits 0 (as CI runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# What each example must print to show it did its job (besides exiting 0).
EXPECTED = {
    "http_router.py": ("router listening on http://127.0.0.1:", "prefix-cache hit rate through the router"),
    "trio_events.py": ("lifecycle Synced()", "blocks stored per the stream"),
    "lifecycle_failover.py": ("restarting vllm-b", "-> route elsewhere", "back in rotation"),
    "static_config.py": ("subscribed to 2 static sources", "engine found 320 tokens"),
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
    for text in EXPECTED[name]:
        assert text in proc.stdout, (text, proc.stdout[-3000:])
