"""Loading user tools for the CLI's ``--tools FILE_OR_MODULE``.

A spec ending in ``.py`` is a file path, imported under a fresh module name so two files
with the same name do not replace each other; anything else is an importable module name.
The tools of a module are its module-level :class:`~greenroom.protocols.tools.Tool` values
(``@tool`` functions, and tools it imports or builds), in definition order.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import re
import stat
import sys
from pathlib import Path
from types import ModuleType

from greenroom.protocols.tools import Tool
from greenroom.protocols.wording import special_file_words

__all__ = ["ToolLoadError", "load_tools"]


class ToolLoadError(Exception):
    """A ``--tools`` spec gave no usable tools: missing file, failed import, no tools, or
    two tools with one name. The message names the spec and, for an import failure, the
    original error."""


_module_numbers = itertools.count(1)


def load_tools(spec: str) -> list[Tool]:
    """The module-level tools of ``spec`` (a ``.py`` path or a module name), in definition
    order, each once. Importing runs the module's code. Never returns an empty list:
    raises :class:`ToolLoadError` instead."""
    module = _import_file(spec) if spec.endswith(".py") else _import_module(spec)
    tools: list[Tool] = []
    by_name: dict[str, Tool] = {}
    for value in vars(module).values():
        if not isinstance(value, Tool) or any(value is t for t in tools):
            continue
        if value.name in by_name:
            raise ToolLoadError(f"{spec}: defines two different tools named {value.name!r}")
        by_name[value.name] = value
        tools.append(value)
    if not tools:
        raise ToolLoadError(f"{spec}: defines no tools (decorate async functions with @tool)")
    return tools


def _import_file(spec: str) -> ModuleType:
    path = Path(spec).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ToolLoadError(f"tool file not found: {spec}") from None
    except OSError as exc:  # a symbolic link loop, a directory on the way it may not enter
        raise ToolLoadError(f"tool file {spec}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        # A FIFO would be waited on for ever by the import, a device read without end.
        raise ToolLoadError(f"tool file {spec}: {_not_regular(mode)}")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"greenroom_user_tools_{next(_module_numbers)}_{stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ToolLoadError(f"cannot import tool file {spec}")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before it runs, as a normal import would be: attrs, dataclasses and
    # pickling look the module up by name while it executes.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ToolLoadError(
            f"importing tool file {spec} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _not_regular(mode: int) -> str:
    """What a file of ``mode`` that is no regular file is, in a few words."""
    if stat.S_ISDIR(mode):
        return "it is a directory, not a file"
    return special_file_words(mode)


def _import_module(spec: str) -> ModuleType:
    try:
        return importlib.import_module(spec)
    except Exception as exc:
        hint = " (a tool file path must end in .py)" if "/" in spec or "\\" in spec else ""
        raise ToolLoadError(
            f"importing tool module {spec} failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc
