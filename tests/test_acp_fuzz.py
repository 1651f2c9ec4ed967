"""A bounded fuzz trial of ``greenroom acp`` (R-SEC-1, R-ACP-1: no frame from the editor can
end the agent or lose another request). A seeded generator writes 150 mutated ACP
requests — the methods an editor calls, their params dropped, given odd types, lone
surrogates, huge or deep values, unknown ids — and a few broken lines, to one agent
process. Every request with an id is answered exactly once, never with an internal error;
every line the agent writes stays a valid ACP frame; a well-formed prompt then completes
and closing stdin ends the agent with exit code 0.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from test_acp import greenroom_acp, run, start, text, workspace  # noqa: F401 (a fixture)

from tests.support.mutation import JsonMutator

FRAMES = 150
SEED = 20261205
FIRST_ID = 10_000
INTERNAL_ERROR = -32603


class FrameMaker:
    """Mutated ACP requests for one agent whose session ``session_id`` is open."""

    def __init__(self, rng: random.Random, session_id: str, cwd: str) -> None:
        self.rng = rng
        self.session_id = session_id
        self.cwd = cwd
        self.mutator = JsonMutator(rng, more_odd=({"type": "nope"}, "relative/dir"), max_depth=3)

    def params(self, method: str) -> dict[str, Any]:
        rng = self.rng
        sid = rng.choice([self.session_id, self.session_id, "20990101-000000-abcdef"])
        prompt = [{"type": "text", "text": rng.choice(["hello", "tell me more", "ok"])}]
        if rng.random() < 0.3:
            prompt.append(
                rng.choice(
                    [
                        {"type": "image", "data": "not base64", "mimeType": "image/png"},
                        {"type": "resource_link", "uri": "file:///etc/passwd", "name": "p"},
                        {"type": "resource", "resource": {"uri": "file:///x", "text": "t"}},
                        {"type": "audio", "data": "", "mimeType": "audio/wav"},
                    ]
                )
            )
        return {
            "session/prompt": {"sessionId": sid, "prompt": prompt},
            "session/new": {"cwd": self.cwd, "mcpServers": []},
            "session/load": {"cwd": self.cwd, "sessionId": sid, "mcpServers": []},
            "session/set_mode": {"sessionId": sid, "modeId": rng.choice(["ask", "all", "x"])},
            "session/list": {},
            "_greenroom/steer": {"sessionId": sid, "prompt": prompt},
            "_greenroom/follow_up": {"sessionId": sid, "prompt": prompt},
        }.get(method, {})

    def frame(self, request_id: int) -> dict[str, Any]:
        rng = self.rng
        method = rng.choice(
            [
                "session/prompt", "session/prompt", "session/new", "session/load",
                "session/set_mode", "session/list", "_greenroom/steer",
                "_greenroom/follow_up", "no/such/method",
            ]
        )  # fmt: skip
        params: Any = self.params(method)
        if rng.random() < 0.8:
            params = self.mutator.mutate(params)
        return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


def answers_by_id(raw: list[bytes]) -> dict[Any, list[dict[str, Any]]]:
    answers: dict[Any, list[dict[str, Any]]] = {}
    for line in raw:
        frame = json.loads(line)
        if "method" not in frame and "id" in frame:
            answers.setdefault(frame["id"], []).append(frame)
    return answers


def test_fuzzed_frames_are_all_answered_and_the_agent_stays(
    tmp_path: Path,
    workspace: Path,  # noqa: F811 (the fixture)
) -> None:
    rng = random.Random(SEED)

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            sid = await start(agent, workspace)
            maker = FrameMaker(rng, sid, str(workspace))
            ids = list(range(FIRST_ID, FIRST_ID + FRAMES))
            for request_id in ids:
                if rng.random() < 0.05:
                    agent.write_raw(rng.choice([b"{\n", b"\xff\xfe\n", b"[1, 2]\n", b"null\n"]))
                frame = maker.frame(request_id)
                agent.write_raw(json.dumps(frame).encode("utf-8", "surrogatepass") + b"\n")
                if rng.random() < 0.1:
                    cancel = {"jsonrpc": "2.0", "method": "session/cancel"}
                    agent.write_raw(json.dumps({**cancel, "params": {"sessionId": sid}}).encode())
                    agent.write_raw(b"\n")
            while not all(i in answers_by_id(agent.raw) for i in ids):
                agent.traffic.clear()
                await agent.traffic.wait()
            answers = answers_by_id(agent.raw)
            for request_id in ids:
                (answer,) = answers[request_id]
                if "error" in answer:
                    assert answer["error"]["code"] != INTERNAL_ERROR, answer
            final = await agent.conn.prompt(session_id=sid, prompt=text("still there?"))
            assert final.stop_reason in ("end_turn", "cancelled")
            assert await agent.close_stdin() == 0
            agent.check_frames()
            assert b"Traceback" not in agent.stderr, agent.stderr.decode(errors="replace")

    run(scenario())
