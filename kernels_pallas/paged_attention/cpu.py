"""Paged attention on the CPU backend: a C++ XLA FFI custom call (``cpu_kernel.cc``), built on first use.

XLA:CPU runs the pure-jnp reference slowly: its page gather is a scalar loop (~2 GB/s on the project's 2-core
machine) and the per-sequence batched dots are tiny; at batch 32 the reference attention took more than half of a
SmolLM2-135M decode step. The kernel reads each key/value row in place, once per block of query rows, and only
below the context length. Contract and results: those of ``reference.py`` (tests compare the two).

Build and caching: ``kernels_pallas/cpu_build.py`` (``g++ -O3 -march=native``, once per source/jax/compiler/CPU
key, ~10 s). ``available()`` is False (with the reason in :func:`unavailable_reason`) when there is no C++ compiler or
the build fails; the engine then uses the reference. ``NIGHTJAR_CPU_KERNEL=0`` disables the kernel.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu_build import CpuKernelLibrary, ffi_call
from kernels_pallas.paged_attention.reference import check_tree_mask, validate_inputs

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGETS = {  # pool dtype -> FFI target name (q cast to the pool dtype)
    jnp.dtype(jnp.float32): "nightjar_paged_attention_f32",
    jnp.dtype(jnp.bfloat16): "nightjar_paged_attention_bf16",
}
F32_Q_BF16_KV = "nightjar_paged_attention_f32_bf16kv"  # float32 q and output over bfloat16 pools
BITS_TARGETS = {  # q dtype -> target over pools of bfloat16 bit patterns (uint16: llama.kv_storage_dtype)
    jnp.dtype(jnp.float32): "nightjar_paged_attention_f32_bf16bits",
    jnp.dtype(jnp.bfloat16): "nightjar_paged_attention_bf16_bf16bits",
}
_SYMBOLS = {  # FFI target name -> handler symbol in the built library
    "nightjar_paged_attention_f32": "NjPagedAttentionF32",
    "nightjar_paged_attention_bf16": "NjPagedAttentionBF16",
    F32_Q_BF16_KV: "NjPagedAttentionF32Bf16Kv",
    "nightjar_paged_attention_f32_bf16bits": "NjPagedAttentionF32Bf16BitsKv",
    "nightjar_paged_attention_bf16_bf16bits": "NjPagedAttentionBf16Bf16BitsKv",
}
_LIBRARY = CpuKernelLibrary("paged_attention", SOURCE, _SYMBOLS)


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    return _LIBRARY.available()


def unavailable_reason() -> str:
    return _LIBRARY.unavailable_reason()


MAX_HEAD_DIM = 512  # cpu_kernel.cc's per-row buffers (MergeChunks' num[512]); impl "auto" takes the reference past it


def paged_attention_cpu(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32
    *,
    scale: float,
    tree_mask: jax.Array | None = None,  # [q_len, M] bool (reference.py: speculative token trees)
    layer: int | None = None,  # the pools are every layer's [L, KVH, pages, page, dim]: attend over this one
    k_ext: jax.Array | None = None,  # an extension pool, shaped as k_pages but for its page count: page ids from
    v_ext: jax.Array | None = None,  # k_pages' page count on address it (elastic memory)
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim], dtype of q
    """The reference's contract as a CPU custom call: K and V pools of one dtype (float32 or bfloat16) and one
    shape, or ``uint16`` pools holding bfloat16 bit patterns (how the engine holds bfloat16 pools on CPU:
    ``nightjar_jax.models.llama.kv_storage_dtype``). Over bfloat16 pools a bfloat16 q computes in bfloat16, any other
    q (float32: ``kv_cache_dtype="bfloat16"`` under a float32 model; float16) in float32, as the reference does; over
    float32 pools q is cast to float32. The result comes back in q's dtype. With ``layer``, the pools are stacked
    over the layers (``nightjar_jax.models.llama.StackedKV``) and the kernel reads that layer's in place.
    ``k_ext``/``v_ext``: an extension pool after the base pool (same layout, dtype and layers; its own page count),
    read in place too."""
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {unavailable_reason()}")
    dtype = jnp.dtype(k_pages.dtype)
    if (dtype not in TARGETS and dtype != jnp.uint16) or v_pages.dtype != dtype:
        raise ValueError(
            f"CPU paged attention takes k_pages and v_pages of one dtype in {[str(d) for d in TARGETS]} (or uint16: "
            f"bfloat16 bit patterns); got {k_pages.dtype}, {v_pages.dtype}"
        )
    stacked = layer is not None
    if k_pages.ndim != 4 + stacked or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         f"{'[layers, KVH, pages, page, dim]' if stacked else '[KVH, pages, page, dim]'}")
    if k_ext is None:  # no extension: an empty one
        k_ext = v_ext = jnp.zeros((*k_pages.shape[:-3], 0, *k_pages.shape[-2:]), dtype)
    ext_shape = (*k_pages.shape[:-3], k_ext.shape[-3], *k_pages.shape[-2:]) if k_ext.ndim == k_pages.ndim else None
    if k_ext.shape != ext_shape or v_ext is None or v_ext.shape != k_ext.shape or {k_ext.dtype, v_ext.dtype} != {dtype}:
        raise ValueError(f"the extension pools k_ext {k_ext.shape} / v_ext {None if v_ext is None else v_ext.shape} "
                         f"must match k_pages {k_pages.shape} ({dtype}) in every dimension but the pages")
    if stacked and not 0 <= layer < k_pages.shape[0]:
        raise ValueError(f"layer {layer} of pools stacked over {k_pages.shape[0]} layers")
    if isinstance(scale, jax.core.Tracer):  # (it is compiled into the call: a traced one was a tracer-conversion error)
        raise ValueError("the CPU attention kernel takes a concrete scale (a Python or NumPy number; it is compiled "
                         "into the call), not a traced one: close over it outside jax.jit, or use impl='reference'")
    if k_pages.shape[-1] > MAX_HEAD_DIM:  # (the kernel's per-row buffers: it failed at run time, after the compile)
        raise ValueError(f"the CPU attention kernel takes head_dim up to {MAX_HEAD_DIM}, got {k_pages.shape[-1]}: "
                         f"use impl='reference' (impl='auto' does for such a model)")
    # The reference's checks (lenient: it computes in float32 whatever it is given, as this kernel casts) on one
    # layer's pools, uint16 ones read as the bfloat16 they hold: dtypes (an integer q, float block tables or context
    # lengths and a string scale were cast silently), sizes of at least 1 (page_size 0 divided by zero in the
    # kernel: SIGFPE), and the values of concrete tables and lengths (an int64 id 2**32 + p read page p).
    pool = jax.ShapeDtypeStruct(k_pages.shape[stacked:], jnp.bfloat16 if dtype == jnp.uint16 else dtype)
    validate_inputs(q, pool, pool, block_tables, context_lens, scale, num_ext_pages=k_ext.shape[-3],
                    lenient_dtypes=True)
    if tree_mask is None:
        tree_mask = jnp.zeros((0, 0), jnp.uint8)
    else:
        check_tree_mask(tree_mask, q.shape[1])
    # over bfloat16 pools (or their uint16 bit patterns) a bfloat16 q computes in bfloat16, any other q in float32 (a
    # float16 q was rounded to bfloat16 first: 13x the reference's error)
    if dtype == jnp.uint16:
        q_dtype = jnp.dtype(jnp.bfloat16) if q.dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)
        target = BITS_TARGETS[q_dtype]
    elif q.dtype != jnp.bfloat16 and dtype == jnp.bfloat16:
        q_dtype, target = jnp.dtype(jnp.float32), F32_Q_BF16_KV
    else:
        q_dtype, target = dtype, TARGETS[dtype]
    call = ffi_call(target, jax.ShapeDtypeStruct(q.shape, q_dtype), vmap_method="sequential")
    out = call(
        q.astype(q_dtype), k_pages, v_pages, k_ext, v_ext, _as_int32(block_tables), _as_int32(context_lens),
        tree_mask.astype(jnp.uint8), scale=np.float32(scale),
        layer=np.int64(-1 if layer is None else layer),
    )
    return out.astype(q.dtype)


_INT32 = np.iinfo(np.int32)


def _as_int32(x: jax.Array) -> jax.Array:
    """Block-table ids or context lengths of any integer type as the kernel's int32. Values outside int32's range
    (wider types under jit: concrete ones were checked) saturate, so the kernel's range checks still refuse them,
    instead of wrapping (an int64 id 2**32 + p read page p; a uint32 length 2**32 - 1 was reported as -1)."""
    info = np.iinfo(x.dtype)
    if info.min < _INT32.min or info.max > _INT32.max:
        xp = np if isinstance(x, np.ndarray) else jnp  # (numpy: no truncating conversion to jax's int32 first)
        x = xp.clip(x, max(info.min, _INT32.min), min(info.max, _INT32.max))
    return jnp.asarray(x.astype(np.int32))
