"""Who a client is and what it may see (R-SEC-4): the principals' tokens, and the sessions
each principal created or was granted."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from greenroom.actors.gateway.config import DEFAULT_CLIENT
from greenroom.actors.runtime.errors import ConfigurationError


class Principals:
    """The known tokens and the principal each names. ``token`` is the one token of the
    principal ``default``; ``tokens`` maps client ids to their tokens (give one or both).
    Raises :class:`ConfigurationError` when no usable token is given."""

    def __init__(self, *, token: str | None, tokens: Mapping[str, str] | None) -> None:
        principals = dict(tokens or {})
        if token is not None:
            principals.setdefault(DEFAULT_CLIENT, token)
        if not principals or not all(principals.values()):
            raise ConfigurationError("the gateway needs a non-empty token")
        self._secrets = tuple(
            (secret.encode("utf-8"), client_id) for client_id, secret in principals.items()
        )

    def of(self, token: bytes) -> str | None:
        """The principal whose token this is. Every known token is compared, in constant
        time, so the time taken says nothing about which (if any) matched."""
        found: str | None = None
        for secret, principal in self._secrets:
            if hmac.compare_digest(token, secret):
                found = principal
        return found


class Grants:
    """The sessions each principal created or was granted; they live as long as the
    gateway."""

    def __init__(self) -> None:
        self._grants: dict[str, set[str]] = {}

    def grant(self, client_id: str, session_id: str) -> None:
        """Let ``client_id`` see and steer ``session_id``."""
        self._grants.setdefault(client_id, set()).add(session_id)

    def owned(self, client_id: str) -> frozenset[str]:
        """The sessions ``client_id`` created or was granted."""
        return frozenset(self._grants.get(client_id, ()))

    def holders(self, session_id: str) -> frozenset[str]:
        """The principals that created or were granted ``session_id``."""
        return frozenset(c for c, owned in self._grants.items() if session_id in owned)

    def anyone_owns(self, session_id: str) -> bool:
        """Whether some principal created or was granted ``session_id``."""
        return any(session_id in owned for owned in self._grants.values())
