"""Sampler: greedy exactness, distribution of temperature sampling, top-k / top-p / min-p supports, seeds, JIT.

Everything goes through two module-level jitted functions with two shapes ([4, 32] and [NUM_DRAWS, 8]) and the
expectations are computed in numpy, so the file compiles a handful of programs and runs in seconds on CPU.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from nightjar_jax.engine.sampler import (
    Penalties,
    SamplingTensors,
    _top_k_top_p_threshold,
    _top_k_top_p_threshold_by_sort,
    apply_penalties,
    argmax,
    processed_probs,
    request_keys,
    sample,
    sample_from_logprobs,
    sample_from_probs,
    top_k_ids,
)

NUM_DRAWS = 20_000
MIN_P_VALUE = 1e-3  # chi-square significance: a correct sampler fails about 1 run in 1000

_sample = jax.jit(sample, static_argnames="salt")
_probs = jax.jit(processed_probs)


def _logits(batch: int, vocab: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * 2.0).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _chi_square_p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `tokens` [N] to `probs` [V]; cells with zero probability must be empty."""
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts[~support]}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def _support(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(row > 0).tolist())


def _minimal_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    return set(order[mass_before < top_p].tolist())


def test_greedy_is_argmax_and_ties_take_lowest_index() -> None:
    logits = _logits(4, 32)
    logits[3, [3, 7]] = 100.0  # row 3: a tie between tokens 3 and 7
    st = SamplingTensors.create(4, temperature=0.0, top_k=5, top_p=0.5, seeds=[1, 2, 3, 4])
    tokens = np.asarray(_sample(logits, st))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[3] == 3
    np.testing.assert_array_equal(_probs(logits, st), np.eye(32)[np.argmax(logits, axis=-1)])


def test_two_pass_argmax_equals_numpy_argmax() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 300)).astype(np.float32)
    x[0, 1, [10, 250]] = 9.0  # a tie: the lowest index
    x[1, 2, :] = -np.inf  # a fully masked row: index 0, as numpy
    x[2, 0, [40, 90]] = np.nan  # NaN wins, the first one, as numpy
    x[2, 3, [5, 6]] = np.inf
    got = np.asarray(jax.jit(argmax)(x))
    assert got.dtype == np.int32 and got.shape == (3, 5)
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_temperature_sampling_matches_softmax() -> None:
    temperature = 0.7
    logits = np.broadcast_to(_logits(1, 8), (NUM_DRAWS, 8))  # one row per seed
    st = SamplingTensors.create(NUM_DRAWS, temperature=temperature, seeds=np.arange(NUM_DRAWS), steps=3)
    tokens = np.asarray(_sample(logits, st))
    assert _chi_square_p_value(tokens, _softmax(logits[0] / temperature)) > MIN_P_VALUE


def test_top_k_top_p_sampling_matches_processed_distribution() -> None:
    logits = np.broadcast_to(_logits(1, 8, seed=6), (NUM_DRAWS, 8))
    st = SamplingTensors.create(NUM_DRAWS, temperature=1.5, top_k=5, top_p=0.8, seeds=np.arange(NUM_DRAWS))
    tokens = np.asarray(_sample(logits, st))
    expected = np.asarray(_probs(logits, st))[0].astype(np.float64)
    assert 1 < len(_support(expected)) < 5  # top-p really cut below top-k here
    assert _chi_square_p_value(tokens, expected) > MIN_P_VALUE


def test_inverse_cdf_across_blocks_with_zero_probability_tokens() -> None:
    """V = 300 spans two CDF blocks (256 + 44); every 7th token has probability 0 and must never be drawn."""
    probs = np.zeros(300)
    probs[::7] = np.random.default_rng(10).random(43) + 0.2
    log_probs = np.where(probs > 0, np.log(np.maximum(probs, 1e-30)), -np.inf).astype(np.float32)  # [300]
    log_probs = np.broadcast_to(log_probs, (NUM_DRAWS, 300))
    keys = jax.vmap(jax.random.key)(np.arange(NUM_DRAWS))
    tokens = np.asarray(jax.jit(sample_from_logprobs)(log_probs, keys))
    assert _chi_square_p_value(tokens, probs / probs.sum()) > MIN_P_VALUE


