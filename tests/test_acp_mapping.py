"""The sans-IO half of ``greenroom acp`` (R-ACP-1): frames, the output → ``session/update``
mapping (live and replay), subagent outputs on the parent's ``spawn_subagent`` call, stop
reasons. Every update is validated strictly against the official ACP SDK's schema."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from acp.schema import (
    ListSessionsResponse,
    PromptResponse,
    RequestPermissionRequest,
    SessionModeState,
    SessionNotification,
)

from greenroom.protocols import acp
from greenroom.protocols.content import ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.jsonrpc import FrameError, Notification, Request, RpcError
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    RequestEnd,
    TaskEnd,
    TokenUsageOutput,
    ToolCallOutput,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage

SID = "20260101-000000-aaaaaa"
CHILD = "20260101-000001-bbbbbb"
COMMON: dict[str, Any] = {"session_id": SID, "run_id": "run-1"}


def strict(model: type[pydantic.BaseModel], data: Any) -> None:
    parsed = model.model_validate(data)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == data


def checked(updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for update in updates:
        strict(SessionNotification, {"sessionId": SID, "update": update})
    return updates


def call(call_id: str, name: str, **arguments: Any) -> ToolCallBlock:
    return ToolCallBlock(id=call_id, name=name, arguments=arguments)


def end(status: str = "completed", message: str | None = None, **extra: Any) -> TaskEnd:
    return TaskEnd(
        **COMMON, status=status, turns=1, usage=TokenUsage(), wall_ms=1, message=message, **extra
    )  # type: ignore[arg-type]


def child(output_type: type[Output], **fields: Any) -> Output:
    return output_type(session_id=CHILD, run_id="run-c", origin=(SID, CHILD), **fields)


# -- frames ----------------------------------------------------------------------------------


def test_splitter_joins_pieces_and_drops_overlong_lines() -> None:
    splitter = acp.LineSplitter(max_bytes=10)
    assert splitter.feed(b'{"a"') == []
    assert splitter.feed(b":1}\nxx") == [b'{"a":1}']
    out = splitter.feed(b"x" * 20)
    assert out == []
    out = splitter.feed(b"yy\nok\n")
    assert isinstance(out[0], acp.TooLong) and out[1:] == [b"ok"]
    assert splitter.feed(b"tail") == []
    assert splitter.close() == [b"tail"]


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"nope", -32700),
        (b"\xff", -32700),
        (b"NaN", -32700),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"x":1e999}}', -32700),
        (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":' + b"9" * 5000 + b"}}", -32700),
        (b"[]", -32600),
        (b"[" * 100 + b"]" * 100, -32600),
        (b'{"jsonrpc":"2.0","id":true,"method":"x"}', -32600),
        (b'{"jsonrpc":"1.0","id":1,"method":"x"}', -32600),
        (b'{"jsonrpc":"2.0","id":1,"method":"x","params":[1]}', -32602),
        (b'{"jsonrpc":"2.0","result":{}}', -32600),
    ],
)
def test_malformed_frames_become_errors(line: bytes, code: int) -> None:
    message = acp.parse_message(line)
    assert isinstance(message, FrameError)
    assert message.error.code == code


def test_calls_and_responses_are_told_apart() -> None:
    request = acp.parse_message(b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{}}')
    assert isinstance(request, Request) and request.method == "session/new"
    note = acp.parse_message(b'{"jsonrpc":"2.0","method":"session/cancel","params":{}}')
    assert isinstance(note, Notification)
    response = acp.parse_message(b'{"jsonrpc":"2.0","id":7,"result":{"outcome":{}}}')
    assert isinstance(response, acp.Response) and response.id == 7


def test_prompt_blocks_become_user_content() -> None:
    parts = acp.parse_prompt(
        {
            "prompt": [
                {"type": "text", "text": "look"},
                {"type": "image", "data": "aGk=", "mimeType": "image/png"},
                {"type": "resource_link", "uri": "file:///w/a.py", "name": "a.py"},
                {"type": "resource", "resource": {"uri": "file:///w/b.py", "text": "x = 1"}},
            ]
        }
    )
    assert parts[0] == TextBlock(text="look")
    assert parts[1] == acp.InlineImage(data="aGk=", mime_type="image/png")
    assert parts[2] == acp.LinkedResource(uri="file:///w/a.py", text="[resource: a.py] file:///w/a.py")
    assert isinstance(parts[3], TextBlock) and "x = 1" in parts[3].text
    for bad in ([], "text", [{"type": "audio", "data": "", "mimeType": "audio/wav"}], [3]):
        with pytest.raises(RpcError) as info:
            acp.parse_prompt({"prompt": bad})
        assert info.value.code == -32602


def test_session_ids_that_could_name_other_directories_are_unknown() -> None:
    for bad in ("../x", "/etc", ".hidden", "a/b"):
        with pytest.raises(RpcError) as info:
            acp.session_id_of({"sessionId": bad})
        assert info.value.code == acp.RESOURCE_NOT_FOUND


def test_mcp_servers_keep_greenrooms_shape() -> None:
    config = acp.mcp_servers_config(
        [
            {"name": "fs", "command": "/bin/fs", "args": ["-v"],
             "env": [{"name": "A", "value": "1"}]},
            {"type": "http", "name": "web", "url": "http://x",
             "headers": [{"name": "H", "value": "v"}]},
        ]
    )  # fmt: skip
    assert config == {
        "fs": {"command": "/bin/fs", "args": ["-v"], "env": {"A": "1"}},
        "web": {"type": "http", "url": "http://x", "headers": {"H": "v"}},
    }


# -- the mapping -----------------------------------------------------------------------------


def test_live_text_and_thinking_stream_once() -> None:
    mapper = acp.UpdateMapper(live=True)
    updates = checked(
        mapper.map_all(
            [
                UserMsg(**COMMON, kind="prompt", content=(TextBlock(text="hi"),)),
                PartialThinking(**COMMON, index=0, text="hmm"),
                ModelMsg(**COMMON, turn=1, block=ThinkingBlock(text="hmm")),
                PartialText(**COMMON, index=1, text="Hel"),
                PartialText(**COMMON, index=1, text="lo"),
                ModelMsg(**COMMON, turn=1, block=TextBlock(text="Hello")),
            ]
        )
    )
    assert [(u["sessionUpdate"], u["content"]["text"]) for u in updates] == [
        ("agent_thought_chunk", "hmm"),
        ("agent_message_chunk", "Hel"),
        ("agent_message_chunk", "lo"),
    ]


def test_replay_sends_the_users_messages_and_complete_blocks() -> None:
    mapper = acp.UpdateMapper(live=False, load_image=lambda image: ("image/png", "aGk="))
    updates = checked(
        mapper.map_all(
            [
                UserMsg(
                    **COMMON,
                    kind="prompt",
                    content=(TextBlock(text="hi"), ImageBlock(path="/w/a.png")),
                ),
                ModelMsg(**COMMON, turn=1, block=ThinkingBlock(text="hmm")),
                ModelMsg(**COMMON, turn=1, block=TextBlock(text="Hello")),
            ]
        )
    )
    assert [u["sessionUpdate"] for u in updates] == [
        "user_message_chunk",
        "user_message_chunk",
        "agent_thought_chunk",
        "agent_message_chunk",
    ]
    assert updates[1]["content"] == {"type": "image", "data": "aGk=", "mimeType": "image/png"}


def test_every_tool_call_ends_completed_or_failed() -> None:
    mapper = acp.UpdateMapper(live=True, workspace="/w")
    outputs: list[Output] = [
        ModelMsg(**COMMON, turn=1, block=call("c1", "read_file", path="a.txt")),
        ModelMsg(**COMMON, turn=1, block=call("c2", "run_shell", command="make")),
        ModelMsg(**COMMON, turn=1, block=call("c3", "write_file", path="b", content="")),
        ApprovalDecision(**COMMON, call_id="c1", tool="read_file", decision="allow", by="host"),
        ApprovalDecision(**COMMON, call_id="c2", tool="run_shell", decision="deny", by="host"),
        ToolCallOutput(
            **COMMON, call_id="c1", tool="read_file", status="ok", is_error=False,
            content=(TextBlock(text="text"),),
        ),
        ToolCallOutput(
            **COMMON, call_id="c2", tool="run_shell", status="denied", is_error=True,
            content=(TextBlock(text="Tool call denied by user."),),
        ),
        Abort(**COMMON, reason="cancelled"),
        end("aborted"),
    ]  # fmt: skip
    updates = checked(mapper.map_all(outputs))
    starts = [u for u in updates if u["sessionUpdate"] == "tool_call"]
    assert [(u["kind"], u["title"]) for u in starts] == [
        ("read", "Read a.txt"),
        ("execute", "Run `make`"),
        ("edit", "Write b"),
    ]
    assert starts[0]["locations"] == [{"path": "/w/a.txt"}]
    finals = {
        u["toolCallId"]: (u["status"], u["_meta"]["greenroom"]["status"])
        for u in updates
        if u.get("status") in ("completed", "failed")
    }
    assert finals == {
        "c1": ("completed", "ok"),
        "c2": ("failed", "denied"),
        "c3": ("failed", "interrupted"),
    }


def test_subagent_outputs_are_updates_of_the_spawn_call() -> None:
    """R-HOST-4 through ACP: a subagent's outputs (origin set) never start a stream of
    their own: they update the parent's spawn_subagent call, with the origin in _meta; a
    permission for the subagent's call is asked on that call."""
    mapper = acp.UpdateMapper(live=True)
    spawn = call("s1", "spawn_subagent", task="count the files")
    other = call("s2", "spawn_subagent", task="read the notes")
    inner = call("k1", "list_dir", path=".")
    updates = checked(
        mapper.map_all(
            [
                ModelMsg(**COMMON, turn=1, block=spawn),
                ModelMsg(**COMMON, turn=1, block=other),
                ApprovalDecision(
                    **COMMON, call_id="s1", tool="spawn_subagent", decision="allow", by="host"
                ),
                child(UserMsg, kind="prompt", content=(TextBlock(text="read the notes"),)),
                child(PartialText, index=0, text="I'll"),
                child(ModelMsg, turn=1, block=TextBlock(text="I'll list.")),
                child(ModelMsg, turn=1, block=inner),
            ]
        )
    )
    assert [u["sessionUpdate"] for u in updates] == [
        "tool_call",
        "tool_call",
        "tool_call_update",
        "tool_call_update",
        "tool_call_update",
    ]
    from_child = updates[3:]
    assert {u["toolCallId"] for u in from_child} == {"s2"}  # bound by its task text
    assert from_child[-1]["_meta"]["greenroom"]["origin"] == [SID, CHILD]
    assert "▸ List ." in from_child[-1]["content"][0]["content"]["text"]
    params = mapper.permission_params(SID, inner)
    strict(RequestPermissionRequest, params)
    assert params["toolCall"]["toolCallId"] == "s2"
    assert params["toolCall"]["_meta"]["greenroom"]["callId"] == "k1"
    assert [o["kind"] for o in params["options"]] == ["allow_once", "allow_always", "reject_once"]
    restore = checked(mapper.restore_after_permission(inner))
    assert restore[0]["title"] == "Subagent: read the notes"
    done = checked(
        mapper.map(
            ToolCallOutput(
                **COMMON, call_id="s2", tool="spawn_subagent", status="ok", is_error=False,
                content=(TextBlock(text="2 notes"),),
            )
        )
    )  # fmt: skip
    assert done[0]["status"] == "completed"
    assert (
        checked(
            mapper.map(child(TaskEnd, status="completed", turns=1, usage=TokenUsage(), wall_ms=1))
        )
        == []
    )


