"""How fast `train-drafter` steps on this device, before a real training run is sized for it.

Run on a device in the repository root (PYTHONPATH=.): a randomly initialised target of a
named shape (no GGUF needed, so the run fits one small `run` call) and a fresh DSpark drafter
shaped like the shipped one (2 layers, block 8, Markov rank 32, 12,288-token draft vocabulary)
train on real token data for a few steps per setting. Prints one JSON line per setting: seconds
a step, sequences a second, first and last loss, peak GPU memory. Random target features make
the loss meaningless; the time and memory are what a real run pays.

    python3 scripts/device/train_speed.py DATA_DIR [--shape smollm2-135m] [--device cuda]
        [--settings 8:0,32:0,32:1]   # batch size : compiled loss (0/1)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from dspark.bench.roofline import random_model
from dspark.train.dataset import TokenDataset
from dspark.train.drafter_init import frequent_tokens, make_drafter_config, new_drafter
from dspark.train.trainer import TrainConfig, Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir")
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--settings", default="8:0,32:0,32:1")
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting (after 3 warm-up steps)")
    args = p.parse_args()
    dev = torch.device(args.device)
    data = TokenDataset(args.data_dir, max_len=1024)
    target = random_model(args.shape, dev, torch.bfloat16).requires_grad_(False)
    tc = target.config
    vocab = frequent_tokens(data, min(12288, tc.vocab_size), tc.vocab_size)
    for setting in args.settings.split(","):
        bs, compiled = (int(x) for x in setting.split(":"))
        dc = make_drafter_config(tc, num_layers=2, block_size=8, markov_rank=32, mask_token_id=16,
                                 draft_vocab_size=vocab.numel())
        drafter = new_drafter(dc, target, 0, vocab)
        cfg = TrainConfig(steps=args.steps + 3, batch_size=bs, anchors_per_seq=48, lr=2e-4, warmup=3,
                          dtype="bf16", device=args.device, save_every=0, log_every=1000, progress=False,
                          compile_loss=bool(compiled))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with tempfile.TemporaryDirectory() as out:
            tr = Trainer(target, drafter, data, cfg, out, pad_id=2)
            losses, t0 = [], time.perf_counter()
            for step in range(cfg.steps):
                if step == 3:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                parts = tr.train_step()
                losses.append(float(parts["loss"]))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            sec = (time.perf_counter() - t0) / args.steps
        print(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                          "shape": args.shape, "batch_size": bs, "compile_loss": bool(compiled),
                          "s_per_step": round(sec, 4), "seqs_per_s": round(bs / sec, 1),
                          "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                          "peak_gb": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
                          if dev.type == "cuda" else None}), flush=True)


if __name__ == "__main__":
    main()
