"""The trace file format and the usage-ledger row (pure: no I/O, no trio).

A session's trace is a sequence of files ``trace_001.jsonl``, ``trace_002.jsonl``, … in the
session directory; one file is exactly one model context (a successful compaction starts the
next file: R-COMPACT-8). Each file holds one record per line, and a record is exactly the
JSON that :func:`greenroom.protocols.converter.to_json` gives for a traced output (a class
with ``TRACED = True``) followed by ``"\\n"``. Live-only outputs (``partial_*``,
``tool_progress``) are never traced (R-TRACE-1).

Invariants a writer keeps and :func:`parse_trace` checks:

* every line ends with ``"\\n"``; a line is never split or merged, so a crash can tear at most
  the last line of a file (a write cut short before its newline);
* every record has a ``seq``, strictly increasing within the file (the session's sequence
  continues across files, so the first ``seq`` of a file is not 1 after a rotation).

Reading is forgiving, because a trace is the durable record: a corrupt line (bad UTF-8, bad
JSON, an unknown or live-only ``type``, a missing or wrong field, or a torn final line) is
reported as a :class:`TraceLineError` naming the file and the 1-based line, and skipped;
every other line is still read. A ``seq`` that does not increase is reported but the record
is kept.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from collections.abc import Iterable
from typing import Literal

import attrs

from greenroom.protocols import converter
from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    UserContent,
)
from greenroom.protocols.outputs import Output, TokenUsageOutput
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.text import compact_json

TRACE_FILE_PATTERN = re.compile(r"trace_(\d{3,})\.jsonl")
"""Names of trace files: ``trace_`` + a number of at least three digits + ``.jsonl``."""


def trace_file_name(n: int) -> str:
    """The name of a session's ``n``-th trace file (``n`` >= 1): ``trace_001.jsonl``, …

    Numbers above 999 simply get more digits; :func:`trace_file_number` reads them back.
    Raises ValueError for ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"trace file numbers start at 1, got {n}")
    return f"trace_{n:03d}.jsonl"


def trace_file_number(name: str) -> int | None:
    """The number of a trace file name (the last path component), or None for any other name."""
    match = TRACE_FILE_PATTERN.fullmatch(name)
    if match is None:
        return None
    n = int(match.group(1))
    return n if n >= 1 else None


def encode_record(output: Output) -> str:
    """One trace line for ``output``: its converter JSON plus ``"\\n"``.

    Raises ValueError for a live-only output or an output without ``seq``: neither may reach
    a trace (R-TRACE-1), and catching that at the writer beats finding a hole when reading.
    """
    if not type(output).TRACED:
        raise ValueError(f"{type(output).TYPE!r} outputs are live-only and never traced")
    if output.seq is None:
        raise ValueError(f"a traced {type(output).TYPE!r} output needs a seq")
    return converter.to_json(output) + "\n"


IMAGE_ACCEPTANCE_BYTES = 512
"""The most bytes an image block not accepted yet (without ``sha256``) is counted to grow
by in its record once the session takes it: its hash and media type, or the line of
text saying why it was refused."""


def input_size(content: Iterable[UserContent], output_schema: object = None) -> int:
    """The bytes a client's input takes in its trace record: its blocks (and a run's
    output schema) as the record's UTF-8 JSON holds them, each image not accepted yet
    counted as accepted (:data:`IMAGE_ACCEPTANCE_BYTES`). What a trace whose records
    have a limit (a cluster's NATS server) measures input against."""
    blocks = tuple(content)
    size = record_size(blocks)
    if output_schema is not None:
        size += record_size(output_schema)
    unaccepted = sum(isinstance(b, ImageBlock) and b.sha256 is None for b in blocks)
    return size + unaccepted * IMAGE_ACCEPTANCE_BYTES


def record_size(value: object) -> int:
    """The bytes ``value`` (a protocol value, or JSON: a call's arguments) takes in a trace
    record, as the record's UTF-8 JSON holds it."""
    return len(converter.to_json(value).encode("utf-8", "backslashreplace"))


