"""The DSpark training loss (REFERENCE.md, DSpark paper / DeepSpec):

    loss = 0.1 * CE(draft logits, true next token)
         + 0.9 * L1(p_d, p_t)                 (||p_d - p_t||_1 over the vocabulary, in [0, 2])
         + 1.0 * BCEWithLogits(c, c*)         c* = clamp(1 - 0.5 * ||p_d - p_t||_1, 0, 1), detached

Each term is weighted per block slot by exp(-k / gamma) (slot k = 0 predicts the token right
after the anchor) and averaged over the supervised slots: sum_k w_k * l_k / #slots (the
notebook's `(l * decay).mean()`). Draft logits are the Markov-corrected ones,
U_k + W2(W1[x_{k-1}]) with teacher forcing (x_{k-1} = the true previous token, the anchor for
k = 0); the confidence reads [h_k ; W1[x_{k-1}]] exactly as at inference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.train.features import drafter_blocks, valid_slots

LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # ce, l1, bce


def decay_weights(block_size: int, gamma: float = 4.0, device=None) -> torch.Tensor:
    """exp(-k / gamma) for k = 0..block_size-1."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / gamma)


def target_c_star(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """Analytic acceptance probability of a draft sampled from p_d under target p_t."""
    return (1.0 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0.0, 1.0)


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                conf_logits: torch.Tensor | None, slot: torch.Tensor, gamma: float = 4.0,
                weights: tuple[float, float, float] = LOSS_WEIGHTS,
                draft_to_target: torch.Tensor | None = None,
                target_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Loss over N supervised slots: draft logits [N, Vd] and target logits [N, V] (float32),
    labels [N] (target ids), conf_logits [N] or None, slot [N] (block position k of each row).

    With a reduced draft vocabulary (draft_to_target [Vd], ascending target ids) p_d is 0 outside it, so
    the L1 distance gains the target mass there, and a label outside it adds no CE term. Given
    target_lse [N] (the target's log-normalizer over the full vocabulary), target_logits are
    already restricted to the draft vocabulary [N, Vd]: the full-vocabulary head is then never run.
    Returns (total, parts as floats)."""
    n = max(1, labels.numel())
    w = torch.exp(-slot.float() / gamma)
    p_d = F.softmax(draft_logits.float(), -1)
    outside = 0.0
    if draft_to_target is None:
        p_t = F.softmax(target_logits.float(), -1)
    else:
        if target_lse is None:
            p_t = F.softmax(target_logits.float(), -1)[:, draft_to_target]
        else:
            p_t = torch.exp(target_logits.float() - target_lse.float()[:, None])
        outside = (1.0 - p_t.sum(-1)).clamp(min=0.0)
        # draft_to_target is ascending (frequent_tokens): a label's draft id by binary search, -100
        # (no CE term) when it lies outside; no data-dependent shapes, so torch.compile keeps one graph
        at = torch.searchsorted(draft_to_target, labels).clamp(max=draft_to_target.numel() - 1)
        labels = torch.where(draft_to_target[at] == labels, at, torch.full_like(at, -100))
    ce = F.cross_entropy(draft_logits.float(), labels, reduction="none", ignore_index=-100)
    l1 = (p_d - p_t).abs().sum(-1) + outside
    cstar = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    ce_m, l1_m = (ce * w).sum() / n, (l1 * w).sum() / n
    total = weights[0] * ce_m + weights[1] * l1_m
    parts = {"ce": ce_m.detach(), "l1": l1_m.detach(), "cstar": cstar.mean()}
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), cstar, reduction="none")
        bce_m = (bce * w).sum() / n
        total = total + weights[2] * bce_m
        parts["bce"] = bce_m.detach()
    with torch.no_grad():
        hit = (draft_logits.argmax(-1) == labels).float()
        parts["acc"] = hit.mean()
        parts["hit"] = hit  # per row: batch_loss counts it by block position
    return total, parts


def batch_loss(drafter, target_lm_head, feats: torch.Tensor, final_hidden: torch.Tensor,
               tokens: torch.Tensor, lengths: torch.Tensor, resp_mask: torch.Tensor,
               anchors: torch.Tensor, anchor_ok: torch.Tensor, gamma: float = 4.0,
               final_lse: torch.Tensor | None = None, loss_fn=dspark_loss,
               weights: tuple[float, float, float] = LOSS_WEIGHTS) -> tuple[torch.Tensor, dict]:
    """Full DSpark loss for a batch: one multi-anchor drafter forward, LM heads only on the
    supervised slots. feats/final_hidden come from features.target_features (no grad);
    final_lse [B, T] (the target's log-normalizers) lets a reduced-vocabulary drafter skip the
    target's full LM head. loss_fn: dspark_loss or a torch.compile'd version of it; weights: (ce, l1, bce)."""
    c = drafter.config
    Bk = c.block_size
    h = drafter_blocks(drafter, feats, tokens, anchors)  # [B, A, Bk, H]
    ok = valid_slots(anchors, anchor_ok, lengths, resp_mask, Bk)  # [B, A, Bk]
    b_idx, a_idx, k_idx = ok.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        zero = sum(p.sum() * 0 for p in drafter.parameters())
        return zero, {"ce": zero.detach(), "l1": zero.detach(), "bce": zero.detach(),
                      "cstar": zero.detach(), "acc": zero.detach(), "slots": 0,
                      "slot_hits": torch.zeros(Bk), "slot_rows": torch.zeros(Bk)}
    pos = anchors[b_idx, a_idx] + k_idx  # position of slot k's input: predicts pos + 1
    labels = tokens[b_idx, pos + 1]
    prev = tokens[b_idx, pos]  # teacher forcing: x_{k-1} = tok[a+k] (the anchor for k = 0)
    hs = h[b_idx, a_idx, k_idx]  # [N, H]
    d2t, lse = drafter.draft_to_target, None
    with torch.no_grad():
        if d2t is not None and final_lse is not None:
            t_logits = F.linear(final_hidden[b_idx, pos], target_lm_head.weight[d2t]).float()
            lse = final_lse[b_idx, pos]
        else:
            t_logits = target_lm_head(final_hidden[b_idx, pos]).float()
    d_logits = drafter.step_logits(drafter.draft_logits(hs), prev)
    conf = drafter.confidence(hs, prev)
    total, parts = loss_fn(d_logits, t_logits, labels, conf, k_idx, gamma, weights, draft_to_target=d2t,
                           target_lse=lse)
    parts["slots"] = int(b_idx.numel())
    # teacher-forced agreement by block position (outside loss_fn: bincount's size is data-dependent)
    parts["slot_hits"] = torch.bincount(k_idx, weights=parts.pop("hit"), minlength=Bk).float().cpu()
    parts["slot_rows"] = torch.bincount(k_idx, minlength=Bk).float().cpu()
    return total, parts


def expected_tau(rate_per_slot: torch.Tensor) -> float:
    """1 + sum_k prod_{i<=k} r_k for a [Bk] vector of per-position acceptance rates (a rough tau).
    With teacher-forced agreement as r_k (slot k is told the true earlier tokens, so r_k reads as
    P(slot k right | slots < k right)) this estimates greedy tau on the batches it was measured on."""
    return 1.0 + float(torch.cumprod(rate_per_slot, 0).sum()) if rate_per_slot.numel() else math.nan
