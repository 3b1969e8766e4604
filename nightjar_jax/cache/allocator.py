"""Host-side page allocator (no JAX).

Vocabulary
- page: ``page_size`` consecutive token slots in every layer's K and V pool; identified by a page id.
- page 0: reserved as the padding target. Padding tokens of a batch write their K/V there and padding entries of
  block tables point there; it is never handed to a sequence, so ``num_free == num_pages - 1`` when idle.
- block table: a sequence's list of page ids; logical page ``j`` holds positions ``j*page_size .. (j+1)*page_size-1``.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free (callers check ``can_allocate`` first)."""


class PageAllocator:
    """A LIFO free list of page ids ``1 .. num_pages - 1`` (page 0 reserved)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} is too small: need at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Reversed so that pop() hands out low ids first: easier to read in tests and logs.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_usable(self) -> int:
        """Pages a sequence can ever get (all but the reserved page 0)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise OutOfPagesError(f"requested {num_pages} pages, only {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free or foreign page)")
            self._used.remove(p)
            self._free.append(p)
