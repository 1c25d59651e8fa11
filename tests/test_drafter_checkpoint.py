"""Drafter checkpoints: the DeepSpec DSpark layout and the z-lab DFlash layout, written by hand
here with the key names of REFERENCE.md, load with load_drafter and reproduce an independent dense
re-implementation of the model (the DSpark notebook's conventions) from the raw tensors;
save_drafter -> load_drafter is exact; drafters that do not fit the target are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dspark.engine.attention import AttnBatch, TorchAttention
from dspark.engine.kv_cache import KVCache
from dspark.models.drafters.checkpoint import load_drafter, save_drafter
from dspark.models.llama import LlamaConfig, LlamaModel

V, HT, LT = 80, 32, 4  # target vocab, hidden, layers
H, I, NH, NKV, HD, NL = 32, 48, 4, 2, 8, 2  # drafter
BLOCK, RANK, MASK = 5, 6, 79
LAYER_IDS = [0, 2]
THETA, EPS = 10000.0, 1e-6


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(model_type="llama", vocab_size=V, hidden_size=HT, intermediate_size=64, num_hidden_layers=LT,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=EPS, rope_theta=THETA,
                      rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False,
                      qk_norm=False, eos_token_id=[2], bos_token_id=1)
    m = LlamaModel(cfg)
    with torch.no_grad():
        m.embed_tokens.weight.normal_(0, 1.0)
        m.lm_head.weight.normal_(0, 0.3)
    return m.eval()


def raw_tensors(kind: str, seed: int = 0, hidden: int = H, fc_in: int = HT * len(LAYER_IDS), vocab: int = V,
                own_embed: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint key names (REFERENCE.md); no embed_tokens / lm_head."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    sd = {"fc.weight": w(hidden, fc_in), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(NL):
        p = f"layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(NH * HD, hidden), p + "self_attn.k_proj.weight": w(NKV * HD, hidden),
               p + "self_attn.v_proj.weight": w(NKV * HD, hidden), p + "self_attn.o_proj.weight": w(hidden, NH * HD),
               p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
               p + "mlp.gate_proj.weight": w(I, hidden), p + "mlp.up_proj.weight": w(I, hidden),
               p + "mlp.down_proj.weight": w(hidden, I),
               p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden)}
    if kind == "dspark":
        sd |= {"markov_head.markov_w1.weight": w(vocab, RANK, scale=1.0),
               "markov_head.markov_w2.weight": w(vocab, RANK, scale=1.0),  # nn.Linear(r, V) weight: [V, r]
               "confidence_head.proj.weight": w(1, hidden + RANK), "confidence_head.proj.bias": w(1, scale=1.0)}
    if own_embed:
        sd |= {"embed_tokens.weight": w(vocab, hidden, scale=1.0), "lm_head.weight": w(vocab, hidden, scale=0.3)}
    return sd


def hf_config(kind: str, **over) -> dict:
    """config.json: a Qwen3 base config plus the DSpark (DeepSpec) or DFlash (z-lab) fields."""
    cfg = {"model_type": "qwen3", "hidden_size": H, "intermediate_size": I, "num_hidden_layers": NL,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "vocab_size": V,
           "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512, "torch_dtype": "float32",
           "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "num_target_layers": LT, "block_size": BLOCK}
    if kind == "dspark":
        cfg |= {"architectures": ["Qwen3DSparkModel"], "mask_token_id": MASK, "target_layer_ids": LAYER_IDS,
                "markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True}
    else:
        cfg |= {"architectures": ["DFlashDraftModel"],
                "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}}
    cfg |= over
    return cfg


def write(folder: Path, cfg: dict, sd: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------- the reference model, dense
def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, pos):
    """x [n, heads, d] at positions pos [n]: HF's half-split rotary."""
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_context_kv(sd, feats):
    """Per layer (k, v) of the context: k_norm(k_proj(ctx)) rotated at 0..C-1, v_proj(ctx)."""
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    pos = torch.arange(feats.shape[0])
    out = []
    for i in range(NL):
        p = f"layers.{i}.self_attn."
        k = _rms((ctx @ sd[p + "k_proj.weight"].T).view(-1, NKV, HD), sd[p + "k_norm.weight"])
        out.append((_rope(k, pos), (ctx @ sd[p + "v_proj.weight"].T).view(-1, NKV, HD)))
    return ctx, out


def ref_block_hidden(sd, embed, feats, block_ids):
    """The notebook's backbone: block queries over [context; block] keys, no mask, final norm."""
    ctx, _ = ref_context_kv(sd, feats)
    C, B = feats.shape[0], block_ids.shape[0]
    pos = torch.arange(C + B)
    x = embed[block_ids]
    for i in range(NL):
        p = f"layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"])
        q = _rms((h @ sd[p + "self_attn.q_proj.weight"].T).view(B, NH, HD), sd[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])
        k = _rms((both @ sd[p + "self_attn.k_proj.weight"].T).view(C + B, NKV, HD), sd[p + "self_attn.k_norm.weight"])
        v = (both @ sd[p + "self_attn.v_proj.weight"].T).view(C + B, NKV, HD)
        q, k = _rope(q, pos[C:]), _rope(k, pos)
        k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(B, NH * HD)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["norm.weight"])


