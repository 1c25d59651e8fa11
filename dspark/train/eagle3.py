"""The EAGLE-3 training objective: "training-time test" (TTT, EAGLE-3 paper; SpecForge's scheme).

A training sequence x_0..x_{T-1} with the target's fused features f_i = fc([low; mid; high] at i)
is run through the head K times ("steps"); every position i stands for a draft that starts
after committing positions 0..i, exactly as the engine drafts (proposers/eagle3.py):

* step 0, position i: input [emb(x_{i+1}); f_i] at rotary position i, causal attention over the
  step-0 K/V of positions 0..i (the engine's committed context, written from true features),
  output h^0_i predicts x_{i+2};
* step s >= 1, position i: input [emb(x_{i+1+s}); h^{s-1}_i] (the head's own previous output,
  the token teacher-forced from the data) at rotary position i+s; its query sees the step-0 K/V
  of positions 0..i plus the K/V of steps 1..s at this same position i (the chain it drafted
  itself), nothing else; output h^s_i predicts x_{i+2+s}.

This is the exact attention pattern of inference (not the plain-causal simplification): step s
at position i computes what the engine's s-th draft step computes after committing 0..i, given
the true tokens as the drafted ones. The K/V of steps >= 1 are "diagonal" (one per position),
so the extra attention costs one dot product per step and position.

Loss at step s, over positions i whose token after i is a response token (i >= prompt_len - 1:
drafts the engine makes; prompts are masked as in DSpark training) and whose label x_{i+2+s}
exists: cross-entropy against x_{i+2+s} over the draft vocabulary (a label outside it adds no
term) plus kl_weight * KL(p_t || p_d), p_t the target's distribution at position i+1+s restricted
to the draft vocabulary and renormalised (EAGLE-3's soft target). Step s is weighted decay^s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.models.layers import apply_rotary

TTT_STEPS = 3
STEP_DECAY = 0.8


def _ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                   vs: list[torch.Tensor], pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, R, nh, hd] of the rows at positions pos [B, R]; k0/v0 [B, T, nkv, hd] (step 0, every
    position: a row sees those up to its own); ks/vs: [B, R, nkv, hd] per later step (a row sees
    only its own) -> [B, R, nh, hd]."""
    nh = q.shape[2]
    T, g = k0.shape[1], nh // k0.shape[2]
    rep = lambda x: x.repeat_interleave(g, dim=2).transpose(1, 2)  # noqa: E731 - [B, nh, *, hd]
    qh = q.transpose(1, 2)  # [B, nh, R, hd]
    scores = qh @ rep(k0).transpose(-1, -2) * scale  # [B, nh, R, T]
    future = torch.arange(T, device=q.device)[None, None, :] > pos[:, :, None]
    scores = scores.masked_fill(future[:, None], float("-inf"))
    diag = [(qh * rep(k)).sum(-1, keepdim=True) * scale for k in ks]  # [B, nh, R, 1] each
    p = torch.softmax(torch.cat([scores, *diag], -1).float(), -1).to(q.dtype)
    o = p[..., :T] @ rep(v0)
    for t, v in enumerate(vs):
        o = o + p[..., T + t, None] * rep(v)
    return o.transpose(1, 2)


