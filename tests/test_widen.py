"""Widening a model by zero-padding keeps its function (dspark/models/widen.py, scripts/widen.py).

A tiny random GQA llama (hidden 288, 9 query / 3 KV heads of 32, 3 layers, SmolLM2's vocabulary)
widened to hidden 1024, 32 / 8 heads (c = 288 / 1024 = 9 / 32, the 2B target's own ratio, so norm
weights and eps change by factors that are not powers of two; widths that are multiples of 32, as
SmolLM2's 576, so the drafter's int4 inference linears quantize the same groups in both): fp32
logits within 1e-5 relative, greedy ids and text identical through dspark's Engine, the same
through the GGUF path (rotary rows interleaved as llama.cpp stores them), and a DSpark drafter
widened alongside drafts the same tokens with the same confidences; greedy speculative decoding
on the widened pair equals plain.
No llama.cpp needed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from spec_helpers import copy_tokenizer, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.models.widen import Widening, widen_drafter, widen_gguf, widen_hf_folder, widen_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 49152
SHAPE = {"hidden": 288, "intermediate": 384, "heads": 9, "kv_heads": 3, "head_dim": 32, "layers": 3}
WIDE = {"hidden": 1024, "intermediate": 1536, "heads": 32, "kv_heads": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1000 + 37 * i + j * 11 for j in range(n)] for i, n in enumerate([5, 17, 33])]


def _tiny_llama(folder: Path, seed: int = 0) -> str:
    """A random tiny llama with SmolLM2's tokenizer, tied embeddings (as SmolLM2) and norms far from 1."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["intermediate"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"], max_position_embeddings=512, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight"):
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif "embed" in name:  # small against the layers: the context, not the last token, decides
                p.normal_(0, 0.3)
    m.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return str(folder)


