"""The web console as a reader sees it: the log follows the latest output, steering shows
as queued then delivered, model text renders as markdown with no raw HTML, the session
list names each session (R-HOST-5) with its last activity and state, and approval answers
use the one vocabulary of :mod:`greenroom.protocols.wording`.

Driven in headless Chromium like ``tests/test_console.py`` (whose helpers these reuse);
model text comes from the scripted provider.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from datetime import datetime
from pathlib import Path

import trio
from conftest import Gates, port_of
from test_console import (
    BROWSER_BOUND_S,
    LISTED,
    SUBSCRIBED,
    chromium,
    first_prompt,
    needs_chromium,
    open_console,
    stack,
    task_end_rows,
)

from greenroom.actors.gateway import TITLE_FILE
from greenroom.actors.gateway.console import PAGE_PATH
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    ScriptStep,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Output, RequestEnd
from greenroom.protocols.stream import BlockCompleted, ModelError, TextDelta
from greenroom.protocols.tools import tool
from greenroom.protocols.wording import DECISION_WORDS

LOG = "document.querySelector('#log')"
AT_BOTTOM = f"(l => l.scrollHeight - l.scrollTop - l.clientHeight < 2)({LOG})"
JUMP = "#jump-latest"


def test_the_page_keeps_the_decision_words_of_protocols_wording() -> None:
    page = PAGE_PATH.read_text(encoding="utf-8")
    match = re.search(r"const DECISION_WORDS = (\{.*?\});", page, re.DOTALL)
    assert match, "no DECISION_WORDS table in the page's script"
    table = json.loads(match.group(1))
    assert table == {f"{decision} {by}": words for (decision, by), words in DECISION_WORDS.items()}


# -- 1. following the latest output ---------------------------------------------------------------


@needs_chromium
async def test_browser_log_follows_the_latest_until_the_reader_scrolls_up(
    tmp_path: Path,
) -> None:
    lines = [f"Line {n} of a long streamed answer" for n in range(1, 121)]
    grown = trio.Event()
    more = trio.Event()

    async def one_growing_row(request: ModelRequest, stream: ScriptedStream) -> None:
        # One text block whose row grows delta by delta, paused half way.
        index = await stream.text_delta(lines[0] + "\n")
        for line in lines[1:60]:
            await stream._deliver([TextDelta(index=index, text=line + "\n")])
        grown.set()
        await more.wait()
        for line in lines[60:]:
            await stream._deliver([TextDelta(index=index, text=line + "\n")])
        full = "".join(line + "\n" for line in lines)
        await stream._deliver([BlockCompleted(index=index, block=TextBlock(text=full))])

    def script() -> list[ScriptStep]:
        return [one_growing_row, Reply(blocks=(text("\n\n".join(lines[:80])),))]

    def partial_has(line: str) -> str:
        return (
            "[...document.querySelectorAll('[data-type=partial_text]')]"
            f".some(r => r.textContent.includes({json.dumps(line + chr(10))}))"
        )

    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, script) as server, chromium(tmp_path) as page:
            await open_console(page, server)
            button = await page.js(
                f"(b => [b.tagName, b.type, b.textContent])(document.querySelector('{JUMP}'))"
            )
            assert button == ["BUTTON", "button", "Jump to latest ↓"]
            assert await page.js(f"document.querySelector('{JUMP}').hidden") is True

            await first_prompt(page, server, "Tell me everything")
            await grown.wait()
            await page.wait_for(partial_has(lines[59]))
            # One row grew taller than the log: the view followed it.
            assert await page.count("[data-type=partial_text]") == 1
            assert await page.js(f"{LOG}.scrollHeight > {LOG}.clientHeight + 300") is True
            assert await page.js(AT_BOTTOM) is True
            assert await page.js(f"document.querySelector('{JUMP}').hidden") is True

            # The reader scrolls up: the view stays where they are, the button appears.
            await page.js(f"{LOG}.scrollTop = 0")
            await page.wait_for(f"!document.querySelector('{JUMP}').hidden")
            more.set()
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")
            assert await page.js(f"{LOG}.scrollTop") == 0
            assert await page.js(AT_BOTTOM) is False
            assert await page.js(f"document.querySelector('{JUMP}').hidden") is False

            # "Jump to latest" brings them back, and the log follows again.
            await page.click(JUMP)
            assert await page.js(AT_BOTTOM) is True
            assert await page.js(f"document.querySelector('{JUMP}').hidden") is True
            await page.wait_for("document.querySelector('#send').textContent === 'Run'")
            await page.type_and_send("And again")
            await page.wait_for(
                f"document.querySelectorAll('{task_end_rows('completed')}').length === 2"
            )
            assert await page.js(AT_BOTTOM) is True


# -- 3. markdown, and no raw HTML -----------------------------------------------------------------

MARKDOWN = """# Report

