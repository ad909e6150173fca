"""Repository invariants: the README's commands are the ones CI runs; the public API (docs/architecture.md) imports."""

from __future__ import annotations

import re
from pathlib import Path

import kvroute

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:sh|bash|console)?\n(.*?)\n```", text, flags=re.S)[:2]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    demo_cmd, test_cmd = _readme_commands()
    assert "kvroute demo" in demo_cmd and "[demo]" in demo_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd.strip() in [line.strip() for line in ci]


def test_api_md_names_are_public() -> None:
    names = [
        "WorkerKey", "EventSource", "discover", "decode_batch", "EventBatch", "BlockStored", "BlockRemoved",
        "AllBlocksCleared", "PrefixIndex", "OverlapScores", "KvEventClient", "Envelope", "Router",
        "RoutingDecision", "KvRouteError", "DecodeError", "DiscoveryError",
    ]
    # Public, not merely importable: a name in ../shared/api.md must not warn (kvroute._DEPRECATED).
    missing = [n for n in names if n not in kvroute.__all__]
    assert not missing
    assert set(kvroute.__all__) <= set(dir(kvroute))
