"""Session traces in one JetStream stream, fenced (R-CLUSTER-1, R-TRACE-1).

The stream holds one subject per session (:meth:`ClusterNames.trace_subject`). A message
on it is one of:

* a batch of trace records: the payload is exactly the JSONL lines of the trace files
  (:func:`greenroom.protocols.trace.encode_record`), one or more, in ``seq`` order;
* a *fence* (header ``Greenroom-Fence: <host id>``, no payload): written by a host that
  just claimed the session, before it reads the trace to rebuild it;
* a *rotation* (header ``Greenroom-Rotate: <n>``, no payload): the records after it belong
  to the session's ``n``-th trace file (a compaction started a new model context).

Fencing: a :class:`TraceWriter` appends with ``Nats-Expected-Last-Subject-Sequence`` set to
the stream sequence of the subject's last message as this writer knows it. A new owner's
fence moves that sequence on, so every later append of the previous owner (which lost its
lease, perhaps while stopped) is refused with :class:`~.errors.Fenced`, and the records the
new owner read up to its fence are the whole trace as far as anyone can have written it.

A retried append is no fence: every append carries a ``Nats-Msg-Id`` that is the same
for each attempt of one message and different for any other (the session, the sequence
it is appended after, a digest of its headers and payload). When an attempt was stored
but its acknowledgement lost, the server refuses the retry for its expected sequence (it
checks that before the message id); the writer then finds its message as the subject's
first after the sequence it appended after, and goes on after it (another host's fence
may follow it: the next append is refused then). If anything else is first there, the
writer was fenced.

Reading: :meth:`TraceStream.read` gives the records with ``seq`` greater than ``after_seq``
that exist now, all at once; :meth:`TraceStream.pages` gives the same a stream message at a
time, keeping none (a replay to a client); :meth:`TraceStream.follow` gives the same and
then every record appended later, in order, without gap or duplicate (one ordered consumer
does both).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence

import attrs
import nats.errors
import nats.js.api
import nats.js.errors
import trio
from nats.aio.msg import Msg

from greenroom.actors.cluster.bridge import Inbox
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable, Fenced, RecordTooLarge
from greenroom.actors.cluster.leases import wrong_last_sequence
from greenroom.protocols.outputs import Output
from greenroom.protocols.trace import TraceLineError, parse_trace

__all__ = ["Pages", "Records", "TraceRead", "TraceStream", "TraceWriter", "largest_input"]

FENCE_HEADER = "Greenroom-Fence"
ROTATE_HEADER = "Greenroom-Rotate"
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_MESSAGE_ID = "Nats-Msg-Id"
_HEADER_FRAME = len(b"NATS/1.0\r\n\r\n")
_HEADER_LINE = len(b": \r\n")
_LARGEST_SEQUENCE = "9" * 20
"""A stream sequence of the most digits (a uint64)."""
_UNSUBSCRIBE_S = 2.0
_PAGES_HELD = 16
"""The most stream messages a reader of :meth:`TraceStream.pages` is handed ahead of what
it took (each one record, or lines of at most a message's bytes)."""

RECORD_HEADROOM = 4096
"""Bytes of a trace message left to all but a client's input: the message's headers (its
expected sequence and id) and the other fields of the input's record (its envelope, a
run's output schema is counted with the input)."""


def largest_input(conn: Connection) -> int:
    """The most bytes a client's input may take in its trace record
    (:func:`~greenroom.protocols.trace.input_size`): a record NATS cannot carry in one
    message (its ``max_payload``) never reaches the cluster, and its session would stop on
    its host (:class:`~.errors.RecordTooLarge`)."""
    return conn.client.max_payload - RECORD_HEADROOM


@attrs.frozen(kw_only=True)
class TraceRead:
    """What :meth:`TraceStream.read` found: ``records`` with ``seq > after_seq`` (all
    files), ``current`` the records of the latest trace file (``file`` its number; the model
    context to rebuild), ``last_sequence`` the stream sequence of the subject's last
    message read, and the lines that could not be parsed."""

    records: tuple[Output, ...]
    current: tuple[Output, ...]
    file: int
    last_sequence: int
    files: tuple[tuple[int, tuple[Output, ...]], ...] = ()
    """Every record (whatever ``after_seq``) by trace file number, oldest first."""
    errors: tuple[TraceLineError, ...] = ()


class TraceStream:
    """The cluster's trace stream. Use :meth:`open`."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._names = conn.names

    @classmethod
    async def open(cls, conn: Connection) -> TraceStream:
        """Bind the trace stream, creating it if it does not exist."""
        config = nats.js.api.StreamConfig(
            name=conn.names.trace_stream,
            subjects=[conn.names.trace_subjects],
            storage=nats.js.api.StorageType.FILE,
            retention=nats.js.api.RetentionPolicy.LIMITS,
            allow_direct=True,
            deny_delete=True,
        )
        try:
            await conn.call(conn.js.stream_info(conn.names.trace_stream))
        except nats.js.errors.NotFoundError:
            try:
                await conn.call(conn.js.add_stream(config))
            except nats.js.errors.APIError as exc:
                # Created by another host meanwhile: that is the one to use.
                try:
                    await conn.call(conn.js.stream_info(conn.names.trace_stream))
                except nats.js.errors.APIError:
                    raise ClusterUnavailable(f"cannot create the trace stream: {exc}") from exc
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot open the trace stream: {exc}") from exc
        return cls(conn)

    def largest_input(self) -> int:
        """:func:`largest_input` of the stream's connection."""
        return largest_input(self._conn)

    async def last_sequence(self, session_id: str) -> int:
        """The stream sequence of the last message on ``session_id``'s subject (0: none)."""
        subject = self._names.trace_subject(session_id)
        try:
            msg = await self._conn.call(
                self._conn.js.get_last_msg(self._names.trace_stream, subject, direct=True)
            )
        except nats.js.errors.NotFoundError:
            return 0
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read the trace of {session_id}: {exc}") from exc
        return int(msg.seq or 0)

    async def purge(self, session_id: str) -> None:
        """Remove ``session_id``'s trace (the session was deleted)."""
        await self._conn.call_api(
            self._conn.js.purge_stream(
                self._names.trace_stream, subject=self._names.trace_subject(session_id)
            ),
            f"purge the trace of {session_id}",
        )

    async def fence(self, session_id: str, host_id: str) -> TraceWriter:
        """Write a fence for ``host_id`` (which must hold the session's lease) and return
        the writer that appends after it. Every writer made before is refused from now on."""
        subject = self._names.trace_subject(session_id)
        ack = await self._conn.call_api(
            self._conn.js.publish(subject, b"", headers={FENCE_HEADER: host_id}),
            f"fence the trace of {session_id}",
        )
        return TraceWriter(self._conn, session_id, expected=ack.seq)

    async def read(self, session_id: str, *, after_seq: int = 0) -> TraceRead:
        """Every record of ``session_id`` with ``seq > after_seq`` written so far."""
        last = await self.last_sequence(session_id)
        folded = _Fold(after_seq)
        if last:
            async with self._subscription(session_id) as messages:
                async for msg in messages:
                    folded.add(msg)
                    if msg.metadata.sequence.stream >= last:
                        break
        return folded.result(last)

    @contextlib.asynccontextmanager
    async def follow(self, session_id: str, *, after_seq: int = 0) -> AsyncIterator[Records]:
        """An iterator over the records with ``seq > after_seq``: those written so far and
        then each one appended later, in order, for as long as the ``async with`` lasts.
        Each record is handed on and not kept."""
        async with self._subscription(session_id) as messages:
            yield Records(messages, _Fold(after_seq, keep=False))

    @contextlib.asynccontextmanager
    async def pages(self, session_id: str, *, after_seq: int = 0) -> AsyncIterator[Pages]:
        """An iterator over the records with ``seq > after_seq`` written so far (as
        :meth:`read` gives them), a page at a time: the records of one stream message
        (at most the NATS server's ``max_payload``), none kept once handed on, at most
        :data:`_PAGES_HELD` messages read ahead. A trace of any length costs its reader
        that much memory, where :meth:`read` holds it whole (R-SEC-9)."""
        last = await self.last_sequence(session_id)
        if not last:
            yield Pages(None, _Fold(after_seq, keep=False), last)
            return
        async with self._subscription(session_id, limit=_PAGES_HELD) as messages:
            yield Pages(messages, _Fold(after_seq, keep=False), last)

    @contextlib.asynccontextmanager
    async def _subscription(
        self, session_id: str, *, limit: int | None = None
    ) -> AsyncIterator[Inbox[Msg]]:
        subject = self._names.trace_subject(session_id)
        inbox: Inbox[Msg] = (
            self._conn.bridge.inbox() if limit is None else self._conn.bridge.inbox(limit)
        )
        self._conn.inboxes.add(inbox)
        try:
            sub = await self._conn.call_api(
                self._conn.js.subscribe(
                    subject,
                    stream=self._names.trace_stream,
                    ordered_consumer=True,
                    deliver_policy=nats.js.api.DeliverPolicy.ALL,
                    cb=inbox.put,
                ),
                f"read the trace of {session_id}",
            )
            try:
                yield inbox
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(_UNSUBSCRIBE_S):
                    with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
                        await self._conn.call(self._conn.close_consumer(sub))
        finally:
            self._conn.inboxes.discard(inbox)
            inbox.end()


class Records:
    """The records of a :meth:`TraceStream.follow`, as an async iterator."""

    def __init__(self, messages: Inbox[Msg], fold: _Fold) -> None:
        self._messages = messages
        self._fold = fold
        self._ready: list[Output] = []

    def __aiter__(self) -> Records:
        return self

    async def __anext__(self) -> Output:
        while not self._ready:
            msg = await self._messages.__anext__()
            self._ready = self._fold.add(msg)
        return self._ready.pop(0)


class Pages:
    """The records of a :meth:`TraceStream.pages`, as an async iterator of lists (each
    the new records of one stream message), up to the stream sequence ``last``."""

    def __init__(self, messages: Inbox[Msg] | None, fold: _Fold, last: int) -> None:
        self._messages = messages
        self._fold = fold
        self._last = last

    @property
    def last_seq(self) -> int:
        """The highest ``seq`` read so far, ``after_seq`` or not: once the pages are
        through, the session's last seq as the stream held it."""
        return self._fold.last_seq

    def __aiter__(self) -> Pages:
        return self

    async def __anext__(self) -> list[Output]:
        while self._messages is not None:
            msg = await self._messages.__anext__()
            if msg.metadata.sequence.stream >= self._last:
                self._messages = None  # read through the last message there was
            page = self._fold.add(msg)
            if page:
                return page
        raise StopAsyncIteration


class _Fold:
    """Folds stream messages into records, files and rotations; ``keep``: holds every
    record for :meth:`result` (else only hands each message's new records on)."""

    def __init__(self, after_seq: int, *, keep: bool = True) -> None:
        self._after = after_seq
        self._keep = keep
        self.records: list[Output] = []
        self.current: list[Output] = []
        self.file = 1
        self.errors: list[TraceLineError] = []
        self.files: dict[int, list[Output]] = {}
        self.last_seq = 0
        """The highest ``seq`` folded (every record, not only those after ``after_seq``)."""

    def add(self, msg: Msg) -> list[Output]:
        headers = msg.headers or {}
        rotate = headers.get(ROTATE_HEADER)
        if rotate is not None:
            try:
                self.file = int(rotate)
            except ValueError:
                self.file += 1
            self.current = []
            return []
        if FENCE_HEADER in headers or not msg.data:
            return []
        parsed = parse_trace(msg.data, file=f"{msg.subject}@{msg.metadata.sequence.stream}")
        if self._keep:
            self.errors.extend(parsed.errors)
        fresh: list[Output] = []
        for record in parsed.records:
            seq = record.seq or 0
            # A record at or below the last one seen is a duplicate write; skip it so
            # readers see each seq once.
            if seq <= self.last_seq:
                continue
            self.last_seq = seq
            if self._keep:
                self.current.append(record)
                self.files.setdefault(self.file, []).append(record)
            if seq > self._after:
                fresh.append(record)
        if self._keep:
            self.records.extend(fresh)
        return fresh

    def result(self, last_sequence: int) -> TraceRead:
        return TraceRead(
            records=tuple(self.records),
            current=tuple(self.current),
            file=self.file,
            last_sequence=last_sequence,
            files=tuple((n, tuple(rs)) for n, rs in sorted(self.files.items())),
            errors=tuple(self.errors),
        )


class TraceWriter:
    """Appends to one session's trace after the stream sequence ``expected``; refused with
    :class:`Fenced` once anyone else wrote to the subject. Not for concurrent use: one
    session's appends are made one after another."""

    def __init__(self, conn: Connection, session_id: str, *, expected: int) -> None:
        self._conn = conn
        self.session_id = session_id
        self._subject = conn.names.trace_subject(session_id)
        self.expected = expected
        self.fenced = False
        largest = self._message_id(b"", {}, after=_LARGEST_SEQUENCE)
        self._append_headers = _headers_size(self._headers({}, _LARGEST_SEQUENCE, largest))
        """The most bytes the headers of an append take (the session's, whatever sequence
        it follows)."""

    async def append(self, lines: Sequence[str]) -> int:
        """Append ``lines`` (finished trace lines, each ending in ``"\\n"``) as one message;
        return its stream sequence. Raises :class:`Fenced` when this writer is stale (and
        from then on, without asking the server again). After :class:`ClusterUnavailable`,
        retry with the same ``lines``: the attempt may have been stored, and only the same
        message is recognised as it. Raises :class:`RecordTooLarge` for a message larger,
        with its headers, than NATS takes (nothing was sent)."""
        return await self._publish("".join(lines).encode(), {}, "append to")

    def largest_append(self) -> int:
        """The most bytes of lines one :meth:`append` carries whatever sequence it follows:
        the NATS server's ``max_payload`` less the headers of an append."""
        return self._conn.client.max_payload - self._append_headers

    async def rotate(self, file_number: int) -> int:
        """Mark the start of trace file ``file_number`` (fenced and retried like
        :meth:`append`)."""
        return await self._publish(b"", {ROTATE_HEADER: str(file_number)}, "rotate")

    async def _publish(self, payload: bytes, marks: dict[str, str], doing: str) -> int:
        if self.fenced:
            raise Fenced(self.session_id, self.expected)
        expected = str(self.expected)
        message_id = self._message_id(payload, marks, after=expected)
        headers = self._headers(marks, expected, message_id)
        # The client compares only the payload with max_payload, the server the headers
        # too: a message over it there closes the host's connection, and goes again after
        # each reconnect, for ever.
        size = len(payload) + _headers_size(headers)
        if size > self._conn.client.max_payload:
            raise RecordTooLarge(self.session_id, size, self._conn.client.max_payload)
        try:
            ack = await self._conn.call(
                self._conn.js.publish(self._subject, payload, headers=headers)
            )
        except nats.errors.MaxPayloadError as exc:
            # Refused by the client before anything is sent; sending it again would be
            # refused the same way.
            most = self._conn.client.max_payload
            raise RecordTooLarge(self.session_id, len(payload), most) from exc
        except nats.js.errors.APIError as exc:
            if not wrong_last_sequence(exc):
                raise ClusterUnavailable(f"cannot {doing} {self.session_id}: {exc}") from exc
            # The server checks the expected sequence before the message id, so a retry
            # of a message stored unacknowledged is refused like a stale writer's: it is
            # no fence when that message is the subject's first after ``expected``.
            stored = await self._stored_first(message_id)
            if stored is None:
                self.fenced = True
                raise Fenced(self.session_id, self.expected) from exc
            self.expected = stored
            return stored
        self.expected = ack.seq
        return ack.seq

    @staticmethod
    def _headers(marks: dict[str, str], expected: str, message_id: str) -> dict[str, str]:
        return {**marks, _EXPECTED_LAST: expected, _MESSAGE_ID: message_id}

    def _message_id(self, payload: bytes, marks: dict[str, str], *, after: str) -> str:
        # The same for every attempt of one message, different for any other message in
        # the stream: a writer appends after a given sequence once, no other writer
        # appends after it (each starts after its own fence), and the digest tells this
        # message from a different one tried after the same sequence. So finding it as
        # the subject's first after that sequence proves the attempt stored, and
        # JetStream's duplicate window, where it is consulted first, can only answer a
        # retry with its own ack.
        digest = hashlib.blake2b(digest_size=16)
        for name, value in sorted(marks.items()):
            digest.update(f"{name}: {value}\n".encode())
        digest.update(b"\n")
        digest.update(payload)
        return f"{self.session_id}.{after}.{digest.hexdigest()}"

    async def holds(self, lines: Sequence[str]) -> bool:
        """Whether the stream holds the append of ``lines`` after :attr:`expected` whose
        outcome is unknown (cut short, or its acknowledgement lost), for certain: it is the
        subject's first message after ``expected``, or it is not and never will be. When
        nothing follows ``expected`` yet, the attempt may still be on its way: the same
        message goes again, as a retry would, so that it is stored once now or refused for
        good (the first message after ``expected`` is someone else's). Raises
        :class:`ClusterUnavailable` when NATS does not answer."""
        payload = "".join(lines).encode()
        message_id = self._message_id(payload, {}, after=str(self.expected))
        first = await self._first_after()
        if first is None:
            try:
                await self._publish(payload, {}, "append to")
                return True
            except Fenced:
                first = await self._first_after()
        return first is not None and (first.headers or {}).get(_MESSAGE_ID) == message_id

    async def _first_after(self) -> nats.js.api.RawStreamMsg | None:
        """The subject's first message after :attr:`expected`, if any."""
        try:
            return await self._conn.call(
                self._conn.js.get_msg(
                    self._conn.names.trace_stream,
                    self.expected + 1,
                    subject=self._subject,
                    next=True,
                    direct=True,
                )
            )
        except nats.js.errors.NotFoundError:
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read the trace of {self.session_id}: {exc}") from exc

    async def _stored_first(self, message_id: str) -> int | None:
        """The stream sequence of the subject's first message after :attr:`expected` if it
        is ``message_id`` (another host's fence may follow it: it was stored all the same)."""
        first = await self._first_after()
        if first is None or (first.headers or {}).get(_MESSAGE_ID) != message_id:
            return None
        return int(first.seq or 0)


def _headers_size(headers: dict[str, str]) -> int:
    """The bytes ``headers`` take in a message as the client writes them and the server
    counts them against its ``max_payload``: a status line, a line each, a blank line."""
    return _HEADER_FRAME + sum(
        len(name.encode()) + len(value.encode()) + _HEADER_LINE for name, value in headers.items()
    )
