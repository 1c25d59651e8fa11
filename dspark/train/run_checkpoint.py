"""A training run's checkpoint folder, `<out>/ckpt/`: everything a resume needs, no pickle.

`drafter.safetensors` (fp32 weights), `optimizer.safetensors` (AdamW moments by parameter name),
`average.safetensors` (the running weight mean, when the run keeps one) and `state.json` (step,
wall time, history, AdamW step counts, the run's settings and drafter config). A save writes a
sibling `ckpt.tmp` and renames it over the old folder, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class RunCheckpoint:
    """What one checkpoint holds, as tensors and plain values."""

    state: dict  # step, elapsed_s, history, average_n, config, drafter_config, adam_steps
    drafter: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)  # by parameter name
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    average: dict[str, torch.Tensor] | None = None


def write_checkpoint(folder: Path, ck: RunCheckpoint) -> Path:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cpu = lambda t: t.detach().cpu().contiguous()  # noqa: E731
    save_file({k: cpu(v.float()) for k, v in ck.drafter.items()}, str(tmp / "drafter.safetensors"))
    moments = {f"{n}.exp_avg": cpu(v) for n, v in ck.exp_avg.items()}
    moments.update({f"{n}.exp_avg_sq": cpu(v) for n, v in ck.exp_avg_sq.items()})
    if moments:
        save_file(moments, str(tmp / "optimizer.safetensors"))
    if ck.average is not None:
        save_file({n: cpu(a) for n, a in ck.average.items()}, str(tmp / "average.safetensors"))
    (tmp / "state.json").write_text(json.dumps(ck.state) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def read_checkpoint(folder: Path, device: str) -> RunCheckpoint | None:
    """The checkpoint in `folder`, or None when there is none."""
    if not (folder / "state.json").exists():
        return None
    ck = RunCheckpoint(state=json.loads((folder / "state.json").read_text()),
                       drafter=load_file(str(folder / "drafter.safetensors"), device=device))
    if (folder / "optimizer.safetensors").exists():
        for key, v in load_file(str(folder / "optimizer.safetensors"), device=device).items():
            name, kind = key.rsplit(".", 1)
            (ck.exp_avg if kind == "exp_avg" else ck.exp_avg_sq)[name] = v
    if (folder / "average.safetensors").exists():
        ck.average = load_file(str(folder / "average.safetensors"), device=device)
    return ck
