"""Nightjar: a contextual bandit over γ with blocks, bins and a priced switch (arXiv 2512.22420, §4).

Vocabulary (see also `base.py`):

- **arm**: a γ ∈ {0..γ_max}. **context**: the bucket of the decode batch size (`context.py`).
- **block**: per context, decisions are grouped in blocks of exponentially growing length; block j holds
  2^(j-1) decisions of that context.
- **bin**: a block is cut into bins of about √(block length) decisions; the arm of a context only changes at a
  bin boundary, so a context makes O(√T) arm changes over T decisions (bounded switching).
- **exploration bin**: bin k (1-based within its block) explores with probability min(1, explore_scale / k)
  — it plays the least-played alternative arm; otherwise the bin exploits the arm with the best estimated
  reward. Because later bins of a block explore less, and bins grow, the exploration cost per block is
  O(√L · log L) and cumulative regret against the best fixed arm per context grows like √T (up to logs).
- **reward**: committed tokens per second per sequence, `num_tokens / step_seconds / batch_size`.
- **switching cost**: turning speculation back on (γ = 0 → γ > 0) makes the draft catch up on the tokens it
  skipped (or be reloaded). Its measured seconds (`switch_seconds` in `observe`) are learned per context and
  charged to γ > 0 arms when the previous step ran γ = 0, amortised over the bin:
  value(γ) = r̄(γ) · s̄(γ) / (s̄(γ) + Ŝ / bin_length), i.e. the bin's tokens over the bin's time plus one switch.

Choices where the paper leaves room (why each, also in docs/planner.md):

1. Reward normalisation *per sequence*. Within one context, arms are compared at (almost) the same batch
   size, so dividing by the batch size hardly changes the ranking; it removes the bias that buckets span
   several batch sizes (a bucket 16-31 would otherwise favour whichever arm happened to run at 31), and keeps
   rewards of all contexts on one scale (tokens/s of one stream), which makes logs comparable.
2. Step seconds exclude `switch_seconds`: the switch is priced explicitly (above), so it must not also
   depress the estimate of the arm that happened to pay it.
3. The first block of a context has 2^(first_block_exponent-1) decisions (default 16, bins of 4), not 1:
   blocks of 1, 2, 4 decisions would give bins of 1-2 decisions, i.e. a possible switch every step while the
   planner knows nothing. It only shifts the block sequence; the growth and √ bin law are the paper's.
4. Every arm is played for one bin before any exploitation (untried arms count as best), so estimates exist
   for all arms; this is the usual bandit initialisation.
5. Exploration plays the least-played alternative (ties broken at random), not a uniform one, so coverage
   of all arms is deterministic. `explore_arms="neighbors"` restricts it to γ±1 of the greedy arm, using that
   tokens/s is close to unimodal in γ (acceptance decays, cost grows linearly).
6. An exploration bin may not cross between γ = 0 and γ > 0 (either way: going to 0 is free but coming back
   pays) while one switch would cost more than `max_explore_switch_overhead` of the bin's run time. Bins grow
   as √L, so the overhead shrinks and exploration across the boundary resumes later; with a large switch cost
   this is what stops 0 ↔ γ flapping.
7. Switch cost per context is an exponential moving average of measured switch seconds (weight
   `switch_cost_smoothing` on the newest); a context with no measurement yet borrows the mean of the measured
   contexts, else `initial_switch_seconds`. `last_gamma` (global) decides whether the draft is behind.
8. Estimates are running means (or discounted with `reward_discount` < 1 for drifting environments) and
   persist across blocks: blocks schedule exploration, they do not reset knowledge.
9. A decision forced by `draft_on_device=False` is not a bandit decision: the bin clock does not advance.
10. A context seen for the first time starts from the per-arm means of the nearest visited context, as
   `prior_weight` pseudo-observations (default 1, i.e. one step's worth; 0 turns it off). Under changing load
   the batch size sweeps through buckets that each see few decisions; without a prior every new bucket would
   play every arm for a bin before exploiting. The ranking of arms changes slowly with the batch size, so the
   neighbour is a good first guess, and one pseudo-observation is overwritten by the context's own data fast.
11. Buckets with ratio ~√2 (`FINE_BUCKET_EDGES`, see context.py) bound the within-bucket bias of choice 1.
12. Exploration skips an alternative that is already confidently worse than the greedy arm (mean gap larger
   than `elimination_z` standard errors, both arms with >= `elimination_min_samples` real observations):
   successive elimination inside the paper's exploration bins. Exploring γ = 0 at batch 256 when it is 15%
   worse than γ = 1 is pure loss, and a step at a large batch costs many sequences' time. The test uses the
   current means, so an arm comes back into exploration if the gap closes (e.g. as contexts lengthen).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from nightjar_jax.planner.base import Planner, register_planner, step_reward
from nightjar_jax.planner.context import FINE_BUCKET_EDGES, bucket_of, validate_bucket_edges

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NightjarOptions:
    """Options of the Nightjar planner (all have defaults; see the module docstring for the why)."""

    bucket_edges: tuple[int, ...] = FINE_BUCKET_EDGES  # lower edges of batch-size buckets, from 1
    first_block_exponent: int = 5  # block j has 2^(j-1) decisions; the first block of a context is j = this
    explore_scale: float = 0.5  # bin k of a block explores with probability min(1, explore_scale / k)
    explore_arms: str = "neighbors"  # "neighbors" (γ±1) of the greedy arm, or "all" arms
    max_explore_switch_overhead: float = 0.25  # exploration may not cross 0 <-> γ>0 above this switch/bin time
    switch_cost_smoothing: float = 0.3  # EMA weight of the newest measured switch cost
    initial_switch_seconds: float = 0.0  # switch cost assumed before any measurement
    reward_discount: float = 1.0  # 1: plain running mean; < 1: older observations fade
    prior_weight: float = 1.0  # a new context starts from the nearest visited context's means at this weight
    elimination_z: float = 2.0  # exploration skips arms worse than the greedy one by > z standard errors
    elimination_min_samples: int = 8  # ... but only once both arms have this many real observations
    seed: int = 0  # seeds the exploration coin flips and tie breaks

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_edges", validate_bucket_edges(self.bucket_edges))
        if not 1 <= self.first_block_exponent <= 30:
            raise ValueError(f"first_block_exponent must be in 1..30, got {self.first_block_exponent}")
        if not self.explore_scale >= 0:
            raise ValueError(f"explore_scale must be >= 0, got {self.explore_scale}")
        if self.explore_arms not in ("all", "neighbors"):
            raise ValueError(f"explore_arms must be 'all' or 'neighbors', got {self.explore_arms!r}")
        if not self.max_explore_switch_overhead >= 0:
            raise ValueError(f"max_explore_switch_overhead must be >= 0, got {self.max_explore_switch_overhead}")
        if not 0 < self.switch_cost_smoothing <= 1:
            raise ValueError(f"switch_cost_smoothing must be in (0, 1], got {self.switch_cost_smoothing}")
        if not self.initial_switch_seconds >= 0:
            raise ValueError(f"initial_switch_seconds must be >= 0, got {self.initial_switch_seconds}")
        if not 0 < self.reward_discount <= 1:
            raise ValueError(f"reward_discount must be in (0, 1], got {self.reward_discount}")
        if not self.elimination_z >= 0:
            raise ValueError(f"elimination_z must be >= 0 (inf disables elimination), got {self.elimination_z}")
        if self.elimination_min_samples < 2:
            raise ValueError(f"elimination_min_samples must be >= 2, got {self.elimination_min_samples}")
        if not self.prior_weight >= 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")


@dataclasses.dataclass
class ContextState:
    """What Nightjar knows and where it is in the block/bin schedule, for one context."""

    num_arms: int
    block: int  # j: the current block holds 2^(j-1) decisions
    decisions_in_block: int = 0
    bin_index: int = 0  # k, 1-based within the block (0 before the first bin)
    bin_length: int = 0  # decisions in the current bin
    decisions_in_bin: int = 0
    arm: int | None = None  # the current bin's arm
    exploring: bool = False  # whether the current bin is an exploration bin
    weight: list[float] = dataclasses.field(default_factory=list)  # [num_arms] (discounted) observations
    reward_sum: list[float] = dataclasses.field(default_factory=list)  # [num_arms] sum of rewards
    seconds_sum: list[float] = dataclasses.field(default_factory=list)  # [num_arms] sum of step seconds
    decisions: list[int] = dataclasses.field(default_factory=list)  # [num_arms] decisions that chose the arm
    count: list[int] = dataclasses.field(default_factory=list)  # [num_arms] real observations (no prior)
    reward_moments: list[list[float]] = dataclasses.field(default_factory=list)  # [num_arms][2] Σr, Σr² (real)
    switch_seconds: float | None = None  # learned switch cost (None: never measured here)

    def __post_init__(self) -> None:
        for name in ("weight", "reward_sum", "seconds_sum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.num_arms)
        if not self.decisions:
            self.decisions = [0] * self.num_arms
        if not self.count:
            self.count = [0] * self.num_arms
        if not self.reward_moments:
            self.reward_moments = [[0.0, 0.0] for _ in range(self.num_arms)]

    def reward_variance(self, arm: int) -> float:
        """Sample variance of the arm's real rewards (needs count >= 2)."""
        n, (total, squares) = self.count[arm], self.reward_moments[arm]
        return max(squares - total * total / n, 0.0) / (n - 1)

    def mean_reward(self, arm: int) -> float:
        return self.reward_sum[arm] / self.weight[arm]

    def mean_seconds(self, arm: int) -> float:
        return self.seconds_sum[arm] / self.weight[arm]


