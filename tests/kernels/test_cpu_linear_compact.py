"""Compact weights for the CPU linear kernels (``kernels_pallas/linear/cpu.py``): 4-bit block panels, bfloat16
panels, 8-bit head rows.

``pack_q4``: a weight whose every 32-row block of a column is exactly ``d * q + m`` (q in 0 .. 15, d and m 16-bit
floats: a GGUF Q4_1 weight dequantized, as SmolLM2-135M's 210 matrices are) is held as
``uint8 [N / 16, K / 32, 384]``, and every product from it equals the float32 panels' product to the bit.

Checked: finding d and m from the float32 weight alone (and refusing anything not reproduced bit for bit: random
weights, one element off by an ulp, K not a multiple of 32), the exact round trip, bit equality with the float32
panels for one row (dequantized in registers), register tiles and row groups over dequantized blocks, every fused
form, XLA's fallback (an exact float32 copy), and ``pack_state``: a model quantized as Q4_1 gets 4-bit panels and the
same logits to the bit as float32 panels (``weight_format`` compact, and auto with the float32 panels beside the
compact bytes for more than 8 rows), f32 keeps float32, a model that is not Q4_1 keeps float32.

``pack_bf16``: a weight whose every element is a bfloat16 value (a bfloat16 checkpoint upcast: the shipped drafts) as
bfloat16 panels, the same checks (K any size).

The tied head's table quantized as GGUF Q8_0 (``pack_q8``: ``d * q`` per 32-element block of a row, q in -127 ..
127) likewise: found or refused, the head's products (one row, the 12-row tiles) equal the float32 table's to the bit,
and :func:`nightjar_jax.linear.embed` gathers its rows exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.bench.common import state_bytes
from nightjar_jax.linear import _on_kernel, attn_out_mlp, embed, linear, pack_state
from tests.kernels.test_cpu_linear_packed import model_logits

F32 = jnp.float32

needs_packing = pytest.mark.skipif(
    not cpu.packing_supported(),
    reason=f"packed weights need the CPU linear kernel built with AVX-512 or AVX2 + FMA (available: {cpu.available()})",
)


def q4_1(w: np.ndarray) -> np.ndarray:
    """``w [K, N]`` quantized as llama.cpp's Q4_1 does it (per 32-row block of a column: m = min, d = (max - min) /
    15, both stored as 16-bit floats, q = round((w - m) / d) in 0 .. 15), returned dequantized in float32."""
    k, n = w.shape
    b = w.reshape(k // 32, 32, n).astype(np.float32)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint((b - m[:, None]) / d[:, None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).astype(np.float32)  # whole numbers (no -0.0), as stored
    return (d[:, None] * q + m[:, None]).astype(np.float32).reshape(k, n)


def q8_0(w: np.ndarray) -> np.ndarray:
    """``w [N, K]`` quantized as llama.cpp's Q8_0 (per 32-element block of a row: d = max |w| / 127 as a 16-bit
    float, q = round(w / d) in -127 .. 127), returned dequantized in float32."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32).astype(np.float32)
    d = (np.abs(b).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(b / d[..., None]), 0)
    q = np.clip(q, -127, 127).astype(np.int8).astype(np.float32)  # whole numbers (no -0.0), as stored
    return (d[..., None] * q).astype(np.float32).reshape(n, k)


def _q4_weight(rng, k, n, scale=0.1):
    return q4_1((scale * rng.standard_normal((k, n))).astype(np.float32))


def _bf16_weight(rng, k, n, scale=0.1):
    """A float32 weight whose every element is a bfloat16 value (a bfloat16 checkpoint upcast)."""
    return np.asarray(jnp.asarray((scale * rng.standard_normal((k, n))).astype(np.float32), jnp.bfloat16), np.float32)


def _dual(pack):
    """pack, then the float32 panels beside the compact bytes (weight_format="auto")."""
    return lambda w: cpu.with_f32(pack(w), cpu.pack(w))


# compact panel layouts: how to make a weight it holds exactly, and how to pack it
FORMATS = {"q4": (_q4_weight, cpu.pack_q4), "bf16": (_bf16_weight, cpu.pack_bf16),
           "q4+f32": (_q4_weight, _dual(cpu.pack_q4)), "bf16+f32": (_bf16_weight, _dual(cpu.pack_bf16))}


