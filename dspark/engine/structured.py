"""Structured outputs through xgrammar: a compiled grammar per constraint (cached), a matcher per
request that advances with its committed tokens, and token masks for every verified row.

A row's mask is the matcher's state after the drafts on the way to that row (a chain's first i
drafts, a tree node's path): the drafts are accepted tentatively and rolled back, so verification
accepts exactly what plain constrained decoding could have produced. A draft the grammar refuses
ends its chain's masks there (the target never accepts it, so later rows go unused)."""

from __future__ import annotations

import json
import re

import torch

from dspark.config import StructuredOutputs


class StructuredOutputError(ValueError):
    """A constraint that does not compile; `param` names its request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarCache:
    """Compiles constraints for one tokenizer (xgrammar imported on first use) and caches them."""

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import xgrammar as xgr
        except ImportError as e:  # an install without it: a clear error per request, not at start-up
            raise StructuredOutputError(f"structured outputs need the xgrammar package: {e}",
                                        "structured_outputs") from None
        self.xgr, self.vocab_size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[StructuredOutputs, object] = {}

    def matcher(self, spec: StructuredOutputs):  # noqa: ANN201 - an xgrammar GrammarMatcher
        """A fresh matcher for the constraint (compiled once per distinct constraint)."""
        grammar = self._cache.get(spec)
        if grammar is None:
            grammar = self._cache[spec] = self._compile(spec)
        return self.xgr.GrammarMatcher(grammar)  # rollback is unbounded: drafts are tried, then undone

    def _compile(self, spec: StructuredOutputs):  # noqa: ANN202
        c = self.compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json)
            if spec.json_object:
                return c.compile_builtin_json_grammar()
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:  # a regex of the escaped alternatives
                return c.compile_regex("(" + "|".join(_escape(x) for x in spec.choice) + ")")
            return c.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar's parse errors, without their C++ source location
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e)).strip()
            raise StructuredOutputError(f"{spec.field}: {message}", spec.field) from None


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)


def schema_text(schema: object) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def mask_rows(matcher, rows: torch.Tensor, prefixes: list[list[int]]) -> None:  # noqa: ANN001 - a GrammarMatcher
    """Set every token the grammar refuses to -inf in each row (in place); prefixes[i]: the
    drafts before row i, accepted tentatively and rolled back."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(prefixes), rows.shape[-1])
    for i, prefix in enumerate(prefixes):  # prefixes[0] is empty: the request's own state
        taken = 0
        try:
            for tok in prefix:
                if not matcher.accept_token(tok):
                    break
                taken += 1
            # after a refused draft, or after an accepted EOS that ends the grammar, the row is
            # never read: acceptance stops before it, or the request ends at the EOS
            if taken == len(prefix) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i] = bitmask[0]
        finally:
            if taken:
                matcher.rollback(taken)
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device))
