"""Copy a DSpark drafter with a wider draft vocabulary, untrained: does the reduced vocabulary cap
its acceptance?

    .venv/bin/python scripts/widen_draft_vocab.py SRC OUT [--init zero|mean] [--tokens FILE]

The draft head reads rows of the target's LM head, so a token added to ``draft_to_target`` gets
its logit from the target's own row; only the Markov head's output rows (W2) are per draft token.
New W2 rows start at zero (no bigram bias) or at the mean of the trained rows (the bias an average
token gets). Without --tokens every target token is added (the full vocabulary); with it, the
whitespace-separated target ids in FILE that the drafter lacks, in that order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def widen(src: Path, out: Path, init: str, tokens: list[int] | None) -> int:
    """Write the widened copy to out; returns its draft vocabulary size."""
    sd = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    d2t = sd["draft_to_target"]
    have = set(d2t.tolist())
    wanted = tokens if tokens is not None else range(cfg["vocab_size"])
    new = list(dict.fromkeys(t for t in wanted if t not in have))
    w2 = sd["markov_head.markov_w2.weight"]
    rows = (torch.zeros(len(new), w2.shape[1]) if init == "zero"
            else w2.float().mean(0, keepdim=True).expand(len(new), -1))
    sd["markov_head.markov_w2.weight"] = torch.cat([w2, rows.to(w2.dtype)]).contiguous()
    sd["draft_to_target"] = torch.cat([d2t, torch.tensor(new, dtype=d2t.dtype)])
    cfg["draft_vocab_size"] = len(sd["draft_to_target"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg["draft_vocab_size"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--init", choices=["zero", "mean"], default="mean")
    ap.add_argument("--tokens", type=Path, default=None, help="target ids to add (default: every one)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.read_text().split()] if args.tokens else None
    print(f"{args.out}: draft vocabulary {widen(args.src, args.out, args.init, tokens)}")


if __name__ == "__main__":
    main()
