"""The ``llamacpp`` method of the offline benchmark: llama.cpp (``llama-cpp-python``) on the same GGUF.

* Model: the GGUF file the engine loads (``--model x.gguf``, or the default model's GGUF); an HF
  folder is refused, since llama.cpp reads GGUF only.
* Prompts: the token ids our tokenizer produced (:func:`dspark.bench.offline.encode_prompts`), fed
  to ``Llama.generate`` as they are (no BOS added, no re-tokenization), so every method sees the
  same ids; greedy (``temp=0``) or, with ``--temperature``, sampling over the whole vocabulary
  (request i seeded ``seed + i``), ``max_tokens`` new tokens, stopping at (and keeping) an EOS token.
* Timing, per request: ``t0`` before ``generate`` (which evaluates the prompt), first token at
  ``t_first`` (TTFT = ``t_first - t0``), last token at ``t1``; decode window = ``t1 - t_first``,
  decode tokens = generated - 1 (prefill excluded, as for the other methods).
* Batches: llama-cpp-python has no batched generate, so a group of ``--batch-size`` prompts is run
  one request after another; each TTFT counts from that request's own start (not the group's),
  and the summary says ``"batching": "sequential"``. Compare against batched methods with care.
* No prompt cache: ``generate`` reuses the KV of a matching prefix of the previous prompt (a
  repeated prompt would skip prefill entirely), so the state is reset before every request.
* Threads: ``n_threads`` (and ``n_threads_batch``) = ``torch.get_num_threads()``, which ``dspark
  bench --threads N`` sets, so llama.cpp and torch use the same number of threads.
"""

from __future__ import annotations

import time
from typing import Any

INSTALL_HINT = "pip install llama-cpp-python (or pip install 'dspark[llamacpp]')"


def llamacpp_gguf(model: str | None) -> str:
    """The GGUF file llama.cpp runs for ``--model``; ValueError for an HF folder (or anything else)."""
    from dspark.models.loader import source_gguf

    path = source_gguf(model)
    if path is None:
        raise ValueError(f"--methods llamacpp needs a GGUF model: --model {model!r} is not a .gguf file "
                         "(llama.cpp cannot read an HF folder); pass the .gguf file, or drop llamacpp")
    return path


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module; ValueError (a clear CLI error) naming the install command if missing."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(f"--methods llamacpp needs the llama_cpp module ({e}); install it with "
                         f"{INSTALL_HINT}") from None
    return llama_cpp


def check_llamacpp(model: str | None) -> str:
    """Everything the method needs before any model loads: the GGUF path and the module."""
    path = llamacpp_gguf(model)
    import_llama_cpp()
    return path


class LlamaCppMethod:
    """llama.cpp generation, one request at a time, timed like the other methods."""

    def __init__(self, gguf: str, folder: str, max_tokens: int, n_ctx: int, threads: int | None = None,
                 temperature: float = 0.0, seed: int = 0):
        import torch

        from dspark.bench.offline import MethodRun, eos_ids
        from dspark.models.loader import load_tokenizer

        llama_cpp = import_llama_cpp()
        self.max_tokens, self.threads = max_tokens, threads or torch.get_num_threads()
        self.temperature, self.seed = temperature, seed
        t = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=self.threads,
                                   n_threads_batch=self.threads, n_gpu_layers=0, seed=0, verbose=False)
        load_s = time.perf_counter() - t
        self.eos_ids = (eos_ids(folder, load_tokenizer(folder)) | {self.llm.token_eos()}) - {-1}
        self.run = MethodRun(load_s=load_s, info={
            "gguf": gguf, "llama_cpp": getattr(llama_cpp, "__version__", None), "n_threads": self.threads,
            "n_ctx": n_ctx, "batching": "sequential"})

    def _generate(self, prompt: list[int]) -> tuple[list[int], float, float]:
        """(generated ids, TTFT, decode window) of one request from a clean state."""
        llm = self.llm
        llm.reset()  # n_tokens = 0: no prefix reuse; eval then drops the whole KV cache
        if self.temperature:  # 0xFFFFFFFF would be llama.cpp's "random seed"
            llm.set_seed(self.seed % 0xFFFFFFFF)
            self.seed += 1
        row: list[int] = []
        t0 = time.perf_counter()
        t_first = t1 = t0
        # top_k 0: the whole vocabulary, as the engine samples
        for tok in llm.generate(prompt, top_k=0 if self.temperature else 1, top_p=1.0, min_p=0.0, typical_p=1.0,
                                temp=self.temperature,
                                repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, reset=True):
            t1 = time.perf_counter()
            if not row:
                t_first = t1
            row.append(int(tok))
            if tok in self.eos_ids or len(row) >= self.max_tokens:
                break
        return row, t_first - t0, t1 - t_first

    def warm(self, prompt_ids: list[list[int]]) -> None:
        seed = self.seed
        for prompt in prompt_ids:
            self._generate(prompt)
        self.seed = seed  # measured request i keeps seed + i

    def measure(self, group: list[list[int]]) -> None:
        for prompt in group:  # sequential: no batched generate in llama-cpp-python
            row, ttft, window = self._generate(prompt)
            self.run.ttfts.append(ttft)
            self.run.decode_time += window
            self.run.decode_tokens += max(0, len(row) - 1)
            self.run.token_ids.append(row)
