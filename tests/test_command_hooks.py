"""Command hooks (R-HOOK-2): programs from a settings file, run as real processes through
``trio.run_process`` for a run on the scripted model — the call as JSON on stdin, exit 2 to
deny (stderr the reason), a JSON object on stdout to rewrite, ``{"content"}`` to replace a
result — and what a misbehaving one (another exit, other output, too much of it, too slow)
does; that nothing a command started outlives it; and the settings file's problems, named
by file and place."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type, result_text, results_of

from greenroom import Host, tool
from greenroom.actors.runtime import HooksFileError, command_hooks
from greenroom.actors.runtime.command_hooks import load_hooks_file
from greenroom.actors.scripted import Reply, text, tool_call
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.hooks_file import parse_hooks_settings
from greenroom.protocols.outputs import ApprovalDecision, TaskEnd, ToolCallOutput, ToolHook

ran: list[str] = []

PY = shlex.quote(sys.executable)


@tool(parallel=False)
async def run_shell(command: str) -> str:
    """Run a shell command (a stand-in: it records what it was asked)."""
    ran.append(command)
    return f"output of {command}"


def script(*calls: ToolCallBlock) -> Any:
    def step(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        if results_of(last):
            return Reply(blocks=(text("done"),))
        return Reply(blocks=calls)

    return step


def hooks_file(tmp_path: Path, settings: dict[str, Any]) -> Path:
    path = tmp_path / "hooks.json"
    path.write_text(json.dumps(settings))
    return path


def py(code: str) -> str:
    """A command that runs ``code`` with this Python (no shell quoting worries)."""
    return f"{PY} -c {shlex.quote(code)}"


async def run(
    host: Host, tmp_path: Path, providers: Any, settings: dict[str, Any], *calls: ToolCallBlock
) -> list[Any]:
    ran.clear()
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    session = await host.create_session(
        provider=providers(script(*calls)), tools=[run_shell], workspace_dir=workspace,
        hooks=load_hooks_file(hooks_file(tmp_path, settings)),
    )
    return await collect(session.run("go", approve=allow_all), RUN_TIMEOUT_S * 2)


def sh(call_id: str, command: str) -> ToolCallBlock:
    return tool_call(call_id, "run_shell", command=command)


async def test_the_call_on_stdin_exit_2_denies_and_match_picks_the_tools(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    seen = tmp_path / "stdin.json"
    settings = {
        "before_tool": [
            {"match": "read_*|run_shell",
             "command": f"cat > {shlex.quote(str(seen))}; echo 'rm is not allowed' >&2; exit 2"},
            {"match": "write_file", "command": "exit 2"},
        ]
    }
    outputs = await run(host, tmp_path, providers, settings, sh("c1", "rm -rf /"))
    assert json.loads(seen.read_text()) == {
        "hook": "before_tool", "tool": "run_shell", "call_id": "c1",
        "arguments": {"command": "rm -rf /"}, "session_id": outputs[0].session_id,
        "cwd": str((tmp_path / "ws").resolve()),
    }
    assert ran == []
    (hooked,) = of_type(outputs, ToolHook)
    assert (hooked.action, hooked.reason) == ("deny", "rm is not allowed")
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "hook")


async def test_a_json_object_on_stdout_rewrites_and_the_next_hook_sees_it(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    prefix = py(
        "import json,sys; c=json.load(sys.stdin); "
        "print(json.dumps({'command': 'timeout 5 ' + c['arguments']['command']}))"
    )
    quiet = py(
        "import json,sys; c=json.load(sys.stdin); "
        "print(json.dumps({'command': c['arguments']['command'] + ' >/dev/null'}))"
    )
    settings = {"before_tool": [{"command": prefix}, {"match": "run_shell", "command": quiet}]}
    outputs = await run(host, tmp_path, providers, settings, sh("c1", "make"))
    assert ran == ["timeout 5 make >/dev/null"]
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "rewrite" and hooked.arguments == {
        "command": "timeout 5 make >/dev/null"
    }


async def test_a_command_runs_in_the_sessions_workspace_and_is_told_whose_call_it_is(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    """R-HOOK-2, R-SEC-7: the command's working directory is the session's workspace (not
    the process's), and its stdin names the session and that workspace."""
    where = py(
        "import json,os,sys; c=json.load(sys.stdin); "
        "print(json.dumps({'command': '|'.join([os.getcwd(), c['cwd'], c['session_id']])}))"
    )
    outputs = await run(host, tmp_path, providers, {"before_tool": [{"command": where}]},
                        sh("c1", "ls"))
    workspace = str((tmp_path / "ws").resolve())
    assert ran == [f"{workspace}|{workspace}|{outputs[0].session_id}"]


async def test_after_tool_replaces_with_content_or_with_stderr_on_exit_2(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    upper = py(
        "import json,sys; r=json.load(sys.stdin)['result']; "
        "print(json.dumps({'content': r['text'].upper()}))"
    )
    settings = {"after_tool": [{"command": upper},
                               {"match": "other", "command": "exit 2"}]}
    outputs = await run(host, tmp_path, providers, settings, sh("c1", "ls"))
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == "OUTPUT OF LS"  # type: ignore[arg-type]
    assert [h.action for h in of_type(outputs, ToolHook)] == ["replace"]
    settings = {"after_tool": [{"command": "echo 'output withheld' >&2; exit 2"}]}
    outputs = await run(host, tmp_path, providers, settings, sh("c1", "ls"))
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == "output withheld" and result.status == "ok"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("echo 'policy server down' >&2; exit 1",
         "hook `echo 'policy server down' >&2; exit 1` exited 1: policy server down"),
        ("echo allowed", 'hook `echo allowed` printed "allowed": expected nothing, or a '
                         "JSON object"),
        ("/nonexistent/hook", "hook `/nonexistent/hook` exited 127: "),
    ],
)
async def test_a_misbehaving_before_tool_command_denies_the_call_naming_it(
    host: Host, tmp_path: Path, providers: Any, command: str, reason: str
) -> None:
    outputs = await run(host, tmp_path, providers, {"before_tool": [{"command": command}]},
                        sh("c1", "ls"))
    assert ran == []
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "error" and (hooked.reason or "").startswith(reason)
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "denied" and "the before_tool hook failed" in result_text(result)  # type: ignore[arg-type]


