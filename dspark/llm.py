"""Offline batch generation: `LLM(model=..., drafter=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.engine import Engine
from dspark.engine.sequence import RequestOutput


class LLM:
    """Generates for a list of prompts (strings, token id lists, or chat message lists)."""

    def __init__(self, model: str | None = None, drafter: str | None = None, **kwargs):
        spec_keys = {f.name for f in dataclasses.fields(SpecConfig)}
        spec = SpecConfig(drafter=drafter, **{k: kwargs.pop(k) for k in list(kwargs) if k in spec_keys})
        self.engine = Engine(EngineConfig(model=model, spec=spec, **kwargs))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                rid = f"offline-{id(self)}-{i}"
                self.engine.add_request(rid, prompt, dataclasses.replace(p))
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            self.engine.step()  # drain the aborted outputs
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]
