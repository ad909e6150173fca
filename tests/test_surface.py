"""The public surface: at most 45 names, sorted, each documented; what left it warns for one release (issue 20)."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest

import kvroute

ROOT = Path(__file__).resolve().parent.parent


def test_at_most_45_public_names_sorted_each_documented() -> None:
    names = kvroute.__all__
    assert len(names) <= 45 and names == sorted(names) and len(set(names)) == len(names)
    readme = (ROOT / "README.md").read_text()
    api = readme[readme.index("## Public API") :]
    for name in names:
        obj = getattr(kvroute, name)
        # A class or function documents itself; every name is in the README's API list.
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name
        assert re.search(rf"`{re.escape(name)}`", api), f"{name} is not in the README's Public API section"


@pytest.mark.parametrize("name", sorted(kvroute._DEPRECATED))
def test_a_name_that_left_the_surface_warns_and_still_works(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"kvroute\.{name} is no longer public"):
        obj = getattr(kvroute, name)
    assert obj is getattr(importlib.import_module(kvroute._DEPRECATED[name]), name)
    assert name not in kvroute.__all__


def test_the_public_names_import_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in kvroute.__all__:
            getattr(kvroute, name)
        exec("from kvroute import *", {})
    with pytest.raises(AttributeError):
        kvroute.no_such_name  # noqa: B018


def test_the_module_maps_show_every_module() -> None:
    # docs/architecture.md's pipeline and the README's diagram name every private module of the SDK core.
    package = ROOT / "kvroute"
    modules = sorted(
        p.relative_to(package).with_suffix("").as_posix()
        for p in [*package.glob("_*.py"), *package.glob("_transports/*.py"), *package.glob("_transports/*/*.py")]
        if p.name != "__init__.py"
    )
    assert "_transports/gateway" in modules and "_client" in modules
    for doc in ("docs/architecture.md", "README.md"):
        text = (ROOT / doc).read_text()
        missing = [m for m in modules if m not in text]
        assert not missing, (doc, missing)
