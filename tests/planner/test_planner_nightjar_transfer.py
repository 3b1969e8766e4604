"""Nightjar's cheap cold start (choices 13-14 in nightjar.py): a relative neighbour prior that carries its
confidence, single-decision probes of dominated arms paid from a regret budget, and change detection on probes."""

from __future__ import annotations

import numpy as np
import pytest
from planner_synthetic_env import SyntheticEnv, run

from nightjar_jax.planner import Planner, make_planner

# The pre-transfer behaviour (absolute prior with no confidence, dominated arms never explored): for contrast.
BEFORE = {"prior_mode": "absolute", "prior_transfer_sd": float("inf"), "probe_length": 0}
# Speculation clearly does not pay: AR beats γ = 1 by 26% at batch 1 and by 36% at batch 64.
AR_WINS = {"alpha": 0.2, "per_draft": 0.006}
# ... and after a change it clearly does: γ = 2 is best at batch 8 (103.4 vs AR 75.8 tokens/s/seq).
SPEC_WINS = {"alpha": 0.8, "per_draft": 0.002}


def _sweeps(cycles: int) -> list[int]:
    """Batch sizes of `cycles` load swings 1 -> 64 -> 1 (each batch held for 4 decisions, 1200 per cycle)."""
    ramp = [int(round(2**x)) for x in np.linspace(0, 6, 150)]
    cycle = [b for b in ramp for _ in range(4)] + [b for b in ramp[::-1] for _ in range(4)]
    return cycle * cycles


@pytest.mark.parametrize("seed", [0, 1])
def test_dominated_arms_cost_little_across_contexts(seed):
    env = SyntheticEnv(**AR_WINS)
    assert all(env.best_gamma(b, 4) == 0 for b in (1, 8, 64))
    batches = _sweeps(6)
    results = {}
    for name, options in (("after", {}), ("before", BEFORE)):
        planner = make_planner("nightjar", 4, seed=seed, **options)
        gammas, regrets = run(planner, SyntheticEnv(**AR_WINS, seed=seed), batches)
        first = planner.context_of(1)  # the context that learns from scratch
        later = np.array([planner.context_of(b) != first for b in batches])
        speculative = (np.asarray(gammas) > 0) & later  # [decisions]
        per_cycle = speculative.reshape(6, -1).sum(axis=1)
        results[name] = (int(speculative.sum()), per_cycle, float(np.sum(regrets)))
    (after, per_cycle, regret_after), (before, _, regret_before) = results["after"], results["before"]
    # Later contexts inherit "γ > 0 is confidently worse" instead of each exploring it for whole bins ...
    assert after <= 0.3 * before, (after, before)
    assert after <= 0.01 * len(batches), after
    assert regret_after <= 0.6 * regret_before, (regret_after, regret_before)
    # ... and what remains are single-decision re-checks at a floor rate: a few per 1200-decision cycle.
    assert per_cycle[1:].max() <= 10, per_cycle


def test_dominated_arm_exploration_shrinks_within_a_context():
    env = SyntheticEnv(**AR_WINS, seed=2)
    planner = make_planner("nightjar", 4, seed=2)
    gammas, _ = run(planner, env, [32] * 32_000)
    per_4000 = (np.asarray(gammas) > 0).reshape(8, -1).sum(axis=1)
    assert per_4000[0] >= 10  # it did learn: every arm was tried first
    assert per_4000[1:].max() <= 6 and per_4000[4:].sum() <= per_4000[1:4].sum(), per_4000
    state = planner.contexts[planner.context_of(32)]
    assert 0 < sum(state.count[1:]) < 60  # probes kept sampling γ > 0, rarely


