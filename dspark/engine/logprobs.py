"""Log-probabilities of the tokens a step commits, from the target logits of that step's pass,
and of the prompt's tokens, from the prefill rows' hidden states.

As vLLM's default (raw logprobs): the log-softmax of the target's unprocessed logits, before
temperature, top-k or top-p. Every committed token was predicted by one verified row (a chain's
row i predicts its token i, a tree's path node predicts its child), so speculation returns the
same values plain decoding would: the rows are the same bits (tests/test_bf16_exact.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.engine.verify import Work


@dataclass
class TokenLogprob:
    """One output token's log-probability and the `k` most likely tokens at its position."""

    logprob: float
    rank: int  # 1 for the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


def attach_logprobs(works: list[Work], logits: torch.Tensor | None) -> None:
    """Fill `w.logprobs` (one TokenLogprob per new token) for every work whose request asks."""
    picks: list[tuple[Work, list[int]]] = []
    for w in works:
        if w.new_tokens and w.seq.params.logprobs is not None:
            # decode: kept_rows[i] is the row that predicted new token i; prefill: its one row
            local = w.kept_rows[:len(w.new_tokens)] if w.kind == "decode" else [0]
            picks.append((w, [w.first_logit + r for r in local]))
    if not picks:
        return
    rows = torch.tensor([r for _, rs in picks for r in rs], device=logits.device)
    entries = token_logprobs(logits[rows], [t for w, _ in picks for t in w.new_tokens],
                             [w.seq.params.logprobs for w, _ in picks for _ in w.new_tokens])
    i = 0
    for w, _ in picks:
        w.logprobs, i = entries[i:i + len(w.new_tokens)], i + len(w.new_tokens)


def attach_prompt_logprobs(works: list[Work], hidden: torch.Tensor, runner, chunk: int = 256) -> None:  # noqa: ANN001
    """Append to `seq.prompt_logprobs` (None for the first prompt token, then one TokenLogprob per
    prompt token) from the prefill rows of every request that asks. A prefill chunk's row i
    predicts the token after it; positions already scored (a preempted request's second prefill)
    and output tokens are skipped. The LM head runs `chunk` rows at a time to bound memory."""
    rows, toks, ks, owners = [], [], [], []
    for w in works:
        seq = w.seq
        if w.kind != "prefill" or seq.params.prompt_logprobs is None:
            continue
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        start = seq.num_cached
        for i in range(len(w.tokens)):
            nxt = start + i + 1
            if len(seq.prompt_logprobs) <= nxt < len(seq.prompt_ids):
                rows.append(w.first_row + i)
                toks.append(seq.prompt_ids[nxt])
                ks.append(seq.params.prompt_logprobs)
                owners.append(seq)
    for at in range(0, len(rows), chunk):
        idx = torch.tensor(rows[at:at + chunk], device=hidden.device)
        entries = token_logprobs(runner.logits(hidden[idx]), toks[at:at + chunk], ks[at:at + chunk])
        for seq, e in zip(owners[at:at + chunk], entries):
            seq.prompt_logprobs.append(e)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i's log-softmax value of tokens[i], its rank and the ks[i] most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    toks = torch.tensor(tokens, device=logits.device)
    chosen = lp.gather(1, toks[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    k = max(ks)
    if k:
        top_v, top_i = _top(lp, k)
    else:
        top_v, top_i = lp[:, :0], lp[:, :0].long()
    chosen, ranks, top_v, top_i = chosen.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    return [TokenLogprob(chosen[j], ranks[j], list(zip(top_i[j][:ks[j]], top_v[j][:ks[j]])))
            for j in range(len(tokens))]


def _top(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row, ties listed by id (the lowest first, the one argmax
    picks: bf16 logits tie often). topk, then its k reordered by (-logprob, id); a row where more
    than k tokens reach the k-th value (a tie across the cut) is sorted whole."""
    v, i = lp.topk(k, dim=-1)
    by_id = i.argsort(-1)
    v, i = v.gather(1, by_id), i.gather(1, by_id)
    by_value = (-v).argsort(dim=-1, stable=True)
    v, i = v.gather(1, by_value), i.gather(1, by_value)
    cut = (lp >= v[:, -1:]).sum(-1) > k
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]
        i[rows] = torch.sort(-lp[rows], dim=-1, stable=True).indices[:, :k]
        v[rows] = lp[rows].gather(1, i[rows])
    return v, i
