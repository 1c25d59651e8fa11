"""Weight averaging of drafters (a "model soup"): the weighted element-wise mean of exported
drafter folders that share one architecture and draft vocabulary.

A short CPU run ends with its learning rate still high; the mean of its export and the weights
it warm-started from has measured better than either (drafters/README.md), so the shipped
drafter is built this way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.atomic import atomic_path
from dspark.models.drafters.checkpoint import read_drafter_folder


def normalised(weights: list[float] | None, n: int) -> list[float]:
    """Weights scaled to sum to 1 (None: equal). Refuses a count other than n, or a weight that is
    negative or not finite, or a set that sums to zero."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n or not all(math.isfinite(x) and x >= 0 for x in weights) or sum(weights) <= 0:
        raise ValueError(f"weights: {n} numbers >= 0 wanted (one per drafter, not all zero), got {weights}")
    return [x / sum(weights) for x in weights]


def parse_weights(text: str | None, n: int) -> list[float]:
    """'1,3' -> [0.25, 0.75] for n = 2 drafters; None -> equal weights."""
    if text is None:
        return normalised(None, n)
    try:
        w = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--weights wants comma-separated numbers, got {text!r}") from None
    return normalised(w, n)


def average_drafters(paths: list[str | Path], out: str | Path, weights: list[float] | None = None) -> dict:
    """Write the weighted mean of the drafters at `paths` to `out` (a new or empty folder).

    Floating tensors are averaged in float32 and stored in the first drafter's dtype; integer
    tensors (the draft-to-target map) must be equal in all. Returns what was done, also written
    to out/average.json.
    """
    folders = [Path(p) for p in paths]
    if len(folders) < 2:
        raise ValueError("averaging needs at least two drafter folders")
    weights = normalised(weights, len(folders))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder: pick a new one (nothing is overwritten)")
    loaded = [read_drafter_folder(f) for f in folders]
    cfg0, sd0 = loaded[0]
    for folder, (cfg, sd) in zip(folders[1:], loaded[1:]):
        diff = sorted(k for k in set(cfg) | set(cfg0) if cfg.get(k) != cfg0.get(k))
        if diff:
            raise ValueError(f"{folder} differs from {folders[0]} in config {', '.join(diff)}: only drafters "
                             "of one architecture can be averaged")
        if set(sd) != set(sd0):
            raise ValueError(f"{folder} holds other tensors than {folders[0]}: "
                             f"{sorted(set(sd) ^ set(sd0))[:5]}")
        for k, v in sd.items():
            if v.shape != sd0[k].shape:
                raise ValueError(f"{folder}: {k} has shape {tuple(v.shape)}, {folders[0]} {tuple(sd0[k].shape)}")
            if not v.is_floating_point() and not torch.equal(v, sd0[k]):
                raise ValueError(f"{folder}: {k} differs from {folders[0]}'s (another draft vocabulary?)")
    mean = {}
    for k, v0 in sd0.items():
        if v0.is_floating_point():
            acc = sum(w * sd[k].float() for w, (_, sd) in zip(weights, loaded))
            mean[k] = acc.to(v0.dtype).contiguous()
        else:
            mean[k] = v0
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(mean, str(tmp))
    (out / "config.json").write_text(json.dumps(cfg0, indent=2) + "\n")
    record = {"inputs": [str(f) for f in folders], "weights": [round(w, 6) for w in weights],
              "tensors": len(mean), "bytes": (out / "model.safetensors").stat().st_size}
    (out / "average.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
