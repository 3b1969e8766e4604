"""The CPU linear custom calls (``kernels_pallas/linear/cpu.py``) against a float64 numpy product.

Shapes cover the NN paths (up to ``cpu.SPLIT_K_MAX_ROWS`` rows, 12 or 8 on AMD EPYC with AVX-512: contiguous runs
of weight rows per thread, x rows in pairs or up to 6 per pass, partials summed; more: 8 x 48 register tiles with
AVX-512, packed 6 x 16 tiles without, with every row remainder), the one-row transposed path, column counts that
are not multiples of the 8/16-wide vectors and panels, K not a multiple of the 4-row unroll or of the 64-row block,
the transposed (tied-head) kernel's 4-row and 3-row tiles with remainders, leading batch dimensions, jit, the
dispatch rule (which products ``auto`` sends to the kernel), clear errors for bad dtypes and shapes, and a whole model
giving the same logits with ``linear_impl="cpu"`` and ``"xla"``. Skips only when no C++ compiler exists (the reason
is printed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.linear import (
    attn_out_mlp,
    linear,
    linear_many,
    linear_residual,
    rms_linear_many,
    rms_norm,
    rms_swiglu,
)

F32 = jnp.float32


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.available():
        pytest.skip(f"CPU linear kernel unavailable here: {cpu.unavailable_reason()}")


def _data(m, k, n, *, transposed, seed=0):
    rng = np.random.default_rng(seed + 1000 * m + 10 * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    return x, w


def _check(x, w, *, transposed):
    expected = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    actual = np.asarray(jax.jit(lambda a, b: cpu.linear_cpu(a, b, transposed=transposed))(x, w))
    assert actual.shape == expected.shape and actual.dtype == np.float32
    # float32 accumulation over K terms: error bound relative to sum |x| |w|
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T if transposed else w).astype(np.float64)
    np.testing.assert_array_less(np.abs(actual - expected), 1e-5 * scale + 1e-6)


NN_SHAPES = [
    (1, 576, 960), (1, 577, 33), (2, 130, 1536), (1, 31, 8), (2, 1000, 7),  # 1-2 rows: split-K; chunk/K tails
    (3, 7, 5), (5, 130, 33), (4, 64, 8), (7, 130, 40), (11, 200, 50), (12, 64, 8),  # odd rows: a lone last row
    (13, 65, 23), (15, 64, 16), (16, 130, 40), (17, 33, 19), (48, 576, 96), (50, 200, 130),  # packed; remainders
    # past 12 rows (8 on AMD EPYC) with AVX-512 (9-17 rows above too), 8 x 48 tiles: a lone row / 7-row
    # remainder, K past one 128-row block, columns past the last whole 48 (those on the packed path), exactly two blocks
    (25, 576, 96), (31, 130, 50), (32, 300, 1000), (47, 129, 144), (64, 256, 48), (40, 5, 49),
    (20, 576, 192),  # two row tiles: the one after the first prefetches all three lines per row of the next block
    (157, 200, 144),  # auto's widest range (NN_MAX_ROWS = 160): 19 full row tiles and a 5-row one
]
NT_SHAPES = [
    (1, 576, 4096), (1, 35, 9), (1, 600, 3),  # one row: 4 accumulators per weight row; K tails
    (2, 8, 4), (3, 7, 5), (4, 130, 65), (8, 1, 3), (9, 576, 130), (5, 64, 64),
    # past 12 rows (8 on AMD EPYC) with AVX-512, 12 x 32 tiles of W @ x^T: weight-row remainders, x rows past
    # one 16-column group, two groups of 32 (the second of 16), K tails
    (25, 576, 130), (32, 70, 45), (28, 5, 13), (48, 33, 100), (40, 17, 12), (13, 576, 130), (20, 64, 96),
]


@pytest.mark.parametrize("m,k,n", NN_SHAPES)
def test_nn_matches_numpy(m, k, n):
    _check(*_data(m, k, n, transposed=False), transposed=False)


@pytest.mark.parametrize("m,k,n", NT_SHAPES)
def test_nt_matches_numpy(m, k, n):
    _check(*_data(m, k, n, transposed=True), transposed=True)


def test_leading_dimensions_and_empty_k():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(cpu.linear_cpu(x, w)), x @ w, rtol=1e-5, atol=1e-5)
    zeros = cpu.linear_cpu(jnp.ones((3, 0), F32), jnp.ones((0, 5), F32))
    np.testing.assert_array_equal(np.asarray(zeros), np.zeros((3, 5), np.float32))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="float32"):
        cpu.linear_cpu(jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_cpu(jnp.ones((2, 4), F32), jnp.ones((5, 3), F32))
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_cpu(jnp.ones((2, 4), F32), jnp.ones((4, 3), F32), transposed=True)
    with pytest.raises(ValueError, match="allowed"):
        linear(jnp.ones((2, 4), F32), jnp.ones((4, 3), F32), impl="fast")
    # XLA's path (and auto's off the kernel) said "Size of label 'k' for operand 1 (31) does not match ..."
    with pytest.raises(ValueError, match=r"must agree on K; got x \(2, 31\) and w \(32, 16\)"):
        linear(jnp.ones((2, 31), F32), jnp.ones((32, 16), F32), impl="xla")


@pytest.mark.parametrize("m", [1, 3, 7])
@pytest.mark.parametrize("widths", [(40, 8), (64, 16, 16)])  # gate/up-like, q/k/v-like (GQA: narrower k, v)
def test_many_weights_in_one_call(m, widths):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 72)).astype(np.float32)
    ws = [rng.standard_normal((72, n)).astype(np.float32) for n in widths]
    ys = jax.jit(lambda a, *b: cpu.linear_many_cpu(a, list(b)))(x, *ws)
    for y, w in zip(ys, ws, strict=True):
        np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-4)
    via_dispatch = linear_many(jnp.asarray(x), [jnp.asarray(w) for w in ws], impl="cpu")
    np.testing.assert_allclose(np.asarray(via_dispatch[0]), np.asarray(ys[0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_many_cpu(jnp.asarray(x), [jnp.asarray(ws[0]), jnp.ones((71, 4), F32)])
    with pytest.raises(ValueError, match="2 or 3"):
        cpu.linear_many_cpu(jnp.asarray(x), [jnp.asarray(ws[0])])


def _uses_kernel(fn, *args) -> bool:
    return "nightjar_linear" in jax.jit(fn).lower(*args).as_text()


def test_auto_dispatch_follows_the_measured_row_ranges():
    w, w_t = jnp.ones((64, 32), F32), jnp.ones((32, 64), F32)
    for rows in (1, 2, 5, 6, 8, 9, 24, 25, 48, 49):
        x = jnp.ones((rows, 64), F32)
        lo, hi = cpu.NN_ROWS
        assert _uses_kernel(lambda a, b: linear(a, b), x, w) == (lo <= rows <= hi)
        lo, hi = cpu.NT_ROWS
        assert _uses_kernel(lambda a, b: linear(a, b, transposed=True), x, w_t) == (lo <= rows <= hi)
    x = jnp.ones((4, 64), F32)
    assert _uses_kernel(lambda a, b: linear_many(a, [b, b]), x, w)
    assert _uses_kernel(lambda a, b: linear_many(a, [b, b]), jnp.ones((1, 64), F32), w) == (cpu.NN_ROWS[0] == 1)
    past = cpu.NN_MAX_ROWS + 1
    assert not _uses_kernel(lambda a, b: linear_many(a, [b, b]), jnp.ones((past, 64), F32), w)
    assert _uses_kernel(lambda a, b: linear_many(a, [b, b]), jnp.ones((cpu.NN_MAX_ROWS, 64), F32), w)
    assert not _uses_kernel(lambda a, b: linear(a, b, impl="xla"), x, w)
    assert _uses_kernel(lambda a, b: linear(a, b, impl="cpu"), jnp.ones((1, 64), F32), w)
    assert not _uses_kernel(lambda a, b: linear(a, b), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(linear(x, w)), np.asarray(linear(x, w, impl="xla")), rtol=1e-6)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mha"])  # tied head (transposed kernel) and untied
def test_model_logits_match_with_and_without_the_kernel(preset):
    from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, init_model, make_model_fns
    from nightjar_jax.models.presets import get_preset

    cfg = get_preset(preset).config
    assert cfg.dtype == "float32"
    outs = {}
    for impl in ("xla", "cpu"):  # "cpu": every product on the kernel, whatever its row count
        graphdef, state = init_model(cfg, seed=3, linear_impl=impl)
        hidden_fn, logits_fn = make_model_fns(graphdef)
        kv = allocate_kv_cache(cfg, num_pages=8, page_size=4)
        tokens = jnp.asarray(np.arange(10, dtype=np.int32).reshape(2, 5) * 37 % cfg.vocab_size)
        md = BatchMetadata(block_tables=jnp.asarray([[1, 2], [3, 4]], jnp.int32),
                           context_lens=jnp.asarray([5, 5], jnp.int32))
        hidden, _ = jax.jit(hidden_fn)(state, tokens, kv, md)
        outs[impl] = np.asarray(jax.jit(logits_fn)(state, hidden))
    np.testing.assert_allclose(outs["cpu"], outs["xla"], rtol=2e-4, atol=2e-4)


# ---- fused decoder-layer forms (norm + q/k/v, norm + SwiGLU gate, residual add) against numpy ----


def _rms(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * g


@pytest.mark.parametrize("m", [1, 2, 5, 12, 16])  # split-K rows, and the packed path (cpu.py calls it directly)
@pytest.mark.parametrize("widths", [(40, 8), (64, 16, 16)])
def test_rms_linear_many_matches_numpy(m, widths):
    rng = np.random.default_rng(7 * m)
    k, eps = 70, 1e-5
    x = (3 * rng.standard_normal((m, k))).astype(np.float32)
    g = rng.uniform(0.5, 1.5, k).astype(np.float32)
    ws = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
    ys = jax.jit(lambda a, b, *c: cpu.rms_linear_many_cpu(a, b, list(c), eps))(x, g, *ws)
    xn = _rms(x, g, eps)
    for y, w in zip(ys, ws, strict=True):
        np.testing.assert_allclose(np.asarray(y), xn @ w, rtol=1e-4, atol=1e-4)
    # the dispatcher's XLA composition gives the same numbers
    ref = linear_many(rms_norm(jnp.asarray(x), jnp.asarray(g), eps), [jnp.asarray(w) for w in ws], impl="xla")
    for y, r in zip(ys, ref, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,gate_scale", [(1, 1.0), (3, 1.0), (12, 1.0), (2, 30.0)])  # 30: gates far past +-87
def test_rms_swiglu_matches_numpy(m, gate_scale):
    rng = np.random.default_rng(m)
    k, n, eps = 72, 44, 1e-6
    x = rng.standard_normal((2, m, k)).astype(np.float32)  # leading dimensions are flattened and restored
    g = rng.uniform(0.5, 1.5, k).astype(np.float32)
    wg, wu = (rng.standard_normal((k, n)).astype(np.float32) for _ in range(2))
    wg *= gate_scale
    h = np.asarray(jax.jit(lambda *a: cpu.rms_swiglu_cpu(*a, eps))(x, g, wg, wu))
    xn = _rms(x, g, eps)
    gate, up = xn @ wg, xn @ wu
    assert h.shape == (2, m, n)
    assert np.isfinite(h).all()
    np.testing.assert_allclose(h, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-3 * gate_scale)
    via = rms_swiglu(jnp.asarray(x), jnp.asarray(g), jnp.asarray(wg), jnp.asarray(wu), eps, impl="xla")
    np.testing.assert_allclose(h, np.asarray(via), rtol=1e-4, atol=1e-3 * gate_scale)


@pytest.mark.parametrize("m", [1, 4, 13])
def test_linear_residual_matches_numpy(m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    r = rng.standard_normal((m, 40)).astype(np.float32)
    y = np.asarray(jax.jit(cpu.linear_residual_cpu)(x, w, r))
    np.testing.assert_allclose(y, r + x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_fused_forms_reject_bad_inputs_clearly():
    x, w = jnp.ones((2, 8), F32), jnp.ones((8, 4), F32)
    with pytest.raises(ValueError, match="gain must be float32"):
        cpu.rms_linear_many_cpu(x, jnp.ones((7,), F32), [w, w], 1e-5)
    with pytest.raises(ValueError, match="same shape"):
        cpu.rms_swiglu_cpu(x, jnp.ones((8,), F32), w, jnp.ones((8, 5), F32), 1e-5)
    with pytest.raises(ValueError, match="residual r must be"):
        cpu.linear_residual_cpu(x, w, jnp.ones((2, 5), F32))
    with pytest.raises(ValueError, match="2 or 3"):
        cpu.rms_linear_many_cpu(x, jnp.ones((8,), F32), [w], 1e-5)


def test_auto_dispatch_fuses_the_decoder_layer_ops():
    """``auto`` on the kernel's rows: one custom call each (no XLA norm fusions left); outside them, XLA ops."""
    x, g, w, w2 = jnp.ones((3, 64), F32), jnp.ones((64,), F32), jnp.ones((64, 32), F32), jnp.ones((32, 64), F32)
    text = jax.jit(lambda a: rms_linear_many(a, g, [w, w, w], 1e-5)).lower(x).as_text()
    assert "nightjar_rms_linear3_f32" in text and "rsqrt" not in text
    assert "nightjar_rms_swiglu_f32" in jax.jit(lambda a: rms_swiglu(a, g, w, w, 1e-5)).lower(x).as_text()
    assert "nightjar_linear_residual_f32" in jax.jit(lambda a, r: linear_residual(a, w2, r)).lower(
        jnp.ones((3, 32), F32), x).as_text()
    big = jnp.ones((cpu.NN_MAX_ROWS + 1, 64), F32)
    assert "nightjar" not in jax.jit(lambda a: rms_swiglu(a, g, w, w, 1e-5)).lower(big).as_text()


