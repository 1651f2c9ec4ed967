"""Reading images for provider requests.

An accepted image is sent from the session's private copy, never from its file again
(R-SEC-8, :mod:`greenroom.actors.runtime.attachments`). A provider task reads the images of
each request in a worker thread before it encodes it (:meth:`TaskImages.prepare`), each
once per task (the request encoders cache their encodings), and the encoder's loader
takes them from there. Providers wrap the result in their own wire shape.
"""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Callable, Iterator
from typing import Any

import trio

from greenroom.actors.providers.image_files import image_bytes, is_sha256
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ImageSource, ModelRequest, ToolResult, UserMessage

LoadedImage = tuple[str, str]
"""``(media_type, base64 data)``."""


def read_image(block: ImageBlock, source: ImageSource | None = None) -> LoadedImage | None:
    """``(media_type, base64 data)`` of an image block; None when there is nothing to send
    (the codecs then fold the image to an ``[attached image: <path>]`` line). ``source``
    is the session's (see :class:`~greenroom.protocols.context.ImageSource`); without
    it, only a block never accepted is read, from its path, with the default limit.
    Blocking: a provider reads in a thread (:class:`TaskImages`)."""
    data = image_bytes(block, source)
    if data is None:
        return None
    media_type = block.media_type or mimetypes.guess_type(block.path)[0] or "image/png"
    return media_type, base64.b64encode(data).decode("ascii")


def _key(block: ImageBlock) -> tuple[str | None, ...]:
    if is_sha256(block.sha256):
        return ("sha256", block.sha256, block.media_type)
    return ("path", block.path, block.media_type, block.sha256)


def _images(request: ModelRequest) -> Iterator[ImageBlock]:
    for message in request.messages:
        if not isinstance(message, UserMessage):
            continue
        for part in message.content:
            if isinstance(part, ImageBlock):
                yield part
            elif isinstance(part, ToolResult):
                for block in part.content:
                    if isinstance(block, ImageBlock):
                        yield block


class TaskImages:
    """The images of one task's requests, read in a worker thread before each request is
    encoded and kept until the task ends (its encoder keeps their encodings as long)."""

    __slots__ = ("_loaded",)

    def __init__(self) -> None:
        self._loaded: dict[tuple[str | None, ...], LoadedImage | None] = {}

    async def prepare(self, request: ModelRequest) -> None:
        """Read the images of ``request`` not read yet in this task, off the event loop;
        cancelling abandons the read. Nothing is read for a model without vision."""
        if not request.supports_vision:
            return
        missing: dict[tuple[str | None, ...], ImageBlock] = {}
        for block in _images(request):
            key = _key(block)
            if key not in self._loaded:
                missing.setdefault(key, block)
        if not missing:
            return
        source = request.images
        blocks = list(missing.values())
        loaded = await trio.to_thread.run_sync(
            lambda: [read_image(b, source) for b in blocks], abandon_on_cancel=True
        )
        self._loaded.update(zip(missing, loaded, strict=True))

    def get(self, block: ImageBlock) -> LoadedImage | None:
        """The image read for ``block`` by :meth:`prepare`; None when it could not be (or
        was not) read."""
        return self._loaded.get(_key(block))

    def loader(
        self, shape: Callable[[LoadedImage], dict[str, Any]]
    ) -> Callable[[ImageBlock], dict[str, Any] | None]:
        """An encoder's image loader: the prepared image in the provider's ``shape``."""

        def load(block: ImageBlock) -> dict[str, Any] | None:
            image = self.get(block)
            return None if image is None else shape(image)

        return load
