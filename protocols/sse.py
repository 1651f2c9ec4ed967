"""Incremental Server-Sent-Events decoder (WHATWG HTML "event stream" interpretation).

Bytes in, :class:`SSEEvent` out; no I/O. The input may be split at any byte offset: inside
a multi-byte UTF-8 character, between the ``\\r`` and ``\\n`` of a CRLF, between the two
newlines of an event separator. Lines are found with bytes methods on whole chunks and
decoded once per event, because this sits on the streaming hot path.

Supported: LF, CRLF and CR line endings (mixed), ``:`` comment lines, the ``event`` and
``data`` fields (several ``data`` lines joined by ``\\n``), one optional space after the
colon, a field line without a colon (the whole line is the field name), the ``id`` field
(kept as :attr:`SSEDecoder.last_event_id`), a leading UTF-8 BOM. ``retry`` and unknown
fields are ignored. Invalid UTF-8 is replaced with U+FFFD, as the standard says.

An event larger than :data:`MAX_EVENT_BYTES` (its lines so far, and the line under way)
raises :class:`EventTooLarge`: a server cannot make the decoder hold an event without end
while it waits for that end. The model stream decoders built on this one also take at most
:data:`MAX_RESPONSE_BYTES` of one response's body (:func:`response_too_large`).
"""

from __future__ import annotations

import attrs

_BOM = b"\xef\xbb\xbf"
_LF = 0x0A
_CR = 0x0D
_COLON = 0x3A
_EVENT_NAMES: dict[bytes, str] = {
    n.encode(): n
    for n in (
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop", "ping", "error", "message",
    )
}


MAX_EVENT_BYTES = 16 << 20
"""The most bytes one event may take: a model's events are deltas of a few bytes to a few
kilobytes, a whole tool call's arguments in one event at most some hundred kilobytes."""


MAX_RESPONSE_BYTES = 128 << 20
"""The most bytes of one streamed response's body a model stream decoder takes before it
fails the attempt (``malformed``). Every event holds what it carries until the response
ends (its text, thinking and arguments, in the decoder and in the turn), so a server that
never ends its answer would otherwise grow the host's memory until the process dies
(R-SEC-1). The longest answers a model gives today (128K output tokens, one token an event,
a few hundred bytes of JSON around each on the most verbose servers) take a third of it."""


def response_too_large() -> str:
    """Why a response past :data:`MAX_RESPONSE_BYTES` failed, in words."""
    return (
        f"the response grew past {MAX_RESPONSE_BYTES >> 20} MiB without ending "
        "(a server that does not stop its answer)"
    )


class EventTooLarge(ValueError):
    """An event grew past :data:`MAX_EVENT_BYTES` before its end came."""

    def __init__(self) -> None:
        super().__init__(
            f"an event of the stream grew past {MAX_EVENT_BYTES >> 20} MiB without ending"
        )


@attrs.frozen(kw_only=True, slots=True)
class SSEEvent:
    """One dispatched event. ``event`` is None when the stream gave no (or an empty)
    ``event:`` field, which the standard calls type ``message``."""

    event: str | None
    data: str


