"""The official TypeScript ACP SDK as the editor (R-ACP-2): a Node program using npm's
``@agentclientprotocol/sdk`` — its ``client()`` app, which checks every request and
notification it receives against the SDK's schema — starts the agent
(``tests/support/acp_editor_agent.py``: ``greenroom acp``'s set-up, ``--approve ask``,
sandbox ``off``) and drives a session end to end: a write that the editor is asked to
permit and then performs (a ``diff`` on the call), a command it is asked to permit and
runs in a terminal of its own (embedded in the call), a mode change after which a read
runs unasked through the editor, the session list and ``session/close``.

The packages come from the npm registry once and are kept in ``build/acp-ts-client/``
(pinned versions, installed without their install scripts, npm under a timeout); without
Node, npm or the registry the test is skipped with the reason. The Node program runs under
``trio.fail_after``; everything it saw comes back as one JSON line on its stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.test_acp import env_for

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "support" / "acp_editor_agent.py"
SDK_PACKAGE = "@agentclientprotocol/sdk@2.4.0"
ZOD_PACKAGE = "zod@4.6.7"
"""The SDK's one peer it needs (its schemas are zod's)."""
CACHE = ROOT / "build" / "acp-ts-client"
"""Where the installed packages are kept between runs (git ignores ``build/``)."""

INSTALL_BOUND_S = 180.0
"""How long npm may take to fetch the packages; longer (no registry) skips the test."""
RUN_BOUND_S = 120.0
NODE = shutil.which("node")
NPM = shutil.which("npm")

CLIENT = r"""
import { spawn } from "node:child_process";
import { Readable, Writable } from "node:stream";
import { readFile, writeFile } from "node:fs/promises";
import * as acp from "@agentclientprotocol/sdk";

const [python, agentScript, dataDir, workspace] = process.argv.slice(2);
const child = spawn(python, [agentScript, dataDir, "off", "ask"], {
  stdio: ["pipe", "pipe", "inherit"],
});
const exited = new Promise((resolve) => child.on("exit", (code) => resolve(code)));
const stream = acp.ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));

const seen = { updates: [], requests: [], permissions: [] };
const terminals = new Map();

const editor = acp
  .client({ name: "greenroom-ts-editor" })
  .onRequest("session/request_permission", async ({ params }) => {
    seen.permissions.push(params.toolCall.title);
    return { outcome: { outcome: "selected", optionId: "allow" } };
  })
  .onNotification("session/update", async ({ params }) => {
    seen.updates.push(params.update);
  })
  .onRequest("fs/read_text_file", async ({ params }) => {
    seen.requests.push(["fs/read_text_file", params]);
    const lines = (await readFile(params.path, "utf8")).split(/(?<=\n)/);
    const start = (params.line ?? 1) - 1;
    const end = params.limit == null ? lines.length : start + params.limit;
    return { content: lines.slice(start, end).join("") };
  })
  .onRequest("fs/write_text_file", async ({ params }) => {
    seen.requests.push(["fs/write_text_file", params]);
    await writeFile(params.path, params.content, "utf8");
    return {};
  })
  .onRequest("terminal/create", async ({ params }) => {
    seen.requests.push(["terminal/create", params]);
    const command = spawn(params.command, params.args ?? [], { cwd: params.cwd });
    const terminal = { command, output: "", status: null };
    command.stdout.on("data", (chunk) => (terminal.output += chunk));
    command.stderr.on("data", (chunk) => (terminal.output += chunk));
    terminal.done = new Promise((resolve) =>
      command.on("close", (exitCode, signal) => {
        terminal.status = { exitCode, signal };
        resolve(terminal.status);
      }),
    );
    const terminalId = `ts-${terminals.size + 1}`;
    terminals.set(terminalId, terminal);
    return { terminalId };
  })
  .onRequest("terminal/wait_for_exit", async ({ params }) => {
    seen.requests.push(["terminal/wait_for_exit", params]);
    return await terminals.get(params.terminalId).done;
  })
  .onRequest("terminal/output", async ({ params }) => {
    seen.requests.push(["terminal/output", params]);
    const terminal = terminals.get(params.terminalId);
    return { output: terminal.output, truncated: false, exitStatus: terminal.status };
  })
  .onRequest("terminal/kill", async ({ params }) => {
    seen.requests.push(["terminal/kill", params]);
    terminals.get(params.terminalId).command.kill();
    return {};
  })
  .onRequest("terminal/release", async ({ params }) => {
    seen.requests.push(["terminal/release", params]);
    terminals.get(params.terminalId).command.kill();
    return {};
  });

