"""Offline benchmark: run methods side by side on one prompt set, in one process.

Methods: ``hf`` (transformers ``generate``, greedy), ``ar`` (our engine, no drafter), ``ngram``,
``dspark`` (the configured drafter: ``--drafter`` folder of any layout or ``--draft-model``; else
the default one), ``dspark-tree`` (the same, tree verification) and
``llamacpp`` (llama.cpp on the same GGUF, one request at a time; see :mod:`dspark.bench.llamacpp`).

Timing definitions (prefill excluded from decode speed):

* Prompts run in consecutive groups of ``batch_size``; each group is one batch.
* Our engine: a group is one ``LLM.generate`` call, timed with ``time.perf_counter`` from ``t0``
  (before) to ``t1`` (after). A request's first token lands at ``t0 + ttft`` (arrival is stamped in
  ``add_request`` just after ``t0``; prompts are pre-tokenized, so this errs by microseconds towards
  a longer window). Decode window = ``t1 - (t0 + min ttft)``: first first token to the end.
* HF: ``generate(max_new_tokens=1)`` on the same batch gives the group's TTFT; the decode window
  is the full ``generate`` time minus that TTFT.
* llama.cpp: per request, TTFT = prompt eval + first token, decode window = first to last token.
* ``decode_tok_s`` = sum over groups of (generated tokens - 1 per request) / sum of decode windows.
* ``draft_share`` (speculative methods) = seconds in the drafter's proposals / sum of decode windows.
* Sampling (``--temperature`` > 0): request i of the run (prompts in order) samples with seed
  ``seed + i`` in every method. Our engine's seeded outputs do not depend on drafts, so ``ar``
  and the speculative methods still produce the same tokens (``matches_ar`` stays meaningful);
  ``hf`` and ``llamacpp`` sample with their own generators (their ``matches_ar`` is left out).
* Order: by default every method is loaded at once and each group is run by every method in
  turn (the order rotated per group), so a machine whose speed drifts slows all methods alike;
  ``--sequential`` runs one method at a time (one model in memory, for models that do not fit
  several times).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from typing import Any

import torch

from dspark.bench.llamacpp import LlamaCppMethod, check_llamacpp
from dspark.bench.prompts import default_prompts_path, load_prompts  # noqa: F401  (re-exported)
from dspark.config import EngineConfig, SamplingParams

METHODS = ("hf", "ar", "ngram", "dspark", "dspark-tree", "llamacpp")
SPEC_METHODS = ("ngram", "dspark", "dspark-tree")
# SpecConfig overrides per engine method; "dspark" keeps --drafter or --draft-model (neither: the
# engine's default drafter)
ENGINE_METHODS: dict[str, dict[str, Any]] = {"ar": {"drafter": "none", "draft_model": None, "tree": False},
                                             "ngram": {"drafter": "ngram", "draft_model": None, "tree": False},
                                             "dspark": {}, "dspark-tree": {"tree": True}}


@dataclasses.dataclass
class MethodRun:
    """Raw measurements of one method over all prompts."""

    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)
    decode_tokens: int = 0
    decode_time: float = 0.0
    load_s: float = 0.0
    stats: list[Any] | None = None  # SpecStats per request (our engine only)
    drafter: str | None = None  # the spec runner the engine picked (our engine only)
    draft_time: float = 0.0  # seconds in the drafter's proposals (our engine only)
    info: dict[str, Any] | None = None  # settings reported with the method's figures (llamacpp)


def encode_prompts(tokenizer: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids exactly as the engine would encode the prompts (chat template or raw text)."""
    out = []
    for text in prompts:
        if chat:
            enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        else:
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _groups(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def method_config(cfg: EngineConfig, method: str) -> EngineConfig:
    """The engine config for one of our methods (``ar``, ``ngram``, ``dspark``, ``dspark-tree``)."""
    if method not in ENGINE_METHODS:
        raise ValueError(f"unknown engine method {method!r}")
    return dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, **ENGINE_METHODS[method]))


class EngineMethod:
    """One of our engine methods, loaded once; ``measure`` times one group (one ``generate`` call)."""

    def __init__(self, cfg: EngineConfig, max_tokens: int, temperature: float = 0.0, seed: int = 0):
        from dspark.llm import LLM

        t = time.perf_counter()
        self.llm = LLM.from_config(cfg)
        self.run = MethodRun(load_s=time.perf_counter() - t, stats=[],
                             drafter=getattr(self.llm.engine.spec, "name", None))
        self.params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        self.seed = seed  # of the next measured request, when sampling

    def _params(self, n: int) -> list[SamplingParams]:
        if self.params.greedy:
            return [self.params] * n
        seeds = range(self.seed, self.seed + n)
        return [dataclasses.replace(self.params, seed=s) for s in seeds]

    def warm(self, prompt_ids: list[list[int]]) -> None:
        if prompt_ids:
            self.llm.generate(prompt_ids, [dataclasses.replace(p, seed=-1 - i)
                                           for i, p in enumerate(self._params(len(prompt_ids)))])

    def measure(self, group: list[list[int]]) -> None:
        d0 = self.llm.engine.draft_time
        t0 = time.perf_counter()
        outs = self.llm.generate(group, self._params(len(group)))
        t1 = time.perf_counter()
        self.seed += len(group)
        ttfts = [o.ttft or 0.0 for o in outs]
        run = self.run
        run.draft_time += self.llm.engine.draft_time - d0
        # from the first first-token: requests admitted later (past max_num_seqs or the prefill
        # budget) decode alongside earlier ones, whose tokens all count, so a window opened at the
        # last first-token would miss time that produced counted tokens
        run.decode_time += t1 - (t0 + min(ttfts))
        run.decode_tokens += sum(max(0, len(o.token_ids) - 1) for o in outs)
        run.ttfts += ttfts
        run.token_ids += [list(o.token_ids) for o in outs]
        run.stats += [o.stats for o in outs]