# -- ends ------------------------------------------------------------------------------------


def ok_request(stop: str) -> RequestEnd:
    return RequestEnd(**COMMON, turn=1, status="ok", attempt=1, stop_reason=stop)


@pytest.mark.parametrize(
    ("status", "stop", "reason"),
    [
        ("completed", "end_turn", "end_turn"),
        ("completed", "refusal", "refusal"),
        ("completed", "max_tokens", "max_tokens"),
        ("max_turns", "tool_use", "max_turn_requests"),
        ("aborted", None, "cancelled"),
    ],
)
def test_stop_reasons(status: str, stop: str | None, reason: str) -> None:
    mapper = acp.UpdateMapper(live=True)
    if stop is not None:
        mapper.map(ok_request(stop))
    assert acp.stop_reason(end(status), mapper.last_stop_reason) == reason


@pytest.mark.parametrize(
    ("status", "code"), [("failed", -32603), ("loop_detected", -32603), ("auth", -32000)]
)
def test_failed_tasks_are_errors_with_their_message(status: str, code: int) -> None:
    with pytest.raises(RpcError) as info:
        acp.stop_reason(end(status, message="the model said no"), None)
    assert info.value.code == code
    assert info.value.message == "the model said no"


def test_permission_answers() -> None:
    def answer(result: Any) -> str:
        return acp.verdict_of(acp.Response(id=1, result=result))

    assert answer({"outcome": {"outcome": "selected", "optionId": "allow"}}) == "allow"
    assert (
        answer({"outcome": {"outcome": "selected", "optionId": "allow_session"}}) == "allow_session"
    )
    assert answer({"outcome": {"outcome": "selected", "optionId": "deny"}}) == "deny"
    assert answer({"outcome": {"outcome": "cancelled"}}) == "deny"
    assert answer({"outcome": {"outcome": "selected", "optionId": "whatever"}}) == "deny"
    assert acp.verdict_of(acp.Response(id=1, error={"code": 1, "message": "x"})) == "deny"


