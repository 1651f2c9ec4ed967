"""Lone surrogates are repaired where text enters (R-SEC-1)."""

import json

from greenroom.protocols.text import REPLACEMENT, has_surrogates, repair_json, repair_text


def test_lone_surrogates_become_replacement_characters() -> None:
    text = json.loads('"a\\ud800b\\udfffc"')
    assert has_surrogates(text)
    repaired = repair_text(text)
    assert repaired == f"a{REPLACEMENT}b{REPLACEMENT}c"
    repaired.encode("utf-8")


def test_clean_text_is_returned_unchanged() -> None:
    for text in ("plain", "Grüße — 👋", json.loads('"\\ud83d\\udc4b"')):
        assert not has_surrogates(text)
        assert repair_text(text) is text


def test_json_values_are_repaired_deeply_and_kept_when_clean() -> None:
    value = json.loads('{"k\\ud800": ["x", {"y": "\\udc00"}], "n": 1}')
    repaired = repair_json(value)
    assert repaired == {f"k{REPLACEMENT}": ["x", {"y": REPLACEMENT}], "n": 1}
    json.dumps(repaired, ensure_ascii=False).encode("utf-8")
    clean = {"a": ["b", {"c": 2}]}
    assert repair_json(clean) is clean
