"""The websocket API is documented where clients look: the README's method table is the
one generated from ``protocols.jsonrpc.METHODS``, and that table is the gateway's."""

from __future__ import annotations

from pathlib import Path

from greenroom.actors.gateway import Gateway
from greenroom.protocols import jsonrpc

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- methods:begin -->\n", "<!-- methods:end -->"


def test_the_readme_method_table_is_the_generated_one() -> None:
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "the README lost its method table markers"
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert documented == jsonrpc.methods_markdown(), (
        "README.md's method table is stale: replace it with "
        "greenroom.protocols.jsonrpc.methods_markdown()"
    )


def test_the_method_table_is_the_gateways() -> None:
    gateway = Gateway(host=None, token="t" * 20)  # type: ignore[arg-type]
    assert list(gateway._methods) == list(jsonrpc.METHODS)
    for method in jsonrpc.METHODS.values():
        assert method.doc and method.result, method.name
        assert len({p.name for p in method.params}) == len(method.params), method.name


def test_an_unknown_parameter_error_lists_the_accepted_ones() -> None:
    try:
        jsonrpc.check_params({"session_id": "s", "prompt": "x"}, "run")
    except jsonrpc.RpcError as error:
        assert error.code == jsonrpc.INVALID_PARAMS
        assert error.message == (
            "$.prompt: unknown parameter; run takes session_id, input, output_schema"
        )
    else:
        raise AssertionError("an unknown parameter passed")
