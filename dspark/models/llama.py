"""Llama-family decoder (Llama/SmolLM2, Qwen2, Qwen3, Mistral) on the paged KV cache.

One forward takes a flat ragged batch: the new tokens of many sequences, their
positions, and an attention backend already planned for the batch layout. It
returns the final hidden states and, for the drafter, the residual stream
after any requested layers (HF's hidden_states[l + 1]). Logits are computed
separately, only for the rows that need them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class LlamaConfig:
    """The subset of an HF config.json the Llama family needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_id: list[int]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        mt = cfg.get("model_type", "")
        if mt not in SUPPORTED:
            archs = cfg.get("architectures") or [mt]
            raise ValueError(f"unsupported architecture {archs[0]!r} (model_type {mt!r}); "
                             f"dspark runs {', '.join(sorted(SUPPORTED))}")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=cfg.get("bos_token_id"),
        )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with llama3 scaling when the config asks for it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv.float()


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position (half-split layout, like HF)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        with torch.device("cpu"):  # real values even for a model built on the meta device
            self._exact = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", self._exact.clone(), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # A model cast to bf16 must keep float32 frequencies (as HF does): bf16 ones are off by up
        # to 0.4%, which turns into a phase error of ~0.35 rad at distance 256 and grows with it.
        super()._apply(fn, recurse)
        self.inv_freq = self._exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def cpu_reduced_precision(x: torch.Tensor) -> bool:
    """bf16/fp16 on CPU: where kernels' summation order shows in the rounded result."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"


def exact_dtype(x: torch.Tensor) -> torch.dtype:
    """Precision for a reduction whose result is rounded back to x's dtype.

    On CPU in bf16/fp16 this is float64. A token decoded alone and the same token verified in a
    chain reach the same values through kernels that sum in different orders; in float32 those
    last-bit differences cross a bf16 rounding boundary often enough to flip greedy choices (so
    speculative output would stop matching plain decoding), in float64 practically never. GPUs
    keep float32, as HF does."""
    return torch.float64 if cpu_reduced_precision(x) else torch.float32


class Linear(nn.Linear):
    """nn.Linear whose one-row calls run as two rows on CPU in bf16/fp16: oneDNN's one-row
    kernel sums in another order than its many-row one (measured: 16 of 198 rows differ for
    a 1536-wide input), so a decoded token would get other bits than the same token verified."""

    def forward(self, x: torch.Tensor, rows=None) -> torch.Tensor:  # noqa: ANN001 - rows: packed.RowSplit
        if x.shape[0] == 1 and cpu_reduced_precision(x):
            return super().forward(x.expand(2, *x.shape[1:]).contiguous())[:1]
        return super().forward(x)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does (float64 where exact_dtype says)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.to(exact_dtype(x))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class Attention(nn.Module):
    """GQA self-attention with fused qkv; K/V go to the paged cache via the backend."""

    def __init__(self, c: LlamaConfig, in_features: int | None = None):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # in_features: an EAGLE-3 head attends over [token embedding; hidden state], twice as wide
        self.qkv_proj = Linear(in_features or c.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=c.qkv_bias)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else None
        self.scale = self.hd ** -0.5

    def forward(self, x, cos, sin, attn, k_cache, v_cache, rows=None):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, rows).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k, v = q.view(n, self.nh, self.hd), k.view(n, self.nkv, self.hd), v.view(n, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attn.forward(q, k, v, k_cache, v_cache, self.scale)
        return self.o_proj(o.reshape(n, -1), rows)


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x, rows=None):
        gate, up = self.gate_up_proj(x, rows).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, rows)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, attn, k_cache, v_cache, rows=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, k_cache, v_cache, rows)
        return h + self.mlp(self.post_attention_layernorm(h), rows)


class LlamaModel(nn.Module):
    """A Llama-family causal LM on the paged cache."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, kv,
                capture: tuple[int, ...] = (), rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final normed hidden [N, H], concatenated captured layers [N, m*H] or None).
        rows (a packed.RowSplit) tells packed and quantized linears which rows are prompt tokens."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        taken = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn, kv.k[i], kv.v[i], rows)
            if i in capture:
                taken[i] = h
        # in the order the drafter lists its layers, which need not be sorted
        feats = torch.cat([taken[i] for i in capture], -1) if capture else None
        return self.norm(h), feats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits in the model's dtype: greedy verification only needs their argmax, and
        whoever needs probabilities casts them (bf16 -> fp32 is exact, so nothing changes)."""
        return self.lm_head(hidden)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up; refuse missing tensors."""
        own = {}
        for name, t in sd.items():
            name = name.removeprefix("model.")
            own[name] = t
        c = self.config
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
                parts = [own.pop(f"{p}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
                if any(t is None for t in parts):
                    raise ValueError(f"checkpoint is missing {p}self_attn.q/k/v_proj.{kind}")
                own[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
            gate, up = own.pop(f"{p}mlp.gate_proj.weight", None), own.pop(f"{p}mlp.up_proj.weight", None)
            if gate is None or up is None:
                raise ValueError(f"checkpoint is missing {p}mlp.gate_proj/up_proj")
            own[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        if c.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
