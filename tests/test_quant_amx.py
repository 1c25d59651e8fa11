"""The int4/int8 kernels: dspark/csrc/quant_amx.cpp (bf16 rows) on AMX tiles where the CPU has AMX
and on AVX512-VNNI alone where it has that and AVX512-BF16, or quant_avx2.cpp (float32 rows) where
the CPU has AVX2 without AVX512; each test runs on whichever build this CPU gets.

Against a de-quantized reference, rows independent of their batch (up to the padded multi-tile
path), which kernel an int4 linear picks, clear errors on bad input, and greedy speculative output
equal to plain output of a target whose layers run on it."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, require_kernels, run_requests

from dspark.config import SamplingParams
from dspark.models import cpu_ops
from dspark.models.packed import PackedHead
from dspark.models.quant import Int4Linear, Int8Head, quantize_int4, quantize_q8_0

pytestmark = pytest.mark.usefixtures("single_thread")
require_kernels(cpu_ops.quant(), quant=True)  # a failed build where it could succeed fails, with its output
DT = cpu_ops.quant_dtype() or torch.bfloat16  # the rows this build's kernels take
DT_NAME = str(DT).removeprefix("torch.")


def _int4(n: int, k: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 * torch.linspace(0.3, 3.0, k)  # groups with other scales
    return quantize_int4(w)


def _weights_of(qw) -> torch.Tensor:  # noqa: ANN001
    """The kernel's weights: scale * q + offset with both in fp16 (GGUF's own precision)."""
    n, k = qw.q.shape
    scale = qw.scale.half().double()
    offset = (qw.zero.double() - 8 * qw.scale.double()).half().double()
    return (qw.q.double().view(n, k // 32, 32) * scale[..., None] + offset[..., None]).view(n, k)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int4 kernel reads it: per row and group of 32, codes round(x * 127 / max|x|) (in
    float32, ties to even) times the scale max|x| / 127."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv).double() * (amax / 127.0).double()).view(x.shape)


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 40])
def test_matches_dequantized_reference(rows: int) -> None:
    """Within bf16's rounding of the result (2^-8 of the output scale) of a float64 product of the
    rows quantized to int8 per group of 32 (as llama.cpp runs Q4 weights) with the de-quantized
    weights; and within int8's rounding (1% of the scale) of the unquantized rows' product."""
    qw = _int4(96, 192)
    lin = Int4Linear(qw, None, DT)
    assert lin.amx is not None
    # fixed rows: a draw of a few in a thousand lands just past the bound (by up to 1.25x), and an
    # unseeded one would follow whatever the process ran before
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(DT)
    got = lin(x).double()
    ref = _int8_rows(x) @ _weights_of(qw).t()
    assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    exact = x.double() @ _weights_of(qw).t()
    assert (got - exact).abs().max() <= 0.01 * exact.abs().max()


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row alone == the same row in batches of 2..144 rows, bit for bit (one tile of rows, and
    several tiles with the last one padded)."""
    lin = Int4Linear(_int4(64, 1536, seed=1), None, DT)
    x = torch.randn(144, 1536).to(DT)
    x[5] = 0  # a row of zeros quantizes with scale 0
    alone = torch.cat([lin(x[i:i + 1]) for i in range(144)])
    for m in (2, 9, 16, 17, 33, 144):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    assert torch.equal(lin(x[7:20]), alone[7:20])  # a slice that does not start a tile