def test_back_to_back_fused_calls_stay_exact():
    """Many short fused calls in a row, as in a decode step (work items shared with the pool's helpers,
    ``cpu_parallel.h``): every repetition gives bit-identical results, equal to numpy's within float32 rounding."""
    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((64, n)).astype(np.float32) / 8 for n in (96, 64, 200, 64)]
    g = np.ones(64, np.float32)

    @jax.jit
    def chain(x, *w):
        for _ in range(6):
            q, k = cpu.rms_linear_many_cpu(x, g, [w[0][:, :64], w[1]], 1e-5)
            x = cpu.linear_residual_cpu(q + k, w[3], x)
            x = x + cpu.rms_swiglu_cpu(x, g, w[2][:, :64], w[2][:, 64:128], 1e-5)
        return x

    x = rng.standard_normal((3, 64)).astype(np.float32)
    first = np.asarray(chain(x, *ws))
    for _ in range(30):
        np.testing.assert_array_equal(np.asarray(chain(x, *ws)), first)
    ref = x.astype(np.float64)
    for _ in range(6):
        xn = _rms(ref, g, 1e-5)
        ref = ref + (xn @ ws[0][:, :64] + xn @ ws[1]) @ ws[3]
        xn = _rms(ref, g, 1e-5)
        gate, up = xn @ ws[2][:, :64], xn @ ws[2][:, 64:128]
        ref = ref + gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(first, ref, rtol=1e-3, atol=1e-3)


