"""Packed weights for the CPU linear kernels: ``[K, N]`` stored as 16-column panels ``[N / 16, K, 16]``
(``kernels_pallas/linear/cpu.py`` ``pack``; ``nightjar_jax.linear.pack_state`` packs a model's linear weights at
engine load where the kernel runs them).

Checked against a float64 numpy product: the one-row panel pairs, the register tiles of up to 8 rows, several row
groups with weight-row blocks and prefetch (past 8 rows; K past the 96- and 288-row blocks), panel counts that do not
fill a 3-panel group, leading dimensions, every fused form with packed weights (q/k/v and gate/up in one call, the
norms, the SwiGLU gate, the residual add, the whole post-attention layer with the next layer's q/k/v), clear errors
for mixed or mis-shaped layouts, the dispatch (packed weights stay on the kernel at every row count), and a model
whose packed state gives the unpacked state's logits. Runs where the kernel takes packed weights (built with
AVX-512, or AVX2 and FMA); elsewhere ``pack_state`` leaves the weights as they are, which the last test checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.linear import attn_out_mlp, linear, pack_state

F32 = jnp.float32

needs_packing = pytest.mark.skipif(
    not cpu.packing_supported(),
    reason=f"packed weights need the CPU linear kernel built with AVX-512 or AVX2 + FMA (available: {cpu.available()})",
)


def _w(rng, k, n, scale=0.1):
    return (scale * rng.standard_normal((k, n))).astype(np.float32)


def _rms(x, g, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _silu(x):
    return x / (1.0 + np.exp(-x))


def test_pack_round_trip_and_bad_inputs():
    rng = np.random.default_rng(0)
    w = _w(rng, 7, 48)
    p = cpu.pack(jnp.asarray(w))
    assert p.shape == (3, 7, 16) and cpu.is_packed(p)
    np.testing.assert_array_equal(np.asarray(p)[1, 4], w[4, 16:32])  # panel 1, weight row 4
    np.testing.assert_array_equal(np.asarray(cpu.unpack(p)), w)
    assert (cpu.in_features(p), cpu.out_features(p)) == (7, 48)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.pack(jnp.zeros((7, 40), F32))
    with pytest.raises(ValueError, match="float32"):
        cpu.pack(jnp.zeros((7, 32), jnp.bfloat16))


@needs_packing
@pytest.mark.parametrize("m,k,n", [
    (1, 64, 48), (1, 37, 16), (1, 300, 80),      # one row: 4 panels at once and the 1-3 left, K odd
    (1, 64, 32), (1, 40, 128),                   # 2 panels; two 4-panel items
    (2, 64, 48), (5, 37, 32), (8, 300, 80),      # one register tile of up to 8 rows
    (9, 64, 48), (16, 130, 80), (17, 300, 48),   # row groups, 96- and 288-row blocks, the next block prefetched
    (33, 600, 112),                              # 5 row groups, 3 blocks, 7 panels (a group of 1 at the end)
])
def test_packed_products_match_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = _w(rng, k, n)
    y = np.asarray(jax.jit(cpu.linear_cpu)(jnp.asarray(x), cpu.pack(jnp.asarray(w))))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@needs_packing
def test_packed_leading_dimensions_empty_k_and_dispatch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = _w(rng, 64, 32)
    p = cpu.pack(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), p)), x @ w, rtol=1e-4, atol=1e-4)
    # K = 0: zeros
    y0 = cpu.linear_cpu(jnp.zeros((3, 0), F32), jnp.zeros((2, 0, 16), F32))
    np.testing.assert_array_equal(np.asarray(y0), np.zeros((3, 32), np.float32))
    # packed weights stay on the kernel at every row count (XLA would need an unpacked copy); impl="xla" unpacks
    for rows in (1, 12, 200, 600):
        xr = jnp.ones((rows, 64), F32)
        text = jax.jit(lambda a: linear(a, p)).lower(xr).as_text()
        assert "nightjar_linear_f32" in text
        y = linear(xr, p, impl="xla")
        np.testing.assert_allclose(np.asarray(y), np.ones((rows, 64)) @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_cpu(jnp.ones((2, 63), F32), p)


@needs_packing
@pytest.mark.parametrize("m", [1, 3, 13])
def test_packed_fused_forms_match_numpy(m):
    rng = np.random.default_rng(7 + m)
    eps = 1e-5
    x = rng.standard_normal((m, 64)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    ws = [_w(rng, 64, n) for n in (64, 32, 32)]
    packed = [cpu.pack(jnp.asarray(w)) for w in ws]
    xn = _rms(x, g, eps)
    for t, w in zip(cpu.linear_many_cpu(jnp.asarray(x), packed), ws, strict=True):
        np.testing.assert_allclose(np.asarray(t), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    for t, w in zip(cpu.rms_linear_many_cpu(jnp.asarray(x), jnp.asarray(g), packed, eps), ws, strict=True):
        np.testing.assert_allclose(np.asarray(t), xn @ w, rtol=1e-4, atol=1e-4)
    wg, wu = _w(rng, 64, 96), _w(rng, 64, 96)
    h = cpu.rms_swiglu_cpu(jnp.asarray(x), jnp.asarray(g), cpu.pack(jnp.asarray(wg)), cpu.pack(jnp.asarray(wu)), eps)
    np.testing.assert_allclose(np.asarray(h), _silu(xn @ wg) * (xn @ wu), rtol=1e-4, atol=1e-4)
    r = rng.standard_normal((m, 32)).astype(np.float32)
    y = cpu.linear_residual_cpu(jnp.asarray(x), packed[1], jnp.asarray(r))
    np.testing.assert_allclose(np.asarray(y), r + x.astype(np.float64) @ ws[1], rtol=1e-4, atol=1e-4)


def _layer(rng):
    # a [M, 48] attention output, residual width H = 32, MLP width I = 80, next q/k/v widths 48 / 16 / 16
    wo, wg, wu, wd = _w(rng, 48, 32), _w(rng, 32, 80), _w(rng, 32, 80), _w(rng, 80, 32)
    g = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    gn = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    nws = [_w(rng, 32, n) for n in (48, 16, 16)]
    return wo, g, wg, wu, wd, gn, nws


@needs_packing
@pytest.mark.parametrize("m", [1, 2, 8])
def test_packed_attn_out_mlp_matches_numpy(m):
    rng = np.random.default_rng(20 + m)
    eps = 1e-5
    wo, g, wg, wu, wd, gn, nws = _layer(rng)
    a = rng.standard_normal((m, 48)).astype(np.float32)
    r = (2 * rng.standard_normal((m, 32))).astype(np.float32)
    r1 = r + a.astype(np.float64) @ wo
    xn = _rms(r1, g, eps)
    ref = r1 + (_silu(xn @ wg) * (xn @ wu)) @ wd
    pk = [cpu.pack(jnp.asarray(w)) for w in (wo, wg, wu, wd)]
    pn = [cpu.pack(jnp.asarray(w)) for w in nws]
    y = cpu.attn_out_mlp_cpu(jnp.asarray(a), jnp.asarray(r), pk[0], jnp.asarray(g), *pk[1:], eps)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)
    y2, qkv = jax.jit(lambda a, r: attn_out_mlp(a, r, pk[0], jnp.asarray(g), *pk[1:], eps, next_gain=jnp.asarray(gn),
                                                next_ws=pn, next_eps=1e-6))(jnp.asarray(a), jnp.asarray(r))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    xn2 = _rms(ref, gn, 1e-6)
    for t, w in zip(qkv, nws, strict=True):
        np.testing.assert_allclose(np.asarray(t), xn2 @ w, rtol=1e-4, atol=1e-3)
    # layouts must not mix within a layer call
    with pytest.raises(ValueError, match="all packed"):
        cpu.attn_out_mlp_cpu(jnp.asarray(a), jnp.asarray(r), pk[0], jnp.asarray(g), jnp.asarray(wg), *pk[2:], eps)
    with pytest.raises(ValueError, match="packed"):
        cpu.attn_out_mlp_cpu(jnp.asarray(a), jnp.asarray(r), pk[0], jnp.asarray(g), *pk[1:], eps,
                             next_gain=jnp.asarray(gn), next_ws=[jnp.asarray(w) for w in nws], next_eps=1e-6)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mha"])  # tied head, untied head (its kernel packed too)
def test_pack_state_gives_the_same_logits(preset):
    from nightjar_jax.models.llama import init_model
    from nightjar_jax.models.presets import get_preset

    cfg = get_preset(preset).config
    graphdef, state = init_model(cfg, seed=3, linear_impl="auto")
    assert pack_state(state, "xla") is state
    packed = pack_state(state, "auto")
    shapes = [leaf.shape for leaf in jax.tree.leaves(packed)]
    if not cpu.packing_supported():  # nothing to pack for here: the state is returned as it is
        assert packed is state
        return
    assert any(len(s) == 3 and s[-1] == 16 for s in shapes)
    for q_len in (1, 5, 24):  # one row, a register tile, row groups
        np.testing.assert_allclose(model_logits(cfg, graphdef, packed, q_len),
                                   model_logits(cfg, graphdef, state, q_len), rtol=2e-4, atol=2e-4)


def model_logits(cfg, graphdef, state, q_len: int) -> np.ndarray:
    """Logits of a prefill of two sequences of ``q_len`` tokens each (q_len rows per sequence on the kernel)."""
    from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_model_fns

    hidden_fn, logits_fn = make_model_fns(graphdef)
    kv = allocate_kv_cache(cfg, num_pages=32, page_size=4)
    tokens = jnp.asarray(np.arange(2 * q_len, dtype=np.int32).reshape(2, q_len) * 37 % cfg.vocab_size)
    md = BatchMetadata(block_tables=jnp.asarray([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], jnp.int32),
                       context_lens=jnp.asarray([q_len, q_len], jnp.int32))
    hidden, _ = jax.jit(hidden_fn)(state, tokens, kv, md)
    return np.asarray(jax.jit(logits_fn)(state, hidden))
