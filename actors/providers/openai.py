"""The OpenAI-compatible provider: ``POST /v1/chat/completions`` streamed with httpx.

Works with OpenAI and with local OpenAI-compatible servers (vLLM, llama.cpp, Ollama): the
sans-IO :class:`~greenroom.protocols.openai_codec.OpenAIStreamDecoder` accepts their
variations (``reasoning_content`` / ``reasoning``, whole tool calls in one chunk, usage in
the finish chunk, errors inside a 200 stream). Library errors are translated to
``StreamFailed`` in one place, :meth:`HTTPStreamTask.stream`, which the Responses
provider (:mod:`greenroom.actors.providers.openai_responses`) shares with its own codec.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any, Protocol

import httpx

from greenroom.actors.providers.base import (
    Deliver,
    connect_failure,
    cut_short,
    endpoint_identity,
    transport_failure,
)
from greenroom.actors.providers.media import LoadedImage, TaskImages, read_image
from greenroom.actors.providers.stalls import (
    ProgressDeadline,
    no_response_message,
    stalled_message,
)
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.openai_codec import OpenAIStreamDecoder, RequestEncoder, classify_error
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_TIMEOUT = httpx.Timeout(connect=15.0, read=180.0, write=60.0, pool=60.0)
"""``read`` bounds the silence between two chunks of a stream, and how long a stream may
send only keep-alives (R-SEC-10)."""


def image_part(image: LoadedImage) -> dict[str, Any]:
    """A read image as a chat completions ``data:`` URL part."""
    media_type, data = image
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def load_image(block: ImageBlock) -> dict[str, Any] | None:
    """An image block as a ``data:`` URL part; None when unreadable. Blocking; see
    :func:`~greenroom.actors.providers.media.read_image`."""
    image = read_image(block)
    return None if image is None else image_part(image)


class OpenAIProvider:
    """Chat completions over httpx; one client (connection pool) per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none.
    """

    name = "openai"
    endpoint = "/chat/completions"
    """The path below the ``/v1`` root that this provider posts to."""

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
        self._url = root + self.endpoint
        self._identity = endpoint_identity(self.name, root, key)
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    @property
    def endpoint_identity(self) -> str:
        """The provider's name, its ``/v1`` root and a hash of its key
        (:func:`~greenroom.actors.providers.base.endpoint_identity`)."""
        return self._identity

    def open_task(self) -> HTTPStreamTask:
        """Per-task state: the request encoder that reuses earlier turns' encodings."""
        images = TaskImages()
        return HTTPStreamTask(
            self._client,
            self._url,
            RequestEncoder(image_loader=images.loader(image_part)),
            OpenAIStreamDecoder,
            classify_error,
            images,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


class RequestBuilder(Protocol):
    """A codec's request encoder for one task."""

    def build(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of the request for ``request``."""


class StreamDecoder(Protocol):
    """A codec's sans-IO stream decoder for one attempt."""

    @property
    def finished(self) -> bool:
        """True once the terminal event has been returned (the rest of the body is not read)."""

    def feed(self, data: bytes) -> list[StreamEvent]:
        """The events completed by the next bytes of the body; none after the terminal event."""

    def end_of_stream(self) -> list[StreamEvent]:
        """The body ended: the remaining events, ending with the terminal event unless it
        was already returned (a body cut short ends with a ``StreamFailed``)."""


class ErrorClassifier(Protocol):
    """A codec's ``classify_error``: ``now`` (the wall clock) turns an HTTP-date
    ``retry-after`` into a wait."""

    def __call__(
        self, status: int, body: bytes, headers: Mapping[str, str], *, now: float | None = None
    ) -> ModelError: ...


class HTTPStreamTask:
    """Streams one attempt over httpx through a sans-IO codec; every library error becomes
    a ``StreamFailed`` here."""

    __slots__ = (
        "_classify", "_client", "_decoder", "_encoder", "_images", "_read_timeout", "_url"
    )

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        encoder: RequestBuilder,
        decoder: Callable[[], StreamDecoder],
        classify: ErrorClassifier,
        images: TaskImages | None = None,
    ) -> None:
        self._client = client
        self._url = url
        self._encoder = encoder
        self._decoder = decoder
        self._classify = classify
        self._images = images
        self._read_timeout: float | None = client.timeout.read

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """POST the encoded ``request`` and deliver the decoded events, one batch per read.
        An HTTP error status is classified by the codec, a connection failure or timeout
        becomes a ``StreamFailed``, a body that sends only keep-alives for longer than the
        read timeout fails as ``timeout`` (R-SEC-10), and a body cut short ends as
        :func:`cut_short` judges what arrived: no httpx error escapes. The request's images
        are read first, off the event loop, when the encoder has a :class:`TaskImages`
        loader."""
        if self._images is not None:
            await self._images.prepare(request)
        body = self._encoder.build(request)
        decoder = self._decoder()
        timeout = self._read_timeout
        try:
            async with self._client.stream("POST", self._url, json=body) as response:
                if response.status_code >= 400:
                    content = await response.aread()
                    error = self._classify(
                        response.status_code, content, response.headers, now=time.time()
                    )
                    await deliver([StreamFailed(error=error)])
                    return
                if await _read_body(response.aiter_bytes(), decoder, deliver, timeout):
                    return
            await deliver(decoder.end_of_stream())
        except httpx.ConnectTimeout:
            await deliver([_failed(f"timed out connecting to the server ({self._url})")])
        except httpx.ReadTimeout:
            await deliver([_failed(no_response_message(timeout))])
        except httpx.TimeoutException as exc:
            await deliver([_failed(transport_failure(exc))])
        except httpx.ConnectError as exc:
            await deliver([_failed(connect_failure(self._url, exc))])
        except httpx.TransportError as exc:
            await deliver([_failed(transport_failure(exc))])


async def _read_body(
    chunks: AsyncIterable[bytes], decoder: StreamDecoder, deliver: Deliver,
    read_timeout: float | None,
) -> bool:
    """Feed the body to ``decoder`` and deliver what each read completes. True when the
    stream has ended (its terminal event, a cut or a stall delivered as such); False when
    the body ended first. Reads that decode to nothing (keep-alives) do not keep the
    stream alive past the read timeout (R-SEC-10)."""
    keepalives = False
    with ProgressDeadline(read_timeout) as deadline:
        try:
            async for chunk in chunks:
                events = decoder.feed(chunk)
                if events:
                    deadline.progress()
                    keepalives = False
                    await deliver(events)
                    if decoder.finished:
                        return True
                else:
                    keepalives = True
        except httpx.TimeoutException:
            await deliver([_failed(stalled_message(deadline.timeout, keepalives=False))])
            return True
        except httpx.TransportError as exc:
            # The body had begun: a stream cut short, judged by what arrived.
            await deliver(cut_short(decoder.end_of_stream(), exc))
            return True
        return False
    await deliver([_failed(stalled_message(deadline.timeout, keepalives=keepalives))])
    return True


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))
