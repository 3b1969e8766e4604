"""The one dispatch point for paged attention: ``impl = auto | pallas | cpu | reference``.

- ``reference``: the pure-jnp oracle in ``kernels_pallas/paged_attention/reference.py``.
- ``pallas``: the Pallas kernel; compiled on GPU/TPU, interpreted (``interpret=True``) on CPU for tests.
- ``cpu``: the C++ XLA FFI kernel in ``kernels_pallas/paged_attention/cpu.py`` (CPU backend only; built on first
  use; ~7x faster than the reference at batch 32 with 64-token contexts: 30 layers 3.7 vs 27 ms).
- ``auto``: ``pallas`` on GPU/TPU; on CPU, ``cpu`` when that kernel builds, else ``reference``.

All implementations share one contract (see the reference's docstring): q ``[num_seqs, q_len, num_q_heads,
head_dim]``, one layer's K/V pools ``[num_kv_heads, num_pages, page_size, head_dim]`` (``uint16`` pools hold bfloat16
bit patterns: ``nightjar_jax.models.llama.kv_storage_dtype``; the CPU kernel reads them as they are), block tables,
context lengths that include the ``q_len`` new tokens, and query ``i`` at position ``context_len - q_len + i``; an
optional tree mask (speculative token trees) narrows what each query sees among the last keys (every implementation
takes it). An optional extension pool (``k_ext``/``v_ext``, elastic memory: ``nightjar_jax.memory``) holds the
pages whose ids are ``num_pages`` and up: the CPU and Pallas kernels read it in place, the reference reads the
batch's pages gathered from both pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.reference import paged_attention_reference

IMPLS = ("auto", "pallas", "cpu", "reference")


def check_impl(impl: str) -> str:
    """``impl`` when it names an implementation (a model checks it when built, not at its first call)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown: allowed {IMPLS}")
    return impl


def resolve_impl(impl: str) -> str:
    """Map ``auto`` to the concrete implementation for the default backend."""
    check_impl(impl)
    if impl == "auto":
        if jax.default_backend() in ("gpu", "tpu"):
            return "pallas"
        from kernels_pallas.paged_attention import cpu

        return "cpu" if cpu.available() else "reference"
    if impl == "cpu":
        from kernels_pallas.paged_attention import cpu

        if jax.default_backend() != "cpu":
            raise ValueError(f"attention impl 'cpu' runs on the CPU backend only, not {jax.default_backend()!r}")
        if not cpu.available():
            raise RuntimeError(f"attention impl 'cpu' is unavailable: {cpu.unavailable_reason()}")
    return impl


def paged_attention(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32, including the q_len new tokens
    *,
    scale: float,
    impl: str = "auto",
    tree_mask: jax.Array | None = None,  # [q_len, M] bool: a speculative token tree (reference.py)
    layer: int | None = None,  # the pools hold every layer, [L, ...] (models.llama.StackedKV): attend over this one
    k_ext: jax.Array | None = None,  # an extension pool (elastic memory): page ids from num_pages on address it
    v_ext: jax.Array | None = None,
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim]
    auto = impl == "auto"
    impl = resolve_impl(impl)
    if auto and impl == "cpu":
        from kernels_pallas.paged_attention.cpu import MAX_HEAD_DIM, TARGETS

        pools = jnp.dtype(k_pages.dtype)  # (the kernel's pools: float32, bfloat16 or bfloat16 bits; float16 not)
        if (q.shape[-1] > MAX_HEAD_DIM or isinstance(scale, jax.core.Tracer)  # (what the kernel cannot take)
                or (pools not in TARGETS and pools != jnp.uint16) or v_pages.dtype != pools):
            impl = "reference"
    if impl == "cpu":  # the kernel reads the pools in place: one layer of stacked pools, and the extension's
        from kernels_pallas.paged_attention.cpu import paged_attention_cpu

        return paged_attention_cpu(q, k_pages, v_pages, block_tables, context_lens, scale=scale,
                                   tree_mask=tree_mask, layer=layer, k_ext=k_ext, v_ext=v_ext)
    if layer is not None:
        if k_pages.ndim != 5 or v_pages.shape != k_pages.shape:  # (a rank-4 pool lost its KV-head axis as "layers")
            raise ValueError(f"with layer=, k_pages and v_pages must be stacked over the layers, [layers, KVH, pages, "
                             f"page, dim] (rank 5); got {k_pages.shape} and {v_pages.shape}")
        if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < k_pages.shape[0]:
            # (indexing clamps: layer 7 of 2 read layer 1 without a word; the CPU kernel's own check says the same)
            raise ValueError(f"layer {int(layer)} of pools stacked over {k_pages.shape[0]} layers: allowed 0 .. "
                             f"{k_pages.shape[0] - 1}")
        k_pages, v_pages = k_pages[layer], v_pages[layer]
        if k_ext is not None:
            k_ext, v_ext = k_ext[layer], v_ext[layer]
    if k_ext is not None and impl == "reference":
        # The reference reads one pool: gather the batch's pages from the base pool and the extension into one
        # [KVH, S * W, page, dim] (what it gathers anyway).
        from nightjar_jax.models.llama import split_take

        num_seqs, width = block_tables.shape
        k_pages, v_pages = (split_take(lambda p, ids: p[:, ids], pool, ext, block_tables.reshape(-1), lead=1)
                            for pool, ext in ((k_pages, k_ext), (v_pages, v_ext)))
        block_tables = jnp.arange(num_seqs * width, dtype=jnp.int32).reshape(num_seqs, width)
        k_ext = v_ext = None
    if k_pages.dtype == jnp.uint16:  # bfloat16 pools held as bit patterns (llama.kv_storage_dtype)
        k_pages, v_pages, k_ext, v_ext = (None if p is None else jax.lax.bitcast_convert_type(p, jnp.bfloat16)
                                          for p in (k_pages, v_pages, k_ext, v_ext))
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, context_lens, scale=scale,
                                         tree_mask=tree_mask)
    from kernels_pallas.paged_attention import paged_attention as pallas_paged_attention

    return pallas_paged_attention(
        q,
        k_pages,
        v_pages,
        block_tables,
        context_lens,
        scale=scale,
        interpret=jax.default_backend() not in ("gpu", "tpu"),
        tree_mask=tree_mask,
        k_ext=k_ext,
        v_ext=v_ext,
    )
