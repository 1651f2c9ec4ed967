"""Tools from MCP servers (R-MCP-1…4), through the official ``mcp`` SDK on trio.

The SDK is anyio-based and runs here on anyio's trio backend: no asyncio loop is involved.

Who owns what:

* :class:`McpManager` lives in the host's nursery (``Host`` starts it on the first session
  that configures a server) and owns every connection; ``aclose`` ends them all, waiting
  for each stdio server process to exit (its transport closes its stdin, then terminates
  and kills its process tree, every wait bounded), so no process outlives the host.
* :class:`McpConnection` is one configured server: one process (stdio) or one HTTP session,
  shared by every session of the host that configures the same server identically
  (``"scope": "session"`` gives each session its own). One task of the manager's nursery
  holds the SDK's context managers for the connection's whole life; tool calls run in the
  calling tool's task and only send requests on it.
* :class:`McpBinding` ties one session to its connections: it keeps the session's tool
  table (a :class:`LiveToolTable`, read by the pool on every call, and the schemas the
  supervisor reads on every request) and swaps in a changed tool list only at a turn
  boundary (R-MCP-4): at once when the session is idle, else when the running task's
  tool results are in (the ``after_tool_results`` and ``on_stop`` hooks) or it ends.

Elicitation (R-HITL-5, R-MCP-5): a server that asks for input during a call
(``elicitation/create``, form mode) has its request put to the people of the session whose
call it is, through the call's ``ToolContext.ask``: a durable question in the session's
trace (``approval_request`` of kind ``question`` under the call's id), answered with
``host.answer_question`` (or declined with a ``deny``). The answer goes back as the
elicitation's result: ``accept`` with the content the answer gives for the requested schema
(:func:`~greenroom.protocols.people.form_content`), ``decline``, or ``cancel`` when nobody
answered in time or the call ended first. Nothing on the stdio wire says which request an
elicitation belongs to, so it is put to the one call in flight on its connection; with no
call or several in flight, with nobody to ask (the task's calls are not decided by people),
and for URL mode, it is declined. The time a person takes does not count against the call's
``timeout_s``. A question lasts only as long as its call: a call cannot outlive the host
that runs it, so a host that stops while a question waits leaves the call in doubt when the
task resumes (R-EFFECT-2), and the question is settled with it; until then nobody can answer
it, and it is listed only while its call waits for it here
(:func:`~greenroom.actors.runtime.tool_pool.question_waits`).

A tool's arguments are the model's, each sent as given — ``ctx`` too, whether the tool's
schema names it or not — and the call's ``ToolContext`` (progress, images, questions, the
idempotency key) is :func:`~greenroom.actors.runtime.tool_pool.current_tool_context`,
never an argument (R-MCP-3).

OAuth (R-MCP-5): an HTTP server that asks for authorization gets the token ``greenroom mcp
login`` stored for its URL, refreshed when it expires or is refused
(:mod:`~greenroom.actors.tools.mcp_auth`); without a usable one the server cannot be
started, with a message that says to log in.

Exactly once (R-EFFECT-1): every ``tools/call`` carries the call's idempotency key in its
``_meta`` as ``greenroom/idempotency_key`` — the same key each time the call is sent, on
any host — so a server that makes an effect can make it once.

Failures are error outputs, never failed tasks (R-MCP-4): a server that cannot start, exits
or stops answering makes its calls raise :class:`McpServerError`, which the pool turns into
an ``is_error`` result. A server that exited is started again on its next use; one that
failed to start is tried again after a backoff (1 s, doubling up to 60 s), a start being
bounded by ``START_TIMEOUT_S`` from connecting to the listings; one whose call (or resource
read, prompt) timed out is pinged before the next use and restarted when the ping fails too.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import logging
import math
import mimetypes
import warnings
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import attrs
import mcp_types
import trio
from mcp import ClientSession, StdioServerParameters
from mcp.client import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from greenroom.actors.runtime.tool_pool import current_tool_context
from greenroom.actors.tools.mcp_auth import STORE_NAME, StoredTokenAuth, auth_for
from greenroom.actors.tools.mcp_bounds import bounded_http_client, bounded_sse_client
from greenroom.actors.tools.mcp_commands import READ_RESOURCE
from greenroom.actors.tools.mcp_config import (
    EnvFileProblem,
    as_configs,
    load_config_files,
    read_env_file,
)
from greenroom.actors.tools.mcp_extras import (
    McpPromptInfo,
    McpResourceInfo,
    WorkspaceRoots,
    fetch_prompts,
    fetch_resources,
    prompt_messages,
    read_resource_tool,
    resource_text,
)
from greenroom.actors.tools.mcp_stdio import bounded_stdio_client
from greenroom.protocols.content import ImageBlock, TextBlock, ToolContent
from greenroom.protocols.context import ToolSchema
from greenroom.protocols.effects import MCP_META_KEY
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.mcp_config import (
    McpConfigError,
    McpServerConfig,
    schema_problem,
    tool_name,
    tool_name_problem,
)
from greenroom.protocols.messages import QuestionAnswered
from greenroom.protocols.people import form_content
from greenroom.protocols.tools import Tool, ToolContext, ToolFailure

if TYPE_CHECKING:
    from greenroom.actors.runtime.port import SessionPort

log = logging.getLogger("greenroom.mcp")

_T = TypeVar("_T")

START_TIMEOUT_S = 30.0
"""How long a server may take to start and answer ``initialize`` and ``tools/list``."""

PING_TIMEOUT_S = 5.0
"""How long a server whose last call timed out may take to answer a ping before the next
call restarts it."""

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
"""Waits before trying again to start a server that failed to start, by failure count."""

REFRESH_WAIT_S = 5.0
"""How long a turn boundary waits for a changed tool list being fetched."""

CLOSE_GRACE_S = 10.0
"""Bound on closing every connection (a stdio transport's shutdown takes at most ~6.5 s)."""


class McpServerError(ToolFailure):
    """A call that did not get a result from its server: the server could not be started,
    exited, did not answer in time, or answered with a protocol error. Its message is the
    error output the model sees."""


class McpToolError(ToolFailure):
    """The server ran the tool and reported failure (``isError``); the message is what the
    server said."""


@attrs.frozen(kw_only=True, slots=True)
class McpToolInfo:
    """One tool as the server lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool | None


# -- configuration files --------------------------------------------------------------------


_Listing = tuple[tuple[McpToolInfo, ...], tuple[McpResourceInfo, ...], tuple[McpPromptInfo, ...]]
"""What a server offers: its tools, resources and prompts."""

_LIST_CHANGED = (
    mcp_types.ToolListChangedNotification,
    mcp_types.ResourceListChangedNotification,
    mcp_types.PromptListChangedNotification,
)
"""The notifications after which a server's listing is fetched again."""

# -- the live tool table ------------------------------------------------------------------


class LiveToolTable(dict[str, Tool]):
    """A session's own tool table (never shared with another session), whose content is
    replaced in place at turn boundaries: the pool holds it for a whole task and looks
    tools up in it call by call."""

    def replace(self, tools: Mapping[str, Tool]) -> None:
        """Make the table hold exactly ``tools``, in place (holders of the table see the change)."""
        self.clear()
        self.update(tools)


# -- one server -------------------------------------------------------------------------------


class _Call:
    """One tool call in flight on a connection: its cancel scope, its timeout, the
    context of the greenroom call that made it (None for a call made outside a task's tool
    pool), and the elicitations it waits on (each wait's cancel scope)."""

    __slots__ = ("_left", "ctx", "questions", "scope", "timeout")

    def __init__(self, ctx: ToolContext | None) -> None:
        self.ctx = ctx
        self.scope = trio.CancelScope()
        self.timeout: trio.CancelScope | None = None
        self.questions: set[trio.CancelScope] = set()
        self._left = 0.0

    def pause_timeout(self) -> None:
        """A question begins: the time people take does not count against the server
        (the call's timeout stops while any question of it waits)."""
        timeout = self.timeout
        if timeout is not None and not self.questions:
            self._left = timeout.deadline - trio.current_time()
            timeout.deadline = math.inf

    def resume_timeout(self) -> None:
        """The last question has ended: the call's timeout counts on from where it was."""
        timeout = self.timeout
        if timeout is not None and not self.questions:
            timeout.deadline = trio.current_time() + self._left


class _Live:
    """One run of a connection: from starting the server to its end."""

    __slots__ = ("auth", "calls", "ended", "error", "lost", "ready", "session", "stop")

    def __init__(self) -> None:
        self.ready = trio.Event()  # set when started, or when starting failed
        self.stop = trio.Event()  # set to end this run
        self.ended = trio.Event()
        self.session: ClientSession | None = None
        self.error: str | None = None  # why starting failed
        self.lost: str | None = None  # why a started run ended
        self.auth: StoredTokenAuth | None = None  # an HTTP server's OAuth (R-MCP-5)
        self.calls: set[_Call] = set()

    def fail(self, failure: Exception) -> None:
        """Say why the transport is ending the run, before its calls see it closed."""
        self.lost = self.lost or f"the connection failed: {_describe(failure)}"


class McpConnection:
    """One configured MCP server, shared by the sessions that use it."""

    def __init__(self, config: McpServerConfig, nursery: trio.Nursery, log_dir: Path) -> None:
        self.config = config
        self._nursery = nursery
        self._log_dir = log_dir
        self._live: _Live | None = None
        self._failures = 0
        self._retry_at = -math.inf
        self._last_error = ""
        self._suspect = False
        self._closed = False
        self.tools: tuple[McpToolInfo, ...] | None = None
        """The last listing; None until the server first started."""
        self.version = 0
        """Bumped whenever :attr:`tools` changes."""
        self._tool_objects: tuple[int, tuple[Tool, ...]] | None = None
        self.listeners: set[Callable[[], None]] = set()
        """Called (synchronously) after :attr:`tools` changed."""
        self.warnings: list[str] = []
        self.refreshing: trio.Event | None = None
        """Set while a changed tool list is being fetched; a turn boundary waits for it
        (bounded), so a change the server announced during a turn is in the next one."""
        self.roots = WorkspaceRoots(self._roots_changed)
        """The workspaces of the sessions using the connection: the server's roots."""
        self.resources: tuple[McpResourceInfo, ...] = ()
        """The server's resources at the last listing (none unless it declares them)."""
        self.prompts: tuple[McpPromptInfo, ...] = ()
        """The server's prompts at the last listing (none unless it declares them)."""

    def start_soon(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in the server manager's nursery (work that outlives a call)."""
        self._nursery.start_soon(fn)

    @property
    def name(self) -> str:
        """The server's name in the configuration."""
        return self.config.name

    @property
    def log_path(self) -> Path:
        """Where a stdio server's stderr goes."""
        return self._log_dir / f"{self.name}.stderr.log"

    # -- roots, resources, prompts (R-MCP-5) ----------------------------------------------

    def _roots_changed(self) -> None:
        live = self._live
        if live is not None and live.session is not None:
            self._nursery.start_soon(_send_roots_changed, live.session)

    async def read_resource(self, uri: str) -> str:
        """The text of resource ``uri`` (``resources/read``), within the call timeout.
        Raises :class:`McpServerError` saying why it could not be read."""
        result = await self._request(f"reading {uri}", lambda s: s.read_resource(uri))
        return resource_text(self.name, result)

    async def get_prompt(self, prompt: str, arguments: dict[str, str]) -> str:
        """Prompt ``prompt`` with ``arguments`` expanded into its messages' text
        (``prompts/get``). Raises :class:`McpServerError` saying why not."""
        result = await self._request(
            f"prompt {prompt}", lambda s: s.get_prompt(prompt, arguments)
        )
        return prompt_messages(result)

    async def _request(self, what: str, send: Callable[[ClientSession], Awaitable[_T]]) -> _T:
        """``send`` within the call timeout, failing as :meth:`call` does: a server that
        exits meanwhile stopped (it did not refuse); one that does not answer in time is
        pinged before its next use."""
        live, session = await self._session()
        timeout = self.config.timeout_s
        try:
            with trio.move_on_after(timeout):
                return await send(session)
            self._suspect = True
            raise McpServerError(
                f"MCP server {self.name!r} did not answer {what} within {timeout:g} s"
            )
        except MCPError as exc:
            raise _refusal(self.name, live, what, exc) from None

    # -- starting -----------------------------------------------------------------------

    async def list_tools(self) -> tuple[McpToolInfo, ...]:
        """The server's tools, starting it if needed. Raises :class:`McpServerError`."""
        await self._session()
        return self.tools or ()

    async def _session(self) -> tuple[_Live, ClientSession]:
        while True:
            if self._closed:
                raise McpServerError(f"MCP server {self.name!r} is closed (the host is closing)")
            live = self._live
            if live is None:
                now = trio.current_time()
                if now < self._retry_at:
                    raise McpServerError(
                        f"MCP server {self.name!r} could not be started: {self._last_error}; "
                        f"next try in {self._retry_at - now:.1f} s"
                    )
                live = self._live = _Live()
                self._nursery.start_soon(self._serve, live, name=f"mcp server {self.name}")
            await live.ready.wait()
            if live.error is not None:
                raise McpServerError(
                    f"MCP server {self.name!r} could not be started: {live.error}"
                )
            if live.stop.is_set() or live.session is None:
                await live.ended.wait()
                continue  # it exited or is being stopped: start it again
            if self._suspect and not await self._answers_ping(live.session):
                live.lost = "it stopped answering"
                live.stop.set()
                await live.ended.wait()
                continue
            return live, live.session

    async def _answers_ping(self, session: ClientSession) -> bool:
        with trio.move_on_after(PING_TIMEOUT_S):
            try:
                await session.send_ping()
            except MCPError:
                return False
            self._suspect = False
            return True
        return False

    async def _serve(self, live: _Live) -> None:
        """Hold the connection open until ``live.stop``. Never raises: every failure is
        kept on ``live`` (a task of the manager's nursery must not take the host down)."""
        error: str | None = None
        # Bounds connecting too (a legacy SSE stream may never name its endpoint). A scope,
        # not fail_after: its cancellation comes back out of the SDK's task groups wrapped
        # in exception groups, which only the scope takes apart. Lifted once ready.
        starting = trio.CancelScope(deadline=trio.current_time() + START_TIMEOUT_S)
        try:
            with starting:
                async with contextlib.AsyncExitStack() as stack:
                    read, write = await stack.enter_async_context(self._transport(stack, live))
                    send, receive = anyio.create_memory_object_stream[Any](0)
                    nursery = await stack.enter_async_context(trio.open_nursery())
                    nursery.start_soon(self._forward, read, send, live)
                    session = await stack.enter_async_context(
                        ClientSession(
                            receive,
                            write,
                            message_handler=self._on_message,
                            elicitation_callback=self._on_elicit,
                            list_roots_callback=self.roots.answer,
                            client_info=_client_info(),
                        )
                    )
                    await session.initialize()
                    listing = await self._fetch_listing(session)
                    starting.deadline = math.inf
                    live.session = session
                    self._set_listing(listing)
                    self._failures = 0
                    self._suspect = False
                    live.ready.set()
                    await live.stop.wait()
                    nursery.cancel_scope.cancel()
        except trio.Cancelled:
            error = "the host is closing"
            raise
        except (Exception, BaseExceptionGroup) as exc:  # the SDK's task groups, OSError, …
            if isinstance(exc, BaseExceptionGroup) and exc.subgroup(
                (KeyboardInterrupt, SystemExit)
            ):
                raise
            error = _describe(exc)
        finally:
            if starting.cancelled_caught and not live.ready.is_set():
                error = _start_timeout_message()
            live.ended.set()
            if self._live is live:
                self._live = None
            if not live.ready.is_set():
                live.error = self._failed(error or "it exited while starting")
                live.ready.set()
            elif live.lost is None:
                live.lost = "it exited" if error is None else f"the connection failed: {error}"
            for call in live.calls:
                call.scope.cancel()

    def _failed(self, error: str) -> str:
        if self.config.transport == "stdio" and not self._closed:
            error += f" (its stderr is in {self.log_path})"
        self._failures += 1
        self._last_error = error
        delay = BACKOFF_S[min(self._failures, len(BACKOFF_S)) - 1]
        self._retry_at = trio.current_time() + delay
        log.warning("MCP server %r could not be started: %s", self.name, error)
        return error

    @contextlib.asynccontextmanager
    async def _transport(self, stack: contextlib.AsyncExitStack, live: _Live) -> Any:
        config = self.config
        if config.transport == "stdio":
            assert config.command is not None
            await trio.Path(self._log_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            errlog = await trio.to_thread.run_sync(
                lambda: self.log_path.open("a", encoding="utf-8")
            )
            stack.callback(errlog.close)
            env = dict(config.env)
            if config.env_file is not None:
                env = {**await _env_file(config), **env}  # env wins
            params = StdioServerParameters(
                command=config.command,
                args=list(config.args),
                env=env or None,
                cwd=config.cwd,
            )
            async with bounded_stdio_client(params, errlog=errlog) as streams:
                yield streams
            return
        assert config.url is not None
        # OAuth (R-MCP-5): the stored token of the server's URL, refreshed as needed; a
        # server that asks for one when none is usable fails to start with McpLoginNeeded.
        auth = live.auth = auth_for(
            config.name, config.url, config.headers, self._log_dir / STORE_NAME
        )
        if config.transport == "sse":
            # The legacy HTTP+SSE transport (R-MCP-6): a server that has not moved to
            # streamable HTTP. An idle stream the SDK drops after its read timeout ends
            # this run, as does a failed POST of a message; the next use connects again.
            async with bounded_sse_client(
                config.url, headers=dict(config.headers) or None, auth=auth, failed=live.fail
            ) as streams:
                yield streams
            return
        client = bounded_http_client(headers=dict(config.headers) or None, auth=auth)
        async with client, streamable_http_client(config.url, http_client=client) as streams:
            yield streams

    async def _forward(self, read: Any, send: Any, live: _Live) -> None:
        """Pass the transport's messages to the client session; when the transport's
        stream ends (the server process exited), end this run so that waiting calls fail
        now and the next use starts the server again."""
        async with send:
            try:
                async for message in read:
                    await send.send(message)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
        if live.lost is None:
            live.lost = "it exited"
        live.stop.set()

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, _LIST_CHANGED):
            live = self._live
            if live is not None and live.session is not None:
                # One fetch at a time, one more for a change during it (not one per notice).
                self._refresh_again = self.refreshing is not None
                if self.refreshing is None:
                    self.refreshing = trio.Event()
                    self._nursery.start_soon(self._refresh, live, live.session)
        await trio.lowlevel.checkpoint()

    async def _on_elicit(
        self, context: ClientRequestContext, params: mcp_types.ElicitRequestParams
    ) -> mcp_types.ElicitResult:
        """An ``elicitation/create`` from the server: put to the people of the one call
        in flight (see the module docstring), else declined. Runs in the SDK's task for
        the request; the wait ends with the call."""
        asker = self._asker(params)
        if isinstance(asker, str):
            log.info("MCP server %r: an elicitation was declined: %s", self.name, asker)
            return mcp_types.ElicitResult(action="decline")
        call, ask = asker
        assert isinstance(params, mcp_types.ElicitRequestFormParams)
        schema = params.requested_schema
        arguments = {"question": params.message, "requested_schema": schema,
                     "server": self.name}
        answer = None
        with trio.CancelScope() as waiting:
            call.pause_timeout()
            call.questions.add(waiting)
            try:
                answer = await ask(arguments)
            finally:
                call.questions.discard(waiting)
                call.resume_timeout()
        return _elicit_result(schema, answer)

    def _asker(
        self, params: mcp_types.ElicitRequestParams
    ) -> tuple[_Call, Callable[[dict[str, Any]], Awaitable[QuestionAnswered]]] | str:
        """The call whose people an elicitation is put to and their ``ask``, or why
        there is none."""
        if not isinstance(params, mcp_types.ElicitRequestFormParams):
            return "it asks for a URL to be opened (URL mode)"
        live = self._live
        calls = list(live.calls) if live is not None else []
        if len(calls) != 1:
            return f"{len(calls)} calls are in flight on its connection, not one"
        (call,) = calls
        if call.ctx is None or call.ctx.ask is None:
            return "nobody answers the questions of the call's task"
        return call, call.ctx.ask

    async def _refresh(self, live: _Live, session: ClientSession) -> None:
        """Fetch the changed tool list (``notifications/tools/list_changed``); sessions
        pick it up at their next turn boundary."""
        try:
            self._refresh_again = True
            while self._refresh_again:
                self._refresh_again = False
                with trio.fail_after(START_TIMEOUT_S):
                    listing = await self._fetch_listing(session)
                if self._live is live:
                    self._set_listing(listing)
        except BaseException as exc:
            if isinstance(exc, trio.Cancelled):
                raise
            log.warning("MCP server %r: relisting its tools failed: %s", self.name, _describe(exc))
        finally:
            refreshing, self.refreshing = self.refreshing, None
            if refreshing is not None:
                refreshing.set()

    async def _fetch_listing(self, session: ClientSession) -> _Listing:
        """Tools, and resources and prompts when the server declares those capabilities."""
        capabilities = session.server_capabilities
        tools = await _fetch_tools(session)
        resources = (await fetch_resources(session)
                     if capabilities is not None and capabilities.resources else ())
        prompts = (await fetch_prompts(session)
                   if capabilities is not None and capabilities.prompts else ())
        return tools, resources, prompts

    def _set_listing(self, listing: _Listing) -> None:
        tools, resources, prompts = listing
        if (tools, resources, prompts) == (self.tools, self.resources, self.prompts):
            return
        self.tools, self.resources, self.prompts = tools, resources, prompts
        self.version += 1
        for listener in tuple(self.listeners):
            with contextlib.suppress(Exception):
                listener()

    def kick(self) -> None:
        """Start a server that has never started (its first start failed) in the
        background, once its backoff has passed; its tools then reach the sessions that
        configured it at their next turn boundary."""
        if (
            self.tools is None
            and self._live is None
            and not self._closed
            and trio.current_time() >= self._retry_at
        ):
            self._nursery.start_soon(_list_quietly, self)

    # -- tools --------------------------------------------------------------------------

    def tool_objects(self) -> tuple[Tool, ...]:
        """The current tools as greenroom tools (built once per listing, shared)."""
        cached = self._tool_objects
        if cached is not None and cached[0] == self.version:
            return cached[1]
        built: list[Tool] = []
        warnings: list[str] = []
        for info in _offered(self.config, self.tools or ()):
            problem = tool_name_problem(self.name, info.name) or schema_problem(
                info.input_schema
            )
            if problem is not None:
                warnings.append(f"MCP server {self.name!r}: tool {info.name!r} skipped: {problem}")
                continue
            built.append(self._tool(info))
        warnings.extend(_unknown_disabled(self.name, self.config, self.tools or ()))
        taken = {info.name for info in self.tools or ()} | self.config.disabled_tools
        if self.resources and READ_RESOURCE not in taken:  # the server's own, or disabled
            built.append(read_resource_tool(self.name, self.resources, self.read_resource))
        for warning in warnings:
            log.warning("%s", warning)
        self.warnings = warnings
        self._tool_objects = (self.version, tuple(built))
        return self._tool_objects[1]

    def _tool(self, info: McpToolInfo) -> Tool:
        parallel = self.config.is_parallel(info.name, info.read_only)
        connection = self

        # Every argument is the model's, ``ctx`` as much as any (declared by the schema or
        # not): the pool's context comes apart, never in an argument's place.
        async def call(**arguments: Any) -> Any:
            return await connection.call(info.name, arguments, current_tool_context())

        return Tool(
            name=tool_name(self.name, info.name),
            description=info.description,
            input_schema=info.input_schema,
            parallel=parallel,
            side_effects=not parallel,
            function=call,
        )

    async def call(
        self, tool: str, arguments: dict[str, Any], ctx: ToolContext | None
    ) -> tuple[ToolContent, ...]:
        """Call ``tool`` and map its result (R-MCP-3). Cancelling the caller cancels the
        request, which the SDK reports to the server (``notifications/cancelled``).
        Raises :class:`McpServerError` or :class:`McpToolError`."""
        live, session = await self._session()
        progress = None if ctx is None else _progress_reporter(ctx)
        entry = _Call(ctx)
        live.calls.add(entry)
        timeout = self.config.timeout_s
        try:
            with entry.scope:
                with trio.move_on_after(timeout) as entry.timeout:
                    result = await _call_tool(
                        self.name, session, tool, arguments, progress, _meta(ctx)
                    )
                    return await _result_content(result, ctx)
                self._suspect = True
                raise McpServerError(
                    f"MCP server {self.name!r} did not answer {tool} within {timeout:g} s "
                    "(the call was cancelled)"
                )
            raise McpServerError(_lost_message(self.name, live, tool))
        except MCPError as exc:
            raise _refusal(self.name, live, tool, exc) from None
        finally:
            live.calls.discard(entry)
            for question in entry.questions:
                question.cancel()  # the call is over: so is what it asked

    async def aclose(self) -> None:
        """End the connection (stop the server process) and wait for it."""
        self._closed = True
        live = self._live
        if live is not None:
            live.lost = "the host is closing"
            live.stop.set()
            await live.ended.wait()


def _offered(config: McpServerConfig, tools: tuple[McpToolInfo, ...]) -> list[McpToolInfo]:
    """The listed ``tools`` the configuration does not disable (``disabledTools``): a
    disabled tool is never offered to the model, so a call of it is an unknown tool's."""
    return [info for info in tools if info.name not in config.disabled_tools]


def _unknown_disabled(
    server: str, config: McpServerConfig, tools: tuple[McpToolInfo, ...]
) -> list[str]:
    """A warning for each ``disabledTools`` name the server does not list (a typo disables
    nothing, and would pass unseen); greenroom's own ``read_resource`` counts as listed."""
    listed = {info.name for info in tools} | {READ_RESOURCE}
    return [
        f"MCP server {server!r}: disabledTools names {name!r}, which the server does not "
        "list: it disables nothing"
        for name in sorted(config.disabled_tools - listed)
    ]


async def _fetch_tools(session: ClientSession) -> tuple[McpToolInfo, ...]:
    """Every tool the server lists (``tools/list``, all pages)."""
    tools: list[McpToolInfo] = []
    cursor: str | None = None
    for _ in range(1000):  # a server that pages forever is not followed forever
        params = None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)
        result = await session.list_tools(params=params)
        for item in result.tools:
            read_only = item.annotations.read_only_hint if item.annotations else None
            tools.append(
                McpToolInfo(
                    name=item.name,
                    description=item.description or item.title or item.name,
                    input_schema=item.input_schema,
                    read_only=read_only,
                )
            )
        cursor = result.next_cursor
        if not cursor:
            break
    return tuple(tools)


def _elicit_result(
    schema: dict[str, Any], answer: QuestionAnswered | None
) -> mcp_types.ElicitResult:
    """What the server's elicitation gets for a person's ``answer`` (None: nobody answered
    before the call ended): the content of the requested ``schema`` it gives, or why not."""
    if answer is None or answer.action == "cancel":
        return mcp_types.ElicitResult(action="cancel")
    if answer.action == "decline" or answer.text is None:
        return mcp_types.ElicitResult(action="decline")
    content = form_content(schema, answer.text)
    if isinstance(content, str):  # checked when the answer was taken; never here
        return mcp_types.ElicitResult(action="decline")
    return mcp_types.ElicitResult(action="accept", content=content)


def _lost_message(server: str, live: _Live, what: str) -> str:
    """What a request ``what`` gets when its server's run ended under it."""
    return (
        f"MCP server {server!r} stopped during {what}: {live.lost or 'it exited'}; "
        "it is started again on its next use"
    )


def _refusal(server: str, live: _Live, what: str, exc: MCPError) -> McpServerError:
    """The error for an ``MCPError`` answering ``what``: the server's refusal, or, when
    the connection closed under the request, that the server stopped (the run is ended
    so that the next use starts it again)."""
    if exc.code == mcp_types.CONNECTION_CLOSED or live.ended.is_set():
        # A token refused mid-session closes the transport: say that, not the close.
        problem = live.auth.problem if live.auth is not None else None
        live.lost = live.lost or problem or "it closed the connection"
        live.stop.set()
        return McpServerError(_lost_message(server, live, what))
    return McpServerError(
        f"MCP server {server!r} refused {what}: {exc.message} (code {exc.code})"
    )


async def _call_tool(
    server: str,
    session: ClientSession,
    tool: str,
    arguments: dict[str, Any],
    progress: Any,
    meta: mcp_types.RequestParamsMeta | None,
) -> mcp_types.CallToolResult:
    """``tools/call`` on ``session``. The SDK checks the result against the tool's output
    schema and raises a bare RuntimeError for one that breaks it (or for a result of a kind
    it does not hand back): that is the server's answer, an :class:`McpServerError`."""
    try:
        result = await session.call_tool(
            tool, arguments, progress_callback=progress, meta=meta
        )
    except RuntimeError as exc:
        raise McpServerError(
            f"MCP server {server!r} gave {tool} an invalid result: {_invalid_result(exc)}"
        ) from None
    return result


async def _env_file(config: McpServerConfig) -> dict[str, str]:
    """The variables of a stdio server's ``envFile`` (R-MCP-6), read at each start as VS
    Code reads it. One that cannot be read, or is not simple ``KEY=VALUE`` lines, is
    noted (logger ``greenroom.mcp``) and the server starts without it, as the entry
    would load without the key; a problem already reported with the configuration's
    (``env_file_noted``) is not noted again."""
    assert config.env_file is not None
    try:
        return await trio.to_thread.run_sync(read_env_file, config.env_file)
    except EnvFileProblem as problem:
        level = logging.DEBUG if problem.why == config.env_file_noted else logging.WARNING
        log.log(level, "MCP server %r: %s; it starts without it", config.name, problem)
        return {}


def _invalid_result(exc: RuntimeError) -> str:
    """Why the SDK refused a tool's result, in one line: for structured content that breaks
    the output schema, the schema check's own sentence (its full text runs over lines,
    quoting the schema and the instance)."""
    cause = exc.__cause__
    reason = getattr(cause, "message", None)
    if isinstance(reason, str) and reason:
        return "its structured content does not match its output schema: " + " ".join(
            reason.split()
        )
    return " ".join(str(exc).split()) or "the client could not read it"


def _start_timeout_message() -> str:
    """Why a start failed that ran out of ``START_TIMEOUT_S`` (read when it fails, so that
    a test's lower bound is the one named)."""
    return f"it did not answer initialize and tools/list within {START_TIMEOUT_S:g} s"


def _describe(exc: BaseException) -> str:
    """One line for an exception, looking inside exception groups for the first cause.
    The line reaches the model and the user, so it says what happened in words; a class
    name stands only for an exception that carries no message at all."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (leaves or list(exc.exceptions))[0]
    if isinstance(exc, trio.TooSlowError):  # a bound of greenroom's own, never a class name
        return "it did not answer in time"
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"command not found: {exc.filename}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


async def _send_roots_changed(session: ClientSession) -> None:
    # A server that has gone meanwhile asks for the roots again when it restarts.
    with contextlib.suppress(MCPError, anyio.ClosedResourceError, anyio.BrokenResourceError):
        await session.send_roots_list_changed()


# The SDK warns that roots are deprecated (SEP-2577) each time they change; servers still
# ask for them, and the warning would only reach the person at a terminal. A filter set
# once (not catch_warnings around an await: other tasks run meanwhile).
warnings.filterwarnings("ignore", message=r".*roots capability is deprecated")


def _client_info() -> mcp_types.Implementation:
    """Who the client is, in ``initialize``: greenroom and its installed version."""
    import greenroom

    return mcp_types.Implementation(name="greenroom", version=greenroom.__version__)


def _meta(ctx: ToolContext | None) -> mcp_types.RequestParamsMeta | None:
    """The ``_meta`` of a ``tools/call`` request: the call's idempotency key
    (R-EFFECT-1), so a server that makes an effect can make it once however often the
    call is sent; None for a call made outside a task's tool pool. (The
    SDK's type names only the keys the protocol defines; it sends the others as given.)"""
    if ctx is None:
        return None
    meta: dict[str, Any] = {MCP_META_KEY: ctx.idempotency_key}
    return cast(mcp_types.RequestParamsMeta, meta)


def _progress_reporter(ctx: ToolContext) -> Any:
    async def progress(value: float, total: float | None, message: str | None) -> None:
        amount = f"{value:g}/{total:g}" if total else f"{value:g}"
        ctx.report_progress(f"{message} ({amount})" if message else amount)

    return progress


async def _result_content(
    result: mcp_types.CallToolResult, ctx: ToolContext | None
) -> tuple[ToolContent, ...]:
    """A ``CallToolResult`` as content blocks (R-MCP-3): text as text; images saved to the
    scratchpad as image blocks; audio and binary resources saved there and named in a
    text; text resources as their text; ``structuredContent`` as JSON text (unless a text
    block already holds exactly that JSON). ``isError`` raises :class:`McpToolError`."""
    blocks: list[ToolContent] = []
    texts: list[str] = []
    for index, item in enumerate(result.content):
        if isinstance(item, mcp_types.TextContent):
            blocks.append(TextBlock(text=item.text))
            texts.append(item.text)
        elif isinstance(item, mcp_types.ImageContent):
            path = await _save(ctx, index, item.data, item.mime_type)
            blocks.append(
                ImageBlock(path=str(path), media_type=item.mime_type)
                if isinstance(path, Path)
                else TextBlock(text=f"[image {item.mime_type}: {path}]")
            )
        elif isinstance(item, mcp_types.AudioContent):
            path = await _save(ctx, index, item.data, item.mime_type)
            blocks.append(TextBlock(text=f"[audio {item.mime_type}: {path}]"))
        elif isinstance(item, mcp_types.EmbeddedResource):
            resource = item.resource
            if isinstance(resource, mcp_types.TextResourceContents):
                blocks.append(TextBlock(text=f"[resource {resource.uri}]\n{resource.text}"))
                continue
            mime = resource.mime_type or "application/octet-stream"
            path = await _save(ctx, index, resource.blob, mime)
            if isinstance(path, Path) and mime.startswith("image/"):
                blocks.append(ImageBlock(path=str(path), media_type=mime))
            else:
                blocks.append(TextBlock(text=f"[resource {resource.uri} ({mime}): {path}]"))
        elif isinstance(item, mcp_types.ResourceLink):
            detail = ", ".join(x for x in (item.name, item.mime_type) if x)
            blocks.append(TextBlock(text=f"[resource link {item.uri}" +
                                    (f" ({detail})]" if detail else "]")))
    structured = result.structured_content
    if structured is not None and not _restates(structured, texts):
        structured_text = json.dumps(structured, ensure_ascii=False)
        blocks.append(TextBlock(text=structured_text))
        texts.append(structured_text)
    if result.is_error:
        raise McpToolError("\n".join(texts) or "the tool reported an error")
    return tuple(blocks) or (TextBlock(text=""),)


def _restates(structured: dict[str, Any], texts: list[str]) -> bool:
    """Whether the structured content only repeats the text: a text block holds the same
    JSON (as the specification asks servers to send), or it wraps the text's value under
    one key (``{"result": …}``, as SDK servers do for a plain return value)."""
    if any(_json_value(text) == structured for text in texts):
        return True
    if len(structured) != 1 or not texts:
        return False
    (value,) = structured.values()
    joined = "\n".join(texts)
    if value == joined or _json_value(joined) == value:
        return True
    return isinstance(value, list) and [_json_value(t, t) for t in texts] == value


_NO_JSON = object()


def _json_value(text: str, default: Any = _NO_JSON) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


async def _save(ctx: ToolContext | None, index: int, data: str, mime: str) -> Path | str:
    """Write base64 ``data`` to the scratchpad; the path, or why it was not written."""
    if ctx is None:
        return "not saved (no scratchpad for this tool)"
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        return "not saved (its data is not valid base64)"
    extension = mimetypes.guess_extension(mime.split(";")[0].strip()) or ".bin"
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ctx.call_id)[:80]
    path = ctx.scratchpad_dir / f"mcp-{safe or 'call'}-{index}{extension}"

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)

    try:
        await trio.to_thread.run_sync(write)
    except OSError as exc:
        return f"not saved ({exc.strerror or exc})"
    return path


