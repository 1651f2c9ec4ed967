"""The provider registry: every model provider greenroom can talk to, in one table.

Host, the command line, ``serve`` and the gateway all read :data:`PROVIDERS`, so adding a
provider is one entry here and one adapter module: the flag choices, the default model,
the credential check and the help text cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import attrs

from greenroom.actors.providers.base import ModelProvider
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.settings import SessionSettings


@attrs.frozen(kw_only=True)
class ProviderSpec:
    """How to make and check one provider.

    ``factory`` builds the shared adapter from a session's settings (imported lazily, so an
    unused provider's library is never loaded). ``default_model`` is the model a session gets
    when it names none. ``missing_credentials`` returns None when the environment (and
    ``base_url``) is enough to call the provider, else a sentence saying what to set;
    with ``credentials_required`` a session is refused without them (asking for Claude
    must never run another model silently). ``model_prefixes``: a model named with one of
    them, and no provider, runs on this provider. ``default_base_url`` is where its requests
    go when the session names no ``base_url`` (None: nowhere, it runs in process).
    """

    name: str
    help: str
    default_model: Callable[[], str]
    factory: Callable[[SessionSettings], ModelProvider]
    missing_credentials: Callable[[str | None], str | None]
    credentials_required: bool = False
    model_prefixes: tuple[str, ...] = ()
    default_base_url: Callable[[], str | None] = lambda: None


LEAN_HTTP_VARIABLE = "GREENROOM_LEAN_HTTP"
"""``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``: whether the HTTP
providers (``anthropic``, ``openai``, ``openai-responses``) made without an explicit
``lean_http`` send their requests through greenroom's own HTTP/1.1 client instead of the
anthropic SDK or httpx; unset (or empty) means on: the defaults are the fast path
(R-PERF-1). The command line's ``--lean-http`` / ``--no-lean-http`` set it for the process
they run."""

_TRUE = ("1", "on", "true", "yes", "")
_FALSE = ("0", "off", "false", "no")


def lean_http_enabled() -> bool:
    """What :data:`LEAN_HTTP_VARIABLE` asks for (on when unset); ``ValueError`` naming the
    variable and the accepted words when it holds something else."""
    value = os.environ.get(LEAN_HTTP_VARIABLE, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{LEAN_HTTP_VARIABLE}={os.environ[LEAN_HTTP_VARIABLE]!r}: use 1, on, true, yes "
        "or 0, off, false, no"
    )


def _anthropic(settings: SessionSettings) -> ModelProvider:
    from greenroom.actors.providers.anthropic import AnthropicProvider

    return AnthropicProvider(base_url=settings.base_url)


def _openai(settings: SessionSettings) -> ModelProvider:
    from greenroom.actors.providers.openai import OpenAIProvider

    return OpenAIProvider(base_url=settings.base_url)


def _openai_responses(settings: SessionSettings) -> ModelProvider:
    from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider

    return OpenAIResponsesProvider(base_url=settings.base_url)


def _scripted(settings: SessionSettings) -> ModelProvider:
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.providers.scripted_brain import demo_brain

    return ScriptedProvider(demo_brain)


def anthropic_credentials() -> str | None:
    """The Anthropic key or token from the environment (the SDK's two variables)."""
    return os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")


def _anthropic_base_url() -> str:
    # What the anthropic SDK uses when it is given no base_url.
    return os.environ.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com"


def _openai_base_url() -> str:
    from greenroom.actors.providers.openai import DEFAULT_BASE_URL

    return os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL


def _anthropic_missing(base_url: str | None) -> str | None:
    if anthropic_credentials():
        return None
    return (
        "the anthropic provider needs ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) in the "
        "environment"
    )


def _openai_missing(base_url: str | None) -> str | None:
    if base_url or os.environ.get("OPENAI_API_KEY"):
        return None
    return (
        "the OpenAI providers need OPENAI_API_KEY, or --base-url for a local "
        "OpenAI-compatible server"
    )


def _openai_model() -> str:
    return os.environ.get("OPENAI_MODEL", "gpt-4o-mini")


PROVIDERS: Mapping[str, ProviderSpec] = {
    spec.name: spec
    for spec in (
        ProviderSpec(
            name="anthropic",
            help="Claude through the Messages API (ANTHROPIC_API_KEY)",
            default_model=lambda: "claude-sonnet-5-5",
            factory=_anthropic,
            missing_credentials=_anthropic_missing,
            credentials_required=True,
            model_prefixes=("claude-",),
            default_base_url=_anthropic_base_url,
        ),
        ProviderSpec(
            name="openai",
            help="any OpenAI-compatible /v1/chat/completions server (OPENAI_API_KEY or "
            "--base-url)",
            default_model=_openai_model,
            factory=_openai,
            missing_credentials=_openai_missing,
            default_base_url=_openai_base_url,
        ),
        ProviderSpec(
            name="openai-responses",
            help="OpenAI's /v1/responses API, reasoning carried across tool calls "
            "(OPENAI_API_KEY or --base-url)",
            default_model=_openai_model,
            factory=_openai_responses,
            missing_credentials=_openai_missing,
            default_base_url=_openai_base_url,
        ),
        ProviderSpec(
            name="scripted",
            help="the built-in scripted model: no key, no network",
            default_model=lambda: "scripted",
            factory=_scripted,
            missing_credentials=lambda base_url: None,
        ),
    )
}
"""Every provider by name, in the order help texts list them."""


def default_provider_name() -> str:
    """``anthropic`` when Anthropic credentials are in the environment, else ``scripted``."""
    return "anthropic" if anthropic_credentials() else "scripted"


def provider_spec(name: str) -> ProviderSpec:
    """The spec for ``name``; ``KeyError`` names the known ones."""
    try:
        return PROVIDERS[name]
    except KeyError:
        known = ", ".join(PROVIDERS)
        raise KeyError(f"unknown provider {name!r}; known: {known}") from None


def provider_for(provider: str | None, model: str | None) -> str:
    """The provider of a session that names ``provider`` (or none) and ``model`` (or
    none): the one named, else the one whose model names ``model`` has, else
    :func:`default_provider_name`."""
    if provider is not None:
        return provider
    if model is not None:
        for spec in PROVIDERS.values():
            if model.startswith(spec.model_prefixes or ("\0",)):
                return spec.name
    return default_provider_name()


def server_url(provider: str, base_url: str | None) -> str | None:
    """The URL a session of ``provider`` with ``base_url`` sends its requests to: its
    ``base_url``, else the provider's default (the environment's override included); None
    for an unknown provider or one that runs in process."""
    spec = PROVIDERS.get(provider)
    if spec is None:
        return None
    return base_url or spec.default_base_url()


def require_credentials(provider: str, model: str | None, base_url: str | None = None) -> None:
    """Raise :class:`ConfigurationError` when ``provider`` requires credentials that the
    environment lacks (see :class:`ProviderSpec`); an unknown provider passes here (making
    it fails with the known names)."""
    spec = PROVIDERS.get(provider)
    if spec is None or not spec.credentials_required:
        return
    missing = spec.missing_credentials(base_url)
    if missing is None:
        return
    asked = f"model {model!r} runs on the {provider} provider, which" if model else (
        f"the {provider} provider"
    )
    needs = missing.split(" needs ", 1)[-1] if " needs " in missing else missing
    raise ConfigurationError(
        f"{asked} needs {needs}; pass provider='scripted' for the built-in model"
    )


def default_model(provider: str) -> str:
    """The registry's default model for ``provider`` (``scripted`` for one it lacks)."""
    return PROVIDERS[provider].default_model() if provider in PROVIDERS else "scripted"
