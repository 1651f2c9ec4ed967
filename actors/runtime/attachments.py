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

Reading a named file (:func:`read_named`) is blocking, for a worker thread:

- A relative path is taken from the workspace. A path inside the workspace or the
  scratchpad (judged on its words, ``..`` folded, before anything is opened) is walked from
  that directory one component at a time, each opened relative to the one before with
  ``O_NOFOLLOW``. A symbolic link on the way is never followed by the kernel: its target is
  read and walked the same way, and only while it stays beneath that same directory. A path
  elsewhere (only a host program may name one: gateway clients may not) is opened as given,
  with ``O_NOFOLLOW`` on its last component.
- The file itself is never a link (``O_NOFOLLOW`` on the last component); it is opened
  ``O_NONBLOCK``, so a FIFO never waits for a writer, and ``fstat`` on the descriptor then
  admits regular files only.
- At most ``max_bytes``: the size is checked before reading, and the read stops one byte
  past the limit (a file that grows meanwhile is refused too). An empty file is refused.

Storing (:func:`store`) writes ``<session dir>/attachments/<sha256>``, 0600, under a
temporary name, fsynced, then renamed into place, all through a descriptor of the directory
opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import base64
import binascii
import errno
import functools
import hashlib
import mimetypes
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.storage import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from greenroom.protocols.content import ImageBlock, TextBlock, UserContent
from greenroom.protocols.context import ImageSource
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES

MAX_LINKS = 40
"""Symbolic links followed (by reading them) in one path before giving up, as the kernel's
own limit."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_CHUNK = 1 << 20


class Refused(Exception):
    """A named file that cannot be taken; ``reason`` says why (for people)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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

    @property
    def source(self) -> ImageSource:
        """The same, as a request carries it to the provider."""
        return ImageSource(
            attachments_dir=str(self.directory),
            roots=tuple(str(r) for r in self.roots),
            max_bytes=self.max_bytes,
        )


def is_sha256(value: str | None) -> bool:
    """Whether ``value`` can name a private copy (64 lower-case hex digits): a hash from a
    trace or a host is a file name, and must never be a path."""
    return value is not None and _SHA256.fullmatch(value) is not None


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
        raise ImageRefused(shown, f"cannot be kept for the session: {_reason(exc)}") from None
    suffix = mimetypes.guess_extension(media_type) or ""
    return ImageBlock(path=f"inline-{digest[:12]}{suffix}", media_type=media_type, sha256=digest)


async def attach(
    blocks: Sequence[UserContent],
    attachments: Attachments,
    *,
    confine: bool = False,
    fold: bool = False,
) -> tuple[UserContent, ...]:
    """:func:`accept` in a worker thread (R-SEC-8: never on the event loop); cancelling
    abandons the thread. Input without images is returned as it is, at once."""
    if not any(isinstance(b, ImageBlock) for b in blocks):
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
    )
    try:
        digest = store(attachments.directory, data)
    except OSError as exc:
        raise Refused(f"cannot be kept for the session: {_reason(exc)}") from None
    media_type = block.media_type or mimetypes.guess_type(block.path)[0] or "image/png"
    return attrs.evolve(block, media_type=media_type, sha256=digest)


# -- reading a named file -------------------------------------------------------------------


def read_named(
    path: str,
    *,
    roots: Sequence[Path],
    max_bytes: int,
    confine: bool = False,
    workspace: tuple[int, int] | None = None,
) -> bytes:
    """The bytes of the file named ``path``, read as the module docstring says; ``roots[0]``
    (the workspace) is where a relative path starts, and, with ``workspace`` (its device and
    inode numbers), it must still be that directory. Raises :class:`Refused` naming the
    reason; never another exception for what the file system holds. Blocking."""
    try:
        start = roots[0] if roots else Path.cwd()
        absolute = os.path.normpath(os.path.join(start, os.path.expanduser(path)))
        for index, root in enumerate(roots):
            parts = _beneath(absolute, _root_names(root))
            if parts is not None:
                expected = workspace if index == 0 else None
                return _read_fd(_walk(root, parts, expected), max_bytes)
        if confine:
            raise Refused("outside the session's workspace")
        parent, name = os.path.split(absolute)
        directory = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = _open_file(name, directory)
        finally:
            os.close(directory)
        return _read_fd(fd, max_bytes)
    except OSError as exc:
        raise Refused(_reason(exc)) from None
    except ValueError:  # a NUL, a lone surrogate: no file has such a name
        raise Refused("not a name the file system can hold") from None


def _root_names(root: Path) -> tuple[str, ...]:
    """The words by which a path may name ``root``: as the session holds it and resolved
    (a data dir under a symbolic link, say)."""
    given = os.path.normpath(root)
    real = os.path.realpath(root)
    return (given,) if real == given else (given, real)


def _beneath(absolute: str, root_names: tuple[str, ...]) -> list[str] | None:
    """The components of ``absolute`` below one of ``root_names``, or None."""
    for name in root_names:
        if absolute == name:
            return []
        prefix = name if name.endswith(os.sep) else name + os.sep
        if absolute.startswith(prefix):
            return absolute[len(prefix) :].split(os.sep)
    return None