class SSEDecoder:
    """Turns a byte stream into events, one :meth:`feed` per network read.

    Contract:

    * :meth:`feed` returns the events completed by this chunk, in stream order; bytes of
      an unfinished line or event are kept for the next call.
    * :meth:`close` marks the end of the stream. An event without its terminating blank
      line is discarded (the standard's rule), and :attr:`truncated` tells whether
      anything that could have belonged to an event was discarded.
    * Feeding after :meth:`close` is a programming error (``RuntimeError``).
    * An event that grows past :data:`MAX_EVENT_BYTES` raises :class:`EventTooLarge`
      from :meth:`feed` (and its variants); the decoder is then of no further use.
    """

    __slots__ = ("_closed", "_data", "_event", "_held", "_pending", "_pending_size",
                 "_skip_lf", "_started", "last_event_id", "truncated")

    def __init__(self) -> None:
        # Unterminated line fragments; joined only once a line end arrives, so a long line
        # fed in many small chunks costs linear, not quadratic, time.
        self._pending: list[bytes] = []
        self._pending_size = 0
        # Bytes of the data lines of the event under way: with the pending fragments, what
        # the event holds; past MAX_EVENT_BYTES the decoder gives up (EventTooLarge).
        self._held = 0
        # The previous chunk ended with CR: a LF at the start of the next chunk belongs to
        # that CRLF and must not count as a second (blank) line.
        self._skip_lf = False
        self._data: list[bytes] = []
        self._event: str | None = None
        self._started = False
        self._closed = False
        self.last_event_id: str | None = None
        self.truncated = False

    @property
    def at_event_boundary(self) -> bool:
        """Whether everything fed so far ended with a complete event (nothing is pending,
        not even a CR), after the stream's start: a caller that recognises a chunk's
        leading events itself may feed only the rest."""
        return (
            self._started
            and not self._pending
            and not self._data
            and self._event is None
            and not self._skip_lf
            and not self._closed
        )

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode one chunk; returns the events it completes (possibly none)."""
        return [SSEEvent(event=e, data=d) for e, d in self.feed_raw(data)]

    def feed_raw(self, data: bytes) -> list[tuple[str | None, str]]:
        """:meth:`feed` giving ``(event, data)`` tuples instead of :class:`SSEEvent`:
        same contract, one allocation less per event for hot-path consumers."""
        names, texts = self.feed_columns(data)
        return list(zip(names, texts, strict=True))

    def feed_columns(self, data: bytes) -> tuple[list[str | None], list[str]]:
        """:meth:`feed` as two lists of one length, the events' names and their data: same
        contract, and no object per event (strings only). A chunk completes hundreds of
        events when the client has fallen behind, and every object that lives until the
        chunk is decoded counts towards the cyclic collector's next collection."""
        names: list[str | None] = []
        texts: list[str] = []
        if self._closed:
            raise RuntimeError("SSEDecoder.feed() after close()")
        if not data:
            return names, texts
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
                if not data:
                    return names, texts
        if b"\r" in data:
            if data[-1] == _CR:
                self._skip_lf = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in data:
            self._hold(data)
            return names, texts
        if self._pending:
            self._pending.append(data)
            data = b"".join(self._pending)
            self._pending.clear()
            self._pending_size = 0
        if not self._started or b"\n\n" not in data:
            lines = data.split(b"\n")
            tail = lines.pop()
            self._lines(lines, names, texts)
            if tail:
                self._hold(tail)
            return names, texts
        # Whole events: the common shapes (``event: X`` + one ``data:`` line, or one
        # ``data:`` line) are cut out with two searches each; anything else, or an event
        # begun in an earlier chunk, goes through the line-by-line path.
        blocks = data.split(b"\n\n")
        rest = blocks.pop()
        known = _EVENT_NAMES
        add_name = names.append
        add_text = texts.append
        for block in blocks:
            if not self._data and self._event is None:
                if block.startswith(b"event: "):
                    nl = block.find(b"\n")
                    if (
                        nl > 0
                        and block.startswith(b"data: ", nl + 1)
                        and block.find(b"\n", nl + 1) < 0
                        and b":" not in block[7:nl]
                    ):
                        raw = block[7:nl]
                        name = known.get(raw)
                        if name is None:
                            name = raw.decode("utf-8", "replace") or None
                        add_name(name)
                        add_text(block[nl + 7 :].decode("utf-8", "replace"))
                        continue
                elif block.startswith(b"data: ") and b"\n" not in block:
                    add_name(None)
                    add_text(block[6:].decode("utf-8", "replace"))
                    continue
            lines = block.split(b"\n")
            lines.append(b"")
            self._lines(lines, names, texts)
        # The last block ended with a blank line: no event is under way.
        self._held = 0
        lines = rest.split(b"\n")
        tail = lines.pop()
        if lines:
            self._lines(lines, names, texts)
        if tail:
            self._hold(tail)
        return names, texts

    def _hold(self, fragment: bytes) -> None:
        """Keep ``fragment`` of an unfinished line for the next chunk."""
        self._pending_size += len(fragment)
        if self._held + self._pending_size > MAX_EVENT_BYTES:
            raise EventTooLarge()
        self._pending.append(fragment)

    def close(self) -> list[SSEEvent]:
        """End of stream. Always returns ``[]`` (an unterminated event is never
        dispatched) and sets :attr:`truncated` when something was discarded."""
        if self._closed:
            return []
        self._closed = True
        partial = b"".join(self._pending)
        if not self._started and partial.startswith(_BOM):
            partial = partial[3:]
        partial_counts = bool(partial) and partial[0] != _COLON
        self.truncated = partial_counts or bool(self._data) or self._event is not None
        self._pending.clear()
        self._pending_size = self._held = 0
        self._data = []
        self._event = None
        return []

    def _lines(self, lines: list[bytes], names: list[str | None], texts: list[str]) -> None:
        if not self._started:
            self._started = True
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        data = self._data
        event = self._event
        held = self._held
        for line in lines:
            if not line:
                held = 0
                if data:
                    if len(data) == 1:
                        text = data[0].decode("utf-8", "replace")
                    else:
                        text = b"\n".join(data).decode("utf-8", "replace")
                    names.append(event)
                    texts.append(text)
                    data = []
                event = None
            elif line.startswith(b"data:"):
                held += len(line) + 1
                value = line[5:]
                if value[:1] == b" ":
                    value = value[1:]
                data.append(value)
            elif line.startswith(b"event:"):
                value = line[6:]
                if value[:1] == b" ":
                    value = value[1:]
                event = value.decode("utf-8", "replace") or None
            elif line[0] == _COLON:
                continue
            else:
                name, colon, value = line.partition(b":")
                if colon and value[:1] == b" ":
                    value = value[1:]
                if name == b"data":
                    held += len(line) + 1
                    data.append(value)
                elif name == b"event":
                    event = value.decode("utf-8", "replace") or None
                elif name == b"id" and b"\x00" not in value:
                    self.last_event_id = value.decode("utf-8", "replace")
        self._data = data
        self._event = event
        self._held = held
        if held > MAX_EVENT_BYTES:
            raise EventTooLarge()
