"""Dense (cache-free) forwards for training: the frozen target over a padded batch, and the
drafter over many anchors per sequence in one pass with a block attention mask.

Both reuse the modules of dspark.models (LlamaModel, BlockDrafter) so the trained weights
are exactly the ones the paged inference path runs.

Convention (same as inference, REFERENCE.md): for an anchor at position a the drafter's
context holds the target features of positions 0..a-1 (the anchor's own features are not
known yet at inference), the block [tok[a], MASK x (B-1)] sits at rotary positions
a..a+B-1 and sees every block slot (no causal mask inside the block). DSpark slot k
predicts tok[a+k+1]; the target distribution for it is the target's softmax at a+k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.models.llama import apply_rotary


def _sdpa(q, k, v, mask=None, causal=False, scale=None):
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D] -> [B, Tq, H, D] (GQA by repeating K/V heads)."""
    H, Hkv = q.shape[2], k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def _qkv(att, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotated q [B, T, H, D] and k, v [B, T, Hkv, D] of a target attention module."""
    q, k, v = att.project(x)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal forward of a LlamaModel over right-padded ids [B, T].

    Returns (feats [B, T, m*H]: the residual stream after each layer in layer_ids, i.e. HF
    hidden_states[l + 1], concatenated in layer_ids order; final normed hidden [B, T, H]).
    Right padding needs no extra mask: causal attention never lets a real token see a pad.
    """
    B, T = ids.shape
    h = model.embed_tokens(ids)
    cos, sin = model.rotary(torch.arange(T, device=ids.device), h.dtype)  # [T, 1, D]
    taken = {}
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        q, k, v = _qkv(att, layer.input_layernorm(h), cos, sin)
        h = h + att.o_proj(_sdpa(q, k, v, causal=True, scale=att.scale).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in layer_ids:
            taken[i] = h
    feats = torch.cat([taken[i] for i in layer_ids], -1)
    return feats, model.norm(h)


@torch.no_grad()
def generate_dense(model, prompts: list[list[int]], max_new: int, temps: list[float], eos_ids: set[int],
                   pad_id: int, seed: int = 0) -> list[list[int]]:
    """Batched decoding of a LlamaModel with a dense per-batch KV cache (left padding).

    Greedy rows (temperature 0) take the argmax; others sample softmax(logits / T) from one
    generator seeded per batch. Each response ends at its first EOS (kept) or at max_new.
    Much faster on a GPU than transformers' generate for a small target (no per-step Python
    cache bookkeeping beyond a slice), and the text is the same model's.
    """
    dev = model.embed_tokens.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    L = P + max_new
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
    ids = ids.to(dev)
    valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
    valid[:, :P] = torch.arange(P, device=dev)[None] >= (P - lens)[:, None]
    valid[:, P:] = True
    pos = (torch.arange(P, device=dev)[None] - (P - lens)[:, None]).clamp(min=0)
    c = model.config
    kc = torch.zeros(c.num_hidden_layers, B, L, c.num_key_value_heads, c.head_dim, device=dev,
                     dtype=model.embed_tokens.weight.dtype)
    vc = torch.zeros_like(kc)
    temp = torch.tensor(temps, device=dev, dtype=torch.float32)
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = torch.tensor(sorted(eos_ids), device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    out = torch.full((B, max_new), pad_id, dtype=torch.long, device=dev)
    x, start = ids, 0
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(P, dtype=torch.bool, device=dev)
    for t in range(max_new):
        T = x.shape[1]
        end = start + T
        if t == 0:  # prefill: causal over real tokens; a pad row sees itself so softmax stays finite
            mask = ((causal[None] & valid[:, None, :P]) | eye[None])[:, None]
        else:
            mask = valid[:, None, None, :end]
        cos, sin = model.rotary(pos.reshape(-1), kc.dtype)
        cos, sin = cos.view(B, T, 1, -1), sin.view(B, T, 1, -1)
        h = model.embed_tokens(x)
        for i, layer in enumerate(model.layers):
            att = layer.self_attn
            q, k, v = _qkv(att, layer.input_layernorm(h), cos, sin)
            kc[i, :, start:end], vc[i, :, start:end] = k, v
            o = _sdpa(q, kc[i, :, :end], vc[i, :, :end], mask=mask, scale=att.scale)
            h = h + att.o_proj(o.reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(model.norm(h[:, -1])).float()
        probs = torch.softmax(logits / temp.clamp(min=1e-5)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
        tok = torch.where(temp > 0, sampled, logits.argmax(-1))
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out[:, t] = tok
        done |= torch.isin(tok, eos)
        if t % 16 == 15 and bool(done.all()):
            break
        x, start = tok[:, None], end
        pos = (lens + t)[:, None]
    res = []
    for row in out.tolist():
        r = []
        for tk in row:
            r.append(tk)
            if tk in eos_ids:
                break
        res.append(r)
    return res


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids and positions [B, A, Bk] for anchors [B, A] (positions into tokens)."""
    B, A = anchors.shape
    ids = torch.full((B, A, block_size), mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    pos = anchors[:, :, None] + torch.arange(block_size, device=tokens.device)
    return ids, pos


def block_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """Bool mask [B, 1, A*Bk, T + A*Bk]: block of anchor a sees context < a and its own block."""
    B, A = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, A*Bk]
    ctx = torch.arange(T, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, A*Bk, T]
    blk_id = torch.arange(A, device=dev).repeat_interleave(block_size)
    own = (blk_id[:, None] == blk_id[None, :]).expand(B, -1, -1)  # [B, A*Bk, A*Bk]
    return torch.cat([ctx, own], -1)[:, None]


def drafter_blocks(drafter, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Final normed drafter hidden states [B, A, Bk, H] for every anchor block, in one forward.

    feats [B, T, m*H] (target layers), tokens [B, T], anchors [B, A] (padding anchors may be
    any valid position; their outputs are simply not supervised).
    """
    c = drafter.config
    Bk = c.block_size
    B, T = tokens.shape
    A = anchors.shape[1]
    ctx = drafter.context(feats)  # [B, T, H]
    ids, pos = block_inputs(tokens, anchors, Bk, c.mask_token_id)
    h = drafter.embed(ids.view(B, A * Bk)).to(ctx.dtype)
    bcos, bsin = drafter.rotary(pos.reshape(-1), h.dtype)  # [B*A*Bk, 1, D]
    bcos, bsin = bcos.view(B, A * Bk, 1, -1), bsin.view(B, A * Bk, 1, -1)
    ccos, csin = drafter.rotary(torch.arange(T, device=tokens.device), h.dtype)  # [T, 1, D]
    mask = block_mask(anchors, T, Bk)
    for layer in drafter.layers:
        att = layer.self_attn
        ck, cv = att.kv(ctx, ccos, csin)  # [B, T, nkv, hd]
        x = layer.input_layernorm(h)
        n = A * Bk
        q, bk, bv = att.project(x)
        q, bk = apply_rotary(q, bcos, bsin), apply_rotary(bk, bcos, bsin)
        k, v = torch.cat([ck, bk], 1), torch.cat([cv, bv], 1)
        o = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask=mask, scale=att.scale)
        h = h + att.o_proj(o.reshape(B, n, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(B, A, Bk, -1)


def sample_anchors(lengths: list[int], prompt_lens: list[int], num: int, block_size: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors on response positions: a in [prompt_len, len - 2] (tok[a+1] exists).

    Returns (anchors [B, A] long, valid [B, A] bool), A = num; sequences with fewer
    candidates get padding anchors (position 0, valid False). Sorted per sequence.
    """
    B = len(lengths)
    anchors = torch.zeros(B, num, dtype=torch.long)
    valid = torch.zeros(B, num, dtype=torch.bool)
    for b, (n, p) in enumerate(zip(lengths, prompt_lens)):
        cand = torch.arange(p, n - 1)
        if len(cand) == 0:
            continue
        pick = cand[torch.randperm(len(cand), generator=gen)[:num]].sort().values
        anchors[b, :len(pick)] = pick
        valid[b, :len(pick)] = True
    return anchors, valid


def valid_slots(anchors: torch.Tensor, anchor_ok: torch.Tensor, lengths: torch.Tensor,
                resp_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A, Bk] bool: slot k of anchor a is supervised iff its target tok[a+k+1] exists and is a
    response token, and so is every earlier slot's (the contiguous valid prefix)."""
    B, T = resp_mask.shape
    tgt = anchors[:, :, None] + 1 + torch.arange(block_size, device=anchors.device)  # [B, A, Bk]
    inside = tgt < lengths[:, None, None]
    resp = resp_mask.gather(1, tgt.clamp(max=T - 1).view(B, -1)).view_as(tgt) & inside
    ok = resp & anchor_ok[:, :, None]
    return ok.long().cumprod(-1).bool()
