"""``y = x @ W`` on the CPU backend for the few-row products of decoding: C++ XLA FFI custom calls.

A decode step multiplies a few rows (batch size x (γ + 1) query slots) by every weight matrix, so it is bound by
reading the weights. XLA:CPU's dot handles 2-16 rows poorly (on the project's 2-core machine SmolLM2-135M's
layers took about twice as long at 4 rows as at 1, though both read the same bytes). The kernels in
``cpu_kernel.cc`` give each thread a contiguous run of weight rows to stream (up to 12 rows of x), or run
register-tiled products over blocks of W (more rows: 8 x 48 tiles with AVX-512, packed 6 x 16 tiles
without); ``README.md`` has the measured ratios that set :data:`NN_ROWS` and :data:`NT_ROWS`, the row counts where
:func:`use_kernel` picks them over XLA.

Three layouts: ``linear_cpu(x, w)`` with ``w [K, N]`` (``nnx.Linear``'s kernel) or packed ``[N / 16, K, 16]``
(:func:`pack`: 16-column panels, each read front to back; with AVX-512, or AVX2 and FMA, the layout the engine holds
its linear weights in, ``nightjar_jax.linear.pack_state``), and ``linear_cpu(x, w, transposed=True)`` with
``w [N, K]`` (a tied LM head, i.e. the embedding table); weights a checkpoint stored compactly may also come as
4-bit / bfloat16 panels or 8-bit head rows, rebuilt exactly (:func:`pack_q4`, :func:`pack_bf16`, :func:`pack_q8`).
x float32; leading dimensions of x are flattened. Build and caching: ``kernels_pallas/cpu_build.py``;
``NIGHTJAR_CPU_KERNEL=0`` disables it.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kernels_pallas.cpu_build import CpuKernelLibrary, _cpu_flags, cpu_vendor, ffi_call

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGETS = {False: "nightjar_linear_f32", True: "nightjar_linear_nt_f32"}
_MANY_TARGETS = {2: "nightjar_linear2_f32", 3: "nightjar_linear3_f32"}  # several W [K, N_i] sharing x
_RMS_TARGETS = {2: "nightjar_rms_linear2_f32", 3: "nightjar_rms_linear3_f32"}  # RMSNorm(x) @ W_i


def _has_avx512() -> bool:
    """Whether this CPU has AVX-512F: the kernel is built with -march=native, so its split-K passes then take up to
    6 x rows at once and more rows take the 8 x 48 register tiles (the row ranges below)."""
    return "avx512f" in _cpu_flags().split()


# Rows of x (all leading dimensions flattened) for which the kernels measured faster than XLA's dot inside a
# SmolLM2-135M decode step (README.md): with the earlier 8-float kernel, x rows in pairs (AMD EPYC VM, 2026-12-01),
# 1 to 12 rows (1.00-1.20x the step with XLA's dots); 16+ rows: XLA's tiled GEMM was faster (the kernel 0.66-0.75x at
# 16-32 rows); CPUs without AVX-512 still run that kernel. With AVX-512 (Xeon VM, 2026-12-02; 16-float vectors,
# 6-row passes) up to 24 rows on the split-K path: products alone 0.80x XLA's time at 16 rows, 0.88x at 20, 0.93x at
# 24. Past 24 rows the NN products take an 8 x 48 register tile (cpu_kernel.cc Tile48): whole step 1.12x at 25 rows,
# 1.15x at 32, 1.09x at 40, 1.08x at 48, 0.95x at 64 (1.25-1.32x at 25-48 once the SwiGLU gate ran inside the work
# items, 1.30-1.42x with 96-row blocks and the next panel prefetched); with one tile item per thread, against XLA's
# (2026-12-02 17:35, whole step): 1.15x at 64 rows, 1.08x at 96, 1.09x at 128, 1.09x at 160, 1.01x at 256, 0.94x at
# 512, so up to NN_MAX_ROWS = 160 (a head past 32 rows on its kernel measured no better). The tied head (NT) past
# 24 rows: y^T = W @ x^T in 12 x 32 tiles (BlockNTx), the head alone 8.8 ms against XLA's 11.5 at 32 rows (its first
# version 17.7 against 13.9 at 48), so up to NT_MAX_ROWS. The AMD EPYC (Zen 4) VMs also have AVX-512 (double-pumped
# 256-bit units); there (2026-12-03, ``scripts/bench_linear.py --kernel-impl auto --rows
# 8,12,13,16,24,32,48,64,128,160,256``, whole step against XLA's dots) 1.46x at 8 rows, 1.62x at 13, 1.73x at 16,
# 1.46x at 32, 1.19x at 64, 0.96-1.07x at 128, 0.87-1.00x at 160 (two runs), 1.02x at 256: the same ranges hold.
# Since 2026-12-02 17:45 the tiles start at 13 rows (split-K up to SPLIT_K_MAX_ROWS = 12 on every CPU): once a lone
# tile after the first prefetched all of the next block, whole step 16 rows 51.1-52.5 -> 46.5-47.6 ms, 20 rows
# 59.9-62.3 -> 51.3-52.4, 24 rows 68.5-69.0 -> 56.6-56.9, 13 rows the same (alternating runs).
# On AMD EPYC (Zen 4) the tiles measured faster from 9 rows (2026-12-03; SmolLM2's whole decode step, split-K up to 12
# against up to 8, the two compiled in one process and run in turn, 60 steps each: 9 rows 0.995, 10 rows 0.905,
# 12 rows 0.849 of the time; products alone 8 rows 1.13 (split-K better), 9 rows 0.958, 11 rows 0.862), so there
# split-K stops at 8. The limit is built into cpu_kernel.cc (kSplitKMaxRows, -DNIGHTJAR_SPLIT_K_MAX_ROWS).


# The tied head (NT) takes the 12 x 32 tiles (BlockNTx) from NT_TILE_MIN_ROWS rows: past the split-K rows, or on AMD
# EPYC (Zen 4) with AVX-512 from 2 rows, where they measured faster than the 4 x 3 TileNT at every row count from 2
# (2026-12-03; products alone, the two in turn in one process: 2 rows 0.974, 3 rows 0.958, 4 rows 0.939, 5 rows 0.905,
# 8 rows 0.857 of the time, 1 row 1.108; whole decode step at batch 2 / 4 / 8: 0.978 / 0.941 / 0.868). Not measured
# on a Xeon, which keeps TileNT up to the split-K rows. Since 2026-12-03 (afternoon) every AVX-512 CPU runs 2-8 rows
# of the head on a kernel for few rows (cpu_kernel.cc BlockNTFew, kNtFewRows: the head alone 3.8 / 4.8 / 6.1 / 6.9 ms
# at 2 / 3 / 4-6 / 8 rows against 5.9 / 6.8 / 6.0-6.4 / 6.1 on the tiles, and the only fast form for 8-bit rows), so
# these limits now apply from 9 rows.
_ZEN_AVX512 = _has_avx512() and cpu_vendor() == "AuthenticAMD"
SPLIT_K_MAX_ROWS = 8 if _ZEN_AVX512 else 12
NT_TILE_MIN_ROWS = 2 if _ZEN_AVX512 else SPLIT_K_MAX_ROWS + 1
# W rows per block of the 8 x 48 tiles past 16 rows (cpu_kernel.cc kTileKBlockWide): 288 on AMD EPYC (products alone
# 0.94-0.96 of the time at 24-64 rows against 96-row blocks, in one process, 2026-12-03), 96 on other AVX-512 CPUs.
# Without AVX-512 only packed weights take these blocks (6 x 16 tiles): SmolLM2's seven layer products against XLA's
# dot on the [K, N] weights, interleaved in one process (AMD EPYC Zen 3, 2026-12-03): 1.12 / 1.24 of its time at
# 256 / 512 rows (prefill chunks) with 96-row blocks, 0.97 / 0.99 and 0.97 / 0.95 with 576 (two runs), 0.93 / 0.93
# with 1,536; 0.81-0.84 at 64 rows with any
TILE_K_BLOCK_WIDE = 288 if _ZEN_AVX512 else (96 if _has_avx512() else 576)
NN_MAX_ROWS = 160 if _has_avx512() else SPLIT_K_MAX_ROWS
# the head past 32 rows on its tiles measured no better than XLA's dot on the Xeon; on AMD EPYC (2026-12-03, whole
# step with the head on XLA past 32 rows against on the tiles up to 160, the two in turn in one process) 0.935 of the
# time at batch 48 and 64, 0.985 at 128, 0.982 at 160: there the head takes the tiles as far as the NN products
NT_MAX_ROWS = (NN_MAX_ROWS if _ZEN_AVX512 else 32) if _has_avx512() else SPLIT_K_MAX_ROWS
NN_ROWS = (1, NN_MAX_ROWS)
NT_ROWS = (1, NT_MAX_ROWS)
# the limits are compiled in, so Python's dispatch and the kernel agree on them
_LIBRARY = CpuKernelLibrary("linear", SOURCE, {
    "nightjar_linear_f32": "NjLinearF32", "nightjar_linear_nt_f32": "NjLinearNtF32",
    "nightjar_linear2_f32": "NjLinear2F32", "nightjar_linear3_f32": "NjLinear3F32",
    "nightjar_rms_linear2_f32": "NjRmsLinear2F32", "nightjar_rms_linear3_f32": "NjRmsLinear3F32",
    "nightjar_rms_swiglu_f32": "NjRmsSwiGluF32", "nightjar_linear_residual_f32": "NjLinearResidualF32",
    "nightjar_attn_out_mlp_f32": "NjAttnOutMlpF32", "nightjar_attn_out_mlp_qkv_f32": "NjAttnOutMlpQkvF32",
}, defines={"NIGHTJAR_SPLIT_K_MAX_ROWS": SPLIT_K_MAX_ROWS, "NIGHTJAR_NT_TILE_MIN_ROWS": NT_TILE_MIN_ROWS,
                                     "NIGHTJAR_TILE_K_BLOCK_WIDE": TILE_K_BLOCK_WIDE})


class LayerView:
    """Layer ``index`` of a weight or norm gain stacked over a model's layers (``stacked [L, ...]``): the kernels'
    calls take the stacked array itself with the layer as an attribute (``cpu_kernel.cc`` ``View``), so a decode
    step dispatches one array per weight kind instead of one per layer (``ModelHandle.stack_layers``); anything
    else takes :meth:`value`, the slice (a copy under XLA). Made inside a traced step; ``shape``, ``dtype`` and
    ``ndim`` are the layer's."""

    __slots__ = ("stacked", "index")

    def __init__(self, stacked: jax.Array, index: int):
        if not 0 <= index < stacked.shape[0]:
            raise ValueError(f"layer {index} of a weight stacked over {stacked.shape[0]} layers")
        self.stacked, self.index = stacked, int(index)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        return self.stacked.dtype

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def value(self) -> jax.Array:
        return self.stacked[self.index]

    def __getitem__(self, key):
        return self if key is Ellipsis else self.value()[key]  # nnx reads a parameter as ``param[...]``

    def astype(self, dtype) -> jax.Array:
        return self.value().astype(dtype)

    def reshape(self, *shape) -> jax.Array:
        return self.value().reshape(*shape)

    def __jax_array__(self) -> jax.Array:
        return self.value()


