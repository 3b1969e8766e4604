"""Contexts: the decode batch size, bucketed.

A **context** is the situation a contextual planner conditions on (Nightjar, arXiv 2512.22420, §4: the batch
size). Batch sizes are grouped into **buckets** given by their lower edges: with edges (1, 2, 4, 8) the buckets
are [1], [2, 3], [4..7], [8, ∞). The default edges are powers of two, because step time and the best γ change
roughly with log(batch size) — doubling the batch moves the step from memory-bound towards compute-bound by a
similar amount at every scale — and it keeps the number of contexts (each learned separately) small.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from nightjar_jax.planner.base import is_int, is_sequence

DEFAULT_BUCKET_EDGES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Ratio ~sqrt(2): Nightjar's default. Per-sequence reward falls with the batch inside a bucket; when the load
# ramps, arms tried early and late in a wide bucket are compared at different batches. Narrower buckets bound
# that bias, and the neighbour prior (nightjar.py, choice 10) keeps the extra contexts cheap to learn.
FINE_BUCKET_EDGES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512)


def validate_bucket_edges(edges: Sequence[int], field: str = "bucket_edges") -> tuple[int, ...]:
    """Return `edges` as a tuple, or raise ValueError naming `field` if they are not increasing ints from 1."""
    allowed = "a sequence of ints increasing strictly from 1, e.g. (1, 2, 4, 8)"
    if not is_sequence(edges):
        raise ValueError(f"{field} must be {allowed}, got {edges!r}")
    items = tuple(edges)  # (once: `edges` may be an iterator)
    not_ints = [e for e in items if not is_int(e)]
    if not_ints:
        raise ValueError(f"{field} must be {allowed}; {not_ints[0]!r} in {items!r} is not an int")
    edges = tuple(int(e) for e in items)
    if not edges or edges[0] != 1:
        raise ValueError(f"{field} must start at 1 (the smallest batch), got {edges}")
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"{field} must be strictly increasing, got {edges}")
    return edges


def bucket_of(batch_size: int, edges: Sequence[int]) -> int:
    """Index of the bucket holding `batch_size` (edges are lower edges, edges[0] == 1).

    Example: edges (1, 2, 4, 8): 1 -> 0, 3 -> 1, 4 -> 2, 100 -> 3.
    """
    return bisect.bisect_right(edges, batch_size) - 1


def bucket_label(index: int, edges: Sequence[int]) -> str:
    """Human-readable range of bucket `index`, e.g. '4-7' or '256+'."""
    low = edges[index]
    if index + 1 < len(edges):
        high = edges[index + 1] - 1
        return str(low) if high == low else f"{low}-{high}"
    return f"{low}+"