# -- the editor's files and terminal, modes, the session list, usage (R-ACP-2) ---------------


def result(call_id: str, tool: str, *content: TextBlock) -> ToolCallOutput:
    return ToolCallOutput(
        **COMMON, call_id=call_id, tool=tool, status="ok", is_error=False, content=content
    )


def test_a_calls_diff_and_terminal_show_first_in_its_later_updates() -> None:
    """What :meth:`UpdateMapper.attach` gives a call (an edit's diff, an editor's terminal)
    leads every later update of that call — progress, its end, an interrupt — and the
    mapper forgets it when the call ends or the task does."""
    mapper = acp.UpdateMapper(live=True, workspace="/ws")
    checked(mapper.map(ModelMsg(**COMMON, turn=1, block=call("w1", "write_file", path="a"))))
    checked(mapper.map(ModelMsg(**COMMON, turn=1, block=call("r1", "run_shell", command="x"))))
    diff = acp.diff_content("/ws/a", None, "new")
    terminal = acp.terminal_content("term-1")
    mapper.attach("w1", diff)
    mapper.attach("r1", terminal)
    (progress,) = checked(
        mapper.map(ToolProgress(**COMMON, call_id="r1", tool="run_shell", message="running"))
    )
    assert progress["content"][0] == terminal
    (wrote,) = checked(mapper.map(result("w1", "write_file", TextBlock(text="wrote 3"))))
    assert wrote["content"][0] == {"type": "diff", "path": "/ws/a", "oldText": None,
                                   "newText": "new"}  # fmt: skip
    (cut,) = checked(mapper.map(Abort(**COMMON, reason="stop")))
    assert cut["toolCallId"] == "r1" and cut["content"][0] == terminal
    mapper.attach("late", diff)
    checked(mapper.map(end()))
    checked(mapper.map(ModelMsg(**COMMON, turn=1, block=call("late", "read_file", path="a"))))
    (again,) = checked(mapper.map(result("late", "read_file")))
    assert again["content"] == []


