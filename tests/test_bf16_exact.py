"""bf16 on CPU: a token verified inside a chain gets the same bits as the same token decoded
alone, so speculative output equals plain output in bf16 too (tests/test_spec_greedy.py covers
fp32). Without float64 reductions and two-row linears, SmolLM2's greedy outputs diverged within
a few dozen tokens in 7 of 8 dev prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from spec_helpers import alphabet_prompts

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.engine import Engine
from dspark.models.loader import ModelLoadError

# Dev prompts 2, 4 and 6, where n-gram speculation in bf16 left plain decoding at tokens 7, 17
# and 6 before the fix.
DRIFT_PROMPTS = [
    "Create a JavaScript function that takes an array of integers and returns an array of pairs of "
    "adjacent elements, as arrays, from the original array.",
    "Design a regex expression that validates a given password based on a given criteria.\n\n"
    "Password must have at least one lowercase letter, one uppercase letter, one number and should "
    "be at least 6 characters long.",
    "Write a Python function to calculate the factorial of a given number using recursion.\n\n6",
]


def _decode_vs_verify(engine: Engine, ids: list[int], n: int, tree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the last n tokens: fed one per forward (decoding), and all n in one forward
    (verification; tree: as a one-path tree, through the custom-mask path), each after the same
    prefill of the rest."""
    runner, out = engine.runner, []
    for seq_id, one_by_one in ((1, True), (2, False)):
        s = SimpleNamespace(seq_id=seq_id, num_cached=0)
        engine.pool.reserve(seq_id, len(ids))
        runner.forward([(s, ids[:-n])], [])
        s.num_cached = len(ids) - n
        if one_by_one:
            rows = []
            for t in ids[-n:]:
                rows.append(runner.forward([(s, [t])], [0]).logits[0])
                s.num_cached += 1
            out.append(torch.stack(rows))
        else:
            masks = {"mask": "custom", "custom_masks": [torch.ones(n, n).tril().bool()]} if tree else {}
            out.append(runner.forward([(s, ids[-n:])], list(range(n)), **masks).logits)
        engine.pool.free(seq_id)
    return out[0], out[1]


def test_tiny_model_decode_equals_verify_bitwise(folders, single_thread):
    engine = Engine(EngineConfig(model=folders["target"], device="cpu", dtype="bfloat16",
                                 spec=SpecConfig(drafter="none")))
    for length in (20, 33, 47):
        ids = alphabet_prompts([length], seed=length)[0]
        # 9: block 8; 17 and 33: longer chains (up to a looked-up chain of 32 + the anchor) and
        # trees, which once fell into the prefill bucket and were attended in float32
        for n in (9, 17, 33) if length > 33 else (9,):
            decoded, verified = _decode_vs_verify(engine, ids, n)
            assert torch.equal(decoded, verified), (n, (decoded - verified).abs().max())
        if length > 40:  # a tree larger than the longest chain is still verified exactly
            decoded, verified = _decode_vs_verify(engine, ids, 40, tree=True)
            assert torch.equal(decoded, verified), (decoded - verified).abs().max()


@pytest.fixture(scope="module")
def smol_bf16():
    try:
        return Engine(EngineConfig(device="cpu", dtype="bfloat16", spec=SpecConfig(drafter="none")))
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")


def test_smollm2_decode_equals_verify_bitwise(smol_bf16):
    ids = smol_bf16.encode([{"role": "user", "content": "Write a short poem about the sea."}])
    for n in (9, 33):  # a drafted block; the longest looked-up chain (32) and its anchor
        decoded, verified = _decode_vs_verify(smol_bf16, ids + list(range(1000, 1040)), n)
        assert torch.equal(decoded, verified), (n, (decoded - verified).abs().max())


def test_smollm2_ngram_output_equals_plain_in_bf16(smol_bf16):
    """End to end on the real model: n-gram speculation (chains of up to 8) against plain
    decoding, greedy, on dev prompts where bf16 drift used to flip a token early."""
    picks = DRIFT_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=48)
    spec = Engine(EngineConfig(device="cpu", dtype="bfloat16", spec=SpecConfig(drafter="ngram")))
    for engine in (smol_bf16, spec):
        for i, p in enumerate(picks):
            engine.add_request(f"r{i}", [{"role": "user", "content": p}], params)
    outs = {}
    for engine in (smol_bf16, spec):
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        outs[engine is spec] = [done[f"r{i}"] for i in range(len(picks))]
    assert spec.spec_stats.accepted > 0
    assert outs[True] == outs[False]


def test_bf16_model_keeps_float32_rope_frequencies():
    """Casting a model to bf16 leaves its RoPE frequencies in float32, as HF's from_pretrained
    does: rounded ones put positions far from the origin off by a large phase."""
    from dspark.models.llama import Rotary

    exact = Rotary(64, 100000.0, None)
    cast = Rotary(64, 100000.0, None).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, exact.inv_freq)
    pos = torch.tensor([1000, 4000])
    for a, b in zip(exact(pos, torch.float32), cast(pos, torch.float32)):
        assert torch.equal(a, b)
    with torch.device("meta"):  # how the roofline bench builds large models: real values after to_empty
        lazy = Rotary(64, 100000.0, None).to(torch.bfloat16)
    assert torch.equal(lazy.to_empty(device="cpu").inv_freq, exact.inv_freq)
    rounded = exact.inv_freq.to(torch.bfloat16).float()
    assert (pos[-1] * (rounded - exact.inv_freq)).abs().max() > 1.0  # what the cast used to cost (radians)
