"""SmolLM2-135M-Instruct's own function in a 2B shape: a memory-bound target that speaks real text.

    .venv/bin/python scripts/widen.py --out DIR [--types Q4_0 Q4_K_M Q8_0] [--force]
    .venv/bin/python scripts/widen.py --compare ORIGINAL.gguf DIR/target-F16.gguf ... [--json OUT]

Writes into DIR:

- ``target-F16.gguf``: the default model (its GGUF, de-quantized) widened to hidden 2048, MLP
  8192, 32 query / 8 KV heads of 64, its 30 layers and 49,152-token vocabulary, by zero-padding
  (dspark/models/widen.py says how; the function is the original's up to rounding), tokenizer and
  chat template copied from the original GGUF;
- ``target-Q4_0.gguf``, ``target-Q4_K_M.gguf``, ``target-Q8_0.gguf``: that file through llama.cpp's
  own ``llama-quantize`` (real llama.cpp layouts: Q4_K_M carries Q6_K parts);
- ``drafter/``: the shipped DSpark drafter widened the same way (2 layers of 2048, MLP 8192, float32
  so the widening stays exact), whose drafts on the widened target equal today's on the original.

llama-quantize is looked up in ``--llamacpp-bin``, ``$LLAMACPP_DIR/build/bin`` or
``~/.cache/dspark/llama.cpp/build/bin``; when it is absent scripts/build_llamacpp.sh builds it.
Files that exist are kept unless --force. Model files never belong in the repository.

--compare: greedy text of each model (``default`` for the default model) on --num-prompts held-out
chat prompts (every len/N-th line of --prompts, so every category), fp32, no drafter, temperature 0,
--max-tokens each, one model in memory at a time; prints how many texts equal the first model's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dspark.models.widen import WIDE_2B, widen_drafter, widen_gguf  # noqa: E402

QUANT_TYPES = ("Q4_0", "Q4_K_M", "Q8_0")


def log(msg: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[widen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llamacpp_bin(explicit: str | None) -> pathlib.Path:
    """The folder holding llama-quantize, built by scripts/build_llamacpp.sh when absent."""
    if explicit:
        return pathlib.Path(explicit)
    root = pathlib.Path(os.environ.get("LLAMACPP_DIR", pathlib.Path.home() / ".cache" / "dspark" / "llama.cpp"))
    bin_dir = root / "build" / "bin"
    if not (bin_dir / "llama-quantize").is_file():
        log("llama-quantize not found: running scripts/build_llamacpp.sh (about 10 minutes on 2 cores)")
        out = subprocess.run(["bash", str(REPO / "scripts" / "build_llamacpp.sh")], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        bin_dir = pathlib.Path(out.strip().splitlines()[-1])
    return bin_dir


def compare(models: list[str], prompts_file: str, num_prompts: int, max_tokens: int, json_out: str | None) -> None:
    """Greedy fp32 text of each model on the same prompts, and how many equal the first model's."""
    import gc

    from dspark.config import SamplingParams
    from dspark.llm import LLM

    lines = [json.loads(x) for x in pathlib.Path(prompts_file).read_text().splitlines() if x.strip()]
    step = max(1, len(lines) // num_prompts)
    picked = lines[::step][:num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results: dict[str, dict] = {}
    for model in models:
        t0 = time.perf_counter()
        llm = LLM(None if model == "default" else model, drafter="none", dtype="float32", device="cpu")
        outs = llm.generate([[{"role": "user", "content": p["prompt"]}] for p in picked], params)
        texts = [o.text for o in outs]
        ids = [list(o.token_ids) for o in outs]
        ref = results[models[0]] if results else {"text": texts, "ids": ids}
        same = sum(a == b for a, b in zip(texts, ref["text"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(ids, ref["ids"])]
        results[model] = {"text": texts, "ids": ids, "identical": same, "common_prefix_tokens": prefix,
                          "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{model}: {same}/{len(picked)} texts identical to {models[0]}; common token prefixes {prefix}")
        del llm, outs
        gc.collect()
    summary = {"prompts": [p["id"] for p in picked], "max_tokens": max_tokens, "dtype": "float32",
               "reference": models[0], "models": results}
    if json_out:
        pathlib.Path(json_out).write_text(json.dumps(summary, indent=1) + "\n")
    for model, r in results.items():
        print(f"{model}\t{r['identical']}/{len(picked)} identical\tprefixes {r['common_prefix_tokens']}")


def main() -> None:
    from dspark.engine.proposers import default_drafter
    from dspark.models.loader import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (outside the repository)")
    ap.add_argument("--compare", nargs="+", metavar="MODEL", help="compare greedy text of these models instead")
    ap.add_argument("--prompts", default=str(REPO / "data" / "heldout_chat.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="--compare: write the texts and counts here")
    ap.add_argument("--src", default=None, help="source GGUF (default: the default model's)")
    ap.add_argument("--drafter", default=None, help="DSpark drafter folder to widen (default: the shipped one)")
    ap.add_argument("--types", nargs="*", default=list(QUANT_TYPES), help="llama-quantize types to write")
    ap.add_argument("--llamacpp-bin", default=None, help="folder with llama-quantize")
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    for key, value in WIDE_2B.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.prompts, args.num_prompts, args.max_tokens, args.json)
        return
    if not args.out:
        ap.error("--out is required (or --compare)")

    out = pathlib.Path(args.out).expanduser().resolve()
    if out == REPO or REPO in out.parents:
        sys.exit(f"--out {out} lies inside the repository; model files are never committed, write them elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    src = args.src or default_model_path()
    shape = {k: getattr(args, k) for k in WIDE_2B}
    bin_dir = llamacpp_bin(args.llamacpp_bin) if args.types else None  # build first: fail before hours of work

    f16 = out / "target-F16.gguf"
    if args.force or not f16.is_file():
        log(f"widening {src} -> {f16}")
        tmp = f16.with_suffix(".gguf.tmp")
        wd = widen_gguf(src, tmp, **shape, out_type="F16", name="SmolLM2 135M Instruct widened to 2B shape",
                        progress=log)
        tmp.rename(f16)
    else:
        import gguf

        from dspark.models.widen import gguf_widening

        wd = gguf_widening(gguf.GGUFReader(src), **shape)
        log(f"kept {f16}")

    for qtype in args.types:
        dst = out / f"target-{qtype}.gguf"
        if dst.is_file() and not args.force:
            log(f"kept {dst}")
            continue
        log(f"llama-quantize {qtype} -> {dst}")
        tmp = dst.with_suffix(".gguf.tmp")
        with open(out / f"quantize-{qtype}.log", "w") as qlog:  # llama-quantize lists every tensor
            done = subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(tmp), qtype, str(args.threads)],
                                  stdout=qlog, stderr=subprocess.STDOUT)
        if done.returncode:
            sys.exit(f"llama-quantize {qtype} failed ({done.returncode}); see {out / f'quantize-{qtype}.log'}")
        tmp.rename(dst)

    drafter_src = pathlib.Path(args.drafter or default_drafter())
    drafter_dst = out / "drafter"
    if args.force or not (drafter_dst / "model.safetensors").is_file():
        import torch

        log(f"widening drafter {drafter_src} -> {drafter_dst}")
        widen_drafter(drafter_src, drafter_dst, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                      kv_heads=args.kv_heads, target_hidden=wd.hidden, new_target_hidden=wd.new_hidden,
                      dtype=torch.float32)
    else:
        log(f"kept {drafter_dst}")

    info = {"source": str(src), "drafter_source": str(drafter_src), "shape": shape,
            "original": {"hidden": wd.hidden, "intermediate": wd.intermediate, "heads": wd.heads,
                         "kv_heads": wd.kv_heads, "head_dim": wd.head_dim},
            "files": {p.name: p.stat().st_size for p in sorted(out.glob("target-*.gguf"))}}
    (out / "widen.json").write_text(json.dumps(info, indent=2) + "\n")
    for name, size in info["files"].items():
        print(f"{out / name}\t{size / 2**20:.0f} MiB")
    print(f"{drafter_dst}\t{sum(p.stat().st_size for p in drafter_dst.iterdir()) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
