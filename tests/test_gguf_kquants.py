"""GGUF's k-quant blocks (Q6_K, Q5_K, and a Q4_K_M file's mix of Q4_K and Q6_K parts in one fused
linear) kept on our int8 kernels: exact codes and scales, the kernel's arithmetic, and the engine's
greedy speculative output against plain decoding of the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from spec_helpers import make_engine, require_kernels, run_requests
from test_quant import _q4_k_bytes, _write_quantized_gguf
from test_quant_amx import _int8_rows

from dspark.config import SamplingParams
from dspark.models import cpu_ops
from dspark.models.gguf_blocks import gguf_blocks
from dspark.models.quant import Int4Linear, Int4Weight, Int8Weight, Q8Linear

pytestmark = pytest.mark.usefixtures("single_thread")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _q6_k_bytes(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q6_K layout for w [N, K] (gguf-py writes none): per 16 inputs an int8 scale of
    the super-block's fp16 d, 6-bit codes q with w ~ d * sc * (q - 32)."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    step = np.abs(g).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    safe = lambda x: np.where(x > 0, x, 1).astype(np.float32)  # noqa: E731
    sc = np.clip(np.round(step / safe(d)[..., None]), -128, 127).astype(np.int8)
    q = np.clip(np.round(g / safe(d.astype(np.float32)[..., None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 128)  # two halves of 128 inputs
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)
    qh = sum(((q[..., 32 * s:32 * s + 32] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
    parts = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _f16(d).reshape(n, -1, 2)]
    return np.concatenate(parts, -1).reshape(n, -1)


def _q5_k_bytes(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q5_K layout: Q4_K's scales and mins (six bits each), 5-bit codes whose fifth bit
    sits in 32 bytes of its own."""
    n, k = w.shape
    q4 = _q4_k_bytes(w).reshape(n, k // 256, 144)  # the scale grid of 16 steps; here 32
    d, dmin = (q4[..., 0:2].copy().view(np.float16) / 2).astype(np.float16), q4[..., 2:4]
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(q4[..., 4:16].reshape(-1, 12).copy())
    g = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    step = (d.astype(np.float32).reshape(-1, 1) * sc).reshape(n, k // 256, 8, 1)
    off = (dmin.copy().view(np.float16).astype(np.float32).reshape(-1, 1) * m).reshape(n, k // 256, 8, 1)
    q = np.clip(np.round((g + off) / np.where(step > 0, step, 1)), 0, 31).astype(np.uint8).reshape(n, -1, 256)
    qh = sum(((q[..., 32 * i:32 * i + 32] >> 4) & 1) << i for i in range(8)).astype(np.uint8)
    pairs = q.reshape(n, -1, 4, 2, 32) & 15
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128)
    parts = [d.view(np.uint8).reshape(n, -1, 2), dmin, q4[..., 4:16], qh, qs]
    return np.concatenate(parts, -1).reshape(n, -1)


_WRITERS = {T.Q4_K: _q4_k_bytes, T.Q5_K: _q5_k_bytes, T.Q6_K: _q6_k_bytes}


def _weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, k, generator=g) * 0.05).numpy() * np.linspace(0.2, 3.0, k, dtype=np.float32))


@pytest.mark.parametrize("kind", [T.Q6_K, T.Q5_K], ids=lambda t: t.name)
def test_k_quant_blocks_round_trip(kind: T) -> None:
    """Codes and scales read from Q6_K / Q5_K blocks reproduce gguf's own de-quantization exactly."""
    w = _weights(8, 512)
    raw = _WRITERS[kind](w)
    ref = torch.from_numpy(dequantize(raw, kind).astype(np.float32))
    assert (ref - torch.from_numpy(w)).abs().max() < 0.05 * np.abs(w).max()  # a real quantization of w
    got = gguf_blocks(raw, kind.name, w.shape)
    assert isinstance(got, Int8Weight) and got.q.dtype == torch.int8
    torch.testing.assert_close(got.dequantize(), ref, atol=1e-6, rtol=0)


def test_k_quant_kernel_rows() -> None:
    """pack8's k-quant form (a scale per 16 inputs, an offset per 32): each row's product is the
    int8-rows reference within bf16 rounding, and the same bits alone or in any batch (VNNI rows
    and AMX tiles alike)."""
    amx = cpu_ops.quant()
    require_kernels(amx, quant=True)
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-32, 32, (64, 256), generator=g, dtype=torch.int8)
    scale, zero = torch.rand(64, 16, generator=g) * 0.01, torch.randn(64, 8, generator=g) * 0.01
    dtype = cpu_ops.quant_dtype()
    lin = Q8Linear(codes, scale, amx, int8_rows=True, dtype=dtype, zero=zero)
    w = Int8Weight(codes, scale.half().float(), zero.half().float()).dequantize().double()
    x = torch.randn(40, 256, generator=g).to(dtype)
    x[3] = 0
    got = lin(x)
    ref = _int8_rows(x) @ w.t()
    assert (got.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    for rows in (1, 3, 8, 9, 16, 40):
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(rows)]), lin(x[:rows]))
    # the two halves' scales are not interchangeable: swapping them changes the product
    swapped = Q8Linear(codes, scale.view(64, 8, 2).flip(-1).reshape(64, 16), amx, int8_rows=True, dtype=dtype,
                       zero=zero)
    assert not torch.allclose(swapped(x).float(), got.float(), atol=1e-2)
    if hasattr(amx, "mm_prompt"):  # AMX: prompt rows on bf16 tiles, the weights expanded once
        from dspark.models.packed import RowSplit

        wb = w.float().bfloat16().double()
        for z in (zero, None):  # the k-quant form, and plain Q8_0-like codes
            lin_z = lin if z is not None else Q8Linear(codes, scale[:, ::2].contiguous(), amx, int8_rows=True,
                                                        dtype=dtype)
            plain_w = Int8Weight(codes, scale[:, ::2].half().float())
            w_z = wb if z is not None else plain_w.dequantize().bfloat16().double()
            prompt = amx.mm_prompt(x, lin_z.packed, lin_z.scale, lin_z.sums)
            ref_z = x.double() @ w_z.t()
            assert (prompt.double() - ref_z).abs().max() <= 2 ** -8 * ref_z.abs().max()
            y = lin_z(x, RowSplit.of([30, 10], [30, 0], x.device))
            assert torch.equal(y[:30], prompt[:30]) and torch.equal(y[30:], lin_z(x[30:]))
    with pytest.raises(RuntimeError, match=r"offsets must be \[N, K / 32\]"):
        amx.pack8(codes, scale, zero[:, :4])
    with pytest.raises(RuntimeError, match=r"scales must be \[N, K / 32\] or \[N, K / 16\]"):
        amx.pack8(codes, scale[:, :5])
    with pytest.raises(ValueError, match="need int8_rows"):
        Q8Linear(codes, scale, amx, int8_rows=False, dtype=dtype, zero=zero)


