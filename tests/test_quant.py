"""Weight-only quantized and pre-packed linears (dspark/models/quant.py, gguf_blocks.py).

Kernels against de-quantized references, GGUF blocks read back without loss, rows that do not
depend on their batch, and greedy speculative output equal to plain output of the same
quantized target (chains and trees, fp32 and bf16).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import EngineConfig, SamplingParams
from dspark.models import cpu_ops
from dspark.models.gguf_blocks import gguf_blocks
from dspark.models.packed import PackedLinear
from dspark.models.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from dspark.models.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _weights(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K layout for w [N, K] (K a multiple of 256; gguf-py writes no Q4_K): per
    sub-block of 32 a min/max grid of 16 steps, its scale and min as 6-bit multiples of the
    super-block's fp16 d and dmin. Only the layout matters here, not the best grid."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(g.min(-1), 0), g.max(-1)
    d = ((hi - lo) / 15 / 63).max(-1).astype(np.float16)
    dmin = (-lo / 63).max(-1).astype(np.float16)
    safe = lambda x: np.where(x > 0, x, 1).astype(np.float32)  # noqa: E731
    sc = np.clip(np.round((hi - lo) / 15 / safe(d)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    off = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.round((g + off[..., None]) / safe(step)[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], -1)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    head = [x.reshape(n, k // 256, 1).view(np.uint8) for x in (d, dmin)]
    return np.concatenate([*head, scales, qs], -1).reshape(n, -1)


def _quantize(w: np.ndarray, kind: T) -> np.ndarray:
    return _q4_k_bytes(w) if kind == T.Q4_K else quantize(w, kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0"])
def test_gguf_blocks_round_trip(kind: str) -> None:
    """Codes and scales read from GGUF blocks reproduce gguf's own de-quantization exactly (Q8_0:
    its codes and block scales as they are)."""
    k = 512 if kind == "Q4_K" else 96
    w = _weights(8, k).numpy() * np.linspace(0.2, 3.0, k, dtype=np.float32)  # blocks with other scales
    raw = _quantize(w, T[kind])
    ref = torch.from_numpy(dequantize(raw, T[kind]).astype(np.float32))
    assert (ref - torch.from_numpy(w)).abs().max() < 0.1 * np.abs(w).max()  # a real quantization of w
    got = gguf_blocks(raw, kind, w.shape).dequantize()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_matmul_matches_dequantized_reference(bits: int, dtype: torch.dtype,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """y = x W^T with W de-quantized, in float64: fp32 agrees to 1e-5 relative; bf16 within
    2^-7 of the output scale (the kernel's bf16 scales and its rounding of the result). torch's
    kernels (ours, which quantize the rows too, are checked in test_quant_amx.py)."""
    monkeypatch.setenv("DSPARK_CPU_OPS", "0")
    w = _weights()
    qw = quantize_int4(w) if bits == 4 else quantize_int8(w)
    lin = Int4Linear(qw, None, dtype) if bits == 4 else Int8Linear(qw, None, dtype)
    x = torch.randn(5, w.shape[1]).to(dtype)
    deq = qw.dequantize()
    if dtype == torch.bfloat16:  # the kernels read scales (and int4 offsets) in the activation dtype
        if bits == 4:
            deq = type(qw)(qw.q, qw.scale.to(dtype).float(), qw.zero.to(dtype).float()).dequantize()
        else:
            deq = qw.q.float() * qw.scale.to(dtype).float()[:, None]
    ref = x.double() @ deq.double().t()
    got = lin(x).double()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    assert (deq - w).abs().max() < (0.02 if bits == 4 else 0.002)  # and quantizing loses little


@pytest.mark.parametrize("shape", [(576, 576), (576, 1536)], ids=["576x576", "576x1536"])
@pytest.mark.parametrize("make", ["int4", "int8", "packed", "packed-fp16"])
def test_rows_do_not_depend_on_the_batch(make: str, shape: tuple[int, int]) -> None:
    """A row computed alone equals the same row inside 2..64-row batches, bit for bit: what keeps a
    decoded token and the same token verified in a chain equal (SmolLM2's shapes; oneDNN's
    pre-packed kernel picks its summation order by row count, so exact calls pad to 16-row blocks;
    fp16 where oneDNN has no kernel takes torch's linear, padded alike)."""
    w = _weights(*shape, seed=1)
    dtype = torch.float16 if make == "packed-fp16" else torch.bfloat16
    lin = {"int4": lambda: Int4Linear(quantize_int4(w), None, torch.bfloat16),
           "int8": lambda: Int8Linear(quantize_int8(w), None, torch.bfloat16),
           "packed": lambda: PackedLinear(w.bfloat16(), None),
           "packed-fp16": lambda: PackedLinear(w.half(), None)}[make]()
    x = torch.randn(64, shape[1]).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for m in (2, 5, 9, 17, 33, 64):
        assert torch.equal(lin(x[:m]), alone[:m]), m


def _write_quantized_gguf(path, model, kind, encode=_quantize) -> None:  # noqa: ANN001
    """A tiny llama GGUF whose layer projections are stored as ``kind`` blocks (a type, or a function
    of the tensor's name giving one; ``encode(weight, type)`` writes them; llama.cpp's permuted q/k
    rows), norms and embeddings as F32."""
    from test_loader import _REV, _write_gguf

    c = model.config
    real_add = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, *a, **kw):  # noqa: ANN001, ANN202
        if name.startswith("blk.") and name.endswith(".weight") and tensor.ndim == 2:
            k = kind(name) if callable(kind) else kind
            return real_add(self, name, encode(tensor, k), raw_dtype=k)
        return real_add(self, name, tensor, *a, **kw)

    gguf.GGUFWriter.add_tensor = add
    try:
        _write_gguf(path, "llama", model)
    finally:
        gguf.GGUFWriter.add_tensor = real_add
    assert _REV and c.hidden_size % 32 == 0


@pytest.mark.parametrize("kind", [T.Q4_1, T.Q4_0, T.Q4_K, T.Q5_0, T.Q8_0])
def test_gguf_layers_keep_their_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch, kind: T) -> None:  # noqa: ANN001
    """--quantization auto keeps a GGUF's Q4_0/Q4_1/Q4_K layers as int4 and Q8_0 as int8 (Q8_0
    blocks as they are where our kernels take the dtype, else one scale per row), and their
    products equal those of the loader's de-quantized (dense) weights."""
    from test_loader import _allow_gguf_without_accelerate, _tiny

    from dspark.engine.engine import Engine

    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    width = 256 if kind == T.Q4_K else 64  # a Q4_K row holds whole super-blocks of 256
    model = _tiny("llama", hidden_size=width, intermediate_size=width + 256 if kind == T.Q4_K else 96,
                  num_attention_heads=4, num_key_value_heads=2)
    src = tmp_path / "q.gguf"
    _write_quantized_gguf(src, model, kind)
    q8 = kind in (T.Q8_0, T.Q5_0)  # Q5_0's 5-bit codes are int8 codes with the block's scale

    def kept_as(dtype: torch.dtype) -> str:  # the linear auto builds in dtype where our kernels are
        if cpu_ops.quant_dtype() != dtype:
            return "Int8Linear" if q8 and dtype != torch.float32 else "Int4Linear" if not q8 else "Linear"
        return "Q8Linear" if q8 else "Int4Linear"

    auto = Engine(EngineConfig(model=str(src), device="cpu", dtype="bfloat16", quantization="auto"))
    assert set(auto.quantization) == {kept_as(torch.bfloat16)}
    assert auto.quantization[kept_as(torch.bfloat16)]["count"] == 8
    # float32: auto keeps the blocks only where the AVX2 kernels take float32 rows
    fp32 = Engine(EngineConfig(model=str(src), device="cpu", dtype="float32", quantization="auto"))
    ours = cpu_ops.quant_dtype() == torch.float32
    assert set(fp32.quantization) == {kept_as(torch.float32) if ours else "Linear"}
    x = torch.randn(3, model.config.intermediate_size)
    # exact arithmetic to compare: torch's kernels (ours read rows as int8), where auto stays dense
    # in float32, so the kind is asked for
    monkeypatch.setenv("DSPARK_CPU_OPS", "0")
    dense = Engine(EngineConfig(model=str(src), device="cpu", dtype="float32", quantization="auto"))
    assert set(dense.quantization) == {"Linear"}
    kept = Engine(EngineConfig(model=str(src), device="cpu", dtype="float32", quantization="int8" if q8 else "int4"))
    paths = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for a, b, c in zip(dense.model.layers, kept.model.layers, fp32.model.layers):
        for path in paths:
            da, qb = a.get_submodule(path), b.get_submodule(path)
            assert isinstance(qb, Int8Linear if q8 else Int4Linear)
            xi = x[:, :da.in_features]
            ref = da(xi)
            tol = 1e-5 if not q8 else 0.01  # torch's int8: one scale per row instead of per block
            torch.testing.assert_close(qb(xi), ref, atol=tol * ref.abs().max().item(), rtol=0)
            if ours:  # the file's blocks on our kernels, the rows as int8 per group of 32
                got = c.get_submodule(path)(xi)
                torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_K, T.Q5_0])
