"""Reading user images for provider requests.

Images are read when a request is encoded, each once per task (the request encoders cache
their encodings). Providers wrap the result in their own wire shape.
"""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path

from greenroom.protocols.content import ImageBlock


def read_image(block: ImageBlock) -> tuple[str, str] | None:
    """``(media_type, base64 data)`` of an image block; None when the file cannot be read
    (the codecs then fold the image to an ``[attached image: <path>]`` line)."""
    path = Path(block.path)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    media_type = block.media_type or mimetypes.guess_type(path.name)[0] or "image/png"
    return media_type, base64.b64encode(data).decode("ascii")