const answers = await editor.connectWith(stream, async (agent) => {
  const init = await agent.request("initialize", {
    protocolVersion: acp.PROTOCOL_VERSION,
    clientCapabilities: { fs: { readTextFile: true, writeTextFile: true }, terminal: true },
    clientInfo: { name: "greenroom-ts-editor", version: "1.0.0" },
  });
  const created = await agent.request("session/new", { cwd: workspace, mcpServers: [] });
  const sessionId = created.sessionId;
  const say = (text) =>
    agent.request("session/prompt", { sessionId, prompt: [{ type: "text", text }] });
  const wrote = await say("write notes.txt written by typescript");
  const ran = await say("run cat notes.txt");
  await agent.request("session/set_mode", { sessionId, modeId: "all" });
  const read = await say("read notes.txt");
  const listed = await agent.request("session/list", {});
  await agent.request("session/close", { sessionId });
  return { init, created, wrote, ran, read, listed };
});
child.stdin.end();
const code = await exited;
process.stdout.write(JSON.stringify({ ...answers, seen, code }) + "\n");
"""


# -- the SDK, from npm ----------------------------------------------------------------------


def _cache_key() -> str:
    return f"{SDK_PACKAGE}+{ZOD_PACKAGE}".replace("@", "").replace("/", "-")


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The SDK's ``node_modules``: installed once into :data:`CACHE`, then taken from
    there. Skips the test, saying why, when npm or the registry cannot give it."""
    done = CACHE / _cache_key() / "node_modules"
    if (done / "@agentclientprotocol" / "sdk" / "package.json").is_file():
        return done
    assert NPM is not None  # the test's skipif marks say why when it is missing
    CACHE.mkdir(parents=True, exist_ok=True)
    # Installed aside and renamed into place whole, so a run that stops halfway (or
    # another one at the same time) never leaves a half-installed cache behind.
    work = Path(tempfile.mkdtemp(prefix="installing-", dir=CACHE))
    try:
        (work / "package.json").write_text('{"name": "acp-ts-editor-test", "private": true}\n')
        env = {
            **os.environ,
            "npm_config_update_notifier": "false",
            "npm_config_fund": "false",
            "npm_config_audit": "false",
        }
        try:
            installed = subprocess.run(
                [
                    NPM, "install", "--ignore-scripts", "--no-save", "--fetch-retries=1",
                    "--fetch-timeout=30000", SDK_PACKAGE, ZOD_PACKAGE,
                ],
                cwd=work, env=env, capture_output=True, timeout=INSTALL_BOUND_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {SDK_PACKAGE} did not finish in {INSTALL_BOUND_S:.0f} s")
        if installed.returncode != 0:
            lines = installed.stderr.decode(errors="replace").strip().splitlines()
            pytest.skip(f"npm install {SDK_PACKAGE} failed: {' / '.join(lines[:3])}")
        with contextlib.suppress(OSError):  # another run's is there already: the same
            work.rename(CACHE / _cache_key())
        return done
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the test ---------------------------------------------------------------------------------


def calls_titled(seen: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """Every update of the call whose ``tool_call`` had ``title``."""
    (call_id,) = [
        u["toolCallId"]
        for u in seen["updates"]
        if u["sessionUpdate"] == "tool_call" and u["title"] == title
    ]
    return [u for u in seen["updates"] if u.get("toolCallId") == call_id]


@pytest.mark.skipif(NODE is None, reason="no `node` on PATH: the editor is a Node program")
@pytest.mark.skipif(
    NPM is None, reason="no `npm` on PATH: the ACP TypeScript SDK comes from the npm registry"
)
async def test_the_typescript_sdk_as_the_editor_drives_a_task_end_to_end(
    tmp_path: Path, node_modules: Path
) -> None:
    """R-ACP-2 with the TypeScript SDK: permissions asked and allowed, the edit made by
    the editor and shown as a diff from the file's text, the command run in the editor's
    terminal and embedded in its call, ``all`` mode letting the read run unasked through
    the editor, usage in each answer, the session listed with its title, closed, and the
    agent exiting 0 when the editor leaves."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("old text\n", encoding="utf-8")
    workspace = workspace.resolve()
    program = tmp_path / "editor" / "client.mjs"
    program.parent.mkdir()
    program.write_text(CLIENT, encoding="utf-8")
    # Node looks for packages in the node_modules beside the program.
    (program.parent / "node_modules").symlink_to(node_modules, target_is_directory=True)
    assert NODE is not None
    with trio.fail_after(RUN_BOUND_S):
        done = await trio.run_process(
            [NODE, str(program), sys.executable, str(AGENT), str(tmp_path / "data"),
             str(workspace)],
            env=env_for(tmp_path), capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    report = json.loads(done.stdout)
    seen = report["seen"]
    assert report["code"] == 0
    assert report["created"]["modes"]["currentModeId"] == "ask"
    assert seen["permissions"] == ["Write notes.txt", "Run `cat notes.txt`"]
    notes = str(workspace / "notes.txt")
    assert [method for method, _ in seen["requests"]] == [
        "fs/read_text_file", "fs/write_text_file", "terminal/create",
        "terminal/wait_for_exit", "terminal/output", "terminal/release", "fs/read_text_file",
    ]  # fmt: skip
    assert seen["requests"][1][1]["path"] == notes
    assert seen["requests"][2][1]["cwd"] == str(workspace)
    assert (workspace / "notes.txt").read_text(encoding="utf-8") == "written by typescript"

    wrote = calls_titled(seen, "Write notes.txt")[-1]
    assert wrote["status"] == "completed"
    assert wrote["content"][0] == {
        "type": "diff", "path": notes, "oldText": "old text\n", "newText": "written by typescript"
    }  # fmt: skip
    ran = calls_titled(seen, "Run `cat notes.txt`")
    terminal = {"type": "terminal", "terminalId": "ts-1"}
    assert any(u["status"] == "in_progress" and u.get("content", [None])[0] == terminal
               for u in ran)  # fmt: skip
    assert ran[-1]["status"] == "completed" and ran[-1]["content"][0] == terminal
    assert ran[-1]["content"][1]["content"]["text"] == "exit code: 0\nwritten by typescript"
    read = calls_titled(seen, "Read notes.txt")[-1]
    assert read["content"][0]["content"]["text"] == "     1\twritten by typescript"

    for answer in ("wrote", "ran", "read"):
        assert report[answer]["stopReason"] == "end_turn"
        assert report[answer]["usage"]["totalTokens"] > 0
    assert any(u["sessionUpdate"] == "usage_update" for u in seen["updates"])
    (listed,) = report["listed"]["sessions"]
    assert (listed["sessionId"], listed["cwd"], listed["title"]) == (
        report["created"]["sessionId"], str(workspace), "write notes.txt written by typescript"
    )
