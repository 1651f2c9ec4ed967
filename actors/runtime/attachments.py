"""Image attachments: files named by clients, models and tools, read once (R-SEC-8).

An image block names a file. The file is read when the block is *accepted* — by
:meth:`Session.attach`, by the task that takes input given to ``run``, ``steer`` or
``follow_up`` directly, or by the tool pool when a tool returns an image — and never again.
Its bytes are copied into the session's private ``attachments/`` directory (in the data
dir, which no tool's sandbox shows), named by their SHA-256, and the accepted block carries
that hash; every later request sends the copy, after checking its hash. A file swapped after
acceptance — for a symbolic link to a secret, say — changes nothing the model receives, and
a reloaded session sends what the first request sent. An idle session holds the hashes
only.

Reading a named file is :mod:`greenroom.actors.providers.image_files`' job (a provider reads
private copies with it too).

Storing (:func:`store`) writes ``<session dir>/attachments/<sha256>``, 0600, under a
temporary name, fsynced, then renamed into place, all through a descriptor of the directory
opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import mimetypes
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from greenroom.actors.providers.image_files import (
    DIR_FLAGS,
    Refused,
    describe_os_error,
    is_sha256,
    read_named,
    too_big,
)
from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.storage import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from greenroom.protocols.content import ImageBlock, TextBlock, UserContent
from greenroom.protocols.context import ImageSource
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES


@attrs.frozen(kw_only=True)
class Attachments:
    """One session's attachments: where its private copies live, the directories beneath
    which named files are walked (``roots``: the workspace first, then the scratchpad) and
    the largest image it accepts. Paths only: every method here is pure."""

    directory: Path
    roots: tuple[Path, ...]
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    workspace: tuple[int, int] | None = None
    """The device and inode numbers the first root (the workspace) had when the session
    was created (R-SEC-7): a directory found at its path later with other numbers — a
    symlink put there, say — is not walked."""
    private_dirs: tuple[Path, ...] = ()
    """The host's data dir: never read through the workspace, which may hold it (R-SEC-7)."""

    @property
    def source(self) -> ImageSource:
        """The same, as a request carries it to the provider."""
        return ImageSource(
            attachments_dir=str(self.directory),
            roots=tuple(str(r) for r in self.roots),
            max_bytes=self.max_bytes,
            private_dirs=tuple(str(p) for p in self.private_dirs),
        )


# -- accepting ------------------------------------------------------------------------------


def accept(
    blocks: Sequence[UserContent],
    attachments: Attachments,
    *,
    confine: bool = False,
    fold: bool = False,
) -> tuple[UserContent, ...]:
    """``blocks`` with every image accepted: read (:func:`read_named`), stored
    (:func:`store`) and given its ``sha256`` and media type. An image whose private copy
    this session already holds is kept as it is. With ``confine``, images outside the
    roots are refused. A refused image raises :class:`ImageRefused` (its ``index`` is the
    block's position) or, with ``fold``, becomes the text ``[image refused: <path>:
    <reason>]`` so that the rest of the input still counts. Tool content has the same
    blocks and is accepted the same way. Blocking."""
    accepted: list[UserContent] = []
    for index, block in enumerate(blocks):
        if not isinstance(block, ImageBlock) or _held(block, attachments.directory):
            accepted.append(block)
            continue
        try:
            image = _accept_one(block, attachments, confine=confine)
        except Refused as refused:
            if not fold:
                raise ImageRefused(block.path, refused.reason, index) from None
            accepted.append(TextBlock(text=f"[image refused: {block.path}: {refused.reason}]"))
            continue
        accepted.append(image)
    return tuple(accepted)


