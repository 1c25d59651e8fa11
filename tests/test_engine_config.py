"""Engine settings are checked before any weights load, `dspark serve` exits when the engine
cannot load instead of answering 503 forever, and text prompts get the tokenizer's special tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.cli import main
from dspark.config import EngineConfig, SpecConfig
from dspark.engine.engine import Engine

pytest.importorskip("transformers")

BAD = [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_seqs": -300}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"kv_cache_tokens": -1}, "kv_cache_tokens"),
    ({"kv_cache_tokens": 8}, "one page"), ({"page_size": 0}, "page_size"), ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": -5}, "max_model_len"), ({"dtype": "bf61"}, "dtype"), ({"device": "gpu9"}, "device"),
    ({"attention_backend": "flash"}, "attention backend"), ({"cuda_graph_batch_sizes": [0, 8]}, "cuda_graph"),
    ({"spec": SpecConfig(block_size=0)}, "block_size"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"spec": SpecConfig(policy="threshold", threshold=float("nan"))}, "threshold"),
    *([({"device": "cuda"}, "no CUDA device")] if not torch.cuda.is_available() else []),
]


@pytest.mark.parametrize("kwargs,words", BAD, ids=[w for _, w in BAD])
def test_bad_engine_config_is_refused_before_loading(kwargs, words, monkeypatch):
    def no_load(*args, **kw):
        raise AssertionError("weights were loaded for an invalid config")

    monkeypatch.setattr("dspark.models.loader.load_state_dict", no_load)
    with pytest.raises(ValueError, match=words):
        Engine(EngineConfig(model="/nonexistent", **kwargs))


def test_cli_reports_a_bad_flag(capsys):
    assert main(["generate", "--prompt", "hi", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be an integer >= 1" in capsys.readouterr().err


def test_flags_without_effect_are_warned_about(capsys):
    import argparse

    from dspark.cli import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)

    def warnings(argv: list[str], **kw) -> str:
        engine_config(p.parse_args(argv), **kw)
        return capsys.readouterr().err

    assert warnings([]) == "" and warnings(["--tree", "--tree-budget", "8", "--spec-policy", "threshold",
                                            "--threshold", "0.3"]) == ""
    assert "--threshold only applies" in warnings(["--threshold", "0.3"])
    assert "--threshold only applies" in warnings(["--threshold", "0.3"], default_policy="load-aware")
    assert "--tree-budget only applies with --tree" in warnings(["--tree-budget", "8"])
    assert warnings(["--tree-budget", "8"], tree_by_method=True) == ""  # bench's dspark-tree method
    assert "--drafter none" in warnings(["--drafter", "none", "--block-size", "4"])
    assert "--ngram-assist only applies to a neural drafter" in warnings(["--drafter", "ngram", "--ngram-assist", "3"])
    assert "--tree needs a DSpark drafter" in warnings(["--drafter", "ngram", "--tree"])
    spec = engine_config(p.parse_args(["--tree", "--tree-budget", "8"])).spec
    assert (spec.tree_budget, spec.threshold) == (8, 0.5)  # given values, else SpecConfig's defaults
    assert engine_config(p.parse_args([])).spec.tree_budget == 16
    assert engine_config(p.parse_args([])).spec.ngram_assist == 2
    assert engine_config(p.parse_args(["--ngram-assist", "0"])).spec.ngram_assist == 0


def test_serve_exits_when_the_engine_cannot_load(tmp_path):
    # a folder that exists (a missing path is refused before the port is bound) but holds no model
    root, empty = Path(__file__).resolve().parents[1], tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "serve", "--model", str(empty),
                           "--port", "0", "--log-level", "warning"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "loading the engine failed" in proc.stderr


def test_text_prompt_gets_the_tokenizers_bos(folders, monkeypatch):
    """A text prompt is encoded the way the tokenizer encodes text by default (a Llama tokenizer puts
    its BOS first, as vLLM's completions do); token ids and chat messages are not touched."""
    from spec_helpers import make_engine

    engine = make_engine(folders["target"])
    real = engine.tokenizer.encode

    def with_bos(text, add_special_tokens=True, **kw):
        return ([1] if add_special_tokens else []) + real(text, add_special_tokens=False, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", with_bos)
    assert engine.encode("Hello world") == [1] + real("Hello world", add_special_tokens=False)
    assert engine.encode([5, 6, 7]) == [5, 6, 7]


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


def test_chat_template_replaces_the_tokenizers(folders, tmp_path):
    from spec_helpers import make_engine

    from dspark.engine.prompts import ChatPrompt, render_chat

    msgs = [{"role": "user", "content": "Hi there"}]
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    for given in (TEMPLATE, str(path)):  # the template itself, or a file holding it
        engine = make_engine(folders["target"], chat_template=given)
        assert render_chat(engine.tokenizer, ChatPrompt(msgs)) == "<user>Hi there\n<assistant>"
        assert engine.encode(msgs) == engine.tokenizer.encode("<user>Hi there\n<assistant>", add_special_tokens=False)


def test_chat_template_takes_what_transformers_compiles():
    loop = "{% for m in messages %}{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    assert EngineConfig(chat_template=loop).resolved_chat_template() == loop  # loopcontrols, as transformers


@pytest.mark.parametrize(("template", "words"), [
    ("/no/such/template.jinja", "neither a file nor a Jinja template"),
    ("{% for m in messages %}{{ m }}", "does not parse"),
])
def test_bad_chat_template_is_refused_before_loading(template, words, monkeypatch):
    monkeypatch.setattr("dspark.models.loader.load_state_dict", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=words):
        Engine(EngineConfig(model="/nonexistent", chat_template=template))
    assert main(["generate", "--prompt", "hi", "--chat-template", template]) == 2
