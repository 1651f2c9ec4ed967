"""A bounded fuzz trial of the gateway (R-SEC-1: no frame can end the host or another
session). A seeded generator sends 300 random and mutated frames — lone surrogates,
oversize values, wrong types, deep nesting, batches, broken JSON, binary — over one real
websocket. Every frame is answered (never with -32603), the connection carries on,
another principal's session finishes its task, and the server still accepts connections.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import trio
from test_gateway import BOUND_S, connect, serving

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.providers.scripted import Reply, ScriptStep, text
from greenroom.protocols import jsonrpc

FRAMES = 300
MAX_FRAME_BYTES = 64 * 1024
SEED = 20261201
KNOWN_CODES = {
    jsonrpc.PARSE_ERROR,
    jsonrpc.INVALID_REQUEST,
    jsonrpc.METHOD_NOT_FOUND,
    jsonrpc.INVALID_PARAMS,
    jsonrpc.UNAUTHORIZED,
    jsonrpc.FORBIDDEN,
    jsonrpc.NOT_FOUND,
    jsonrpc.BUSY,
    jsonrpc.AUTH_LOCKED,
}
OTHER_TOKEN = "other-token-0123456789"
FUZZ_TOKEN = "fuzz-token-0123456789ab"


class FrameMaker:
    """Random frames, each with what it should be answered with: ``ids`` (the request ids
    that must get an answer) and whether a frame-level error (id null) is due."""

    def __init__(self, rng: random.Random, session_ids: list[str]) -> None:
        self.rng = rng
        self.session_ids = session_ids
        self.next_id = 1000

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(14 if depth < 4 else 9)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice([True, False])
        if kind == 2:
            return rng.choice([0, -1, 1, 2**31, -(2**63), 10**rng.randrange(20, 400)])
        if kind == 3:
            return rng.choice([0.5, -1e308, 1e-300, 3.0])
        if kind == 4:
            return "".join(rng.choice("ab\ud800\udfff\u00e9\U0001f600\x00 /.") for _ in range(8))
        if kind == 5:
            return "x" * rng.choice([1, 300, 5000, 70_000])
        if kind == 6:
            return rng.choice([*self.session_ids, "", "../etc", "20990101-000000-abcdef"])
        if kind == 7:
            return rng.choice(["/", ".", "..", "allow", "deny", "text", "image"])
        if kind == 8:
            return "\ud83d" * rng.randrange(1, 4)
        if kind <= 11:
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        return {self.key(): self.value(depth + 1) for _ in range(rng.randrange(4))}

    def key(self) -> str:
        names = [p.name for m in jsonrpc.METHODS.values() for p in m.params]
        return self.rng.choice([*names, "bogus", "\ud800", "type", "text", "path"])

    def params(self, method: str) -> Any:
        rng = self.rng
        spec = jsonrpc.METHODS.get(method)
        roll = rng.random()
        if roll < 0.1:
            return self.value()  # not an object at all
        params: dict[str, Any] = {}
        if spec is not None:
            for param in spec.params:
                if rng.random() < 0.8:
                    params[param.name] = self.param_value(param.name)
        if rng.random() < 0.2:
            params[self.key()] = self.value()
        return params

    def param_value(self, name: str) -> Any:
        rng = self.rng
        if rng.random() < 0.4:
            return self.value()
        if name == "session_id":
            return rng.choice(self.session_ids)
        if name == "input":
            return rng.choice(
                [
                    "hi \ud800",
                    [{"type": "text", "text": "t\udfff"}],
                    [{"type": "image", "path": "../../etc/passwd"}],
                    [{"type": "image", "path": "a\x00b"}],
                ]
            )
        if name == "settings":
            field = rng.choice(
                ["max_turns", "approval_timeout_s", "model", "system", "sandbox", "nope"]
            )
            return {field: self.value()}
        if name == "workspace":
            return rng.choice(["/", ".", "..", "x" * 4000, "\ud800", "a\x00"])
        return self.value()

    def call(self, *, notification: bool = False) -> tuple[dict[str, Any], Any]:
        rng = self.rng
        method = rng.choice([*jsonrpc.METHODS, "nope", "\ud800", "run"])
        frame: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if rng.random() < 0.9:
            frame["params"] = self.params(method)
        request_id: Any = None
        if not notification:
            self.next_id += 1
            request_id = rng.choice([self.next_id, f"id-{self.next_id}"])
            frame["id"] = request_id
        if rng.random() < 0.05:
            frame["jsonrpc"] = rng.choice(["1.0", 2, None])
        return frame, request_id

    def frame(self) -> tuple[str | bytes, list[Any], bool]:
        """``(frame, request ids to be answered, whether an answer with id null is due)``."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.05:
            return rng.choice(["{", "[1,", "nul", '{"a":NaN}', ""]), [], True
        if roll < 0.08:
            return b"\x00\xffbinary", [], True
        if roll < 0.12:
            depth = rng.choice([10, 70, 300])
            nested: Any = "deep"
            for _ in range(depth):
                nested = [nested]
            self.next_id += 1
            frame = {"jsonrpc": "2.0", "id": self.next_id, "method": "run", "params": {"x": nested}}
            if depth + 2 > jsonrpc.MAX_DEPTH:
                return json.dumps(frame), [], True  # refused before its id is read
            return json.dumps(frame), [self.next_id], False
        if roll < 0.27:
            calls = [self.call(notification=rng.random() < 0.3) for _ in range(rng.randrange(1, 6))]
            if all("id" not in frame for frame, _ in calls):  # keep every frame answerable
                calls.append(self.call())
            ids = [request_id for frame, request_id in calls if "id" in frame]
            return self.sized(json.dumps([frame for frame, _ in calls]), ids)
        if roll < 0.32:
            return self.sized(json.dumps(self.value()), [], error=True)
        frame, request_id = self.call()
        return self.sized(json.dumps(frame), [request_id])

    def sized(
        self, text: str, ids: list[Any], *, error: bool = False
    ) -> tuple[str, list[Any], bool]:
        """A frame over the size limit is refused as a whole, with id null."""
        if len(text.encode("utf-8", "surrogatepass")) > MAX_FRAME_BYTES:
            return text, [], True
        return text, ids, error


