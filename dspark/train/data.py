"""Self-distillation data: the target writes the responses the drafter learns from.

Prompts come from jsonl (`prompt`: one user turn; `turns`: a list of user turns, of which
the first is used; `messages`: a conversation ending with a user turn, answered as a whole).
The target's chat template is applied, then the target generates a response: greedy for most
prompts, sampled at temperature 0.7 for a share of them (default 25%, chosen per prompt from
the seed). Only token ids are stored, in shards
`<dir>/shard_00000.safetensors` holding `tokens` (int32, all sequences concatenated),
`offsets` (int64 [n+1]), `prompt_lens` (int32 [n]: positions >= prompt_len are the response),
`prompt_index` (int64 [n]) and `sampled` (uint8 [n]); category names in the metadata.
Shard i covers prompts [i*S, (i+1)*S) of the file order; a shard already on disk is skipped,
so an interrupted run resumes where it stopped (a short last shard is written again when a
later run asks for more prompts). Size: 4 bytes a token (~1 KB a sequence).

Backends: "engine" (our continuous-batching engine, the default on CPU), "dense" (a plain
batched decoder over the same LlamaModel weights with a dense KV cache, features.generate_dense:
the default on CUDA, where it is far faster than the engine's pure-torch paged attention or
transformers' generate, which made ~8 prompts/s on an H100 at batch 256), or "hf"
(transformers `generate` with left padding). Either way the text is the target's own.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark.atomic import atomic_path
from dspark.prompt_file import prompt_rows, row_messages

log = logging.getLogger(__name__)


def read_prompts(path: str | Path, limit: int | None = None, skip: int = 0) -> list[dict]:
    """[{id, category, messages}] from a jsonl file with `prompt`, `turns` or `messages` per line,
    after its first `skip` prompts."""
    out = []
    for line_no, d, text in prompt_rows(path):
        if skip > 0:
            skip -= 1
            continue
        out.append({"id": d.get("id", str(line_no - 1)), "category": d.get("category", "all"),
                    "messages": row_messages(d, text)})
        if limit and len(out) >= limit:
            break
    return out


@dataclass
class GenSettings:
    """How the target writes its training responses (stored in the data folder's meta.json)."""

    max_new_tokens: int = 256
    max_prompt_tokens: int = 768
    sample_share: float = 0.25
    temperature: float = 0.7
    seed: int = 0
    shard_size: int = 1024
    batch_size: int = 64
    backend: str = "auto"  # auto | engine | dense | hf


def _is_sampled(i: int, s: GenSettings) -> bool:
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + i)
    return bool(torch.rand(1, generator=g).item() < s.sample_share)


class _EngineGen:
    def __init__(self, model, device, dtype, s: GenSettings):
        from dspark.llm import LLM

        ctx = s.max_prompt_tokens + s.max_new_tokens + 16
        dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, dtype)
        self.llm = LLM(model=model, drafter="none", device=device, dtype=dname, max_num_seqs=s.batch_size,
                       kv_cache_tokens=max(65536, s.batch_size * ctx), max_num_batched_tokens=4096)
        self.tok = self.llm.tokenizer

    def __call__(self, prompt_ids: list[list[int]], temps: list[float], seeds: list[int], s: GenSettings):
        from dspark.config import SamplingParams

        params = [SamplingParams(temperature=t, max_tokens=s.max_new_tokens, seed=sd) for t, sd in zip(temps, seeds)]
        return [o.token_ids for o in self.llm.generate(prompt_ids, params)]


