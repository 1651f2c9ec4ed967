"""The OpenAI-compatible provider: ``POST /v1/chat/completions``, streamed.

Works with OpenAI and with local OpenAI-compatible servers (vLLM, llama.cpp, Ollama): the
sans-IO :class:`~greenroom.protocols.openai_codec.OpenAIStreamDecoder` accepts their
variations (``reasoning_content`` / ``reasoning``, whole tool calls in one chunk, usage in
the finish chunk, errors inside a 200 stream).

By default the request goes through greenroom's own HTTP client
(:class:`~greenroom.actors.providers.lean_wire.LeanEndpoint`: HTTP/1.1 on trio, the body
handed to the codec once per network read); with ``lean_http=False``
(``GREENROOM_LEAN_HTTP=0``, ``--no-lean-http``), or when the environment proxies the base
URL, through httpx (:mod:`~greenroom.actors.providers.openai_httpx`, imported only then).
Both paths report every failure as the same ``StreamFailed``. The Responses provider
(:mod:`greenroom.actors.providers.openai_responses`) is this one with its own endpoint and
codec.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from greenroom.actors.providers.base import (
    Deliver,
    ProviderTask,
    endpoint_identity,
    transport_failure,
)
from greenroom.actors.providers.lean_http import (
    TimeoutException,
    Timeouts,
    TimeoutSettings,
    UnsupportedProtocol,
    environment_proxy,
    parse_url,
)
from greenroom.actors.providers.lean_wire import (
    ErrorClassifier,
    LeanEndpoint,
    RequestBuilder,
    StreamDecoder,
    Wording,
    lean_by_default,
)
from greenroom.actors.providers.media import LoadedImage, TaskImages, read_image
from greenroom.actors.providers.stalls import no_response_message
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.openai_codec import OpenAIStreamDecoder, RequestEncoder, classify_error

if TYPE_CHECKING:
    import httpx

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_TIMEOUT = Timeouts(connect=15.0, read=180.0, write=60.0, pool=60.0)
"""``read`` bounds the silence between two reads of a stream, and how long a stream may
send only keep-alives (R-SEC-10)."""

USER_AGENT = "greenroom"


def image_part(image: LoadedImage) -> dict[str, Any]:
    """A read image as a chat completions ``data:`` URL part."""
    media_type, data = image
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def load_image(block: ImageBlock) -> dict[str, Any] | None:
    """An image block as a ``data:`` URL part; None when unreadable. Blocking; see
    :func:`~greenroom.actors.providers.media.read_image`."""
    image = read_image(block)
    return None if image is None else image_part(image)


def _timed_out(exc: TimeoutException, url: str, read_timeout: float | None) -> str:
    # As the httpx path words them (openai_httpx.HTTPStreamTask).
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "ConnectTimeout" in names:
        return f"timed out connecting to the server ({url})"
    if "ReadTimeout" in names:
        return no_response_message(read_timeout)
    return transport_failure(exc)


WORDING = Wording(is_error_status=lambda status: status >= 400, timed_out=_timed_out)


class OpenAIProvider:
    """Chat completions; one connection pool per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none. ``lean_http``: True for
    greenroom's own HTTP client, False for httpx; None (the default) reads
    ``GREENROOM_LEAN_HTTP`` (on when unset: R-PERF-1). ``timeout``: any object with
    ``connect``, ``read``, ``write`` and ``pool`` seconds (:class:`Timeouts`, or an
    ``httpx.Timeout``).
    """

    name = "openai"
    endpoint = "/chat/completions"
    """The path below the ``/v1`` root that this provider posts to."""
    encoder: ClassVar[Callable[..., RequestBuilder]] = RequestEncoder
    decoder: ClassVar[Callable[[], StreamDecoder]] = OpenAIStreamDecoder
    classify: ClassVar[ErrorClassifier] = classify_error

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: TimeoutSettings = DEFAULT_TIMEOUT,
        max_connections: int = 2000,
        lean_http: bool | None = None,
    ) -> None:
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        if not all(" " <= c <= "~" for c in key):
            raise ConfigurationError(
                "the OpenAI API key holds a character an HTTP header cannot carry "
                "(a line break?)"
            )
        headers = [("Authorization", f"Bearer {key}")] if key else []
        root = (base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self._url = root + self.endpoint
        self._identity = endpoint_identity(self.name, root, key)
        self._timeout = timeout
        try:
            target = parse_url(self._url)
        except UnsupportedProtocol:
            raise ConfigurationError(
                f"the {self.name} provider's base URL {root!r} is not an http or https URL"
            ) from None
        if lean_http is None:
            lean_http = lean_by_default()
        self._proxy = environment_proxy(target) if lean_http else None
        self._lean: LeanEndpoint | None = None
        self._client: httpx.AsyncClient | None = None
        if lean_http and self._proxy is None:
            self._lean = LeanEndpoint(
                self._url,
                [("Accept", "*/*"), ("Accept-Encoding", "identity"),
                 ("User-Agent", USER_AGENT), *headers],
                timeout,
                WORDING,
                max_connections=max(1, max_connections),
            )  # fmt: skip
        else:
            from greenroom.actors.providers.openai_httpx import make_client

            self._client = make_client(dict(headers), timeout, max_connections)

    @property
    def endpoint_identity(self) -> str:
        """The provider's name, its ``/v1`` root and a hash of its key
        (:func:`~greenroom.actors.providers.base.endpoint_identity`)."""
        return self._identity

    @property
    def lean_http(self) -> bool:
        """Whether requests go through greenroom's own HTTP client (False: httpx, asked
        for or because a proxy applies, see :attr:`proxy`)."""
        return self._lean is not None

    @property
    def proxy(self) -> str | None:
        """The environment's proxy for the base URL that sent a lean provider to httpx,
        else None."""
        return self._proxy

    def open_task(self) -> ProviderTask:
        """Per-task state: the request encoder that reuses earlier turns' encodings."""
        images = TaskImages()
        encoder = type(self).encoder(image_loader=images.loader(image_part))
        if self._lean is not None:
            return LeanStreamTask(
                self._lean, encoder, type(self).decoder, type(self).classify, images
            )
        from greenroom.actors.providers.openai_httpx import HTTPStreamTask

        assert self._client is not None
        return HTTPStreamTask(
            self._client, self._url, encoder, type(self).decoder, type(self).classify, images
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._lean is not None:
            await self._lean.aclose()
        if self._client is not None:
            await self._client.aclose()


class LeanStreamTask:
    """Streams one attempt through a :class:`LeanEndpoint` and a sans-IO codec."""

    __slots__ = ("_classify", "_decoder", "_encoder", "_endpoint", "_images")

    usage_at_end: ClassVar[bool] = True
    """Chat Completions and Responses report usage only with a stream's last events (the
    usage chunk, ``response.completed``): the streamer bills a stream that begins at its
    estimated input until then (R-SHARE-3)."""

    def __init__(
        self,
        endpoint: LeanEndpoint,
        encoder: RequestBuilder,
        decoder: Callable[[], StreamDecoder],
        classify: ErrorClassifier,
        images: TaskImages | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._encoder = encoder
        self._decoder = decoder
        self._classify = classify
        self._images = images

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """POST the encoded ``request`` and deliver the decoded events, one batch per read
        (see :meth:`LeanEndpoint.stream`). The request's images are read first, off the
        event loop, when the encoder has a :class:`TaskImages` loader."""
        if self._images is not None:
            await self._images.prepare(request)
        body = self._encoder.build(request)
        await self._endpoint.stream(body, self._decoder(), self._classify, deliver)


__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_TIMEOUT",
    "ErrorClassifier",
    "LeanStreamTask",
    "OpenAIProvider",
    "RequestBuilder",
    "StreamDecoder",
    "image_part",
    "load_image",
]
