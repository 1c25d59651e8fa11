"""The server while its engine loads in the background: 503 "loading", a load failure reported,
and a shutdown that does not wait for a load still running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, wait_for

import dspark.server.app as app_module
from dspark.config import EngineConfig

testclient = pytest.importorskip("fastapi.testclient")


def test_shutdown_during_load_does_not_wait_for_it(monkeypatch):
    release = threading.Event()

    class SlowEngine:  # a model load that would take minutes
        def __init__(self, config):
            release.wait(60)
            raise RuntimeError("released")

    monkeypatch.setattr(app_module, "Engine", SlowEngine)
    timer = threading.Timer(30, release.set)  # never leave the thread behind for long
    timer.start()
    try:
        t0 = time.monotonic()
        with testclient.TestClient(app_module.create_app(EngineConfig())) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10, "shutdown waited for the load"
    finally:
        release.set()
        timer.cancel()


def test_load_failure_is_reported(monkeypatch):
    class BrokenEngine:
        def __init__(self, config):
            raise ValueError("no such model")

    monkeypatch.setattr(app_module, "Engine", BrokenEngine)
    with testclient.TestClient(app_module.create_app(EngineConfig())) as client:
        for _ in range(100):
            r = client.get("/health")
            if r.json()["status"] != "loading":
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "failed"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503
        assert "ValueError: no such model" in r.json()["error"]["message"]


def test_sigterm_during_load_exits_at_once(tmp_path):
    """`dspark serve` stopped before its engine is ready exits 0 at once (no abort, no wait)."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        try:
            seen = []

            def answered() -> bool:
                assert proc.poll() is None, log_path.read_text()
                try:
                    seen.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"])
                except httpx.TransportError:
                    return False
                return True

            assert wait_for(answered, 180, 0.02)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert code == 0, text
    if seen[0] != "loading":
        pytest.skip("the engine loaded before the server could be stopped")
    assert "stopped while the engine was loading" in text, text


def test_port_in_use_exits_with_failure(tmp_path):
    """`dspark serve` on a port another process holds exits non-zero promptly, without aborting
    (an empty cache keeps the engine loading while the bind fails)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root),
           "DSPARK_CACHE_DIR": str(tmp_path / "cache")}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "dspark.cli", "serve", "--drafter", "none",
                               "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=root, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode not in (0, -signal.SIGABRT, 134), text
    assert "terminate called" not in text and "Traceback" not in text, text
    assert "address already in use" in text and "stopped while the engine was loading" not in text, text
