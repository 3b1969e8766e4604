"""Sampler: greedy exactness, distribution of temperature sampling, top-k / top-p / min-p supports, seeds, JIT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from nightjar_jax.engine.sampler import (
    SamplingTensors,
    processed_logprobs,
    processed_probs,
    request_keys,
    sample,
)

VOCAB = 8
NUM_DRAWS = 20_000
MIN_P_VALUE = 1e-3  # chi-square significance: a correct sampler fails 1 run in 1000


def _logits(batch: int, vocab: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, vocab)) * 2.0  # [batch, vocab] f32


def _chi_square_p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `tokens` [N] to `probs` [V]; cells with zero probability must be empty."""
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts[~support]}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def test_greedy_is_argmax_and_ties_take_lowest_index() -> None:
    logits = _logits(5, 50).at[4, 7].set(100.0).at[4, 3].set(100.0)  # row 4: tie between 3 and 7
    st = SamplingTensors.create(5, temperature=0.0, top_k=5, top_p=0.5, seeds=[1, 2, 3, 4, 5])
    tokens = sample(logits, st)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))
    assert int(tokens[4]) == 3
    probs = processed_probs(logits, st)
    np.testing.assert_array_equal(probs, jax.nn.one_hot(jnp.argmax(logits, axis=-1), 50))


def test_temperature_sampling_matches_softmax() -> None:
    logits = jnp.broadcast_to(_logits(1, VOCAB), (NUM_DRAWS, VOCAB))  # [N, V] f32, one row per seed
    temperature = 0.7
    st = SamplingTensors.create(NUM_DRAWS, temperature=temperature, seeds=np.arange(NUM_DRAWS), steps=3)
    tokens = np.asarray(jax.jit(sample)(logits, st))
    expected = np.asarray(jax.nn.softmax(logits[0] / temperature), dtype=np.float64)
    assert _chi_square_p_value(tokens, expected) > MIN_P_VALUE


def test_top_k_keeps_exactly_k_highest() -> None:
    logits = _logits(4, 32)
    top_k = np.array([1, 3, 10, 0])
    probs = np.asarray(processed_probs(logits, SamplingTensors.create(4, temperature=1.3, top_k=top_k)))
    for row in range(4):
        support = np.flatnonzero(probs[row] > 0)
        k = top_k[row] or 32
        np.testing.assert_array_equal(np.sort(support), np.sort(np.argsort(-np.asarray(logits[row]))[:k]))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def _minimal_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_support_is_the_minimal_nucleus(top_p: float) -> None:
    logits = _logits(3, 32, seed=1)
    temperature = 0.8
    probs = np.asarray(processed_probs(logits, SamplingTensors.create(3, temperature=temperature, top_p=top_p)))
    full = np.asarray(jax.nn.softmax(logits / temperature), dtype=np.float64)
    for row in range(3):
        nucleus = _minimal_nucleus(full[row], top_p)
        assert set(np.flatnonzero(probs[row] > 0).tolist()) == nucleus
        assert full[row, sorted(nucleus)].sum() >= top_p - 1e-6
        # Renormalised within the nucleus, ratios unchanged.
        idx = sorted(nucleus)
        np.testing.assert_allclose(probs[row, idx], full[row, idx] / full[row, idx].sum(), rtol=1e-4)


def test_top_k_then_top_p_and_min_p() -> None:
    logits = _logits(2, 32, seed=2)
    st = SamplingTensors.create(2, temperature=1.0, top_k=[6, 0], top_p=[0.7, 1.0], min_p=[0.0, 0.2])
    probs = np.asarray(processed_probs(logits, st))
    full = np.asarray(jax.nn.softmax(logits), dtype=np.float64)
    # Row 0: top-k 6 renormalised, then the nucleus of that.
    top6 = np.argsort(-full[0])[:6]
    restricted = np.zeros(32)
    restricted[top6] = full[0, top6] / full[0, top6].sum()
    assert set(np.flatnonzero(probs[0] > 0).tolist()) == _minimal_nucleus(restricted, 0.7)
    # Row 1: min-p keeps p >= 0.2 * p_max.
    assert set(np.flatnonzero(probs[1] > 0).tolist()) == set(np.flatnonzero(full[1] >= 0.2 * full[1].max()))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_top_k_top_p_sampling_matches_processed_distribution() -> None:
    logits = jnp.broadcast_to(_logits(1, VOCAB, seed=3), (NUM_DRAWS, VOCAB))
    st = SamplingTensors.create(NUM_DRAWS, temperature=1.5, top_k=5, top_p=0.8, seeds=np.arange(NUM_DRAWS))
    tokens = np.asarray(jax.jit(sample)(logits, st))
    expected = np.asarray(processed_probs(logits[:1], st._replace(**{f: v[:1] for f, v in st._asdict().items()})))
    assert _chi_square_p_value(tokens, expected[0].astype(np.float64)) > MIN_P_VALUE


