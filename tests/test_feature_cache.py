"""The on-disk feature cache: same features as computing them, reused across restarts and as
the data grows, recomputed where the tokens or the layers changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.train.feature_cache import FeatureCache, cache_bytes


def _seqs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, int(rng.integers(5, 12))).astype(np.int32) for _ in range(n)]


def _fill(cache, seqs, m=2, H=4):
    for i, s in enumerate(seqs):
        L = len(s)
        base = torch.from_numpy(s.astype(np.float32))[:, None]
        cache.put(i, base.expand(L, m * H) + 0.5, base.expand(L, H) - 0.25, base[:, 0] * 1.5)


@pytest.mark.parametrize("on_disk", [False, True])
def test_roundtrip_bf16_bits(tmp_path, on_disk):
    seqs = _seqs(5)
    c = FeatureCache(seqs, [0, 1], 4, tmp_path / "fc" if on_disk else None)
    assert c.nbytes == cache_bytes(sum(map(len, seqs)), 2, 4) == sum(map(len, seqs)) * (3 * 4 * 2 + 4)
    _fill(c, seqs)
    for i, s in enumerate(seqs):
        f, h, lse = c.get(i)
        ref = torch.from_numpy(s.astype(np.float32))
        assert f.dtype == h.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert torch.equal(f, (ref[:, None] + 0.5).expand(len(s), 8).bfloat16())
        assert torch.equal(h, (ref[:, None] - 0.25).expand(len(s), 4).bfloat16())
        assert torch.equal(lse, ref * 1.5)


def test_disk_cache_survives_restart_and_growth(tmp_path):
    seqs = _seqs(6)
    c = FeatureCache(seqs, [0, 1], 4, tmp_path, key="m1")
    _fill(c, seqs[:4])
    c.close()
    grown = seqs + _seqs(3, seed=1)  # new shards append sequences
    c2 = FeatureCache(grown, [0, 1], 4, tmp_path, key="m1")
    assert [c2.has(i) for i in range(len(grown))] == [True] * 4 + [False] * 5
    assert torch.equal(c2.get(3)[2], torch.from_numpy(seqs[3].astype(np.float32)) * 1.5)
    c2.close()
    changed = list(grown)
    changed[2] = changed[2].copy()
    changed[2][0] += 1  # different tokens from sequence 2 on: recomputed
    c3 = FeatureCache(changed, [0, 1], 4, tmp_path, key="m1")
    assert [c3.has(i) for i in range(4)] == [True, True, False, False]
    c3.close()
    c4 = FeatureCache(changed, [0, 1], 4, tmp_path, key="m1")
    assert [c4.has(i) for i in range(4)] == [True, True, False, False]  # still stale when opened again
    c4.close()
    for layers, key in (([0, 2], "m1"), ([0, 1], "m2")):  # other target layers or model: start over
        c5 = FeatureCache(changed, layers, 4, tmp_path, key=key)
        assert not c5.has(0)
        c5.close()


def test_shrunk_then_restored_data_serves_no_zeros(tmp_path):
    """Opening with fewer sequences truncates the files; reopening with the original data must
    not trust the old `done` flags for the dropped tail."""
    seqs = _seqs(6)
    c = FeatureCache(seqs, [0], 4, tmp_path)
    _fill(c, seqs, m=1)
    c.close()
    FeatureCache(seqs[:3], [0], 4, tmp_path).close()
    c = FeatureCache(seqs, [0], 4, tmp_path)
    assert [c.has(i) for i in range(6)] == [True] * 3 + [False] * 3
    assert torch.equal(c.get(2)[2], torch.from_numpy(seqs[2].astype(np.float32)) * 1.5)


def test_folder_is_locked(tmp_path):
    seqs = _seqs(2)
    c = FeatureCache(seqs, [0], 4, tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        FeatureCache(seqs, [0], 4, tmp_path)
    c.close()
    FeatureCache(seqs, [0], 4, tmp_path).close()


def test_unflushed_sequences_are_not_trusted(tmp_path):
    seqs = _seqs(3)
    c = FeatureCache(seqs, [0], 4, tmp_path)
    _fill(c, seqs, m=1)
    c._lock.close()  # a crash: no flush
    assert not FeatureCache(seqs, [0], 4, tmp_path).has(0)  # done.npy never says so


def test_target_key_sees_every_layer():
    """Two targets that share their embedding and LM head but not a decoder layer get different
    keys, so one's cached features are never served to the other."""
    from dspark.models.llama import LlamaConfig, LlamaModel
    from dspark.train.feature_cache import target_key

    torch.manual_seed(0)
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 8})
    a = LlamaModel(cfg)
    with torch.no_grad():  # nn.Embedding starts random, our Linear layers empty
        for p in a.parameters():
            p.normal_()
    b = LlamaModel(cfg)
    b.load_state_dict(a.state_dict())
    assert target_key(a) == target_key(b)
    with torch.no_grad():
        b.layers[0].mlp.down_proj.weight.mul_(1.5)
    assert target_key(a) != target_key(b)
    assert target_key(a) != target_key(a.to(torch.bfloat16))
