"""Markdown tables in streamed text, laid out for a terminal.

Models answer with Markdown tables whose columns are not aligned (``| South | 6 |``); a
terminal shows them as they come, ragged. :class:`TableLayout` sits between the streamed
text and the screen: text passes through as it arrives, except lines that start with
``|``, which are held until the block of such lines ends (a line that does not start with
``|``, or the end of the text). A held block with a header and a delimiter row
(``|---|--:|``) comes out with its columns padded to one width each, numbers aligned as the
delimiter row says, and a rule under the header::

    | Region | Units |  Revenue |
    |--------|-------|----------|
    | South  |    52 | 2,212.24 |

Anything else that was held comes out as it was. The layout is still Markdown.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Literal

_DELIMITER_CELL = re.compile(r":?-+:?")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")

Align = Literal["left", "right", "center"]


class TableLayout:
    """A filter for one stream of text: :meth:`feed` takes each chunk and returns what can
    be shown now; :meth:`finish` returns what is still held (call it when the text ends or
    is cut off). ``holding`` says whether anything is held."""

    def __init__(self) -> None:
        self._rows: list[str] = []  # complete lines of the block being held
        self._line = ""  # the current line, held while it may be a table row
        self._deciding = False  # the current line has only blanks so far
        self._in_row = False  # the current line starts with "|"
        self._at_line_start = True

    @property
    def holding(self) -> bool:
        """Whether text is held back (a table, or what may be one, is being written)."""
        return bool(self._rows or self._line)

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held before it) that can be shown now."""
        out: list[str] = []
        for piece in re.split(r"(\n)", text):
            if piece == "\n":
                self._end_line(out)
            elif piece:
                self._add(piece, out)
        return "".join(out)

    def finish(self) -> str:
        """Everything still held, the table laid out: the text has ended here."""
        out: list[str] = []
        if self._in_row:  # a last row without its newline
            self._rows.append(self._line)
            self._line = ""
            self._in_row = False
            self._release(out, trailing_newline=False)
        else:
            self._release(out, trailing_newline=True)
        out.append(self._line)
        self._line = ""
        self._deciding = False
        self._at_line_start = True
        return "".join(out)

    def _add(self, piece: str, out: list[str]) -> None:
        if self._in_row:
            self._line += piece
            return
        if self._at_line_start:
            self._at_line_start = False
            self._deciding = True
        if not self._deciding:
            out.append(piece)
            return
        self._line += piece
        stripped = self._line.lstrip()
        if not stripped:
            return  # only blanks yet: the line may still be a row
        self._deciding = False
        if stripped.startswith("|"):
            self._in_row = True
            return
        self._release(out, trailing_newline=True)
        out.append(self._line)
        self._line = ""

    def _end_line(self, out: list[str]) -> None:
        if self._in_row:
            self._rows.append(self._line)
        else:
            self._release(out, trailing_newline=True)
            out.append(self._line + "\n")
        self._line = ""
        self._in_row = self._deciding = False
        self._at_line_start = True

    def _release(self, out: list[str], *, trailing_newline: bool) -> None:
        """Write the held rows: laid out when they make a table, else as they were."""
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        lines = layout(rows) or rows
        out.append("\n".join(lines) + ("\n" if trailing_newline else ""))


def layout(rows: list[str]) -> list[str] | None:
    """The lines of a Markdown table with its columns aligned, or None when ``rows`` are
    not a table (no header followed by a delimiter row)."""
    if len(rows) < 2:
        return None
    aligns = _delimiter(rows[1])
    if aligns is None:
        return None
    body = [_cells(row) for row in (rows[0], *rows[2:])]
    columns = max(len(aligns), *(len(cells) for cells in body))
    aligns += ["left"] * (columns - len(aligns))
    for cells in body:
        cells += [""] * (columns - len(cells))
    widths = [max(1, *(display_width(cells[i]) for cells in body)) for i in range(columns)]
    lines = [_row(body[0], widths, aligns)]
    lines.append("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    lines.extend(_row(cells, widths, aligns) for cells in body[1:])
    return lines


def _cells(row: str) -> list[str]:
    text = row.strip()
    if text.startswith("|"):
        text = text[1:]
    if text.endswith("|") and not text.endswith("\\|"):
        text = text[:-1]
    return [cell.strip() for cell in _CELL_SPLIT.split(text)]


def _delimiter(row: str) -> list[Align] | None:
    cells = _cells(row)
    if not cells or not all(_DELIMITER_CELL.fullmatch(cell) for cell in cells):
        return None
    aligns: list[Align] = []
    for cell in cells:
        if cell.startswith(":") and cell.endswith(":"):
            aligns.append("center")
        elif cell.endswith(":"):
            aligns.append("right")
        else:
            aligns.append("left")
    return aligns


def _row(cells: list[str], widths: list[int], aligns: list[Align]) -> str:
    padded = []
    for cell, width, align in zip(cells, widths, aligns, strict=True):
        room = width - display_width(cell)
        if align == "right":
            padded.append(" " * room + cell)
        elif align == "center":
            padded.append(" " * (room // 2) + cell + " " * (room - room // 2))
        else:
            padded.append(cell + " " * room)
    return "| " + " | ".join(padded) + " |"


def display_width(text: str) -> int:
    """How many terminal columns ``text`` takes: wide East Asian characters take two,
    combining marks none."""
    width = 0
    for char in text:
        if unicodedata.combining(char):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


__all__ = ["TableLayout", "display_width", "layout"]
