"""Serving safely (R-SEC-1, R-SEC-4, R-SEC-5; CONTRACT.md "Serving safely"): real
trio-websocket clients against the real gateway on port 0, every test bounded by
``trio.fail_after`` and synchronised by messages and events, never sleeps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from test_gateway import BOUND_S, TOKEN, Client, connect, serving
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url

from greenroom.actors.gateway import (
    FD_RESERVE,
    Gateway,
    SessionDefaults,
    check_data_dir_private,
    connection_cap,
    load_tokens_file,
)
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.host import Host
from greenroom.protocols import jsonrpc

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


async def raw_send(client: Client, text: str, request_id: Any) -> Any:
    """Send ``text`` as it is (it may spell a lone surrogate) and read its answer
    (notifications read meanwhile are kept by the client)."""
    await client.ws.send_message(text)
    return await client.response(request_id)


# -- R-SEC-1: lone surrogates ------------------------------------------------------------------


async def test_lone_surrogates_in_frames_are_repaired_and_answers_are_sent(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            # An id holding a surrogate: the error answer must still be sendable.
            answer = await raw_send(
                client, '{"jsonrpc":"2.0","id":"a\\ud800","method":"no\\udfffthing"}', "a\ufffd"
            )
            assert answer["id"] == "a\ufffd"
            assert answer["error"]["code"] == jsonrpc.METHOD_NOT_FOUND
            created = await raw_send(
                client,
                '{"jsonrpc":"2.0","id":2,"method":"session.create",'
                '"params":{"model":"m\\ud800"}}',
                2,
            )
            sid = created["result"]["session_id"]
            # The session file holds no surrogate: the listing works, for every client.
            listed = await client.result("session.list")
            assert [s["model"] for s in listed["sessions"]] == ["m\ufffd"]
            await raw_send(
                client,
                '{"jsonrpc":"2.0","id":3,"method":"run",'
                f'"params":{{"session_id":"{sid}","input":"hi \\ud83d"}}}}',
                3,
            )
            await client.result("session.subscribe", {"session_id": sid})
            outputs = client.take_outputs()
            if not outputs or outputs[-1]["type"] != "task_end":
                outputs += await client.outputs_until("task_end")
            assert outputs[0]["content"] == [{"type": "text", "text": "hi \ufffd"}]
            # A key that is a surrogate is repaired too, and named in the error.
            unknown = await raw_send(
                client,
                '{"jsonrpc":"2.0","id":4,"method":"session.list","params":{"\\udc00":1}}',
                4,
            )
            assert "$.\ufffd: unknown parameter" in unknown["error"]["message"]
            assert (await client.result("session.list"))["sessions"][0]["session_id"] == sid


def test_outgoing_frames_are_always_encodable() -> None:
    frame = jsonrpc.encode(jsonrpc.result_frame("x\ud800", {"text": "\udfff", "\ud800": 1}))
    frame.encode("utf-8")  # would raise with a lone surrogate
    assert json.loads(frame) == {
        "jsonrpc": "2.0",
        "id": "x\ufffd",
        "result": {"text": "\ufffd", "\ufffd": 1},
    }


async def test_a_session_file_with_a_surrogate_does_not_poison_the_listing(
    tmp_path: Path,
) -> None:
    """A session.json written by an older version (or by hand) with a lone surrogate."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            meta_path = server.host.data_dir / "sessions" / sid / "session.json"
            meta = json.loads(meta_path.read_text())
            meta["settings"]["model"] = "\ud800"
            meta_path.write_text(json.dumps(meta))  # ensure_ascii: "\ud800" spelled out
            listed = await client.result("session.list")
            assert listed["sessions"][0]["model"] == "\ufffd"


# -- R-SEC-4: principals -----------------------------------------------------------------------