def test_top_k_keeps_exactly_k_highest() -> None:
    logits = _logits(4, 32)
    top_k = np.array([1, 3, 10, 0])  # 0: off
    probs = np.asarray(_probs(logits, SamplingTensors.create(4, temperature=1.3, top_k=top_k)))
    for row in range(4):
        assert _support(probs[row]) == set(np.argsort(-logits[row])[: top_k[row] or 32].tolist())
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_top_p_support_is_the_minimal_nucleus() -> None:
    logits = _logits(4, 32, seed=1)
    temperature, top_p = 0.8, np.array([0.05, 0.5, 0.9, 0.999], np.float32)
    probs = np.asarray(_probs(logits, SamplingTensors.create(4, temperature=temperature, top_p=top_p)))
    full = _softmax(logits / temperature)
    for row in range(4):
        nucleus = _minimal_nucleus(full[row], top_p[row])
        assert _support(probs[row]) == nucleus
        kept = sorted(nucleus)
        assert full[row, kept].sum() >= top_p[row] - 1e-6
        # Renormalised inside the nucleus, ratios unchanged.
        np.testing.assert_allclose(probs[row, kept], full[row, kept] / full[row, kept].sum(), rtol=1e-4)


def test_top_k_then_top_p_and_min_p() -> None:
    logits = _logits(4, 32, seed=2)
    st = SamplingTensors.create(
        4, temperature=1.0, top_k=[6, 0, 4, 0], top_p=[0.7, 1.0, 1.0, 1.0], min_p=[0.0, 0.2, 0.0, 0.0]
    )
    probs = np.asarray(_probs(logits, st))
    full = _softmax(logits)
    # Row 0: top-k 6, renormalised, then the nucleus of that.
    top6 = np.argsort(-full[0])[:6]
    restricted = np.zeros(32)
    restricted[top6] = full[0, top6] / full[0, top6].sum()
    assert _support(probs[0]) == _minimal_nucleus(restricted, 0.7)
    # Row 1: min-p keeps p >= 0.2 * p_max.
    assert _support(probs[1]) == set(np.flatnonzero(full[1] >= 0.2 * full[1].max()).tolist())
    np.testing.assert_allclose(probs[3], full[3], rtol=1e-5)  # all filters off: plain softmax
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_min_p_before_top_k_and_top_p() -> None:
    """vLLM's order: min-p first, then top-k and top-p over the renormalised mass min-p kept (its min-p is a
    logits processor that runs before the top-k/top-p sampler)."""
    logits = _logits(3, 32, seed=5)
    st = SamplingTensors.create(3, temperature=1.0, top_k=[0, 3, 0], top_p=[0.6, 1.0, 0.9], min_p=[0.1, 0.02, 0.05])
    probs = np.asarray(_probs(logits, st))
    full = _softmax(logits)
    for row, (k, p) in enumerate([(32, 0.6), (3, 1.0), (32, 0.9)]):
        kept = full[row] >= float(st.min_p[row]) * full[row].max()
        restricted = np.where(kept, full[row], 0.0)
        order = np.argsort(-restricted)[:k]
        top = np.zeros(32)
        top[order] = restricted[order]
        top /= top.sum()
        expected = _minimal_nucleus(top, p) if p < 1 else _support(top)
        assert _support(probs[row]) == expected, row
        survivors = sorted(expected)
        np.testing.assert_allclose(probs[row, survivors], full[row, survivors] / full[row, survivors].sum(), rtol=1e-4)
    # Rows 0 and 2 tell the orders apart: top-p's nucleus over the whole distribution, then min-p, keeps more.
    for row, p in [(0, 0.6), (2, 0.9)]:
        min_p_kept = set(np.flatnonzero(full[row] >= float(st.min_p[row]) * full[row].max()).tolist())
        other_order = _minimal_nucleus(full[row], p) & min_p_kept
        assert _support(probs[row]) < other_order, row


def test_skipping_the_threshold_search_does_not_change_other_rows() -> None:
    logits = _logits(4, 32, seed=4)
    # Row 1 is greedy, so its top_k must not trigger the top-k/top-p search: with row 3 sampled and unfiltered
    # the search is skipped; with row 3 asking for top-k it runs. Rows 0..2 must not change between the two.
    no_sort = SamplingTensors.create(4, temperature=[0.9, 0.0, 1.1, 1.0], top_k=[0, 5, 0, 0], min_p=[0, 0, 0.05, 0])
    sort = no_sort._replace(top_k=no_sort.top_k.at[3].set(2))
    np.testing.assert_allclose(_probs(logits, sort)[:3], _probs(logits, no_sort)[:3], rtol=1e-6, atol=1e-7)


