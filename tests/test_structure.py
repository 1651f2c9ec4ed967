"""The shape of the runtime (R-ACTOR-1..3), checked in the source.

* No code in ``actors/`` reaches into another object's private names (``other._x``): actors
  talk through messages and public seams, never through each other's fields.
* Every actor of the card starts with ``nursery.start(actor.run, …)``: it has a ``run``
  coroutine taking ``task_status``.
* No class is over about 450 lines: a class that long holds several jobs.
* ``protocols/`` is pure: it imports neither trio nor an HTTP library.
* The modules of ``actors/`` import each other without cycles (lazy imports inside
  functions aside, which break no cycle at import time).
* Every public function, method and class of ``actors/`` and ``protocols/`` has a docstring.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACTORS = ROOT / "actors"
PROTOCOLS = ROOT / "protocols"

MAX_CLASS_LINES = 450

# Private names of the standard library that are its public API.
ALLOWED_PRIVATE = {"os._exit", "sys._getframe"}

CARD_ACTORS = {
    "SessionSupervisor",
    "LLMStreamer",
    "ToolPool",
    "ApprovalBroker",
    "TaskWork",
    "TraceSink",
}


def modules(folder: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_object_reaches_into_another_objects_private_names() -> None:
    found: list[str] = []
    for path, tree in modules(ACTORS):
        # A module's own classes are not another object: a dispatch table may name their
        # methods.
        own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", *own_classes):
                continue
            text = ast.unparse(node)
            if text in ALLOWED_PRIVATE:
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert found == [], "\n".join(found)


def test_every_card_actor_has_a_run_entry_taking_task_status() -> None:
    seen: dict[str, bool] = {}
    for _, tree in modules(ACTORS):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in CARD_ACTORS:
                runs = [
                    item
                    for item in node.body
                    if isinstance(item, ast.AsyncFunctionDef) and item.name == "run"
                ]
                seen[node.name] = any(
                    "task_status" in {a.arg for a in (*r.args.args, *r.args.kwonlyargs)}
                    for r in runs
                )
    assert set(seen) == CARD_ACTORS, f"missing actors: {CARD_ACTORS - set(seen)}"
    assert all(seen.values()), {name: ok for name, ok in seen.items() if not ok}


@pytest.mark.parametrize("folder", [ACTORS, PROTOCOLS], ids=["actors", "protocols"])
def test_no_class_is_over_450_lines(folder: Path) -> None:
    long = [
        f"{path.relative_to(ROOT)}: {node.name} ({(node.end_lineno or 0) - node.lineno + 1})"
        for path, tree in modules(folder)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (node.end_lineno or 0) - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == [], long


def test_protocols_import_no_io_library() -> None:
    forbidden = {"trio", "httpx", "anthropic", "openai", "socket", "sqlite3", "asyncio"}
    found = []
    for path, tree in modules(PROTOCOLS):
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in forbidden
            ]
    assert found == [], found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return "greenroom." + ".".join(parts)


def test_actor_modules_import_each_other_without_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for path, tree in modules(ACTORS):
        name = _module_name(path)
        edges = graph.setdefault(name, set())
        # Only imports executed when the module loads: top level, not inside functions
        # and not under TYPE_CHECKING.
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for child in ast.walk(node) if not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ) else ():
                if isinstance(child, ast.ImportFrom) and child.module:
                    if child.module.startswith("greenroom.actors"):
                        edges.add(child.module)
                elif isinstance(child, ast.Import):
                    edges.update(
                        a.name for a in child.names if a.name.startswith("greenroom.actors")
                    )
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for name, edges in graph.items():
        edges.discard(name)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state and not node.endswith(".__init__"):
            visit(node)
    package_cycles = [c for c in cycles if not any(n == "greenroom.actors" for n in c)]
    assert package_cycles == [], package_cycles


def test_every_memory_channel_states_why_its_buffer_is_that_size() -> None:
    """R-ACTOR-1: a channel's buffer is a decision (an unbounded one says why nothing can
    block there): each ``open_memory_channel`` has a comment in the three lines above."""
    unexplained: list[str] = []
    for path in sorted(ACTORS.rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "open_memory_channel" not in line or line.lstrip().startswith("#"):
                continue
            above = lines[max(0, number - 3) : number]
            if not any(text.lstrip().startswith("#") for text in above):
                unexplained.append(f"{path.relative_to(ROOT)}:{number + 1}")
    assert unexplained == []


def test_the_actor_tree_is_the_folder_tree() -> None:
    """The layout shows the architecture: the runtime's actors, the providers, the tools,
    the gateway, the programs and the observers each in a folder of ``actors/``."""
    expected = {
        "runtime": {"host", "session", "supervisor", "llm_streamer", "tool_pool",
                    "approval_broker", "compactor", "trace_sink", "trace_store", "storage"},
        "providers": {"registry", "anthropic", "openai", "openai_responses", "scripted"},
        "tools": {"builtin", "sandbox", "mcp"},
        "gateway": {"server", "connection", "methods", "hubs"},
        "apps": {"cli", "parser", "run", "render", "asking", "exits", "serve_command",
                 "trace_command", "approvals", "chat", "demo", "acp"},
        "observers": {"otel"},
    }
    for folder, names in expected.items():
        present = {p.stem for p in (ACTORS / folder).glob("*.py")}
        assert names <= present, (folder, names - present)
    loose = {p.stem for p in ACTORS.glob("*.py")} - {"__init__", "scripted"}
    assert loose == set(), "modules outside the tree's folders"


def test_the_session_handle_reaches_a_running_task_only_through_its_inbox() -> None:
    """R-ACTOR-1: outside its module a supervisor is built, started (``run``) and sent
    messages (``inbox``, the send side of its one inbox) — nothing else is called or read,
    and no object keeps the supervisor itself."""
    misuse: list[str] = []
    for path, tree in modules(ACTORS):
        if path.name == "supervisor.py":
            continue
        supervisors: set[str] = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "SessionSupervisor"
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        supervisors.add(target.id)
                    else:
                        misuse.append(f"{path.name}:{node.lineno}: keeps a supervisor")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in supervisors
                and node.attr not in {"run", "inbox"}
            ):
                misuse.append(f"{path.name}:{node.lineno}: supervisor.{node.attr}")
    assert misuse == []


def _is_overload(node: ast.stmt) -> bool:
    """An ``@overload`` signature: the implementation that follows carries the docstring."""
    decorators = getattr(node, "decorator_list", [])
    return any(
        (isinstance(d, ast.Name) and d.id == "overload")
        or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in decorators
    )


def _undocumented(body: list[ast.stmt], prefix: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of each public definition of ``body`` without a docstring,
    and of those of its classes; function bodies are not entered."""
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_") or _is_overload(node):
            continue
        name = f"{prefix}{node.name}"
        if ast.get_docstring(node) is None:
            yield node.lineno, name
        if isinstance(node, ast.ClassDef):
            yield from _undocumented(node.body, f"{name}.")