# -- the manager ----------------------------------------------------------------------------


class McpManager:
    """Every MCP connection of one host; runs in the host's nursery (see the module
    docstring). Start with ``await nursery.start(manager.run)``."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._nursery: trio.Nursery | None = None
        self._shared: dict[McpServerConfig, McpConnection] = {}
        self._private: dict[str, list[McpConnection]] = {}
        self._bindings: dict[str, McpBinding] = {}
        self._started = trio.Event()
        self._closed = trio.Event()
        self._done = trio.Event()

    async def wait_started(self) -> None:
        """Wait until :meth:`run` is ready to open connections."""
        await self._started.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The SDK logs transport failures; those are reported as error outputs instead,
        # and must not reach a terminal as tracebacks (the host's logging still sees them).
        """Hold the nursery the servers run in until :meth:`aclose`; then close every connection
        (within ``CLOSE_GRACE_S``) and cancel what is left."""
        logging.getLogger("mcp").addHandler(logging.NullHandler())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._started.set()
                task_status.started()
                await self._closed.wait()
                with trio.move_on_after(CLOSE_GRACE_S):
                    async with trio.open_nursery() as closing:
                        for connection in self.connections():
                            closing.start_soon(connection.aclose)
                nursery.cancel_scope.cancel()
        finally:
            self._done.set()

    def connections(self) -> list[McpConnection]:
        """Every connection the manager holds: the host's shared ones, then sessions' own."""
        private = [c for group in self._private.values() for c in group]
        return [*self._shared.values(), *private]

    def connection(self, config: McpServerConfig, session_id: str) -> McpConnection:
        """The connection of ``config`` for a session: the host's shared one, or (scope
        ``session``) one of the session's own."""
        assert self._nursery is not None, "McpManager.run has not started"
        if config.scope == "host":
            connection = self._shared.get(config)
            if connection is None:
                connection = self._shared[config] = McpConnection(
                    config, self._nursery, self._log_dir
                )
            return connection
        connection = McpConnection(config, self._nursery, self._log_dir)
        self._private.setdefault(session_id, []).append(connection)
        return connection

    def bind(self, session_id: str, binding: McpBinding) -> None:
        """Keep ``binding`` as the session's, for :meth:`release` to detach."""
        self._bindings[session_id] = binding

    async def release(self, session_id: str) -> None:
        """Forget a closed session: stop telling it about tool changes, and close its own
        connections (``"scope": "session"``)."""
        binding = self._bindings.pop(session_id, None)
        if binding is not None:
            binding.detach()
        for connection in self._private.pop(session_id, ()):
            await connection.aclose()

    async def aclose(self) -> None:
        """Stop every server and wait until their processes are gone (bounded)."""
        self._closed.set()
        await self._done.wait()


