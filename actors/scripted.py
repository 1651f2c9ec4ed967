"""Scripts for the built-in scripted model: deterministic runs for tests and examples.

A :class:`ScriptedProvider` answers each model request with the next step of its script,
with no key and no network::

    from greenroom import Host, user_text
    from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call

    provider = ScriptedProvider([
        Reply(blocks=(text("Let me look."), tool_call("call_1", "list_dir", path="."))),
        Reply(blocks=(text("Two files."),)),
    ])
    session = await host.create_session(provider=provider, tools=[...])

A step (the type :data:`ScriptStep`) is one of:

- a :class:`Reply`: complete blocks, streamed word by word. ``Reply(fail=model_error(…),
  fail_after_blocks=n)`` fails the attempt after ``n`` blocks (the runtime retries it as
  it would a real provider's failure); ``truncate_last_tool_call=True`` cuts the last
  tool call as the output-token limit would; ``chunk_delay_s`` paces the stream.
- a function of the :class:`~greenroom.protocols.context.ModelRequest` returning a
  ``Reply``, to answer from what the model was sent (the tool results, say);
- an ``async`` function of the request and a :class:`ScriptedStream`, for full control:
  ``await stream.text(…)``, ``.thinking(…)``, ``.tool_call(block)``, ``.text_delta(…)``
  (an unfinished block), ``.end(stop_reason)``, ``.fail(error)`` — and it may wait on a
  ``trio.Event`` mid-stream.

``ScriptedProvider(step)`` with a single step (not a list) answers every request with it.
When a list runs out, the request fails with "script exhausted", so a test fails instead
of hanging. Every request is kept in ``provider.requests``; each is checked for the
tool-call pairing a real provider insists on (every call answered once, in order, no
orphan results), and a violation fails that request and is listed in
``provider.violations``.

Block helpers: :func:`text`, :func:`thinking`, :func:`tool_call`, :func:`invalid_tool_call`
(argument text that is not a JSON object); :func:`model_error` builds a failure.
"""

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    ScriptStep,
    invalid_tool_call,
    model_error,
    text,
    thinking,
    tool_call,
)

__all__ = [
    "Reply",
    "ScriptStep",
    "ScriptedProvider",
    "ScriptedStream",
    "invalid_tool_call",
    "model_error",
    "text",
    "thinking",
    "tool_call",
]