def eos_ids(folder: str, tokenizer: Any) -> set[int]:
    """Every id that ends a generation for the model in ``folder``: its config's and its tokenizer's."""
    from dspark.models.loader import load_config

    eos = load_config(folder).get("eos_token_id")
    return (set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}) - {None}


def _trim(row: list[int], eos_ids: set[int]) -> list[int]:
    """Cut a generated row after its first end-of-sequence token (as the engine stops)."""
    return row[:next((i + 1 for i, tok in enumerate(row) if tok in eos_ids), len(row))]


class HFMethod:
    """transformers ``generate`` (greedy, left-padded batches) in the engine's dtype and device."""

    def __init__(self, cfg: EngineConfig, folder: str, max_tokens: int, temperature: float = 0.0, seed: int = 0):
        from dspark.models.loader import load_tokenizer, load_transformers_model

        self.device, dtype = cfg.resolved_device(), cfg.resolved_dtype()
        self.cuda, self.max_tokens = self.device.startswith("cuda"), max_tokens
        self.temperature, self.seed = temperature, seed
        t = time.perf_counter()
        self.model = load_transformers_model(folder, dtype).to(self.device).eval()
        tok = load_tokenizer(folder)
        self.run = MethodRun(load_s=time.perf_counter() - t)
        self.eos_ids = eos_ids(folder, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def _generate(self, group: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        width = max(len(p) for p in group)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in group], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=self.device)
        sample = {"do_sample": True, "temperature": self.temperature, "top_k": 0} if self.temperature else \
            {"do_sample": False, "temperature": None, "top_k": None}
        torch.manual_seed(self.seed % 2**63)
        _sync(self.cuda)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, pad_token_id=self.pad,
                                      eos_token_id=sorted(self.eos_ids), top_p=None, **sample)
        _sync(self.cuda)
        elapsed = time.perf_counter() - t0
        return [_trim(r, self.eos_ids) for r in out[:, width:].tolist()], elapsed

    def warm(self, prompt_ids: list[list[int]]) -> None:
        if prompt_ids:
            self._generate(prompt_ids, 1)
            self._generate(prompt_ids, self.max_tokens)

    def measure(self, group: list[list[int]]) -> None:
        _, ttft = self._generate(group, 1)
        rows, total = self._generate(group, self.max_tokens)
        self.seed += len(group)
        self.run.decode_time += max(0.0, total - ttft)
        self.run.decode_tokens += sum(max(0, len(r) - 1) for r in rows)
        self.run.ttfts += [ttft] * len(group)
        self.run.token_ids += rows


def _spec_summary(stats: list[Any]) -> dict[str, Any]:
    """tau and per-position acceptance, summed over requests."""
    steps, committed = sum(s.steps for s in stats), sum(s.generated for s in stats)
    width = max((len(s.verified_per_pos) for s in stats), default=0)
    acc = [sum(s.accepted_per_pos[i] for s in stats if i < len(s.accepted_per_pos)) for i in range(width)]
    ver = [sum(s.verified_per_pos[i] for s in stats if i < len(s.verified_per_pos)) for i in range(width)]
    return {"tau": round(committed / steps, 4) if steps else None, "steps": steps,
            "proposed": sum(s.proposed for s in stats), "verified": sum(s.verified for s in stats),
            "accepted": sum(s.accepted for s in stats),
            "lookup_steps": sum(s.lookup_steps for s in stats),
            "lookup_accepted": sum(s.lookup_accepted for s in stats),
            "acceptance_per_pos": [round(a / v, 4) if v else None for a, v in zip(acc, ver)],
            "verified_per_pos": ver}


