"""EAGLE-3 draft heads in the published layout (EAGLE-3, SpecForge, vLLM and SGLang checkpoints).

One decoder layer whose attention reads [token embedding; hidden state] (twice the hidden width).
The hidden state at position i is the fused low/mid/high target features ``fc([f_low; f_mid;
f_high])`` while they exist, and the head's own output for positions it drafts beyond them; the
embedding is of token i + 1, so the output at position i predicts token i + 2. The head has its
own reduced vocabulary: ``d2t[d]`` is added to draft id d to give the target id.

Checkpoint keys: fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, d2t, t2d, and optionally embed_tokens.weight (else the target's is shared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.models.layers import MLP, Attention, RMSNorm, Rotary
from dspark.models.llama import LlamaConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """The head's layer shape plus its vocabulary map and the target layers it reads."""

    layer: LlamaConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # HF hidden_states indices (the inputs of these target layers)
    raw: dict

    @classmethod
    def from_hf(cls, cfg: dict, target: LlamaConfig) -> Eagle3Config:
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported (one layer)")
        layer = LlamaConfig.from_hf({**cfg, "model_type": "llama"})
        n = target.num_hidden_layers
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        return cls(layer, cfg.get("draft_vocab_size") or layer.vocab_size,
                   cfg.get("target_hidden_size") or layer.hidden_size, list(aux), cfg)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs (dspark's capture) are hidden_states[aux_layer_ids]."""
        return tuple(i - 1 for i in self.aux_layer_ids)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding); norm(hidden)], residual on hidden."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, in_features=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)

    def forward(self, emb, hidden, cos, sin, attn, k_cache, v_cache):
        h = hidden + self.self_attn(self.inputs(emb, hidden), cos, sin, attn, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc + one layer + norm + reduced-vocabulary LM head; the embedding is the target's unless owned."""

    def __init__(self, config: Eagle3Config, own_embed: bool = False):
        super().__init__()
        self.config = c = config
        H = c.layer.hidden_size
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3Layer(c.layer)
        self.norm = RMSNorm(H, c.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.layer.vocab_size, H) if own_embed else None
        self.rotary = Rotary(c.layer.head_dim, c.layer.rope_theta, c.layer.rope_scaling)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.layer.vocab_size, dtype=torch.bool))
        self._shared: tuple[nn.Module] | None = None  # the target's embedding, not registered as ours

    def attach(self, target) -> None:
        self._shared = (target.embed_tokens,)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self._shared[0])(ids)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft-vocabulary id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn, kv) -> torch.Tensor:
        """One forward (ids: the tokens after each row's position; hidden: fused features or the
        head's previous output) -> pre-norm output, the next step's hidden."""
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.midlayer(self.embed(ids), hidden, cos, sin, attn, kv.k[0], kv.v[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float logits over the draft vocabulary."""
        return self.lm_head(self.norm(h)).float()

    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv,
                      next_ids: torch.Tensor) -> None:
        """K/V of committed positions from the target's features and the tokens after them: one
        layer, so a position's K/V need no attention over the others."""
        x = self.midlayer.inputs(self.embed(next_ids), self.fc(feats))
        k, v = self.midlayer.self_attn.kv(x, *self.rotary(positions, x.dtype))
        kv.k[0].index_copy_(0, slots, k)
        kv.v[0].index_copy_(0, slots, v)


def eagle3_hf_config(target: LlamaConfig, draft_vocab_size: int, intermediate_size: int | None = None) -> dict:
    """config.json of a new head for ``target``: its layer shaped like one of the target's."""
    n = target.num_hidden_layers
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": target.hidden_size,
            "intermediate_size": intermediate_size or target.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
            "rope_scaling": target.rope_scaling, "max_position_embeddings": target.max_position_embeddings,
            "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target.hidden_size, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [min(2, n), max(1, n // 2), max(1, n - 3)]}}


def _from_checkpoint_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k.removeprefix("model."): v for k, v in sd.items()}
    p = "midlayer."
    if all(f"{p}self_attn.{x}_proj.weight" in out for x in "qkv"):
        out[f"{p}self_attn.qkv_proj.weight"] = torch.cat([out.pop(f"{p}self_attn.{x}_proj.weight") for x in "qkv"])
    if f"{p}mlp.gate_proj.weight" in out and f"{p}mlp.up_proj.weight" in out:
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([out.pop(f"{p}mlp.gate_proj.weight"),
                                                        out.pop(f"{p}mlp.up_proj.weight")])
    return out


def _to_checkpoint_names(sd: dict[str, torch.Tensor], layer: LlamaConfig) -> dict[str, torch.Tensor]:
    out = dict(sd)
    p = "midlayer."
    q, k, v = out.pop(f"{p}self_attn.qkv_proj.weight").split(
        [layer.num_attention_heads * layer.head_dim] + [layer.num_key_value_heads * layer.head_dim] * 2)
    out.update({f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k, f"{p}self_attn.v_proj.weight": v})
    out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = out.pop(f"{p}mlp.gate_up_proj.weight").chunk(2)
    return out


def load_eagle3(cfg: dict, sd: dict[str, torch.Tensor], target, dtype: torch.dtype, device, path: str) -> Eagle3Head:
    """An EAGLE-3 head from its config.json and tensors, checked against and attached to the target."""
    tc = target.config
    c = Eagle3Config.from_hf(cfg, tc)
    problems = []
    if c.layer.vocab_size != tc.vocab_size:
        problems.append(f"vocab {c.layer.vocab_size} != target vocab {tc.vocab_size}")
    if c.target_hidden_size != tc.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != the target's hidden size {tc.hidden_size}")
    bad = [i for i in c.aux_layer_ids if not 1 <= i <= tc.num_hidden_layers]
    if bad:
        problems.append(f"aux hidden-state layers {bad} outside 1..{tc.num_hidden_layers}")
    sd = _from_checkpoint_names(sd)
    own_embed = "embed_tokens.weight" in sd
    if not own_embed and c.layer.hidden_size != tc.hidden_size:
        problems.append(f"hidden size {c.layer.hidden_size} differs from the target's and it has no embed_tokens")
    if problems:
        raise ValueError(f"EAGLE-3 head {path} does not fit the target model: " + "; ".join(problems))
    head = Eagle3Head(c, own_embed)
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "t2d"]  # t2d is d2t's inverse, rebuilt below
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 checkpoint {path} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    ids = head.draft_to_target
    if ids.min() < 0 or ids.max() >= tc.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"EAGLE-3 checkpoint {path}: d2t must map its {c.draft_vocab_size} draft ids to distinct "
                         f"target ids below {tc.vocab_size}")
    head.t2d.zero_()[ids] = True
    head.attach(target)
    return head.to(device, dtype).eval()


def save_eagle3(head: Eagle3Head, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json + model.safetensors in the published layout (shared target weights left out)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
          for k, v in _to_checkpoint_names(sd, head.config.layer).items()}
    save_file(sd, str(path / "model.safetensors"))
    c = head.config
    cfg = {**c.raw, "architectures": [ARCHITECTURE], "draft_vocab_size": c.draft_vocab_size,
           "target_hidden_size": c.target_hidden_size, "num_hidden_layers": 1,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)}}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
