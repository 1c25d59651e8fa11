"""The drafter trainer: frozen target -> features on the fly -> DSpark loss -> AdamW.

Warmup + cosine learning rate, gradient accumulation, fp32 or bf16 autocast, CPU or CUDA.
Batches (dataset.BatchOrder) and anchors are drawn from generators seeded by (seed, step), so a
resumed run takes exactly the batches an uninterrupted one would; checkpoints are
run_checkpoint.py's folders. The export is `save_drafter` in the DSpark layout without the target's
embed_tokens / lm_head, which the drafter shares. eagle3_trainer.Eagle3Trainer reuses all of it for
EAGLE-3 heads through the few methods that depend on the drafter's kind, and micro_loss.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark.models.drafters.checkpoint import save_drafter
from dspark.models.drafters.dspark import BlockDrafter
from dspark.train.dataset import BatchOrder, TokenDataset
from dspark.train.drafter_init import DTYPES
from dspark.train.feature_cache import FeatureCache, cached_features, target_key
from dspark.train.features import sample_anchors, target_features
from dspark.train.loss import LOSS_WEIGHTS, batch_loss, dspark_loss, expected_tau
from dspark.train.run_checkpoint import RunCheckpoint, read_checkpoint, write_checkpoint

SLOT_COUNTS = ("slot_hits", "slot_rows")  # [block] tensors a step sums over its micro-batches


def slot_summary(hits: torch.Tensor, rows: torch.Tensor) -> dict:
    """Teacher-forced agreement with the target by block position, and the greedy tau it implies
    on these (seen) training batches: an optimistic preview of eval-drafter's tau."""
    acc = hits / rows.clamp(min=1)
    return {"acc_by_slot": [round(float(a), 4) for a in acc], "tau_est": round(expected_tau(acc), 4)}


@dataclass
class TrainConfig:
    """Optimisation settings of one training run (stored in every checkpoint's state.json)."""

    steps: int = 2000
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1
    anchors_per_seq: int = 32
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 4.0
    loss_weights: list[float] = field(default_factory=lambda: list(LOSS_WEIGHTS))  # ce, l1, bce
    dtype: str = "fp32"  # fp32 | bf16 (autocast; master weights stay fp32)
    device: str = "cpu"
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    max_len: int = 1024
    # micro-batches per length group: each epoch's permutation is cut into runs of this many
    # micro-batches and each run sorted by length, so a batch pads little (1: plain random batches)
    length_groups: int = 32
    # from this step on, keep the uniform mean of the weights after every step and export it
    # (the last weights go to <export>_last): a short run's mean beats its last weights
    average_from: int | None = None
    time_budget_s: float | None = None  # stop cleanly (checkpoint + export) past this
    deadline: float | None = None  # absolute time.time() at which to stop (set by the CLI)
    # the cosine also follows the clock: its progress is the larger of the steps' and the time's
    # share of this invocation's budget, so a run stopped by its deadline still ends at min_lr
    lr_by_time: bool = False
    export_dtype: str = "bf16"
    progress: bool = True
    cache_features: bool = False  # keep each sequence's target features (bf16) after first use
    compile_loss: bool = False  # torch.compile the loss: one fused pass over [slots, vocab] (~2.3x faster loss on CPU)
    feature_cache_dir: str | None = None  # ... in memory-mapped files here (survives restarts) instead of RAM
    drafter: dict = field(default_factory=dict)


# Settings a resumed run may change on purpose (more --steps after new data reshapes the cosine),
# but that should never change unnoticed: load_checkpoint lists the ones that differ.
RESUME_SETTINGS = ("steps", "lr", "min_lr_ratio", "warmup", "batch_size", "grad_accum", "anchors_per_seq",
                   "weight_decay", "gamma", "loss_weights", "dtype", "seed", "length_groups", "average_from",
                   "lr_by_time")