def test_which_kernel_an_int4_linear_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel for the build's dtype with output widths in pairs of 16 columns; torch's kernel
    for other dtypes, other widths, or DSPARK_CPU_OPS=0 (whose outputs agree with ours within bf16
    rounding)."""
    qw = _int4(64, 128)
    assert Int4Linear(qw, None, DT).amx is not None
    for other in {torch.bfloat16, torch.float16, torch.float32} - {DT}:
        assert Int4Linear(qw, None, other).amx is None
    assert Int4Linear(_int4(48, 128), None, DT).amx is None
    monkeypatch.setenv("DSPARK_CPU_OPS", "0")
    off = Int4Linear(qw, None, DT)
    assert off.amx is None
    monkeypatch.delenv("DSPARK_CPU_OPS")
    x = torch.randn(3, 128).to(DT)
    on = Int4Linear(qw, None, DT)(x).float()
    torch.testing.assert_close(off(x).float(), on, atol=0.02 * on.abs().max().item(), rtol=0)


@pytest.mark.skipif(cpu_ops.quant_kind() != "amx", reason="no AMX tiles on this CPU: only the VNNI build")
def test_vnni_build_gives_the_tile_paths_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSPARK_CPU_AMX=0 on an AMX CPU loads the build a CPU with VNNI alone gets (every row count on
    VNNI): int4 and int8-row products give every row the same bits as the tile build's."""
    qw = _int4(64, 128)
    xs = [torch.randn(n, 128).bfloat16() for n in (9, 40)]  # the pipelined tile path (<= 16 rows) and past it
    codes, scale = quantize_q8_0(torch.randn(64, 128) * 0.05)
    tiles = cpu_ops.quant()
    want = [(Int4Linear(qw, None, torch.bfloat16)(x), tiles.mm8(x, *tiles.pack8(codes, scale))) for x in xs]
    monkeypatch.setenv("DSPARK_CPU_AMX", "0")
    vnni = cpu_ops.quant()
    assert vnni is not tiles and cpu_ops.quant_kind() == "vnni"
    lin = Int4Linear(qw, None, torch.bfloat16)
    assert lin.amx is vnni
    for x, (int4, int8) in zip(xs, want):
        assert torch.equal(lin(x), int4)
        assert torch.equal(vnni.mm8(x, *vnni.pack8(codes, scale)), int8)



def test_symmetric_int4_keeps_scales_alone_with_the_same_bits() -> None:
    """Q4_0's w = d * (q - 8): an Int4Linear stores its scales alone (half the scale bytes) and
    every row count, and prompt rows where the build has mm_prompt, give the bits the same weight
    packed with its offsets stored gives."""
    from dspark.models.quant import Int4Weight

    qw = _int4(64, 256, seed=4)
    q4_0 = Int4Weight(qw.q.to(torch.uint8), qw.scale.half().float(), torch.zeros_like(qw.scale))
    lin = Int4Linear(q4_0, None, DT)
    assert lin.scale_offset.numel() == 64 * 256 // 32  # one fp16 scale per group, no offsets
    amx = cpu_ops.quant()
    offset = -8 * q4_0.scale
    packed, stored = amx.pack(q4_0.q, q4_0.scale, offset)
    assert torch.equal(packed, lin.packed) and stored.numel() == 2 * lin.scale_offset.numel()
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).to(DT)
    for rows in (1, 3, 8, 16, 17, 40):
        assert torch.equal(lin(x[:rows]), amx.mm(x[:rows], packed, stored)), rows
    if hasattr(amx, "mm_prompt"):
        assert torch.equal(amx.mm_prompt(x, lin.packed, lin.scale_offset), amx.mm_prompt(x, packed, stored))
    with pytest.raises(RuntimeError, match="int8 codes take no offsets"):
        codes, scale = quantize_q8_0(torch.randn(64, 128))
        amx.pack(codes, scale, scale)

