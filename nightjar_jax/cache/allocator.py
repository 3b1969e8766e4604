"""Host-side page allocator (no JAX).

Vocabulary
- page: ``page_size`` consecutive token slots in every layer's K and V pool; identified by a page id.
- page 0: reserved as the padding target. Padding tokens of a batch write their K/V there and padding entries of
  block tables point there; it is never handed to a sequence, so ``num_free == num_pages - 1`` when idle.
- block table: a sequence's list of page ids; logical page ``j`` holds positions ``j*page_size .. (j+1)*page_size-1``.
- base and extension: ids ``0 .. num_pages - 1`` address the pool the engine starts with; while the draft model is
  offloaded (``nightjar_jax/memory``) an extension pool adds ids ``num_pages .. num_pages + extension - 1``.
  Base pages are handed out first, so the extension holds as little as possible when it is detached.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free (callers check ``can_allocate`` first)."""


class PageAllocator:
    """A LIFO free list of page ids ``1 .. num_pages - 1`` (page 0 reserved), plus an optional extension range."""

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
        self.num_extension = 0  # pages of the attached extension (ids num_pages ..); 0: none

    @property
    def num_usable(self) -> int:
        """Pages a sequence can get now (all but the reserved page 0, the extension's included)."""
        return self.num_pages - 1 + self.num_extension

    def extension_pages_used(self) -> int:
        return sum(1 for p in self._used if p >= self.num_pages)

    def attach_extension(self, num_pages: int) -> None:
        """Add ids ``self.num_pages .. self.num_pages + num_pages - 1`` (an extension pool now addresses them). They
        go under the free base pages: a base page freed later is handed out before them too."""
        if self.num_extension:
            raise RuntimeError(f"an extension of {self.num_extension} pages is already attached")
        if num_pages < 1:
            raise ValueError(f"an extension needs at least 1 page, got {num_pages}")
        self.num_extension = num_pages
        self._free[:0] = range(self.num_pages + num_pages - 1, self.num_pages - 1, -1)

    def detach_extension(self, block_tables: list[list[int]]) -> tuple[list[int], list[int]]:
        """Take the extension's ids back: every live extension page in ``block_tables`` (the block tables of all
        sequences holding pages, rewritten in place) moves to a free base page. Returns the moves ``(src, dst)``:
        the caller copies those pages' contents from the extension pool into the base pool before it frees the
        extension. Raises (changing nothing) when the free base pages cannot take the live extension pages."""
        if not self.num_extension:
            raise RuntimeError("no extension is attached")
        live = sorted(p for p in self._used if p >= self.num_pages)
        listed = sorted(p for table in block_tables for p in table if p >= self.num_pages)
        if listed != live:
            raise ValueError(f"the block tables hold extension pages {listed}, the allocator has {live} in use: "
                             "every sequence holding pages must be given (a page would leak or be copied twice)")
        base_free = [p for p in self._free if p < self.num_pages]
        if len(live) > len(base_free):
            raise OutOfPagesError(f"{len(live)} live extension pages do not fit in {len(base_free)} free base pages")
        self._free = base_free  # (LIFO order kept: pop() still hands out low ids first)
        src: list[int] = []
        dst: list[int] = []
        for table in block_tables:
            for j, p in enumerate(table):
                if p >= self.num_pages:
                    q = self._free.pop()
                    self._used.remove(p)
                    self._used.add(q)
                    table[j] = q
                    src.append(p)
                    dst.append(q)
        self.num_extension = 0
        return src, dst

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
            if p >= self.num_pages:  # an extension page: under the base pages (handed out last)
                self._free.insert(0, p)
            else:
                self._free.append(p)
