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


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_planner_round_trips_json_mid_run(spec):
    env = SyntheticEnv(seed=2)
    planner = make_planner(spec, 4)
    run(planner, env, [3, 30, 60] * 40)
    clone = Planner.from_json(planner.to_json())
    assert type(clone) is type(planner) and clone.spec == planner.spec
    assert clone.to_json() == planner.to_json()
    assert [clone.select(b) for b in (3, 30, 60)] == [planner.select(b) for b in (3, 30, 60)]


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
