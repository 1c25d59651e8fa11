"""Tests for dspark.train: loss parts, masks, the dense multi-anchor forward against the paged
inference path, training, export/reload and resume. A tiny random Llama target (SmolLM2's
vocabulary and tokenizer, hidden 64, 4 layers) keeps everything on CPU and fast."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dspark.models.drafters.checkpoint import load_drafter
from dspark.models.loader import load_transformers_model
from dspark.train.data import GenSettings, generate_dataset, read_prompts
from dspark.train.dataset import TokenDataset
from dspark.train.drafter_init import default_layer_ids, frequent_tokens, load_target, make_drafter_config, new_drafter
from dspark.train.features import block_mask, drafter_blocks, sample_anchors, target_features, valid_slots
from dspark.train.loss import batch_loss, decay_weights, dspark_loss, target_c_star
from dspark.train.trainer import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from dspark.models.loader import resolve_model_folder

    src = resolve_model_folder(None)
    out = tmp_path_factory.mktemp("tiny")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0, 0.5)
    m.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, out / f)
    return str(out)


@pytest.fixture(scope="module")
def target(tiny_folder):
    return load_target(tiny_folder, "cpu", torch.float32)[0]


def _drafter(target, block=4, rank=8, seed=0):
    dc = make_drafter_config(target.config, num_layers=2, block_size=block, markov_rank=rank,
                             layer_ids=[0, 1, 2], mask_token_id=16)
    d = new_drafter(dc, target, seed)
    with torch.no_grad():  # non-zero Markov head so the tests exercise it
        d.markov_head.markov_w2.weight.normal_(0, 0.1)
    return d


def _write_shard(path, seqs, prompt_lens):
    path.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
               "offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
               "prompt_lens": np.asarray(prompt_lens, np.int32),
               "prompt_index": np.arange(len(seqs), dtype=np.int64),
               "sampled": np.zeros(len(seqs), np.uint8)}, str(path / "shard_00000.safetensors"))


def _toy_data(tmp_path, n=12):
    rng = np.random.default_rng(0)
    seqs, pls = [], []
    for _i in range(n):
        p = int(rng.integers(4, 8))
        start = int(rng.integers(100, 200))
        resp = [(start + 3 * j) % 300 + 100 for j in range(int(rng.integers(20, 30)))]  # learnable pattern
        seqs.append([1] + list(rng.integers(100, 400, p - 1)) + resp)
        pls.append(p)
    _write_shard(tmp_path / "data", seqs, pls)
    return TokenDataset(tmp_path / "data")


# ------------------------------------------------------------------ loss parts
def test_cstar_and_loss_parts_by_hand():
    d = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # p_d = [.5, .5]
    t = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])  # p_t = [.75, .25] and [.5, .5]
    assert torch.allclose(target_c_star(d.softmax(-1), t.softmax(-1)), torch.tensor([0.75, 1.0]))
    labels = torch.tensor([0, 1])
    conf = torch.tensor([0.0, 0.0])
    slot = torch.tensor([0, 1])
    total, parts = dspark_loss(d, t, labels, conf, slot, gamma=4.0)
    w1 = math.exp(-1 / 4)
    ce = (math.log(2) + w1 * math.log(2)) / 2
    l1 = (0.5 + w1 * 0.0) / 2
    bce = (math.log(2) + w1 * math.log(2)) / 2  # BCE(sigmoid(0)=.5, c*) = ln 2 for any c*
    assert parts["ce"].item() == pytest.approx(ce, abs=1e-6)
    assert parts["l1"].item() == pytest.approx(l1, abs=1e-6)
    assert parts["bce"].item() == pytest.approx(bce, abs=1e-6)
    assert total.item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * bce, abs=1e-6)
    # c* is a detached target: no gradient flows into p_d through it
    d2 = d.clone().requires_grad_(True)
    c2 = torch.tensor([1.0, -1.0], requires_grad=True)
    _, p = dspark_loss(d2, t, labels, c2, slot)
    bce_only = torch.nn.functional.binary_cross_entropy_with_logits(c2, torch.tensor([0.75, 1.0]), reduction="none")
    assert p["bce"].item() == pytest.approx(((bce_only * torch.tensor([1.0, w1])).sum() / 2).item(), abs=1e-6)


def test_decay_weights():
    w = decay_weights(8, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(8)]))
    assert w[0] == 1.0


def test_default_layer_ids():
    assert default_layer_ids(30) == [1, 7, 14, 20, 27]


def test_valid_prefix_mask():
    lengths = torch.tensor([10])
    resp = torch.zeros(1, 12, dtype=torch.bool)
    resp[0, 4:10] = True
    resp[0, 7] = False  # a hole: slots targeting 7 and everything after must drop
    anchors = torch.tensor([[4, 8, 5]])
    ok = torch.tensor([[True, True, False]])
    v = valid_slots(anchors, ok, lengths, resp, 4)
    assert v[0, 0].tolist() == [True, True, False, False]  # targets 5, 6, 7(hole), 8
    assert v[0, 1].tolist() == [True, False, False, False]  # targets 9, 10 (past the end)
    assert v[0, 2].tolist() == [False] * 4  # padding anchor


def test_sample_anchors_on_response():
    a, ok = sample_anchors([10, 6], [5, 5], 8, 4, torch.Generator().manual_seed(0))
    assert sorted(a[0][ok[0]].tolist()) == [5, 6, 7, 8]
    assert a[1][ok[1]].tolist() == [] and not ok[1].any()


def test_block_mask_shape():
    m = block_mask(torch.tensor([[2, 5]]), 6, 3)[0, 0]
    assert m.shape == (6, 12)
    assert m[0, :6].tolist() == [True, True, False, False, False, False]
    assert m[3, :6].tolist() == [True] * 5 + [False]
    assert m[0, 6:].tolist() == [True] * 3 + [False] * 3


# ------------------------------------------------------------------ forwards
def test_target_features_match_hf(tiny_folder, target):
    hf = load_transformers_model(tiny_folder).eval()
    ids = torch.tensor([[1, 500, 600, 700, 800, 900, 1000, 42], [1, 9, 8, 7, 6, 5, 2, 2]])
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        feats, final = target_features(target, ids, [0, 2])
    H = target.config.hidden_size
    assert torch.allclose(feats[..., :H], out.hidden_states[1], atol=1e-4)
    assert torch.allclose(feats[..., H:], out.hidden_states[3], atol=1e-4)
    assert torch.allclose(target.lm_head(final), out.logits, atol=1e-3)


def test_paged_capture_matches_training_features_in_listed_order(target):
    """The serving forward concatenates captured layers in the drafter's order, like training,
    even when that order is not sorted."""
    from dspark.engine.attention import AttnBatch, TorchAttention
    from dspark.engine.kv_cache import KVCache

    c = target.config
    ids = torch.tensor([[1, 500, 600, 700, 800, 900, 1000, 42]])
    kv = KVCache(c.num_hidden_layers, 1, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    attn = TorchAttention("cpu")
    attn.plan(AttnBatch(q_lens=[8], kv_lens=[8], page_tables=[[0]], page_size=16, mask="causal"))
    with torch.no_grad():
        ref, _ = target_features(target, ids, [2, 0])
        _, feats = target(ids[0], torch.arange(8), attn, kv, (2, 0))
    assert torch.allclose(feats, ref[0], atol=1e-4)


def test_multi_anchor_equals_single_and_inference_path(target):
    from dspark.engine.attention import AttnBatch, TorchAttention
    from dspark.engine.kv_cache import KVCache

    d = _drafter(target).eval()
    torch.manual_seed(1)
    tokens = torch.randint(20, 3000, (1, 24))
    with torch.no_grad():
        feats, _ = target_features(target, tokens, d.config.target_layer_ids)
        anchors = torch.tensor([[5, 11, 17, 20]])
        multi = drafter_blocks(d, feats, tokens, anchors)
        c = d.config
        for i, a in enumerate(anchors[0].tolist()):
            single = drafter_blocks(d, feats, tokens, torch.tensor([[a]]))
            assert torch.allclose(multi[0, i], single[0, 0], atol=1e-5)
            # the paged inference path: context 0..a-1 written to the drafter cache, block at a..a+B-1
            ps, npages = 16, 4
            kv = KVCache(c.num_hidden_layers, npages, ps, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
            pages = [0, 1, 2, 3]
            slots = torch.arange(a)
            d.write_context(feats[0, :a], torch.arange(a), slots, kv)
            attn = TorchAttention("cpu")
            attn.plan(AttnBatch(q_lens=[c.block_size], kv_lens=[a + c.block_size], page_tables=[pages],
                                page_size=ps, mask="full"))
            ids = torch.tensor([tokens[0, a].item()] + [c.mask_token_id] * (c.block_size - 1))
            ref = d.block_hidden(ids, torch.arange(a, a + c.block_size), attn, kv)
            assert torch.allclose(multi[0, i], ref, atol=1e-5)


# ------------------------------------------------------------------ training
def _trainer(target, data, out, steps=6, seed=0, **kw):
    d = _drafter(target, seed=seed)
    cfg = TrainConfig(steps=steps, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=2, seed=seed,
                      save_every=0, log_every=1, progress=False, export_dtype="fp32", **kw)
    return Trainer(target, d, data, cfg, out, pad_id=2)


def test_training_lowers_loss(target, tmp_path):
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=20)
    with torch.no_grad():
        before = float(tr.micro_loss(10_000)[0])
    tr.fit()
    with torch.no_grad():
        after = float(tr.micro_loss(10_000)[0])
    assert after < 0.8 * before, (before, after)


def test_slot_agreement_and_tau_estimate(target, tmp_path):
    from dspark.train.loss import expected_tau
    from dspark.train.trainer import slot_summary

    assert expected_tau(torch.tensor([0.5, 0.5])) == pytest.approx(1.75)  # 1 + 0.5 + 0.5 * 0.5
    s = slot_summary(torch.tensor([2.0, 1.0, 0.0]), torch.tensor([4.0, 2.0, 0.0]))  # no rows: 0, not nan
    assert s == {"acc_by_slot": [0.5, 0.5, 0.0], "tau_est": 1.75}
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=2)
    with torch.no_grad():
        _, parts = tr.micro_loss(0)
    rows, hits = parts["slot_rows"], parts["slot_hits"]
    assert rows.shape == (4,) and rows.sum() == parts["slots"] and (hits <= rows).all()
    assert float(hits.sum() / rows.sum()) == pytest.approx(float(parts["acc"]))
    assert (rows[:-1] >= rows[1:]).all()  # valid prefixes: a later slot is never supervised more often
    tr.fit()
    rec = tr.history[-1]
    assert len(rec["acc_by_slot"]) == 4
    assert rec["tau_est"] == pytest.approx(expected_tau(torch.tensor(rec["acc_by_slot"])), abs=1e-3)


def test_export_reload_same_outputs(target, tmp_path):
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=3)
    tr.fit()
    stats = tr.export(tmp_path / "run" / "final")
    assert stats["steps"] == 3
    cfg = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == 16 and cfg["markov_rank"] == 8
    assert cfg["architectures"] == ["Qwen3DSparkModel"]  # DeepSpec's name for the layout
    d2 = load_drafter(tmp_path / "run" / "final", target, torch.float32, "cpu")
    d1 = tr.drafter.eval()
    b = data.batch([0, 1], 2, "cpu")
    a, ok = sample_anchors(b["lens"], b["prompt_lens"], 5, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats, final = target_features(target, b["ids"], d1.config.target_layer_ids)
        h1, h2 = drafter_blocks(d1, feats, b["ids"], a), drafter_blocks(d2, feats, b["ids"], a)
        assert torch.allclose(h1, h2, atol=1e-6)
        prev = b["ids"][:, :4]
        assert torch.allclose(d1.step_logits(d1.head(h1[:, 0]), prev), d2.step_logits(d2.head(h2[:, 0]), prev))
        assert torch.allclose(d1.confidence(h1[:, 0], prev), d2.confidence(h2[:, 0], prev))
        l1 = batch_loss(d1, target.lm_head, feats, final, b["ids"], b["lengths"], b["resp"], a, ok)[0]
        l2 = batch_loss(d2, target.lm_head, feats, final, b["ids"], b["lengths"], b["resp"], a, ok)[0]
    assert l1.item() == pytest.approx(l2.item(), abs=1e-6)


def test_length_groups_cover_each_epoch_and_pad_less(target, tmp_path):
    rng = np.random.default_rng(1)
    seqs = [[1] + list(rng.integers(100, 400, int(rng.integers(5, 200)))) for _ in range(64)]
    _write_shard(tmp_path / "data", seqs, [3] * 64)
    data = TokenDataset(tmp_path / "data")
    plain, grouped = (_trainer(target, data, tmp_path / f"g{g}", length_groups=g) for g in (1, 4))
    epoch = {g: [tr.order.batch(m) for m in range(16)] for g, tr in ((1, plain), (4, grouped))}  # 16 x 4 = 64
    for batches in epoch.values():
        assert sorted(i for b in batches for i in b) == list(range(64))  # every sequence once an epoch
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    assert epoch[1] == [perm[4 * m:4 * m + 4] for m in range(16)]  # length_groups 1: plain random batches
    for start in range(0, 16, 4):  # each run of 4 batches is the same 16 sequences, sorted by length
        group = [i for b in epoch[4][start:start + 4] for i in b]
        assert sorted(group) == sorted(perm[4 * start:4 * start + 16])
        assert [len(data.seqs[i]) for i in group] == sorted(len(data.seqs[i]) for i in group)

    def padded(batches):
        return sum(4 * max(len(data.seqs[i]) for i in b) for b in batches)

    assert padded(epoch[4]) < 0.8 * padded(epoch[1])
    assert [grouped.order.batch(m) for m in range(16, 32)] != epoch[4]  # the next epoch has new batches


def test_resume_continues_the_same_run(target, tmp_path):
    data = _toy_data(tmp_path)
    full = _trainer(target, data, tmp_path / "a", steps=5)
    losses_full = [full.train_step()["loss"] for _ in range(5)]
    part = _trainer(target, data, tmp_path / "b", steps=5)
    for _ in range(3):
        part.train_step()
    part.save_checkpoint()
    resumed = _trainer(target, data, tmp_path / "b", steps=5, seed=0)
    assert resumed.load_checkpoint() and resumed.step == 3
    losses_resumed = [resumed.train_step()["loss"] for _ in range(2)]
    assert losses_resumed == pytest.approx(losses_full[3:], rel=1e-5, abs=1e-6)


def test_conversation_rows_are_answered_whole(tmp_path):
    """A `messages` row (user, assistant, user) keeps the whole conversation for the chat template;
    bench readers take its first user message as the prompt text."""
    from dspark.bench.prompts import load_prompts

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "A pear."}, {"role": "user", "content": "Another?"}]
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"id": "m", "category": "multiturn", "messages": conv}) + "\n"
                  + json.dumps({"prompt": "Hi"}) + "\n")
    got = read_prompts(pf)
    assert got[0]["messages"] == conv and got[0]["category"] == "multiturn"
    assert got[1]["messages"] == [{"role": "user", "content": "Hi"}]
    assert load_prompts(pf, 2) == ["Name a fruit.", "Hi"]


def test_generate_dataset_resumable(tiny_folder, tmp_path):
    pf = tmp_path / "p.jsonl"
    rows = [{"id": f"x{i}", "category": "c", "prompt": f"Say {i}"} for i in range(3)]
    rows.append({"id": "t", "category": "d", "turns": ["Hi there"]})
    pf.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompts(pf)[3]["messages"][0]["content"] == "Hi there"
    s = GenSettings(max_new_tokens=6, shard_size=2, batch_size=4, sample_share=0.5)
    st = generate_dataset(str(pf), tmp_path / "data", None, tiny_folder, "cpu", torch.float32, s, progress=False)
    assert st["shards_written"] == 2 and st["sequences"] == 4
    ds = TokenDataset(tmp_path / "data")
    assert all(len(x) > p for x, p in zip(ds.seqs, ds.prompt_lens))
    again = generate_dataset(str(pf), tmp_path / "data", None, tiny_folder, "cpu", torch.float32, s, progress=False)
    assert again["shards_written"] == 0
    assert [p["id"] for p in read_prompts(pf, limit=2, skip=1)] == ["x1", "x2"]
    with pytest.raises(ValueError, match="skip_prompts=0, not 2"):  # would mix two prompt ranges
        generate_dataset(str(pf), tmp_path / "data", None, tiny_folder, "cpu", torch.float32, s,
                         progress=False, skip_prompts=2)
    tail = generate_dataset(str(pf), tmp_path / "tail", None, tiny_folder, "cpu", torch.float32, s,
                            progress=False, skip_prompts=2)
    assert tail["sequences"] == 2 and TokenDataset(tmp_path / "tail").seqs[1].tolist() == ds.seqs[3].tolist()
    # 3 prompts leave shard 1 short; asking for all 4 later writes it again instead of skipping prompt 3
    few = generate_dataset(str(pf), tmp_path / "grow", 3, tiny_folder, "cpu", torch.float32, s, progress=False)
    assert few["sequences"] == 3
    # responses written with other generation settings are refused, not mixed in (shard 1 is to be written)
    for change, field in ((dict(max_new_tokens=7), "max_new_tokens=6"), (dict(seed=3), "seed=0"),
                          (dict(sample_share=1.0), "sample_share=0.5")):
        with pytest.raises(ValueError, match=field):
            generate_dataset(str(pf), tmp_path / "grow", 4, tiny_folder, "cpu", torch.float32,
                             GenSettings(**{**s.__dict__, **change}), progress=False)
    assert json.loads((tmp_path / "grow" / "meta.json").read_text())["max_new_tokens"] == 6
    more = generate_dataset(str(pf), tmp_path / "grow", 4, tiny_folder, "cpu", torch.float32, s, progress=False)
    assert more["shards_written"] == 1 and len(TokenDataset(tmp_path / "grow")) == 4
    # a finished folder serves a run with another seed (the CLI's --seed also seeds training)
    done = generate_dataset(str(pf), tmp_path / "grow", None, tiny_folder, "cpu", torch.float32,
                            GenSettings(**{**s.__dict__, "seed": 3}), progress=False)
    assert done["shards_written"] == 0
    assert json.loads((tmp_path / "grow" / "meta.json").read_text())["seed"] == 0


def test_generate_dense_matches_hf_greedy(tiny_folder, target):
    from dspark.train.features import generate_dense

    hf = load_transformers_model(tiny_folder).eval()
    prompts = [[1, 500, 600, 700, 800], [1, 42, 43], [1, 9, 8, 7, 6, 5, 4]]
    got = generate_dense(target, prompts, 6, [0.0, 0.0, 0.0], {2}, pad_id=2)
    for p, g in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2)
        ref = ref[0, len(p):].tolist()
        if 2 in ref:
            ref = ref[:ref.index(2) + 1]
        assert g == ref
    sampled = generate_dense(target, prompts, 4, [0.7, 0.0, 0.7], {2}, pad_id=2, seed=1)
    assert sampled[1] == got[1][:4] and all(1 <= len(r) <= 4 for r in sampled)


def test_dense_backend_data_equals_engine_greedy(tiny_folder, tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt": f"Count to {i}, please"}) + "\n" for i in range(3)))
    out = {}
    for backend in ("engine", "dense"):
        s = GenSettings(max_new_tokens=5, shard_size=8, batch_size=2, sample_share=0.0, backend=backend)
        generate_dataset(str(pf), tmp_path / backend, None, tiny_folder, "cpu", torch.float32, s, progress=False)
        out[backend] = [x.tolist() for x in TokenDataset(tmp_path / backend).seqs]
    assert out["engine"] == out["dense"]


# ------------------------------------------------------------------ reduced draft vocabulary
def test_reduced_vocab_loss_by_hand():
    """p_d lives on draft ids {0, 2} of a 3-token vocabulary: L1 gains the target's mass on id 1,
    a label outside the draft vocabulary adds no CE, and the log-normalizer path agrees."""
    d2t = torch.tensor([0, 2])
    d = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # p_d = [.5, 0, .5] over the target vocabulary
    t = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))
    labels = torch.tensor([2, 1])  # the second label cannot be drafted
    slot = torch.tensor([0, 0])
    _, parts = dspark_loss(d, t, labels, None, slot, draft_to_target=d2t)
    l1 = ((0.0 + 0.25 + 0.25) + (0.25 + 0.5 + 0.25)) / 2
    assert parts["l1"].item() == pytest.approx(l1, abs=1e-6)
    assert parts["ce"].item() == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert parts["acc"].item() == pytest.approx(0.0)  # argmax ties pick id 0, never 2; id 1 impossible
    lse = torch.logsumexp(t, -1)
    _, parts2 = dspark_loss(d, t[:, d2t], labels, None, slot, draft_to_target=d2t, target_lse=lse)
    for k in ("ce", "l1", "cstar"):
        assert parts2[k].item() == pytest.approx(parts[k].item(), abs=1e-6)
    _, parts3 = dspark_loss(d, t, torch.tensor([2, 7]), None, slot, draft_to_target=d2t)  # 7: above every id
    assert parts3["ce"].item() == pytest.approx(parts["ce"].item(), abs=1e-6)


def _rv_drafter(target, data, n=64, seed=0):
    vocab = frequent_tokens(data, n, target.config.vocab_size)
    dc = make_drafter_config(target.config, num_layers=1, block_size=4, markov_rank=8, layer_ids=[0, 1, 2],
                             mask_token_id=16, draft_vocab_size=n)
    return new_drafter(dc, target, seed, vocab), vocab


def test_unsorted_draft_vocabulary_is_refused(target, tmp_path):
    data = _toy_data(tmp_path)
    d, vocab = _rv_drafter(target, data)
    d.draft_to_target.copy_(vocab.flip(0))
    with pytest.raises(ValueError, match="ascending"):
        Trainer(target, d, data, TrainConfig(progress=False), tmp_path / "run", pad_id=2)


def test_frequent_tokens_cover_the_responses(target, tmp_path):
    data = _toy_data(tmp_path)
    vocab = frequent_tokens(data, 300, target.config.vocab_size)
    resp = set(np.concatenate([s[p:] for s, p in zip(data.seqs, data.prompt_lens)]).tolist())
    assert resp <= set(vocab.tolist()) and vocab.tolist() == sorted(vocab.tolist())
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_tokens(data, 0, target.config.vocab_size)


def test_reduced_vocab_training_cached_features_export(target, tmp_path):
    """Cached features (bf16 + log-normalizers) give the loss of the uncached full-head path; a few
    steps lower it; the export keeps the vocabulary and reloads to the same logits."""
    data = _toy_data(tmp_path)
    d, vocab = _rv_drafter(target, data)
    cfg = dict(steps=20, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=2, save_every=0, log_every=1,
               progress=False, export_dtype="fp32")
    plain = Trainer(target, d, data, TrainConfig(**cfg), tmp_path / "a", pad_id=2)
    cached = Trainer(target, _rv_drafter(target, data)[0], data, TrainConfig(cache_features=True, **cfg),
                     tmp_path / "b", pad_id=2)
    with torch.no_grad():
        l_plain, l_cached = float(plain.micro_loss(0)[0]), float(cached.micro_loss(0)[0])
        assert l_cached == pytest.approx(l_plain, rel=2e-2)
        assert float(cached.micro_loss(0)[0]) == pytest.approx(l_cached, rel=1e-6)  # served from the cache
        before = float(cached.micro_loss(10_000)[0])
    cached.fit()
    with torch.no_grad():
        after = float(cached.micro_loss(10_000)[0])
    assert after < 0.8 * before, (before, after)
    cached.export(tmp_path / "b" / "final")
    cfg_json = json.loads((tmp_path / "b" / "final" / "config.json").read_text())
    assert cfg_json["draft_vocab_size"] == 64
    d2 = load_drafter(tmp_path / "b" / "final", target, torch.float32, "cpu")
    assert d2.draft_to_target.tolist() == vocab.tolist()
    h = torch.randn(3, target.config.hidden_size)
    prev = torch.tensor([5, 100, 200])
    full = d2.step_logits(d2.head(h), prev)
    assert torch.isinf(full).sum(-1).tolist() == [target.config.vocab_size - 64] * 3
    d1 = cached.drafter.eval()
    assert torch.allclose(full, d1.step_logits(d1.head(h), prev), atol=1e-5)
    assert torch.allclose(full[:, vocab], d1.step_logits(d1.draft_logits(h), prev), atol=1e-5)


def test_trainer_disk_cache_equals_ram_and_skips_target(target, tmp_path, monkeypatch):
    """The on-disk cache gives the RAM cache's losses, and a new trainer on the same folder never
    runs the target for sequences a flushed cache holds."""
    from dspark.train import trainer as trainer_mod

    data = _toy_data(tmp_path)
    cfg = dict(steps=3, batch_size=4, anchors_per_seq=6, lr=3e-3, warmup=1, save_every=0, log_every=1,
               progress=False, export_dtype="fp32")
    ram = trainer_mod.Trainer(target, _rv_drafter(target, data)[0], data,
                              trainer_mod.TrainConfig(cache_features=True, **cfg), tmp_path / "a", pad_id=2)
    disk = trainer_mod.Trainer(target, _rv_drafter(target, data)[0], data,
                               trainer_mod.TrainConfig(feature_cache_dir=str(tmp_path / "fc"), **cfg),
                               tmp_path / "b", pad_id=2)
    with torch.no_grad():
        for micro in range(3):  # 12 sequences, 4 a batch: every sequence is filled
            assert float(disk.micro_loss(micro)[0]) == float(ram.micro_loss(micro)[0])
    disk.save_checkpoint()
    disk.cache.close()  # a finished run releases the folder

    def no_target(*a, **kw):
        raise AssertionError("the target ran although every sequence was cached")

    monkeypatch.setattr(trainer_mod, "target_features", no_target)
    again = trainer_mod.Trainer(target, _rv_drafter(target, data)[0], data,
                                trainer_mod.TrainConfig(feature_cache_dir=str(tmp_path / "fc"), **cfg),
                                tmp_path / "c", pad_id=2)
    with torch.no_grad():
        assert float(again.micro_loss(1)[0]) == float(ram.micro_loss(1)[0])


def test_compiled_loss_equals_eager(target, tmp_path):
    """--compile-loss changes how the loss runs, not what it computes (values and gradients)."""
    data = _toy_data(tmp_path)
    cfg = dict(steps=2, batch_size=4, anchors_per_seq=6, save_every=0, progress=False, cache_features=True)
    runs = []
    for compiled in (False, True):
        tr = Trainer(target, _rv_drafter(target, data)[0], data, TrainConfig(compile_loss=compiled, **cfg),
                     tmp_path / str(compiled), pad_id=2)
        losses = []
        for micro in range(2):  # two batches: different slot counts through the dynamic graph
            loss, parts = tr.micro_loss(micro)
            loss.backward()
            losses += [float(loss.detach()), float(parts["l1"]), float(parts["acc"])]
        grads = [p.grad.clone() for p in tr.params if p.grad is not None]
        runs.append((losses, grads))
    (l0, g0), (l1, g1) = runs
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert len(g0) == len(g1) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g0, g1))


def test_train_cli_warm_start(tiny_folder, target, tmp_path):
    """--init-from starts from a checkpoint's weights, config and vocabulary (not the flags): with
    lr 0 the export equals the checkpoint; a missing checkpoint is refused before any work."""
    from safetensors.torch import load_file

    from dspark.cli import main

    data = _toy_data(tmp_path)
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(len(data))))
    init = tmp_path / "init"
    d, vocab = _rv_drafter(target, data)
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.3)
    from dspark.models.drafters.checkpoint import save_drafter

    save_drafter(d, init)
    common = ["train-drafter", "--prompts", str(pf), "--model", tiny_folder, "--data-dir", str(tmp_path / "data"),
              "--shard-size", str(len(data)), "--device", "cpu", "--dtype", "fp32", "--no-progress",
              "--batch-size", "4", "--anchors-per-seq", "4", "--export-dtype", "fp32", "--save-every", "0"]
    assert main(common + ["--out", str(tmp_path / "x"), "--init-from", str(tmp_path / "nothing")]) == 2
    assert main(common + ["--out", str(tmp_path / "x"), "--skip-prompts", "-1"]) == 2
    assert not (tmp_path / "x" / "final").exists()
    assert main(common + ["--out", str(tmp_path / "run"), "--init-from", str(init), "--num-layers", "3",
                          "--block-size", "6", "--steps", "2", "--lr", "0", "--weight-decay", "0"]) == 0
    out = tmp_path / "run" / "final"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["block_size"] == 4 and cfg["draft_vocab_size"] == 64
    a, b = load_file(str(init / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "train_stats.json").read_text())["init_from"] == str(init)


def test_confidence_savings_by_hand():
    from dspark.train.evaluate import confidence_savings

    # (category, confidences, verified, accepted): at t=0.5 the first step keeps 1 of 3 drafts
    # (loses 1 accepted), the second keeps none (loses nothing: none was accepted)
    steps = [("a", [0.9, 0.2, 0.8], 3, 2), ("a", [0.1, 0.9], 2, 0)]
    s = confidence_savings(steps, (0.5, 0.05))["0.5"]
    assert s["verified_tokens_cut"] == 4 and s["accepted_tokens_lost"] == 1
    assert s["verify_share_saved"] == round(4 / 7, 4)  # the target also runs each step's anchor
    assert s["accepted_share_lost"] == 0.5 and s["tau_estimate"] == 1.5
    none = confidence_savings(steps, (0.05,))["0.05"]
    assert none["verified_tokens_cut"] == 0 and none["tau_estimate"] == 2.0


def test_eval_drafter_reports_per_category(tiny_folder, target, tmp_path):
    """eval-drafter on a tiny target: the per-category steps add up to the overall tau, each category
    has its acceptance by block position, and the JSON is written where asked."""
    from dspark.cli import main
    from dspark.models.drafters.checkpoint import save_drafter

    save_drafter(_drafter(target), tmp_path / "d")
    pf = tmp_path / "p.jsonl"
    rows = [{"category": c, "prompt": f"{c} question {i}"} for c in ("math", "code") for i in range(3)]
    pf.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    assert main(["eval-drafter", "--drafter", str(tmp_path / "d"), "--prompts", str(pf), "--model", tiny_folder,
                 "--device", "cpu", "--dtype", "float32", "--per-category", "2", "--max-tokens", "10",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    cats = res["per_category"]
    assert res["prompts"] == 4 and set(cats) == {"math", "code"} and all(c["requests"] == 2 for c in cats.values())
    assert res["output_tokens"] == 40  # the random target never picks its eos in 10 tokens
    steps = sum(c["steps"] for c in cats.values())
    assert res["tau"] == pytest.approx((40 - 4) / steps, abs=1e-3)  # each prefill writes the first token
    assert 1.0 <= res["tau"] <= 5.0  # block 4: a DSpark drafter emits 4 drafts, + the bonus token
    assert res["tau_category_mean"] == pytest.approx(sum(c["tau"] for c in cats.values()) / 2, abs=1e-3)
    assert len(res["acceptance_per_position"]) == 4
    assert all(len(c["acceptance_per_position"]) == 4 for c in cats.values())
    assert res["confidence_savings"]["steps_recorded"] > 0 and res["tree_budget"] is None
    assert res["ngram_assist"] == 2 and 0 <= res["lookup_accepted"] and 0 <= res["lookup_steps"] <= steps
    # looked-up steps carry no confidences, so the savings count only the drafted ones
    assert res["confidence_savings"]["steps_recorded"] <= steps - res["lookup_steps"]
    assert main(["eval-drafter", "--drafter", str(tmp_path / "d"), "--prompts", str(pf), "--model", tiny_folder,
                 "--device", "cpu", "--dtype", "float32", "--per-category", "2", "--max-tokens", "10",
                 "--ngram-assist", "0", "--out", str(out)]) == 0
    alone = json.loads(out.read_text())  # the drafter alone: no step looks a chain up
    assert alone["ngram_assist"] == 0 and alone["lookup_steps"] == alone["lookup_accepted"] == 0
    assert alone["confidence_savings"]["steps_recorded"] > 0
    assert main(["eval-drafter", "--drafter", str(tmp_path / "d"), "--prompts", str(pf), "--model", tiny_folder,
                 "--device", "cpu", "--dtype", "float32", "--per-category", "2", "--max-tokens", "10",
                 "--tree-budget", "6", "--out", str(out)]) == 0
    tree = json.loads(out.read_text())
    assert tree["tree_budget"] == 6 and tree["output_tokens"] == 40 and tree["tau"] >= 1.0
    assert tree["confidence_savings"]["steps_recorded"] == 0  # trees are pruned by probability, not confidence


def test_trainer_refuses_dflash_and_freezes_shared_copies(target, tmp_path):
    """A DFlash drafter would be taught labels one position off, so it is refused; a drafter with
    its own copy of the target's embedding and LM head trains neither (they are the target's)."""
    import dataclasses

    from dspark.models.drafters.dspark import BlockDrafter

    data = _toy_data(tmp_path)
    cfg = TrainConfig(steps=2, batch_size=4, anchors_per_seq=6, progress=False, save_every=0)
    dc = dataclasses.replace(_drafter(target).config, kind="dflash")
    with pytest.raises(ValueError, match="DSpark"):
        Trainer(target, BlockDrafter(dc, target.config.hidden_size), data, cfg, tmp_path / "a")
    own = BlockDrafter(_drafter(target).config, target.config.hidden_size, own_embed=True, own_head=True)
    own.attach(target)
    with torch.no_grad():
        own.embed_tokens.weight.copy_(target.embed_tokens.weight)
        own.lm_head.weight.copy_(target.lm_head.weight)
    before = own.lm_head.weight.clone()
    tr = Trainer(target, own, data, cfg, tmp_path / "b")
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in tr.names)
    tr.train_step()
    tr.train_step()  # a second backward through the cached head rows must work too
    assert torch.equal(own.lm_head.weight, before)


def test_grad_accumulation_equals_one_large_batch(target, tmp_path):
    """Two micro-batches of 2 sequences give the gradient of one batch of the 4: each micro-batch's
    mean loss is weighed by its number of supervised slots (their counts differ here)."""
    data = _toy_data(tmp_path)
    b = data.batch([0, 1, 2, 3], 2, "cpu")
    anchors, ok = sample_anchors(b["lens"], b["prompt_lens"], 6, 4, torch.Generator().manual_seed(0))
    ok[2:, 3:] = False  # fewer slots in the second half
    grads = []
    for accum in (1, 2):
        tr = _trainer(target, data, tmp_path / f"g{accum}", grad_accum=accum, grad_clip=1e9)
        feats, final = target_features(target, b["ids"], tr.drafter.config.target_layer_ids)

        def micro(m, tr=tr, feats=feats, final=final, accum=accum):
            rows = slice(None) if accum == 1 else slice(2 * m, 2 * m + 2)
            return batch_loss(tr.drafter, target.lm_head, feats[rows], final[rows], b["ids"][rows],
                              b["lengths"][rows], b["resp"][rows], anchors[rows], ok[rows])

        tr.micro_loss = micro
        tr.opt.step = lambda: None
        tr.opt.zero_grad = lambda set_to_none=True: None
        tr.train_step()
        grads.append({n: p.grad.clone() for n, p in zip(tr.names, tr.params) if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-4)


def test_resume_lists_changed_settings(target, tmp_path):
    """A resume with another learning rate or step count is allowed (runs add steps after new
    data) but listed, so the CLI can warn instead of silently changing the schedule."""
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=2)
    tr.train_step()
    tr.save_checkpoint()
    same = _trainer(target, data, tmp_path / "run", steps=2)
    assert same.load_checkpoint() and same.resume_changes == {}
    cfg = dataclasses.replace(tr.cfg, steps=5, lr=tr.cfg.lr * 2)
    other = Trainer(target, tr.drafter, data, cfg, tmp_path / "run", pad_id=2)
    assert other.load_checkpoint()
    assert other.resume_changes == {"steps": (2, 5), "lr": (tr.cfg.lr, tr.cfg.lr * 2)}
    weighted = Trainer(target, tr.drafter, data, dataclasses.replace(tr.cfg, loss_weights=[0.5, 0.5, 1.0]),
                       tmp_path / "run", pad_id=2)
    assert weighted.load_checkpoint()
    assert weighted.resume_changes == {"loss_weights": ([0.1, 0.9, 1.0], [0.5, 0.5, 1.0])}


def test_loss_weights_reach_the_loss(target, tmp_path):
    """--loss-weights: the trainer's total is the weighted sum of the same parts."""
    data = _toy_data(tmp_path)
    parts_total = {}
    for w in ([0.1, 0.9, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 2.0]):
        tr = _trainer(target, data, tmp_path / "run", loss_weights=w)
        with torch.no_grad():
            total, parts = tr.micro_loss(3)
        parts_total[tuple(w)] = float(total)
        expect = w[0] * float(parts["ce"]) + w[1] * float(parts["l1"]) + w[2] * float(parts["bce"])
        assert float(total) == pytest.approx(expect, rel=1e-5)
    assert len(set(parts_total.values())) == 3


