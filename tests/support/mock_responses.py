"""The OpenAI Responses wire (``POST /v1/responses``) for the loopback mock model server.

:func:`render_responses` turns a scripted reply's blocks into the server's SSE events
(``response.created``, per item ``output_item.added`` / deltas / ``output_item.done``, then
``response.completed`` with the whole output and usage, or ``response.incomplete`` at
``max_tokens``). Reasoning items carry ``encrypted_content`` (the scripted thinking's
signature), so a client that sends them back can be checked.

:func:`check_responses_input` is the tool-pairing invariant of a request body: every
``function_call`` has a non-empty ``call_id``, unique, answered by exactly one
``function_call_output`` that comes after it and before the next user message; every output
answers a call; reasoning items sent back carry ``id`` and ``encrypted_content``.

Blocks are duck-typed (``text`` / ``deltas()``; ``signature``; ``id`` / ``name`` / ``input`` /
``argument_fragments()``), so this module does not import the server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

RESPONSES_PATH = "/v1/responses"


def _event(obj: dict[str, Any]) -> bytes:
    return (
        f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}"
        "\n\n"
    ).encode()


def render_responses(
    blocks: Sequence[Any],
    *,
    response_id: str,
    model: str,
    stop_reason: str,
    usage: tuple[int, int],
) -> list[tuple[bytes, bool]]:
    """``(event bytes, is_delta)`` for one streamed response."""
    seq = iter(range(1_000_000))
    base = {"id": response_id, "object": "response", "created_at": 0, "model": model,
            "status": "in_progress", "output": [], "usage": None}
    events: list[tuple[bytes, bool]] = [
        (_event({"type": "response.created", "sequence_number": next(seq), "response": base}),
         False),
    ]
    output: list[dict[str, Any]] = []
    truncate_last_call = stop_reason == "max_tokens"
    for index, block in enumerate(blocks):
        kind = type(block).__name__
        if kind == "Text":
            item = {"id": f"msg_{response_id}_{index}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            events.append((_event({"type": "response.output_item.added",
                                   "sequence_number": next(seq), "output_index": index,
                                   "item": item}), False))
            for delta in block.deltas():
                events.append((_event({"type": "response.output_text.delta",
                                       "sequence_number": next(seq), "output_index": index,
                                       "item_id": item["id"], "content_index": 0,
                                       "delta": delta, "logprobs": []}), True))
            done = {**item, "status": "completed",
                    "content": [{"type": "output_text", "text": block.text, "annotations": []}]}
        elif kind == "Thinking":
            item = {"id": f"rs_{response_id}_{index}", "type": "reasoning", "summary": []}
            events.append((_event({"type": "response.output_item.added",
                                   "sequence_number": next(seq), "output_index": index,
                                   "item": item}), False))
            for delta in block.deltas():
                events.append((_event({"type": "response.reasoning_summary_text.delta",
                                       "sequence_number": next(seq), "output_index": index,
                                       "item_id": item["id"], "summary_index": 0,
                                       "delta": delta}), True))
            done = {**item, "summary": [{"type": "summary_text", "text": block.text}],
                    "encrypted_content": block.signature}
        else:
            item = {"id": f"fc_{response_id}_{index}", "type": "function_call",
                    "call_id": block.id, "name": block.name, "arguments": "",
                    "status": "in_progress"}
            events.append((_event({"type": "response.output_item.added",
                                   "sequence_number": next(seq), "output_index": index,
                                   "item": item}), False))
            fragments = block.argument_fragments()
            if truncate_last_call and index == len(blocks) - 1:
                fragments = fragments[:1]
            for fragment in fragments:
                events.append((_event({"type": "response.function_call_arguments.delta",
                                       "sequence_number": next(seq), "output_index": index,
                                       "item_id": item["id"], "delta": fragment}), True))
            if truncate_last_call and index == len(blocks) - 1:
                continue  # cut by the token limit: never done
            arguments = json.dumps(dict(block.input), ensure_ascii=False)
            done = {**item, "arguments": arguments, "status": "completed"}
        events.append((_event({"type": "response.output_item.done",
                               "sequence_number": next(seq), "output_index": index,
                               "item": done}), False))
        output.append(done)
    usage_body = {"input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage[0] + usage[1]}
    if stop_reason == "max_tokens":
        final = {**base, "status": "incomplete", "output": output, "usage": usage_body,
                 "incomplete_details": {"reason": "max_output_tokens"}}
        events.append((_event({"type": "response.incomplete", "sequence_number": next(seq),
                               "response": final}), False))
    else:
        final = {**base, "status": "completed", "output": output, "usage": usage_body}
        events.append((_event({"type": "response.completed", "sequence_number": next(seq),
                               "response": final}), False))
    return events


def responses_error_event(code: str, message: str) -> bytes:
    """A ``response.failed`` event carrying ``code`` (mid-stream failure)."""
    return _event({"type": "response.failed", "sequence_number": 0,
                   "response": {"id": "resp_failed", "status": "failed",
                                "error": {"code": code, "message": message}}})


def check_responses_input(body: Any) -> list[str]:
    """Violations of the Responses tool-pairing invariants in a request body (empty if
    fine); see the module docstring."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        return ["'input' must be a non-empty list"]
    problems: list[str] = []
    seen: dict[str, int] = {}
    open_calls: dict[str, int] = {}
    answered: set[str] = set()

    def close(at: int) -> None:
        for call_id, where in open_calls.items():
            if call_id not in answered:
                problems.append(
                    f"input[{where}]: function_call {call_id!r} has no function_call_output "
                    f"before input[{at}]"
                )
        open_calls.clear()

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            problems.append(f"input[{i}]: not an object")
            continue
        kind = item.get("type", "message")
        if kind == "function_call":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                problems.append(f"input[{i}]: function_call with empty call_id")
            elif call_id in seen:
                problems.append(f"input[{i}]: call_id {call_id!r} already used at "
                                f"input[{seen[call_id]}]")
            else:
                seen[call_id] = i
                open_calls[call_id] = i
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in open_calls:
                problems.append(f"input[{i}]: function_call_output for unknown or closed "
                                f"call_id {call_id!r}")
            elif call_id in answered:
                problems.append(f"input[{i}]: second function_call_output for {call_id!r}")
            else:
                answered.add(call_id)
        elif kind == "reasoning":
            if not item.get("id") or not item.get("encrypted_content"):
                problems.append(f"input[{i}]: reasoning item without id or encrypted_content")
        elif kind == "message" and item.get("role") == "user":
            close(i)
    close(len(items))
    return problems
