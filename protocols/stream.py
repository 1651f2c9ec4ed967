"""Typed stream events: what every provider codec turns its wire format into.

The supervisor consumes only these, so it never sees a provider's format. A codec emits,
for one response, in stream order:

* ``BlockStarted`` when a content block opens, then its deltas (``TextDelta``,
  ``ThinkingDelta``, ``ToolArgumentsDelta``);
* ``BlockCompleted`` with the finished block once it is certain to be complete (a tool
  call whose generation was cut by the output-token limit is reported as
  ``ToolCallTruncated`` instead and must never run: R-TOOL-5);
* ``UsageReported`` whenever cumulative usage changes;
* exactly one terminal event: ``MessageCompleted`` (the stream ended properly) or
  ``StreamFailed`` (classified error: R-RETRY-1).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from greenroom.protocols.content import ModelBlock

ErrorKind = Literal["auth", "timeout", "malformed", "failed", "context_overflow"]
"""Classification of a model-side failure (R-RETRY-1)."""

BlockKind = Literal["text", "thinking", "redacted_thinking", "tool_call"]


MAX_TOOL_CALLS = 1000
"""The most tool calls one model message may make; a message with more is a malformed
attempt. Models make a few, rarely dozens; each call costs the runtime work in proportion to
the calls before it, so a stream of hundreds of thousands would hold the session for hours."""

MAX_TOKEN_COUNT = 10**15
"""The largest token count a provider's report is taken at: far beyond any context, and
small enough that its cost is a finite float."""


def token_count(value: Any) -> int | None:
    """A token count as a provider reported it, fit for pricing and budgets: a whole
    number of at least 0 (one past :data:`MAX_TOKEN_COUNT` counts as that), else None (the
    report is ignored). A negative count would price a request below zero and give its
    cost back to every budget it was spent against; a count too large for a float would
    fail the pricing (R-SHARE-3)."""
    if value.__class__ is not int or value < 0:
        return None
    return value if value <= MAX_TOKEN_COUNT else MAX_TOKEN_COUNT


@attrs.frozen(kw_only=True, slots=True)
class TokenUsage:
    """Token counts of one request (cumulative within the request), and what they cost.

    ``total`` is the size of the context the request occupied: every input token (fresh,
    cache read, cache write) plus the output. It is what compaction compares with
    ``max_context_length`` (R-COMPACT-2).

    ``cost_usd`` is what the tokens cost in USD at the model's price (R-SHARE-3,
    :mod:`greenroom.protocols.prices`); None when the price is unknown. Codecs report
    tokens only: the runtime prices a request's usage before it is emitted. A sum is
    None as soon as one of its terms is (a partial sum would understate the cost).
    """

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    cost_usd: float | None = None

    @property
    def total(self) -> int:
        """Every token of the request: fresh input, cache reads and writes, and output."""
        return self.input + self.output + self.cache_read + self.cache_write

    def __add__(self, other: TokenUsage) -> TokenUsage:
        cost, more = self.cost_usd, other.cost_usd
        return TokenUsage(
            input=self.input + other.input,
            output=self.output + other.output,
            cache_read=self.cache_read + other.cache_read,
            cache_write=self.cache_write + other.cache_write,
            cost_usd=None if cost is None or more is None else cost + more,
        )


@attrs.frozen(kw_only=True, slots=True)
class ModelError:
    """A classified model-side failure. Errors are data between actors.

    ``permanent`` marks a ``failed`` error the provider says no repetition of the same
    request can cure (unknown model, a request it rejects as invalid, a request too large,
    an exhausted quota): the turn ends at once instead of spending its retries (R-RETRY-2)."""

    kind: ErrorKind
    message: str
    status_code: int | None = None
    retry_after_s: float | None = None
    permanent: bool = False


@attrs.frozen(kw_only=True, slots=True)
class BlockStarted:
    """Block ``index`` of the response began; ``call_id`` and ``name`` are set for a
    ``tool_call`` block."""

    index: int
    kind: BlockKind
    call_id: str | None = None
    name: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class TextDelta:
    """More text of block ``index``."""

    index: int
    text: str


_set_delta_index = TextDelta.__dict__["index"].__set__
_set_delta_text = TextDelta.__dict__["text"].__set__


def text_delta(index: int, text: str) -> TextDelta:
    """``TextDelta(index=..., text=...)`` for a decoder's hot path, one per streamed
    token: the same object, made without attrs' ``__init__`` (see ``partial_text``)."""
    out = object.__new__(TextDelta)
    _set_delta_index(out, index)
    _set_delta_text(out, text)
    return out


@attrs.frozen(kw_only=True, slots=True)
class ThinkingDelta:
    """More thinking text of block ``index``."""

    index: int
    text: str


@attrs.frozen(kw_only=True, slots=True)
class ToolArgumentsDelta:
    """More of the arguments of tool call ``call_id`` (block ``index``) as raw JSON text, not yet
    parseable on its own; the parsed call arrives with :class:`BlockCompleted`."""

    index: int
    call_id: str
    name: str
    delta: str


