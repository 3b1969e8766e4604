"""Rejection sampler: the canonical speculative-decoding tests.

1. Greedy: the output is the target's argmax chain (all accepted, all rejected, first rejected, mid rejection).
2. Distribution: with random p, q (through top-k / top-p applied identically to both), the first committed token
   is distributed as p_0, and the second, given that d_0 was accepted, as p_1(· | d_0).
3. Negative controls: variants that ignore q fail the same test, so the test can fail.
4. The acceptance rate is sum_x min(p(x), q(x)); the mean accepted length matches its exact value.
5. With q == p everything is accepted and the bonus token is distributed as p_γ.

The statistical setup: NUM_ROWS rows, each its own request (seed), all with the same target and draft models;
the target's distribution at position 1 depends on the token at position 0 (a table), so the committed prefix
is checked as a sequence, not as independent positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from nightjar_jax.engine.sampler import SamplingTensors, processed_probs
from nightjar_jax.spec import rejection
from nightjar_jax.spec.rejection import PAD_TOKEN, draft_sample, greedy_verify, rejection_sample

NUM_ROWS = 20_000
VOCAB = 8
GAMMA = 2
MIN_P_VALUE = 1e-3  # a correct sampler fails a chi-square test about 1 run in 1000
BROKEN_MAX_P_VALUE = 1e-6  # a broken sampler must be rejected by a wide margin

_rejection_sample = jax.jit(rejection_sample, static_argnames="salt")
_greedy_verify = jax.jit(greedy_verify)
_draft_sample = jax.jit(draft_sample, static_argnames="salt")
_probs = jax.jit(processed_probs)


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `counts` to `probs` (any shape); cells under 5 expected draws are pooled."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    assert counts[probs <= 0].sum() == 0, "a token outside the target's support was committed"
    expected = probs / probs.sum() * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    observed_cells = np.append(counts[big], counts[small].sum())
    expected_cells = np.append(expected[big], expected[small].sum())
    if expected_cells[-1] == 0:
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    return float(stats.chisquare(observed_cells, expected_cells).pvalue)


class Experiment:
    """One batched verify step over NUM_ROWS requests with shared models and sampling parameters."""

    def __init__(self, *, same_draft: bool = False, top_k: int = 6, top_p: float = 0.95, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        target_0 = rng.standard_normal(VOCAB) * 1.5  # [V] position 0
        target_1 = rng.standard_normal((VOCAB, VOCAB)) * 1.5  # [V (token at 0), V] position 1 given d_0
        target_2 = rng.standard_normal(VOCAB) * 1.5  # [V] position 2 (bonus), fixed
        draft_0 = target_0 if same_draft else rng.standard_normal(VOCAB) * 1.5  # [V]
        draft_1 = target_1 if same_draft else rng.standard_normal((VOCAB, VOCAB)) * 1.5  # [V, V]
        self.st = SamplingTensors.create(
            NUM_ROWS, temperature=0.9, top_k=top_k, top_p=top_p, seeds=np.arange(NUM_ROWS) + 1000 * seed, steps=4
        )
        # The draft proposes d_0, then d_1 given d_0, with the same processing as the target.
        rows = lambda x: np.broadcast_to(x, (NUM_ROWS, VOCAB)).astype(np.float32)  # noqa: E731
        d_0, q_0 = _draft_sample(rows(draft_0), self.st)
        d_1, q_1 = _draft_sample(draft_1[np.asarray(d_0)].astype(np.float32), self.st._replace(steps=self.st.steps + 1))
        self.draft_tokens = jnp.stack([d_0, d_1], axis=1)  # [N, γ] int32
        self.draft_probs = jnp.stack([q_0, q_1], axis=1)  # [N, γ, V] f32
        target_logits = np.stack([rows(target_0), target_1[np.asarray(d_0)], rows(target_2)], axis=1).astype(
            np.float32
        )  # [N, γ + 1, V]
        self.target_probs = _probs(target_logits, self.st)  # [N, γ + 1, V] f32

        # Exact quantities from the processed distributions (numpy, float64).
        target_probs, draft_probs = np.asarray(self.target_probs, np.float64), np.asarray(self.draft_probs, np.float64)
        d_0 = np.asarray(d_0)
        self.p_0, self.q_0, self.p_2 = target_probs[0, 0], draft_probs[0, 0], target_probs[0, 2]
        self.p_1 = np.zeros((VOCAB, VOCAB))  # [V, V] p_1 given d_0 (rows for tokens never drafted stay 0)
        self.q_1 = np.zeros((VOCAB, VOCAB))
        for x in np.unique(d_0):
            first = np.flatnonzero(d_0 == x)[0]
            self.p_1[x], self.q_1[x] = target_probs[first, 1], draft_probs[first, 1]

    def run(self, draft_probs: jax.Array | None = None, fn=_rejection_sample) -> tuple[np.ndarray, np.ndarray]:
        output, num_accepted = fn(
            self.draft_tokens, self.draft_probs if draft_probs is None else draft_probs, self.target_probs, self.st
        )
        return np.asarray(output), np.asarray(num_accepted)

    def first_token_p_value(self, output: np.ndarray) -> float:
        return _chi_square_p_value(np.bincount(output[:, 0], minlength=VOCAB), self.p_0)

    def second_token_p_value(self, output: np.ndarray, num_accepted: np.ndarray) -> float:
        """(output[0], output[1]) given d_0 accepted ~ min(p_0, q_0)(x) * p_1(y | x), normalised."""
        pairs = output[num_accepted >= 1, :2]
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
        return _chi_square_p_value(counts, np.minimum(self.p_0, self.q_0)[:, None] * self.p_1)


@pytest.fixture(scope="module")
def experiment() -> Experiment:
    return Experiment()


# ---------------------------------------------------------------------------------------------------- greedy


def _greedy_case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target argmax chain [5, 7, 9, 4] for every row; drafts that stop at different places."""
    rng = np.random.default_rng(1)
    target_logits = rng.standard_normal((4, 4, 16)).astype(np.float32)  # [B, γ + 1, V]
    target_logits[:, np.arange(4), [5, 7, 9, 4]] = 10.0
    draft_tokens = np.array(
        [
            [5, 7, 9],  # all accepted -> bonus 4
            [1, 2, 3],  # all rejected
            [1, 7, 9],  # first rejected (the later matches do not count)
            [5, 7, 3],  # rejected in the middle
        ],
        np.int32,
    )
    expected = np.array([[5, 7, 9, 4], [5, -1, -1, -1], [5, -1, -1, -1], [5, 7, 9, -1]], np.int32)
    return draft_tokens, target_logits, expected


