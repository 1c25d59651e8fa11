"""Prompt files for the benchmarks: jsonl rows with a ``prompt`` string or a ``turns`` list."""

from __future__ import annotations

import json
import pathlib


def default_prompts_path() -> pathlib.Path | None:
    """``../shared/data/dev_prompts.jsonl`` next to the repository, if present."""
    path = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "dev_prompts.jsonl"
    return path if path.is_file() else None


def load_prompts(path: str | pathlib.Path, num: int, category: str | None = None) -> list[str]:
    """The first ``num`` prompts of a jsonl file (``prompt``, or the first of ``turns``)."""
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}")
            if category is not None and row.get("category") != category:
                continue
            text = row["prompt"] if "prompt" in row else (row.get("turns") or [None])[0]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: a row needs a 'prompt' string or a 'turns' list")
            out.append(text)
            if len(out) >= num:
                break
    if not out:
        raise ValueError(f"no prompts in {path}" + (f" with category {category!r}" if category else ""))
    return out


def cycle_prompts(prompts: list[str], num: int) -> list[str]:
    """Exactly ``num`` prompts: ``prompts`` repeated in order as often as needed."""
    if not prompts:
        raise ValueError("no prompts to cycle")
    return [prompts[i % len(prompts)] for i in range(num)]
