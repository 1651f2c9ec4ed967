"""A session's workspace, fixed when the session is created (R-SEC-7).

When a session is created its workspace is resolved and identified
(:func:`identify_workspace`: the resolved path and the directory's device and inode
numbers, a :class:`~greenroom.protocols.tools.WorkspaceIdentity`). Every later use opens
the directory at that path and compares its numbers (:func:`open_workspace`): a symlink
or another directory put in its place makes the call fail with :class:`WorkspaceError`,
so replacing a workspace never widens what its session reaches. The open directory is
then the root of everything the call does: paths are walked from its descriptor one
component at a time (:meth:`OpenWorkspace.locate`), never again through the workspace's
path, so nothing swapped in after the check is followed.

A private directory (the host's data dir: traces, ledger, tokens) is never reached through
a workspace: a workspace that is one or lies inside one is refused when the session is
created and again at each use; in a workspace that holds one, the walk refuses to enter
it (a directory is compared by its device and inode numbers, on the open descriptor) and
listings and searches leave it out, whatever path or symlink leads there.

Exceptions::

    BuiltinToolError              a built-in tool refused or failed (a message for the model)
    ├── OutsideWorkspaceError     a path argument leads outside the workspace
    └── WorkspaceError            the session's workspace cannot be used: replaced since
                                  the session was created, missing, or private

All functions here block (file system calls): run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePath

from greenroom.protocols.tools import WorkspaceIdentity

__all__ = [
    "DIR_FLAGS",
    "MAX_PATH_STEPS",
    "BuiltinToolError",
    "OpenWorkspace",
    "OutsideWorkspaceError",
    "Target",
    "WorkspaceError",
    "current_boot",
    "display",
    "file_error",
    "hidden_in",
    "identify_workspace",
    "keep_private_identity",
    "kept_private_identity",
    "moved_private",
    "open_unlinked",
    "open_workspace",
    "private_relation",
    "refuse_hidden",
    "resolved_dirs",
    "unusable_path",
]


class BuiltinToolError(Exception):
    """A built-in tool refused or failed; the message is meant for the model."""


class OutsideWorkspaceError(BuiltinToolError):
    """A path argument leads (after symlinks and ``..``) outside the workspace root."""


class WorkspaceError(BuiltinToolError):
    """The session's workspace cannot be used: another directory or a symlink stands
    where it was when the session was created, it is gone, or it is private (R-SEC-7)."""


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every directory below the workspace root is opened: never through a symlink."""

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PASS_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# As many symlinks as Linux follows in one path before it says ELOOP.
_MAX_LINKS = 40
MAX_PATH_STEPS = 4096
"""The most components a path may walk, its symlinks' included (a path the kernel takes
holds at most 2,048): ``a/../`` repeated makes any number of them."""
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def current_boot() -> str | None:
    """This boot of the system (Linux's boot id), or None where it is not known."""
    try:
        return _BOOT_ID.read_text(encoding="ascii").strip() or None
    except OSError:
        return None


def _drop(opened: list[int], fd: int) -> None:
    """Close ``fd``, a directory a walk opened and left, and forget it."""
    opened.remove(fd)
    os.close(fd)


