"""The console's input with ``@server:uri`` (R-MCP-5), in a real headless Chromium: the
gateway reads the resource through the session's MCP server (a real one, built with the
official SDK) and the page shows an unreadable one as its error, keeping the prompt."""

from __future__ import annotations

from pathlib import Path

import trio

from greenroom.actors.providers.scripted import Reply, ScriptStep, text
from tests.test_console import (
    BROWSER_BOUND_S,
    chromium,
    needs_chromium,
    open_console,
    stack,
    task_end_rows,
)
from tests.test_mcp import stdio

ERROR = "document.querySelector('#error').textContent"
PROMPT = "document.querySelector('#prompt').value"


@needs_chromium
async def test_browser_attaches_a_resource_and_shows_an_unreadable_one(tmp_path: Path) -> None:
    """R-MCP-5: a prompt naming a resource the server cannot read is refused with the
    gateway's -32602 naming it, shown as the page's error; nothing runs and the prompt
    stays to be corrected. A readable one runs, its text attached to the prompt."""

    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text("Read it."),))]

    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, script, approve="all", mcp_servers={"t": stdio()}) as server,
            chromium(tmp_path) as page,
        ):
            await open_console(page, server)
            await page.type_and_send("check @t:greenroom://nope")
            await page.wait_for(f"{ERROR}.includes('greenroom://nope')")
            error = await page.js(ERROR)
            assert error.startswith(
                "$.input: @t:greenroom://nope: MCP server 't' refused reading greenroom://nope"
            ), error
            assert error.endswith("(-32602)"), error
            assert await page.js(PROMPT) == "check @t:greenroom://nope"
            assert await page.count("[data-type=user_msg]") == 0

            await page.type_and_send("check @t:greenroom://notes")
            await page.wait_for(f"document.querySelectorAll('{task_end_rows('completed')}').length")
            (shown,) = await page.texts("[data-type=user_msg]")
            assert "check @t:greenroom://notes" in shown
            assert "the notes say: ship on Friday" in shown
            assert await page.js(ERROR) == ""
            assert await page.js(PROMPT) == ""
            assert len(server.providers) == 1 and len(server.providers[0].requests) == 1
