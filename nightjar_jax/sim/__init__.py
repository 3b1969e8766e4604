"""Trace-driven simulator for evaluating planners (pure Python + numpy, no JAX).

`CostProfile` (profile.py) holds the cost surface, `make_trace` (workload.py) draws a seeded request trace,
`Simulator` (simulator.py) replays it under any planner, `build_oracles` (oracle.py) makes hindsight references
(not upper bounds), and `build_synthetic_profile` (synthetic.py) writes a clearly-labelled roofline *model* profile.
"""

from __future__ import annotations

from nightjar_jax.sim.oracle import ScheduledPlanner, build_oracles
from nightjar_jax.sim.profile import DEFAULT_PROFILE, CostProfile
from nightjar_jax.sim.simulator import CellStats, SimConfig, SimResult, Simulator
from nightjar_jax.sim.synthetic import RooflineModel, build_synthetic_profile
from nightjar_jax.sim.workload import PRESETS, LengthDistribution, Phase, Trace, low_burst_low, make_trace, oscillating

__all__ = [
    "DEFAULT_PROFILE",
    "PRESETS",
    "CellStats",
    "CostProfile",
    "LengthDistribution",
    "Phase",
    "RooflineModel",
    "ScheduledPlanner",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Trace",
    "build_oracles",
    "build_synthetic_profile",
    "low_burst_low",
    "make_trace",
    "oscillating",
]
