"""Tool calls a model writes in its own format, for tool_choice "auto" (vLLM's
--enable-auto-tool-choice --tool-call-parser NAME). Each parser reads a whole output (`split`)
and streams one (`stream()`, fed the output's text as it comes, giving content and call deltas),
as tools.ToolCalling does for tool_choice "required" and named functions:

- hermes (Qwen2.5, Qwen3, Hermes 2 Pro): <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  blocks after optional text;
- llama3_json (Llama 3.1-3.3): the whole output is {"name": ..., "parameters": {...}} objects,
  separated by ";", optionally after <|python_tag|>.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dspark.server.tools import BufferedCalls, indexed, tool_call


def _call(obj: Any, args_key: str) -> dict | None:
    """An OpenAI tool call from a parsed {"name", args_key} object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    try:
        return tool_call(obj["name"], json.dumps(obj.get(args_key, {}), ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _held_back(text: str, marker: str) -> int:
    """Characters at the end of text that could begin marker (wait for more before sending them)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def calls_finish(text: str, engine_finish: str | None) -> str:
    """An output in which a parser found calls ends with "tool_calls", as vLLM's "auto" answers."""
    return "tool_calls"


class HermesParser:
    """<tool_call> blocks: the text before the first is the content, each block one call."""

    finish_reason = staticmethod(calls_finish)

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + "|" + re.escape(START) + r"(.*)\Z", re.DOTALL)

    def split(self, text: str) -> tuple[str | None, list[dict] | None]:
        """A whole output as (content, tool calls): the text before the first block (None when
        blank) and one call per block (a last block may be left open by max_tokens); (text, None)
        when it calls nothing or a block is not a valid call, as vLLM's parser answers."""
        start = text.find(self.START)
        if start < 0:
            return text, None
        calls = []
        for m in self._BLOCK.finditer(text, start):
            call = _call(_loads(m.group(1) if m.group(1) is not None else m.group(2)), "arguments")
            if call is None:
                return text, None
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def stream(self) -> HermesStream:
        return HermesStream()


class HermesStream:
    """One streamed output: its text goes out as content until a block opens, then each call goes
    out whole when its block closes (or the output ends); text after the first call is dropped,
    as in the whole response. A block that is not a valid call goes out as content."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_block = False
        self.sent = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, call deltas to send) after the output's next text."""
        content, calls = self._read(text, final)
        deltas = indexed(calls, self.sent)
        self.sent += len(calls)
        return content, deltas

    def _read(self, text: str, final: bool) -> tuple[str, list[dict]]:
        start, end = HermesParser.START, HermesParser.END
        self.buf += text
        content, calls = "", []
        while True:
            if not self.in_block:
                i = self.buf.find(start)
                if i < 0:
                    cut = len(self.buf) - (0 if final else _held_back(self.buf, start))
                    plain, self.buf = self.buf[:cut], self.buf[cut:]
                    content += "" if self.sent or calls else plain
                    return content, calls
                content += "" if self.sent or calls else self.buf[:i]
                self.buf, self.in_block = self.buf[i + len(start):], True
            j = self.buf.find(end)
            if j < 0 and not final:
                return content, calls
            body = self.buf if j < 0 else self.buf[:j]
            self.buf, self.in_block = ("" if j < 0 else self.buf[j + len(end):]), False
            call = _call(_loads(body), "arguments")
            if call is None:
                content += start + body + ("" if j < 0 else end)
            else:
                calls.append(call)
            if j < 0:
                return content, calls


class Llama3JsonParser:
    """Llama 3's JSON tool calls: an output that is nothing but {"name", "parameters"} objects."""

    finish_reason = staticmethod(calls_finish)

    TAG = "<|python_tag|>"

    def split(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(None, calls) when the whole output is calls, else (text, None)."""
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, None
            call = _call(obj, "parameters" if "parameters" in obj else "arguments") if isinstance(obj, dict) else None
            if call is None:
                return text, None
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)


class Llama3JsonStream:
    """One streamed output: once its first characters show a call (a "{" or the python tag), the
    output is held and read whole when it ends; any other output streams as content."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        self.parser, self.held = parser, BufferedCalls(parser)
        self.text = False  # decided: the output is plain text

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.text:
            return text, []
        head = (self.held.buf + text).lstrip()
        if head and not (head.startswith("{") or self.parser.TAG.startswith(head[:len(self.parser.TAG)])):
            self.text = True
            out, self.held.buf = self.held.buf + text, ""
            return out, []
        return self.held.feed(text, final)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    """The tool-call parser called name (a ValueError naming the choices for another)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()