class _HFGen:
    def __init__(self, model, device, dtype, s: GenSettings):
        from dspark.models.loader import load_tokenizer, load_transformers_model, resolve_model_folder

        folder = resolve_model_folder(model)
        self.tok = load_tokenizer(folder)
        self.model = load_transformers_model(folder, dtype).to(device).eval()
        self.device = device
        eos = self.model.generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or [])) | {self.tok.eos_token_id}
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    @torch.inference_mode()
    def __call__(self, prompt_ids, temps, seeds, s: GenSettings):
        out = [None] * len(prompt_ids)
        for temp in sorted(set(temps)):
            idx = [i for i, t in enumerate(temps) if t == temp]
            idx.sort(key=lambda i: len(prompt_ids[i]))
            for j in range(0, len(idx), s.batch_size):
                chunk = idx[j:j + s.batch_size]
                L = max(len(prompt_ids[i]) for i in chunk)
                ids = torch.full((len(chunk), L), self.pad, dtype=torch.long)
                att = torch.zeros_like(ids)
                for r, i in enumerate(chunk):
                    p = prompt_ids[i]
                    ids[r, L - len(p):] = torch.tensor(p)
                    att[r, L - len(p):] = 1
                torch.manual_seed(seeds[chunk[0]])
                kw = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False)
                gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                          max_new_tokens=s.max_new_tokens, pad_token_id=self.pad, **kw)
                for r, i in enumerate(chunk):
                    resp = []
                    for t in gen[r, L:].tolist():
                        resp.append(t)
                        if t in self.eos:
                            break
                    out[i] = resp
        return out


class _DenseGen:
    """features.generate_dense over length-sorted batches of the same LlamaModel weights."""

    def __init__(self, model, device, dtype, s: GenSettings):
        from dspark.train.drafter_init import load_target

        self.model, self.tok = load_target(model, device, dtype)
        self.eos = set(self.model.config.eos_token_id) | {self.tok.eos_token_id}
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    def __call__(self, prompt_ids, temps, seeds, s: GenSettings):
        from dspark.train.features import generate_dense

        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        out = [None] * len(prompt_ids)
        for j in range(0, len(order), s.batch_size):
            chunk = order[j:j + s.batch_size]
            res = generate_dense(self.model, [prompt_ids[i] for i in chunk], s.max_new_tokens,
                                 [temps[i] for i in chunk], self.eos, self.pad, seed=seeds[chunk[0]])
            for i, r in zip(chunk, res):
                out[i] = r
        return out


BACKENDS = {"engine": _EngineGen, "hf": _HFGen, "dense": _DenseGen}


def make_generator(model, device: str, dtype: torch.dtype, s: GenSettings):  # noqa: ANN201 - one of BACKENDS
    """The response writer s.backend names ("auto": the dense batched decoder on CUDA, our engine on CPU)."""
    backend = s.backend
    if backend == "auto":
        backend = "dense" if str(device).startswith("cuda") else "engine"
    return BACKENDS[backend](model, device, dtype, s)


def shard_path(data_dir: Path, i: int) -> Path:
    return Path(data_dir) / f"shard_{i:05d}.safetensors"


