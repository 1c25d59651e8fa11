"""Widen a llama-family model (and its DSpark drafter) into a bigger shape with the same function.

Every weight is zero-padded so that the widened hidden state is the original's followed by zeros:

- query head i of KV group j (``g`` query heads a group) goes to widened query head ``j * g' + i % g``
  and KV head j stays KV head j, so every real query head keeps its keys and values; padded query
  heads have zero q rows and zero ``o_proj`` columns (their uniform attention adds nothing);
- the MLP gets zero rows (gate, up) and zero columns (down), the embedding and LM head zero columns;
- an RMSNorm over ``H' > H`` of ``[x, 0]`` gives ``rms_H(x) * sqrt(H / H')``: with ``c = H / H'`` the
  widened norm weight is ``w * sqrt(c)`` (zeros on the padded features) and the widened eps is
  ``eps * c``, since then ``mean' + eps' = c (mean + eps)`` and ``x w' / sqrt(mean' + eps') =
  x w / sqrt(mean + eps)`` for every input;
- q/k norms (Qwen3, the DSpark drafter) run over the head dimension, which does not change, but they
  share the config's one eps: the q and k rows are scaled by ``sqrt(c)`` instead, so that
  ``s q / sqrt(s^2 mean + c eps) = q / sqrt(mean + eps)`` with ``s^2 = c``;
- rotary embeddings act within a head and the head dimension stays, so RoPE is unchanged (and so
  is llama.cpp's per-head row interleaving of q/k in a GGUF: heads move whole).

The functions work on HF-named state dicts (``widen_llama``), on one GGUF file streamed tensor by
tensor with its tokenizer metadata kept as it is (``widen_gguf``), and on a DSpark drafter folder
(``widen_drafter``). ``scripts/widen.py`` is the command line.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# the 2B shape of issue 59: SmolLM2-1.7B's width with SmolLM2-135M's depth and GQA groups of 4
WIDE_2B = {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8}


@dataclass(frozen=True)
class Widening:
    """One model's shape before and after widening (the head dimension never changes)."""

    hidden: int
    new_hidden: int
    intermediate: int
    new_intermediate: int
    heads: int
    new_heads: int
    kv_heads: int
    new_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        problems = []
        for what, old, new in (("hidden", self.hidden, self.new_hidden),
                               ("intermediate", self.intermediate, self.new_intermediate),
                               ("heads", self.heads, self.new_heads), ("kv_heads", self.kv_heads, self.new_kv_heads)):
            if new < old:
                problems.append(f"{what} {new} < {old}")
        if self.heads % self.kv_heads or self.new_heads % self.new_kv_heads:
            problems.append("query heads must be a multiple of KV heads")
        elif self.new_group < self.group:
            problems.append(f"widened GQA group {self.new_group} < original {self.group}")
        if problems:
            raise ValueError("cannot widen: " + "; ".join(problems))

    @classmethod
    def for_config(cls, cfg: dict, hidden: int, intermediate: int, heads: int, kv_heads: int) -> Widening:
        """The widening of an HF-style config dict (a target's or a drafter's) to the given shape."""
        h = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], new_hidden=hidden, intermediate=cfg["intermediate_size"],
                   new_intermediate=intermediate, heads=h, new_heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or h, new_kv_heads=kv_heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // h)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def new_group(self) -> int:
        return self.new_heads // self.new_kv_heads

    @property
    def ratio(self) -> float:
        """c = H / H': the factor on eps, and its square root on norm weights."""
        return self.hidden / self.new_hidden

    def eps(self, eps: float) -> float:
        """The widened RMSNorm eps."""
        return eps * self.ratio

    def q_heads(self) -> list[int]:
        """Widened query head of each original query head (KV groups kept)."""
        return [(i // self.group) * self.new_group + i % self.group for i in range(self.heads)]

    def kv_map(self) -> list[int]:
        return list(range(self.kv_heads))


def _pad(w: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """w in the leading corner of a zero tensor of the given shape."""
    out = w.new_zeros(shape)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def _place_heads(w: torch.Tensor, where: list[int], count: int, head_dim: int, dim: int) -> torch.Tensor:
    """Move head blocks of head_dim along dim (0: rows, 1: columns) to heads `where` of `count`."""
    w = w.movedim(dim, 0)
    out = w.new_zeros((count * head_dim, *w.shape[1:]))
    for i, j in enumerate(where):
        out[j * head_dim:(j + 1) * head_dim] = w[i * head_dim:(i + 1) * head_dim]
    return out.movedim(0, dim)


# HF tensor name suffix -> how it widens
_KINDS = {
    "embed_tokens.weight": "embed", "lm_head.weight": "embed", "norm.weight": "norm",
    "input_layernorm.weight": "norm", "post_attention_layernorm.weight": "norm", "hidden_norm.weight": "norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "head_norm", "self_attn.k_norm.weight": "head_norm",
    "mlp.gate_proj.weight": "in_mlp", "mlp.up_proj.weight": "in_mlp", "mlp.down_proj.weight": "out_mlp",
}


def tensor_kind(name: str) -> str | None:
    """How the HF-named tensor widens (None: a name the widening does not know)."""
    for suffix, kind in _KINDS.items():
        if name == suffix or name.endswith("." + suffix):
            return kind
    return None


def widen_tensor(kind: str, w: torch.Tensor, wd: Widening, qk_norm: bool = False) -> torch.Tensor:
    """One weight (HF [out, in] layout, or GGUF rows: heads move whole either way) widened.
    qk_norm: the model norms q and k per head (their rows are then scaled by sqrt(c))."""
    H, I, D = wd.new_hidden, wd.new_intermediate, wd.head_dim
    s = math.sqrt(wd.ratio) if qk_norm else 1.0
    if kind == "embed":
        return _pad(w, (w.shape[0], H))
    if kind == "norm":
        return _pad(w * math.sqrt(wd.ratio), (H,))
    if kind == "head_norm":
        return w.clone()
    if kind in ("q", "q_bias"):
        w = _place_heads(w, wd.q_heads(), wd.new_heads, D, 0) * s
        return w if kind == "q_bias" else _pad(w, (w.shape[0], H))
    if kind in ("k", "v", "k_bias", "v_bias"):
        w = _place_heads(w, wd.kv_map(), wd.new_kv_heads, D, 0) * (s if kind[0] == "k" else 1.0)
        return w if kind.endswith("bias") else _pad(w, (w.shape[0], H))
    if kind == "o":
        return _pad(_place_heads(w, wd.q_heads(), wd.new_heads, D, 1), (H, wd.new_heads * D))
    if kind == "in_mlp":
        return _pad(w, (I, H))
    if kind == "out_mlp":
        return _pad(w, (H, I))
    raise ValueError(f"unknown tensor kind {kind!r}")


def widen_llama_config(cfg: dict, wd: Widening) -> dict:
    """An HF llama/qwen config.json dict in the widened shape."""
    out = dict(cfg)
    out.update(hidden_size=wd.new_hidden, intermediate_size=wd.new_intermediate, num_attention_heads=wd.new_heads,
               num_key_value_heads=wd.new_kv_heads, head_dim=wd.head_dim,
               rms_norm_eps=wd.eps(cfg.get("rms_norm_eps", 1e-6)))
    return out


def widen_llama(cfg: dict, sd: dict[str, torch.Tensor], wd: Widening) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of an HF llama/qwen2/qwen3 model widened by wd."""
    qk_norm = cfg.get("model_type") == "qwen3"
    out = {}
    for name, w in sd.items():
        kind = tensor_kind(name)
        if kind is None:
            raise ValueError(f"cannot widen tensor {name!r}")
        out[name] = widen_tensor(kind, w, wd, qk_norm).contiguous()
    return widen_llama_config(cfg, wd), out


def widen_hf_folder(src: str | pathlib.Path, dst: str | pathlib.Path, wd: Widening,
                    dtype: torch.dtype = torch.float32) -> str:
    """Widen an HF model folder (config.json, *.safetensors, tokenizer files) into dst."""
    from safetensors.torch import save_file

    from dspark.models.loader import load_config, load_state_dict

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    cfg, sd = widen_llama(load_config(str(src)), load_state_dict(str(src), torch.float32), wd)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "source.txt") and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return str(dst)


# --------------------------------------------------------------------------- GGUF
def _gguf_kind(name: str) -> str | None:
    from dspark.models.loader import gguf_hf_name

    hf = gguf_hf_name(name)
    return None if hf is None else tensor_kind(hf)


def gguf_widening(reader, hidden: int, intermediate: int, heads: int, kv_heads: int) -> Widening:  # noqa: ANN001
    """The widening of an open GGUFReader's model to the given shape."""
    from dspark.models.loader import gguf_heads

    arch, n_head, n_kv = gguf_heads(reader)
    h = int(reader.fields[f"{arch}.embedding_length"].contents())
    ff = int(reader.fields[f"{arch}.feed_forward_length"].contents())
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    return Widening(hidden=h, new_hidden=hidden, intermediate=ff,
                    new_intermediate=intermediate, heads=n_head, new_heads=heads, kv_heads=n_kv,
                    new_kv_heads=kv_heads, head_dim=int(q.shape[1]) // n_head)


def widen_gguf(src: str | pathlib.Path, dst: str | pathlib.Path, hidden: int, intermediate: int, heads: int,
               kv_heads: int, out_type: str = "F16", name: str | None = None,
               progress: Callable[[str], None] | None = None) -> Widening:
    """Write dst: the GGUF src widened, every 2-D weight as out_type ("F16" or "F32"), 1-D ones
    (norms) as F32, metadata (tokenizer, chat template, rope) copied except the shape keys, the
    eps and the file type. Streams one tensor at a time (memory: about one widened tensor)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    wd = gguf_widening(reader, hidden, intermediate, heads, kv_heads)
    arch = reader.fields["general.architecture"].contents()
    qk_norm = any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors)
    np_type = {"F16": np.float16, "F32": np.float32}[out_type]
    file_type = {"F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32}[out_type]
    changed = {f"{arch}.embedding_length": wd.new_hidden, f"{arch}.feed_forward_length": wd.new_intermediate,
               f"{arch}.attention.head_count": wd.new_heads, f"{arch}.attention.head_count_kv": wd.new_kv_heads}
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        key = field.name
        if key == "general.architecture" or key.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key in changed:
            value = changed[key]
        elif key == f"{arch}.attention.layer_norm_rms_epsilon":
            value = wd.eps(float(value))
        elif key == "general.file_type":
            value = int(file_type)
        elif key == "general.name" and name:
            value = name
        elif key == "general.size_label":
            continue
        writer.add_key_value(key, value, kind, sub_type=sub)

    plan = []
    for t in reader.tensors:
        kind = _gguf_kind(t.name)
        if kind is None:
            raise ValueError(f"cannot widen GGUF tensor {t.name!r}")
        shape = tuple(int(d) for d in reversed(t.shape))
        new_shape = _widened_shape(kind, shape, wd)
        dtype = np.float32 if len(new_shape) == 1 else np_type
        nbytes = int(np.prod(new_shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(t.name, new_shape, np.dtype(dtype), nbytes)
        plan.append((t, kind, shape, dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (t, kind, shape, dtype) in enumerate(plan):
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32))
        wide = widen_tensor(kind, w, wd, qk_norm)
        assert tuple(wide.shape) == _widened_shape(kind, shape, wd), t.name
        writer.write_tensor_data(wide.numpy().astype(dtype))
        if progress is not None and (i % 40 == 0 or i == len(plan) - 1):
            progress(f"{i + 1}/{len(plan)} tensors")
    writer.close()
    return wd


def _widened_shape(kind: str, shape: tuple[int, ...], wd: Widening) -> tuple[int, ...]:
    H, I, q, kv = wd.new_hidden, wd.new_intermediate, wd.new_heads * wd.head_dim, wd.new_kv_heads * wd.head_dim
    return {"embed": (shape[0], H), "norm": (H,), "head_norm": shape, "q": (q, H), "k": (kv, H), "v": (kv, H),
            "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "o": (H, q), "in_mlp": (I, H), "out_mlp": (H, I)}[kind]


# --------------------------------------------------------------------------- DSpark drafter
def widen_drafter_state(cfg: dict, sd: dict[str, torch.Tensor], wd: Widening,
                        target_hidden: int, new_target_hidden: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, checkpoint tensors) of a DSpark/DFlash drafter (checkpoint names: fc,
    hidden_norm, layers.N.*, norm, markov_head.*, confidence_head.*, draft_to_target) widened by wd,
    for a target whose hidden state grew from target_hidden to new_target_hidden (zeros appended):
    its drafts from the widened target's hidden states equal today's from the original's."""
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        key = name.removeprefix("model.")
        if key == "fc.weight":  # [H, m * H_t]: each captured layer's block of columns padded
            m = w.shape[1] // target_hidden
            blocks = [_pad(b, (w.shape[0], new_target_hidden)) for b in w.split(target_hidden, 1)]
            out[name] = _pad(torch.cat(blocks, 1), (wd.new_hidden, m * new_target_hidden))
        elif key == "confidence_head.proj.weight":  # [1, H (+ markov rank)]: [h ; W1[prev]]
            h, extra = w[:, :wd.hidden], w[:, wd.hidden:]
            out[name] = torch.cat([_pad(h, (w.shape[0], wd.new_hidden)), extra], 1)
        elif key.startswith(("markov_head.", "confidence_head.proj.bias", "draft_to_target")):
            out[name] = w.clone()
        else:
            kind = tensor_kind(key)
            if kind is None:
                raise ValueError(f"cannot widen drafter tensor {name!r}")
            # float32: a bf16 checkpoint's norm weights times sqrt(c) do not round back exactly
            out[name] = widen_tensor(kind, w.float(), wd, qk_norm=True)
        out[name] = out[name].contiguous()
    new_cfg = widen_llama_config(cfg, wd)
    return new_cfg, out


def widen_drafter(src: str | pathlib.Path, dst: str | pathlib.Path, hidden: int, intermediate: int, heads: int,
                  kv_heads: int, target_hidden: int, new_target_hidden: int,
                  dtype: torch.dtype | None = None) -> Widening:
    """Widen a drafter folder (config.json + model.safetensors) into dst; dtype: the stored one
    (None: float32 for the widened weights, which keeps the widening exact for a bf16 checkpoint
    too, the heads' tensors as they were)."""
    from safetensors.torch import save_file

    from dspark.models.drafters.checkpoint import read_drafter_folder

    cfg, sd = read_drafter_folder(src)
    wd = Widening.for_config(cfg, hidden, intermediate, heads, kv_heads)
    new_cfg, new_sd = widen_drafter_state(cfg, sd, wd, target_hidden, new_target_hidden)
    if dtype is not None:
        new_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in new_sd.items()}
    dst = pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(new_sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    return wd
