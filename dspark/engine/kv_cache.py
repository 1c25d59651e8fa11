"""Paged KV cache: a pool of fixed-size pages and one page table per sequence.

The target model and the drafter share page tables: a drafter's context cache
always holds exactly the positions the target has cached, so both are sized,
grown and rolled back together. Each model owns its own K/V tensors indexed
by the same page ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPages(RuntimeError):
    """Raised when the pool cannot satisfy an allocation."""


@dataclass
class PageTable:
    """Pages owned by one sequence and how many tokens they hold."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagePool:
    """Allocates pages to sequences; grows, frees and rolls back their tables."""

    def __init__(self, num_pages: int, page_size: int = 16):
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.tables: dict[int, PageTable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_pages

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages seq_id needs to hold num_tokens tokens in total."""
        have = len(self.tables[seq_id].pages) if seq_id in self.tables else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    def capacity(self, seq_id: int) -> int:
        """Most tokens seq_id could hold if it took every free page."""
        have = len(self.tables[seq_id].pages) if seq_id in self.tables else 0
        return (have + len(self._free)) * self.page_size

    def can_reserve(self, seq_id: int, num_tokens: int) -> bool:
        return self.pages_needed(seq_id, num_tokens) <= len(self._free)

    def reserve(self, seq_id: int, num_tokens: int) -> PageTable:
        """Ensure seq_id has pages for num_tokens tokens (does not change num_tokens)."""
        table = self.tables.setdefault(seq_id, PageTable())
        need = self.pages_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free")
        for _ in range(need):
            table.pages.append(self._free.pop())
        return table

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll seq_id back to num_tokens cached tokens and free pages past them."""
        table = self.tables[seq_id]
        keep = -(-num_tokens // self.page_size)
        while len(table.pages) > keep:
            self._free.append(table.pages.pop())
        table.num_tokens = min(table.num_tokens, num_tokens)

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(reversed(table.pages))

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot ids (page * page_size + offset) for positions [start, end)."""
        return self.slots_at(seq_id, range(start, end))

    def slots_at(self, seq_id: int, positions) -> list[int]:
        pages, ps = self.tables[seq_id].pages, self.page_size
        return [pages[p // ps] * ps + p % ps for p in positions]


class KVCache:
    """K and V tensors of one model: [num_layers, num_pages * page_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device):
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