def test_usage_of_a_prompt_and_of_each_request() -> None:
    """The prompt's answer carries the task's tokens (cost in ``_meta``); a root request's
    ``token_usage`` is a ``usage_update`` of the context window, a subagent's none."""
    usage = TokenUsage(input=10, output=5, cache_read=100, cache_write=20, cost_usd=0.25)
    answer = acp.prompt_usage(usage)
    strict(PromptResponse, {"stopReason": "end_turn", "usage": answer})
    assert answer == {
        "totalTokens": 135, "inputTokens": 10, "outputTokens": 5, "cachedReadTokens": 100,
        "cachedWriteTokens": 20, "_meta": {"greenroom": {"costUsd": 0.25}},
    }  # fmt: skip
    assert "_meta" not in acp.prompt_usage(TokenUsage(input=1))
    used = TokenUsageOutput(**COMMON, turn=1, request=usage)
    assert checked(acp.usage_update(used, 1000)) == [
        {"sessionUpdate": "usage_update", "used": 135, "size": 1000}
    ]
    assert acp.usage_update(child(TokenUsageOutput, turn=1, request=usage), 1000) == []
    assert acp.usage_update(end(), 1000) == []


def test_editor_capabilities_and_its_answers() -> None:
    assert acp.editor_capabilities({}) == acp.EditorCapabilities()
    offered = acp.editor_capabilities(
        {"clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": "yes"},
                                "terminal": True}}
    )  # fmt: skip
    assert (offered.reads, offered.writes, offered.terminal, offered.any) == (
        True, False, True, True
    )
    refused = acp.Response(id=1, error={"code": -32002, "message": "no such buffer"})
    with pytest.raises(ValueError, match=r"no such buffer \(code -32002\)"):
        acp.client_result(refused, "fs/read_text_file")
    with pytest.raises(ValueError, match="not an object"):
        acp.client_result(acp.Response(id=1, result=[]), "fs/read_text_file")
    assert acp.client_result(acp.Response(id=1, result=None), "fs/write_text_file") == {}
    with pytest.raises(ValueError, match="no text"):
        acp.text_of({"content": 3})
    with pytest.raises(ValueError, match="no terminalId"):
        acp.terminal_id_of({})
    ran = acp.terminal_output(
        {"output": "x", "truncated": True, "exitStatus": {"exitCode": None, "signal": "SIGKILL"}}
    )
    assert (ran.exited, ran.exit_code, ran.signal, ran.truncated) == (True, None, "SIGKILL", True)
    assert acp.terminal_output({"output": ""}).exited is False
    assert acp.exit_status({"exitCode": True, "signal": ""}) == (None, None)


