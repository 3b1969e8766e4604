"""Folding query heads onto their KV head, and the online-softmax step both kernel bodies share.

Vocabulary (beyond ``reference.py``)
- group: the ``num_q_heads // num_kv_heads`` query heads that read one KV head (GQA).
- row: one (query, q head in the group) pair. A kernel instance works on one KV head of one sequence, so it folds
  all its rows into the M dimension of one matmul: row ``r`` of a q block is query ``r // group`` of that block,
  head ``r % group`` of the group.
- q block: ``block_q`` consecutive queries of one sequence (all of them for decode and verify; a tile of a long
  prefill chunk), i.e. ``block_q * group`` rows, padded to ``block_rows`` (a power of two >= 16: ``tl.dot`` needs
  M >= 16, and Mosaic TPU needs a multiple of 8 sublanes).
- row query index: per row, the index ``i`` of its query in ``0 .. q_len - 1``; padding rows get ``-PAD_ROW``,
  which puts them at a negative position so they are treated exactly like left padding (no keys, output 0).
- tree words (speculative token trees, ``reference.py``): the ``[q_len, M]`` tree mask packed per row into
  ``ceil(M / 32)`` int32 columns; bit ``b`` of word ``w`` says whether the row's query sees window key ``32 w + b``
  (window key ``j`` is position ``context_len - M + j``). Bit tests are elementwise shifts and selects, which both
  the Triton and the Mosaic lowerings take, where a gather from a ``[q_len, M]`` block would not lower.

Worked example (q_len 3, group 2, block_q 2 -> 2 q blocks, block_rows 16):
  q block 0 rows 0..3 = (query 0, head 0), (0, 1), (1, 0), (1, 1); rows 4..15 are padding.
  q block 1 rows 0..1 = (2, 0), (2, 1); query 3 does not exist (q_len padded to 4) -> rows 2..15 are padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Score given to masked keys: finite, so ``row_max - row_max_next`` never becomes ``-inf - -inf = nan``.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Query index given to padding rows; any value > the longest context makes their position negative.
PAD_ROW = 1 << 30


@dataclasses.dataclass(frozen=True)
class QueryBlocking:
    """How the ``[q_len, group]`` rows of one (sequence, KV head) are tiled into q blocks."""

    q_len: int  # queries per sequence
    group: int  # q heads per KV head
    block_q: int  # queries per q block
    block_rows: int  # rows per q block after padding (power of two >= 16)

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @staticmethod
    def choose(q_len: int, group: int, target_rows: int) -> QueryBlocking:
        """Largest ``block_q`` whose ``block_q * group`` rows fit ``target_rows`` (at least one query)."""
        block_q = max(1, min(q_len, target_rows // group))
        rows = block_q * group
        block_rows = max(16, 1 << (rows - 1).bit_length())
        return QueryBlocking(q_len=q_len, group=group, block_q=block_q, block_rows=block_rows)

    def row_query_index(self) -> np.ndarray:  # [num_q_blocks * block_rows, 1] int32
        """Per row, the index of its query in the sequence; ``-PAD_ROW`` for padding rows (see module doc)."""
        index = np.full((self.num_q_blocks, self.block_rows), -PAD_ROW, dtype=np.int32)
        rows = np.arange(self.block_q * self.group)
        for q_block in range(self.num_q_blocks):
            query = q_block * self.block_q + rows // self.group
            index[q_block, rows] = np.where(query < self.q_len, query, -PAD_ROW)
        return index.reshape(-1, 1)


def fold_queries(q: jax.Array, num_kv_heads: int, blocking: QueryBlocking) -> jax.Array:
    """``[num_seqs, q_len, num_q_heads, head_dim]`` -> ``[num_seqs, num_kv_heads, num_q_blocks * rows, head_dim]``.

    ``rows`` is ``blocking.block_rows``."""
    num_seqs, q_len, _, head_dim = q.shape
    b = blocking
    q = q.reshape(num_seqs, q_len, num_kv_heads, b.group, head_dim).transpose(0, 2, 1, 3, 4)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, b.num_q_blocks * b.block_q - q_len), (0, 0), (0, 0)))
    q = q.reshape(num_seqs, num_kv_heads, b.num_q_blocks, b.block_q * b.group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, b.block_rows - b.block_q * b.group), (0, 0)))
    return q.reshape(num_seqs, num_kv_heads, b.num_q_blocks * b.block_rows, head_dim)


def unfold_outputs(out: jax.Array, blocking: QueryBlocking) -> jax.Array:
    """Inverse of :func:`fold_queries`, dropping padding rows and padding queries."""
    num_seqs, num_kv_heads, _, head_dim = out.shape
    b = blocking
    out = out.reshape(num_seqs, num_kv_heads, b.num_q_blocks, b.block_rows, head_dim)
    out = out[:, :, :, : b.block_q * b.group]
    out = out.reshape(num_seqs, num_kv_heads, b.num_q_blocks * b.block_q, b.group, head_dim)[:, :, : b.q_len]
    return out.transpose(0, 2, 1, 3, 4).reshape(num_seqs, b.q_len, num_kv_heads * b.group, head_dim)


def pad_block_tables(block_tables: jax.Array, pages_per_block: int) -> jax.Array:
    """Pad ``[num_seqs, max_pages]`` with page 0 (the reserved padding page) to a multiple of ``pages_per_block``."""
    extra = -block_tables.shape[1] % pages_per_block
    return jnp.pad(block_tables, ((0, 0), (0, extra))) if extra else block_tables


def num_keys_needed(context_len: jax.Array, q_block: jax.Array, blocking: QueryBlocking) -> jax.Array:
    """Keys a q block can see: up to its last real query's position (inclusive), clipped to [0, context_len]."""
    b = blocking
    last_query = jnp.minimum((q_block + 1) * b.block_q, b.q_len) - 1
    return jnp.clip(context_len - b.q_len + last_query + 1, 0, context_len)


