"""Every place that reacts to each kind of output handles every kind (the output contract).

The dispatchers ``match`` on :data:`~greenroom.protocols.outputs.Output` and end with
``case _: assert_never(output)``. Two checks keep that true: each dispatcher takes one
output of every class, root and forwarded, without raising; and mypy, run on the package
with one more class in the union, names every dispatcher as not handling it, so adding an
output without deciding what each screen, hub and transcript does with it fails the check.
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio
from test_protocol_roundtrip import EXAMPLES

from greenroom.actors.apps.chat import ChatRenderer
from greenroom.actors.apps.render import HumanRenderer, JsonRenderer, format_record
from greenroom.actors.gateway import hubs
from greenroom.actors.runtime import subagents, tree
from greenroom.protocols import a2a, ag_ui, outputs
from greenroom.protocols.history import live_records
from greenroom.protocols.messages import SubagentOutputs, SupervisorMessage
from greenroom.protocols.transcript import Transcript, rebuild

ROOT = Path(__file__).resolve().parent.parent

ORIGINS: list[tuple[str, ...] | None] = [None, ("root", "child")]


def every_output() -> Iterator[outputs.Output]:
    """One output of each class, from the session itself and forwarded from a subagent."""
    for origin in ORIGINS:
        for seq, cls in enumerate(outputs.OUTPUT_CLASSES, start=1):
            traced_seq = seq if cls.TRACED else None
            yield cls(session_id="s1", run_id="r1", seq=traced_seq, origin=origin, **EXAMPLES[cls])


class _FakeSession:
    id = "s1"
    origin_path = ("root", "child")

    def __init__(self) -> None:
        self.interrupts: list[str] = []

    def subscribe(self, callback: Callable[[list[outputs.Output]], None]) -> Callable[[], None]:
        return lambda: None

    def send(self, message: Any) -> bool:
        self.interrupts.append(message.reason)
        return True


def _terminal_renderers() -> list[Any]:
    out, err = io.StringIO(), io.StringIO()
    return [
        HumanRenderer(out, err),
        JsonRenderer(out),
        ChatRenderer(out, err, live=False),
    ]


async def test_renderers_show_every_output() -> None:
    for renderer in _terminal_renderers():
        for output in every_output():
            renderer.show(output)


def test_trace_records_format_every_output() -> None:
    lines = [format_record(output) for output in every_output()]
    assert all(line.strip() for line in lines)
    model_msg = next(line for line in lines if " model_msg " in line)
    assert "tool_call toolu_1 lookup" in model_msg


def test_gateway_hub_follows_every_output() -> None:
    ended: list[object] = []
    hub = hubs.SessionHub(_FakeSession(), on_task_end=ended.append)  # type: ignore[arg-type]
    batch = list(every_output())
    hub._fan_out(batch)
    assert len(ended) == 1  # only the session's own task_end, not the subagent's
    assert hub.finishing  # task_end is the last class of the union


def test_a2a_fold_takes_every_output() -> None:
    fold = a2a.TaskFold(context_id="s1", run_id="r1", file_data=lambda block: ("image/png", ""))
    for output in every_output():
        fold.apply(output)
    assert fold.state in a2a.END_STATES  # task_end is the last class of the union


def test_ag_ui_mapper_takes_every_output() -> None:
    mapper = ag_ui.RunMapper(thread_id="s1", run_id="front-1")
    events = [event for output in every_output() for event in mapper.map(output)]
    assert mapper.ended and events[-1]["type"] == "RUN_FINISHED"


def test_transcript_takes_every_output() -> None:
    """Fed every output (what a rewind cut left out, as a rewinding session rebuilds its
    transcript from what the rewind keeps: R-FORK-2), the live transcript is the rebuilt
    one; the example rewind cuts the records after seq 2."""
    own = [o for o in every_output() if o.origin is None]
    transcript = Transcript()
    for output in live_records(own):
        transcript.apply(output)
    rebuilt = rebuild(own)
    assert rebuilt.messages == transcript.messages
    last = max(o.seq for o in own if o.seq is not None)  # the rewind's and what follows it
    assert [o.seq for o in live_records(own) if o.seq is not None] == [1, 2, last - 1, last]
    cut = Transcript()
    for output in own:
        cut.apply(output)
    assert cut.messages != rebuilt.messages  # the compaction after seq 2 was cut


async def test_subagent_watch_follows_every_output() -> None:
    """The watch of a child's run counts the usage of its whole subtree (its own and the
    forwarded outputs) and keeps its own task_end."""
    child = _FakeSession()
    watch = subagents.ChildWatch(child, -1)  # type: ignore[arg-type]
    # Room for the one batch: sent before the watch reads.
    batches_send, batches = trio.open_memory_channel[list[outputs.Output]](1)
    batches_send.send_nowait(list(every_output()))
    batches_send.close()
    await watch.follow(batches)
    assert watch.end is not None and watch.end.origin is None
    assert watch.used == 2 * EXAMPLES[outputs.TokenUsageOutput]["request"].total
    assert child.interrupts == []


async def test_forwarding_up_takes_every_output() -> None:
    """A child's batches reach its parent: through its supervisor's inbox while it runs,
    else straight to its subscribers, each untagged output tagged with the child's path."""
    parent = _FakeParent()
    forward = tree.forward_up(_FakeSession(), parent)  # type: ignore[arg-type]
    # Unbounded: the forwarder sends with send_nowait; the test reads afterwards.
    parent.inbox, reported = trio.open_memory_channel[SupervisorMessage](math.inf)
    forward(list(every_output()))
    (message,) = [reported.receive_nowait()]
    assert isinstance(message, SubagentOutputs) and message.origin == ("root", "child")
    assert list(message.outputs) == list(every_output())
    parent.inbox.close()
    forward(list(every_output()))
    (published,) = parent.published
    assert [o.origin for o in published] == [("root", "child")] * len(published)