def test_pack_bf16_takes_bfloat16_values_only():
    rng = np.random.default_rng(4)
    w = _bf16_weight(rng, 37, 48)
    wb = cpu.pack_bf16(jnp.asarray(w))
    assert wb is not None and wb.dtype == jnp.bfloat16 and wb.shape == (3, 37, 16)
    assert cpu.is_packed(wb) and cpu.is_compact(wb) and not cpu.is_compact(cpu.pack(jnp.asarray(w)))
    np.testing.assert_array_equal(np.asarray(cpu.unpack(wb)), w)
    w2 = w.copy()
    w2[3, 4] = np.nextafter(w2[3, 4], np.float32(10))  # one element with low bits: not a bfloat16 value
    assert cpu.pack_bf16(jnp.asarray(w2)) is None
    assert cpu.pack_bf16(jnp.asarray(w[:, :40])) is None


def test_pack_q4_finds_the_blocks_exactly_or_refuses():
    rng = np.random.default_rng(0)
    w = _q4_weight(rng, 64, 48)
    wq = cpu.pack_q4(jnp.asarray(w))
    assert wq is not None and wq.dtype == jnp.uint8 and wq.shape == (3, 2, cpu.Q4_BLOCK_BYTES)
    assert cpu.is_q4(wq) and cpu.is_packed(wq) and not cpu.is_q4(cpu.pack(jnp.asarray(w)))
    assert (cpu.in_features(wq), cpu.out_features(wq)) == (64, 48)
    # exact: the dequantized panels are the float32 panels bit for bit, and unpack gives w back
    np.testing.assert_array_equal(np.asarray(cpu.q4_dequantize(wq)), np.asarray(cpu.pack(jnp.asarray(w))))
    np.testing.assert_array_equal(np.asarray(cpu.unpack(wq)), w)
    # a block of equal values (d = 0) round-trips too
    w2 = w.copy()
    w2[:32, 5] = w2[0, 5]
    np.testing.assert_array_equal(np.asarray(cpu.unpack(cpu.pack_q4(jnp.asarray(w2)))), w2)
    # refused: a weight that is not Q4_1, one element off by an ulp, shapes the layout cannot hold
    assert cpu.pack_q4(jnp.asarray(rng.standard_normal((64, 48)).astype(np.float32))) is None
    w3 = w.copy()
    w3[40, 7] = np.nextafter(w3[40, 7], np.float32(10))
    assert cpu.pack_q4(jnp.asarray(w3)) is None
    assert cpu.pack_q4(jnp.asarray(_q4_weight(rng, 64, 48)[:48])) is None  # K = 48: not whole blocks
    assert cpu.pack_q4(jnp.asarray(w[:, :40])) is None  # N = 40: not whole panels
    assert cpu.pack_q4(jnp.asarray(w, jnp.bfloat16)) is None


_SHAPES = [
    (1, 64, 48), (1, 32, 16), (1, 320, 80), (1, 64, 128),  # one row: 4 panels at once and the 1-3 left
    (2, 64, 48), (5, 96, 32), (8, 320, 80),               # one register tile over 96-row dequantized blocks
    (9, 64, 48), (17, 320, 48), (33, 608, 112),           # row groups; 288-row blocks past 16 rows; a short block
]


@needs_packing
@pytest.mark.parametrize("fmt,m,k,n", [(f, *s) for f in FORMATS for s in _SHAPES]
                         + [(f, *s) for f in ("bf16", "bf16+f32") for s in ((1, 37, 48), (5, 37, 16), (20, 101, 32))])
def test_compact_products_equal_float32_panels(fmt, m, k, n):
    make, pack = FORMATS[fmt]
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w = make(rng, k, n)
    y32 = np.asarray(jax.jit(cpu.linear_cpu)(x, cpu.pack(jnp.asarray(w))))
    packed = pack(jnp.asarray(w))
    assert cpu.in_features(packed) == k and cpu.out_features(packed) == n
    np.testing.assert_array_equal(np.asarray(cpu.unpack(packed)), w)  # XLA's copy: exact
    y4 = np.asarray(jax.jit(cpu.linear_cpu)(x, packed))
    np.testing.assert_array_equal(y4, y32)
    np.testing.assert_allclose(y4, np.asarray(x, np.float64) @ w, rtol=1e-4, atol=1e-4)


