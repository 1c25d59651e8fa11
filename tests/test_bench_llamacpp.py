"""`dspark bench --methods llamacpp`: llama.cpp on the engine's GGUF, and every method's ratio to it."""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace

import pytest
from spec_helpers import save_tiny_target

from dspark.bench import llamacpp
from dspark.bench.cli import format_methods
from dspark.bench.offline import MethodRun, summarize
from dspark.cli import main


def _prompts(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Name three primary colors."}, {"prompt": "What is 2 + 3?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_hf_folder_is_refused_before_anything_loads(tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = save_tiny_target(tmp_path / "target")
    rc = main(["bench", "--model", str(folder), "--methods", "ar,llamacpp", "--prompts", str(_prompts(tmp_path)),
               "--max-tokens", "2", "--device", "cpu"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and "needs a GGUF model" in err and "[bench] loading" not in err


def test_missing_llama_cpp_names_the_install(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read: the check fails first")
    rc = main(["bench", "--model", str(gguf), "--methods", "llamacpp", "--prompts", str(_prompts(tmp_path)),
               "--max-tokens", "2", "--device", "cpu"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and "pip install llama-cpp-python" in err
    assert llamacpp.llamacpp_gguf(str(gguf)) == str(gguf.resolve())


def test_every_method_reports_its_ratio_to_llamacpp() -> None:
    runs = {"llamacpp": MethodRun(token_ids=[[1, 2, 3]], ttfts=[0.01], decode_tokens=200, decode_time=2.0,
                                  info={"batching": "sequential", "n_threads": 2}),
            "ar": MethodRun(token_ids=[[1, 2, 4]], ttfts=[0.02], decode_tokens=100, decode_time=2.0, stats=[]),
            "hf": MethodRun(token_ids=[[1, 2, 3]], ttfts=[0.03], decode_tokens=30, decode_time=1.0)}
    ref = dict(runs)
    out = {m: summarize(m, r, ref) for m, r in runs.items()}
    assert out["llamacpp"]["vs_llamacpp"] == 1.0 and out["ar"]["vs_llamacpp"] == 0.5
    assert out["hf"]["vs_llamacpp"] == 0.3 and out["llamacpp"]["speedup_vs_ar"] == 2.0
    assert out["llamacpp"]["batching"] == "sequential" and out["llamacpp"]["matches_ar"] == 0.0
    assert "vs_llamacpp" not in summarize("ar", runs["ar"], {"ar": runs["ar"]})
    table = format_methods({"methods": {**out, "dspark": {"error": "boom"}}, "batch_size": 4})
    head, *rows = table.splitlines()
    assert "vs llama.cpp" in head and "vs hf" in head
    assert rows[0].split()[0] == "llamacpp" and rows[1].split()[-1] == "0.5" and "error" in rows[3]
    assert "one after another" in table  # batch size 4: llama.cpp's sequential requests are said


class _FakeLlama:
    """Records resets and the tokens each generate call starts from; yields a fixed stream."""

    def __init__(self, stream: list[int]):
        self.stream, self.calls, self.seeds = stream, [], []
        self.n_tokens = 0

    def set_seed(self, seed: int) -> None:
        self.seeds.append(seed)

    def reset(self) -> None:
        self.n_tokens = 0

    def generate(self, tokens: list[int], **kw):  # noqa: ANN201
        self.calls.append((self.n_tokens, list(tokens), kw["temp"], kw["top_k"]))
        self.n_tokens = len(tokens)
        for tok in self.stream:
            yield tok
            self.n_tokens += 1


def test_requests_start_clean_stop_at_eos_and_time_decode_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    m = object.__new__(llamacpp.LlamaCppMethod)
    m.llm, m.eos_ids, m.max_tokens, m.run = _FakeLlama([5, 6, 2, 7]), {2}, 10, MethodRun()
    m.temperature, m.seed = 0.0, 0
    clock = iter([0.0, 0.5, 0.6, 0.7, 10.0, 10.2, 10.3, 10.4])  # t0, then one stamp per token
    monkeypatch.setattr(llamacpp, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    m.measure([[9, 9, 9], [9, 9, 9]])  # the same prompt twice: no reuse of the first's KV
    assert [c[0] for c in m.llm.calls] == [0, 0] and all(c[1] == [9, 9, 9] for c in m.llm.calls)
    assert all(c[2] == 0.0 and c[3] == 1 for c in m.llm.calls)  # greedy
    assert m.run.token_ids == [[5, 6, 2], [5, 6, 2]]  # EOS kept, nothing after it
    assert m.run.ttfts == pytest.approx([0.5, 0.2]) and m.run.decode_tokens == 4
    assert m.run.decode_time == pytest.approx(0.2 + 0.2)
    m.max_tokens, m.run = 2, MethodRun()
    clock = iter([0.0, 1.0, 2.0])
    m.measure([[1]])
    assert m.run.token_ids == [[5, 6]] and m.run.decode_time == pytest.approx(1.0)


def test_bench_llamacpp_end_to_end(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp")
    from dspark.models.loader import ModelLoadError, default_model_path

    try:
        gguf = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    rc = main(["bench", "--prompts", str(_prompts(tmp_path)), "--num-prompts", "2", "--max-tokens", "8",
               "--methods", "llamacpp,ar", "--kv-cache-tokens", "1024", "--threads", "1"])
    assert rc == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    lc, ar = report["methods"]["llamacpp"], report["methods"]["ar"]
    assert "error" not in lc and "error" not in ar, report["methods"]
    assert lc["requests"] == 2 and 0 < lc["tokens"] <= 16 and lc["decode_tok_s"] > 0 and lc["ttft_ms"] > 0
    assert lc["gguf"] == str(pathlib.Path(gguf).resolve()) and lc["n_threads"] == 1
    assert lc["vs_llamacpp"] == 1.0 and ar["vs_llamacpp"] > 0 and lc["matches_ar"] is not None
    assert "vs llama.cpp" in err


def test_llamacpp_evaluates_the_whole_prompt_every_time() -> None:
    """llama-cpp-python would reuse the KV of a repeated prompt (no prefill at all); the method resets."""
    pytest.importorskip("llama_cpp")
    from dspark.models.loader import ModelLoadError, default_model_path, resolve_model_folder

    try:
        gguf = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    m = llamacpp.LlamaCppMethod(gguf, resolve_model_folder(None), max_tokens=4, n_ctx=64, threads=1)
    evals: list[int] = []
    real_eval = m.llm.eval
    m.llm.eval = lambda tokens: (evals.append(len(tokens)), real_eval(tokens))[1]
    prompt = [1, 4093, 198, 19556, 2]
    m.measure([prompt, prompt])
    assert m.run.token_ids[0] == m.run.token_ids[1] and len(m.run.token_ids[0]) >= 1
    assert evals.count(len(prompt)) == 2  # the full prompt, both times


def test_sampled_requests_are_seeded_in_order_after_warmup() -> None:
    """--temperature: request i of the measured run samples with seed + i over the whole
    vocabulary, whatever the warm-up ran before it."""
    m = object.__new__(llamacpp.LlamaCppMethod)
    m.llm, m.eos_ids, m.max_tokens, m.run = _FakeLlama([5, 2]), {2}, 10, MethodRun()
    m.temperature, m.seed = 0.7, 40
    m.warm([[1], [2]])
    m.measure([[1], [2], [3]])
    assert m.llm.seeds[2:] == [40, 41, 42]
    assert all(c[2] == 0.7 and c[3] == 0 for c in m.llm.calls)
