"""Trace-driven simulator of the engine's decode loop, for evaluating planners at scale in seconds.

Vocabulary: a **step** is one engine iteration, either a **prefill step** (admitted prompts are processed and
each new request gets its first token) or a **decode step** (every running sequence gets 1 + accepted tokens).
The **KV budget** is a number of pages of `page_size` tokens; a running sequence holds the pages for its
tokens plus γ_max + 1 look-ahead slots. **Lag** is the number of tokens a sequence committed while γ = 0, which
the draft must catch up on (Nightjar, arXiv 2512.22420, §3-4) before the next γ > 0 step.

One decode step, as the engine does it:
  1. preempt the newest sequences (recompute later) while the KV budget is exceeded;
  2. γ = planner.select(batch, queue_len, free_pages);
  3. if γ > 0 and any lag: pay catch-up seconds for the summed lag (the switching cost) and clear it;
  4. step seconds from the cost profile at (batch, γ, mean context), times seeded log-normal noise;
  5. per sequence, draft i is accepted while U[position + i] < α_i, with U a per-request stream of uniforms
     drawn once per trace (common random numbers: every planner sees the same acceptance luck per token);
  6. planner.observe(γ, batch, committed tokens, step + switch seconds, switch seconds).

Simplifications (documented, deliberate): prefill runs the draft too (so new requests have no lag), prefill
and decode steps are not mixed (vLLM v0 style, prefill first), the draft is always on device.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import numbers
from typing import Any

import numpy as np

from nightjar_jax.planner.base import Planner, is_int
from nightjar_jax.planner.context import DEFAULT_BUCKET_EDGES, bucket_of, validate_bucket_edges
from nightjar_jax.sim.profile import CostProfile
from nightjar_jax.sim.workload import Trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    gamma_max: int = 4
    max_num_seqs: int | None = None  # None: the profile's
    kv_budget_pages: int | None = None  # None: the profile's
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step
    step_noise: float = 0.03  # sigma of the log-normal noise on step seconds
    seed: int = 0  # acceptance streams and step noise
    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES  # for per-bucket statistics

    def __post_init__(self) -> None:
        for field, minimum, none_allowed in (
            ("gamma_max", 0, False),
            ("max_num_seqs", 1, True),
            ("kv_budget_pages", 1, True),
            ("max_prefill_tokens", 1, False),
            ("seed", 0, False),
        ):
            value = getattr(self, field)
            if not (value is None and none_allowed) and (not is_int(value) or value < minimum):
                raise ValueError(f"{field} must be an int >= {minimum}{' or None' if none_allowed else ''}, "
                                 f"got {value!r}")
        if not (isinstance(self.step_noise, numbers.Real) and 0 <= self.step_noise < math.inf):
            raise ValueError(f"step_noise must be a finite number >= 0, got {self.step_noise!r}")
        object.__setattr__(self, "bucket_edges", validate_bucket_edges(self.bucket_edges))


@dataclasses.dataclass
class CellStats:
    """Decode steps of one (phase, batch bucket) cell."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    sequence_seconds: float = 0.0  # Σ step seconds × batch size
    gamma_counts: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_sequence_second(self) -> float:
        return self.tokens / self.sequence_seconds if self.sequence_seconds > 0 else 0.0


@dataclasses.dataclass
class SimResult:
    planner: str
    num_requests: int
    total_tokens: int  # output tokens of all requests
    makespan_seconds: float  # first arrival to last finish
    latencies: np.ndarray  # [num_requests] finish - arrival
    ttfts: np.ndarray  # [num_requests] first token - arrival
    num_decode_steps: int
    num_prefill_steps: int
    num_switches: int
    num_preemptions: int
    switch_seconds: float
    busy_seconds: float  # time spent in prefill and decode steps (including switches)
    gamma_counts: dict[int, int]
    phase_names: list[str]
    phase_tokens: list[int]  # [num_phases] tokens committed in steps that started in the phase
    phase_seconds: list[float]  # [num_phases] wall time of the phase (the last one runs to the end)
    phase_latency: list[float]  # [num_phases] mean latency of requests arriving in the phase
    cells: dict[tuple[int, int], CellStats]  # (phase, bucket) -> stats

    @property
    def throughput(self) -> float:
        """Output tokens per wall second, first arrival to last finish (arrival-limited when not saturated)."""
        return self.total_tokens / self.makespan_seconds

    @property
    def busy_throughput(self) -> float:
        """Output tokens per busy second: the device time the policy needed to serve the trace."""
        return self.total_tokens / self.busy_seconds

    def phase_throughput(self) -> list[float]:
        return [t / s if s > 0 else 0.0 for t, s in zip(self.phase_tokens, self.phase_seconds, strict=True)]

    def summary(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "num_requests": self.num_requests,
            "total_tokens": self.total_tokens,
            "makespan_seconds": self.makespan_seconds,
            "throughput_tokens_per_second": self.throughput,
            "busy_seconds": self.busy_seconds,
            "tokens_per_busy_second": self.busy_throughput,
            "mean_latency_seconds": float(self.latencies.mean()),
            "p90_latency_seconds": float(np.percentile(self.latencies, 90)),
            "mean_ttft_seconds": float(self.ttfts.mean()),
            "num_decode_steps": self.num_decode_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "num_switches": self.num_switches,
            "num_preemptions": self.num_preemptions,
            "switch_seconds": self.switch_seconds,
            "gamma_histogram": {str(g): n for g, n in sorted(self.gamma_counts.items())},
            "phases": [
                {"name": n, "tokens": t, "seconds": s, "throughput": tp, "mean_latency_seconds": lat}
                for n, t, s, tp, lat in zip(
                    self.phase_names,
                    self.phase_tokens,
                    self.phase_seconds,
                    self.phase_throughput(),
                    self.phase_latency,
                    strict=True,
                )
            ],
        }


