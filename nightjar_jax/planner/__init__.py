"""Planners: choose the speculative length γ per decode step (Nightjar, arXiv 2512.22420, §4).

Pure Python + numpy; importing this package never imports JAX. Usage:

    from nightjar_jax.planner import make_planner
    planner = make_planner("nightjar", gamma_max=4)
    gamma = planner.select(batch_size, queue_len=q, free_pages=f, draft_on_device=True)
    planner.observe(gamma, batch_size, num_tokens, seconds, switch_seconds)

Registered names: "nightjar", "ar", "static" / "static:K", "banditspec", "dsd", "table". See `base.py` for the
vocabulary and contract, `nightjar.py` for the algorithm, and docs/planner.md.
"""

from __future__ import annotations

from nightjar_jax.planner import banditspec, dsd, fixed, nightjar  # noqa: F401  (registers the planners)
from nightjar_jax.planner.banditspec import BanditSpecOptions, BanditSpecPlanner
from nightjar_jax.planner.base import (
    Planner,
    known_planners,
    make_planner,
    register_planner,
    step_reward,
)
from nightjar_jax.planner.context import DEFAULT_BUCKET_EDGES, FINE_BUCKET_EDGES, bucket_label, bucket_of
from nightjar_jax.planner.decision_log import DecisionLogger, ReplayResult, read_log, replay
from nightjar_jax.planner.dsd import DsdOptions, DsdPlanner
from nightjar_jax.planner.fixed import AutoregressivePlanner, StaticPlanner, TablePlanner, default_table
from nightjar_jax.planner.nightjar import NightjarOptions, NightjarPlanner

__all__ = [
    "DEFAULT_BUCKET_EDGES",
    "FINE_BUCKET_EDGES",
    "AutoregressivePlanner",
    "BanditSpecOptions",
    "BanditSpecPlanner",
    "DecisionLogger",
    "DsdOptions",
    "DsdPlanner",
    "NightjarOptions",
    "NightjarPlanner",
    "Planner",
    "ReplayResult",
    "StaticPlanner",
    "TablePlanner",
    "bucket_label",
    "bucket_of",
    "default_table",
    "known_planners",
    "make_planner",
    "read_log",
    "register_planner",
    "replay",
    "step_reward",
]
