"""Reads tool_choice "required" output, a JSON list of {"name": ..., "parameters": {...}}, as it
grows: each call's name once it is whole and its parameters' text as it comes, so a stream can
send a call's arguments piece by piece (as vLLM streams them) instead of the list at its end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class _Call:
    """One list item as read so far: its name (once whole) and its parameters' raw text."""

    name: str | None = None
    chars: list[str] = field(default_factory=list)  # the parameters' text (a list: appends stay O(1))

    @property
    def text(self) -> str:
        return "".join(self.chars)


@dataclass
class CallListScanner:
    """A character scanner over the list's text that tracks strings, nesting and, at each item's
    own level, which key a value belongs to. It trusts the grammar for well-formedness: it only
    has to find where names and parameters start and end."""

    calls: list[_Call] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    expect_key: bool = False  # at an item's level: the next string is a key
    key: str = ""  # the key whose value is being read at an item's level
    token: str = ""  # the raw text of the key or name string being read
    capture: str | None = None  # "name" or "parameters" while reading that value

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _track(self, ch: str) -> None:
        """The JSON structure a character moves: strings (and their escapes) and nesting."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1

    def _char(self, ch: str) -> None:
        if self.capture == "parameters" and self._parameters_char(ch):
            return
        was_in_string = self.in_string
        self._track(ch)
        if was_in_string:
            self.token += ch
            if not self.in_string:
                self._string_done()
        elif self.in_string:  # a string opens
            self.token = ch
        elif self.depth == 2 and ch in "{,":  # an item opens, or its next key follows
            if ch == "{":
                self.calls.append(_Call())
            self.expect_key = True
        elif self.depth == 2 and ch == ":":
            self.capture = self.key if self.key in ("name", "parameters") else None

    def _string_done(self) -> None:
        if self.depth != 2:
            return
        value = json.loads(self.token)
        if self.expect_key:
            self.key, self.expect_key = value, False
        elif self.capture == "name" and self.calls:
            self.calls[-1].name = value if isinstance(value, str) else None
            self.capture = None

    def _parameters_char(self, ch: str) -> bool:
        """Reads a character of the current item's parameters value (a JSON object, as
        FunctionDefinition asks, though a number or literal is read too): the whitespace before
        it is skipped and the value ends where it closes. False for the character that ends a
        number or literal, which is the item's own punctuation."""
        call = self.calls[-1]
        if not call.chars and ch.isspace():
            return True
        if call.chars and call.chars[0] not in '{["' and (ch in ",}]" or ch.isspace()):
            self.capture = None
            return False
        call.chars.append(ch)
        self._track(ch)
        if self.depth == 2 and not self.in_string and call.chars[0] in '{["':
            self.capture = None
        return True
