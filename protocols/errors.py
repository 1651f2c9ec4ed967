"""The public exception tree.

::

    GreenroomError
    ├── Busy               the session already runs a task or compaction (409 on the wire)
    ├── AuthLocked         the session's credentials failed; call retry_auth() (423)
    ├── SessionNotFound    no session with that id in the data dir (404)
    ├── SessionExists      a new session named with the id of one that exists (409)
    ├── SessionClosed      the session was closed or deleted
    ├── HostClosed         the host is shut down
    ├── ConfigurationError bad settings, unknown provider, missing key…
    │   ├── OutputSchemaError  an output_schema that cannot be used (R-OUT-1) (400)
    │   └── HooksFileError     a command hooks settings file that cannot be used (R-HOOK-2)
    ├── ImageRefused       an image file that cannot be attached, and why (400)
    ├── InputTooLarge      input larger than the session's trace carries in a record (400)
    ├── NotPending         an answer for a request no person is asked (any more) (409)
    └── SeqRefused         a fork or rewind point the session's history does not have (400)

Model and tool failures are not exceptions: they are outputs (``request_end`` with a
status, ``tool_call_output`` with ``is_error``).
"""

from __future__ import annotations


class GreenroomError(Exception):
    """Base of every error greenroom raises on purpose."""


class Busy(GreenroomError):
    """A task or compaction is already running in this session (R-HOST-2). Use
    ``follow_up()`` to queue work instead."""

    code = 409


class AuthLocked(GreenroomError):
    """The last request failed authentication; the session refuses new tasks until its
    credentials are updated or ``retry_auth()`` is called (R-RETRY-6)."""

    code = 423


class SessionNotFound(GreenroomError):
    """No session with this id exists in the host's data dir."""

    code = 404


class SessionExists(GreenroomError):
    """A session was to be created with an id an existing session has (open in this host,
    being created, or stored in its data dir); nothing was written."""

    code = 409


class SessionOpenElsewhere(Busy):
    """The session is open in another host on the same data dir (another process, or
    another :class:`Host` of this one): a trace has one writer at a time (R-TRACE-1), so
    it is answered, steered or run through the host that has it open."""


class SessionClosed(GreenroomError):
    """The session was closed or deleted; it accepts no more work."""

    code = 410


class HostClosed(GreenroomError):
    """The host has shut down."""

    code = 503


class ConfigurationError(GreenroomError):
    """Settings that cannot work: unknown provider, missing credentials, bad values."""

    code = 400


class OutputSchemaError(ConfigurationError, ValueError):
    """What ``output_schema`` was given cannot be used (R-OUT-1): not a JSON Schema of an
    object, an annotation with no JSON form, a recursive class, or a session with a tool
    of the final answer's name. Nothing was started."""

    code = 400


class HooksFileError(ConfigurationError):
    """A command hooks settings file (``--hooks FILE``, R-HOOK-2) that cannot be read or
    used; the message names the file and the place (``$.before_tool[0].command``)."""


class ImageRefused(GreenroomError):
    """An image named in the input cannot be attached (R-SEC-8): a symbolic link, not a
    regular file, larger than the session's ``max_image_bytes``, missing, unreadable, or
    outside what the caller may name. Nothing of the input was taken: correct it and send
    it again.

    ``path`` is the name as given, ``reason`` says why, ``index`` is the block's position
    in the input (None when the image did not come from a list of blocks)."""

    code = 400

    def __init__(self, path: str, reason: str, index: int | None = None) -> None:
        super().__init__(f"image {path!r} refused: {reason}")
        self.path = path
        self.reason = reason
        self.index = index


class InputTooLarge(GreenroomError, ValueError):
    """Input (of ``run``, ``steer`` or ``follow_up``, or a person's answer to a question,
    which becomes the call's result) whose trace record would be larger
    than the session's trace carries in one record: a cluster's NATS server's
    ``max_payload``, less what the record's other fields take (R-SEC-9, R-CLUSTER-2). A
    file trace has no such limit. Nothing of the input was taken: send less.

    ``size`` is the input's bytes as its record holds them (its blocks, and the output
    schema of a task), ``most`` the most the trace carries."""

    code = 400

    def __init__(self, size: int, most: int) -> None:
        super().__init__(
            f"input too large: its trace record would hold {size} bytes of input, more than "
            f"the cluster's NATS server carries in one message ({most} bytes with its "
            "max_payload); nothing was done, send less"
        )
        self.size = size
        self.most = most


class NotPending(GreenroomError):
    """An answer (``answer_approval``, ``answer_question``, a client's ``approve``) for a
    call no person is asked about: it was answered already, it timed out, its task
    ended, or its arguments are not the ones the person saw (R-HITL-2)."""

    code = 409


class SeqRefused(GreenroomError):
    """A ``seq`` to fork at or rewind to that the session's history does not allow
    (R-FORK-1, R-FORK-2): out of range, or (a rewind) cut by an earlier rewind. The
    message says which, and what to do instead."""

    code = 400
