"""Tool definitions: the ``@tool`` decorator, JSON schemas and argument validation.

A tool is a plain ``async def`` whose annotations give its JSON schema and whose docstring
gives its description. Whether it may run beside other calls is declared, never guessed
from its name (R-TOOL-3)::

    @tool(parallel=True)
    async def lookup(key: str, limit: int = 10) -> str:
        \"\"\"Look up a key.

        Args:
            key: what to look up.
            limit: the most results to return.
        \"\"\"

A parameter named ``ctx`` receives a :class:`ToolContext` and is not part of the schema.
Its ``idempotency_key`` names the call for the outside world (R-EFFECT-1): the same on
every attempt, host and restart, different for every other call — a payment API's
``Idempotency-Key`` header (``ctx.idempotency_headers()``). A tool whose effect may have
happened when its host was lost says how to find out with ``check`` (R-EFFECT-2)::

    async def find_payment(key: str) -> str | None:
        payment = await payments.lookup(key)            # the key the call sent
        return f"paid {payment.amount}" if payment else None

    @tool(check=find_payment)
    async def pay(amount: int, ctx: ToolContext) -> str:
        \"\"\"Pay an amount.\"\"\"
        return await payments.pay(amount, headers=ctx.idempotency_headers())

Validation errors are ``$.path: message`` strings that go back to the model as an error
output; the tool is not run (R-TOOL-5).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import (
    Any,
    Literal,
    Protocol,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

import attrs

from greenroom.protocols.content import ImageBlock, TextBlock, ToolContent
from greenroom.protocols.context import ToolSchema
from greenroom.protocols.messages import QuestionAnswered
from greenroom.protocols.text import has_surrogates, json_type_name, repair_json


@attrs.frozen(kw_only=True, slots=True)
class WorkspaceIdentity:
    """Which directory a session's workspace is (R-SEC-7), fixed when the session is
    created: its resolved ``path`` then, and that directory's ``device`` and ``inode``
    numbers. A directory found at ``path`` later is the workspace only when its numbers
    are these; anything else standing there (a symlink, another directory) is refused.
    ``boot`` names the system boot the numbers were taken in (device numbers need not
    survive a reboot), None where it is not known."""

    path: Path
    device: int
    inode: int
    boot: str | None = None


class Spawn(Protocol):
    """The runtime's subagent callback (:attr:`ToolContext.spawn`): run a subagent on
    ``task`` and return its final answer, or start it in the ``background`` and return
    ``{"session_id": …}`` as JSON (R-HOST-4, R-TREE-2). ``name`` labels it. Raises when
    the subagent cannot run, fails or hits a limit."""

    def __call__(
        self, task: str, *, background: bool = False, name: str | None = None
    ) -> Awaitable[str]:
        """Spawn the subagent (see the class docstring)."""
        ...


class EditorError(Exception):
    """The editor refused or failed a request of :class:`Editor` (its words, for the
    model), or did not answer in time."""


@attrs.frozen(kw_only=True, slots=True)
class TerminalRun:
    """How a command run in the editor's terminal ended: its ``output`` (the end of it
    when the editor kept only that: ``truncated``), its ``exit_code`` or the ``signal``
    that ended it, and whether it was killed because it ran past its time
    (``timed_out``)."""

    output: str
    truncated: bool = False
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool = False


class Editor(Protocol):
    """The editor that drives a session, when it offers its files and its terminal (an
    ACP client's ``fs`` and ``terminal`` capabilities, R-ACP-2): :attr:`ToolContext.editor`.

    The built-in tools use it after their own workspace checks (R-SEC-7), with absolute
    paths inside the workspace only: ``read_file`` reads through it when :attr:`reads`
    (the editor's buffer, saved or not), ``write_file`` writes through it when
    :attr:`writes` and shows the edit with :meth:`show_diff`, and ``run_shell`` runs in
    its terminal when :attr:`runs` and the session's sandbox is ``off`` (the editor runs
    the command: no sandbox of greenroom's applies). The methods that ask the editor raise
    :class:`EditorError`; cancelling one stops what it asked for (a terminal's command is
    killed)."""

    @property
    def reads(self) -> bool:
        """Whether files are read through the editor."""
        ...

    @property
    def writes(self) -> bool:
        """Whether files are written through the editor."""
        ...

    @property
    def runs(self) -> bool:
        """Whether commands may run in the editor's terminal."""
        ...

    async def read_text(
        self, path: str, *, line: int | None = None, limit: int | None = None
    ) -> str:
        """The text of ``path`` as the editor has it, from ``line`` (1-based), at most
        ``limit`` lines; None: from the start, to the end."""
        ...

    async def write_text(self, path: str, content: str) -> None:
        """Have the editor write ``content`` to ``path`` (its buffer and the file)."""
        ...

    def show_diff(
        self, call_id: str, path: str, old_text: str | None, new_text: str
    ) -> None:
        """Show the call ``call_id`` as the edit of ``path`` from ``old_text`` (None: a
        new file) to ``new_text``. Never raises."""
        ...

    async def run(
        self,
        command: str,
        *,
        cwd: str,
        timeout_s: float,
        output_limit: int,
        call_id: str,
        report_progress: Callable[[str], None],
    ) -> TerminalRun:
        """Run ``command`` with ``bash -c`` in ``cwd`` in a terminal of the editor until
        it exits or ``timeout_s`` pass (then it is killed); the editor keeps at most the
        last ``output_limit`` bytes of its output. The terminal is shown on the call
        ``call_id`` from the ``report_progress`` note that says it started."""
        ...


@attrs.frozen(kw_only=True, slots=True)
class ToolContext:
    """What a running tool may use besides its arguments.

    ``report_progress`` never raises and never blocks; notes sent after the call is
    terminal are dropped (R-TOOL-6).

    ``spawn`` runs a subagent on a task inside the calling session's task and returns its
    final answer, or starts it in the background (R-HOST-4, R-TREE-2: :class:`Spawn`); it
    raises when the subagent fails or hits a limit. It is an opaque callback into the
    runtime, set by the tool pool; None where subagents are not available (a tool run
    outside a session).

    ``sandbox`` and ``shell_network`` are the session's settings for ``run_shell``
    (R-SEC-3); ``private_dirs`` are host directories (the data dir) that no tool of the
    session may reach: a workspace that is, holds or lies inside one is refused, and a
    sandboxed command does not see them.

    ``workspace_identity`` is the directory the session's workspace was when the session
    was created (R-SEC-7): the built-in tools work only in that directory and refuse the
    call when another one stands at its path. None (a context built by hand) takes the
    directory at ``workspace_dir`` when each call starts.

    ``idempotency_key`` names the call outside the runtime (R-EFFECT-1): the same for
    every attempt of this call — run again after its host was lost, on any host, after
    any restart — and different for every other call; send it where an effect is made
    (:meth:`idempotency_headers`, an MCP call's ``_meta``). A context built by hand has
    its ``call_id``.

    ``editor`` is the editor that drives the session when it offers its files and
    terminal (:class:`Editor`, R-ACP-2): the built-in tools read, write and run through it
    after the same workspace checks; None otherwise (they use the disk and the sandbox).

    ``ask`` asks the session's people a question while the call runs (an MCP server's
    elicitation: R-HITL-5), given the ``arguments`` a person is shown (``question`` at
    least), and returns their :class:`~greenroom.protocols.messages.QuestionAnswered`.
    The question is durable like any request of the task, but it lasts only as long as
    the call: it is cancelled when the call ends, and a call lost with its host is not
    run again. One question at a time per call. None where nobody answers questions (the
    task's calls are not decided by people).
    """

    call_id: str
    workspace_dir: Path
    scratchpad_dir: Path
    report_progress: Callable[[str], None]
    spawn: Spawn | None = None
    sandbox: Literal["auto", "required", "off"] = "auto"
    shell_network: bool = False
    private_dirs: tuple[Path, ...] = ()
    workspace_identity: WorkspaceIdentity | None = None
    ask: Callable[[dict[str, Any]], Awaitable[QuestionAnswered]] | None = None
    editor: Editor | None = None
    idempotency_key: str = attrs.field(
        default=attrs.Factory(lambda ctx: ctx.call_id, takes_self=True)
    )

    def idempotency_headers(self) -> dict[str, str]:
        """``{"Idempotency-Key": key}``: the HTTP header by which payment and other APIs
        (Stripe, Adyen, the IETF draft) make a request that is sent again take effect
        once. Merge it into the headers of the request that makes the effect."""
        return {IDEMPOTENCY_HEADER: self.idempotency_key}


IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The HTTP header :meth:`ToolContext.idempotency_headers` sets (IETF
draft-ietf-httpapi-idempotency-key-header)."""

InDoubtCheck = Callable[[str], Awaitable[Any]]
"""``@tool(check=fn)``: ``async def fn(idempotency_key) -> result | None``, asked after a
crash whether the call with that key took effect (R-EFFECT-2). A result — a string,
content blocks as a tool returns them, or a
:class:`~greenroom.protocols.context.ToolResult` (its ``content`` and ``is_error``) — is
recorded as the call's result; None means it did not take effect, and the call runs again
once. A check that raises or runs out of time answers nothing."""


ToolFunction = Callable[..., Awaitable[Any]]


@attrs.frozen(kw_only=True, slots=True)
class Tool:
    """A tool the model can call.

    ``parallel`` — parallel-safe calls share the pool's slots; other calls run alone, in
    call order (R-TOOL-3). ``side_effects`` — the trace is made durable before such a
    call starts (R-TRACE-2); it defaults to ``not parallel``. ``idempotent`` — running the
    call again after its host was lost is safe (R-CLUSTER-2): the model is told so and
    may call it again. ``check`` — asks the outside world whether a call its host lost
    took effect (:data:`InDoubtCheck`, R-EFFECT-2). ``client_side`` — a client runs the
    tool, not the runtime (an AG-UI front end's tool: :func:`client_tool`): a call is never
    run here, it is a durable question (R-HITL-5) whose answer is its result, whoever
    decides the session's other calls.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    parallel: bool
    side_effects: bool
    function: ToolFunction = attrs.field(eq=False, repr=False)
    takes_ctx: bool = False
    timeout_s: float | None = None
    idempotent: bool = False
    check: InDoubtCheck | None = attrs.field(default=None, eq=False, repr=False)
    client_side: bool = False

    @property
    def schema(self) -> ToolSchema:
        """What the model is told of the tool: name, description and input schema."""
        return ToolSchema(
            name=self.name, description=self.description, input_schema=self.input_schema
        )

    def validate(self, arguments: Mapping[str, Any]) -> list[str]:
        """``$.path: message`` errors of ``arguments`` against the schema (empty if valid).
        Arguments nested deeper than :data:`MAX_ARGUMENT_DEPTH` are one error (R-SEC-6)."""
        if value_too_deep(arguments):
            return [f"$: nested deeper than {MAX_ARGUMENT_DEPTH} levels"]
        return validate_json(arguments, self.input_schema)


CLIENT_NOT_ANSWERING = "The client that runs this tool did not give its result."
"""What a client-side tool's call gives should it ever be run here (nobody answered)."""


def client_tool(name: str, description: str, parameters: dict[str, Any]) -> Tool:
    """A tool a client runs itself (``Tool.client_side``): ``parameters`` is its JSON Schema
    (an object schema). Its calls wait for the client's answer, given as the answer to the
    call's question (``host.answer_question``)."""

    async def not_run_here(**_: Any) -> str:
        return CLIENT_NOT_ANSWERING

    return Tool(
        name=name,
        description=description,
        input_schema=parameters,
        parallel=True,
        side_effects=False,
        function=not_run_here,
        client_side=True,
    )


class ToolDefinitionError(TypeError):
    """A function cannot be turned into a tool (an annotation with no JSON form...)."""


class ToolFailure(Exception):
    """Raised by a tool whose message is the whole error output: the model sees
    ``str(exc)`` alone (R-TOOL-4). Other exceptions reach it as ``ClassName: message``,
    which tells the author of a Python tool what went wrong but would only mislead about a
    failure reported from elsewhere (an MCP server's own message)."""


_TYPE_NAMES: dict[type, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
}


def json_schema_for(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a Python annotation (str, int, float, bool, None, Literal,
    list/tuple/set, dict[str, X], unions and Optional)."""
    if annotation is Any:
        return {}
    if annotation is type(None) or annotation is None:
        return {"type": "null"}
    if annotation in _TYPE_NAMES:
        return {"type": _TYPE_NAMES[annotation]}
    if annotation in (list, tuple, set, frozenset):
        return {"type": "array"}
    if annotation is dict:
        return {"type": "object"}
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {type(a) for a in args}
        if len(kinds) == 1 and next(iter(kinds)) in _TYPE_NAMES:
            schema["type"] = _TYPE_NAMES[next(iter(kinds))]
        return schema
    if origin in (list, set, frozenset, Sequence) or (
        origin is tuple and len(args) == 2 and args[1] is Ellipsis
    ):
        return {"type": "array", "items": json_schema_for(args[0])} if args else {"type": "array"}
    if origin is tuple:
        return {
            "type": "array",
            "prefixItems": [json_schema_for(a) for a in args],
            "minItems": len(args),
            "maxItems": len(args),
        }
    if origin in (dict, Mapping):
        if args and args[0] is not str:
            raise ToolDefinitionError(f"dict keys must be str, not {args[0]!r}")
        return (
            {"type": "object", "additionalProperties": json_schema_for(args[1])}
            if args
            else {"type": "object"}
        )
    if origin in (Union, types.UnionType):
        members = [json_schema_for(a) for a in args]
        return {"anyOf": members}
    raise ToolDefinitionError(f"no JSON schema for annotation {annotation!r}")


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\w+)\s*(\([^)]*\))?:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Description (everything before ``Args:``) and per-parameter descriptions."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    description: list[str] = []
    params: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in lines:
        if _ARGS_HEADER.match(line):
            in_args = True
            continue
        if not in_args:
            description.append(line)
            continue
        if line and not line[0].isspace():
            in_args = False
            description.append(line)
            continue
        match = _ARG_LINE.match(line)
        if match and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = match.group(1)
            params[current] = match.group(3).strip()
        elif current is not None and line.strip():
            params[current] = f"{params[current]} {line.strip()}".strip()
    return "\n".join(description).strip(), params


def make_tool(
    function: ToolFunction,
    *,
    parallel: bool,
    name: str | None = None,
    description: str | None = None,
    side_effects: bool | None = None,
    timeout_s: float | None = None,
    idempotent: bool = False,
    check: InDoubtCheck | None = None,
) -> Tool:
    """Build a :class:`Tool` from an ``async def``; see the module docstring."""
    if not inspect.iscoroutinefunction(function):
        raise ToolDefinitionError(f"tool {function.__name__!r} must be an async function")
    if check is not None and not inspect.iscoroutinefunction(check):
        raise ToolDefinitionError(
            f"tool {function.__name__!r}: its check must be an async function of the "
            "idempotency key"
        )
    hints = get_type_hints(function)
    doc_description, param_docs = _parse_docstring(function.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    takes_ctx = False
    for param in inspect.signature(function).parameters.values():
        if param.name == "ctx":
            takes_ctx = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {function.__name__!r}: *args/**kwargs not allowed")
        annotation = hints.get(param.name, Any)
        schema = dict(json_schema_for(annotation))
        if param.name in param_docs:
            schema["description"] = param_docs[param.name]
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        elif param.default is not None and isinstance(param.default, str | int | float | bool):
            schema["default"] = param.default
        properties[param.name] = schema
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return Tool(
        name=name or function.__name__,
        description=description or doc_description or (name or function.__name__),
        input_schema=input_schema,
        parallel=parallel,
        side_effects=(not parallel) if side_effects is None else side_effects,
        function=function,
        takes_ctx=takes_ctx,
        timeout_s=timeout_s,
        idempotent=idempotent,
        check=check,
    )


@overload
def tool(function: ToolFunction, /) -> Tool: ...
@overload
def tool(
    *,
    parallel: bool = False,
    name: str | None = None,
    description: str | None = None,
    side_effects: bool | None = None,
    timeout_s: float | None = None,
    idempotent: bool = False,
    check: InDoubtCheck | None = None,
) -> Callable[[ToolFunction], Tool]: ...
def tool(
    function: ToolFunction | None = None,
    /,
    *,
    parallel: bool = False,
    name: str | None = None,
    description: str | None = None,
    side_effects: bool | None = None,
    timeout_s: float | None = None,
    idempotent: bool = False,
    check: InDoubtCheck | None = None,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Turn an ``async def`` into a :class:`Tool`. Bare ``@tool`` means not parallel-safe;
    the other options are :class:`Tool`'s."""

    def wrap(fn: ToolFunction) -> Tool:
        return make_tool(
            fn,
            parallel=parallel,
            name=name,
            description=description,
            side_effects=side_effects,
            timeout_s=timeout_s,
            idempotent=idempotent,
            check=check,
        )

    if function is not None:
        return wrap(function)
    return wrap


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


MAX_ARGUMENT_DEPTH = 64
"""How deeply tool arguments may nest (objects and arrays). Deeper arguments are invalid
arguments of that call (R-SEC-6, R-TOOL-5): every consumer of a value — validation, repair,
encoding the next request, the trace — walks it recursively, and no tool needs more."""

# A JSON string (escapes included) or one bracket: brackets inside strings never count.
_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_text_too_deep(text: str, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether the JSON text ``text`` nests objects and arrays deeper than ``limit``.

    Checked before parsing, so a hostile value costs one regular-expression scan and never a
    recursion. Text with no more than ``limit`` brackets in all returns at once."""
    if text.count("{") + text.count("[") <= limit:
        return False
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        token = match.group()
        if token == "{" or token == "[":
            depth += 1
            if depth > limit:
                return True
        elif token == "}" or token == "]":
            depth -= 1
    return False


def value_too_deep(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether a decoded JSON value nests objects and arrays deeper than ``limit``
    (iterative: safe on any depth)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class NotAJsonNumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in JSON text, or a number too large for a
    float (``1e999`` reads as infinity): Python reads them, but no JSON encoder the
    providers use writes them back, so such arguments would make every later request of
    the session fail (and an answer holding them would be printed and sent to every
    client as text that is not JSON). Its message says which, in words for a person."""


def _reject_constant(name: str) -> Any:
    raise NotAJsonNumber(f"{name} is not a JSON number")


def _read_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotAJsonNumber("number too large (not finite once read)")
    return value


decode_strict_json: Callable[[str], Any] = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_read_float
).decode
"""``json.loads`` as every JSON reader takes it: raises :class:`NotAJsonNumber` where
Python alone would read ``NaN``, ``Infinity`` or a number no float holds."""


def json_error_reason(exc: BaseException) -> str:
    """Why JSON text did not decode, in words for a person, never Python's internals:
    ``expecting ',' delimiter at character 12``, ``number too long`` (an integer past
    Python's digit limit), ``number too large (not finite once read)`` (``1e999``),
    ``nested too deeply``, ``NaN is not a JSON number``."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, json.JSONDecodeError):
        msg = exc.msg
        return f"{msg[:1].lower()}{msg[1:]} at character {exc.pos}"
    if isinstance(exc, NotAJsonNumber):
        return str(exc)
    if "integer string conversion" in str(exc):
        return "number too long"
    return "not valid JSON"


def invalid_arguments_reason(raw: str) -> str:
    """Why a call's argument text (``ToolCallBlock.invalid_arguments``) is not usable
    arguments, in words: ``nested deeper than 64 levels``, ``malformed JSON: number too
    long``, ``not a JSON object (got array)``. The error output of such a call says it
    (R-TOOL-5)."""
    if json_text_too_deep(raw):
        return f"nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        value = decode_strict_json(raw)
    except (ValueError, RecursionError) as exc:
        return f"malformed JSON: {json_error_reason(exc)}"
    if value.__class__ is not dict:
        return f"not a JSON object (got {json_type_name(value)})"
    return "not usable as arguments"


def parse_tool_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """``(arguments, invalid_arguments)`` of a model's complete argument text.

    Blank text means ``{}``. Text that is not a JSON object, nests deeper than
    :data:`MAX_ARGUMENT_DEPTH`, holds a number Python cannot read (an integer past its digit
    limit) or a number that is not finite (``NaN``, ``Infinity``, or ``1e999``, which reads
    as infinity; no request encoder writes them back) gives ``({}, raw)``: the call gets an
    error output saying why (:func:`invalid_arguments_reason`) and is not run (R-TOOL-5,
    R-SEC-6). Lone UTF-16 surrogates in the value become U+FFFD (R-SEC-1); the repair walk
    runs only when the text can hold one. Never raises."""
    if not raw or raw.isspace():
        return {}, None
    if json_text_too_deep(raw):
        return {}, raw
    try:
        value = decode_strict_json(raw)
    except (ValueError, RecursionError):
        return {}, raw
    if value.__class__ is not dict:
        return {}, raw
    if (not raw.isascii() and has_surrogates(raw)) or (
        "\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None
    ):
        value = repair_json(value)
    return value, None


def validate_json(value: Any, schema: Mapping[str, Any] | bool, path: str = "$") -> list[str]:
    """Validate ``value`` against the subset of JSON Schema that :func:`json_schema_for`
    produces (type, enum, anyOf, properties/required/additionalProperties, items,
    prefixItems), and the boolean schemas (``true`` allows any value, ``false`` none).
    Draft-07's tuple form, a list of ``items`` with ``additionalItems`` for the rest (as
    MCP servers built with zod-to-json-schema list them), is read too.
    Returns ``$.path: message`` strings."""
    if schema is True:
        return []
    if schema is False:
        return [f"{path}: no value is allowed here"]
    errors: list[str] = []
    if "anyOf" in schema:
        if not any(not validate_json(value, sub, path) for sub in schema["anyOf"]):
            # A ``false`` choice accepts nothing: it is no kind to name.
            kinds = [_kind_of(sub) for sub in schema["anyOf"] if sub is not False]
            errors.append(f"{path}: expected one of: {', '.join(kinds)}" if kinds
                          else f"{path}: no value is allowed here")
        return errors
    expected = schema.get("type")
    if isinstance(expected, str) and not _JSON_TYPES[expected](value):
        return [f"{path}: expected {expected}, got {json_type_name(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: expected one of {schema['enum']!r}, got {value!r}"]
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}.{key}: required property missing")
        additional = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors.extend(validate_json(item, properties[key], f"{path}.{key}"))
            elif additional is False:
                errors.append(f"{path}.{key}: unexpected property")
            elif isinstance(additional, dict):
                errors.extend(validate_json(item, additional, f"{path}.{key}"))
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        if isinstance(schema.get("items"), list):
            # Draft-07 tuple: fewer items than listed are allowed (minItems says how many
            # are needed); more are checked against additionalItems.
            listed: list[Any] = schema["items"]
            rest = schema.get("additionalItems", True)
            for i, item in enumerate(value):
                if i < len(listed):
                    errors.extend(validate_json(item, listed[i], f"{path}[{i}]"))
                elif rest is False:
                    errors.append(f"{path}: expected at most {len(listed)} items, got {len(value)}")
                    break
                else:
                    errors.extend(validate_json(item, rest, f"{path}[{i}]"))
        elif prefix is not None:
            if len(value) != len(prefix):
                errors.append(f"{path}: expected {len(prefix)} items, got {len(value)}")
            for i, (item, sub) in enumerate(zip(value, prefix, strict=False)):
                errors.extend(validate_json(item, sub, f"{path}[{i}]"))
        elif "items" in schema:
            for i, item in enumerate(value):
                errors.extend(validate_json(item, schema["items"], f"{path}[{i}]"))
    return errors


def _kind_of(schema: Any) -> str:
    """What a subschema of ``anyOf`` accepts, for a message: its type (or types), else
    "value" (also for the boolean schema ``true``, or a type given otherwise)."""
    if not isinstance(schema, Mapping):
        return "value"
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return " or ".join(kind)
    return "value"


def normalize_result(value: Any) -> tuple[ToolContent, ...]:
    """A tool's return value as content blocks: a string, a block, or a sequence of them.

    Anything else is turned into text with ``str()``; ``None`` becomes an empty text.
    """
    if value is None:
        return (TextBlock(text=""),)
    if isinstance(value, str):
        return (TextBlock(text=value),)
    if isinstance(value, TextBlock | ImageBlock):
        return (value,)
    if isinstance(value, list | tuple) and all(
        isinstance(v, str | TextBlock | ImageBlock) for v in value
    ):
        return tuple(TextBlock(text=v) if isinstance(v, str) else v for v in value)
    return (TextBlock(text=str(value)),)
