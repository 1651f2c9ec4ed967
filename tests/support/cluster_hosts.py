"""``greenroom serve --nats`` host processes for the cluster tests (trio, as the bridge's
guest): started with a scripted model server and the side-effect tool, their stderr kept
for assertions, their gateway URL and token read when they are ready — a cluster host once
it also takes sessions placed by other hosts, so a test never races a host's start."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tests" / "support" / "cluster_tools.py"
_URL = re.compile(r"listening on (ws://[\w.:]+/v1)")
PLACEABLE = "takes sessions placed by other hosts"
"""What a cluster host logs once other gateways may place sessions on it."""


@attrs.define
class HostProcess:
    """One host: its id, process, gateway URL, token and everything it logged (``logged_at``:
    when each line arrived, ``time.time()``)."""

    host_id: str
    process: trio.Process
    url: str
    token: str
    log: list[str]
    news: list[trio.Event]
    ended: trio.Event
    logged_at: list[float] = attrs.Factory(list)

    def logged(self, text: str) -> bool:
        """Whether some line of the host's log so far contains ``text``."""
        return any(text in line for line in self.log)

    async def wait_logged(self, *texts: str) -> None:
        """Return once a line containing one of ``texts`` is logged; AssertionError when
        the host's log ends without one."""
        while not any(self.logged(t) for t in texts):
            assert not self.ended.is_set(), f"host {self.host_id} ended: {self.log}"
            await self.news[0].wait()


async def start_host(
    nursery: trio.Nursery,
    tmp_path: Path,
    host_id: str,
    *,
    nats_url: str | None,
    model_url: str,
    effects: Path,
    lease_ttl_s: float,
    approve: str = "all",
    tokens_file: Path | None = None,
    extra_tools: tuple[str, ...] = (),
    data_dir: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HostProcess:
    """Start host ``host_id`` and return once its gateway listens and, in a cluster, it
    takes placed sessions (``nats_url`` None: a single-host ``serve``, for comparisons).
    ``approve`` is ``serve --approve``; with ``tokens_file`` the host knows those
    principals (and ``token`` is empty); ``extra_tools`` are more ``serve --tools``
    beside the side-effect tools; ``data_dir`` (default ``tmp_path / host_id``) lets a host
    start again on the data dir of one that stopped, under a new id; ``extra_env`` is set in
    the host's environment."""
    data = data_dir if data_dir is not None else tmp_path / host_id
    workspace = tmp_path / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(
        ANTHROPIC_API_KEY="k",
        GREENROOM_HOME=str(tmp_path / "home"),
        GREENROOM_TEST_EFFECTS=str(effects),
        NO_COLOR="1",
    )
    env.update(extra_env or {})
    cluster = (
        ["--nats", nats_url, "--host-id", host_id, "--lease-ttl", str(lease_ttl_s)]
        if nats_url is not None
        else []
    )
    principals = ["--tokens-file", str(tokens_file)] if tokens_file is not None else []
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "greenroom",
            "serve",
            *cluster,
            "--port",
            "0",
            "--no-console",
            "--data-dir",
            str(data),
            "--workspace",
            str(workspace),
            "--provider",
            "anthropic",
            "--base-url",
            model_url,
            "--model",
            "mock-model",
            "--tools",
            str(TOOLS),
            *(f"--tools={t}" for t in extra_tools),
            "--no-builtin-tools",
            "--approve",
            approve,
            *principals,
        ],
        env=env,
        stderr=-1,
    )
    assert process.stderr is not None
    log: list[str] = []
    logged_at: list[float] = []
    news = [trio.Event()]
    ready = trio.Event()
    ended = trio.Event()
    found: dict[str, Any] = {}

    async def read_log() -> None:
        assert process.stderr is not None
        buffered = b""
        async for chunk in process.stderr:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                log.append(line)
                logged_at.append(time.time())
                news[0].set()
                news[0] = trio.Event()
                match = _URL.search(line)
                if match:
                    found["url"] = match.group(1)
                    ready.set()
        ended.set()
        ready.set()
        news[0].set()

    nursery.start_soon(read_log)
    await ready.wait()
    assert "url" in found, f"host {host_id} did not start: {log}"
    token = "" if tokens_file is not None else (data / "serve.token").read_text().strip()
    host = HostProcess(
        host_id=host_id,
        process=process,
        url=found["url"],
        token=token,
        log=log,
        news=news,
        ended=ended,
        logged_at=logged_at,
    )
    if nats_url is not None:
        await host.wait_logged(PLACEABLE)
    return host
