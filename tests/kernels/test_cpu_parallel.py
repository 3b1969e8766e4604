"""The CPU kernels' shared helper threads (``kernels_pallas/cpu_parallel.h``'s SpinTeam): one setting for every
kernel library, the same bits whether a call's helpers come from the team or from XLA's pool, and calls from several
Python threads at once (the team takes one; the others fall back to XLA's pool) all correct."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_build
from kernels_pallas.linear import cpu
from kernels_pallas.paged_attention import cpu as attention_cpu


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not (cpu.available() and attention_cpu.available()):
        pytest.skip(f"CPU kernels unavailable here: {cpu.unavailable_reason()}")
    before = cpu_build.spin_us()
    yield
    cpu_build.spin_us(before)


def _layer_inputs(m: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    h, i = 64, 160
    a = rng.standard_normal((m, h)).astype(np.float32)
    r = rng.standard_normal((m, h)).astype(np.float32)
    ws = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0]) for s in ((h, h), (h, i), (h, i), (i, h))]
    gain = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return a, r, ws, gain


@jax.jit
def _layer(a, r, w_o, gain, w_gate, w_up, w_down):
    # ParallelPhases (the fused layer) and ParallelFor (a product over many column blocks) in one step
    y = cpu.attn_out_mlp_cpu(a, r, w_o, gain, w_gate, w_up, w_down, 1e-5)
    return y, cpu.linear_cpu(y, w_gate)


def test_one_setting_for_every_library():
    cpu_build.spin_us(17)
    assert cpu_build.spin_us() == 17
    # the attention library reaches the same team as the linear one (one GNU-unique object in the process)
    assert int(attention_cpu._LIBRARY._state["lib"].NightjarSpinUs()) == 17
    assert cpu_build.spin_us(-5) == 0  # clamped: 0 hands every call to XLA's pool


@pytest.mark.parametrize("m", [1, 5, 33])
def test_team_and_xla_pool_give_the_same_bits(m):
    a, r, ws, gain = _layer_inputs(m)
    cpu_build.spin_us(0)
    y0, z0 = (np.asarray(t) for t in _layer(a, r, ws[0], gain, *ws[1:]))
    cpu_build.spin_us(30)
    y1, z1 = (np.asarray(t) for t in _layer(a, r, ws[0], gain, *ws[1:]))
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(z0, z1)
    r1 = r + a @ ws[0]
    n = r1 / np.sqrt((r1 * r1).mean(-1, keepdims=True) + 1e-5) * gain
    g, u = n @ ws[1], n @ ws[2]
    expected = r1 + (g / (1 + np.exp(-g)) * u) @ ws[3]
    np.testing.assert_allclose(y1, expected, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(z1, y1 @ ws[1], rtol=2e-4, atol=2e-4)


def test_calls_from_several_threads_at_once_are_all_correct():
    cpu_build.spin_us(30)
    inputs = [_layer_inputs(3, seed) for seed in range(4)]
    expected = [tuple(np.asarray(t) for t in _layer(a, r, ws[0], gain, *ws[1:])) for a, r, ws, gain in inputs]
    errors: list[str] = []

    def worker(idx: int) -> None:
        a, r, ws, gain = inputs[idx]
        for _ in range(40):
            y, z = (np.asarray(t) for t in _layer(a, r, ws[0], gain, *ws[1:]))
            if not (np.array_equal(y, expected[idx][0]) and np.array_equal(z, expected[idx][1])):
                errors.append(f"thread {idx}: result differs from its single-threaded run")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call hung"
    assert not errors, errors


@pytest.mark.parametrize("form", ["packed", "q4", "w4a8"])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_wide_and_small_panel_items_give_the_same_bits(form, m):
    """Packed panels are split into one wide item per thread with the team, into small groups taken dynamically
    with XLA's pool (1-8 rows): every column is still computed whole by one item, so the bits are the same."""
    from tests.kernels.test_cpu_linear_compact import _q4_weight

    rng = np.random.default_rng(m)
    # 40 panels: 3-panel groups leave one over; wide items of 21 and 19 end one-row passes of 4 panels short
    k, n = 96, 40 * 16
    w = _q4_weight(rng, k, n)
    if form == "packed":
        wp = cpu.pack(jnp.asarray(w))
    elif form == "q4":
        wp = cpu.pack_q4(jnp.asarray(w))
    else:
        if not cpu.w4a8_supported():
            pytest.skip("int8-activation weights need AVX-512 with AVX512-VNNI")
        wp = cpu.pack_w4a8(jnp.asarray(w))
    assert wp is not None
    x = rng.standard_normal((m, k)).astype(np.float32)
    run = jax.jit(cpu.linear_cpu)
    cpu_build.spin_us(0)
    small = np.asarray(run(x, wp))
    cpu_build.spin_us(30)
    wide = np.asarray(run(x, wp))
    np.testing.assert_array_equal(small, wide)
    if form != "w4a8":  # exact weights: against numpy (w4a8 quantizes x; its own tests bound that)
        np.testing.assert_allclose(wide, x.astype(np.float64) @ w.astype(np.float64), rtol=2e-4, atol=2e-4)
