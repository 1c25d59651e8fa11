"""Tiny random targets and drafters for the speculative-decoding tests (CPU, fp32).

The target is an HF LlamaForCausalLM with SmolLM2's vocabulary (so SmolLM2's tokenizer fits),
hidden 64 and 4 layers. Random weights alone make every draft a miss, so the target is made
*predictable*: on a small alphabet S of tokens it mostly continues t -> f(t) for a fixed
permutation f of S (orthonormal embeddings of S and an lm_head whose row f(t) points along t's
embedding), while its random layers are strong enough that the context overrides f now and then.
A DSpark drafter whose Markov head encodes f then drafts f(anchor), f(f(anchor)), ...: accepted
while the target follows f, rejected where the context wins, so steps end in partial acceptances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB = 49152
SMALL_VOCAB = 12  # ids 0..11: SmolLM2's special tokens; sampling tests set ignore_eos
HIDDEN = 64
LAYERS = 4
LAYER_IDS = [0, 2]  # captured target layers (HF hidden_states[l + 1]); the last one is normed in HF
MASK_ID = 0
ALPHABET = list(range(1000, 1024))  # S: ordinary tokens, far from the special ids 0..16
PERM_SHIFT = 7  # f(S[i]) = S[(i + 7) % |S|]: one long cycle, so n-gram drafts only help after a lap


def follow(tok: int) -> int:
    """f: the continuation the predictable target prefers after tok (tok in ALPHABET)."""
    i = ALPHABET.index(tok)
    return ALPHABET[(i + PERM_SHIFT) % len(ALPHABET)]


def save_tiny_target(folder: str | Path, predictable: bool = True, seed: int = 0, layer_std: float = 0.25,
                     alpha: float = 6.0, vocab: int = VOCAB, head_dim: int = 16) -> str:
    """Write a tiny random Llama target (config.json, model.safetensors, SmolLM2 tokenizer) to folder.
    A vocab below SmolLM2's still works with its tokenizer: the ids the model can emit are a prefix.
    head_dim: 16 keeps CPU tests fast; the GPU tests use 64, a size FlashInfer's kernels take."""
    import transformers


    folder = Path(folder)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=head_dim, max_position_embeddings=1024, rope_theta=10000.0,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                   rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * layer_std / p.shape[1] ** 0.5 * 4)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        emb = torch.randn(vocab, HIDDEN, generator=g) * 0.5
        head = torch.randn(vocab, HIDDEN, generator=g) * 0.3
        if predictable:
            basis, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=g))
            for i, t in enumerate(ALPHABET):
                emb[t] = basis[:, i] * HIDDEN ** 0.5 * 0.5
                head[follow(t)] = basis[:, i] * alpha
        m.model.embed_tokens.weight.copy_(emb)
        m.lm_head.weight.copy_(head)
    m.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return str(folder)


def copy_tokenizer(folder: str | Path) -> None:
    """Give a model folder SmolLM2's tokenizer files."""
    from dspark.models.loader import resolve_model_folder

    src = Path(resolve_model_folder(None))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, Path(folder) / f)


def drafter_config(kind: str, block_size: int, markov_rank: int = 0, num_layers: int = 1, vocab: int = VOCAB,
                   draft_vocab_size: int | None = None, head_dim: int = 16):
    from dspark.models.drafters.dspark import DrafterConfig

    return DrafterConfig(kind=kind, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=vocab,
                         block_size=block_size, mask_token_id=MASK_ID, target_layer_ids=list(LAYER_IDS),
                         num_target_layers=LAYERS, markov_rank=markov_rank if kind == "dspark" else 0,
                         confidence_head=kind == "dspark", rope_theta=10000.0, draft_vocab_size=draft_vocab_size)


def save_tiny_drafter(folder: str | Path, kind: str = "dspark", block_size: int = 8, markov: bool = True,
                      seed: int = 1, beta: float = 60.0, vocab: int = VOCAB,
                      draft_vocab: list[int] | None = None, head_dim: int = 16) -> str:
    """A random drafter for the tiny target; with markov=True (DSpark) its Markov head encodes f
    (on SmolLM2's vocabulary; on a smaller one it stays random). draft_vocab: a reduced draft
    vocabulary (sorted target ids) the drafter proposes from."""
    from dspark.models.drafters.checkpoint import save_drafter
    from dspark.models.drafters.dspark import BlockDrafter

    rank = len(ALPHABET) if kind == "dspark" else 0
    markov = markov and vocab > max(ALPHABET)
    torch.manual_seed(seed)
    d = BlockDrafter(drafter_config(kind, block_size, rank, vocab=vocab, head_dim=head_dim,
                                    draft_vocab_size=len(draft_vocab) if draft_vocab else None), HIDDEN)
    with torch.no_grad():
        if draft_vocab:
            d.draft_to_target.copy_(torch.tensor(draft_vocab))
        for name, p in d.named_parameters():
            if name.endswith("proj.weight") and "confidence" not in name:
                p.normal_(0, 0.2)
        if d.confidence_head is not None:
            d.confidence_head.proj.weight.normal_(0, 0.3)
            d.confidence_head.proj.bias.fill_(0.5)
        if d.markov_head is not None and not markov:
            d.markov_head.markov_w1.weight.normal_(0, 1.0)
            d.markov_head.markov_w2.weight.normal_(0, 0.3)
        elif d.markov_head is not None:
            w1 = torch.zeros(vocab, rank)
            w2 = torch.zeros(vocab, rank)
            if markov:
                for i, t in enumerate(ALPHABET):
                    w1[t, i] = 1.0
                    w2[follow(t), i] = beta
            d.markov_head.markov_w1.weight.copy_(w1)
            d.markov_head.markov_w2.weight.copy_(w2[draft_vocab] if draft_vocab else w2)
    save_drafter(d, folder)
    return str(folder)