def test_resume_refuses_another_drafter_shape(target, tmp_path):
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=2)
    tr.train_step()
    tr.save_checkpoint()
    d6 = new_drafter(make_drafter_config(target.config, num_layers=2, block_size=6, markov_rank=8,
                                         layer_ids=[0, 1, 2], mask_token_id=16), target, 0)
    other = Trainer(target, d6, data, tr.cfg, tmp_path / "run", pad_id=2)
    with pytest.raises(ValueError, match="block_size"):
        other.load_checkpoint()
    assert _trainer(target, data, tmp_path / "run", steps=2).load_checkpoint()


def test_average_from_exports_the_mean_of_the_late_weights_and_resumes(target, tmp_path):
    from safetensors.torch import load_file

    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=5, average_from=3)
    seen = []
    for _ in range(5):
        tr.train_step()
        seen.append(tr.drafter.fc.weight.detach().clone())
    want = torch.stack(seen[2:]).mean(0)  # the weights after steps 3, 4 and 5
    assert tr.average_n == 3
    tr.export(tmp_path / "run" / "final")
    assert torch.allclose(load_file(str(tmp_path / "run" / "final" / "model.safetensors"))["fc.weight"], want,
                          atol=1e-6)
    assert torch.equal(load_file(str(tmp_path / "run" / "final_last" / "model.safetensors"))["fc.weight"], seen[-1])
    assert torch.equal(tr.drafter.fc.weight, seen[-1])  # training weights restored after the export
    # a resume from a checkpoint taken at step 4 ends with the same mean
    part = _trainer(target, data, tmp_path / "part", steps=5, average_from=3)
    for _ in range(4):
        part.train_step()
    part.save_checkpoint()
    resumed = _trainer(target, data, tmp_path / "part", steps=5, average_from=3)
    assert resumed.load_checkpoint() and resumed.average_n == 2
    resumed.train_step()
    fc = resumed.names.index("fc.weight")
    assert torch.allclose(resumed.average[fc], want, atol=1e-5)


