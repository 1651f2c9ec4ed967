"""Model providers: one adapter per wire protocol (Anthropic Messages, OpenAI Chat
Completions, OpenAI Responses) and the in-process scripted model, listed in ``registry``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greenroom.actors.providers.media import read_image
    from greenroom.actors.providers.registry import (
        LEAN_HTTP_VARIABLE,
        PROVIDERS,
        default_model,
        default_provider_name,
        lean_http_enabled,
        provider_spec,
    )
    from greenroom.actors.providers.scripted_brain import DEMO_PROMPT

# Loaded on first use: the modules import each other, and importing the package must
# not import them all (nor pay for the ones a program never uses).
_MODULE_OF = {
    "read_image": "greenroom.actors.providers.media",
    "LEAN_HTTP_VARIABLE": "greenroom.actors.providers.registry",
    "PROVIDERS": "greenroom.actors.providers.registry",
    "lean_http_enabled": "greenroom.actors.providers.registry",
    "default_model": "greenroom.actors.providers.registry",
    "default_provider_name": "greenroom.actors.providers.registry",
    "provider_spec": "greenroom.actors.providers.registry",
    "DEMO_PROMPT": "greenroom.actors.providers.scripted_brain",
}

__all__ = [
    "DEMO_PROMPT",
    "LEAN_HTTP_VARIABLE",
    "PROVIDERS",
    "default_model",
    "default_provider_name",
    "lean_http_enabled",
    "provider_spec",
    "read_image",
]


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = globals()[name] = getattr(import_module(module), name)
        return value