def test_bisection_threshold_equals_sort_reference() -> None:
    """The bisected top-k/top-p threshold is exactly the sort-based one, with ties, -inf and extreme k / p."""
    rng = np.random.default_rng(9)
    scaled = (rng.standard_normal((16, 300)) * 3).astype(np.float32)
    scaled[0, :50] = -np.inf  # masked vocabulary
    scaled[1, 10:20] = 5.0  # a tie across the top-k boundary
    scaled[2] = np.round(scaled[2])  # many ties
    scaled[3] = 1e30  # one flat row
    scaled[4, :] = -1e-30  # negative values near zero, to exercise the float -> int order
    top_k = rng.choice([1, 2, 15, 100, 299, 300], (16, 1)).astype(np.int32)
    top_p = rng.choice([1.0, 0.999, 0.9, 0.5, 0.01], (16, 1)).astype(np.float32)
    bisected = jax.jit(_top_k_top_p_threshold)(scaled, top_k, top_p)
    np.testing.assert_array_equal(bisected, jax.jit(_top_k_top_p_threshold_by_sort)(scaled, top_k, top_p))


def test_seed_reproducible_and_independent_of_batch_slot_and_composition() -> None:
    others = _logits(4, 32, seed=6)
    row = _logits(1, 32, seed=5)[0]
    batch_a = np.stack([row, others[0], row, others[1]])
    st_a = SamplingTensors.create(4, temperature=1.0, seeds=[42, 7, 99, 3], steps=[5, 0, 5, 1])
    batch_b = np.stack([others[2], row, row, row])
    st_b = SamplingTensors.create(4, temperature=[0.0, 1.0, 1.0, 1.0], seeds=[1, 99, 42, 42], steps=[0, 5, 5, 6])
    tokens_a, tokens_b = np.asarray(_sample(batch_a, st_a)), np.asarray(_sample(batch_b, st_b))
    assert tokens_a[0] == tokens_b[2]  # seed 42, step 5: slot 0 vs slot 2, different neighbours
    assert tokens_a[2] == tokens_b[1]  # seed 99, step 5: slot 2 vs slot 1
    np.testing.assert_array_equal(tokens_a, _sample(batch_a, st_a))  # reproducible
    key_data = lambda st, salt: np.asarray(jax.random.key_data(request_keys(st, salt)))  # noqa: E731
    np.testing.assert_array_equal(key_data(st_a, 0)[0], key_data(st_b, 0)[2])
    assert not np.array_equal(key_data(st_b, 0)[2], key_data(st_b, 0)[3])  # a different step, another key
    assert not np.array_equal(key_data(st_a, 1)[0], key_data(st_a, 0)[0])  # a different salt, another key


def test_large_seeds_are_valid() -> None:
    st = SamplingTensors.create(4, temperature=1.0, seeds=[0, 2**31, 2**32 - 1, 2**40 + 5])
    tokens = np.asarray(_sample(_logits(4, 32), st))
    assert ((tokens >= 0) & (tokens < 32)).all()


def test_seeds_differing_in_their_high_half_draw_different_streams() -> None:
    """A seed under 2**32 is the key's own; a larger one is mixed whole: 5, 5 + 2**32 and 5 + 7 * 2**32 drew the
    same samples when the engine took seeds mod 2**32 (and an xor of the halves mapped 5 + 2**32 onto 4)."""
    from nightjar_jax.engine.sampler import fold_seeds

    seeds = [5, 5 + 2**32, 5 + 7 * 2**32, 4, 2**63 - 1]
    folded = fold_seeds(seeds)
    assert folded.dtype == np.uint32 and folded[0] == 5 and folded[3] == 4 and len(set(folded.tolist())) == 5
    assert (fold_seeds([0, 2**32 - 1]) == [0, 2**32 - 1]).all()  # (under 2**32: unchanged, as before)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a scalar seed's hash wrapped with a RuntimeWarning)
        assert fold_seeds(5) == 5 and fold_seeds(2**40) == fold_seeds([2**40])[0]
    st = SamplingTensors.create(5, temperature=1.0, seeds=seeds)
    rows = np.stack([np.asarray(_sample(_logits(5, 64, seed=s), st)) for s in range(16)], axis=1)
    assert len({tuple(r) for r in rows[:3]}) == 3  # (16 draws over 64 tokens each: distinct streams)


