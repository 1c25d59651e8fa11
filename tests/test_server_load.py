"""The server while its engine loads in the background: 503 "loading", a load failure reported,
and a shutdown that does not wait for a load still running."""

from __future__ import annotations

import threading
import time

import pytest

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
