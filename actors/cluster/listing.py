"""``session.list`` over the whole cluster (R-CLUSTER-1): the caller's sessions that this
host's data dir does not list, from the session directory, and the cluster's view of those
it lists but no longer runs.

A gateway lists the sessions its own data dir holds as on one host; in a cluster it adds,
from one pass over the directory bucket (:meth:`SessionDirectory.entries`), every other
session the caller may see — one whose entry names the caller among its principals, or
granted at this gateway, or a node of a tree whose root is so (R-TREE-1), the rule calls
on it are checked by (:meth:`ClusterRouter.holds`). Such an entry carries what the
directory knows (:func:`listed_from_entry`) and ``host``, the host that runs or last ran it;
a closed session is listed too (it is still its user's).

The data dir's copy of a session this host does not run is not the cluster's truth when
the directory says otherwise (:func:`superseded`): a session another host took over (its
entry names that host) is listed from its entry, as any session of another host; one the
cluster deleted (its entry removed: the pass reads the delete marker the bucket keeps) is
not listed at all, while the copy waits to be removed (:mod:`.deleted_copies`). So too
``Host.list_sessions`` of a cluster host (:func:`stale_copies`): it lists the host's own
sessions, not such a copy.

Bounded: the pass reads at most :data:`MAX_DIRECTORY_ENTRIES` entries within ``bound_s``,
and one pass answers a gateway's calls for :data:`PASS_REUSE_S` (:class:`DirectoryPasses`);
a directory that cannot be read leaves the local listing as it is, with a note saying why
(``cluster``), and a longer one is listed in part, with a note saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import trio

from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.placements import PLACEMENT_FIELD, PlacementRecords
from greenroom.actors.cluster.registry import DirectoryPass, SessionDirectory
from greenroom.actors.runtime.host import stored_root

__all__ = [
    "MAX_DIRECTORY_ENTRIES",
    "PASS_REUSE_S",
    "DirectoryPasses",
    "listed_from_entry",
    "sessions_elsewhere",
    "stale_copies",
    "superseded",
    "visible",
]

MAX_DIRECTORY_ENTRIES = 10_000
"""How many directory entries one ``session.list`` reads at most (the oldest written first):
past that, the sessions written last are left out and the answer's ``cluster`` says so."""


PASS_REUSE_S = 1.0
"""How long one pass over the directory answers every ``session.list`` of a gateway: a
console asks for its list at each burst of outputs, and a pass reads every entry of the
cluster. A session another host made shows up that much later at most."""


class DirectoryPasses:
    """One gateway's passes over the session directory: a pass younger than
    :data:`PASS_REUSE_S` answers the calls that come meanwhile, and calls that come during
    a pass wait for it rather than make their own."""

    __slots__ = ("_directory", "_last", "_last_at", "_lock")

    def __init__(self, directory: SessionDirectory) -> None:
        self._directory = directory
        self._lock = trio.Lock()
        self._last: DirectoryPass | None = None
        self._last_at = 0.0

    async def read(self) -> DirectoryPass:
        """The entries of the last pass, or of a new one (see
        :meth:`SessionDirectory.entries`). Raises :class:`ClusterUnavailable`."""
        async with self._lock:
            if self._last is None or trio.current_time() - self._last_at >= PASS_REUSE_S:
                self._last = await self._directory.entries(limit=MAX_DIRECTORY_ENTRIES)
                self._last_at = trio.current_time()
            return self._last


async def sessions_elsewhere(
    passes: DirectoryPasses,
    principal: str,
    granted: frozenset[str],
    listed: frozenset[str],
    *,
    bound_s: float,
    host_id: str,
    serves: Callable[[str], bool],
    withdrawn: Container[str] = (),
    placements: PlacementRecords | None = None,
) -> tuple[list[dict[str, Any]], frozenset[str], str | None]:
    """The sessions of the directory ``principal`` may see (``granted``: those granted to it
    at this gateway) that host ``host_id``'s own listing, ``listed``, does not answer for,
    newest first; the sessions of ``listed`` whose copy here the cluster's view supersedes
    (:func:`superseded`: left out of the host's listing, those still in the directory
    listed among the first); and a note when the directory was not read whole (None when
    it was). ``serves`` says which sessions the host runs. A session made for a placement
    of ``withdrawn``, or one ``placements`` records withdrawn, is left out: it is on its
    way out of the cluster (:mod:`.placements`)."""
    try:
        with trio.fail_after(bound_s):
            read = await passes.read()
    except ClusterUnavailable as exc:
        return [], frozenset(), f"unavailable: {exc}"
    except trio.TooSlowError:
        why = f"unavailable: the session directory was not read within {bound_s:g} s"
        return [], frozenset(), why
    entries = read.entries
    stale = superseded(listed, read, host_id, serves)
    answered_here = listed - stale
    shown = {
        session_id: entry
        for session_id, entry in entries.items()
        if session_id not in answered_here
        and visible(principal, session_id, entry, entries, granted)
        and not _withdrawn(entry, withdrawn)
    }
    if placements is not None:
        # Any gateway may have withdrawn it, not only this one: the cluster's record says.
        gone = await _withdrawn_elsewhere(placements, shown.values(), bound_s)
        shown = {sid: entry for sid, entry in shown.items() if not _withdrawn(entry, gone)}
    found = [listed_from_entry(session_id, entry) for session_id, entry in shown.items()]
    found.sort(key=lambda s: s.get("created_at", 0.0), reverse=True)
    if read.whole:
        return found, stale, None
    partial = (
        f"partial: only the first {MAX_DIRECTORY_ENTRIES} entries of the session directory "
        "were read; sessions written to it later are not listed"
    )
    return found, stale, partial