def test_mixed_greedy_and_sampled_batch() -> None:
    logits = np.broadcast_to(_logits(1, 8, seed=8), (NUM_DRAWS, 8))
    greedy = np.arange(NUM_DRAWS) % 2 == 0
    st = SamplingTensors.create(NUM_DRAWS, temperature=np.where(greedy, 0.0, 0.7), seeds=np.arange(NUM_DRAWS))
    tokens = np.asarray(_sample(logits, st))
    assert (tokens[greedy] == np.argmax(logits[0])).all()
    assert _chi_square_p_value(tokens[~greedy], _softmax(logits[0] / 0.7)) > MIN_P_VALUE


def test_jit_compiles_once_across_parameter_values() -> None:
    num_traces = []  # jit traces once per compilation, so this counts compilations without private APIs
    jitted = jax.jit(lambda logits, st: (num_traces.append(1), sample(logits, st))[1])
    logits = _logits(4, 32)
    for temperature, top_k, top_p, min_p in [(0.0, 0, 1.0, 0.0), (1.0, 3, 0.9, 0.1), (0.5, 0, 1.0, 0.0)]:
        st = SamplingTensors.create(4, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=7)
        jitted(logits, st).block_until_ready()
    assert len(num_traces) == 1
    if hasattr(jitted, "_cache_size"):  # private, present in jax 0.10 / 0.11
        assert jitted._cache_size() == 1


def _penalized(logits: np.ndarray, counts: np.ndarray, prompt: np.ndarray, presence: float, frequency: float,
               repetition: float) -> np.ndarray:
    """vLLM's order over one position's logits [V]: repetition (prompt or generated tokens), then the others."""
    seen = prompt | (counts > 0)
    out = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return out - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
def test_apply_penalties_counts_the_drafts_before_each_position(shape) -> None:
    """Against numpy: at each position the penalties are those of the generated tokens plus the drafted tokens in its
    prefix (repeated ones included), the repetition penalty over the prompt's tokens too; for one position (a plain
    step), a chain and a token tree whose branches repeat tokens."""
    from nightjar_jax.spec.tree import chain_prefixes, make_tree

    rng = np.random.default_rng(0)
    vocab, batch = 6, 4
    prefix = {"plain": None, "chain": chain_prefixes(5),
              "tree": make_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]).prefixes}[shape]
    num = 1 if prefix is None else prefix.shape[0]
    tokens = rng.integers(0, 3, (batch, num)).astype(np.int32)  # (3 of 6 ids: many repeats)
    counts = rng.integers(0, 3, (batch, vocab)).astype(np.int32)
    prompt = rng.random((batch, vocab)) < 0.3
    presence = np.array([0.0, 1.5, -0.5, 0.7], np.float32)
    frequency = np.array([0.0, 0.25, 1.0, -0.3], np.float32)
    repetition = np.array([1.0, 1.3, 0.8, 2.0], np.float32)
    raw = rng.standard_normal((batch, num, vocab)).astype(np.float32) * 3
    st = SamplingTensors.create(batch)._replace(
        penalties=Penalties(presence, frequency, repetition, counts, prompt))
    penalize = jax.jit(lambda logits, tokens, st: apply_penalties(logits, st, None if prefix is None else tokens,
                                                                  prefix))
    got = np.asarray(penalize(raw, tokens, st))
    want = raw.copy()
    for b in range(batch):
        for p in range(num):
            seen = counts[b] + (0 if prefix is None else np.bincount(tokens[b][prefix[p]], minlength=vocab))
            want[b, p] = _penalized(raw[b, p], seen, prompt[b], presence[b], frequency[b], repetition[b])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    if prefix is not None:  # (the drafts moved some penalties)
        committed = np.stack([[_penalized(raw[b, p], counts[b], prompt[b], presence[b], frequency[b],
                                          repetition[b]) for p in range(num)] for b in range(batch)])
        assert not np.allclose(want, committed)
    # no penalties in the batch: unchanged
    np.testing.assert_array_equal(apply_penalties(raw, st._replace(penalties=None)), raw)


