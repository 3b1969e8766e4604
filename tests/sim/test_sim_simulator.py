"""The simulator: conservation, common random numbers, KV pressure, switching cost, oracles."""

from __future__ import annotations

import numpy as np
import pytest

from nightjar_jax.planner import make_planner
from nightjar_jax.sim import CostProfile, Phase, SimConfig, Simulator, build_oracles, make_trace


@pytest.fixture(scope="module")
def profile() -> CostProfile:
    return CostProfile.from_json()


@pytest.fixture(scope="module")
def trace():
    return make_trace([Phase("low", 10, 2.0), Phase("high", 10, 20.0)], seed=3)


def test_trace_is_seeded_and_phased(trace):
    again = make_trace(list(trace.phases), seed=3)
    assert np.array_equal(trace.arrival_seconds, again.arrival_seconds)
    assert np.array_equal(trace.output_lengths, again.output_lengths)
    assert np.all(np.diff(trace.arrival_seconds) >= 0)
    high = trace.phase_index == 1
    assert high.sum() > 5 * (~high).sum()  # 10x the rate in the second phase
    with pytest.raises(ValueError, match="rate_per_second"):
        Phase("x", 1, -1)


@pytest.mark.parametrize("spec", ["ar", "static:3", "nightjar", "dsd"])
def test_every_request_finishes_and_tokens_are_conserved(profile, trace, spec):
    result = Simulator(trace, profile, SimConfig(gamma_max=4)).run(make_planner(spec, 4))
    assert np.all(np.isfinite(result.latencies)) and np.all(result.latencies > 0)
    assert np.all(result.ttfts <= result.latencies)
    assert sum(result.phase_tokens) == result.total_tokens == int(trace.output_lengths.sum())
    assert sum(result.gamma_counts.values()) == result.num_decode_steps
    if spec == "ar":
        assert result.switch_seconds == 0 and result.num_switches == 0


def test_common_random_numbers_make_runs_repeatable(profile, trace):
    simulator = Simulator(trace, profile, SimConfig(gamma_max=4, seed=1))
    a = simulator.run(make_planner("static:2", 4))
    b = simulator.run(make_planner("static:2", 4))
    assert a.summary() == b.summary()


def test_speculation_pays_at_low_load(profile):
    quiet = make_trace([Phase("quiet", 30, 0.5)], seed=0)
    simulator = Simulator(quiet, profile, SimConfig(gamma_max=4))
    ar, sd = simulator.run(make_planner("ar", 4)), simulator.run(make_planner("static:2", 4))
    assert sd.latencies.mean() < 0.8 * ar.latencies.mean()


def test_kv_pressure_preempts_but_loses_nothing(profile, trace):
    result = Simulator(trace, profile, SimConfig(gamma_max=2, kv_budget_pages=300)).run(make_planner("static:2", 2))
    assert result.num_preemptions > 0
    assert np.all(np.isfinite(result.latencies))
    with pytest.raises(ValueError, match="never fit"):
        Simulator(trace, profile, SimConfig(kv_budget_pages=10))


def test_catchup_is_charged_when_speculation_switches_back_on(profile, trace):
    result = Simulator(trace, profile, SimConfig(gamma_max=4)).run(make_planner("table", 4))
    assert result.num_switches > 0 and 0 < result.switch_seconds < result.busy_seconds


def test_oracles_follow_the_static_runs(profile, trace):
    simulator = Simulator(trace, profile, SimConfig(gamma_max=2))
    statics = {g: simulator.run(make_planner(f"static:{g}", 2)) for g in range(3)}
    per_phase, per_cell = build_oracles(statics, trace, SimConfig().bucket_edges, 2)
    assert set(per_phase.per_phase) == {0, 1} and per_cell.per_cell
    result = simulator.run(per_phase)
    assert sum(result.gamma_counts.values()) == result.num_decode_steps
    assert set(result.gamma_counts) <= set(per_phase.per_phase.values())


def test_a_trace_without_requests_is_a_clear_error(profile):
    """It raised ZeroDivisionError from the result's throughput after the run."""
    trace = make_trace([Phase("quiet", 10.0, 0.0)])
    assert trace.num_requests == 0
    with pytest.raises(ValueError, match=r"the trace has no requests .*'quiet'"):
        Simulator(trace, profile)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"step_noise": float("nan")}, "step_noise must be a finite number >= 0"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an int >= 1 or None"),
        ({"gamma_max": True}, "gamma_max must be an int >= 0"),
        ({"bucket_edges": (2, 4)}, "bucket_edges must start at 1"),
    ],
)
def test_sim_config_is_validated(options, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**options)
    assert SimConfig(max_num_seqs=np.int64(4), bucket_edges=[1, 8]).bucket_edges == (1, 8)


def test_phases_must_be_finite():
    with pytest.raises(ValueError, match="rate_per_second must be finite"):
        Phase("x", 1.0, float("inf"))
    with pytest.raises(ValueError, match="duration_seconds must be finite"):
        Phase("x", float("inf"), 1.0)
