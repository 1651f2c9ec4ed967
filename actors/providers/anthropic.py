"""The Anthropic provider: the official SDK's async client, parsed by our own codec.

The SDK does what it is best at — authentication headers, base URL, connection pool,
HTTP error translation — while the response body is read raw
(``with_streaming_response``) and parsed by the sans-IO
:class:`~greenroom.protocols.anthropic_codec.AnthropicStreamDecoder`. That keeps the per-event
cost low (no model object per event) and lets the runtime see what the SDK would hide: a
stream cut before ``message_stop``, a tool call truncated by ``max_tokens``, an ``error``
event after a 200 (fixtures README). The SDK's own retries are off (``max_retries=0``): the
runtime's schedule (R-RETRY-2) is the only one.

Every library error is translated here, in :meth:`_AnthropicTask.stream`, into a
``StreamFailed`` event.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterable
from typing import Any

import anthropic
import httpx2

from greenroom.actors.providers.base import (
    Deliver,
    connect_failure,
    cut_short,
    endpoint_identity,
    transport_failure,
)
from greenroom.actors.providers.lean_http import LeanTransport, RawBody, raw_body
from greenroom.actors.providers.media import LoadedImage, TaskImages, read_image
from greenroom.actors.providers.stalls import (
    ProgressDeadline,
    no_response_message,
    stalled_message,
)
from greenroom.protocols.anthropic_codec import (
    AnthropicStreamDecoder,
    RequestEncoder,
    classify_error,
)
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.stream import ModelError, StreamFailed

DEFAULT_BASE_URL = "https://api.anthropic.com"
"""Where the SDK sends requests when neither ``base_url`` nor ``ANTHROPIC_BASE_URL`` says."""

DEFAULT_TIMEOUT = httpx2.Timeout(connect=15.0, read=180.0, write=60.0, pool=60.0)
"""``read`` bounds the silence between two chunks of a stream, and how long a stream may
send only keep-alives (R-SEC-10): a stalled stream becomes a ``timeout`` failure and is
retried."""


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


POOL_SHARDS = 8
SHARD_BUSY = 64
"""httpcore's pool scans every connection it holds for each request it places, so one pool
of 1,000 busy connections costs O(1,000) per request. The provider starts with one client
and adds another (up to ``shards``, sharing one SSL context) only when every client has
``SHARD_BUSY`` requests in flight; each request goes to the least busy client. A small
host keeps one client; at N = 1,000 a request scans about 1/8 of the open connections."""


class _Shard:
    __slots__ = ("active", "client")

    def __init__(self, client: anthropic.AsyncAnthropic) -> None:
        self.client = client
        self.active = 0


class AnthropicProvider:
    """Anthropic Messages API through ``anthropic.AsyncAnthropic``; one provider per host
    and endpoint, shared by every session (its clients and pools included).

    ``lean_http=True`` gives the SDK's client greenroom's
    :class:`~greenroom.actors.providers.lean_http.LeanTransport` (HTTP/1.1 on trio sockets, a
    streamed body handed on once per network read instead of once per HTTP chunk); the
    SDK still builds, authenticates and routes the requests (proxied URLs keep its own
    transport) and raises its own errors. Off by default."""

    name = "anthropic"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: httpx2.Timeout = DEFAULT_TIMEOUT,
        max_connections: int = 2000,
        shards: int = POOL_SHARDS,
        lean_http: bool = False,
    ) -> None:
        key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        token = None if key else os.environ.get("ANTHROPIC_AUTH_TOKEN")
        if not key and not token:
            raise ConfigurationError(
                "the anthropic provider needs credentials: set ANTHROPIC_API_KEY "
                "(or ANTHROPIC_AUTH_TOKEN)"
            )
        self._key = key
        self._token = token
        self._base_url = base_url
        self._timeout = timeout
        self._max_shards = max(1, shards)
        per_shard = max(1, -(-max_connections // self._max_shards))
        self._limits = httpx2.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._ssl = httpx2.create_ssl_context()
        # The lean transport's pool costs the same at any size: one client is enough.
        self._lean = lean_http
        if lean_http:
            self._max_shards = 1
            per_shard = max(1, max_connections)
        self._per_shard = per_shard
        self._shards: list[_Shard] = []
        self._add_shard()

    @property
    def endpoint_identity(self) -> str:
        """``anthropic``, the base URL (the SDK's: ``ANTHROPIC_BASE_URL``, else Anthropic's
        API) and a hash of the key or token (:func:`~greenroom.actors.providers.base.
        endpoint_identity`)."""
        base_url = self._base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_BASE_URL
        return endpoint_identity(self.name, base_url, self._key or self._token)

    @property
    def read_timeout(self) -> float | None:
        """The read timeout in seconds (None: none): the longest silence, and the longest
        run of keep-alives without progress, a stream may have (R-SEC-10)."""
        return self._timeout.read

    @property
    def lean_http(self) -> bool:
        """Whether streams are read through the lean transport."""
        return self._lean

    def _add_shard(self) -> _Shard:
        client = anthropic.AsyncAnthropic(
            api_key=self._key,
            auth_token=self._token,
            base_url=self._base_url,
            max_retries=0,
            timeout=self._timeout,
            http_client=anthropic.DefaultAsyncHttpxClient(
                limits=self._limits,
                timeout=self._timeout,
                verify=self._ssl,
                transport=LeanTransport(ssl_context=self._ssl, max_connections=self._per_shard)
                if self._lean
                else None,
            ),
        )
        shard = _Shard(client)
        self._shards.append(shard)
        return shard

    def pick_shard(self) -> _Shard:
        """The least busy client for the next request, a new one when every client has
        ``SHARD_BUSY`` requests in flight and fewer than ``shards`` exist. The caller counts its
        request in the shard's ``active`` while it runs."""
        shards = self._shards
        best = shards[0]
        for shard in shards:
            if shard.active < best.active:
                best = shard
        if best.active >= SHARD_BUSY and len(shards) < self._max_shards:
            best = self._add_shard()
        return best

    def open_task(self) -> _AnthropicTask:
        """Per-task state: the request encoder that reuses earlier turns' encodings."""
        return _AnthropicTask(self)

    async def aclose(self) -> None:
        """Close every client and its connection pool."""
        shards, self._shards = self._shards, []
        for shard in shards:
            await shard.client.close()