def plenty() -> list[ScriptStep]:
    """Enough replies for every task and compaction the fuzzer can start."""
    return [Reply(blocks=(text("ok"),))] * FRAMES


def check_answer(answer: Any) -> None:
    assert isinstance(answer, dict) and answer.get("jsonrpc") == "2.0", answer
    if "error" in answer:
        error = answer["error"]
        assert error["code"] in KNOWN_CODES, answer  # never -32603: no internal error
        assert isinstance(error["message"], str) and error["message"]
    else:
        assert "result" in answer, answer


async def test_fuzzed_frames_are_all_answered_and_nothing_breaks(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    limits = GatewayLimits(
        rate_per_s=1e9, burst=10**9, max_frame_bytes=MAX_FRAME_BYTES, max_message_bytes=1 << 20
    )
    tokens = {"fuzz": FUZZ_TOKEN, "other": OTHER_TOKEN}
    with trio.fail_after(BOUND_S * 6):
        async with (
            serving(tmp_path, plenty, limits=limits, tokens=tokens) as server,
            connect(server, token=OTHER_TOKEN) as other,
            connect(server, token=FUZZ_TOKEN) as fuzz,
        ):
            other_sid = (await other.result("session.create"))["session_id"]
            own = [(await fuzz.result("session.create"))["session_id"] for _ in range(2)]
            maker = FrameMaker(rng, [*own, other_sid])
            frame_errors = 0
            for _ in range(FRAMES):
                frame, ids, frame_error = maker.frame()
                await fuzz.ws.send_message(frame)
                want = set(ids)
                while want or frame_error:
                    message = json.loads(await fuzz.ws.get_message())
                    if isinstance(message, dict) and "method" in message:
                        continue  # an output of a subscription
                    batch = isinstance(message, list)
                    for answer in message if batch else [message]:
                        check_answer(answer)
                        if answer["id"] in want:
                            want.discard(answer["id"])
                        elif answer["id"] is None and (frame_error or batch):
                            # Batch entries that are not calls are answered with id null.
                            frame_errors += frame_error
                            frame_error = False
                        else:
                            raise AssertionError(f"unexpected {answer} for {frame[:300]!r}")
            assert frame_errors > 10
            # The fuzzed connection and the other principal's session carry on.
            listed = await fuzz.result("session.list")
            assert {s["session_id"] for s in listed["sessions"]} >= set(own)
            await other.result("session.subscribe", {"session_id": other_sid})
            await other.result("run", {"session_id": other_sid, "input": "still here"})
            outputs = other.take_outputs() + await other.outputs_until("task_end")
            assert outputs[-1]["status"] == "completed"
            # The server stayed up: a new connection is served.
            async with connect(server, token=FUZZ_TOKEN) as again:
                await again.result("session.list")