TREE_WORD_BITS = 32


def tree_words(tree_mask: jax.Array, blocking: QueryBlocking) -> tuple[jax.Array, ...]:
    """``[q_len, M]`` bool -> ``ceil(M / 32)`` int32 columns ``[num_q_blocks * block_rows, 1]`` (module doc:
    tree words); padding rows get 0 (they see no key anyway)."""
    q_len, window = tree_mask.shape
    num_words = -(-window // TREE_WORD_BITS)
    bits = jnp.pad(tree_mask.astype(jnp.uint32), ((0, 0), (0, num_words * TREE_WORD_BITS - window)))
    bits = bits.reshape(q_len, num_words, TREE_WORD_BITS) << jnp.arange(TREE_WORD_BITS, dtype=jnp.uint32)
    words = lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # [q_len, num_words]
    index = blocking.row_query_index()[:, 0]
    real = index >= 0
    rows = jnp.where(jnp.asarray(real)[:, None], words[np.where(real, index, 0)], 0)
    return tuple(rows[:, w : w + 1] for w in range(num_words))


def tree_visible(
    words: tuple[jax.Array, ...],  # each [block_rows, 1] int32 (``tree_words``, this q block's rows)
    key_pos_row: jax.Array,  # [1, block_k] int32 absolute key positions
    window_start: jax.Array,  # [] int32: context_len - M
) -> jax.Array:  # [block_rows, block_k] bool
    """Which keys each row may see under its tree words: every key before the window, and inside it the keys whose
    bit is set (causality and the context length are the caller's)."""
    rel = key_pos_row - window_start  # [1, block_k]; negative before the window
    word_of_key = rel >> 5  # rel // 32; negative before the window, where no word matches
    word = jnp.where(word_of_key == 0, words[0], 0)
    for w in range(1, len(words)):
        word = jnp.where(word_of_key == w, words[w], word)
    bit = (word >> (rel & (TREE_WORD_BITS - 1))) & 1  # arithmetic shift: bit 31 comes out right too
    return (rel < 0) | (bit != 0)


def online_softmax_step(
    q: jax.Array,  # [block_rows, head_dim], input dtype
    k: jax.Array,  # [block_k, head_dim], input dtype (may hold NaN past the context)
    v: jax.Array,  # [block_k, head_dim], input dtype (may hold NaN past the context)
    key_pos_row: jax.Array,  # [1, block_k] int32 absolute key positions
    key_pos_col: jax.Array,  # [block_k, 1] int32 the same positions, as a column (for masking V)
    query_pos: jax.Array,  # [block_rows, 1] int32 absolute query positions (negative = padding)
    context_len: jax.Array,  # [] int32
    acc: jax.Array,  # [block_rows, head_dim] f32 un-normalised output
    row_max: jax.Array,  # [block_rows, 1] f32 running max score
    row_sum: jax.Array,  # [block_rows, 1] f32 running sum of exp(score - row_max)
    *,
    scale: float,
    visible: jax.Array | None = None,  # [block_rows, block_k] bool: a token tree's mask (``tree_visible``)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update over ``block_k`` keys. Masking is by select, never by multiply: keys past the
    context may be NaN and ``0 * nan = nan``, so masked scores, probabilities and values are all replaced."""
    # HIGHEST: fp32 inputs use IEEE fp32 on GPU instead of TF32; no effect on bf16.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    if k.dtype != q.dtype:  # a float32 q over bfloat16 pages (the wrapper never passes a narrower q): widen the tile
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    scores = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [block_rows, block_k]
    scores = scores * scale
    mask = (key_pos_row < context_len) & (key_pos_row <= query_pos)  # [block_rows, block_k]
    if visible is not None:
        mask &= visible
    scores = jnp.where(mask, scores, MASK_VALUE)
    row_max_next = jnp.maximum(row_max, jnp.max(scores, axis=1, keepdims=True))
    correction = jnp.exp(row_max - row_max_next)
    probs = jnp.where(mask, jnp.exp(scores - row_max_next), 0.0)
    row_sum_next = row_sum * correction + jnp.sum(probs, axis=1, keepdims=True)
    v = jnp.where(key_pos_col < context_len, v, jnp.zeros_like(v))
    pv = lax.dot_general(
        probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [block_rows, head_dim]
    return acc * correction + pv, row_max_next, row_sum_next


def normalise(acc: jax.Array, row_sum: jax.Array) -> jax.Array:
    """``acc / row_sum``, and 0 for rows that saw no key (left padding, padding rows).

    Tests ``row_sum == 0`` rather than ``row_sum > 0`` so that a NaN ``row_sum`` (a stray read of a NaN slot)
    stays NaN instead of silently turning into a zero row."""
    no_keys = row_sum == 0.0
    return jnp.where(no_keys, 0.0, acc / jnp.where(no_keys, 1.0, row_sum))
