"""Image files are read once, when accepted, and never again (R-SEC-8).

Real files, FIFOs and symbolic links in a real workspace; the real ``anthropic`` SDK
against the loopback mock server where what reaches the model matters, the scripted model
where only the task's course does; the gateway over a real websocket and the ACP agent on
memory streams where a client names the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, collect, of_type

from greenroom.actors.apps.acp import AcpAgent, AcpConfig
from greenroom.actors.providers import media
from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.runtime import attachments
from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.host import Host
from greenroom.actors.scripted import Reply as ScriptedReply
from greenroom.actors.scripted import ScriptedProvider, text, tool_call
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import ImageBlock, TextBlock, user_image, user_text
from greenroom.protocols.context import ToolResult
from greenroom.protocols.outputs import TaskEnd, UserMsg
from greenroom.protocols.tools import ToolContext, tool
from tests.support.mock_model_server import (
    MockModelServer,
    RecordedRequest,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)
from tests.support.ndjson import NdjsonPeer
from tests.test_gateway import connect, serving

PNG = b"\x89PNG\r\n\x1a\n" + b"first picture"
OTHER_PNG = b"\x89PNG\r\n\x1a\n" + b"second picture"
SHOT = b"\x89PNG\r\n\x1a\n" + b"a screenshot"
SECRET = b"ANTHROPIC_API_KEY=sk-ant-fake-0123456789\n"
MIB = 1024 * 1024


def allow(_: object) -> str:
    return "allow"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.env"
    path.write_bytes(SECRET)
    return path


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sent_images(request: RecordedRequest) -> list[str]:
    """The base64 data of every image in an Anthropic request (tool results included), in
    order."""
    found: list[str] = []

    def walk(blocks: Sequence[Any]) -> None:
        for block in blocks:
            if block.get("type") == "image":
                found.append(block["source"]["data"])
            elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                walk(block["content"])

    for message in request.messages:
        if isinstance(message.get("content"), list):
            walk(message["content"])
    return found


def assert_no_secret(server: MockModelServer) -> None:
    for request in server.requests:
        assert SECRET not in request.raw_body, f"request {request.index} carried the secret"
        for data in sent_images(request):
            assert SECRET not in base64.b64decode(data), f"request {request.index}: the secret"


def anthropic(server: MockModelServer) -> AnthropicProvider:
    return AnthropicProvider(base_url=server.base_url, api_key="test-key")


async def test_a_file_swapped_after_acceptance_changes_nothing_later_requests_send(
    tmp_path: Path, workspace: Path, secret: Path
) -> None:
    """R-SEC-8 (the reported leak): a prompt's image and a tool's returned image are read
    once; after a tool call swaps both files for symbolic links to a secret, every later
    request — of this task and of the next, whose encoder starts afresh — sends the bytes
    read then, and the secret never reaches the model."""
    (workspace / "pic.png").write_bytes(PNG)

    @tool
    async def screenshot(ctx: ToolContext) -> Sequence[ImageBlock]:
        """Take a screenshot."""
        shot = ctx.scratchpad_dir / "shot.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_bytes(SHOT)
        return [ImageBlock(path=str(shot))]

    @tool
    async def swap(ctx: ToolContext) -> str:
        """What a model's run_shell can do: ln -sf SECRET pic.png."""
        for path in (ctx.workspace_dir / "pic.png", ctx.scratchpad_dir / "shot.png"):
            path.unlink()
            path.symlink_to(secret)
        return "swapped"

    async with open_mock_server(
        Reply([ToolUse("toolu_1", "screenshot", {})], stop_reason="tool_use"),
        Reply([ToolUse("toolu_2", "swap", {})], stop_reason="tool_use"),
        Reply([Text("Done.")]),
        Reply([Text("Still the same picture.")]),
    ) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[screenshot, swap],
                provider=anthropic(server),
                workspace_dir=workspace,
                model="claude-sonnet-4-5",
            )
            first = await collect(
                session.run([user_text("look"), user_image("pic.png")], approve=allow)
            )
            second = await collect(session.run("and again?", approve=allow))
        server.assert_clean()
    assert [e.status for e in of_type(first + second, TaskEnd)] == ["completed", "completed"]
    assert [sent_images(r) for r in server.requests] == [
        [b64(PNG)],
        [b64(PNG), b64(SHOT)],
        [b64(PNG), b64(SHOT)],
        [b64(PNG), b64(SHOT)],
    ]
    assert_no_secret(server)


