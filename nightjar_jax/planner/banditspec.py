"""BanditSpec-style baseline: UCB1 over γ with no context (after BanditSpec, Hou et al. 2025).

Each decision plays the arm γ with the largest upper confidence bound

    index(γ) = r̄(γ) / r_max + exploration · sqrt(2 ln t / n(γ)),

where r̄(γ) is the mean reward (committed tokens per second per sequence, as for Nightjar), r_max the best
arm mean (rewards have no known range, so they are put on a [0, 1]-ish scale), t the number of observations
and n(γ) the arm's. Untried arms are played first. There is no context (the batch size is ignored), no bin
structure (the arm may change every step) and no switching cost: that is what makes it a baseline for
Nightjar, which adds all three.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nightjar_jax.planner.base import (
    Planner,
    check_number_option,
    learned_arm_list,
    register_planner,
    step_reward,
)


@dataclasses.dataclass(frozen=True)
class BanditSpecOptions:
    exploration: float = 1.0  # weight of the UCB bonus

    def __post_init__(self) -> None:
        check_number_option(self, "exploration", minimum=0.0, finite=True)


@register_planner("banditspec")
class BanditSpecPlanner(Planner):
    """UCB1 over γ ∈ {0..γ_max}, one global bandit."""

    Options = BanditSpecOptions

    def __init__(self, gamma_max: int, options: BanditSpecOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.counts = [0] * (gamma_max + 1)  # [num_arms] observations per arm
        self.reward_sums = [0.0] * (gamma_max + 1)  # [num_arms]

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        untried = [a for a, n in enumerate(self.counts) if n == 0]
        if untried:
            return max(untried)
        means = [s / n for s, n in zip(self.reward_sums, self.counts, strict=True)]
        scale = max(means) or 1.0
        log_t = math.log(sum(self.counts))
        bonus = self.options.exploration
        return max(
            range(self.gamma_max + 1),
            key=lambda a: means[a] / scale + bonus * math.sqrt(2 * log_t / self.counts[a]),
        )

    def _observe(self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float) -> None:
        reward = step_reward(batch_size, num_tokens, seconds, switch_seconds)
        if reward is not None:
            self.counts[gamma] += 1
            self.reward_sums[gamma] += reward

    def _learned_state(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "reward_sums": list(self.reward_sums)}

    def _load_learned_state(self, learned: dict[str, Any]) -> None:
        counts = learned_arm_list(learned, "counts", self.gamma_max, counts=True)
        reward_sums = learned_arm_list(learned, "reward_sums", self.gamma_max)
        self.counts, self.reward_sums = counts, reward_sums
