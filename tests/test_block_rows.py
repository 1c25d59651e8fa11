"""A quantized GGUF target's token embedding and LM-head rows kept in the file's blocks (BlockRows,
mapped, never dense): rows with the bits the dense load gives them, bad ids refused, the same
logits and greedy tokens as with a dense embedding, and a drafter sharing the head reads the
same rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from spec_helpers import drafter_config, make_engine, require_kernels, run_requests
from test_gguf_kquants import _q6_k_bytes
from test_quant import _q4_k_bytes, _write_quantized_gguf

from dspark.config import SamplingParams
from dspark.models import cpu_ops, quantize
from dspark.models.block_rows import BlockRows
from dspark.models.gguf_tensors import GGUFTensors
from dspark.models.quant import Int8Head

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 288  # the byte-level tokenizer's 260 tokens, padded to whole tiles of 32 rows
_ENCODE = {T.Q6_K: _q6_k_bytes, T.Q4_K: _q4_k_bytes}


def _write(path, tied: bool, kind: T) -> None:  # noqa: ANN001
    """A tiny llama GGUF: Q4_0 layers, embedding (and untied head) as ``kind`` blocks."""
    from test_loader import _tiny

    model = _tiny("llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied)
    real_add = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, *a, **kw):  # noqa: ANN001, ANN202
        if name in ("token_embd.weight", "output.weight"):
            w = np.ascontiguousarray(tensor, dtype=np.float32)
            data = _ENCODE[kind](w) if kind in _ENCODE else gguf.quants.quantize(w, kind)
            return real_add(self, name, data, raw_dtype=kind)
        return real_add(self, name, tensor, *a, **kw)

    gguf.GGUFWriter.add_tensor = add
    try:
        _write_quantized_gguf(path, model, T.Q4_0)
    finally:
        gguf.GGUFWriter.add_tensor = real_add


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", [T.Q8_0, T.Q6_K, T.Q4_K, T.F16], ids=lambda t: t.name)
def test_embedding_and_head_rows_stay_in_the_files_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                          kind: T, tied: bool) -> None:
    from test_loader import _allow_gguf_without_accelerate

    require_kernels(cpu_ops.quant(), quant=True)
    dtype = cpu_ops.quant_dtype()
    _allow_gguf_without_accelerate(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "e.gguf"
    _write(src, tied, kind)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    eng = make_engine(str(src), "none", dtype=name, quantization="auto")
    m = eng.model
    assert isinstance(m.embed_tokens, BlockRows) and isinstance(m.lm_head, Int8Head)
    assert m.lm_head.weight is None  # no dense copy of the head (nor of the embedding it may be tied to)

    index = GGUFTensors.load(eng.model_path)
    emb = index.dense(index.by_hf["model.embed_tokens.weight"], dtype)
    head = emb if tied else index.dense(index.by_hf["lm_head.weight"], dtype)
    ids = torch.tensor([[0, 5, VOCAB - 1], [7, 7, 100]])
    assert torch.equal(m.embed_tokens(ids), emb[ids])  # the dense load's bits
    # a decode step's few ids come from the recent rows' cache, with the same bits, and the cache
    # stays within its bound; a prompt chunk's many ids bypass it
    rows = m.embed_tokens
    assert torch.equal(rows(ids), emb[ids]) and set(rows._recent) == {0, 5, 7, 100, VOCAB - 1}
    rows._recent.clear()
    rows.recent_rows = 3
    few = torch.tensor([9, 4, 9, 11, 12, 13, 4])
    assert torch.equal(rows(few), emb[few]) and len(rows._recent) == 3
    assert torch.equal(rows(few), emb[few]) and len(rows._recent) == 3
    many = torch.arange(VOCAB).flip(0)
    assert torch.equal(rows(many), emb[many]) and len(rows._recent) == 3
    assert torch.equal(m.lm_head.rows(ids[0]), head[ids[0]])
    assert torch.equal(m.lm_head.rows(), head)
    for bad in (-1, VOCAB):
        with pytest.raises(IndexError, match="out of range"):
            m.embed_tokens(torch.tensor([3, bad]))

    # a drafter sharing the target's embedding and head reads the same rows
    from dspark.models.drafters.dspark import BlockDrafter

    drafter = BlockDrafter(drafter_config("dspark", 4, markov_rank=4, vocab=VOCAB, draft_vocab_size=32), 256)
    drafter.attach(m)
    drafter.draft_to_target = torch.arange(3, 3 + 64, 2)
    assert torch.equal(drafter._head_weight(), head[drafter.draft_to_target])
    assert torch.equal(drafter.embed(ids), emb[ids])

    # against the same file loaded with a dense embedding and head: the same logits and tokens
    monkeypatch.setattr(quantize, "_file_rows", lambda *a: (None, None))
    ref = make_engine(str(src), "none", dtype=name, quantization="auto")
    assert not isinstance(ref.model.embed_tokens, BlockRows) and ref.model.lm_head.weight is not None
    h = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(m.logits(h), ref.model.logits(h))
    prompts = [[11 + (i * 7) % 200 for i in range(n)] for n in (5, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = run_requests(eng, [(p, sp, None) for p in prompts])
    want = run_requests(ref, [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
