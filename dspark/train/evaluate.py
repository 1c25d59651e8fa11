"""`dspark eval-drafter`: measure a drafter with our engine on a prompts file.

Reports tau (tokens committed per target pass) overall and per category, acceptance per
block position, and, offline, what the confidence head would have saved: for every
speculative step we record the confidences of the verified drafts and how many were
accepted; cutting the block at the first confidence below a threshold t would have verified
`cut` fewer tokens and lost the accepted ones past the cut. The share of verification
compute saved is sum(cut) / sum(verified + 1) (the target also processes the anchor), and
the tau estimate after the cut is 1 + accepted-kept per step (greedy: what happens after a
rejection does not change the counted steps' outcomes, so this is an approximation that
ignores the changed trajectory).
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict

THRESHOLDS = (0.3, 0.5, 0.7)


class _StepRecorder:
    """Wraps the spec runner to capture (seq_id, confidences) for every proposed block."""

    def __init__(self, runner):
        self.runner = runner
        self.pending: list[tuple[int, list[float]]] = []
        orig_propose, orig_choose = runner.propose, runner.policy.choose
        state = {"active": []}

        def propose(seqs, other_tokens=0, max_drafts=None):
            state["active"] = [s for s in seqs if runner.draft_budget(s) > 0]
            return orig_propose(seqs, other_tokens, max_drafts)

        def choose(budgets, conf, *a, **kw):
            # looked-up chains (the n-gram assist) carry running rates, not the head's confidences
            looked = runner.assist.looked if getattr(runner, "assist", None) is not None else {}
            if conf is not None:
                for s, row in zip(state["active"], conf.float().cpu().tolist()):
                    if s.seq_id not in looked:
                        self.pending.append((s.seq_id, row))
            return orig_choose(budgets, conf, *a, **kw)

        runner.propose, runner.policy.choose = propose, choose


def evaluate(drafter: str, prompts_file: str, num_prompts: int | None = None, per_category: int | None = None,
             max_tokens: int = 256, temperature: float = 0.0, model: str | None = None, device: str = "auto",
             dtype: str = "auto", max_num_seqs: int = 16, block_size: int | None = None, seed: int = 0,
             thresholds=THRESHOLDS, tree_budget: int | None = None, ngram_assist: int | None = None,
             ngram_assist_max_len: int | None = None) -> dict:
    """Greedy (or sampled) generation for every prompt with `drafter`; the JSON report. With
    tree_budget the target verifies draft trees of that many nodes instead of chains (the
    confidence savings then stay empty: a tree is pruned by joint draft probability)."""
    from dspark.config import SamplingParams
    from dspark.llm import LLM
    from dspark.train.data import read_prompts

    prompts = read_prompts(prompts_file)
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        picked = []
        for p in prompts:
            if seen[p["category"]] < per_category:
                seen[p["category"]] += 1
                picked.append(p)
        prompts = picked
    if num_prompts:
        prompts = prompts[:num_prompts]
    spec = {"tree": True, "tree_budget": tree_budget} if tree_budget is not None else {}
    if ngram_assist is not None:
        spec["ngram_assist"] = ngram_assist
    if ngram_assist_max_len is not None:
        spec["ngram_assist_max_len"] = ngram_assist_max_len
    # fixed: every drafted token is verified, so tau measures the drafter, not the machine's costs
    # sampled requests without their own seed take rejection sampling, as a client's usually do
    # (a seeded one races, docs/api.md); the engine's seed still makes the run repeat
    llm = LLM(model=model, drafter=drafter, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
              block_size=block_size, policy="fixed", seed=seed, **spec)
    eng = llm.engine
    rec = _StepRecorder(eng.spec) if hasattr(eng.spec, "policy") else None
    steps: list[tuple[str, list[float], int, int]] = []  # (category, conf, verified, accepted)
    rid_cat, sid_rid, last = {}, {}, {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        seq = eng.add_request(f"eval-{i}", p["messages"], params)
        rid_cat[seq.request_id] = p["category"]
        sid_rid[seq.seq_id] = seq
        last[seq.seq_id] = (0, 0, 0)
    t0 = time.perf_counter()
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        confs = dict(rec.pending) if rec else {}
        if rec:
            rec.pending.clear()
        for sid, seq in sid_rid.items():
            st = seq.stats
            n0, v0, a0 = last[sid]
            if st.steps > n0:
                last[sid] = (st.steps, st.verified, st.accepted)
                if sid in confs and st.steps == n0 + 1:
                    steps.append((rid_cat[seq.request_id], confs[sid], st.verified - v0, st.accepted - a0))
    wall = time.perf_counter() - t0
    cat = defaultdict(lambda: {"requests": 0, "steps": 0, "generated": 0, "accepted": 0, "verified": 0,
                               "lookup_steps": 0, "lookup_accepted": 0})
    acc_pos: dict[str, Counter] = defaultdict(Counter)  # per category: block position -> count
    ver_pos: dict[str, Counter] = defaultdict(Counter)
    total_tokens = 0
    for rid, o in outs.items():
        c = cat[rid_cat[rid]]
        s = o.stats
        c["requests"] += 1
        c["steps"] += s.steps
        c["generated"] += s.generated
        c["accepted"] += s.accepted
        c["verified"] += s.verified
        c["lookup_steps"] += s.lookup_steps
        c["lookup_accepted"] += s.lookup_accepted
        total_tokens += len(o.token_ids)
        for k, (a, v) in enumerate(zip(s.accepted_per_pos, s.verified_per_pos)):
            acc_pos[rid_cat[rid]][k] += a
            ver_pos[rid_cat[rid]][k] += v
    per_cat = {k: {"tau": round(v["generated"] / max(1, v["steps"]), 3), "requests": v["requests"],
                   "steps": v["steps"], "accept_rate": round(v["accepted"] / max(1, v["verified"]), 3),
                   "acceptance_per_position": _rates(acc_pos[k], ver_pos[k])}
               for k, v in sorted(cat.items())}
    tot_steps = sum(v["steps"] for v in cat.values())
    result = {
        "drafter": drafter, "prompts": len(prompts), "temperature": temperature, "max_tokens": max_tokens,
        "tree_budget": tree_budget, "ngram_assist": llm.engine.config.spec.ngram_assist,
        "ngram_assist_max_len": llm.engine.config.spec.ngram_assist_max_len,
        "tau": round(sum(v["generated"] for v in cat.values()) / max(1, tot_steps), 3),
        "tau_per_category": {k: v["tau"] for k, v in per_cat.items()},
        # the n-gram assist's part: steps that verified a looked-up chain, and the tokens kept from them
        "lookup_steps": sum(v["lookup_steps"] for v in cat.values()),
        "lookup_accepted": sum(v["lookup_accepted"] for v in cat.values()),
        # tau weights categories by their target passes (long answers weigh more); this weighs them equally
        "tau_category_mean": round(sum(v["tau"] for v in per_cat.values()) / max(1, len(per_cat)), 3),
        "per_category": per_cat,
        "acceptance_per_position": _rates(sum(acc_pos.values(), Counter()), sum(ver_pos.values(), Counter())),
        "wall_s": round(wall, 2), "output_tokens": total_tokens,
        "confidence_savings": confidence_savings(steps, thresholds),
    }
    return result


def _rates(accepted: Counter, verified: Counter) -> list[float]:
    """Share of the drafts verified at each block position that were accepted (every position
    up to the last one verified was verified at least once)."""
    return [round(accepted[k] / verified[k], 3) for k in range(len(verified))]


def confidence_savings(steps, thresholds=THRESHOLDS) -> dict:
    """Offline: verified tokens cut vs accepted tokens lost when truncating at c < t."""
    out = {}
    n = len(steps)
    base_verify = sum(v + 1 for _, _, v, _ in steps)
    base_acc = sum(a for _, _, _, a in steps)
    for t in thresholds:
        cut = lost = 0
        for _, conf, v, a in steps:
            keep = v
            for j, c in enumerate(conf[:v]):
                if c < t:
                    keep = j
                    break
            cut += v - keep
            lost += max(0, a - keep)
        out[str(t)] = {"verify_share_saved": round(cut / max(1, base_verify), 4),
                       "accepted_share_lost": round(lost / max(1, base_acc), 4),
                       "verified_tokens_cut": cut, "accepted_tokens_lost": lost,
                       "tau_estimate": round(1 + (base_acc - lost) / max(1, n), 3)}
    out["steps_recorded"] = n
    return out


def main_json(result: dict) -> str:
    return json.dumps(result, indent=2)
