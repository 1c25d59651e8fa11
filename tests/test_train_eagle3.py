"""`train-drafter --kind eagle3`: the training-time-test forward against the engine's drafting path,
the loss by hand, training on a fixed batch, the command end to end (export in the EAGLE-3 layout,
loaded by the engine: greedy output equals plain decoding, and the head drafts its training data
well) and the flags each --kind refuses. The tiny predictable target of spec_helpers writes the data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from spec_helpers import alphabet_prompts, make_engine, run_requests, save_tiny_target

from dspark.cli import main
from dspark.config import SamplingParams
from dspark.train.dataset import TokenDataset
from dspark.train.drafter_init import load_target, new_eagle3_head
from dspark.train.eagle3 import eagle3_loss, ttt_outputs
from dspark.train.eagle3_trainer import Eagle3TrainConfig, Eagle3Trainer
from dspark.train.features import target_features

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny target, and a data folder of its greedy continuations of 24 alphabet prompts (one
    shard, as train-drafter writes them) with a prompts file of as many lines."""
    root = tmp_path_factory.mktemp("eagle3_train")
    target = save_tiny_target(root / "target")
    prompts = alphabet_prompts([12 + i % 9 for i in range(24)], seed=11)
    outs = run_requests(make_engine(target), [(p, GREEDY, None) for p in prompts], spec=False)
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    (root / "data").mkdir()
    save_file({"tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
               "offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
               "prompt_lens": np.asarray([len(p) for p in prompts], np.int32),
               "prompt_index": np.arange(len(seqs), dtype=np.int64), "sampled": np.zeros(len(seqs), np.uint8)},
              str(root / "data" / "shard_00000.safetensors"))
    pf = root / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(len(seqs))))
    return {"root": root, "target": target, "prompts": prompts, "outputs": [o.token_ids for o in outs],
            "prompts_file": str(pf)}


@pytest.fixture(scope="module")
def model(run):
    return load_target(run["target"], "cpu", torch.float32)[0]


def _head(model, vocab=None, seed=3):
    head = new_eagle3_head(model, vocab, 96, seed=seed).eval()
    with torch.no_grad():  # weights large enough that every input visibly moves the output
        for name, p in head.named_parameters():
            if name.endswith("proj.weight") or name.startswith("fc"):
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    return head


def test_ttt_steps_compute_what_the_engine_drafts(model):
    """Step s at position i of the dense forward is the engine's s-th draft step after committing
    0..i (paged K/V from the target's features, its own earlier steps' K/V, true tokens fed)."""
    from dspark.engine.attention import AttnBatch, TorchAttention
    from dspark.engine.kv_cache import KVCache

    head = _head(model)
    torch.manual_seed(1)
    tokens = torch.randint(20, 3000, (2, 20))
    c = head.config.layer
    with torch.no_grad():
        feats, _ = target_features(model, tokens, list(head.config.capture_layers))
        outs = ttt_outputs(head, feats, tokens, 3)
        # the rows from 3 on in sequence 0 and from 7 on in sequence 1, alone: the same outputs
        later = ttt_outputs(head, feats, tokens, 3, torch.tensor([3, 7]), rows=10)
        assert all(torch.allclose(a[0, 3:13], b[0], atol=1e-5) and torch.allclose(a[1, 7:17], b[1], atol=1e-5)
                   for a, b in zip(outs, later))
        for b, i in [(0, 0), (0, 11), (1, 4), (1, 16)]:
            kv = KVCache(1, 4, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
            head.write_context(feats[b, :i + 1], torch.arange(i + 1), torch.arange(i + 1), kv, tokens[b, 1:i + 2])
            hidden = head.fc(feats[b, i:i + 1])
            for s in range(3):
                attn = TorchAttention("cpu", exact=False)
                attn.plan(AttnBatch(q_lens=[1], kv_lens=[i + 1 + s], page_tables=[[0, 1, 2, 3]], page_size=16))
                hidden = head.step(tokens[b, i + 1 + s:i + 2 + s], hidden, torch.tensor([i + s]), attn, kv)
                assert torch.allclose(hidden[0], outs[s][b, i], atol=1e-5), (b, i, s)


@pytest.mark.parametrize("reduced", [True, False], ids=["draft-vocab", "full-vocab"])
def test_loss_by_hand_masks_prompts_and_foreign_labels(model, reduced):
    """Step s supervises x[i+2+s] where the token after i is a response token; a label outside the
    draft vocabulary adds no CE; steps weigh 0.8^s; the KL is against the target's renormalised
    distribution over the draft vocabulary."""
    vocab = torch.tensor(sorted(set(range(20, 60)) - {33})) if reduced else None
    head = _head(model, vocab)
    vocab = head.draft_to_target
    tokens = torch.tensor([[1, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35],
                           [1, 40, 41, 42, 43, 44, 45, 2, 2, 2, 2, 2]])
    lengths, prompt_lens = torch.tensor([12, 7]), [5, 3]
    resp = torch.zeros(2, 12, dtype=torch.bool)
    resp[0, 5:12], resp[1, 3:7] = True, True
    with torch.no_grad():
        feats, final = target_features(model, tokens, list(head.config.capture_layers))
        total, parts = eagle3_loss(head, model.lm_head, feats, final, tokens, lengths, resp, prompt_lens,
                                   steps=2, kl_weight=0.5)
        outs = ttt_outputs(head, feats, tokens, 2)
        want, rows = 0.0, []
        for s in range(2):
            ce = kl = 0.0
            pairs = [(b, i) for b in range(2) for i in range(prompt_lens[b] - 1, int(lengths[b]) - 2 - s)]
            for b, i in pairs:
                logits = head.logits(outs[s][b, i])
                label = int(tokens[b, i + 2 + s])
                if label in vocab.tolist():
                    ce -= float(torch.log_softmax(logits, -1)[vocab.tolist().index(label)])
                p_t = torch.softmax(model.lm_head(final[b, i + 1 + s])[vocab], -1)
                kl += float((p_t * (p_t.log() - torch.log_softmax(logits, -1))).sum())
            want += 0.8 ** s * (ce + 0.5 * kl) / len(pairs)
            rows.append(len(pairs))
    assert parts["slot_rows"].tolist() == rows == [6 + 3, 5 + 2]
    assert float(total) == pytest.approx(want, rel=1e-4)


def test_training_lowers_the_loss_on_a_fixed_batch(model, run, tmp_path):
    data = TokenDataset(run["root"] / "data")
    cfg = Eagle3TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup=2, save_every=0, log_every=10, progress=False,
                            export_dtype="fp32")
    # a draft vocabulary that holds the data's tokens: SmolLM2's full one would cost a second a step
    head = new_eagle3_head(model, torch.arange(1100), 96)
    tr = Eagle3Trainer(model, head, data, cfg, tmp_path / "run", pad_id=2)
    with torch.no_grad():
        before, parts = tr.micro_loss(10_000)
    tr.fit()
    with torch.no_grad():
        after, later = tr.micro_loss(10_000)
    assert float(after) < 0.6 * float(before), (float(before), float(after))
    assert float(later["acc"]) > float(parts["acc"]) + 0.2
    assert len(tr.history[-1]["acc_by_slot"]) == 3  # one agreement rate per TTT step


