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


def test_every_mutation_applies_and_names_tests_that_exist() -> None:
    """scripts/mutate.py stays current: each mutation's text occurs exactly once, and what it runs and claims exists.

    The script reports an entry that matches nothing only when it runs (a long run, not CI's): a
    refactor that moved the text would leave its rule unchecked without anyone noticing.
    """
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_kvroute_mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mutate = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutate  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mutate)
    finally:
        del sys.modules[spec.name]
    names = [m.name for m in mutate.MUTATIONS]
    assert len(names) == len(set(names))
    for m in mutate.MUTATIONS:
        assert (ROOT / m.file).read_text().count(m.old) == 1, f"{m.name}: its text to break is not in {m.file} once"
        for node in (*m.tests, *m.claims):
            path, _, test = node.partition("::")
            assert (ROOT / path).exists(), f"{m.name}: {path}"
            if (ROOT / path).is_file() and test:  # (tests/engines::<expr> is the engine stage's -k)
                name = test.split("[")[0]  # a parametrised id names its function
                assert f"def {name}(" in (ROOT / path).read_text(), f"{m.name}: {node}"
