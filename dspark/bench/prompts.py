"""Prompt files for the benchmarks: jsonl rows with a ``prompt`` string or a ``turns`` list."""

from __future__ import annotations

import pathlib

from dspark.prompt_file import prompt_rows


def default_prompts_path() -> pathlib.Path | None:
    """``../shared/data/dev_prompts.jsonl`` next to the repository, if present."""
    path = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "dev_prompts.jsonl"
    return path if path.is_file() else None


def load_prompts(path: str | pathlib.Path, num: int, category: str | None = None) -> list[str]:
    """The first ``num`` prompts of a jsonl file (``prompt``, or the first of ``turns``)."""
    out: list[str] = []
    for _, row, text in prompt_rows(path):
        if category is not None and row.get("category") != category:
            continue
        out.append(text)
        if len(out) >= num:
            break
    if not out:
        raise ValueError(f"no prompts in {path}" + (f" with category {category!r}" if category else ""))
    return out
