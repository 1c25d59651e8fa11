"""The DSpark block drafter (and DFlash, the same backbone without its two heads).

One forward over [anchor, MASK x (B-1)] per request through the shared decoder layers
(layers.py): queries come from the block,
keys/values from [context; block] with no causal mask inside the block. The context
is the target's hidden states at `target_layer_ids`, fused by fc -> hidden_norm and
projected by each layer's k/v into the drafter's own paged cache, incrementally.
DSpark reads a draft from every slot (slot k predicts the token k+1 after the anchor)
and couples neighbours with a low-rank Markov head; DFlash drops the anchor slot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models import cpu_ops
from dspark.models.fused import decoder_forward, forget_stack, kernels_for
from dspark.models.layers import DecoderLayer, RMSNorm, Rotary
from dspark.models.llama import LlamaConfig
from dspark.models.quant import cpu_packable, draft_linear


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters, read from a DSpark (DeepSpec) or DFlash (z-lab) config.json."""

    kind: str  # "dspark" | "dflash"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    markov_rank: int = 0
    confidence_head: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # EAGLE-3-style reduced draft vocabulary: the drafter only proposes these many target tokens
    # (buffer `draft_to_target`, target ids); every other token has q = 0, so verification stays
    # exactly lossless. None: the full target vocabulary.
    draft_vocab_size: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_drafts(self) -> int:
        """Draft tokens one forward emits."""
        return self.block_size if self.kind == "dspark" else self.block_size - 1

    @classmethod
    def from_hf(cls, cfg: dict) -> DrafterConfig:
        archs = cfg.get("architectures") or []
        dflash = cfg.get("dflash_config")
        kind = "dflash" if any("DFlash" in a for a in archs) or (dflash is not None and "markov_rank" not in cfg) \
            else "dspark"
        sub = dflash or {}
        heads = cfg["num_attention_heads"]
        layer_ids = cfg.get("target_layer_ids") or sub.get("target_layer_ids")
        mask_id = cfg.get("mask_token_id", sub.get("mask_token_id"))
        if layer_ids is None or mask_id is None or "block_size" not in cfg:
            raise ValueError("drafter config.json needs block_size, mask_token_id and target_layer_ids")
        rope = cfg.get("rope_parameters") or {}
        return cls(
            kind=kind, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
            block_size=cfg["block_size"], mask_token_id=mask_id, target_layer_ids=list(layer_ids),
            num_target_layers=cfg.get("num_target_layers"),
            markov_rank=cfg.get("markov_rank", 0) if kind == "dspark" else 0,
            confidence_head=bool(cfg.get("enable_confidence_head", kind == "dspark")) and kind == "dspark",
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            draft_vocab_size=cfg.get("draft_vocab_size") if kind == "dspark" else None)

    def layer_config(self) -> LlamaConfig:
        """The backbone layers' shape: Qwen3-style decoder layers (q/k norms, no biases)."""
        return LlamaConfig(model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, max_position_embeddings=1 << 20, tie_word_embeddings=False,
                           qkv_bias=False, qk_norm=True, eos_token_id=[], bos_token_id=None)

    def to_hf(self) -> dict:
        """config.json in the DeepSpec DSpark layout."""
        d = asdict(self)
        d.pop("kind"), d.pop("extra")
        d["enable_confidence_head"] = d.pop("confidence_head")
        d.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", markov_head_type="vanilla",
                  confidence_head_with_markov=self.markov_rank > 0, tie_word_embeddings=False, **self.extra)
        if self.kind == "dflash":  # keep the kind: DFlash reads no anchor slot and has no heads
            d.update(architectures=["DFlashDraftModel"],
                     dflash_config={"mask_token_id": self.mask_token_id,
                                    "target_layer_ids": list(self.target_layer_ids)})
        return d