async def stale_copies(
    passes: DirectoryPasses,
    listed: frozenset[str],
    *,
    bound_s: float,
    host_id: str,
    serves: Callable[[str], bool],
) -> frozenset[str]:
    """The sessions of ``listed`` (held in host ``host_id``'s data dir) whose copy there
    the cluster supersedes (:func:`superseded`; ``serves``: the sessions the host runs),
    for ``Host.list_sessions``; none when the directory cannot be read within
    ``bound_s``: then the data dir's listing stands, as in ``session.list``."""
    try:
        with trio.fail_after(bound_s):
            read = await passes.read()
    except (ClusterUnavailable, trio.TooSlowError):
        return frozenset()
    return superseded(listed, read, host_id, serves)


def superseded(
    listed: Iterable[str], read: DirectoryPass, host_id: str, serves: Callable[[str], bool]
) -> frozenset[str]:
    """The sessions of ``listed`` (held in host ``host_id``'s data dir) whose copy there is
    not the cluster's truth, as of directory pass ``read``: the host does not run it
    (``serves``) and the cluster deleted it, or its entry names another host (one that took
    it over, or opened it after this host closed it). A session the directory does not know
    (never published, or past what the pass read) stays the host's own."""
    stale: set[str] = set()
    for session_id in listed:
        if serves(session_id):
            continue
        host = (read.entries.get(session_id) or {}).get("host")
        if session_id in read.deleted or (isinstance(host, str) and host != host_id):
            stale.add(session_id)
    return frozenset(stale)


def visible(
    principal: str,
    session_id: str,
    entry: Mapping[str, Any],
    entries: Mapping[str, Mapping[str, Any]],
    granted: frozenset[str],
) -> bool:
    """Whether ``principal`` may see ``session_id`` (directory ``entry``; ``entries``: the
    directory read, for its tree's root): granted here, among its principals, or so for
    the root of its tree."""
    if session_id in granted or principal in _principals(entry):
        return True
    meta = entry.get("meta")
    root_id = stored_root(meta if isinstance(meta, dict) else {}, session_id)
    if root_id == session_id:
        return False
    return root_id in granted or principal in _principals(entries.get(root_id) or {})


def listed_from_entry(session_id: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The ``session.list`` entry of a session known only from its directory ``entry``:
    what its ``session.json`` says (``created_at``, ``workspace_dir``, ``provider``,
    ``model``, ``parent_id``, ``root_id``), ``open`` false (not open here), ``busy`` and
    ``state`` (``running`` or ``idle``: whether a person is awaited is known on its host
    only) from whether its task runs, ``usage`` null (its ledger is its host's) and
    ``host``. What only its host knows (``updated_at``, ``trace_files``, ``auth_locked``,
    ``title``, ``last_activity_at``) is left out."""
    raw_meta = entry.get("meta")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    raw_settings = meta.get("settings")
    settings: Mapping[str, Any] = raw_settings if isinstance(raw_settings, dict) else {}
    parent_id = meta.get("parent_id")
    running = entry.get("running") is True and not entry.get("closed")
    listed: dict[str, Any] = {"session_id": session_id}
    created_at = meta.get("created_at")
    if isinstance(created_at, int | float) and not isinstance(created_at, bool):
        listed["created_at"] = float(created_at)
    for field, source in (
        ("workspace_dir", meta.get("workspace_dir")),
        ("provider", settings.get("provider")),
        ("model", settings.get("model")),
    ):
        if isinstance(source, str):
            listed[field] = source
    host = entry.get("host")
    return {
        **listed,
        "parent_id": parent_id if isinstance(parent_id, str) else None,
        "root_id": stored_root(meta, session_id),
        "open": False,
        "busy": running,
        "state": "running" if running else "idle",
        "usage": None,
        "host": host if isinstance(host, str) else None,
    }


def _withdrawn(entry: Mapping[str, Any], withdrawn: Container[str]) -> bool:
    placement = entry.get(PLACEMENT_FIELD)
    return isinstance(placement, str) and placement in withdrawn


async def _withdrawn_elsewhere(
    placements: PlacementRecords, entries: Iterable[Mapping[str, Any]], bound_s: float
) -> Container[str]:
    """The placements named by ``entries`` that the cluster records withdrawn; none when
    the records cannot be read within ``bound_s`` (those sessions are listed, as before
    any withdrawal). Only a placed session whose first task has not started names one."""
    named = {e[PLACEMENT_FIELD] for e in entries if isinstance(e.get(PLACEMENT_FIELD), str)}
    if not named:
        return ()
    with trio.move_on_after(bound_s):
        try:
            return await placements.withdrawn_among(named)
        except ClusterUnavailable:
            pass
    return ()


def _principals(entry: Mapping[str, Any]) -> tuple[str, ...]:
    principals = entry.get("principals")
    if not isinstance(principals, list):
        return ()
    return tuple(p for p in principals if isinstance(p, str))
