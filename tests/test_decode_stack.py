"""The decoder stack in one C++ call (dspark/csrc/decode_stack.cpp), where the CPU has the int4
kernels (AMX, AVX512-VNNI with AVX512-BF16, or AVX2 in float32).

It must give the Python loop's bits (the same kernels in the same order): greedy tokens of a plain
int4 target, and of DSpark speculation (the drafter's block passes, with q/k norms, and the
target's passes with captured layers go through it too), equal with the stack on and off; which
stacks qualify; and a stack whose modules are swapped is planned again."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, kernel_dtype_name, make_engine, require_kernels, run_requests

from dspark.config import SamplingParams
from dspark.models import cpu_ops, fused
from dspark.models.packed import pack_linears

pytestmark = pytest.mark.usefixtures("single_thread")
require_kernels(cpu_ops.quant(), quant=True)  # a failed build where it could succeed fails, with its output
DT_NAME = kernel_dtype_name()


def _tokens(engine, prompts: list[list[int]], stack: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """Greedy tokens of the prompts and the drafts accepted meanwhile, the stack on or off."""
    with monkeypatch.context() as m:
        if not stack:
            m.setattr(fused, "stack_plan", lambda model, ops: None)
        before = engine.spec_stats.accepted
        outs = run_requests(engine, [(p, SamplingParams(temperature=0.0, max_tokens=24), None) for p in prompts])
    return [o.token_ids for o in outs], engine.spec_stats.accepted - before


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_stack_gives_the_python_loops_tokens(folders, drafter: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Same greedy tokens and, with a drafter, the same accepted drafts (so the same proposals) with
    the stack as with the Python loop; both models' stacks are planned."""
    engine = make_engine(folders["target"], folders[drafter] if drafter != "none" else "none",
                         quantization="int4", dtype=DT_NAME)
    ops = cpu_ops.load()
    assert fused.stack_plan(engine.runner.model, ops) is not None
    if drafter != "none":
        d = engine.spec.proposer.drafter
        assert d.layers[0].self_attn.q_norm is not None  # the q/k-norm branch runs
        assert fused.stack_plan(d, ops) is not None
    prompts = alphabet_prompts([12, 21, 30], seed=3)
    on, acc_on = _tokens(engine, prompts, True, monkeypatch)
    off, acc_off = _tokens(engine, prompts, False, monkeypatch)
    assert on == off
    assert acc_on == acc_off
    assert drafter == "none" or acc_on > 0


def test_which_stacks_qualify(folders) -> None:  # noqa: ANN001
    """Dense (pre-packed) layers keep the Python loop; a stack whose linears are swapped after its
    plan was made is planned again (the packers and the quantizer forget the old plan)."""
    ops = cpu_ops.load()
    dense = make_engine(folders["target"], "none", quantization="none", dtype=DT_NAME).runner.model
    assert fused.stack_plan(dense, ops) is None
    model = make_engine(folders["target"], "none", quantization="int4", dtype=DT_NAME).runner.model
    assert fused.stack_plan(model, ops) is not None
    layer = model.layers[0].mlp
    dense_down = torch.nn.Linear(layer.down_proj.in_features, layer.down_proj.out_features)
    layer.down_proj = dense_down.to(cpu_ops.quant_dtype())
    pack_linears(model.layers)  # -> a dense pre-packed linear, and the plan is dropped
    assert fused.stack_plan(model, ops) is None


@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_pass_with_prompt_rows_gives_the_python_loops_bits(tmp_path, head_dim: int,  # noqa: ANN001
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass mixing decode rows and prompt chunks (head dim 64: one of them long enough for the
    causal attention kernel's group) runs in the stack and gives the Python loop's hidden rows, captured
    layers and K/V bit for bit."""
    from spec_helpers import save_tiny_target

    from dspark.engine.sequence import Sequence

    engine = make_engine(save_tiny_target(tmp_path / "t", head_dim=head_dim), "none", quantization="int4",
                         dtype=DT_NAME)
    ops = cpu_ops.load()
    plan = fused.stack_plan(engine.runner.model, ops)
    assert plan is not None and plan.prompt_kernel is not None
    seqs = [Sequence(seq_id=i, request_id=f"s{i}", prompt_ids=[3 + i] * 60, params=SamplingParams(),
                     generator=None, eos_ids=frozenset()) for i in range(4)]
    for s in seqs:
        engine.pool.reserve(s.seq_id, 60)
    torch.manual_seed(0)
    ids = [torch.randint(5, 200, (60,)).tolist() for _ in seqs]
    long = 48 if head_dim == 64 else 30  # past 33 rows a chunk is a causal group: head dims 64 and 128
    items = [(seqs[0], ids[0][:1]), (seqs[1], ids[1][:1]), (seqs[2], ids[2][:9]), (seqs[3], ids[3][:long])]
    for s in seqs[:2]:  # the decode rows' context: 20 cached positions
        s.num_cached = 20
    layers = tuple(range(len(engine.runner.model.layers)))[:2]
    calls = []

    def run(stack: bool):
        with monkeypatch.context() as m:
            if stack:
                real = ops.decode_stack
                m.setattr(ops, "decode_stack", lambda *a: calls.append(a[11].numel()) or real(*a))
            else:
                m.setattr(fused, "stack_plan", lambda model, ops: None)
            res = engine.runner.forward(items, [0, 1, 10, 10 + long], capture=layers, prompt_rows=[0, 0, 9, long])
            slots = [sl for s, t in items for sl in engine.pool.slots(s.seq_id, s.num_cached, s.num_cached + len(t))]
            kv = engine.runner.kv
            return res.hidden.clone(), res.feats.clone(), kv.k[:, slots].clone(), kv.v[:, slots].clone()

    with torch.inference_mode():
        on, off = run(True), run(False)
    # the stack ran, with the prompt rows split from the decode rows; a long chunk needs the
    # causal kernel, which AVX2 builds do not have (the Python loop attends it there)
    assert calls == ([9 + long] if head_dim == 16 or hasattr(ops, "attend_causal") else [])
    for a, b in zip(on, off):
        assert torch.equal(a, b)
