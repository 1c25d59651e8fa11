"""Structured outputs through xgrammar: a compiled grammar per constraint (cached), a matcher per
request that advances with its committed tokens, and token masks for every verified row.

A row's mask is the matcher's state after the drafts on the way to that row (a chain's first i
drafts, a tree node's path): the drafts are accepted tentatively and rolled back, so verification
accepts exactly what plain constrained decoding could have produced. A draft the grammar refuses
ends its chain's masks there (the target never accepts it, so later rows go unused)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

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

    def compile(self, spec: StructuredOutputs):  # noqa: ANN201 - an xgrammar CompiledGrammar
        """The constraint compiled, once per distinct constraint. Thread-safe: the server compiles
        in a worker thread before admission, so a large schema never stalls the engine's steps."""
        grammar = self._cache.get(spec)
        if grammar is None:
            grammar = self._cache[spec] = self._compile(spec)
        return grammar

    def matcher(self, spec: StructuredOutputs):  # noqa: ANN201 - an xgrammar GrammarMatcher
        """A fresh matcher for the constraint (rollback is unbounded: drafts are tried, then undone)."""
        return self.xgr.GrammarMatcher(self.compile(spec))

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


@contextmanager
def tentatively(matcher, tokens: list[int]) -> Iterator[bool]:  # noqa: ANN001 - a GrammarMatcher
    """Accept tokens into the matcher for the block, then roll them back whatever happens. Yields
    whether the grammar took them all and is still open: after a refused token, or after an EOS
    that ends the grammar, nothing can follow."""
    taken = 0
    try:
        for tok in tokens:
            if not matcher.accept_token(tok):
                break
            taken += 1
        yield taken == len(tokens) and not matcher.is_terminated()
    finally:
        if taken:
            matcher.rollback(taken)


def mask_rows(matcher, rows: torch.Tensor, prefixes: list[list[int]]) -> None:  # noqa: ANN001 - a GrammarMatcher
    """Set every token the grammar refuses to -inf in each row (in place); prefixes[i]: the
    drafts before row i, accepted tentatively."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(prefixes), rows.shape[-1])
    for i, prefix in enumerate(prefixes):  # prefixes[0] is empty: the request's own state
        with tentatively(matcher, prefix) as open_:
            if open_:
                matcher.fill_next_token_bitmask(bitmask, i)
            else:  # the row is never read: acceptance stops before it, or the request ends at the EOS
                bitmask[i] = bitmask[0]
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device))


def allowed_tokens(matcher, vocab: int) -> torch.Tensor:  # noqa: ANN001 - a GrammarMatcher
    """[vocab] bool: the tokens the matcher accepts next (bit i % 32 of word i // 32)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def draftable(matcher, vocab: int, to_target: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The drafter's columns (logits [V or draft V]) that the grammar admits next and the drafter
    can propose: a sampled row spans the target vocabulary, yet its head fills only its own."""
    allowed = allowed_tokens(matcher, vocab).to(logits.device)  # the bitmask is on the CPU
    if to_target is not None:
        allowed = allowed[to_target]
    return allowed & torch.isfinite(logits)


class DraftConstraint:
    """Keeps a batch's chain drafts inside their requests' grammars while they are proposed: the
    logits of each position are masked from the grammar's state after the drafts so far (accepted
    tentatively), a row stops drafting where its grammar admits nothing the drafter can propose
    (or has ended), and every matcher is rolled back at the end. Only acceptance changes: the
    target's rows are masked anyway, so a refused draft would merely be rejected."""

    def __init__(self, matchers: list, vocab: int, to_target: torch.Tensor | None):
        self.matchers, self.vocab, self.to_target = matchers, vocab, to_target
        self.stop: list[int | None] = [None] * len(matchers)  # drafts kept per row (None: all)
        self.taken = [0] * len(matchers)

    def _live(self) -> list[int]:
        return [r for r, m in enumerate(self.matchers) if m is not None and self.stop[r] is None]

    def mask(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Position k's logits [R, V or draft V] with what each live row's grammar refuses at -inf."""
        for r in self._live():
            m = self.matchers[r]
            allowed = None if m.is_terminated() else draftable(m, self.vocab, self.to_target, logits[r])
            if allowed is None or not bool(allowed.any()):
                self.stop[r] = k
            else:
                logits[r].masked_fill_(~allowed, float("-inf"))
        return logits

    def advance(self, tokens: torch.Tensor, k: int) -> None:
        """The tokens proposed at position k (target ids), taken into each live row's grammar."""
        ids = tokens.tolist()
        for r in self._live():
            if self.matchers[r].accept_token(ids[r]):
                self.taken[r] += 1
            else:
                self.stop[r] = k

    def finish(self) -> list[int | None]:
        """Roll every matcher back to its request's state; the drafts each row keeps."""
        for m, n in zip(self.matchers, self.taken):
            if n:
                m.rollback(n)
        return self.stop


class TreeConstraint:
    """Keeps a batch's draft trees inside their requests' grammars: each node's children are
    masked to what the grammar admits after the node's path (accepted tentatively); a node whose
    grammar admits nothing the drafter can propose (or has ended) is dead, and build_trees drops
    its children."""

    def __init__(self, matchers: list, vocab: int, to_target: torch.Tensor | None):
        self.matchers, self.vocab, self.to_target = matchers, vocab, to_target

    def mask_layer(self, logits: torch.Tensor, paths: list[list[list[int]]],
                   alive: list[list[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [R, W, V or draft V] of one layer's nodes -> (masked copy, dead [R, W]); nodes
        not alive (their joint probability already 0: padding, children of dead nodes) stay dead
        without consulting the grammar."""
        logits = logits.clone()  # often an expanded view of one row per request
        dead = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
        for r, m in enumerate(self.matchers):
            for w, path in enumerate(paths[r] if m is not None else ()):
                allowed = None
                if alive[r][w]:
                    with tentatively(m, path) as open_:
                        if open_:
                            allowed = draftable(m, self.vocab, self.to_target, logits[r, w])
                if allowed is None or not bool(allowed.any()):
                    dead[r, w] = True
                else:
                    logits[r, w].masked_fill_(~allowed, float("-inf"))
        return logits, dead