def test_per_row_tensors_must_match_the_batch():
    """One row's SamplingTensors against a batch of 4 broadcast (every row on one PRNG key, four equal draws) with
    no error; two rows against 4 failed deep in XLA ("div got incompatible shapes"). Both are a ValueError now."""
    import jax.numpy as jnp

    from nightjar_jax.spec.rejection import rejection_sample

    logits = jnp.zeros((4, 8), jnp.float32)
    for rows in (1, 2):
        st = SamplingTensors.create(rows, temperature=1.0)
        with pytest.raises(ValueError, match=f"SamplingTensors' rows: {rows} for a batch of 4 rows"):
            sample(logits, st)
        with pytest.raises(ValueError, match=f"SamplingTensors' rows: {rows} for a batch of 4 rows"):
            rejection_sample(jnp.zeros((4, 2), jnp.int32), jnp.full((4, 2, 8), 1 / 8), jnp.full((4, 3, 8), 1 / 8), st)
    st = SamplingTensors.create(4, temperature=1.0)
    with pytest.raises(ValueError, match=r"target_probs has shape \(4, 2, 8\), needs \[4, 3, V\]"):
        rejection_sample(jnp.zeros((4, 2), jnp.int32), jnp.full((4, 2, 8), 1 / 8), jnp.full((4, 2, 8), 1 / 8), st)
    assert sample(logits, st).shape == (4,)


def test_a_row_without_mass_draws_a_token_of_the_vocabulary():
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 2)
    for vocab in (8, 300, 600):  # (it drew 255, 511, 767: the padded block's last id)
        probs = jnp.zeros((2, vocab)).at[1, 3].set(1.0)
        assert sample_from_probs(probs, keys).tolist() == [0, 3]


def test_top_k_ids_past_the_row_is_an_error():
    import jax.numpy as jnp

    x = jnp.asarray([[1.0, 2.0, 3.0]])
    assert top_k_ids(x, 3).tolist() == [[2, 1, 0]]
    for k in (4, 10):  # (4: id 0 twice, no error; 10: lax.top_k's own message)
        with pytest.raises(ValueError, match=rf"top_k_ids: k={k} must be in \[0, 3\]"):
            top_k_ids(x, k)


def test_min_p_of_one_keeps_only_the_most_likely_tokens():
    """vLLM takes min_p in [0, 1]; 1 keeps the tokens as likely as the most likely (it was refused: [0, 1))."""
    import jax.numpy as jnp

    from nightjar_jax.engine.sampling_params import SamplingParams

    assert SamplingParams(min_p=1.0).min_p == 1.0
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0]])
    probs = processed_probs(logits, SamplingTensors.create(1, temperature=1.0, min_p=1.0))
    assert np.allclose(np.asarray(probs), [[0.0, 0.5, 0.5, 0.0]])


def test_a_negative_seed_is_vllms_64_bit_seed() -> None:
    """vLLM takes any signed 64-bit seed (a 400 here before): a negative one folds as its two's complement, and a
    request's n sequences are seeded seed + j (sequence 0 the seed's own stream), wrapping past 2**63 - 1 to 0."""
    from nightjar_jax.engine.sampler import fold_seeds
    from nightjar_jax.engine.sampling_params import SamplingParams, child_seed

    assert fold_seeds(-1) == fold_seeds(2**64 - 1) and fold_seeds(-1) != fold_seeds(1)
    assert (fold_seeds([-5, 3]) == [fold_seeds(2**64 - 5), 3]).all()
    SamplingParams(seed=-(2**63))
    with pytest.raises(ValueError, match=r"seed=-9223372036854775809 is invalid: allowed None or an integer in "
                                         r"\[-2\*\*63, 2\*\*63\)"):
        SamplingParams(seed=-(2**63) - 1)
    assert [child_seed(-1, j) for j in range(3)] == [-1, 0, 1]
    assert [child_seed(2**63 - 1, j) for j in range(2)] == [2**63 - 1, 0] and child_seed(None, 1) is None


