"""The host's provider clients: one per provider and endpoint, shared by the sessions
that use it (its connection pool with them), made the first time one is needed — in a
worker thread, as a provider's first use imports its library — and closed with the host.
Which provider a session gets, its credentials and its default model are the registry's
alone (:mod:`greenroom.actors.providers.registry`)."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from greenroom.actors.providers.registry import provider_for, provider_spec, require_credentials
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.protocols.settings import SessionSettings

__all__ = ["ProviderClients", "make_provider"]


class ProviderClients:
    """A host's provider clients, keyed by provider name and base URL."""

    __slots__ = ("_clients", "_making")

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str | None], ModelProvider] = {}
        self._making = trio.Lock()

    async def get(self, settings: SessionSettings) -> ModelProvider:
        """The client for ``settings``' provider and endpoint, made now if need be.
        Raises :class:`ConfigurationError` for a provider the registry does not know."""
        key = (settings.provider, settings.base_url)
        client = self._clients.get(key)
        if client is not None:
            return client
        async with self._making:  # sessions created together share one client
            client = self._clients.get(key)
            if client is None:
                # In a worker thread: a provider's first use imports its library (the
                # anthropic SDK: seconds on a busy machine), which on the event loop would
                # stall every session, connection and lease renewal of the host meanwhile.
                client = await trio.to_thread.run_sync(make_provider, settings)
                self._clients[key] = client
        return client

    async def load(
        self, provider: str | None = None, *, model: str | None = None, base_url: str | None = None
    ) -> None:
        """Make the client a session created with these names would get (see
        :meth:`Host.load_provider <greenroom.actors.runtime.host.Host.load_provider>`)."""
        name = provider_for(provider, model)
        require_credentials(name, model, base_url)
        changes: dict[str, Any] = {"provider": name, "base_url": base_url}
        await self.get(attrs.evolve(SessionSettings(), **changes))

    async def aclose(self) -> None:
        """Close every client (the host is closing)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


def make_provider(settings: SessionSettings) -> ModelProvider:
    """The provider adapter a session's settings name (from the provider registry)."""
    try:
        spec = provider_spec(settings.provider)
    except KeyError as exc:
        raise ConfigurationError(str(exc.args[0])) from None
    return spec.factory(settings)