def _tiny_drafter(folder: Path, seed: int = 1) -> str:
    """A random 2-layer DSpark drafter for the tiny target: Markov and confidence heads, a reduced
    draft vocabulary, norms far from 1 (bf16, as the shipped checkpoint)."""
    from dspark.models.drafters.checkpoint import save_drafter
    from dspark.models.drafters.dspark import BlockDrafter, DrafterConfig

    dc = DrafterConfig(kind="dspark", hidden_size=SHAPE["hidden"], intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
                       head_dim=SHAPE["head_dim"], vocab_size=VOCAB, block_size=6, mask_token_id=16,
                       target_layer_ids=[0, 2], num_target_layers=SHAPE["layers"], markov_rank=8,
                       confidence_head=True, rms_norm_eps=1e-5, rope_theta=100000.0, draft_vocab_size=4096)
    torch.manual_seed(seed)
    d = BlockDrafter(dc, SHAPE["hidden"])
    with torch.no_grad():
        d.draft_to_target.copy_(torch.randperm(VOCAB)[:4096].sort().values)
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif name.startswith("markov_head"):
                p.normal_(0, 1.0)
            elif p.dim() == 2:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    save_drafter(d, folder, dtype=torch.bfloat16)
    return str(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    """The tiny target and drafter, and both widened."""
    root = tmp_path_factory.mktemp("widen")
    target = _tiny_llama(root / "target")
    drafter = _tiny_drafter(root / "drafter")
    wd = Widening(hidden=SHAPE["hidden"], new_hidden=WIDE["hidden"], intermediate=SHAPE["intermediate"],
                  new_intermediate=WIDE["intermediate"], heads=SHAPE["heads"], new_heads=WIDE["heads"],
                  kv_heads=SHAPE["kv_heads"], new_kv_heads=WIDE["kv_heads"], head_dim=SHAPE["head_dim"])
    wide = widen_hf_folder(target, root / "wide", wd)
    wide_drafter = root / "wide_drafter"
    widen_drafter(drafter, wide_drafter, hidden=WIDE["hidden"], intermediate=4 * 192, heads=WIDE["heads"],
                  kv_heads=WIDE["kv_heads"], target_hidden=SHAPE["hidden"], new_target_hidden=WIDE["hidden"],
                  dtype=torch.float32)
    return {"target": target, "drafter": drafter, "wide": wide, "wide_drafter": str(wide_drafter)}


def test_head_placement_keeps_kv_groups():
    wd = Widening(hidden=576, new_hidden=2048, intermediate=1536, new_intermediate=8192, heads=9, new_heads=32,
                  kv_heads=3, new_kv_heads=8, head_dim=64)
    assert wd.q_heads() == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert [h // wd.new_group for h in wd.q_heads()] == [h // wd.group for h in range(9)]
    assert wd.eps(1e-5) == pytest.approx(1e-5 * 576 / 2048)
    with pytest.raises(ValueError, match="GQA group"):
        Widening(hidden=576, new_hidden=2048, intermediate=1536, new_intermediate=8192, heads=9, new_heads=16,
                 kv_heads=3, new_kv_heads=8, head_dim=64)


def test_rmsnorm_of_the_padded_state_is_exact():
    """rms over H' of [x, 0] with w sqrt(c) and eps c equals rms over H of x with w and eps."""
    from dspark.models.layers import RMSNorm

    wd = Widening(hidden=576, new_hidden=2048, intermediate=1, new_intermediate=1, heads=1, new_heads=1,
                  kv_heads=1, new_kv_heads=1, head_dim=64)
    norm, wide = RMSNorm(576, 1e-5), RMSNorm(2048, wd.eps(1e-5))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
        wide.weight.copy_(torch.nn.functional.pad(norm.weight * wd.ratio ** 0.5, (0, 2048 - 576)))
    x = torch.randn(4, 576) * torch.tensor([1e-3, 1.0, 30.0, 1e-4])[:, None]  # eps matters in some rows
    y = wide(torch.nn.functional.pad(x, (0, 2048 - 576)))
    torch.testing.assert_close(y[:, :576], norm(x), rtol=1e-6, atol=0)
    assert not y[:, 576:].any()


def _logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    m = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits


def test_widened_logits_match_in_fp32(pair):
    ids = torch.tensor(PROMPTS[2])[None]
    a, b = _logits(pair["target"], ids), _logits(pair["wide"], ids)
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert rel < 1e-5, rel
    assert a.std() > 1.0  # not a degenerate model: the check means something


def test_widened_state_dict_is_zero_padded(pair):
    from dspark.models.loader import load_config, load_state_dict

    cfg, sd = load_config(pair["wide"]), load_state_dict(pair["wide"], torch.float32)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (1024, 32, 8)
    o = sd["model.layers.1.self_attn.o_proj.weight"].view(1024, 32, 32)
    assert not o[:, 3::4].any() and not o[:, 12:].any() and not o[288:].any()  # padded heads write nothing
    assert not sd["model.embed_tokens.weight"][:, 288:].any()
    again = widen_llama(load_config(pair["target"]), load_state_dict(pair["target"], torch.float32),
                        Widening.for_config(load_config(pair["target"]), **WIDE))[1]
    assert all(torch.equal(again[k], sd[k]) for k in sd)


def test_widened_greedy_ids_and_text_are_identical(pair):
    reqs = [(p, GREEDY, None) for p in PROMPTS]
    a = run_requests(make_engine(pair["target"]), reqs, spec=False)
    b = run_requests(make_engine(pair["wide"]), reqs, spec=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert len({t for o in a for t in o.token_ids}) > 10  # varied continuations


def _recorded_drafts(engine) -> list[tuple[list[int], list[float]]]:
    """Wrap the engine's proposer so that every chain it drafts is recorded (tokens, confidences)."""
    seen: list[tuple[list[int], list[float]]] = []
    proposer = engine.spec.proposer
    inner = proposer.draft

    def draft(seqs, budgets):  # noqa: ANN001, ANN202
        out = inner(seqs, budgets)
        for d in out:
            conf = [] if d.confidence is None else d.confidence.float().tolist()
            seen.append((list(d.tokens), conf))
        return out

    proposer.draft = draft
    return seen


def _dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Module:
    """An exact float linear in place of the drafter's inference ones (int4 with int8 rows)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight.data = weight
    if bias is not None:
        lin.bias.data = bias
    return lin


@pytest.mark.parametrize("linears", ["exact", "inference"])
def test_widened_drafter_drafts_what_the_original_drafts(pair, linears, monkeypatch):
    """The widened drafter on the widened target drafts the original's tokens with its confidences
    (with exact float linears: all of them; with the inference ones, int4 weights and int8
    activation rows whose roundings can flip where 1e-7 differences meet a rounding boundary:
    almost all), and greedy speculative decoding on the widened pair equals plain decoding."""
    if linears == "exact":
        import dspark.engine.proposers.block as block
        import dspark.models.drafters.dspark as dspark_drafter

        for mod in (block, dspark_drafter):
            monkeypatch.setattr(mod, "draft_linear", _dense)
            monkeypatch.setattr(mod, "cpu_packable", lambda w: False)
    reqs = [(p, GREEDY, None) for p in PROMPTS]
    opts = {"policy": "fixed", "ngram_assist": 0}
    ea = make_engine(pair["target"], pair["drafter"], **opts)
    eb = make_engine(pair["wide"], pair["wide_drafter"], **opts)
    da, db = _recorded_drafts(ea), _recorded_drafts(eb)
    a, b = run_requests(ea, reqs), run_requests(eb, reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    plain = run_requests(make_engine(pair["wide"]), reqs, spec=False)
    assert [o.token_ids for o in b] == [o.token_ids for o in plain]
    assert len(da) > 20 and len(da) == len(db)
    if linears == "exact":
        assert [t for t, _ in da] == [t for t, _ in db]
        assert [dataclasses.asdict(o.stats) for o in a] == [dataclasses.asdict(o.stats) for o in b]
        for (_, ca), (_, cb) in zip(da, db):
            torch.testing.assert_close(torch.tensor(cb), torch.tensor(ca), rtol=1e-4, atol=1e-5)
    else:
        same = sum(x == y for (ta, _), (tb, _) in zip(da, db) for x, y in zip(ta, tb))
        assert same >= 0.9 * sum(len(t) for t, _ in da), (same, da, db)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_widened_pair_trees_equal_plain(pair, dtype):
    """Draft trees (and chains under the load-aware policy with the n-gram assist, the defaults) from
    the widened drafter on the widened target: greedy output equals plain decoding of that target,
    in float32 and in bf16 (where the CPU kernels run the layers)."""
    reqs = [(p, GREEDY, None) for p in PROMPTS]
    plain = run_requests(make_engine(pair["wide"], dtype=dtype), reqs, spec=False)
    for opts in ({"tree": True, "tree_budget": 12, "policy": "fixed"}, {}):
        engine = make_engine(pair["wide"], pair["wide_drafter"], dtype=dtype, **opts)
        outs = run_requests(engine, reqs)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], opts
        assert engine.spec_stats.verified > 0, opts


def _write_gguf(folder: str, path: Path) -> None:
    """The tiny HF target as an F32 llama GGUF, q/k rows interleaved as llama.cpp stores them,
    tokenizer metadata copied from the default model's GGUF."""
    import gguf

    from dspark.models.llama import LlamaConfig
    from dspark.models.loader import default_model_path, load_config, load_state_dict

    cfg, sd = load_config(folder), load_state_dict(folder, torch.float32)
    src = gguf.GGUFReader(default_model_path())
    w = gguf.GGUFWriter(str(path), "llama")
    for field in src.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            w.add_key_value(field.name, field.contents(), kind,
                            sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(LlamaConfig.from_hf(cfg).rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, t in sd.items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, *rest = key.split(".")
            name = f"blk.{layer}.{names['.'.join(rest[:-1])]}.weight"
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(name.split(".")[-2])
        if heads:  # HF -> llama.cpp rotary layout, as convert_hf_to_gguf.py permutes
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_widened_gguf_holds_the_widened_weights(pair, tmp_path):
    """widen_gguf on a GGUF (q/k rows interleaved for rotary, as llama.cpp stores them) writes what
    widen_llama makes of the HF weights, read back as dspark's loader reads a GGUF, with the
    tokenizer metadata as it was and the shape keys and eps of the widened model."""
    import gguf
    from gguf.quants import dequantize

    from dspark.models.loader import gguf_heads, gguf_hf_name, load_config, load_state_dict, unpermute_rotary_rows

    small, wide = tmp_path / "tiny.gguf", tmp_path / "tiny-wide.gguf"
    _write_gguf(pair["target"], small)
    wd = widen_gguf(small, wide, out_type="F32", **WIDE)
    assert (wd.hidden, wd.heads, wd.kv_heads, wd.head_dim) == (288, 9, 3, 32)
    cfg = load_config(pair["target"])
    expect = widen_llama(cfg, load_state_dict(pair["target"], torch.float32), wd)[1]
    r, r0 = gguf.GGUFReader(str(wide)), gguf.GGUFReader(str(small))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    f0 = {k: v.contents() for k, v in r0.fields.items() if not k.startswith("GGUF.")}
    assert (f["llama.embedding_length"], f["llama.feed_forward_length"]) == (1024, 1536)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (32, 8)
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5 * 288 / 1024)
    assert all(f[k] == v for k, v in f0.items() if k.startswith("tokenizer."))
    arch, n_head, n_kv = gguf_heads(r)
    assert len(r.tensors) == len(expect)
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        w = torch.from_numpy(unpermute_rotary_rows(w, arch, t.name, n_head, n_kv).copy())
        assert torch.equal(w, expect[gguf_hf_name(t.name)]), t.name
