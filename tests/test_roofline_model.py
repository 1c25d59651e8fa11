"""`dspark bench roofline --model`: a real (tiny) model's passes of k rows per request, loaded as the
engine loads it, with the bytes a pass reads checked against sums made apart from the bench's own."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open
from spec_helpers import one_thread, save_tiny_target

from dspark.bench.roofline_model import run_model_roofline
from dspark.cli import main
from dspark.engine.attention import make_backend
from dspark.models.loader import load_model
from dspark.models.packed import PackedHead
from dspark.models.quant import Int8Head


def test_roofline_model_hf_folder(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An fp32 HF folder through the CLI: rows k = 1..3 at batch 1 and 2, T(k)/T(1) > 0, and
    bytes_per_step = the file's tensors but the embedding + one embedding row per input row +
    every request's K/V, summed from the safetensors file itself."""
    folder = save_tiny_target(tmp_path / "m", predictable=False, vocab=512)
    out = tmp_path / "r.json"
    with one_thread():  # tiny passes: two spinning threads under load only make them slower
        rc = main(["bench", "roofline", "--model", folder, "--dtype", "fp32", "--max-rows", "3", "--batch-sizes",
                   "1,2", "--context", "8", "--reps", "1", "--bandwidth-mib", "8", "--output", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report == json.loads(out.read_text())
    assert "T(k)/T(1)" in captured.err and "of the read bandwidth" in captured.err
    assert report["device"] == "cpu" and report["dtype"] == "float32" and set(report["kernels"]) == {"Linear"}
    assert report["weight_bytes_by_part"]["layers"] == report["kernels"]["Linear"]["bytes"]  # the loader's count
    rows = {(r["batch_size"], r["tokens_per_request"]): r for r in report["rows"]}
    assert set(rows) == {(b, k) for b in (1, 2) for k in (1, 2, 3)}
    assert all(r["kind"] == ("decode" if k == 1 else "verify") for (_, k), r in rows.items())
    assert set(report["verify_over_decode"]) == {"1", "2"}
    for ratios in report["verify_over_decode"].values():
        assert list(ratios) == ["1", "2", "3"] and ratios["1"] == 1.0 and all(v > 0 for v in ratios.values())
    with safe_open(str(pathlib.Path(folder) / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    emb = tensors.pop("model.embed_tokens.weight")
    weights = sum(t.numel() * 4 for t in tensors.values())  # fp32; untied: the head is in the file
    row = emb.shape[1] * 4
    kv_token = 2 * 4 * 2 * 16 * 4  # (k, v) x 4 layers x 2 kv heads x 16 dims x 4 bytes
    assert report["weight_bytes"] == weights and report["kv_bytes_per_token"] == kv_token
    for (b, k), r in rows.items():
        assert r["bytes_per_step"] == weights + b * k * row + b * (8 + k) * kv_token, (b, k)
        assert r["ms"] > 0 and r["gb_s"] >= 0  # a tiny model's GB/s may round to 0 on a loaded machine
    for b, d in report["decode"].items():
        assert d["bytes_per_step"] == rows[int(b), 1]["bytes_per_step"] and d["tok_s"] > 0
        assert 0 <= d["fraction_of_bandwidth"] and d["gb_s"] >= 0
    assert report["read_bandwidth_gb_s"] > 0


def test_roofline_model_gguf_kept_int4(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_0 GGUF in bf16 keeps its layers as int4 (the engine's kernels): the bytes counted are
    the quantizer's own count of those linears plus norms and the LM head in the form its forward
    reads (int8 or pre-packed, never the dense weight it exposes), summed here module by module."""
    from gguf import GGMLQuantizationType as T
    from test_loader import _allow_gguf_without_accelerate, _tiny
    from test_quant import _write_quantized_gguf

    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "q.gguf"
    _write_quantized_gguf(src, _tiny("llama", hidden_size=64, intermediate_size=96), T.Q4_0)
    with one_thread():
        report = run_model_roofline(str(src), "cpu", torch.bfloat16, "auto", [1, 3], max_rows=2, context=5, reps=1,
                                    bandwidth_bytes=1 << 23)
    assert set(report["kernels"]) == {"Int4Linear"} and report["kernels"]["Int4Linear"]["count"] == 8
    assert report["weight_bytes_by_part"]["layers"] == report["kernels"]["Int4Linear"]["bytes"]
    model, _ = load_model(str(src), torch.device("cpu"), torch.bfloat16, "auto")
    norms = sum(n.weight.nbytes for layer in model.layers
                for n in (layer.input_layernorm, layer.post_attention_layernorm)) + model.norm.weight.nbytes
    head = model.lm_head
    if isinstance(head, Int8Head):  # Q8_0 codes and scales (sums: empty, or one per output row)
        head_bytes = head.packed.nbytes + head.scale.nbytes + head.sums.nbytes
    elif isinstance(head, PackedHead):  # oneDNN's blocked copy (a vocabulary of 260 is no multiple of 32)
        head_bytes = head.linear.packed.nbytes
    else:
        head_bytes = head.weight.nbytes
    assert report["weight_bytes_by_part"] == {"layers": report["kernels"]["Int4Linear"]["bytes"], "norms": norms,
                                              "head": head_bytes}
    assert report["lm_head"] == type(head).__name__ and report["attention_backend"] == make_backend("auto", "cpu").name
    c = model.config
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    weights = report["weight_bytes"]
    for r in report["rows"]:
        b, k = r["batch_size"], r["tokens_per_request"]
        assert r["bytes_per_step"] == weights + b * k * c.hidden_size * 2 + b * (5 + k) * kv_token
    assert all(v > 0 for ratios in report["verify_over_decode"].values() for v in ratios.values())
