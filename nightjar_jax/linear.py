"""The one dispatch point for the model's linear layers: ``impl = auto | cpu | xla``.

- ``xla``: ``jnp`` dot products (what ``nnx.Linear`` does), on every backend.
- ``cpu``: the C++ kernels of ``kernels_pallas/linear/cpu.py`` wherever they take the product (CPU backend,
  float32); XLA's dot otherwise.
- ``auto``: the kernels on the CPU backend for the row counts where they measured faster than XLA's dot in a
  whole decode step (1-160 rows with AVX-512, 1-12 without; ``kernels_pallas/linear/README.md``), XLA's
  dot elsewhere and on GPU/TPU (whose dots are already bandwidth-bound at decode).

:func:`linear_many` takes the weights that share one input (q/k/v, gate/up) in one kernel call. :func:`pack_state`
stores a model's linear weights as the kernel's 16-column panels ``[N / 16, K, 16]`` (the engine does it at load on
CPUs with AVX-512, or AVX2 and FMA); every function here takes either layout, packed weights on the kernel at every
row count.

Shapes are static under ``jit``, so the choice is made once per compiled step variant.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from nightjar_jax.config import WEIGHT_FORMATS

IMPLS = ("auto", "cpu", "xla")
_log = logging.getLogger(__name__)


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"linear impl {impl!r} is unknown: allowed {IMPLS}")
    return impl


def _on_kernel(x: jax.Array, w: jax.Array, impl: str, *, transposed: bool = False) -> bool:
    """Whether ``impl`` sends ``x @ w`` to the CPU kernel (decided at trace time: shapes are static)."""
    if impl == "xla" or jax.default_backend() != "cpu" or x.dtype != jnp.float32 or x.size == 0:
        return False
    from kernels_pallas.linear import cpu

    # packed weights take the kernel at every row count (XLA's dot would need an unpacked copy of the weight), and so
    # does a tied head held as 8-bit rows (XLA's dot would need a float32 copy of the table: past the kernel's 12 rows
    # without AVX-512, SmolLM2's batch-16 step spent 52 ms making it and 26 ms in the dot, 2026-12-03) and a w4a8
    # head (its int8 activations at every row count, as the layers')
    if impl == "auto" and not (cpu.is_packed(w) and not transposed) and not (transposed and cpu.is_q8(w)):
        return cpu.use_kernel(x.shape, w, transposed=transposed)
    return (w.dtype == jnp.float32 or (cpu.is_compact(w) and cpu.is_q8(w) == transposed)) and cpu.available()


def compute_dtype(w: jax.Array) -> jnp.dtype:
    """The compute dtype of a weight: float32 for the compact layouts (their float32 values), else its own."""
    from kernels_pallas.linear import cpu

    return jnp.dtype(jnp.float32) if cpu.is_compact(w) else w.dtype


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows ``tokens`` of an embedding table ``[vocab, hidden]``, or of its 8-bit rows (:func:`pack_state`)."""
    from kernels_pallas.linear import cpu

    if cpu.is_q8(table):
        return cpu.q8_rows(table, tokens)
    return jnp.take(table, tokens, axis=0)


