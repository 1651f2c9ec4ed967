"""The anthropic provider's library path: the official SDK's async client and its HTTP
stack (httpx2 → httpcore2 → h11), parsed by greenroom's codec.

Used when the lean path is turned off (``lean_http=False``, ``GREENROOM_LEAN_HTTP=0``,
``--no-lean-http``) and when a proxy from the environment applies to the base URL (the
SDK's client honours ``HTTPS_PROXY`` and its kin; the lean client does not). Importing this
module imports the SDK, about a second on a busy machine: the lean path never does.

The SDK builds, authenticates and routes the requests; the response body is read raw
(``with_streaming_response``) and parsed by the sans-IO
:class:`~greenroom.protocols.anthropic_codec.AnthropicStreamDecoder`. The SDK's own retries
are off (``max_retries=0``): the runtime's schedule (R-RETRY-2) is the only one. Every
library error is translated here, in :meth:`SDKTask.stream`, into a ``StreamFailed`` with
the words the lean path uses for the same failure. A response head, and the body of a
response outside 2xx (an error the SDK reads whole, a redirect httpx2 reads before it
follows it), get no longer than the lean path gives them however they trickle in
(:class:`~greenroom.actors.providers.stalls.HeadDeadline`, R-SEC-10). Redirects are
followed as on the lean path (:func:`lean_redirects`, :func:`keys_stay_home`): only 307
and 308, at most ``MAX_REDIRECTS`` of them, no key sent on to another origin.
"""

from __future__ import annotations

import time

import anthropic
import httpx2

