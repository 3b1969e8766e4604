"""The one dispatch point for the model's linear layers: ``impl = auto | cpu | xla``.

- ``xla``: ``jnp`` dot products (what ``nnx.Linear`` does), on every backend.
- ``cpu``: the C++ kernels of ``kernels_pallas/linear/cpu.py`` wherever they take the product (CPU backend,
  float32); XLA's dot otherwise.
- ``auto``: the kernels on the CPU backend for the row counts where they measured faster than XLA's dot in a
  whole decode step (1-12 rows; ``kernels_pallas/linear/README.md``), XLA's
  dot elsewhere and on GPU/TPU (whose dots are already bandwidth-bound at decode).

:func:`linear_many` takes the weights that share one input (q/k/v, gate/up) in one kernel call.

Shapes are static under ``jit``, so the choice is made once per compiled step variant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "cpu", "xla")


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"linear impl {impl!r} is unknown: allowed {IMPLS}")
    return impl


def _on_kernel(x: jax.Array, w: jax.Array, impl: str, *, transposed: bool = False) -> bool:
    """Whether ``impl`` sends ``x @ w`` to the CPU kernel (decided at trace time: shapes are static)."""
    if impl == "xla" or jax.default_backend() != "cpu" or x.dtype != jnp.float32 or x.size == 0:
        return False
    from kernels_pallas.linear import cpu

    if impl == "auto":
        return cpu.use_kernel(x.shape, w, transposed=transposed)
    return w.dtype == jnp.float32 and cpu.available()


def linear(x: jax.Array, w: jax.Array, *, impl: str = "auto", transposed: bool = False,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x [..., K] @ w`` with ``w [K, N]`` (or ``[N, K]`` when ``transposed``); result in ``out_dtype``
    (default: x's dtype), accumulated in at least float32 precision for float32 inputs."""
    check_impl(impl)
    if _on_kernel(x, w, impl, transposed=transposed):
        from kernels_pallas.linear import cpu

        y = cpu.linear_cpu(x, w, transposed=transposed)
        return y if out_dtype is None else y.astype(out_dtype)
    spec = "...k,nk->...n" if transposed else "...k,kn->...n"
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def linear_many(x: jax.Array, ws: list[jax.Array], *, impl: str = "auto") -> list[jax.Array]:
    """``[linear(x, w) for w in ws]`` for 2 or 3 weights ``[K, N_i]`` sharing x (q/k/v, gate/up): on the kernel,
    one custom call for all of them."""
    check_impl(impl)
    if len(ws) in (2, 3) and all(_on_kernel(x, w, impl) for w in ws):
        from kernels_pallas.linear import cpu

        return cpu.linear_many_cpu(x, ws)
    return [linear(x, w, impl="xla") for w in ws]
