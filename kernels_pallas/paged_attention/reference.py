"""Pure-jnp paged attention: the oracle for the Pallas kernels and the CPU fallback.

Vocabulary
- page: ``page_size`` consecutive token slots of K (or V) for one KV head, in a pool of ``num_pages`` pages.
- block table: per sequence, the physical page id of each logical page (logical page j holds positions
  ``j * page_size ... (j + 1) * page_size - 1``). Entries past the sequence's last page are padding (0).
- context length: the number of tokens of a sequence in the cache, *including* the ``q_len`` new tokens whose
  K/V were written before attention runs.
- query position: query ``i`` of a sequence sits at absolute position ``context_len - q_len + i``; it attends
  keys at positions ``0 .. that position`` (causal within the new tokens). A query whose position is negative is
  left padding (used to right-align ragged prefill chunks) and its output is zero.
- tree mask (optional, speculative token trees): ``[q_len, M]`` bool over the window of the last ``M >= q_len`` key
  positions ``context_len - M .. context_len - 1``; query ``i`` additionally sees window key ``j`` only where
  ``tree_mask[i, j]`` (its ancestors and itself in the tree). Keys before the window stay causal-visible.

Worked example (page_size 4, q_len 2, context_len 6, block table [7, 3, 0, ...]): query 0 is position 4 and reads
keys 0..4 = page 7 slots 0..3 and page 3 slot 0; query 1 is position 5 and also reads page 3 slot 1.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def validate_inputs(q, k_pages, v_pages, block_tables, context_lens, scale, num_ext_pages: int = 0,
                    lenient_dtypes: bool = False) -> None:
    """The contract's shapes and dtypes (every implementation checks them: the reference read a wrong shape as a
    silent broadcast or a cryptic reshape error), sizes of at least 1, and, for concrete (not traced) block tables
    and context lengths, their values: each context within its table's pages, and the table's ids over the pages a
    context covers within the pools (``num_pages`` plus ``num_ext_pages`` of an extension). Inside ``jit`` the
    values are the caller's to keep (the engine's scheduler does): an id out of range is clamped by XLA's gather
    and would be an out-of-bounds read in a compiled kernel.

    ``lenient_dtypes`` (the reference, which computes in float32 whatever it is given, as the CPU kernel casts):
    float16 too, integer tables and lengths of any width, and any real scale (a numpy or concrete jax scalar);
    the Pallas bodies take float32 / bfloat16, int32 and a real number (a Python or numpy scalar: it is baked into
    the kernel as a Python float)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [num_seqs, q_len, num_q_heads, head_dim] (rank 4), got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim] (rank 4), got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    floats = (*SUPPORTED_DTYPES, jnp.float16) if lenient_dtypes else SUPPORTED_DTYPES
    for name, array in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if array.dtype not in floats:
            raise ValueError(f"{name} dtype {array.dtype} is not supported; allowed: "
                             f"{', '.join(jnp.dtype(d).name for d in floats)}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype} and {v_pages.dtype}")
    num_seqs, _, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    for name, size in (("num_kv_heads (k_pages axis 0)", num_kv_heads), ("num_pages (k_pages axis 1)", num_pages),
                       ("page_size (k_pages axis 2)", page_size), ("head_dim (q axis 3)", head_dim)):
        if size < 1:
            raise ValueError(f"{name} is {size}: must be at least 1")
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages head_dim {k_pages.shape[3]} must equal q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} (q axis 2) must be a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_pages_per_seq], got {block_tables.shape}")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}], got shape {context_lens.shape}")
    for name, array in (("block_tables", block_tables), ("context_lens", context_lens)):
        if not (jnp.issubdtype(array.dtype, jnp.integer) if lenient_dtypes else array.dtype == jnp.int32):
            raise ValueError(f"{name} dtype must be {'an integer type' if lenient_dtypes else 'int32'}, got "
                             f"{array.dtype}")
    if lenient_dtypes:
        if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) or getattr(scale, "shape", None) == ()):
            raise ValueError(f"scale must be a real number, got {type(scale).__name__}")
    elif not isinstance(scale, numbers.Real):  # (numpy scalars are numbers.Real too; check_scale refuses a bool)
        raise ValueError(f"scale must be a Python or numpy real number (it is baked into the kernel), got "
                         f"{type(scale).__name__}")
    check_scale(scale)
    if isinstance(block_tables, jax.core.Tracer) or isinstance(context_lens, jax.core.Tracer):
        return
    import numpy as np

    ctx, table = np.asarray(context_lens), np.asarray(block_tables)
    width = table.shape[1]
    bad = np.flatnonzero((ctx < 0) | (ctx > width * page_size))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"context_lens[{s}]={int(ctx[s])} is out of range: allowed 0 .. {width * page_size} (the "
                         f"block table's {width} pages of {page_size} tokens)")
    used = np.arange(width)[None, :] < -(-ctx[:, None] // page_size)
    total = num_pages + num_ext_pages
    wrong = used & ((table < 0) | (table >= total))
    if wrong.any():
        s, j = (int(i[0]) for i in np.nonzero(wrong))
        raise ValueError(f"block_tables[{s}, {j}]={int(table[s, j])} is out of range: the pools hold pages 0 .. "
                         f"{total - 1}")


def check_scale(scale) -> None:
    """A concrete scale must be a finite float32 number (the kernels compute in float32): a NaN, an infinite one or one
    past float32's range (1e39) gave NaN on the reference and Pallas paths and zeros on the CPU kernel, never an
    error. A bool is not a scale."""
    if isinstance(scale, bool):
        raise ValueError(f"scale must be a real number, got bool {scale}")
    if isinstance(scale, jax.core.Tracer):
        return
    value = float(scale)
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ValueError(f"scale must be a finite float32 number (1 / sqrt(head_dim) by convention), got {value}")


FLOAT32_MAX = 3.4028234663852886e38


def paged_attention_reference(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32
    *,
    scale: float,
    tree_mask: jax.Array | None = None,  # [q_len, M] bool over the last M key positions (module docstring)
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim], dtype of q
    """Multi-query causal attention over a paged KV cache with GQA; see the module docstring for terms.

    Scores and softmax run in float32. Keys at positions >= context_len are never used: their scores are masked
    and their values are replaced by zeros before the weighted sum, so NaN in unused pages cannot leak.
    """
    validate_inputs(q, k_pages, v_pages, block_tables, context_lens, scale, lenient_dtypes=True)
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_pages = block_tables.shape[1]
    num_keys = max_pages * page_size

    # [num_kv_heads, num_seqs, max_pages, page_size, head_dim] -> [num_seqs, num_kv_heads, num_keys, head_dim]
    k = k_pages[:, block_tables].transpose(1, 0, 2, 3, 4).reshape(num_seqs, num_kv_heads, num_keys, head_dim)
    v = v_pages[:, block_tables].transpose(1, 0, 2, 3, 4).reshape(num_seqs, num_kv_heads, num_keys, head_dim)

    key_pos = jnp.arange(num_keys, dtype=jnp.int32)  # [num_keys]
    key_valid = key_pos[None, :] < context_lens[:, None]  # [num_seqs, num_keys]
    k = jnp.where(key_valid[:, None, :, None], k, 0).astype(jnp.float32)
    v = jnp.where(key_valid[:, None, :, None], v, 0).astype(jnp.float32)

    query_pos = context_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]  # [num_seqs, q_len]
    # [num_seqs, q_len, num_keys]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]
    if tree_mask is not None:
        check_tree_mask(tree_mask, q_len)
        mask &= tree_visible(tree_mask, key_pos, context_lens)

    qg = q.astype(jnp.float32).reshape(num_seqs, q_len, num_kv_heads, group, head_dim)
    # float32 products at full precision: XLA:GPU's default takes TF32 inputs (~1e-3 off), too loose for an oracle
    hi = jax.lax.Precision.HIGHEST
    # [num_seqs, kv_heads, group, q_len, num_keys]
    scores = jnp.einsum("sqhgd,shkd->shgqk", qg, k, precision=hi) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    # Rows that see no key get zeros, as in every kernel: left padding (a negative position), and under jit a tree
    # row that allows none (a concrete mask with such a row is refused by check_tree_mask); softmax would give NaN.
    sees = mask.any(axis=-1)  # [num_seqs, q_len]
    scores = jnp.where(sees[:, None, None, :, None], scores, 0.0)  # finite scores, output zeroed below
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("shgqk,shkd->sqhgd", probs, v, precision=hi)
    out = jnp.where(sees[:, :, None, None, None], out, 0.0)
    return out.reshape(num_seqs, q_len, num_q_heads, head_dim).astype(q.dtype)


