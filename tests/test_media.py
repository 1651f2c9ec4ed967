"""Images reach each provider's wire shape from one reader; unreadable ones fold to text;
accepted ones are read from the session's private copy only (R-SEC-8)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from greenroom.actors.providers import anthropic as provider_anthropic
from greenroom.actors.providers import openai as provider_openai
from greenroom.actors.providers.media import read_image
from greenroom.actors.runtime.attachments import store
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ImageSource

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


def test_an_accepted_image_is_read_from_its_private_copy_only(tmp_path: Path) -> None:
    """R-SEC-8: a block with ``sha256`` is sent from the session's copy of that hash, never
    from its path; a copy that was changed, replaced by a link, or is gone is not sent
    (the codecs fold it to its ``[attached image: <path>]`` line)."""
    copies = tmp_path / "attachments"
    digest = store(copies, PNG)
    path = tmp_path / "pic.png"
    path.write_bytes(b"what the file holds now")
    block = ImageBlock(path=str(path), media_type="image/png", sha256=digest)
    source = ImageSource(attachments_dir=str(copies))
    assert read_image(block, source) == ("image/png", base64.b64encode(PNG).decode("ascii"))
    assert read_image(block) is None  # no session to read the copy from
    (copies / digest).write_bytes(PNG + b"changed")
    assert read_image(block, source) is None
    (copies / digest).unlink()
    (copies / digest).symlink_to(path)
    assert read_image(block, source) is None
    (copies / digest).unlink()
    assert read_image(block, source) is None
    bad = ImageBlock(path=str(path), sha256="../" + digest[3:])
    assert read_image(bad, source) is None


def test_a_block_never_accepted_is_read_the_safe_way(tmp_path: Path) -> None:
    """R-SEC-8: an image from an older trace (no ``sha256``) is read from its path with the
    limit, never through a link as its last component, regular files only."""
    path = tmp_path / "pic.png"
    path.write_bytes(PNG)
    (tmp_path / "link.png").symlink_to(path)
    os.mkfifo(tmp_path / "pipe.png")
    source = ImageSource(attachments_dir=str(tmp_path / "none"), max_bytes=len(PNG))
    assert read_image(ImageBlock(path=str(path)), source) is not None
    assert read_image(ImageBlock(path=str(tmp_path / "link.png")), source) is None
    assert read_image(ImageBlock(path=str(tmp_path / "pipe.png")), source) is None
    path.write_bytes(PNG + b"!")
    assert read_image(ImageBlock(path=str(path)), source) is None


def test_an_image_kept_already_is_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-8, R-TOOL-8: a result of hundreds of blocks of one image wrote and fsynced the
    same private copy once per block. A copy kept already is kept as it is; another image,
    or a copy whose size is not the image's, is written."""
    copies = tmp_path / "copies"
    digest = store(copies, PNG)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    assert store(copies, PNG) == digest
    assert synced == []
    (copies / digest).write_bytes(PNG[:4])  # not what a whole copy is
    assert store(copies, PNG) == digest
    assert (copies / digest).read_bytes() == PNG
    other = store(copies, PNG + b"!")
    assert len(synced) == 4  # each written copy: its file and its directory
    assert sorted(p.name for p in copies.iterdir()) == sorted([digest, other])
