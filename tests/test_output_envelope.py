"""One envelope for every output (the output contract, R-TRACE-1): ``session_id``,
``run_id``, ``seq`` and ``origin`` are declared once, come first in every output, and the
JSON of a trace line is what it was before the envelope existed, so old traces load."""

from __future__ import annotations

import inspect
import json
from typing import Any, get_args

import attrs
import pytest
from test_protocol_roundtrip import EXAMPLES

from greenroom.protocols import outputs, to_json
from greenroom.protocols.converter import output_from_dict

ENVELOPE = ["session_id", "run_id", "seq", "origin"]


def test_the_envelope_holds_the_shared_fields() -> None:
    assert [f.name for f in attrs.fields(outputs.Envelope)] == ENVELOPE


@pytest.mark.parametrize("cls", outputs.OUTPUT_CLASSES, ids=lambda c: c.TYPE)
def test_every_output_inherits_the_envelope_first(cls: type[Any]) -> None:
    assert issubclass(cls, outputs.Envelope)
    assert [f.name for f in attrs.fields(cls)][:4] == ENVELOPE
    assert not set(ENVELOPE) & set(inspect.get_annotations(cls)), "declared once"
    value = cls(session_id="s", run_id="r", **EXAMPLES[cls])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        value.seq = 1  # type: ignore[misc]
    assert not hasattr(value, "__dict__")


def test_output_classes_are_the_union() -> None:
    assert get_args(outputs.Output) == outputs.OUTPUT_CLASSES
    assert len({cls.TYPE for cls in outputs.OUTPUT_CLASSES}) == len(outputs.OUTPUT_CLASSES)
    assert outputs.Envelope not in outputs.OUTPUT_CLASSES


def test_the_envelope_is_not_an_output() -> None:
    with pytest.raises(ValueError, match="unknown type"):
        output_from_dict({"session_id": "s", "run_id": "r"})


# Lines as greenroom wrote them before outputs shared an envelope.
EARLIER_LINES: dict[type[Any], list[str]] = {
    outputs.PartialText: [
        '{"type":"partial_text","session_id":"s1","run_id":"r1","index":0,"text":"he",'
        '"seq":3,"origin":["root","child"]}',
        '{"type":"partial_text","session_id":"s","run_id":"r","index":0,"text":"he"}',
    ],
    outputs.RequestEnd: [
        '{"type":"request_end","session_id":"s1","run_id":"r1","turn":1,"status":"timeout",'
        '"attempt":2,"retry_in_ms":500,"error_message":"overloaded","stop_reason":null,'
        '"seq":3,"origin":["root","child"]}',
    ],
    outputs.TaskEnd: [
        '{"type":"task_end","session_id":"s1","run_id":"r1","status":"aborted","turns":2,'
        '"usage":{"input":10,"output":5,"cache_read":100,"cache_write":7,"total":122},'
        '"wall_ms":12,"message":null,"seq":3,"origin":["root","child"]}',
        '{"type":"task_end","session_id":"s","run_id":"r","status":"aborted","turns":2,'
        '"usage":{"input":10,"output":5,"cache_read":100,"cache_write":7,"total":122},'
        '"wall_ms":12,"message":null}',
    ],
}


@pytest.mark.parametrize("cls", list(EARLIER_LINES), ids=lambda c: c.TYPE)
def test_json_is_byte_for_byte_what_it_was(cls: type[Any]) -> None:
    for line in EARLIER_LINES[cls]:
        value = output_from_dict(json.loads(line))
        assert type(value) is cls
        assert value == cls(**{k: getattr(value, k) for k in ENVELOPE}, **EXAMPLES[cls])
        # Usage has said what it cost since R-SHARE-3: null for a line written before.
        assert to_json(value) == line.replace('"total":122}', '"total":122,"cost_usd":null}')


def test_the_hot_path_constructors_make_the_same_objects() -> None:
    """R-PERF-1's per-token constructors (``partial_text``, ``text_delta``) bypass attrs'
    ``__init__``: they must set every field of their class (a field added later would be
    missing), give an equal, hashable, frozen object, and encode to the same JSON."""
    from greenroom.protocols.stream import TextDelta, text_delta

    fast = outputs.partial_text("s", "r", 2, "tok")
    slow = outputs.PartialText(session_id="s", run_id="r", index=2, text="tok")
    assert [f.name for f in attrs.fields(outputs.PartialText)] == [*ENVELOPE, "index", "text"]
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert to_json(fast) == to_json(slow)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast.text = "other"  # type: ignore[misc]
    delta = text_delta(1, "x")
    assert [f.name for f in attrs.fields(TextDelta)] == ["index", "text"]
    assert delta == TextDelta(index=1, text="x")
    assert hash(delta) == hash(TextDelta(index=1, text="x"))
