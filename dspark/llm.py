"""Offline batch generation: `LLM(model=..., drafter=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.engine import Engine
from dspark.engine.prompts import ChatPrompt
from dspark.engine.sequence import RequestOutput


def _is_chat(x: Any) -> bool:
    """A conversation: a non-empty list of message dicts (each with a role)."""
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and isinstance(x[0], int)


def _one_prompt(p: Any) -> str | list[int] | list[dict]:
    """vLLM's prompt forms for one request: a string, token ids, {"prompt": str},
    {"prompt_token_ids": ids}, or (ours) a conversation, as messages or a ChatPrompt."""
    if isinstance(p, dict):
        if set(p) == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if set(p) == {"prompt_token_ids"} and isinstance(p["prompt_token_ids"], list):
            return p["prompt_token_ids"]
        raise TypeError(f"a prompt dict takes only 'prompt' (a string) or 'prompt_token_ids' (a list), "
                        f"got keys {sorted(p)}")
    return p


def _prompt_list(prompts: Any) -> list:
    """One prompt or a list of them -> a list of prompts."""
    single = isinstance(prompts, (str, dict, ChatPrompt)) or _is_chat(prompts) or _is_token_ids(prompts)
    return [_one_prompt(prompts)] if single else [_one_prompt(p) for p in prompts]


class LLM:
    """Generates for a list of prompts (strings, token id lists, vLLM's prompt dicts, or
    conversations given as lists of chat messages)."""

    def __init__(self, model: str | None = None, drafter: str | None = None, **kwargs):
        # as `dspark serve`, `generate` and `bench`: verify only what pays at the measured cost,
        # so the Python API never runs slower than plain decoding where `dspark serve` would not
        kwargs.setdefault("policy", "load-aware")
        spec_keys = {f.name for f in dataclasses.fields(SpecConfig)}
        spec = SpecConfig(drafter=drafter, **{k: kwargs.pop(k) for k in list(kwargs) if k in spec_keys})
        self._attach(Engine(EngineConfig(model=model, spec=spec, **kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._attach(Engine(config))
        return llm

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        """The tokenizer requests are encoded with (vLLM's LLM.get_tokenizer)."""
        return self.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (they also end with the process)."""
        self.engine.close()

    def _attach(self, engine: Engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        self._calls = itertools.count()  # numbers each generate() call: request ids never repeat

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order, holding SamplingParams.n samples. If
        anything fails or is interrupted (Ctrl-C) on the way, this call's requests are aborted, so
        the engine is left clean."""
        prompts = _prompt_list(prompts)
        sp = sampling_params
        params_list = list(sp) if isinstance(sp, (list, tuple)) else [sp or SamplingParams()] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params_list):
            raise TypeError("sampling_params takes a SamplingParams or a list of them, one per prompt")
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        for p in params_list:
            p.validate()  # a field changed after construction (n above all) fails before anything is queued
        call = next(self._calls)
        ids: list[str] = []  # every sample's request id, prompt by prompt
        done: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                for j in range(p.n):
                    rid = f"offline-{call}-{i}" + (f"-{j}" if j else "")
                    self.engine.add_request(rid, prompt, p.choice(j))
                    ids.append(rid)
            mine = set(ids)
            from tqdm import tqdm

            with tqdm(total=len(ids), desc="generating", unit="sample", disable=not use_tqdm) as bar:
                while len(done) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in mine:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)  # frees its pages at once
            # drain their outputs now; if the engine itself is failing, a later step drains them
            # (request ids are unique per call, so they never clash with the next call's)
            with contextlib.suppress(Exception):
                self.engine.step()
            raise
        outs = iter(done[r] for r in ids)
        return [self._joined(prompt, [next(outs) for _ in range(p.n)]) for prompt, p in zip(prompts, params_list)]

    def _joined(self, prompt: Any, outs: list[RequestOutput]) -> RequestOutput:
        """A prompt's samples as one RequestOutput (the first's fields, every sample in outputs),
        with the prompt's text as vLLM gives it: as passed, or as the chat template wrote it."""
        first = outs[0]
        if isinstance(prompt, str):
            text = prompt
        elif _is_token_ids(prompt):
            text = None
        else:
            text = self.tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False)
        samples = [o.as_completion(j) for j, o in enumerate(outs)] if len(outs) > 1 else None
        return dataclasses.replace(first, prompt=text, samples=samples)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """generate() for one conversation or a list of them, through the model's chat template,
        with vLLM's template options: add_generation_prompt opens the assistant's turn,
        continue_final_message continues the last (assistant) message instead, chat_template_kwargs
        are extra template variables and tools the function definitions the template shows."""
        convs = [messages] if _is_chat(messages) else list(messages)
        if not all(_is_chat(c) for c in convs):
            raise TypeError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of them")
        prompts = [ChatPrompt(c, add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {}),
                              tools) for c in convs]
        for p in prompts:
            p.validate()  # before any request is queued
        return self.generate(prompts, sampling_params, use_tqdm)
