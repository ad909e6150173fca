"""vLLM's own cache manager vs kvroute, per configuration (runs in a vLLM venv: see README.md)."""

from __future__ import annotations

import dataclasses

import pytest
import vllm_driver
from harness import Gap, Suite
from vllm_driver import VERSION, Config, Group
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
    "multimodal": (Config("multimodal", ns=IMAGES, seed=7), "asyncio"),
    "lookahead-1": (Config("lookahead-1", lookahead=1, seed=8), "asyncio"),
    "lookahead-3": (Config("lookahead-3", lookahead=3, seed=9), "trio"),
    "reuse-reports": (Config("reuse-reports", report_full=0.5, seed=10), "asyncio"),
    "hybrid-swa": (Config("hybrid-swa", groups=(Group(16), Group(16, window=128)), num_blocks=96,
                          seed=11), "asyncio"),
    "hybrid-swa-dense": (Config("hybrid-swa-dense", groups=(Group(16), Group(16, window=128)), num_blocks=96,
                                retention=None, seed=12), "trio"),
    "mixed-block-sizes": (Config("mixed-block-sizes", groups=(Group(32), Group(16, window=64)), num_blocks=96,
                                 seed=13), "asyncio"),
    "mixed-block-sizes-dense": (Config("mixed-block-sizes-dense", groups=(Group(32), Group(16, window=64)),
                                       num_blocks=96, retention=None, seed=14), "asyncio"),
    # Issue 18's measurement: 2 data-parallel ranks, 1,000 requests, every prompt block-aligned, no reuse
    # reports asked: window 128 in the full group's 16-token blocks, and full attention in 32-token blocks
    # with the window in 16.
    "hybrid-swa-2rank": (Config("hybrid-swa-2rank", groups=(Group(16), Group(16, window=128)), num_blocks=96,
                                ranks=2, requests=1000, aligned=True, seed=15), "asyncio"),
    "mixed-block-sizes-2rank": (Config("mixed-block-sizes-2rank", groups=(Group(32), Group(16, window=128)),
                                       num_blocks=96, ranks=2, requests=1000, aligned=True, seed=16), "trio"),
    # Reports asked on half the requests of a hybrid model, kvroute at its default: never an over-claim.
    "hybrid-swa-reports": (Config("hybrid-swa-reports", groups=(Group(16), Group(16, window=128)), num_blocks=96,
                                  report_full=0.5, seed=17), "asyncio"),
}
# Every hybrid configuration again, judged by a client told that no request asks for reuse reports
# (`KvEventClient(reuse_reports=False)`): each repeated store is then a real copy. Same seed and routing,
# so the engine publishes the same stream as in the configuration it repeats.
CONFIGS.update({
    f"{name}-no-reports": (dataclasses.replace(cfg, name=f"{name}-no-reports", reuse_reports=False), backend)
    for name, (cfg, backend) in list(CONFIGS.items())
    if len(cfg.groups) > 1 and cfg.report_full == 0
})

# What kvroute does today where it does not yet meet the pass bar, measured by this suite (same counts on
# 0.33.0 and 0.34.0): (vLLM version, configuration, "over" | "under") -> the measured count, an upper bound
# (test_known_gaps_do_not_grow), and why. A fix turns the strict xfail into a failure that says to delete
# or lower the entry. "*" = every version. No configuration over-claims; these are under-claims only.
KNOWN: dict[tuple[str, str, str], Gap] = {
    # All remaining under-claims are one cause, at kvroute's default (reuse reports may come): a store from
    # block 0 (no parent) of blocks a group already holds, with every group's store dense, is a reuse report
    # or a real recompute (after a window miss); the wire cannot tell them apart, so it counts once and the
    # first removal of such a copy drops it. Each "-no-reports" twin (the router says no request asks for
    # reports) meets the bar: 0 under-claims.
    ("*", "hybrid-swa", "under"): Gap(2, "of 317 (160 tokens): copies from block 0"),
    ("*", "hybrid-swa-dense", "under"): Gap(8, "of 300 (768 tokens), e.g. kvroute 0 vs engine 80: copies "
                                            "from block 0"),
    ("*", "mixed-block-sizes", "under"): Gap(26, "of 300 (1,216 tokens): copies from block 0"),
    ("*", "mixed-block-sizes-dense", "under"): Gap(19, "of 300 (3,104 tokens): copies from block 0"),
    ("*", "hybrid-swa-2rank", "under"): Gap(16, "of 1,071 (1,024 tokens): copies from block 0"),
    ("*", "mixed-block-sizes-2rank", "under"): Gap(65, "of 1,000 (5,248 tokens): copies from block 0"),
}

SUITE = Suite(CONFIGS, vllm_driver.run, KNOWN, VERSION)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [SUITE.case(n, "over") for n in CONFIGS])
def test_no_over_claims(name: str) -> None:
    """kvroute never claims more of a prompt than vLLM serves from cache (`get_computed_blocks`)."""
    t = SUITE.tally(name)
    assert t.admissions > 0
    assert t.over == 0, t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [SUITE.case(n, "under") for n in CONFIGS])
def test_no_under_claims(name: str) -> None:
    """On a lossless run (every batch delivered) kvroute finds everything vLLM would reuse."""
    t = SUITE.tally(name)
    assert t.hits > 0, "the workload never hit the engine's cache: it proves nothing"
    assert t.under == 0, t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_known_gaps_do_not_grow(name: str) -> None:
    """A known gap's measured count is an upper bound: a change that adds under-claims fails here."""
    t = SUITE.tally(name)
    assert t.under <= SUITE.bound(name, "under"), t.line() + "\n" + "\n".join(t.examples)
    assert t.over <= SUITE.bound(name, "over"), t.line() + "\n" + "\n".join(t.examples)


@pytest.mark.timeout(600)
def test_reuse_reports_false_is_a_promise() -> None:
    """`reuse_reports=False` while requests do ask for reports counts each report as a copy the engine
    never removes: it over-claims (measured: 61/317 admissions on hybrid-swa-reports), which is why the
    default stays True and the README calls the setting a promise."""
    cfg, backend = CONFIGS["hybrid-swa-reports"]
    t = vllm_driver.run(dataclasses.replace(cfg, name="hybrid-swa-reports, misused reuse_reports=False",
                                            reuse_reports=False), backend)
    assert t.over > 0, t.line()


def test_workload_exercises_evictions_and_reset() -> None:
    """The plain run really evicted and really reset (else its zero counts prove less)."""
    t = SUITE.tally("plain")
    assert t.events.get("BlockRemoved", 0) > 0
    assert t.events.get("AllBlocksCleared", 0) == 1