def summarize(method: str, run: MethodRun, ref: dict[str, MethodRun], sampled: bool = False) -> dict[str, Any]:
    """The reported numbers for one method; ``ref`` holds the ``ar``, ``hf`` and ``llamacpp`` runs when made.
    sampled: the run sampled (temperature > 0), so only our engine's methods can match ``ar``."""
    tok_s = run.decode_tokens / run.decode_time if run.decode_time > 0 else None
    out: dict[str, Any] = {
        "decode_tok_s": round(tok_s, 2) if tok_s else None,
        "ttft_ms": round(1000 * sum(run.ttfts) / len(run.ttfts), 2) if run.ttfts else None,
        "tokens": sum(len(t) for t in run.token_ids), "requests": len(run.token_ids),
        "decode_tokens": run.decode_tokens, "decode_s": round(run.decode_time, 4),
        "load_s": round(run.load_s, 3), "matches_ar": None}
    if run.drafter is not None:
        out["drafter"] = run.drafter
    out.update(run.info or {})
    ar = ref.get("ar")
    if ar is not None and run.token_ids and not (sampled and method in ("hf", "llamacpp")):
        same = sum(a == b for a, b in zip(run.token_ids, ar.token_ids))
        out["matches_ar"] = round(same / len(run.token_ids), 4)
    if method in SPEC_METHODS and run.stats is not None:
        out.update(_spec_summary(run.stats))
        if run.draft_time > 0 and run.decode_time > 0:  # how much of decoding the drafter itself costs
            out["draft_share"] = round(run.draft_time / run.decode_time, 4)
    for name, key in (("ar", "speedup_vs_ar"), ("hf", "speedup_vs_hf"), ("llamacpp", "vs_llamacpp")):
        other = ref.get(name)  # llamacpp: every method's baseline column, itself included (1.0)
        if (method != name or name == "llamacpp") and other and tok_s and other.decode_time > 0 and other.decode_tokens:
            out[key] = round(tok_s / (other.decode_tokens / other.decode_time), 3)
    return out


def _fail(errors: dict[str, str], method: str, e: Exception) -> None:
    # one failing method (e.g. a drafter still being written) must not sink the rest
    errors[method] = f"{type(e).__name__}: {e}"
    print(f"[bench] {method} failed: {errors[method]}", file=sys.stderr, flush=True)


def _measure_interleaved(load, methods: list[str], groups: list, warm: list, errors: dict) -> dict[str, MethodRun]:
    """Every method loaded at once, then each group run by every method in turn, the order rotated
    by one per group: a machine whose speed drifts (a shared CPU, clocks, other work) slows every
    method alike instead of whichever happened to run during the slow minutes. Given one method,
    this is the sequential benchmark's step."""
    live = {}
    for method in methods:
        print(f"[bench] loading {method} ...", file=sys.stderr, flush=True)
        try:
            live[method] = load(method)
            live[method].warm(warm)
        except Exception as e:
            live.pop(method, None)
            _fail(errors, method, e)
    for i, group in enumerate(groups):
        names = list(live)
        k = i % len(names) if names else 0
        for method in names[k:] + names[:k]:
            try:
                live[method].measure(group)
            except Exception as e:
                del live[method]
                _fail(errors, method, e)
    return {m: live[m].run for m in methods if m in live}


def run_bench(cfg: EngineConfig, methods: list[str], prompts: list[str], batch_size: int,
              max_tokens: int, warmup: int, chat: bool = True, interleave: bool = True,
              temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Run every method on ``prompts`` and return the report (one JSON-able dict).
    ``interleave``: all methods in memory, taking turns per group (see _measure_interleaved);
    else one after another. ``temperature`` > 0 samples, request i with seed ``seed + i``."""
    import transformers

    from dspark.models.loader import load_tokenizer, resolve_model_folder

    t_start = time.perf_counter()
    load_before = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    gguf = check_llamacpp(cfg.model) if "llamacpp" in methods else None  # before any model loads
    folder = resolve_model_folder(cfg.model)
    prompt_ids = encode_prompts(load_tokenizer(folder, cfg.resolved_chat_template()), prompts, chat)

    def load(method: str) -> EngineMethod | HFMethod | LlamaCppMethod:
        if method == "hf":
            return HFMethod(cfg, folder, max_tokens, temperature, seed)
        if method == "llamacpp":
            return LlamaCppMethod(gguf, folder, max_tokens, n_ctx=max(map(len, prompt_ids)) + max_tokens,
                                  temperature=temperature, seed=seed)
        return EngineMethod(method_config(cfg, method), max_tokens, temperature, seed)

    errors: dict[str, str] = {}
    groups, warm, device = _groups(prompt_ids, batch_size), prompt_ids[:warmup], cfg.resolved_device()
    if interleave:
        runs = _measure_interleaved(load, methods, groups, warm, errors)
    else:  # one method at a time, its model freed before the next loads
        runs = {}
        for method in methods:
            runs.update(_measure_interleaved(load, [method], groups, warm, errors))
            _free(device)
    ref = {k: runs[k] for k in ("ar", "hf", "llamacpp") if k in runs}
    results = {m: ({"error": errors[m]} if m in errors else summarize(m, runs[m], ref, temperature > 0))
               for m in methods}
    return {
        "device": device, "dtype": str(cfg.resolved_dtype()).removeprefix("torch."),
        "model": folder, "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "loadavg_1m_before": load_before, "batch_size": batch_size, "num_prompts": len(prompts),
        "max_tokens": max_tokens, "warmup": warmup, "chat": chat, "interleaved": interleave,
        "temperature": temperature, "seed": seed if temperature > 0 else None,
        "drafter": cfg.spec.drafter, "draft_model": cfg.spec.draft_model, "block_size": cfg.spec.block_size,
        "spec_policy": cfg.spec.policy,
        "methods": results, "wall_s": round(time.perf_counter() - t_start, 2)}
