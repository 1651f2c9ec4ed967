"""The head deadline's ``trace`` hook on the SDK path after a redirect (R-SEC-10): each
request the library sends — the first and each one a 307 sends on — has the hook once, so
each of its trace events reaches the head timer once.

Before the fix: httpx2 builds the redirected request with the first one's extensions, so
``time_heads`` found its own hook already there and wrapped it with itself: every event of
the second request reached the timer twice (and of a third, three times).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from greenroom.actors.providers import stalls
from greenroom.actors.providers.stalls import HeadDeadline
from greenroom.protocols.stream import MessageCompleted
from tests.support.mock_model_server import ErrorReply, Reply, Text, open_mock_server
from tests.test_s14_streams import one_stream, provider_for, text_of

STARTED = "http11.receive_response_headers.started"
COMPLETE = "http11.receive_response_headers.complete"


@pytest.mark.parametrize("redirects", [1, 2])
async def test_each_head_event_reaches_the_timer_once_across_redirects(
    monkeypatch: pytest.MonkeyPatch, redirects: int
) -> None:
    seen: Counter[str] = Counter()
    real = stalls.HeadDeadline.trace

    async def counted(self: HeadDeadline, name: str, info: dict[str, Any]) -> None:
        seen[name] += 1
        await real(self, name, info)

    monkeypatch.setattr(stalls.HeadDeadline, "trace", counted)
    async with open_mock_server() as server:
        moved = ErrorReply(307, b"", {"location": "/v1/messages"})
        server.push(*[moved] * redirects, Reply([Text("moved here")]))
        events = await one_stream(provider_for("anthropic", server.base_url, lean=False))
        assert len(server.requests) == redirects + 1
    assert isinstance(events[-1], MessageCompleted), events
    assert text_of(events) == "moved here"
    # One head read a request, each seen once.
    assert (seen[STARTED], seen[COMPLETE]) == (redirects + 1, redirects + 1), seen
