"""Tools with a side effect for the cluster tests, loaded by ``serve --tools``.

``side_effect`` reports each start by connecting to the unix socket named by
``GREENROOM_TEST_EFFECTS`` and sending its note (the test counts the starts), then waits
until its host is killed, stopped or interrupts it: the call is in flight when the host is
lost. ``side_effect_once`` reports its start the same way and returns; ``gated`` reports its
start and returns once the test answers on its connection. ``keyed_effect`` reports its
note with its idempotency key (R-EFFECT-1) and then waits as ``side_effect`` does; its
check asks the same socket whether an effect with a key was reported (``? KEY``, answered
with the note or ``none``: R-EFFECT-2).
"""

from __future__ import annotations

import os

import trio

from greenroom.protocols.tools import ToolContext, tool


@tool(side_effects=True)
async def side_effect(note: str) -> str:
    """Do something that must not happen twice.

    Args:
        note: what to do.
    """
    stream = await trio.open_unix_socket(os.environ["GREENROOM_TEST_EFFECTS"])
    await stream.send_all(f"{note}\n".encode())
    await trio.sleep_forever()
    return note


@tool(side_effects=True)
async def side_effect_once(note: str) -> str:
    """Do something that must not happen twice, and finish.

    Args:
        note: what to do.
    """
    # Reported as side_effect is; it returns, so its task can end on the host it runs on.
    stream = await trio.open_unix_socket(os.environ["GREENROOM_TEST_EFFECTS"])
    await stream.send_all(f"{note}\n".encode())
    await stream.aclose()
    return f"done: {note}"


@tool(side_effects=True)
async def gated(note: str) -> str:
    """Do something that must not happen twice, once allowed to finish.

    Args:
        note: what to do.
    """
    # Reported as side_effect is; then it waits for the test to say "go" on the same
    # connection: the call is in flight until the test lets it end.
    stream = await trio.open_unix_socket(os.environ["GREENROOM_TEST_EFFECTS"])
    await stream.send_all(f"{note}\n".encode())
    await stream.receive_some()
    await stream.aclose()
    return f"done: {note}"


async def find_keyed_effect(key: str) -> str | None:
    """The note of the effect reported with ``key``, or None when there is none."""
    stream = await trio.open_unix_socket(os.environ["GREENROOM_TEST_EFFECTS"])
    async with stream:
        await stream.send_all(f"? {key}\n".encode())
        answer = (await stream.receive_some()).decode().strip()
    return None if answer == "none" else f"found: {answer}"


@tool(side_effects=True, check=find_keyed_effect)
async def keyed_effect(note: str, ctx: ToolContext) -> str:
    """Do something that must not happen twice; it can be looked up by its key.

    Args:
        note: what to do.
    """
    stream = await trio.open_unix_socket(os.environ["GREENROOM_TEST_EFFECTS"])
    await stream.send_all(f"{note} {ctx.idempotency_key}\n".encode())
    await trio.sleep_forever()
    return note