def value(w):
    """``w`` as an array: a :class:`LayerView`'s slice, anything else itself."""
    return w.value() if isinstance(w, LayerView) else w


def _operands(*ws) -> tuple[list[jax.Array], np.ndarray]:
    """A call's weight / gain operands and its ``layers`` attribute: a :class:`LayerView` as its stacked array at its
    layer, an array as itself at -1."""
    arrays = [w.stacked if isinstance(w, LayerView) else w for w in ws]
    return arrays, np.asarray([w.index if isinstance(w, LayerView) else -1 for w in ws], np.int64)


PANEL = 16  # columns per panel of a packed weight
Q4_ROWS = 32  # weight rows per block of a 4-bit panel weight (pack_q4)
Q4_BLOCK_BYTES = 384  # per panel and block: 16 float32 scales d, 16 float32 offsets m, 16 x 16 bytes of row pairs
Q8_BLOCK_BYTES = 36  # per row and 32-element block of an 8-bit weight: a float32 scale d, then 32 int8 q
# "with float32": the compact bytes of the whole weight first, then its float32 panels ([N / 16, K, 16]) or table
# ([N, K]); the kernel reads the first for up to 8 rows, the second for more (where the products are bound by
# FMAs: rebuilding the weights per call cost 21-31% at 9-12 rows; cpu_kernel.cc kDualCompactMaxRows). The shape's
# last axis says which.
Q4_DUAL_BLOCK_BYTES = Q4_BLOCK_BYTES + Q4_ROWS * PANEL * 4
W4A8_BLOCK_BYTES = 320  # pack_w4a8: per panel and block 16 float16 d, 16 float16 m, then 4 x 64 bytes of nibbles
Q8_DUAL_BLOCK_BYTES = Q8_BLOCK_BYTES + Q4_ROWS * 4
# a tied head's 8-bit rows with panels for int8 activations beside them (with_w8a8_head; weight_format="w4a8"):
# [N, K / 32, 72], the rows first, then [N / 16, K / 32, 576] panels (16 float32 d, 8 groups of 16 x 4 bytes q + 128)
Q8_W8A8_BLOCK_BYTES = 2 * Q8_BLOCK_BYTES
W8A8_PANEL_BLOCK_BYTES = 64 + Q4_ROWS * PANEL
BF16_DUAL_WIDTH = PANEL * 3  # bfloat16 panels then float32 panels, as bfloat16 [N / 16, K, 16 + 2 * 16]


