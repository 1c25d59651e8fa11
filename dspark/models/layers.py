"""Layers shared by the target models and the drafters: linear, RMS norm, rotary embedding,
paged-cache attention, SwiGLU MLP and the pre-norm decoder layer.

A drafter file holds only what differs from these (DSpark's Markov and confidence heads, EAGLE-3's
wider attention input). ``c`` below is a ``llama.LlamaConfig`` (or any object with its fields).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dspark.models.llama import LlamaConfig


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


class _NoInitOnMeta:
    """A module whose weights on the meta device (placeholders for weights about to be loaded) get
    no random init: torch's init there imports torch._dynamo and triton, ~0.14 GB resident for the
    life of a server that never compiles anything."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Embedding(_NoInitOnMeta, nn.Embedding):
    """nn.Embedding without a random init on the meta device."""


class Linear(_NoInitOnMeta, nn.Linear):
    """nn.Linear whose one-row calls run as two rows on CPU in bf16/fp16: oneDNN's one-row
    kernel sums in another order than its many-row one (measured: 16 of 198 rows differ for
    a 1536-wide input), so a decoded token would get other bits than the same token verified.
    No random init on the meta device."""

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

    def project(self, x: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """q [..., nh, hd], k and v [..., nkv, hd] of x [..., in] (q/k normed where the config says;
        no rotary yet)."""
        q, k, v = self.qkv_proj(x, rows).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        lead = x.shape[:-1]
        q = q.reshape(*lead, self.nh, self.hd)
        k, v = k.reshape(*lead, self.nkv, self.hd), v.reshape(*lead, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated k and v of rows that only serve as context (a drafter's cache): the q rows of the
        fused weight are skipped where the weight is a plain tensor (not pre-packed)."""
        w = getattr(self.qkv_proj, "weight", None)
        if w is None:
            _, k, v = self.project(x)
            return apply_rotary(k, cos, sin), v
        b = self.qkv_proj.bias
        nq = self.nh * self.hd
        return self.rotated_kv(F.linear(x, w[nq:], None if b is None else b[nq:]), cos, sin)

    def rotated_kv(self, kv_rows: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k and v outputs of the fused projection [..., 2 * nkv * hd] -> rotated (k normed
        where the config says) k and v [..., nkv, hd]."""
        k, v = kv_rows.split(self.nkv * self.hd, -1)
        lead = kv_rows.shape[:-1]
        k, v = k.reshape(*lead, self.nkv, self.hd), v.reshape(*lead, self.nkv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, attn, k_cache, v_cache, rows=None):
        n = x.shape[0]
        q, k, v = self.project(x, rows)
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