def test_converges_after_the_best_arm_changes():
    # 8000 decisions where AR wins (γ > 0 becomes confidently dominated), then the draft gets much better.
    reached = []
    for seed in range(3):
        env = SyntheticEnv(**AR_WINS, seed=seed)
        planner = make_planner("nightjar", 4, seed=seed)
        run(planner, env, [8] * 8000)
        assert planner.best_arms() == {planner.context_of(8): 0}
        env.alpha, env.per_draft = SPEC_WINS["alpha"], SPEC_WINS["per_draft"]
        best = env.best_gamma(8, 4)
        assert best == 2
        gammas, _ = run(planner, env, [8] * 8000)
        reached.append(float(np.mean(np.asarray(gammas)[-2000:] == best)))
    # A probe that beats its arm's estimate by > probe_reset_z predictive sds restarts the context.
    assert min(reached) > 0.8, reached


def test_without_probes_a_dominated_arm_is_never_rechecked():
    # The contrast for the test above: probe_length=0 (dominated arms skipped) stays on AR after the change.
    env = SyntheticEnv(**AR_WINS, seed=0)
    planner = make_planner("nightjar", 4, seed=0, probe_length=0)
    run(planner, env, [8] * 8000)
    env.alpha, env.per_draft = SPEC_WINS["alpha"], SPEC_WINS["per_draft"]
    gammas, _ = run(planner, env, [8] * 8000)
    assert np.mean(np.asarray(gammas)[-2000:] == 0) > 0.95


class _FlipEnv(SyntheticEnv):
    """AR wins up to batch 16, γ = 2 wins from batch 17 on: adjacent contexts with opposite rankings."""

    def _switch(self, batch: int) -> None:
        regime = SPEC_WINS if batch > 16 else AR_WINS
        self.alpha, self.per_draft = regime["alpha"], regime["per_draft"]

    def mean_reward(self, batch: int, gamma: int) -> float:
        self._switch(batch)
        return super().mean_reward(batch, gamma)

    def step(self, batch: int, gamma: int) -> tuple[int, float, float]:
        self._switch(batch)
        return super().step(batch, gamma)


def test_a_wrong_neighbour_prior_is_overcome():
    env = _FlipEnv(seed=3)
    assert env.best_gamma(16, 4) == 0 and env.best_gamma(23, 4) > 0
    planner = make_planner("nightjar", 4, seed=3)
    run(planner, env, [16] * 4000)  # γ > 0 confidently dominated next door ...
    gammas, _ = run(planner, env, [23] * 6000)  # ... and the new context inherits that, wrongly
    tail = np.asarray(gammas)[-1500:]
    assert np.mean(tail == env.best_gamma(23, 4)) > 0.7, np.bincount(tail, minlength=5)


def test_relative_prior_keeps_the_neighbours_ratios():
    relative, absolute = (make_planner("nightjar", 4, seed=4, prior_mode=mode) for mode in ("relative", "absolute"))
    for planner in (relative, absolute):
        run(planner, SyntheticEnv(**AR_WINS, seed=4), [4] * 2000)
        # A new context, 6 buckets away, seeded from the batch-4 one: its first bin (4 decisions) plays AR.
        gammas, _ = run(planner, SyntheticEnv(**AR_WINS, seed=5), [40] * 4)
        assert gammas == [0] * 4
    source, state = (relative.contexts[relative.context_of(b)] for b in (4, 40))
    # Per-sequence rewards at batch 40 are ~3x lower than at 4: the prior is rescaled, its ratios are kept ...
    assert relative.mean_reward(state, 0) < 0.5 * relative.mean_reward(source, 0)
    for arm in range(1, 5):
        ratio = relative.mean_reward(source, arm) / relative.mean_reward(source, 0)
        assert relative.mean_reward(state, arm) / relative.mean_reward(state, 0) == pytest.approx(ratio, rel=0.05)
    # ... while absolute priors keep batch-4 values, so the unmeasured arms look better than the measured AR.
    state = absolute.contexts[absolute.context_of(40)]
    assert absolute.mean_reward(state, 1) > absolute.mean_reward(state, 0)


