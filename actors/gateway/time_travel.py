"""The gateway's ``session.fork`` and ``session.rewind`` (R-FORK-1, R-FORK-2).

Authorized as every method on a session is (R-SEC-4): the caller must own the session, or
the root of its tree. A fork is a new session of the caller's — it counts against the
caller's cap of open sessions from the moment it is asked (R-SEC-9: forks made at once
cannot all take the last place) and is stored as the caller's — whoever owned the
source. A rewind of a session whose task runs is 409 (``Busy``); a point the history does
not have is -32602 on the parameter, with the reason.

:class:`TimeTravelMethods` holds no state of its own: the gateway's
:class:`~greenroom.actors.gateway.methods.Methods` hands it what they share (its
authorization, its cap, its way of taking a new session) and dispatches to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from greenroom.actors.gateway.config import SessionDefaults
from greenroom.actors.runtime.errors import SeqRefused
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import invalid

if TYPE_CHECKING:
    from greenroom.actors.gateway.connection import Connection

__all__ = ["TimeTravelMethods"]

Owned = Callable[..., Awaitable[Session]]
"""``Methods._owned_session(connection, params, node=…)``: the session the caller may use."""


class TimeTravelMethods:
    """``rpc_session_fork`` and ``rpc_session_rewind``; see the module docstring."""

    __slots__ = ("_defaults", "_host", "_owned", "_reserve", "_take_new")

    def __init__(
        self,
        host: Host,
        defaults: SessionDefaults,
        owned: Owned,
        reserve: Callable[[str], AbstractContextManager[None]],
        take_new: Callable[[str, Session], Awaitable[None]],
    ) -> None:
        self._host = host
        self._defaults = defaults
        self._owned = owned
        self._reserve = reserve
        self._take_new = take_new

    async def rpc_session_fork(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Fork a session the caller may use at ``at_seq`` (default: its last record) into
        a new session of the caller's, with the server's tools and provider. Returns
        ``{session_id, seq}``: the fork and its fork point."""
        jsonrpc.check_params(params, "session.fork")
        at_seq = jsonrpc.optional_int(params, "at_seq", minimum=0)
        source = await self._owned(connection, params)
        principal = _identity(connection)
        defaults = self._defaults
        with self._reserve(principal):
            try:
                fork = await self._host.fork_session(
                    source.id,
                    at_seq,
                    tools=defaults.tools,
                    provider=defaults.session_provider(),
                    mcp_servers=defaults.mcp_servers,
                    principal=principal,
                )
            except SeqRefused as exc:
                raise invalid("$.at_seq", str(exc)) from None
            await self._take_new(principal, fork)
        return {"session_id": fork.id, "seq": _forked_at(fork)}

    async def rpc_session_rewind(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Rewind the caller's idle session to ``to_seq``; its subscribers get the
        ``rewind`` output. Returns ``{seq}``, the rewind record's; 409 while a task runs."""
        jsonrpc.check_params(params, "session.rewind")
        if params.get("to_seq") is None:
            raise invalid("$.to_seq", "required")
        to_seq = jsonrpc.optional_int(params, "to_seq", minimum=0)
        assert to_seq is not None
        session = await self._owned(connection, params, node=False)
        try:
            record = await session.rewind(to_seq, reason=f"rewound by {_identity(connection)}")
        except SeqRefused as exc:
            raise invalid("$.to_seq", str(exc)) from None
        return {"seq": record.seq}


def _identity(connection: Connection) -> str:
    assert connection.identity is not None  # checked before any method but initialize
    return connection.identity


def _forked_at(fork: Session) -> int | None:
    """The fork point, as the fork's ``session.json`` names it."""
    forked_from = fork.forked_from
    return None if forked_from is None else forked_from[1]
