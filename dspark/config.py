"""Configuration dataclasses shared by the engine, scheduler and server."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

# Past any vocabulary size top_k means "off"; beyond int64 it would fail inside a batched engine step
# (taking the other requests in that step down with it), so it is refused up front.
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20  # most alternatives a token's logprobs may list (vLLM's default max_logprobs)


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output (vLLM's structured outputs): exactly one of a JSON schema (as JSON
    text), any JSON object, a regex, a choice among strings, or an EBNF grammar (GBNF style).
    `field` names the request field it came from, for error messages."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"

    def validate(self) -> None:
        """A ValueError naming `field` (its `param`, which the server's 400 names too)."""
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise field_error(f"{self.field}: give exactly one of json, json_object, regex, choice or grammar",
                              self.field)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise field_error(f"{self.field}: choice must be a non-empty list of non-empty strings", self.field)


def field_error(message: str, param: str) -> ValueError:
    """A ValueError that names the request field at fault (`param`: the server's 400 names it)."""
    err = ValueError(message)
    err.param = param
    return err


@dataclass
class SamplingParams:
    """How one request samples; field names and defaults follow vLLM's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0: disabled)
    max_tokens: int | None = 16  # None: up to the context
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS or stop token id (and no stop string) before this many output tokens
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF's: divides (multiplies) the positive (negative) logits of seen tokens
    logprobs: int | None = None  # None: none; k: each output token's logprob and its k best alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be generated (vLLM's)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in its text
    skip_special_tokens: bool = True  # special tokens (other than the stop token) left out of the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    structured_outputs: StructuredOutputs | None = None
    bad_words: list[str] = field(default_factory=list)  # never completed in the output (vLLM's)
    n: int = 1  # samples per prompt (LLM.generate and the HTTP API fan out; the engine runs one each)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.validate()  # as vLLM: a bad value fails here, not once generation starts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logit_mask(self) -> bool:
        """A logit bias, an allowed-token list or bad words change the distribution."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def choice(self, i: int) -> SamplingParams:
        """The parameters of sample i of n: one sample, seeded with seed + i (wrapping within the
        accepted range), so seeded samples differ from each other yet repeat across identical calls."""
        seed = None if self.seed is None else self.seed + i
        if seed is not None and seed >= 2**64:
            seed -= 2**64
        return replace(self, n=1, seed=seed)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise field_error(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise field_error(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < float("inf"):  # NaN fails too
            raise field_error(f"temperature must be a finite number >= 0, got {t!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise field_error(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise field_error(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k > MAX_TOP_K):
            raise field_error(f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}, "
                              f"got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise field_error(f"seed must be an integer, got {self.seed!r}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise field_error(f"stop strings must be non-empty strings, got {s!r}", "stop")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise field_error(f"bad_words must be non-empty strings, got {w!r}", "bad_words")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise field_error(f"stop_token_ids must be token ids (integers >= 0), got {t!r}", "stop_token_ids")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise field_error(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise field_error(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                              "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise field_error(f"{name} must be in [-2, 2], got {v!r}", name)
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 < r < float("inf"):
            raise field_error(f"repetition_penalty must be a finite number > 0, got {r!r}", "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise field_error(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        self._validate_logit_mask()
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise field_error(f"truncate_prompt_tokens must be an integer >= 1, got {k!r}", "truncate_prompt_tokens")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.ignore_eos or self.min_tokens or self.allowed_token_ids is not None:
                # the grammar ends at the EOS token, and decides itself which tokens may come
                field = self.structured_outputs.field
                raise field_error(f"{field} cannot be combined with ignore_eos, min_tokens or allowed_token_ids",
                                  field)

    def _validate_logit_mask(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise field_error(f"logit_bias must map token ids to biases, got {self.logit_bias!r}", "logit_bias")
            for t, b in self.logit_bias.items():
                if not _is_token_id(t):
                    raise field_error(f"logit_bias keys must be token ids (integers >= 0), got {t!r}", "logit_bias")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100.0 <= b <= 100.0:
                    raise field_error(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}",
                                      "logit_bias")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                raise field_error(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}",
                                  "allowed_token_ids")
            bad = next((t for t in ids if not _is_token_id(t)), None)
            if bad is not None:
                raise field_error(f"allowed_token_ids must be token ids (integers >= 0), got {bad!r}",
                                  "allowed_token_ids")

    def logit_token_ids(self) -> list[int]:
        """The token ids whose logits the request changes (the engine checks them against its
        vocabulary; a stop token id outside it simply never matches)."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or [])]


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass
class SpecConfig:
    """Speculative decoding settings.

    drafter: a drafter folder (DSpark, DFlash or EAGLE-3 layout), "ngram", "none", or None for
    the shipped default. draft_model: a model the loader reads (HF folder or .gguf) that drafts
    autoregressively instead (same tokenizer as the target).
    """

    drafter: str | None = None
    draft_model: str | None = None
    block_size: int | None = None  # None: the drafter's own block size
    tree: bool = False
    tree_budget: int = 16  # draft nodes per request when tree=True
    tree_topk: int = 2
    policy: str = "fixed"  # fixed | threshold | load-aware
    threshold: float = 0.5
    ngram_max: int = 4
    ngram_min: int = 1
    # neural drafters: a request whose last ngram_assist (up to ngram_max) tokens occurred earlier
    # in it verifies their continuation instead of a drafted block (0: never)
    ngram_assist: int = 2
    ngram_assist_max_len: int = 32  # a looked-up chain's longest (it grows while accepted whole)
    # draft models: a request's chain stops growing once the product of its drafted tokens'
    # probabilities (its survival estimate) falls below this (llama.cpp's --draft-p-min, on the
    # chain rather than one token); 0: every draft walks its whole block
    draft_p_min: float = 0.1

    def validate(self) -> None:
        if self.block_size is not None and not 1 <= self.block_size <= 32:
            raise ValueError(f"block_size must be in [1, 32], got {self.block_size}")
        if self.policy not in ("fixed", "threshold", "load-aware"):
            raise ValueError(f"unknown spec policy {self.policy!r}: choose fixed, threshold or load-aware")
        if not isinstance(self.threshold, (int, float)) or not 0.0 <= self.threshold <= 1.0:  # NaN fails too
            raise ValueError(f"threshold must be a confidence in [0, 1], got {self.threshold!r}")
        if not _is_token_id(self.ngram_assist):  # an integer >= 0
            raise ValueError(f"ngram_assist must be an integer >= 0, got {self.ngram_assist!r}")
        # 32 + the anchor is the longest chain the bf16 CPU attention verifies exactly (its bucket)
        if not _is_token_id(self.ngram_assist_max_len) or not 1 <= self.ngram_assist_max_len <= 32:
            raise ValueError(f"ngram_assist_max_len must be an integer in [1, 32], got {self.ngram_assist_max_len!r}")
        if self.tree_budget < 1 or self.tree_topk < 1:
            raise ValueError("tree_budget and tree_topk must be >= 1")
        if not isinstance(self.draft_p_min, (int, float)) or not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError(f"draft_p_min must be a probability in [0, 1), got {self.draft_p_min!r}")
        if self.draft_model is not None:
            if self.drafter is not None:
                raise ValueError("drafter and draft_model are exclusive: a draft model is the drafter")
            if not os.path.exists(self.draft_model):
                raise ValueError(f"draft model {self.draft_model!r} does not exist (an HF folder or a .gguf file)")
        if self.drafter not in (None, "none", "ngram") and not os.path.isdir(self.drafter):
            raise ValueError(f"drafter {self.drafter!r} is not a folder; use a drafter folder, 'ngram' or 'none'")


QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def check_quantization(mode: str) -> None:
    """ValueError naming the choices when ``mode`` is not one of them."""
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {mode!r}: choose {', '.join(QUANTIZATION_CHOICES)}")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (2-3x fp32 for the small batches of
    decoding); elsewhere torch emulates them and fp32 is faster."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch: no probe, stay on the safe side
        return False


# `dspark serve`'s default max_decode_stall_ms: a server's prompts arrive beside decoding requests,
# and a burst of them prefilled in one step stalls every running stream (docs/flags.md, *Batching*)
SERVE_DECODE_STALL_MS = 60.0


@dataclass
class EngineConfig:
    """What the engine runs and how much memory it may use."""

    model: str | None = None  # HF folder or .gguf; None: the default SmolLM2
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    quantization: str = "auto"  # decoder-layer weights: auto | none | int8 | int4 (models/quant.py)
    prefill_dense_copy: bool = False  # quantized linears keep a dense copy for prompt rows (models/quantize.py)
    # where prompt rows have a path of their own (the AMX prompt GEMM, a dense copy), prompts shorter
    # than this take the decode kernels instead: that path's fixed cost per pass (every weight
    # expanded) outweighs its faster rows for a short prompt or a thin chunk of one (0: every prompt
    # takes it). Decided per request, by its prompt's length, so its bits never depend on chunking
    prompt_gemm_min_tokens: int = 256
    device: str = "auto"
    attention_backend: str = "auto"  # auto | torch | flashinfer
    page_size: int = 16
    kv_cache_tokens: int = 65536  # token budget of the page pool
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int = 2048  # tokens per forward (prefill chunking)
    # while requests decode, prefill chunks are cut so that a step's target pass, as the measured
    # cost model predicts it, stays under this many ms (None: the token budget alone), or under
    # decode_stall_factor times what the decodes alone cost where that is more: under a load whose
    # decodes fill the bound, prompts still get that share of every step instead of starving
    max_decode_stall_ms: float | None = None  # `dspark serve`: SERVE_DECODE_STALL_MS
    decode_stall_factor: float = 2.0
    enforce_eager: bool = False  # no CUDA graphs (they need CUDA and the flashinfer backend)
    # share the KV pages of identical prompt prefixes (vLLM's); None: on wherever a prompt's K/V
    # do not depend on its chunking, so a cached prefix gives the bits a fresh one would (Engine)
    enable_prefix_caching: bool | None = None
    cuda_graph_batch_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, ... up to max_num_seqs
    seed: int = 0  # seeds the per-request seeds of requests that give none (reproducible runs, as vLLM)
    tensor_parallel_size: int = 1  # ranks the decoder layers are split over (dspark/dist/)
    chat_template: str | None = None  # a Jinja file or the template itself, over the tokenizer's (vLLM's)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid setting (before any weights load)."""
        for name in ("page_size", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one page "
                             f"({self.page_size} tokens)")
        gemm = self.prompt_gemm_min_tokens
        if not isinstance(gemm, int) or isinstance(gemm, bool) or gemm < 0:
            raise ValueError(f"prompt_gemm_min_tokens must be an integer >= 0, got {gemm!r}")
        stall = self.max_decode_stall_ms
        if stall is not None and (not isinstance(stall, (int, float)) or isinstance(stall, bool)
                                  or not 0 < stall < float("inf")):  # NaN fails too
            raise ValueError(f"max_decode_stall_ms must be a number of milliseconds > 0 (None: no bound), "
                             f"got {stall!r}")
        factor = self.decode_stall_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 1 <= factor < float("inf"):
            raise ValueError(f"decode_stall_factor must be a number >= 1, got {factor!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 (None: the model's), got {self.max_model_len!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}: choose torch, flashinfer or auto")
        if self.cuda_graph_batch_sizes is not None and any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be >= 1, got {self.cuda_graph_batch_sizes}")
        check_quantization(self.quantization)
        self.resolved_dtype()
        import torch

        try:
            torch.device(self.resolved_device())
        except RuntimeError as e:
            raise ValueError(f"unknown device {self.device!r}: {e}") from None
        if self.resolved_device().startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch build or machine has no CUDA device")
        self.spec.validate()
        if self.chat_template is not None:
            self.resolved_chat_template()
        if self.model is not None and not os.path.exists(os.path.expanduser(self.model)):
            raise ValueError(f"model path {self.model!r} does not exist; expected a Hugging Face folder "
                             "(config.json + *.safetensors) or a .gguf file")

    def resolved_chat_template(self) -> str | None:
        """chat_template's text: a file's contents when it names one, else the string itself when
        it is a template; ValueError for a missing file or a template Jinja cannot parse."""
        t = self.chat_template
        if t is None:
            return None
        path = os.path.expanduser(t)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                t = f.read()
        elif "{{" not in t and "{%" not in t:
            raise ValueError(f"chat_template {t!r} is neither a file nor a Jinja template")
        import jinja2

        try:  # compiled as transformers compiles it (its sandbox and extensions: {% break %}, ...)
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # another transformers: a bad template shows on the first chat request
            return t
        try:
            _compile_jinja_template(t)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template does not parse (line {e.lineno}): {e.message}") from None
        return t

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self):
        import torch

        if self.dtype == "auto":
            if self.resolved_device().startswith("cuda"):
                return torch.bfloat16
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose auto, fp32 (float32), bf16 (bfloat16) "
                             "or fp16 (float16)") from None