def display(name: str) -> str:
    """A file name as text the model can read: bytes that are not UTF-8 as ``\\xNN``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def unusable_path(path: str) -> str | None:
    """Why no file system can hold ``path``, in words after the path (``"holds a NUL
    character"``), or None. A name read from disk that is not UTF-8 (surrogate-escaped
    bytes) is fine; a lone surrogate, which JSON can spell, is not."""
    if "\0" in path:
        return "holds a NUL character"
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return "is not valid text (it holds a lone surrogate)"
    return None


def file_error(exc: OSError, shown: str) -> BuiltinToolError:
    """An ``OSError`` as a message that names the workspace-relative path only."""
    if isinstance(exc, FileNotFoundError):
        return BuiltinToolError(f"{shown}: no such file or directory")
    if isinstance(exc, IsADirectoryError):
        return BuiltinToolError(f"{shown}: is a directory")
    if isinstance(exc, NotADirectoryError):
        return BuiltinToolError(f"{shown}: not a directory")
    if isinstance(exc, PermissionError):
        return BuiltinToolError(f"{shown}: permission denied")
    return BuiltinToolError(f"{shown}: {exc.strerror or exc}")


def private_relation(workspace: Path, private_dirs: Iterable[Path]) -> str | None:
    """Whether the resolved ``workspace`` is or lies inside one of the resolved
    ``private_dirs``, as words for a message (``"is …"``, ``"lies inside …"``), or None.
    A workspace that holds one is allowed: the private directory is hidden in it."""
    for private in private_dirs:
        if workspace == private:
            return f"is the data dir {private}"
        if workspace.is_relative_to(private):
            return f"lies inside the data dir {private}"
    return None


def resolved_dirs(private_dirs: Iterable[Path]) -> list[Path]:
    """``private_dirs`` with symlinks resolved, as :func:`private_relation` compares them."""
    return [Path(os.path.realpath(p)) for p in private_dirs]


_KEPT_PRIVATE: dict[str, tuple[int, int]] = {}
"""The device and inode numbers each private directory had when its host opened, by its
path (as given, and resolved then)."""


def keep_private_identity(directory: Path) -> None:
    """Remember which directory the private ``directory`` (a host's data dir, as the host
    opens) is: walks hide it, and sandboxes refuse to run without it at its path, wherever
    it is moved later (a sandboxed command may rename a directory above it). Blocking."""
    info = os.stat(directory)
    identity = (info.st_dev, info.st_ino)
    _KEPT_PRIVATE[str(directory)] = identity
    _KEPT_PRIVATE[os.path.realpath(directory)] = identity


def kept_private_identity(directory: Path) -> tuple[int, int] | None:
    """What :func:`keep_private_identity` remembered of ``directory``, if anything."""
    return _KEPT_PRIVATE.get(str(directory))


def hidden_in(workspace: Path, private_dirs: Iterable[Path]) -> frozenset[tuple[int, int]]:
    """The device and inode numbers of the resolved ``private_dirs`` that the resolved
    ``workspace`` holds: the directories no walk below it may enter (:func:`refuse_hidden`).
    A kept one (:func:`keep_private_identity`) is hidden wherever it is now; what stands
    at a private path is hidden too, and one that cannot be stat'ed (not created yet) is
    left out. Blocking."""
    hidden: set[tuple[int, int]] = set()
    for directory in private_dirs:
        kept = kept_private_identity(directory)
        if kept is not None:
            hidden.add(kept)
        if directory.is_relative_to(workspace):
            with contextlib.suppress(OSError):
                inner = os.stat(directory)
                hidden.add((inner.st_dev, inner.st_ino))
    return frozenset(hidden)


def moved_private(workspace: Path, private_dirs: Iterable[Path]) -> Path | None:
    """The first of the resolved ``private_dirs`` inside the resolved ``workspace`` that is
    not the directory its host opened (:func:`keep_private_identity`): moved away, or
    something else made at its path. A sandbox hides a private directory by its path, so
    it must not run then. Blocking."""
    for directory in private_dirs:
        kept = kept_private_identity(directory)
        if kept is None or not directory.is_relative_to(workspace):
            continue
        try:
            info = os.stat(directory, follow_symlinks=False)
        except OSError:
            return directory
        if (info.st_dev, info.st_ino) != kept:
            return directory
    return None


def refuse_hidden(fd: int, hidden: frozenset[tuple[int, int]], shown: str) -> None:
    """Raise :class:`OutsideWorkspaceError`, naming the directory ``shown``, when the
    directory open as ``fd`` is one of the ``hidden`` private ones (:func:`hidden_in`):
    compared on the descriptor, so no name or symlink that leads there gets in. The
    caller keeps ``fd`` either way."""
    if hidden:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) in hidden:
            raise OutsideWorkspaceError(
                f"{shown} is the host's data dir, which no session may use"
            )


def identify_workspace(
    directory: str | Path, private_dirs: Sequence[Path] = ()
) -> WorkspaceIdentity:
    """The identity of the directory ``directory`` names now (``~`` expanded, symlinks
    followed). Raises :class:`WorkspaceError` when it is not a directory, cannot be
    opened, or is or lies inside one of ``private_dirs``."""
    try:
        path = Path(directory).expanduser().resolve(strict=True)
        fd = open_unlinked(path)
    except FileNotFoundError:
        raise WorkspaceError(f"the workspace {directory} does not exist") from None
    except NotADirectoryError:
        raise WorkspaceError(f"the workspace {directory} is not a directory") from None
    except (OSError, RuntimeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WorkspaceError(f"the workspace {directory} cannot be used: {reason}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    relation = private_relation(path, resolved_dirs(private_dirs))
    if relation is not None:
        raise WorkspaceError(
            f"the workspace {path} {relation}; no session may work there: choose another "
            "workspace (or another data dir)"
        )
    return WorkspaceIdentity(
        path=path, device=info.st_dev, inode=info.st_ino, boot=current_boot()
    )


def open_unlinked(path: Path) -> int:
    """The directory at the resolved ``path``, opened one component at a time without
    following a symlink: the identity taken from it is that of the directory the path
    names, even when a component is swapped for a symlink meanwhile (then
    :class:`WorkspaceError`). Raises OSError as ``os.open`` does."""
    fd = os.open(path.anchor, _ROOT_FLAGS)
    try:
        for index, name in enumerate(path.parts[1:], start=1):
            last = index == len(path.parts) - 1
            # Search permission is enough on the way (O_PATH), as for a whole path.
            flags = DIR_FLAGS if last else _PASS_FLAGS
            try:
                inner = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise WorkspaceError(
                        f"the workspace {path} was replaced while it was opened (a symlink "
                        "stands on its path now); try again"
                    ) from None
                raise
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_workspace(
    identity: WorkspaceIdentity | None,
    directory: Path,
    private_dirs: Sequence[Path] = (),
) -> OpenWorkspace:
    """The session's workspace, opened and checked for this call: the directory at
    ``identity.path`` must be the one the identity names, and it must not be or lie
    inside one of the ``private_dirs`` (those it holds are hidden). With no identity (a
    context built by hand) the directory that ``directory`` names now is taken. Raises
    :class:`WorkspaceError`. The caller closes the result (it is a context manager)."""
    if identity is None:
        identity = identify_workspace(directory, private_dirs)
    path = identity.path
    private = resolved_dirs(private_dirs)
    relation = private_relation(path, private)
    if relation is not None:
        raise WorkspaceError(
            f"the session's workspace {path} {relation}; the call was not run"
        )
    try:
        fd = os.open(path, _ROOT_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise WorkspaceError(
                f"the session's workspace {path} is gone (nothing, or no directory, stands "
                "at its path); the call was not run"
            ) from None
        raise WorkspaceError(
            f"the session's workspace {path} cannot be opened: {exc.strerror or exc}"
        ) from None
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != (identity.device, identity.inode):
        os.close(fd)
        raise WorkspaceError(
            f"the session's workspace {path} was replaced: the directory at that path is "
            "not the one the session was created with (a symlink or another directory "
            "stands there now); the call was not run, and the session's tools will not "
            "work anywhere else"
        )
    return OpenWorkspace(fd, path, hidden_in(path, private))


class Target:
    """Where :meth:`OpenWorkspace.locate` led: ``name`` in the directory ``dir_fd``
    (it may not exist), or, with ``name`` None, the directory ``dir_fd`` itself.
    ``parts`` are the names from the workspace root to it (symlinks resolved)."""

    __slots__ = ("dir_fd", "name", "parts")

    def __init__(self, dir_fd: int, name: str | None, parts: tuple[str, ...]) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.parts = parts

    @property
    def relative(self) -> str:
        """The path from the workspace root, POSIX separators; ``.`` for the root."""
        return "/".join(self.parts) or "."


class OpenWorkspace:
    """A verified workspace held open for one call: ``fd`` is the directory, ``path``
    its resolved path when the session was created, ``hidden`` the device and inode
    numbers of the private directories it holds, which no walk enters. Descriptors
    opened while walking stay open until :meth:`close` (idempotent; also run when the
    object is collected, so that a call abandoned in a worker thread never leaks them).
    Use from one thread at a time."""

    __slots__ = ("_fds", "fd", "hidden", "path")

    def __init__(
        self, fd: int, path: Path, hidden: frozenset[tuple[int, int]] = frozenset()
    ) -> None:
        self.fd = fd
        self.path = path
        self.hidden = hidden
        self._fds: list[int] = [fd]

    def __enter__(self) -> OpenWorkspace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the workspace and every directory opened below it."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def open_dir(self, name: str, dir_fd: int, *, shown: str) -> int:
        """Open the directory ``name`` of ``dir_fd`` (never through a symlink, never a
        hidden one); closed with the workspace. Raises ``OSError`` or
        :class:`OutsideWorkspaceError` (naming it ``shown``)."""
        fd = self.enter(name, dir_fd, shown=shown)
        self._fds.append(fd)
        return fd

    def enter(self, name: str, dir_fd: int, *, shown: str) -> int:
        """A new descriptor of the directory ``name`` of ``dir_fd``, opened without
        following a symlink; :class:`OutsideWorkspaceError` when it is a private
        directory the workspace holds (checked on the descriptor). The caller closes
        it."""
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        try:
            refuse_hidden(fd, self.hidden, shown)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def is_hidden(self, entry: os.DirEntry[str]) -> bool:
        """Whether a directory entry is a private directory (left out of listings)."""
        if not self.hidden or not entry.is_dir(follow_symlinks=False):
            return False
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) in self.hidden

    def release(self, target: Target) -> None:
        """Close ``target``'s directory now, unless it is the workspace root (a walk
        that locates many files keeps few descriptors open)."""
        if target.dir_fd != self.fd and target.dir_fd in self._fds:
            self._fds.remove(target.dir_fd)
            os.close(target.dir_fd)

    def locate(self, path: str, *, make_parents: bool = False) -> Target:
        """Walk ``path`` (relative to the workspace, or absolute) from the workspace
        descriptor, one component at a time: a symlink is read and its target walked in
        turn (an absolute one only when it points inside the workspace), ``..`` never
        climbs above the root. Missing directories on the way are created with
        ``make_parents``; the last component need not exist. The target's directory
        stays open until :meth:`release` or :meth:`close`. Raises
        :class:`OutsideWorkspaceError`, or :class:`BuiltinToolError` naming the
        workspace-relative path."""
        opened: list[int] = []
        kept = self.fd
        try:
            target = self._walk(path, opened, make_parents)
            kept = target.dir_fd
            return target
        finally:
            for fd in opened:
                if fd == kept:
                    self._fds.append(fd)
                else:
                    os.close(fd)

    def _walk(self, path: str, opened: list[int], make_parents: bool) -> Target:
        stack = [self.fd]
        names: list[str] = []
        pending = list(reversed(self._parts(path, path)))
        links = steps = 0
        while pending:
            name = pending.pop()
            steps += 1
            if steps > MAX_PATH_STEPS:
                raise BuiltinToolError(
                    f"path {display(path[:200])!r} has more than {MAX_PATH_STEPS} components"
                )
            if name in ("", "."):
                continue
            if name == "..":
                if not names:
                    raise _outside(path)
                # Closed now: a path that goes down and up again would hold one
                # descriptor a step until the walk ends (and run the process out of them).
                _drop(opened, stack.pop())
                names.pop()
                continue
            at = stack[-1]
            shown = display("/".join([*names, name]))
            try:
                try:
                    info = os.stat(name, dir_fd=at, follow_symlinks=False)
                except FileNotFoundError:
                    if not pending:
                        return Target(at, name, (*names, name))
                    # What is missing holds no symlink: the rest is names only, and
                    # climbing out through it is refused like any other way out.
                    if _climbs_out(len(names), [name, *reversed(pending)]):
                        raise _outside(path) from None
                    if not make_parents:
                        raise
                    os.mkdir(name, dir_fd=at)
                    info = os.stat(name, dir_fd=at, follow_symlinks=False)
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    if links > _MAX_LINKS:
                        raise BuiltinToolError(f"{shown}: too many levels of symbolic links")
                    target = os.readlink(name, dir_fd=at)
                    if os.path.isabs(target):
                        while len(stack) > 1:
                            _drop(opened, stack.pop())
                        names.clear()
                    pending.extend(reversed(self._parts(target, path)))
                    continue
                if not pending:
                    return Target(at, name, (*names, name))
                if not stat.S_ISDIR(info.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory")
                fd = self.enter(name, at, shown=shown)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # swapped for a symlink since the stat
                    raise BuiltinToolError(f"{shown} changed while it was read; try again") from exc
                raise file_error(exc, shown) from exc
            opened.append(fd)
            stack.append(fd)
            names.append(name)
        return Target(stack[-1], None, tuple(names))

    def _parts(self, path: str, argument: str) -> tuple[str, ...]:
        """The components of ``path`` to walk from the root (an absolute path must lie in
        the workspace, spelled as its resolved path or through symlinks to it)."""
        unusable = unusable_path(path)
        if unusable is not None:
            raise BuiltinToolError(f"path {argument!r} {unusable}")
        pure = PurePath(path)
        if not pure.is_absolute():
            return pure.parts
        if pure.is_relative_to(self.path):
            return pure.relative_to(self.path).parts
        # Another spelling of a path inside (through a symlink to the workspace, say):
        # what it resolves to is only a list of names, walked from the verified root.
        real = Path(os.path.realpath(path))
        if real.is_relative_to(self.path):
            return real.relative_to(self.path).parts
        raise _outside(argument)


def _climbs_out(depth: int, names: Sequence[str]) -> bool:
    """Whether ``names``, walked by name from ``depth`` levels below the root, climb
    above it."""
    for name in names:
        if name == "..":
            depth -= 1
            if depth < 0:
                return True
        elif name not in ("", "."):
            depth += 1
    return False


def _outside(path: str) -> OutsideWorkspaceError:
    return OutsideWorkspaceError(
        f"path {path!r} is outside the workspace; only paths inside the workspace may be used"
    )
