"""Shared pytest configuration: every async test runs on both anyio backends."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run each ``@pytest.mark.anyio`` test once on asyncio and once on trio."""
    return str(request.param)


# CI runs every property test with a fixed seed, so a landing never depends on what a random search
# happens to find that day; local runs keep exploring (and a failure there prints its example).
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# tests/engines/ runs in the engines' own venvs (tests/engines/README.md), not in this suite.
collect_ignore = ["engines"]