def test_bad_input_is_a_clear_error() -> None:
    amx = cpu_ops.quant()
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    s = torch.ones(48, 2)
    with pytest.raises(RuntimeError, match="N must divide by 32 and K by 32"):
        amx.pack(q, s, s)
    with pytest.raises(RuntimeError, match=r"\[N, K\] uint8 or int8"):
        amx.pack(q.int(), s, s)
    packed, so = amx.pack(q[:32], s[:32], s[:32])
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        amx.mm(torch.zeros(1, 96).to(DT), packed, so)
    with pytest.raises(RuntimeError, match="x must be"):
        amx.mm(torch.zeros(1, 64, dtype=torch.float64), packed, so)
    with pytest.raises(RuntimeError, match="fp16 tensor pack"):
        amx.mm(torch.zeros(1, 64).to(DT), packed, so.float())


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_equals_plain_on_amx(folders, tree: bool) -> None:  # noqa: ANN001
    """Greedy DSpark speculation on an int4 bf16 target running the AMX kernel gives plain
    decoding's tokens of that target."""
    prompts = alphabet_prompts([15, 24, 33, 40], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    plain = make_engine(folders["target"], "none", quantization="int4", dtype=DT_NAME)
    layers = [m for m in plain.runner.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.amx is not None for m in layers)
    assert isinstance(plain.runner.model.lm_head, Int8Head)
    ref = run_requests(plain, [(p, sp, None) for p in prompts])
    spec = make_engine(folders["target"], folders["dspark"], quantization="int4", dtype=DT_NAME, tree=tree)
    outs = run_requests(spec, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.spec_stats.accepted > 0


@pytest.mark.parametrize("int8_rows", [True, pytest.param(False, marks=pytest.mark.skipif(
    DT != torch.bfloat16, reason="the AVX2 build multiplies int8 weights by int8 rows only"))],
    ids=["int8-rows", "bf16-rows"])
@pytest.mark.parametrize("rows", [1, 9, 17])
def test_int8_head_matches_q8_0_reference(rows: int, int8_rows: bool) -> None:
    """The int8 head (GGUF's Q8_0 codes, one fp16 scale per 32 inputs) within bf16's rounding of
    a float64 product with scale * q (of the rows quantized to int8 per group of 32, as llama.cpp
    runs a Q8_0 product, by default), each row as it is alone, the dense weight still exposed."""
    w = torch.randn(96, 128) * 0.05
    codes, scale = quantize_q8_0(w)
    deq = (codes.double().view(96, 4, 32) * scale.double()[..., None]).view(96, 128)
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6  # half a step at most
    lin = torch.nn.Linear(128, 96, bias=False).to(DT)
    head = Int8Head(lin, codes, scale, cpu_ops.quant(), int8_rows=int8_rows)
    assert head.weight is lin.weight
    x = torch.randn(rows, 128).to(DT)
    ref = (_int8_rows(x) if int8_rows else x.double()) @ deq.t()
    got = head(x[None])[0].double()
    assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    assert torch.equal(torch.cat([head(x[i:i + 1]) for i in range(rows)]), head(x))


def test_drafter_linears_run_int4(folders) -> None:  # noqa: ANN001
    """A bf16 drafter's backbone, context projection and reduced head run as int4 groups of 32 on
    our kernel (its bias kept), within an int4 step of the dense product; shapes the kernel cannot
    take stay dense."""
    from dspark.models.packed import PackedLinear
    from dspark.models.quant import draft_linear

    w, b = torch.randn(64, 96).to(DT) * 0.05, torch.randn(64).to(DT)
    lin = draft_linear(w, b)
    assert isinstance(lin, Int4Linear) and lin.amx is not None
    x = torch.randn(3, 5, 96).to(DT)
    ref = x.double() @ w.double().t() + b.double()
    assert lin(x).shape == (3, 5, 64)
    assert (lin(x).double() - ref).abs().max() <= 0.1 * ref.abs().max()
    assert isinstance(draft_linear(torch.randn(48, 96).to(DT)), PackedLinear)  # 48 columns: no tile pair
    assert isinstance(draft_linear(torch.randn(64, 96).half()), PackedLinear)
    spec = make_engine(folders["target"], folders["dspark"], quantization="int4", dtype=DT_NAME)
    drafter = spec.spec.proposer.drafter
    assert isinstance(drafter.fc, Int4Linear) and isinstance(drafter.layers[0].mlp.down_proj, Int4Linear)


def test_gguf_head_blocks_are_the_files_own(tmp_path) -> None:  # noqa: ANN001
    """A GGUF's Q8_0 token embedding comes back as its own codes and scales (gguf's de-quantization
    exactly); another type gives None, so the head is quantized at load instead."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from dspark.models.gguf_blocks import gguf_head_blocks
    from dspark.models.gguf_tensors import GGUFTensors

    w = (np.random.default_rng(0).standard_normal((64, 96)) * 0.05).astype(np.float32)
    for kind, name in ((gguf.GGMLQuantizationType.Q8_0, "q8"), (gguf.GGMLQuantizationType.F32, "f32")):
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        raw = quantize(w, kind) if name == "q8" else w
        writer.add_tensor("token_embd.weight", raw, raw_dtype=kind if name == "q8" else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        got = gguf_head_blocks(GGUFTensors.from_reader(gguf.GGUFReader(str(path)), str(path), "llama", 1, 1))
        if name == "f32":
            assert got is None
            continue
        codes, scale = got
        assert codes.dtype == torch.int8 and codes.shape == (64, 96) and scale.shape == (64, 3)
        want = torch.from_numpy(dequantize(raw, kind).astype(np.float32))
        assert torch.equal((codes.float().view(64, 3, 32) * scale[..., None]).view(64, 96), want)


def test_dense_heads_stay_dense(folders) -> None:  # noqa: ANN001
    """Without quantized layers (--quantization none) the head stays a pre-packed dense one."""
    engine = make_engine(folders["target"], "none", quantization="none", dtype="bfloat16")
    assert isinstance(engine.runner.model.lm_head, PackedHead)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16, 17, 40])
def test_int8_rows_match_reference_and_do_not_depend_on_the_batch(rows: int) -> None:
    """A drafter's Q8_0 linear with int8 rows (amx.mm8: VNNI up to 4 rows, AMX-INT8 past it):
    within bf16's rounding of a float64 product of the rows quantized to int8 per group of 32
    with scale * q, its bias added, and each row the same bits alone as in the batch (either path
    sums the same exact integers)."""
    from dspark.models.quant import Q8Linear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g) * 0.05
    b = torch.randn(96, generator=g).to(DT)
    codes, scale = quantize_q8_0(w)
    deq = (codes.double().view(96, 5, 32) * scale.double()[..., None]).view(96, 160)
    lin = Q8Linear(codes, scale, cpu_ops.quant(), b, int8_rows=True)
    x = torch.randn(rows, 160, generator=g).to(DT)
    x[0] = 0  # a row of zeros quantizes with scale 0
    got = lin(x).double()
    ref = _int8_rows(x) @ deq.t() + b.double()
    assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(rows)]), lin(x))
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 160"):
        cpu_ops.quant().mm8(torch.zeros(1, 96).to(DT), lin.packed, lin.scale, lin.sums)
    with pytest.raises(RuntimeError, match="pack8 returned"):
        cpu_ops.quant().mm8(x, lin.packed, lin.scale, lin.sums[:1])


@pytest.mark.skipif(cpu_ops.quant_kind() != "amx", reason="mm_prompt runs on AMX-BF16 tiles")
def test_prompt_rows_take_the_bf16_tile_gemm() -> None:
    """On AMX, an int4 linear's prompt rows (a RowSplit's prefill rows) go through mm_prompt: the
    codes expanded to bf16 weights w = d q + m, a GEMM in fp32 over the whole K; each row's result
    is that row's alone, close to the dense product; decoded rows keep mm's bits."""
    from dspark.models.packed import RowSplit

    qw = _int4(96, 256)
    lin = Int4Linear(qw, None, torch.bfloat16)
    d = qw.scale.half().float()
    m = (qw.zero.double() - 8 * qw.scale.double()).half().float()
    w = (qw.q.float().view(96, 8, 32) * d[..., None] + m[..., None]).view(96, 256).bfloat16().double()
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    amx = cpu_ops.quant()
    got = amx.mm_prompt(x, lin.packed, lin.scale_offset)
    ref = x.double() @ w.t()
    assert (got.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    assert torch.equal(torch.cat([amx.mm_prompt(x[i:i + 1], lin.packed, lin.scale_offset) for i in range(37)]), got)
    split = RowSplit.of([30, 7], [30, 0], x.device)  # one request prefilling, one decoding
    y = lin(x, split)
    assert torch.equal(y[:30], got[:30])
    assert torch.equal(y[30:], lin(x[30:]))  # the decode kernel's bits
    assert not torch.equal(got[30:], lin(x[30:]))
    with pytest.raises(RuntimeError, match="int8 codes take pack8"):  # pack's int8 codes have no prompt path
        codes, scale = quantize_q8_0(torch.randn(64, 128))
        amx.mm_prompt(torch.zeros(1, 128).bfloat16(), *amx.pack(codes, scale))