class _FakeParent:
    def __init__(self) -> None:
        self.inbox: trio.MemorySendChannel[SupervisorMessage] | None = None
        self.published: list[list[outputs.Output]] = []
        self.parked_task = None  # not parked: no run's reader besides its subscribers

    def send(self, message: SupervisorMessage) -> bool:
        assert self.inbox is not None
        try:
            self.inbox.send_nowait(message)
        except trio.ClosedResourceError:
            return False
        return True

    def publish(self, batch: list[outputs.Output]) -> None:
        self.published.append(batch)


# -- the static check ----------------------------------------------------------------------

DISPATCHERS = {
    ("actors/apps/render.py", "Renderer._mark_shown"),
    ("actors/apps/render.py", "HumanRenderer.show"),
    ("actors/apps/render.py", "HumanRenderer._show_subagent"),
    ("actors/apps/render.py", "_record_detail"),
    ("actors/apps/chat.py", "ChatRenderer.show"),
    ("actors/gateway/hubs.py", "SessionHub._fan_out"),
    ("actors/runtime/subagents.py", "ChildWatch.on_batch"),
    ("protocols/transcript.py", "Transcript.apply"),
    ("protocols/transcript.py", "rebuild"),
    ("protocols/task.py", "TaskRecord.observe"),
    ("protocols/acp.py", "UpdateMapper.map"),
    ("actors/observers/otel.py", "GenAIObserver._map"),
    ("actors/runtime/session.py", "RunStream._note"),
    ("protocols/a2a.py", "TaskFold.apply"),
    ("protocols/ag_ui.py", "RunMapper.map"),
}

EXTRA_OUTPUT = '''
@_documented
@attrs.frozen(kw_only=True, slots=True)
class ExtraOutput(Envelope):
    """A newly added output."""

    TYPE: ClassVar[str] = "extra_output"
    TRACED: ClassVar[bool] = True


'''


def _function_at(path: Path, line: int) -> str:
    """The qualified name of the innermost function around ``line`` of ``path``."""
    found = ""

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                end = child.end_lineno or child.lineno
                if child.lineno <= line <= end:
                    found = prefix + child.name
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def _typecheck_tree(base: Path) -> Path:
    """The packages under their installed names, as ``tasks.py check`` lays them out."""
    package = base / "greenroom"
    package.mkdir(parents=True)
    for name in ("actors", "protocols"):
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    for name in ("__init__.py", "py.typed"):
        (package / name).symlink_to(ROOT / "actors" / "_root" / name)
    return base


def test_mypy_names_every_dispatcher_that_misses_a_new_output(tmp_path: Path) -> None:
    source = (ROOT / "protocols" / "outputs.py").read_text()
    union = "Output: TypeAlias = (\n"
    assert source.count(union) == 1
    shadow = tmp_path / "outputs.py"
    shadow.write_text(source.replace(union, EXTRA_OUTPUT + union + "    ExtraOutput\n    |"))
    tree = _typecheck_tree(tmp_path / "typecheck")
    cache = tmp_path / "mypy_cache"
    if (ROOT / ".mypy_cache").is_dir():
        # A copy of the project's cache: only what depends on outputs.py is checked again.
        # A file that a concurrent check replaces while it is copied is checked afresh.
        with contextlib.suppress(shutil.Error):
            shutil.copytree(ROOT / ".mypy_cache", cache)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "-p",
            "greenroom",
            "--cache-dir",
            str(cache),
            "--shadow-file",
            str(tree / "greenroom" / "protocols" / "outputs.py"),
            str(shadow),
        ],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    missed = set()
    for line in errors:
        match = re.match(r".*?/greenroom/(.+?):(\d+): error: (.*)", line)
        assert match, line
        relative, number, message = match.groups()
        assert '"assert_never" has incompatible type "ExtraOutput"' in message, line
        missed.add((relative, _function_at(ROOT / relative, int(number))))
    assert missed == DISPATCHERS, result.stdout
