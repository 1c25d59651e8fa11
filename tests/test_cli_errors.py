"""Bad command lines fail at once with one clear line and exit status 2, before any model loads,
and leave nothing behind that would refuse the corrected command."""

from __future__ import annotations

import json

import pytest

from dspark.cli import main


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return str(path)


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a command line that is wrong")

    monkeypatch.setattr("dspark.llm.LLM.from_config", refuse)
    monkeypatch.setattr("dspark.train.drafter_init.load_target", refuse)


def _fails(argv: list[str], capsys, words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags,words", [
    (["--shard-size", "0"], "--shard-size must be >= 1"), (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 1"), (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1"), (["--sample-share", "1.5"], "--sample-share"),
    (["--time-budget-minutes", "0"], "--time-budget-minutes"), (["--gamma", "0"], "--gamma must be > 0"),
    (["--loss-weights", "0.1,0.9"], "--loss-weights wants CE,L1,BCE"),
    (["--loss-weights", "0,0,1"], "--loss-weights wants CE,L1,BCE"),
    (["--loss-weights", "0.1,-1,1"], "--loss-weights wants CE,L1,BCE"),
    (["--loss-weights", "a,b,c"], "--loss-weights wants CE,L1,BCE"),
    (["--lr", "-1"], "--lr must be a number >= 0"), (["--lr", "nan"], "--lr must be a number >= 0"),
    (["--target-layers", "1,99"], "--target-layers wants distinct"), (["--target-layers", "1,1"], "in [0, 29]"),
    (["--target-layers", "a"], "(the target has 30 layers)"),
])
def test_train_drafter_numbers(flags, words, prompts, tmp_path, capsys):
    _fails(["train-drafter", "--prompts", prompts, "--out", str(tmp_path / "run"), *flags], capsys, words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line,words", [
    ("{bad json", ":2: not valid JSON"), ('["a list"]', ":2: each line must be a JSON object"),
    ('{"turns": [5]}', ":2: a row needs"), ('{"prompt": ""}', ":2: a row needs"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', ":2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
     ":2: the last of 'messages' must be a user message"),
])
def test_bad_prompt_lines_are_named(line, words, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    _fails(["train-drafter", "--prompts", str(path), "--out", str(tmp_path / "run"), "--data-only"], capsys, words)
    _fails(["bench", "--prompts", str(path), "--methods", "ar", "--num-prompts", "2"], capsys, words)


def test_a_model_that_fails_to_load_records_nothing(prompts, tmp_path, capsys):
    out = tmp_path / "run"
    _fails(["train-drafter", "--prompts", prompts, "--out", str(out), "--model", str(tmp_path / "nope")], capsys,
           "does not exist")
    assert not (out / "data" / "meta.json").exists()  # the corrected command is not refused


@pytest.mark.parametrize("argv,words", [
    (["eval-drafter", "--drafter", "x", "--per-category", "0"], "--per-category must be >= 1"),
    (["eval-drafter", "--drafter", "x", "--temperature", "-1"], "temperature"),
    (["eval-drafter", "--drafter", "x", "--ngram-assist", "-1"], "--ngram-assist must be >= 0"),
    (["generate", "--prompt", "hi", "--ngram-assist", "-2"], "ngram_assist must be an integer >= 0"),
    (["eval-drafter", "--drafter", "x", "--out", "/nonexistent/dir/r.json"], "does not exist"),
    (["bench", "--methods", "ar", "--output", "/nonexistent/dir/r.json"], "does not exist"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "does not exist"),
    (["generate", "--prompt", "hi", "--drafter", "/nonexistent/drafter"], "is not a folder"),
    (["serve", "--model", "/nonexistent/model"], "does not exist"),
    (["serve", "--enable-auto-tool-choice"], "--tool-call-parser"),
    (["serve", "--enable-auto-tool-choice", "--tool-call-parser", "xml"], "hermes, llama3_json"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "--prompt", "hi", "--temperature", "inf"], "temperature must be a finite number"),
    (["eval-drafter", "--drafter", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["eval-drafter", "--drafter", "ngram"], "eval-drafter measures a drafter folder"),
    (["generate", "--prompt", "hi", "--spec-policy", "threshold", "--threshold", "2"], "threshold must be"),
    (["serve", "--port", "99999"], "--port must be in [0, 65535]"),
    (["generate", "--prompt", "hi", "--raw", "--chat-template", "x.jinja"], "no effect with --raw"),
    (["generate", "--prompt", "hi", "--dtype", "f32"], "choose auto, fp32 (float32), bf16"),
    (["serve", "--shutdown-timeout", "-5"], "--shutdown-timeout must be"),
])
def test_checked_before_loading(argv, words, prompts, capsys):
    if argv[0] == "eval-drafter":
        argv = [*argv, "--prompts", prompts]
    _fails(argv, capsys, words)