def test_probe_state_round_trips_through_json():
    planner = make_planner("nightjar", 4, seed=5)
    env_a, env_b = SyntheticEnv(**AR_WINS, seed=5), SyntheticEnv(**AR_WINS, seed=5)
    run(planner, env_a, _sweeps(1))
    clone = Planner.from_json(planner.to_json())
    assert clone.to_json() == planner.to_json()
    env_b.rng.bit_generator.state = env_a.rng.bit_generator.state
    env_b.previous_gamma = env_a.previous_gamma
    assert run(clone, env_b, _sweeps(1))[0] == run(planner, env_a, _sweeps(1))[0]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"prior_mode": "nearest"}, "prior_mode"),
        ({"prior_transfer_sd": 0.0}, "prior_transfer_sd"),
        ({"prior_transfer_sd": -1.0}, "prior_transfer_sd"),
        ({"probe_length": -1}, "probe_length"),
        ({"probe_length": 1.5}, "probe_length"),
        ({"probe_length": True}, "probe_length"),
        ({"probe_budget": -0.1}, "probe_budget"),
        ({"probe_budget": 2.0}, "probe_budget"),
        ({"probe_budget": float("nan")}, "probe_budget"),
        ({"probe_reset_z": 0.0}, "probe_reset_z"),
        ({"prior_weight": float("inf")}, "prior_weight"),
    ],
)
def test_new_options_are_validated(options, field):
    with pytest.raises(ValueError, match=field):
        make_planner("nightjar", 4, **options)


def test_new_options_have_working_extremes():
    for options in (BEFORE, {"probe_budget": 0.0}, {"probe_reset_z": float("inf")}, {"probe_length": 3}):
        planner = make_planner("nightjar", 4, seed=6, **options)
        gammas, _ = run(planner, SyntheticEnv(**AR_WINS, seed=6), _sweeps(1))
        assert planner.best_arms()[planner.context_of(1)] == 0
        assert Planner.from_json(planner.to_json()).options == planner.options


def _wrongly_eliminated(probe_every_bin: bool, seed: int = 0):
    """A context that learned speculation (every γ > 0) from a few unlucky steps as far worse than AR, as a warm
    start can carry over, in an environment where γ = 2 is in fact best and AR 27% worse. No exploration bins
    (explore_scale=0), so only probes can re-check γ > 0. Returns the γs chosen and the per-step expected regret."""
    env = SyntheticEnv(**SPEC_WINS, seed=seed)
    assert env.best_gamma(8, 4) == 2
    planner = make_planner("nightjar", 4, seed=seed, explore_scale=0.0, probe_every_bin=probe_every_bin)
    for gamma in range(5):  # every arm tried 12 times; each γ > 0 committed 4-5 tokens per step for 8 sequences
        for i in range(12):
            planner.select(8)
            num_tokens, seconds, switch = env.step(8, gamma)
            if gamma > 0:
                num_tokens = 4 + i % 2
            planner.observe(gamma, 8, num_tokens, seconds, switch)
    state = planner.contexts[planner.context_of(8)]
    assert all(planner._dominated(state, g, 0) for g in range(1, 5))
    gammas, regrets = run(planner, env, [8] * 8_000)
    return np.asarray(gammas), np.asarray(regrets)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probe_every_bin_recovers_wrongly_eliminated_arms(seed):
    # Default (probes only in exploration bins): nothing ever re-checks γ > 0 here; it stays on AR.
    stuck, stuck_regret = _wrongly_eliminated(probe_every_bin=False, seed=seed)
    assert (stuck[-4000:] == 0).mean() > 0.99
    # probe_every_bin: a probe paid from the credit finds γ > 0 far above its estimate, change detection restarts
    # the context, and it relearns that speculation pays (γ = 2-4 are within 5% of one another, AR 27% below).
    recovered, recovered_regret = _wrongly_eliminated(probe_every_bin=True, seed=seed)
    assert (recovered[-4000:] > 0).mean() > 0.95, np.bincount(recovered[-4000:], minlength=5)
    assert recovered_regret[-4000:].mean() < 0.2 * stuck_regret[-4000:].mean()


def test_probe_every_bin_is_validated():
    with pytest.raises(ValueError, match="probe_every_bin"):
        make_planner("nightjar", 4, probe_every_bin="yes")
