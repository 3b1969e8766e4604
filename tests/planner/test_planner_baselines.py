"""Baselines and the shared interface: validation, registry, draft-off, JSON state, learning."""

from __future__ import annotations

import numpy as np
import pytest
from planner_synthetic_env import SyntheticEnv, run

from nightjar_jax.planner import Planner, known_planners, make_planner

ALL_SPECS = ["ar", "static", "static:2", "banditspec", "dsd", "table", "nightjar"]


def test_registry_lists_the_planners():
    assert set(known_planners()) >= {"ar", "static", "banditspec", "dsd", "table", "nightjar"}


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="known planners: .*nightjar"):
        make_planner("speedy", 4)


@pytest.mark.parametrize("gamma_max", [-1, 1.5, True, "4"])
def test_bad_gamma_max(gamma_max):
    with pytest.raises(ValueError, match="gamma_max"):
        make_planner("nightjar", gamma_max)


def test_static_above_gamma_max_is_a_clear_error():
    with pytest.raises(ValueError, match="K=5 exceeds gamma_max=4"):
        make_planner("static:5", 4)
    with pytest.raises(ValueError, match="static:K"):
        make_planner("static:x", 4)
    for spec in ("static:٢", "static: 2", "static:+2", "static:-1"):  # (int() took the first three; QA, 2026-12-07)
        with pytest.raises(ValueError, match=r"'static:K' with an int K >= 0 in digits 0-9"):
            make_planner(spec, 4)
    with pytest.raises(ValueError, match=r"gamma must be an int >= 0 or None .* got 2\.0"):
        make_planner("static:2", 4, gamma=2.0)  # (it passed as 2.0 == 2, the spec's 2 kept)
    assert make_planner("static:2", 4, gamma=2).gamma == 2


def test_unknown_option_and_bad_option_values():
    with pytest.raises(ValueError, match="no option"):
        make_planner("nightjar", 4, explore=2)
    with pytest.raises(ValueError, match="explore_scale"):
        make_planner("nightjar", 4, explore_scale=-1)
    with pytest.raises(ValueError, match="bucket_edges"):
        make_planner("nightjar", 4, bucket_edges=(2, 4))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_bad_inputs(spec):
    planner = make_planner(spec, 4)
    with pytest.raises(ValueError, match="batch_size"):
        planner.select(0)
    with pytest.raises(ValueError, match="gamma"):
        planner.observe(5, 1, 1, 0.01)
    with pytest.raises(ValueError, match="switch_seconds"):
        planner.observe(1, 1, 1, 0.01, switch_seconds=0.02)
    with pytest.raises(ValueError, match="seconds"):
        planner.observe(1, 1, 1, 0.0)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_draft_off_device_means_gamma_zero(spec):
    planner = make_planner(spec, 4)
    assert all(planner.select(b, draft_on_device=False) == 0 for b in (1, 2, 7, 300))
    assert planner.last_gamma == 0


def _twin_envs(env: SyntheticEnv) -> SyntheticEnv:
    twin = SyntheticEnv(seed=0)
    twin.rng.bit_generator.state = env.rng.bit_generator.state
    twin.previous_gamma = env.previous_gamma
    return twin


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("steps", [1, 13, 121])  # (not multiples of dsd's refit_every: its fit is then stale)
def test_every_planner_round_trips_json_mid_run_and_continues_identically(spec, steps):
    """Equal JSON is not enough: dsd's cached fit was not saved, so a restored dsd refitted at once and decided
    differently from the original, which kept its fit until `refit_every` more observations."""
    env = SyntheticEnv(seed=2)
    planner = make_planner(spec, 4)
    batches = np.random.default_rng(steps).choice([1, 2, 3, 30, 60], size=steps + 400)
    run(planner, env, batches[:steps])
    clone = Planner.from_json(planner.to_json())
    assert type(clone) is type(planner) and clone.spec == planner.spec
    assert clone.to_json() == planner.to_json()
    twin = _twin_envs(env)
    assert run(clone, twin, batches[steps:])[0] == run(planner, env, batches[steps:])[0]


def test_a_restored_dsd_keeps_the_fit_the_original_decides_with():
    """The QA repro: fitted on batch-2 steps, then big-batch steps before the next refit."""

    def step(p, b, g):
        p.observe(g, b, round(b * sum(0.7**i for i in range(g + 1))), 0.01 + 0.001 * b * (1 + g))

    original = make_planner("dsd", 4)
    for i in range(11):
        b = 2 if i < 10 else 64
        step(original, b, original.select(b))
    for _ in range(3):
        step(original, 64, original.select(64))
    restored = Planner.from_json(original.to_json())
    for _ in range(20):
        gamma = original.select(64)
        assert restored.select(64) == gamma
        step(original, 64, gamma)
        step(restored, 64, gamma)


