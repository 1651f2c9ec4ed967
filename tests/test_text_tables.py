"""``greenroom.protocols.tables``: Markdown tables in streamed text laid out for a terminal,
whatever the chunks the text arrives in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from greenroom.protocols.tables import TableLayout, display_width, layout

ANSWER = (
    "Totals:\n"
    "| a | long header |\n"
    "|--:|:-:|\n"
    "| 1 | x |\n"
    "| 22 | \\| escaped |\n"
    "after\n"
)
SHOWN = (
    "Totals:\n"
    "|  a | long header |\n"
    "|----|-------------|\n"
    "|  1 |      x      |\n"
    "| 22 | \\| escaped  |\n"
    "after\n"
)


def through(chunks: list[str]) -> str:
    tables = TableLayout()
    return "".join(tables.feed(chunk) for chunk in chunks) + tables.finish()


def test_a_table_is_aligned_right_centred_and_left_as_its_delimiter_row_says() -> None:
    assert through([ANSWER]) == SHOWN


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(ANSWER)), max_size=12))
def test_any_chunking_gives_the_same_text(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [ANSWER[a:b] for a, b in zip([0, *points], [*points, len(ANSWER)], strict=True)]
    assert through(chunks) == SHOWN


def test_text_passes_through_at_once_and_rows_wait_for_the_table_to_end() -> None:
    tables = TableLayout()
    assert tables.feed("Totals: ") == "Totals: "  # nothing held outside a table
    assert tables.feed("here\n| a |") == "here\n"
    assert tables.holding
    assert tables.feed(" b |\n|---|---|\n| 1 | 2 |\n") == ""
    assert tables.feed("no") == "| a | b |\n|---|---|\n| 1 | 2 |\nno"
    assert not tables.holding


def test_what_is_not_a_table_comes_out_as_it_was() -> None:
    for text in (
        "| just one line |",
        "| a | b |\n| no delimiter |\n",
        "a | b\n|---|---|\n",  # the header does not start with a bar
        "   | indented | row |\n\nnext",
    ):
        assert through([text]) == text


def test_a_table_cut_off_mid_row_is_laid_out_with_what_came() -> None:
    assert through(["| a | b |\n|---|---|\n| 1 | 22"]) == (
        "| a | b  |\n|---|----|\n| 1 | 22 |"
    )


def test_rows_with_missing_or_extra_cells_are_padded() -> None:
    assert layout(["| a | b |", "|---|---|", "| 1 |", "| 1 | 2 | 3 |"]) == [
        "| a | b |   |",
        "|---|---|---|",
        "| 1 |   |   |",
        "| 1 | 2 | 3 |",
    ]


def test_wide_characters_take_two_columns() -> None:
    assert display_width("北京") == 4
    assert display_width("e\u0301") == 1  # a combining accent takes none
    assert layout(["| 名前 | n |", "|---|---|", "| ab | 1 |"]) == [
        "| 名前 | n |",
        "|------|---|",
        "| ab   | 1 |",
    ]
