"""dspark average-drafters: the weighted mean of exported drafters, checked tensor by tensor
against the inputs; the result loads and runs; mismatched inputs and bad flags are refused
with a clear error and nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.cli import main
from dspark.models.drafters.checkpoint import load_drafter, save_drafter
from dspark.models.llama import LlamaConfig, LlamaModel
from dspark.train.average import average_drafters
from dspark.train.drafter_init import make_drafter_config, new_drafter

V = 64


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                      tie_word_embeddings=False, qkv_bias=False, qk_norm=False, eos_token_id=[2], bos_token_id=1)
    return LlamaModel(cfg).eval()


def _export(target, path, seed, draft_vocab=16, block=4, dtype=torch.bfloat16):
    dc = make_drafter_config(target.config, num_layers=1, block_size=block, markov_rank=4, layer_ids=[0, 2],
                             mask_token_id=5, draft_vocab_size=draft_vocab)
    vocab = torch.arange(draft_vocab) * 2 + (seed % 2) if draft_vocab else None  # seed parity: another vocab
    d = new_drafter(dc, target, seed, vocab)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 1)
    save_drafter(d, path, dtype=dtype)
    return load_file(str(path / "model.safetensors"))


def test_weighted_mean_tensor_by_tensor_and_it_loads(target, tmp_path):
    a, b = _export(target, tmp_path / "a", 0), _export(target, tmp_path / "b", 2)
    rec = average_drafters([tmp_path / "a", tmp_path / "b"], tmp_path / "m", [1.0, 3.0])
    assert rec["weights"] == [0.25, 0.75]
    m = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert set(m) == set(a)
    for k, v in m.items():
        assert v.dtype == a[k].dtype
        if v.is_floating_point():
            want = (0.25 * a[k].float() + 0.75 * b[k].float()).to(v.dtype)
            assert torch.equal(v, want), k
            assert not torch.equal(v, a[k]) or torch.equal(a[k], b[k]), k
        else:
            assert torch.equal(v, a[k])  # the draft-to-target map is carried over
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == \
        json.loads((tmp_path / "a" / "config.json").read_text())
    assert json.loads((tmp_path / "m" / "average.json").read_text())["inputs"] == [str(tmp_path / "a"),
                                                                                     str(tmp_path / "b")]
    d = load_drafter(tmp_path / "m", target, torch.float32, "cpu")
    assert torch.equal(d.draft_to_target, a["draft_to_target"])


def test_equal_weights_by_default_through_the_cli(target, tmp_path, capsys):
    a, b = _export(target, tmp_path / "a", 0), _export(target, tmp_path / "b", 2)
    assert main(["average-drafters", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == [0.5, 0.5]
    m = load_file(str(tmp_path / "m" / "model.safetensors"))
    k = next(k for k in m if k.startswith("fc"))
    assert torch.equal(m[k], ((a[k].float() + b[k].float()) / 2).to(m[k].dtype))


@pytest.mark.parametrize("case, message", [
    ("another_vocab", "another draft vocabulary"),  # same shapes, another draft-to-target map
    ("another_block", "in config block_size"),
    ("another_shape", "in config draft_vocab_size"),
    ("one_input", "at least two"),
    ("bad_weights", "--weights wants"),
    ("wrong_weight_count", "2 numbers >= 0"),
    ("negative_weight", "2 numbers >= 0"),
    ("out_not_empty", "not an empty folder"),
    ("not_a_drafter", "needs config.json"),
])
def test_refused_with_a_clear_error_and_nothing_written(target, tmp_path, capsys, case, message):
    _export(target, tmp_path / "a", 0)
    other = {"another_vocab": dict(seed=1), "another_block": dict(seed=2, block=3),
             "another_shape": dict(seed=2, draft_vocab=20)}.get(case, dict(seed=2))
    _export(target, tmp_path / "b", **other)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "m"
    inputs = [str(tmp_path / "a"), str(tmp_path / ("empty" if case == "not_a_drafter" else "b"))]
    flags = {"bad_weights": ["--weights", "1,x"], "wrong_weight_count": ["--weights", "1,2,3"],
             "negative_weight": ["--weights", "1,-1"]}.get(case, [])
    if case == "one_input":
        inputs = inputs[:1]
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    assert main(["average-drafters", *inputs, "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    if case == "out_not_empty":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()
