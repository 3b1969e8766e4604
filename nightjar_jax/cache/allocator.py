"""Host-side page allocator (no JAX).

Vocabulary
- page: ``page_size`` consecutive token slots in every layer's K and V pool; identified by a page id.
- page 0: reserved as the padding target. Padding tokens of a batch write their K/V there and padding entries of
  block tables point there; it is never handed to a sequence, so ``num_free == num_pages - 1`` when idle.
- block table: a sequence's list of page ids; logical page ``j`` holds positions ``j*page_size .. (j+1)*page_size-1``.
- base and extension: ids ``0 .. num_pages - 1`` address the pool the engine starts with; while the draft model is
  offloaded (``nightjar_jax/memory``) an extension pool adds ids ``num_pages .. num_pages + extension - 1``.
  Free base pages are handed out first, so the extension holds as little as possible when it is detached (a cached
  free base page, below, only after the extension's free pages: its prefix is kept rather than a migration saved).
- prefix caching (``CacheConfig.enable_prefix_caching``, on by default; the scheduler drives it): a page full of
  computed tokens can be registered under the hash of every token up to its end (``page_hashes``). Pages are reference
  counted: a registered page is shared by every request whose tokens start with the same pages, and when the last
  holder frees it, it stays "cached free": counted in ``num_free`` and handed out only after the plain free pages
  (least recently freed first, its hash dropped then), so a later request with that prefix can still take it.
- the draft's K/V (speculative decoding): the draft's pool is addressed by the same page ids, so a registered page
  can hold the draft's K/V of its tokens too. The scheduler marks such pages (``mark_draft``) once a holder's draft
  has run over them; a request that finds them cached skips the draft's catch-up over them (``draft_prefix``). The
  marks go with the page's hash, and all at once when the draft's pool is released (``forget_draft``).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence


def salt_hash(salt: str | None) -> bytes:
    """The chain's start for requests salted with ``salt`` (b"" without one)."""
    if not salt:
        return b""
    return hashlib.blake2b(b"nightjar-cache-salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, start: list[bytes] | None = None,
                upto: int | None = None, salt: str | None = None) -> list[bytes]:
    """Chained hashes of the full pages of ``token_ids``: page ``j``'s hash covers every token of pages ``0 .. j``
    (a 16-byte BLAKE2b of the previous page's hash and its own tokens). ``start``: hashes already computed for the
    first pages (extended in place and returned); ``upto``: hash at most this many pages. ``salt`` (vLLM's
    ``cache_salt``) starts the chain from its own hash, so only requests with the same salt share pages."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be an integer >= 1")
    out = [] if start is None else start
    full = len(token_ids) // page_size if upto is None else min(upto, len(token_ids) // page_size)
    prev = out[-1] if out else salt_hash(salt)
    for j in range(len(out), full):
        h = hashlib.blake2b(prev, digest_size=16)
        try:
            h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids[j * page_size:(j + 1) * page_size]))
        except OverflowError:
            bad = next(t for t in token_ids[j * page_size:(j + 1) * page_size] if not 0 <= int(t) < 2**32)
            raise ValueError(f"token id {bad} is out of range: token ids are 0 .. 2**32 - 1") from None
        prev = h.digest()
        out.append(prev)
    return out


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free (callers check ``can_allocate`` first)."""


