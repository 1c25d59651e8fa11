"""A token's own bytes, for the chat logprobs' `bytes` field. A token that holds part of a UTF-8
character (an emoji split over two tokens) decodes to U+FFFD alone; OpenAI returns its raw bytes
instead, so that a client can join the tokens' bytes back into the text."""

from __future__ import annotations

import functools
import re

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:  # noqa: ANN001 - any HF tokenizer
    """token_id's bytes; `text` is its decoded text, whose UTF-8 is the answer unless the token
    ends or starts inside a character."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if m := _HEX_BYTE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
    return text.encode("utf-8")
