"""CUDA checks (marker `gpu`; skipped without CUDA): the FlashInfer backend against the torch
backend on the same device, for prefill, decode, chains, the drafter's full block and trees;
greedy speculative output against plain greedy output on CUDA with FlashInfer; and the real
SmolLM2's logits under both backends. Run on a device: `pytest -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, run_requests, save_tiny_drafter, save_tiny_target, tree_mask

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.attention import AttnBatch, TorchAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = {  # (cached tokens, new tokens) per request
    "prefill": [(0, 37), (0, 5), (0, 130)],
    "decode": [(0, 1), (17, 1), (200, 1), (63, 1)],
    "chain": [(40, 9), (3, 9), (129, 9)],
    "full": [(40, 8), (3, 8), (129, 8)],
    "custom": [(40, 12), (3, 5), (129, 16)],
    "mixed": [(0, 33), (70, 1), (12, 9)],
}


@pytest.fixture(scope="module")
def gpu_folders(tmp_path_factory):
    """The tiny predictable target and its DSpark drafter with 64-dim heads (SmolLM2's size, so
    FlashInfer compiles one kernel module for these tests and the real model)."""
    root = tmp_path_factory.mktemp("gpu_assets")
    return {"target": save_tiny_target(root / "target", head_dim=64),
            "dspark": save_tiny_drafter(root / "dspark", "dspark", 8, head_dim=64)}


def _flashinfer():
    pytest.importorskip("flashinfer")
    from dspark.engine.flashinfer_backend import FlashInferAttention

    return FlashInferAttention("cuda")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])
def test_flashinfer_matches_torch_backend(case, heads):
    H, HKV, D = heads
    page = 16
    g = torch.Generator(device="cuda").manual_seed(0)
    seqs = CASES[case]
    tables, used = [], 0
    for ctx, n in seqs:
        need = -(-(ctx + n) // page) + 1
        tables.append(list(range(used + need - 1, used - 1, -1)))
        used += need
    mask = {"prefill": "causal", "decode": "causal", "chain": "causal", "mixed": "causal"}.get(case, case)
    cg = torch.Generator().manual_seed(1)
    customs = [tree_mask(n, cg) for _, n in seqs] if case == "custom" else []
    batch = AttnBatch(q_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs], page_tables=tables,
                      page_size=page, mask=mask, custom_masks=customs)
    N = sum(n for _, n in seqs)
    bf = torch.bfloat16
    k_cache = torch.randn(used * page, HKV, D, device="cuda", generator=g).to(bf)
    v_cache = torch.randn(used * page, HKV, D, device="cuda", generator=g).to(bf)
    q = torch.randn(N, H, D, device="cuda", generator=g).to(bf)
    k_new = torch.randn(N, HKV, D, device="cuda", generator=g).to(bf)
    v_new = torch.randn(N, HKV, D, device="cuda", generator=g).to(bf)
    outs = []
    for backend in (TorchAttention("cuda"), _flashinfer()):
        kc, vc = k_cache.clone(), v_cache.clone()
        backend.plan(batch)
        outs.append(backend.forward(q, k_new, v_new, kc, vc, D ** -0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def _engine(model: str, drafter: str, backend: str, enforce_eager: bool = True, **spec):
    from dspark.engine.engine import Engine

    return Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", attention_backend=backend,
                               enforce_eager=enforce_eager, max_num_seqs=8, spec=SpecConfig(drafter=drafter, **spec)))


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_spec_equals_plain_fp32_on_cuda(gpu_folders, tree):
    """The engine's speculative logic on a GPU, where rounding cannot hide a bug: fp32, torch backend."""
    from dspark.engine.engine import Engine

    def engine(drafter):
        return Engine(EngineConfig(model=gpu_folders["target"], device="cuda", dtype="float32",
                                   attention_backend="torch",
                                   max_num_seqs=8, spec=SpecConfig(drafter=drafter, tree=tree)))

    prompts = alphabet_prompts([15, 16, 17, 31, 33, 40], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run_requests(engine("none"), [(p, sp, None) for p in prompts])
    spec_engine = engine(gpu_folders["dspark"])
    spec = run_requests(spec_engine, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in spec) > 0


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_spec_matches_plain_with_flashinfer(gpu_folders, tree):
    """bf16 with FlashInfer: plain decode runs the decode kernel and verification the prefill kernel,
    which sum in other orders, so a near-tie may resolve differently (CPU avoids that with float64
    reductions; GPUs do as vLLM does). Most outputs must be identical and none may diverge early."""
    pytest.importorskip("flashinfer")
    prompts = alphabet_prompts([15, 16, 17, 31, 33, 40], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run_requests(_engine(gpu_folders["target"], "none", "flashinfer"), [(p, sp, None) for p in prompts])
    spec = run_requests(_engine(gpu_folders["target"], gpu_folders["dspark"], "flashinfer", tree=tree),
                        [(p, sp, None) for p in prompts])
    firsts = [_first_divergence(a.token_ids, b.token_ids) for a, b in zip(spec, plain)]
    assert sum(f == 40 for f in firsts) >= 4 and min(firsts) >= 10, firsts
    assert sum(o.stats.accepted for o in spec) > 0


def test_smollm2_logits_flashinfer_vs_torch():
    """The real target, prefill then three decode steps, under both backends: same argmax at
    every step and logits within bf16 noise."""
    pytest.importorskip("flashinfer")
    from dspark.models.loader import ModelLoadError

    try:
        engines = [_engine(None, "none", b) for b in ("torch", "flashinfer")]
    except (FileNotFoundError, ModelLoadError) as e:  # pragma: no cover - no GGUF on this machine
        pytest.skip(f"default model unavailable: {e}")
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = [{"role": "user", "content": "Write a haiku about paged attention."}]
    a, b = (run_requests(e, [(prompt, sp, None)])[0].token_ids for e in engines)
    agree = _first_divergence(a, b)
    assert agree >= 8, f"backends diverge at token {agree}: {a} vs {b}"


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_graph_replay_equals_eager(gpu_folders, drafter):
    """Captured decode, verification and drafter graphs give the eager engine's greedy output."""
    pytest.importorskip("flashinfer")
    d = gpu_folders.get(drafter, drafter)
    prompts = alphabet_prompts([15, 17, 24, 33, 40], seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = run_requests(_engine(gpu_folders["target"], d, "flashinfer"), [(p, sp, None) for p in prompts])
    eng = _engine(gpu_folders["target"], d, "flashinfer", enforce_eager=False)
    graphed = run_requests(eng, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert all(p.capture for p in eng.runner.graphs.values())
    assert sum(p.num_served for p in eng.runner.graphs.values()) > 10
    if drafter == "dspark":
        assert eng.spec.graphs.num_served == eng.spec.controller.num_draft_passes > 0


def test_graph_replay_of_long_looked_up_chains(gpu_folders):
    """Looked-up chains grown past a block replay from the 33-token pool with the eager output
    (the CPU twin, test_long_looked_up_chains_run_padded, checks the padding without capture)."""
    pytest.importorskip("flashinfer")
    prompts = alphabet_prompts([30, 31, 33], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    eager = run_requests(_engine(gpu_folders["target"], gpu_folders["dspark"], "flashinfer"),
                         [(p, sp, None) for p in prompts])
    eng = _engine(gpu_folders["target"], gpu_folders["dspark"], "flashinfer", enforce_eager=False)
    graphed = run_requests(eng, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert eng.runner.graphs[33].capture and eng.runner.graphs[33].num_served > 0


def test_prefix_caching_equals_no_caching_on_cuda(gpu_folders):
    """Shared pages on a GPU (fp32, torch backend): prompts with a common prefix, one repeated, give
    the tokens an engine without prefix caching gives, and pages are found in the cache."""
    from dspark.engine.engine import Engine

    def engine(caching: bool):
        return Engine(EngineConfig(model=gpu_folders["target"], device="cuda", dtype="float32",
                                   attention_backend="torch", max_num_seqs=8, enable_prefix_caching=caching,
                                   max_num_batched_tokens=40, spec=SpecConfig(drafter=gpu_folders["dspark"])))

    base = alphabet_prompts([41], seed=3)[0]
    prompts = [base + t for t in alphabet_prompts([5, 9, 3], seed=4)] + [base + alphabet_prompts([5], seed=4)[0]]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = run_requests(engine(False), [(p, sp, None) for p in prompts])
    cached = engine(True)
    run_requests(cached, [(prompts[0], sp, None)])
    got = run_requests(cached, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert cached.pool.prefix_hits >= 3 * 32


def test_structured_output_with_the_shipped_drafter_on_cuda():
    """SmolLM2 and its reduced-vocabulary drafter on CUDA under a JSON schema: the drafts' grammar
    masks index a GPU vocabulary map, the output parses, drafts are accepted."""
    import json

    pytest.importorskip("xgrammar")
    from dspark.config import StructuredOutputs
    from dspark.engine.engine import Engine
    from dspark.models.loader import ModelLoadError

    try:
        engine = Engine(EngineConfig(device="cuda", max_num_seqs=8))
    except ModelLoadError as e:
        pytest.skip(str(e))
    if engine.spec.name != "dspark":
        pytest.skip("the shipped drafter is not installed")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    sp = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    chat = [{"role": "user", "content": "A person as JSON with a name and an age."}]
    outs = run_requests(engine, [(chat, sp, None), (chat, SamplingParams(temperature=0.8, seed=1, max_tokens=48,
                                                                          structured_outputs=sp.structured_outputs),
                                  None)])
    for out in outs:
        assert set(json.loads(out.text)) == {"name", "age"}
    assert engine.spec_stats.accepted > 0
