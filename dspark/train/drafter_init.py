"""Setting up a training run: the frozen target, a new drafter shaped like it (config, target
layers, mask token, reduced draft vocabulary) and its exported size."""

from __future__ import annotations

import numpy as np
import torch

from dspark.models.drafters.dspark import BlockDrafter, DrafterConfig
from dspark.train.dataset import TokenDataset

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
SMOL_MASK_TOKEN = "<empty_output>"  # id 16 in SmolLM2: a Jupyter-dataset marker chat never emits


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """`count` target layers spread evenly from 1 to L-3 (DFlash's default)."""
    lo, hi = 1, max(1, num_layers - 3)
    if count == 1:
        return [hi]
    return sorted({int(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def default_mask_token(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(SMOL_MASK_TOKEN)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
        return tid
    avoid = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    spare = [i for i in tokenizer.all_special_ids if i not in avoid]
    return spare[-1] if spare else tokenizer.eos_token_id


def make_drafter_config(tc, *, num_layers: int = 2, block_size: int = 8, markov_rank: int = 32,
                        layer_ids: list[int] | None = None, mask_token_id: int = 0,
                        intermediate_size: int | None = None, draft_vocab_size: int | None = None) -> DrafterConfig:
    """A DSpark drafter shaped like the target's layers (heads, head_dim, hidden)."""
    return DrafterConfig(
        kind="dspark", hidden_size=tc.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, vocab_size=tc.vocab_size,
        block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=layer_ids or default_layer_ids(tc.num_hidden_layers),
        num_target_layers=tc.num_hidden_layers, markov_rank=markov_rank, confidence_head=True,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
        draft_vocab_size=draft_vocab_size)


def frequent_tokens(data: TokenDataset, n: int, vocab: int, extra: list[list[int]] = (),
                    response_weight: int = 4) -> torch.Tensor:
    """The draft vocabulary: the n most frequent tokens, ascending ids. Response tokens (what the
    drafter proposes) count `response_weight` times; `extra` (e.g. every training prompt, tokenized
    without a template: far more text than the generated responses) once each."""
    if not 0 < n <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {n}")
    counts = np.zeros(vocab, dtype=np.int64)
    for seq, p in zip(data.seqs, data.prompt_lens):
        counts += response_weight * np.bincount(seq[p:], minlength=vocab)
    for ids in extra:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
    top = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(top).astype(np.int64))


def new_drafter(dc: DrafterConfig, target, seed: int, draft_vocab: torch.Tensor | None = None) -> BlockDrafter:
    torch.manual_seed(seed)
    d = BlockDrafter(dc, target.config.hidden_size)
    if draft_vocab is not None:
        if dc.draft_vocab_size != draft_vocab.numel():
            raise ValueError(f"draft vocabulary has {draft_vocab.numel()} ids, config says {dc.draft_vocab_size}")
        d.draft_to_target.copy_(draft_vocab)
    if d.markov_head is not None:  # start as a pure parallel drafter (notebook section 8)
        torch.nn.init.normal_(d.markov_head.markov_w1.weight, std=0.02)
        torch.nn.init.zeros_(d.markov_head.markov_w2.weight)
    d.attach(target)
    return d


def checkpoint_bytes(drafter: BlockDrafter, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in drafter.parameters()) * size


def load_target(model: str | None, device: str, dtype: torch.dtype) -> tuple:
    """(frozen LlamaModel in eval mode, its tokenizer) for a model path or the default model."""
    from dspark.models.llama import LlamaConfig, LlamaModel
    from dspark.models.loader import load_config, load_state_dict, load_tokenizer, resolve_model_folder

    folder = resolve_model_folder(model)
    m = LlamaModel(LlamaConfig.from_hf(load_config(folder)))
    m.load_hf_state_dict(load_state_dict(folder, dtype))
    m = m.to(device, dtype).eval().requires_grad_(False)
    return m, load_tokenizer(folder)


def new_eagle3_head(target, draft_vocab: torch.Tensor | None = None, intermediate_size: int | None = None,
                    seed: int = 0):  # noqa: ANN201 - an Eagle3Head
    """A new EAGLE-3 head for the target (eagle3_hf_config: its layer shaped like one of the
    target's), randomly initialised except its output: the final norm and the LM head rows of its
    draft vocabulary (sorted target ids; None: the full vocabulary) start as the target's, so its
    first logits already read the target's output space. The target's embedding is shared."""
    from dspark.models.drafters.eagle3 import Eagle3Config, Eagle3Head, eagle3_hf_config

    tc = target.config
    ids = draft_vocab if draft_vocab is not None else torch.arange(tc.vocab_size)
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_hf(eagle3_hf_config(tc, ids.numel(), intermediate_size), tc))
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(ids.numel()))  # d2t[d]: target id of draft id d, minus d
        head.t2d.zero_()[ids] = True
        head.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)].float().cpu())
        head.norm.weight.copy_(target.norm.weight.float().cpu())
    head.attach(target)
    return head
