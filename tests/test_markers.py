"""The summary-extraction ladder of R-COMPACT-4 and the marker helpers (pure functions)."""

from __future__ import annotations

import pytest

from greenroom.protocols import markers
from greenroom.protocols.compaction import judge, summary_message
from greenroom.protocols.content import TextBlock
from greenroom.protocols.markers import extract_summary, unwrap, wrap


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        # 1. the first non-empty [summary] pair wins, surrounding chatter is ignored
        ("Sure.\n[summary]Goal: ship it.[/summary]\nBye", "Goal: ship it."),
        ("[summary] first [/summary] and [summary]second[/summary]", "first"),
        # empty pairs are skipped until a non-empty one
        (
            "[summary][/summary][summary]  \n [/summary][summary]the real one[/summary]",
            "the real one",
        ),
        # multi-line bodies are kept whole (trimmed)
        ("[summary]\nline 1\nline 2\n[/summary]", "line 1\nline 2"),
        # 2. every pair empty: the text left after stripping the tags
        ("Notes before [summary][/summary] notes after", "Notes before  notes after"),
        ("[summary]   [/summary]", ""),
        # a stray unpaired tag is stripped too
        ("[summary]unclosed summary text", "unclosed summary text"),
        ("all of it[/summary]", "all of it"),
        # 3. no tags at all: the whole output
        ("  Just a plain summary.\nSecond line.  ", "Just a plain summary.\nSecond line."),
        # legacy angle-bracket tags are recognised when reading
        ("<summary>legacy body</summary>", "legacy body"),
        ("<summary></summary>[summary]new style[/summary]", "new style"),
        ("<summary> </summary> rest", "rest"),
        # 4. nothing at all: empty
        ("", ""),
        ("   \n\t ", ""),
    ],
    ids=[
        "first-pair",
        "first-of-two",
        "skip-empty-pairs",
        "multiline",
        "all-empty-keeps-rest",
        "only-empty-pair",
        "unpaired-open",
        "unpaired-close",
        "no-tags",
        "legacy",
        "legacy-empty-then-new",
        "legacy-all-empty",
        "empty",
        "blank",
    ],
)
def test_extraction_ladder(output: str, expected: str) -> None:
    """R-COMPACT-4: first non-empty pair; all pairs empty → the text left after stripping
    the tags; no tags → the whole output; legacy <summary> tags; empty → ""."""
    assert extract_summary(output) == expected


def test_wrap_and_unwrap_round_trip_with_legacy_form() -> None:
    """System markers are written [tag]…[/tag]; reading accepts <tag>…</tag> too."""
    assert wrap(markers.CONTEXT_SUMMARY, "x") == "[context_summary]x[/context_summary]"
    assert unwrap(markers.CONTEXT_SUMMARY, "a [context_summary]body[/context_summary] b") == "body"
    assert unwrap(markers.CONTEXT_SUMMARY, "<context_summary>old</context_summary>") == "old"
    assert unwrap(markers.CONTEXT_SUMMARY, "no marker here") is None


def test_summary_message_is_one_marked_user_text() -> None:
    """R-COMPACT-3: the first message of the fresh context."""
    message = summary_message("the gist")
    assert message.content == (TextBlock(text="[context_summary]the gist[/context_summary]"),)


def test_judge_accepts_a_valid_summary_and_rejects_an_empty_one() -> None:
    """R-COMPACT-6 on the pure verdict: a valid summary has no repair; an empty one is an
    error whose repair keeps the response (history is only appended to)."""
    ok = judge((TextBlock(text="[summary]done[/summary]"),))
    assert ok.summary == "done" and ok.error is None and ok.repair == ()
    empty = judge((TextBlock(text="[summary] [/summary]"),))
    assert empty.summary is None and empty.error == "the summary was empty"
    assert len(empty.repair) == 1
    nothing = judge(())
    assert nothing.summary is None and nothing.repair == ()
