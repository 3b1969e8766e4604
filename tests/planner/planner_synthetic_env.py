"""A synthetic, stationary speculative-decoding environment for planner tests (hand-computable means).

Step seconds s(b, γ) = base + per_seq·b·(1 + γ) + per_draft·γ; each sequence commits 1 + (number of leading
accepted drafts), each draft accepted with probability α. The expected reward (tokens/s/seq) of arm γ at batch
b is E(γ) / s(b, γ) with E(γ) = Σ_{i=0..γ} α^i.
"""

from __future__ import annotations

import numpy as np


class SyntheticEnv:
    def __init__(
        self,
        *,
        alpha: float = 0.7,
        base: float = 0.010,
        per_seq: float = 0.0004,
        per_draft: float = 0.0015,
        noise: float = 0.05,
        switch_seconds: float = 0.0,
        seed: int = 0,
    ):
        self.alpha, self.base, self.per_seq, self.per_draft = alpha, base, per_seq, per_draft
        self.noise, self.switch_seconds = noise, switch_seconds
        self.rng = np.random.default_rng(seed)
        self.previous_gamma: int | None = None

    def seconds(self, batch: int, gamma: int) -> float:
        return self.base + self.per_seq * batch * (1 + gamma) + self.per_draft * gamma

    def mean_reward(self, batch: int, gamma: int) -> float:
        return sum(self.alpha**i for i in range(gamma + 1)) / self.seconds(batch, gamma)

    def best_gamma(self, batch: int, gamma_max: int) -> int:
        return max(range(gamma_max + 1), key=lambda g: self.mean_reward(batch, g))

    def step(self, batch: int, gamma: int) -> tuple[int, float, float]:
        """(num_tokens, seconds, switch_seconds) of one step."""
        accepted = (self.rng.random((batch, gamma)) < self.alpha).cumprod(axis=1).sum(axis=1) if gamma else 0
        num_tokens = int(np.sum(accepted + 1)) if gamma else batch
        seconds = self.seconds(batch, gamma) * float(np.exp(self.noise * self.rng.standard_normal()))
        switch = self.switch_seconds if (self.previous_gamma == 0 and gamma > 0) else 0.0
        self.previous_gamma = gamma
        return num_tokens, seconds + switch, switch


def run(planner, env: SyntheticEnv, batches) -> tuple[list[int], list[float]]:
    """Drive `planner` through `env` for each batch size; returns chosen γs and per-step expected regret."""
    gammas, regrets = [], []
    for batch in batches:
        gamma = planner.select(int(batch))
        num_tokens, seconds, switch = env.step(int(batch), gamma)
        planner.observe(gamma, int(batch), num_tokens, seconds, switch)
        best = env.best_gamma(int(batch), planner.gamma_max)
        gammas.append(gamma)
        regrets.append(env.mean_reward(int(batch), best) - env.mean_reward(int(batch), gamma))
    return gammas, regrets