def save_drafter_for(folder: str | Path, target_folder: str, kind: str = "dspark", block_size: int = 8,
                     seed: int = 0) -> str:
    """A random one-layer drafter sized for the target in target_folder (e.g. SmolLM2-135M)."""
    from dspark.models.drafters.checkpoint import save_drafter
    from dspark.models.drafters.dspark import BlockDrafter, DrafterConfig
    from dspark.models.llama import LlamaConfig
    from dspark.models.loader import load_config

    tc = LlamaConfig.from_hf(load_config(target_folder))
    L = tc.num_hidden_layers
    dc = DrafterConfig(kind=kind, hidden_size=tc.hidden_size, intermediate_size=256, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=tc.vocab_size,
                       block_size=block_size, mask_token_id=0, target_layer_ids=[1, L // 2, L - 3],
                       num_target_layers=L, markov_rank=32 if kind == "dspark" else 0,
                       confidence_head=kind == "dspark", rope_theta=tc.rope_theta)
    torch.manual_seed(seed)
    save_drafter(BlockDrafter(dc, tc.hidden_size), folder)
    return str(folder)


def alphabet_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts over the alphabet: a walk along f with random jumps (so the context is not trivial)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tok = ALPHABET[int(torch.randint(len(ALPHABET), (1,), generator=g))]
        ids = []
        for _ in range(n):
            ids.append(tok)
            jump = float(torch.rand(1, generator=g)) < 0.3
            tok = ALPHABET[int(torch.randint(len(ALPHABET), (1,), generator=g))] if jump else follow(tok)
        out.append(ids)
    return out


_ASSETS: dict[str, str] = {}


def assets(tmp_path_factory) -> dict[str, str]:
    """Build (once per session) the tiny targets and their drafters; returns their folders:
    target, dspark (Markov head encodes f, block 8), dflash (block 9: 8 drafts), dspark_soft
    (weak Markov head, block 4: spread-out draft distributions), small_target (vocab 12, random:
    its sampling distribution can be enumerated), small_dspark (random, block 3), and
    small_dspark_rv / dspark_rv (the same kinds with a reduced draft vocabulary), eagle3 /
    small_eagle3 (EAGLE-3 heads) and draft_model / small_draft_model (tiny targets as draft models)."""
    if not _ASSETS:
        root = tmp_path_factory.mktemp("spec_assets")
        _ASSETS["target"] = save_tiny_target(root / "target")
        _ASSETS["dspark"] = save_tiny_drafter(root / "dspark", "dspark", 8)
        _ASSETS["dflash"] = save_tiny_drafter(root / "dflash", "dflash", 9)
        _ASSETS["dspark_soft"] = save_tiny_drafter(root / "dspark_soft", "dspark", 4, beta=3.0)
        _ASSETS["small_target"] = save_tiny_target(root / "small_target", predictable=False, seed=4,
                                                   vocab=SMALL_VOCAB)
        _ASSETS["small_dspark"] = save_tiny_drafter(root / "small_dspark", "dspark", 3, markov=False, seed=5,
                                                    vocab=SMALL_VOCAB)
        # reduced draft vocabularies: q = 0 outside them, so some target tokens are never drafted
        _ASSETS["small_dspark_rv"] = save_tiny_drafter(root / "small_dspark_rv", "dspark", 3, markov=False,
                                                       seed=6, vocab=SMALL_VOCAB, draft_vocab=[3, 5, 6, 7, 9, 10])
        _ASSETS["dspark_rv"] = save_tiny_drafter(root / "dspark_rv", "dspark", 8,
                                                 draft_vocab=list(range(17)) + ALPHABET[:16])
        # other proposer kinds: EAGLE-3 heads (random, reduced vocabularies) and draft models (tiny
        # targets of their own: the predictable one mostly follows f too, so its drafts often survive)
        _ASSETS["eagle3"] = save_tiny_eagle3(root / "eagle3", _ASSETS["target"], list(range(17)) + ALPHABET)
        _ASSETS["small_eagle3"] = save_tiny_eagle3(root / "small_eagle3", _ASSETS["small_target"], [3, 5, 6, 7, 9, 10])
        _ASSETS["draft_model"] = save_tiny_target(root / "draft_model", seed=3)
        _ASSETS["small_draft_model"] = save_tiny_target(root / "small_draft_model", predictable=False, seed=8,
                                                        vocab=SMALL_VOCAB)
    return dict(_ASSETS)


def make_engine(model: str, drafter: str = "none", **kwargs):
    """An Engine on CPU (fp32 unless dtype= says) with the given drafter; SpecConfig fields go to the spec."""
    from dspark.config import EngineConfig, SpecConfig
    from dspark.engine.engine import Engine

    spec_keys = {f.name for f in dataclasses.fields(SpecConfig)}
    spec = SpecConfig(drafter=drafter, **{k: kwargs.pop(k) for k in list(kwargs) if k in spec_keys})
    return Engine(EngineConfig(**{"model": model, "device": "cpu", "dtype": "float32", "spec": spec, **kwargs}))


def run_requests(engine, requests, spec: bool = True) -> list:
    """Add (prompt, SamplingParams, block_size) requests, step until all finish; outputs in order.
    spec=False decodes them plainly (no drafts) on the same engine."""
    base = len(engine.seqs) + engine.spec_stats.steps + id(requests)
    rids = []
    for i, (prompt, params, block) in enumerate(requests):
        rid = f"req-{base}-{i}"
        engine.add_request(rid, prompt, dataclasses.replace(params), spec=spec, block_size=block)
        rids.append(rid)
    done = {}
    guard = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        guard += 1
        assert guard < 10_000, "engine did not finish"
    return [done[r] for r in rids]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run tiny models on one thread: their ops are too small to gain from two, and under CPU
    contention two spinning OpenMP threads make them many times slower. Same numbers."""
    with cpu_threads(1):
        yield


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """torch on n threads inside the block (a real model's batch of hundreds of rows in a module
    that otherwise runs tiny ones on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """A random tree over n new tokens (node 0 the root): each row sees itself and its ancestors."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[int(torch.randint(0, i, (1,), generator=g))]
    return m


def save_tiny_eagle3(folder: str | Path, target_folder: str, draft_vocab: list[int], seed: int = 2) -> str:
    """A random EAGLE-3 head for the target in target_folder, in the published layout, drafting
    from draft_vocab (sorted target ids)."""
    from dspark.models.drafters.eagle3 import Eagle3Config, Eagle3Head, eagle3_hf_config, save_eagle3
    from dspark.models.llama import LlamaConfig
    from dspark.models.loader import load_config

    tc = LlamaConfig.from_hf(load_config(target_folder))
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_hf(eagle3_hf_config(tc, len(draft_vocab), 96), tc))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("proj.weight") or name.startswith(("fc", "lm_head")):
                p.normal_(0, 0.5 / p.shape[1] ** 0.5)
        head.d2t.copy_(torch.tensor(draft_vocab) - torch.arange(len(draft_vocab)))
    save_eagle3(head, folder)
    return str(folder)


def kernel_dtype_name() -> str:
    """The dtype name the int4 kernels' build takes rows in (bfloat16 on AMX or VNNI, float32 on
    AVX2 alone), as EngineConfig.dtype spells it."""
    from dspark.models import cpu_ops

    return str(cpu_ops.quant_dtype()).removeprefix("torch.")


def require_kernels(built: object, quant: bool = False) -> None:
    """At a kernel test module's import: skip the module, saying why, where the C++ kernels cannot
    be built (DSPARK_CPU_OPS=0, no compiler or ninja, or for quant=True a CPU without AMX,
    VNNI+BF16 or AVX2); fail its collection with the compiler's output where they could have been
    but `built` (cpu_ops.load() or .quant()) is None: a broken kernel build must not pass as skips."""
    import pytest

    from dspark.models import cpu_ops

    if built is not None:
        return
    if not cpu_ops.enabled():
        pytest.skip("DSPARK_CPU_OPS=0: the fused CPU kernels are switched off", allow_module_level=True)
    missing = cpu_ops.toolchain_missing()
    if missing is not None:
        pytest.skip(f"the C++ kernels cannot be built here: {missing}", allow_module_level=True)
    if quant and not cpu_ops.quant_expected():
        pytest.skip("no AMX, AVX512-VNNI+BF16 or AVX2 on this CPU: no int4/int8 kernels", allow_module_level=True)
    errors = "\n\n".join(f"{name}: {err}" for name, err in cpu_ops.build_errors.items()) or "(no error kept)"
    pytest.fail(f"a C++ compiler and ninja are here, yet the kernels did not build:\n{errors}", pytrace=False)