Here is **bold**, *emphasis*, `inline <code>` and ~~gone~~.

| Region | Sales |
|:-------|------:|
| North  | `12`  |
| South  | 7     |

- first item
- second item with [a link](https://example.com/docs?q=1)
  - nested item
1. one
2. two

```python
print("<b>not bold</b>")
```

Bad: <img src=x onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script>
and [a trap](javascript:window.__pwned=3) and <b onclick="window.__pwned=4">raw</b>
and ![pic](javascript:window.__pwned=5) and [relative](/etc/passwd)."""

PATHOLOGICAL = "*" * 4000 + "[" * 4000 + "`" * 3 + "_a" * 4000 + "](" * 2000 + "<" * 4000


@needs_chromium
async def test_browser_renders_model_markdown_and_never_raw_html(tmp_path: Path) -> None:
    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text(MARKDOWN),)), Reply(blocks=(text(PATHOLOGICAL),))]

    msg = "[data-type=model_msg]"

    async def texts(selector: str) -> list[str]:
        return await page.texts(f"{msg} {selector}")

    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, script) as server, chromium(tmp_path) as page:
            await open_console(page, server)
            await first_prompt(page, server, "Write the report")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")

            # Nothing the model wrote as HTML became an element, nothing ran...
            for tag in ("img", "script", "b", "[onerror]", "[onclick]", "iframe"):
                assert await page.count(f"#log {tag}") == 0, tag
            assert await page.js("typeof window.__pwned") == "undefined"
            body = (await texts(".md"))[0]
            assert '<img src=x onerror="window.__pwned = 1">' in body
            assert "<script>window.__pwned = 2</script>" in body
            # ...and links go only to http(s) and mailto addresses.
            hrefs = await page.js(f"[...document.querySelectorAll('{msg} a')].map(a => a.href)")
            assert hrefs == ["https://example.com/docs?q=1"]
            rel = await page.js(f"document.querySelector('{msg} a').rel")
            assert "noopener" in rel and "noreferrer" in rel
            assert "a trap" in body and "relative" in body and "image: pic" in body

            # The markdown rendered as elements.
            assert await texts("h3") == ["Report"]
            assert await texts("strong") == ["bold"]
            assert await texts("em") == ["emphasis"]
            assert await texts("del") == ["gone"]
            assert await texts("p > code") == ["inline <code>"]
            assert await texts("table th") == ["Region", "Sales"]
            assert await texts("table td") == ["North", "12", "South", "7"]
            assert await texts("table td code") == ["12"]
            assert await texts("th.align-right") == ["Sales"]
            assert await texts(".md > ul > li > p") == [
                "first item",
                "second item with a link",
            ]
            assert await texts(".md > ul > li > ul > li") == ["nested item"]
            assert await texts(".md > ol > li") == ["one", "two"]
            assert await texts("pre > code") == ['print("<b>not bold</b>")']
            lang = await page.js(f"document.querySelector('{msg} pre > code').dataset.lang")
            assert lang == "python"

            # Text built to be slow to parse renders, as text (a parse that backtracks on it
            # would hold the page past the wait's bound).
            await page.wait_for("document.querySelector('#send').textContent === 'Run'")
            await page.type_and_send("Now something odd")
            await page.wait_for(
                f"document.querySelectorAll('{task_end_rows('completed')}').length === 2"
            )
            assert await page.count("#log img, #log script") == 0
            last = await page.js(f"[...document.querySelectorAll('{msg}')].at(-1).textContent")
            assert "<<<<" in last and "_a_a" in last


# -- 4. the session list --------------------------------------------------------------------------


@needs_chromium
async def test_browser_on_an_empty_data_dir_makes_no_session_until_a_prompt(
    tmp_path: Path,
) -> None:
    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text("Hello."),))]

    sessions_dir = tmp_path / "data" / "sessions"

    def stored() -> list[str]:
        return sorted(p.name for p in sessions_dir.iterdir()) if sessions_dir.exists() else []

    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, script) as server, chromium(tmp_path) as page:
            for _ in range(2):  # a first load and a reload
                await open_console(page, server)
                assert server.gateway.owned("default") == frozenset()
                assert stored() == []
                assert await page.js("document.querySelector('#sessions-empty').hidden") is False
                assert await page.js("document.querySelector('#prompt').disabled") is False
                assert await page.js("document.querySelector('#session-id').textContent") == (
                    "no session"
                )
                await page.send("Page.reload")
            await open_console(page, server)
            session_id = await first_prompt(page, server, "Hi")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")
            assert stored() == [session_id]
            await page.wait_for("document.querySelector('#sessions-empty').hidden")
            assert await page.texts("#sessions .sid") == [session_id]


def is_title_request(request: ModelRequest) -> bool:
    first = request.messages[0].content[0] if request.messages else None
    return (
        not request.tools
        and request.system is None
        and isinstance(first, TextBlock)
        and first.text.startswith("Give a short title")
    )


@needs_chromium
async def test_browser_lists_each_session_with_its_title_activity_and_state(
    tmp_path: Path, gates: Gates
) -> None:
    title_requests: list[ModelRequest] = []

    def script() -> ScriptStep:
        replies = [
            Reply(blocks=(text("Sales were up in the north."),)),
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("Waited."),)),
        ]

        def answer(request: ModelRequest) -> Reply:
            if is_title_request(request):
                title_requests.append(request)
                return Reply(blocks=(text('"Quarterly sales by region"'),))
            return replies.pop(0)

        return answer

    def state_is(session_id: str, words: str) -> str:
        button = f"document.querySelector('#sessions [data-session-id={json.dumps(session_id)}]')"
        return f"{button}.querySelector('.state').textContent === {json.dumps(words)}"

    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, script, tools=[gates.tool()], approve="ask", titles=True) as server,
            chromium(tmp_path) as page,
        ):
            await open_console(page, server)
            session_id = await first_prompt(page, server, "How did sales go last quarter?")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")

            # After the first task the gateway names the session once (R-HOST-5), in the
            # background; Refresh (or the page's own periodic refresh) shows it.
            titled = (
                "document.querySelector('#sessions .title').textContent"
                " === 'Quarterly sales by region'"
            )
            while not await page.js(titled):
                await page.click("#refresh")
                await trio.sleep(0.1)
            title_file = tmp_path / "data" / "sessions" / session_id / TITLE_FILE
            assert title_file.read_text(encoding="utf-8") == "Quarterly sales by region\n"
            assert await page.js("document.querySelector('#session-title').textContent") == (
                "Quarterly sales by region"
            )
            await page.wait_for(state_is(session_id, "idle"))
            when = await page.js(
                "(t => [t.dateTime, t.textContent])(document.querySelector('#sessions time'))"
            )
            last_activity = datetime.fromisoformat(when[0].replace("Z", "+00:00"))
            assert abs(last_activity.timestamp() - time.time()) < 120
            assert when[1] == "just now"

            # A tool call waits for an answer: the list says so, then "running" while the
            # allowed call runs, then "idle" again.
            await page.type_and_send("Now wait for it")
            await page.wait_for(state_is(session_id, "waiting for approval"))
            state = "document.querySelector('#session-state').textContent"
            assert await page.js(state) == "waiting for approval"
            await page.click("[data-type=approval_request] [data-testid=approve-allow]")
            await gates.started("a")
            await page.wait_for(state_is(session_id, "running"))
            gates.release("a")
            await page.wait_for(
                f"document.querySelectorAll('{task_end_rows('completed')}').length === 2"
            )
            await page.wait_for(state_is(session_id, "idle"))
            assert len(title_requests) == 1  # once per session, not once per task

            # A new page load lists it the same way (the title is stored).
            await page.send("Page.reload")
            await page.wait_for(f"{LISTED} && {SUBSCRIBED}")
            assert await page.texts("#sessions .title") == ["Quarterly sales by region"]


# -- 5. each decision once, long results collapsed, waits that outlived their task ------------

VISIBLE = "(e => { const r = e.getBoundingClientRect(); return r.width > 1 && r.height > 1; })"


@needs_chromium
async def test_browser_shows_a_decision_once_and_collapses_a_long_result(tmp_path: Path) -> None:
    """An answered approval reads once on screen (on its request; the decision's own row is
    kept for screen readers only); a tool result longer than a dozen lines shows its first
    lines and a button that shows it all, and back."""

    @tool(parallel=True)
    async def listing() -> str:
        """Forty lines."""
        return "\n".join(f"line {n}" for n in range(1, 41))

    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(tool_call("c1", "listing"),)),
            Reply(blocks=(text("Forty lines."),)),
        ]

    result = "[data-type=tool_call_output][data-call-id=c1]"
    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, script, tools=[listing], approve="ask") as server,
            chromium(tmp_path) as page,
        ):
            await open_console(page, server)
            await first_prompt(page, server, "List")
            await page.click("[data-type=approval_request] [data-testid=approve-allow]")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")
            shown = await page.js(
                "[...document.querySelectorAll('#log .row')]"
                f".filter({VISIBLE}).map(e => e.textContent).join('\\n')"
            )
            assert shown.count("allowed by you") == 1, shown
            assert await page.texts("[data-type=approval_decision]") == ["listing: allowed by you"]

            content = f"document.querySelector('{result} .content').textContent"
            toggle = f"{result} [data-testid=expand-result]"
            assert (await page.js(content)).splitlines() == [
                *(f"line {n}" for n in range(1, 13)), "…"
            ]
            assert await page.texts(toggle) == ["Show all 40 lines"]
            await page.click(toggle)
            assert (await page.js(content)).splitlines() == [f"line {n}" for n in range(1, 41)]
            assert await page.texts(toggle) == ["Show less"]
            assert await page.js(f"document.querySelector('{toggle}').ariaExpanded") == "true"
            await page.click(toggle)
            assert len((await page.js(content)).splitlines()) == 13


@needs_chromium
async def test_browser_ends_the_retry_countdown_of_a_task_that_is_over(tmp_path: Path) -> None:
    """A session whose trace stops in a reconnect wait (its host went away mid-wait) is idle
    when the page opens it: the failed request is shown, but no countdown runs and no
    "Retry now" / "Stop" is offered for a task that no longer exists."""
    overloaded = ModelError(
        kind="failed", message="overloaded", status_code=529, retry_after_s=60.0
    )
    waiting = trio.Event()

    def on_batch(batch: list[Output]) -> None:
        if any(isinstance(o, RequestEnd) and o.retry_in_ms for o in batch):
            waiting.set()

    # A first host runs the task into its 60 s wait; its session directory, copied then,
    # is what a host that died in the wait leaves behind.
    async with Host.open(tmp_path / "first") as first:
        provider = ScriptedProvider(
            [Reply(blocks=(text("Half"),), fail=overloaded, fail_after_blocks=1)]
        )
        session = await first.create_session(provider=provider, workspace_dir=tmp_path)
        session.subscribe(on_batch)
        session.run("Try it").detach()
        with trio.fail_after(BROWSER_BOUND_S):
            await waiting.wait()
            await port_of(session).sync_trace()
        shutil.copytree(session.directory, tmp_path / "data" / "sessions" / session.id)

    failed = "[data-type=request_end][data-status=failed]"
    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, lambda: []) as server, chromium(tmp_path) as page:
            server.gateway.grant("default", session.id)
            await open_console(page, server)
            await page.wait_for(f"!!document.querySelector('{failed}')")
            await page.wait_for(
                f"document.querySelectorAll('{failed} button').length === 0"
                f" && document.querySelector('{failed} .countdown').textContent === ''"
            )
            assert await page.js("document.querySelector('#send').textContent") == "Run"
