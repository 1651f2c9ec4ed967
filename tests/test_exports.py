"""The public names users import (CONTRACT.md) stay importable from the package roots."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
