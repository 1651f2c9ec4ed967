"""The output classes are the public contract: each one reads its JSON ``type`` as
``output.type`` and documents every field it has, so ``help()`` shows the contract."""

from __future__ import annotations

import pydoc
import re
from typing import Any

import attrs
import pytest
from test_protocol_roundtrip import COMMON, EXAMPLES

from greenroom.protocols import outputs, to_dict


@pytest.mark.parametrize("cls", outputs.OUTPUT_CLASSES, ids=lambda c: c.TYPE)
def test_type_is_the_json_type(cls: type[Any]) -> None:
    value = cls(**COMMON, **EXAMPLES[cls])
    assert value.type == to_dict(value)["type"] == cls.TYPE
    assert "type" not in attrs.fields_dict(cls)  # not a field: the JSON is unchanged
    assert not hasattr(value, "__dict__")  # the shared base keeps outputs slotted


@pytest.mark.parametrize("cls", outputs.OUTPUT_CLASSES, ids=lambda c: c.TYPE)
def test_docstring_documents_every_field(cls: type[Any]) -> None:
    doc = cls.__doc__ or ""
    summary = doc.strip().splitlines()[0] if doc.strip() else ""
    assert summary and not summary.startswith(cls.__name__), "a one-line summary first"
    for name in ["type", *attrs.fields_dict(cls)]:
        assert re.search(rf"^\s+{name}: \S", doc, re.MULTILINE), f"{cls.__name__}.{name}"


def test_help_shows_the_fields() -> None:
    rendered = pydoc.render_doc(outputs.TaskEnd, renderer=pydoc.plaintext)
    for name in ("status:", "turns:", "usage:", "wall_ms:", "session_id:", "origin:"):
        assert name in rendered