def test_modes_are_the_approval_policies() -> None:
    strict(SessionModeState, acp.modes_state("all"))
    assert acp.parse_set_mode({"sessionId": SID, "modeId": "none"}) == "none"
    with pytest.raises(RpcError) as unknown:
        acp.parse_set_mode({"sessionId": SID, "modeId": "yolo"})
    assert unknown.value.code == -32602 and "ask" in unknown.value.message


def test_session_pages_are_newest_first_and_cursors_survive_new_sessions() -> None:
    """Pages of ``session/list``: newest first by creation time (then id), each cursor
    the place after its page's last session — sessions created in between neither repeat
    nor hide older ones; a cursor that is not ours is -32602."""
    sessions = [(float(i // 3), f"s{i:03d}") for i in range(7)]
    page, cursor = acp.sessions_page(sessions, None, size=3)
    assert page == ["s006", "s005", "s004"] and cursor is not None
    sessions.append((99.0, "s999"))
    parsed = acp.parse_list_sessions({"cursor": cursor}).cursor
    page, cursor = acp.sessions_page(sessions, parsed, size=3)
    assert page == ["s003", "s002", "s001"] and cursor is not None
    page, cursor = acp.sessions_page(
        sessions, acp.parse_list_sessions({"cursor": cursor}).cursor, size=3
    )
    assert (page, cursor) == (["s000"], None)
    assert acp.sessions_page([], None) == ([], None)
    for bad in ({"cursor": "s003"}, {"cursor": 3}, {"cwd": "relative"}):
        with pytest.raises(RpcError) as refused:
            acp.parse_list_sessions(bad)
        assert refused.value.code == -32602
    strict(ListSessionsResponse, {"sessions": [acp.session_info(SID, "/ws", "Hi", None)]})
