"""Reading image files safely, for the runtime's attachments and the providers' requests
(R-SEC-8): a file named by a client, a model or a tool, and a session's private copies.

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

A private copy (:func:`stored`) is read only when it is still a regular file holding exactly
the bytes of its hash.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from greenroom.actors.tools.workspace import (
    OutsideWorkspaceError,
    hidden_in,
    private_relation,
    refuse_hidden,
    resolved_dirs,
    unusable_path,
)
from greenroom.protocols.content import ImageBlock
from greenroom.protocols.context import ImageSource
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES

__all__ = [
    "DIR_FLAGS",
    "MAX_LINKS",
    "Refused",
    "describe_os_error",
    "image_bytes",
    "is_sha256",
    "read_named",
    "stored",
    "too_big",
]

MAX_LINKS = 40
"""Symbolic links followed (by reading them) in one path before giving up, as the kernel's
own limit."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_CHUNK = 1 << 20


class Refused(Exception):
    """A named file that cannot be taken; ``reason`` says why (for people)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_sha256(value: str | None) -> bool:
    """Whether ``value`` can name a private copy (64 lower-case hex digits): a hash from a
    trace or a host is a file name, and must never be a path."""
    return value is not None and _SHA256.fullmatch(value) is not None


def read_named(
    path: str,
    *,
    roots: Sequence[Path],
    max_bytes: int,
    confine: bool = False,
    workspace: tuple[int, int] | None = None,
    private_dirs: Sequence[Path] = (),
) -> bytes:
    """The bytes of the file named ``path``, read as the module docstring says; ``roots[0]``
    (the workspace) is where a relative path starts, and, with ``workspace`` (its device and
    inode numbers), it must still be that directory. A path beneath several roots is walked
    from the innermost (the scratchpad, in a data dir the workspace holds). The walk from
    the workspace never enters one of ``private_dirs`` (the data dir: R-SEC-7), as the file
    tools' walk does not. Raises :class:`Refused` naming the reason; never another exception
    for what the file system holds. Blocking."""
    unusable = unusable_path(path)
    if unusable is not None:
        raise Refused(f"the path {unusable}")
    try:
        start = roots[0] if roots else Path.cwd()
        absolute = os.path.normpath(os.path.join(start, os.path.expanduser(path)))
        beneath = [
            (parts, index)
            for index, root in enumerate(roots)
            if (parts := _beneath(absolute, _root_names(root))) is not None
        ]
        if beneath:
            parts, index = min(beneath, key=lambda found: len(found[0]))
            if index != 0:
                return _read_fd(_walk(roots[index], parts), max_bytes)
            hidden = _private_in_workspace(roots[0], private_dirs)
            return _read_fd(_walk(roots[0], parts, workspace, hidden), max_bytes)
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
        raise Refused(describe_os_error(exc)) from None
    except ValueError:  # unusable_path's words should have come first; never a traceback
        raise Refused("not a name the file system can hold") from None


def _private_in_workspace(
    workspace: Path, private_dirs: Sequence[Path]
) -> frozenset[tuple[int, int]]:
    """The private directories the workspace holds (refused when it is or lies inside
    one), as the file tools judge them (:mod:`greenroom.actors.tools.workspace`)."""
    if not private_dirs:
        return frozenset()
    resolved = Path(os.path.realpath(workspace))
    private = resolved_dirs(private_dirs)
    relation = private_relation(resolved, private)
    if relation is not None:
        raise Refused(f"the session's workspace {resolved} {relation}")
    return hidden_in(resolved, private)


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


def _walk(
    root: Path,
    parts: list[str],
    expected: tuple[int, int] | None = None,
    hidden: frozenset[tuple[int, int]] = frozenset(),
) -> int:
    """Open the file ``parts`` below ``root`` without letting the kernel follow a link
    (see the module docstring); returns its descriptor. ``expected``: the root's device
    and inode numbers, when known; ``hidden``: those of the directories not to enter.
    Raises :class:`Refused` or OSError."""
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
                    inner = os.open(name, DIR_FLAGS, dir_fd=directory)
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
                try:
                    refuse_hidden(directory, hidden, "/".join(walked))
                except OutsideWorkspaceError as exc:
                    raise Refused(str(exc)) from None
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


def describe_os_error(exc: OSError) -> str:
    """An operating system error in words for people (``no such file``, ``permission
    denied``…)."""
    known = {
        errno.ENOENT: "no such file",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.ENAMETOOLONG: "the path is too long",
        errno.ELOOP: "too many levels of symbolic links",
    }
    return known.get(exc.errno or 0) or exc.strerror or type(exc).__name__


def stored(directory: str | Path, digest: str, max_bytes: int) -> bytes | None:
    """The private copy ``digest`` when it is still there, a regular file of at most
    ``max_bytes``, holding exactly the bytes of that hash; else None. Blocking."""
    if not is_sha256(digest):
        return None
    try:
        folder = os.open(directory, DIR_FLAGS)
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
    private = tuple(Path(p) for p in source.private_dirs) if source is not None else ()
    try:
        return read_named(block.path, roots=roots, max_bytes=max_bytes, private_dirs=private)
    except Refused:
        return None
