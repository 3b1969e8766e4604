"""GPU body of paged attention: Pallas with the Triton lowering (also the body run interpreted on CPU).

Grid ``(num_seqs, num_kv_heads, num_q_blocks)``; one program owns the folded rows of one q block (see
``layout.py``) and loops over only the pages that q block can see, ``pages_per_block`` pages per iteration. The
whole page pool of its KV head is the program's block; pages are gathered by id from the block table
(``k_pages_ref[page_ids]``), the same gather ``jax.experimental.pallas.ops.gpu.paged_attention`` uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.paged_attention.layout import (
    MASK_VALUE,
    QueryBlocking,
    fold_queries,
    normalise,
    num_keys_needed,
    online_softmax_step,
    pad_block_tables,
    tree_visible,
    tree_words,
    unfold_outputs,
)

try:  # the Triton backend module; absent from some jax builds
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

GPU_TUNING_DEFAULTS = {
    "pages_per_block": 4,  # pages gathered per loop iteration (power of two); block_k = pages_per_block * page_size
    "block_rows": 64,  # target rows (queries x group) per q block; prefill chunks are tiled by this
    "num_warps": 4,
    "num_stages": 2,
}


def _paged_attention_gpu_kernel(
    block_tables_ref,  # [padded_pages_per_seq] int32 (this sequence's row)
    context_lens_ref,  # [1] int32
    row_query_index_ref,  # [block_rows, 1] int32
    q_ref,  # [block_rows, head_dim]
    k_pages_ref,  # [num_pages, page_size, head_dim] (this KV head's pool)
    v_pages_ref,  # [num_pages, page_size, head_dim]
    *refs,  # tree word refs ([block_rows, 1] int32 each; none without a tree), out_ref [block_rows, head_dim]
    blocking: QueryBlocking,
    pages_per_block: int,
    scale: float,
    tree_window: int,  # M of the tree mask (0: no tree)
):
    *word_refs, out_ref = refs
    q_block = pl.program_id(2)
    block_rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_k = pages_per_block * page_size
    max_iterations = block_tables_ref.shape[0] // pages_per_block

    context_len = context_lens_ref[0]
    query_pos = context_len - blocking.q_len + row_query_index_ref[...]  # [block_rows, 1]
    q = q_ref[...]
    words = tuple(ref[...] for ref in word_refs)
    num_keys = num_keys_needed(context_len, q_block, blocking)
    # Clamp so a context_len beyond the block table's capacity cannot read past it.
    num_iterations = jnp.minimum(lax.div(num_keys + block_k - 1, block_k), max_iterations)

    def body(iteration, carry):
        acc, row_max, row_sum = carry
        page_ids = block_tables_ref[pl.ds(iteration * pages_per_block, pages_per_block)]  # [pages_per_block]
        k = k_pages_ref[page_ids].reshape(block_k, head_dim)
        v = v_pages_ref[page_ids].reshape(block_k, head_dim)
        start = iteration * block_k
        key_pos_row = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        key_pos_col = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        visible = tree_visible(words, key_pos_row, context_len - tree_window) if words else None
        return online_softmax_step(
            q, k, v, key_pos_row, key_pos_col, query_pos, context_len, acc, row_max, row_sum, scale=scale,
            visible=visible,
        )

    acc = jnp.zeros((block_rows, head_dim), jnp.float32)
    row_max = jnp.full((block_rows, 1), MASK_VALUE, jnp.float32)
    row_sum = jnp.zeros((block_rows, 1), jnp.float32)
    acc, row_max, row_sum = lax.fori_loop(0, num_iterations, body, (acc, row_max, row_sum))
    out_ref[...] = normalise(acc, row_sum).astype(out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "pages_per_block", "block_rows", "num_warps", "num_stages"),
)
def paged_attention_gpu(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32
    tree_mask: jax.Array | None = None,  # [q_len, M] bool (reference.py: speculative token trees)
    *,
    scale: float,
    interpret: bool,
    pages_per_block: int = GPU_TUNING_DEFAULTS["pages_per_block"],
    block_rows: int = GPU_TUNING_DEFAULTS["block_rows"],
    num_warps: int = GPU_TUNING_DEFAULTS["num_warps"],
    num_stages: int = GPU_TUNING_DEFAULTS["num_stages"],
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim]
    """Paged attention with the GPU body; inputs are assumed validated by ``paged_attention``."""
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    blocking = QueryBlocking.choose(q_len, num_q_heads // num_kv_heads, block_rows)
    q_folded = fold_queries(q, num_kv_heads, blocking)  # [num_seqs, num_kv_heads, num_q_blocks * rows, head_dim]
    block_tables = pad_block_tables(block_tables, pages_per_block)
    padded_pages_per_seq = block_tables.shape[1]
    row_query_index = jnp.asarray(blocking.row_query_index())  # [num_q_blocks * rows, 1]
    rows = blocking.block_rows
    words = () if tree_mask is None else tree_words(tree_mask, blocking)

    kernel = functools.partial(
        _paged_attention_gpu_kernel, blocking=blocking, pages_per_block=pages_per_block, scale=scale,
        tree_window=0 if tree_mask is None else tree_mask.shape[1],
    )
    compiler_params = None
    if plgpu is not None:
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, blocking.num_q_blocks),
        in_specs=[
            pl.BlockSpec((None, padded_pages_per_seq), lambda s, h, b: (s, 0)),
            pl.BlockSpec((None, 1), lambda s, h, b: (s, 0)),
            pl.BlockSpec((rows, 1), lambda s, h, b: (b, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b: (s, h, b, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, b: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, b: (h, 0, 0, 0)),
            *[pl.BlockSpec((rows, 1), lambda s, h, b: (b, 0)) for _ in words],
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b: (s, h, b, 0)),
        out_shape=jax.ShapeDtypeStruct(q_folded.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"paged_attention_gpu_rows{rows}_ppb{pages_per_block}" + ("_tree" if words else ""),
    )(block_tables, context_lens.reshape(num_seqs, 1), row_query_index, q_folded, k_pages, v_pages, *words)
    return unfold_outputs(out, blocking)
