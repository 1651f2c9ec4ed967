"""The OpenAI Responses provider: ``POST /v1/responses`` streamed with httpx.

For OpenAI's current API and the servers that speak it (vLLM, Ollama). Requests are
stateless (``store: false``); reasoning models get their encrypted reasoning items back
within a tool-use chain (see :mod:`greenroom.protocols.openai_responses_codec`). The HTTP
side — the client, its pool, and the translation of library errors — is the Chat
Completions provider's.
"""

from __future__ import annotations

from greenroom.actors.providers.media import TaskImages
from greenroom.actors.providers.openai import HTTPStreamTask, OpenAIProvider, image_part
from greenroom.protocols.openai_responses_codec import (
    RequestEncoder,
    ResponsesStreamDecoder,
    classify_error,
)


class OpenAIResponsesProvider(OpenAIProvider):
    """The Responses API over httpx; one client (connection pool) per host and endpoint.

    ``base_url`` is the server's ``/v1`` root. The key comes from ``api_key`` or
    ``OPENAI_API_KEY``; local servers usually need none.
    """

    name = "openai-responses"
    endpoint = "/responses"

    def open_task(self) -> HTTPStreamTask:
        """Per-task state: the request encoder that reuses earlier turns' input items."""
        images = TaskImages()
        return HTTPStreamTask(
            self._client,
            self._url,
            RequestEncoder(image_loader=images.loader(image_part)),
            ResponsesStreamDecoder,
            classify_error,
            images,
        )
