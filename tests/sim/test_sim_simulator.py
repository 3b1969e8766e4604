"""The simulator: conservation, common random numbers, KV pressure, switching cost, oracles."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nightjar_jax.planner import make_planner
from nightjar_jax.sim import CostProfile, Phase, SimConfig, Simulator, build_oracles, make_trace
from nightjar_jax.sim.workload import MAX_TRACE_REQUESTS, Trace


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


def _hand_trace(**change) -> Trace:
    fields = dict(phases=(Phase("a", 10.0, 1.0),), arrival_seconds=[0.0, 1.0], prompt_lengths=[30, 40],
                  output_lengths=[5, 6], phase_index=[0, 0], seed=0)
    return Trace(**{**fields, **change})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"arrival_seconds": [0.0, float("nan")]}, "arrival_seconds must be finite and >= 0"),
        ({"arrival_seconds": [0.0, float("inf")]}, "arrival_seconds must be finite and >= 0"),
        ({"arrival_seconds": [5.0, 1.0]}, "arrival_seconds must be sorted"),
        ({"output_lengths": [5, 0]}, "output_lengths must be >= 1 token each, got minimum 0"),
        ({"prompt_lengths": [30]}, "one entry per request, got lengths"),
        ({"prompt_lengths": [30.5, 40.0]}, "prompt_lengths must be integers"),
        ({"phase_index": [0, 1]}, "phase_index entries must be in 0..0"),
        ({"phases": ()}, "phases must be a non-empty sequence of Phase"),
        ({"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_a_trace_built_by_hand_is_checked(change, message):
    """A NaN arrival made Simulator.run loop forever; an infinite one gave NaN latencies; an unsorted one served
    a request before it arrived; an output of 0 tokens was counted as 0 though one was generated."""
    with pytest.raises(ValueError, match=re.escape(message)):
        _hand_trace(**change)


def test_a_hand_built_trace_runs(profile):
    trace = _hand_trace()
    assert isinstance(trace.arrival_seconds, np.ndarray) and trace.prompt_lengths.dtype == np.int64
    result = Simulator(trace, profile, SimConfig(gamma_max=2)).run(make_planner("static:1", 2))
    assert result.total_tokens == 11 and np.all(result.latencies > 0)


def test_a_phase_too_large_for_a_trace_is_refused():
    with pytest.raises(ValueError, match="would draw about 1e\\+300 requests"):
        make_trace([Phase("huge", 10.0, 1e299)])
    assert MAX_TRACE_REQUESTS >= 1_000_000


def test_phase_seconds_start_at_the_trace_start(profile):
    """Phase 0 ran from the first arrival: a first phase that drew no request had negative seconds."""
    trace = make_trace([Phase("idle", 10.0, 0.0), Phase("busy", 10.0, 2.0)], seed=1)
    result = Simulator(trace, profile, SimConfig(gamma_max=2)).run(make_planner("static:1", 2))
    assert result.phase_seconds[0] == 10.0 and result.phase_tokens[0] == 0 and result.phase_seconds[1] >= 10.0


def test_switches_are_the_runs_own_for_a_warmed_planner(profile, trace):
    """The count was the planner's running total: a planner warmed on one run reported that run's switches too."""
    sim = Simulator(trace, profile, SimConfig(gamma_max=4))
    planner = make_planner("nightjar", 4)
    first = sim.run(planner)
    second = sim.run(planner)
    assert first.num_switches > 0
    assert second.num_switches == planner.num_switches - first.num_switches
