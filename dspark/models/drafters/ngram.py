"""Prompt-lookup drafting: propose the continuation of the latest earlier match of the
request's last n tokens. No weights, any model; its proposals are deterministic, so
their draft distribution q is one-hot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NgramDrafter:
    """Matches the longest suffix (max_n down to min_n tokens) against the request's own tokens."""

    max_n: int = 4
    min_n: int = 1
    block_size: int = 8

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n:]
            first = suffix[0]
            # latest earlier occurrence whose continuation exists
            for i in range(L - n - 1, -1, -1):
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []
