"""The CPU greedy-argmax custom call (``kernels_pallas/sampling/cpu.py``) against ``np.argmax``: ties (lowest index),
NaN rows (first NaN, as ``jnp.argmax``), infinities, constant rows, vocabularies shorter than or not a multiple of
the 16-float vector, leading dimensions, the sampler's dispatch to it, and a clear error for other dtypes. Skips
only when no C++ compiler exists (the reason is printed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sampling import cpu
from nightjar_jax.engine.sampler import argmax


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.available():
        pytest.skip(f"CPU sampling kernel unavailable here: {cpu.unavailable_reason()}")


def _rows(v: int) -> np.ndarray:
    rng = np.random.default_rng(v)
    x = rng.standard_normal((9, v)).astype(np.float32)
    x[1, :] = 0.5  # constant: index 0
    x[2, v // 3] = x[2, v - 1] = 40.0  # a tie: the lower index
    x[3, -1] = np.nan  # NaN: its index (jnp.argmax's answer)
    x[4, v // 2] = np.nan
    x[4, v - 1] = np.nan  # two NaNs: the first
    x[5, :] = -np.inf  # all -inf: index 0
    x[6, v // 2] = np.inf
    x[7, 0] = 30.0  # at the first position
    x[8, v - 1] = 30.0  # at the last
    return x


@pytest.mark.parametrize("v", [1, 5, 16, 17, 100, 49152])
def test_matches_numpy(v):
    x = _rows(v)
    expected = np.argmax(x, axis=-1)
    got = np.asarray(jax.jit(cpu.argmax_cpu)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_leading_dimensions_and_the_sampler_dispatch():
    x = np.random.default_rng(0).standard_normal((2, 3, 70)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(cpu.argmax_cpu(jnp.asarray(x))), np.argmax(x, axis=-1))
    fn = jax.jit(argmax)
    assert "nightjar_argmax_f32" in fn.lower(jnp.asarray(x)).as_text()
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), np.argmax(x, axis=-1))
    # other dtypes keep the jnp form
    xb = jnp.asarray(x, jnp.bfloat16)
    assert "nightjar_argmax" not in jax.jit(argmax).lower(xb).as_text()
    np.testing.assert_array_equal(np.asarray(argmax(xb)), np.argmax(np.asarray(xb, np.float32), axis=-1))


def test_bad_input_raises_clearly():
    with pytest.raises(ValueError, match="float32"):
        cpu.argmax_cpu(jnp.ones((2, 4), jnp.bfloat16))


def test_an_empty_vocabulary_is_an_error():
    # (the kernel returned index 0 for every row; jnp.argmax raises)
    with pytest.raises(ValueError, match="empty vocabulary"):
        cpu.argmax_cpu(jnp.zeros((2, 0), jnp.float32))
