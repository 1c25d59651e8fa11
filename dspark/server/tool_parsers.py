"""Tool calls a model writes in its own format, for tool_choice "auto" (vLLM's
--enable-auto-tool-choice --tool-call-parser). Hermes style, as Qwen2.5, Qwen3 and Hermes 2 Pro
write them: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks after optional text."""

from __future__ import annotations

import json
import re

from dspark.server.tools import new_call_id

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + "|" + re.escape(START) + r"(.*)\Z", re.DOTALL)
PARSERS = ("hermes",)


def _call(body: str) -> dict | None:
    """An OpenAI tool call from one block's JSON, or None when it is not {"name", "arguments"}."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def split_tool_calls(text: str) -> tuple[str | None, list[dict] | None]:
    """A whole output as (content, tool calls): the text before the first block (None when blank)
    and one call per block (a last block may be left open by max_tokens); (text, None) when it
    calls nothing or a block is not a valid call, as vLLM's parser answers."""
    start = text.find(START)
    if start < 0:
        return text, None
    calls = []
    for m in _BLOCK.finditer(text, start):
        call = _call(m.group(1) if m.group(1) is not None else m.group(2))
        if call is None:
            return text, None
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def _held_back(text: str) -> int:
    """Characters at the end of text that could begin START (wait for more before sending them)."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """One streamed output: its text goes out as content until a block opens, then each call goes
    out whole when its block closes (or the output ends); text after the first call is dropped,
    as in the whole response. A block that is not a valid call goes out as content."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_block = False
        self.called = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, calls to send) after the output's next text."""
        self.buf += text
        content, calls = "", []
        while True:
            if not self.in_block:
                i = self.buf.find(START)
                if i < 0:
                    cut = len(self.buf) - (0 if final else _held_back(self.buf))
                    plain, self.buf = self.buf[:cut], self.buf[cut:]
                    content += "" if self.called else plain
                    return content, calls
                content += "" if self.called else self.buf[:i]
                self.buf, self.in_block = self.buf[i + len(START):], True
            j = self.buf.find(END)
            if j < 0 and not final:
                return content, calls
            body = self.buf if j < 0 else self.buf[:j]
            self.buf, self.in_block = ("" if j < 0 else self.buf[j + len(END):]), False
            call = _call(body)
            if call is None:
                content += START + body + ("" if j < 0 else END)
            else:
                calls.append(call)
                self.called = True
            if j < 0:
                return content, calls
