"""The engine: one step of work on one batch, with continuous batching.

Each step (1) admits and schedules work under a token and page budget,
(2) asks the drafter for proposals for every decoding request, (3) lets the
policy choose how many draft tokens to verify, (4) runs one target forward
over the ragged batch (prefill chunks + [anchor, drafts] chains), (5) accepts
losslessly and commits, rolling back the caches to the accepted length.
With no drafter the chains are just [anchor]: plain decoding.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time

import torch

from dspark.config import EngineConfig, SamplingParams, field_error
from dspark.dist.workers import start_tensor_parallel
from dspark.engine import profile
from dspark.engine.attention import exact_prompt_chunks, make_backend
from dspark.engine.batch_planner import BatchPlanner
from dspark.engine.cuda_graphs import SCRATCH_TOKENS, install_graphs
from dspark.engine.detokenizer import decode_new_text, find_stop
from dspark.engine.kv_cache import KVCache, PagePool
from dspark.engine.logprobs import attach_logprobs, attach_prompt_logprobs
from dspark.engine.model_runner import ModelRunner
from dspark.engine.policy import CostModel
from dspark.engine.prompts import ChatPrompt, bad_word_token_ids, encode_prompt
from dspark.engine.proposal import Proposal, TargetView
from dspark.engine.proposers import make_spec_runner
from dspark.engine.sequence import RequestOutput, Sequence, SpecStats, Status
from dspark.engine.structured import GrammarCache
from dspark.engine.verify import Work, accept, layout
from dspark.models.loader import load_model, load_tokenizer, resolve_model_folder
from dspark.models.quantize import has_prompt_path, return_freed_heap

logger = logging.getLogger(__name__)


class Engine:
    """Owns the model, the caches and the requests; `step()` advances every running request."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = torch.device(config.resolved_device())
        self.dtype = config.resolved_dtype()
        page_size = config.page_size
        num_pages = max(1, config.kv_cache_tokens // page_size)
        self.pool = PagePool(num_pages, page_size)
        # a few pages past the pool's own: the padding requests of CUDA graphs write there
        self.scratch_pages = list(range(num_pages, num_pages + -(-SCRATCH_TOKENS // page_size)))
        self.kv_pages = num_pages + len(self.scratch_pages)
        self.workers = None  # tensor-parallel ranks 1..N-1
        if config.tensor_parallel_size > 1:
            self.model_path = resolve_model_folder(config.model)
            self.workers, self.model, kv, self.attn, vocab = start_tensor_parallel(
                config, self.model_path, self.device, self.dtype, self.kv_pages)
        else:
            self.model, self.model_path = load_model(config.model, self.device, self.dtype, config.quantization,
                                                         config.prefill_dense_copy)
            mc = self.model.config
            kv = KVCache(mc.num_hidden_layers, self.kv_pages, page_size, mc.num_key_value_heads,
                         mc.head_dim, self.dtype, self.device)
            self.attn = make_backend(config.attention_backend, self.device)
            vocab = self.model
        self.model_config = mc = self.model.config
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.quantization = self.model.quantization
        self.tokenizer = load_tokenizer(self.model_path, config.resolved_chat_template())
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        eos = set(mc.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.runner = ModelRunner(self.model, self.pool, kv, self.attn, self.device, self.workers)
        self.spec_stats = SpecStats()  # engine-wide totals
        # proposers see the target's whole vocabulary (under tensor parallelism a full copy on rank 0)
        target = TargetView(vocab, self.pool, self.kv_pages, self.device, self.dtype, config.attention_backend,
                            self.runner.batch_layout, self.tokenizer, config.quantization)
        self.spec = make_spec_runner(config.spec, target, self.spec_stats, self.max_model_len,
                                     default_model=config.model is None)
        self._fit_context(num_pages * page_size)
        self.spec.max_model_len = self.max_model_len
        caching = config.enable_prefix_caching
        if caching is None:
            caching = exact_prompt_chunks(self.model, self.attn, self.device, self.workers)
            logger.info("prefix caching %s", "on: prompt chunks get the same bits however they are cut"
                        if caching else "off: this build's prompt path sums by chunk")
        self.pool.prefix_caching = self.spec.shared_prefixes = caching
        # whether prompt rows have a kernel of their own here, which short prompts skip (add_request)
        self.prompt_kernel_differs = self.device.type == "cpu" and has_prompt_path(self.model)
        if not config.enforce_eager and self.device.type == "cuda" and self.attn.name == "flashinfer" \
                and self.workers is None:
            self.enable_graphs(capture=True)
        # a target pass's seconds by its tokens, measured once complete (CUDA graphs change them):
        # one model for the load-aware policy and the decode-stall bound, learning from real steps
        self.cost: CostModel | None = None
        self.spec.calibrate(self._cost_model)
        if config.max_decode_stall_ms is not None:
            self._cost_model()
        self.planner = BatchPlanner(config, self.pool, self.spec, self.cost)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)  # for requests without their own seed
        self._grammars: GrammarCache | None = None  # compiled on the first structured-output request
        self.draft_time = 0.0  # wall seconds spent in the drafter's proposals (bench: draft_share)
        self._finished_pending: list[Sequence] = []
        return_freed_heap()

    def _cost_model(self) -> CostModel:
        if self.cost is None:
            self.cost = profile.load_or_measure(self)
        return self.cost

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _fit_context(self, pool_tokens: int) -> None:
        """One request must fit the page pool alone, or the scheduler would preempt it forever:
        an asked-for context that does not fit is refused, the model's own is shortened."""
        headroom = self.spec.context_headroom()
        fit = pool_tokens - headroom
        if self.max_model_len <= fit:
            return
        if self.config.max_model_len is not None:
            raise ValueError(f"max_model_len {self.max_model_len} needs a KV cache of at least "
                             f"{self.max_model_len + headroom} tokens; kv_cache_tokens "
                             f"gives {pool_tokens}: raise it or lower max_model_len")
        if fit < 2:
            raise ValueError(f"kv_cache_tokens gives {pool_tokens} tokens, too few for any request")
        logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d to %d",
                       pool_tokens, self.max_model_len, fit)
        self.max_model_len = fit

    def enable_graphs(self, capture: bool = True) -> None:
        """Serve uniform forwards from padded CUDA graphs (cuda_graphs.install_graphs)."""
        install_graphs(self, capture)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int] | list[dict] | ChatPrompt,
                    params: SamplingParams | None = None, spec: bool = True,
                    block_size: int | None = None) -> Sequence:
        """Queue a request: a prompt string, token ids, or chat messages."""
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:  # LLM.generate and the HTTP API fan a request out into n of these
            raise field_error(f"the engine runs one sample per request, got n={params.n}; "
                              "add n requests with params.choice(i)", "n")
        error = self.spec.block_size_error(block_size)
        if error is not None:
            raise ValueError(error)
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.prompt_ids(prompt, params)
        if not ids:
            raise field_error("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise field_error(f"the prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                              "tokens and needs room for at least one generated token", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_token_ids() if t >= vocab), None)
        if bad is not None:
            field = "logit_bias" if bad in (params.logit_bias or {}) else "allowed_token_ids"
            raise field_error(f"token id {bad} in {field} is outside the vocabulary (size {vocab})", field)
        if params.max_tokens is None:  # up to the context (the server resolves it before it gets here)
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        seeded = params.seed is not None and not params.greedy
        gen = None if params.greedy or seeded else torch.Generator().manual_seed(self._seeds.getrandbits(62))
        early = frozenset(self.eos_ids | set(params.stop_token_ids)) if params.min_tokens else frozenset()
        if params.allowed_token_ids is not None and early.issuperset(params.allowed_token_ids):
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens bans: nothing could be "
                             "generated")
        seq = Sequence(seq_id=next(self._ids), request_id=request_id, prompt_ids=ids, params=params,
                       generator=gen, seed=params.seed if seeded else None,
                       eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
                       early_stop_ids=early, spec_enabled=spec, block_size=block_size,
                       prompt_on_decode_kernels=self.prompt_on_decode_kernels(len(ids)))
        if params.structured_outputs is not None:
            seq.grammar = self.grammars().matcher(params.structured_outputs)
        seq.bad_word_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        self.seqs[request_id] = seq
        self.planner.waiting.append(seq)
        return seq

    def prompt_on_decode_kernels(self, prompt_tokens: int) -> bool:
        """Whether a prompt of this many tokens runs its rows on the decode kernels rather than
        the CPU's prompt path (EngineConfig.prompt_gemm_min_tokens)."""
        return self.prompt_kernel_differs and prompt_tokens < self.config.prompt_gemm_min_tokens

    def grammars(self) -> GrammarCache:
        """The compiled structured-output constraints (built, with xgrammar, on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def encode(self, prompt: str | list[int] | list[dict] | ChatPrompt) -> list[int]:
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def prompt_ids(self, prompt: str | list[int] | list[dict] | ChatPrompt, params: SamplingParams) -> list[int]:
        """The token ids the engine runs for a prompt: encoded, then truncated as the request asks."""
        ids = self.encode(prompt)
        k = params.truncate_prompt_tokens
        return ids if k is None else ids[-k:]

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its pages at once; False if it is unknown or finished."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting(self) -> list[Sequence]:
        return self.planner.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.planner.running

    @property
    def num_preemptions(self) -> int:
        return self.planner.num_preemptions

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one forward over everything schedulable; return outputs of touched requests."""
        # whether this step drafts is known before it is planned: a paused step reserves no draft slots
        self.spec.begin_step([s for s in self.planner.running if not s.in_prefill],
                             prompts_waiting=self.planner.prompts_waiting)
        decode, prefill = self.planner.plan()
        if not decode and not prefill:
            return self._drain_finished([])
        t0 = time.perf_counter()
        # a step without decodes still proposes (nothing), so no runner keeps the last step's state
        proposals = self.spec.propose(decode, sum(n for _, n in prefill), self.planner.draft_allowance)
        t_draft = time.perf_counter() - t0
        self.draft_time += t_draft
        works = []
        for seq in decode:
            prop = proposals.get(seq.seq_id) or Proposal([])
            body = prop.tree.tokens if prop.tree is not None else prop.tokens
            works.append(Work(seq, "decode", [seq.output_ids[-1]] + body, list(prop.tokens), prop.tree,
                              samples=True, q=prop.q, num_proposed=prop.num_proposed, looked_up=prop.looked_up))
        for seq, n in prefill:
            final = seq.num_cached + n == seq.prefill_target and not seq.output_ids
            works.append(Work(seq, "prefill", seq.all_ids[seq.num_cached:seq.num_cached + n], samples=final))
        items, rows, mask, masks, positions = layout(works)
        capture = self.spec.capture_for([w.seq for w in works])
        result = self.runner.forward(items, rows, capture=capture, mask=mask,
                                     custom_masks=masks, positions=positions,
                                     prompt_rows=[w.prompt_rows for w in works])
        accept(works, result.logits)
        attach_logprobs(works, result.logits)
        attach_prompt_logprobs(works, result.hidden, self.runner)
        generated = self.spec_stats.generated  # _commit adds the decode rows' committed tokens
        touched = self._commit(works, result)
        seconds = time.perf_counter() - t0 - t_draft  # the acceptance read the logits: the pass has finished
        if not prefill:
            self.spec.observe_step(len(rows), seconds)  # the policy's cost model, if it prices steps
            self.spec.observe_outcome(len(decode), self.spec_stats.generated - generated, seconds + t_draft)
            if self.cost is not None and self.cost is not getattr(self.spec.policy, "cost", None):
                self.cost.observe(len(rows), seconds)  # the stall bound's alone
        elif decode:  # prompt tokens beside decodes: the passes the decode-stall bound prices
            self.planner.observe_prefill_step(sum(len(w.tokens) for w in works), seconds)
        return self._drain_finished(touched)

    def _commit(self, works: list[Work], result) -> list[Sequence]:
        """Append accepted tokens, keep the accepted positions' K/V, feed the drafter's context."""
        for w in works:
            if w.new_tokens:
                committed = self._append_tokens(w.seq, w.new_tokens, w.logprobs)
                if w.kind == "decode":
                    # a stop cuts the step short: count only what was committed, so that
                    # generated == steps + accepted and tau and the acceptance metrics agree
                    a = min(len(w.kept_rows), committed) - 1
                    for st in (w.seq.stats, self.spec_stats):
                        st.record(w.num_proposed, w.num_verified, a, committed, w.looked_up)
        ctx_rows = []
        for w in works:
            seq, start = w.seq, w.seq.num_cached
            keep = len(w.kept_rows)
            if not seq.is_finished and w.kept_rows != list(range(keep)):
                self._compact(seq, start, w.kept_rows)
            ctx_rows.append((seq, start, [w.first_row + r for r in w.kept_rows]))
            seq.num_cached += keep
        self.spec.commit(ctx_rows, result)
        # a shared page shares the drafter's context at its slots too: under prefix caching prompt
        # positions enter the drafter's cache at once, even while drafting pauses (SpecRunner.commit)
        share = self.pool.prefix_caching
        for w in works:
            if not w.seq.is_finished:
                self.pool.truncate(w.seq.seq_id, w.seq.num_cached)
                self.pool.tables[w.seq.seq_id].num_tokens = w.seq.num_cached
                if share:  # prompt pages only: see PagePool.register
                    self.pool.register(w.seq.seq_id, w.seq.token_range,
                                       min(w.seq.num_cached, len(w.seq.prompt_ids)), w.seq.prefix_salt)
        return [w.seq for w in works]

    def _compact(self, seq: Sequence, start: int, kept: list[int]) -> None:
        """Move the accepted tree path's K/V to consecutive positions after the anchor."""
        src = torch.tensor(self.pool.slots_at(seq.seq_id, [start + r for r in kept]), device=self.device)
        dst = torch.tensor(self.pool.slots(seq.seq_id, start, start + len(kept)), device=self.device)
        self.runner.copy_slots(src, dst)

    def _append_tokens(self, seq: Sequence, new: list[int], logprobs: list | None = None) -> int:
        """Commit sampled tokens (and their logprobs), stopping exactly where plain decoding would."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        p = seq.params
        count, stop_token = 0, False
        for tok in new:
            seq.output_ids.append(tok)
            if seq.grammar is not None:  # masked rows only offer what it accepts
                seq.grammar.accept_token(tok)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[count])
            count += 1
            if tok in seq.eos_ids or tok in p.stop_token_ids:
                seq.finish_reason, stop_token = "stop", True
                seq.stop_reason = None if tok in seq.eos_ids else tok  # vLLM: None for EOS
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if p.stop:  # token by token, so the output ends at the token that completes a stop string
                self._append_text(seq, stop_token)
            if seq.finish_reason:
                break
        if not p.stop:
            self._append_text(seq, stop_token)
        if seq.finish_reason:
            self._finish(seq, seq.finish_reason)
        return count

    def _append_text(self, seq: Sequence, stop_token: bool = False) -> None:
        """Detokenize the tokens appended since the last call; a stop string cuts the text and
        finishes the request. A stop token (EOS or stop_token_ids) stays in the token ids but not
        in the text, as in vLLM."""
        end = len(seq.output_ids) - 1 if stop_token and not seq.params.include_stop_str_in_output else None
        delta = decode_new_text(self.tokenizer, seq, flush=seq.finish_reason is not None, end=end)
        seq.text += delta
        if seq.params.stop and delta and len(seq.output_ids) > seq.params.min_tokens:  # as vLLM
            cut, which = find_stop(seq.text, seq.params.stop, len(delta))
            if cut != -1:
                seq.text = seq.text[:cut + len(which) if seq.params.include_stop_str_in_output else cut]
                seq.finish_reason, seq.stop_reason = "stop", which

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        seq.finish_time = time.perf_counter()
        self.pool.free(seq.seq_id)
        self.planner.drop(seq)
        self.spec.release(seq.seq_id)
        self._finished_pending.append(seq)

    def _drain_finished(self, touched: list[Sequence]) -> list[RequestOutput]:
        pending, self._finished_pending = self._finished_pending, []
        seen, outs = set(), []
        for seq in touched + pending:
            if seq.seq_id in seen:
                continue
            seen.add(seq.seq_id)
            outs.append(seq.take_output())
            if seq.is_finished:
                self.seqs.pop(seq.request_id, None)
        return outs