# -- one session's binding ---------------------------------------------------------------------


class McpBinding:
    """The MCP tools of one session and when its tool table changes (R-MCP-4)."""

    def __init__(
        self, session: SessionPort, static: tuple[Tool, ...], connections: list[McpConnection]
    ) -> None:
        self._session = session
        self._static = static
        self._connections = connections
        self._versions: tuple[int, ...] = ()
        self._pending = False
        self._waiting = False
        self.table = LiveToolTable({})
        self.warnings: list[str] = []

    def build(self) -> tuple[dict[str, Tool], tuple[ToolSchema, ...]]:
        """The session's tool table and schemas now: its own tools first, then each server's in
        configuration order; an MCP tool whose name is taken is skipped with a warning
        (collected in :attr:`warnings`)."""
        tools: dict[str, Tool] = {t.name: t for t in self._static}
        warnings: list[str] = []
        for connection in self._connections:
            for item in connection.tool_objects():
                if item.name in tools:
                    warnings.append(f"{item.name}: a tool of that name is already given; skipped")
                    continue
                tools[item.name] = item
            warnings.extend(connection.warnings)
        self.warnings = warnings
        self._versions = tuple(c.version for c in self._connections)
        return tools, tuple(t.schema for t in tools.values())

    def apply(self) -> None:
        """Swap in the current tool lists. Call only at a turn boundary."""
        self._pending = False
        if self._versions == tuple(c.version for c in self._connections):
            return
        tools, schemas = self.build()
        self.table.replace(tools)
        self._session.set_tool_table(self.table, schemas)

    def changed(self) -> None:
        """A server's tool list changed: apply it now when the session is idle, else at the
        running task's next turn boundary (or its end)."""
        if not self._session.busy:
            self.apply()
            return
        self._pending = True
        if not self._waiting and self._connections:
            self._waiting = True
            self._connections[0].start_soon(self._apply_when_idle)

    async def _apply_when_idle(self) -> None:
        try:
            while self._pending:
                await self._session.wait_idle()
                await trio.lowlevel.checkpoint()
                if not self._session.busy:
                    self.apply()
        finally:
            self._waiting = False

    async def at_turn_boundary(self, _info: Any) -> None:
        """The turn-boundary check (R-MCP-4): wait (at most ``REFRESH_WAIT_S``) for tool lists
        being fetched, swap in any change, and retry servers that never started."""
        with trio.move_on_after(REFRESH_WAIT_S):
            for connection in self._connections:
                if connection.refreshing is not None:
                    await connection.refreshing.wait()
        if self._pending:
            self.apply()
        for connection in self._connections:
            connection.kick()

    def hooks(self, hooks: Hooks) -> Hooks:
        """``hooks`` with this binding's turn-boundary check in front of
        ``after_tool_results`` and ``on_stop`` (the user's hooks still run and decide)."""
        return attrs.evolve(
            hooks,
            after_tool_results=_chain(self.at_turn_boundary, hooks.after_tool_results),
            on_stop=_chain(self.at_turn_boundary, hooks.on_stop),
        )

    # -- what a person reaches (R-MCP-5): the session's ``McpView``

    def prompts(self) -> dict[str, tuple[McpPromptInfo, ...]]:
        """Every server of the session by name, with the prompts it last listed."""
        return {c.name: c.prompts for c in self._connections}

    def resources(self) -> dict[str, tuple[McpResourceInfo, ...]]:
        """Every server of the session by name, with the resources it last listed."""
        return {c.name: c.resources for c in self._connections}

    async def get_prompt(self, server: str, prompt: str, arguments: Mapping[str, str]) -> str:
        """Prompt ``prompt`` of the session's server ``server`` expanded with
        ``arguments``. Raises :class:`McpServerError` saying why not."""
        for connection in self._connections:
            if connection.name == server:
                return await connection.get_prompt(prompt, dict(arguments))
        raise McpServerError(f"no MCP server {server!r} in this session")

    def detach(self) -> None:
        """Stop listening to the servers' tool changes; the session's workspace stops
        being one of their roots."""
        for connection in self._connections:
            connection.listeners.discard(self.changed)
            connection.roots.drop(self._session.id)