def cut_to_fit(
    text: str, most: int | None, whole_at: str | None, *, record: int | None = None
) -> str:
    """``text``, input the runtime itself gives a session (a background child's answer,
    a hook's), as one text block whose record holds at most ``most`` bytes of input
    (:func:`input_size`; None: no limit, as in a file trace): whole when it fits, else
    its start followed by a marker saying how many characters were left out and where
    the whole text is (``whole_at``; None: nowhere). A user's input is never cut: it is
    refused (:class:`~greenroom.protocols.errors.InputTooLarge`). Unlike a user's, this
    input has nobody to refuse it to, and a record the trace cannot carry stops the
    session on its host (a cluster's NATS server, R-SEC-9, R-CLUSTER-1). The marker names
    the bytes of one record: ``record`` when ``most`` is only what others leave of it."""
    if most is None or input_size((TextBlock(text=text),)) <= most:
        return text

    def kept(count: int) -> str:
        where = f"the whole text is in {whole_at}" if whole_at else "the rest is not kept"
        return (
            f"{text[:count]}\n[cut: {len(text) - count} of {len(text)} characters left out "
            f"to fit one record of this session's trace ({record or most} bytes); {where}]"
        )

    # The most characters kept whose block fits: escapes make a character's bytes vary.
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if input_size((TextBlock(text=kept(middle)),)) <= most:
            low = middle
        else:
            high = middle - 1
    return kept(low)


@attrs.frozen(kw_only=True, slots=True)
class ImagesFit:
    """What :func:`fit_images` left of a result: ``content``, its blocks in their order
    without the images left out, then ``left_out``, the line that says how many were (None:
    none was); ``text_room``, the most bytes of input (:func:`input_size`) its text, joined
    into one block, may take beside the images kept (None: its text fits as it is)."""

    content: tuple[UserContent, ...]
    left_out: TextBlock | None
    text_room: int | None


