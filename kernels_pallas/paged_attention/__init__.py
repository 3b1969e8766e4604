"""Paged attention over a paged KV cache: decode (q_len 1), verify (q_len gamma + 1) and ragged prefill chunks.

Terms and the contract are defined in ``reference.py`` (the pure-jnp oracle); query-head folding in
``layout.py``; the GPU (Pallas Triton) body in ``kernel_gpu.py``; the TPU (Mosaic, scalar prefetch) body in
``kernel_tpu.py``. This module validates inputs and picks the body.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.kernel_gpu import GPU_TUNING_DEFAULTS, choose_gpu_tiles, paged_attention_gpu
from kernels_pallas.paged_attention.kernel_tpu import TPU_TUNING_DEFAULTS, paged_attention_tpu
from kernels_pallas.paged_attention.layout import QueryBlocking
from kernels_pallas.paged_attention.reference import check_tree_mask, paged_attention_reference, validate_inputs

__all__ = ["import_pallas_backends", "paged_attention", "paged_attention_reference"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gpu", "tpu")

# Modules that register pallas_call lowerings. Importing them lazily, inside a trace, has been seen to make a
# jitted function holding a pallas_call compile twice (jax 0.11.x), so the engine imports them at start-up.
_PALLAS_BACKEND_MODULES = (
    "jax.experimental.pallas.triton",
    "jax._src.pallas.triton.pallas_call_registration",
    "jax.experimental.pallas.mosaic_gpu",
    "jax._src.pallas.mosaic_gpu.pallas_call_registration",
    "jax.experimental.pallas.tpu",
    "jax._src.pallas.mosaic.pallas_call_registration",
)


def import_pallas_backends() -> list[str]:
    """Import every Pallas backend lowering module this jax has; returns the names imported. Call once at start-up."""
    imported = []
    for name in _PALLAS_BACKEND_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            logger.debug("Pallas backend module %s not importable: %s", name, error)
        else:
            imported.append(name)
    return imported


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    # On CPU (and anything else) the GPU body runs interpreted.
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _validate_extension(k_pages, k_ext, v_ext) -> None:
    if (k_ext is None) != (v_ext is None):
        raise ValueError("k_ext and v_ext come together (an extension pool holds both), got one of them")
    if k_ext is None:
        return
    for name, ext in (("k_ext", k_ext), ("v_ext", v_ext)):
        if ext.ndim != 4 or ext.shape[0] != k_pages.shape[0] or ext.shape[2:] != k_pages.shape[2:]:
            raise ValueError(f"{name} must be [num_kv_heads, num_ext_pages, page_size, head_dim] = "
                             f"[{k_pages.shape[0]}, *, {k_pages.shape[2]}, {k_pages.shape[3]}] like k_pages, "
                             f"got shape {ext.shape}")
        if ext.dtype != k_pages.dtype:
            raise ValueError(f"{name} dtype {ext.dtype} must equal the pools' {k_pages.dtype}")
    if v_ext.shape != k_ext.shape:
        raise ValueError(f"v_ext shape {v_ext.shape} must equal k_ext shape {k_ext.shape}")


def _validate_tuning(tuning: dict, defaults: dict, backend: str, page_size: int, head_dim: int, compiled: bool):
    unknown = set(tuning) - set(defaults)
    if unknown:
        raise ValueError(
            f"unknown tuning parameters {sorted(unknown)} for backend {backend!r}; allowed: {sorted(defaults)}"
        )
    params = {**defaults, **tuning}
    for name in ("pages_per_block", "block_rows", *(("num_stages",) if "num_stages" in params else ())):
        value = params[name]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if "num_splits" in params and (not isinstance(params["num_splits"], int) or params["num_splits"] < 0):
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen from the grid's size, 1: no split), "
                         f"got {params['num_splits']!r}")
    if backend == "gpu" and compiled:
        # Triton tiles must have power-of-two sides: [pages_per_block * page_size, head_dim].
        for name, value in (
            ("pages_per_block", params["pages_per_block"]),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two for the compiled GPU (Triton) kernel")
    return params


NOT_DIFFERENTIABLE = ("paged_attention's Pallas kernels are not differentiable; use paged_attention_reference for "
                      "gradients")


def _not_differentiable(body):
    """``body`` behind a JVP rule that raises a clear error: the Pallas bodies have no backward, and ``jax.grad``
    through them failed deep inside Pallas with an empty AssertionError (GPU) or NotImplementedError (TPU). The
    forward pass is the body's, unchanged."""

    @jax.custom_jvp
    def call(*args):
        return body(*args)

    @call.defjvp
    def _jvp(primals, tangents):
        raise ValueError(NOT_DIFFERENTIABLE)

    return call