class Trainer:
    """One training run in `out_dir`: resumes from `out_dir/ckpt` when present."""

    def __init__(self, target, drafter: BlockDrafter, data: TokenDataset, cfg: TrainConfig,
                 out_dir: str | Path, pad_id: int = 0):
        self.target, self.drafter, self.data, self.cfg = target, drafter, data, cfg
        self.out = Path(out_dir)
        self.dev = torch.device(cfg.device)
        self.pad_id = pad_id
        self.check_drafter()
        self.drafter.to(self.dev, torch.float32).train()
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.names = [n for n, p in drafter.named_parameters() if p.requires_grad]
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.step = 0
        self.resume_changes: dict[str, tuple] = {}  # setting -> (checkpoint's, this run's), after a resume
        self.elapsed = 0.0
        self.history: list[dict] = []
        self.average: list[torch.Tensor] | None = None  # running mean of self.params (average_from)
        # lr_by_time: when this invocation's annealing began (warm-up done), and how far along the
        # cosine an earlier invocation got (from the checkpoint); lr_progress is this run's so far
        self.anneal_start: float | None = None
        self.resumed_progress = self.lr_progress = 0.0
        self.average_n = 0
        self.order = BatchOrder([len(s) for s in data.seqs], cfg.batch_size, cfg.seed, cfg.length_groups)
        self.amp = DTYPES[cfg.dtype] == torch.bfloat16
        # dynamic: the number of supervised slots changes every step
        self.loss_fn = torch.compile(dspark_loss, dynamic=True) if cfg.compile_loss else dspark_loss
        self.cache = None
        if cfg.cache_features or cfg.feature_cache_dir:
            self.cache = FeatureCache(data.seqs, self.capture_layers(), target.config.hidden_size,
                                      cfg.feature_cache_dir, key=target_key(target))
        d2t = drafter.draft_to_target
        if d2t is not None and not bool((d2t[1:] > d2t[:-1]).all()):
            raise ValueError("draft_to_target must hold ascending target ids (the loss maps labels by binary search)")

    # ------------------------------------------------------------------ what differs by drafter kind
    # (eagle3_trainer.Eagle3Trainer overrides these and micro_loss)
    resume_settings = RESUME_SETTINGS

    def check_drafter(self) -> None:
        """Refuse a drafter this trainer's loss does not fit; freeze what it shares with the target."""
        if self.drafter.config.kind != "dspark":
            # the loss teaches slot k the token after slot k's input; a DFlash drafter's slot k
            # drafts the token at its own position, so every label would be one off
            raise ValueError(f"train-drafter trains DSpark drafters; this one is {self.drafter.config.kind}")
        for shared in (self.drafter.embed_tokens, self.drafter.lm_head):  # a checkpoint's own copies of the target's
            if shared is not None:
                shared.requires_grad_(False)

    def capture_layers(self) -> list[int]:
        """The target layers whose outputs the drafter reads, in its order."""
        return list(self.drafter.config.target_layer_ids)

    def drafter_config(self) -> dict:
        """The drafter's shape as stored in checkpoints (a resume refuses another one)."""
        return json.loads(json.dumps(asdict(self.drafter.config)))  # tuples as lists, as stored

    def export_config(self) -> dict:
        return self.drafter.config.to_hf()

    def save_weights(self, path: Path, dtype: torch.dtype) -> None:
        """The exported folder's layout."""
        save_drafter(self.drafter, path, dtype=dtype)

    # ------------------------------------------------------------------ schedule, batches
    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        t = self.progress(step)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def progress(self, step: int) -> float:
        """How far along the cosine a step after warm-up is, from 0 to 1: its share of the steps,
        or with lr_by_time the larger of that and the share of the time budget gone since the
        annealing began in this invocation, applied to what an earlier invocation left (a
        resumed run continues its cosine over its new budget instead of starting it again)."""
        c = self.cfg
        t = (step - c.warmup) / max(1, c.steps - c.warmup)
        if c.lr_by_time and c.deadline is not None and self.anneal_start is not None:
            share = (time.time() - self.anneal_start) / max(1e-9, c.deadline - self.anneal_start)
            t = max(t, self.resumed_progress + (1 - self.resumed_progress) * min(1.0, share))
        return min(1.0, t)

    def micro_loss(self, micro: int) -> tuple[torch.Tensor, dict]:
        c = self.cfg
        idx = self.order.batch(micro)
        b = self.data.batch(idx, self.pad_id, self.dev)
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + micro)
        anchors, ok = sample_anchors(b["lens"], b["prompt_lens"], c.anchors_per_seq,
                                     self.drafter.config.block_size, gen)
        anchors, ok = anchors.to(self.dev), ok.to(self.dev)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
            feats, final, lse = self.features(idx, b)
            return batch_loss(self.drafter, self.target.lm_head, feats, final, b["ids"], b["lengths"],
                              b["resp"], anchors, ok, gamma=c.gamma, final_lse=lse, loss_fn=self.loss_fn,
                              weights=tuple(c.loss_weights))

    def features(self, idx: list[int], b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(feats, final hidden, log-normalizers or None) of a padded batch, through the feature
        cache when the run keeps one."""
        layers = self.capture_layers()
        if self.cache is None:
            with torch.no_grad():
                return (*target_features(self.target, b["ids"], layers), None)
        return cached_features(self.cache, self.target, layers, idx, b, self.dev)

    def train_step(self) -> dict:
        """One optimizer step (grad_accum micro-batches); returns the averaged loss parts."""
        c = self.cfg
        if self.step >= c.warmup and self.anneal_start is None:  # warm-up ends, or a resumed run goes on
            self.anneal_start = time.time()
        lr = self.lr_at(self.step)
        if self.step >= c.warmup:
            self.lr_progress = max(self.lr_progress, self.progress(self.step))
        for g in self.opt.param_groups:
            g["lr"] = lr
        agg: dict = {}
        slots = 0
        for j in range(c.grad_accum):
            loss, parts = self.micro_loss(self.step * c.grad_accum + j)
            # each micro-batch's loss is a mean over its own slots: weigh it by them, so the step's
            # gradient is the mean over all slots, as one large batch would give
            (loss * parts["slots"] if c.grad_accum > 1 else loss).backward()
            slots += parts["slots"]
            agg["loss"] = agg.get("loss", 0.0) + float(loss.detach()) / c.grad_accum
            for k, v in parts.items():
                if k in SLOT_COUNTS:  # summed, not averaged
                    agg[k] = agg[k] + v if k in agg else v
                else:
                    agg[k] = agg.get(k, 0.0) + float(v) / c.grad_accum
        if c.grad_accum > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad /= max(1, slots)
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        if c.average_from is not None and self.step >= c.average_from:
            self._update_average()
        agg.update(lr=lr, grad_norm=float(gnorm))
        return agg

    @torch.no_grad()
    def _update_average(self) -> None:
        if self.average is None:
            self.average, self.average_n = [p.detach().clone() for p in self.params], 0
        self.average_n += 1
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1.0 / self.average_n)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        if self.cache is not None:
            self.cache.flush()
        ck = RunCheckpoint(state={"step": self.step, "elapsed_s": self.elapsed, "history": self.history,
                                  "average_n": self.average_n, "adam_steps": {}, "lr_progress": self.lr_progress,
                                  "config": {k: v for k, v in asdict(self.cfg).items() if k != "deadline"},
                                  "drafter_config": self.drafter_config()},
                           drafter=self.drafter.state_dict())
        for name, p in zip(self.names, self.params):
            if st := self.opt.state.get(p):
                ck.exp_avg[name], ck.exp_avg_sq[name] = st["exp_avg"], st["exp_avg_sq"]
                ck.state["adam_steps"][name] = float(st["step"])
        if self.average is not None:
            ck.average = dict(zip(self.names, self.average))
        return write_checkpoint(self.out / "ckpt", ck)

    def load_checkpoint(self) -> bool:
        """Resume from `<out>/ckpt` if it exists (False when it does not); refuses a checkpoint of
        another drafter shape and records the settings this run changes (resume_changes)."""
        folder = self.out / "ckpt"
        ck = read_checkpoint(folder, str(self.dev))
        if ck is None:
            return False
        state = ck.state
        mine = self.drafter_config()
        saved = state.get("drafter_config", mine)
        if saved != mine:
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise ValueError(f"{folder} holds a drafter with other {', '.join(diff)} than this run's; resume with "
                             "the same drafter flags or use another --out")
        self.drafter.load_state_dict(ck.drafter)
        for name, p in zip(self.names, self.params):
            if name in ck.exp_avg:
                self.opt.state[p] = {"step": torch.tensor(state["adam_steps"][name]),
                                     "exp_avg": ck.exp_avg[name], "exp_avg_sq": ck.exp_avg_sq[name]}
        self.step, self.elapsed, self.history = state["step"], state["elapsed_s"], state["history"]
        self.resumed_progress = self.lr_progress = state.get("lr_progress", 0.0)
        if ck.average is not None:
            self.average, self.average_n = [ck.average[n] for n in self.names], state["average_n"]
        saved_cfg, mine_cfg = state.get("config", {}), asdict(self.cfg)
        self.resume_changes = {k: (saved_cfg[k], mine_cfg[k]) for k in self.resume_settings
                               if k in saved_cfg and saved_cfg[k] != mine_cfg[k]}
        return True

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        from tqdm import tqdm

        c = self.cfg
        start = self.step
        bar = tqdm(total=c.steps, initial=start, desc="train", unit="step", disable=not c.progress,
                   dynamic_ncols=True)
        t_last = time.perf_counter()
        seqs_per_s, stopped = None, "steps"
        run_avg: dict[str, float] = {}
        window = {k: 0.0 for k in SLOT_COUNTS}  # per-position counts since the last log record
        while self.step < c.steps:
            if c.deadline is not None and time.time() >= c.deadline:
                stopped = "time budget"
                break
            parts = self.train_step()
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            self.elapsed += dt
            for k in SLOT_COUNTS:
                window[k] = window[k] + parts.pop(k)
            for k, v in parts.items():
                run_avg[k] = v if k not in run_avg else 0.9 * run_avg[k] + 0.1 * v
            if self.step - start >= 2:  # skip warm-up steps in the speed estimate
                sps = c.batch_size * c.grad_accum / dt
                seqs_per_s = sps if seqs_per_s is None else 0.9 * seqs_per_s + 0.1 * sps
            if self.step % c.log_every == 0 or self.step == c.steps:
                rec = {"step": self.step, "elapsed_s": round(self.elapsed, 1)}
                rec.update({k: round(v, 5) for k, v in parts.items()})
                rec.update(slot_summary(window["slot_hits"], window["slot_rows"]))
                window = {k: 0.0 for k in SLOT_COUNTS}
                run_avg["tau_est"] = rec["tau_est"]
                self.history.append(rec)
                if not c.progress:
                    print(json.dumps(rec | {"seqs_per_s": round(seqs_per_s or 0.0, 2)}), flush=True)
            bar.set_postfix({k: f"{run_avg[k]:.3f}" for k in ("loss", "ce", "l1", "bce", "kl", "acc", "tau_est")
                             if k in run_avg},
                            refresh=False)
            bar.update(1)
            if c.save_every and self.step % c.save_every == 0 and self.step < c.steps:
                self.save_checkpoint()
        bar.close()
        self.save_checkpoint()
        return {"stopped_by": stopped, "seqs_per_s": seqs_per_s, "last": run_avg}

    def export(self, path: str | Path, extra: dict | None = None) -> dict:
        path = Path(path)
        dt = DTYPES[self.cfg.export_dtype]
        if self.average is not None:  # the last weights beside the mean, which goes to `path`
            self.save_weights(path.with_name(path.name + "_last"), dt)
            last = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.average)
            self.save_weights(path, dt)
            with torch.no_grad():
                torch._foreach_copy_(self.params, last)
        else:
            self.save_weights(path, dt)
        size = (path / "model.safetensors").stat().st_size
        stats = {"steps": self.step, "total_steps": self.cfg.steps, "averaged_steps": self.average_n,
                 "train_wall_s": round(self.elapsed, 1),
                 "checkpoint_bytes": size, "export_dtype": self.cfg.export_dtype,
                 "final": self.history[-1] if self.history else None,
                 "drafter_config": self.export_config(), "train_config":
                 {k: v for k, v in asdict(self.cfg).items() if k not in ("deadline", "drafter")}}
        stats.update(extra or {})
        return stats
