"""Prompt-lookup drafting: propose the continuation of the latest earlier match of the
request's last n tokens. No weights, any model; its proposals are deterministic, so
their draft distribution q is one-hot."""

from __future__ import annotations

from dataclasses import dataclass, field


class _Index:
    """Latest start of every n-gram of one request's tokens, extended as they grow (tokens only
    ever get appended), so a step costs the new tokens, not a scan of the whole context."""

    __slots__ = ("last", "size")

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}
        self.size = 0  # tokens seen by the last extend: its n-grams start before size - n

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        L = len(tokens)
        for n in range(min_n, max_n + 1):
            for i in range(max(0, self.size - n), L - n):  # an earlier occurrence starts by L - n - 1
                self.last[tuple(tokens[i:i + n])] = i
        self.size = L


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on; past the end the copy reads its own output, so a loop of
    period L - start repeats instead of stopping at the last token."""
    out = tokens[start:start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


@dataclass
class NgramDrafter:
    """Matches the longest suffix (max_n down to min_n tokens) against the request's own tokens.
    With a key (the request's id) it keeps that request's n-gram index between calls."""

    max_n: int = 4
    min_n: int = 1
    block_size: int = 8
    _indexes: dict[int, _Index] = field(default_factory=dict, repr=False)

    def propose(self, tokens: list[int], k: int, key: int | None = None) -> list[int]:
        if k <= 0:
            return []
        index = self._indexes.get(key) if key is not None else None
        if index is None:
            index = _Index()
            if key is not None:
                self._indexes[key] = index
        index.extend(tokens, self.min_n, self.max_n)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            i = index.last.get(tuple(tokens[L - n:]))
            if i is not None:
                return _continue(tokens, i + n, k)
        return []

    def forget(self, key: int) -> None:
        """Drop one request's index (it finished, or a preemption will recompute it)."""
        self._indexes.pop(key, None)

    def forget_all_but(self, keys: set[int]) -> None:
        """Drop the indexes of requests outside keys (finished ones), once they pile up."""
        if len(self._indexes) > 2 * len(keys) + 16:
            self._indexes = {k: v for k, v in self._indexes.items() if k in keys}
