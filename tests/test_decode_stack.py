"""The decoder stack in one C++ call (dspark/csrc/decode_stack.cpp), where the CPU has the int4
kernels (AMX, AVX512-VNNI with AVX512-BF16, or AVX2 in float32).

It must give the Python loop's bits (the same kernels in the same order): greedy tokens of a plain
int4 target, and of DSpark speculation (the drafter's block passes, with q/k norms, and the
target's passes with captured layers go through it too), equal with the stack on and off; which
stacks qualify; and a stack whose modules are swapped is planned again."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, require_kernels, run_requests

from dspark.config import SamplingParams
from dspark.models import cpu_ops, fused
from dspark.models.packed import pack_linears

pytestmark = pytest.mark.usefixtures("single_thread")
require_kernels(cpu_ops.quant(), quant=True)  # a failed build where it could succeed fails, with its output
DT_NAME = str(cpu_ops.quant_dtype()).removeprefix("torch.")


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