def test_speculative_equals_plain_on_kept_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch, kind: T) -> None:  # noqa: ANN001
    """A GGUF's Q8_0 / Q4_K blocks on our kernels (the decoder stack in one call included):
    prompt-lookup speculation gives plain decoding's greedy tokens of that target."""
    from spec_helpers import require_kernels
    from test_loader import _allow_gguf_without_accelerate, _tiny

    require_kernels(cpu_ops.quant(), quant=True)  # skips only where no build is possible
    dtype = cpu_ops.quant_dtype()
    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    width = 256 if kind == T.Q4_K else 64
    model = _tiny("llama", hidden_size=width, intermediate_size=512 if kind == T.Q4_K else 96,
                  num_attention_heads=4, num_key_value_heads=2)
    src = tmp_path / "q.gguf"
    _write_quantized_gguf(src, model, kind)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    prompts = [[5 + (i % k) for i in range(24)] for k in (3, 4, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = make_engine(str(src), "none", dtype=name, quantization="auto")
    want = "Q8Linear" if kind in (T.Q8_0, T.Q5_0) else "Int4Linear"
    assert set(plain.quantization) == {want}
    ref = run_requests(plain, [(p, sp, None) for p in prompts])
    spec = make_engine(str(src), "ngram", dtype=name, quantization="auto")
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.spec_stats.verified > 0


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_kept_layers_are_never_made_dense(tmp_path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:  # noqa: ANN001
    """Loading a GGUF reads each tensor from the file through the converted folder's index (no
    dense copy on disk): with ``auto`` the layers kept in the file's blocks are built from them
    alone, never de-quantized, and their blocks equal gguf's de-quantization of the file's own
    tensors; with ``none`` every layer is made dense instead."""
    from test_loader import _allow_gguf_without_accelerate, _tiny

    from dspark.models.gguf_blocks import KeptParts
    from dspark.models.gguf_tensors import GGUFTensors, unpermute_rotary_rows
    from dspark.models.loader import load_model, resolve_model_folder

    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    src = tmp_path / "q.gguf"
    _write_quantized_gguf(src, model, T.Q4_1)
    folder = resolve_model_folder(str(src))
    assert not list(pathlib.Path(folder).glob("*.safetensors"))
    made_dense: list[str] = []
    real_dense = GGUFTensors.dense
    monkeypatch.setattr(GGUFTensors, "dense", lambda self, e, *a: made_dense.append(e.name) or real_dense(self, e, *a))
    net, _ = load_model(str(src), torch.device("cpu"), torch.bfloat16, mode)
    layer_weights = [n for n in made_dense if n.startswith("blk.") and not n.endswith("norm.weight")]
    assert layer_weights == [] if mode == "auto" else len(layer_weights) == 14
    want = Int4Linear if mode == "auto" else PackedLinear
    assert isinstance(net.layers[1].mlp.gate_up_proj, want) and isinstance(net.layers[0].self_attn.qkv_proj, want)

    index = GGUFTensors.load(folder)
    parts = KeptParts(index)
    assert len(parts) == 8
    reader = gguf.GGUFReader(str(src))
    files = {t.name: t for t in reader.tensors}
    layout, w = parts["layers.1.self_attn.qkv_proj"]
    ref = [unpermute_rotary_rows(dequantize(files[f"blk.1.attn_{x}.weight"].data, T.Q4_1).reshape(-1, 64),
                                 "llama", f"blk.1.attn_{x}.weight", 4, 2) for x in "qkv"]
    assert layout == "Q4"
    torch.testing.assert_close(w.dequantize(), torch.from_numpy(np.concatenate(ref)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("quant,dtype", [("int4", "float32"), ("int8", "float32"), ("int4", "bfloat16"),
                                         ("none", "bfloat16")])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_equals_plain_quantized(folders, quant: str, dtype: str, tree: bool) -> None:  # noqa: ANN001
    """Greedy DSpark speculation on a quantized target gives plain decoding's tokens of that same
    quantized target (the tiny safetensors target, quantized at load)."""
    prompts = alphabet_prompts([15, 24, 33, 40], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    plain = make_engine(folders["target"], "none", quantization=quant, dtype=dtype)
    want = {"int4": "Int4Linear", "int8": "Int8Linear", "none": "PackedLinear"}[quant]
    assert set(plain.quantization) == {want}
    ref = run_requests(plain, [(p, sp, None) for p in prompts])
    spec = make_engine(folders["target"], folders["dspark"], quantization=quant, dtype=dtype, tree=tree)
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.spec_stats.accepted > 0


def test_bad_quantization_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3': choose auto, none, int8, int4"):
        EngineConfig(quantization="int3").validate()
    with pytest.raises(ValueError, match="choose auto, none, int8, int4"):
        quantize_model(torch.nn.Module(), "fp8")
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--prompt", "hi", "--quantization", "q4"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice: 'q4'" in r.stderr and "'int4'" in r.stderr


@pytest.mark.parametrize("bits", [4, 8])
def test_prompt_rows_take_the_dense_copy(bits: int) -> None:
    """In a pass mixing prompt rows and decoded rows, decoded rows get exactly the weight-only
    kernel's bits (as in a pass of their own) and prompt rows the dense copy's."""
    from dspark.models.packed import RowSplit

    w = _weights(192, 128, seed=2)
    qw = quantize_int4(w) if bits == 4 else quantize_int8(w)
    lin = (Int4Linear if bits == 4 else Int8Linear)(qw, torch.randn(192) * 0.1, torch.bfloat16, True)
    x = torch.randn(3 + 40 + 9, 128).bfloat16()  # a decode row, a prompt chunk of 40, a chain of 9
    rows = RowSplit.of([3, 40, 9], [0, 40, 0], torch.device("cpu"))
    y = lin(x, rows)
    rest = torch.cat([x[:3], x[43:]])
    assert torch.equal(torch.cat([y[:3], y[43:]]), lin(rest))
    assert torch.equal(y[3:43], lin.prefill(x[3:43]))
    assert torch.equal(lin(x[3:43], RowSplit.of([40], [40], torch.device("cpu"))), y[3:43])
    assert RowSplit.of([3, 9], [0, 0], torch.device("cpu")) is None
    part = RowSplit.of([5, 4], [0, 3], torch.device("cpu"))  # a re-prefill: 3 prompt tokens, 1 generated
    assert part.prefill.tolist() == [5, 6, 7] and part.rest.tolist() == [0, 1, 2, 3, 4, 8]
    # the dense copy holds the same (de-quantized) weights: equal up to bf16 rounding
    torch.testing.assert_close(y[3:43].float(), lin(x[3:43]).float(), atol=0.05 * y.abs().max().item(), rtol=0)


@pytest.mark.parametrize("copy", [False, True], ids=["kernel", "dense-copy"])
def test_speculative_equals_plain_with_prompts_beside_decodes(folders, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                              copy: bool) -> None:
    """bf16 int4 target, a small token budget: later prompts are prefilled in chunks beside
    requests already decoding or verifying (through the int4 kernel, or the dense copy); outputs
    still equal plain decoding's."""
    from dspark.models.packed import RowSplit

    mixed = []
    real = RowSplit.of.__func__

    def of(cls, counts, prompt_rows, device):  # noqa: ANN001, ANN202
        mixed.append(any(prompt_rows) and any(p < n for n, p in zip(counts, prompt_rows)))
        return real(cls, counts, prompt_rows, device)

    monkeypatch.setattr(RowSplit, "of", classmethod(of))
    prompts = alphabet_prompts([15, 24, 33, 40, 47, 18], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    # every prompt on the prompt path (short ones default to the decode kernels): the mixed passes
    kw = dict(quantization="int4", dtype="bfloat16", max_num_batched_tokens=32, prefill_dense_copy=copy,
              prompt_gemm_min_tokens=0)
    plain = make_engine(folders["target"], "none", **kw)
    assert (plain.model.layers[0].mlp.down_proj.prefill is not None) == copy
    ref = run_requests(plain, [(p, sp, None) for p in prompts])
    spec = make_engine(folders["target"], folders["dspark"], **kw)
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.spec_stats.accepted > 0
    assert sum(mixed) >= 4  # passes that held prompt rows and decoded rows together


def test_speculative_equals_plain_int4_under_preemption(folders) -> None:  # noqa: ANN001
    """bf16 int4, a pool small enough to preempt: a request prefilled again feeds its generated
    tokens through the int4 kernel they were decoded with, so outputs still equal plain ones."""
    prompts = alphabet_prompts([15, 16, 17, 24, 31, 32, 33, 40], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    kw = dict(quantization="int4", dtype="bfloat16", kv_cache_tokens=16 * 14, max_num_batched_tokens=40)
    ref = run_requests(make_engine(folders["target"], "none", **kw), [(p, sp, None) for p in prompts])
    spec = make_engine(folders["target"], folders["dspark"], ngram_assist=0, **kw)
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.num_preemptions > 0 and spec.spec_stats.accepted > 0
