"""TPU body of paged attention: Pallas Mosaic TPU with the block tables as scalar prefetch.

Grid ``(num_seqs, num_kv_heads, num_q_blocks, num_page_steps)``; the last axis walks the sequence's pages
``pages_per_block`` at a time and is sequential ("arbitrary"): the online-softmax state lives in VMEM scratch
and the output block is written on the last step. The gather is done by the pipeline, not the body: K and V are
each passed ``pages_per_block`` times, and input ``j``'s index_map reads the page id of logical page
``step * pages_per_block + j`` from the prefetched block table (in SMEM). Past the last page a q block can see,
the index_map repeats that last page, so the pipeline issues no new DMA, and the body skips the step.

Extension pool (elastic memory, ``nightjar_jax.memory``): page ids from the base pool's page count on address a
second pool. Each of the ``pages_per_block`` K and V inputs then comes in twice, once per pool; the index_maps send
a page's DMA to the pool that holds it and park the other pool's input on its page 0, which the pipeline fetches
again only when the parked index changes (a sequence that alternates between the pools: at most one more page DMA
per page), and the body reads the input of the page's pool (the page id is in SMEM).

Limits of the compiled body, refused before lowering (``check_compiled_tpu_shapes``): bfloat16 pools with page_size
1 (Mosaic does not verify them), and block tables over ``SMEM_BUDGET`` bytes of scalar memory.

Not vmappable under the TPU interpreter (jax 0.10.2): ``jax.vmap`` over q or the pools adds a fifth grid axis that
the interpreter zips with the four ``dimension_semantics`` ("safe_zip() argument 1 has length 4 but argument 0 has
length 5"). The vmapped body does lower to Mosaic, but that was not run on a TPU. The engine never vmaps attention:
sequences are the grid's first axis.
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

try:  # the Mosaic TPU backend module; absent from some jax builds
    from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover
    pltpu = None

TPU_TUNING_DEFAULTS = {
    "pages_per_block": 2,  # pages DMA'd per grid step (K and V each passed this many times)
    "block_rows": 128,  # target rows (queries x group) per q block
}

# Scalar memory (SMEM) the compiled body lets its prefetched block table and context lengths take, in bytes: half
# of the 1 MiB SMEM of TPUs up to v6e, the margin vLLM's TPU backend keeps (vllm-project/vllm#16871); a table past
# the whole 1 MiB fails at compile time with RESOURCE_EXHAUSTED ("space=smem ... prefetched SMEM operand").
SMEM_BUDGET = 512 * 1024


def check_compiled_tpu_shapes(page_size: int, pool_dtype, num_seqs: int, padded_pages_per_seq: int) -> None:
    """Refuse, before lowering, what the compiled (Mosaic) body cannot take:

    - a 16-bit pool (bfloat16) with page_size 1: Mosaic fails to verify the ``[1, head_dim]`` page blocks
      ("'vector.broadcast' op failed to verify that source operand and result have same element type"); float32
      pools with page 1 and bfloat16 pools with pages 2..16 lower (QA, jax 0.10.2, ``jax.export`` for "tpu");
    - a block table (plus the context lengths) over ``SMEM_BUDGET`` bytes of scalar memory.

    The TPU interpreter takes both, so interpreted calls are not checked."""
    if page_size == 1 and jnp.dtype(pool_dtype).itemsize == 2:
        raise ValueError(f"page_size=1 with a {jnp.dtype(pool_dtype).name} KV pool does not lower to Mosaic (the "
                         f"compiled TPU kernel): use page_size >= 2 or a float32 pool")
    smem_bytes = 4 * num_seqs * (padded_pages_per_seq + 1)
    if smem_bytes > SMEM_BUDGET:
        raise ValueError(f"the block table [{num_seqs}, {padded_pages_per_seq}] int32 (after padding to a multiple "
                         f"of pages_per_block) and the context lengths take {smem_bytes} bytes of TPU scalar memory, "
                         f"over the {SMEM_BUDGET}-byte budget of the compiled TPU kernel: call it on fewer sequences "
                         f"at a time, or with a larger page_size (fewer pages per sequence)")


def _paged_attention_tpu_kernel(
    block_tables_ref,  # SMEM [num_seqs * padded_pages_per_seq] int32 (flattened; scalar prefetch)
    context_lens_ref,  # SMEM [num_seqs] int32 (scalar prefetch)
    row_query_index_ref,  # VMEM [block_rows, 1] int32
    q_ref,  # VMEM [block_rows, head_dim]
    *refs,  # tree word refs (VMEM [block_rows, 1] int32 each; none without a tree), k page refs x pages_per_block,
    # v page refs x pages_per_block (with an extension: then the extension's k and v page refs, as many), out_ref,
    # acc, row_max, row_sum scratch
    blocking: QueryBlocking,
    pages_per_block: int,
    scale: float,
    num_tree_words: int,
    tree_window: int,  # M of the tree mask (0: no tree)
    base_pages: int,  # pages of the base pool; 0: no extension pool
    padded_pages_per_seq: int,
):
    word_refs, refs = refs[:num_tree_words], refs[num_tree_words:]
    num_page_refs = 4 * pages_per_block if base_pages else 2 * pages_per_block
    page_refs, (out_ref, acc_ref, row_max_ref, row_sum_ref) = refs[:num_page_refs], refs[num_page_refs:]
    k_refs = page_refs[:pages_per_block]  # each VMEM [page_size, head_dim]
    v_refs = page_refs[pages_per_block : 2 * pages_per_block]
    seq, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    page_size = k_refs[0].shape[0]

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        row_max_ref[...] = jnp.full_like(row_max_ref, MASK_VALUE)
        row_sum_ref[...] = jnp.zeros_like(row_sum_ref)

    context_len = context_lens_ref[seq]
    num_pages = lax.div(num_keys_needed(context_len, q_block, blocking) + page_size - 1, page_size)
    query_pos = context_len - blocking.q_len + row_query_index_ref[...]  # [block_rows, 1]

    for j in range(pages_per_block):
        logical_page = step * pages_per_block + j

        @pl.when(logical_page < num_pages)
        def _attend(j=j, logical_page=logical_page):
            k, v = k_refs[j][...], v_refs[j][...]
            if base_pages:  # the page's pool: its input holds it (the other input is parked, see the module doc)
                in_base = block_tables_ref[seq * padded_pages_per_seq + logical_page] < base_pages
                k = jnp.where(in_base, k, page_refs[2 * pages_per_block + j][...])
                v = jnp.where(in_base, v, page_refs[3 * pages_per_block + j][...])
            start = logical_page * page_size
            key_pos_row = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            key_pos_col = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
            visible = None
            if word_refs:
                words = tuple(ref[...] for ref in word_refs)
                visible = tree_visible(words, key_pos_row, context_len - tree_window)
            acc, row_max, row_sum = online_softmax_step(
                q_ref[...],
                k,
                v,
                key_pos_row,
                key_pos_col,
                query_pos,
                context_len,
                acc_ref[...],
                row_max_ref[...],
                row_sum_ref[...],
                scale=scale,
                visible=visible,
            )
            acc_ref[...] = acc
            row_max_ref[...] = row_max
            row_sum_ref[...] = row_sum

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        out_ref[...] = normalise(acc_ref[...], row_sum_ref[...]).astype(out_ref.dtype)


def _page_index_map(j, *, blocking, pages_per_block, page_size, padded_pages_per_seq, total_pages, pool=None,
                    base_pages=0):
    """index_map of the ``j``-th K (or V) input: the physical page of logical page ``step * ppb + j``. With an
    extension pool (``base_pages`` > 0) ``pool`` says which input this is ("base" or "ext"): its page index in that
    pool, page 0 when the other pool holds the page.

    A q block that sees no key (context 0, or only left padding) DMAs the reserved page 0: the body skips every
    step, and the table's first entry is then padding, which may hold anything (the interpreter raised on 10**6, a
    compiled body would have DMA'd from past the pool). Other ids are clamped into the pools (``total_pages``: base
    plus extension), as the GPU body reads no page outside them: an id out of range under jit (unchecked there)
    becomes a wrong page, not an out-of-bounds DMA."""

    def index_map(seq, kv_head, q_block, step, block_tables_ref, context_lens_ref):
        num_keys = num_keys_needed(context_lens_ref[seq], q_block, blocking)
        last_page = jnp.maximum(lax.div(num_keys + page_size - 1, page_size) - 1, 0)
        # Past the last visible page, repeat it: same block index as the previous step -> no new DMA.
        logical_page = jnp.minimum(step * pages_per_block + j, last_page)
        page = block_tables_ref[seq * padded_pages_per_seq + logical_page]
        page = jnp.where(num_keys > 0, jnp.clip(page, 0, total_pages - 1), 0)
        if pool == "base":
            page = jnp.where(page < base_pages, page, 0)
        elif pool == "ext":
            page = jnp.where(page < base_pages, 0, page - base_pages)
        return kv_head, page, 0, 0

    return index_map


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "block_rows"))
def paged_attention_tpu(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32
    tree_mask: jax.Array | None = None,  # [q_len, M] bool (reference.py: speculative token trees)
    k_ext: jax.Array | None = None,  # [num_kv_heads, num_ext_pages, page_size, head_dim]: page ids num_pages..
    v_ext: jax.Array | None = None,
    *,
    scale: float,
    interpret: bool | object,
    pages_per_block: int = TPU_TUNING_DEFAULTS["pages_per_block"],
    block_rows: int = TPU_TUNING_DEFAULTS["block_rows"],
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim]
    """Paged attention with the TPU body; inputs are assumed validated by ``paged_attention``.

    ``interpret`` is False (compile with Mosaic), True (Pallas' generic interpreter) or a
    ``pltpu.InterpretParams`` (the TPU interpreter, which simulates VMEM/SMEM and DMAs on CPU).
    """
    if pltpu is None:  # pragma: no cover
        raise RuntimeError("jax.experimental.pallas.tpu is not available in this jax build")
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    base_pages = 0 if k_ext is None else num_pages
    total_pages = num_pages + (0 if k_ext is None else k_ext.shape[1])
    blocking = QueryBlocking.choose(q_len, num_q_heads // num_kv_heads, block_rows)
    q_folded = fold_queries(q, num_kv_heads, blocking)  # [num_seqs, num_kv_heads, num_q_blocks * rows, head_dim]
    block_tables = pad_block_tables(block_tables, pages_per_block)
    padded_pages_per_seq = block_tables.shape[1]
    if not interpret:
        check_compiled_tpu_shapes(page_size, k_pages.dtype, num_seqs, padded_pages_per_seq)
    row_query_index = jnp.asarray(blocking.row_query_index())  # [num_q_blocks * rows, 1]
    rows = blocking.block_rows
    words = () if tree_mask is None else tree_words(tree_mask, blocking)

    def page_specs(pool=None):
        return [
            pl.BlockSpec(
                (None, None, page_size, head_dim),
                _page_index_map(
                    j,
                    blocking=blocking,
                    pages_per_block=pages_per_block,
                    page_size=page_size,
                    padded_pages_per_seq=padded_pages_per_seq,
                    total_pages=total_pages,
                    pool=pool,
                    base_pages=base_pages,
                ),
            )
            for j in range(pages_per_block)
        ]

    if base_pages:
        base_specs, ext_specs = page_specs("base"), page_specs("ext")
        all_page_specs = [*base_specs, *base_specs, *ext_specs, *ext_specs]
        pools = ([k_pages] * pages_per_block + [v_pages] * pages_per_block + [k_ext] * pages_per_block
                 + [v_ext] * pages_per_block)
    else:
        specs = page_specs()
        all_page_specs = [*specs, *specs]
        pools = [k_pages] * pages_per_block + [v_pages] * pages_per_block
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_seqs, num_kv_heads, blocking.num_q_blocks, padded_pages_per_seq // pages_per_block),
        in_specs=[
            pl.BlockSpec((rows, 1), lambda s, h, b, p, *_: (b, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b, p, *_: (s, h, b, 0)),
            *[pl.BlockSpec((rows, 1), lambda s, h, b, p, *_: (b, 0)) for _ in words],
            *all_page_specs,
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b, p, *_: (s, h, b, 0)),
        scratch_shapes=[
            pltpu.VMEM((rows, head_dim), jnp.float32),  # acc
            pltpu.VMEM((rows, 1), jnp.float32),  # row_max
            pltpu.VMEM((rows, 1), jnp.float32),  # row_sum
        ],
    )
    kernel = functools.partial(
        _paged_attention_tpu_kernel, blocking=blocking, pages_per_block=pages_per_block, scale=scale,
        num_tree_words=len(words), tree_window=0 if tree_mask is None else tree_mask.shape[1],
        base_pages=base_pages, padded_pages_per_seq=padded_pages_per_seq,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_folded.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=(f"paged_attention_tpu_rows{rows}_ppb{pages_per_block}" + ("_tree" if words else "")
              + ("_ext" if base_pages else "")),
    )(
        block_tables.reshape(-1),
        context_lens,
        row_query_index,
        q_folded,
        *words,
        *pools,
    )
    return unfold_outputs(out, blocking)
