"""The gateway actor: JSON-RPC 2.0 over websockets at ``ws://HOST:PORT/v1`` (CONTRACT.md).

::

    Gateway.run                     the listener (trio-websocket), until cancelled
    ├── titles                      names each session once, after its first task
    └── one handler per connection
        ├── reader   the handler task itself: reads frames, answers requests in order
        ├── writer   sends the connection's queued frames (responses, notifications)
        └── compact  a detached call (it waits for a model request), answered when done

The modules, by role:

* :mod:`.server` — :class:`Gateway`: listening, admission (origins, the connection cap,
  the file descriptor reserve), the handshake and its token; :func:`run_serve`.
* :mod:`.connection` — one connection: its reader, writer, outbox, token bucket and the
  slow-client rule.
* :mod:`.methods` — the JSON-RPC method handlers, driven by
  :data:`greenroom.protocols.jsonrpc.METHODS`.
* :mod:`.hubs` — the gateway's one listener per session, subscriptions with gapless
  replay.
* :mod:`.access` — principals and their tokens, the sessions each may see (a session's
  creator is stored with it), and admission (each principal's connections, each
  address's wrong tokens).
* :mod:`.titles` — session titles.
* :mod:`.config` — :class:`SessionDefaults`, :class:`GatewayLimits`, tokens files,
  workspace confinement.
* :mod:`.console` — the web console's HTTP server and its page (``console/index.html``).

Frames are read and built by :mod:`greenroom.protocols.jsonrpc`; this package does the I/O.

Invariants:

* A session's supervisor never waits on a client. The gateway watches each session through
  one ``Session.subscribe`` listener that encodes every output once and queues the frame on
  each subscribed connection's outbox without blocking. A client is dropped only when it is
  really behind: its writer has not finished a send for ``stall_timeout_s`` (the socket
  refuses bytes: the client does not read) while more than ``max_pending_frames`` frames
  wait that the writer has not taken, or an output would take what waits past
  ``max_pending_bytes`` whatever the reason. A burst of outputs on a busy server, which a
  prompt reader gets as soon as its writer runs, never counts. A dropped subscription gets
  a ``subscription_dropped`` notification ``{session_id, reason, last_seq}``; the client
  resubscribes with ``after_seq: last_seq`` and misses nothing. Other clients and the
  session are never slowed down.
* Every frame counts against ``max_pending_bytes`` (R-SEC-9): an answer, error or notice
  that would pass it closes the connection (1008, ``client too slow: …``) instead of
  being queued, so a client that sends and never reads is cut off rather than grow the
  server. A writer stuck in one send for ``send_timeout_s`` (the client reads nothing;
  looked at every quarter of it) closes the connection too, letting go of what waits: a
  client that stopped reading holds nothing for much longer than that, and comes back by
  resubscribing with ``after_seq``.
* Runs are not read through their ``RunStream``: the gateway detaches it at once
  (``RunStream.detach``) and every output reaches clients through the subscription, so
  nothing piles up for a run nobody reads.
* Requests of one connection are executed in arrival order by its reader (a ``steer``
  sent after a ``run`` lands in that run). ``compact`` alone runs in its own task, so the
  connection keeps reading while the model summarizes (inside a batch it runs in line).
* A bad frame is answered with an error and the connection stays open: not JSON (-32700);
  binary, wrong shape, too large (-32600); unknown method (-32601); bad params (-32602,
  naming the ``$.path``). The one exception is a message larger than
  ``max_message_bytes``, which the websocket library refuses by closing (1009).
* Batches are supported (JSON-RPC 2.0 §6); each entry counts against the rate limit.
* Sessions outlive the gateway: stopping it closes each connection with code 1001 and a
  reason, and leaves running tasks to the host.

Authentication and identity (R-SEC-4): a connection is authenticated by ``Authorization:
Bearer TOKEN`` on the handshake (a wrong token is refused with HTTP 401 before the upgrade)
or by an ``initialize {token, client_id?}`` first call; until then every other method
answers 401 and the connection stays open, for at most ``auth_timeout_s`` (10 s: then it is
closed with 1008; after ``max_auth_failures`` wrong tokens it is closed at once). Each token
names one *principal* (``--tokens-file``: one ``CLIENT_ID TOKEN`` per line; ``--token-file``
or the generated token: the principal ``default``). Tokens are compared in constant time,
every known token each time. ``initialize {client_id}`` and the ``X-Greenroom-Client``
header may only repeat the token's principal: naming another is refused (403). A
principal sees only the sessions it created or was granted (:meth:`Gateway.grant`):
another principal's session answers 403, an unknown one 404. A principal holds at most
``max_sessions_per_principal`` sessions open in the host; ``session.create`` beyond them
answers 429. Every connection of one
principal sees the same sessions (a reconnecting client keeps its sessions).

Admission, before any of that: a request whose ``Host`` header names neither
``localhost``, the listen host, an IP address nor a name given with ``allowed_hosts`` /
:meth:`Gateway.allow_host` (``serve --allow-host``) is refused with HTTP 421 first (DNS
rebinding), on the websocket, the HTTP endpoints and the console alike; a browser
handshake (one with an ``Origin`` header) whose
origin is not allowed (the console's, or one given with ``allowed_origins`` /
:meth:`Gateway.allow_origin`) is refused with HTTP 403; beyond ``max_connections`` open
connections the handshake is refused with HTTP 503, and beyond its principal's
``max_connections_per_principal`` with HTTP 429, so that one principal cannot take every
place (R-SEC-9); a remote address (an IPv6 address's /64) that sent
``max_auth_failures_per_address`` wrong tokens within ``auth_failure_window_s`` is refused
with HTTP 429 and ``Retry-After`` before its token is looked at, other addresses
unaffected; and the listener stops accepting sockets at
``max_connections + HANDSHAKE_SLACK``, so a flood of half-open connections
waits in the kernel's backlog instead of taking the file descriptors sessions need for
their traces. ``greenroom serve`` raises the process's soft ``RLIMIT_NOFILE`` to its hard
limit and keeps ``FD_RESERVE`` descriptors out of the cap (:func:`connection_cap`).

Workspaces (R-SEC-5): a client's ``session.create {workspace}`` must resolve (symlinks
followed) to a directory under the workspace root (:attr:`SessionDefaults.workspace_root`,
default: the default workspace) that is not the file system root; relative paths are
taken from the root. The gateway refuses to start when the data dir (tokens, traces,
ledger) lies under the workspace root or the default workspace: no session's tools could
then reach it.

People (``approve="ask"``, the default of ``greenroom serve``): tasks run with
``approve="people"``. A tool call's ``approval_request`` is a record of the trace that
waits, whoever watches, until a person answers it (R-HITL-1): ``approvals.list`` lists
the requests of the caller's sessions, ``approve {session_id, call_id, decision,
digest?}`` and ``answer {session_id, call_id, text}`` answer them through the host as the
caller's principal, whether or not the task is in memory (R-HITL-2). An answer for a call
that waits for none is 409. The session's ``approval_timeout_s`` (``None``, no limit, by
default here) denies a request nobody answers in time. Stopping the gateway, or the
server, leaves requests pending: a gateway started again grants each stored session to
its creator, and its host takes up the tasks left open (R-HITL-4).
"""

from greenroom.actors.gateway.config import (
    AUTH_TIMEOUT_S,
    DEFAULT_CLIENT,
    DEFAULT_MAX_CONNECTIONS,
    FD_RESERVE,
    PATH,
    TOKEN_FILE_NAME,
    GatewayLimits,
    SessionDefaults,
    check_data_dir_private,
    connection_cap,
    load_or_create_token,
    load_tokens_file,
    raise_fd_limit,
    token_file_path,
)
from greenroom.actors.gateway.server import Gateway, run_serve
from greenroom.actors.gateway.titles import TITLE_FILE

__all__ = [
    "AUTH_TIMEOUT_S",
    "DEFAULT_CLIENT",
    "DEFAULT_MAX_CONNECTIONS",
    "FD_RESERVE",
    "PATH",
    "TITLE_FILE",
    "TOKEN_FILE_NAME",
    "Gateway",
    "GatewayLimits",
    "SessionDefaults",
    "check_data_dir_private",
    "connection_cap",
    "load_or_create_token",
    "load_tokens_file",
    "raise_fd_limit",
    "run_serve",
    "token_file_path",
]