def generate_dataset(prompts_file: str, data_dir: str | Path, num_prompts: int | None, model: str | None,
                     device: str, dtype: torch.dtype, s: GenSettings, progress: bool = True,
                     deadline: float | None = None, skip_prompts: int = 0) -> dict:
    """Write the missing shards; return stats (sequences, tokens, seconds). Past `deadline`
    (time.time()) it stops after the shard in progress and sets stats["incomplete"].
    `skip_prompts` drops the file's first prompts (those an earlier run used); shard numbers,
    prompt_index and the per-prompt sampling seeds count from the first prompt kept."""
    from tqdm import tqdm

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(prompts_file, num_prompts, skip_prompts)
    if not prompts:
        raise ValueError(f"{prompts_file}: no prompts left after skipping {skip_prompts}")
    n_shards = -(-len(prompts) // s.shard_size)
    todo = [i for i in range(n_shards)
            if not _shard_complete(shard_path(data_dir, i), min(s.shard_size, len(prompts) - i * s.shard_size))]
    meta = {"prompts_file": str(prompts_file), "skip_prompts": skip_prompts, "num_prompts": len(prompts),
            "shard_size": s.shard_size,
            "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens,
            "sample_share": s.sample_share, "temperature": s.temperature, "seed": s.seed,
            "model": model or "default (SmolLM2-135M-Instruct)"}
    _check_same_layout(data_dir / "meta.json", meta, writing=bool(todo))
    t0 = time.perf_counter()
    stats = {"shards_written": 0, "sequences": 0, "tokens": 0, "skipped_long": 0}
    if not todo:  # e.g. a training run on a finished folder with another --seed: nothing to record
        return stats | {"seconds": 0.0}
    gen = make_generator(model, device, dtype, s)  # first: a model that fails to load records nothing
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    bar = tqdm(total=sum(min(s.shard_size, len(prompts) - i * s.shard_size) for i in todo),
               desc="generating", unit="prompt", disable=not progress)
    for si in todo:
        if deadline is not None and time.time() >= deadline:
            stats["incomplete"] = True
            break
        lo, hi = si * s.shard_size, min(len(prompts), (si + 1) * s.shard_size)
        keep, pids = [], []
        for i in range(lo, hi):
            out = gen.tok.apply_chat_template(prompts[i]["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
            if len(ids) > s.max_prompt_tokens:
                stats["skipped_long"] += 1
                continue
            keep.append(i)
            pids.append(ids)
        temps = [s.temperature if _is_sampled(i, s) else 0.0 for i in keep]
        seeds = [s.seed * 1_000_003 + i for i in keep]
        resps = []
        for j in range(0, len(keep), s.batch_size * 4):  # bounded work per call, live progress
            resps += gen(pids[j:j + s.batch_size * 4], temps[j:j + s.batch_size * 4],
                         seeds[j:j + s.batch_size * 4], s)
            bar.update(min(s.batch_size * 4, len(keep) - j))
        bar.update((hi - lo) - len(keep))
        seqs = [p + r for p, r in zip(pids, resps)]
        arrays = {
            "tokens": np.concatenate([np.asarray(x, dtype=np.int32) for x in seqs]) if seqs
            else np.zeros(0, np.int32),
            "offsets": np.cumsum([0] + [len(x) for x in seqs]).astype(np.int64),
            "prompt_lens": np.asarray([len(p) for p in pids], dtype=np.int32),
            "prompt_index": np.asarray(keep, dtype=np.int64),
            "sampled": np.asarray([t > 0 for t in temps], dtype=np.uint8),
        }
        cats = json.dumps([prompts[i]["category"] for i in keep])
        with atomic_path(shard_path(data_dir, si)) as tmp:
            save_file(arrays, str(tmp), metadata={"categories": cats, "prompts": str(hi - lo)})
        stats["shards_written"] += 1
        stats["sequences"] += len(seqs)
        stats["tokens"] += int(arrays["tokens"].size)
    bar.close()
    return stats | {"seconds": round(time.perf_counter() - t0, 2)}


def _shard_complete(path: Path, num_prompts: int) -> bool:
    """A shard on disk that covers all `num_prompts` of its range. The last shard of a run with
    fewer prompts covers fewer and is written again; shards written before the count was stored
    are trusted."""
    if not path.exists():
        return False
    with safe_open(str(path), "np") as f:
        covered = (f.metadata() or {}).get("prompts")
    return covered is None or int(covered) >= num_prompts


# Shard i holds prompts [i*S, (i+1)*S) counted from the first kept prompt: always the same S and skip.
_LAYOUT_KEYS = ("shard_size", "skip_prompts")
# What else decides a response: new shards written with other values would be silently mixed with
# the old ones (and meta.json would describe only the latest), so they must match when any is written.
_GENERATION_KEYS = ("model", "max_new_tokens", "max_prompt_tokens", "sample_share", "temperature", "seed")


def _check_same_layout(meta_path: Path, meta: dict, writing: bool) -> None:
    """Refuse a folder written with another layout, or (when shards are to be written) other
    generation settings. Only num_prompts (the folder grows) and the prompts file's path may change."""
    if not meta_path.exists():
        return
    old = json.loads(meta_path.read_text())
    old.setdefault("skip_prompts", 0)  # written before the option existed
    for key in _LAYOUT_KEYS + (_GENERATION_KEYS if writing else ()):
        if key in old and old[key] != meta[key]:
            raise ValueError(f"{meta_path.parent} was written with {key}={old[key]!r}, not "
                             f"{meta[key]!r}: use the same value or another data folder")