@needs_packing
@pytest.mark.parametrize("fmt", ["f32", "q8 head", "q8+f32 head", *FORMATS])
def test_a_rows_result_does_not_depend_on_the_row_count(fmt):
    """One x row gets the bits it gets in a call of 2 .. 13 rows, for every weight layout `auto` uses: a speculative
    verify step's rows then equal one-row decoding to the bit, as the lossless invariant needs (until 2026-12-04 one
    row summed even and odd k apart, and the head four sums per weight row: ~1e-5 apart, enough to change a greedy
    token where the two best logits tie that closely)."""
    rng = np.random.default_rng(21)
    k, n = 320, 80  # 10 blocks of 32; 5 panels: the one-row pass's groups and one left
    x = rng.standard_normal((13, k)).astype(np.float32)
    if fmt == "f32":
        w, transposed = cpu.pack(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))), False
    elif fmt.startswith("q8"):
        table = q8_0(rng.standard_normal((n, k)).astype(np.float32))
        w, transposed = cpu.pack_q8(jnp.asarray(table)), True
        if fmt == "q8+f32 head":
            w = cpu.with_f32(w, jnp.asarray(table))
    else:
        make, pack = FORMATS[fmt]
        w, transposed = pack(jnp.asarray(make(rng, k, n))), False
    run = jax.jit(lambda x: cpu.linear_cpu(x, w, transposed=transposed))
    one = np.stack([np.asarray(run(jnp.asarray(x[i:i + 1])))[0] for i in range(len(x))])
    # 1-8 rows: the one-row passes and the few-row tiles, on every CPU. Past 8, AVX2 CPUs keep the order (measured
    # to 200 rows); AVX-512 ones take the head's 8-lane or transposed tiles there, not checked on such a CPU yet.
    counts = (2, 3, 5, 8) if cpu._has_avx512() else (2, 3, 5, 8, 9, 13)
    for m in counts:
        np.testing.assert_array_equal(np.asarray(run(jnp.asarray(x[:m]))), one[:m], err_msg=f"{m} rows")