class _AnthropicTask:
    __slots__ = ("_encoder", "_images", "_provider")

    def __init__(self, provider: AnthropicProvider) -> None:
        self._provider = provider
        self._images = TaskImages()
        self._encoder = RequestEncoder(image_loader=self._images.loader(image_part))

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        await self._images.prepare(request)
        body = self._encoder.build(request)
        native_format = body.pop("output_config", None)
        if native_format is not None:
            # Sent as it is: SDK releases older than structured outputs (>=0.40 is
            # allowed) do not take the keyword.
            body["extra_body"] = {"output_config": native_format}
        decoder = AnthropicStreamDecoder()
        provider = self._provider
        timeout = provider.read_timeout
        shard = provider.pick_shard()
        shard.active += 1
        try:
            async with shard.client.messages.with_streaming_response.create(**body) as response:
                # The lean transport's body is read as it is (one piece per network read,
                # one cancel scope for all its reads); the SDK's iterators decode what that
                # cannot (another transport, gzip).
                raw = raw_body(response.http_response)
                if raw is None:
                    ended = await _read_body(response.iter_bytes(), decoder, deliver, timeout)
                else:
                    ended = await _read_raw(raw, decoder, deliver, timeout)
                if ended:
                    return
            await deliver(decoder.end_of_stream())
        except anthropic.APIStatusError as exc:
            await deliver([StreamFailed(error=_status_error(exc))])
        except anthropic.APITimeoutError as exc:
            await deliver([_failed("timeout", _timed_out(exc, timeout))])
        except anthropic.APIConnectionError as exc:
            if _is_connect_error(exc):
                url = str(exc.request.url) if exc.request is not None else "the server"
                await deliver([_failed("timeout", connect_failure(url, exc))])
            else:
                await deliver([_failed("timeout", transport_failure(_cause_of(exc)))])
        except httpx2.TimeoutException as exc:
            await deliver([_failed("timeout", _timed_out(exc, timeout))])
        except httpx2.TransportError as exc:
            await deliver([_failed("timeout", transport_failure(exc))])
        finally:
            shard.active -= 1


