"""The page pool: which of the cache's fixed set of 128-token pages are free.

Pages are allocated once, up front, by the cache (kvcache/cache.py); this file only hands out
their ids. A sequence reserves the pages its longest possible length needs when it is admitted,
so a running sequence can never run out mid-decode: when the pool cannot cover a new request,
the request waits instead, and nobody else's pages are touched.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))