def _walk(root: Path, parts: list[str], expected: tuple[int, int] | None = None) -> int:
    """Open the file ``parts`` below ``root`` without letting the kernel follow a link
    (see the module docstring); returns its descriptor. ``expected``: the root's device
    and inode numbers, when known. Raises :class:`Refused` or OSError."""
    names = _root_names(root)
    links = 0
    while True:
        if not parts:
            raise Refused("a directory, not a file")
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if expected is not None:
                info = os.fstat(directory)
                if (info.st_dev, info.st_ino) != expected:
                    raise Refused(
                        f"the session's workspace {root} was replaced: the directory at "
                        "that path is not the one the session was created with"
                    )
            walked: list[str] = []
            for i, name in enumerate(parts):
                if i == len(parts) - 1:
                    return _open_file(name, directory)
                try:
                    inner = os.open(name, _DIR_FLAGS, dir_fd=directory)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    info = os.stat(name, dir_fd=directory, follow_symlinks=False)
                    if not stat.S_ISLNK(info.st_mode):
                        raise Refused(f"{'/'.join([*walked, name])} is not a directory") from None
                    links += 1
                    if links > MAX_LINKS:
                        raise Refused("too many levels of symbolic links") from None
                    target = os.readlink(name, dir_fd=directory)
                    resolved = _link_target(target, walked, names)
                    if resolved is None:
                        raise Refused(
                            f"{'/'.join([*walked, name])} is a symbolic link that leads "
                            "outside the session's workspace"
                        ) from None
                    parts = resolved + parts[i + 1 :]
                    break
                os.close(directory)
                directory = inner
                walked.append(name)
        finally:
            os.close(directory)


def _link_target(target: str, walked: list[str], root_names: tuple[str, ...]) -> list[str] | None:
    """A link's target as components below the root, or None when it leads out of it."""
    if os.path.isabs(target):
        return _beneath(os.path.normpath(target), root_names)
    joined = os.path.normpath(os.path.join(*walked, target) if walked else target)
    if joined == os.curdir:
        return []
    if joined == os.pardir or joined.startswith(os.pardir + os.sep):
        return None
    return joined.split(os.sep)


def _open_file(name: str, directory: int) -> int:
    try:
        return os.open(name, _FILE_FLAGS, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("a symbolic link (images are read without following links)") from None
        if exc.errno == errno.ENXIO:
            raise Refused("a socket, not a regular file") from None
        raise


def _read_fd(fd: int, max_bytes: int) -> bytes:
    """Read a whole regular file of at most ``max_bytes`` from ``fd``, and close it."""
    try:
        info = os.fstat(fd)
        kind = _special(info.st_mode)
        if kind is not None:
            raise Refused(f"{kind}, not a regular file")
        if info.st_size > max_bytes:
            raise Refused(too_big(info.st_size, max_bytes))
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise Refused(too_big(total, max_bytes, grew=True))
        if not total:
            raise Refused("an empty file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _special(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def too_big(size: int, limit: int, *, grew: bool = False) -> str:
    """Why an image of ``size`` bytes is refused under ``limit``."""
    size_text = f"more than {limit:,}" if grew else f"{size:,}"
    scaled = f"{_amount(limit)}, " if limit >= 1024 else ""
    return (
        f"{size_text} bytes; an image may have at most {limit:,} bytes "
        f"({scaled}the setting max_image_bytes)"
    )


def _amount(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = f"{size / scale:.1f}".removesuffix(".0")
            return f"{value} {unit}"
    return f"{size} bytes"


def _reason(exc: OSError) -> str:
    known = {
        errno.ENOENT: "no such file",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.ENAMETOOLONG: "the path is too long",
        errno.ELOOP: "too many levels of symbolic links",
    }
    return known.get(exc.errno or 0) or exc.strerror or type(exc).__name__


# -- the private copies ---------------------------------------------------------------------


def store(directory: Path, data: bytes) -> str:
    """Keep ``data`` as ``directory/<sha256>`` (0600; the directory 0700, created when
    missing); returns the hash. Written under a temporary name, fsynced and renamed, so a
    copy is whole or absent. Raises OSError (the directory is a link, the disk is full).
    Blocking."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        os.mkdir(directory, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:  # a session whose directory went missing gets it back
        os.makedirs(directory, PRIVATE_DIR_MODE, exist_ok=True)
    folder = os.open(directory, _DIR_FLAGS)
    try:
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


def stored(directory: str | Path, digest: str, max_bytes: int) -> bytes | None:
    """The private copy ``digest`` when it is still there, a regular file of at most
    ``max_bytes``, holding exactly the bytes of that hash; else None. Blocking."""
    if not is_sha256(digest):
        return None
    try:
        folder = os.open(directory, _DIR_FLAGS)
        try:
            fd = _open_file(digest, folder)
        finally:
            os.close(folder)
        data = _read_fd(fd, max_bytes)
    except (OSError, Refused):
        return None
    if hashlib.sha256(data).hexdigest() != digest:
        return None
    return data


def image_bytes(block: ImageBlock, source: ImageSource | None) -> bytes | None:
    """The bytes a request sends for ``block``: its private copy when it was accepted
    (never its file again), else — a block from an older trace — its file read as a named
    file is (:func:`read_named`), with the limit. None when there is nothing to send.
    Blocking."""
    max_bytes = source.max_bytes if source is not None else DEFAULT_MAX_IMAGE_BYTES
    if block.sha256 is not None:
        if source is None:
            return None
        return stored(source.attachments_dir, block.sha256, max_bytes)
    roots = tuple(Path(r) for r in source.roots) if source is not None else ()
    try:
        return read_named(block.path, roots=roots, max_bytes=max_bytes)
    except Refused:
        return None
