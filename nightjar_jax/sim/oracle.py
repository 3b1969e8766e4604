"""Hindsight oracles for the simulator, built from separate static-γ runs on the same trace.

Vocabulary: a **cell** is a (phase, batch bucket) pair. The per-phase oracle plays, in each phase, the static
γ whose run had the highest tokens per second per sequence over that phase's decode steps; the per-cell oracle
does the same per (phase, bucket), falling back to the per-phase choice in cells a static run never visited.
They know the future phase structure, so they are not deployable planners (not registered).

They are hindsight *references*, not upper bounds, not even over the static runs they are built from: the choice
is made per phase on decode-only tokens per sequence-second of the static runs, while the rows are compared on
tokens per busy second (prefill and switches included) of the oracle's own run, whose queue and batch sizes
differ from those of every static run once it changes γ. A static row can beat them (static:2 beat oracle:phase
by 0.62% on low-burst-low, seed 0, synthetic profile); `scripts/sim_planners.py` prints a note when one does.
"""

from __future__ import annotations

from nightjar_jax.planner.base import Planner
from nightjar_jax.planner.context import bucket_of
from nightjar_jax.sim.simulator import CellStats, SimResult
from nightjar_jax.sim.workload import Trace


class ScheduledPlanner(Planner):
    """Plays a fixed γ per (phase, bucket); the simulator tells it the time through `set_clock`."""

    name = "oracle"

    def __init__(
        self,
        gamma_max: int,
        trace: Trace,
        bucket_edges: tuple[int, ...],
        per_phase: dict[int, int],
        per_cell: dict[tuple[int, int], int] | None = None,
        *,
        spec: str = "oracle",
    ) -> None:
        super().__init__(gamma_max, spec=spec)
        self.trace, self.bucket_edges = trace, bucket_edges
        self.per_phase, self.per_cell = per_phase, per_cell or {}
        self._phase = 0

    def set_clock(self, seconds: float) -> None:
        self._phase = self.trace.phase_at(seconds)

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        key = (self._phase, bucket_of(batch_size, self.bucket_edges))
        return self.per_cell.get(key, self.per_phase[self._phase])


def _best(candidates: dict[int, CellStats]) -> int:
    return max(candidates, key=lambda g: (candidates[g].tokens_per_sequence_second, -g))


def build_oracles(
    static_results: dict[int, SimResult], trace: Trace, bucket_edges: tuple[int, ...], gamma_max: int
) -> tuple[ScheduledPlanner, ScheduledPlanner]:
    """(per-phase oracle, per-(phase, bucket) oracle) from static runs keyed by their γ."""
    per_phase: dict[int, int] = {}
    for phase in range(len(trace.phases)):
        merged: dict[int, CellStats] = {}
        for gamma, result in static_results.items():
            total = CellStats()
            for (p, _), cell in result.cells.items():
                if p == phase:
                    total.tokens += cell.tokens
                    total.sequence_seconds += cell.sequence_seconds
            merged[gamma] = total
        per_phase[phase] = _best(merged)
    keys = {key for result in static_results.values() for key in result.cells}
    per_cell = {
        key: _best({g: r.cells[key] for g, r in static_results.items() if key in r.cells and r.cells[key].steps >= 20})
        for key in keys
        if any(key in r.cells and r.cells[key].steps >= 20 for r in static_results.values())
    }
    return (
        ScheduledPlanner(gamma_max, trace, bucket_edges, per_phase, spec="oracle:phase"),
        ScheduledPlanner(gamma_max, trace, bucket_edges, per_phase, per_cell, spec="oracle:phase×bucket"),
    )
