"""The cluster's exceptions: the NATS client's errors are translated into these at the one
module that makes each kind of call (:mod:`.connection`, :mod:`.leases`, :mod:`.traces`,
:mod:`.routing`), so nothing above them sees a nats-py type.

::

    Exception
    └── ClusterError
        ├── ClusterUnavailable  NATS (or its JetStream) cannot be reached or refused a call
        ├── LeaseLost           this host no longer owns the session (expired or taken over)
        ├── Fenced              a trace append was refused: another host wrote the session
        │                       since (its lease is gone); the writer must stop the session
        ├── RecordTooLarge      a trace record is larger than NATS carries in one message
        ├── CallTooLarge        a request to another host is larger than NATS carries
        └── OwnerUnreachable    no host answered a request for the session in time
"""

from __future__ import annotations

__all__ = [
    "CallTooLarge",
    "ClusterError",
    "ClusterUnavailable",
    "Fenced",
    "LeaseLost",
    "OwnerUnreachable",
    "RecordTooLarge",
]


class ClusterError(Exception):
    """Anything that went wrong between this host and the cluster."""


class ClusterUnavailable(ClusterError):
    """NATS or its JetStream could not be reached, or refused the call."""


class LeaseLost(ClusterError):
    """This host's lease on ``session_id`` expired or another host holds it now."""

    def __init__(self, session_id: str, message: str = "") -> None:
        super().__init__(message or f"this host no longer owns session {session_id}")
        self.session_id = session_id


class Fenced(ClusterError):
    """An append to ``session_id``'s trace was refused because the trace moved on since this
    writer last wrote (another host took the session over): this writer is stale."""

    def __init__(self, session_id: str, expected: int) -> None:
        super().__init__(
            f"the trace of session {session_id} was written by another host "
            f"(this writer expected its last record at {expected})"
        )
        self.session_id = session_id
        self.expected = expected


class RecordTooLarge(ClusterError):
    """A trace record of ``session_id`` (``size`` bytes, with its message's headers) is
    larger than the NATS server takes in one message (its ``max_payload``): it can never
    reach the cluster's trace."""

    def __init__(self, session_id: str, size: int, most: int) -> None:
        super().__init__(
            f"a record of session {session_id} ({size} bytes) is larger than the NATS "
            f"server takes in one message ({most} bytes, its max_payload)"
        )
        self.session_id = session_id
        self.size = size


class CallTooLarge(ClusterError):
    """A request to another host (``size`` bytes) is larger than the NATS server takes in
    one message (its ``max_payload``): nothing was sent."""

    def __init__(self, size: int, most: int) -> None:
        super().__init__(
            f"the call ({size} bytes as forwarded) is larger than the NATS server carries "
            f"between hosts ({most} bytes, its max_payload); nothing was done"
        )
        self.size = size


class OwnerUnreachable(ClusterError):
    """No host answered a request for ``session_id`` within the timeout (its owner is gone
    and no other host has taken it over yet). ``in_doubt``: a host took the request and
    may have carried it out before it stopped answering (else no host served the session
    when it was sent)."""

    def __init__(self, session_id: str, timeout_s: float, *, in_doubt: bool = True) -> None:
        doubt = (
            ": the call may have been carried out, look before sending it again"
            if in_doubt
            else ", try again shortly"
        )
        super().__init__(
            f"no host answered for session {session_id} within {timeout_s:g} s; "
            f"it is being moved to another host{doubt}"
        )
        self.session_id = session_id
        self.timeout_s = timeout_s
        self.in_doubt = in_doubt
