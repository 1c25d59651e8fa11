"""A decoder stack (the target's, or a DSpark drafter's block) through the fused CPU kernels.

Same layers, same linears (int4/int8/pre-packed, tensor-parallel shards), fewer ops: per layer
one residual-add-and-norm call after attention and after the MLP, one rotary-and-cache-write
call, one attention call and one SwiGLU call. Used for every inference pass on CPU when the
kernels are available and the attention backend is the torch one, so a decoded token and the
same token verified always take this path.

Where every linear is an int4/int8 product of ``cpu_ops.quant()`` (``amx_weights``), prompt rows
(if any) take no dense copy, and every attention group is a short one or a causal prompt chunk
with a fused kernel, the whole loop runs in C++
(``csrc/decode_stack.cpp``): the same kernels in the same order, so the same bits, without the
Python between them. Which layers qualify is worked out once per stack and kept on its ``layers``
list; code that swaps a stack's modules afterwards calls :func:`forget_stack` (the quantizer and
the packers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_STACK = "_decode_stack"  # where a layers list keeps its StackPlan (or None: the Python loop)


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
    plan = stack_plan(model, ops)
    if plan is not None and (rows is None or plan.prompt_kernel is not None) \
            and all(g.fused(ops, plan.shape[2]) for g in attn.groups):
        groups = [t for g in attn.groups for t in (g.gather, g.q_index, g.kernel_mask)]
        prompt = _NO_ROWS if rows is None else rows.prefill
        rest = _NO_ROWS if rows is None or rows.rest is None else rows.rest
        out = ops.decode_stack(h, plan.weights, kv.k, kv.v, cos, sin, attn.slot_mapping, groups, plan.shape,
                               plan.eps, list(capture), prompt, rest, plan.prompt_kernel or [])
        return out[0], (torch.cat(out[1:], -1) if capture else None)
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


_NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class StackPlan:
    """What ``decode_stack`` takes for one model: its flat weight list (see the C++ source), the
    attention shape (heads, kv heads, head dim), (norm eps, q/k norm eps, attention scale), and per
    layer and linear whether prompt rows take ``mm_prompt`` (None: some linear keeps a dense copy
    for them, so passes with prompt rows keep the Python loop)."""

    weights: list[torch.Tensor]
    shape: list[int]
    eps: list[float]
    prompt_kernel: list[int] | None = None


def forget_stack(module: nn.Module) -> None:
    """Drop the plans kept under ``module``: its linears or norms are about to be swapped."""
    for m in module.modules():
        m.__dict__.pop(_STACK, None)


def stack_plan(model, ops) -> StackPlan | None:  # noqa: ANN001 - model as decoder_forward's; ops: cpu_ops
    """The model's StackPlan, made on first use and kept on ``model.layers``; None when the
    kernels have no decoder stack or some layer is not in its form."""
    layers = model.layers
    if _STACK not in layers.__dict__:
        layers.__dict__[_STACK] = _make_plan(model) if hasattr(ops, "decode_stack") else None
    return layers.__dict__[_STACK]


def _norm_weight(norm, eps: set[float], dtype: torch.dtype) -> torch.Tensor | None:  # noqa: ANN001 - an RMSNorm
    w = getattr(norm, "weight", None)
    if w is None or w.dtype != dtype:
        return None
    eps.add(norm.eps)
    return w


def _make_plan(model) -> StackPlan | None:  # noqa: ANN001
    from dspark.models import cpu_ops
    from dspark.models.drafters.dspark import KernelRMSNorm  # the drafter's module imports this one

    layers = model.layers
    dtype = cpu_ops.quant_dtype()  # the stack's linears and norms all take it
    eps: set[float] = set()
    qk_eps: set[float] = set()
    none = torch.empty(0, dtype=dtype)
    first = _norm_weight(layers[0].input_layernorm, eps, dtype)
    weights = [first]
    prompt_kernel: list[int] | None = []
    for i, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        parts = [getattr(lin, "amx_weights", lambda: None)() for lin in linears]
        if any(p is None for p in parts):
            return None
        if prompt_kernel is not None:
            paths = [lin.prompt_path() for lin in linears]
            prompt_kernel = None if "dense" in paths else prompt_kernel + [int(p == "prompt") for p in paths]
        qk = [none, none]
        if a.q_norm is not None or a.k_norm is not None:
            if not (isinstance(a.q_norm, KernelRMSNorm) and isinstance(a.k_norm, KernelRMSNorm)):
                return None  # a target's q/k norms stay torch's (the exact path)
            qk = [_norm_weight(a.q_norm, qk_eps, dtype), _norm_weight(a.k_norm, qk_eps, dtype)]
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        weights += [*parts[0], *qk, *parts[1], _norm_weight(layer.post_attention_layernorm, eps, dtype),
                    *parts[2], *parts[3], _norm_weight(after, eps, dtype)]
    if any(w is None for w in weights) or len(eps) != 1 or len(qk_eps) > 1:
        return None
    a = layers[0].self_attn
    return StackPlan(weights, [a.nh, a.nkv, a.hd], [eps.pop(), qk_eps.pop() if qk_eps else 0.0, a.scale],
                     prompt_kernel)