def test_tokens_file_is_parsed_and_bad_lines_are_named(tmp_path: Path) -> None:
    good = tmp_path / "tokens"
    good.write_text(f"# who may connect\nalice {ALICE}\n\n  bob   {BOB}  # the other one\n")
    assert load_tokens_file(good) == {"alice": ALICE, "bob": BOB}
    for text, problem in [
        (f"alice {ALICE}\nbob\n", ":2: expected CLIENT_ID TOKEN"),
        (f"alice {ALICE} extra\n", ":1: expected CLIENT_ID TOKEN"),
        (f"al/ice {ALICE}\n", ":1: bad client id"),
        (f"alice {ALICE}\nalice {BOB}\n", ":2: client id 'alice' given twice"),
        (f"alice {ALICE}\nbob {ALICE}\n", ":2: this token is already another client's"),
        ("alice short\n", ":1: token shorter than 16"),
        ("# nobody\n", "names no client"),
    ]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ConfigurationError) as caught:
            load_tokens_file(bad)
        assert str(bad) in str(caught.value) and problem in str(caught.value), text
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigurationError):
        load_tokens_file(bad)
    with pytest.raises(ConfigurationError):
        load_tokens_file(tmp_path / "missing")


async def test_a_token_cannot_claim_another_principal(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, tokens={"alice": ALICE, "bob": BOB}) as server:
            # On the handshake: the header must name the token's own principal.
            with pytest.raises(ConnectionRejected) as rejected:
                async with connect(server, token=BOB, client_id="alice"):
                    pass
            assert rejected.value.status_code == 403
            # With initialize: neither the client id nor a header may name another.
            async with connect(server, token=None) as bob:
                claim = await bob.error("initialize", {"token": BOB, "client_id": "alice"})
                assert claim["code"] == jsonrpc.FORBIDDEN
                assert (await bob.error("session.list"))["code"] == jsonrpc.UNAUTHORIZED
                named = await bob.result("initialize", {"token": BOB})
                assert named["client_id"] == "bob"
            async with connect(server, token=None, client_id="alice") as bob:
                claim = await bob.error("initialize", {"token": BOB})
                assert claim["code"] == jsonrpc.FORBIDDEN
            async with connect(server, token=ALICE) as alice:
                assert (await alice.result("initialize", {}))["client_id"] == "alice"
                sid = (await alice.result("session.create"))["session_id"]
            async with connect(server, token=BOB) as bob:
                # A handshake token for bob and an initialize token for alice: refused.
                swap = await bob.error("initialize", {"token": ALICE})
                assert swap["code"] == jsonrpc.UNAUTHORIZED
                assert (await bob.error("run", {"session_id": sid, "input": "x"}))["code"] == 403
                assert (await bob.result("session.list")) == {"sessions": []}
            # The one-token case is the principal `default`.
            with pytest.raises(ConnectionRejected):
                async with connect(server, token=TOKEN):
                    pass


async def test_one_token_is_the_principal_default(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server, token=None) as client:
            result = await client.result("initialize", {"token": TOKEN})
            assert result["client_id"] == "default"


# -- R-SEC-4: admission ------------------------------------------------------------------------