class PageAllocator:
    """A LIFO free list of page ids ``1 .. num_pages - 1`` (page 0 reserved), plus an optional extension range, and
    the pages registered for prefix caching (reference counted; see the module's docstring)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} is too small: need at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Reversed so that pop() hands out low ids first: easier to read in tests and logs.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs: dict[int, int] = {}  # page in use -> how many block tables hold it (more than 1: shared)
        self.num_extension = 0  # pages of the attached extension (ids num_pages ..); 0: none
        # prefix caching: hash -> registered page and back; registered pages nobody holds, least recently freed first
        self._cached: dict[bytes, int] = {}
        self._page_hash: dict[int, bytes] = {}
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._draft: set[int] = set()  # registered pages whose draft K/V are computed too

    @property
    def num_usable(self) -> int:
        """Pages a sequence can get now (all but the reserved page 0, the extension's included)."""
        return self.num_pages - 1 + self.num_extension

    def extension_pages_used(self) -> int:
        return sum(1 for p in self._refs if p >= self.num_pages)

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
        sequences holding pages, rewritten in place; a page shared by several tables moves once) moves to a free base
        page, and cached free extension pages are forgotten. Returns the moves ``(src, dst)``: the caller copies those
        pages' contents from the extension pool into the base pool before it frees the extension. Raises (changing
        nothing) when the free base pages cannot take the live extension pages."""
        if not self.num_extension:
            raise RuntimeError("no extension is attached")
        live = sorted(p for p in self._refs if p >= self.num_pages)
        listed = collections.Counter(p for table in block_tables for p in table if p >= self.num_pages)
        if sorted(listed) != live or any(listed[p] != self._refs[p] for p in live):
            raise ValueError(f"the block tables hold extension pages {sorted(listed.elements())}, the allocator has "
                             f"{sorted(p for p in live for _ in range(self._refs[p]))} in use: every sequence holding "
                             "pages must be given (a page would leak or be copied twice)")
        base_free = [p for p in self._free if p < self.num_pages]
        base_cached = sum(1 for p in self._cached_free if p < self.num_pages)
        if len(live) > len(base_free) + base_cached:
            raise OutOfPagesError(f"{len(live)} live extension pages do not fit in {len(base_free) + base_cached} "
                                  "free base pages")
        for p in [p for p in self._cached_free if p >= self.num_pages]:  # (their contents go with the extension)
            del self._cached_free[p]
            self._forget(p)
        self._free = base_free  # (LIFO order kept: pop() still hands out low ids first)
        moves: dict[int, int] = {}
        for p in live:
            q = self._take()
            self._refs[q] = self._refs.pop(p)
            h = self._page_hash.pop(p, None)
            self._draft.discard(p)  # (no draft pool while an extension exists: nothing to carry)
            if h is not None:  # a shared prefix page: registered under its new id
                self._page_hash[q] = h
                self._cached[h] = q
            moves[p] = q
        for table in block_tables:
            for j, p in enumerate(table):
                if p in moves:
                    table[j] = moves[p]
        self.num_extension = 0
        return list(moves), list(moves.values())

    @property
    def num_free(self) -> int:
        """Pages that can be handed out: the plain free ones and the cached free ones (prefix caching)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        """Free pages still registered for prefix caching (handed out after the plain free ones)."""
        return len(self._cached_free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        if num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0")
        return num_pages <= self.num_free

    def _take(self) -> int:
        """A free page: a plain free one first, else the least recently freed cached one (its hash forgotten)."""
        if self._free:
            return self._free.pop()
        p, _ = self._cached_free.popitem(last=False)
        self._forget(p)
        return p

    def _forget(self, page: int) -> None:
        h = self._page_hash.pop(page, None)
        if h is not None:
            del self._cached[h]
        self._draft.discard(page)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0")
        if num_pages > self.num_free:
            raise OutOfPagesError(f"requested {num_pages} pages, only {self.num_free} free")
        pages = [self._take() for _ in range(num_pages)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one hold on each page. A page nobody holds goes back: to the free list, or, registered, to the
        cached free pages (a block table's later pages ahead of its first ones, to be handed out before them).
        All or nothing: a page not held (as often as it is listed) raises before any hold is dropped (a failing call
        halfway through lost the registered pages it had freed)."""
        if len(set(pages)) != len(pages):
            counts = collections.Counter(pages)
            bad = next((p for p, n in counts.items() if self._refs.get(p, 0) < n), None)
        else:
            bad = next((p for p in pages if p not in self._refs), None)
        if bad is not None:
            raise ValueError(f"page {bad} is not allocated (double free or foreign page)")
        cached: list[int] = []
        for p in pages:
            refs = self._refs[p]
            if refs > 1:
                self._refs[p] = refs - 1
                continue
            del self._refs[p]
            if p in self._page_hash:
                cached.append(p)
            elif p >= self.num_pages:  # an extension page: under the base pages (handed out last)
                self._free.insert(0, p)
            else:
                self._free.append(p)
        for p in reversed(cached):  # a prefix's later pages are handed out before its first ones
            self._cached_free[p] = None

    # ---- prefix caching ---------------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered pages of the longest run of ``hashes`` from the first (held or cached free)."""
        pages: list[int] = []
        for h in hashes:
            p = self._cached.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def num_unheld(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (from :meth:`lookup`) nobody holds: sharing them takes that many free pages."""
        return sum(1 for p in pages if p not in self._refs)

    def share(self, pages: Sequence[int]) -> None:
        """Take one more hold on each of ``pages`` (registered pages from :meth:`lookup`); all or nothing."""
        bad = next((p for p in pages if p not in self._page_hash), None)
        if bad is not None:
            raise ValueError(f"page {bad} is not registered: only cached pages can be shared")
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            else:
                del self._cached_free[p]
                self._refs[p] = 1

    def register(self, page: int, h: bytes) -> None:
        """Register a held page, full of computed tokens, under its hash (a no-op when the hash or the page is
        registered already: two requests that computed the same prefix side by side keep one copy cached)."""
        if page not in self._refs:
            raise ValueError(f"page {page} is not allocated: only a held page can be registered")
        if h in self._cached or page in self._page_hash:
            return
        self._cached[h] = page
        self._page_hash[page] = h

    def mark_draft(self, pages: Sequence[int]) -> None:
        """Record that the draft's K/V of ``pages`` (held pages, full of computed tokens) are computed; pages not
        registered are skipped (another page holds their hash, or the cache was reset)."""
        self._draft.update(p for p in pages if p in self._page_hash)

    def draft_prefix(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (from :meth:`lookup`), from the first, hold the draft's K/V too."""
        for i, p in enumerate(pages):
            if p not in self._draft:
                return i
        return len(pages)

    @property
    def num_draft_pages(self) -> int:
        """Registered pages marked as holding the draft's K/V."""
        return len(self._draft)

    def forget_draft(self) -> None:
        """The draft's K/V pool is gone (elastic memory offloaded the draft): no page holds its K/V."""
        self._draft.clear()

    def reset_prefix_cache(self) -> int:
        """Forget every registered page (held ones stay held, cached free ones become plain free pages); returns
        how many pages were registered."""
        n = len(self._page_hash)
        self._free[:0] = sorted((p for p in self._cached_free if p >= self.num_pages), reverse=True)
        self._free.extend(sorted((p for p in self._cached_free if p < self.num_pages), reverse=True))
        self._cached_free.clear()
        self._cached.clear()
        self._page_hash.clear()
        self._draft.clear()
        return n

    def check(self) -> None:
        """Raise if the bookkeeping is inconsistent (tests): every usable page exactly once among free, cached free
        and held; the hash maps each other's inverse."""
        usable = set(range(1, self.num_pages)) | set(range(self.num_pages, self.num_pages + self.num_extension))
        parts = [set(self._free), set(self._cached_free), set(self._refs)]
        if sum(map(len, parts)) != len(usable) or set().union(*parts) != usable or len(self._free) != len(parts[0]):
            raise AssertionError(f"pages lost or counted twice: free {sorted(parts[0])}, cached free "
                                 f"{sorted(parts[1])}, held {sorted(parts[2])}")
        if {p: h for h, p in self._cached.items()} != self._page_hash:
            raise AssertionError("the prefix cache's hash -> page and page -> hash maps disagree")
        if not set(self._cached_free) <= set(self._page_hash):
            raise AssertionError("a cached free page is not registered")
        if not self._draft <= set(self._page_hash):
            raise AssertionError(f"pages {sorted(self._draft - set(self._page_hash))} are marked as holding the "
                                 "draft's K/V but not registered")