@pytest.mark.parametrize("filters", [{}, dict(min_p=0.1), dict(top_k=3, top_p=0.9)], ids=["plain", "min_p", "top"])
def test_a_tiny_temperature_samples_the_argmax(filters):
    """Temperatures down to the smallest float32 (SamplingParams allows any above 0) divided the logits into inf and
    the min-p floor into NaN: every token was removed and token 0 drawn (QA: temperature 3e-38 wrote only <unk>). The
    logits are shifted by their maximum first: the greedy limit."""
    logits = np.array([[3.0, 40.0, 1.0, 0.0, -1.0], [-5.0, -2.0, -9.0, -1.5, -3.0]], np.float32)
    for temperature in (3e-38, 1e-37, 1e-30, 1e-6):
        st = SamplingTensors.create(2, temperature=temperature, seeds=[1, 2], **filters)
        probs = np.asarray(_probs(logits, st))
        assert np.isfinite(probs).all() and (probs.argmax(axis=1) == [1, 3]).all() and np.allclose(probs.max(1), 1)
        assert np.asarray(_sample(logits, st)).tolist() == [1, 3]
    moderate = SamplingTensors.create(2, temperature=0.7, seeds=[1, 2], **filters)  # (unchanged: the shift cancels)
    shifted = logits / 0.7
    expected = np.exp(shifted - shifted.max(1, keepdims=True))
    if not filters:
        np.testing.assert_allclose(np.asarray(_probs(logits, moderate)), expected / expected.sum(1, keepdims=True),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("filters", [{}, dict(top_k=2)], ids=["plain", "top_k"])
def test_a_huge_temperature_keeps_bans_and_filters(filters):
    """XLA divides by multiplying with 1 / t: a temperature past ~1e38 (allowed: any finite float) flushed that to 0,
    every scaled logit was 0, top-k was ignored and banned (-1e30) tokens drawn, and a -inf logit gave NaN; past
    t ~ 1e28, -1e30 / t was no longer far below the rest (QA, 2026-12-07). Now: uniform over the kept tokens."""
    logits = np.array([[5, 4, 3, 2, -1e30, -1e30, -np.inf, 1], [5, 4, 3, 2, -1e30, -1e30, 0, 1]], np.float32)
    logits = np.pad(logits, ((0, 2), (0, 24)), constant_values=-1e30)  # (the file's [4, 32] shape)
    allowed = [[0, 1, 2, 3, 7], [0, 1, 2, 3, 6, 7]] if not filters else [[0, 1], [0, 1]]
    for temperature in (1e29, 1e37, 3e38):
        st = SamplingTensors.create(4, temperature=temperature, seeds=[1, 2, 3, 4], **filters)
        probs = np.asarray(_probs(logits, st))
        for row, kept in enumerate(allowed):
            want = np.zeros(32)
            want[kept] = 1 / len(kept)
            np.testing.assert_allclose(probs[row], want, atol=1e-6, err_msg=f"t={temperature} row {row}")
        np.testing.assert_allclose(probs[2:], 1 / 32, atol=1e-6)  # (a row with every token banned: left as it was)
        for seed in range(8):
            st = SamplingTensors.create(4, temperature=temperature, seeds=seed, **filters)
            drawn = np.asarray(_sample(logits, st))
            assert drawn[0] in allowed[0] and drawn[1] in allowed[1], (temperature, seed, drawn)


def test_an_infinite_logit_is_certain_at_any_temperature():
    """A +inf logit: inf - inf was NaN in every probability and token 0 drawn at t > 0 (greedy took it)."""
    logits = np.zeros((4, 32), np.float32)
    logits[0, 3] = logits[1, 5] = logits[1, 9] = np.inf
    for temperature in (0.0, 1.0):
        st = SamplingTensors.create(4, temperature=temperature, seeds=[1, 2, 3, 4])
        probs = np.asarray(_probs(logits, st))
        assert probs[0, 3] == 1 and probs[0].sum() == 1 and np.isfinite(probs).all()
        assert (probs[1, [5, 9]] == (0.5 if temperature else [1, 0])).all() and probs[1].sum() == 1
        drawn = np.asarray(_sample(logits, st))
        assert drawn[0] == 3 and drawn[1] in (5, 9)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), r"temperature=-1.0 is invalid: allowed a finite float >= 0"),  # (reversed the dist.)
    (dict(temperature=float("nan")), "temperature=nan is invalid"),  # (NaN probabilities, token 0)
    (dict(temperature="0.5"), "temperature='0.5' is invalid"),
    (dict(min_p=2.0), r"min_p=2.0 is invalid: allowed a float in \[0, 1\]"),
    (dict(top_p=0.0), r"top_p=0.0 is invalid: allowed a float in \(0, 1\]"),
    (dict(top_k=2.7), "top_k=2.7 is invalid: allowed an integer"),  # (cut to 2)
    (dict(top_k=2**40), "top_k=1099511627776 is invalid"),  # (an int32 OverflowError)
    (dict(steps=2**40), "steps=1099511627776 is invalid"),
    (dict(seeds=2**64 + 5), "seeds=18446744073709551621 is invalid"),  # (folded onto seed 5's stream)
    (dict(temperature=[1.0, 2.0, 3.0]), r"temperature has shape \(3,\) for batch_size 2"),  # (numpy's broadcast)
])
def test_sampling_tensors_create_checks_its_values(kwargs, message):
    with pytest.raises(ValueError, match="SamplingTensors.create: " + message):
        SamplingTensors.create(2, **kwargs)
    st = SamplingTensors.create(2, temperature=[0.5, np.float32(1.0)], top_k=np.int64(5), seeds=[2**64 - 1, -1])
    assert np.asarray(st.top_k).tolist() == [5, 5] and np.asarray(st.seeds).tolist()[0] == np.asarray(st.seeds)[1]


