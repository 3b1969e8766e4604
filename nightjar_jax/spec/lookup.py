"""N-gram lookup proposals: draft tokens copied from earlier in the sequence itself (prompt lookup decoding, Saxena
2023; vLLM's ``ngram`` speculative method), used beside the draft model.

When the last ``n`` tokens of a sequence (``n`` from ``max_n`` down to ``min_n``) occurred before, the tokens that
followed that earlier occurrence are proposed as the next drafts: text that quotes its prompt, repeats a name, a
list's scaffolding or a loop of its own is predicted far better this way than by a small draft. Small models loop
often: on the held-out prompts of issue 8 the target's greedy answers had such a match at 47% of smollm2-eagle's
decode steps, and there the copied tokens were accepted 1.9 more per step than the draft's (offline replay,
2026-12-03; docs/benchmarks.md).

The engine uses them in decode steps (``SpecConfig.prompt_lookup_max``): in a chain step a row with a match
verifies the copied tokens instead of the draft's, and a token tree carries them as a copy branch beside the
draft's candidates (``spec/tree.py``, ``with_copy_branch``), in the same target pass. Greedy verification compares
them with the target's argmax, so outputs stay exactly the target's greedy ones; rejection sampling takes a copied
token as a draw from a point mass on it (accepted with probability p(t)), so sampled outputs keep the target's
distribution.
:class:`NgramIndex` keeps, per request, where every n-gram last started, updated with each committed token, so a
proposal costs O(1) per step after the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (``min_n`` to ``max_n`` tokens) of one growing token sequence last started.

    :meth:`extend` appends the tokens committed since the last call (a sequence only grows: committed tokens are
    never taken back), costing O(new tokens x sizes), never O(sequence); :meth:`propose` answers from the previous
    occurrence of the sequence's current suffix. An n-gram is keyed by its ids packed into one integer (32 bits
    each), one table per size.
    """

    _ID_BITS = 32  # every int32 token id

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        self._last: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}  # n -> key -> start
        self._prev: dict[int, int] = {}  # n -> where the current length-n suffix occurred before (absent: never)

    def __len__(self) -> int:
        return len(self._tokens)

    def _key(self, end: int, n: int) -> int:
        key = 0
        for t in self._tokens[end - n : end]:
            if not 0 <= t < 1 << self._ID_BITS:
                raise ValueError(f"token id {t} is outside 0 .. {(1 << self._ID_BITS) - 1}")
            key = (key << self._ID_BITS) | t
        return key

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append and index ``new_tokens`` (the sequence's tokens after the first ``len(self)``)."""
        if not new_tokens:
            return
        begin = len(self._tokens)
        self._tokens.extend(int(t) for t in new_tokens)
        total = len(self._tokens)
        self._prev.clear()
        for end in range(begin + 1, total + 1):  # the n-grams ending at token end - 1
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table, key = self._last[n], self._key(end, n)
                if end == total:  # the current suffix: remember where it occurred before
                    before = table.get(key)
                    if before is not None:
                        self._prev[n] = before
                table[key] = end - n

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of the sequence (at
        most ``max_n``, at least ``min_n`` tokens) that occurred before; [] when none did."""
        for n in range(self.max_n, self.min_n - 1, -1):
            start = self._prev.get(n)
            if start is not None:
                return self._tokens[start + n : min(start + n + k, len(self._tokens))]
        return []
