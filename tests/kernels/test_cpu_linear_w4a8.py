"""4-bit weights with int8 activations (``weight_format="w4a8"``; ``kernels_pallas/linear/cpu.py`` ``pack_w4a8``).

The same Q4_1 blocks as the lossless 4-bit panels, laid out for AVX512-VNNI dot products (on CPUs without AVX-512,
AVX2's vpmaddubsw + vpmaddwd give the same integer sums); each product quantizes its x per row and 32-element block
to int8. Lossy in x, so these tests check what the kernel must still guarantee:
- the layout holds the exact weights (round trip) and refuses weights that are not Q4_1;
- every product equals the numpy model of the scheme (x quantized as the kernel does, exact integer sums) to
  float32 rounding, and differs from the exact product by no more than x's rounding allows;
- a row's result never depends on the other rows of the call (1 row, register tiles, row groups: the same bits),
  nor on the fused form that computed it, which is what keeps verify steps and batches equal to one-row decoding;
- a tied Q8_0 head gets panels of its rows for int8 x too (``with_w8a8_head``), with the same guarantees (without
  AVX-512 the kernel reads its rows: vpsignb + vpmaddubsw, the same integer sums);
- ``pack_state`` holds a Q4_1 model this way (and anything else as ``auto``), and in the engine greedy speculative
  decoding equals plain decoding and a batch equals each prompt run alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.linear import _on_kernel, attn_out_mlp, linear, pack_state
from tests.kernels.test_cpu_linear_compact import _q4_weight, q4_1, q8_0

F32 = jnp.float32

pytestmark = pytest.mark.skipif(
    not cpu.w4a8_supported(),
    reason=f"int8-activation weights need the CPU kernel with AVX512-VNNI, or AVX2 and F16C without AVX-512 "
           f"(available: {cpu.available()})",
)


def _x(rng, m, k, scale=1.0):
    return (scale * rng.standard_normal((m, k))).astype(np.float32)


def test_pack_w4a8_holds_the_exact_weights_or_refuses():
    rng = np.random.default_rng(0)
    w = _q4_weight(rng, 96, 48)
    wa = cpu.pack_w4a8(jnp.asarray(w))
    assert wa.dtype == jnp.int8 and wa.shape == (3, 3, cpu.W4A8_BLOCK_BYTES)
    assert cpu.is_w4a8(wa) and cpu.is_packed(wa) and cpu.is_compact(wa) and not cpu.is_q4(wa)
    assert (cpu.in_features(wa), cpu.out_features(wa), cpu.compact_bytes(wa)) == (96, 48, 3 * 3 * 320)
    np.testing.assert_array_equal(np.asarray(cpu.unpack(wa)), w)  # bit for bit
    assert cpu.pack_w4a8(jnp.asarray(0.1 * rng.standard_normal((96, 48)).astype(np.float32))) is None  # not Q4_1
    assert cpu.pack_w4a8(jnp.asarray(_q4_weight(rng, 64, 40))) is None  # N not a multiple of 16
    off = w.copy()
    off[5, 7] = np.nextafter(off[5, 7], np.float32(1))  # one element an ulp off
    assert cpu.pack_w4a8(jnp.asarray(off)) is None
    # d * q + m exactly, but the offset m not a 16-bit float (not from a GGUF): the exact 4-bit panels take it, the
    # int8 layout (16-bit scales, as the GGUF stores them) does not
    q = rng.integers(0, 16, (64, 32)).astype(np.float32)
    q[0::32], q[1::32] = 0, 15  # each block spans 0 .. 15
    d, m = np.float32(np.float16(0.01)), np.float32(0.1)  # 0.1: a float32 that no 16-bit float equals
    odd = (d * q + m).astype(np.float32)
    assert cpu.pack_q4(jnp.asarray(odd)) is not None
    assert cpu.pack_w4a8(jnp.asarray(odd)) is None


@pytest.mark.parametrize("k,n", [(64, 48), (576, 80), (160, 16)])
def test_products_follow_the_scheme_and_stay_near_exact(k, n):
    rng = np.random.default_rng(k + n)
    w = _q4_weight(rng, k, n)
    wa = cpu.pack_w4a8(jnp.asarray(w))
    for m in (1, 2, 3, 4, 5, 8, 13):
        x = _x(rng, m, k)
        x[0, :32] = 0.0  # an all-zero block (d_x = 0)
        y = np.asarray(cpu.linear_cpu(jnp.asarray(x), wa))
        ref = cpu.w4a8_reference(x, wa)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))  # sum of |x w|: the rounding's scale
        assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-6), (m, np.abs(y - ref).max())
        exact = x.astype(np.float64) @ w.astype(np.float64)
        err = np.abs(y - exact)
        # x's rounding: at most half a step (max |x| / 254 per block) per element, times |w|
        step = np.abs(x).reshape(m, k // 32, 32).max(axis=2) / 254.0  # [m, blocks]
        bound = np.repeat(step, 32, axis=1) @ np.abs(w.astype(np.float64))  # [m, n]
        assert np.all(err <= bound * 1.01 + 1e-5 * scale + 1e-6)
        assert err.max() > 0  # x is quantized: not the exact product


def test_a_rows_result_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng(3)
    k, n = 192, 96
    wa = cpu.pack_w4a8(jnp.asarray(_q4_weight(rng, k, n)))
    x = _x(rng, 21, k)
    one = np.stack([np.asarray(cpu.linear_cpu(jnp.asarray(x[i:i + 1]), wa))[0] for i in range(len(x))])
    for m in (2, 3, 4, 5, 7, 8, 9, 13, 21):  # register tiles of 1-4 rows, row groups, one-row passes of 4 panels
        np.testing.assert_array_equal(np.asarray(cpu.linear_cpu(jnp.asarray(x[:m]), wa)), one[:m])
        np.testing.assert_array_equal(np.asarray(cpu.linear_cpu(jnp.asarray(x[m - 1:2 * m - 1]), wa)),
                                      one[m - 1:2 * m - 1])


@pytest.mark.parametrize("m", [1, 3, 13])
def test_fused_forms_equal_the_products(m):
    rng = np.random.default_rng(11 + m)
    eps = 1e-5
    x = jnp.asarray(_x(rng, m, 64))
    g = jnp.asarray((1 + 0.1 * rng.standard_normal(64)).astype(np.float32))
    ws = [_q4_weight(rng, 64, n) for n in (64, 32, 32)]
    pa = [cpu.pack_w4a8(jnp.asarray(w)) for w in ws]
    singles = [np.asarray(cpu.linear_cpu(x, w)) for w in pa]
    for a, b in zip(cpu.linear_many_cpu(x, pa), singles, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    xn = cpu.rms_linear_many_cpu(x, g, [cpu.pack(jnp.eye(64, dtype=jnp.float32))] * 2, eps)[0]  # the kernel's norm
    for a, w in zip(cpu.rms_linear_many_cpu(x, g, pa, eps), pa, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(cpu.linear_cpu(xn, w)))
    wg, wu = (cpu.pack_w4a8(jnp.asarray(_q4_weight(rng, 64, 96))) for _ in range(2))
    h = np.asarray(cpu.rms_swiglu_cpu(x, g, wg, wu, eps))
    gate, up = np.asarray(cpu.linear_cpu(xn, wg)), np.asarray(cpu.linear_cpu(xn, wu))
    np.testing.assert_allclose(h, gate / (1 + np.exp(-gate.astype(np.float64))) * up, rtol=1e-5, atol=1e-6)
    r = jnp.asarray(_x(rng, m, 32))
    np.testing.assert_array_equal(np.asarray(cpu.linear_residual_cpu(x, pa[1], r)),
                                  np.asarray(r) + singles[1])
    # XLA's dot (impl="xla") takes the exact weights and does not quantize x
    np.testing.assert_allclose(np.asarray(linear(x, pa[0], impl="xla")), np.asarray(x, np.float64) @ ws[0],
                               rtol=1e-4, atol=1e-4)


def test_attn_out_mlp_rows_equal_one_row_calls():
    rng = np.random.default_rng(5)
    eps = 1e-5
    wo, wg, wu, wd = (cpu.pack_w4a8(jnp.asarray(_q4_weight(rng, k, n)))
                      for k, n in ((64, 32), (32, 96), (32, 96), (96, 32)))
    g, gn = (jnp.asarray((1 + 0.1 * rng.standard_normal(32)).astype(np.float32)) for _ in range(2))
    nws = [cpu.pack_w4a8(jnp.asarray(_q4_weight(rng, 32, n))) for n in (48, 16, 16)]
    a = _x(rng, 8, 64)
    r = _x(rng, 8, 32, 2.0)

    def call(a, r):
        return jax.jit(lambda a, r: attn_out_mlp(a, r, wo, g, wg, wu, wd, eps, next_gain=gn, next_ws=nws,
                                                 next_eps=1e-6))(jnp.asarray(a), jnp.asarray(r))

    y, qkv = call(a, r)
    for i in range(8):
        y1, qkv1 = call(a[i:i + 1], r[i:i + 1])
        np.testing.assert_array_equal(np.asarray(y)[i:i + 1], np.asarray(y1))
        for t, t1 in zip(qkv, qkv1, strict=True):
            np.testing.assert_array_equal(np.asarray(t)[i:i + 1], np.asarray(t1))
    # and near the exact layer (float32 weights)
    po, pg, pu, pd = (cpu.pack(cpu.unpack(w)) for w in (wo, wg, wu, wd))  # the same weights as float32 panels
    exact = attn_out_mlp(jnp.asarray(a), jnp.asarray(r), po, g, pg, pu, pd, eps)
    np.testing.assert_allclose(np.asarray(y), np.asarray(exact), rtol=0.05, atol=0.05)


def test_tied_head_panels_for_int8_x():
    """``with_w8a8_head``: the 8-bit rows kept first (the embedding's gathers, XLA's exact copy), panels of them for
    int8 x after; the head's products follow the scheme, a row's logits do not depend on the other rows."""
    rng = np.random.default_rng(8)
    n, k = 160, 96
    table = q8_0((0.1 * rng.standard_normal((n, k))).astype(np.float32))
    q8 = cpu.pack_q8(jnp.asarray(table))
    head = cpu.with_w8a8_head(q8)
    assert head.shape == (n, k // 32, cpu.Q8_W8A8_BLOCK_BYTES) and cpu.is_w8a8_head(head) and cpu.is_q8(head)
    np.testing.assert_array_equal(np.asarray(cpu.q8_table(head)), table)
    np.testing.assert_array_equal(np.asarray(cpu.q8_rows(head, jnp.asarray([[3, 159], [0, 7]]))), table[[[3, 159],
                                                                                                          [0, 7]]])
    assert cpu.with_w8a8_head(cpu.pack_q8(jnp.asarray(table[:40]))) is None  # N not a multiple of 16
    x = _x(rng, 13, k)
    one = np.stack([np.asarray(cpu.linear_cpu(jnp.asarray(x[i:i + 1]), head, transposed=True))[0] for i in range(13)])
    for m in (1, 2, 5, 13):
        y = np.asarray(cpu.linear_cpu(jnp.asarray(x[:m]), head, transposed=True))
        np.testing.assert_array_equal(y, one[:m])
        ref = cpu.w8a8_head_reference(x[:m], head)
        scale = np.abs(x[:m].astype(np.float64)) @ np.abs(table.T.astype(np.float64))
        assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-6)
        exact = x[:m].astype(np.float64) @ table.T.astype(np.float64)
        assert 0 < np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()
    # on the kernel at every row count, beyond the tiles' range too (as the layers); XLA's path: the exact table
    assert _on_kernel(jnp.ones((400, k), F32), head, "auto", transposed=True)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x[:2]), head, impl="xla", transposed=True)),
                               x[:2].astype(np.float64) @ table.T, rtol=1e-4, atol=1e-4)


def _quantized_model(preset: str, seed: int):
    """A tiny preset with every linear weight exactly Q4_1 and the table Q8_0 (a GGUF checkpoint dequantized)."""
    from nightjar_jax.models.llama import init_model
    from nightjar_jax.models.presets import get_preset

    cfg = get_preset(preset).config
    graphdef, state = init_model(cfg, seed=seed, linear_impl="auto")

    def quantize(path, w):
        key = jax.tree_util.keystr(path)
        if "kernel" in key:
            return jnp.asarray(q4_1(np.asarray(w)))
        return jnp.asarray(q8_0(np.asarray(w))) if "embedding" in key else w

    return cfg, graphdef, jax.tree_util.tree_map_with_path(quantize, state)


def test_pack_state_w4a8_holds_q4_models_and_others_as_auto():
    from nightjar_jax.models.llama import init_model
    from nightjar_jax.models.presets import get_preset
    from tests.kernels.test_cpu_linear_packed import model_logits

    cfg, graphdef, quantized = _quantized_model("tiny-gqa", 3)
    held = pack_state(quantized, "auto", weight_format="w4a8")
    leaves = jax.tree.leaves(held)
    kernels = [leaf for leaf in leaves if cpu.is_packed(leaf)]
    assert kernels and all(cpu.is_w4a8(leaf) for leaf in kernels)  # all of them, no float32 beside
    assert any(cpu.is_w8a8_head(leaf) for leaf in leaves)  # the tied head: panels for int8 x beside its rows
    ref = model_logits(cfg, graphdef, pack_state(quantized, "auto", weight_format="f32"), 5)
    got = model_logits(cfg, graphdef, held, 5)
    assert not np.array_equal(got, ref)  # lossy ...
    np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.05)  # ... but close
    # a model that is not Q4_1: held as auto would hold it
    _, state = init_model(get_preset("tiny-gqa").config, seed=3, linear_impl="auto")
    for a, b in zip(jax.tree.leaves(pack_state(state, "auto", weight_format="w4a8")),
                    jax.tree.leaves(pack_state(state, "auto", weight_format="auto")), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert pack_state(quantized, "xla", weight_format="w4a8") is quantized  # XLA's dots: nothing packed


def test_engine_on_w4a8_speculation_and_batches_equal_one_row_decoding():
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.engine.runner import ModelHandle
    from nightjar_jax.engine.sampling_params import SamplingParams

    cfg, graphdef, quantized = _quantized_model("tiny-gqa", 4)
    target = ModelHandle(cfg, graphdef, pack_state(quantized, "auto", weight_format="w4a8"))
    dcfg, dgraph, dquant = _quantized_model("tiny-mha", 9)
    draft = ModelHandle(dcfg, dgraph, pack_state(dquant, "auto", weight_format="w4a8"))

    def engine(with_draft: bool) -> LLMEngine:
        ecfg = make_engine_config(model="tiny-gqa", page_size=4, num_pages=96, max_num_seqs=3,
                                  max_num_batched_tokens=16, compilation_cache_dir=None, max_model_len=96,
                                  planner="static:3" if with_draft else "static", num_speculative_tokens=3,
                                  weight_format="w4a8")
        return LLMEngine(ecfg, target=target, draft=draft if with_draft else None)

    prompts = [[1, 403, 261, 374, 302, 70, 45], [1, 70, 45, 321, 2, 9, 400, 33, 12, 101, 7, 8, 300, 5, 6, 99],
               [1, 5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(eng: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
        for i, p in enumerate(batch):
            eng.add_request(p, sp, request_id=str(i))
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
        assert eng.num_free_pages == eng.num_total_pages  # nothing leaked
        return [outs[str(i)] for i in range(len(batch))]

    ar = engine(False)
    alone = [run(ar, [p])[0] for p in prompts]
    assert run(ar, prompts) == alone  # a batch: each row as in one-row decoding
    sd = engine(True)
    assert run(sd, prompts) == alone  # verify steps (γ + 1 rows per sequence): the same greedy tokens
    assert all(len(t) == 20 for t in alone)


def test_pack_state_w4a8_falls_back_to_the_exact_layouts_as_auto_would():
    """Q4_1 weights whose offsets are not 16-bit floats (not from a GGUF): no int8 layout, the exact 4-bit panels with
    float32 beside them, exactly what ``auto`` holds."""
    cfg, graphdef, quantized = _quantized_model("tiny-gqa", 6)
    first = True

    def shift(path, w):  # one kernel rebuilt with float32 offsets off the 16-bit grid (exactly d * q + m still)
        nonlocal first
        if first and "kernel" in jax.tree_util.keystr(path):
            first = False
            rng = np.random.default_rng(0)
            q = rng.integers(0, 16, w.shape).astype(np.float32)
            q[0::32], q[1::32] = 0, 15
            return jnp.asarray((np.float32(np.float16(0.01)) * q + np.float32(0.1)).astype(np.float32))
        return w

    odd = jax.tree_util.tree_map_with_path(shift, quantized)
    held = pack_state(odd, "auto", weight_format="w4a8")
    auto = pack_state(odd, "auto", weight_format="auto")
    assert not any(cpu.is_w4a8(w) for w in jax.tree.leaves(held))
    assert any(cpu.is_q4(w) for w in jax.tree.leaves(held))
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(auto), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
