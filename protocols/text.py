"""Text that can always be encoded: lone UTF-16 surrogates repaired where text enters.

JSON may spell a lone surrogate (``"\\ud800"``) and Python strings can hold one, but no
UTF-8 encoder accepts it: one such character in a trace line, a websocket reply or a
terminal write fails that write. Every boundary where outside text enters the runtime —
websocket frames, model streams, tool output, file contents — passes it through
:func:`repair_text` (or :func:`repair_json` for decoded JSON values), which replaces each
lone surrogate with U+FFFD and leaves everything else untouched (R-SEC-1). A correctly
paired surrogate escape decodes to one real character and is never affected.
"""

from __future__ import annotations

import json
import re
from typing import Any

compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``: the one compact JSON
of trace records and gateway frames, with its encoder made once (``json.dumps`` makes one
per call when given options, a microsecond of every record and frame)."""

def json_type_name(value: Any, *, integers: bool = True) -> str:
    """The JSON name of a decoded value's type, for messages: ``integer`` for a whole
    number (JSON Schema's word) — ``number`` with ``integers=False`` — and the Python type's
    name for what JSON cannot hold."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer" if integers else "number"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


REPLACEMENT = "\ufffd"
"""What a lone surrogate becomes: the Unicode replacement character."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogates(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (one that UTF-8 cannot encode)."""
    if text.isascii():
        return False
    return _SURROGATE.search(text) is not None


def repair_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD; the same object when clean.

    Cheap on the hot path: ASCII text (most model deltas) returns after one C-level check.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(REPLACEMENT, text)


def repair_json(value: Any) -> Any:
    """A decoded JSON value with every string (keys included) passed through
    :func:`repair_text`. Containers are rebuilt only when something changed."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, list):
        repaired = [repair_json(item) for item in value]
        if all(new is old for new, old in zip(repaired, value, strict=True)):
            return value
        return repaired
    if isinstance(value, dict):
        changed = False
        out: dict[Any, Any] = {}
        for key, item in value.items():
            new_key = repair_text(key) if isinstance(key, str) else key
            new_item = repair_json(item)
            changed = changed or new_key is not key or new_item is not item
            out[new_key] = new_item
        return out if changed else value
    return value
