"""GPU body of paged attention: Pallas with the Triton lowering (also the body run interpreted on CPU).

Grid ``(num_seqs, num_kv_heads, num_q_blocks)``; one program owns the folded rows of one q block (see
``layout.py``) and loops over only the pages that q block can see, ``pages_per_block`` pages per iteration. The
whole page pool of its KV head is the program's block; pages are gathered by id from the block table
(``k_pages_ref[page_ids]``), the same gather ``jax.experimental.pallas.ops.gpu.paged_attention`` uses.

Split keys (``num_splits > 1``, flash-decoding): a fourth grid axis cuts the block table's loop iterations into
``num_splits`` equal ranges at fixed positions; each program writes its range's un-normalised sums, running max and
running sum (float32), and :func:`combine_splits` merges the ranges in order. A small grid (batch 1, GQA: 8
programs on a GPU of 132 multiprocessors) then spreads one long context over many programs. Off by default (1):
on an H200 the unsplit body was 4.5x XLA's time for GQA decode at batch 1 and 4096 keys, and the split body has
not been timed on a GPU yet (``scripts/device_check.py`` times both).

Extension pool (elastic memory, ``nightjar_jax.memory``): page ids from the base pool's page count on address a
second pool. The body then takes both pools of its KV head and reads each page from the pool that holds it with
two masked loads (``plgpu.load``): a lane masked off issues no memory access, so the bytes read are the pages'
own, as from one pool, and nothing is copied.
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
    "num_splits": 1,  # ranges of keys per (sequence, KV head, q block), each its own program; 1: no split
}

# Programs a split grid aims for in ``auto_num_splits`` (an H200 has 132 multiprocessors).
SPLIT_TARGET_PROGRAMS = 128

# Keys per loop iteration the compiled body needs at least: the key tile (block_k = pages_per_block * page_size) is
# N of ``q @ k.T`` and K of ``p @ v``, and Triton's tl.dot needs >= 16 along both (TritonGPUAccelerateMatmul
# failed for sm_80 and sm_90 on tiles of 2 and 4 keys: page 1 with pages_per_block 2 or 4, page 2 with 1).
MIN_BLOCK_K = 16
# Shared memory one compiled program may plan for, in bytes. 96 KiB is under every sm_80+ part's per-block
# maximum (99 KiB on sm_86 / sm_89, 163 KiB on an A100, 227 KiB on an H100 / H200), leaving A100 and H100 room for
# what ``shared_memory_bytes`` does not model. Without a bound the defaults asked for far more (Triton compiled
# for sm_80, ``metadata.shared``): bf16 page 64, head_dim 128, 4 pages per block 208,896 B; f32 page 128,
# head_dim 64 430,080 B, which no GPU can launch.
SHARED_MEMORY_BUDGET = 96 * 1024


def shared_memory_bytes(block_k: int, head_dim: int, itemsize: int, num_stages: int, block_rows: int,
                        extension: bool = False) -> int:
    """Shared memory of one compiled program: ``2 * num_stages - 1`` K/V tiles ``[block_k, head_dim]`` (twice that
    with an extension pool, whose masked loads are pipelined too) plus the q tile ``[block_rows, head_dim]`` and the
    probabilities ``[block_rows, block_k]``. Fitted to Triton 3.x for sm_80 (``metadata.shared`` of the lowered
    body): exact for one pool over bf16 / f32, pages 16..128, head_dim 64..256, 1 or 2 stages (e.g. bf16 page 16,
    head_dim 128, 4 pages, 16 rows, 2 stages: 3 * 16,384 + 16 * 192 * 2 = 55,296 B); an upper bound with an
    extension (measured 5 tiles where this counts 6). ``itemsize``: the wider of q's and the pools' dtypes."""
    tiles = (2 * num_stages - 1) * (2 if extension else 1)
    return (tiles * block_k * head_dim + block_rows * (head_dim + block_k)) * itemsize


def choose_gpu_tiles(page_size: int, head_dim: int, itemsize: int, *, block_rows: int, extension: bool = False,
                     pages_per_block: int | None = None, num_stages: int | None = None,
                     budget: int = SHARED_MEMORY_BUDGET) -> tuple[int, int]:
    """``(pages_per_block, num_stages)`` for the compiled GPU body: a key tile of at least ``MIN_BLOCK_K`` keys
    whose ``shared_memory_bytes`` fit ``budget``. ``None`` = the caller left it to us: pages_per_block starts at the
    default raised to the 16-key minimum and is halved (not below it) until the tile fits at the default num_stages;
    if none does, num_stages 1 with the widest tile that fits. A caller's value is kept, or refused with a
    ValueError naming it and what fits; a page too large for any tile is a ValueError naming the page size that fits.
    ``page_size`` and ``head_dim`` are powers of two (checked by the wrapper), so the minimum is exact.

    Example (bf16, head_dim 128, 16 rows): page 1 -> (16, 2); page 16 -> (4, 2); page 64 -> (1, 2); page 128 ->
    (2, 1); f32 page 128, head_dim 64 -> (2, 1); f32 page 256, head_dim 256 -> ValueError (page_size <= 64)."""
    min_pages = max(1, MIN_BLOCK_K // page_size)

    def fits(ppb: int, stages: int) -> bool:
        return shared_memory_bytes(ppb * page_size, head_dim, itemsize, stages, block_rows, extension) <= budget

    if pages_per_block is not None and pages_per_block < min_pages:
        raise ValueError(f"pages_per_block={pages_per_block} with page_size={page_size} gives a key tile of "
                         f"{pages_per_block * page_size} keys; the compiled GPU (Triton) kernel needs at least "
                         f"{MIN_BLOCK_K} (tl.dot): use pages_per_block >= {min_pages}, or leave it unset")
    stage_options = [num_stages] if num_stages is not None else [GPU_TUNING_DEFAULTS["num_stages"], 1]
    if pages_per_block is not None:
        ppb_options = [pages_per_block]
    else:
        ppb = max(GPU_TUNING_DEFAULTS["pages_per_block"], min_pages)
        ppb_options = [ppb >> i for i in range(ppb.bit_length()) if ppb >> i >= min_pages]
    for stages in stage_options:  # the deepest pipeline first, then the widest tile
        for ppb in ppb_options:
            if fits(ppb, stages):
                return ppb, stages
    dtype = {2: "bfloat16", 4: "float32"}.get(itemsize, f"{itemsize}-byte")
    need = shared_memory_bytes(ppb_options[-1] * page_size, head_dim, itemsize, stage_options[-1], block_rows,
                               extension)
    where = (f"page_size={page_size}, head_dim={head_dim}, {dtype}, {block_rows} rows"
             + (", an extension pool" if extension else ""))
    given = ", ".join(f"{name}={value}" for name, value in (("pages_per_block", pages_per_block),
                                                            ("num_stages", num_stages)) if value is not None)
    for stages in range(stage_options[0], 0, -1):  # a caller's value that cannot fit: what would, deepest first
        widest = [p for p in (1 << i for i in range(16)) if p >= min_pages and fits(p, stages)]
        if widest:
            raise ValueError(f"{given} needs ~{need} bytes of GPU shared memory ({where}), over the {budget}-byte "
                             f"budget: pages_per_block <= {widest[-1]} with num_stages={stages} fits, or leave "
                             f"them unset")
    fitting = [p for p in (1 << i for i in range(12))
               if shared_memory_bytes(max(p, MIN_BLOCK_K), head_dim, itemsize, 1, block_rows, extension) <= budget]
    hint = f"page_size <= {fitting[-1]} at this head_dim" if fitting else "a smaller head_dim"
    raise ValueError(f"one key tile of {max(page_size, MIN_BLOCK_K)} keys needs ~{need} bytes of GPU shared memory "
                     f"({where}, num_stages={stage_options[-1]}), over the {budget}-byte budget of the compiled GPU "
                     f"kernel: use {hint}" + (", or a bfloat16 pool and q" if itemsize > 2 else ""))


def _paged_attention_gpu_kernel(
    block_tables_ref,  # [padded_pages_per_seq] int32 (this sequence's row)
    context_lens_ref,  # [1] int32
    row_query_index_ref,  # [block_rows, 1] int32
    q_ref,  # [block_rows, head_dim]
    k_pages_ref,  # [num_pages, page_size, head_dim] (this KV head's pool)
    v_pages_ref,  # [num_pages, page_size, head_dim]
    *refs,  # with an extension: k_ext_ref, v_ext_ref ([num_ext_pages, page_size, head_dim]); tree word refs
    # ([block_rows, 1] int32 each; none without a tree), then the outputs: out_ref
    # [block_rows, head_dim]; split (iters_per_split > 0): acc_ref [block_rows, head_dim] f32, max_ref and sum_ref
    # [block_rows, 1] f32
    blocking: QueryBlocking,
    pages_per_block: int,
    scale: float,
    tree_window: int,  # M of the tree mask (0: no tree)
    iters_per_split: int,  # loop iterations per split (0: no split)
    extension: bool,  # k_ext_ref and v_ext_ref follow v_pages_ref
):
    num_outputs = 3 if iters_per_split else 1
    ext_refs, refs = (refs[:2], refs[2:]) if extension else ((None, None), refs)
    word_refs, out_refs = refs[:-num_outputs], refs[-num_outputs:]
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
    # The q block's last visible page (within the table), where the ids past it are read (``visible_page_ids``).
    last_page = jnp.clip(lax.div(num_keys + page_size - 1, page_size) - 1, 0, block_tables_ref.shape[0] - 1)

    def body(iteration, carry):
        acc, row_max, row_sum = carry
        page_ids = visible_page_ids(block_tables_ref, iteration, pages_per_block, last_page)  # [pages_per_block]
        k = _load_pages(k_pages_ref, ext_refs[0], page_ids).reshape(block_k, head_dim)
        v = _load_pages(v_pages_ref, ext_refs[1], page_ids).reshape(block_k, head_dim)
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
    if not iters_per_split:
        acc, row_max, row_sum = lax.fori_loop(0, num_iterations, body, (acc, row_max, row_sum))
        out_refs[0][...] = normalise(acc, row_sum).astype(out_refs[0].dtype)
        return
    first = pl.program_id(3) * iters_per_split
    last = jnp.maximum(jnp.minimum(first + iters_per_split, num_iterations), first)  # empty past the context
    acc, row_max, row_sum = lax.fori_loop(first, last, body, (acc, row_max, row_sum))
    acc_ref, max_ref, sum_ref = out_refs
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def visible_page_ids(block_tables_ref, iteration, pages_per_block: int, last_page) -> jax.Array:
    """The page ids of loop iteration ``iteration`` (``[pages_per_block]``: logical pages ``iteration *
    pages_per_block + j``), each logical page past ``last_page`` (the last one the q block sees) read as
    ``last_page``, as the TPU body's index_map does. Block-table entries past a context are padding and may hold
    anything (``validate_inputs`` checks only the pages a context covers): gathered as they are, a compiled body
    loaded pages 1e6 or -7 pages away from the pool. The keys of a repeated page sit past the q block's last
    position (or the context) and are masked as before."""
    logical = iteration * pages_per_block + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
    return block_tables_ref[jnp.minimum(logical, last_page)]


def _load_pages(pool_ref, ext_ref, page_ids: jax.Array) -> jax.Array:
    """The pages ``page_ids`` (``[n]``) of a KV head, ``[n, page_size, head_dim]``: gathered from ``pool_ref``, or
    with an extension pool (``ext_ref``, ids from the pool's page count on) by two masked loads, each touching only
    the pages its pool holds. ``plgpu.load`` takes an index array per axis (the interpreter takes no mix of arrays
    and slices in a masked load), so the slots and columns are iotas broadcast against the page ids."""
    if ext_ref is None:
        return pool_ref[page_ids]
    if plgpu is None:  # pragma: no cover
        raise RuntimeError("reading an extension pool needs jax.experimental.pallas.triton (masked loads), which "
                           "this jax build lacks")
    base = pool_ref.shape[0]
    shape = (page_ids.shape[0], *pool_ref.shape[1:])
    slot = lax.broadcasted_iota(jnp.int32, shape, 1)
    col = lax.broadcasted_iota(jnp.int32, shape, 2)
    in_base = jnp.broadcast_to((page_ids < base)[:, None, None], shape)
    ids = page_ids[:, None, None]
    zero = jnp.zeros((), pool_ref.dtype)
    from_base = plgpu.load(pool_ref.at[jnp.where(in_base, ids, 0), slot, col], mask=in_base, other=zero)
    from_ext = plgpu.load(ext_ref.at[jnp.where(in_base, 0, ids - base), slot, col], mask=~in_base, other=zero)
    return jnp.where(in_base, from_base, from_ext)


def auto_num_splits(num_programs: int, max_iterations: int, target: int = SPLIT_TARGET_PROGRAMS) -> int:
    """Splits that bring ``num_programs`` (sequences x KV heads x q blocks) up to about ``target`` programs: a power
    of two, at most ``max_iterations`` (one loop iteration per split), 1 when the grid is already that large."""
    want = -(-target // max(num_programs, 1))
    return max(1, min(1 << (want - 1).bit_length(), max_iterations))


def split_plan(num_seqs: int, num_kv_heads: int, blocking: QueryBlocking, max_iterations: int,
               num_splits: int) -> tuple[int, int]:
    """``(iterations per split, splits)`` the body runs for ``num_splits`` (0: :func:`auto_num_splits` over the
    grid's ``num_seqs x num_kv_heads x q blocks`` programs); ``(0, 1)`` when it does not split. The splits actually
    run can be fewer than asked: equal ranges of ``ceil(max_iterations / num_splits)`` iterations."""
    if num_splits == 0:
        num_splits = auto_num_splits(num_seqs * num_kv_heads * blocking.num_q_blocks, max_iterations)
    if num_splits <= 1:
        return 0, 1
    iters_per_split = -(-max_iterations // num_splits)
    return iters_per_split, -(-max_iterations // iters_per_split)


def combine_splits(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """Merge per-split flash-attention state along axis 2 (``[..., num_splits, rows, head_dim | 1]``), in split
    order, into normalised float32 outputs ``[..., rows, head_dim]``. An empty split (max ``MASK_VALUE``, sum 0)
    adds nothing; rows no split saw come out 0; a NaN sum (a stray read) stays NaN."""
    num_splits = acc.shape[2]
    top = jnp.max(row_max, axis=2)
    total_acc = jnp.zeros_like(acc[:, :, 0])
    total_sum = jnp.zeros_like(row_sum[:, :, 0])
    for i in range(num_splits):  # a fixed order of sums, whatever the shapes around it
        weight = jnp.exp(row_max[:, :, i] - top)
        total_acc = total_acc + weight * acc[:, :, i]
        total_sum = total_sum + weight * row_sum[:, :, i]
    return normalise(total_acc, total_sum)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "pages_per_block", "block_rows", "num_warps", "num_stages", "num_splits"),
)
def paged_attention_gpu(
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
    interpret: bool,
    pages_per_block: int = GPU_TUNING_DEFAULTS["pages_per_block"],
    block_rows: int = GPU_TUNING_DEFAULTS["block_rows"],
    num_warps: int = GPU_TUNING_DEFAULTS["num_warps"],
    num_stages: int = GPU_TUNING_DEFAULTS["num_stages"],
    num_splits: int = GPU_TUNING_DEFAULTS["num_splits"],
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim]
    """Paged attention with the GPU body; inputs are assumed validated by ``paged_attention``. ``num_splits``: key
    ranges per (sequence, KV head, q block) (module doc); 0 picks :func:`auto_num_splits` from the grid's size."""
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    blocking = QueryBlocking.choose(q_len, num_q_heads // num_kv_heads, block_rows)
    q_folded = fold_queries(q, num_kv_heads, blocking)  # [num_seqs, num_kv_heads, num_q_blocks * rows, head_dim]
    block_tables = pad_block_tables(block_tables, pages_per_block)
    padded_pages_per_seq = block_tables.shape[1]
    row_query_index = jnp.asarray(blocking.row_query_index())  # [num_q_blocks * rows, 1]
    rows = blocking.block_rows
    words = () if tree_mask is None else tree_words(tree_mask, blocking)

    iters_per_split, splits = split_plan(num_seqs, num_kv_heads, blocking, padded_pages_per_seq // pages_per_block,
                                         num_splits)

    extension = k_ext is not None
    kernel = functools.partial(
        _paged_attention_gpu_kernel, blocking=blocking, pages_per_block=pages_per_block, scale=scale,
        tree_window=0 if tree_mask is None else tree_mask.shape[1], iters_per_split=iters_per_split,
        extension=extension,
    )
    compiler_params = None
    if plgpu is not None:
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    pools = (k_pages, v_pages, k_ext, v_ext) if extension else (k_pages, v_pages)
    in_specs = [
        pl.BlockSpec((None, padded_pages_per_seq), lambda s, h, b, *_: (s, 0)),
        pl.BlockSpec((None, 1), lambda s, h, b, *_: (s, 0)),
        pl.BlockSpec((rows, 1), lambda s, h, b, *_: (b, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b, *_: (s, h, b, 0)),
        *[pl.BlockSpec((None, pool.shape[1], page_size, head_dim), lambda s, h, b, *_: (h, 0, 0, 0))
          for pool in pools],
        *[pl.BlockSpec((rows, 1), lambda s, h, b, *_: (b, 0)) for _ in words],
    ]
    name = (f"paged_attention_gpu_rows{rows}_ppb{pages_per_block}" + ("_tree" if words else "")
            + ("_ext" if extension else ""))
    args = (block_tables, context_lens.reshape(num_seqs, 1), row_query_index, q_folded, *pools, *words)
    if not iters_per_split:
        out = pl.pallas_call(
            kernel,
            grid=(num_seqs, num_kv_heads, blocking.num_q_blocks),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b: (s, h, b, 0)),
            out_shape=jax.ShapeDtypeStruct(q_folded.shape, q.dtype),
            compiler_params=compiler_params,
            interpret=interpret,
            name=name,
        )(*args)
        return unfold_outputs(out, blocking)
    split_shape = (num_seqs, num_kv_heads, splits, q_folded.shape[2])
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, blocking.num_q_blocks, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, b, p: (s, h, p, b, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda s, h, b, p: (s, h, p, b, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda s, h, b, p: (s, h, p, b, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*split_shape, 1), jnp.float32),
            jax.ShapeDtypeStruct((*split_shape, 1), jnp.float32),
        ],
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"{name}_split{splits}",
    )(*args)
    return unfold_outputs(combine_splits(acc, row_max, row_sum).astype(q.dtype), blocking)
