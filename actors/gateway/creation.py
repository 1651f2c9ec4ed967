"""Creating sessions for the gateway's clients: the server's defaults, the client's
settings, the workspace root (R-SEC-5), each principal's cap on open sessions (R-SEC-9)
and the stored owner (R-SEC-4). The websocket method ``session.create`` and the HTTP
endpoints (A2A, AG-UI) create sessions here alike."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.gateway.access import Grants, store_owner
from greenroom.actors.gateway.config import (
    GatewayLimits,
    SessionDefaults,
    check_budgets,
    confined_workspace,
    directory,
    principal_workspace_root,
)
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError
from greenroom.protocols.tools import WorkspaceIdentity

logger = logging.getLogger(__name__)


class SessionCreation:
    """Creates the sessions clients ask for. Holds no channel and starts no task;
    ``workspace_root`` is set by the gateway when it starts, before any call."""

    def __init__(
        self,
        host: Host,
        *,
        defaults: SessionDefaults,
        approval_timeout_s: float | None,
        grants: Grants,
        hubs: Hubs,
        limits: GatewayLimits,
    ) -> None:
        self.host = host
        self.defaults = defaults
        self.approval_timeout_s = approval_timeout_s
        self.workspace_root: Path | None = None
        """Where clients' workspaces must resolve (set when the gateway starts)."""
        self._grants = grants
        self._hubs = hubs
        self._limits = limits
        self._creating: Counter[str] = Counter()
        """Sessions each principal is creating now (they count against its cap)."""

    def provider(self) -> str | ModelProvider | None:
        """The provider of a session the gateway creates or loads: a new one from the
        defaults' factory, else the defaults' provider name."""
        if self.defaults.provider_factory is not None:
            return self.defaults.provider_factory()
        return self.defaults.provider

    async def create_for(
        self,
        principal: str,
        *,
        workspace: str | None = None,
        model: str | None = None,
        settings: Mapping[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Create a session owned by ``principal``: the server's defaults, then the client's
        ``settings`` (checked already: none of ``CLIENT_SETTABLE_FORBIDDEN``); a
        ``workspace`` must resolve under the workspace root (R-SEC-5), or the principal's
        own directory in it (``workspace_per_principal``, also its default); ``session_id``
        chooses its id. 429 beyond the principal's cap on open sessions (R-SEC-9). Its hub
        is running when it returns."""
        with self.reserve(principal):
            return await self._create(principal, workspace, model, dict(settings or {}), session_id)

    @contextlib.contextmanager
    def reserve(self, principal: str) -> Iterator[None]:
        """A place among ``principal``'s sessions for one being made (created or forked)
        meanwhile: 429 when it has none left (:meth:`check_room`). Made at once, several
        cannot all find the same last place (R-SEC-9)."""
        self.check_room(principal)
        self._creating[principal] += 1
        try:
            yield
        finally:
            self._creating[principal] -= 1
            if not self._creating[principal]:
                del self._creating[principal]

    def check_room(self, principal: str) -> None:
        """429 when ``principal`` holds its cap of open sessions in this host (created or
        granted, or being created now: R-SEC-9)."""
        cap = self._limits.max_sessions_per_principal
        if self._grants.count(principal) + self._creating[principal] < cap:
            # Below the cap even if every session it holds were open; counting the open
            # ones is a pass over them, which every create of a busy server would pay.
            return
        held = self._held(principal)
        if held >= cap:
            raise RpcError(
                jsonrpc.TOO_MANY_REQUESTS,
                f"too many sessions: client {principal!r} holds {held} open sessions "
                f"(at most {cap}, --max-sessions-per-principal)",
            )

    async def take_new(self, principal: str, session: Session) -> None:
        """A session created for ``principal`` is its own (stored with it: R-SEC-4), and
        its hub runs."""
        self._grants.grant(principal, session.id)
        try:
            await trio.to_thread.run_sync(store_owner, session.directory, principal)
        except OSError as exc:
            # The session works; only a gateway started later will not know its owner.
            logger.warning("gateway: cannot store the owner of session %s: %s", session.id, exc)
        await self._hubs.adopt(session)

    async def undo(self, principal: str, session: Session) -> None:
        """Delete ``session``, just created for ``principal`` by a request then refused, as
        if it had not been made: its directory goes (the host's deletion, closing it) and
        so does the principal's grant of it."""
        await self.host.delete_session(session.id)
        self._grants.revoke(principal, session.id)

    def _held(self, principal: str) -> int:
        """The sessions open in this host that ``principal`` created or was granted, and
        those it is creating now."""
        owned = self._grants.owned(principal)
        held = sum(1 for session in self.host.sessions if session.id in owned)
        return held + self._creating[principal]

    async def _create(
        self,
        principal: str,
        workspace_param: str | None,
        model: str | None,
        client_settings: dict[str, Any],
        session_id: str | None,
    ) -> Session:
        defaults = self.defaults
        check_budgets(client_settings, defaults.settings)
        workspace: Path | WorkspaceIdentity
        root = self.workspace_root
        if defaults.workspace_per_principal:
            assert root is not None  # set when the gateway starts
            root = await trio.to_thread.run_sync(principal_workspace_root, root, principal)
            # The principal's own root is its default workspace, checked as one it names.
            workspace_param = "." if workspace_param is None else workspace_param
        if workspace_param is None:
            workspace = await trio.to_thread.run_sync(directory, defaults.workspace_dir)
        else:
            assert root is not None  # set when the gateway starts
            workspace = await trio.to_thread.run_sync(
                confined_workspace, workspace_param, root, self.host.data_dir
            )
        overrides: dict[str, Any] = {
            **defaults.settings,
            "approval_timeout_s": self.approval_timeout_s,
            **client_settings,
        }
        # create_session takes these two as arguments (its default model would override
        # one given in the settings).
        settings_model = overrides.pop("model", None)
        model = model or settings_model or defaults.model
        system = overrides.pop("system", None) or defaults.system
        session = await self.host.create_session(
            session_id=session_id,
            model=model,
            tools=defaults.tools,
            workspace_dir=workspace,
            provider=self.defaults.session_provider(),
            system=system,
            mcp_servers=defaults.mcp_servers,
            # Its costs count against the caller's budget (R-SHARE-4).
            principal=principal,
            **overrides,
        )
        await self.take_new(principal, session)
        return session
