"""greenroom.actors: the actor tree (I/O and concurrency).

Start with :class:`Host`; it creates and loads :class:`Session` objects. Errors are the
tree in :mod:`greenroom.actors.runtime.errors`. Scripts for the built-in scripted model (tests,
examples) are built with :mod:`greenroom.actors.scripted`.
"""

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptedStream
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.admission import ProviderLimits
from greenroom.actors.runtime.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    HostClosed,
    ImageRefused,
    InputTooLarge,
    OutputSchemaError,
    SeqRefused,
    SessionClosed,
    SessionExists,
    SessionNotFound,
    SessionOpenElsewhere,
)
from greenroom.actors.runtime.host import Host, SessionInfo
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.session import RunResult, RunStream, Session

__all__ = [
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "GreenroomError",
    "Host",
    "HostClosed",
    "ImageRefused",
    "InputReceipt",
    "InputTooLarge",
    "OutputSchemaError",
    "PrincipalBudget",
    "ProviderLimits",
    "Reply",
    "RunResult",
    "RunStream",
    "ScriptedProvider",
    "ScriptedStream",
    "SeqRefused",
    "Session",
    "SessionClosed",
    "SessionExists",
    "SessionInfo",
    "SessionNotFound",
    "SessionOpenElsewhere",
]
