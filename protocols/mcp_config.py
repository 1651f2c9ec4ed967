"""MCP server configuration: the JSON that MCP clients write (R-MCP-1, R-MCP-6).

A file holds ``{"mcpServers": {"NAME": SERVER, …}}`` (Claude Desktop, Claude Code, Cursor,
Cline), or VS Code's ``{"servers": {"NAME": SERVER, …}, "inputs": […]}`` (also inside a
settings file's ``"mcp"`` object); other top-level keys are ignored, so a client's whole
settings file can be given; VS Code's comments and trailing commas (JSONC) are read past.
VS Code's ``inputs`` (prompted variables) are not supported: they are ignored with a note,
and a ``${input:…}`` in a value stays as written. A SERVER is either stdio::

    {"command": "npx", "args": ["-y", "some-server"], "env": {"KEY": "value"}, "cwd": "/dir"}

(also with VS Code's ``"envFile": "${workspaceFolder}/.env"``, read when the server starts)

or streamable HTTP (``"type": "http"``; a ``url`` without a ``type`` means HTTP too)::

    {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "…"}}

or the legacy HTTP+SSE transport (``"type": "sse"``, with ``url`` and ``headers``). Cline's
``"transportType"`` stands for ``"type"``; ``"disabled": true`` skips the entry; Cline's
``autoApprove`` and Roo's ``alwaysAllow`` are ignored (greenroom's approval decides, R-APPROVE),
and so are other keys those clients write (``timeout``, ``watchPaths``, …), each with a note.

with optional keys on both: ``"parallel": true | false | ["tool", …]`` (which tools may run
beside other calls; without it the server's ``readOnlyHint`` decides: R-MCP-2),
``"timeout_s": N`` (how long one call may take, default :data:`DEFAULT_TIMEOUT_S`) and
``"scope": "host" | "session"`` (one process per host shared by its sessions, the default,
or one per session) and Cline's and Roo Code's ``"disabledTools": ["tool", …]`` (tools of
the server that are not offered to the model).

Everything here is pure: the caller reads the file and passes its text. Every problem is an
:class:`McpConfigError` whose message names the source and the JSON path
(``servers.json: $.mcpServers.x.command: expected a string``). Reading a file with a
``report`` callback, one bad entry is reported through it and skipped, and the others load
(R-MCP-6); without one, the first problem raises.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

DEFAULT_TIMEOUT_S = 300.0
"""How long one tool call may wait for its server unless ``timeout_s`` says otherwise."""

MAX_TOOL_NAME = 64
"""The longest tool name every provider accepts (OpenAI's limit; Anthropic allows more)."""

_NAME_PART = re.compile(r"[A-Za-z0-9_-]+")
_IGNORED_KEYS = ("autoApprove", "alwaysAllow")
"""Keys other clients write that greenroom reads past: auto-approval lists (greenroom's own
approval decides every call, so ignoring them only asks more often, never less)."""
_NOTED_KEYS = {
    "timeout": 'greenroom\'s limit on one call is "timeout_s"',
    "networkTimeout": 'greenroom\'s limit on one call is "timeout_s"',
    "watchPaths": "greenroom does not restart a server when files change",
    "dev": "VS Code's development mode (watch, debug) is not supported",
}
"""Keys other clients write (Cline, Roo Code, VS Code) that greenroom reads past with a
note saying why: the entry loads, as the client that wrote it would load it, without what
the key asks for."""
_KNOWN_KEYS = ("type", "transportType", "command", "args", "env", "envFile", "cwd", "url",
               "headers", "parallel", "timeout_s", "scope", "disabled", "disabledTools",
               *_IGNORED_KEYS, *_NOTED_KEYS)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TRANSPORTS = {"stdio": "stdio", "http": "http", "streamable-http": "http",
               "streamableHttp": "http", "sse": "sse"}

Report = Callable[[str], None]
"""Takes one message about a skipped entry or an ignored setting (R-MCP-6)."""


class McpConfigError(ValueError):
    """A server configuration that cannot be used; the message names file and JSON path."""


@attrs.frozen(kw_only=True, slots=True)
class McpServerConfig:
    """One configured MCP server. Hashable: servers of equal configuration are shared."""

    name: str
    transport: Literal["stdio", "http", "sse"]
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    parallel: bool | tuple[str, ...] | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    scope: Literal["host", "session"] = "host"
    env_file: str | None = None
    """VS Code's ``envFile``: read when the server starts, its ``KEY=VALUE`` lines under
    ``env`` (see :func:`env_file_values`). From a configuration file it is resolved against
    the file's workspace (:func:`parse_config_text`); otherwise it is as written."""
    disabled_tools: frozenset[str] = frozenset()
    """Cline's and Roo Code's ``disabledTools``: the server's tools the user turned off.
    They are not offered to the model, so a call of one is a call of an unknown tool."""
    env_file_noted: str | None = attrs.field(default=None, eq=False, repr=False)
    """Why ``env_file`` could not be loaded when the configuration was read, once that was
    reported with the configuration's other problems (see
    :func:`~greenroom.actors.tools.mcp_config.load_config_files`): a start that meets the
    same problem does not report it again. Not part of the configuration's identity."""

    def is_parallel(self, tool: str, read_only_hint: bool | None) -> bool:
        """Whether ``tool`` may share the pool's slots (R-MCP-2): the configuration when
        it says, else the server's ``readOnlyHint``; never guessed."""
        if self.parallel is None:
            return read_only_hint is True
        if isinstance(self.parallel, bool):
            return self.parallel
        return tool in self.parallel


def valid_name_part(name: str) -> bool:
    """Whether ``name`` may stand in ``mcp__<server>__<tool>``: letters, digits, ``_`` and
    ``-``, and no ``__`` (which separates the parts)."""
    return bool(_NAME_PART.fullmatch(name)) and "__" not in name


def tool_name(server: str, tool: str) -> str:
    """The name the model sees for ``tool`` of ``server`` (R-MCP-1)."""
    return f"mcp__{server}__{tool}"


def tool_name_problem(server: str, tool: str) -> str | None:
    """Why a server's tool cannot be offered under its name, or None. Tool names may hold
    characters (``.``, ``/``) that providers refuse; such tools are skipped, not renamed,
    so a name in a trace always means the same tool."""
    if not _NAME_PART.fullmatch(tool):
        return f"its name {tool!r} has characters other than letters, digits, '_' and '-'"
    if len(tool_name(server, tool)) > MAX_TOOL_NAME:
        return f"{tool_name(server, tool)!r} is longer than {MAX_TOOL_NAME} characters"
    return None


def parse_config_text(
    text: str, source: str, report: Report | None = None
) -> dict[str, McpServerConfig]:
    """The servers of a config file's text, in any of the shapes of the module docstring.
    With ``report``, a bad entry is reported (naming it and why) and skipped, and so is a
    disabled one; without it, the first problem raises :class:`McpConfigError`. A file that
    is not JSON, or holds no servers object at all, raises either way (it has no entries to
    keep)."""
    try:
        data = json.loads(strip_jsonc(text))
    except json.JSONDecodeError as exc:
        raise McpConfigError(
            f"{source}: not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise McpConfigError(f"{source}: not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise McpConfigError(f"{source}: $: expected an object with \"mcpServers\"")
    groups: list[tuple[str, Any]] = []
    if "mcpServers" in data:
        groups.append(("$.mcpServers", data["mcpServers"]))
    if "servers" in data:  # VS Code's .vscode/mcp.json
        groups.append(("$.servers", data["servers"]))
    settings = data.get("mcp")
    if isinstance(settings, Mapping) and "servers" in settings:  # VS Code's settings.json
        groups.append(("$.mcp.servers", settings["servers"]))
        if "inputs" in settings:
            _note_inputs(source, "$.mcp.inputs", report)
    if not groups:
        raise McpConfigError(
            f"{source}: $.mcpServers: required property missing (or VS Code's \"servers\")"
        )
    if "inputs" in data:
        _note_inputs(source, "$.inputs", report)
    servers: dict[str, McpServerConfig] = {}
    for path, value in groups:
        for name, config in parse_servers(value, source=source, path=path, report=report).items():
            if name in servers:
                problem = _error(source, f"{path}.{name}", f"server {name!r} is listed twice")
                if report is None:
                    raise problem
                report(f"{problem}; skipped")
                continue
            servers[name] = config
    return {name: _resolve_env_file(config, source) for name, config in servers.items()}


def _resolve_env_file(config: McpServerConfig, source: str) -> McpServerConfig:
    """``config`` with its ``envFile`` resolved as VS Code resolves it: against the
    workspace of the file ``source`` (the folder of its ``.vscode`` folder, else its own
    folder), for ``${workspaceFolder}`` and for a relative path. (Path text alone: no I/O.)"""
    if config.env_file is None:
        return config
    folder = posixpath.dirname(source)
    if posixpath.basename(folder) == ".vscode":
        folder = posixpath.dirname(folder)
    folder = folder or "."
    resolved = config.env_file.replace("${workspaceFolder}", folder)
    if not resolved.startswith(("/", "~", "${")):
        resolved = posixpath.join(folder, resolved)
    return attrs.evolve(config, env_file=resolved)


def env_file_values(text: str) -> dict[str, str]:
    """The variables of an env file's ``text`` when every line is simple: ``KEY=VALUE``
    (``export`` before it allowed), the value bare or in matching quotes; blank lines and
    ``#`` comments are skipped. Raises ValueError naming the first line that is not simple
    (a value with an inline comment, escapes, a quote left open, several lines): such a
    file is read by rules this does not follow, and a guess would give the server wrong
    values."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, equals, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not _ENV_NAME.fullmatch(key):
            raise ValueError(f"line {number} is not KEY=VALUE")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            inner = value[1:-1]
            if value[0] in inner or (value[0] == '"' and "\\" in inner):
                raise ValueError(f"line {number} has a quoted value this does not read")
            value = inner
        elif any(c in value for c in "'\"`#"):
            raise ValueError(f"line {number} has a value this does not read")
        values[key] = value
    return values


_JSONC_COMMENTS = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*[\s\S]*?(?:\*/|\Z)')
_JSONC_TRAILING_COMMAS = re.compile(r'"(?:[^"\\\n]|\\.)*"|,(?=\s*[}\]])')


def strip_jsonc(text: str) -> str:
    """``text`` with the JSONC that VS Code writes in its settings and ``mcp.json`` made
    JSON: ``//`` and ``/* */`` comments and commas before a closing ``}`` or ``]`` become
    blanks (newlines stay, so an error's line and column are those of ``text``); strings
    are left as they are. Plain JSON comes back unchanged."""

    def blank(match: re.Match[str]) -> str:
        found = match.group()
        if found.startswith('"'):
            return found
        return re.sub(r"[^\n]", " ", found)

    without_comments = _JSONC_COMMENTS.sub(blank, text)
    return _JSONC_TRAILING_COMMAS.sub(blank, without_comments)


def _note_inputs(source: str, path: str, report: Report | None) -> None:
    if report is not None:
        report(f"{source}: {path}: ignored (VS Code input variables are not supported; a "
               "${input:…} in a value is passed as written)")


def parse_servers(
    value: Any, *, source: str = "mcp_servers", path: str = "$", report: Report | None = None
) -> dict[str, McpServerConfig]:
    """The servers of an ``mcpServers`` mapping (``{"NAME": {...}}``); ``source`` and
    ``path`` prefix the error messages. A ``"disabled": true`` entry is left out. With
    ``report``, a bad entry is reported and skipped (R-MCP-6); without it, it raises
    :class:`McpConfigError`."""
    if not isinstance(value, Mapping):
        raise _error(source, path, "expected an object of servers by name")
    servers: dict[str, McpServerConfig] = {}
    for name, entry in value.items():
        where = f"{path}.{name}"
        try:
            if _disabled(entry, source, where):
                continue
            servers[name] = parse_server(name, entry, source=source, path=where, report=report)
        except McpConfigError as exc:
            if report is None:
                raise
            report(f"{exc}; server {name!r} skipped, the others load")
    return servers


def _disabled(entry: Any, source: str, path: str) -> bool:
    """Whether an entry says ``"disabled": true`` (Cline, Roo Code): it is not loaded."""
    if not isinstance(entry, Mapping) or "disabled" not in entry:
        return False
    disabled = entry["disabled"]
    if not isinstance(disabled, bool):
        raise _error(source, f"{path}.disabled", f"expected true or false, got {disabled!r}")
    return disabled


def parse_server(
    name: Any, entry: Any, *, source: str, path: str, report: Report | None = None
) -> McpServerConfig:
    """One server entry. Raises :class:`McpConfigError`. A key another client writes that
    greenroom reads past (``timeout``, ``watchPaths``, …) is noted through ``report`` once
    the entry has loaded."""
    config = _parse_server(name, entry, source=source, path=path)
    if report is not None and isinstance(entry, Mapping):
        for key in entry:
            if key in _NOTED_KEYS:
                report(f"{source}: {path}.{key}: ignored ({_NOTED_KEYS[key]})")
    return config


def _parse_server(name: Any, entry: Any, *, source: str, path: str) -> McpServerConfig:
    if not isinstance(name, str) or not valid_name_part(name):
        raise _error(
            source, path, f"server name {name!r} must be letters, digits, '_' and '-', "
            "without '__' (it becomes part of the tool names mcp__<server>__<tool>)"
        )
    if isinstance(entry, McpServerConfig):
        return attrs.evolve(entry, name=name)
    if not isinstance(entry, Mapping):
        raise _error(source, path, "expected an object")
    for key in entry:
        if key not in _KNOWN_KEYS:
            raise _error(
                source, f"{path}.{key}", f"unknown key (known: {', '.join(_KNOWN_KEYS)})"
            )
    type_key = "type" if "type" in entry or "transportType" not in entry else "transportType"
    given = entry.get(type_key)
    if given is None:
        given = "http" if "url" in entry and "command" not in entry else "stdio"
    kind = _TRANSPORTS.get(given) if isinstance(given, str) else None
    if kind is None:
        raise _error(source, f"{path}.{type_key}",
                     f'expected "stdio", "http" or "sse", got {given!r}')
    common: dict[str, Any] = {
        "name": name,
        "disabled_tools": frozenset(
            _strings(entry.get("disabledTools", []), source, f"{path}.disabledTools")
        ),
        "parallel": _parallel(entry.get("parallel"), source, f"{path}.parallel"),
        "timeout_s": _timeout(entry.get("timeout_s"), source, f"{path}.timeout_s"),
        "scope": _scope(entry.get("scope"), source, f"{path}.scope"),
    }
    if kind == "stdio":
        for key in ("url", "headers"):
            if key in entry:
                raise _error(source, f"{path}.{key}", "only for a server of type http or sse")
        command = entry.get("command")
        if not isinstance(command, str) or not command:
            raise _error(source, f"{path}.command", "expected a string")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise _error(source, f"{path}.cwd", "expected a string")
        env_file = entry.get("envFile")
        if env_file is not None and (not isinstance(env_file, str) or not env_file):
            raise _error(source, f"{path}.envFile", "expected a string")
        return McpServerConfig(
            transport="stdio",
            command=command,
            args=_strings(entry.get("args", []), source, f"{path}.args"),
            env=_string_map(entry.get("env", {}), source, f"{path}.env"),
            cwd=cwd,
            env_file=env_file,
            **common,
        )
    for key in ("command", "args", "env", "envFile", "cwd"):
        if key in entry:
            raise _error(source, f"{path}.{key}", "only for a stdio server")
    url = entry.get("url")
    if not isinstance(url, str):
        raise _error(source, f"{path}.url", "expected a string")
    if not re.match(r"https?://[^/\s]+", url):
        raise _error(source, f"{path}.url", f"expected an http:// or https:// URL, got {url!r}")
    return McpServerConfig(
        transport="sse" if kind == "sse" else "http",
        url=url,
        headers=_string_map(entry.get("headers", {}), source, f"{path}.headers"),
        **common,
    )


def merge_configs(
    parts: list[tuple[str, dict[str, McpServerConfig]]], report: Report | None = None
) -> dict[str, McpServerConfig]:
    """The servers of several files in order; a name given twice is an error naming both
    files (which one should win is not obvious). With ``report`` it is reported instead and
    the first file's server kept (R-MCP-6)."""
    merged: dict[str, McpServerConfig] = {}
    origin: dict[str, str] = {}
    for source, servers in parts:
        for name, config in servers.items():
            if name in merged:
                problem = McpConfigError(
                    f"{source}: $.mcpServers.{name}: server {name!r} is also configured in "
                    f"{origin[name]}"
                )
                if report is None:
                    raise problem
                report(f"{problem}; the one in {origin[name]} is used")
                continue
            merged[name] = config
            origin[name] = source
    return merged


def parse_acp_servers(value: Any, *, source: str = "session/new", path: str = "$.mcpServers"
                      ) -> dict[str, McpServerConfig]:
    """The servers of an ACP ``session/new {mcpServers}`` list: ``{name, command, args,
    env: [{name, value}]}`` (stdio) or ``{type: "http", name, url, headers: [{name,
    value}]}``. Raises :class:`McpConfigError`."""
    if not isinstance(value, list):
        raise _error(source, path, "expected an array of servers")
    servers: dict[str, McpServerConfig] = {}
    for index, entry in enumerate(value):
        where = f"{path}[{index}]"
        if not isinstance(entry, Mapping):
            raise _error(source, where, "expected an object")
        name = entry.get("name")
        if not isinstance(name, str):
            raise _error(source, f"{where}.name", "expected a string")
        converted: dict[str, Any] = {}
        for key, item in entry.items():
            if key == "name":
                continue
            if key in ("env", "headers"):
                converted[key] = _name_value_pairs(item, source, f"{where}.{key}")
            else:
                converted[key] = item
        if name in servers:
            raise _error(source, f"{where}.name", f"server {name!r} is listed twice")
        servers[name] = parse_server(name, converted, source=source, path=where)
    return servers


def _name_value_pairs(value: Any, source: str, path: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, list):
        raise _error(source, path, "expected an array of {name, value}")
    pairs: dict[str, Any] = {}
    for index, item in enumerate(value):
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise _error(source, f"{path}[{index}]", "expected {name, value}")
        pairs[item["name"]] = item.get("value")
    return pairs


def _error(source: str, path: str, message: str) -> McpConfigError:
    return McpConfigError(f"{source}: {path}: {message}")


def _strings(value: Any, source: str, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _error(source, path, "expected an array of strings")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise _error(source, f"{path}[{index}]", "expected a string")
    return tuple(value)


def _string_map(value: Any, source: str, path: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise _error(source, path, "expected an object of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise _error(source, f"{path}.{key}", "expected a string")
    return tuple(sorted(value.items()))


def _parallel(value: Any, source: str, path: str) -> bool | tuple[str, ...] | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, list):
        return _strings(value, source, path)
    raise _error(source, path, "expected true, false or an array of tool names")


def _timeout(value: Any, source: str, path: str) -> float:
    if value is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _error(source, path, f"expected a positive number of seconds, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range: 400 digits read as JSON
        raise _error(
            source, path, "expected a positive number of seconds, got one too large"
        ) from None


def _scope(value: Any, source: str, path: str) -> Literal["host", "session"]:
    if value is None:
        return "host"
    if value not in ("host", "session"):
        raise _error(source, path, f'expected "host" or "session", got {value!r}')
    return "host" if value == "host" else "session"


_SCHEMA_TYPES = frozenset(("string", "integer", "number", "boolean", "null", "array", "object"))
_MAX_SCHEMA_DEPTH = 64


def schema_problem(schema: Any) -> str | None:
    """Why a server's input schema cannot be offered to the model, or None: the root must
    be an object schema, and every ``type`` a JSON type (the argument check of R-TOOL-5
    relies on both). Iterative, so any nesting is safe to inspect."""
    if not isinstance(schema, Mapping):
        return "its input schema is not an object"
    if schema.get("type", "object") != "object":
        return f"its input schema has type {schema.get('type')!r}, not 'object'"
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        return "its input schema's properties are not an object"
    # (node, path, depth, whether node is a schema rather than a map of named schemas)
    stack: list[tuple[Any, str, int, bool]] = [(schema, "$", 1, True)]
    while stack:
        node, path, depth, is_schema = stack.pop()
        if depth > _MAX_SCHEMA_DEPTH:
            return f"its input schema nests deeper than {_MAX_SCHEMA_DEPTH} levels"
        if isinstance(node, list):
            stack.extend((item, f"{path}[{i}]", depth + 1, True) for i, item in enumerate(node))
            continue
        if not isinstance(node, Mapping):
            if not is_schema:
                return f"its input schema has {node!r:.40} where named schemas belong, at {path}"
            if not isinstance(node, bool):
                return f"its input schema has {node!r:.40} where a schema belongs, at {path}"
            continue
        if not is_schema:
            stack.extend((child, f"{path}.{key}", depth + 1, True) for key, child in node.items())
            continue
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        for item in kinds:
            if not isinstance(item, str) or item not in _SCHEMA_TYPES:
                return f"its input schema has an unknown type {item!r} at {path}"
        for key in _LISTS:
            if key in node and not isinstance(node[key], list):
                return f"its input schema's {key} at {path} is not a list"
        required = node.get("required", ())
        if not all(isinstance(name, str) for name in required):
            return f"its input schema's required at {path} names a property by a non-string"
        for key, child in node.items():
            if key in _NAMED_SCHEMAS:
                stack.append((child, f"{path}.{key}", depth + 1, False))
            elif key in _SUBSCHEMAS:
                stack.append((child, f"{path}.{key}", depth + 1, True))
    return None


_LISTS = ("enum", "required", "anyOf", "oneOf", "allOf", "prefixItems")
"""Keywords whose value is a list (the argument check of R-TOOL-5 iterates them)."""
_NAMED_SCHEMAS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
)
_SUBSCHEMAS = frozenset(
    ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not",
     "contains", "if", "then", "else", "propertyNames", "additionalItems")
)
