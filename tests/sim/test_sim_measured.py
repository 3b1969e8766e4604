"""The checked-in profile measured by the engine (scripts/measure_profile.py): it loads, its values are sane, and
the simulator runs on it with a rate-scaled workload."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from nightjar_jax.planner import make_planner
from nightjar_jax.sim import CostProfile, SimConfig, Simulator, make_trace
from nightjar_jax.sim.profile import PROFILES_DIR

MEASURED = PROFILES_DIR / "measured_stories260k_cpu.json"
SIM_PLANNERS = Path(__file__).resolve().parents[2] / "scripts" / "sim_planners.py"


@pytest.fixture(scope="module")
def profile() -> CostProfile:
    return CostProfile.from_json(MEASURED)


@pytest.fixture(scope="module")
def sim_planners():
    spec = importlib.util.spec_from_file_location("sim_planners", SIM_PLANNERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_profile_loads_and_says_what_it_is(profile):
    assert profile.kind == "measured"
    assert "stories260k" in profile.target and "skip" in profile.draft
    assert profile.device and "measure_profile.py" in profile.notes and "load average" in profile.notes
    assert profile.gammas == tuple(range(profile.gamma_max + 1)) and profile.gamma_max >= 1
    assert len(profile.batch_sizes) >= 4 and len(profile.context_lengths) >= 2
    assert profile.max_num_seqs == max(profile.batch_sizes)


def test_measured_values_are_sane(profile):
    grid = np.asarray(profile.step_seconds_grid)  # [nb][ng][nc]
    assert np.all(grid > 0) and np.all(grid < 10.0)
    # Speculating costs more than not at the same batch and context (draft + wider verify on top of AR).
    assert np.all(grid[:, 1:, :] > grid[:, :1, :])
    # Monotonic-ish: the largest batch costs more than the smallest (per step), and γ_max more than γ = 1
    # at most cells (timings are noisy on a shared CPU, so no strict cell-by-cell order).
    assert np.all(grid[-1] > grid[0])
    assert np.mean(grid[:, -1, :] > grid[:, 1, :]) >= 0.75
    assert all(0.0 <= a <= 1.0 for a in profile.acceptance_per_position)
    assert 1.0 <= profile.expected_tokens(profile.gamma_max) <= 1 + profile.gamma_max
    assert profile.prefill_seconds(256) > 0 and profile.prefill_seconds_per_token >= 0
    assert profile.catchup_seconds(256) > 0 and profile.catchup_seconds(0) == 0.0


def test_auto_rate_scale_targets_ar_capacity(profile, sim_planners):
    capacity = sim_planners.ar_capacity_requests_per_second(profile)
    assert capacity > 0
    scale = sim_planners.auto_rate_scale(profile, "low-burst-low", 10.0)
    phases = sim_planners.preset_phases("low-burst-low", 10.0, scale)
    busiest = max(p.rate_per_second for p in phases)
    assert busiest == pytest.approx(sim_planners.AUTO_HIGH_LOAD * capacity)
    unscaled = sim_planners.preset_phases("low-burst-low", 10.0)
    assert sim_planners.preset_phases("low-burst-low", 10.0, 1.0) == unscaled  # default: unchanged
    assert [p.rate_per_second / q.rate_per_second for p, q in zip(phases, unscaled, strict=True)] == pytest.approx(
        [scale] * len(phases)
    )


@pytest.mark.parametrize("spec", ["ar", "static:2", "nightjar"])
def test_short_sim_on_measured_profile_conserves_tokens(profile, sim_planners, spec):
    scale = sim_planners.auto_rate_scale(profile, "low-burst-low", 4.0)
    phases = sim_planners.preset_phases("low-burst-low", 4.0, scale)
    trace = make_trace(phases, seed=1)
    assert trace.num_requests > 10
    config = SimConfig(gamma_max=profile.gamma_max, seed=1)
    result = Simulator(trace, profile, config).run(make_planner(spec, profile.gamma_max))
    assert sum(result.phase_tokens) == result.total_tokens == int(trace.output_lengths.sum())
    assert np.all(np.isfinite(result.latencies)) and np.all(result.latencies > 0)
    assert sum(result.gamma_counts.values()) == result.num_decode_steps
    if spec == "ar":
        assert set(result.gamma_counts) == {0}


def test_cold_nightjar_keeps_up_with_ar_where_speculation_never_pays(profile, sim_planners):
    # On this profile AR beats every γ > 0 (nearly) everywhere, so every speculative step is exploration cost.
    scale = sim_planners.auto_rate_scale(profile, "low-burst-low", 15.0)
    trace = make_trace(sim_planners.preset_phases("low-burst-low", 15.0, scale), seed=1)
    simulator = Simulator(trace, profile, SimConfig(gamma_max=profile.gamma_max, seed=1))
    ar = simulator.run(make_planner("ar", profile.gamma_max)).busy_throughput
    nightjar = simulator.run(make_planner("nightjar", profile.gamma_max)).busy_throughput
    # The pre-transfer exploration (absolute prior, dominated arms never re-checked): each bucket the burst
    # sweeps through explores γ > 0 for whole bins. It cost ~9% here; confidence transfer and probes make it ~0.3%.
    before = make_planner(
        "nightjar", profile.gamma_max, prior_mode="absolute", prior_transfer_sd=float("inf"), probe_length=0
    )
    assert simulator.run(before).busy_throughput < 0.97 * ar
    assert nightjar >= 0.99 * ar, (nightjar, ar)


def test_nightjar_variant_option_parses_and_validates(sim_planners):
    import argparse

    name, options = sim_planners.parse_variant('before={"prior_transfer_sd": Infinity, "probe_length": 0}')
    assert name == "before" and options == {"prior_transfer_sd": float("inf"), "probe_length": 0}
    for bad in ("before", "nightjar={}", "x=[1]", "x={bad json}", 'x={"probe_length": -1}', 'x={"nope": 1}'):
        with pytest.raises(argparse.ArgumentTypeError):
            sim_planners.parse_variant(bad)


def test_default_pair_profile_has_the_crossover_it_was_measured_with():
    """measured_smollm2_draft_cpu.json (docs/benchmarks.md, issue 6): per token, γ = 1 beats AR at batch 1 and AR
    beats every γ > 0 at batch 32, so an adaptive planner has something to learn on it."""
    p = CostProfile.from_json(PROFILES_DIR / "measured_smollm2_draft_cpu.json")
    assert p.kind == "measured" and "smollm2" in p.target and p.draft == "smollm2-draft"
    assert p.gamma_max == 3 and all(0.1 < a < 0.6 for a in p.acceptance_per_position)

    def seconds_per_token(batch: int, gamma: int, context: float) -> float:
        return p.step_seconds(batch, gamma, context) / p.expected_tokens(gamma)

    for context in p.context_lengths:
        assert seconds_per_token(1, 1, context) < seconds_per_token(1, 0, context)
        assert all(seconds_per_token(32, g, context) > seconds_per_token(32, 0, context) for g in (1, 2, 3))


def test_measure_profile_refuses_gamma_max_zero(monkeypatch, capsys):
    """--gamma-max 0 wrote NaN acceptance rates into the profile's JSON; it is a usage error before any model
    loads."""
    spec = importlib.util.spec_from_file_location("measure_profile", SIM_PLANNERS.parent / "measure_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", ["measure_profile.py", "--gamma-max", "0"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2 and "argument --gamma-max: expected an integer >= 1" in capsys.readouterr().err


def test_sigterm_stops_the_workers_too(tmp_path):
    """``--jobs N``: a SIGTERM to the script alone left its N workers hung for good (orphans blocked on the result
    pipe, QA 2026-12-07); now they are terminated with it and it exits 143."""
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "stderr.txt"  # (a file: orphaned workers would hold a pipe open, and reading it hung)
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(SIM_PLANNERS), "--jobs", "2", "--out", str(tmp_path / "sim.json")],
                                stdout=subprocess.DEVNULL, stderr=err)
    children: set[int] = set()
    deadline = time.monotonic() + 120
    while len(children) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                children |= {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                pass
    assert len(children) >= 2, "the workers never started"
    time.sleep(1.0)  # (the workers busy with a simulation)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # (it hung: killed, and the test fails below)
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20

    def alive() -> list[int]:
        out = []
        for c in children:
            try:
                if Path(f"/proc/{c}/stat").read_text().split()[2] != "Z":
                    out.append(c)
            except OSError:
                pass
        return out

    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive()
    for c in left:  # (never leave them behind, even when the test fails)
        os.kill(c, signal.SIGKILL)
    assert proc.returncode == 143, log.read_text()[-2000:]
    assert not left, f"workers {left} outlived the SIGTERM"
