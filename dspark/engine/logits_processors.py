"""Per-request changes to the target's logits before acceptance: min_tokens, the penalties,
logit_bias, allowed_token_ids and structured outputs (structured.py).

Each verified row predicts one output position. What comes before that position is the
request's prompt and output so far plus the drafts on the way from the anchor to the row (a
chain's first i drafts; a tree node's ancestors and the node itself). Processing every row with
exactly that context makes verification accept from the same processed distribution that plain
decoding samples from, so speculation stays lossless with respect to it. The raw logits are left
as they are (a copy is processed): logprobs report them, as vLLM's do by default.

Penalties follow vLLM: repetition (HF's: a seen token's positive logit divided by it, a negative
one multiplied) over prompt and output; frequency (times the count) and presence (once) over
the output only. Then the logit bias is added, tokens outside allowed_token_ids are masked, and
so is the last token of any bad word the output would complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dspark.engine.structured import mask_rows

if TYPE_CHECKING:  # verify.py imports this module
    from dspark.engine.verify import Work


def row_prefixes(w: Work, n: int) -> list[list[int]]:
    """For each of the work's n logit rows, the drafts between the request's output and the token
    that row predicts."""
    if w.kind == "prefill":
        return [[]]
    if w.tree is None:
        return [w.drafts[:i] for i in range(n)]
    paths: list[list[int]] = [[]]
    for tok, par in zip(w.tree.tokens, w.tree.parents):  # parents come before their children
        paths.append(paths[par] + [tok])
    return paths[:n]


def _active(w: Work) -> bool:
    p = w.seq.params
    return ((len(w.seq.output_ids) < p.min_tokens and bool(w.seq.early_stop_ids)) or p.has_penalties
            or p.has_logit_mask or w.seq.grammar is not None)


def process_logits(works: list[Work], logits: torch.Tensor | None) -> torch.Tensor | None:
    """The logits every work's acceptance should read: the same tensor when no request needs
    processing, else a processed float32 copy (bf16 would round a small penalty away)."""
    todo = [w for w in works if w.num_logit_rows and _active(w)]
    if not todo:
        return logits
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    for w in todo:
        at, n = w.first_logit, w.num_logit_rows
        prefixes = row_prefixes(w, n)
        if w.seq.params.has_penalties:
            logits[at:at + n] = _penalize(w, logits[at:at + n], prefixes)
        if w.seq.params.has_logit_mask:
            _bias(w, logits[at:at + n])
            _ban_bad_words(w, logits[at:at + n], prefixes)
        if w.seq.grammar is not None:
            mask_rows(w.seq.grammar, logits[at:at + n], prefixes)
        _ban_early_stops(w, logits[at:at + n], prefixes)
    return logits


def _penalize(w: Work, rows: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
    p, seq = w.seq.params, w.seq
    n, V = rows.shape
    dev = rows.device
    out = torch.tensor(seq.output_ids, dtype=torch.long, device=dev)
    counts = torch.bincount(out, minlength=V)[:V].float().expand(n, V).clone()
    pairs = [(j, t) for j, prefix in enumerate(prefixes) for t in prefix]
    if pairs:  # each row also counts the drafts before it
        idx = torch.tensor(pairs, dtype=torch.long, device=dev)
        counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(pairs), device=dev), accumulate=True)
    x = rows
    if p.repetition_penalty != 1.0:
        in_prompt = torch.zeros(V, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor([t for t in seq.prompt_ids if t < V], dtype=torch.long, device=dev)] = True
        seen = (counts > 0) | in_prompt
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def _bias(w: Work, rows: torch.Tensor) -> None:
    """Add the request's logit bias and mask what allowed_token_ids leaves out (in place), as one
    row built on the request's first step: every step would otherwise rebuild it."""
    p, seq = w.seq.params, w.seq
    if not p.logit_bias and p.allowed_token_ids is None:
        return
    if seq.logit_offset is None:
        dev = rows.device
        offset = torch.zeros(rows.shape[-1], dtype=rows.dtype, device=dev)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            offset[ids] = torch.tensor(list(p.logit_bias.values()), dtype=rows.dtype, device=dev)
        if p.allowed_token_ids is not None:
            banned = torch.ones(rows.shape[-1], dtype=torch.bool, device=dev)
            banned[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = False
            offset[banned] = float("-inf")
        seq.logit_offset = offset
    rows += seq.logit_offset


def _ban_bad_words(w: Work, rows: torch.Tensor, prefixes: list[list[int]]) -> None:
    """-inf (in place) for the last token of every bad word whose other tokens end a row's context."""
    if not w.seq.bad_word_ids:
        return
    longest = max(len(ids) for ids in w.seq.bad_word_ids) - 1  # the context a word's head can span
    for j, prefix in enumerate(prefixes):
        context = (w.seq.output_ids[-longest:] if longest else []) + prefix
        for ids in w.seq.bad_word_ids:
            head = ids[:-1]
            if ids[-1] < rows.shape[-1] and (not head or context[-len(head):] == head):
                rows[j, ids[-1]] = float("-inf")


def _ban_early_stops(w: Work, rows: torch.Tensor, prefixes: list[list[int]]) -> None:
    """The request's early stop ids at -inf (in place) in the rows that predict an output token
    before its min_tokens."""
    done, p = len(w.seq.output_ids), w.seq.params
    ids = sorted(i for i in w.seq.early_stop_ids if i < rows.shape[-1])
    early = [j for j, prefix in enumerate(prefixes) if done + len(prefix) < p.min_tokens]
    if ids and early:
        dev = rows.device
        rows[torch.tensor(early, device=dev)[:, None], torch.tensor(ids, device=dev)[None, :]] = float("-inf")
