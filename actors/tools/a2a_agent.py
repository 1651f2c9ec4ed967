"""A remote A2A agent as a tool (R-PROTO-1, ``--a2a-agent URL``): a session calls another
organisation's agent as it calls a subagent, and watches it work.

:func:`load_a2a_agent` (or, before the event loop runs, :func:`a2a_tools` for the CLI)
reads the agent card at the URL and gives a :class:`~greenroom.protocols.tools.Tool` named
after it (:mod:`greenroom.protocols.a2a_client` for the mapping). A call sends the model's
``message`` (``message/stream`` when the card says the agent streams, else
``message/send``) with the call's idempotency key as the A2A ``messageId`` (R-EFFECT-1: a
message sent again after a lost host is the same message), reports each status and
artifact as the call's progress, and returns the agent's answer with the ``context_id``
and ``task_id`` to go on with.

When the agent asks for input (``input-required``) and people decide the session's calls,
its question is asked to them (R-HITL-5) and their answer sent as the next message of the
task, up to :data:`MAX_ROUNDS` times in one call; otherwise the call returns the question
and the model answers it with another call. An interrupt cancels the remote task
(``tasks/cancel``, bounded). The bearer token is ``token``, or the environment variable
:data:`TOKEN_VARIABLE` for the CLI.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import trio

from greenroom.protocols.a2a_client import (
    CardError,
    RemoteAgent,
    RemoteCall,
    cancel_request,
    card_url,
    remote_agent,
    request,
    rpc_error_text,
    tool_name,
)
from greenroom.protocols.sse import SSEDecoder
from greenroom.protocols.tools import Tool, ToolContext, ToolFailure

__all__ = ["TOKEN_VARIABLE", "a2a_agent_tool", "a2a_tools", "load_a2a_agent"]

log = logging.getLogger(__name__)

TOKEN_VARIABLE = "GREENROOM_A2A_TOKEN"
"""The environment variable whose value the CLI sends as the agents' bearer token."""

CONNECT_TIMEOUT_S = 10.0
"""How long connecting to an agent (and reading its card) may take."""

CANCEL_TIMEOUT_S = 5.0
"""How long an interrupted call waits for the agent to take its ``tasks/cancel``."""

