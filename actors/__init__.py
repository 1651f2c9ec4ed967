"""greenroom.actors: the actor tree (I/O and concurrency).

Start with :class:`Host`; it creates and loads :class:`Session` objects. Errors are the
tree in :mod:`greenroom.actors.errors`. Scripts for the built-in scripted model (tests,
examples) are built with :mod:`greenroom.actors.scripted`.
"""

from greenroom.actors.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    HostClosed,
    SessionClosed,
    SessionNotFound,
)
from greenroom.actors.host import Host, SessionInfo
from greenroom.actors.provider_scripted import Reply, ScriptedProvider, ScriptedStream
from greenroom.actors.session import RunResult, RunStream, Session

__all__ = [
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "GreenroomError",
    "Host",
    "HostClosed",
    "Reply",
    "RunResult",
    "RunStream",
    "ScriptedProvider",
    "ScriptedStream",
    "Session",
    "SessionClosed",
    "SessionInfo",
    "SessionNotFound",
]
