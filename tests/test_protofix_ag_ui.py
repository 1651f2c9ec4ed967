"""The AG-UI endpoint of ``serve --ag-ui`` (R-PROTO-2, R-SEC-8): the image parts of a
front end's user message are images the model sees, attached as every inline image is
(the session's ``max_image_bytes``, an ``image/`` type), and one that cannot be is 400
naming the part."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import trio
from ag_ui.core import RunAgentInput
from test_gateway import serving
from test_gateway_ag_ui import BOUND_S, posted, run_input

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.providers.scripted import Reply, ScriptStep, text
from greenroom.protocols.content import ImageBlock, TextBlock
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
PNG_B64 = base64.b64encode(PNG).decode()


def with_parts(thread: str, run: str, *parts: dict[str, Any]) -> dict[str, Any]:
    """A run whose one user message is ``parts``, as a front end sends it."""
    body = run_input(thread, run)
    body["messages"] = [{"id": f"u-{run}", "role": "user", "content": list(parts)}]
    return body


def image(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


def replies() -> list[ScriptStep]:
    return [Reply(blocks=(text("A dot."),)) for _ in range(4)]


async def test_the_image_parts_of_a_user_message_reach_the_model(tmp_path: Path) -> None:
    """R-PROTO-2: a user message of a text part and an image part (its bytes inline) gave
    the model the text alone — the image was dropped without a word. The model now sees
    the image after the text, attached to the session like any inline image; an image
    as a ``data:`` URL, and the legacy ``binary`` part, likewise."""
    data = {"type": "data", "value": PNG_B64, "mimeType": "image/png"}
    url = {"type": "url", "value": f"data:image/png;base64,{PNG_B64}"}
    legacy = {"type": "binary", "mimeType": "image/png", "data": PNG_B64}
    runs = [
        with_parts("t-img", "r1", {"type": "text", "text": "what is this?"}, image(data)),
        with_parts("t-img", "r2", image(url)),
        with_parts("t-img", "r3", {"type": "text", "text": "and this?"}, legacy),
    ]
    for body in runs[:2]:
        RunAgentInput.model_validate(body)  # what a front end sends
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, replies, ag_ui=True) as server:
            url_of = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            for body in runs:
                done = await posted(url_of, body)
                assert done.status == 200, done.body
                assert done.events[-1][1]["type"] == "RUN_FINISHED"
            attachments = server.host.get_session("t-img").attachments
    seen = [request.messages[-1].content for request in server.providers[0].requests]
    assert [type(block).__name__ for block in seen[0]] == ["TextBlock", "ImageBlock"]
    assert seen[0][0] == TextBlock(text="what is this?")
    assert [type(block).__name__ for block in seen[1]] == ["ImageBlock"]
    assert [type(block).__name__ for block in seen[2]] == ["TextBlock", "ImageBlock"]
    images = [block for content in seen for block in content if isinstance(block, ImageBlock)]
    assert {(block.media_type, block.sha256 is not None) for block in images} == {
        ("image/png", True)
    }
    assert (attachments.directory / str(images[0].sha256)).read_bytes() == PNG


async def test_an_image_part_that_cannot_be_taken_is_refused_naming_it(tmp_path: Path) -> None:
    """R-PROTO-2, R-SEC-8, R-SEC-9: an image that is not base64, not of an image type,
    larger than ``max_image_bytes``, given by a URL to fetch or by a provider's file
    handle, or an audio part, is 400 naming the part and why; nothing runs, and a new
    thread's run leaves no session behind."""
    text_part = {"type": "text", "text": "look"}
    too_big = "A" * (4 * ((DEFAULT_MAX_IMAGE_BYTES + 2) // 3) + 4)
    cases = [
        ({"type": "data", "value": "not base64!", "mimeType": "image/png"}, "not base64"),
        ({"type": "data", "value": PNG_B64, "mimeType": "text/plain"}, "not an image type"),
        ({"type": "data", "value": too_big, "mimeType": "image/png"}, "max_image_bytes"),
        ({"type": "url", "value": "https://example.com/a.png"}, "not fetched"),
        ({"type": "file", "value": "file-abc123"}, "file handle"),
    ]
    limits = GatewayLimits(max_frame_bytes=16 << 20)
    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, replies, ag_ui=True, limits=limits) as server:
            url_of = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            for number, (source, why) in enumerate(cases):
                thread = f"t-bad-{number}"
                refused = await posted(url_of, with_parts(thread, "r", text_part, image(source)))
                assert refused.status == 400, (source, refused.body)
                message = refused.body["error"]["message"]
                assert message.startswith("$.messages[0].content[1]"), message
                assert why in message, message
                assert not (server.host.data_dir / "sessions" / thread).exists(), thread
            audio = {"type": "audio", "source": {"type": "data", "value": "aGk=",
                                                 "mimeType": "audio/wav"}}  # fmt: skip
            refused = await posted(url_of, with_parts("t-audio", "r", text_part, audio))
            assert refused.status == 400
            assert "a audio part" in refused.body["error"]["message"]
            assert not (server.host.data_dir / "sessions" / "t-audio").exists()
            assert all(not provider.requests for provider in server.providers)  # none ran