async def test_unauthenticated_connections_are_closed_after_the_deadline(
    tmp_path: Path,
) -> None:
    """A connection that authenticates in time keeps going after the deadline; one that
    does not is closed with 1008. The first connects first, so when the second is closed
    the first's deadline has passed too."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, auth_timeout_s=0.3) as server:
            async with connect(server, token=None) as prompt:
                await prompt.result("initialize", {"token": TOKEN})
                async with connect(server, token=None) as idle:
                    with pytest.raises(ConnectionClosed) as closed:
                        await idle.ws.get_message()
                    reason = closed.value.reason
                    assert reason is not None and reason.code == 1008
                    assert reason.reason is not None and "not authenticated" in reason.reason
                assert (await prompt.result("session.list")) == {"sessions": []}


def test_the_default_auth_deadline_is_ten_seconds() -> None:
    from greenroom.actors import gateway

    assert gateway.AUTH_TIMEOUT_S == 10.0
    assert Gateway.__init__.__kwdefaults__["auth_timeout_s"] == 10.0


async def test_connections_beyond_the_cap_are_refused_with_503(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, max_connections=2) as server:
            async with connect(server) as first, connect(server, token=None) as second:
                with pytest.raises(ConnectionRejected) as rejected:
                    async with connect(server):
                        pass
                assert rejected.value.status_code == 503
                await first.result("session.list")
                await second.result("initialize", {"token": TOKEN})
            # Closed connections free their places.
            async with connect(server) as again:
                await again.result("session.list")


def test_the_connection_cap_keeps_descriptors_in_reserve() -> None:
    assert connection_cap(1024, None) == 1024
    assert connection_cap(1024, 1_048_576) == 1024
    capped = connection_cap(1024, 1024)
    assert capped < 1024 - FD_RESERVE
    assert connection_cap(1024, 10) == 1


async def test_foreign_browser_origins_are_refused(tmp_path: Path) -> None:
    allowed = "http://app.example:3000"
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, allowed_origins=[allowed]) as server:
            server.gateway.allow_origin("http://127.0.0.1:9999/")
            for origin, status in [
                ("http://evil.example", 403),
                ("null", 403),
                ("http://127.0.0.1:9998", 403),
            ]:
                with pytest.raises(ConnectionRejected) as rejected:
                    async with open_websocket_url(
                        server.url,
                        extra_headers=[(b"Origin", origin.encode())],
                        connect_timeout=BOUND_S,
                    ):
                        pass
                assert rejected.value.status_code == status, origin
            for origin in (allowed, "HTTP://App.Example:3000", "http://127.0.0.1:9999"):
                async with open_websocket_url(
                    server.url,
                    extra_headers=[
                        (b"Origin", origin.encode()),
                        (b"Authorization", f"Bearer {TOKEN}".encode()),
                    ],
                    connect_timeout=BOUND_S,
                ) as ws:
                    await Client(ws).result("session.list")
            # No Origin: not a browser; the token decides.
            async with connect(server) as client:
                await client.result("session.list")


# -- R-SEC-5: workspaces -----------------------------------------------------------------------


async def test_client_workspaces_stay_under_the_workspace_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "project").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "inner").symlink_to(root / "project")
    (root / "file").write_text("x")
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, workspace_root=root) as server, connect(server) as client:
            for workspace, problem in [
                ("/", "file system root"),
                (str(tmp_path / "outside"), "outside the server's workspace root"),
                ("escape", "outside the server's workspace root"),
                ("../outside", "outside the server's workspace root"),
                ("project/../../outside", "outside the server's workspace root"),
                ("missing", "no such directory"),
                ("file", "not a directory"),
                ("x" * 4000, "cannot be used"),
                ("a\x00b", "cannot be used"),
            ]:
                error = await client.error("session.create", {"workspace": workspace})
                assert error["code"] == jsonrpc.INVALID_PARAMS, workspace
                assert error["message"].startswith("$.workspace: "), error
                assert problem in error["message"], (workspace, error)
            for workspace in ("project", str(root / "project"), "inner", str(root)):
                sid = (await client.result("session.create", {"workspace": workspace}))[
                    "session_id"
                ]
                resolved = server.host.get_session(sid).workspace_dir
                assert resolved.is_relative_to(root.resolve())


async def test_a_workspace_holding_the_data_dir_is_refused(tmp_path: Path) -> None:
    """The serving() data dir is tmp_path/data: a workspace root above it cannot start,
    and neither can a default workspace above it."""
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            for defaults in (
                SessionDefaults(workspace_dir=tmp_path / "ws", workspace_root=tmp_path),
                SessionDefaults(workspace_dir=tmp_path),
            ):
                gateway = Gateway(host, token=TOKEN, port=0, defaults=defaults)
                with pytest.raises(ConfigurationError) as caught:
                    await gateway.run()  # refused before it listens
                assert "data dir" in str(caught.value)
    with pytest.raises(ConfigurationError):
        check_data_dir_private(tmp_path / "a" / "data", tmp_path / "a")
    check_data_dir_private(tmp_path / "data", tmp_path / "ws")


# -- values no setting can hold ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"approval_timeout_s": 10**400}, "$.settings.approval_timeout_s"),
        ({"approval_timeout_s": -1}, "$.settings.approval_timeout_s"),
        ({"max_turns": 10**30}, "$.settings.max_turns"),
        ({"max_tokens": 0}, "$.settings.max_tokens"),
        ({"max_subagents_per_task": -2}, "$.settings.max_subagents_per_task"),
        ({"max_subagent_depth": -1}, "$.settings.max_subagent_depth"),
        ({"subagent_token_budget": -2}, "$.settings.subagent_token_budget"),
        ({"model": "m" * 500}, "$.settings.model"),
        ({"system": "s" * 200_000}, "$.settings.system"),
        ({"supports_vision": "yes"}, "$.settings.supports_vision"),
        ({"sandbox": "maybe"}, "$.settings.sandbox"),
        ({"tool_result_budget": [1]}, "$.settings.tool_result_budget"),
    ],
)
async def test_values_no_setting_can_hold_are_invalid_params(
    tmp_path: Path, settings: dict[str, Any], path: str
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            frame = json.dumps(
                {"jsonrpc": "2.0", "id": 1, "method": "session.create",
                 "params": {"settings": settings}}
            )
            answer = await raw_send(client, frame, 1)
            assert answer["error"]["code"] == jsonrpc.INVALID_PARAMS, answer
            assert answer["error"]["message"].startswith(path + ": "), answer


async def test_wrong_types_and_sizes_anywhere_are_invalid_params(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            for method, params, path in [
                ("session.create", {"workspace": 5}, "$.workspace"),
                ("session.create", {"model": "m" * 300}, "$.model"),
                ("session.create", {"settings": []}, "$.settings"),
                ("session.subscribe", {"session_id": sid, "after_seq": -1}, "$.after_seq"),
                ("session.subscribe", {"session_id": sid, "after_seq": 1.5}, "$.after_seq"),
                ("run", {"session_id": sid, "input": {"a": 1}}, "$.input"),
                ("run", {"session_id": sid, "input": [{"type": "image", "path": "a\x00"}]},
                 "$.input[0].path"),
                ("run", {"session_id": sid, "input": [{"type": "image", "path": "x" * 5000}]},
                 "$.input[0].path"),
                ("approve", {"session_id": sid, "call_id": "c", "decision": "maybe"},
                 "$.decision"),
                ("run", {"session_id": sid, "prompt": "hi"}, "$.prompt"),
            ]:
                error = await client.error(method, params)
                assert error["code"] == jsonrpc.INVALID_PARAMS, (method, params, error)
                assert error["message"].startswith(path + ": "), (method, error)
            # The session is unharmed.
            await client.result("run", {"session_id": sid, "input": "hi"})


async def test_an_unknown_parameter_names_the_accepted_ones(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            error = await client.error("run", {"session_id": sid, "prompt": "hi"})
            assert error["message"] == (
                "$.prompt: unknown parameter; run takes session_id, input, output_schema"
            )
            none = await client.error("session.list", {"x": 1})
            assert none["message"] == "$.x: unknown parameter; session.list takes no parameters"


# -- unreadable session files ------------------------------------------------------------------


BAD_META: list[bytes] = [
    b"[]",
    b'"x"',
    b'{"settings": 5}',
    b'{"created_at": "yesterday"}',
    b"\xff\xfe not utf-8",
    b"{not json",
    b'{"settings": {"max_turns": "many"}}',
]


async def test_an_unreadable_session_file_does_not_break_the_listing(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            good = (await client.result("session.create"))["session_id"]
            bad_ids = []
            for content in BAD_META:
                sid = (await client.result("session.create"))["session_id"]
                await server.host.close_session(sid)
                (server.host.data_dir / "sessions" / sid / "session.json").write_bytes(content)
                bad_ids.append(sid)
            scan = await server.host.scan_sessions()
            assert [s.session_id for s in scan.sessions if s.session_id in bad_ids] == [
                sid for sid, c in zip(bad_ids, BAD_META, strict=True) if b"many" in c
            ]  # well-formed, only a setting of the wrong type: listed, fails on load
            listed = await client.result("session.list")
            assert good in [s["session_id"] for s in listed["sessions"]]
            unreadable = {u["session_id"]: u["reason"] for u in listed["unreadable"]}
            assert set(unreadable) == set(bad_ids[:-1])
            assert all(reason and "/" not in reason for reason in unreadable.values())
            for path in (u.path for u in scan.unreadable):
                assert path.endswith("session.json")
            # Opening one is a clear error, not an internal one; the others carry on.
            for sid in bad_ids:
                error = await client.error("session.subscribe", {"session_id": sid})
                assert error["code"] == jsonrpc.NOT_FOUND, error
                assert "unreadable" in error["message"]
            await client.result("run", {"session_id": good, "input": "hi"})


def test_serve_raises_the_soft_descriptor_limit_to_the_hard_one() -> None:
    resource = pytest.importorskip("resource")
    from greenroom.actors.gateway import raise_fd_limit

    soft = raise_fd_limit()
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert now == hard or hard == resource.RLIM_INFINITY
    assert soft is None or soft == now


@pytest.mark.parametrize(
    "settings",
    [{"provider": "openai"}, {"base_url": "http://127.0.0.2:1"}, {"sandbox": "off"},
     {"shell_network": True}],
)
async def test_a_client_cannot_redirect_the_key_or_loosen_the_shell_sandbox(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    """R-SEC-3: run_shell's confinement is the server's choice, like where its key goes."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            frame = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "session.create",
                                "params": {"settings": settings}})
            answer = await raw_send(client, frame, 1)
            (name,) = settings
            assert answer["error"]["code"] == jsonrpc.INVALID_PARAMS, answer
            assert answer["error"]["message"] == f"$.settings.{name}: cannot be set by a client"


