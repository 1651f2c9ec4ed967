"""What a host's sessions share instead of each holding a copy (an idle session stays
small: R-PERF): one tool table per distinct tool list, one path and one workspace identity
per distinct workspace. Read-only for the sessions."""

from __future__ import annotations

from pathlib import Path

import attrs

from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.tools.workspace import WorkspaceError, identify_workspace, open_workspace
from greenroom.protocols.context import ToolSchema
from greenroom.protocols.tools import Tool, WorkspaceIdentity

__all__ = ["SharedTables", "ToolTable", "fixed_workspace"]

ToolTable = tuple[dict[str, Tool], tuple[ToolSchema, ...]]
"""A tool list by name, and its schemas in order."""


class SharedTables:
    """A host's shared tables; see the module docstring."""

    __slots__ = ("_identities", "_paths", "_tools")

    def __init__(self) -> None:
        self._tools: dict[tuple[int, ...], ToolTable] = {}
        self._paths: dict[str, Path] = {}
        self._identities: dict[WorkspaceIdentity, WorkspaceIdentity] = {}

    def tool_table(self, tools: list[Tool]) -> ToolTable:
        """The name table and schemas of ``tools``, shared by every session given the same
        tool objects."""
        key = tuple(id(t) for t in tools)
        table = self._tools.get(key)
        if table is None:
            by_name = {t.name: t for t in tools}
            table = (by_name, tuple(t.schema for t in by_name.values()))
            # The tools stay referenced by the table, so their ids cannot be reused.
            self._tools[key] = table
        return table

    def path(self, path: Path) -> Path:
        """One Path object per distinct workspace."""
        return self._paths.setdefault(str(path), path)

    def identity(self, identity: WorkspaceIdentity) -> WorkspaceIdentity:
        """One identity object per distinct workspace."""
        shared = self._identities.get(identity)
        if shared is None:
            shared = attrs.evolve(identity, path=self.path(identity.path))
            self._identities[shared] = shared
        return shared


def fixed_workspace(
    workspace: str | Path | WorkspaceIdentity, data_dir: Path
) -> WorkspaceIdentity:
    """The identity of a new session's workspace (R-SEC-7): the directory ``workspace``
    names now, or the identity given, checked to still stand at its path. Raises
    :class:`ConfigurationError`. Blocking."""
    private = (data_dir,)
    try:
        if isinstance(workspace, WorkspaceIdentity):
            open_workspace(workspace, workspace.path, private).close()
            return workspace
        return identify_workspace(workspace, private)
    except WorkspaceError as exc:
        raise ConfigurationError(str(exc)) from None
