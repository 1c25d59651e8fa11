"""Tensor-parallel shards of a Llama-family target (Megatron-style, as vLLM and SGLang split it).

Each rank holds 1/N of every decoder layer: the q/k/v heads and the gate/up rows (column
parallel: no communication), the matching input columns of o_proj and down_proj (row parallel:
their partial outputs are summed over the ranks), 1/N of the KV heads in its cache, and 1/N of
the vocabulary rows of the embedding (a token's row lives on one rank; the others add zeros) and
of the LM head (each rank scores its rows; the logits are gathered). A rank reads only its slices
of the safetensors files. The per-rank shard is an ordinary LlamaModel of a narrower config, so
the forward is the single-process one with two all-reduces per layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dspark.dist.group import Group
from dspark.models.gguf_tensors import GGUFTensors
from dspark.models.llama import LlamaConfig, LlamaModel
from dspark.models.quantize import quantize_model


def check_divisible(c: LlamaConfig, world: int) -> None:
    """A clear error when the model's heads or MLP width do not split over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    sizes = {"attention heads": c.num_attention_heads, "KV heads": c.num_key_value_heads,
             "MLP intermediate size": c.intermediate_size}
    bad = [f"{n} {name}" for name, n in sizes.items() if n % world]
    if bad:
        raise ValueError(f"--tensor-parallel-size {world} does not divide the model: it has "
                         f"{', '.join(bad)} (each must be a multiple of {world})")


def local_config(c: LlamaConfig, world: int) -> LlamaConfig:
    """The shape of one rank's shard."""
    return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // world,
                               num_key_value_heads=c.num_key_value_heads // world,
                               intermediate_size=c.intermediate_size // world)