class Simulator:
    """Replays one trace against one cost profile; `run(planner)` can be called for many planners."""

    def __init__(self, trace: Trace, profile: CostProfile, config: SimConfig | None = None) -> None:
        if trace.num_requests == 0:
            phases = [(p.name, p.duration_seconds, p.rate_per_second) for p in trace.phases]
            raise ValueError(
                f"the trace has no requests (its phases {phases} as (name, seconds, requests/s) drew none): nothing "
                "to simulate; use longer phases or higher rates"
            )
        self.trace, self.profile = trace, profile
        self.config = config or SimConfig()
        if self.config.gamma_max > profile.gamma_max:
            raise ValueError(f"gamma_max={self.config.gamma_max} exceeds the profile's {profile.gamma_max}")
        self.max_num_seqs = self.config.max_num_seqs or profile.max_num_seqs
        self.kv_budget_pages = self.config.kv_budget_pages or profile.kv_budget_pages
        self.page_size = profile.page_size
        longest = int(np.max(trace.prompt_lengths + trace.output_lengths, initial=0)) + self.config.gamma_max + 1
        if -(-longest // self.page_size) > self.kv_budget_pages:
            raise ValueError(f"a request of {longest} tokens can never fit in {self.kv_budget_pages} pages")
        # Common random numbers: one stream of uniforms per request, indexed by output position.
        rng = np.random.default_rng([self.config.seed, trace.seed, 1])
        lengths = trace.output_lengths + self.config.gamma_max + 1
        self._uniform_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [num_requests]
        self._uniforms = rng.random(int(lengths.sum()))  # [Σ lengths] float64
        self._alpha = np.asarray(profile.acceptance_per_position[: self.config.gamma_max])  # [gamma_max]

    def run(self, planner: Planner, name: str | None = None) -> SimResult:
        """Simulate the whole trace under `planner` (which must have gamma_max <= the config's)."""
        cfg, trace, profile = self.config, self.trace, self.profile
        if planner.gamma_max > cfg.gamma_max:
            raise ValueError(f"planner gamma_max={planner.gamma_max} exceeds the simulator's {cfg.gamma_max}")
        noise_rng = np.random.default_rng([cfg.seed, trace.seed, 2])
        n_req = trace.num_requests
        arrival, prompt, output = trace.arrival_seconds, trace.prompt_lengths, trace.output_lengths
        lookahead = cfg.gamma_max + 1
        capacity = self.max_num_seqs
        req = np.zeros(capacity, np.int64)  # [capacity] request id per slot
        ctx = np.zeros(capacity, np.int64)  # [capacity] tokens in the sequence (prompt + generated)
        gen = np.zeros(capacity, np.int64)  # [capacity] generated tokens
        lag = np.zeros(capacity, np.int64)  # [capacity] tokens the draft has not seen
        n = 0
        waiting: collections.deque[tuple[int, int]] = collections.deque()  # (request, generated so far)
        finish = np.full(n_req, np.nan)
        first_token = np.full(n_req, np.nan)
        num_phases = len(trace.phases)
        phase_tokens = [0] * num_phases
        cells: dict[tuple[int, int], CellStats] = {}
        gamma_counts: dict[int, int] = collections.Counter()
        t = float(arrival[0]) if n_req else 0.0
        next_arrival = 0
        decode_steps = prefill_steps = preemptions = num_done = 0
        switch_total = busy = 0.0
        clock = getattr(planner, "set_clock", None)
        switches_before = planner.num_switches  # (a planner warmed on another run has counted its switches)
        phase_ends = [float(e) for e in trace.phase_ends[:-1]]  # phase i ends at phase_ends[i]

        def pages(tokens: np.ndarray | int) -> np.ndarray | int:
            return -(-(tokens + lookahead) // self.page_size)

        while num_done < n_req:
            while next_arrival < n_req and arrival[next_arrival] <= t:
                waiting.append((next_arrival, 0))
                next_arrival += 1
            if n == 0 and not waiting:
                t = float(arrival[next_arrival])
                continue
            used = int(pages(ctx[:n]).sum()) if n else 0
            phase = bisect.bisect_right(phase_ends, t)
            # ---- prefill step: admit FIFO while slots, pages and the prefill token budget allow
            admitted, prefill_tokens = [], 0
            while waiting and n + len(admitted) < capacity:
                r, done = waiting[0]
                tokens = int(prompt[r]) + done
                need = pages(tokens)
                if used + need > self.kv_budget_pages or (
                    admitted and prefill_tokens + tokens > cfg.max_prefill_tokens
                ):
                    break
                waiting.popleft()
                admitted.append((r, done))
                used += need
                prefill_tokens += tokens
            if admitted:
                t += profile.prefill_seconds(prefill_tokens)
                busy += profile.prefill_seconds(prefill_tokens)
                prefill_steps += 1
                for r, done in admitted:
                    req[n], gen[n], lag[n] = r, max(done, 1), 0
                    ctx[n] = prompt[r] + gen[n]
                    if done == 0:
                        first_token[r] = t
                        phase_tokens[phase] += 1
                    n += 1
                n, num_done = self._retire(n, req, ctx, gen, lag, output, finish, t, num_done)
                continue
            # ---- decode step
            while used > self.kv_budget_pages and n > 1:  # preempt the newest sequence, recompute later
                n -= 1
                used -= int(pages(ctx[n]))
                waiting.appendleft((int(req[n]), int(gen[n])))
                preemptions += 1
            if clock is not None:
                clock(t)
            batch = n
            gamma = planner.select(batch, queue_len=len(waiting), free_pages=max(self.kv_budget_pages - used, 0))
            switch = 0.0
            if gamma > 0:
                missed = int(lag[:n].sum())
                if missed:
                    switch = profile.catchup_seconds(missed)
                    lag[:n] = 0
            step = profile.step_seconds(batch, gamma, float(ctx[:n].mean()))
            if cfg.step_noise:
                step *= float(np.exp(cfg.step_noise * noise_rng.standard_normal()))
            remaining = output[req[:n]] - gen[:n]  # [n]
            if gamma > 0:
                index = self._uniform_offsets[req[:n], None] + gen[:n, None] + np.arange(gamma)  # [n, gamma]
                accepted = (self._uniforms[index] < self._alpha[:gamma]).cumprod(axis=1).sum(axis=1)  # [n]
                committed = np.minimum(accepted + 1, remaining)
            else:
                committed = np.minimum(1, remaining)
                lag[:n] += committed
            gen[:n] += committed
            ctx[:n] += committed
            num_tokens = int(committed.sum())
            t += step + switch
            busy += step + switch
            planner.observe(gamma, batch, num_tokens, step + switch, switch)
            decode_steps += 1
            switch_total += switch
            gamma_counts[gamma] += 1
            phase_tokens[phase] += num_tokens
            cell = cells.setdefault((phase, bucket_of(batch, cfg.bucket_edges)), CellStats())
            cell.steps += 1
            cell.tokens += num_tokens
            cell.seconds += step
            cell.sequence_seconds += step * batch
            cell.gamma_counts[gamma] = cell.gamma_counts.get(gamma, 0) + 1
            n, num_done = self._retire(n, req, ctx, gen, lag, output, finish, t, num_done)

        starts = np.concatenate([[0.0], trace.phase_ends[:-1]])  # (phase 0 starts with the trace, not a request)
        phase_seconds = [float(trace.phase_ends[i] - starts[i]) for i in range(num_phases)]
        phase_seconds[-1] = max(t - starts[-1], phase_seconds[-1]) if n_req else phase_seconds[-1]
        latencies = finish - arrival
        phase_latency = [
            float(latencies[trace.phase_index == i].mean()) if np.any(trace.phase_index == i) else float("nan")
            for i in range(num_phases)
        ]
        return SimResult(
            planner=name or planner.spec,
            num_requests=n_req,
            total_tokens=int(output.sum()),
            makespan_seconds=t - (float(arrival[0]) if n_req else 0.0),
            latencies=latencies,
            ttfts=first_token - arrival,
            num_decode_steps=decode_steps,
            num_prefill_steps=prefill_steps,
            num_switches=planner.num_switches - switches_before,
            num_preemptions=preemptions,
            switch_seconds=switch_total,
            busy_seconds=busy,
            gamma_counts=dict(gamma_counts),
            phase_names=[p.name for p in trace.phases],
            phase_tokens=phase_tokens,
            phase_seconds=phase_seconds,
            phase_latency=phase_latency,
            cells=cells,
        )

    @staticmethod
    def _retire(n, req, ctx, gen, lag, output, finish, t, num_done) -> tuple[int, int]:
        """Drop finished sequences (record their finish time), compacting the slot arrays."""
        done = gen[:n] >= output[req[:n]]
        if not done.any():
            return n, num_done
        finish[req[:n][done]] = t
        keep = ~done
        m = int(keep.sum())
        for array in (req, ctx, gen, lag):
            array[:m] = array[:n][keep]
        return m, num_done + int(done.sum())