def test_greedy_verify_is_target_argmax_chain() -> None:
    draft_tokens, target_logits, expected = _greedy_case()
    output, num_accepted = _greedy_verify(draft_tokens, target_logits)
    np.testing.assert_array_equal(num_accepted, [3, 0, 0, 2])
    np.testing.assert_array_equal(output, expected)
    assert PAD_TOKEN == -1


def test_rejection_sample_greedy_rows_match_greedy_verify() -> None:
    draft_tokens, target_logits, expected = _greedy_case()
    # Rows 1 and 3 sampled at high temperature: they must not disturb the greedy rows 0 and 2.
    st = SamplingTensors.create(4, temperature=[0.0, 2.0, 0.0, 2.0], seeds=[1, 2, 3, 4])
    target_probs = _probs(target_logits, st)  # [4, 4, 16]
    draft_probs = _probs(np.random.default_rng(2).standard_normal((4, 3, 16)).astype(np.float32), st)
    output, num_accepted = _rejection_sample(draft_tokens, draft_probs, target_probs, st)
    np.testing.assert_array_equal(np.asarray(output)[[0, 2]], expected[[0, 2]])
    np.testing.assert_array_equal(np.asarray(num_accepted)[[0, 2]], [3, 0])
    all_greedy = st._replace(temperature=jnp.zeros(4))
    output, num_accepted = _rejection_sample(
        draft_tokens, _probs(target_logits[:, :3], all_greedy), _probs(target_logits, all_greedy), all_greedy
    )
    np.testing.assert_array_equal(output, expected)
    np.testing.assert_array_equal(num_accepted, [3, 0, 0, 2])


def test_greedy_verify_accepts_no_draft_past_max_accept() -> None:
    draft_tokens, target_logits, _ = _greedy_case()
    output, num_accepted = _greedy_verify(draft_tokens, target_logits, np.array([1, 3, 0, 2], np.int32))
    np.testing.assert_array_equal(num_accepted, [1, 0, 0, 2])
    # the final token sits at the limit: the target's argmax there (7 after the accepted 5)
    np.testing.assert_array_equal(output, [[5, 7, -1, -1], [5, -1, -1, -1], [5, -1, -1, -1], [5, 7, 9, -1]])


# ------------------------------------------------------------------------------------------- distribution


