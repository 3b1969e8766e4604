"""Goodput-model baseline in the style of SmartSpec / DSD: γ from measured acceptance and a latency model.

Model (fitted online from `observe`):

- **acceptance rate α**: one α for every draft position. With γ drafts, the expected committed tokens per
  sequence per step is E(γ) = (1 - α^(γ+1)) / (1 - α) = 1 + α + ... + α^γ. α is the moment estimate: the α in
  [0, 1] at which Σ_steps E(γ_step) equals the committed tokens per sequence observed over all γ > 0 steps
  (solved by bisection; E is increasing in α).
- **step latency** ≈ a + b·batch + c·batch·γ, least squares (tiny ridge) over all observed steps, with
  seconds excluding `switch_seconds`. The minimum-norm solution is taken when the system is rank-deficient:
  at a constant batch size B the columns 1 and batch are collinear, so only a + b·B is determined, and the
  minimum-norm split of it still predicts every γ at B exactly (a fixed-batch deployment is common).
- **decision**: γ maximising batch·E(γ) / latency(batch, γ), the expected committed tokens per second.
  Both fits are refreshed every `refit_every` observations (cheap enough per step, but there is no need).

It first cycles γ = 0, 1, ..., γ_max for `warmup_steps` decisions, then uses `default_gamma` until steps at two
different γ have been observed (with a single γ the cost of another γ is unknown: the batch and batch·γ columns
are collinear), and, while every step observed had one batch size B, at batch sizes other than B (the fit predicts
only B). With `warmup_steps=0` it therefore stays at `default_gamma`. Switching costs are ignored, as in the
original systems.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from nightjar_jax.engine.sampling_params import short_repr
from nightjar_jax.planner.base import (
    Planner,
    check_int_option,
    check_number_option,
    is_int,
    learned_arm_list,
    register_planner,
)


@dataclasses.dataclass(frozen=True)
class DsdOptions:
    default_gamma: int = 1  # γ before the models are fitted (clipped to gamma_max)
    warmup_steps: int | None = None  # decisions cycling through all γ first; None: 2 * (gamma_max + 1)
    ridge: float = 1e-9  # Tikhonov weight (relative to the data) for the latency least squares
    refit_every: int = 8  # refit α and the latency model every this many observations (they move slowly)

    def __post_init__(self) -> None:
        check_int_option(self, "default_gamma", minimum=0, note="(clipped to gamma_max)")
        check_int_option(self, "warmup_steps", minimum=0, none_allowed=True, note="(None: 2 * (gamma_max + 1))")
        check_number_option(self, "ridge", minimum=0.0, finite=True)
        check_int_option(self, "refit_every", minimum=1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected committed tokens per sequence with γ drafts at per-position acceptance α: Σ_{i=0..γ} α^i."""
    return float(sum(alpha**i for i in range(gamma + 1)))


