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

MAX_TRACE_REQUESTS = 10_000_000  # per phase (a trace is arrays in memory, simulated step by step)


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

    def __post_init__(self) -> None:
        """Checks a trace built by hand as :func:`make_trace` builds one (a NaN arrival would stall the simulator's
        clock, an unsorted one serve a request before it arrived); lists become arrays."""
        if not self.phases or not all(isinstance(p, Phase) for p in self.phases):
            raise ValueError(f"phases must be a non-empty sequence of Phase, got {self.phases!r}")
        object.__setattr__(self, "phases", tuple(self.phases))
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        arrays = {}
        for name in ("arrival_seconds", "prompt_lengths", "output_lengths", "phase_index"):
            value = np.asarray(getattr(self, name))
            if value.ndim != 1:
                raise ValueError(f"{name} must be one-dimensional ([num_requests]), got shape {value.shape}")
            if name == "arrival_seconds":
                if value.size and not np.issubdtype(value.dtype, np.number):  # (bools are not numbers here)
                    raise ValueError(f"arrival_seconds must be numbers, got dtype {value.dtype}")
                value = value.astype(np.float64)
            elif value.size and not np.issubdtype(value.dtype, np.integer):
                raise ValueError(f"{name} must be integers, got dtype {value.dtype}")
            else:
                value = value.astype(np.int64)
            arrays[name] = value
            object.__setattr__(self, name, value)
        sizes = {name: len(v) for name, v in arrays.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the trace's arrays must all have one entry per request, got lengths {sizes}")
        arrival = arrays["arrival_seconds"]
        if not np.all(np.isfinite(arrival)) or np.any(arrival < 0):
            raise ValueError("arrival_seconds must be finite and >= 0 (seconds from the trace's start)")
        if np.any(np.diff(arrival) < 0):
            raise ValueError("arrival_seconds must be sorted (non-decreasing): requests are served in arrival order")
        for name in ("prompt_lengths", "output_lengths"):
            if np.any(arrays[name] < 1):
                raise ValueError(f"{name} must be >= 1 token each, got minimum {int(arrays[name].min())}")
        index = arrays["phase_index"]
        if np.any((index < 0) | (index >= len(self.phases))):
            raise ValueError(f"phase_index entries must be in 0..{len(self.phases) - 1} (one per phase)")

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
    for phase in phases:
        if phase.rate_per_second * phase.duration_seconds > MAX_TRACE_REQUESTS:
            expected = phase.rate_per_second * phase.duration_seconds
            raise ValueError(f"phase {phase.name!r} would draw about {expected:.3g} requests "
                             f"({phase.rate_per_second:g}/s for {phase.duration_seconds:g} s); a trace holds at most "
                             f"{MAX_TRACE_REQUESTS:,} per phase: lower the rate or the duration")
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