class KernelRMSNorm(RMSNorm):
    """RMSNorm through the fused CPU kernel outside autograd (one call instead of six torch ops),
    for a drafter at inference: drafts need no bit-equality with the torch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = None if torch.is_grad_enabled() else cpu_ops.for_tensor(x)
        if ops is None or self.weight.dtype != x.dtype:
            return super().forward(x)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class MarkovHead(nn.Module):
    """Low-rank bigram bias: logits_k += W2(W1[x_{k-1}]). W1 reads any target token (the anchor
    may lie outside a reduced draft vocabulary); W2 writes the draft vocabulary."""

    def __init__(self, vocab: int, rank: int, out_vocab: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab or vocab, bias=False)
        self._w2t: tuple | None = None  # (key, float32 W2 transposed) for frozen weights

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))

    def add_bias(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Float base + W2(W1[prev]) over W2's vocabulary. Frozen weights take one float32 addmm:
        on CPU a bf16 GEMM with 32 inputs runs ~3x slower than that (it is called once per draft
        slot, so it added ~1 ms to a batch-1 drafter pass)."""
        if self.markov_w2.weight.requires_grad or prev.dim() != 1:
            return base + self.bias(prev)
        return torch.addmm(base, self.markov_w1(prev).float(), self._frozen_w2t())

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """The float bias W2(W1[prev]) [.., V]; frozen weights through the float32 product (see
        add_bias)."""
        if self.markov_w2.weight.requires_grad:
            return self(prev).float()
        return self.markov_w1(prev).float() @ self._frozen_w2t()

    def _frozen_w2t(self) -> torch.Tensor:
        w = self.markov_w2.weight
        key = (w.data_ptr(), w.dtype, w.device)
        if self._w2t is None or self._w2t[0] != key:
            self._w2t = (key, w.detach().float().t().contiguous())
        return self._w2t[1]

    def greedy_walk(self, base: torch.Tensor, anchors: torch.Tensor,
                    to_target: torch.Tensor | None) -> torch.Tensor | None:
        """Target ids [R, K] of the greedy walk over float logits base [R, K, V] (W2's vocabulary)
        from the anchors [R], in one call of the fused CPU kernel; None where it does not run
        (training, another device, no kernels): walk slot by slot with add_bias instead."""
        ops = cpu_ops.for_tensor(base)
        if ops is None or self.markov_w2.weight.requires_grad or base.dtype != torch.float32:
            return None
        empty = torch.empty(0, dtype=torch.long)
        return ops.markov_walk(base.contiguous(), self.markov_w1.weight.contiguous(), self._frozen_w2t(),
                               anchors.contiguous(), empty if to_target is None else to_target.contiguous())


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])): will draft token k survive verification?"""

    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # in float32: a bf16 GEMM with one output column takes a slow path on CPU (~8x)
        return F.linear(feats.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class BlockDrafter(nn.Module):
    """DSpark / DFlash backbone + heads. embed_tokens / lm_head are the target's unless owned."""

    def __init__(self, c: DrafterConfig, target_hidden: int, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        self.config = c
        m = len(c.target_layer_ids)
        self.fc = nn.Linear(m * target_hidden, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # the shared decoder layer: block queries over [paged context K/V; block K/V], where the
        # context enters only through the cached K/V (write_context)
        layer = c.layer_config()
        self.layers = nn.ModuleList(DecoderLayer(layer) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embed else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if own_head else None
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank, c.draft_vocab_size) if c.markov_rank > 0 else None
        # target ids of the reduced draft vocabulary (None: the full one)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size) if c.draft_vocab_size else None)
        self._head_cache: tuple | None = None  # (key, rows of the LM head for the draft vocabulary)
        self._packed_head: tuple | None = None  # (those rows, their inference linear or None) for inference
        conf_in = c.hidden_size + (c.markov_rank if c.markov_rank > 0 else 0)
        self.confidence_head = ConfidenceHead(conf_in) if c.confidence_head else None
        # the target's embedding and head, kept in a tuple so they are not registered as ours
        self._shared: tuple[nn.Module, nn.Module] | None = None
        self._context_kv: tuple[nn.Module] | None = None  # every layer's context k/v rows (pack_context_kv)

    def attach(self, target) -> None:
        """Share the target's embedding and LM head where the checkpoint has none."""
        self._shared = (target.embed_tokens, target.lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self._shared[0])(ids)

    def _head_weight(self) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self._shared[1]
        w = head.weight
        if w is None:  # a shared head kept as codes (Int8Head over the file's blocks): its rows, once
            key = (id(head), None if self.draft_to_target is None else self.draft_to_target.data_ptr())
            if self._head_cache is None or self._head_cache[0] != key:
                self._head_cache = (key, head.rows(self.draft_to_target))
            return self._head_cache[1]
        if self.draft_to_target is None:
            return w
        key = (w.data_ptr(), w.dtype, w.device, w.requires_grad, self.draft_to_target.data_ptr())
        if self._head_cache is None or self._head_cache[0] != key:
            rows = w[self.draft_to_target]
            self._head_cache = (key, rows if w.requires_grad else rows.detach())
        return self._head_cache[1]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float logits over the draft vocabulary (the target's when there is no reduced one)."""
        w = self._head_weight()
        if self.draft_to_target is None or torch.is_grad_enabled():
            return F.linear(h, w).float()
        # inference: on CPU the rows packed once (aten::mm re-lays them every call), or int4; whether
        # they can be is decided with the packing, not on every pass
        if self._packed_head is None or self._packed_head[0] is not w:
            self._packed_head = (w, draft_linear(w) if cpu_packable(w) else None)
        packed = self._packed_head[1]
        return (F.linear(h, w) if packed is None else packed(h)).float()

    def to_target_vocab(self, logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Draft-vocabulary values -> [.., V] target-vocabulary ones, `fill` elsewhere."""
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), fill)
        return out.index_copy(-1, self.draft_to_target, logits)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary (-inf outside a reduced draft vocabulary)."""
        return self.to_target_vocab(self.draft_logits(h))

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Fused context features from the target's concatenated layer outputs."""
        return self.hidden_norm(self.fc(feats))

    def pack_context_kv(self, make) -> None:  # noqa: ANN001 - make: (weight, bias) -> an inference linear
        """Every layer's k and v rows of its fused qkv weight as one inference linear (before the
        layers' own projections are packed): a step's context write is then one product over the
        weights it needs instead of a qkv projection per layer, q rows included."""
        ws, bs = [], []
        for layer in self.layers:
            a = layer.self_attn
            nq = a.nh * a.hd
            ws.append(a.qkv_proj.weight[nq:])
            bs.append(None if a.qkv_proj.bias is None else a.qkv_proj.bias[nq:])
        bias = None if bs[0] is None else torch.cat(bs).detach()
        # a tuple: an inference copy, kept out of the module's parameters and state dict
        self._context_kv = (make(torch.cat(ws).detach(), bias),)

    def use_kernel_norms(self) -> None:
        """The context norm and the layers' q/k norms as KernelRMSNorm, same weights (inference)."""
        def kernel(norm: RMSNorm | None) -> RMSNorm | None:
            if norm is None:
                return None
            k = KernelRMSNorm(norm.weight.shape[0], norm.eps)
            k.weight = norm.weight
            return k

        self.hidden_norm = kernel(self.hidden_norm)
        for layer in self.layers:
            a = layer.self_attn
            a.q_norm, a.k_norm = kernel(a.q_norm), kernel(a.k_norm)
        forget_stack(self.layers)

    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv) -> None:
        """Project new context positions into every layer's cached K/V."""
        ctx = self.context(feats)
        cos, sin = self.rotary(positions, ctx.dtype)
        packed = None if torch.is_grad_enabled() else self._context_kv
        if packed is not None:  # every layer's k/v rows from one product
            a = self.layers[0].self_attn
            rows = packed[0](ctx).split(2 * a.nkv * a.hd, -1)
            if self._store_context_kv(rows, cos, sin, slots, kv):
                return
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            k, v = a.kv(ctx, cos, sin) if packed is None else a.rotated_kv(rows[i], cos, sin)
            kv.k[i].index_copy_(0, slots, k)
            kv.v[i].index_copy_(0, slots, v)

    def _store_context_kv(self, rows: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
                          slots: torch.Tensor, kv) -> bool:  # noqa: ANN001 - kv: a KVCache
        """Each layer's k (normed) and v rows into its cache through the fused rotary-and-store
        kernel, the one the block forward uses: a write of a step's few rows is then a handful
        of calls instead of a dozen torch ops per layer. False (nothing written) where the
        kernels do not run."""
        ops = cpu_ops.for_tensor(rows[0])
        if ops is None or not kv.k.dtype == rows[0].dtype == cos.dtype:
            return False
        a = self.layers[0].self_attn
        c, s = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        no_q = rows[0].new_empty(rows[0].shape[0], 0, a.hd)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            k, v = rows[i].split(a.nkv * a.hd, -1)
            k, v = k.reshape(-1, a.nkv, a.hd), v.reshape(-1, a.nkv, a.hd)
            k = a.k_norm(k) if a.k_norm is not None else k.contiguous()  # rotated in place
            ops.rope_store(no_q, k, v, c, s, kv.k[i], kv.v[i], slots)
        return True

    def block_hidden(self, ids: torch.Tensor, positions: torch.Tensor, attn, kv) -> torch.Tensor:
        """Run the block tokens (attn planned with mask "full") -> final normed hidden."""
        h = self.embed(ids)
        ops = kernels_for(h, attn)
        if ops is not None:
            return decoder_forward(self, ops, h, positions, attn, kv, (), None)[0]
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn, kv.k[i], kv.v[i])
        return self.norm(h)

    def draft_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """[R, B, H] block outputs -> [R, num_drafts, H]: the slots that carry drafts."""
        return h if self.config.kind == "dspark" else h[:, 1:]

    def step_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits of one draft slot given the previous token (Markov bias when present); base may be
        over the draft vocabulary (training) or the target's (inference, from head())."""
        if self.markov_head is None:
            return base
        if base.shape[-1] == self.markov_head.markov_w2.out_features:
            return self.markov_head.add_bias(base, prev)
        return base + self.to_target_vocab(self.markov_head(prev).float(), 0.0)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits [..] for draft slots given their previous tokens."""
        if self.confidence_head is None:
            return None
        feats = h if self.markov_head is None else torch.cat([h, self.markov_head.markov_w1(prev)], -1)
        return self.confidence_head(feats).float()
