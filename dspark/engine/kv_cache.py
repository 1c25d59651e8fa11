"""Paged KV cache: a pool of fixed-size pages and one page table per sequence.

The target model and the drafter share page tables: a drafter's context cache
always holds exactly the positions the target has cached, so both are sized,
grown and rolled back together. Each model owns its own K/V tensors indexed
by the same page ids.

With prefix caching (vLLM's automatic prefix caching), a full page of committed tokens is
registered under a hash of every token up to its end; a new request whose prompt starts with
the same pages takes them (shared, counted by reference) instead of computing them again.
A registered page nobody holds stays cached until a new allocation needs it (least recently
freed first). Only full, committed pages are shared, so the positions a step writes (the
tokens it adds, its drafts, a tree's compaction) always lie in the request's own pages.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfPages(RuntimeError):
    """Raised when the pool cannot satisfy an allocation."""


@dataclass
class PageTable:
    """Pages owned by one sequence and how many tokens they hold."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # of its first full pages (prefix caching)


class PagePool:
    """Allocates pages to sequences; grows, frees and rolls back their tables; with
    prefix_caching, shares the full pages of identical prefixes between them."""

    def __init__(self, num_pages: int, page_size: int = 16, prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.tables: dict[int, PageTable] = {}
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # prefix hash -> the page holding it
        self._hash_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered pages nobody holds, oldest first
        self.prefix_queries = 0  # tokens of admitted requests looked up, and how many were found
        self.prefix_hits = 0  # (vLLM's prefix_cache_queries and prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the cached page freed longest ago
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def _hash(self, parent: bytes, tokens) -> bytes:
        data = np.asarray(tokens, dtype=np.int64).tobytes()
        return hashlib.blake2b(parent + data, digest_size=16).digest()

    def match_prefix(self, seq_id: int, token_ids: list[int], limit: int, salt: bytes = b"") -> int:
        """Give a sequence without pages the cached pages its tokens start with, at most `limit`
        tokens' worth (leave the caller a token to compute); returns the tokens now cached. salt:
        the cache it looks in (Sequence.prefix_salt), as register was given it."""
        if not self.prefix_caching or self.tables.get(seq_id, PageTable()).pages:
            return 0
        table = self.tables.setdefault(seq_id, PageTable())
        ps, parent = self.page_size, salt
        for i in range(limit // ps):
            h = self._hash(parent, token_ids[i * ps:(i + 1) * ps])
            page = self._page_of.get(h)
            if page is None:
                break
            self._cached.pop(page, None)
            self._refs[page] += 1
            table.pages.append(page)
            table.hashes.append(h)
            parent = h
        table.num_tokens = len(table.pages) * ps
        return table.num_tokens

    def count_admission(self, queried: int, found: int) -> None:
        """An admitted request looked up `queried` prompt tokens and found `found` cached (only
        admitted ones count: one that waits again for room gives its matched pages back).
        Without prefix caching nothing is looked up, so nothing counts (as vLLM)."""
        if not self.prefix_caching:
            return
        self.prefix_queries += queried
        self.prefix_hits += found

    def register(self, seq_id: int, tokens: Callable[[int, int], list[int]], num_cached: int,
                 salt: bytes = b"") -> None:
        """Make the full pages among a sequence's first num_cached tokens (computed, committed)
        available to later requests with the same prefix. tokens(start, end): the sequence's
        token ids there, read only for a page that has just filled (this runs every step). The
        engine registers prompt pages only: a generated token's K/V come from the decode
        kernels, and a later prompt holding the same tokens (the next turn of a chat) computes
        them as prompt rows, whose bits differ where prompt rows take a GEMM (AMX); that prompt's
        own pages are registered in turn. salt: which cache they go to (Sequence.prefix_salt)."""
        table = self.tables.get(seq_id)
        if not self.prefix_caching or table is None:
            return
        ps = self.page_size
        for i in range(len(table.hashes), min(num_cached // ps, len(table.pages))):
            h = self._hash(table.hashes[-1] if table.hashes else salt, tokens(i * ps, (i + 1) * ps))
            table.hashes.append(h)
            page = table.pages[i]
            if h not in self._page_of and page not in self._hash_of:  # else another page holds it already
                self._page_of[h] = page
                self._hash_of[page] = h

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages seq_id needs to hold num_tokens tokens in total."""
        have = len(self.tables[seq_id].pages) if seq_id in self.tables else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    def capacity(self, seq_id: int) -> int:
        """Most tokens seq_id could hold if it took every free page."""
        have = len(self.tables[seq_id].pages) if seq_id in self.tables else 0
        return (have + self.num_free) * self.page_size

    def can_reserve(self, seq_id: int, num_tokens: int) -> bool:
        return self.pages_needed(seq_id, num_tokens) <= self.num_free

    def reserve(self, seq_id: int, num_tokens: int) -> PageTable:
        """Ensure seq_id has pages for num_tokens tokens (does not change num_tokens)."""
        table = self.tables.setdefault(seq_id, PageTable())
        need = self.pages_needed(seq_id, num_tokens)
        if need > self.num_free:
            raise OutOfPages(f"need {need} pages, {self.num_free} free")
        for _ in range(need):
            table.pages.append(self._take())
        return table

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll seq_id back to num_tokens cached tokens and free pages past them."""
        table = self.tables[seq_id]
        keep = -(-num_tokens // self.page_size)
        while len(table.pages) > keep:
            self._release(table.pages.pop())
        del table.hashes[keep:]
        table.num_tokens = min(table.num_tokens, num_tokens)

    def free(self, seq_id: int) -> None:
        """Release every page of seq_id; its registered ones stay cached (the last pages of a
        prefix are evicted first)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            for page in reversed(table.pages):
                self._release(page)

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
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.page_size = page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """torch.zeros, except on CPU the memory is an anonymous map: the OS maps zero pages as they
    are first written, so a cache of gigabytes costs neither seconds at start nor resident
    memory until requests fill it (torch.zeros writes every byte up front). Not numpy's calloc:
    numpy asks for transparent huge pages, so the first token written to each layer's K and V
    made 2 MB resident (0.12 GB for one short request on a 30-layer model)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    # the tensor holds the map (frombuffer keeps its exporter alive); mmap refuses a length of 0
    raw = torch.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=torch.uint8)
    return raw[:size].view(dtype).view(shape)
