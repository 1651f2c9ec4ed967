"""``serve --workspace-per-principal`` (R-SEC-5): each principal's workspaces resolve under
``<workspace root>/<principal id>``, its default workspace too, through the websocket,
AG-UI and A2A alike; without the flag the principals share the root. Real gateways on
port 0, real websocket and HTTP clients, scripted models."""

from __future__ import annotations

import json
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from test_gateway import BOUND_S, Server, connect, serving

from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"
TOKENS = {"alice": ALICE, "bob": BOB}


@asynccontextmanager
async def per_principal(
    root: Path, data: Path, *, tokens: dict[str, str] = TOKENS, **gateway_options: Any
) -> AsyncIterator[Server]:
    """A host (data dir ``data``) and its gateway for the principals of ``tokens`` (alice
    and bob unless told), confined each to its own directory under ``root``; every
    session's model answers "hi"."""
    made: list[ScriptedProvider] = []

    def factory() -> ScriptedProvider:
        made.append(ScriptedProvider([Reply(blocks=(text("hi"),))]))
        return made[-1]

    async with Host.open(data) as host, trio.open_nursery() as nursery:
        gateway = Gateway(
            host,
            tokens=tokens,
            listen_host="127.0.0.1",
            port=0,
            defaults=SessionDefaults(
                provider_factory=factory,
                workspace_dir=root,
                workspace_root=root,
                workspace_per_principal=True,
            ),
            **gateway_options,
        )
        await nursery.start(gateway.run)
        yield Server(host=host, gateway=gateway, providers=made)
        nursery.cancel_scope.cancel()


def workspace_of(server: Server, session_id: str) -> Path:
    return server.host.get_session(session_id).workspace_dir


async def test_bob_cannot_name_alices_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data") as server:
            async with connect(server, token=ALICE) as alice:
                sid = (await alice.result("session.create"))["session_id"]
            alices = (root / "alice").resolve()
            assert workspace_of(server, sid) == alices
            (alices / "project").mkdir()
            (alices / "project" / "secret.txt").write_text("alice's")
            async with connect(server, token=BOB) as bob:
                for named in (
                    str(alices / "project"),
                    str(alices),
                    "../alice/project",
                    str(root),
                    "..",
                ):
                    error = await bob.error("session.create", {"workspace": named})
                    assert error["code"] == jsonrpc.INVALID_PARAMS, named
                    assert error["message"].startswith("$.workspace: "), error
                    assert "outside the server's workspace root" in error["message"], error
                    # The root it names is bob's own, not the shared one.
                    assert error["message"].endswith(str(root.resolve() / "bob")), error
            async with connect(server, token=ALICE) as alice:
                # Alice's own names are hers to use, relative ones from her directory.
                sid = (await alice.result("session.create", {"workspace": "project"}))["session_id"]
                assert workspace_of(server, sid) == alices / "project"


async def test_bobs_default_workspace_is_his_own_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data") as server:
            async with connect(server, token=BOB) as bob:
                sid = (await bob.result("session.create"))["session_id"]
                again = (await bob.result("session.create", {"workspace": "."}))["session_id"]
            bobs = (root / "bob").resolve()
            assert workspace_of(server, sid) == bobs
            assert workspace_of(server, again) == bobs
            assert stat.S_IMODE(bobs.stat().st_mode) & 0o077 == 0
            assert not (root / "alice").exists()  # made on first use only


async def test_a_symlink_in_bobs_directory_into_alices_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "alice" / "project").mkdir(parents=True)
    (root / "bob").mkdir(mode=0o700)
    (root / "bob" / "peek").symlink_to(root / "alice" / "project")
    (root / "bob" / "mine").mkdir()
    (root / "bob" / "inner").symlink_to(root / "bob" / "mine")
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data") as server:
            async with connect(server, token=BOB) as bob:
                for named in ("peek", str(root / "bob" / "peek")):
                    error = await bob.error("session.create", {"workspace": named})
                    assert error["code"] == jsonrpc.INVALID_PARAMS, named
                    assert error["message"].startswith("$.workspace: "), error
                    assert "outside the server's workspace root" in error["message"], error
                sid = (await bob.result("session.create", {"workspace": "inner"}))["session_id"]
            assert workspace_of(server, sid) == (root / "bob" / "mine").resolve()