async def test_a_symlink_named_directly_is_refused(
    host: Host, workspace: Path, secret: Path
) -> None:
    """R-SEC-8: the last component is opened O_NOFOLLOW, wherever the link points;
    ``attach`` raises naming the file and why, and ``run`` given the block directly ends
    the task failed before anything is recorded or sent."""
    (workspace / "pic.png").write_bytes(PNG)
    (workspace / "outside.png").symlink_to(secret)
    (workspace / "inside.png").symlink_to(workspace / "pic.png")
    provider = ScriptedProvider([ScriptedReply(blocks=(text("never"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    for name in ("outside.png", "inside.png"):
        with pytest.raises(ImageRefused) as refused:
            await session.attach([user_text("look"), user_image(name)])
        assert (refused.value.path, refused.value.index) == (name, 1)
        assert "symbolic link" in refused.value.reason
    outputs = await collect(session.run([user_text("look"), user_image("outside.png")]))
    (end,) = outputs
    assert isinstance(end, TaskEnd) and end.status == "failed" and end.turns == 0
    assert end.message is not None and "'outside.png'" in end.message
    assert "symbolic link" in end.message
    assert provider.requests == []
    assert not of_type(outputs, UserMsg)


async def test_links_on_the_way_may_not_lead_out_of_the_workspace(
    host: Host, workspace: Path, tmp_path: Path, secret: Path
) -> None:
    """R-SEC-8: a symbolic link among the directories of the path is walked by reading it,
    and only while it stays in the workspace; ``..`` cannot climb out either."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pic.png").write_bytes(SECRET)
    (workspace / "real").mkdir()
    (workspace / "real" / "pic.png").write_bytes(PNG)
    (workspace / "assets").symlink_to("real")
    (workspace / "away").symlink_to(elsewhere)
    (workspace / "climb").symlink_to("../elsewhere")
    session = await host.create_session(provider=ScriptedProvider([]), workspace_dir=workspace)
    (image,) = await session.attach([user_image("assets/pic.png")])
    assert isinstance(image, ImageBlock) and image.sha256 == hashlib.sha256(PNG).hexdigest()
    for name in ("away/pic.png", "climb/pic.png"):
        with pytest.raises(ImageRefused, match="leads outside the session's workspace"):
            await session.attach([user_image(name)])
    with pytest.raises(ImageRefused, match="outside the session's workspace"):
        await session.attach([user_image("../elsewhere/pic.png")], confine=True)


async def test_a_client_cannot_name_an_image_in_the_data_dir_the_workspace_holds(
    tmp_path: Path,
) -> None:
    """R-SEC-7: a workspace may hold the host's data dir (a home directory holding
    ``~/.greenroom``); an image path into it — by name, absolute, through a symlink, in
    ``attach`` confined or not and in a prompt — is refused as the file tools refuse it,
    whereas the same bytes elsewhere in the workspace are taken."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "pic.png").write_bytes(PNG)
    (home / "peek").symlink_to("data")
    provider = ScriptedProvider([ScriptedReply(blocks=(text("never"),))])
    async with Host.open(home / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=home)
        (taken,) = await session.attach([user_image("pic.png")])
        assert isinstance(taken, ImageBlock) and taken.sha256 is not None
        private = f"sessions/{session.id}/attachments/{taken.sha256}"
        assert (home / "data" / private).read_bytes() == PNG
        for name in (f"data/{private}", str(home / "data" / private), f"peek/{private}"):
            for confine in (False, True):
                with pytest.raises(ImageRefused) as refused:
                    await session.attach([user_image(name)], confine=confine)
                assert refused.value.path == name
                assert "the host's data dir, which no session may use" in refused.value.reason
        outputs = await collect(session.run([user_text("look"), user_image(f"data/{private}")]))
    (end,) = outputs
    assert isinstance(end, TaskEnd) and end.status == "failed" and end.message is not None
    assert "the host's data dir, which no session may use" in end.message
    assert provider.requests == []


async def test_an_image_in_a_data_dir_moved_within_the_workspace_is_refused(
    tmp_path: Path,
) -> None:
    """R-SEC-7: the data dir two levels down the workspace (``alice/.greenroom``), and
    ``alice`` renamed (as a sandboxed command may): an image path into the moved data dir
    was taken, the reader knowing the data dir by its path only. It is refused by what the
    directory is, wherever it went."""
    home = tmp_path / "home"
    data = home / "alice" / ".greenroom"
    provider = ScriptedProvider([ScriptedReply(blocks=(text("never"),))])
    async with Host.open(data) as host:
        session = await host.create_session(provider=provider, workspace_dir=home)
        (data / "leak.png").write_bytes(PNG)
        (home / "alice").rename(home / "alice2")
        try:
            for confine in (False, True):
                with pytest.raises(ImageRefused) as refused:
                    await session.attach([user_image("alice2/.greenroom/leak.png")],
                                         confine=confine)
                assert "the host's data dir, which no session may use" in refused.value.reason
        finally:
            (home / "alice2").rename(home / "alice")


async def test_a_model_named_image_in_the_data_dir_the_workspace_holds_is_refused(
    tmp_path: Path,
) -> None:
    """R-SEC-7: an image a tool returns (a path the model chose) or a steering image that
    leads into the data dir the workspace holds becomes a line saying it is refused; the
    session's own scratchpad, which lies in the data dir, still serves the tool's
    screenshots."""
    home = tmp_path / "home"
    home.mkdir()
    started = trio.Event()
    release = trio.Event()

    @tool
    async def show(path: str, ctx: ToolContext) -> Sequence[ImageBlock]:
        """Show the image at ``path`` and a screenshot."""
        started.set()
        await release.wait()
        shot = ctx.scratchpad_dir / "shot.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_bytes(SHOT)
        return [ImageBlock(path=str(ctx.workspace_dir / path)), ImageBlock(path=str(shot))]

    meta = "data/sessions/s-shown/session.json"
    provider = ScriptedProvider(
        [
            ScriptedReply(blocks=(tool_call("c1", "show", path=meta),)),
            ScriptedReply(blocks=(text("ok"),)),
        ]
    )
    async with Host.open(home / "data") as host:
        session = await host.create_session(
            tools=[show], provider=provider, workspace_dir=home, session_id="s-shown"
        )
        stream = session.run("look", approve=allow)
        with trio.fail_after(RUN_TIMEOUT_S):
            await started.wait()
        assert session.steer([user_text("and this"), user_image(meta)])
        release.set()
        outputs = await collect(stream)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    why = "data is the host's data dir, which no session may use"
    steering = [o for o in of_type(outputs, UserMsg) if o.kind == "steering"]
    assert [o.content for o in steering] == [
        (TextBlock(text="and this"), TextBlock(text=f"[image refused: {meta}: {why}]"))
    ]
    (result,) = [
        part
        for message in provider.requests[1].messages
        for part in getattr(message, "content", ())
        if isinstance(part, ToolResult)
    ]
    refused, shot = result.content
    assert refused == TextBlock(text=f"[image refused: {home / meta}: {why}]")
    assert isinstance(shot, ImageBlock) and shot.sha256 == hashlib.sha256(SHOT).hexdigest()


class _Watchdog:
    """Opens the write end of a FIFO after a while, from a thread: the rescue of a reader
    blocked in open(2) (what the event loop would be without O_NONBLOCK). ``fired`` says
    whether it had to."""

    def __init__(self, fifo: Path, after_s: float) -> None:
        self.fired = False
        self._fifo = fifo
        self._timer = threading.Timer(after_s, self._release)
        self._timer.daemon = True

    def _release(self) -> None:
        self.fired = True
        for _ in range(100):
            try:
                os.close(os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                threading.Event().wait(0.05)

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


async def test_a_fifo_named_as_an_image_is_refused_without_blocking(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-8, R-SEC-1: a FIFO is opened O_NONBLOCK and refused by fstat — the task that
    named it ends failed at once, and another session of the same host, running
    meanwhile, is served to its end; nothing needed the watchdog."""
    os.mkfifo(workspace / "pipe.png")
    (workspace / "pic.png").write_bytes(PNG)
    with _Watchdog(workspace / "pipe.png", after_s=3 * RUN_TIMEOUT_S) as watchdog:
        async with open_mock_server(Reply([Text("A picture.")])) as server:
            async with Host.open(tmp_path / "data") as host:
                named = await host.create_session(
                    provider=anthropic(server), workspace_dir=workspace, model="claude-x"
                )
                other = await host.create_session(
                    provider=anthropic(server), workspace_dir=workspace, model="claude-x"
                )
                results: dict[str, list[Any]] = {}

                async def run(name: str, stream: Any) -> None:
                    results[name] = await collect(stream)

                with trio.fail_after(RUN_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(
                            run, "fifo", named.run([user_text("look"), user_image("pipe.png")])
                        )
                        nursery.start_soon(
                            run, "other", other.run([user_text("look"), user_image("pic.png")])
                        )
                    with pytest.raises(ImageRefused, match="a FIFO, not a regular file"):
                        await named.attach([user_image("pipe.png")])
    assert not watchdog.fired
    (failed,) = of_type(results["fifo"], TaskEnd)
    assert failed.status == "failed" and failed.message is not None
    assert "'pipe.png'" in failed.message and "a FIFO, not a regular file" in failed.message
    (served,) = of_type(results["other"], TaskEnd)
    assert served.status == "completed"
    assert [sent_images(r) for r in server.requests] == [[b64(PNG)]]


async def test_an_image_over_the_limit_is_refused_with_a_clear_message(
    host: Host, workspace: Path
) -> None:
    """R-SEC-8: ``max_image_bytes`` (5 MiB by default) is checked on the opened file before
    anything is read; the message gives the size and the limit. A file at the limit is
    taken."""
    sparse = workspace / "huge.png"
    with sparse.open("wb") as f:
        f.truncate(400 * MIB)  # sparse: refused by its size, never read
    (workspace / "big.png").write_bytes(b"\x89PNG" + b"\x00" * (5 * MIB - 3))
    provider = ScriptedProvider([ScriptedReply(blocks=(text("never"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    limit = "an image may have at most 5,242,880 bytes (5 MiB, the setting max_image_bytes)"
    with pytest.raises(ImageRefused) as refused:
        await session.attach([user_image("huge.png")])
    assert refused.value.reason == f"419,430,400 bytes; {limit}"
    with pytest.raises(ImageRefused) as refused:
        await session.attach([user_image("big.png")])
    assert refused.value.reason == f"5,242,881 bytes; {limit}"
    outputs = await collect(session.run([user_text("look"), user_image("huge.png")]))
    (end,) = outputs
    assert isinstance(end, TaskEnd) and end.status == "failed"
    assert end.message == f"image 'huge.png' refused: 419,430,400 bytes; {limit}"
    assert provider.requests == []

    small = await host.create_session(
        provider=provider, workspace_dir=workspace, max_image_bytes=1000
    )
    (workspace / "at.png").write_bytes(b"x" * 1000)
    (workspace / "over.png").write_bytes(b"x" * 1001)
    (taken,) = await small.attach([user_image("at.png")])
    assert isinstance(taken, ImageBlock) and taken.sha256 is not None
    with pytest.raises(ImageRefused) as refused:
        await small.attach([user_image("over.png")])
    assert refused.value.reason == (
        "1,001 bytes; an image may have at most 1,000 bytes (the setting max_image_bytes)"
    )


async def test_steering_and_tool_images_that_are_refused_become_a_line_saying_why(
    host: Host, workspace: Path, secret: Path
) -> None:
    """R-SEC-8, R-STEER-2: a refused image in steering or in a tool's result does not cost
    the words around it: it becomes ``[image refused: <path>: <reason>]`` and the task
    goes on."""
    (workspace / "link.png").symlink_to(secret)
    started = trio.Event()
    release = trio.Event()

    @tool
    async def wait(ctx: ToolContext) -> Sequence[TextBlock | ImageBlock]:
        """Wait."""
        started.set()
        await release.wait()
        return [TextBlock(text="here"), ImageBlock(path=str(ctx.workspace_dir / "link.png"))]

    provider = ScriptedProvider(
        [
            ScriptedReply(blocks=(tool_call("c1", "wait"),)),
            ScriptedReply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(tools=[wait], provider=provider, workspace_dir=workspace)
    stream = session.run("start", approve=allow)
    with trio.fail_after(RUN_TIMEOUT_S):
        await started.wait()
    assert session.steer([user_text("and this"), user_image("link.png")])
    release.set()
    outputs = await collect(stream)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    why = "a symbolic link (images are read without following links)"
    steering = [o for o in of_type(outputs, UserMsg) if o.kind == "steering"]
    assert [o.content for o in steering] == [
        (TextBlock(text="and this"), TextBlock(text=f"[image refused: link.png: {why}]"))
    ]
    (result,) = [
        part
        for message in provider.requests[1].messages
        for part in getattr(message, "content", ())
        if isinstance(part, ToolResult)
    ]
    link = workspace / "link.png"
    assert result.content == (
        TextBlock(text="here"),
        TextBlock(text=f"[image refused: {link}: {why}]"),
    )


async def test_the_read_happens_off_the_event_loop(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-8: the file is read in a worker thread — while the read is in progress, another
    task of the event loop runs (deterministically: the read waits for it). Were the read
    on the event loop, ``trio.from_thread`` would refuse to run there and the read would
    fail."""
    (workspace / "pic.png").write_bytes(PNG)
    real_read = attachments.read_named
    reading = trio.Event()
    loop_ran = threading.Event()
    ticks: list[str] = []

    def watched_read(path: str, **kwargs: Any) -> bytes:
        trio.from_thread.run_sync(reading.set)
        assert loop_ran.wait(RUN_TIMEOUT_S), "the event loop made no progress during the read"
        return real_read(path, **kwargs)

    monkeypatch.setattr(attachments, "read_named", watched_read)
    session = await host.create_session(provider=ScriptedProvider([]), workspace_dir=workspace)

    async def meanwhile() -> None:
        await reading.wait()
        ticks.append("the loop ran while the file was read")
        loop_ran.set()

    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(meanwhile)
            (image,) = await session.attach([user_image("pic.png")])
    assert ticks == ["the loop ran while the file was read"]
    assert isinstance(image, ImageBlock) and image.sha256 == hashlib.sha256(PNG).hexdigest()


async def test_an_interrupt_does_not_wait_for_a_read_that_hangs(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-2, R-SEC-8: a prompt's image is read before the task's scope exists; an
    interrupt during that read (a file system that hangs) abandons it, and the task ends
    aborted with nothing recorded or sent."""
    (workspace / "pic.png").write_bytes(PNG)
    reading = trio.Event()
    release = threading.Event()

    def hanging_read(path: str, **kwargs: Any) -> bytes:
        trio.from_thread.run_sync(reading.set)
        release.wait(3 * RUN_TIMEOUT_S)
        raise attachments.Refused("released")

    monkeypatch.setattr(attachments, "read_named", hanging_read)
    provider = ScriptedProvider([ScriptedReply(blocks=(text("never"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    try:
        stream = session.run([user_text("look"), user_image("pic.png")])
        with trio.fail_after(RUN_TIMEOUT_S):
            await reading.wait()
            assert session.interrupt("stop")
            outputs = await collect(stream)
    finally:
        release.set()
    (end,) = outputs
    assert isinstance(end, TaskEnd) and (end.status, end.message) == ("aborted", "stop")
    assert provider.requests == []


async def test_a_request_reads_its_images_off_the_event_loop(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-8: the provider reads the private copy for a request in a worker thread too."""
    (workspace / "pic.png").write_bytes(PNG)
    real_bytes = media.image_bytes
    reading = trio.Event()
    loop_ran = threading.Event()

    def watched_bytes(block: ImageBlock, source: Any) -> bytes | None:
        trio.from_thread.run_sync(reading.set)
        assert loop_ran.wait(RUN_TIMEOUT_S), "the event loop made no progress during the read"
        return real_bytes(block, source)

    monkeypatch.setattr(media, "image_bytes", watched_bytes)

    async def meanwhile() -> None:
        await reading.wait()
        loop_ran.set()

    async with open_mock_server(Reply([Text("A picture.")])) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=anthropic(server), workspace_dir=workspace, model="claude-x"
            )
            with trio.fail_after(RUN_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(meanwhile)
                    outputs = await collect(
                        session.run([user_text("look"), user_image("pic.png")])
                    )
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert [sent_images(r) for r in server.requests] == [[b64(PNG)]]


async def test_a_reloaded_session_sends_the_bytes_read_then(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-8, R-TRACE-4: the trace records the hash; after the file changed and the session
    was closed and loaded again, its next request still sends the first bytes, from the
    private copy (0600 in a 0700 directory of the session's)."""
    (workspace / "pic.png").write_bytes(PNG)
    async with open_mock_server(Reply([Text("One.")]), Reply([Text("Two.")])) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=anthropic(server), workspace_dir=workspace, model="claude-x"
            )
            await collect(session.run([user_text("look"), user_image("pic.png")]))
            session_id = session.id
            await host.close_session(session_id)
        (workspace / "pic.png").write_bytes(OTHER_PNG)
        async with Host.open(tmp_path / "data") as host:
            loaded = await host.load_session(session_id, provider=anthropic(server))
            await collect(loaded.run("and now?"))
        server.assert_clean()
    assert [sent_images(r) for r in server.requests] == [[b64(PNG)], [b64(PNG)]]
    digest = hashlib.sha256(PNG).hexdigest()
    copy = tmp_path / "data" / "sessions" / session_id / "attachments" / digest
    assert copy.read_bytes() == PNG
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
    (prompt, *_) = [
        json.loads(line)
        for line in (copy.parent.parent / "trace_001.jsonl").read_text().splitlines()
    ]
    assert prompt["content"][1] == {
        "type": "image",
        "path": "pic.png",
        "media_type": "image/png",
        "sha256": digest,
    }


async def test_an_old_trace_without_the_hash_reads_the_file_the_safe_way(
    tmp_path: Path, workspace: Path, secret: Path
) -> None:
    """R-SEC-8, R-TRACE-4: a trace written before attachments names images by path only; a
    loaded session reads them through the same reader (no link, regular files, the limit):
    a file still there is sent, one swapped for a link to a secret folds to its
    ``[attached image: <path>]`` line."""
    (workspace / "a.png").write_bytes(PNG)
    (workspace / "b.png").write_bytes(SHOT)
    async with open_mock_server(Reply([Text("One.")]), Reply([Text("Two.")])) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=anthropic(server), workspace_dir=workspace, model="claude-x"
            )
            await collect(
                session.run([user_text("look"), user_image("a.png"), user_image("b.png")])
            )
            session_id = session.id
            await host.close_session(session_id)
        trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
        records = [json.loads(line) for line in trace.read_text().splitlines()]
        for block in records[0]["content"]:
            block.pop("sha256", None)
            block.pop("media_type", None)
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        (workspace / "b.png").unlink()
        (workspace / "b.png").symlink_to(secret)
        async with Host.open(tmp_path / "data") as host:
            loaded = await host.load_session(session_id, provider=anthropic(server))
            await collect(loaded.run("and now?"))
        server.assert_clean()
    assert sent_images(server.requests[1]) == [b64(PNG)]
    assert b"[attached image: b.png]" in server.requests[1].raw_body
    assert_no_secret(server)


async def test_an_old_trace_naming_the_data_dir_the_workspace_holds_sends_no_image(
    tmp_path: Path,
) -> None:
    """R-SEC-7, R-TRACE-4: an image of an old trace (a path, no hash) that leads into the
    data dir the workspace holds is not read for a request either: it goes as its
    ``[attached image: <path>]`` line."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "pic.png").write_bytes(PNG)
    async with open_mock_server(Reply([Text("One.")]), Reply([Text("Two.")])) as server:
        async with Host.open(home / "data") as host:
            session = await host.create_session(
                provider=anthropic(server), workspace_dir=home, model="claude-x"
            )
            await collect(session.run([user_text("look"), user_image("pic.png")]))
            await host.close_session(session.id)
        private = f"data/sessions/{session.id}/attachments/{hashlib.sha256(PNG).hexdigest()}"
        trace = home / "data" / "sessions" / session.id / "trace_001.jsonl"
        records = [json.loads(line) for line in trace.read_text().splitlines()]
        image = records[0]["content"][1]
        image.pop("sha256")
        image["path"] = private
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        async with Host.open(home / "data") as host:
            loaded = await host.load_session(session.id, provider=anthropic(server))
            await collect(loaded.run("and now?"))
        server.assert_clean()
    assert sent_images(server.requests[1]) == []
    assert f"[attached image: {private}]".encode() in server.requests[1].raw_body


async def test_gateway_run_refuses_an_image_it_cannot_take_with_invalid_params(
    tmp_path: Path, secret: Path
) -> None:
    """R-SEC-8 over the websocket: ``run``, ``steer`` and ``follow_up`` answer -32602 naming
    the block and why — a link, a FIFO, a file over the limit, a path out of the
    workspace — without blocking, and nothing of the call is done; a client cannot raise
    the limit."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            workspace = server.host.get_session(sid).workspace_dir
            (workspace / "link.png").symlink_to(secret)
            os.mkfifo(workspace / "pipe.png")
            with (workspace / "huge.png").open("wb") as f:
                f.truncate(6 * MIB)
            cases = {
                "link.png": "'link.png': a symbolic link (images are read without following links)",
                "pipe.png": "'pipe.png': a FIFO, not a regular file",
                "huge.png": "'huge.png': 6,291,456 bytes; an image may have at most 5,242,880",
                "missing.png": "'missing.png': no such file",
                "../x.png": "'../x.png': outside the session's workspace",
            }
            for method in ("run", "steer", "follow_up"):
                for name, reason in cases.items():
                    blocks = [{"type": "text", "text": "see"}, {"type": "image", "path": name}]
                    error = await client.error(method, {"session_id": sid, "input": blocks})
                    assert error["code"] == jsonrpc.INVALID_PARAMS
                    assert error["message"].startswith(f"$.input[1].path: {reason}"), error
            raise_limit = await client.error(
                "session.create", {"settings": {"max_image_bytes": 1 << 30}}
            )
            assert "$.settings.max_image_bytes" in raise_limit["message"]
    assert server.providers[0].requests == []


async def test_acp_inline_image_over_the_limit_is_refused(tmp_path: Path) -> None:
    """R-SEC-8 for an editor's inline (base64) image: the limit is checked on the base64
    text before decoding; a refused image is -32602 naming the block, and nothing is
    stored or run."""
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    peer = NdjsonPeer(to_agent, from_agent)
    provider = ScriptedProvider([ScriptedReply(blocks=(text("A picture."),))])
    config = AcpConfig(provider=provider, settings={"max_image_bytes": 1000})
    answers: list[dict[str, Any]] = []

    async def call(method: str, params: dict[str, Any]) -> dict[str, Any]:
        request_id = len(answers) + 1
        await peer.write({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        while True:
            frame = await peer.read()
            if frame.get("id") == request_id and "method" not in frame:
                answers.append(frame)
                return frame

    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            nursery.start_soon(AcpAgent(host, config, agent_out).serve, agent_in)
            await call("initialize", {"protocolVersion": 1})
            created = await call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]

            def image(size: int, mime: str = "image/png") -> dict[str, Any]:
                return {"type": "image", "mimeType": mime, "data": b64(b"x" * size)}

            over = await call("session/prompt", {"sessionId": sid, "prompt": [image(1001)]})
            way_over = await call(
                "session/prompt",
                {"sessionId": sid, "prompt": [{"type": "text", "text": "a"}, image(4000)]},
            )
            not_image = await call(
                "session/prompt", {"sessionId": sid, "prompt": [image(10, "text/plain")]}
            )
            taken = await call("session/prompt", {"sessionId": sid, "prompt": [image(1000)]})
            await to_agent.aclose()
    limit = "an image may have at most 1,000 bytes (the setting max_image_bytes)"
    assert over["error"]["code"] == jsonrpc.INVALID_PARAMS
    assert over["error"]["message"] == f"$.prompt[0]: 1,001 bytes; {limit}"
    assert way_over["error"]["message"] == f"$.prompt[1]: 4,000 bytes; {limit}"
    assert not_image["error"]["message"] == "$.prompt[0]: 'text/plain' is not an image type"
    assert taken["result"]["stopReason"] == "end_turn"
    (request,) = provider.requests
    (block,) = [p for p in request.messages[-1].content if isinstance(p, ImageBlock)]
    stored = tmp_path / "data" / "sessions" / sid / "attachments"
    assert [p.name for p in stored.iterdir()] == [block.sha256]