def linear(x: jax.Array, w: jax.Array, *, impl: str = "auto", transposed: bool = False,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x [..., K] @ w`` with ``w [K, N]`` (or ``[N, K]`` when ``transposed``); result in ``out_dtype``
    (default: the promoted dtype of x and w, x's when they share one, as the model's layers do), accumulated in at
    least float32 precision for float32 inputs."""
    check_impl(impl)
    if _on_kernel(x, w, impl, transposed=transposed):
        from kernels_pallas.linear import cpu

        y = cpu.linear_cpu(x, w, transposed=transposed)
        return y if out_dtype is None else y.astype(out_dtype)
    from kernels_pallas.linear import cpu

    w = cpu.value(w)  # one layer of a stacked weight (ModelHandle.stack_layers): its slice
    if w.ndim == 3:  # packed for the CPU kernel (pack_state); XLA's dot takes [K, N] / [N, K]: a float32 copy
        w = cpu.q8_table(w) if cpu.is_q8(w) else cpu.unpack(w)
    k = w.shape[-1] if transposed else w.shape[0]
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != k:  # (einsum's own: "Size of label 'k' for operand 1 ...")
        layout = "[N, K]" if transposed else "[K, N]"
        raise ValueError(f"linear: x [..., K] and w {layout} must agree on K; got x {tuple(x.shape)} and w "
                         f"{tuple(w.shape)}")
    spec = "...k,nk->...n" if transposed else "...k,kn->...n"
    # float32 means float32 on a GPU too: XLA:GPU's default precision feeds float32 products TF32 inputs (10-bit
    # mantissas), as PyTorch does not by default. XLA:CPU computes float32 in full either way (left at its default).
    full = jnp.result_type(x, w) == jnp.float32 and jax.default_backend() != "cpu"
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype,
                      precision=jax.lax.Precision.HIGHEST if full else None)


def pack_state(state, impl: str = "auto", *, weight_format: str = "auto"):
    """The model state with its linear weights packed for the CPU kernel (``kernels_pallas/linear/cpu.py`` ``pack``:
    ``[K, N]`` -> 16-column panels ``[N / 16, K, 16]``, each read front to back: SmolLM2-135M's layer products at one
    row 0.88x the time of the ``[K, N]`` split-K passes, 2026-12-03), where they will run on it: ``impl`` not
    ``xla``, the CPU backend, a kernel built with AVX-512 or AVX2 + FMA, and every ``kernel`` float32 with N a multiple
    of 16 (all or none, so a fused layer call never mixes layouts). Otherwise ``state`` itself. Packed weights then
    stay on the kernel at every row count (:func:`_on_kernel`); ``impl="xla"`` calls take an unpacked copy.

    ``weight_format`` ``compact``: when every kernel is exactly a GGUF Q4_1 weight dequantized (``cpu.pack_q4``: each
    element reproduced bit for bit, K a multiple of 32), the panels are held as 4-bit blocks (0.75 bytes per weight
    instead of 4); else, when every kernel is a bfloat16 value (a bfloat16 checkpoint upcast, ``cpu.pack_bf16``), as
    bfloat16 panels (2 bytes); and an embedding table that is exactly GGUF Q8_0 values (``cpu.pack_q8``) as 8-bit rows
    (1.125 bytes; a tied head reads them, :func:`embed` gathers them). The kernel rebuilds every element exactly
    and sums in the float32 order: the same results to the bit. ``auto`` (default): the same with the float32 panels
    (a tied head's table) kept beside the compact bytes, which products of more than 8 rows read instead (where
    they are bound by FMAs: rebuilding the weights per call cost 21-31% at 9-12 rows): the fewest bytes for decode
    steps, float32's speed for large batches and prefill, at ~1.2x float32's memory. ``f32``: float32 only.

    ``w4a8`` (opt-in, **lossy**): where every kernel is exactly Q4_1 with 16-bit d and m (a GGUF's), the blocks laid
    out for int8 activations (``cpu.pack_w4a8``): each product quantizes its x per row and 32-element block to int8 and
    multiplies with AVX512-VNNI integer dot products (llama.cpp's scheme; without AVX-512, AVX2's vpmaddubsw +
    vpmaddwd, the same integers), at every row count (no float32 beside them), so a row's result never depends on
    the other rows of its step; a tied Q8_0 head likewise (``cpu.with_w8a8_head``: the 8-bit rows, then panels of
    them for int8 x, instead of the float32 table; without AVX-512 the kernel reads the rows with int8 x).
    The weights stay exact; x's rounding changes the outputs slightly. Other models (and the bfloat16 drafts) get
    ``auto``; so do CPUs with AVX-512 but not AVX512-VNNI, with a warning."""
    check_impl(impl)
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format {weight_format!r} is unknown: allowed {WEIGHT_FORMATS}")
    if impl == "xla" or jax.default_backend() != "cpu":
        return state
    from kernels_pallas.linear import cpu

    if not cpu.packing_supported():
        return state
    flat = [(jax.tree_util.keystr(path), path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
    kernels = {key: w for key, path, w in flat if _is_linear_kernel(path)}
    if not kernels or not all(cpu.can_pack(w) for w in kernels.values()):
        return state
    new = {key: cpu.pack(w) for key, w in kernels.items()}
    if weight_format == "f32":
        return _replace(state, new)
    w4a8 = weight_format == "w4a8"
    if w4a8 and not cpu.w4a8_supported():
        _log.warning("weight_format='w4a8' needs AVX512-VNNI, or AVX2 and F16C without AVX-512, which this CPU "
                     "lacks: weights held as 'auto'")
        w4a8 = False
    makers = (cpu.pack_w4a8, cpu.pack_q4, cpu.pack_bf16) if w4a8 else (cpu.pack_q4, cpu.pack_bf16)
    for make in makers:  # the first layout every kernel fits (all or none)
        compact = {}
        for key, w in kernels.items():
            if (compact.setdefault(key, make(w))) is None:
                break
        else:
            alone = weight_format == "compact" or make is cpu.pack_w4a8  # w4a8: the int8 path at every row count
            new = compact if alone else {k: cpu.with_f32(c, new[k]) for k, c in compact.items()}
            break
    int8_x = any(cpu.is_w4a8(w) for w in new.values())  # w4a8 took: the tied head's products quantize x too
    if weight_format == "w4a8" and not int8_x:
        _log.info("weight_format='w4a8': not every linear weight is exactly GGUF Q4_1 (16-bit d and m) here; "
                  "held as 'auto'")
    tied = not any("lm_head" in key for key in kernels)  # else the table is only gathered: no float32 beside it
    for key, path, w in flat:
        if _is_embedding(path) and (q8 := cpu.pack_q8(w)) is not None:
            if int8_x and tied and (head := cpu.with_w8a8_head(q8)) is not None:
                new[key] = head
            else:
                new[key] = cpu.with_f32(q8, w) if weight_format in ("auto", "w4a8") and tied else q8
    return _replace(state, new)


def _replace(state, new: dict):
    return jax.tree_util.tree_map_with_path(lambda path, w: new.get(jax.tree_util.keystr(path), w), state)


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _is_linear_kernel(path) -> bool:
    return "kernel" in _keys(path)


def _is_embedding(path) -> bool:
    keys = _keys(path)
    return "embed_tokens" in keys and "embedding" in keys


def linear_many(x: jax.Array, ws: list[jax.Array], *, impl: str = "auto") -> list[jax.Array]:
    """``[linear(x, w) for w in ws]`` for 2 or 3 weights ``[K, N_i]`` sharing x (q/k/v, gate/up): on the kernel,
    one custom call for all of them."""
    check_impl(impl)
    if len(ws) in (2, 3) and all(_on_kernel(x, w, impl) for w in ws):
        from kernels_pallas.linear import cpu

        return cpu.linear_many_cpu(x, ws)
    return [linear(x, w, impl="xla") for w in ws]


# ---- fused decoder-layer forms ------------------------------------------------------------------------------------
# On the kernel each is one custom call instead of 2-6 XLA thunks (XLA:CPU runs an RMSNorm as four small fusions;
# a one-row SmolLM2 step spent ~0.7 ms outside its products before, ~0.3 ms after); elsewhere they are exactly the
# jnp composition the model used before (the XLA path's numerics are unchanged).


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * gain`` in float32, returned in x's dtype (the model's RMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * gain.astype(jnp.float32)).astype(x.dtype)


def _split_k_rows(x: jax.Array) -> bool:
    from kernels_pallas.linear import cpu

    return math.prod(x.shape[:-1]) <= cpu.SPLIT_K_MAX_ROWS


def _fused_on_kernel(x: jax.Array, gain: jax.Array | None, ws: list[jax.Array], impl: str) -> bool:
    return (gain is None or gain.dtype == jnp.float32) and all(_on_kernel(x, w, impl) for w in ws)


def rms_linear_many(x: jax.Array, gain: jax.Array, ws: list[jax.Array], eps: float, *,
                    impl: str = "auto") -> list[jax.Array]:
    """``linear_many(rms_norm(x, gain, eps), ws)`` (2 or 3 weights): the pre-attention norm with q/k/v."""
    check_impl(impl)
    if len(ws) in (2, 3) and _fused_on_kernel(x, gain, ws, impl):
        from kernels_pallas.linear import cpu

        return cpu.rms_linear_many_cpu(x, gain, ws, eps)
    return linear_many(rms_norm(x, gain, eps).astype(compute_dtype(ws[0])), ws, impl=impl)


def rms_swiglu(x: jax.Array, gain: jax.Array, w_gate: jax.Array, w_up: jax.Array, eps: float, *,
               impl: str = "auto") -> jax.Array:
    """``silu(g) * u`` with ``g, u = linear_many(rms_norm(x, gain, eps), [w_gate, w_up])``: a SwiGLU MLP's first
    half with its norm."""
    check_impl(impl)
    if _fused_on_kernel(x, gain, [w_gate, w_up], impl):
        from kernels_pallas.linear import cpu

        return cpu.rms_swiglu_cpu(x, gain, w_gate, w_up, eps)
    gate, up = linear_many(rms_norm(x, gain, eps).astype(compute_dtype(w_gate)), [w_gate, w_up], impl=impl)
    return jax.nn.silu(gate) * up


def linear_residual(x: jax.Array, w: jax.Array, r: jax.Array, *, impl: str = "auto") -> jax.Array:
    """``r + linear(x, w)`` (``w [K, N]``): a projection back onto the residual stream."""
    check_impl(impl)
    if r.dtype == jnp.float32 and _fused_on_kernel(x, None, [w], impl):
        from kernels_pallas.linear import cpu

        return cpu.linear_residual_cpu(x, w, r)
    return r + linear(x.astype(compute_dtype(w)), w, impl=impl)


def attn_out_mlp(a: jax.Array, r: jax.Array, w_o: jax.Array, gain: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array, eps: float, *, impl: str = "auto", next_gain: jax.Array | None = None,
                 next_ws: list[jax.Array] | None = None, next_eps: float | None = None):
    """A decoder layer after attention: ``r1 = linear_residual(a, w_o, r)``, then
    ``y = linear_residual(rms_swiglu(r1, gain, w_gate, w_up, eps), w_down, r1)``; with ``next_gain`` and
    ``next_ws`` (the next layer's pre-attention norm and its q/k/v weights) also
    ``rms_linear_many(y, next_gain, next_ws, next_eps)``, returned as ``(y, [q, k, v])``. On the kernel (the row
    counts where every one of its products is) one custom call whose threads pass the dependent products to each
    other without returning to XLA's pool; elsewhere exactly that composition."""
    check_impl(impl)
    with_next = next_gain is not None
    if with_next and (next_ws is None or len(next_ws) != 3 or next_eps is None):
        raise ValueError("attn_out_mlp: the next layer's q/k/v need next_gain, 3 next_ws and next_eps")
    # split-K phases only (up to cpu.SPLIT_K_MAX_ROWS = 12 rows, 8 on AMD EPYC: small decode batches and verify);
    # more rows take the composition, whose products use the kernel's tiles (or its packed path)
    if (r.dtype == jnp.float32 and _fused_on_kernel(a, gain, [w_o], impl) and _split_k_rows(a)
            and _fused_on_kernel(r, None, [w_gate, w_up], impl) and _on_kernel(a, w_down, impl)
            and (not with_next or _fused_on_kernel(r, next_gain, list(next_ws), impl))):
        from kernels_pallas.linear import cpu

        if with_next:
            return cpu.attn_out_mlp_cpu(a, r, w_o, gain, w_gate, w_up, w_down, eps, next_gain=next_gain,
                                        next_ws=next_ws, next_eps=next_eps)
        return cpu.attn_out_mlp_cpu(a, r, w_o, gain, w_gate, w_up, w_down, eps)
    r1 = linear_residual(a, w_o, r, impl=impl)
    y = linear_residual(rms_swiglu(r1, gain, w_gate, w_up, eps, impl=impl), w_down, r1, impl=impl)
    if with_next:
        return y, rms_linear_many(y, next_gain, list(next_ws), next_eps, impl=impl)
    return y