def test_q4_k_keeps_its_own_scales() -> None:
    """A Q4_K tensor on our int4 kernel keeps the file's super-block scales (fp16 d and dmin per 256
    inputs, 6-bit scales and mins per 32: 2.5 bytes a group and column, not fp16 scale and offset's
    4); its rows are those the same values stored in full give, bit for bit (decode rows, tiles,
    prompt rows), and gguf's own de-quantization within the int8 rows' rounding."""
    amx = cpu_ops.quant()
    require_kernels(amx, quant=True)
    w = _weights(64, 512, seed=3)
    raw = _q4_k_bytes(w)
    got = gguf_blocks(raw, "Q4_K", w.shape)
    assert isinstance(got, Int4Weight) and got.q4k is not None
    dtype = cpu_ops.quant_dtype()
    lin = Int4Linear(got, None, dtype)
    assert lin.scale_offset.dtype == torch.uint8 and lin.scale_offset.numel() == 64 * 512 // 32 * 5 // 2
    scale, offset = got.q4k.scale_offset()
    packed, full = amx.pack(got.q.to(torch.uint8), scale, offset)
    assert torch.equal(packed, lin.packed)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4)).to(dtype)
    for rows in (1, 5, 16, 17, 40):
        assert torch.equal(lin(x[:rows]), amx.mm(x[:rows], packed, full)), rows
    if hasattr(amx, "mm_prompt"):
        assert torch.equal(amx.mm_prompt(x, lin.packed, lin.scale_offset), amx.mm_prompt(x, packed, full))
    ref = _int8_rows(x) @ torch.from_numpy(dequantize(raw, T.Q4_K).astype(np.float64)).t()
    assert (lin(x).double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    with pytest.raises(RuntimeError, match="K by 256"):
        amx.pack_q4k(got.q[:, :480].to(torch.uint8), got.q4k.d, got.q4k.dmin, got.q4k.sc, got.q4k.mn)
    with pytest.raises(RuntimeError, match="bytes pack_q4k"):
        amx.mm(x, lin.packed, lin.scale_offset[:1])

@pytest.mark.parametrize("kinds", [{"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "*": T.Q4_K},
                                   {"attn_v": T.Q6_K, "*": T.Q5_K}], ids=["Q4_K_M", "Q5_K_M"])
def test_k_quant_layers_keep_their_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch, kinds: dict) -> None:  # noqa: ANN001
    """A Q4_K_M-like / Q5_K_M-like file: every layer linear stays in the file's blocks on our kernels
    (q/k/v mixing Q4_K and Q6_K in the int8 k-quant form, gate/up in int4), never dense; each product
    matches the loader's de-quantized weights; prompt-lookup speculation gives plain decoding's
    greedy tokens (the decoder stack in one call included)."""
    from test_loader import _allow_gguf_without_accelerate, _tiny

    from dspark.models.quant import Int4Linear

    require_kernels(cpu_ops.quant(), quant=True)
    dtype = cpu_ops.quant_dtype()
    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    src = tmp_path / "k.gguf"
    # the type by tensor, as llama-quantize's Q4_K_M (Q6_K for attn_v and ffn_down)
    _write_quantized_gguf(src, model, lambda name: next((t for key, t in kinds.items() if key in name), kinds["*"]),
                          encode=lambda w, kind: _WRITERS[kind](w))
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    plain = make_engine(str(src), "none", dtype=name, quantization="auto")
    layer = plain.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Q8Linear)  # mixed parts: the k-quant form
    want_up = Int4Linear if kinds["*"] == T.Q4_K else Q8Linear
    assert isinstance(layer.mlp.gate_up_proj, want_up)
    assert isinstance(layer.mlp.down_proj, Q8Linear)
    assert "PackedLinear" not in plain.quantization and "Linear" not in plain.quantization

    monkeypatch.setenv("DSPARK_CPU_OPS", "0")  # the de-quantized weights, dense
    dense = make_engine(str(src), "none", dtype="float32", quantization="none")
    monkeypatch.delenv("DSPARK_CPU_OPS")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ref_lin = dense.model.layers[1].get_submodule(path)
        xi = x[:, :ref_lin.in_features]
        ref = ref_lin(xi)
        got = plain.model.layers[1].get_submodule(path)(xi.to(dtype)).float()
        torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0)

    prompts = [[5 + (i % k) for i in range(24)] for k in (3, 4, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = run_requests(plain, [(p, sp, None) for p in prompts])
    spec = make_engine(str(src), "ngram", dtype=name, quantization="auto")
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.spec_stats.verified > 0
