"""What a host lists of a session it holds a copy of but no longer runs is the cluster's
view (R-CLUSTER-1, R-CLUSTER-2, R-SEC-9): two in-process cluster hosts, each with its
gateway, on a real nats-server.

* a runs a session and stops; b takes it over and runs it further. a, started again on
  its data dir, lists it once, as b's (``host``), from the directory, not from its own
  stale copy. Before, a listed its copy as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.registry import SessionDirectory
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_forwarding import (
    ANSWERED_S,
    BOUND_S,
    Member,
    _client,
    _member,
    _session_on,
    _until,
)


async def _entry_names(directory: SessionDirectory, sid: str, member: Member) -> None:
    """Return once ``member`` runs ``sid`` and its directory entry says so."""

    async def there() -> bool:
        entry = await directory.get(sid)
        return member.node.serves(sid) and (entry or {}).get("host") == member.node.host_id

    await _until(there)


def test_a_restarted_host_lists_a_session_taken_over_from_it_as_the_cluster_has_it(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        directory = await SessionDirectory.open(conn)
        found: dict[str, Any] = {}
        async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
            sid = found["sid"] = await _session_on(a, conn)
            async with _client(a) as client:
                await client.result("run", {"session_id": sid, "input": "hello"})
        async with _member(conn, url, tmp_path, "b", request_timeout_s=ANSWERED_S) as b:
            await _entry_names(directory, sid, b)
            async with _client(b) as client:
                await client.result("run", {"session_id": sid, "input": "again"})
            async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
                found["copy_on_a"] = sid in {s.session_id for s in await a.host.list_sessions()}
                async with _client(a) as client:
                    found["via_a"] = (await client.result("session.list"))["sessions"]
                async with _client(b) as client:
                    found["via_b"] = (await client.result("session.list"))["sessions"]
        return found

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    sid = found["sid"]
    assert found["copy_on_a"], found  # the copy is kept: the session lives on
    via_a = [s for s in found["via_a"] if s["session_id"] == sid]
    assert len(via_a) == 1 and via_a[0].get("host") == "b", found
    from_b = next(s for s in found["via_b"] if s["session_id"] == sid)
    # The directory's view, as any session of another host: not a's copy's.
    assert "updated_at" not in via_a[0] and "title" not in via_a[0], found
    assert via_a[0]["created_at"] == from_b["created_at"], found
    assert via_a[0]["usage"] is None and via_a[0]["open"] is False, found