def paged_attention(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim] float32 | bfloat16
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] float32 | bfloat16
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], dtype of k_pages
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32, including the q_len new tokens
    *,
    scale: float,
    backend: str = "auto",
    interpret: bool | None = None,
    tree_mask: jax.Array | None = None,  # [q_len, M] bool: a speculative token tree (reference.py)
    k_ext: jax.Array | None = None,  # [num_kv_heads, num_ext_pages, page_size, head_dim]: an extension pool
    v_ext: jax.Array | None = None,
    **tuning: int,
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim], dtype of q
    """Paged multi-query causal attention with GQA; same contract as ``paged_attention_reference``, tree mask
    included (each q block's rows carry their tree mask as bit words: ``layout.py``).

    If q's dtype differs from the pages' dtype, the products run in the wider of the two (a float32 q over bfloat16
    pages: K and V widened to float32 tile by tile, as the reference does) and the output is returned in q's dtype.

    Not differentiable (``jax.grad`` raises ``NOT_DIFFERENTIABLE``): use ``paged_attention_reference`` for gradients.

    backend: "gpu" (Pallas Triton body), "tpu" (Mosaic TPU body) or "auto" (TPU body on TPU, GPU body elsewhere).
    interpret: None -> interpret exactly when running on CPU. With backend="tpu", ``interpret=True`` uses the TPU
      interpreter (``pltpu.InterpretParams()``), which models SMEM scalar prefetch and the page DMAs.
    k_ext, v_ext: an extension pool (elastic memory): block-table ids from ``num_pages`` on address its pages. Both
      bodies read each page in place from the pool that holds it (``kernel_gpu.py``, ``kernel_tpu.py``).
    tuning: ``GPU_TUNING_DEFAULTS`` / ``TPU_TUNING_DEFAULTS`` keys (pages_per_block, block_rows; GPU also
      num_warps, num_stages, and num_splits: key ranges per (sequence, KV head, q block) merged afterwards, 1 = no
      split, 0 = chosen from the grid's size; see ``kernel_gpu.py``). Compiled GPU: pages_per_block and num_stages
      left unset are chosen by ``kernel_gpu.choose_gpu_tiles`` (a key tile of >= 16 keys within the shared-memory
      budget); values given that cannot work are a ValueError. Compiled TPU: ``kernel_tpu.check_compiled_tpu_shapes``.
    """
    _validate_extension(k_pages, k_ext, v_ext)
    validate_inputs(q, k_pages, v_pages, block_tables, context_lens, scale,
                    num_ext_pages=0 if k_ext is None else k_ext.shape[1])
    if tree_mask is not None:
        check_tree_mask(tree_mask, q.shape[1])
    backend = _resolve_backend(backend)
    out_dtype = q.dtype
    if q.size == 0 or block_tables.shape[1] == 0:  # (no rows, or no keys: the reference's zeros; the bodies' grids
        return jnp.zeros(q.shape, out_dtype)      # cannot be empty)
    # The products take the wider of the two dtypes: a bfloat16 q over float32 pages is widened (q is small); a
    # float32 q over bfloat16 pages stays float32 and each K/V tile is widened in the body (online_softmax_step), so
    # q and the sums stay float32 as they do in the reference and the CPU kernel (kv_cache_dtype="bfloat16" under a
    # float32 model), rather than q being rounded to bfloat16.
    q = q.astype(jnp.promote_types(q.dtype, k_pages.dtype))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    if backend == "gpu":
        params = _validate_tuning(tuning, GPU_TUNING_DEFAULTS, backend, page_size, head_dim, not interpret)
        if not interpret:  # a key tile tl.dot takes, within the shared-memory budget (kernel_gpu.choose_gpu_tiles)
            # (chosen as if an extension pool were there, whether or not it is: a step before and after a draft
            # offload gets one tile, and so one order of arithmetic; the rows are this call's q block's)
            rows = QueryBlocking.choose(q.shape[1], q.shape[2] // k_pages.shape[0], params["block_rows"]).block_rows
            params["pages_per_block"], params["num_stages"] = choose_gpu_tiles(
                page_size, head_dim, jnp.dtype(q.dtype).itemsize, block_rows=rows, extension=True,
                pages_per_block=tuning.get("pages_per_block"), num_stages=tuning.get("num_stages"))
        body = functools.partial(paged_attention_gpu, scale=float(scale), interpret=bool(interpret), **params)
        out = _not_differentiable(body)(q, k_pages, v_pages, block_tables, context_lens, tree_mask, k_ext, v_ext)
        return out.astype(out_dtype)
    params = _validate_tuning(tuning, TPU_TUNING_DEFAULTS, backend, page_size, head_dim, not interpret)
    tpu_interpret = False
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        tpu_interpret = pltpu.InterpretParams()
    body = functools.partial(paged_attention_tpu, scale=float(scale), interpret=tpu_interpret, **params)
    out = _not_differentiable(body)(q, k_pages, v_pages, block_tables, context_lens, tree_mask, k_ext, v_ext)
    return out.astype(out_dtype)
