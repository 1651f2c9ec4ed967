"""The public names users import (CONTRACT.md) stay importable from the package roots."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import greenroom.actors
import greenroom.protocols


def test_contract_names_are_exported() -> None:
    from greenroom.actors import Host, Session  # noqa: F401
    from greenroom.protocols import tool, user_text  # noqa: F401


def test_all_lists_exactly_what_exists() -> None:
    for module in (greenroom.actors, greenroom.protocols):
        for name in module.__all__:
            assert getattr(module, name) is not None, name
        public = {n for n in vars(module) if not n.startswith("_")}
        submodules = {n for n in public if isinstance(getattr(module, n), type(importlib))}
        assert public - submodules - {"annotations"} == set(module.__all__)


def test_protocols_do_not_import_trio_or_httpx() -> None:
    """protocols/ stays free of I/O: importing all of it loads neither trio nor httpx."""
    code = (
        "import sys, pkgutil, importlib, greenroom.protocols as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('greenroom.protocols.' + m.name)\n"
        "bad = [n for n in ('trio', 'httpx', 'httpx2', 'anthropic') if n in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_nothing_installed_under_bare_top_level_names() -> None:
    code = "import importlib.util as u; print(u.find_spec('actors'), u.find_spec('protocols'))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert result.stdout.strip() == "None None"


def test_the_root_re_exports_the_layers_names() -> None:
    """``from greenroom import …`` gives the very objects of the two layers."""
    import greenroom
    from greenroom import Host, Session, ToolContext, tool, user_text

    assert Host is greenroom.actors.Host and Session is greenroom.actors.Session
    assert tool is greenroom.protocols.tool and user_text is greenroom.protocols.user_text
    assert ToolContext is greenroom.protocols.ToolContext
    for name in greenroom.__all__:
        value = getattr(greenroom, name)
        if name != "__version__":
            layer = greenroom.actors if hasattr(greenroom.actors, name) else greenroom.protocols
            assert value is getattr(layer, name), name
    assert set(greenroom.__all__) <= set(dir(greenroom))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        greenroom.Nope  # noqa: B018


def test_importing_the_root_loads_no_layer() -> None:
    """``import greenroom`` is cheap; a name loads its layer on first use."""
    code = (
        "import sys, greenroom\n"
        "before = [m for m in ('trio', 'greenroom.actors', 'greenroom.protocols') "
        "if m in sys.modules]\n"
        "greenroom.user_text\n"
        "print(before, 'greenroom.protocols' in sys.modules, 'trio' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert result.stdout.strip() == "[] True False"


def test_version_comes_from_the_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    import greenroom

    assert greenroom._installed_version() == metadata.version("greenroom")

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert greenroom._installed_version() == "0+unknown"