def _chain(
    first: Callable[[Any], Awaitable[None]], then: Callable[[Any], Any] | None
) -> Callable[[Any], Awaitable[Any]]:
    async def hook(info: Any) -> Any:
        await first(info)
        if then is None:
            return None
        result = then(info)
        return await result if inspect.isawaitable(result) else result

    return hook


async def attach_servers(
    manager: McpManager,
    session: SessionPort,
    configs: Mapping[str, McpServerConfig],
) -> McpBinding:
    """Give ``session`` the tools of ``configs``: each server is started (once per host
    for shared servers) and its tools listed now, so the session's first request offers
    them. A server that cannot be started contributes no tools for now (a warning is
    logged); it is tried again, after its backoff, whenever one of its tools is listed
    again. Never raises for a server's failure."""
    connections = [manager.connection(config, session.id) for config in configs.values()]
    for connection in connections:
        connection.roots.add(session.id, session.workspace_dir)
    try:
        async with trio.open_nursery() as nursery:
            for connection in connections:
                nursery.start_soon(_list_quietly, connection)
    except BaseException:
        # The session will not open (its creation was cancelled: a client that went
        # away): its workspace is no root of a shared server, its own servers stop.
        for connection in connections:
            connection.roots.drop(session.id)
        with trio.CancelScope(shield=True):
            await manager.release(session.id)
        raise
    binding = McpBinding(session, tuple(session.tool_by_name.values()), connections)
    tools, schemas = binding.build()
    binding.table.replace(tools)
    session.set_tool_table(binding.table, schemas)
    session.hooks = binding.hooks(session.hooks)
    session.mcp = binding
    for connection in connections:
        connection.listeners.add(binding.changed)
    manager.bind(session.id, binding)
    return binding


async def _list_quietly(connection: McpConnection) -> None:
    try:
        await connection.list_tools()
    except McpServerError as exc:
        # A start that failed was reported as it failed (``_failed``): once is enough.
        log.debug("%s", exc)


__all__ = [
    "LiveToolTable",
    "McpBinding",
    "McpConfigError",
    "McpConnection",
    "McpManager",
    "McpServerError",
    "McpToolError",
    "as_configs",
    "attach_servers",
    "load_config_files",
]