from greenroom.actors.providers.base import (
    Deliver,
    connect_failure,
    transport_failure,
)
from greenroom.actors.providers.httpx2_bodies import BoundedStream
from greenroom.actors.providers.lean_http import TimeoutSettings
from greenroom.actors.providers.lean_wire import CREDENTIALS, MAX_REDIRECTS, REDIRECTS
from greenroom.actors.providers.library_bodies import BodyBounds
from greenroom.actors.providers.media import TaskImages
from greenroom.actors.providers.stalls import HeadDeadline, read_library_body, time_heads
from greenroom.protocols.anthropic_codec import (
    AnthropicStreamDecoder,
    RequestEncoder,
    classify_error,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.stream import ModelError, StreamFailed

POOL_SHARDS = 8
SHARD_BUSY = 64
"""httpcore's pool scans every connection it holds for each request it places, so one pool
of 1,000 busy connections costs O(1,000) per request. The SDK path starts with one client
and adds another (up to ``shards``, sharing one SSL context) only when every client has
``SHARD_BUSY`` requests in flight; each request goes to the least busy client. A small
host keeps one client; at N = 1,000 a request scans about 1/8 of the open connections."""


class _Shard:
    __slots__ = ("active", "client")

    def __init__(self, client: anthropic.AsyncAnthropic) -> None:
        self.client = client
        self.active = 0


class SDKClients:
    """The SDK's clients of one provider (one to ``shards`` of them, see
    :data:`SHARD_BUSY`), shared by every task."""

    def __init__(
        self,
        *,
        api_key: str | None,
        auth_token: str | None,
        base_url: str | None,
        timeout: TimeoutSettings,
        max_connections: int,
        shards: int,
    ) -> None:
        self._key = api_key
        self._token = auth_token
        self._base_url = base_url
        self._timeout = httpx2.Timeout(
            connect=timeout.connect, read=timeout.read, write=timeout.write, pool=timeout.pool
        )
        self._max_shards = max(1, shards)
        per_shard = max(1, -(-max_connections // self._max_shards))
        self._limits = httpx2.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._ssl = httpx2.create_ssl_context()
        # The SDK reads an error body whole before greenroom sees it, and httpx2 a
        # redirect's body before it follows it: both bounded here, in size and in time.
        self._bounds = BodyBounds(
            BoundedStream, httpx2.RemoteProtocolError, read_timeout=timeout.read, error_from=300
        )
        self._shards: list[_Shard] = []
        self._add_shard()

    @property
    def read_timeout(self) -> float | None:
        """The read timeout in seconds (None: none)."""
        return self._timeout.read

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
                max_redirects=MAX_REDIRECTS,
                event_hooks={
                    "request": [time_heads, keys_stay_home],
                    "response": [lean_redirects, self._bounds],
                },
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

    def open_task(self, encoder: RequestEncoder, images: TaskImages) -> SDKTask:
        """A task's adapter on these clients."""
        return SDKTask(self, encoder, images)

    async def aclose(self) -> None:
        """Close every client and its connection pool."""
        shards, self._shards = self._shards, []
        for shard in shards:
            await shard.client.close()


_HOME = "greenroom_home"
"""A request's extension: the origin its chain of redirects began at, None once it has
left it (httpx2 copies a request's extensions into the request that follows its redirect)."""
_HOPS = "greenroom_hops"
"""A request's extension: how many redirects its chain has followed."""


async def keys_stay_home(request: httpx2.Request) -> None:
    """A request hook: once a chain of redirects has left the origin it began at, its
    requests carry no credential header (:data:`~greenroom.actors.providers.lean_wire.
    CREDENTIALS`), as on the lean path. httpx2 drops only ``authorization`` (and keeps it
    from ``http://host`` to ``https://host``): an ``x-api-key`` from
    ``ANTHROPIC_CUSTOM_HEADERS`` went to whatever server a 307 named (R-SEC-10)."""
    extensions = request.extensions
    home = extensions.setdefault(_HOME, request.url.origin)
    if home is not None and request.url.origin != home:
        extensions[_HOME] = home = None  # away for good, as on the lean path
    if home is None:
        for name in CREDENTIALS:
            request.headers.pop(name.decode(), None)


async def lean_redirects(response: httpx2.Response) -> None:
    """A response hook: httpx2 follows a redirect only when it is a 307 or 308 and fewer
    than ``MAX_REDIRECTS`` were followed before it, as the lean path does; any other
    response is the answer (R-SEC-10). The SDK's client followed a 301, 302 or 303 too,
    as a GET without the body, and up to 20 of them."""
    if not response.has_redirect_location:
        return
    extensions = response.request.extensions
    hops: int = extensions.get(_HOPS, 0)
    if response.status_code in REDIRECTS and hops < MAX_REDIRECTS:
        extensions[_HOPS] = hops + 1
        return
    # httpx2 follows a response only while it names where to go: without, it is the answer.
    del response.headers["location"]


class SDKTask:
    """One task's requests through the SDK (see the module docstring)."""

    __slots__ = ("_clients", "_encoder", "_images")

    def __init__(self, clients: SDKClients, encoder: RequestEncoder, images: TaskImages) -> None:
        self._clients = clients
        self._encoder = encoder
        self._images = images

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """Send ``request`` and deliver its events, one batch per chunk the SDK hands on,
        ending with exactly one terminal event; never raises but ``trio.Cancelled``."""
        await self._images.prepare(request)
        body = self._encoder.build(request)
        native_format = body.pop("output_config", None)
        if native_format is not None:
            # Sent as it is: SDK releases older than structured outputs (>=0.40 is
            # allowed) do not take the keyword.
            body["extra_body"] = {"output_config": native_format}
        decoder = AnthropicStreamDecoder()
        clients = self._clients
        timeout = clients.read_timeout
        shard = clients.pick_shard()
        shard.active += 1
        try:
            with HeadDeadline(timeout, httpx2.ReadTimeout):
                async with shard.client.messages.with_streaming_response.create(
                    **body
                ) as response:
                    if await read_library_body(
                        response.iter_bytes(), decoder, deliver, timeout,
                        timeout_error=httpx2.TimeoutException,
                        transport_error=httpx2.TransportError,
                    ):
                        return
            await deliver(decoder.end_of_stream())
        except anthropic.APIStatusError as exc:
            await deliver([StreamFailed(error=_status_error(exc))])
        except anthropic.APITimeoutError as exc:
            await deliver([_failed(_timed_out(exc, timeout))])
        except anthropic.APIConnectionError as exc:
            if _is_connect_error(exc):
                url = str(exc.request.url) if exc.request is not None else "the server"
                await deliver([_failed(connect_failure(url, exc))])
            else:
                await deliver([_failed(transport_failure(_cause_of(exc)))])
        except httpx2.TimeoutException as exc:
            await deliver([_failed(_timed_out(exc, timeout))])
        except httpx2.TransportError as exc:
            await deliver([_failed(transport_failure(exc))])
        finally:
            shard.active -= 1


def _status_error(exc: anthropic.APIStatusError) -> ModelError:
    response = exc.response
    try:
        body: bytes | str = response.content
    except Exception:  # a streamed body that was never read
        body = str(exc.body) if exc.body is not None else exc.message
    # The wall clock: an HTTP-date ``retry-after`` is an absolute time.
    return classify_error(exc.status_code, body, dict(response.headers), now=time.time())


def _failed(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))


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
    from greenroom.actors.providers.anthropic import timeout_words

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, httpx2.TimeoutException):
        seen = seen.__cause__ or seen.__context__
    return timeout_words(seen, timeout)


__all__ = [
    "POOL_SHARDS",
    "SHARD_BUSY",
    "SDKClients",
    "SDKTask",
    "keys_stay_home",
    "lean_redirects",
]