def is_q8(w: jax.Array) -> bool:
    """Whether ``w`` is an 8-bit ``[N, K]`` weight ``uint8 [N, K / 32, 36]`` (:func:`pack_q8`: a tied head), or the
    same with the float32 table beside it (``[N, K / 32, 164]``)."""
    return w.ndim == 3 and w.dtype == jnp.uint8 and w.shape[-1] in (Q8_BLOCK_BYTES, Q8_DUAL_BLOCK_BYTES,
                                                                     Q8_W8A8_BLOCK_BYTES)


def is_w8a8_head(w: jax.Array) -> bool:
    """Whether ``w`` is a tied head's 8-bit rows with panels for int8 activations beside them (:func:`with_w8a8_head`,
    ``uint8 [N, K / 32, 72]``): its products quantize x and use AVX512-VNNI at every row count."""
    return w.ndim == 3 and w.dtype == jnp.uint8 and w.shape[-1] == Q8_W8A8_BLOCK_BYTES


def is_w4a8(w: jax.Array) -> bool:
    """Whether ``w`` is a 4-bit panel weight for int8 activations, ``int8 [N / 16, K / 32, 320]`` (:func:`pack_w4a8`:
    ``weight_format="w4a8"``, lossy in the activation)."""
    return w.ndim == 3 and w.dtype == jnp.int8 and w.shape[-1] == W4A8_BLOCK_BYTES


def is_q4(w: jax.Array) -> bool:
    """Whether ``w`` is a 4-bit panel weight ``uint8 [N / 16, K / 32, 384]`` (:func:`pack_q4`), or the same with its
    float32 panels beside it (``[N / 16, K / 32, 2432]``)."""
    return w.ndim == 3 and w.dtype == jnp.uint8 and w.shape[-1] in (Q4_BLOCK_BYTES, Q4_DUAL_BLOCK_BYTES)


def _regions(w: jax.Array, block_bytes: int) -> tuple[jax.Array, jax.Array | None]:
    """A compact weight's compact part (its layout without float32) and its float32 part (None if it has none)."""
    a, b = w.shape[:2]
    if w.shape[-1] == block_bytes:
        return w, None
    flat = w.reshape(-1)
    compact = flat[: a * b * block_bytes].reshape(a, b, block_bytes)
    f32 = jax.lax.bitcast_convert_type(flat[a * b * block_bytes:].reshape(-1, 4), jnp.float32)
    return compact, f32


def compact_bytes(w: jax.Array) -> int:
    """Bytes of a compact weight's compact part (all of it when no float32 sits beside it)."""
    if is_w4a8(w):
        return w.shape[0] * w.shape[1] * W4A8_BLOCK_BYTES
    if is_q4(w):
        return w.shape[0] * w.shape[1] * Q4_BLOCK_BYTES
    if is_q8(w):
        return w.shape[0] * w.shape[1] * Q8_BLOCK_BYTES
    return w.shape[0] * w.shape[1] * PANEL * 2  # bfloat16 panels


def with_f32(compact: jax.Array, w: jax.Array) -> jax.Array:
    """A compact weight with ``w``'s float32 panels (or table) beside it, the compact bytes first: 4-bit panels
    ``[..., 2432]``, 8-bit rows ``[..., 164]``, bfloat16 panels ``bfloat16 [N / 16, K, 48]``; ``w`` is what
    ``compact`` holds, packed (:func:`pack`; ``[N, K]`` for 8-bit rows)."""
    f32 = np.asarray(jax.device_get(w), "<f4").reshape(-1)
    if compact.dtype == jnp.bfloat16:
        both = np.concatenate([np.asarray(compact).reshape(-1).view(np.uint16), f32.view(np.uint16)])
        return jnp.asarray(both.view(ml_dtypes.bfloat16).reshape(*compact.shape[:2], BF16_DUAL_WIDTH))
    block = Q4_DUAL_BLOCK_BYTES if compact.shape[-1] == Q4_BLOCK_BYTES else Q8_DUAL_BLOCK_BYTES
    both = np.concatenate([np.asarray(compact).reshape(-1), f32.view(np.uint8)])
    return jnp.asarray(both.reshape(*compact.shape[:2], block))


def is_packed(w: jax.Array) -> bool:
    """Whether ``w`` is in a panel layout for the kernel: float32 ``[N / 16, K, 16]`` (:func:`pack`), bfloat16
    (:func:`pack_bf16`), 4-bit ``uint8 [N / 16, K / 32, 384]`` (:func:`pack_q4`) or ``int8`` (:func:`pack_w4a8`)."""
    return ((w.ndim == 3 and w.dtype == jnp.float32 and w.shape[-1] == PANEL)
            or (w.ndim == 3 and w.dtype == jnp.bfloat16 and w.shape[-1] in (PANEL, BF16_DUAL_WIDTH)) or is_q4(w)
            or is_w4a8(w))


def is_compact(w: jax.Array) -> bool:
    """Whether ``w`` is a compact layout (4-bit / bfloat16 panels, 8-bit rows: rebuilt as float32; 4-bit panels for
    int8 activations), whose products take float32 x."""
    return is_q4(w) or is_q8(w) or is_w4a8(w) or (is_packed(w) and w.dtype == jnp.bfloat16)


def in_features(w: jax.Array, *, transposed: bool = False) -> int:
    """K of a weight: ``[K, N]``, ``[N, K]`` (transposed), packed ``[N / 16, K, 16]``, or a compact layout."""
    if is_q4(w) or is_q8(w) or is_w4a8(w):
        return w.shape[1] * Q4_ROWS
    return w.shape[1] if transposed or is_packed(w) else w.shape[0]