@needs_packing
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 13])
def test_compact_fused_forms_equal_float32_panels(fmt, m):
    make, pack = FORMATS[fmt]
    rng = np.random.default_rng(7 + m)
    eps = 1e-5
    x = jnp.asarray(rng.standard_normal((m, 64)).astype(np.float32))
    g = jnp.asarray((1 + 0.1 * rng.standard_normal(64)).astype(np.float32))
    ws = [make(rng, 64, n) for n in (64, 32, 32)]
    p32 = [cpu.pack(jnp.asarray(w)) for w in ws]
    p4 = [pack(jnp.asarray(w)) for w in ws]
    for a, b in zip(cpu.linear_many_cpu(x, p4), cpu.linear_many_cpu(x, p32), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(cpu.rms_linear_many_cpu(x, g, p4, eps), cpu.rms_linear_many_cpu(x, g, p32, eps), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wg, wu = make(rng, 64, 96), make(rng, 64, 96)
    h4 = cpu.rms_swiglu_cpu(x, g, pack(jnp.asarray(wg)), pack(jnp.asarray(wu)), eps)
    h32 = cpu.rms_swiglu_cpu(x, g, cpu.pack(jnp.asarray(wg)), cpu.pack(jnp.asarray(wu)), eps)
    np.testing.assert_array_equal(np.asarray(h4), np.asarray(h32))
    r = jnp.asarray(rng.standard_normal((m, 32)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(cpu.linear_residual_cpu(x, p4[1], r)),
                                  np.asarray(cpu.linear_residual_cpu(x, p32[1], r)))
    # XLA's dot (impl="xla") takes an exact float32 copy
    np.testing.assert_allclose(np.asarray(linear(x, p4[0], impl="xla")), np.asarray(x, np.float64) @ ws[0],
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_cpu(jnp.ones((2, 63), F32), p4[0])


@needs_packing
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 2, 8])
def test_compact_attn_out_mlp_equals_float32_panels(fmt, m):
    make, pack_compact = FORMATS[fmt]
    rng = np.random.default_rng(20 + m)
    eps = 1e-5
    wo, wg, wu, wd = (make(rng, k, n) for k, n in ((64, 32), (32, 96), (32, 96), (96, 32)))
    g = jnp.asarray((1 + 0.1 * rng.standard_normal(32)).astype(np.float32))
    gn = jnp.asarray((1 + 0.1 * rng.standard_normal(32)).astype(np.float32))
    nws = [make(rng, 32, n) for n in (48, 16, 16)]
    a = jnp.asarray(rng.standard_normal((m, 64)).astype(np.float32))
    r = jnp.asarray((2 * rng.standard_normal((m, 32))).astype(np.float32))
    outs = []
    for pack in (cpu.pack, pack_compact):
        pk = [pack(jnp.asarray(w)) for w in (wo, wg, wu, wd)]
        pn = [pack(jnp.asarray(w)) for w in nws]
        y = cpu.attn_out_mlp_cpu(a, r, pk[0], g, *pk[1:], eps)
        y2, qkv = jax.jit(lambda a, r, pk=pk, pn=pn: attn_out_mlp(a, r, pk[0], g, *pk[1:], eps, next_gain=gn,
                                                                  next_ws=pn, next_eps=1e-6))(a, r)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
        outs.append([np.asarray(y), *(np.asarray(t) for t in qkv)])
    for a4, a32 in zip(outs[1], outs[0], strict=True):
        np.testing.assert_array_equal(a4, a32)


def test_fit_blocks_tries_the_neighbouring_scales():
    # blocks whose d is one or two 16-bit steps from span / 15 (the first guess): found on the later candidates
    rng = np.random.default_rng(3)
    d = rng.uniform(0.01, 0.02, (4, 8)).astype(np.float16)
    m = (-rng.uniform(0, 1, (4, 8))).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (4, 32, 8)).astype(np.float32)
    blocks = (d.astype(np.float32)[:, None] * q + m[:, None]).astype(np.float32)
    off = np.array([0, 1, -1, 2, -2, 0, 1, 0])  # per column: how far the guess is from d, in 16-bit steps
    guess = (d.view(np.uint16) + off).astype(np.uint16).view(np.float16).astype(np.float64)
    found = cpu._fit_blocks(blocks, 1, m, 15 * guess, 0, 15)
    assert found is not None
    np.testing.assert_array_equal(found[0], d.astype(np.float32))
    np.testing.assert_array_equal(found[0][:, None] * found[1] + m[:, None], blocks)
    off[3] = 3  # three steps away: not among the candidates
    guess = (d.view(np.uint16) + off).astype(np.uint16).view(np.float16).astype(np.float64)
    assert cpu._fit_blocks(blocks, 1, m, 15 * guess, 0, 15) is None


def test_pack_q8_finds_the_blocks_exactly_or_refuses():
    rng = np.random.default_rng(1)
    w = q8_0(rng.standard_normal((50, 64)).astype(np.float32))
    w[3, :32] = 0  # a block of zeros (d = 0)
    wq = cpu.pack_q8(jnp.asarray(w))
    assert wq is not None and wq.shape == (50, 2, cpu.Q8_BLOCK_BYTES) and cpu.is_q8(wq) and not cpu.is_packed(wq)
    assert (cpu.in_features(wq, transposed=True), cpu.out_features(wq, transposed=True)) == (64, 50)
    np.testing.assert_array_equal(np.asarray(cpu.q8_dequantize(wq)), w)
    tokens = jnp.asarray([[0, 3, 49], [7, 7, 1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(embed(wq, tokens)), w[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(embed(cpu.with_f32(wq, jnp.asarray(w)), tokens)), w[np.asarray(tokens)])
    np.testing.assert_array_equal(np.asarray(embed(jnp.asarray(w), tokens)), w[np.asarray(tokens)])
    assert cpu.pack_q8(jnp.asarray(rng.standard_normal((50, 64)).astype(np.float32))) is None
    w2 = w.copy()
    w2[10, 40] = np.nextafter(w2[10, 40], np.float32(10))
    assert cpu.pack_q8(jnp.asarray(w2)) is None
    assert cpu.pack_q8(jnp.asarray(w[:, :48])) is None  # K = 48: not whole blocks


@needs_packing
@pytest.mark.parametrize("m,n", [(1, 100), (1, 33), (2, 100), (3, 61), (8, 31), (9, 100), (12, 200), (33, 130),
                                 (40, 48)])
def test_q8_head_equals_float32_head(m, n):
    rng = np.random.default_rng(m * 100 + n)
    x = jnp.asarray(rng.standard_normal((m, 96)).astype(np.float32))
    w = q8_0(rng.standard_normal((n, 96)).astype(np.float32))
    wq = cpu.pack_q8(jnp.asarray(w))
    wd = cpu.with_f32(wq, jnp.asarray(w))  # the float32 table beside the 8-bit rows: read past 8 rows
    assert wd.shape == (n, 3, cpu.Q8_DUAL_BLOCK_BYTES) and cpu.is_q8(wd)
    np.testing.assert_array_equal(np.asarray(cpu.q8_table(wd)), w)
    y8 = np.asarray(jax.jit(lambda x: cpu.linear_cpu(x, wq, transposed=True))(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: cpu.linear_cpu(x, wd, transposed=True))(x)), y8)
    y32 = np.asarray(jax.jit(lambda x: cpu.linear_cpu(x, jnp.asarray(w), transposed=True))(x))
    np.testing.assert_array_equal(y8, y32)
    np.testing.assert_allclose(y8, np.asarray(x, np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    # dispatch: the kernel at every row count (past its float32 row range too: XLA's dot would need a float32 copy of
    # the table), XLA's dot on an exact float32 copy with impl="xla"
    assert _on_kernel(jnp.ones((400, 96), F32), wq, "auto", transposed=True)
    np.testing.assert_allclose(np.asarray(linear(x, wq, transposed=True, impl="xla")), y32, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(linear(x, wq, transposed=True)), y32)
    with pytest.raises(ValueError, match="do not match"):
        cpu.linear_cpu(jnp.ones((2, 64), F32), wq, transposed=True)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mha"])  # tied head, untied head (its kernel packed too)
@pytest.mark.parametrize("fmt", ["q4", "bf16"])
def test_pack_state_holds_a_compact_model_with_the_same_logits(preset, fmt):
    from nightjar_jax.models.llama import init_model
    from nightjar_jax.models.presets import get_preset

    cfg = get_preset(preset).config
    graphdef, state = init_model(cfg, seed=3, linear_impl="auto")
    if not cpu.packing_supported():  # nothing to pack for here
        assert pack_state(state, "auto") is state
        return

    # q4: every linear weight quantized as Q4_1 and the embedding as Q8_0 (a GGUF checkpoint dequantized);
    # bf16: every weight a bfloat16 value (a bfloat16 checkpoint upcast)
    def quantize(path, w):
        key = jax.tree_util.keystr(path)
        if fmt == "bf16":
            return jnp.asarray(w, jnp.bfloat16).astype(jnp.float32)
        if "kernel" in key:
            return jnp.asarray(q4_1(np.asarray(w)))
        return jnp.asarray(q8_0(np.asarray(w))) if "embedding" in key else w

    quantized = jax.tree_util.tree_map_with_path(quantize, state)
    states = {f: pack_state(quantized, "auto", weight_format=f) for f in ("compact", "auto", "f32")}
    compact, dual, p32 = (jax.tree.leaves(states[f]) for f in ("compact", "auto", "f32"))
    if fmt == "q4":
        assert any(cpu.is_q4(leaf) for leaf in compact) and any(cpu.is_q8(leaf) for leaf in compact)
        assert any(leaf.shape[-1] == cpu.Q4_DUAL_BLOCK_BYTES for leaf in dual)
        # the table: float32 beside it for a tied head (tiny-gqa); only gathered with an untied one (tiny-mha)
        assert any(leaf.shape[-1] == cpu.Q8_DUAL_BLOCK_BYTES for leaf in dual) == cfg.tie_word_embeddings
        assert any(leaf.shape[-1] == cpu.Q8_BLOCK_BYTES for leaf in dual) != cfg.tie_word_embeddings
        # the bytes as held (what a one-row step reads) and as float32 (what the compact blocks stand for)
        assert state_bytes(states["compact"], as_float32=True) == state_bytes(states["f32"]) > 3 * state_bytes(
            states["compact"])
        assert state_bytes(states["auto"], one_row=True) == state_bytes(states["compact"])
        assert state_bytes(states["auto"]) < 1.3 * state_bytes(states["f32"])
    else:
        assert any(leaf.dtype == jnp.bfloat16 and cpu.is_packed(leaf) for leaf in compact)
        assert any(leaf.dtype == jnp.bfloat16 and leaf.shape[-1] == cpu.BF16_DUAL_WIDTH for leaf in dual)
        assert not any(cpu.is_q4(leaf) for leaf in compact)
    assert not any(cpu.is_compact(leaf) for leaf in p32)
    assert not any(cpu.is_compact(leaf) for leaf in jax.tree.leaves(pack_state(state, "auto")))  # neither
    with pytest.raises(ValueError, match="weight_format"):
        pack_state(state, "auto", weight_format="q4")
    table = jnp.zeros((cfg.vocab_size, cfg.hidden_size), F32)  # the f32 state's tied head: [N, K] float32
    for q_len in (1, 5, 24):  # one row, a register tile (compact bytes), row groups (float32 beside them in auto)
        ref = model_logits(cfg, graphdef, states["f32"], q_len)
        # the float32 table past the kernel's row range for it (12 rows without AVX-512) takes XLA's dot, while
        # 8-bit rows stay on the kernel (XLA would need a float32 copy of them): the same products, summed in
        # another order there
        same = fmt != "q4" or not cfg.tie_word_embeddings or cpu.use_kernel((2 * q_len, cfg.hidden_size), table,
                                                                            transposed=True)
        for f in ("compact", "auto"):
            got = model_logits(cfg, graphdef, states[f], q_len)
            if same:
                np.testing.assert_array_equal(got, ref)
            else:
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@needs_packing
def test_feature_draft_on_bfloat16_panels_equals_float32():
    """A feature draft (the shipped smollm2-eagle's form: fc over [the target's embedding, feature], an untied subset
    head) with bfloat16-valued weights: the same hidden states and logits to the bit from bfloat16 panels as from
    float32 ones. Its fc input stays float32 (it once took the compact kernel's storage dtype, bfloat16: rounded
    inputs, and XLA's dot on an unpacked copy of the weight every pass)."""
    from nightjar_jax.config import ModelConfig
    from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, init_model, make_model_fns

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, head_vocab_size=16,
                      feature_size=32, name="tiny-feature")
    graphdef, state = init_model(cfg, seed=5, linear_impl="auto")
    quantized = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16).astype(w.dtype) if w.dtype == F32 else w, state)
    states = {f: pack_state(quantized, "auto", weight_format=f) for f in ("compact", "auto", "f32")}
    assert any(leaf.dtype == jnp.bfloat16 and cpu.is_packed(leaf) for leaf in jax.tree.leaves(states["compact"]))
    hidden_fn, logits_fn = make_model_fns(graphdef)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((cfg.vocab_size, 32)), F32)  # the target's embedding
    for q_len in (1, 5):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, q_len)), jnp.int32)
        feats = jnp.asarray(rng.standard_normal((2, q_len, 32)), F32)
        md = BatchMetadata(block_tables=jnp.asarray([[1, 2], [3, 4]], jnp.int32),
                           context_lens=jnp.asarray([q_len, q_len], jnp.int32))

        def run(s, tokens=tokens, feats=feats, md=md):
            kv = allocate_kv_cache(cfg, num_pages=8, page_size=4)
            hidden, _ = jax.jit(hidden_fn)(s, tokens, kv, md, features=feats, embed_table=table)
            return np.asarray(hidden), np.asarray(jax.jit(logits_fn)(s, hidden))

        ref = run(states["f32"])
        for f in ("compact", "auto"):
            for got, want in zip(run(states[f]), ref, strict=True):
                np.testing.assert_array_equal(got, want)