def test_first_committed_token_is_distributed_as_target(experiment: Experiment) -> None:
    output, num_accepted = experiment.run()
    assert ((num_accepted >= 0) & (num_accepted <= GAMMA)).all()
    position = np.arange(GAMMA + 1)
    assert (output[position[None, :] <= num_accepted[:, None]] >= 0).all()  # committed tokens are real
    assert (output[position[None, :] > num_accepted[:, None]] == PAD_TOKEN).all()
    # The draft really differs from the target here, or the test would prove nothing.
    assert 0.2 < np.minimum(experiment.p_0, experiment.q_0).sum() < 0.8
    assert experiment.first_token_p_value(output) > MIN_P_VALUE


def test_second_committed_token_given_acceptance_is_distributed_as_target(experiment: Experiment) -> None:
    output, num_accepted = experiment.run()
    assert experiment.second_token_p_value(output, num_accepted) > MIN_P_VALUE


@pytest.mark.parametrize("limit", [0, 1])
def test_a_row_limited_to_k_drafts_stays_distributed_as_target(experiment: Experiment, limit: int) -> None:
    """``max_accept`` k: no draft past k is accepted, and the token at k is drawn from p_k itself (no draft was
    tried there), not from the residual: the committed tokens stay distributed as the target's. The residual there
    would fail these tests (q differs from p here: the first test's check)."""
    st = experiment.st._replace(max_accept=jnp.full(NUM_ROWS, limit, jnp.int32))
    output, num_accepted = _rejection_sample(experiment.draft_tokens, experiment.draft_probs, experiment.target_probs,
                                             st)
    output, num_accepted = np.asarray(output), np.asarray(num_accepted)
    assert (num_accepted <= limit).all() and (num_accepted == limit).mean() > 0.2
    assert (output[:, limit + 1 :] == PAD_TOKEN).all()
    assert experiment.first_token_p_value(output) > MIN_P_VALUE
    if limit == 1:
        assert experiment.second_token_p_value(output, num_accepted) > MIN_P_VALUE


def test_negative_control_accepting_with_p_only_fails(experiment: Experiment) -> None:
    """Passing q = 1 everywhere accepts with u < p(d) and resamples from p: not lossless, must be caught."""
    output, _ = experiment.run(draft_probs=jnp.ones_like(experiment.draft_probs))
    assert experiment.first_token_p_value(output) < BROKEN_MAX_P_VALUE


