"""Llama-family decoder (Llama/SmolLM2, Qwen2, Qwen3, Mistral) on the paged KV cache.

One forward takes a flat ragged batch: the new tokens of many sequences, their
positions, and an attention backend already planned for the batch layout. It
returns the final hidden states and, for the drafter, the residual stream
after any requested layers (HF's hidden_states[l + 1]). Logits are computed
separately, only for the rows that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.models.fused import decoder_forward, kernels_for
from dspark.models.layers import (  # noqa: F401 - re-exported: the layers' historical home
    MLP,
    Attention,
    DecoderLayer,
    Embedding,
    Linear,
    RMSNorm,
    Rotary,
    apply_rotary,
    cpu_reduced_precision,
    exact_dtype,
    rope_inv_freq,
)

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}
_FUSED_PARTS = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}  # a fused linear's HF parts, in order


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


class LlamaModel(nn.Module):
    """A Llama-family causal LM on the paged cache."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    @classmethod
    def for_loading(cls, c: LlamaConfig, materialize: bool = True) -> LlamaModel:
        """The model with its parameters allocated on CPU but not initialized, for weights about to
        be loaded: the random init they would replace costs a second or more at start-up.
        materialize=False leaves them on the meta device, for :meth:`load_hf_state_dict` with
        ``assign=True`` to take the loaded tensors as they are (no second copy)."""
        with torch.device("meta"):
            net = cls(c)
        if materialize:
            net.to_empty(device="cpu")
            if c.tie_word_embeddings:  # to_empty gives each module its own tensor
                net.lm_head.weight = net.embed_tokens.weight
        net.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)  # computed, never loaded
        return net

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, kv,
                capture: tuple[int, ...] = (), rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final normed hidden [N, H], concatenated captured layers [N, m*H] or None).
        rows (a packed.RowSplit) tells packed and quantized linears which rows are prompt tokens."""
        h = self.embed_tokens(input_ids)
        ops = kernels_for(h, attn)
        if ops is not None:
            return decoder_forward(self, ops, h, positions, attn, kv, capture, rows)
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

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], assign: bool = False,
                           absent: frozenset[str] = frozenset()) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up; refuse missing tensors. Consumes ``sd``
        (each part is dropped once fused, so a load never holds the model twice). assign: take the
        tensors as the parameters (a model from ``for_loading(materialize=False)``). absent: modules
        (fused linears as ``layers.3.mlp.gate_up_proj``, ``embed_tokens``) whose weights are not in
        ``sd`` and stay unloaded."""
        own = {name.removeprefix("model."): sd.pop(name) for name in list(sd)}
        c = self.config
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            for name, part_names in _FUSED_PARTS.items():
                for kind in ("weight", "bias") if c.qkv_bias and name == "self_attn.qkv_proj" else ("weight",):
                    if kind == "weight" and p + name in absent:
                        continue
                    parts = [own.pop(f"{p}{x}.{kind}", None) for x in part_names]
                    if any(t is None for t in parts):
                        raise ValueError(f"checkpoint is missing {p}{'/'.join(part_names)}.{kind}")
                    own[f"{p}{name}.{kind}"] = torch.cat(parts)
        if c.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=assign)
        own.clear()
        if assign and c.tie_word_embeddings:  # assign replaced the embedding the head was tied to
            self.lm_head.weight = self.embed_tokens.weight
        missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")
                   and m.rpartition(".")[0] not in absent]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