def accept_data(data: bytes | str, media_type: str, attachments: Attachments) -> ImageBlock:
    """An image given as bytes, or as base64 text (an editor's inline image), stored like a
    file's and returned as an accepted block whose path is ``inline-<12 hex digits of its
    hash>`` with the media type's extension. Base64 text is measured against the limit
    before it is decoded. Raises :class:`ImageRefused` when it is not base64, empty, over
    the limit, not of an ``image/`` type, or cannot be stored. Blocking."""
    shown = "inline image"
    if not media_type.startswith("image/"):
        raise ImageRefused(shown, f"{media_type!r} is not an image type")
    if isinstance(data, str):
        if len(data) > 4 * ((attachments.max_bytes + 2) // 3):
            size = len(data) * 3 // 4 - data[-2:].count("=")
            raise ImageRefused(shown, too_big(size, attachments.max_bytes))
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRefused(shown, "its data is not base64") from None
    if not data:
        raise ImageRefused(shown, "an empty image")
    if len(data) > attachments.max_bytes:
        raise ImageRefused(shown, too_big(len(data), attachments.max_bytes))
    try:
        digest = store(attachments.directory, data)
    except OSError as exc:
        reason = describe_os_error(exc)
        raise ImageRefused(shown, f"cannot be kept for the session: {reason}") from None
    suffix = mimetypes.guess_extension(media_type) or ""
    return ImageBlock(path=f"inline-{digest[:12]}{suffix}", media_type=media_type, sha256=digest)


def has_images(blocks: Sequence[UserContent]) -> bool:
    """Whether ``blocks`` hold an image, which :func:`attach` reads in a worker thread;
    without one it has nothing to do."""
    return any(isinstance(b, ImageBlock) for b in blocks)


async def attach(
    blocks: Sequence[UserContent],
    attachments: Attachments,
    *,
    confine: bool = False,
    fold: bool = False,
) -> tuple[UserContent, ...]:
    """:func:`accept` in a worker thread (R-SEC-8: never on the event loop); cancelling
    abandons the thread. Input without images is returned as it is, at once."""
    if not has_images(blocks):
        return tuple(blocks)
    return await trio.to_thread.run_sync(
        functools.partial(accept, blocks, attachments, confine=confine, fold=fold),
        abandon_on_cancel=True,
    )


def _held(block: ImageBlock, directory: Path) -> bool:
    if not is_sha256(block.sha256):
        return False
    try:
        info = os.stat(directory / str(block.sha256), follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode)


def _accept_one(block: ImageBlock, attachments: Attachments, *, confine: bool) -> ImageBlock:
    data = read_named(
        block.path,
        roots=attachments.roots,
        max_bytes=attachments.max_bytes,
        confine=confine,
        workspace=attachments.workspace,
        private_dirs=attachments.private_dirs,
    )
    try:
        digest = store(attachments.directory, data)
    except OSError as exc:
        raise Refused(f"cannot be kept for the session: {describe_os_error(exc)}") from None
    media_type = block.media_type or mimetypes.guess_type(block.path)[0] or "image/png"
    return attrs.evolve(block, media_type=media_type, sha256=digest)


# -- reading a named file -------------------------------------------------------------------


# -- the private copies ---------------------------------------------------------------------


def store(directory: Path, data: bytes) -> str:
    """Keep ``data`` as ``directory/<sha256>`` (0600; the directory 0700, created when
    missing); returns the hash. Written under a temporary name, fsynced and renamed, so a
    copy is whole or absent: one already kept (the same image again, in the same result or
    a later one) is kept as it is. Raises OSError (the directory is a link, the disk is
    full). Blocking."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        os.mkdir(directory, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:  # a session whose directory went missing gets it back
        os.makedirs(directory, PRIVATE_DIR_MODE, exist_ok=True)
    folder = os.open(directory, DIR_FLAGS)
    try:
        if _kept(folder, digest, len(data)):
            return digest
        temporary = f".{digest}.{secrets.token_hex(4)}.tmp"
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            PRIVATE_FILE_MODE,
            dir_fd=folder,
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(temporary, dir_fd=folder)
            raise
        os.close(fd)
        os.replace(temporary, digest, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)
    finally:
        os.close(folder)
    return digest


def _kept(folder: int, digest: str, size: int) -> bool:
    """Whether ``folder`` keeps a copy named ``digest`` already: only a whole one is ever
    renamed into place, so its name and size vouch for its content."""
    try:
        info = os.stat(digest, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == size