# ---------------------------------------------------------------- the loaded module, paged
def paged_forward(model, feats_list, anchors):
    """write_context for each request's context, then one block_hidden over all blocks (mask "full")."""
    dc, ps = model.config, 16
    kv = KVCache(dc.num_hidden_layers, 8, ps, dc.num_key_value_heads, dc.head_dim, torch.float32, "cpu")
    tables, next_page, ids, pos, q_lens, kv_lens = [], 0, [], [], [], []
    for feats, anchor in zip(feats_list, anchors):
        C, B = feats.shape[0], dc.block_size
        n_pages = -(-(C + B) // ps)
        pages = list(range(next_page, next_page + n_pages))[::-1]  # non-contiguous, reversed pages
        next_page += n_pages
        tables.append(pages)
        slots = torch.tensor([pages[t // ps] * ps + t % ps for t in range(C)])
        with torch.inference_mode():
            model.write_context(feats, torch.arange(C), slots, kv)
        ids += [anchor] + [dc.mask_token_id] * (B - 1)
        pos += list(range(C, C + B))
        q_lens.append(B)
        kv_lens.append(C + B)
    attn = TorchAttention("cpu")
    attn.plan(AttnBatch(q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=ps, mask="full"))
    with torch.inference_mode():
        h = model.block_hidden(torch.tensor(ids), torch.tensor(pos), attn, kv)
    return h.view(len(anchors), dc.block_size, -1), kv, tables


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("own_embed", [False, True], ids=["shared-embed", "own-embed"])
def test_layout_loads_and_matches_reference(tmp_path, target, kind, own_embed):
    sd = raw_tensors(kind, own_embed=own_embed)
    folder = write(tmp_path / kind, hf_config(kind), sd)
    model = load_drafter(folder, target, torch.float32, "cpu")
    dc = model.config
    assert (dc.kind, dc.block_size, dc.mask_token_id, dc.target_layer_ids) == (kind, BLOCK, MASK, LAYER_IDS)
    assert dc.num_drafts == (BLOCK if kind == "dspark" else BLOCK - 1)
    assert (model.markov_head is not None, model.confidence_head is not None) == (kind == "dspark",) * 2
    assert (model.embed_tokens is not None) == own_embed and (model.lm_head is not None) == own_embed
    embed = sd["embed_tokens.weight"] if own_embed else target.embed_tokens.weight.detach()
    lm_head = sd["lm_head.weight"] if own_embed else target.lm_head.weight.detach()

    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(c, HT * len(LAYER_IDS), generator=g) for c in (7, 19)]  # 19 + block crosses a page
    anchors = [11, 42]
    h, kv, tables = paged_forward(model, feats, anchors)
    for r, (f, a) in enumerate(zip(feats, anchors)):
        block_ids = torch.tensor([a] + [MASK] * (BLOCK - 1))
        want = ref_block_hidden(sd, embed, f, block_ids)
        _close(h[r], want, f"block_hidden of request {r}")
        # the paged context cache holds the reference context K/V
        _, ctx_kv = ref_context_kv(sd, f)
        slots = [tables[r][t // 16] * 16 + t % 16 for t in range(f.shape[0])]
        for i, (k, v) in enumerate(ctx_kv):
            _close(kv.k[i, slots], k, f"context K, layer {i}")
            _close(kv.v[i, slots], v, f"context V, layer {i}")
        # heads: draft slots, base logits through the (shared or own) LM head, Markov, confidence
        with torch.inference_mode():
            dh = model.draft_hidden(h[r:r + 1])[0]
            base = model.head(dh)
        slots_used = want if kind == "dspark" else want[1:]
        _close(dh, slots_used, "draft slots")
        _close(base, slots_used @ lm_head.T, "base logits")
        prev = torch.tensor([a, 3, 17, 29, 61][:dh.shape[0]])
        with torch.inference_mode():
            step = torch.stack([model.step_logits(base[k], prev[k]) for k in range(dh.shape[0])])
            conf = model.confidence(dh, prev)
        if kind == "dspark":
            w1 = sd["markov_head.markov_w1.weight"][prev]
            _close(step, base + w1 @ sd["markov_head.markov_w2.weight"].T, "Markov logits")
            model.requires_grad_(False)  # as the engine holds it: the Markov bias from a float32 copy
            with torch.inference_mode():
                frozen = torch.stack([model.step_logits(base[k], prev[k]) for k in range(dh.shape[0])])
            model.requires_grad_(True)
            _close(frozen, step, "frozen Markov logits")
            with torch.inference_mode():  # a batch of slots at once, as the engine calls it
                _close(model.step_logits(base, prev), step, "frozen Markov logits, batched")
            want_c = torch.cat([slots_used, w1], -1) @ sd["confidence_head.proj.weight"].T \
                + sd["confidence_head.proj.bias"]
            _close(conf, want_c.squeeze(-1), "confidence logits")
        else:
            _close(step, base, "DFlash logits (no Markov head)")
            assert conf is None


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_save_load_round_trip(tmp_path, target, kind):
    sd = raw_tensors(kind, seed=3)
    model = load_drafter(write(tmp_path / "in", hf_config(kind), sd), target, torch.float32, "cpu")
    save_drafter(model, tmp_path / "out")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(sd), "saved in the DSpark layout: separate gate/up, no shared embed/lm_head"
    for k in sd:
        assert torch.equal(saved[k], sd[k]), k
    again = load_drafter(tmp_path / "out", target, torch.float32, "cpu")
    assert dataclasses.asdict(again.config) == dataclasses.asdict(model.config)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["block_size"] == BLOCK and cfg["target_layer_ids"] == LAYER_IDS
    assert cfg["num_target_layers"] == LT and cfg["tie_word_embeddings"] is False
    if kind == "dspark":
        assert cfg["markov_rank"] == RANK and cfg["enable_confidence_head"] is True


def test_round_trip_with_own_embedding_and_narrower_hidden(tmp_path, target):
    """A drafter with its own embed_tokens / lm_head may be narrower than the target."""
    sd = raw_tensors("dspark", seed=4, hidden=24, own_embed=True)
    model = load_drafter(write(tmp_path / "in", hf_config("dspark", hidden_size=24), sd), target,
                         torch.float32, "cpu")
    f = torch.randn(9, HT * len(LAYER_IDS), generator=torch.Generator().manual_seed(5))
    h, _, _ = paged_forward(model, [f], [7])
    _close(h[0], ref_block_hidden(sd, sd["embed_tokens.weight"], f, torch.tensor([7] + [MASK] * (BLOCK - 1))),
           "block_hidden")
    save_drafter(model, tmp_path / "out")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(sd) and all(torch.equal(saved[k], sd[k]) for k in sd)


REFUSALS = {
    "wrong-vocab": (dict(vocab_size=V + 8), dict(vocab=V + 8), r"vocab 88 != target vocab 80"),
    "fc-width": ({}, dict(fc_in=HT * len(LAYER_IDS) + 8), r"fc expects 72 features"),
    "layer-out-of-range": (dict(target_layer_ids=[0, 4]), {}, r"target_layer_ids \[4\] outside"),
    "num-target-layers": (dict(num_target_layers=6), {}, r"trained for a 6-layer target"),
    "mask-out-of-range": (dict(mask_token_id=V), {}, r"mask_token_id 80 outside"),
    "hidden-without-embed": (dict(hidden_size=24), dict(hidden=24), r"hidden size 24 differs"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_mismatched_drafter_is_refused(tmp_path, target, case):
    cfg_over, tensor_over, message = REFUSALS[case]
    folder = write(tmp_path / case, hf_config("dspark", **cfg_over), raw_tensors("dspark", **tensor_over))
    with pytest.raises(ValueError, match=message):
        load_drafter(folder, target, torch.float32, "cpu")


def test_dflash_layer_ids_checked_too(tmp_path, target):
    cfg = hf_config("dflash", dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 7]})
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] outside"):
        load_drafter(write(tmp_path / "d", cfg, raw_tensors("dflash")), target, torch.float32, "cpu")


def test_broken_checkpoints_are_refused(tmp_path, target):
    sd = raw_tensors("dspark")
    missing = {k: v for k, v in sd.items() if k != "layers.1.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match="missing"):
        load_drafter(write(tmp_path / "a", hf_config("dspark"), missing), target, torch.float32, "cpu")
    no_fc = {k: v for k, v in sd.items() if k != "fc.weight"}
    with pytest.raises(ValueError, match="no fc.weight"):
        load_drafter(write(tmp_path / "b", hf_config("dspark"), no_fc), target, torch.float32, "cpu")
    cfg = hf_config("dspark")
    del cfg["block_size"]
    with pytest.raises(ValueError, match="block_size"):
        load_drafter(write(tmp_path / "c", cfg, sd), target, torch.float32, "cpu")
    (tmp_path / "e").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_drafter(tmp_path / "e", target, torch.float32, "cpu")


def test_reduced_vocab_map_is_checked(tmp_path, target):
    from dspark.models.drafters.dspark import BlockDrafter, DrafterConfig

    sd = raw_tensors("dspark")
    cfg = hf_config("dspark", draft_vocab_size=4)
    assert BlockDrafter(DrafterConfig.from_hf(cfg), HT).markov_head.markov_w2.weight.shape == (4, RANK)
    good = dict(sd, **{"markov_head.markov_w2.weight": sd["markov_head.markov_w2.weight"][:4]})
    good["draft_to_target"] = torch.tensor([1, 5, 9, 20])
    loaded = load_drafter(write(tmp_path / "ok", cfg, good), target, torch.float32, "cpu")
    assert loaded.draft_to_target.tolist() == [1, 5, 9, 20]
    for bad in ([1, 5, 9, V], [1, 5, 5, 9]):
        good["draft_to_target"] = torch.tensor(bad)
        with pytest.raises(ValueError, match="draft_to_target"):
            load_drafter(write(tmp_path / f"bad{bad[-1]}{bad[2]}", cfg, good), target, torch.float32, "cpu")
