"""The OpenAI-compatible provider: ``POST /v1/chat/completions`` streamed with httpx.

Works with OpenAI and with local OpenAI-compatible servers (vLLM, llama.cpp, Ollama): the
sans-IO :class:`~greenroom.protocols.openai_codec.OpenAIStreamDecoder` accepts their
variations (``reasoning_content`` / ``reasoning``, whole tool calls in one chunk, usage in
the finish chunk, errors inside a 200 stream). Library errors are translated to
``StreamFailed`` in one place, :meth:`_OpenAITask.stream`.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from greenroom.actors.llm_streamer import Deliver, connect_failure, cut_short
from greenroom.actors.media import read_image
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.openai_codec import OpenAIStreamDecoder, RequestEncoder, classify_error
from greenroom.protocols.stream import ModelError, StreamFailed

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_TIMEOUT = httpx.Timeout(connect=15.0, read=180.0, write=60.0, pool=60.0)


def load_image(block: ImageBlock) -> dict[str, Any] | None:
    """An image block as a ``data:`` URL part; None when unreadable."""
    image = read_image(block)
    if image is None:
        return None
    media_type, data = image
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


class OpenAIProvider:
    """Chat completions over httpx; one client (connection pool) per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none.
    """

    name = "openai"

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
        self._url = root + "/chat/completions"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def open_task(self) -> _OpenAITask:
        return _OpenAITask(self._client, self._url)

    async def aclose(self) -> None:
        await self._client.aclose()


class _OpenAITask:
    __slots__ = ("_client", "_encoder", "_url")

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client = client
        self._url = url
        self._encoder = RequestEncoder(image_loader=load_image)

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        body = self._encoder.build(request)
        decoder = OpenAIStreamDecoder()
        try:
            async with self._client.stream("POST", self._url, json=body) as response:
                if response.status_code >= 400:
                    content = await response.aread()
                    error = classify_error(response.status_code, content, response.headers)
                    await deliver([StreamFailed(error=error)])
                    return
                try:
                    async for chunk in response.aiter_bytes():
                        events = decoder.feed(chunk)
                        if events:
                            await deliver(events)
                        if decoder.finished:
                            return
                except httpx.TimeoutException:
                    raise
                except httpx.TransportError as exc:
                    # The body had begun: a stream cut short, judged by what arrived.
                    await deliver(cut_short(decoder.end_of_stream(), exc))
                    return
            await deliver(decoder.end_of_stream())
        except httpx.ConnectTimeout:
            await deliver([_failed(f"cannot connect to {self._url} (timed out)")])
        except httpx.TimeoutException:
            await deliver([_failed("request timed out or stream stalled")])
        except httpx.ConnectError as exc:
            await deliver([_failed(connect_failure(self._url, exc))])
        except httpx.TransportError as exc:
            await deliver([_failed(f"connection failed or dropped: {exc or type(exc).__name__}")])


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))
