"""One import root, ``greenroom``, in both kinds of install: the editable one the
repository's own venv uses, and a normal one built as a wheel into a fresh venv. Both must
resolve ``greenroom``, ``greenroom.actors`` and ``greenroom.protocols`` from the
repository's two folders, and nothing under a bare name like ``actors``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["version"]
BUILD_TIMEOUT_S = 240

PROBE = """
import importlib.util, json, sys
import greenroom, greenroom.actors, greenroom.protocols
from greenroom import Host, Session, ToolContext, tool, user_text
from greenroom.actors.scripted import Reply, text
print(json.dumps({
    "root": greenroom.__file__,
    "actors": greenroom.actors.__file__,
    "protocols": greenroom.protocols.__file__,
    "version": greenroom.__version__,
    "host": Host.__module__,
    "bare": [str(importlib.util.find_spec(n)) for n in ("actors", "protocols")],
}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _probe(python: str | Path, cwd: Path) -> dict[str, object]:
    result = subprocess.run(
        [str(python), "-c", PROBE], cwd=cwd, env=_clean_env(),
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    probed: dict[str, object] = json.loads(result.stdout)
    return probed


def _is_editable(cwd: Path) -> bool:
    """Whether this venv installed greenroom in editable mode (asked from outside the
    repository, whose build metadata would answer first on this process's path)."""
    code = (
        "import importlib.metadata as m, json\n"
        "url = json.loads(m.distribution('greenroom').read_text('direct_url.json') or '{}')\n"
        "print(bool(url.get('dir_info', {}).get('editable')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=_clean_env(),
        capture_output=True, text=True, check=True, timeout=60,
    )
    return result.stdout.strip() == "True"


def test_editable_install_resolves_the_root_from_the_repository(tmp_path: Path) -> None:
    if not _is_editable(tmp_path):
        pytest.skip("greenroom is not installed in editable mode here")
    probed = _probe(sys.executable, tmp_path)
    assert probed["root"] == str(ROOT / "actors" / "_root" / "__init__.py")
    assert probed["actors"] == str(ROOT / "actors" / "__init__.py")
    assert probed["protocols"] == str(ROOT / "protocols" / "__init__.py")
    assert probed["version"] == VERSION
    assert probed["host"] == "greenroom.actors.runtime.host"
    assert probed["bare"] == ["None", "None"]


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of a copy of the sources (the build writes nothing into the repository)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("actors", "protocols"):
        shutil.copytree(ROOT / name, source / name, ignore=junk)
    # This venv's setuptools builds offline when it can; an older one (before 70.1 it
    # needs the separate wheel package) leaves pip to fetch the declared build backend.
    setuptools_version = tuple(int(p) for p in metadata.version("setuptools").split(".")[:2])
    isolation = ["--no-build-isolation"] if setuptools_version >= (70, 1) else []
    dist = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
         "--disable-pip-version-check", "-q", "-w", str(dist), str(source)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = dist.glob("greenroom-*.whl")
    return wheel


def test_a_wheel_installs_the_root_and_both_layers(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {n for n in names if not n.startswith(f"greenroom-{VERSION}.dist-info/")}
    assert {"greenroom/__init__.py", "greenroom/py.typed", "greenroom/actors/__init__.py",
            "greenroom/actors/py.typed", "greenroom/actors/scripted.py",
            "greenroom/protocols/__init__.py", "greenroom/protocols/py.typed"} <= packaged
    assert all(n.startswith("greenroom/") for n in packaged), sorted(packaged)
    assert not [n for n in packaged if "_root" in n]

    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "-q", str(wheel)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The fresh venv borrows this venv's dependencies (trio, attrs…) through a .pth
    # line; the editable install's own .pth hook is not run from there.
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
    )
    (purelib / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    probed = _probe(python, tmp_path)
    installed = purelib / "greenroom"
    assert probed["root"] == str(installed / "__init__.py")
    assert probed["actors"] == str(installed / "actors" / "__init__.py")
    assert probed["protocols"] == str(installed / "protocols" / "__init__.py")
    assert probed["version"] == VERSION
    assert probed["bare"] == ["None", "None"]
