"""greenroom.actors: the actor tree (I/O and concurrency).

Start with :class:`Host`; it creates and loads :class:`Session` objects. Errors are the
tree in :mod:`greenroom.actors.errors`.
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
from greenroom.actors.session import RunStream, Session

__all__ = [
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "GreenroomError",
    "Host",
    "HostClosed",
    "Reply",
    "RunStream",
    "ScriptedProvider",
    "ScriptedStream",
    "Session",
    "SessionClosed",
    "SessionInfo",
    "SessionNotFound",
]