def out_features(w: jax.Array, *, transposed: bool = False) -> int:
    """N of a weight: ``[K, N]``, ``[N, K]`` (transposed), packed ``[N / 16, K, 16]``, or a compact layout."""
    if is_packed(w):
        return w.shape[0] * PANEL
    return w.shape[0] if transposed or is_q8(w) else w.shape[1]


def can_pack(w: jax.Array) -> bool:
    """Whether :func:`pack` takes ``w``: float32 ``[K, N]`` with N a multiple of 16."""
    return w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] % PANEL == 0 and w.shape[1] > 0


def pack(w: jax.Array) -> jax.Array:
    """``[K, N]`` -> ``[N / 16, K, 16]``: 16-column panels, each one contiguous run of memory, which the kernels read
    front to back with their sums in registers (cpu_kernel.cc ``PackedProduct``). ``unpack`` inverts it."""
    if not can_pack(w):
        raise ValueError(f"pack takes a float32 [K, N] weight with N a multiple of {PANEL}; got {w.dtype}{w.shape}")
    k, n = w.shape
    return jnp.transpose(jnp.reshape(w, (k, n // PANEL, PANEL)), (1, 0, 2))


def unpack(w: jax.Array) -> jax.Array:
    """``[N / 16, K, 16]`` (float32, bfloat16 or 4-bit panels) -> float32 ``[K, N]`` (for XLA's dot: a copy; for
    :func:`pack_w4a8`'s layout the exact weights, x then not quantized)."""
    if is_w4a8(w):
        w = w4a8_dequantize(w)
    elif is_q4(w):
        compact, f32 = _regions(w, Q4_BLOCK_BYTES)
        w = q4_dequantize(compact) if f32 is None else f32.reshape(w.shape[0], -1, PANEL)
    elif w.dtype == jnp.bfloat16 and w.shape[-1] == BF16_DUAL_WIDTH:  # the float32 panels after the bfloat16 ones
        tail = jax.lax.bitcast_convert_type(w.reshape(-1)[w.shape[0] * w.shape[1] * PANEL:], jnp.uint16)
        w = jax.lax.bitcast_convert_type(tail.reshape(-1, 2), jnp.float32).reshape(w.shape[0], w.shape[1], PANEL)
    w = w.astype(jnp.float32)
    p, k, _ = w.shape
    return jnp.reshape(jnp.transpose(w, (1, 0, 2)), (k, p * PANEL))


# ---- 4-bit block panels: a lossless second layout for weights quantized as GGUF Q4_1 ----------------------------
# A checkpoint stored as Q4_1 (SmolLM2-135M's 210 matrices) dequantizes to float32 weights whose every 32-element
# block (along K, for one output column) is W[k, c] = d * q[k, c] + m with q in 0 .. 15 and d, m 16-bit floats. The
# kernel reads such a weight as 0.75 bytes per element instead of 4 and rebuilds each element as the float32
# fma(d, q, m), which equals the float32 d * q + m (d * q is exact): the products are the float32 panels' to the bit
# (cpu_kernel.cc, "4-bit block panels"). pack_q4 finds d and m from the float32 weight alone and returns None unless
# every element comes back bit for bit, so no weight is ever approximated.


def _fit_blocks(blocks: np.ndarray, axis: int, base: np.ndarray, span: np.ndarray, qmin: int,
                qmax: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``blocks`` float32 with its 32-element blocks along ``axis`` -> ``(d, q)`` (d: ``blocks`` without that axis;
    q: ``blocks``' shape, whole numbers in qmin .. qmax) with the float32 ``d * q + base`` equal to every element bit
    for bit, or None. d is the 16-bit float nearest ``span / (qmax - max(qmin, 0))`` or one of its neighbours
    (llama.cpp's quantizers round d to 16 bits after choosing it); the blocks it leaves try the next candidate."""
    d0 = (span / (qmax - max(qmin, 0))).astype(np.float16).view(np.uint16).astype(np.int32)

    def fit(d16, vals, b, along):  # candidate d (as 16-bit patterns) for blocks vals -> (d, q, ok)
        cand = np.expand_dims(np.clip(d16, 0, 0x7BFF).astype(np.uint16).view(np.float16).astype(np.float32), along)
        b = np.expand_dims(b, along)
        with np.errstate(divide="ignore", invalid="ignore"):
            qc = np.where(cand > 0, np.rint((vals - b) / cand), 0.0).clip(qmin, qmax).astype(np.float32)
        ok = np.all((cand * qc + b).view(np.uint32) == vals.view(np.uint32), axis=along)  # bits: -0.0 is not 0.0
        return np.squeeze(cand, along), qc, ok

    d, q, ok = fit(d0, blocks, base, axis)  # every block at once, in place
    if ok.all():
        return d, q
    left = np.nonzero(~ok)
    vals = np.moveaxis(blocks, axis, -1)[left]  # [blocks left, 32]
    q_last = np.moveaxis(q, axis, -1)  # a view: writes land in q
    for step in (1, -1, 2, -2):
        cand, qc, ok = fit(d0[left] + step, vals, base[left], -1)
        hit = tuple(i[ok] for i in left)
        d[hit] = cand[ok]
        q_last[hit] = qc[ok]
        left, vals = tuple(i[~ok] for i in left), vals[~ok]
        if not len(vals):
            return d, q
    return None


def _q4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``w [K, N]`` float32 -> ``(d [K/32, N], m [K/32, N], q [K, N] uint8)`` with ``d * q + m == w`` bit for bit in
    float32, or None. m is each block's minimum (q = 0 there), d as :func:`_fit_blocks` finds it."""
    k, n = w.shape
    blocks = w.reshape(k // Q4_ROWS, Q4_ROWS, n)
    lo = blocks.min(axis=1)
    found = _fit_blocks(blocks, 1, lo, blocks.max(axis=1).astype(np.float64) - lo, 0, 15)
    if found is None:
        return None
    d, q = found
    return d, lo, q.astype(np.uint8).reshape(k, n)


def pack_bf16(w: jax.Array) -> jax.Array | None:
    """``[K, N]`` float32 -> bfloat16 panels ``[N / 16, K, 16]`` when every element is a bfloat16 value (a bfloat16
    checkpoint upcast; the kernel widens them exactly), else None."""
    if not can_pack(w):
        return None
    arr = np.asarray(jax.device_get(w))
    if (arr.view(np.uint32) & 0xFFFF).any():
        return None  # low 16 bits set somewhere: not a bfloat16 value
    return pack(jnp.asarray(arr)).astype(jnp.bfloat16)


def can_pack_q4(w: jax.Array) -> bool:
    """Shapes :func:`pack_q4` may take: float32 ``[K, N]``, K a multiple of 32, N of 16 (whether the values fit is
    :func:`pack_q4`'s to find)."""
    return can_pack(w) and w.shape[0] % Q4_ROWS == 0 and w.shape[0] > 0


def pack_q4(w: jax.Array) -> jax.Array | None:
    """``[K, N]`` float32 -> ``uint8 [N / 16, K / 32, 384]``, the 4-bit panel layout, when every element of ``w`` is
    exactly ``d * q + m`` for its 32-row block and column (q in 0 .. 15, d and m 16-bit floats: a GGUF Q4_1 weight
    dequantized); None otherwise. :func:`q4_dequantize` (and the kernel) give back ``w``'s panels bit for bit."""
    if not can_pack_q4(w):
        return None
    arr = np.asarray(jax.device_get(w))
    found = _q4_blocks(arr)
    if found is None:
        return None
    d, m, q = found
    k, n = arr.shape
    nb, panels = k // Q4_ROWS, n // PANEL
    out = np.empty((panels, nb, Q4_BLOCK_BYTES), np.uint8)
    for lo, values in ((0, d), (64, m)):  # [block, column] -> per panel and block, 16 little-endian float32
        per_panel = values.reshape(nb, panels, PANEL).transpose(1, 0, 2).astype("<f4")
        out[:, :, lo:lo + 64] = per_panel.view(np.uint8).reshape(panels, nb, 64)
    qp = q.reshape(nb, Q4_ROWS // 2, 2, panels, PANEL)  # [block, pair, row in pair, panel, column]
    nibbles = qp[:, :, 0] | (qp[:, :, 1] << 4)  # [block, pair, panel, column]
    out[:, :, 128:] = nibbles.transpose(2, 0, 1, 3).reshape(panels, nb, 256)
    return jnp.asarray(out)


# ---- 4-bit panels for int8 activations (weight_format="w4a8"): the same Q4_1 blocks, lossy in the activation -----
# cpu_kernel.cc PackedProductW4A8: x is quantized per row and 32-element block to int8 and multiplied with the 4-bit
# weights by AVX512-VNNI dot products (llama.cpp's scheme for Q4_1 weights), at every row count: SmolLM2's layer
# products 0.41-0.45x the exact 4-bit rebuild's time in cache at 1-8 rows, 0.64-0.81x for all 210 from memory; with
# the tied head on int8 x too (with_w8a8_head) the whole engine 1.2-1.3x at batch 1-4, 1.9-2.1x at batch 16-64
# (README.md, "4-bit weights with int8 activations"). The weights are still exact; x's rounding is not (at most half
# a step, a block's max |x| / 254, per element): on SmolLM2 the greedy next token matched the exact model's at 91%
# of held-out positions (perplexity 43.5 -> 45.0). So it is opt-in.


def w4a8_supported() -> bool:
    """Whether the kernel takes :func:`pack_w4a8`'s layout here: packed weights and AVX512-VNNI, or no AVX-512 at all
    with AVX2 and F16C (vpmaddubsw + vpmaddwd give vpdpbusd's integer sums exactly for 4-bit weights; the kernel is
    built with -march=native, so each is compiled in exactly when this CPU has it)."""
    flags = _cpu_flags().split()
    return packing_supported() and ("avx512_vnni" in flags or (not _has_avx512() and "f16c" in flags))


def pack_w4a8(w: jax.Array) -> jax.Array | None:
    """``[K, N]`` float32 -> ``int8 [N / 16, K / 32, 320]`` when every element is exactly a Q4_1 block's
    ``d * q + m`` with d and m 16-bit floats (a GGUF Q4_1 weight dequantized), else None. Per panel and 32-row
    block: the 16 columns' d, then their m (little-endian float16: 0.625 bytes per weight), then 4 groups of 64
    bytes, group g holding rows 8g .. 8g + 7 with column c in bytes 4c .. 4c + 3 (byte i: row 8g + i in the low
    nibble, 8g + 4 + i in the high), the order AVX512-VNNI's vpdpbusd sums."""
    if not can_pack_q4(w):
        return None
    found = _q4_blocks(np.asarray(jax.device_get(w)))
    if found is None:
        return None
    d, m, q = found
    halves = [v.astype("<f2") for v in (d, m)]
    if any((h.astype(np.float32).view(np.uint32) != v.view(np.uint32)).any() for h, v in zip(halves, (d, m),
                                                                                              strict=True)):
        return None  # a scale or offset that is not a 16-bit float (not from a GGUF): pack_q4 holds it
    k, n = w.shape
    nb, panels = k // Q4_ROWS, n // PANEL
    out = np.empty((panels, nb, W4A8_BLOCK_BYTES), np.uint8)
    for lo, values in ((0, halves[0]), (32, halves[1])):  # [block, column] -> per panel and block, 16 float16
        out[:, :, lo:lo + 32] = values.reshape(nb, panels, PANEL).transpose(1, 0, 2).view(np.uint8).reshape(
            panels, nb, 32)
    qg = q.reshape(nb, 4, 2, 4, panels, PANEL)  # [block, group, half, i, panel, column]: row 8g + 4 half + i
    nibbles = qg[:, :, 0] | (qg[:, :, 1] << 4)  # [block, group, i, panel, column]
    out[:, :, 64:] = nibbles.transpose(3, 0, 1, 4, 2).reshape(panels, nb, 256)  # [panel, block, group, column, i]
    return jnp.asarray(out.view(np.int8))


def _w4a8_parts(wq) -> tuple:
    """:func:`pack_w4a8`'s layout (numpy or jax) -> ``(d, m, q)``: d and m float32 ``[panels, blocks, 16]``, q
    ``[panels, blocks, 32, 16]`` (row in block, column) in 0 .. 15."""
    xp = jnp if isinstance(wq, jax.Array) else np
    u = jax.lax.bitcast_convert_type(wq, jnp.uint8) if xp is jnp else np.asarray(wq).view(np.uint8)
    panels, nb, _ = u.shape

    def halves(a):  # [panels, nb, 32] bytes -> [panels, nb, 16] float32
        if xp is jnp:
            return jax.lax.bitcast_convert_type(a.reshape(panels, nb, PANEL, 2), jnp.float16).astype(jnp.float32)
        return np.ascontiguousarray(a).view("<f2").astype(np.float32).reshape(panels, nb, PANEL)

    g = u[:, :, 64:].reshape(panels, nb, 4, PANEL, 4)  # [panel, block, group, column, i]
    q = xp.stack([g & 15, g >> 4], axis=3)  # [panel, block, group, half, column, i]
    q = xp.transpose(q, (0, 1, 2, 3, 5, 4)).reshape(panels, nb, Q4_ROWS, PANEL)
    return halves(u[:, :, :32]), halves(u[:, :, 32:64]), q


def w4a8_dequantize(wq: jax.Array) -> jax.Array:
    """:func:`pack_w4a8`'s layout -> the float32 panels ``[N / 16, K, 16]`` of its exact weights."""
    d, m, q = _w4a8_parts(wq)
    panels, nb = d.shape[:2]
    return (d[:, :, None, :] * q.astype(jnp.float32) + m[:, :, None, :]).reshape(panels, nb * Q4_ROWS, PANEL)


def _quantize_x(x: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ``[M, K]`` as the kernel quantizes it per row and 32-element block: ``(x blocks [M, nb, 32] float32, d_x
    [M, nb], q_x [M, nb, 32] as float64 integers)``, d_x = max |x| / 127 and q_x = round(x * 127 / max |x|)."""
    xb = np.asarray(x, np.float32).reshape(-1, nb, Q4_ROWS)
    amax = np.abs(xb).max(axis=2)
    dx = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return xb, dx, np.rint(xb * inv[:, :, None]).astype(np.float64)


def w4a8_reference(x: np.ndarray, wq) -> np.ndarray:
    """What the kernel computes for ``x [M, K] @`` a :func:`pack_w4a8` weight, in numpy (float64 sums; tests): x
    quantized per row and 32-element block as the kernel does, the exact weights' blocks."""
    d, m, q = _w4a8_parts(np.asarray(wq))
    panels, nb = d.shape[:2]
    xb, dx, qx = _quantize_x(x, nb)
    isum = np.einsum("mbk,pbkc->mpbc", qx, q.astype(np.float64))  # exact integers
    sx = xb.astype(np.float64).sum(axis=2)  # [M, nb]
    y = (isum * (d[None].astype(np.float64) * dx[:, None, :, None]) + m[None] * sx[:, None, :, None]).sum(axis=2)
    return y.reshape(xb.shape[0], panels * PANEL).astype(np.float32)


def w8a8_head_reference(x: np.ndarray, wq) -> np.ndarray:
    """What the kernel computes for ``x [M, K]`` times a :func:`with_w8a8_head` table ``[N, K / 32, 72]``
    (transposed), in numpy (tests): x quantized per row and 32 elements, exact integer sums, float64 scaling."""
    n, nb, _ = wq.shape
    rows = np.asarray(wq).reshape(-1)[: n * nb * Q8_BLOCK_BYTES].reshape(n, nb, Q8_BLOCK_BYTES)  # the rows come first
    d = rows[:, :, :4].copy().view("<f4").reshape(n, nb).astype(np.float64)
    q = rows[:, :, 4:].view(np.int8).astype(np.float64)  # [n, nb, 32]
    _, dx, qx = _quantize_x(x, nb)
    isum = np.einsum("mbk,nbk->mnb", qx, q)
    return (isum * d[None] * dx[:, None, :]).sum(axis=2).astype(np.float32)


def _q8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``w [N, K]`` float32 -> ``(d [N, K/32], q [N, K] int8)`` with ``d * q == w`` bit for bit in float32, or None
    (d as :func:`_fit_blocks` finds it from the block's largest magnitude)."""
    n, k = w.shape
    blocks = w.reshape(n, k // Q4_ROWS, Q4_ROWS)
    found = _fit_blocks(blocks, 2, np.zeros(blocks.shape[:2], np.float32),
                        np.abs(blocks).max(axis=2).astype(np.float64), -127, 127)
    if found is None:
        return None
    d, q = found
    return d, q.astype(np.int8).reshape(n, k)


def pack_q8(w: jax.Array) -> jax.Array | None:
    """``[N, K]`` float32 (an embedding table, the tied head's weight) -> ``uint8 [N, K / 32, 36]``, the 8-bit block
    layout, when every element is exactly ``d * q`` for its 32-element block of the row (q in -127 .. 127, d a 16-bit
    float: a GGUF Q8_0 table dequantized); None otherwise. :func:`q8_dequantize` gives back ``w`` bit for bit."""
    if w.ndim != 2 or w.dtype != jnp.float32 or w.shape[1] % Q4_ROWS or not w.shape[1] or not w.shape[0]:
        return None
    arr = np.asarray(jax.device_get(w))
    found = _q8_blocks(arr)
    if found is None:
        return None
    d, q = found
    n, k = arr.shape
    out = np.empty((n, k // Q4_ROWS, Q8_BLOCK_BYTES), np.uint8)
    out[:, :, :4] = d.astype("<f4").view(np.uint8).reshape(n, k // Q4_ROWS, 4)
    out[:, :, 4:] = q.view(np.uint8).reshape(n, k // Q4_ROWS, Q4_ROWS)
    return jnp.asarray(out)


def q8_table(wq: jax.Array) -> jax.Array:
    """8-bit rows (either form) -> the float32 ``[N, K]`` table they hold (exact)."""
    compact, f32 = _regions(wq, Q8_BLOCK_BYTES)
    if f32 is None or is_w8a8_head(wq):  # (the bytes after the rows of a w8a8 head are panels, not float32)
        return q8_dequantize(compact)
    return f32.reshape(wq.shape[0], -1)


def with_w8a8_head(q8: jax.Array) -> jax.Array | None:
    """8-bit rows ``uint8 [N, K / 32, 36]`` (:func:`pack_q8`) -> the same rows followed by panels of them for int8
    activations, ``uint8 [N, K / 32, 72]`` (None unless N is a multiple of 16): per 16 rows and 32-element block the
    16 rows' d (float32), then 8 groups of 64 bytes, group g holding elements 4g .. 4g + 3 of row c in bytes 4c ..
    4c + 3 as q + 128 (unsigned, vpdpbusd's first operand; the kernel takes 128 * sum q_x back off). A tied head
    reads the panels (x quantized per row and 32 elements, as ``pack_w4a8``'s weights), the embedding the rows."""
    if q8.shape[-1] != Q8_BLOCK_BYTES or q8.shape[0] % PANEL:
        return None
    rows = np.asarray(jax.device_get(q8))
    n, nb, _ = rows.shape
    panels = n // PANEL
    d = rows[:, :, :4].copy().view("<f4").reshape(panels, PANEL, nb)  # [panel, row, block]
    q = (rows[:, :, 4:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [n, block, 32]
    out = np.empty((panels, nb, W8A8_PANEL_BLOCK_BYTES), np.uint8)
    out[:, :, :64] = np.ascontiguousarray(d.transpose(0, 2, 1), "<f4").view(np.uint8).reshape(panels, nb, 64)
    qg = q.reshape(panels, PANEL, nb, 8, 4)  # [panel, row, block, group, i]
    out[:, :, 64:] = qg.transpose(0, 2, 3, 1, 4).reshape(panels, nb, 8 * PANEL * 4)  # [panel, block, group, row, i]
    both = np.concatenate([rows.reshape(-1), out.reshape(-1)])
    return jnp.asarray(both.reshape(n, nb, Q8_W8A8_BLOCK_BYTES))


def q8_rows(wq: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` of 8-bit rows (either form) as float32 ``[*ids.shape, K]`` (an embedding lookup; exact)."""
    compact, _ = _regions(wq, Q8_BLOCK_BYTES)
    return q8_dequantize(jnp.take(compact, ids, axis=0))


def q8_dequantize(wq: jax.Array) -> jax.Array:
    """8-bit rows ``[..., K / 32, 36]`` -> the float32 ``[..., K]`` they hold (exact), any leading shape."""
    lead, nb = wq.shape[:-2], wq.shape[-2]
    d = jax.lax.bitcast_convert_type(wq[..., :4], jnp.float32)  # [..., nb]
    q = jax.lax.bitcast_convert_type(wq[..., 4:], jnp.int8).astype(jnp.float32)  # [..., nb, 32]
    return (d[..., None] * q).reshape(*lead, nb * Q4_ROWS)


def q4_dequantize(wq: jax.Array) -> jax.Array:
    """4-bit panels -> the float32 panels ``[N / 16, K, 16]`` they hold (exact; what the kernel computes with)."""
    wq = _regions(wq, Q4_BLOCK_BYTES)[0]
    panels, nb, _ = wq.shape
    d = jax.lax.bitcast_convert_type(wq[:, :, :64].reshape(panels, nb, PANEL, 4), jnp.float32)
    m = jax.lax.bitcast_convert_type(wq[:, :, 64:128].reshape(panels, nb, PANEL, 4), jnp.float32)
    pairs = wq[:, :, 128:].reshape(panels, nb, Q4_ROWS // 2, 1, PANEL)
    q = jnp.concatenate([pairs & 15, pairs >> 4], axis=3).reshape(panels, nb, Q4_ROWS, PANEL).astype(jnp.float32)
    w = d[:, :, None, :] * q + m[:, :, None, :]
    return w.reshape(panels, nb * Q4_ROWS, PANEL)


def packing_supported() -> bool:
    """Whether the kernels take packed weights here: built with AVX-512, or AVX2 and FMA (the panels are 16-float
    vectors: one AVX-512 register, or a pair of AVX registers)."""
    flags = _cpu_flags().split()
    return (_has_avx512() or ("avx2" in flags and "fma" in flags)) and available()


def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call)."""
    return _LIBRARY.available()


def unavailable_reason() -> str:
    return _LIBRARY.unavailable_reason()


def use_kernel(x_shape: tuple[int, ...], w: jax.Array, *, transposed: bool = False) -> bool:
    """Whether ``auto`` dispatch runs this product on the kernel: CPU backend, float32, rows in the measured range."""
    rows = math.prod(x_shape[:-1])
    lo, hi = NT_ROWS if transposed else NN_ROWS
    return (
        jax.default_backend() == "cpu"
        and (w.dtype == jnp.float32 or (is_compact(w) and is_q8(w) == transposed))
        and (w.ndim == 2 or (is_packed(w) and not transposed) or (is_q8(w) and transposed))
        and lo <= rows <= hi
        and available()
    )


def _rows(x: jax.Array, ws, *, transposed: bool = False) -> jax.Array:
    """Checks the operands of a call and returns x as ``[rows, K]``."""
    if not available():
        raise RuntimeError(f"the CPU linear kernel is unavailable: {unavailable_reason()}")
    if x.dtype != jnp.float32 or any(w.dtype != jnp.float32 and not (is_q8(w) if transposed else is_packed(w))
                                     for w in ws):
        raise ValueError(f"the CPU linear kernel takes float32 x and float32 (or compact panel / 8-bit head) w; got "
                         f"{x.dtype} and {[str(w.dtype) for w in ws]}")
    k = x.shape[-1] if x.ndim else None
    if any((w.ndim != 2 and not (is_q8(w) if transposed else is_packed(w)))
           or in_features(w, transposed=transposed) != k for w in ws):
        layout = "[N, K] (transposed)" if transposed else "[K, N] or packed [N / 16, K, 16]"
        raise ValueError(f"x {x.shape} and weights {[w.shape for w in ws]} do not match (x [..., K], each w {layout})")
    return x.reshape(math.prod(x.shape[:-1]), k)


def linear_cpu(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """``x [..., K] @ w`` (``w [K, N]``, or ``[N, K]`` when ``transposed``) -> ``[..., N]`` float32."""
    x2 = _rows(x, [w], transposed=transposed)
    n = out_features(w, transposed=transposed)
    call = ffi_call(_TARGETS[transposed], jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    (w_op,), layers = _operands(w)
    return call(x2, w_op, layers=layers).reshape(*x.shape[:-1], n)


def linear_many_cpu(x: jax.Array, ws: list[jax.Array] | tuple[jax.Array, ...]) -> list[jax.Array]:
    """``[x @ w for w in ws]`` (2 or 3 weights ``[K, N_i]``, e.g. q/k/v or gate/up) in one custom call: the pool is
    woken once and the products do not run as concurrent calls competing for the same cores."""
    if len(ws) not in _MANY_TARGETS:
        raise ValueError(f"linear_many_cpu takes 2 or 3 weights, got {len(ws)}")
    x2 = _rows(x, ws)
    outs = tuple(jax.ShapeDtypeStruct((x2.shape[0], out_features(w)), jnp.float32) for w in ws)
    ops, layers = _operands(*ws)
    ys = ffi_call(_MANY_TARGETS[len(ws)], outs, vmap_method="sequential")(x2, *ops, layers=layers)
    return [y.reshape(*x.shape[:-1], out_features(w)) for y, w in zip(ys, ws, strict=True)]


# ---- fused decoder-layer forms: fewer XLA thunks per decode step (580 -> 257 for a one-row SmolLM2 step) ----


def _gain(x: jax.Array, gain: jax.Array) -> None:
    if gain.dtype != jnp.float32 or gain.shape != (x.shape[-1],):
        raise ValueError(f"RMSNorm gain must be float32 [{x.shape[-1]}] for x {x.shape}; got {gain.dtype}{gain.shape}")


def rms_linear_many_cpu(x: jax.Array, gain: jax.Array, ws: list[jax.Array] | tuple[jax.Array, ...],
                        eps: float) -> list[jax.Array]:
    """``[RMSNorm(x) @ w for w in ws]`` (2 or 3 weights ``[K, N_i]``) in one custom call: the pre-attention norm and
    q/k/v. ``RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * gain`` in float32."""
    if len(ws) not in _RMS_TARGETS:
        raise ValueError(f"rms_linear_many_cpu takes 2 or 3 weights, got {len(ws)}")
    x2 = _rows(x, ws)
    _gain(x, gain)
    outs = tuple(jax.ShapeDtypeStruct((x2.shape[0], out_features(w)), jnp.float32) for w in ws)
    ops, layers = _operands(gain, *ws)
    ys = ffi_call(_RMS_TARGETS[len(ws)], outs, vmap_method="sequential")(x2, *ops, eps=np.float32(eps),
                                                                                    layers=layers)
    return [y.reshape(*x.shape[:-1], out_features(w)) for y, w in zip(ys, ws, strict=True)]


def rms_swiglu_cpu(x: jax.Array, gain: jax.Array, w_gate: jax.Array, w_up: jax.Array, eps: float) -> jax.Array:
    """``silu(RMSNorm(x) @ w_gate) * (RMSNorm(x) @ w_up)`` (both ``[K, N]``) -> ``[..., N]`` in one custom call."""
    x2 = _rows(x, [w_gate, w_up])
    _gain(x, gain)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {w_gate.shape} and w_up {w_up.shape} must have the same shape [K, N]")
    n = out_features(w_gate)
    call = ffi_call("nightjar_rms_swiglu_f32", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    ops, layers = _operands(gain, w_gate, w_up)
    return call(x2, *ops, eps=np.float32(eps), layers=layers).reshape(*x.shape[:-1], n)


def linear_residual_cpu(x: jax.Array, w: jax.Array, r: jax.Array) -> jax.Array:
    """``r + x @ w`` (``w [K, N]``, r ``[..., N]`` float32 with x's leading dimensions) in one custom call."""
    x2 = _rows(x, [w])
    n = out_features(w)
    if r.dtype != jnp.float32 or r.shape != (*x.shape[:-1], n):
        raise ValueError(f"residual r must be float32 {(*x.shape[:-1], n)} for x {x.shape} @ w {w.shape}; "
                         f"got {r.dtype}{r.shape}")
    call = ffi_call("nightjar_linear_residual_f32", jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    (w_op,), layers = _operands(w)
    return call(x2, w_op, r.reshape(x2.shape[0], n), layers=layers).reshape(*x.shape[:-1], n)


def attn_out_mlp_cpu(a: jax.Array, r: jax.Array, w_o: jax.Array, gain: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array, eps: float, *, next_gain: jax.Array | None = None,
                     next_ws: list[jax.Array] | tuple[jax.Array, ...] | None = None,
                     next_eps: float | None = None) -> jax.Array | tuple[jax.Array, list[jax.Array]]:
    """A decoder layer after attention in one custom call: ``r1 = r + a @ w_o``, then
    ``y = r1 + silu(RMSNorm(r1) @ w_gate) * (RMSNorm(r1) @ w_up) @ w_down``. ``a [..., A]`` (the attention output),
    ``r [..., H]`` float32 (the residual stream), ``w_o [A, H]``, ``w_gate, w_up [H, I]``, ``w_down [I, H]``.
    With ``next_gain`` and the 3 ``next_ws`` (the next layer's pre-attention norm and q/k/v ``[H, N_i]``) the same
    call also computes ``[RMSNorm'(y) @ w for w in next_ws]`` and returns ``(y, [q, k, v])``."""
    a2 = _rows(a, [w_o])
    h = out_features(w_o)
    if r.dtype != jnp.float32 or r.shape != (*a.shape[:-1], h):
        raise ValueError(f"residual r must be float32 {(*a.shape[:-1], h)} for a {a.shape} @ w_o {w_o.shape}; "
                         f"got {r.dtype}{r.shape}")
    r2 = r.reshape(a2.shape[0], h)
    _rows(r2, [w_gate, w_up])
    _gain(r, gain)
    if (w_gate.shape != w_up.shape or (in_features(w_down), out_features(w_down)) != (out_features(w_gate), h)
            or (w_down.dtype != jnp.float32 and not is_packed(w_down))
            or len({is_packed(w) for w in (w_o, w_gate, w_up, w_down)}) != 1):
        raise ValueError(f"w_gate {w_gate.shape} and w_up {w_up.shape} must be [H, I] and w_down {w_down.shape} "
                         f"float32 [I, H] with H = {h}, all [K, N] or all packed [N / 16, K, 16]")
    y_shape = jax.ShapeDtypeStruct((a2.shape[0], h), jnp.float32)
    if next_gain is None:
        call = ffi_call("nightjar_attn_out_mlp_f32", y_shape, vmap_method="sequential")
        ops, layers = _operands(w_o, gain, w_gate, w_up, w_down)
        return call(a2, r2, *ops, eps=np.float32(eps), layers=layers).reshape(r.shape)
    if next_ws is None or len(next_ws) != 3 or next_eps is None:
        raise ValueError("the next layer's q/k/v need next_gain, 3 next_ws and next_eps")
    _rows(r2, next_ws)
    _gain(r, next_gain)
    if any(is_packed(w) != is_packed(w_o) for w in next_ws):
        raise ValueError("the next q/k/v must be packed [N / 16, K, 16] exactly when the layer's weights are")
    outs = (y_shape, *(jax.ShapeDtypeStruct((a2.shape[0], out_features(w)), jnp.float32) for w in next_ws))
    call = ffi_call("nightjar_attn_out_mlp_qkv_f32", outs, vmap_method="sequential")
    ops, layers = _operands(w_o, gain, w_gate, w_up, w_down, next_gain, *next_ws)
    y, *qkv = call(a2, r2, *ops, eps=np.float32(eps), eps_next=np.float32(next_eps), layers=layers)
    lead = a.shape[:-1]
    return y.reshape(r.shape), [t.reshape(*lead, out_features(w)) for t, w in zip(qkv, next_ws, strict=True)]