@register_planner("dsd")
class DsdPlanner(Planner):
    """Pick γ maximising modelled goodput (SmartSpec/DSD style)."""

    Options = DsdOptions

    def __init__(self, gamma_max: int, options: DsdOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.steps_per_gamma = [0] * (gamma_max + 1)  # [num_arms] observed steps with γ
        self.tokens_per_seq_sum = [0.0] * (gamma_max + 1)  # [num_arms] Σ committed tokens per sequence
        self.gram = np.zeros((3, 3))  # [3, 3] Σ x xᵀ with x = (1, batch, batch·γ)
        self.moment = np.zeros(3)  # [3] Σ x · seconds
        self.warmup_steps = 2 * (gamma_max + 1) if self.options.warmup_steps is None else self.options.warmup_steps
        self._fit: tuple[float | None, np.ndarray | None] | None = None  # cached (α, coefficients)
        self._fitted_at = -1  # num_observations at the cached fit

    # ------------------------------------------------------------------------------------------- models
    def acceptance(self) -> float | None:
        """Fitted α, or None without any γ > 0 observation."""
        gammas = [g for g in range(1, self.gamma_max + 1) if self.steps_per_gamma[g] > 0]
        if not gammas:
            return None
        target = sum(self.tokens_per_seq_sum[g] for g in gammas)

        def excess(alpha: float) -> float:
            return sum(self.steps_per_gamma[g] * expected_tokens(alpha, g) for g in gammas) - target

        low, high = 0.0, 1.0
        if excess(high) <= 0:
            return 1.0
        if excess(low) >= 0:
            return 0.0
        for _ in range(40):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if excess(mid) < 0 else (low, mid)
        return 0.5 * (low + high)

    def latency_coefficients(self) -> np.ndarray | None:
        """(a, b, c) of seconds ≈ a + b·batch + c·batch·γ (minimum norm where the batch never varied), or None
        before steps at two different γ."""
        if sum(1 for n in self.steps_per_gamma if n > 0) < 2:
            return None
        regularised = self.gram + self.options.ridge * np.trace(self.gram) * np.eye(3)
        return np.linalg.lstsq(regularised, self.moment, rcond=None)[0]

    def only_batch_size(self) -> int | None:
        """The batch size of every observed step when there was only one (None: several, or none yet). The fit
        then predicts that batch size exactly and others not at all (the split of a + b·batch is arbitrary)."""
        count, total, squares = self.gram[0, 0], self.gram[0, 1], self.gram[1, 1]
        if count <= 0 or count * squares - total * total > 1e-9 * total * total:
            return None
        return round(total / count)

    # ------------------------------------------------------------------------------------------- planner
    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        if self.num_decisions < self.warmup_steps:
            return self.num_decisions % (self.gamma_max + 1)
        if self._fit is None or self.num_observations - self._fitted_at >= self.options.refit_every:
            self._fit = (self.acceptance(), self.latency_coefficients())
            self._fitted_at = self.num_observations
        alpha, coefficients = self._fit
        only = self.only_batch_size()
        if alpha is None or coefficients is None or (only is not None and batch_size != only):
            return min(self.options.default_gamma, self.gamma_max)
        a, b, c = coefficients
        best_gamma, best_rate = 0, -1.0
        for gamma in range(self.gamma_max + 1):
            latency = max(a + b * batch_size + c * batch_size * gamma, 1e-9)
            rate = batch_size * expected_tokens(alpha, gamma) / latency
            if rate > best_rate:
                best_gamma, best_rate = gamma, rate
        return best_gamma

    def _observe(self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float) -> None:
        step_seconds = seconds - switch_seconds
        if step_seconds <= 0:
            return
        self.steps_per_gamma[gamma] += 1
        self.tokens_per_seq_sum[gamma] += num_tokens / batch_size
        x = np.array([1.0, float(batch_size), float(batch_size) * gamma])  # (floats: never an int64 overflow)
        self.gram += np.outer(x, x)
        self.moment += x * step_seconds

    def _learned_state(self) -> dict[str, Any]:
        fit = None
        if self._fit is not None:  # (saved: a restored planner refitting early would decide differently)
            alpha, coefficients = self._fit
            fit = {
                "alpha": alpha,
                "coefficients": None if coefficients is None else coefficients.tolist(),
                "fitted_at": self._fitted_at,
            }
        return {
            "steps_per_gamma": list(self.steps_per_gamma),
            "tokens_per_seq_sum": list(self.tokens_per_seq_sum),
            "gram": self.gram.tolist(),
            "moment": self.moment.tolist(),
            "fit": fit,
        }

    def _load_learned_state(self, learned: dict[str, Any]) -> None:
        steps_per_gamma = learned_arm_list(learned, "steps_per_gamma", self.gamma_max, counts=True)
        tokens_per_seq_sum = learned_arm_list(learned, "tokens_per_seq_sum", self.gamma_max)
        gram = np.array(learned["gram"], dtype=float)
        moment = np.array(learned["moment"], dtype=float)
        if gram.shape != (3, 3) or moment.shape != (3,):
            raise ValueError(f"state's gram must be 3x3 and moment 3 long, got {gram.shape} and {moment.shape}")
        if not (np.isfinite(gram).all() and np.isfinite(moment).all()):  # (None reads as NaN)
            raise ValueError("state's gram and moment must hold finite numbers")
        fit, fitted_at = None, -1
        if learned.get("fit") is not None:  # (a state saved before the fit was kept: refit at the next decision)
            saved = learned["fit"]
            coefficients = saved["coefficients"]
            if coefficients is not None:
                coefficients = np.array(coefficients, dtype=float)
                if coefficients.shape != (3,) or not np.isfinite(coefficients).all():
                    raise ValueError(f"state's fit coefficients must be 3 numbers, got {saved['coefficients']!r}")
            alpha, fitted_at = saved["alpha"], saved["fitted_at"]
            if alpha is not None and not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                                          and 0 <= alpha <= 1):
                # (an acceptance rate: 1.5 or "0.7" was taken, and its expected tokens per step grew without bound)
                raise ValueError(f"state's fit alpha must be null or a number in [0, 1] (an acceptance rate), got "
                                 f"{short_repr(alpha)}")
            if not is_int(fitted_at) or fitted_at < -1:
                raise ValueError(f"state's fit fitted_at must be an int >= -1 (the observation the fit was made "
                                 f"at), got {short_repr(fitted_at)}")
            fit, fitted_at = (None if alpha is None else float(alpha), coefficients), int(fitted_at)
        self.steps_per_gamma, self.tokens_per_seq_sum = steps_per_gamma, tokens_per_seq_sum
        self.gram, self.moment = gram, moment
        self._fit, self._fitted_at = fit, fitted_at
