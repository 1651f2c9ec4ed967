"""``serve --workspace-per-principal`` (R-SEC-5, R-SEC-7): each principal's directory has a
name of its own whatever the file system does with case. It was the client id itself, so
on a case-insensitive file system (macOS, Windows) the principals ``Alice`` and ``alice``
shared one directory, and each reached the other's workspaces. A real case-insensitive
file system is not available here: the tests check that no two principals' directory
names are equal once lower-cased, through the naming function and a real gateway."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import trio
from test_gateway import BOUND_S, connect
from test_principalws_workspaces import per_principal

from greenroom.actors.gateway.config import CLIENT_ID, principal_workspace_root

LOWER = "lower-token-0123456789"
UPPER = "upper-token-0123456789"
TOKENS = {"alice": LOWER, "Alice": UPPER}


def test_lower_case_ids_keep_their_name_and_others_get_a_hash_of_the_exact_id() -> None:
    from greenroom.actors.gateway.config import principal_directory_name

    # Existing directories of lower-case ids (the usual ones) keep their names.
    for principal in ("alice", "default", "bob.smith@example", "svc:42", "a-b.c"):
        assert principal_directory_name(principal) == principal
    name = principal_directory_name("Alice")
    digest = hashlib.sha256(b"Alice").hexdigest()
    assert name.startswith("alice+") and digest.startswith(name.removeprefix("alice+"))
    # A hashed name is never a client id: no id can have it as its plain name.
    assert not CLIENT_ID.fullmatch(name)


def test_ids_differing_only_by_case_get_names_differing_whatever_the_case() -> None:
    from greenroom.actors.gateway.config import principal_directory_name

    ids = ["alice", "Alice", "ALICE", "aLiCe", "alicE", "Bob", "bob", "BOB", "x" * 63 + "Y"]
    ids.append("x" * 64)
    names = [principal_directory_name(principal) for principal in ids]
    folded = {name.lower() for name in names}
    assert len(folded) == len(ids), names
    # The same id always gets the same name: a principal finds its directory again.
    assert names == [principal_directory_name(principal) for principal in ids]


def test_principal_roots_of_ids_differing_by_case_are_distinct_directories(
    tmp_path: Path,
) -> None:
    roots = [principal_workspace_root(tmp_path, p) for p in ("alice", "Alice", "ALICE")]
    assert len({root.name.lower() for root in roots}) == 3, roots
    assert roots[0] == tmp_path / "alice"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(root.name for root in roots)


async def test_two_principals_differing_by_case_get_workspaces_apart(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    workspaces: dict[str, Any] = {}
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data", tokens=TOKENS) as server:
            for principal, token in TOKENS.items():
                async with connect(server, token=token) as client:
                    sid = (await client.result("session.create"))["session_id"]
                workspaces[principal] = server.host.get_session(sid).workspace_dir
    lower, upper = workspaces["alice"], workspaces["Alice"]
    assert lower == (root / "alice").resolve()
    assert upper.parent == root.resolve()
    # On a case-insensitive file system these would be one directory.
    assert lower.name.lower() != upper.name.lower(), (lower, upper)