def fit_images(content: tuple[UserContent, ...], most: int) -> ImagesFit:
    """``content``, a tool's result, made to fit one record of ``most`` bytes of input
    (:func:`input_size`; a cluster's NATS server, R-SEC-9, R-CLUSTER-1) as far as its
    images go. Text and images share the record so that neither crowds the other out: each
    takes what it needs while both fit; when they do not, the text keeps what the images
    leave, at least half of the record (the caller cuts it to ``text_room``, its whole kept
    elsewhere), and the images, in order, the rest. The images past that are left out, the
    last first so that the model keeps what comes first, and ``left_out`` tells it how many
    and why."""
    texts = [b for b in content if isinstance(b, TextBlock)]
    images = [b for b in content if not isinstance(b, TextBlock)]
    # A list's JSON is its brackets and its elements, each but one after a comma: 1 byte
    # plus each element's bytes and one more.
    room = most - 1
    text_size = sum(_element_size(b) for b in texts)
    sizes = [_element_size(b) for b in images]
    images_size = sum(sizes)
    if text_size + images_size <= room:
        return ImagesFit(content=content, left_out=None, text_room=None)
    text_room = min(text_size, room // 2)
    if images_size <= room - text_room:
        return ImagesFit(content=content, left_out=None, text_room=1 + room - images_size)
    widest = _left_out(len(images), len(images), most)  # no count is longer
    image_room = room - text_room - _element_size(widest)
    kept, kept_size = 0, 0
    while kept < len(sizes) and kept_size + sizes[kept] <= image_room:
        kept_size += sizes[kept]
        kept += 1
    left_out = _left_out(len(images) - kept, len(images), most)
    blocks: list[UserContent] = []
    for block in content:
        if isinstance(block, TextBlock):
            blocks.append(block)
        elif kept > 0:
            blocks.append(block)
            kept -= 1
    left = room - kept_size - _element_size(left_out)  # for the text: at least text_room
    cut = None if text_size <= left else 1 + left
    return ImagesFit(content=tuple(blocks), left_out=left_out, text_room=cut)


def _element_size(block: UserContent) -> int:
    """The bytes ``block`` adds to a list of blocks' :func:`input_size`, its comma's too."""
    return input_size((block,)) - 1


def _left_out(count: int, of: int, most: int) -> TextBlock:
    return TextBlock(
        text=f"[images cut: {count} of {of} images left out, the last ones, to fit one "
        f"record of this session's trace ({most} bytes)]"
    )


_MOST_BYTES_A_CHARACTER = 6
"""The most bytes a character takes in a record's UTF-8 JSON: an escape (``\\u001f``)."""


def fit_model_block(block: ModelBlock, most: int) -> tuple[ModelBlock, ...] | str:
    """``block``, one complete block of the model's message, as the blocks of that message
    that records of at most ``most`` bytes (:func:`record_size`; a cluster's NATS server,
    R-SEC-9, R-CLUSTER-1) hold: itself when it fits. Text (or thinking with no signature,
    which no provider needs back byte for byte) too large for one is split at line breaks
    into several blocks, each within a record and none blank, which joined by line breaks
    — as every reader of a message's text blocks joins them, and every codec sends
    adjacent text blocks of the model's as one text — are the whole text again. The pieces
    carry no line break of their own: a message's text reads the same split or not.
    Anything else, or a line longer than a record, cannot be
    recorded: the sentence returned says so, naming its size and the limit. A tool call is
    never cut or split: one that runs must be recorded as the model made it."""
    if type(block) is TextBlock and len(block.text) * _MOST_BYTES_A_CHARACTER < most - 64:
        return (block,)  # the common case, measured without encoding it
    size = record_size(block)
    if size <= most:
        return (block,)
    if type(block) is TextBlock or (
        isinstance(block, ThinkingBlock) and block.signature is None and block.item_id is None
    ):
        room = most - record_size(attrs.evolve(block, text=""))
        pieces = _split_at_lines(block.text, room)
        if pieces is not None:
            return tuple(attrs.evolve(block, text=piece) for piece in pieces)
    if isinstance(block, ToolCallBlock):
        what = f"call of {block.name}"
    elif isinstance(block, RedactedThinkingBlock):
        what = "redacted thinking"
    else:
        what = block.TYPE
    return (
        f"the model's {what} takes {size} bytes in the trace, more than the {most} bytes "
        "one record of this session's trace carries"
    )


def fit_partial(
    partial: tuple[ModelBlock, ...], most: int, beside: int = 0
) -> tuple[ModelBlock, ...]:
    """``partial``, what an interrupted model message said (an ``abort``'s ``partial``,
    the carry-over of R-ABORT-2), as blocks one record of ``most`` bytes holds
    (:func:`record_size`; a cluster's NATS server, R-SEC-9, R-CLUSTER-1) beside the
    ``beside`` bytes the rest of the record (the ``abort``) takes: whole when it fits.
    Each of its blocks fits a record, recorded as the model made it, but together they may
    not. Its thinking goes first (the carry-over shows none); then its text and calls are
    kept in order while they fit, a text that does not is cut, a call that does not is
    left out, and a last text block says how many were left out or cut. That marker and a
    cut text's both name the record's ``most`` bytes, whatever room the rest left."""
    if record_size(partial) <= most - beside:
        return partial
    total = len(partial)
    # The brackets, and the marker's block with its comma (no count is longer than total).
    marker = TextBlock(text=_partial_marker(total, total, most))
    room = most - beside - 2 - record_size(marker) - 1
    kept: list[ModelBlock] = []
    whole = 0
    for block in partial:
        if isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue  # never shown again (markers.render_partial): it takes no room
        size = record_size(block) + 1
        if size <= room:
            kept.append(block)
            room -= size
            whole += 1
        elif type(block) is TextBlock:
            # cut_to_fit measures a list of the one block: its brackets for our comma.
            text = cut_to_fit(block.text, max(room - 1, 0), None, record=most)
            if (size := record_size(TextBlock(text=text)) + 1) <= room:
                kept.append(TextBlock(text=text))
                room -= size
    return (*kept, TextBlock(text=_partial_marker(total - whole, total, most)))


def _partial_marker(left_out: int, total: int, most: int) -> str:
    return (
        f"[cut: {left_out} of {total} blocks of the interrupted message left out or cut to "
        f"fit one record of this session's trace ({most} bytes)]"
    )


def _split_at_lines(text: str, room: int) -> list[str] | None:
    """``text`` in pieces of whole lines, each taking at most ``room`` bytes in a record's
    JSON string, the line breaks between pieces left out, and none blank: providers refuse
    a text block of whitespace alone (Anthropic), and a reader that skips empty blocks
    would lose its line breaks. None when there are no such pieces: a line alone is
    larger, or blank lines find no room beside a line of text."""
    lines = text.split("\n")
    count = len(lines)
    # A string's JSON is its characters', each escaped alone: the quotes aside, a piece
    # takes its lines' bytes and two (\\n) for each line break between them. ``taken[i]``:
    # the bytes of lines[:i], each with a line break.
    taken = [0]
    for line in lines:
        taken.append(taken[-1] + len(compact_json(line).encode("utf-8", "backslashreplace")))
    # next_text[i]: the first line from i on that is not blank (count: none).
    next_text = [count] * (count + 1)
    for i in range(count - 1, -1, -1):
        next_text[i] = i if lines[i].strip() else next_text[i + 1]
    # farthest[i]: the line a piece from line i ends at, at the latest (exclusive).
    farthest = [0] * count
    end = 0
    for i in range(count):
        end = max(end, i + 1)
        while end < count and taken[end + 1] - taken[i] - 2 <= room:
            end += 1
        if taken[end] - taken[i] - 2 > room:
            return None  # a line alone is larger
        farthest[i] = end
    # A piece from line i ends after its first line of text and within the room; the
    # rest can be pieces too when it ends at a line the same holds for. ``rest[i]``: the
    # lines from i on (and the text's end) that the rest of the text can start at.
    rest = [0] * (count + 2)
    rest[count] = 1
    for i in range(count - 1, -1, -1):
        low, high = next_text[i] + 1, farthest[i]
        rest[i] = rest[i + 1] + (low <= high and rest[low] > rest[high + 1])
    if rest[0] == rest[1]:
        return None
    pieces: list[str] = []
    start = 0
    while start < count:  # each piece as long as the rest allows: few records
        end = farthest[start]
        while rest[end] == rest[end + 1]:
            end -= 1
        pieces.append("\n".join(lines[start:end]))
        start = end
    return pieces


@attrs.frozen(kw_only=True, slots=True)
class CopiedTrace:
    """What :func:`copy_records` took from one trace file: ``data``, the lines it keeps
    (each a whole record, moved to the new session), and the ``seq`` of the file's first
    and last complete records (None for a file without any)."""

    data: bytes
    first_seq: int | None
    last_seq: int | None


def copy_records(
    data: bytes, *, source_id: str, session_id: str, through_seq: int
) -> CopiedTrace:
    """The records of one trace file (its bytes) with ``seq <= through_seq``, each moved
    from session ``source_id`` to ``session_id``, as the lines of a trace file of that
    session (a fork: R-FORK-1). No record is decoded: a file whose lines are in the shape
    :func:`encode_record` writes is cut and renamed in whole-file passes (regular
    expressions, a replace), so a fork costs about what reading and writing its bytes
    costs; any other file is copied line by line, a line of another shape decoded and
    encoded again.
    A torn final line (no newline) is left out; a line whose ``seq`` cannot be found is
    dropped (it would not be read either)."""
    old = b'"session_id":' + json.dumps(source_id, ensure_ascii=False).encode()
    new = b'"session_id":' + json.dumps(session_id, ensure_ascii=False).encode()
    complete = data[: data.rfind(b"\n") + 1]
    ends = list(_ENVELOPE_END.finditer(complete))
    if len(ends) == complete.count(b"\n"):  # every line ends as encode_record ends it
        seqs = [int(m.group(1)) for m in ends]
        if all(a < b for a, b in itertools.pairwise(seqs)):
            kept = bisect.bisect_right(seqs, through_seq)
            prefix = complete[: ends[kept - 1].end()] if kept else b""
            # Each kept line starts with the envelope naming the source, and the source's
            # id appears nowhere else: then replacing every occurrence renames exactly the
            # envelopes (an id inside a tool's arguments sends the file line by line).
            starts = re.compile(rb'\n\{"type":"[a-z_]+",' + re.escape(old))
            if len(starts.findall(b"\n" + prefix)) == kept == prefix.count(old):
                first, last = (seqs[0], seqs[-1]) if seqs else (None, None)
                return CopiedTrace(data=prefix.replace(old, new), first_seq=first, last_seq=last)
    return _copy_line_by_line(complete, old, new, session_id, through_seq)


MAX_SEQ_DIGITS = 19
"""The most digits a trace line's ``seq`` may have (any 64-bit count fits): a line with a
longer one is damaged, read like any line that cannot be read, never turned into an
integer (past 4,300 digits, Python refuses to)."""
_SEQ_BOUND = 10**MAX_SEQ_DIGITS

_ENVELOPE_END = re.compile(
    rb'"seq":(\d{1,%d})(?:,"origin":\[[^\]\n]*\])?\}\n' % MAX_SEQ_DIGITS
)
"""The end of a line :func:`encode_record` wrote: the envelope's ``seq`` (then ``origin``)
closes it. A ``"seq"`` inside a record's fields is followed by more of the record, never by
the line's end."""


def _copy_line_by_line(
    complete: bytes, old: bytes, new: bytes, session_id: str, through_seq: int
) -> CopiedTrace:
    kept: list[bytes] = []
    first: int | None = None
    last: int | None = None
    for line in complete.split(b"\n")[:-1]:
        seq = record_seq(line)
        if seq is None:
            continue
        first = seq if first is None else first
        last = seq
        if seq <= through_seq:
            kept.append(_moved(line, old, new, session_id) + b"\n")
    return CopiedTrace(data=b"".join(kept), first_seq=first, last_seq=last)


_SEQ_KEY = b'"seq":'


def record_seq(line: bytes) -> int | None:
    """The ``seq`` of one trace line (without its newline), or None when it has none or
    one of more than :data:`MAX_SEQ_DIGITS` digits (a damaged line). Never raises.

    :func:`encode_record` puts the envelope's ``seq`` after every field of the record, only
    ``origin`` (a list of ids) after it, so its last ``"seq":`` key is the envelope's: read
    without decoding the line. Anything else is decoded."""
    at = line.rfind(_SEQ_KEY)
    if at != -1:
        end = start = at + len(_SEQ_KEY)
        while end < len(line) and 48 <= line[end] <= 57:
            end += 1
        if end > start and line[end : end + 1] in (b"}", b","):
            tail = line[end:]
            if tail == b"}" or tail.startswith(b',"origin":'):
                return int(line[start:end]) if end - start <= MAX_SEQ_DIGITS else None
    try:
        value = json.loads(line)
    except ValueError:  # also an integer past Python's 4,300 digits
        return None
    seq = value.get("seq") if isinstance(value, dict) else None
    if isinstance(seq, int) and not isinstance(seq, bool) and abs(seq) < _SEQ_BOUND:
        return seq
    return None


def _moved(line: bytes, old: bytes, new: bytes, session_id: str) -> bytes:
    """``line`` with its envelope's ``session_id`` replaced: in place where it stands
    right after ``type`` (as :func:`encode_record` writes it), else decoded and encoded
    again (so a ``"session_id"`` inside a tool's arguments is never touched)."""
    if line.startswith(b'{"type":"'):
        after_type = line.find(b'",', 9) + 2
        if line.startswith(old, after_type):
            return line[:after_type] + new + line[after_type + len(old) :]
    try:
        value = json.loads(line)
    except ValueError:
        return line
    if isinstance(value, dict):
        value["session_id"] = session_id
    return compact_json(value).encode()


@attrs.frozen(kw_only=True, slots=True)
class TraceLineError:
    """A problem found at one line of one trace file (``line`` is 1-based)."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@attrs.frozen(kw_only=True, slots=True)
class TraceReadResult:
    """Everything readable in a trace file, in file order, and what was wrong with the rest."""

    records: list[Output]
    errors: list[TraceLineError]


def parse_trace(data: str | bytes, *, file: str) -> TraceReadResult:
    """Read the records of one trace file; never raises for bad content.

    ``data`` is the whole file. Given bytes, each line is decoded as UTF-8 on its own, so a
    torn multi-byte character spoils only its line. ``file`` only names the file in errors.
    Blank lines carry no record and are skipped silently.
    """
    # Split on "\n" only: with ensure_ascii=False a record may hold U+2028 and friends, which
    # str.splitlines would treat as line ends. The part after the last "\n" is the torn tail.
    lines: list[str | bytes] = [
        *(data.split("\n") if isinstance(data, str) else data.split(b"\n"))
    ]
    records: list[Output] = []
    errors: list[TraceLineError] = []
    last_seq: int | None = None
    last_index = len(lines) - 1
    for number, raw in enumerate(lines, start=1):
        torn = number - 1 == last_index
        try:
            text = raw if isinstance(raw, str) else raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(_line_error(file, number, f"invalid UTF-8: {exc.reason}", torn))
            continue
        if not text.strip():
            continue
        try:
            record = _parse_record(text)
        except _BadRecord as exc:
            errors.append(_line_error(file, number, str(exc), torn))
            continue
        records.append(record)
        seq = record.seq
        if seq is None:
            errors.append(TraceLineError(file=file, line=number, message="record has no seq"))
        elif last_seq is not None and seq <= last_seq:
            errors.append(
                TraceLineError(
                    file=file,
                    line=number,
                    message=f"seq {seq} does not increase (previous record has seq {last_seq})",
                )
            )
        if seq is not None:
            last_seq = seq if last_seq is None else max(last_seq, seq)
    return TraceReadResult(records=records, errors=errors)


class _BadRecord(Exception):
    pass


def _parse_record(text: str) -> Output:
    try:
        data = json.loads(text)
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # not Python's advice on its limit
            raise _BadRecord("invalid JSON: an integer of more than 4300 digits") from None
        raise _BadRecord(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadRecord(f"expected a JSON object, got {type(data).__name__}")
    seq = data.get("seq")
    if isinstance(seq, int) and abs(seq) >= _SEQ_BOUND:
        # As record_seq reads it: a fork drops the line, so loading must not keep it.
        raise _BadRecord(f"seq of more than {MAX_SEQ_DIGITS} digits")
    tag = data.get("type")
    cls = converter.OUTPUT_BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise _BadRecord(f"unknown type {tag!r}")
    if not cls.TRACED:
        raise _BadRecord(f"{tag!r} is a live-only output and is never traced")
    try:
        return converter.output_from_dict(data)
    except Exception as exc:
        # cattrs raises a zoo of errors (ClassValidationError, KeyError, TypeError, ...);
        # any of them means this line is not a record we can use.
        raise _BadRecord(f"invalid {tag!r} record: {converter.describe_error(exc)}") from None


def _line_error(file: str, number: int, message: str, torn: bool) -> TraceLineError:
    if torn:
        message = f"torn final line (no newline; a write cut short at a crash?): {message}"
    return TraceLineError(file=file, line=number, message=message)


UsageKind = Literal["request", "compaction_failed", "title"]

STARTED = "started"
"""The ``status`` of a request's usage row written as its stream began (see
:class:`UsageRow`)."""


@attrs.frozen(kw_only=True, slots=True)
class UsageRow:
    """One row of the host's usage ledger (R-TRACE-5): the raw data for cost reports.

    ``kind`` is ``request`` for every ``token_usage`` of a task or compaction request,
    ``compaction_failed`` for a compaction that ended ``failed`` (R-COMPACT-7) and ``title``
    for a :meth:`Session.generate_title` call. ``at`` is unix time in seconds, given by the
    caller (this module reads no clock). ``status`` and ``error_message`` are free text.
    ``usage.cost_usd`` is the request's cost (None: the model's price is unknown, or a row
    written before costs were computed); ``principal`` the gateway client the session
    belongs to (None outside the gateway); ``root_id`` the root of the session's tree
    (R-TREE-1; None in rows written before it was recorded). ``request_key`` names one
    request's row: a row with the key of one already in the ledger replaces it — a
    streamed request's row is written as its stream begins (``status`` ``started``, the
    usage reported then) and replaced by its usage at its end, so a host that dies between
    the two leaves the request counted at its start (R-SHARE-3). None: a row of its own.
    ``estimated``: the usage is the runtime's estimate of the request's input, not what
    the provider reported (a provider that reports usage only at a stream's end, whose
    stream was cut or is under way).
    """

    at: float
    session_id: str
    run_id: str | None
    turn: int | None
    kind: UsageKind
    provider: str
    model: str
    usage: TokenUsage = attrs.field(factory=TokenUsage)
    status: str | None = None
    error_message: str | None = None
    principal: str | None = None
    root_id: str | None = None
    request_key: str | None = None
    estimated: bool = False

    @classmethod
    def for_request(
        cls, output: TokenUsageOutput, *, at: float, provider: str, model: str
    ) -> UsageRow:
        """The ledger row for a traced ``token_usage`` output."""
        return cls(
            at=at,
            session_id=output.session_id,
            run_id=output.run_id,
            turn=output.turn,
            kind="request",
            provider=provider,
            model=model,
            usage=output.request,
        )


UsageGrouping = Literal["session", "principal", "model"]
"""What a usage report adds up by: each session, each principal, or each model."""


@attrs.frozen(kw_only=True, slots=True)
class UsageQuery:
    """Which ledger rows a report covers and how it groups them (every filter optional).

    ``since`` (inclusive) and ``until`` (exclusive) bound ``at`` (unix seconds);
    ``principal`` keeps that principal's rows; ``tree`` keeps the rows of that session and
    of every session whose root it is (a root's whole tree; a subagent's own rows). ``by``
    groups the lines (None: one line for everything, even when no row matches)."""

    since: float | None = None
    until: float | None = None
    principal: str | None = None
    tree: str | None = None
    by: UsageGrouping | None = "session"

    def matches(self, row: UsageRow) -> bool:
        """Whether ``row`` is one the report covers."""
        return (
            (self.since is None or row.at >= self.since)
            and (self.until is None or row.at < self.until)
            and (self.principal is None or row.principal == self.principal)
            and (self.tree is None or self.tree in (row.session_id, row.root_id))
        )

    def key_of(self, row: UsageRow) -> str | None:
        """The group ``row`` is added to (None: no principal, or no grouping)."""
        if self.by == "session":
            return row.session_id
        if self.by == "principal":
            return row.principal
        if self.by == "model":
            return row.model
        return None


@attrs.frozen(kw_only=True, slots=True)
class UsageLine:
    """One group of a usage report: its ``key`` (a session id, a principal, a model; None
    for rows without a principal, or for an ungrouped report), how many model ``requests``
    it holds (``request`` and ``title`` rows), their tokens, and their cost: ``cost_usd``
    adds up the priced requests, ``unpriced`` counts the others (their price was unknown),
    so the cost is complete only when ``unpriced`` is 0."""

    key: str | None
    requests: int = 0
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    total: int = 0
    cost_usd: float = 0.0
    unpriced: int = 0


def summarize_usage(rows: Iterable[UsageRow], query: UsageQuery) -> list[UsageLine]:
    """The report of ``query`` over ``rows``: one line per group, sorted by key (None
    first). What every ledger answers for :meth:`UsageLedger.report` (a SQL backend adds
    up in SQL; the conformance suite checks they agree)."""
    sums: dict[str | None, list[float]] = {}
    if query.by is None:
        sums[None] = [0.0] * 8
    for row in rows:
        if not query.matches(row):
            continue
        entry = sums.setdefault(query.key_of(row), [0.0] * 8)
        usage = row.usage
        request = row.kind != "compaction_failed"
        entry[0] += request
        entry[1] += usage.input
        entry[2] += usage.output
        entry[3] += usage.cache_read
        entry[4] += usage.cache_write
        entry[5] += usage.total
        if usage.cost_usd is not None:
            entry[6] += usage.cost_usd
        elif request:
            entry[7] += 1
    return [
        UsageLine(
            key=key,
            requests=int(s[0]),
            input=int(s[1]),
            output=int(s[2]),
            cache_read=int(s[3]),
            cache_write=int(s[4]),
            total=int(s[5]),
            cost_usd=s[6],
            unpriced=int(s[7]),
        )
        for key, s in sorted(sums.items(), key=lambda item: (item[0] is not None, item[0] or ""))
    ]