# ---- a decoder layer after attention in one call (o_proj, residual, norm, SwiGLU MLP, residual[, next q/k/v]) ----


def _layer_ref(a, r, wo, g, wg, wu, wd, eps):
    r1 = r.astype(np.float64) + a.astype(np.float64) @ wo
    xn = _rms(r1, g, eps)
    gate, up = xn @ wg, xn @ wu
    return r1 + (gate / (1 + np.exp(-gate)) * up) @ wd


def _layer_weights(rng, a_dim=48, h=40, i=72, widths=(40, 8, 8)):
    wo = rng.standard_normal((a_dim, h)).astype(np.float32) / 6
    g, gn = (rng.uniform(0.5, 1.5, h).astype(np.float32) for _ in range(2))
    wg, wu = (rng.standard_normal((h, i)).astype(np.float32) / 6 for _ in range(2))
    wd = rng.standard_normal((i, h)).astype(np.float32) / 8
    nws = [rng.standard_normal((h, n)).astype(np.float32) for n in widths]
    return wo, g, wg, wu, wd, gn, nws


# 1 row: the two-stream passes; more: x rows in pairs or (AVX-512) up to 6 per pass, with remainders
@pytest.mark.parametrize("m", [1, 2, 5, 7, 12, 13, 23])
def test_attn_out_mlp_matches_numpy(m):
    rng = np.random.default_rng(11 * m)
    eps = 1e-5
    wo, g, wg, wu, wd, gn, nws = _layer_weights(rng)
    a = rng.standard_normal((2, m, 48)).astype(np.float32)  # leading dimensions flattened and restored
    r = (2 * rng.standard_normal((2, m, 40))).astype(np.float32)
    y = np.asarray(jax.jit(lambda *t: cpu.attn_out_mlp_cpu(*t, eps))(a, r, wo, g, wg, wu, wd))
    ref = _layer_ref(a, r, wo, g, wg, wu, wd, eps)
    assert y.shape == (2, m, 40)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    # with the next layer's norm and q/k/v in the same call: the same y, and q/k/v of RMSNorm'(y)
    y2, qkv = jax.jit(lambda *t: cpu.attn_out_mlp_cpu(*t[:7], eps, next_gain=t[7], next_ws=list(t[8:]),
                                                       next_eps=1e-6))(a, r, wo, g, wg, wu, wd, gn, *nws)
    np.testing.assert_array_equal(np.asarray(y2), y)
    xn = _rms(ref, gn, 1e-6)
    for t, w in zip(qkv, nws, strict=True):
        assert t.shape == (2, m, w.shape[1])
        np.testing.assert_allclose(np.asarray(t), xn @ w, rtol=1e-4, atol=1e-3)
    # the dispatcher: the kernel where every product is on it, else exactly the composition (XLA path)
    args = [jnp.asarray(t) for t in (a, r, wo, g, wg, wu, wd)]
    for impl in ("auto", "xla"):
        y3, qkv3 = attn_out_mlp(*args, eps, impl=impl, next_gain=jnp.asarray(gn),
                                next_ws=[jnp.asarray(w) for w in nws], next_eps=1e-6)
        np.testing.assert_allclose(np.asarray(y3), y, rtol=1e-4, atol=1e-4)
        for t, u in zip(qkv3, qkv, strict=True):
            np.testing.assert_allclose(np.asarray(t), np.asarray(u), rtol=1e-4, atol=1e-3)