async def test_a_command_past_its_timeout_is_killed_and_the_result_kept(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    """An ``after_tool`` command that hangs is killed at its timeout (not waited for):
    the task goes on with the tool's own result."""
    settings = {"after_tool": [{"command": "sleep 30", "timeout": 0.2}]}
    with trio.fail_after(RUN_TIMEOUT_S):
        outputs = await run(host, tmp_path, providers, settings, sh("c1", "ls"))
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == "hook `sleep 30` did not finish within 0.2 s (killed)"
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == "output of ls"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "hooks.json: not JSON: line 1 column 2: Expecting property name"),
        ("[]", "hooks.json: $: expected an object with before_tool and after_tool"),
        ('{"before_tools": []}', "hooks.json: $.before_tools: unknown key"),
        ('{"before_tool": {}}', "hooks.json: $.before_tool: expected a list of hooks"),
        ('{"after_tool": [{"match": "x"}]}', "hooks.json: $.after_tool[0].command: required"),
        ('{"before_tool": [{"command": "x", "timeout": "5"}]}',
         'hooks.json: $.before_tool[0].timeout: expected a number of seconds above 0, got "5"'),
        ('{"before_tool": [{"command": "x", "matcher": "y"}]}',
         "hooks.json: $.before_tool[0].matcher: unknown key"),
    ],
)
def test_a_bad_settings_file_names_the_file_and_the_place(text: str, problem: str) -> None:
    with pytest.raises(HooksFileError) as raised:
        parse_hooks_settings(text, "hooks.json")
    assert str(raised.value).startswith(problem)


def test_a_missing_settings_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(HooksFileError, match=r"nope\.json: cannot read it: No such file"):
        load_hooks_file(tmp_path / "nope.json")


async def test_the_gateways_sessions_meet_the_hooks_installed_on_its_host(
    tmp_path: Path,
) -> None:
    """``serve --hooks FILE`` installs the hooks as a host observer: a session a client
    creates over the websocket has them, and its subscriber sees what they did."""
    from test_gateway import BOUND_S, connect, serving

    from greenroom.actors.runtime import install_tool_hooks

    hooks = load_hooks_file(hooks_file(tmp_path, {"before_tool": [
        {"match": "run_shell", "command": "echo 'not over the websocket' >&2; exit 2"}
    ]}))
    ran.clear()
    with trio.fail_after(BOUND_S * 2):
        async with serving(
            tmp_path, lambda: script(sh("c1", "ls")), tools=[run_shell], approve="all",
            host_options={"observers": [install_tool_hooks(hooks)]},
        ) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "go"})
            outputs = client.take_outputs() + await client.outputs_until("task_end")
    hooked = next(o for o in outputs if o["type"] == "tool_hook")
    assert (hooked["action"], hooked["reason"]) == ("deny", "not over the websocket")
    assert ran == [] and outputs[-1]["status"] == "completed"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _pid_in(pidfile: Path) -> int | None:
    """The pid a hook wrote to ``pidfile``; None before it has."""
    text = pidfile.read_text() if pidfile.exists() else ""
    return int(text) if text.strip() else None


