"""Workloads: seeded request traces with a piecewise-constant Poisson arrival rate.

Vocabulary: a **phase** is a stretch of wall time with a constant arrival rate (requests per second); a
**trace** is the list of requests (arrival time, prompt length, output length, phase) drawn from the phases
with a seeded RNG, so every planner is evaluated on the very same requests. Lengths are log-normal (the shape
of chat datasets such as ShareGPT), clipped to [min, max].
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    duration_seconds: float
    rate_per_second: float  # Poisson arrival rate in this phase

    def __post_init__(self) -> None:
        if not 0 < self.duration_seconds < math.inf:
            raise ValueError(
                f"phase {self.name!r}: duration_seconds must be finite and > 0, got {self.duration_seconds}"
            )
        if not 0 <= self.rate_per_second < math.inf:
            raise ValueError(
                f"phase {self.name!r}: rate_per_second must be finite and >= 0, got {self.rate_per_second}"
            )


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Log-normal token counts with the given median, clipped to [minimum, maximum]."""

    median: float
    sigma: float
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.minimum <= self.maximum):
            raise ValueError(f"bad length distribution {self}: need median > 0, sigma >= 0, 1 <= minimum <= maximum")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values = np.exp(np.log(self.median) + self.sigma * rng.standard_normal(n))
        return np.clip(np.round(values), self.minimum, self.maximum).astype(np.int64)


DEFAULT_PROMPT_LENGTHS = LengthDistribution(median=256, sigma=0.8, minimum=8, maximum=2048)
DEFAULT_OUTPUT_LENGTHS = LengthDistribution(median=192, sigma=0.7, minimum=4, maximum=1024)


@dataclasses.dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival. Arrays are [num_requests]."""

    phases: tuple[Phase, ...]
    arrival_seconds: np.ndarray  # [num_requests] float64
    prompt_lengths: np.ndarray  # [num_requests] int64
    output_lengths: np.ndarray  # [num_requests] int64
    phase_index: np.ndarray  # [num_requests] int64
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.arrival_seconds)

    @property
    def phase_ends(self) -> np.ndarray:
        """[num_phases] end time of each phase (the last one extends to the end of the run)."""
        return np.cumsum([p.duration_seconds for p in self.phases])

    def phase_at(self, seconds: float) -> int:
        return int(min(np.searchsorted(self.phase_ends, seconds, side="right"), len(self.phases) - 1))


def make_trace(
    phases: list[Phase] | tuple[Phase, ...],
    *,
    seed: int = 0,
    prompt_lengths: LengthDistribution = DEFAULT_PROMPT_LENGTHS,
    output_lengths: LengthDistribution = DEFAULT_OUTPUT_LENGTHS,
) -> Trace:
    """Draw a trace: Poisson arrivals at each phase's rate, then lengths, all from one seeded RNG."""
    if not phases:
        raise ValueError("phases must not be empty")
    rng = np.random.default_rng(seed)
    arrivals, indices, start = [], [], 0.0
    for i, phase in enumerate(phases):
        n = rng.poisson(phase.rate_per_second * phase.duration_seconds)
        arrivals.append(np.sort(start + phase.duration_seconds * rng.random(n)))
        indices.append(np.full(n, i, dtype=np.int64))
        start += phase.duration_seconds
    arrival = np.concatenate(arrivals)
    n = len(arrival)
    return Trace(
        phases=tuple(phases),
        arrival_seconds=arrival,
        prompt_lengths=prompt_lengths.sample(rng, n),
        output_lengths=output_lengths.sample(rng, n),
        phase_index=np.concatenate(indices),
        seed=seed,
    )


def low_burst_low(low: float = 2.0, burst: float = 24.0, seconds: float = 90.0) -> list[Phase]:
    """Quiet, then a burst above capacity, then quiet again."""
    return [Phase("low-1", seconds, low), Phase("burst", seconds, burst), Phase("low-2", seconds, low)]


def oscillating(low: float = 3.0, high: float = 20.0, period_seconds: float = 60.0, cycles: int = 3) -> list[Phase]:
    """Rates alternating between low and high every half period."""
    phases = []
    for c in range(cycles):
        phases += [Phase(f"low-{c + 1}", period_seconds / 2, low), Phase(f"high-{c + 1}", period_seconds / 2, high)]
    return phases


PRESETS = {"low-burst-low": low_burst_low, "oscillating": oscillating}
