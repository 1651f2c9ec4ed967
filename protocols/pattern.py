"""JSON Schema ``pattern`` matched in time linear in the text (R-SEC-1), pure.

Python's ``re`` backtracks and holds the interpreter lock for the whole of one match: a
pattern like ``(x+)+y`` against forty ``x`` takes minutes, and an answer's check runs on
the event loop that serves every session. So a schema's pattern is read with ``re``'s own
parser and run here as a Thompson automaton (the Pike VM of RE2): every character of the
text moves a set of at most :data:`MAX_PROGRAM` states, never a backtracking search, and
each move is counted against the caller's budget.

It takes the syntax patterns are written in — literals, classes, ``.``, ``\\d``/``\\w``/
``\\s`` and their negations, groups, alternation, greedy and lazy repetition (bounded
repetition unrolled), ``^``/``$``/``\\A``/``\\Z``/``\\b``/``\\B`` and the ``(?i)``,
``(?m)``, ``(?s)``, ``(?a)`` flags. What cannot be matched without backtracking —
backreferences, lookahead and lookbehind, atomic groups and possessive repetition — is
refused with :class:`PatternError`, as is a pattern ``re`` cannot read. Case-insensitive
matching is ``re``'s own: the test of one character against one literal or class is
``re``'s compiled test of that item alone, which cannot backtrack (its case folding has
exceptions no simple rule reproduces: "İ" and "K", the Kelvin sign, match ``(?i)[a-z]``;
"ß" does not).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_COMPILE_STEPS", "MAX_PROGRAM", "Pattern", "PatternError", "compile_pattern"]

MAX_PROGRAM = 2000
"""At most this many states in one pattern's automaton (bounded repetition unrolled):
``[a-z]{1,5000}`` is refused, not run."""

MAX_COMPILE_STEPS = 20 * MAX_PROGRAM
"""At most this many parts of a pattern read while it is compiled, repetitions counted out:
a part that makes no state (an empty group) costs its reading all the same, and
``(?:(?:){65535}){65535}`` would be read four billion times."""

_sre: Any = importlib.import_module("re._parser")  # re's own reader of patterns
_re_compiler: Any = importlib.import_module("re._compiler")  # and its compiler, for one item

_IGNORECASE, _MULTILINE, _DOTALL, _ASCII = 2, 8, 16, 256

Step = Callable[[int], None]
"""Called with the number of automaton moves made; raises to stop the match."""


class PatternError(ValueError):
    """A pattern this engine cannot run: unreadable, too large, or needing backtracking."""


CharTest = Callable[[str], bool]
# An instruction: ("char", test) consumes one character; ("split", a, b) and ("jmp", a)
# move without consuming; ("at", code) asserts a position; ("match",) accepts.
Instruction = tuple[Any, ...]


class Pattern:
    """A compiled pattern: :meth:`search` says whether it matches anywhere in a text."""

    __slots__ = ("_program", "source")

    def __init__(self, source: str, program: list[Instruction]) -> None:
        self.source = source
        self._program = program

    def __len__(self) -> int:
        return len(self._program)

    def search(self, text: str, step: Step) -> bool:
        """Whether the pattern matches somewhere in ``text``, as ``re.search`` does. Calls
        ``step`` once per character with the moves it made (at most twice the program's
        length), so the work is bounded by whoever counts it."""
        program = self._program
        current: list[int] = []
        self._add(current, set(), 0, text, 0)
        for pos in range(len(text) + 1):
            moves = len(current)
            char = text[pos] if pos < len(text) else None
            following: list[int] = []
            seen: set[int] = set()
            for pc in current:
                instruction = program[pc]
                if instruction[0] == "match":
                    step(moves)
                    return True
                if char is not None and instruction[0] == "char" and instruction[1](char):
                    moves += self._add(following, seen, pc + 1, text, pos + 1)
            if char is not None:
                # Unanchored: a match may also start at the next position.
                moves += self._add(following, seen, 0, text, pos + 1)
            step(moves)
            current = following
        return False

    def _add(self, threads: list[int], seen: set[int], pc: int, text: str, pos: int) -> int:
        """Follow the moves that consume nothing from ``pc``; returns how many states it
        visited. Each state enters ``threads`` at most once per position."""
        visited = 0
        stack = [pc]
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            visited += 1
            instruction = self._program[pc]
            kind = instruction[0]
            if kind == "jmp":
                stack.append(instruction[1])
            elif kind == "split":
                stack.append(instruction[2])
                stack.append(instruction[1])
            elif kind == "at":
                if _at(instruction[1], instruction[2], text, pos):
                    stack.append(pc + 1)
            else:
                threads.append(pc)
        return visited


def compile_pattern(source: str) -> Pattern:
    """``source`` as a :class:`Pattern`; raises :class:`PatternError` saying why it
    cannot be one."""
    try:
        parsed = _sre.parse(source)
    except Exception as exc:  # re.error, and the rare RecursionError of a deep pattern
        raise PatternError(f"not a regular expression Python can read: {exc}") from None
    program: list[Instruction] = []
    try:
        _Compiler(program).sequence(parsed, parsed.state.flags)
    except RecursionError:
        raise PatternError("nested too deeply") from None
    program.append(("match",))
    return Pattern(source, program)


class _Compiler:
    __slots__ = ("program", "steps")

    def __init__(self, program: list[Instruction]) -> None:
        self.program = program
        self.steps = 0

    def emit(self, *instruction: Any) -> int:
        if len(self.program) >= MAX_PROGRAM:
            raise PatternError(
                f"too large to check (more than {MAX_PROGRAM} states once its repetitions "
                "are counted out; minLength and maxLength bound a length)"
            )
        self.program.append(instruction)
        return len(self.program) - 1

    def sequence(self, items: Any, flags: int) -> None:
        self.steps += 1 + len(items)
        if self.steps > MAX_COMPILE_STEPS:
            raise PatternError(
                f"too large to check (more than {MAX_COMPILE_STEPS} parts to read once its "
                "repetitions are counted out)"
            )
        for op, arg in items:
            self.item(op, arg, flags)

    def item(self, opcode: Any, arg: Any, flags: int) -> None:
        op = str(opcode)
        if op in ("LITERAL", "NOT_LITERAL", "IN") and flags & _IGNORECASE:
            self.emit("char", _re_char_test(opcode, arg, flags))
        elif op in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            self.emit("char", _char_test(op, arg, flags))
        elif op == "AT":
            if str(arg) not in _POSITIONS:
                raise PatternError(f"uses the assertion {str(arg).lower()}, not supported")
            self.emit("at", str(arg), flags)
        elif op == "SUBPATTERN":
            _group, add_flags, del_flags, body = arg
            self.sequence(body, (flags | add_flags) & ~del_flags)
        elif op == "BRANCH":
            self.branch(arg[1], flags)
        elif op in ("MAX_REPEAT", "MIN_REPEAT"):
            # Whether a match exists does not depend on greed: lazy is greedy here.
            low, high, body = arg
            self.repeat(low, None if high == _sre.MAXREPEAT else high, body, flags)
        else:
            raise PatternError(_REFUSED.get(op, f"uses {op.lower()}, which is not supported"))

    def branch(self, alternatives: list[Any], flags: int) -> None:
        ends: list[int] = []
        for i, alternative in enumerate(alternatives):
            if i == len(alternatives) - 1:
                self.sequence(alternative, flags)
                break
            split = self.emit("split", 0, 0)
            self.sequence(alternative, flags)
            ends.append(self.emit("jmp", 0))
            self.program[split] = ("split", split + 1, len(self.program))
        for end in ends:
            self.program[end] = ("jmp", len(self.program))

    def repeat(self, low: int, high: int | None, body: Any, flags: int) -> None:
        for _ in range(low):
            self.sequence(body, flags)
        if high is None:
            loop = self.emit("split", 0, 0)
            self.sequence(body, flags)
            self.emit("jmp", loop)
            self.program[loop] = ("split", loop + 1, len(self.program))
            return
        splits: list[int] = []
        for _ in range(high - low):
            splits.append(self.emit("split", 0, 0))
            self.sequence(body, flags)
        for split in splits:
            self.program[split] = ("split", split + 1, len(self.program))


_REFUSED = {
    "GROUPREF": "uses a backreference, which cannot be checked without backtracking",
    "GROUPREF_EXISTS": "uses a conditional group, which cannot be checked without backtracking",
    "ASSERT": "uses lookahead or lookbehind, which is not supported",
    "ASSERT_NOT": "uses lookahead or lookbehind, which is not supported",
    "ATOMIC_GROUP": "uses an atomic group, which is not supported",
    "POSSESSIVE_REPEAT": "uses possessive repetition, which is not supported",
}


def _category(name: str, flags: int) -> CharTest:
    ascii_only = bool(flags & _ASCII)
    tests: dict[str, CharTest] = {
        "DIGIT": (lambda c: "0" <= c <= "9") if ascii_only else str.isdecimal,
        "SPACE": (lambda c: c in " \t\n\r\f\v") if ascii_only else str.isspace,
        "WORD": (lambda c: c.isascii() and (c.isalnum() or c == "_"))
        if ascii_only
        else (lambda c: c.isalnum() or c == "_"),
    }
    kind = name.removeprefix("CATEGORY_")
    if kind.startswith("NOT_"):
        positive = tests[kind.removeprefix("NOT_")]
        return lambda c: not positive(c)
    return tests[kind]


def _class_test(items: list[Any], flags: int) -> tuple[CharTest, bool]:
    """The test of a character class without its negation, and whether it is negated."""
    negate = False
    tests: list[CharTest] = []
    for op, arg in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name in ("LITERAL", "NOT_LITERAL", "RANGE"):
            tests.append(_member_test(name, arg))
        elif name == "CATEGORY":
            tests.append(_category(str(arg), flags))
        else:
            raise PatternError(f"uses {name.lower()} in a character class, not supported")

    return (lambda c: any(t(c) for t in tests)), negate


def _member_test(name: str, arg: Any) -> CharTest:
    if name == "RANGE":
        low, high = chr(arg[0]), chr(arg[1])
        return lambda c: low <= c <= high
    literal = chr(arg)
    return (lambda c: c == literal) if name == "LITERAL" else (lambda c: c != literal)


def _char_test(op: str, arg: Any, flags: int) -> CharTest:
    if op == "ANY":
        return (lambda c: True) if flags & _DOTALL else (lambda c: c != "\n")
    negate = op == "NOT_LITERAL"
    if op == "IN":
        positive, negate = _class_test(arg, flags)
    else:
        literal = chr(arg)
        positive = lambda c: c == literal  # noqa: E731
    if negate:
        return lambda c: not positive(c)
    return positive


def _re_char_test(opcode: Any, arg: Any, flags: int) -> CharTest:
    """The test of one character against one literal or class under ``flags``, as ``re``
    compiles that item alone: a single item consumes one character and cannot backtrack,
    and ``re``'s case folding is the reference a pattern's author expects."""
    state = _sre.State()
    state.flags = flags
    try:
        match = _re_compiler.compile(_sre.SubPattern(state, [(opcode, arg)]), flags).match
    except Exception as exc:  # re.error: what re read, it compiles; said plainly if not
        raise PatternError(f"not a regular expression Python can compile: {exc}") from None
    return lambda c: match(c) is not None


def _at(code: str, flags: int, text: str, pos: int) -> bool:
    end = len(text)
    if code == "AT_BEGINNING":
        return pos == 0 or (bool(flags & _MULTILINE) and text[pos - 1] == "\n")
    if code == "AT_BEGINNING_STRING":
        return pos == 0
    if code == "AT_END":
        if flags & _MULTILINE:
            return pos == end or text[pos] == "\n"
        return pos == end or (pos == end - 1 and text[pos] == "\n")
    if code == "AT_END_STRING":
        return pos == end
    word = _category("CATEGORY_WORD", flags)  # for the ends of a word
    before = pos > 0 and word(text[pos - 1])
    after = pos < end and word(text[pos])
    return before != after if code == "AT_BOUNDARY" else before == after


_POSITIONS = frozenset(
    {
        "AT_BEGINNING",
        "AT_BEGINNING_STRING",
        "AT_END",
        "AT_END_STRING",
        "AT_BOUNDARY",
        "AT_NON_BOUNDARY",
    }
)
