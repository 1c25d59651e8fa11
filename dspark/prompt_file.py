"""Prompt files: jsonl rows with a `prompt` string or `turns` (strings or {"content"} messages).

One reader for every command (bench, bench serve, train-drafter, eval-drafter), so a bad line
gets the same error everywhere: the file, the line number and what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def prompt_rows(path: str | Path) -> Iterator[tuple[int, dict, str]]:
    """(line number, row, prompt text) for each non-blank line; ValueError names the bad line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}")
            text = row.get("prompt")
            if text is None and isinstance(row.get("turns"), list) and row["turns"]:
                first = row["turns"][0]
                text = first.get("content") if isinstance(first, dict) else first
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{line_no}: a row needs a non-empty 'prompt' string or a 'turns' list "
                                 "whose first entry is a string or a message with 'content'")
            yield line_no, row, text