async def _until(condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` about another process holds within the tests' bound: that
    process sends no event, so it is checked every 20 ms."""
    with trio.move_on_after(RUN_TIMEOUT_S):
        while not condition():  # noqa: ASYNC110 (another process: no event to wait for)
            await trio.sleep(0.02)
    return condition()


def _kill_left(pidfile: Path) -> None:
    """Whatever failed, a test leaves no process behind."""
    pid = _pid_in(pidfile)
    if pid is not None and _alive(pid):
        os.kill(pid, 9)


@pytest.mark.parametrize("end", ["timeout", "interrupt", "exit"])
async def test_the_processes_a_command_hook_started_end_with_it(
    host: Host, tmp_path: Path, providers: Any, end: str
) -> None:
    """R-SEC-11, R-HOOK-2: a command hook runs in a process group of its own, killed whole
    however the hook ends — past its timeout, interrupted with its task, or exited with a
    child left behind (which, holding the hook's stdout, held the hook until its
    timeout) — so the ``sleep`` it started in the background ends with it (before: only
    ``/bin/sh`` was killed, and the ``sleep`` lived on)."""
    pidfile = tmp_path / "child.pid"
    command = f"sleep 300 & echo $! > {shlex.quote(str(pidfile))}"
    hook = {"command": command if end == "exit" else f"{command}; wait",
            "timeout": 0.5 if end == "timeout" else 60}
    settings = {"before_tool": [hook]}
    try:
        if end == "interrupt":
            workspace = tmp_path / "ws"
            workspace.mkdir()
            session = await host.create_session(
                provider=providers(script(sh("c1", "ls"))), tools=[run_shell],
                workspace_dir=workspace, hooks=load_hooks_file(hooks_file(tmp_path, settings)),
            )
            stream = session.run("go", approve=allow_all)
            assert await _until(lambda: _pid_in(pidfile) is not None)
            session.interrupt()
            outputs = await collect(stream, RUN_TIMEOUT_S)
            assert of_type(outputs, TaskEnd)[-1].status == "aborted"
        else:
            outputs = await run(host, tmp_path, providers, settings, sh("c1", "ls"))
            (end_of_task,) = of_type(outputs, TaskEnd)
            assert end_of_task.status == "completed"
            assert ran == ([] if end == "timeout" else ["ls"])
        pid = _pid_in(pidfile)
        assert pid is not None
        # SIGKILL is sent before the hook returns; the dead child may wait to be reaped.
        assert await _until(lambda: not _alive(pid)), f"the hook's child {pid} outlived it"
    finally:
        _kill_left(pidfile)


async def test_a_command_hooks_long_stderr_is_cut_as_a_reason_and_whole_as_a_result(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    """R-HOOK-2, R-SEC-9: a command that exits 2 with 5,000 characters on stderr denies
    with a reason cut as every reason is, ending with the note of how much was left out
    (``before_tool``), or is the model's whole result instead (``after_tool``: fit to the
    result budget as a tool's result is). Before: both silently cut to 2,000."""
    loud = py("import sys; sys.stderr.write('x' * 5000); sys.exit(2)")
    outputs = await run(host, tmp_path, providers, {"before_tool": [{"command": loud}]},
                        sh("c1", "ls"))
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == f"{'x' * 2000}… [cut: 3000 of 5000 characters left out]"
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == f"Tool call denied by a hook: {hooked.reason}"  # type: ignore[arg-type]
    outputs = await run(host, tmp_path, providers, {"after_tool": [{"command": loud}]},
                        sh("c1", "ls"))
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == "x" * 5000  # type: ignore[arg-type]


async def test_a_command_that_prints_past_the_cap_is_a_hook_error(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    """R-HOOK-2: what a command prints is read up to ``OUTPUT_CAP`` bytes a stream, so a
    runaway hook cannot fill the host's memory: past it the command is killed and it is a
    hook error naming the stream (before: read whole, whatever its size)."""
    cap = command_hooks.OUTPUT_CAP
    flood = py(f"import sys; sys.stdout.write('x' * {cap + 1})")
    outputs = await run(host, tmp_path, providers, {"before_tool": [{"command": flood}]},
                        sh("c1", "ls"))
    assert ran == []
    (hooked,) = of_type(outputs, ToolHook)
    assert (hooked.action, hooked.reason) == (
        "error", f"hook `{flood}` printed more than {cap} bytes on stdout (killed)"
    )


async def test_a_command_hooks_lone_surrogate_is_repaired_and_the_task_goes_on(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    """R-SEC-1, R-HOOK-2: a command that prints the JSON escape of a lone surrogate
    (``\\ud800``: a file name it echoes, say) rewrites the call with U+FFFD in its place;
    the task completes (before: the ``tool_hook`` record could not be written and the task
    ended ``failed``)."""
    echo = py("print('{\"command\": \"ls \\\\ud800\"}')")
    outputs = await run(host, tmp_path, providers, {"before_tool": [{"command": echo}]},
                        sh("c1", "ls"))
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert ran == ["ls \ufffd"]