MAX_ROUNDS = 8
"""How many of the agent's questions one call answers through people before it returns."""

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""A response (a whole stream) larger than this ends the call with an error."""

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "description": "what to tell or ask the agent"},
        "context_id": {
            "type": "string",
            "description": "the context_id of an earlier answer, to go on with it",
        },
        "task_id": {
            "type": "string",
            "description": "the task_id of an earlier answer whose agent waits for input",
        },
    },
    "required": ["message"],
    "additionalProperties": False,
}


class A2aAgentError(Exception):
    """An agent whose card cannot be read or used; the message names the URL and why."""


def _headers(token: str | None, accept: str = "application/json") -> dict[str, str]:
    headers = {"Accept": accept}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _card(url: str, response: httpx.Response) -> RemoteAgent:
    if response.status_code != 200:
        raise A2aAgentError(f"{url}: the agent card answered HTTP {response.status_code}")
    try:
        return remote_agent(response.json(), url)
    except ValueError as exc:  # not JSON, or a CardError
        raise A2aAgentError(str(exc) if isinstance(exc, CardError) else
                            f"{url}: the agent card is not JSON") from None


async def load_a2a_agent(
    url: str, *, token: str | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> Tool:
    """The tool of the A2A agent at ``url`` (its base URL, or its card's URL), reading its
    card now. Raises :class:`A2aAgentError` when the card cannot be read or used."""
    where = card_url(url)
    try:
        async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S, transport=transport) as client:
            response = await client.get(where, headers=_headers(token))
    except httpx.HTTPError as exc:
        raise A2aAgentError(f"{where}: cannot read the agent card: {exc}") from None
    return a2a_agent_tool(_card(where, response), token=token, transport=transport)


def a2a_tools(
    urls: Sequence[str], *, warn: Callable[[str], None] | None = None
) -> list[Tool]:
    """The tools of the agents at ``urls``, read before the event loop runs (the CLI's
    ``--a2a-agent``), with the token of :data:`TOKEN_VARIABLE`. An agent whose card cannot
    be read or used is reported through ``warn`` (stderr by default) and left out: the
    run goes on with the others."""
    token = os.environ.get(TOKEN_VARIABLE) or None
    say = warn or (lambda line: print(line, file=sys.stderr))
    tools: list[Tool] = []
    for url in urls:
        where = card_url(url)
        try:
            with httpx.Client(timeout=CONNECT_TIMEOUT_S) as client:
                response = client.get(where, headers=_headers(token))
            tools.append(a2a_agent_tool(_card(where, response), token=token))
        except httpx.HTTPError as exc:
            say(f"greenroom: --a2a-agent {url}: cannot read the agent card: {exc} (skipped)")
        except A2aAgentError as exc:
            say(f"greenroom: --a2a-agent {url}: {exc} (skipped)")
    return tools


def a2a_agent_tool(
    agent: RemoteAgent,
    *,
    token: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Tool:
    """The tool that calls ``agent`` (see the module docstring)."""
    name = tool_name(agent)

    async def call(**arguments: Any) -> str:
        ctx: ToolContext = arguments.pop("ctx")
        remote = RemoteCall(agent, name)
        text: str = arguments["message"]
        context_id: str | None = arguments.get("context_id") or None
        task_id: str | None = arguments.get("task_id") or None
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=None)
        async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
            sender = _Sender(client, agent, token, remote, ctx)
            try:
                for round_number in range(MAX_ROUNDS):
                    await sender.send(text, f"{ctx.idempotency_key}-{round_number}",
                                      context_id, task_id)
                    if not remote.waiting or ctx.ask is None:
                        break
                    answer = await ctx.ask({"question": f"{agent.name} asks: "
                                                        f"{remote.question()}"})
                    if answer.action != "accept" or not answer.text:
                        break
                    text, context_id, task_id = answer.text, remote.context_id, remote.task_id
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await sender.cancel()
                raise
        return remote.outcome()

    return Tool(
        name=name,
        description=agent.tool_description(),
        input_schema=_SCHEMA,
        parallel=True,
        side_effects=True,  # the agent may act: the trace is durable before it is asked
        function=call,
        takes_ctx=True,
    )


class _Sender:
    """The requests of one call to the agent."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        agent: RemoteAgent,
        token: str | None,
        remote: RemoteCall,
        ctx: ToolContext,
    ) -> None:
        self._client = client
        self._agent = agent
        self._token = token
        self._remote = remote
        self._ctx = ctx
        self._ids = itertools.count(1)

    async def send(
        self, text: str, message_id: str, context_id: str | None, task_id: str | None
    ) -> None:
        """Send ``text`` and fold the whole answer in (a stream to its end)."""
        agent = self._agent
        body = request(next(self._ids), text, message_id=message_id, context_id=context_id,
                       task_id=task_id, stream=agent.streaming)
        accept = "text/event-stream" if agent.streaming else "application/json"
        try:
            async with self._client.stream(
                "POST", agent.url, json=body, headers=_headers(self._token, accept)
            ) as response:
                self._check_status(response.status_code)
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    await self._read_stream(response)
                else:
                    self._take(json.loads(await self._read_all(response)))
        except httpx.HTTPError as exc:
            raise ToolFailure(f"the agent {agent.name!r} at {agent.url} failed: {exc}") from None
        except ValueError:
            raise ToolFailure(
                f"the agent {agent.name!r} answered something that is not JSON-RPC"
            ) from None

    def _check_status(self, status: int) -> None:
        name = self._agent.name
        if status in (401, 403):
            raise ToolFailure(
                f"the agent {name!r} refused the credentials (HTTP {status}); its token is "
                f"{TOKEN_VARIABLE} for the command line"
            )
        if status >= 400:
            raise ToolFailure(f"the agent {name!r} answered HTTP {status}")

    async def _read_all(self, response: httpx.Response) -> bytes:
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > MAX_RESPONSE_BYTES:
                raise ToolFailure(f"the agent {self._agent.name!r} answered more than "
                                  f"{MAX_RESPONSE_BYTES} bytes")
        return bytes(data)

    async def _read_stream(self, response: httpx.Response) -> None:
        decoder = SSEDecoder()
        read = 0
        async for chunk in response.aiter_bytes():
            read += len(chunk)
            if read > MAX_RESPONSE_BYTES:
                raise ToolFailure(f"the agent {self._agent.name!r} streamed more than "
                                  f"{MAX_RESPONSE_BYTES} bytes")
            for event in decoder.feed(chunk):
                if event.data and self._take(json.loads(event.data)):
                    return

    def _take(self, frame: Any) -> bool:
        """Fold one JSON-RPC response in; whether it ends the answer (a final event)."""
        if not isinstance(frame, dict):
            raise ValueError("not a JSON-RPC response")
        if "error" in frame:
            raise ToolFailure(
                f"the agent {self._agent.name!r} refused: {rpc_error_text(frame['error'])}"
            )
        result = frame.get("result")
        note = self._remote.apply(result)
        if note:
            self._ctx.report_progress(note)
        return isinstance(result, dict) and result.get("final") is True

    async def cancel(self) -> None:
        """Ask the agent to cancel the task this call started, if it goes on (bounded;
        a refusal or no answer is only logged)."""
        remote = self._remote
        if remote.task_id is None or remote.over:
            return
        with trio.move_on_after(CANCEL_TIMEOUT_S):
            try:
                await self._client.post(
                    self._agent.url, json=cancel_request(next(self._ids), remote.task_id),
                    headers=_headers(self._token),
                )
                return
            except httpx.HTTPError as exc:
                log.info("a2a: cancelling %s at %s failed: %s", remote.task_id,
                         self._agent.url, exc)
                return
        log.info("a2a: %s did not answer tasks/cancel within %g s", self._agent.url,
                 CANCEL_TIMEOUT_S)
