"""Images reach each provider's wire shape from one reader; unreadable ones fold to text."""

from __future__ import annotations

import base64
from pathlib import Path

from greenroom.actors.providers import anthropic as provider_anthropic
from greenroom.actors.providers import openai as provider_openai
from greenroom.actors.providers.media import read_image
from greenroom.protocols.content import ImageBlock

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8


def test_read_image_guesses_the_type_and_encodes(tmp_path: Path) -> None:
    path = tmp_path / "shot.png"
    path.write_bytes(PNG)
    assert read_image(ImageBlock(path=str(path))) == (
        "image/png",
        base64.b64encode(PNG).decode("ascii"),
    )
    assert read_image(ImageBlock(path=str(path), media_type="image/webp"))[0] == "image/webp"  # type: ignore[index]
    assert read_image(ImageBlock(path=str(tmp_path / "missing.png"))) is None


def test_provider_shapes(tmp_path: Path) -> None:
    path = tmp_path / "a.jpg"
    path.write_bytes(b"jpeg")
    block = ImageBlock(path=str(path))
    data = base64.b64encode(b"jpeg").decode("ascii")
    assert provider_anthropic.load_image(block) == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": data},
    }
    assert provider_openai.load_image(block) == {
        "type": "image_url",
        "image_url": {"url": f"data:image/jpeg;base64,{data}"},
    }
    missing = ImageBlock(path=str(tmp_path / "none.png"))
    assert provider_anthropic.load_image(missing) is None
    assert provider_openai.load_image(missing) is None
