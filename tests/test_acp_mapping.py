"""The sans-IO half of ``greenroom acp`` (R-ACP-1): frames, the output → ``session/update``
mapping (live and replay), subagent outputs on the parent's ``spawn_subagent`` call, stop
reasons. Every update is validated strictly against the official ACP SDK's schema."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from acp.schema import RequestPermissionRequest, SessionNotification

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
    ToolCallOutput,
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
