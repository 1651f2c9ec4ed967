"""The OpenAI Responses provider: ``POST /v1/responses``, streamed.

For OpenAI's current API and the servers that speak it (vLLM, Ollama). Requests are
stateless (``store: false``); reasoning models get their encrypted reasoning items back
within a tool-use chain (see :mod:`greenroom.actors.providers.openai_responses_codec`). The
HTTP side — greenroom's own client by default, httpx with ``lean_http=False`` or behind a
proxy, and the translation of every failure — is the Chat Completions provider's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from greenroom.actors.providers.lean_wire import ErrorClassifier, RequestBuilder, StreamDecoder
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.protocols.openai_responses_codec import (
    RequestEncoder,
    ResponsesStreamDecoder,
    classify_error,
)


class OpenAIResponsesProvider(OpenAIProvider):
    """The Responses API; one connection pool per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none. The other options are
    :class:`~greenroom.actors.providers.openai.OpenAIProvider`'s.
    """

    name = "openai-responses"
    endpoint = "/responses"
    encoder: ClassVar[Callable[..., RequestBuilder]] = RequestEncoder
    decoder: ClassVar[Callable[[], StreamDecoder]] = ResponsesStreamDecoder
    classify: ClassVar[ErrorClassifier] = classify_error