def _train(run, out, *extra: str) -> int:
    return main(["train-drafter", "--kind", "eagle3", "--prompts", run["prompts_file"], "--model", run["target"],
                 "--data-dir", str(run["root"] / "data"), "--shard-size", "24", "--device", "cpu", "--dtype", "fp32",
                 "--no-progress", "--batch-size", "8", "--export-dtype", "fp32", "--save-every", "0", "--warmup", "2",
                 "--lr", "3e-3", "--draft-vocab", "40", "--intermediate-size", "96", "--log-every", "50",
                 "--out", str(out), *extra])


def test_train_drafter_eagle3_end_to_end(run, tmp_path, capsys):
    from dspark.engine.proposers import drafter_kind

    out = tmp_path / "run"
    assert _train(run, out, "--steps", "100") == 0
    final = out / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert drafter_kind(str(final)) == "eagle3" and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 40 and cfg["intermediate_size"] == 96
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["steps"] == 100 and stats["train_config"]["ttt_steps"] == 3
    # the engine loads the export as an EAGLE-3 head; speculation keeps greedy output exact
    reqs = [(p, GREEDY, None) for p in alphabet_prompts([15, 31], seed=99)]
    spec = run_requests(make_engine(run["target"], str(final), block_size=4, ngram_assist=0), reqs)
    plain = run_requests(make_engine(run["target"]), reqs, spec=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # on its training prompts the head drafts what it learned: a training convention one position
    # off from the engine's would be rejected almost always (an untrained head: tau ~1.1)
    engine = make_engine(run["target"], str(final), block_size=4, ngram_assist=0)
    spec = run_requests(engine, [(p, GREEDY, None) for p in run["prompts"][:8]])
    assert [o.token_ids for o in spec] == run["outputs"][:8]
    assert engine.spec_stats.tau > 2.5, engine.spec_stats.as_dict()
    # the same command with more steps resumes from <out>/ckpt
    capsys.readouterr()
    assert _train(run, out, "--steps", "105") == 0
    assert "resumed from" in capsys.readouterr().err
    assert json.loads((out / "train_stats.json").read_text())["steps"] == 105


@pytest.mark.parametrize("kind,flags,words", [
    ("eagle3", ["--block-size", "4", "--gamma", "2"], "--block-size, --gamma do not apply to --kind eagle3"),
    ("eagle3", ["--init-from", "x"], "--init-from does not apply to --kind eagle3"),
    ("dspark", ["--ttt-steps", "2"], "--ttt-steps does not apply to --kind dspark"),
    ("eagle3", ["--ttt-steps", "0"], "--ttt-steps must be >= 1"),
    ("eagle3", ["--kl-weight", "-1"], "--kl-weight must be a number >= 0"),
])
def test_flags_of_the_other_kind_are_refused(kind, flags, words, tmp_path, capsys):
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "run"
    assert main(["train-drafter", "--kind", kind, "--prompts", str(pf), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not out.exists()  # refused before any work
