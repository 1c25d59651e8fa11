"""One request's state inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dspark.config import SamplingParams


class Status(enum.Enum):
    """Where a sequence is in its life: queued, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters: one step = one target pass for this request."""

    steps: int = 0
    proposed: int = 0  # draft tokens the drafter produced
    verified: int = 0  # draft tokens the policy sent to the target
    accepted: int = 0  # draft tokens the target kept and the request committed (not past a stop)
    generated: int = 0  # tokens committed by decode steps (accepted + corrections/bonuses)
    lookup_steps: int = 0  # steps that verified a looked-up chain (the n-gram assist) instead
    lookup_accepted: int = 0  # ... and the tokens accepted from those chains
    accepted_per_pos: list[int] = field(default_factory=list)
    verified_per_pos: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens committed per target pass (accepted + 1 on average)."""
        return self.generated / self.steps if self.steps else 0.0

    def record(self, proposed: int, verified: int, accepted: int, committed: int, looked_up: bool = False) -> None:
        self.steps += 1
        if looked_up:
            self.lookup_steps += 1
            self.lookup_accepted += accepted
        self.proposed += proposed
        self.verified += verified
        self.accepted += accepted
        self.generated += committed
        for pos in range(verified):
            if pos >= len(self.verified_per_pos):
                self.verified_per_pos.append(0)
                self.accepted_per_pos.append(0)
            self.verified_per_pos[pos] += 1
            self.accepted_per_pos[pos] += pos < accepted

    def add(self, other: SpecStats) -> None:
        """Fold another request's counters into these."""
        self.steps += other.steps
        self.proposed += other.proposed
        self.verified += other.verified
        self.accepted += other.accepted
        self.generated += other.generated
        self.lookup_steps += other.lookup_steps
        self.lookup_accepted += other.lookup_accepted
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos),
                             (self.verified_per_pos, other.verified_per_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for pos, v in enumerate(theirs):
                mine[pos] += v

    def as_dict(self) -> dict:
        return {"steps": self.steps, "proposed": self.proposed, "verified": self.verified,
                "accepted": self.accepted, "tau": round(self.tau, 4),
                "lookup_steps": self.lookup_steps, "lookup_accepted": self.lookup_accepted,
                "accepted_per_pos": list(self.accepted_per_pos),
                "verified_per_pos": list(self.verified_per_pos)}


@dataclass(eq=False)  # identity: queues look requests up by object, and field-wise equality is O(fields)
class Sequence:
    """A request as the engine tracks it. The last output token is the "anchor": sampled
    but not yet run through the target, so num_cached == len(all_ids) - 1 while decoding."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # an unseeded sampled request's randomness
    eos_ids: frozenset[int]
    # a seeded sampled request's: each output position's noise comes from (seed, position)
    seed: int | None = None
    # banned before min_tokens: the model's EOS (even with ignore_eos, as vLLM) and the stop token ids
    early_stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # logprobs.TokenLogprob per output token, when asked
    prompt_logprobs: list = field(default_factory=list)  # None, then a TokenLogprob per prompt token, when asked
    num_cached: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched (vLLM's)
    text: str = ""
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # incremental detokenizer offsets into output_ids
    prefix_offset: int = 0
    read_offset: int = 0
    reported_tokens: int = 0
    reported_chars: int = 0
    spec_enabled: bool = True
    block_size: int | None = None
    plain_step: bool = False  # this step decodes without drafts: free pages could not hold its drafts
    # its prompt rows take the decode kernels, not the CPU's prompt path (a short prompt:
    # EngineConfig.prompt_gemm_min_tokens); its cached pages are kept apart (prefix_salt)
    prompt_on_decode_kernels: bool = False
    grammar: object | None = None  # structured outputs: an xgrammar matcher at the committed output
    bad_word_ids: list[list[int]] = field(default_factory=list)  # bad_words as token sequences
    logit_offset: object | None = None  # logit_bias and allowed_token_ids as one row added to the logits

    @property
    def prefix_salt(self) -> bytes:
        """Where its prompt pages are cached: prompt rows computed by the decode kernels and by the
        prompt path hold different bits, so neither kind's pages may answer the other's prefix."""
        return b"decode-kernels" if self.prompt_on_decode_kernels else b""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        """len(all_ids) without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to cache before decoding can start (all but the anchor)."""
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target or not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def take_output(self) -> RequestOutput:
        """What is new since the last call (tokens and text), plus the totals so far."""
        # hold back text that could still turn out to start a stop string
        hold = 0 if self.is_finished else max((len(s) - 1 for s in self.params.stop), default=0)
        shown = max(self.reported_chars, len(self.text) - hold)
        new_ids = self.output_ids[self.reported_tokens:]
        new_text = self.text[self.reported_chars:shown]
        self.reported_tokens, self.reported_chars = len(self.output_ids), shown
        ttft = self.first_token_time - self.arrival_time if self.first_token_time else None
        end = self.finish_time or time.perf_counter()
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_ids, token_ids=list(self.output_ids),
            text=self.text, new_token_ids=new_ids, new_text=new_text, finished=self.is_finished,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, stats=self.stats, ttft=ttft,
            decode_time=end - self.first_token_time if self.first_token_time else None,
            num_preemptions=self.num_preemptions,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
            # complete once the prompt is prefilled, which is before any output
            prompt_logprobs=self.prompt_logprobs if self.params.prompt_logprobs is not None else None)


@dataclass
class CompletionOutput:
    """One generated sample in vLLM's shape (an item of RequestOutput.outputs)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the sampled tokens' logprobs, when logprobs were asked
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one engine step produced for one request. The flat fields (text, token_ids, ...) are
    its first sample's; `outputs` lists every sample as vLLM's RequestOutput does."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stats: SpecStats
    stop_reason: int | str | None = None
    ttft: float | None = None  # seconds from arrival to the first token
    decode_time: float | None = None  # seconds from the first token to the last
    num_preemptions: int = 0
    logprobs: list | None = None  # logprobs.TokenLogprob per token of token_ids, when the request asked
    prompt_logprobs: list | None = None  # None, then a TokenLogprob per later prompt token, when asked
    prompt: str | None = None  # the prompt's text (LLM.generate fills it; None for token ids, as vLLM)
    samples: list[CompletionOutput] | None = None  # n > 1 (LLM.generate): every sample, the first as above

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The generated samples, vLLM's `outputs` (one unless SamplingParams.n > 1)."""
        return self.samples if self.samples is not None else [self.as_completion(0)]

    def as_completion(self, index: int) -> CompletionOutput:
        """This request's sample as the index-th CompletionOutput."""
        cumulative = sum(t.logprob for t in self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(index, self.text, self.token_ids, cumulative, self.logprobs, self.finish_reason,
                                self.stop_reason)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_time if self.decode_time and n > 0 else 0.0