def test_attn_out_mlp_dispatch_and_bad_inputs():
    rng = np.random.default_rng(3)
    wo, g, wg, wu, wd, gn, nws = (jnp.asarray(t) if not isinstance(t, list) else [jnp.asarray(w) for w in t]
                                  for t in _layer_weights(rng))
    split_k = cpu.SPLIT_K_MAX_ROWS  # 12, or 8 on AMD EPYC with AVX-512 (cpu.py)
    for rows, on_kernel in ((1, True), (split_k, True), (split_k + 1, False), (48, False)):
        a, r = jnp.ones((rows, 48), F32), jnp.ones((rows, 40), F32)
        text = jax.jit(lambda a, r: attn_out_mlp(a, r, wo, g, wg, wu, wd, 1e-5)).lower(a, r).as_text()
        assert ("nightjar_attn_out_mlp_f32" in text) == on_kernel
        text = jax.jit(lambda a, r: attn_out_mlp(a, r, wo, g, wg, wu, wd, 1e-5, next_gain=gn, next_ws=nws,
                                                 next_eps=1e-5)).lower(a, r).as_text()
        assert ("nightjar_attn_out_mlp_qkv_f32" in text) == on_kernel
    # impl="cpu" past the split-K rows (a prefill chunk): the composition, its products on the packed kernel path
    rows = cpu.SPLIT_K_MAX_ROWS + 1
    a, r = jnp.ones((rows, 48), F32), jnp.ones((rows, 40), F32)
    text = jax.jit(lambda a, r: attn_out_mlp(a, r, wo, g, wg, wu, wd, 1e-5, impl="cpu")).lower(a, r).as_text()
    assert "nightjar_attn_out_mlp" not in text and "nightjar_linear_residual_f32" in text
    a, r = jnp.ones((2, 48), F32), jnp.ones((2, 40), F32)
    with pytest.raises(ValueError, match="residual r must be"):
        cpu.attn_out_mlp_cpu(a, jnp.ones((2, 41), F32), wo, g, wg, wu, wd, 1e-5)
    with pytest.raises(ValueError, match="must be \\[H, I\\]"):
        cpu.attn_out_mlp_cpu(a, r, wo, g, wg, wu, jnp.ones((71, 40), F32), 1e-5)
    with pytest.raises(ValueError, match="gain must be float32"):
        cpu.attn_out_mlp_cpu(a, r, wo, g, wg, wu, wd, 1e-5, next_gain=jnp.ones((7,), F32), next_ws=nws,
                             next_eps=1e-5)
    with pytest.raises(ValueError, match="next_gain, 3 next_ws"):
        attn_out_mlp(a, r, wo, g, wg, wu, wd, 1e-5, next_gain=gn, next_ws=nws[:2], next_eps=1e-5)