def _strict_json(text: str) -> Any:
    """``text`` read as a browser's JSON.parse reads it: ``Infinity`` and ``NaN`` refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("session.create", '{"settings":{"approval_timeout_s":1e400}}'),
        ("run", '{"session_id":"SID","input":"hi","output_schema":{"type":"object",'
                '"properties":{"a":{"type":"number","maximum":-1e999}}}}'),
    ],
    ids=["setting", "output-schema"],
)
async def test_a_number_that_reads_as_infinity_is_a_parse_error_and_never_recorded(
    tmp_path: Path, method: str, params: str
) -> None:
    """``1e400`` is valid JSON that Python reads as inf. Kept, it would be written back as
    ``Infinity`` (not JSON) in the session's records, so every replay to every subscriber
    would fail a browser's JSON.parse: it is refused as ``NaN`` is (-32700, null id) and
    the session's replay stays JSON."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            given = params.replace("SID", sid)
            await client.send(f'{{"jsonrpc":"2.0","id":"r","method":"{method}","params":{given}}}')
            answer = await client.response(None)
            assert answer["error"]["code"] == jsonrpc.PARSE_ERROR, answer
            assert "out of range (not finite once read)" in answer["error"]["message"], answer
            await client.send(
                {"jsonrpc": "2.0", "id": "s", "method": "session.subscribe",
                 "params": {"session_id": sid, "after_seq": 0}}
            )
            while True:
                message = _strict_json(await client.ws.get_message())
                if message.get("id") == "s":
                    break
            assert "result" in message, message
