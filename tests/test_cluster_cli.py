"""``greenroom serve --nats`` flags: an unreachable NATS is one clear line and exit 2, not a
traceback or a hang; the flags are in the help (R-CLUSTER-1)."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.test_cli import greenroom


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_nats_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    result = greenroom(
        tmp_path, "serve", "--nats", f"nats://127.0.0.1:{_closed_port()}", "--port", "0",
        "--no-console", "--data-dir", str(tmp_path / "data"), "--workspace", str(tmp_path / "ws"),
    )
    assert result.returncode == 2, result.stderr
    assert "greenroom serve: --nats: cannot reach NATS at nats://127.0.0.1:" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_cluster_flags_are_documented(tmp_path: Path) -> None:
    help_text = greenroom(tmp_path, "serve", "--help").stdout
    for flag in ("--nats", "--host-id", "--lease-ttl"):
        assert flag in help_text
    assert "cluster-demo" in greenroom(tmp_path, "--help").stdout
    bad = greenroom(tmp_path, "serve", "--nats", "nats://x:1", "--lease-ttl", "0")
    assert bad.returncode == 2 and "--lease-ttl" in bad.stderr
