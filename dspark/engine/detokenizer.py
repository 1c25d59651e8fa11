"""Incremental detokenization and stop-string handling."""

from __future__ import annotations

from dspark.engine.sequence import Sequence


def decode_new_text(tokenizer, seq: Sequence, flush: bool = False, end: int | None = None) -> str:
    """Text added by the tokens appended since the last call (output ids before `end` only).
    Holds back bytes that do not yet form a whole character (unless flush), decoding only a
    short window of recent tokens."""
    ids = seq.output_ids if end is None else seq.output_ids[:end]
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix):]
    return ""


def find_stop(text: str, stops: list[str], new_len: int) -> tuple[int, str | None]:
    """(index where the earliest stop string starts in text, that string), searching only where
    the newest new_len characters could complete one; (-1, None) when none."""
    best, which = -1, None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best, which = i, s
    return best, which