def check_tree_mask(tree_mask: jax.Array, q_len: int) -> None:
    """The tree mask's contract (module docstring), shared by every implementation: its shape and dtype, and, for a
    concrete (not traced) mask, that each row allows a key at or before its own column ``M - q_len + i`` (a row holds
    its ancestors and itself). A row allowing none saw nothing where the context is the window: the reference gave
    NaN and every kernel 0. Under jit all give 0."""
    if tree_mask.ndim != 2 or tree_mask.shape[0] != q_len or tree_mask.shape[1] < q_len:
        raise ValueError(f"tree_mask {tree_mask.shape} must be [q_len={q_len}, M >= q_len]")
    if tree_mask.dtype != jnp.bool_:  # (the CPU kernel cast 0.5 to False, the reference failed on floats)
        raise ValueError(f"tree_mask dtype must be bool, got {tree_mask.dtype}")
    if isinstance(tree_mask, jax.core.Tracer):
        return
    import numpy as np

    window = tree_mask.shape[1]
    own = window - q_len + np.arange(q_len)  # row i's own column
    allowed = np.asarray(tree_mask) & (np.arange(window)[None, :] <= own[:, None])
    empty = np.flatnonzero(~allowed.any(axis=1))
    if empty.size:
        i = int(empty[0])
        raise ValueError(f"tree_mask row {i} allows no key at or before its own column {int(own[i])}: each row must "
                         f"allow its ancestors and itself")


def tree_visible(tree_mask: jax.Array, key_pos: jax.Array, context_lens: jax.Array) -> jax.Array:
    """Which keys each query may see under a tree mask ``[q_len, M]`` (module docstring): ``[num_seqs, q_len,
    num_keys]`` bool, True before the window of the last ``M`` positions and where the mask allows inside it
    (causality is the caller's)."""
    q_len, window = tree_mask.shape
    rel = key_pos[None, None, :] - (context_lens[:, None, None] - window)  # [num_seqs, 1, num_keys]
    return (rel < 0) | tree_mask[jnp.arange(q_len)[None, :, None], jnp.clip(rel, 0, window - 1)]
