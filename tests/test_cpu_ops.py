"""The fused CPU kernels (dspark/csrc/cpu_ops.cpp): each against a plain torch reference, the
attention's fixed per-row order (a row alone == the same row among others, bit for bit), the
fused decoder stack against the modules' own forward, and the pure-torch fallback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from spec_helpers import require_kernels

from dspark.config import EngineConfig, SpecConfig
from dspark.engine.attention import AttnBatch, TorchAttention
from dspark.engine.engine import Engine
from dspark.models import cpu_ops
from dspark.models.layers import apply_rotary

ops = cpu_ops.load()
require_kernels(ops)  # skipped without build tools; a failed build with them fails, with its output
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = want.float().abs().max().clamp_min(1e-6)
    assert ((got.float() - want.float()).abs().max() / scale).item() <= tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_norms_and_swiglu_match_torch(dtype, tol):
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(5, 72, generator=g).to(dtype), torch.randn(5, 72, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(72, generator=g)).to(dtype)

    def norm(x):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    _close(ops.rms_norm(h, w, 1e-5), norm(h), tol)
    s, out = ops.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(s, h + d)
    _close(out, norm(h + d), tol)
    gu = torch.randn(3, 2 * 40, generator=g).to(dtype)
    _close(ops.silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:], tol)


def test_rope_store_matches_the_modules_and_writes_the_cache():
    g = torch.Generator().manual_seed(1)
    n, nh, nkv, d = 4, 6, 2, 16
    qkv = torch.randn(n, (nh + 2 * nkv) * d, generator=g).to(torch.bfloat16)
    q, k, v = (t.reshape(n, -1, d) for t in qkv.split([nh * d, nkv * d, nkv * d], -1))
    ang = torch.randn(n, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16), torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    want_q, want_k = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None])
    want_v = v.clone()
    kc, vc = torch.zeros(10, nkv, d, dtype=torch.bfloat16), torch.zeros(10, nkv, d, dtype=torch.bfloat16)
    slots = torch.tensor([7, 2, 9, 0])
    ops.rope_store(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # the same bits as the module ops
    assert torch.equal(kc[slots], want_k) and torch.equal(vc[slots], want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_store(q, k, v, cos, sin, kc, vc, torch.tensor([7, 2, 9, 10]))


def _plan(q_lens, kv_lens, masks=None):
    attn = TorchAttention("cpu")
    tables = [[i * 8 + p for p in range(8)] for i in range(len(q_lens))]
    attn.plan(AttnBatch(q_lens, kv_lens, tables, page_size=4, mask="custom" if masks else "causal",
                        custom_masks=masks or []))
    return attn


@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128 take the kernel's register path
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_attention_matches_sdpa(dtype, tol, head_dim):
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(64, 2, head_dim, generator=g).to(dtype)
    vc = torch.randn(64, 2, head_dim, generator=g).to(dtype)
    q = torch.randn(1 + 5, 4, head_dim, generator=g).to(dtype)
    attn = _plan([1, 5], [9, 20])
    got = attn.attend(q, kc, vc, 0.25, ops)
    want = attn.attend(q.double(), kc.double(), vc.double(), 0.25)
    _close(got, want, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float32 shows any change of order
@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_row_alone_equals_row_in_a_chain_and_a_tree(head_dim, dtype):
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(64, 2, head_dim, generator=g).to(dtype)
    vc = torch.randn(64, 2, head_dim, generator=g).to(dtype)
    q = torch.randn(6, 4, head_dim, generator=g).to(dtype)
    chain = _plan([6], [20]).attend(q, kc, vc, 0.25, ops)
    for j in range(6):  # the query at position 14 + j decoded alone
        alone = _plan([1], [15 + j]).attend(q[j:j + 1], kc, vc, 0.25, ops)
        assert torch.equal(alone[0], chain[j])
    # a tree whose node 3 descends from nodes 0 and 2: alone, its path sits at positions 14-16
    tree = torch.eye(4, dtype=torch.bool)
    tree[1, 0] = tree[2, 0] = tree[3, 0] = tree[3, 2] = True
    kt, vt = kc.clone(), vc.clone()
    both = _plan([4], [18], [tree]).attend(q[:4], kt, vt, 0.25, ops)
    path = [0, 2, 3]  # slots 14, 16, 17 in the tree; 14, 15, 16 on the path decoded alone
    kt[15], vt[15] = kt[16], vt[16]
    kt[16], vt[16] = kc[17], vc[17]
    alone = _plan([1], [17]).attend(q[3:4], kt, vt, 0.25, ops)
    assert path[-1] == 3 and torch.equal(alone[0], both[3])


@pytest.mark.parametrize("head_dim", [64, 128])  # the register path, heads of a KV head side by side
def test_attention_head_gets_its_bits_alone_and_under_any_thread_split(head_dim):
    """attend runs the query heads of a KV head together (sharing each key's load): every head
    gets the bits it gets attended alone (one head over its KV head's cache), and the output does
    not depend on how threads split the heads (float32 shows any change of order)."""
    g = torch.Generator().manual_seed(4)
    nh, nkv = 9, 3
    kc = torch.randn(96, nkv, head_dim, generator=g)
    vc = torch.randn(96, nkv, head_dim, generator=g)
    q = torch.randn(1 + 6 + 1, nh, head_dim, generator=g)
    attn = _plan([1, 6, 1], [9, 20, 30])
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attn.attend(q, kc, vc, 0.25, ops))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for h in range(nh):
        kvh = h // (nh // nkv)
        alone = attn.attend(q[:, h:h + 1].contiguous(), kc[:, kvh:kvh + 1].contiguous(),
                            vc[:, kvh:kvh + 1].contiguous(), 0.25, ops)
        assert torch.equal(alone[:, 0], outs[0][:, h])


needs_causal = pytest.mark.skipif(not hasattr(ops, "attend_causal"), reason="this build has no attend_causal")


@needs_causal
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((4, 4), 64)])
def test_causal_attention_gives_attends_bits(dtype, heads, head_dim):
    """Long causal chunks (prompt rows) through attend_causal: every row the bits attend gives it
    (float32 shows any change of order), in groups of unequal query and key counts, padded."""
    g = torch.Generator().manual_seed(5)
    nh, nkv = heads
    kc = torch.randn(400, nkv, head_dim, generator=g).to(dtype)
    vc = torch.randn(400, nkv, head_dim, generator=g).to(dtype)
    q_lens, kv_lens = [40, 35, 50], [40, 70, 100]
    perm = torch.randperm(100, generator=g).tolist()
    tables = [perm[0:10], perm[10:28], perm[28:53]]
    attn = TorchAttention("cpu")
    attn.plan(AttnBatch(q_lens, kv_lens, tables, page_size=4))
    [grp] = attn.groups
    assert not grp.short and grp.visible is not None
    q = torch.randn(sum(q_lens), nh, head_dim, generator=g).to(dtype)
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    ops.attend(q, kc, vc, grp.gather, grp.q_index, grp.row_mask, 0.125, want)
    ops.attend_causal(q, kc, vc, grp.gather, grp.q_index, grp.visible, 0.125, got)
    assert torch.equal(got, want)
    assert torch.equal(attn.attend(q, kc, vc, 0.125, ops), want)  # the backend takes it for long chunks
    with pytest.raises(RuntimeError, match="visible"):
        ops.attend_causal(q, kc, vc, grp.gather, grp.q_index, grp.visible[:, :-1].contiguous(), 0.125, got)


@needs_causal
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_does_not_depend_on_its_chunk(dtype):
    """A prompt's row attended in one 60-row chunk, in a 40-row chunk after 20 cached rows, and as
    the last of 3 rows: the same bits, so a cached prefix equals the same prefix computed again."""
    g = torch.Generator().manual_seed(6)
    kc = torch.randn(64, 2, 64, generator=g).to(dtype)
    vc = torch.randn(64, 2, 64, generator=g).to(dtype)
    q = torch.randn(60, 6, 64, generator=g).to(dtype)

    def rows(n):  # the last n of the prompt's 60 positions, pages 0-14 of 4 slots
        attn = TorchAttention("cpu")
        attn.plan(AttnBatch([n], [60], [list(range(15))], page_size=4))
        return attn.attend(q[60 - n:], kc, vc, 0.125, ops)

    whole, tail, last = rows(60), rows(40), rows(3)
    assert torch.equal(tail, whole[20:]) and torch.equal(last, whole[57:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_stack_matches_the_modules(folders, dtype, monkeypatch):
    outs = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("DSPARK_CPU_OPS", enabled)
        engine = Engine(EngineConfig(model=folders["target"], device="cpu", dtype=dtype,
                                     spec=SpecConfig(drafter="none")))
        s = SimpleNamespace(seq_id=1, num_cached=0)
        engine.pool.reserve(1, 40)
        prompt = engine.runner.forward([(s, list(range(3, 23)))], [19], capture=(0, 1))
        s.num_cached = 20
        step = engine.runner.forward([(s, [5, 6, 7])], [0, 1, 2], capture=(0, 1))
        outs.append((prompt, step))
    tol = 1e-4 if dtype == "float32" else 3e-2
    for a, b in zip(*outs):
        _close(a.logits, b.logits, tol)
        _close(a.feats, b.feats, tol)


def test_a_failed_build_logs_the_compilers_output(tmp_path, monkeypatch, caplog):
    """With a compiler present, a source that does not compile is an error that shows the
    compiler's message (kept for the tests too), then the fallback; without one, a warning."""
    src = tmp_path / "broken.cpp"
    src.write_text("int dspark_probe() { return undeclared_name_xyz; }\n")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ops, "build_errors", {})
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert cpu_ops._compile("dspark_broken_probe", [src], []) is None
    assert "undeclared_name_xyz" in cpu_ops.build_errors["dspark_broken_probe"]
    [rec] = [r for r in caplog.records if "dspark_broken_probe" in r.getMessage()]
    assert rec.levelno == logging.ERROR and "undeclared_name_xyz" in rec.getMessage()

    caplog.clear()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_ops.toolchain_missing() == f"no C++ compiler ({tmp_path / 'no-such-compiler'}) on PATH"
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert cpu_ops._compile("dspark_broken_probe2", [src], []) is None
    [rec] = [r for r in caplog.records if "dspark_broken_probe2" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "no C++ compiler" in rec.getMessage()


def test_disabled_kernels_fall_back(monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_OPS", "0")
    assert cpu_ops.load() is None
    monkeypatch.setenv("DSPARK_CPU_OPS", "1")
    assert cpu_ops.for_tensor(torch.zeros(1, dtype=torch.int64)) is None
    assert cpu_ops.for_tensor(torch.zeros(1)) is ops


def test_decode_equals_verify_bitwise_with_64_wide_heads(tmp_path):
    """The engine's exactness check (tests/test_bf16_exact.py) on a target whose heads take the
    attention kernel's register path, as SmolLM2's do. (bf16 rounding hides most changes of
    summation order; the float32 kernel tests above see them. A float32 engine is not compared
    bitwise: its dense linears go through MKL, whose row sums depend on the row count.)"""
    from spec_helpers import alphabet_prompts, save_tiny_target
    from test_bf16_exact import _decode_vs_verify

    folder = save_tiny_target(tmp_path / "t64", head_dim=64)
    engine = Engine(EngineConfig(model=folder, device="cpu", dtype="bfloat16", spec=SpecConfig(drafter="none")))
    ids = alphabet_prompts([40], seed=4)[0]
    decoded, chain = _decode_vs_verify(engine, ids, 9)
    _, tree = _decode_vs_verify(engine, ids, 9, tree=True)  # a one-path tree: the custom-mask path
    out = [decoded, chain, tree]
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_fused_drafter_block_matches_the_modules(folders, monkeypatch):
    """A DSpark drafter's block pass (q/k norms, the "full" block mask over its context) through
    the fused kernels against its modules' own forward (its linears kept dense: on an AVX2 CPU a
    float32 drafter's would run as int4)."""
    from dspark.engine.proposers import block
    from dspark.models.drafters import dspark

    monkeypatch.setattr(block, "cpu_packable", lambda w: False)
    monkeypatch.setattr(dspark, "cpu_packable", lambda w: False)
    outs = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("DSPARK_CPU_OPS", enabled)
        engine = Engine(EngineConfig(model=folders["target"], device="cpu", dtype="float32",
                                     spec=SpecConfig(drafter=folders["dspark"])))
        proposer = engine.spec.proposer
        seq = SimpleNamespace(seq_id=1, num_cached=12, output_ids=[7])
        engine.pool.reserve(1, 40)
        g = torch.Generator().manual_seed(5)
        feats = torch.randn(12, proposer.drafter.fc.in_features, generator=g)
        proposer.drafter.write_context(feats, torch.arange(12), torch.tensor(engine.pool.slots(1, 0, 12)), proposer.kv)
        with torch.inference_mode():
            outs.append(proposer._block_pass([seq], proposer.drafter.config.block_size))
    _close(outs[0], outs[1], 1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_context_write_matches_the_torch_ops(folders, monkeypatch, dtype):
    """The drafter's context write at inference (every layer's k normed, rotated and stored by the
    fused kernel) leaves the cache the torch ops' path leaves, and touches no other slot."""
    engine = Engine(EngineConfig(model=folders["target"], device="cpu", dtype=dtype,
                                 spec=SpecConfig(drafter=folders["dspark"])))
    proposer = engine.spec.proposer
    drafter, kv = proposer.drafter, proposer.kv
    engine.pool.reserve(1, 40)
    slots = torch.tensor(engine.pool.slots(1, 20, 26))
    feats = torch.randn(6, drafter.fc.in_features, generator=torch.Generator().manual_seed(3)).to(kv.k.dtype)
    caches = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(drafter, "_store_context_kv", lambda *args: False)
        kv.k.zero_(), kv.v.zero_()
        with torch.inference_mode():
            drafter.write_context(feats, torch.arange(20, 26), slots, kv)
        caches.append((kv.k.clone(), kv.v.clone()))
    (k1, v1), (k2, v2) = caches
    others = torch.ones(kv.k.shape[1], dtype=torch.bool)
    others[slots] = False
    assert not k1[:, others].any() and not v1[:, others].any()
    assert torch.equal(v1, v2)  # the same product's rows, stored
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: the torch path rounds after each op
    _close(k1.float(), k2.float(), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mapped", [True, False], ids=["reduced-vocab", "full-vocab"])
def test_markov_walk_matches_the_slot_by_slot_walk(dtype, mapped):
    """The fused greedy walk of a drafter's Markov head picks what add_bias + argmax pick slot by
    slot (each slot's previous token through the reduced-vocabulary map), and refuses bad input."""
    from dspark.models.drafters.dspark import MarkovHead

    torch.manual_seed(0)
    vd = 300 if mapped else 500
    mh = MarkovHead(500, 32, vd).to(dtype).requires_grad_(False)
    base, anchors = torch.randn(3, 8, vd), torch.tensor([1, 499, 42])
    to_target = torch.randperm(500)[:vd] if mapped else None
    prev, want = anchors, []
    for k in range(8):
        pick = mh.add_bias(base[:, k], prev).argmax(-1)
        prev = to_target[pick] if mapped else pick
        want.append(prev)
    assert torch.equal(mh.greedy_walk(base, anchors, to_target), torch.stack(want, 1))
    assert mh.requires_grad_(True).greedy_walk(base, anchors, to_target) is None  # training: slot by slot
    w2t = torch.zeros(32, vd)
    with pytest.raises(RuntimeError, match="outside W1"):
        ops.markov_walk(base, mh.markov_w1.weight.detach(), w2t, torch.tensor([1, 500, 2]), torch.empty(0).long())
    with pytest.raises(RuntimeError, match="float32"):
        ops.markov_walk(base.bfloat16(), mh.markov_w1.weight.detach(), w2t, anchors, torch.empty(0).long())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("V", [16, 300, 4096])
def test_markov_walk_takes_the_first_of_equal_maxima(V, threads):
    """Ties go to the lowest index, as torch's argmax: whether the maxima share a vector lane, sit
    in different lanes, one lies past the last whole vector, or (two threads splitting a slot's
    columns) in different threads' parts."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    w1, w2t = torch.zeros(V, 4), torch.zeros(4, V)
    base = torch.zeros(1, 4, V)
    for k, ties in enumerate([[V - 1, 5, 3], [17 % V, 1, V - 1], [V - 2, V - 1], [0, V // 2]]):
        base[0, k, ties] = 1.0
    try:
        got = ops.markov_walk(base, w1, w2t, torch.tensor([0]), torch.empty(0).long())
    finally:
        torch.set_num_threads(old)
    assert got.tolist() == [[3, 1, V - 2, 0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_rows_follows_torchs_argmax(dtype: torch.dtype) -> None:
    """Each row's first maximum (ties across and within vector lanes, widths off the 16-lane
    step), the first NaN where there is one, index 0 for a row of -inf; as torch.argmax."""
    g = torch.Generator().manual_seed(0)
    for v in (1, 15, 16, 17, 33, 1000, 12288):
        for r in (1, 3):
            x = (torch.randn(r, v, generator=g) * 3).to(dtype)
            assert torch.equal(ops.argmax_rows(x), x.float().argmax(-1)), (v, r)
            ties = torch.randint(0, 3, (r, v), generator=g).to(dtype)
            assert torch.equal(ops.argmax_rows(ties), ties.float().argmax(-1)), (v, r)
    x = torch.randn(3, 100, generator=g).to(dtype)
    x[0, 37] = x[0, 60] = float("nan")
    x[1] = float("-inf")
    x[2, 99] = float("nan")
    assert ops.argmax_rows(x).tolist() == x.float().argmax(-1).tolist() == [37, 0, 99]
    with pytest.raises(RuntimeError, match="contiguous features"):
        ops.argmax_rows(x.t())
