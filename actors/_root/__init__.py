"""greenroom: LLM agent loops as trees of trio actors.

The names most programs need, from one import root::

    import trio
    from greenroom import Host, tool, user_text

Everything else lives in the two layers: ``greenroom.actors`` (the actor tree: I/O and
concurrency) and ``greenroom.protocols`` (pure typed data and sans-IO logic). Script
helpers for a deterministic model in tests and examples are in ``greenroom.actors.scripted``.

Importing ``greenroom`` is cheap: each name is loaded from its layer on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greenroom.actors import (
        AuthLocked,
        Busy,
        ConfigurationError,
        GreenroomError,
        Host,
        HostClosed,
        ImageRefused,
        InputTooLarge,
        OutputSchemaError,
        ProviderLimits,
        RunResult,
        RunStream,
        Session,
        SessionClosed,
        SessionExists,
        SessionNotFound,
        SessionOpenElsewhere,
    )
    from greenroom.protocols import (
        Output,
        TaskEnd,
        Tool,
        ToolContext,
        to_dict,
        to_json,
        tool,
        user_image,
        user_text,
    )

    __version__: str

_LAYER_OF = {
    "AuthLocked": "greenroom.actors",
    "Busy": "greenroom.actors",
    "ConfigurationError": "greenroom.actors",
    "GreenroomError": "greenroom.actors",
    "Host": "greenroom.actors",
    "HostClosed": "greenroom.actors",
    "ImageRefused": "greenroom.actors",
    "InputTooLarge": "greenroom.actors",
    "OutputSchemaError": "greenroom.actors",
    "ProviderLimits": "greenroom.actors",
    "RunResult": "greenroom.actors",
    "RunStream": "greenroom.actors",
    "Session": "greenroom.actors",
    "SessionClosed": "greenroom.actors",
    "SessionExists": "greenroom.actors",
    "SessionNotFound": "greenroom.actors",
    "SessionOpenElsewhere": "greenroom.actors",
    "Output": "greenroom.protocols",
    "TaskEnd": "greenroom.protocols",
    "Tool": "greenroom.protocols",
    "ToolContext": "greenroom.protocols",
    "to_dict": "greenroom.protocols",
    "to_json": "greenroom.protocols",
    "tool": "greenroom.protocols",
    "user_image": "greenroom.protocols",
    "user_text": "greenroom.protocols",
}

__all__ = [
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "GreenroomError",
    "Host",
    "HostClosed",
    "ImageRefused",
    "InputTooLarge",
    "Output",
    "OutputSchemaError",
    "ProviderLimits",
    "RunResult",
    "RunStream",
    "Session",
    "SessionClosed",
    "SessionExists",
    "SessionNotFound",
    "SessionOpenElsewhere",
    "TaskEnd",
    "Tool",
    "ToolContext",
    "__version__",
    "to_dict",
    "to_json",
    "tool",
    "user_image",
    "user_text",
]


def _installed_version() -> str:
    """The installed distribution's version; a source tree that was never installed
    (say, on ``PYTHONPATH``) reports ``0+unknown`` rather than failing to import."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("greenroom")
    except PackageNotFoundError:
        return "0+unknown"


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            value = _installed_version()
        else:
            layer = _LAYER_OF.get(name)
            if layer is None:
                raise AttributeError(f"module 'greenroom' has no attribute {name!r}")
            from importlib import import_module

            value = getattr(import_module(layer), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