def test_negative_control_resampling_from_p_fails(experiment: Experiment, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right acceptance test, but the recovered token drawn from p instead of norm(max(p - q, 0))."""
    monkeypatch.setattr(rejection, "_residual_probs", lambda p, q: p)
    broken = jax.jit(lambda *args: rejection.rejection_sample(*args))  # a fresh trace sees the patch
    output, _ = experiment.run(fn=broken)
    assert experiment.first_token_p_value(output) < BROKEN_MAX_P_VALUE


def test_copied_draft_token_as_a_point_mass_is_lossless(experiment: Experiment) -> None:
    """n-gram lookup's copied token (spec/lookup.py) is verified as a draw from a point mass on it (the runner's
    ``verify``): accepted with probability p(c), else a draw from p without c, so the first committed token is
    distributed as p. A wrong q for the copy (the draft's own) is caught."""
    c = int(np.argsort(experiment.p_0)[-2])  # a likely token that is not the mode
    assert 0.05 < experiment.p_0[c] < 0.95
    tokens = experiment.draft_tokens.at[:, 0].set(c)
    point_mass = experiment.draft_probs.at[:, 0].set(jax.nn.one_hot(c, VOCAB))
    output, num_accepted = map(np.asarray, _rejection_sample(tokens, point_mass, experiment.target_probs,
                                                             experiment.st))
    rate = (num_accepted >= 1).mean()
    assert abs(rate - experiment.p_0[c]) < 5 * np.sqrt(experiment.p_0[c] * (1 - experiment.p_0[c]) / NUM_ROWS)
    assert experiment.first_token_p_value(output) > MIN_P_VALUE
    output, _ = map(np.asarray, _rejection_sample(tokens, experiment.draft_probs, experiment.target_probs,
                                                  experiment.st))  # the copy verified with the draft's q: biased
    assert experiment.first_token_p_value(output) < BROKEN_MAX_P_VALUE


def test_a_constraint_that_refuses_drafts_is_lossless_through_its_mask_alone(experiment: Experiment) -> None:
    """A structured output's position 0 allows half the vocabulary (the target's p there masked and renormalised);
    the draft's q does not know it. Verified under the mask alone, a refused draft has p = 0 and is rejected into the
    residual: the first token is distributed as the masked p. Limiting the row's accepted drafts at a refused draft
    (0 when d_0 is refused: a limit that depends on the sampled draft) draws from p there instead of the residual:
    biased, and caught (the runner's ``_walk_constraints`` once did so)."""
    allowed = np.arange(VOCAB) % 2 == 0
    masked = np.asarray(experiment.target_probs).copy()
    masked[:, 0] *= allowed
    masked[:, 0] /= masked[:, 0].sum(axis=-1, keepdims=True)
    p_0 = masked[0, 0]
    refused = ~allowed[np.asarray(experiment.draft_tokens[:, 0])]
    assert 0.2 < refused.mean() < 0.8
    run = lambda st: np.asarray(_rejection_sample(experiment.draft_tokens, experiment.draft_probs,  # noqa: E731
                                                  jnp.asarray(masked), st)[0])
    output = run(experiment.st)
    assert allowed[output[:, 0]].all()
    assert _chi_square_p_value(np.bincount(output[:, 0], minlength=VOCAB), p_0) > MIN_P_VALUE
    limited = experiment.st._replace(max_accept=jnp.asarray(np.where(refused, 0, 2**30), jnp.int32))
    output = run(limited)
    assert _chi_square_p_value(np.bincount(output[:, 0], minlength=VOCAB), p_0) < BROKEN_MAX_P_VALUE


def test_acceptance_rate_and_mean_accepted_length(experiment: Experiment) -> None:
    _, num_accepted = experiment.run()
    alpha_0 = np.minimum(experiment.p_0, experiment.q_0).sum()  # P(d_0 accepted)
    rate = (num_accepted >= 1).mean()
    assert abs(rate - alpha_0) < 5 * np.sqrt(alpha_0 * (1 - alpha_0) / NUM_ROWS)
    # P(d_1 accepted and d_0 accepted) = sum_x min(p_0, q_0)(x) * sum_y min(p_1, q_1)(y | x).
    both = (np.minimum(experiment.p_0, experiment.q_0) * np.minimum(experiment.p_1, experiment.q_1).sum(1)).sum()
    expected_mean = alpha_0 + both
    variance = alpha_0 + 3 * both - expected_mean**2  # E[n^2] = P(n >= 1) + 3 P(n >= 2) for n in {0, 1, 2}
    assert abs(num_accepted.mean() - expected_mean) < 5 * np.sqrt(variance / NUM_ROWS)


def test_bonus_token_when_draft_equals_target() -> None:
    same = Experiment(same_draft=True, seed=3)
    np.testing.assert_array_equal(same.draft_probs, same.target_probs[:, :GAMMA])
    output, num_accepted = same.run()
    assert (num_accepted == GAMMA).all()
    np.testing.assert_array_equal(output[:, :GAMMA], same.draft_tokens)
    assert _chi_square_p_value(np.bincount(output[:, GAMMA], minlength=VOCAB), same.p_2) > MIN_P_VALUE


def test_residual_without_mass_falls_back_to_target() -> None:
    """p <= q everywhere (here p = q / 2, as rounding can make it) leaves no residual: draw from p instead."""
    st = SamplingTensors.create(4, temperature=1.0, seeds=[1, 2, 3, 4])
    q = _probs(np.random.default_rng(4).standard_normal((4, 4, 16)).astype(np.float32), st)  # [4, γ + 1, 16]
    draft_tokens = jnp.argmax(q[:, :3], axis=-1).astype(jnp.int32)  # [4, γ = 3]
    output, num_accepted = _rejection_sample(draft_tokens, q[:, :3], q / 2, st)
    output, num_accepted = np.asarray(output), np.asarray(num_accepted)
    final = output[np.arange(4), num_accepted]
    assert (final >= 0).all() and (final < 16).all()


def test_gamma_zero_is_a_plain_target_sample() -> None:
    st = SamplingTensors.create(4, temperature=[0.0, 1.0, 1.0, 0.0], seeds=[1, 2, 3, 4])
    target_probs = _probs(np.random.default_rng(5).standard_normal((4, 1, 16)).astype(np.float32), st)
    output, num_accepted = _rejection_sample(jnp.zeros((4, 0), jnp.int32), jnp.zeros((4, 0, 16)), target_probs, st)
    np.testing.assert_array_equal(num_accepted, 0)
    assert output.shape == (4, 1) and (np.asarray(target_probs)[np.arange(4), 0, np.asarray(output)[:, 0]] > 0).all()
