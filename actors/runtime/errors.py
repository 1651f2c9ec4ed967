"""The public exception tree, where the runtime's users import it from; defined in
:mod:`greenroom.protocols.errors` so that every part (providers, tools, apps) raises the
same classes without importing the runtime."""

from __future__ import annotations

from greenroom.protocols.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    HooksFileError,
    HostClosed,
    ImageRefused,
    InputTooLarge,
    NotPending,
    OutputSchemaError,
    SeqRefused,
    SessionClosed,
    SessionExists,
    SessionNotFound,
    SessionOpenElsewhere,
)

__all__ = [
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "GreenroomError",
    "HooksFileError",
    "HostClosed",
    "ImageRefused",
    "InputTooLarge",
    "NotPending",
    "OutputSchemaError",
    "SeqRefused",
    "SessionClosed",
    "SessionExists",
    "SessionNotFound",
    "SessionOpenElsewhere",
]