@register_planner("nightjar")
class NightjarPlanner(Planner):
    """Per-context blocked bandit over γ with priced switching (see module docstring)."""

    Options = NightjarOptions

    def __init__(self, gamma_max: int, options: NightjarOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.contexts: dict[int, ContextState] = {}
        self._rng = np.random.default_rng(self.options.seed)

    # ------------------------------------------------------------------------------------------- decisions
    def context_of(self, batch_size: int) -> int:
        return bucket_of(batch_size, self.options.bucket_edges)

    def _state(self, context: int) -> ContextState:
        state = self.contexts.get(context)
        if state is None:
            state = ContextState(num_arms=self.gamma_max + 1, block=self.options.first_block_exponent)
            self._seed_from_neighbour(context, state)
            self.contexts[context] = state
        return state

    def _seed_from_neighbour(self, context: int, state: ContextState) -> None:
        """Start a new context from the nearest visited context's per-arm means (choice 10)."""
        weight = self.options.prior_weight
        visited = [c for c, s in self.contexts.items() if any(w > 0 for w in s.weight)]
        if weight <= 0 or not visited:
            return
        source = self.contexts[min(visited, key=lambda c: (abs(c - context), c))]
        for arm in range(self.gamma_max + 1):
            if source.weight[arm] > 0:
                state.weight[arm] = weight
                state.reward_sum[arm] = weight * source.mean_reward(arm)
                state.seconds_sum[arm] = weight * source.mean_seconds(arm)

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        state = self._state(self.context_of(batch_size))
        if state.arm is None or state.decisions_in_bin >= state.bin_length:
            self._start_bin(state)
        assert state.arm is not None
        state.decisions_in_bin += 1
        state.decisions_in_block += 1
        state.decisions[state.arm] += 1
        return state.arm

    def _start_bin(self, state: ContextState) -> None:
        block_length = 2 ** (state.block - 1)
        if state.decisions_in_block >= block_length:
            state.block += 1
            state.decisions_in_block = 0
            state.bin_index = 0
            block_length *= 2
        nominal = max(1, round(math.sqrt(block_length)))
        state.bin_index += 1
        state.bin_length = min(nominal, block_length - state.decisions_in_block)
        state.decisions_in_bin = 0
        state.arm, state.exploring = self._choose_arm(state)

    def _switch_cost(self, state: ContextState) -> float:
        if state.switch_seconds is not None:
            return state.switch_seconds
        measured = [s.switch_seconds for s in self.contexts.values() if s.switch_seconds is not None]
        return float(np.mean(measured)) if measured else self.options.initial_switch_seconds

    def _choose_arm(self, state: ContextState) -> tuple[int, bool]:
        arms = range(self.gamma_max + 1)
        previous = self.last_gamma
        draft_behind = previous == 0
        switch_cost = self._switch_cost(state)
        tried = [a for a in arms if state.weight[a] > 0]
        bin_seconds = state.bin_length * (float(np.mean([state.mean_seconds(a) for a in tried])) if tried else 0.0)

        def crossing_allowed(arm: int) -> bool:
            crosses = previous is not None and (previous == 0) != (arm == 0)
            if not crosses or switch_cost <= 0:
                return True
            if bin_seconds <= 0:  # nothing measured yet: we cannot judge, let it learn
                return True
            return switch_cost <= self.options.max_explore_switch_overhead * bin_seconds

        untried = [a for a in arms if state.weight[a] == 0 and crossing_allowed(a)]
        if untried:
            anchor = previous if previous is not None else self.gamma_max
            return min(untried, key=lambda a: (abs(a - anchor), -a)), True
        if not tried:  # every arm untried but none allowed (cannot happen: the anchor never crosses)
            return (previous if previous is not None else 0), False

        def value(arm: int) -> float:
            reward = state.mean_reward(arm)
            if draft_behind and arm > 0 and switch_cost > 0:
                seconds = state.mean_seconds(arm)
                reward *= seconds / (seconds + switch_cost / state.bin_length)
            return reward

        greedy = max(tried, key=lambda a: (value(a), -abs(a - (previous or 0))))
        explore_probability = min(1.0, self.options.explore_scale / state.bin_index)
        if self._rng.random() < explore_probability:
            if self.options.explore_arms == "neighbors":
                candidates = [a for a in (greedy - 1, greedy + 1) if 0 <= a <= self.gamma_max]
            else:
                candidates = [a for a in arms if a != greedy]
            candidates = [a for a in candidates if crossing_allowed(a) and not self._eliminated(state, a, greedy)]
            if candidates:
                fewest = min(state.decisions[a] for a in candidates)
                least_played = [a for a in candidates if state.decisions[a] == fewest]
                return int(least_played[self._rng.integers(len(least_played))]), True
        return greedy, False

    def _eliminated(self, state: ContextState, arm: int, greedy: int) -> bool:
        """Whether `arm` is confidently worse than `greedy` (choice 12): no point exploring it."""
        minimum = self.options.elimination_min_samples
        if state.count[arm] < minimum or state.count[greedy] < minimum or math.isinf(self.options.elimination_z):
            return False
        gap = state.mean_reward(greedy) - state.mean_reward(arm)
        stderr = math.sqrt(
            state.reward_variance(arm) / state.count[arm] + state.reward_variance(greedy) / state.count[greedy]
        )
        return gap > self.options.elimination_z * stderr

    # ------------------------------------------------------------------------------------------- learning
    def _observe(self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float) -> None:
        state = self._state(self.context_of(batch_size))
        if switch_seconds > 0:
            if state.switch_seconds is None:
                state.switch_seconds = switch_seconds
            else:
                w = self.options.switch_cost_smoothing
                state.switch_seconds = (1 - w) * state.switch_seconds + w * switch_seconds
        reward = step_reward(batch_size, num_tokens, seconds, switch_seconds)
        if reward is None:
            logger.warning("step with no time outside the switch (seconds=%s); reward skipped", seconds)
            return
        d = self.options.reward_discount
        state.weight[gamma] = d * state.weight[gamma] + 1.0
        state.reward_sum[gamma] = d * state.reward_sum[gamma] + reward
        state.seconds_sum[gamma] = d * state.seconds_sum[gamma] + (seconds - switch_seconds)
        state.count[gamma] += 1
        state.reward_moments[gamma][0] += reward
        state.reward_moments[gamma][1] += reward * reward

    # ------------------------------------------------------------------------------------------- inspection
    def best_arms(self) -> dict[int, int]:
        """Greedy arm (best mean reward, no switch charge) per visited context with data."""
        best = {}
        for context, state in self.contexts.items():
            tried = [a for a in range(self.gamma_max + 1) if state.weight[a] > 0]
            if tried:
                best[context] = max(tried, key=state.mean_reward)
        return best

    def _learned_state(self) -> dict[str, Any]:
        return {
            "contexts": {str(c): dataclasses.asdict(s) for c, s in self.contexts.items()},
            "rng": self._rng.bit_generator.state,
        }

    def _load_learned_state(self, learned: dict[str, Any]) -> None:
        self.contexts = {int(c): ContextState(**s) for c, s in learned["contexts"].items()}
        self._rng.bit_generator.state = learned["rng"]
