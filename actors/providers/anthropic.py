"""The Anthropic provider: the Messages API streamed over greenroom's own HTTP client,
parsed by greenroom's codec.

By default (the lean path) greenroom builds the request itself — ``POST
{base_url}/v1/messages`` with the body of
:class:`~greenroom.protocols.anthropic_codec.RequestEncoder` and ``stream: true``, the key in
``x-api-key`` (or ``ANTHROPIC_AUTH_TOKEN`` as a bearer token), ``anthropic-version``
:data:`ANTHROPIC_VERSION` — sends it through its HTTP/1.1 connection pool on trio
(:mod:`~greenroom.actors.providers.lean_http`) and hands the body, once per network read,
to the sans-IO :class:`~greenroom.protocols.anthropic_codec.AnthropicStreamDecoder`. No
model object per event, and the runtime sees what an SDK would hide: a stream cut before
``message_stop``, a tool call truncated by ``max_tokens``, an ``error`` event after a 200
(fixtures README). Neither the ``anthropic`` SDK nor its HTTP library is imported.

``lean_http=False`` (``GREENROOM_LEAN_HTTP=0``, ``--no-lean-http``) sends the same body
through the official SDK's client instead (:mod:`~greenroom.actors.providers.anthropic_sdk`),
and so does a provider whose base URL the environment proxies (``HTTPS_PROXY`` and its
kin), which the lean client does not do. Both paths report every failure as the same
``StreamFailed``: the same kinds and the same words.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from greenroom.actors.providers.base import Deliver, ProviderTask, endpoint_identity
from greenroom.actors.providers.lean_http import (
    Timeouts,
    TimeoutSettings,
    UnsupportedProtocol,
    environment_proxy,
    parse_url,
)
from greenroom.actors.providers.lean_wire import LeanEndpoint, Wording, lean_by_default
from greenroom.actors.providers.media import LoadedImage, TaskImages, read_image
from greenroom.actors.providers.stalls import no_response_message
from greenroom.protocols.anthropic_codec import (
    AnthropicStreamDecoder,
    RequestEncoder,
    classify_error,
)
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.errors import ConfigurationError

if TYPE_CHECKING:
    from greenroom.actors.providers.anthropic_sdk import SDKClients

DEFAULT_BASE_URL = "https://api.anthropic.com"
"""Where requests go when neither ``base_url`` nor ``ANTHROPIC_BASE_URL`` says."""

DEFAULT_TIMEOUT = Timeouts(connect=15.0, read=180.0, write=60.0, pool=60.0)
"""``read`` bounds the silence between two reads of a stream, and how long a stream may
send only keep-alives (R-SEC-10): a stalled stream becomes a ``timeout`` failure and is
retried."""

ANTHROPIC_VERSION = "2023-06-01"
"""The Messages API version the lean path asks for (``anthropic-version``)."""

USER_AGENT = f"greenroom (Python {sys.version_info[0]}.{sys.version_info[1]})"

POOL_SHARDS = 8
"""How many SDK clients the library path may spread its requests over (see
:data:`~greenroom.actors.providers.anthropic_sdk.SHARD_BUSY`); the lean pool needs one."""

CUSTOM_HEADERS_VARIABLE = "ANTHROPIC_CUSTOM_HEADERS"
"""Extra request headers, one ``Name: value`` a line, as the SDK reads them."""


def image_part(image: LoadedImage) -> dict[str, Any]:
    """A read image as an Anthropic base64 image block."""
    media_type, data = image
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def load_image(block: ImageBlock) -> dict[str, Any] | None:
    """An image block as an Anthropic base64 image source; None when unreadable (the codec
    then folds it to an ``[attached image: <path>]`` line). Blocking; see
    :func:`~greenroom.actors.providers.media.read_image`."""
    image = read_image(block)
    return None if image is None else image_part(image)


def timeout_words(exc: BaseException | None, read_timeout: float | None) -> str:
    """A timeout before the response's body, in words: which phase ran out of time. Read
    from the class names, which greenroom's client shares with httpx2's."""
    names = {cls.__name__ for cls in type(exc).__mro__} if exc is not None else set()
    if "ConnectTimeout" in names:
        return "timed out connecting to the server"
    if "WriteTimeout" in names:
        return "timed out sending the request"
    if "PoolTimeout" in names:
        return "timed out waiting for a free connection (too many requests in flight)"
    if "ReadTimeout" in names:
        return no_response_message(read_timeout)
    return "request timed out"


WORDING = Wording(
    # The SDK raises for every status outside 2xx (httpx's ``raise_for_status``).
    is_error_status=lambda status: not 200 <= status < 300,
    timed_out=lambda exc, url, read_timeout: timeout_words(exc, read_timeout),
)


def _header_safe(value: str) -> bool:
    return all(" " <= c <= "~" or c == "\t" for c in value)


def custom_headers() -> list[tuple[str, str]]:
    """The headers of :data:`CUSTOM_HEADERS_VARIABLE` (lines without a colon skipped, as
    the SDK skips them); :class:`ConfigurationError` naming the variable for a name or
    value a header cannot carry."""
    text = os.environ.get(CUSTOM_HEADERS_VARIABLE)
    if text is None:
        return []
    headers: list[tuple[str, str]] = []
    for line in text.split("\n"):
        name, colon, value = line.partition(":")
        if not colon:
            continue
        name, value = name.strip(), value.strip()
        if not name or not _header_safe(name) or " " in name or not _header_safe(value):
            raise ConfigurationError(
                f"{CUSTOM_HEADERS_VARIABLE}: {name[:40]!r} cannot be sent as an HTTP header"
            )
        headers.append((name, value))
    return headers


class AnthropicProvider:
    """The Anthropic Messages API; one provider per host and endpoint, shared by every
    session (its connection pool included). See the module docstring for the two paths.

    ``lean_http``: True for greenroom's own HTTP client, False for the SDK's; None (the
    default) reads ``GREENROOM_LEAN_HTTP`` (on when unset: R-PERF-1). ``timeout``: any
    object with ``connect``, ``read``, ``write`` and ``pool`` seconds (:class:`Timeouts`, or
    an ``httpx2.Timeout``). ``shards``: how many SDK clients the library path may use."""

    name = "anthropic"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: TimeoutSettings = DEFAULT_TIMEOUT,
        max_connections: int = 2000,
        shards: int = POOL_SHARDS,
        lean_http: bool | None = None,
    ) -> None:
        key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        token = None if key else os.environ.get("ANTHROPIC_AUTH_TOKEN")
        if not key and not token:
            raise ConfigurationError(
                "the anthropic provider needs credentials: set ANTHROPIC_API_KEY "
                "(or ANTHROPIC_AUTH_TOKEN)"
            )
        if not _header_safe(key or token or ""):
            what = "the API key" if key else "ANTHROPIC_AUTH_TOKEN"
            raise ConfigurationError(
                f"{what} holds a character an HTTP header cannot carry (a line break?)"
            )
        self._key = key
        self._token = token
        self._base_url = base_url
        self._timeout = timeout
        root = base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_BASE_URL
        self._root = root
        url = root.rstrip("/") + "/v1/messages"
        try:
            target = parse_url(url)
        except UnsupportedProtocol:
            raise ConfigurationError(
                f"the anthropic provider's base URL {root!r} is not an http or https URL"
            ) from None
        if lean_http is None:
            lean_http = lean_by_default()
        self._proxy = environment_proxy(target) if lean_http else None
        self._lean: LeanEndpoint | None = None
        self._sdk: SDKClients | None = None
        if lean_http and self._proxy is None:
            self._lean = LeanEndpoint(
                url, self._headers(), timeout, WORDING, max_connections=max(1, max_connections)
            )
        else:
            from greenroom.actors.providers.anthropic_sdk import SDKClients

            self._sdk = SDKClients(
                api_key=key,
                auth_token=token,
                base_url=base_url,
                timeout=timeout,
                max_connections=max_connections,
                shards=shards,
            )

    def _headers(self) -> list[tuple[str, str]]:
        credential = (
            ("x-api-key", self._key) if self._key else ("Authorization", f"Bearer {self._token}")
        )
        headers = [
            ("Accept", "application/json"),
            # Streams are read as they come: no compression to wait for or to undo.
            ("Accept-Encoding", "identity"),
            ("User-Agent", USER_AGENT),
            ("anthropic-version", ANTHROPIC_VERSION),
            credential,
        ]
        extra = custom_headers()
        replaced = {name.lower() for name, _ in extra}
        return [h for h in headers if h[0].lower() not in replaced] + extra

    @property
    def endpoint_identity(self) -> str:
        """``anthropic``, the base URL (``ANTHROPIC_BASE_URL``, else Anthropic's API) and a
        hash of the key or token (:func:`~greenroom.actors.providers.base.
        endpoint_identity`)."""
        return endpoint_identity(self.name, self._root, self._key or self._token)

    @property
    def read_timeout(self) -> float | None:
        """The read timeout in seconds (None: none): the longest silence, and the longest
        run of keep-alives without progress, a stream may have (R-SEC-10)."""
        return self._timeout.read

    @property
    def lean_http(self) -> bool:
        """Whether requests go through greenroom's own HTTP client (False: the SDK's,
        asked for or because a proxy applies, see :attr:`proxy`)."""
        return self._lean is not None

    @property
    def proxy(self) -> str | None:
        """The environment's proxy for the base URL that sent a lean provider to the SDK's
        client, else None."""
        return self._proxy

    def open_task(self) -> ProviderTask:
        """Per-task state: the request encoder that reuses earlier turns' encodings."""
        images = TaskImages()
        encoder = RequestEncoder(image_loader=images.loader(image_part))
        if self._lean is not None:
            return _AnthropicTask(self._lean, encoder, images)
        assert self._sdk is not None
        return self._sdk.open_task(encoder, images)

    async def aclose(self) -> None:
        """Close the connection pool (or the SDK's clients)."""
        if self._lean is not None:
            await self._lean.aclose()
        if self._sdk is not None:
            await self._sdk.aclose()


class _AnthropicTask:
    __slots__ = ("_encoder", "_endpoint", "_images")

    def __init__(self, endpoint: LeanEndpoint, encoder: RequestEncoder, images: TaskImages) -> None:
        self._endpoint = endpoint
        self._encoder = encoder
        self._images = images

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        await self._images.prepare(request)
        body = self._encoder.build(request)
        await self._endpoint.stream(body, AnthropicStreamDecoder(), classify_error, deliver)
