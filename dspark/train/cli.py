"""`dspark train-drafter` (eval-drafter and average-drafters: eval_cli.py).

train-drafter does everything from a prompts file, resumably, in one command:
  1. self-distillation data into <out>/data (skips shards already written),
  2. training with checkpoints in <out>/ckpt (resumes from them),
  3. export to <out>/final (DSpark layout, or EAGLE-3's with --kind eagle3) and <out>/train_stats.json.
--time-budget-minutes counts from the start of the command: data generation stops after
the shard in progress, training stops after the step in progress; both leave a resumable
state and training exports what it has. Run the same command again to continue.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from dspark.cli import check_at_least
from dspark.train.eval_cli import add_eval_parsers

# Flags of one --kind only. They default to None so that the other kind can tell them given (and
# refuse them: a run that silently trains something else than asked costs an hour); DSpark's
# defaults are filled in here, EAGLE-3's come from Eagle3TrainConfig.
DSPARK_FLAGS = {"init_from": None, "num_layers": 2, "block_size": 8, "markov_rank": 32, "target_layers": None,
                "mask_token_id": None, "anchors_per_seq": 32, "gamma": 4.0, "loss_weights": "0.1,0.9,1.0",
                "compile_loss": False}
EAGLE3_FLAGS = ("ttt_steps", "kl_weight")


def add_train_parsers(sub) -> None:
    t = sub.add_parser("train-drafter", help="self-distill data, train a DSpark drafter or EAGLE-3 head, export it")
    t.add_argument("--prompts", required=True, help="jsonl with 'prompt' (or 'turns') per line")
    t.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the file (default: all)")
    t.add_argument("--skip-prompts", type=int, default=0,
                   help="start after the file's first N prompts, e.g. those an earlier run used")
    t.add_argument("--out", required=True, help="run folder (data/, ckpt/, final/, train_stats.json)")
    t.add_argument("--data-dir", default=None, help="token shards (default: <out>/data)")
    t.add_argument("--model", default=None, help="target: HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    t.add_argument("--kind", default="dspark", choices=["dspark", "eagle3"],
                   help="dspark: a DSpark block drafter; eagle3: an EAGLE-3 head trained with training-time test "
                        "(exported in the published EAGLE-3 layout)")
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    g = t.add_argument_group("data generation")
    g.add_argument("--gen-batch-size", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped")
    g.add_argument("--sample-share", type=float, default=0.25, help="share of responses sampled at T=0.7")
    g.add_argument("--gen-backend", default="auto", choices=["auto", "engine", "dense", "hf"],
                   help="auto: the dense batched decoder on CUDA, our engine on CPU")
    g.add_argument("--shard-size", type=int, default=1024)
    g.add_argument("--data-only", action="store_true", help="stop after writing the data")
    m = t.add_argument_group("drafter", "flags marked DSpark or EAGLE-3 apply to that --kind only (the other "
                             "kind refuses them)")
    m.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                   help="DSpark: warm start from the weights, config and draft vocabulary of this drafter "
                        "checkpoint (the other drafter flags are then ignored); a run that resumes from "
                        "<out>/ckpt ignores it")
    m.add_argument("--num-layers", type=int, default=None, help="DSpark (default 2)")
    m.add_argument("--block-size", type=int, default=None, help="DSpark (default 8)")
    m.add_argument("--markov-rank", type=int, default=None, help="DSpark (default 32)")
    m.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    m.add_argument("--target-layers", default=None, help="DSpark: comma list (default: 5 spread from 1 to L-3; "
                   "an EAGLE-3 head reads layers 2, L/2 and L-3)")
    m.add_argument("--draft-vocab", type=int, default=None,
                   help="reduced draft vocabulary: the N most frequent tokens of the responses and all "
                        "--prompts (default: the full vocabulary)")
    m.add_argument("--mask-token-id", type=int, default=None,
                   help="DSpark (default: <empty_output> (16) for SmolLM2)")
    m.add_argument("--ttt-steps", type=int, default=None,
                   help="EAGLE-3: training-time-test steps, the head fed its own outputs K-1 times (default 3)")
    m.add_argument("--kl-weight", type=float, default=None,
                   help="EAGLE-3: weight of KL(target || head) over the draft vocabulary beside the CE on the "
                        "data's tokens (default 1.0; 0: CE only)")
    o = t.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=2000)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    o.add_argument("--grad-accum", type=int, default=1)
    o.add_argument("--anchors-per-seq", type=int, default=None, help="DSpark (default 32)")
    o.add_argument("--lr", type=float, default=6e-4)
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--warmup", type=int, default=100)
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--gamma", type=float, default=None, help="DSpark: position weights exp(-k/gamma) (default 4)")
    o.add_argument("--loss-weights", default=None, metavar="CE,L1,BCE",
                   help="DSpark: weights of the loss parts (default: DSpark's, 0.1,0.9,1.0)")
    o.add_argument("--max-len", type=int, default=1024, help="truncate training sequences")
    o.add_argument("--length-groups", type=int, default=32,
                   help="batch sequences of like length: each epoch's shuffled order is sorted by length in "
                        "runs of this many batches (1: plain random batches)")
    o.add_argument("--average-from", type=int, default=None, metavar="STEP",
                   help="export the mean of the weights after every step from STEP on (the last weights "
                        "go to <out>/final_last)")
    o.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (0: only when stopping)")
    o.add_argument("--log-every", type=int, default=10)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--time-budget-minutes", type=float, default=None)
    o.add_argument("--lr-by-time", action="store_true",
                   help="with --time-budget-minutes: the cosine ends when the budget does if that comes before "
                        "--steps (a run stopped by the clock still anneals)")
    o.add_argument("--export-dtype", default="bf16", choices=["fp32", "bf16"])
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--cache-features", action="store_true",
                   help="keep target features in RAM after their first use (bf16, ~2*(m+1)*hidden bytes a token)")
    o.add_argument("--compile-loss", action="store_true", default=None,
                   help="DSpark: torch.compile the loss (needs a C++ compiler on CPU; ~25 s once, then a ~2.3x "
                        "faster loss)")
    o.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="cache target features in memory-mapped files under DIR instead of RAM: they survive "
                        "restarts, so a resumed run skips the target for sequences it has seen")
    t.set_defaults(func=cmd_train)

    add_eval_parsers(sub)


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _loss_weights(text: str) -> list[float]:
    """'0.1,0.9,1.0' -> [0.1, 0.9, 1.0]: three finite weights >= 0, not all of CE and L1 zero."""
    try:
        w = [float(x) for x in text.split(",")]
    except ValueError:
        w = []
    if len(w) != 3 or not all(math.isfinite(x) and x >= 0 for x in w) or w[0] + w[1] == 0:
        raise ValueError(f"--loss-weights wants CE,L1,BCE: three numbers >= 0 with CE + L1 > 0, got {text!r}")
    return w


def _kind_flags(args: argparse.Namespace) -> None:
    """Refuse the flags of the other --kind (ValueError naming them); fill in DSpark's defaults."""
    other = EAGLE3_FLAGS if args.kind == "dspark" else tuple(DSPARK_FLAGS)
    given = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to --kind {args.kind}"
                         f" ({'EAGLE-3' if args.kind == 'dspark' else 'DSpark'} flags); drop "
                         f"{'it' if len(given) == 1 else 'them'}")
    if args.kind == "dspark":
        for k, v in DSPARK_FLAGS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.drafters.checkpoint import load_drafter
    from dspark.train.data import GenSettings, generate_dataset
    from dspark.train.dataset import TokenDataset
    from dspark.train.drafter_init import DTYPES, checkpoint_bytes, load_target, new_eagle3_head
    from dspark.train.eagle3_trainer import Eagle3TrainConfig, Eagle3Trainer
    from dspark.train.trainer import TrainConfig, Trainer

    _kind_flags(args)
    check_at_least(args, num_prompts=1, skip_prompts=0, gen_batch_size=1, max_new_tokens=1, max_prompt_tokens=1,
                   shard_size=1, num_layers=1, block_size=1, markov_rank=1, intermediate_size=1, draft_vocab=1,
                   steps=1, batch_size=1, grad_accum=1, anchors_per_seq=1, warmup=0, max_len=2, save_every=0,
                   log_every=1, length_groups=1, average_from=1, ttt_steps=1)
    eagle3 = args.kind == "eagle3"
    weights = None if eagle3 else _loss_weights(args.loss_weights)
    if not 0 <= args.lr < float("inf"):  # 0 is allowed: it keeps the start weights (a dry run of the loop)
        raise ValueError(f"--lr must be a number >= 0, got {args.lr}")
    if args.gamma is not None and not args.gamma > 0:
        raise ValueError(f"--gamma must be > 0, got {args.gamma}")
    if args.kl_weight is not None and not (math.isfinite(args.kl_weight) and args.kl_weight >= 0):
        raise ValueError(f"--kl-weight must be a number >= 0, got {args.kl_weight}")
    if not 0.0 <= args.sample_share <= 1.0:
        raise ValueError(f"--sample-share must be in [0, 1], got {args.sample_share}")
    if args.time_budget_minutes is not None and args.time_budget_minutes <= 0:
        raise ValueError(f"--time-budget-minutes must be > 0, got {args.time_budget_minutes}")
    if args.lr_by_time and args.time_budget_minutes is None:
        raise ValueError("--lr-by-time needs --time-budget-minutes")
    if args.target_layers and not args.init_from:  # checked before data generation too
        from dspark.models.loader import load_config, resolve_model_folder

        _layer_ids(args.target_layers, load_config(resolve_model_folder(args.model))["num_hidden_layers"])
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        # checked before data generation, which may take an hour
        print(f"error: --init-from {args.init_from}: no drafter config.json there", file=sys.stderr)
        return 2
    t_start = time.time()
    deadline = t_start + 60 * args.time_budget_minutes if args.time_budget_minutes else None
    device = _device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    gs = GenSettings(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                     sample_share=args.sample_share, seed=args.seed, shard_size=args.shard_size,
                     batch_size=args.gen_batch_size, backend=args.gen_backend)
    gen_stats = generate_dataset(args.prompts, data_dir, args.num_prompts, args.model, device,
                                 DTYPES[dtype], gs, progress=not args.no_progress, deadline=deadline,
                                 skip_prompts=args.skip_prompts)
    print(json.dumps({"data": gen_stats}), file=sys.stderr)
    if gen_stats.get("incomplete"):
        print("time budget reached during data generation; run the same command again to continue",
              file=sys.stderr)
        return 0
    if args.data_only:
        return 0
    target, tok = load_target(args.model, device, DTYPES[dtype])
    data = TokenDataset(data_dir, max_len=args.max_len)
    if eagle3:
        drafter = new_eagle3_head(target, _draft_vocab(args, target, tok, data), args.intermediate_size, args.seed)
    elif args.init_from:
        drafter = load_drafter(args.init_from, target, torch.float32, "cpu")
        print(f"warm start from {args.init_from}: its architecture and draft vocabulary replace the drafter "
              "flags", file=sys.stderr)
    else:
        drafter = _new_drafter(args, target, tok, data)
    size = checkpoint_bytes(drafter, DTYPES[args.export_dtype])
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, "
          f"{size / 1e6:.1f} MB as {args.export_dtype}; data: {len(data)} sequences, {data.num_tokens()} tokens; "
          f"device {device}, {dtype}", file=sys.stderr)
    if size > 25e6:
        print("warning: the exported checkpoint will exceed 25 MB", file=sys.stderr)
    common = dict(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                  min_lr_ratio=args.min_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay,
                  grad_clip=args.grad_clip, dtype=dtype, device=device, seed=args.seed, save_every=args.save_every,
                  log_every=args.log_every, max_len=args.max_len, length_groups=args.length_groups,
                  average_from=args.average_from, deadline=deadline, export_dtype=args.export_dtype,
                  progress=not args.no_progress, cache_features=args.cache_features,
                  feature_cache_dir=args.feature_cache, lr_by_time=args.lr_by_time)
    if eagle3:
        given = {k: getattr(args, k) for k in EAGLE3_FLAGS if getattr(args, k) is not None}
        cfg = Eagle3TrainConfig(**common, **given)
    else:
        cfg = TrainConfig(**common, anchors_per_seq=args.anchors_per_seq, gamma=args.gamma, loss_weights=weights,
                          compile_loss=args.compile_loss)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    tr = (Eagle3Trainer if eagle3 else Trainer)(target, drafter, data, cfg, out, pad_id=pad)
    if tr.cache is not None:
        where = f"on disk in {args.feature_cache}" if args.feature_cache else "in RAM"
        print(f"feature cache: {tr.cache.nbytes / 1e9:.2f} GB {where}, {int(tr.cache.done.sum())} of "
              f"{len(data)} sequences filled", file=sys.stderr)
    if tr.load_checkpoint():
        print(f"resumed from {out / 'ckpt'} at step {tr.step}", file=sys.stderr)
        if tr.resume_changes:
            changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in tr.resume_changes.items())
            print(f"warning: the checkpoint was trained with other settings: {changed}", file=sys.stderr)
    res = tr.fit()
    extra = {"completed": tr.step >= cfg.steps, "stopped_by": res["stopped_by"],
             "train_seqs_per_s": round(res["seqs_per_s"], 3) if res["seqs_per_s"] else None,
             "smoothed_last": {k: round(v, 4) for k, v in res["last"].items()},
             "data": {"sequences": len(data), "tokens": data.num_tokens(), "dir": str(data_dir),
                      "generation": gen_stats},
             "init_from": args.init_from,
             "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(),
             "command_wall_s": round(time.time() - t_start, 1)}
    if device.startswith("cuda"):
        extra["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    stats = tr.export(out / "final", extra)
    text = json.dumps(stats, indent=2) + "\n"
    (out / "train_stats.json").write_text(text)
    (out / "final" / "train_stats.json").write_text(text)
    print(json.dumps({k: stats[k] for k in ("steps", "train_wall_s", "completed", "stopped_by", "final",
                                            "train_seqs_per_s", "checkpoint_bytes")} |
                     {"cuda_peak_mem_gb": extra.get("cuda_peak_mem_gb")}))
    return 0


def _layer_ids(text: str, num_layers: int) -> list[int]:
    """--target-layers '1,5,9' -> [1, 5, 9]: distinct layer indices of a target with num_layers."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = []
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"--target-layers wants distinct comma-separated layer indices in [0, {num_layers - 1}] "
                         f"(the target has {num_layers} layers), got {text!r}")
    return ids


def _new_drafter(args: argparse.Namespace, target, tok, data):
    """A fresh drafter shaped by the command's drafter flags."""
    from dspark.train.drafter_init import default_mask_token, make_drafter_config, new_drafter

    layer_ids = _layer_ids(args.target_layers, target.config.num_hidden_layers) if args.target_layers else None
    dc = make_drafter_config(target.config, num_layers=args.num_layers, block_size=args.block_size,
                             markov_rank=args.markov_rank, layer_ids=layer_ids,
                             intermediate_size=args.intermediate_size,
                             mask_token_id=args.mask_token_id if args.mask_token_id is not None
                             else default_mask_token(tok), draft_vocab_size=args.draft_vocab)
    return new_drafter(dc, target, args.seed, _draft_vocab(args, target, tok, data))


def _draft_vocab(args: argparse.Namespace, target, tok, data):  # noqa: ANN202 - a tensor or None
    """The --draft-vocab most frequent tokens of the responses and prompts (sorted ids), or None."""
    if not args.draft_vocab:
        return None
    from dspark.train.data import read_prompts
    from dspark.train.drafter_init import frequent_tokens

    texts = [p["messages"][0]["content"] for p in read_prompts(args.prompts)]
    extra = tok(texts, add_special_tokens=False)["input_ids"]
    return frequent_tokens(data, args.draft_vocab, target.config.vocab_size, extra)
