"""Prompt files: jsonl rows with a `prompt` string, `turns` (user turns: strings or {"content"}
messages, the first is the prompt), or `messages` (a whole conversation in OpenAI's form ending
with a user message; the assistant replies in it are given, only the last reply is the model's).

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
            if "messages" in row:  # checked once here; row_messages hands the checked list on
                row["messages"] = conversation(row["messages"], f"{path}:{line_no}")
                yield line_no, row, next(m["content"] for m in row["messages"] if m["role"] == "user")
                continue
            text = row.get("prompt")
            if text is None and isinstance(row.get("turns"), list) and row["turns"]:
                first = row["turns"][0]
                text = first.get("content") if isinstance(first, dict) else first
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{line_no}: a row needs a non-empty 'prompt' string, a 'turns' list "
                                 "whose first entry is a string or a message with 'content', or 'messages'")
            yield line_no, row, text


ROLES = ("system", "user", "assistant")


def conversation(messages: object, where: str) -> list[dict]:
    """A row's ``messages`` checked: [{"role", "content"}] with roles from ROLES, non-empty string
    contents, at least one user message, ending with a user message (what the model answers)."""
    ok = isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) and m["content"]
        for m in messages)
    if not ok:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": one of {', '.join(ROLES)}, "
                         "\"content\": a non-empty string}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last of 'messages' must be a user message (the one to answer), "
                         f"got {messages[-1]['role']!r}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def row_messages(row: dict, text: str) -> list[dict]:
    """The chat messages a row from :func:`prompt_rows` asks the model to answer: its (checked)
    conversation, or one user turn."""
    return row["messages"] if "messages" in row else [{"role": "user", "content": text}]
