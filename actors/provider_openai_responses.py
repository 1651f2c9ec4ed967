"""The OpenAI Responses provider: ``POST /v1/responses`` streamed with httpx.

For OpenAI's current API and the servers that speak it (vLLM, Ollama). Requests are
stateless (``store: false``); reasoning models get their encrypted reasoning items back
within a tool-use chain (see :mod:`greenroom.protocols.openai_responses_codec`). Library
errors are translated to ``StreamFailed`` in one place, :meth:`_ResponsesTask.stream`.
"""

from __future__ import annotations

import os

import httpx

from greenroom.actors.llm_streamer import Deliver
from greenroom.actors.provider_openai import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, load_image
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.openai_responses_codec import (
    RequestEncoder,
    ResponsesStreamDecoder,
    classify_error,
)
from greenroom.protocols.stream import ModelError, StreamFailed


class OpenAIResponsesProvider:
    """The Responses API over httpx; one client (connection pool) per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none.
    """

    name = "openai-responses"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        max_connections: int = 2000,
    ) -> None:
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        root = (base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self._url = root + "/responses"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def open_task(self) -> _ResponsesTask:
        """Per-task state: the request encoder that reuses earlier turns' items."""
        return _ResponsesTask(self._client, self._url)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


class _ResponsesTask:
    __slots__ = ("_client", "_encoder", "_url")

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client = client
        self._url = url
        self._encoder = RequestEncoder(image_loader=load_image)

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        body = self._encoder.build(request)
        decoder = ResponsesStreamDecoder()
        try:
            async with self._client.stream("POST", self._url, json=body) as response:
                if response.status_code >= 400:
                    content = await response.aread()
                    error = classify_error(response.status_code, content, response.headers)
                    await deliver([StreamFailed(error=error)])
                    return
                async for chunk in response.aiter_bytes():
                    events = decoder.feed(chunk)
                    if events:
                        await deliver(events)
                    if decoder.finished:
                        return
            await deliver(decoder.end_of_stream())
        except httpx.TimeoutException:
            await deliver([_failed("request timed out or stream stalled")])
        except httpx.ConnectError as exc:
            await deliver([_failed(f"cannot connect to {self._url} ({_reason(exc)})")])
        except httpx.TransportError as exc:
            await deliver([_failed(f"connection failed or dropped: {_reason(exc)}")])


def _reason(exc: Exception) -> str:
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    return str(exc) or type(exc).__name__


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))