def test_back_to_back_layer_calls_stay_exact():
    """Layer calls chained as in a decode step (phases and spin barriers shared with the pool's helpers,
    ``cpu_parallel.h``'s ParallelPhases): bit-identical on every repetition."""
    rng = np.random.default_rng(9)
    wo, g, wg, wu, wd, gn, nws = _layer_weights(rng, a_dim=40, widths=(40, 16, 16))

    @jax.jit
    def chain(x):
        q, k, v = cpu.rms_linear_many_cpu(x, gn, nws, 1e-5)
        for _ in range(8):
            x, (q, k, v) = cpu.attn_out_mlp_cpu(q + jnp.tile(k + v, 3)[:, :40] / 4, x, wo, g, wg, wu, wd, 1e-5,
                                                next_gain=gn, next_ws=nws, next_eps=1e-5)
        return x, q

    x = rng.standard_normal((1, 40)).astype(np.float32)
    first = [np.asarray(t) for t in chain(x)]
    assert np.isfinite(first[0]).all()
    for _ in range(25):
        for t, f in zip(chain(x), first, strict=True):
            np.testing.assert_array_equal(np.asarray(t), f)


def test_xla_products_of_float32_ask_for_full_precision_off_the_cpu(monkeypatch):
    """On a GPU, XLA's default precision gives float32 products TF32 inputs; the model's linear layers ask for
    HIGHEST there (float32 means float32, as in PyTorch), bfloat16 keeps the default, and on the CPU backend (full
    float32 either way) the product is left as it was."""
    x = jnp.ones((3, 16), jnp.float32)
    w = jnp.ones((16, 8), jnp.float32)

    def text(a, b) -> str:
        return str(jax.make_jaxpr(lambda a, b: linear(a, b, impl="xla"))(a, b))

    assert "Precision.HIGHEST" not in text(x, w)  # CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "precision=(Precision.HIGHEST, Precision.HIGHEST)" in text(x, w)
    assert "Precision.HIGHEST" not in text(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
