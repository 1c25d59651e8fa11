"""A decoder stack (the target's, or a DSpark drafter's block) through the fused CPU kernels.

Same layers, same linears (int4/int8/pre-packed, tensor-parallel shards), fewer ops: per layer
one residual-add-and-norm call after attention and after the MLP, one rotary-and-cache-write
call, one attention call and one SwiGLU call. Used for every inference pass on CPU when the
kernels are available and the attention backend is the torch one, so a decoded token and the
same token verified always take this path.
"""

from __future__ import annotations

import torch


def kernels_for(h: torch.Tensor, attn):  # noqa: ANN001, ANN201 - attn: an attention backend; returns cpu_ops or None
    """The fused kernels when this pass can use them: CPU activations, the torch attention backend
    (FlashInfer keeps the modules' own forward) and no autograd (the kernels have no backward)."""
    if getattr(attn, "attend", None) is None or torch.is_grad_enabled():
        return None
    from dspark.models import cpu_ops

    return cpu_ops.for_tensor(h)


def decoder_forward(model, ops, h: torch.Tensor, positions: torch.Tensor, attn, kv,  # noqa: ANN001
                    capture: tuple[int, ...], rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaModel.forward after the embedding, with the fused kernels (see the module docstring).
    model: anything with ``rotary``, ``layers`` (layers.DecoderLayer) and a final ``norm``."""
    n = h.shape[0]
    cos, sin = model.rotary(positions, h.dtype)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    layers = model.layers
    x = ops.rms_norm(h, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
    taken = {}
    for i, layer in enumerate(layers):
        a = layer.self_attn
        q, k, v = a.project(x, rows)
        ops.rope_store(q, k, v, cos, sin, kv.k[i], kv.v[i], attn.slot_mapping)
        o = attn.attend(q, kv.k[i], kv.v[i], a.scale, ops)
        norm = layer.post_attention_layernorm
        h, x = ops.add_rms_norm(h, a.o_proj(o.view(n, -1), rows), norm.weight, norm.eps)
        m = layer.mlp
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        h, x = ops.add_rms_norm(h, m.down_proj(ops.silu_mul(m.gate_up_proj(x, rows)), rows), norm.weight, norm.eps)
        if i in capture:
            taken[i] = h
    feats = torch.cat([taken[i] for i in capture], -1) if capture else None
    return x, feats
