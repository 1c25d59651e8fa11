"""Plain decoding speed of a random llama whose layer projections a GGUF stores as Q4_K (as a
Q4_K_M file stores most of them) or Q8_0, the file's blocks kept (`--quantization auto`) against
the same weights dense (`none`). No such real file is available offline; speed depends on the
shapes, not on the weights' values.

    .venv/bin/python scripts/kept_blocks_speed.py [--kind Q4_K|Q8_0] [--hidden 2048] [--intermediate 5632]
        [--layers 8] [--tokens 64]

Writes the file with the test suite's GGUF writer and Q4_K encoder (tests/), then runs
`dspark bench --methods ar` on it once per mode and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="Q4_K", choices=["Q4_K", "Q8_0"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        run(args, pathlib.Path(folder))


def run(args: argparse.Namespace, tmp: pathlib.Path) -> None:
    from gguf import GGMLQuantizationType as T
    from test_loader import _tiny
    from test_quant import _write_quantized_gguf

    model = _tiny("llama", hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4)
    src = tmp / "model.gguf"
    _write_quantized_gguf(src, model, T[args.kind])
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "hi " * (8 + i)}) + "\n" for i in range(4)))
    for mode in ("auto", "none"):
        cmd = [sys.executable, "-m", "dspark.cli", "bench", "--model", str(src), "--methods", "ar", "--no-chat",
               "--prompts", str(prompts), "--max-tokens", str(args.tokens), "--quantization", mode,
               "--dtype", "float32"]
        env = {**os.environ, "DSPARK_CACHE_DIR": str(tmp / "c")}
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        report = json.loads(out.stdout)
        print(f"--quantization {mode}: {report['methods']['ar']['decode_tok_s']} tok/s")


if __name__ == "__main__":
    main()