def test_sort_skipping_does_not_change_rows_without_top_k_top_p() -> None:
    logits = _logits(4, 64, seed=4)
    # Rows 0..2 need no sort (row 1 is greedy, so its top_k is ignored); row 3 forces the sorting branch.
    no_sort = SamplingTensors.create(3, temperature=[0.9, 0.0, 1.1], top_k=[0, 5, 0], min_p=[0.0, 0.0, 0.05])
    forced = SamplingTensors.create(
        4, temperature=[0.9, 0.0, 1.1, 1.0], top_k=[0, 5, 0, 2], min_p=[0.0, 0.0, 0.05, 0.0]
    )
    np.testing.assert_allclose(
        processed_logprobs(logits, forced)[:3], processed_logprobs(logits[:3], no_sort), rtol=1e-6
    )


def test_seed_reproducible_and_independent_of_batch_slot_and_composition() -> None:
    row = _logits(1, 64, seed=5)[0]
    batch_a = jnp.stack([row, _logits(1, 64, seed=6)[0], row])
    st_a = SamplingTensors.create(3, temperature=1.0, seeds=[42, 7, 99], steps=[5, 0, 5])
    batch_b = jnp.stack([_logits(1, 64, seed=7)[0], row, row, row])
    st_b = SamplingTensors.create(4, temperature=[0.0, 1.0, 1.0, 1.0], seeds=[1, 99, 42, 42], steps=[0, 5, 5, 6])
    tokens_a, tokens_b = sample(batch_a, st_a), sample(batch_b, st_b)
    assert int(tokens_a[0]) == int(tokens_b[2])  # seed 42, step 5, slots 0 vs 2
    assert int(tokens_a[2]) == int(tokens_b[1])  # seed 99, step 5, slots 2 vs 1
    np.testing.assert_array_equal(tokens_a, sample(batch_a, st_a))  # reproducible
    keys_a, keys_b = request_keys(st_a, 0), request_keys(st_b, 0)
    np.testing.assert_array_equal(jax.random.key_data(keys_a[0]), jax.random.key_data(keys_b[2]))
    assert not np.array_equal(jax.random.key_data(keys_b[2]), jax.random.key_data(keys_b[3]))  # step differs
    assert not np.array_equal(jax.random.key_data(request_keys(st_a, 1)[0]), jax.random.key_data(keys_a[0]))


def test_mixed_greedy_and_sampled_batch() -> None:
    batch = 256
    logits = jnp.broadcast_to(_logits(1, VOCAB, seed=8), (batch, VOCAB))
    greedy = np.arange(batch) % 2 == 0
    st = SamplingTensors.create(batch, temperature=np.where(greedy, 0.0, 5.0), seeds=np.arange(batch))
    tokens = np.asarray(sample(logits, st))
    assert (tokens[greedy] == int(jnp.argmax(logits[0]))).all()
    assert len(set(tokens[~greedy].tolist())) > 2  # high temperature spreads the sampled rows


def test_jit_compiles_once_across_parameter_values() -> None:
    jitted = jax.jit(sample, static_argnames="salt")
    logits = _logits(4, 32)
    for temperature, top_k, top_p, min_p in [(0.0, 0, 1.0, 0.0), (1.0, 3, 0.9, 0.1), (0.5, 0, 1.0, 0.0)]:
        st = SamplingTensors.create(4, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=7)
        jitted(logits, st).block_until_ready()
    assert jitted._cache_size() == 1