async def _read_body(
    chunks: AsyncIterable[bytes], decoder: AnthropicStreamDecoder, deliver: Deliver,
    read_timeout: float | None,
) -> bool:
    """Feed the body to ``decoder`` and deliver what each piece completes. True when the
    stream has ended (its terminal event, a cut or a stall delivered as such); False when
    the body ended first. Keep-alives alone end it after the read timeout (R-SEC-10)."""
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
        except httpx2.TimeoutException:
            await deliver([_failed("timeout", stalled_message(deadline.timeout,
                                                              keepalives=False))])
            return True
        except httpx2.TransportError as exc:
            # The body had begun: a stream cut short, judged by what arrived.
            await deliver(cut_short(decoder.end_of_stream(), exc))
            return True
        return False
    await deliver([_failed("timeout", stalled_message(deadline.timeout, keepalives=keepalives))])
    return True


async def _read_raw(
    raw: RawBody, decoder: AnthropicStreamDecoder, deliver: Deliver,
    read_timeout: float | None,
) -> bool:
    """:func:`_read_body` for the lean transport's raw body, whose one read deadline moves
    on only when a read decodes to events: marking that costs an attribute store."""
    keepalives = False
    try:
        with raw.read_deadline(progress=True) as deadline:
            try:
                async for chunk in raw:
                    events = decoder.feed(chunk)
                    if events:
                        deadline.progressed = True
                        keepalives = False
                        await deliver(events)
                        if decoder.finished:
                            return True
                    else:
                        keepalives = True
            except httpx2.TimeoutException:
                raise
            except httpx2.TransportError as exc:
                await deliver(cut_short(decoder.end_of_stream(), exc))
                return True
    except httpx2.ReadTimeout:
        # Only the held deadline raises it here, and only for a finite timeout.
        read = math.inf if read_timeout is None else read_timeout
        await deliver([_failed("timeout", stalled_message(read, keepalives=keepalives))])
        return True
    return False


def _status_error(exc: anthropic.APIStatusError) -> ModelError:
    response = exc.response
    try:
        body: bytes | str = response.content
    except Exception:  # a streamed body that was never read
        body = str(exc.body) if exc.body is not None else exc.message
    # The wall clock: an HTTP-date ``retry-after`` is an absolute time.
    return classify_error(exc.status_code, body, dict(response.headers), now=time.time())


def _failed(kind: str, message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind=kind, message=message))  # type: ignore[arg-type]


def _is_connect_error(exc: BaseException) -> bool:
    """Whether the connection was never opened (as opposed to dropped mid-request)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, httpx2.ConnectError):
            return True
        cause = cause.__cause__
    return False


def _cause_of(exc: BaseException) -> BaseException:
    """The transport error an SDK connection error wraps, else the error itself."""
    cause = exc.__cause__ or exc.__context__
    return cause if isinstance(cause, httpx2.TransportError) else exc


def _timed_out(exc: BaseException, timeout: float | None) -> str:
    """A timeout before the response's body, in words: which phase ran out of time."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, httpx2.TimeoutException):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, httpx2.ConnectTimeout):
        return "timed out connecting to the server"
    if isinstance(seen, httpx2.WriteTimeout):
        return "timed out sending the request"
    if isinstance(seen, httpx2.PoolTimeout):
        return "timed out waiting for a free connection (too many requests in flight)"
    if isinstance(seen, httpx2.ReadTimeout):
        return no_response_message(timeout)
    return "request timed out"