async def test_a_principal_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """bob's directory itself standing as a symlink to alice's is no directory of his."""
    root = tmp_path / "root"
    (root / "alice").mkdir(parents=True)
    (root / "bob").symlink_to(root / "alice")
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data") as server:
            async with connect(server, token=BOB) as bob:
                for params in ({}, {"workspace": "."}):
                    error = await bob.error("session.create", params)
                    assert error["code"] == jsonrpc.INVALID_PARAMS, params
                    assert error["message"].startswith("$.workspace: "), error


def test_a_client_id_that_names_no_directory_of_its_own_is_refused(tmp_path: Path) -> None:
    from greenroom.actors.gateway.config import principal_workspace_root

    for principal in (".", "..", "a/b", ""):
        with pytest.raises(RpcError) as caught:
            principal_workspace_root(tmp_path, principal)
        assert caught.value.code == jsonrpc.INVALID_PARAMS
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _post(url: str, token: str, body: dict[str, Any], accept: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", "Accept": accept}
    with httpx.Client(timeout=BOUND_S) as client:
        response = client.post(url, content=json.dumps(body).encode(), headers=headers)
        response.read()
        return response


async def test_ag_ui_threads_and_a2a_contexts_work_in_the_principals_directory(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with trio.fail_after(BOUND_S):
        async with per_principal(root, tmp_path / "data", ag_ui=True, a2a=True) as server:
            base = f"http://127.0.0.1:{server.gateway.port}"
            run = {
                "threadId": "thread-b",
                "runId": "run-1",
                "messages": [{"id": "u1", "role": "user", "content": "hello"}],
                "tools": [],
                "context": [],
                "state": {},
                "forwardedProps": {},
            }
            answer = await trio.to_thread.run_sync(
                lambda: _post(f"{base}/ag-ui", BOB, run, "text/event-stream")
            )
            assert answer.status_code == 200, answer.text
            assert workspace_of(server, "thread-b") == (root / "bob").resolve()
            message = {
                "kind": "message",
                "messageId": "m1",
                "role": "user",
                "parts": [{"kind": "text", "text": "hello"}],
            }
            send = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "message/send",
                "params": {"message": message},
            }
            reply = await trio.to_thread.run_sync(
                lambda: _post(f"{base}/a2a", ALICE, send, "application/json")
            )
            context = reply.json()["result"]["contextId"]
            assert workspace_of(server, context) == (root / "alice").resolve()


async def test_without_the_flag_the_principals_share_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "alice" / "project").mkdir(parents=True)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, workspace_root=root, tokens=TOKENS) as server:
            async with connect(server, token=BOB) as bob:
                named = str(root / "alice" / "project")
                sid = (await bob.result("session.create", {"workspace": named}))["session_id"]
                default = (await bob.result("session.create"))["session_id"]
            assert workspace_of(server, sid) == (root / "alice" / "project").resolve()
            assert workspace_of(server, default) == tmp_path / "workspace"
            assert not (root / "bob").exists()


@pytest.mark.parametrize("given", [True, False])
def test_the_serve_flag_reaches_the_session_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: bool
) -> None:
    from greenroom.actors import gateway
    from greenroom.actors.apps.parser import build_parser
    from greenroom.actors.apps.serve_command import serve_command

    seen: list[SessionDefaults] = []

    async def fake_run_serve(**options: Any) -> None:
        seen.append(options["defaults"])

    monkeypatch.setattr(gateway, "run_serve", fake_run_serve)
    (tmp_path / "ws").mkdir()
    flag = ["--workspace-per-principal"] if given else []
    args = build_parser().parse_args(
        ["serve", "--no-console", "--data-dir", str(tmp_path / "data"),
         "--workspace", str(tmp_path / "ws"), *flag]
    )  # fmt: skip
    args.observers = ()  # what the CLI's main adds
    assert serve_command(args) == 0
    assert [d.workspace_per_principal for d in seen] == [given]
