"""vLLM's own cache manager vs kvroute, per configuration (runs in a vLLM venv: see README.md)."""

from __future__ import annotations

import pytest
import vllm_driver
from harness import NEW_QUERY_API, RESULTS, Tally
from vllm_driver import VERSION, Config
from workload import Namespaces

LORAS = Namespaces(loras=(None, "sql-lora", "chat-lora"))
SALTS = Namespaces(salts=(None, "tenant-a", "tenant-b"))
IMAGES = Namespaces(images=(None, "img-sha-1", "img-sha-2", "img-sha-3"))

CONFIGS: dict[str, tuple[Config, str]] = {
    # name: (configuration, anyio backend of the subscriber)
    "plain": (Config("plain", requests=400, reset_at=200), "asyncio"),
    "plain-trio": (Config("plain-trio", requests=150, seed=2), "trio"),
    "evicting": (Config("evicting", num_blocks=72, max_running=2, requests=300, seed=3), "asyncio"),
    "lora": (Config("lora", ns=LORAS, requests=300, seed=4), "asyncio"),
    "salt": (Config("salt", ns=SALTS, requests=300, seed=5), "trio"),
    "lora+salt": (Config("lora+salt", ns=Namespaces(loras=LORAS.loras, salts=SALTS.salts), seed=6), "asyncio"),
}

# What kvroute does today where it does not yet meet the pass bar, measured by this suite:
# (vLLM version, configuration, "over" | "under") -> the measured counts. A fix turns the strict xfail
# into a failure that says to delete the entry.
# A version of "*" is every version.
KNOWN: dict[tuple[str, str, str], str] = {}
if not NEW_QUERY_API:
    KNOWN.update({
        ("*", "lora", "under"): "LoRA blocks never match (the adapter name is in extra_keys too); "
        "measured 0.33.0: 83/300 admissions under-claimed, 0.34.0: see the run's table",
        ("*", "lora+salt", "under"): "LoRA blocks never match",
    })

_results: dict[str, Tally] = {}


def _tally(name: str) -> Tally:
    if name not in _results:
        cfg, backend = CONFIGS[name]
        _results[name] = vllm_driver.run(cfg, backend)
        RESULTS.append(_results[name])
    return _results[name]


def _case(name: str, side: str) -> object:
    reason = KNOWN.get((VERSION, name, side)) or KNOWN.get(("*", name, side))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [_case(n, "over") for n in CONFIGS])
def test_no_over_claims(name: str) -> None:
    """kvroute never claims more of a prompt than vLLM's own lookup finds cached."""
    t = _tally(name)
    assert t.admissions > 0
    assert t.over == 0, t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [_case(n, "under") for n in CONFIGS])
def test_no_under_claims(name: str) -> None:
    """On a lossless run (every batch delivered) kvroute finds everything vLLM would reuse."""
    t = _tally(name)
    assert t.hits > 0, "the workload never hit the engine's cache: it proves nothing"
    assert t.under == 0, t.line() + "\n" + "\n".join(t.examples)


def test_workload_exercises_evictions_and_reset() -> None:
    """The plain run really evicted and really reset (else its zero counts prove less)."""
    t = _tally("plain")
    assert t.events.get("BlockRemoved", 0) > 0
    assert t.events.get("AllBlocksCleared", 0) == 1