def test_library_shape_errors_say_what_is_needed():
    """top_k_ids with k = 0 (which it allows) stacked nothing; 1-D logits to sample were read as V rows; greedy_verify
    with γ target positions, not γ + 1, failed inside a broadcast; mismatched vocabularies in rejection_sample too."""
    import jax.numpy as jnp

    from nightjar_jax.spec.rejection import greedy_verify, rejection_sample

    assert top_k_ids(jnp.ones((2, 6)), 0).shape == (2, 0)
    with pytest.raises(ValueError, match=r"sample: logits must be \[B, V\] \(a batch of rows\), got shape \(5,\)"):
        sample(jnp.zeros(5), SamplingTensors.create(1, temperature=1.0))
    with pytest.raises(ValueError, match=r"greedy_verify: target_logits has shape \(1, 2, 8\), needs \[1, 3, V\]"):
        greedy_verify(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2, 8)))
    with pytest.raises(ValueError, match=r"greedy_verify: draft_tokens has shape \(3,\), needs \[B, γ\]"):
        greedy_verify(jnp.zeros((3,), jnp.int32), jnp.zeros((2, 4, 8)))
    with pytest.raises(ValueError, match=r"max_accept has shape \(5,\), needs \[2\] \(one limit per row"):
        greedy_verify(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4, 8)), jnp.zeros((5,), jnp.int32))
    from nightjar_jax.engine.sampler import token_logprobs

    with pytest.raises(ValueError, match=r"token_logprobs: tokens has shape \(3,\), needs the logits' \(2,\)"):
        token_logprobs(jnp.zeros((2, 8)), jnp.zeros((3,), jnp.int32), 2)
    with pytest.raises(ValueError, match="draft_probs cover 8 tokens and target_probs 9"):
        rejection_sample(jnp.zeros((1, 2), jnp.int32), jnp.full((1, 2, 8), 1 / 8), jnp.full((1, 3, 9), 1 / 9),
                         SamplingTensors.create(1, temperature=1.0))


def test_sampling_params_take_numpy_scalars():
    """np.float64 passed as a float while np.float32, np.int64 and np.int32 were refused ("is invalid"): NumPy
    scalars are taken as the Python numbers they hold; a NumPy bool or array is still refused."""
    from nightjar_jax import SamplingParams

    sp = SamplingParams(temperature=np.float32(0.5), seed=np.int64(5), top_k=np.int32(3), max_tokens=np.int64(4))
    assert (sp.temperature, sp.seed, sp.top_k, sp.max_tokens) == (0.5, 5, 3, 4)
    assert type(sp.temperature) is float and type(sp.seed) is int
    for bad in (np.bool_(True), np.array([0.5])):
        with pytest.raises(ValueError, match="SamplingParams.temperature=.* is invalid"):
            SamplingParams(temperature=bad)
