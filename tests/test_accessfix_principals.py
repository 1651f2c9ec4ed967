"""One token names one client, and one client's name is never another's (R-SEC-4), also for
a :class:`Gateway` embedded in a program that builds its principals itself (the tokens
file is checked already: ``load_tokens_file``).

Each test gives the gateway principals that cannot be kept apart — a token named for two
principals, or a client id that becomes another one once stored — and holds it to one of
two outcomes: the gateway refuses the configuration (:class:`ConfigurationError`), or it
keeps each principal's sessions to itself, over real websocket clients and a restart on
the same data dir. Before the fix it did neither: the shared token opened the other
principal's sessions, and ``"alice "`` (a trailing space) gave its sessions to ``alice``
after the restart, its stored owner read back without the space.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from test_gateway import BOUND_S, Client, Server, connect

from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.host import Host

FIRST = "first-token-0123456789"
SECOND = "second-token-0123456789"


@asynccontextmanager
async def gateway_on(
    tmp_path: Path, *, token: str | None = None, tokens: Mapping[str, str] | None = None
) -> AsyncIterator[Server | None]:
    """A host on ``tmp_path``'s data dir and a gateway with these principals, serving on a
    free port; None when the gateway refuses them."""
    workspace = tmp_path / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    async with Host.open(tmp_path / "data") as host:
        try:
            gateway = Gateway(
                host,
                token=token,
                tokens=tokens,
                port=0,
                defaults=SessionDefaults(provider="scripted", workspace_dir=workspace),
            )
        except ConfigurationError as exc:
            assert FIRST not in str(exc) and SECOND not in str(exc)  # never echoes a token
            yield None
            return
        async with trio.open_nursery() as nursery:
            await nursery.start(gateway.run)
            yield Server(host=host, gateway=gateway, providers=[])
            nursery.cancel_scope.cancel()


async def listed(client: Client) -> set[str]:
    return {s["session_id"] for s in (await client.result("session.list"))["sessions"]}


async def test_a_token_named_for_two_principals_opens_neither_ones_sessions_to_the_other(
    tmp_path: Path,
) -> None:
    """``default`` created a session with its token; the program then names the token
    ``FIRST`` both ``default``'s (``token``) and ``alice``'s (``tokens``). Whoever holds
    ``FIRST`` as alice must not reach the session of ``default``, who held another
    token then."""
    with trio.fail_after(BOUND_S):
        async with gateway_on(tmp_path, token=SECOND) as server:
            assert server is not None
            async with connect(server, token=SECOND) as default:
                theirs = (await default.result("session.create"))["session_id"]
        async with gateway_on(tmp_path, token=FIRST, tokens={"alice": FIRST}) as server:
            if server is None:
                return  # refused: the token names one client or none
            async with connect(server, token=FIRST) as holder:
                named = (await holder.result("initialize", {}))["client_id"]
                assert named == "alice" or theirs not in await listed(holder), (
                    f"alice's token is {named!r}'s and opens its session {theirs}"
                )


async def test_a_client_id_that_is_another_once_stored_never_takes_its_sessions(
    tmp_path: Path,
) -> None:
    """``"alice "`` (a trailing space) and ``alice`` are two principals; ``"alice "``
    creates a session. After a restart on the same data dir, ``alice`` must not be given
    it (nor ``"alice "`` lose it to her)."""
    tokens = {"alice ": FIRST, "alice": SECOND}
    with trio.fail_after(BOUND_S):
        async with gateway_on(tmp_path, tokens=tokens) as server:
            if server is None:
                return  # refused: not a client id
            async with connect(server, token=FIRST) as spaced:
                theirs = (await spaced.result("session.create"))["session_id"]
        async with gateway_on(tmp_path, tokens=tokens) as server:
            assert server is not None
            async with connect(server, token=SECOND) as alice:
                assert theirs not in await listed(alice), (
                    f"alice was given the session {theirs} of 'alice '"
                )


async def test_a_token_that_is_anothers_once_stripped_is_not_the_others(tmp_path: Path) -> None:
    """``bob``'s token is ``alice``'s with a trailing space, which a header does not keep
    (a client strips the value, or refuses to send it; the gateway strips it too): bob's
    token, sent as the header carries it, must not open alice's session."""
    tokens = {"alice": FIRST, "bob": FIRST + " "}
    with trio.fail_after(BOUND_S):
        async with gateway_on(tmp_path, tokens=tokens) as server:
            if server is None:
                return  # refused: one token for two clients
            async with connect(server, token=FIRST) as alice:
                hers = (await alice.result("session.create"))["session_id"]
            async with connect(server, token=tokens["bob"].strip()) as bob:
                named = (await bob.result("initialize", {}))["client_id"]
                assert hers not in await listed(bob), (
                    f"bob's token, as a header carries it, is {named!r}'s and opens her "
                    f"session {hers}"
                )