class RowParallel(nn.Module):
    """A linear over this rank's slice of the input features; the ranks' outputs are summed."""

    def __init__(self, inner: nn.Module, group: Group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor, rows=None) -> torch.Tensor:  # noqa: ANN001 - packed.RowSplit
        return self.group.all_reduce(self.inner(x, rows))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [lo, lo + rows) on this rank; a token's vector comes from the rank holding it."""

    def __init__(self, weight: torch.Tensor, lo: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lo, self.group = lo, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[..., None]
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """LM-head rows [rank * per, (rank + 1) * per) on this rank (zero rows pad the last shard); every
    rank ends with the full logits."""

    def __init__(self, weight: torch.Tensor, vocab: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab, self.group = vocab, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.all_gather(F.linear(h, self.weight)), -1)[..., :self.vocab]


class _Slices:
    """Reads slices of named tensors from a folder's safetensors files (never the whole file), or
    from the GGUF a converted folder indexes (a tensor de-quantized whole, then sliced)."""

    def __init__(self, folder: str):
        self.gguf = GGUFTensors.load(folder)
        self.where: dict[str, tuple[Path, str]] = {}  # name -> (file, its key there)
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    self.where[k.removeprefix("model.")] = (f, k)
        self.handles: dict[Path, object] = {}

    def _entry(self, name: str):  # noqa: ANN202 - the GGUF index entry of name, if any
        by_hf = self.gguf.by_hf if self.gguf is not None else {}
        return by_hf.get(f"model.{name}", by_hf.get(name))

    def has(self, name: str) -> bool:
        return name in self.where or self._entry(name) is not None

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if not self.has(name):
            raise ValueError(f"checkpoint is missing {name}")
        if name in self.where:
            f, key = self.where[name]
            if f not in self.handles:
                self.handles[f] = safe_open(str(f), "pt")
            sl = self.handles[f].get_slice(key)
        else:  # a GGUF's tensor: de-quantized whole, sliced as a safetensors slice would be
            sl = self.gguf.dense(self._entry(name))
        if rows is None and cols is None:
            return sl[:]
        return sl[rows or slice(None), cols] if cols is not None else sl[rows]


def _vocab_rows(t: torch.Tensor, lo: int, per: int) -> torch.Tensor:
    """Rows [lo, lo + per) of t, zero-padded past its end."""
    out = t.new_zeros(per, t.shape[1])
    part = t[lo:lo + per]
    out[:part.shape[0]] = part
    return out


def load_shard(folder: str, c: LlamaConfig, rank: int, world: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's weights under the shard's own (fused) names; vocabulary slices included."""
    src = _Slices(folder)
    lc = local_config(c, world)
    hd = c.head_dim
    qs, ks = lc.num_attention_heads * hd, lc.num_key_value_heads * hd
    q_rows, kv_rows = slice(rank * qs, (rank + 1) * qs), slice(rank * ks, (rank + 1) * ks)
    inter = lc.intermediate_size
    i_rows = slice(rank * inter, (rank + 1) * inter)
    sd: dict[str, torch.Tensor] = {}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            sd[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(
                [src.get(f"{p}self_attn.q_proj.{kind}", q_rows), src.get(f"{p}self_attn.k_proj.{kind}", kv_rows),
                 src.get(f"{p}self_attn.v_proj.{kind}", kv_rows)])
        sd[f"{p}self_attn.o_proj.weight"] = src.get(f"{p}self_attn.o_proj.weight", cols=q_rows)
        sd[f"{p}mlp.gate_up_proj.weight"] = torch.cat([src.get(f"{p}mlp.gate_proj.weight", i_rows),
                                                       src.get(f"{p}mlp.up_proj.weight", i_rows)])
        sd[f"{p}mlp.down_proj.weight"] = src.get(f"{p}mlp.down_proj.weight", cols=i_rows)
        for norm in ("input_layernorm", "post_attention_layernorm") + (("self_attn.q_norm", "self_attn.k_norm")
                                                                       if c.qk_norm else ()):
            sd[f"{p}{norm}.weight"] = src.get(f"{p}{norm}.weight")
    sd["norm.weight"] = src.get("norm.weight")
    per = -(-c.vocab_size // world)
    rows = slice(rank * per, (rank + 1) * per)
    sd["embed_tokens.weight"] = _vocab_rows(src.get("embed_tokens.weight", rows), 0, per)
    head = "embed_tokens.weight" if c.tie_word_embeddings or not src.has("lm_head.weight") else "lm_head.weight"
    sd["lm_head.weight"] = _vocab_rows(src.get(head, rows), 0, per)
    return {k: v.to(dtype) for k, v in sd.items()}


def build_shard(folder: str, c: LlamaConfig, group: Group, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """This rank's LlamaModel shard, its row-parallel projections and vocabulary-parallel ends
    wired to the group (the model must divide: check_divisible). The layers stay dense
    (pre-packed on CPU in bf16)."""
    lc = local_config(c, group.world)
    sd = load_shard(folder, c, group.rank, group.world, dtype)
    model = LlamaModel(dataclasses.replace(lc, tie_word_embeddings=False))
    embed, head = sd.pop("embed_tokens.weight"), sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m not in ("embed_tokens.weight", "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"shard weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.to(device, dtype).eval()
    model.quantization = quantize_model(model, "none")
    per = embed.shape[0]
    model.embed_tokens = VocabParallelEmbedding(embed.to(device), group.rank * per, group)
    model.lm_head = ParallelLMHead(head.to(device), c.vocab_size, group)
    model.config = c  # callers read the whole model's shape (vocab, layers, eos)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    return model


class VocabView(nn.Module):
    """The target's whole embedding and LM head (and config) on rank 0: what drafters read of the
    target, outside the collectives of its vocabulary-parallel shards."""

    def __init__(self, config: LlamaConfig, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)


def vocab_view(folder: str, c: LlamaConfig, device: torch.device, dtype: torch.dtype) -> VocabView:
    src = _Slices(folder)
    embed = src.get("embed_tokens.weight").to(device, dtype)
    tied = c.tie_word_embeddings or not src.has("lm_head.weight")
    head = embed if tied else src.get("lm_head.weight").to(device, dtype)
    return VocabView(c, embed, head)

