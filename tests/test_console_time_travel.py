"""The web console and time travel (R-FORK-1, R-FORK-2): "Fork from here" on a message
makes a new session with the history up to there and shows it; a rewind, wherever it was
asked, takes the cut rows out of the log of every page that shows the session. Driven in
headless Chromium like ``tests/test_console.py`` (whose helpers these reuse)."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import trace_lines
from test_console import (
    BROWSER_BOUND_S,
    chromium,
    first_prompt,
    needs_chromium,
    open_console,
    stack,
    task_end_rows,
)

from greenroom.actors.providers.scripted import Reply, ScriptStep, text

COMPLETED = f"document.querySelectorAll('{task_end_rows('completed')}')"


def script() -> list[ScriptStep]:
    return [Reply(blocks=(text(f"answer {n}"),)) for n in (1, 2, 3)]


@needs_chromium
async def test_browser_forks_from_an_answer_and_shows_a_rewind(tmp_path: Path) -> None:
    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, script) as server, chromium(tmp_path) as page:
            await open_console(page, server)
            source = await first_prompt(page, server, "one")
            await page.wait_for(f"{COMPLETED}.length === 1")
            await page.type_and_send("two")
            await page.wait_for(f"{COMPLETED}.length === 2")
            # The row's text is the message's own; the button is named for screen readers.
            assert await page.texts("[data-type=model_msg]") == ["answer 1", "answer 2"]
            label = await page.js(
                "document.querySelector('[data-type=model_msg] [data-testid=fork-here]')"
                ".getAttribute('aria-label')"
            )
            assert label == "Fork from here"

            await page.click("[data-type=model_msg] [data-testid=fork-here]")
            fork_id = await page.wait_for(
                f"(() => {{ const id = document.querySelector('#session-id').textContent;"
                f" return id && id !== '{source}' && "
                "document.querySelector('#log').dataset.subscribed === id && id; })()"
            )
            fork = server.host.get_session(fork_id)
            records = trace_lines(server.host.get_session(source))
            first_end = next(r["seq"] for r in records if r["type"] == "task_end")
            assert fork.forked_from == (source, first_end)
            await page.wait_for(f"{COMPLETED}.length === 1")
            assert await page.texts("[data-type=model_msg]") == ["answer 1"]
            assert fork_id in await page.texts("#sessions .sid")

            await page.type_and_send("three")
            await page.wait_for(f"{COMPLETED}.length === 2")
            await fork.rewind(first_end, reason="asked by a test")
            await page.wait_for("!!document.querySelector('[data-type=rewind]')")
            assert await page.texts("[data-type=model_msg]") == ["answer 1"]
            assert await page.count(task_end_rows("completed")) == 1
            (note,) = await page.texts("[data-type=rewind]")
            assert note.startswith(f"Rewoundto record {first_end}") and "asked by a test" in note
            # A page that opens the session later replays it the same way.
            await open_console(page, server)
            await page.js(f"document.querySelector('[data-session-id=\"{fork_id}\"]').click()")
            await page.wait_for("!!document.querySelector('[data-type=rewind]')")
            assert await page.texts("[data-type=model_msg]") == ["answer 1"]