@pytest.mark.parametrize("batch", [1, 8])
def test_dsd_adapts_when_the_batch_size_never_changes(batch):
    """Its latency model a + b·batch + c·batch·γ is rank-deficient at one batch size; it stayed at default_gamma
    for good. The minimum-norm fit predicts every γ at that batch exactly."""
    env = SyntheticEnv(alpha=0.8, per_draft=0.0005, seed=0)
    planner = make_planner("dsd", 4)
    gammas, _ = run(planner, env, [batch] * 1500)
    best = env.best_gamma(batch, 4)
    assert best >= 3  # (not default_gamma: staying there fails)
    assert np.bincount(gammas[-500:], minlength=5).argmax() == best
    a, b, c = planner.latency_coefficients()
    for gamma in range(5):
        assert a + b * batch + c * batch * gamma == pytest.approx(env.seconds(batch, gamma), rel=0.05)


def test_dsd_does_not_extrapolate_a_one_batch_size_fit():
    """Fitted at batch 1 alone, the split of a + b·batch is arbitrary: at batch 64 it predicted 0.34 s for γ = 0
    (true 0.042) and chose γ = 3 where 0 was best. Until a second batch size is seen, others get default_gamma."""
    env = SyntheticEnv(alpha=0.8, base=0.02, per_seq=0.002, per_draft=0.0, seed=0)
    planner = make_planner("dsd", 4)
    run(planner, env, [1] * 40)
    assert planner.only_batch_size() == 1 and planner.select(1) == env.best_gamma(1, 4) == 4
    assert env.best_gamma(64, 4) == 0 and planner.select(64) == 1  # default_gamma (the one-batch fit chose 3)
    run(planner, env, [64] * 20)
    assert planner.only_batch_size() is None


def test_dsd_needs_two_different_gammas_before_it_fits():
    planner = make_planner("dsd", 4, warmup_steps=0)
    run(planner, SyntheticEnv(seed=1), [4] * 50)
    assert planner.latency_coefficients() is None and planner.last_gamma == 1  # default_gamma, as documented


def test_gamma_max_zero_always_ar():
    for spec in ("nightjar", "banditspec", "dsd", "table", "static"):
        planner = make_planner(spec, 0)
        assert planner.select(1) == 0


def test_fixed_planners_and_switch_count():
    assert make_planner("ar", 4).select(1) == 0
    assert make_planner("static", 4).select(9) == 4
    static = make_planner("static:2", 4)
    assert [static.select(b) for b in (1, 100)] == [2, 2] and static.num_switches == 0
    table = make_planner("table", 4)
    assert [table.select(b) for b in (1, 4, 5, 16, 17, 32, 33, 500)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert table.num_switches == 3 and table.last_gamma == 0
    custom = make_planner("table", 3, table=((8, 3), (64, 1)))
    assert [custom.select(b) for b in (8, 9, 65)] == [3, 1, 0]
    with pytest.raises(ValueError, match="exceed gamma_max"):
        make_planner("table", 2, table=((8, 3),))


def test_banditspec_finds_the_best_arm_for_one_batch_size():
    env = SyntheticEnv(seed=3)
    planner = make_planner("banditspec", 4, exploration=0.2)
    gammas, _ = run(planner, env, [2] * 3000)
    assert np.bincount(gammas[-1000:], minlength=5).argmax() == env.best_gamma(2, 4)


def test_dsd_fits_acceptance_and_latency_and_picks_by_goodput():
    env = SyntheticEnv(alpha=0.7, noise=0.0, per_draft=0.0, seed=4)  # exactly the DSD latency model
    planner = make_planner("dsd", 4)
    assert planner.select(1) == 0  # warm-up cycles γ = 0, 1, ...
    rng = np.random.default_rng(0)
    gammas, _ = run(planner, env, rng.choice([1, 2, 8, 32, 64, 96], size=1500))
    assert planner.acceptance() == pytest.approx(0.7, abs=0.03)
    a, b, c = planner.latency_coefficients()
    assert b == pytest.approx(env.per_seq, rel=0.1) and c == pytest.approx(env.per_seq, rel=0.1)
    assert planner.select(1) >= 2 and planner.select(96) == 0