def test_every_public_definition_has_a_docstring() -> None:
    """Public functions, methods and classes of ``actors/`` and ``protocols/`` state their
    contract in a docstring (functions nested inside functions are not public)."""
    missing: list[str] = []
    for folder in (ACTORS, PROTOCOLS):
        for path, tree in modules(folder):
            where = path.relative_to(ROOT)
            for line, name in _undocumented(tree.body, ""):
                missing.append(f"{where}:{line} {name}")
    assert missing == []


def test_the_apps_use_the_runtime_providers_and_tools_through_their_package_roots() -> None:
    """The programs are built on the packages' public names (``greenroom.actors.runtime``,
    ``…providers``, ``…tools``), not on the modules behind them."""
    deep: list[str] = []
    for path, tree in modules(ACTORS / "apps"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["greenroom", "actors"] and len(parts) > 3 and parts[2] in {
                    "runtime", "providers", "tools"
                }:
                    deep.append(f"{path.name}:{node.lineno}: {node.module}")
    assert deep == []


def test_watchers_of_a_session_are_tasks_with_their_own_inbox() -> None:
    """R-ACTOR-1: the gateway, the observers, the cluster node and the ACP agent watch a
    session through ``Session.watch`` (their own task drains their own inbox), never
    through ``Session.subscribe``, whose listener runs inside the publishing task. A call
    counts when its receiver names a session (``session``, ``self._session``,
    ``hub.session``…): other ``subscribe`` methods (NATS subjects, the hubs) take none."""
    watchers = [ACTORS / "gateway", ACTORS / "observers", ACTORS / "cluster"]
    paths = [p for folder in watchers for p in sorted(folder.rglob("*.py"))]
    paths.append(ACTORS / "apps" / "acp.py")
    found: list[str] = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            last = receiver.attr if isinstance(receiver, ast.Attribute) else None
            if isinstance(receiver, ast.Name):
                last = receiver.id
            if node.func.attr == "subscribe" and last and "session" in last.lower():
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "\n".join(found)


def _imported_modules(tree: ast.Module) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import of ``tree``, TYPE_CHECKING and function
    bodies included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore is its module's own: importing it from another
    module couples the two behind their public names' backs."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}.{name}"
        for folder in (ACTORS, PROTOCOLS)
        for path, tree in modules(folder)
        for line, module, names in _imported_modules(tree)
        if module.startswith("greenroom.")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert found == []


def test_the_apps_import_each_other_without_cycles_even_lazily() -> None:
    """The programs are layered (issue: the house, item 5): ``cli`` dispatches to the
    commands, the commands build on ``run``, ``asking`` and ``render``, and those on
    ``exits`` and ``parser``; nothing below imports what is above it. Unlike the package
    wide check, imports inside functions count: a lazy import that closes a cycle still
    ties the two modules into one."""
    apps = "greenroom.actors.apps."
    graph: dict[str, set[str]] = {}
    for path, tree in modules(ACTORS / "apps"):
        name = _module_name(path)
        graph[name] = set()
        for _, module, names in _imported_modules(tree):
            if module == "greenroom.actors.apps":
                graph[name].update(apps + n for n in names)
            elif module.startswith(apps):
                graph[name].add(module)
        graph[name].discard(name)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state and target in graph:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_no_runtime_module_but_the_host_imports_the_session_handle() -> None:
    """The task port is the runtime's seam (issue: the house): the supervisor, the emitter,
    compaction, subagents and every other runtime module work on a ``SessionPort``, never
    on the user's ``Session`` — not even for type checking. Only the host, which makes
    sessions, and the package's re-exports name it."""
    found: list[str] = []
    for path, tree in modules(ACTORS / "runtime"):
        if path.name in {"host.py", "__init__.py", "session.py"}:
            continue
        for line, module, _ in _imported_modules(tree):
            if module == "greenroom.actors.runtime.session":
                found.append(f"{path.name}:{line}")
    assert found == []



def test_provider_adapters_import_nothing_from_the_runtime() -> None:
    """The provider seam sits at the rim (``actors/providers/base.py``): an adapter is
    written against it and ``protocols/``, so it can be read, tested and replaced without
    the runtime — which drives adapters through that seam only."""
    found = [
        f"{path.name}:{line}: {module}"
        for path, tree in modules(ACTORS / "providers")
        for line, module, _ in _imported_modules(tree)
        if module.startswith("greenroom.actors.runtime")
    ]
    assert found == []



@pytest.mark.parametrize("package", ["runtime", "providers", "tools"])
def test_no_name_a_package_exports_is_also_one_of_its_modules(package: str) -> None:
    # Importing a module sets the package's attribute of its name to the module: a
    # package that also exports an object under that name (``tools.ask_user``, the tool,
    # from ``tools/ask_user.py``) then gives the module to ``from package import name``
    # once anything has imported the module first.
    folder = ROOT / "actors" / package
    exported = importlib.import_module(f"greenroom.actors.{package}").__all__
    modules = {path.stem for path in folder.glob("*.py")} | {
        path.name for path in folder.iterdir() if (path / "__init__.py").exists()
    }
    assert sorted(set(exported) & modules) == []
