"""The engine suite runs in an engine's venv, apart from the main suite (see README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The suite's modules (harness, workload, the drivers) import each other by plain name.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    """Judge this checkout's kvroute, not the one a shared venv was built from."""
    import kvroute

    repo = Path(__file__).resolve().parents[2]
    where = Path(kvroute.__file__).resolve()
    if repo not in where.parents:
        raise pytest.UsageError(f"kvroute imported from {where}, not from {repo}: run tests/engines/run.sh")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per configuration: admissions, over-claims, under-claims (the README's table)."""
    from harness import RESULTS, report

    if RESULTS:
        terminalreporter.section("kvroute vs the engine's own prefix-hit answer")
        report(RESULTS, terminalreporter.write_line)
