"""SGLang's own radix cache vs kvroute, per configuration (runs in the SGLang venv: see README.md)."""

from __future__ import annotations

import pytest
import sglang_driver
from harness import Gap, Suite
from sglang_driver import VERSION, Config
from workload import Namespaces

LORAS = Namespaces(loras=(None, "sql-lora", "chat-lora"))
SALTS = Namespaces(salts=(None, "tenant-a", "tenant-b"))

CONFIGS: dict[str, tuple[Config, str]] = {
    # name: (configuration, anyio backend of the subscriber)
    "plain": (Config("plain", requests=400, reset_at=200), "asyncio"),
    "plain-trio": (Config("plain-trio", requests=150, seed=2), "trio"),
    "evicting": (Config("evicting", slots=1200, requests=300, seed=3), "asyncio"),
    "lora": (Config("lora", ns=LORAS, seed=4), "asyncio"),
    "salt": (Config("salt", ns=SALTS, seed=5), "trio"),
    "lora+salt": (Config("lora+salt", ns=Namespaces(loras=LORAS.loras, salts=SALTS.salts), seed=6), "asyncio"),
    "eagle-bigrams": (Config("eagle-bigrams", eagle=True, seed=7), "asyncio"),
    # Every prompt one token past a page boundary: an exact repeat (or a turn whose prefix is all held) is
    # where SGLang's bigram view serves a page less than the prompt minus one token.
    "eagle-bigrams-edge": (Config("eagle-bigrams-edge", eagle=True, page_plus_one=True, seed=8), "trio"),
}

# What kvroute does today where it does not yet meet the pass bar (see test_vllm.py): none at present.
# Before the namespaced index landed, salts over-claimed (86/300 admissions, 9,200 tokens) and EAGLE
# bigrams failed every batch (294/300 under-claimed). "*" = every version.
KNOWN: dict[tuple[str, str, str], Gap] = {}

SUITE = Suite(CONFIGS, sglang_driver.run, KNOWN, VERSION)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [SUITE.case(n, "over") for n in CONFIGS])
def test_no_over_claims(name: str) -> None:
    """kvroute never claims more of a prompt than SGLang serves (its match within the prompt minus one token)."""
    t = SUITE.tally(name)
    assert t.admissions > 0
    assert t.over == 0, t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [SUITE.case(n, "under") for n in CONFIGS])
def test_no_under_claims(name: str) -> None:
    """On a lossless run (every batch delivered) kvroute finds everything SGLang would reuse."""
    t = SUITE.tally(name)
    assert t.hits > 0, "the workload never hit the engine's cache: it proves nothing"
    assert t.under == 0, t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_known_gaps_do_not_grow(name: str) -> None:
    """A known gap's measured count is an upper bound (none today: every count must stay 0)."""
    t = SUITE.tally(name)
    assert t.under <= SUITE.bound(name, "under"), t.line() + "\n" + "\n".join(t.examples)
    assert t.over <= SUITE.bound(name, "over"), t.line() + "\n" + "\n".join(t.examples)


def test_workload_exercises_evictions_and_reset() -> None:
    """The plain run really evicted and really reset (else its zero counts prove less)."""
    t = SUITE.tally("plain")
    assert t.events.get("BlockRemoved", 0) > 0
    assert t.events.get("AllBlocksCleared", 0) == 2  # the cache's construction, then the mid-run reset