def test_lr_by_time_anneals_by_the_deadline(target, tmp_path, monkeypatch):
    """With lr_by_time the cosine's progress is the larger of the steps' and the clock's share of
    the budget: halfway through the budget at step 3 of 1,000 the lr is already halfway down."""
    import dspark.train.trainer as trainer_mod

    now = [1000.0]
    monkeypatch.setattr(trainer_mod.time, "time", lambda: now[0])
    data = _toy_data(tmp_path)
    tr = _trainer(target, data, tmp_path / "run", steps=1000, deadline=1100.0, lr_by_time=True, min_lr_ratio=0.2)
    plain = _trainer(target, data, tmp_path / "plain", steps=1000, deadline=1100.0, min_lr_ratio=0.2)
    tr.anneal_start = plain.anneal_start = 1000.0
    now[0] = 1050.0
    half = 3e-3 * (0.2 + 0.8 * 0.5)
    assert tr.lr_at(3) == pytest.approx(half)
    assert plain.lr_at(3) > 0.99 * 3e-3  # steps alone: barely started
    # a run resumed halfway along its cosine spreads the other half over its new budget
    tr.resumed_progress = 0.5
    assert tr.progress(3) == pytest.approx(0.75)
    tr.resumed_progress = 0.0
    now[0] = 1100.0
    assert tr.lr_at(3) == pytest.approx(3e-3 * 0.2)
    assert tr.lr_at(0) == pytest.approx(3e-3 / 2)  # warm-up stays step-based


def test_lr_by_time_progress_survives_a_resume(target, tmp_path, monkeypatch):
    """The cosine's progress goes into the checkpoint: a run the clock stopped near its minimum
    resumes near its minimum, not at its peak."""
    import dspark.train.trainer as trainer_mod

    now = [0.0]

    def tick():
        now[0] += 1.0  # every clock read moves one second: a 60-second budget ends in a few steps
        return now[0]

    monkeypatch.setattr(trainer_mod.time, "time", tick)
    data = _toy_data(tmp_path)
    first = _trainer(target, data, tmp_path / "run", steps=1000, deadline=60.0, lr_by_time=True, min_lr_ratio=0.2)
    first.fit()
    assert first.step < 1000 and first.lr_progress > 0.9
    last_lr = first.history[-1]["lr"]
    first.save_checkpoint()
    again = _trainer(target, data, tmp_path / "run", steps=1000, deadline=now[0] + 600.0, lr_by_time=True,
                     min_lr_ratio=0.2)
    assert again.load_checkpoint() and again.resumed_progress == pytest.approx(first.lr_progress)
    again.anneal_start = now[0]
    assert again.lr_at(again.step) <= last_lr * 1.05