def ttt_outputs(head, feats: torch.Tensor, tokens: torch.Tensor, steps: int, starts: torch.Tensor | None = None,
                rows: int | None = None) -> list[torch.Tensor]:
    """Pre-norm outputs [B, R, H] of every TTT step for the positions starts[b] + r, r < R (R:
    rows, default T - min(starts)); positions before a row's start only serve as step-0 context,
    and rows past the sequence are padding whose outputs mean nothing. head: an Eagle3Head (its
    modules used dense and cache-free, so the trained weights are the ones inference runs);
    feats [B, T, m*H]: the target's features at head.config.capture_layers; tokens [B, T]."""
    layer = head.midlayer
    att = layer.self_attn
    B, T = tokens.shape
    dev = tokens.device
    starts = torch.zeros(B, dtype=torch.long, device=dev) if starts is None else starts.to(dev)
    R = rows if rows is not None else T - int(starts.min())
    pos = (starts[:, None] + torch.arange(R, device=dev)).clamp(max=T - 1)  # [B, R]
    # the token after each position, then zeros past the end (only unsupervised rows read them)
    after = F.pad(tokens[:, 1:], (0, steps), value=0)  # [B, T - 1 + steps]
    fused = head.fc(feats.to(head.fc.weight.dtype))
    x0 = layer.inputs(head.embed(after[:, :T]).to(fused.dtype), fused)
    k0, v0 = att.kv(x0, *head.rotary(torch.arange(T, device=dev), x0.dtype))  # every position: context
    rows_of = lambda x: x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731 - [B, R, *]
    hidden = rows_of(fused)
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs = []
    for s in range(steps):
        x = rows_of(x0) if s == 0 else layer.inputs(head.embed(after.gather(1, pos + s)).to(hidden.dtype), hidden)
        cos, sin = head.rotary((pos + s).flatten(), x.dtype)
        cos, sin = cos.view(B, R, 1, -1), sin.view(B, R, 1, -1)
        q, k, v = att.project(x)
        q = apply_rotary(q, cos, sin)
        if s:  # step 0's own K/V are k0/v0's rows
            ks.append(apply_rotary(k, cos, sin))
            vs.append(v)
        o = _ttt_attention(q, k0, v0, ks, vs, pos, att.scale)
        h = hidden + att.o_proj(o.reshape(B, R, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
        hidden = h
    return outs


def _draft_labels(labels: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """Target ids -> draft ids (draft_to_target ascending), -100 for those outside the draft vocabulary."""
    if draft_to_target is None:
        return labels
    at = torch.searchsorted(draft_to_target, labels).clamp(max=draft_to_target.numel() - 1)
    return torch.where(draft_to_target[at] == labels, at, torch.full_like(at, -100))


def eagle3_loss(head, target_lm_head, feats: torch.Tensor, final_hidden: torch.Tensor, tokens: torch.Tensor,
                lengths: torch.Tensor, resp_mask: torch.Tensor, prompt_lens: list[int], steps: int = TTT_STEPS,
                decay: float = STEP_DECAY, kl_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The TTT loss of a padded batch (dataset.TokenDataset.batch; feats/final_hidden from the
    target, no grad) -> (total, parts): ce and kl (means over steps), acc (all steps pooled),
    slots (supervised step-0 rows) and slot_hits/slot_rows [steps] (agreement by step, which the
    trainer turns into acc_by_slot and tau_est)."""
    B, T = tokens.shape
    # row r of sequence b: position starts[b] + r, the r-th draft of its response (the first one
    # follows the prompt's last token); only as many rows as the longest response needs
    starts = (torch.as_tensor(prompt_lens, device=tokens.device) - 1).clamp(min=0)
    R = max(1, int((lengths - 2 - starts).max()))
    outs = ttt_outputs(head, feats, tokens, steps, starts, R)
    V = head.config.layer.vocab_size
    d2t = head.draft_to_target
    reduced = d2t.numel() < V
    w_t = target_lm_head.weight[d2t] if reduced and kl_weight else target_lm_head.weight
    pos = starts[:, None] + torch.arange(R, device=tokens.device)  # [B, R]
    # a draft after committing 0..i: the token after i is part of the response
    anchor = resp_mask.gather(1, (pos + 1).clamp(max=T - 1)) & (pos + 1 < lengths[:, None])
    total = tokens.new_zeros((), dtype=torch.float32)
    ces, kls, hits, counts = [], [], torch.zeros(steps), torch.zeros(steps)
    for s, h in enumerate(outs):
        b, r = (anchor & (pos + 2 + s < lengths[:, None])).nonzero(as_tuple=True)
        if b.numel() == 0:
            break  # later steps have even fewer rows
        at = pos[b, r] + 2 + s  # label position
        labels = _draft_labels(tokens[b, at], d2t if reduced else None)
        logits = head.logits(h[b, r])  # float32 [N, Vd]
        n = b.numel()
        ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n
        loss = ce
        if kl_weight:
            with torch.no_grad():
                p_t = F.softmax(F.linear(final_hidden[b, at - 1], w_t).float(), -1)
                entropy = -(p_t * torch.log(p_t.clamp(min=1e-30))).sum(-1).mean()
            kl = -(p_t * F.log_softmax(logits, -1)).sum(-1).mean() - entropy  # soft CE minus a constant
            loss = loss + kl_weight * kl
            kls.append(kl.detach())
        total = total + decay ** s * loss
        ces.append(ce.detach())
        with torch.no_grad():
            hits[s] = float((logits.argmax(-1) == labels).sum())
        counts[s] = n
    if not ces:  # nothing supervised: a zero that still reaches every parameter
        total = sum(p.sum() * 0 for p in head.parameters())
    mean = lambda xs: torch.stack(xs).mean() if xs else torch.zeros(())  # noqa: E731
    parts = {"ce": mean(ces), "acc": hits.sum() / counts.sum().clamp(min=1), "slots": int(counts[0]),
             "slot_hits": hits, "slot_rows": counts}
    if kl_weight:
        parts["kl"] = mean(kls)
    return total, parts
