"""The package's import graph, read from the source: no cycle, the SDK core never imports the simulator or
the command line, and benchmarks and examples use public names only (docs/architecture.md). The command line
ships inside the package and may use its private modules, as httpx's does (issue 20)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvroute
import kvroute.sim

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvroute"
PUBLIC = {"kvroute": set(kvroute.__all__), "kvroute.sim": set(kvroute.sim.__all__)}
# (file, module, name) imports allowed although not public, each with its reason. The soak benchmark's
# control channel between its two processes rides on the client's anyio ZMQ seam; it belongs to the fault
# driver shared with tests/test_chaos.py, which leaves bench/ on its own. The test below fails once an entry
# is no longer used, so none outlives its reason. The wire benchmark times the compiled decoder's count-only
# entry (`_core.decode_count`: what the raw-bytes ingest path pays before it applies), which has no public
# name until `PrefixIndex.apply_payload` gives it one.
# Measurement hooks a bench needs and a router does not: raw sockets, the core's decode alone, and a
# JetStream client follower's per-batch `on_applied` (timing it by `events()` would decode every batch).
EXEMPT = {
    ("bench/bench_soak.py", "kvroute._transports.zmq", "sockets"),
    ("bench/bench_wire.py", "kvroute", "_core"),
    ("bench/bench_jetstream.py", "kvroute._transports.jetstream", "JetStreamSource"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import in ``path``, relative ones resolved; name None for ``import module``."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.extend((module, alias.name) for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the kvroute modules it imports (``from pkg import submodule`` counts as the submodule)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for module, imported in _imports(path):
            if f"{module}.{imported}" in modules:
                edges.add(f"{module}.{imported}")
            elif module in modules:
                edges.add(module)
        graph[name] = edges - {name}
    return graph


def _core(module: str) -> bool:
    return not (module.startswith("kvroute.sim") or module.startswith("kvroute.cli"))


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert {"kvroute", "kvroute.cli", "kvroute.sim", "kvroute._source", "kvroute.cli._display"} <= set(graph)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_sdk_core_imports_neither_the_simulator_nor_the_command_line() -> None:
    graph = _graph()
    wrong = sorted((m, t) for m, targets in graph.items() if _core(m) for t in targets if not _core(t))
    assert not wrong
    assert not [(m, t) for m, targets in graph.items() if m.startswith("kvroute.sim") for t in targets if "cli" in t]
    # The command line is the one that reaches into both.
    assert {"kvroute", "kvroute.sim"} <= set().union(*(graph[m] for m in graph if m.startswith("kvroute.cli")))


def _private_uses(path: Path, *, own_package: str | None = None) -> list[tuple[str, str, str | None]]:
    rel = path.relative_to(ROOT).as_posix()
    uses = []
    for module, name in _imports(path):
        if not (module == "kvroute" or module.startswith("kvroute.")):
            continue
        if own_package is not None and (module == own_package or module.startswith(own_package + ".")):
            continue
        if module not in PUBLIC or (name is not None and name not in PUBLIC[module]):
            uses.append((rel, module, name))
    return uses


def test_bench_and_examples_use_public_names_only() -> None:
    files = [*(ROOT / "bench").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    assert len(files) > 5
    uses = [use for path in sorted(files) for use in _private_uses(path)]
    assert [u for u in uses if u not in EXEMPT] == []
    assert set(uses) == EXEMPT, "an exemption is no longer needed: remove it"


def test_the_checker_sees_private_imports() -> None:
    # The checks above pass on this repository; here they must catch what they are for.
    uses = _private_uses(ROOT / "tests" / "test_source.py")
    assert ("tests/test_source.py", "kvroute._source", "SourceMachine") in uses
    graph = _graph()
    assert "kvroute._wire" in graph["kvroute._index"]  # relative imports resolve
    assert "kvroute.cli._display" in graph["kvroute.cli._watch"]  # `from . import _display` is the submodule