@attrs.frozen(kw_only=True, slots=True)
class BlockCompleted:
    """Block ``index`` is complete; ``block`` is the whole block as it enters the transcript."""

    index: int
    block: ModelBlock


@attrs.frozen(kw_only=True, slots=True)
class ToolCallTruncated:
    """A tool call cut off by the output-token limit: never executed (R-TOOL-5)."""

    index: int
    call_id: str
    name: str
    partial_arguments: str


@attrs.frozen(kw_only=True, slots=True)
class UsageReported:
    """The request's token counts so far: cumulative, so each report replaces the last."""

    usage: TokenUsage


@attrs.frozen(kw_only=True, slots=True)
class MessageCompleted:
    """The response ended properly. ``stop_reason`` is normalised to one of
    ``end_turn``, ``tool_use``, ``max_tokens``, ``stop_sequence``, ``refusal``,
    ``pause_turn`` or the provider's own word when unknown. ``response_id`` is the id the
    provider gave the response (OpenAI's ``chatcmpl-…`` or ``resp_…``, Anthropic's
    ``msg_…``), None when it gave none. ``response_model`` is the model the provider says
    answered (often a dated snapshot of the one requested), None when it named none."""

    stop_reason: str
    usage: TokenUsage
    response_id: str | None = None
    response_model: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class StreamFailed:
    """The request failed, classified in ``error``; no event of the request follows it."""

    error: ModelError


StreamEvent = (
    BlockStarted
    | TextDelta
    | ThinkingDelta
    | ToolArgumentsDelta
    | BlockCompleted
    | ToolCallTruncated
    | UsageReported
    | MessageCompleted
    | StreamFailed
)


_Delta = TextDelta | ThinkingDelta | ToolArgumentsDelta


def coalesce_deltas(events: list[StreamEvent]) -> list[StreamEvent]:
    """The events one network read decoded to, each run of deltas of one block joined into
    one delta. The text is the same and in the same order; what changes is the number of
    ``partial_*`` outputs (R-RUN-2: a partial chunk is what arrived of a block at once),
    and with it the work of every layer above and every reader's loop. ``events`` itself
    when nothing joins, as on a paced stream read one delta at a time."""
    if len(events) < 2:
        return events
    joined: list[StreamEvent] = []
    head: _Delta | None = None
    pieces: list[str] = []
    for event in events:
        if isinstance(event, (TextDelta, ThinkingDelta, ToolArgumentsDelta)):
            if head is not None and head.__class__ is event.__class__ and head.index == event.index:
                pieces.append(_delta_piece(event))
                continue
            _end_run(joined, head, pieces)
            head = event
            pieces = [_delta_piece(event)]
        else:
            _end_run(joined, head, pieces)
            head = None
        joined.append(event)
    _end_run(joined, head, pieces)
    return events if len(joined) == len(events) else joined


def _delta_piece(delta: _Delta) -> str:
    return delta.delta if isinstance(delta, ToolArgumentsDelta) else delta.text


def _end_run(joined: list[StreamEvent], head: _Delta | None, pieces: list[str]) -> None:
    """Put the run that ``head`` began, if it took more than one delta, in its place."""
    if head is None or len(pieces) < 2:
        return
    whole = "".join(pieces)
    if isinstance(head, TextDelta):
        joined[-1] = text_delta(head.index, whole)
    elif isinstance(head, ThinkingDelta):
        joined[-1] = ThinkingDelta(index=head.index, text=whole)
    else:
        joined[-1] = attrs.evolve(head, delta=whole)


class ResponseCollector:
    """One whole response gathered from its stream events, for the requests whose deltas
    nobody watches (compaction summaries, titles): its completed blocks, its text, its
    last usage, and how it ended. Feed it every batch; :attr:`done` once the terminal
    event came (later events are ignored)."""

    __slots__ = ("blocks", "done", "error", "texts", "usage")

    def __init__(self) -> None:
        self.blocks: list[ModelBlock] = []
        self.texts: list[str] = []
        self.usage: TokenUsage | None = None
        self.error: ModelError | None = None
        self.done = False

    def feed(self, events: list[StreamEvent]) -> bool:
        """Take one batch; returns :attr:`done`."""
        for event in events:
            if self.done:
                break
            if isinstance(event, TextDelta):
                self.texts.append(event.text)
            elif isinstance(event, BlockCompleted):
                self.blocks.append(event.block)
            elif isinstance(event, UsageReported):
                self.usage = event.usage
            elif isinstance(event, MessageCompleted):
                self.usage = event.usage
                self.done = True
            elif isinstance(event, StreamFailed):
                self.error = event.error
                self.done = True
        return self.done

    @property
    def text(self) -> str:
        """The streamed text, every text delta joined."""
        return "".join(self.texts)
