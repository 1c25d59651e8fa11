"""Reading a request's JSON body defensively: malformed JSON, nesting deeper than MAX_JSON_DEPTH
and lone UTF-16 surrogates (JSON's "\\ud800", which no tokenizer or UTF-8 encoder takes) are
400s naming the field, before any model or tokenizer sees the body."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from fastapi import Request

from dspark.server.protocol import APIError

MAX_JSON_DEPTH = 64  # arrays and objects, the body itself counting as one
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string
# a string (with a ":" after it when it is a key), or a bracket; everything else is skipped in C
_TOKEN = re.compile(_STRING.pattern + rb"(\s*:)?|[\[\]{}]", re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_OPENERS = b"[{"
# an escape that may decode to half of a UTF-16 pair (U+D800..U+DFFF): only then is the parsed body walked
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _key_name(token: bytes) -> str | None:
    """A top-level key's name, when it is plain enough to name a field in a message."""
    try:
        name = json.loads(token[:token.rindex(b'"') + 1])
    except ValueError:
        return None
    return name if isinstance(name, str) and name.isascii() and name.isprintable() else None


def _too_deep(raw: bytes) -> bool:
    """Whether raw nests arrays and objects (brackets inside strings left out) more than
    MAX_JSON_DEPTH deep, at C speed; a body with fewer opening brackets than that is not scanned."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= MAX_JSON_DEPTH:
        return False
    codes = np.frombuffer(brackets, np.uint8)
    steps = np.where((codes == _OPENERS[0]) | (codes == _OPENERS[1]), 1, -1)
    return int(np.cumsum(steps).max()) > MAX_JSON_DEPTH


def check_depth(raw: bytes) -> None:
    """APIError(400) when raw nests arrays and objects more than MAX_JSON_DEPTH deep, naming the
    top-level field that does. A scan of the bytes, so json.loads never recurses that far."""
    if not _too_deep(raw):
        return
    depth, key = 0, None
    for m in _TOKEN.finditer(raw):  # once more, token by token, for the field's name
        token = m.group()
        if token[0] == 0x22:  # a string
            if depth == 1 and m.group(1) is not None:
                key = _key_name(token)
        elif token[0] in _OPENERS:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                break
        else:
            depth -= 1
    where = f"{key}: " if key else "the request body "
    raise APIError(400, f"{where}nests arrays and objects more than {MAX_JSON_DEPTH} levels deep", param=key)


def _surrogate_at(body: Any) -> tuple[str | None, str] | None:
    """(the dotted path of the first string holding a lone surrogate, the surrogate), or None."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if (m := _SURROGATE.search(node)) is not None:
                return ".".join(path) or None, m.group()
        elif isinstance(node, dict):
            for k, v in node.items():
                if (m := _SURROGATE.search(k)) is not None:
                    return ".".join(path) or None, m.group()
                stack.append((v, (*path, k)))
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))
    return None


def parse_json(raw: bytes) -> Any:
    """raw as JSON; APIError(400) when it is not JSON, nests too deep or holds a lone surrogate."""
    check_depth(raw)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # not JSON either (the scan passed it), but say so rather than crash
        raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep") from None
    if _SURROGATE_ESCAPE.search(raw) is not None and (found := _surrogate_at(body)) is not None:
        param, char = found
        where = f"{param}: " if param else "the request body "
        raise APIError(400, f"{where}holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not "
                            "valid Unicode text", param=param)
    return body


async def read_json(request: Request) -> Any:
    """A request's JSON body (see parse_json)."""
    return parse_json(await request.body())
