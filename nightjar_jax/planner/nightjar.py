"""Nightjar: a contextual bandit over γ with blocks, bins and a priced switch (arXiv 2512.22420, §4).

Vocabulary (see also `base.py`):

- **arm**: a γ ∈ {0..γ_max}. **context**: the bucket of the decode batch size (`context.py`).
- **block**: per context, decisions are grouped in blocks of exponentially growing length; block j holds
  2^(j-1) decisions of that context.
- **bin**: a block is cut into bins of about √(block length) decisions; the arm of a context only changes at a
  bin boundary (a probe, below, adds at most one detour of `probe_length` decisions to a bin), so a context
  makes O(√T) arm changes over T decisions (bounded switching).
- **exploration bin**: bin k (1-based within its block) explores with probability min(1, explore_scale / k)
  — it plays the least-played alternative arm; otherwise the bin exploits the arm with the best estimated
  reward. Because later bins of a block explore less, and bins grow, the exploration cost per block is
  O(√L · log L) and cumulative regret against the best fixed arm per context grows like √T (up to logs).
- **dominated arm**: an alternative whose estimated reward is below the greedy arm's by more than
  `elimination_z` standard errors, with the evidence of the context's own steps and of a neighbouring
  context's (choices 12-13). An exploration bin whose alternatives are all dominated does not spend the bin on
  one: it **probes** it for `probe_length` (1) decision(s), if the context's probe credit covers the probe's
  expected regret, and exploits for the rest of the bin (choice 14).
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
10. A context seen for the first time starts from the per-arm estimates of the nearest visited context, as
   `prior_weight` pseudo-observations (default 1, i.e. one step's worth; 0 turns it off). Under changing load
   the batch size sweeps through buckets that each see few decisions; without a prior every new bucket would
   play every arm for a bin before exploiting. The ranking of arms changes slowly with the batch size, so the
   neighbour is a good first guess, and one pseudo-observation is overwritten by the context's own data fast.
   With `prior_mode="relative"` (default) the prior keeps the neighbour's *ratios* between arms: it is
   rescaled by (own rewards) / (what the prior predicts for the same steps), the same for step seconds.
   Per-sequence reward falls with the batch, so an absolute prior made the arms a new, larger-batch context
   had not played yet look better than the one it had measured, and it played them (measured: on the CPU
   profile most of the cold-start loss came from this).
11. Buckets with ratio ~√2 (`FINE_BUCKET_EDGES`, see context.py) bound the within-bucket bias of choice 1.
12. Exploration does not spend whole bins on an alternative that is already confidently worse than the greedy
   arm (dominated: mean gap larger than `elimination_z` standard errors): successive elimination inside the
   paper's exploration bins. Exploring γ = 0 at batch 256 when it is 15% worse than γ = 1 is pure loss, and a
   step at a large batch costs many sequences' time. The test uses the current estimates, so an arm comes back
   into exploration if the gap closes (e.g. as contexts lengthen). Own evidence alone needs
   `elimination_min_samples` steps of both arms (a sample variance of 2-3 steps is meaningless).
13. The prior also carries the neighbour's *confidence* (`prior_transfer_sd`): per arm, the variance of the
   neighbour's estimate plus (prior_transfer_sd · mean)² per bucket of distance (how far the ranking may have
   moved), and its per-step variance. The context combines it with its own steps by precision (a normal
   prior and normal observations), so the dominance test of choice 12 works from the first decision of a new
   context: "γ > 0 is 30% worse next door" is enough to skip its exploration bins here, while a gap within
   the transfer uncertainty (at 5% per bucket and z = 2, about 14% one bucket away) is explored as before.
   Transfer chains through contexts created from one another and fades with each bucket.
14. A dominated arm is not dropped for good (the surface moves: contexts lengthen, the draft is reloaded): an
   exploration bin whose alternatives are all dominated probes the least-played of them for `probe_length`
   decision(s) and exploits for the rest of the bin. A probe is charged its expected regret — the share of
   the greedy reward it loses times its step seconds, plus a switch if it crosses 0 ↔ γ > 0 — against a
   per-context credit that accrues `probe_budget` (0.2%) of the context's step seconds, so re-checks cost at
   most that share of the time (plus one probe), happen often where they are cheap (small batches, small
   gaps) and rarely where they are not. Each probe is a change test: a reward more than `probe_reset_z` (3)
   predictive standard deviations above the arm's estimate restarts the context (own and prior statistics
   forgotten, first block again), as change-detecting bandits (e.g. M-UCB) restart; otherwise the probe is an
   ordinary observation. This is the one structural deviation from the paper: a probe changes the arm inside
   a bin (two switches), at most once per exploration bin. It is what keeps cold start cheap where one arm
   dominates (docs/benchmarks.md, CPU profile, cold vs AR: -6.7% -> -0.13% on low-burst-low, -2.8% ->
   -0.09% on oscillating). `probe_every_bin=True` also probes in exploitation bins (within the same credit):
   a wrongly eliminated arm is then re-checked at the budget's rate, not the decaying exploration rate, at the
   price of probes (and switches) that recur at a constant rate (docs/planner.md, choice 14).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from nightjar_jax.engine.sampling_params import short_repr
from nightjar_jax.planner.base import (
    Planner,
    check_arm_lists,
    check_int_option,
    check_number_option,
    is_int,
    register_planner,
    step_reward,
)
from nightjar_jax.planner.context import FINE_BUCKET_EDGES, bucket_of, validate_bucket_edges

logger = logging.getLogger(__name__)

# a context's block j holds 2^(j-1) decisions: 64 is past any run, and a loaded block of 5000 overflowed a float
MAX_BLOCK = 64
ALL_SWITCH_WARN_EVERY = 1000  # an all-switch step warns on the 1st, 1001st, ... occurrence; the others log at debug


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
    prior_mode: str = "relative"  # "relative": the prior keeps the neighbour's ratios between arms, rescaled
    #                               to this context's own rewards; "absolute": the neighbour's values as they are
    prior_transfer_sd: float = 0.05  # relative sd of an arm's reward added per bucket of distance when a prior
    #                                  carries the neighbour's confidence over (inf: priors carry no confidence)
    elimination_z: float = 2.0  # an arm worse than the greedy one by > z standard errors is dominated
    elimination_min_samples: int = 8  # own observations needed before an arm's own sample variance is used
    probe_length: int = 1  # an exploration bin spends this many decisions on a dominated arm, then exploits
    #                        (0: dominated arms are never explored)
    probe_budget: float = 0.002  # probes may spend this fraction of a context's step seconds (expected regret)
    probe_every_bin: bool = False  # True: probe at any bin start the credit covers, not only in exploration bins
    probe_reset_z: float = 3.0  # a probe this many predictive sds above its arm's estimate restarts the context
    seed: int | None = 0  # seeds the exploration coin flips and tie breaks (None: a fresh random seed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_edges", validate_bucket_edges(self.bucket_edges))
        check_int_option(self, "first_block_exponent", minimum=1, maximum=30)
        check_number_option(self, "explore_scale", minimum=0.0)
        if not isinstance(self.explore_arms, str) or self.explore_arms not in ("all", "neighbors"):
            raise ValueError(f"explore_arms must be 'all' or 'neighbors', got {self.explore_arms!r}")
        check_number_option(self, "max_explore_switch_overhead", minimum=0.0)
        check_number_option(self, "switch_cost_smoothing", minimum=0.0, maximum=1.0, open_minimum=True)
        check_number_option(self, "initial_switch_seconds", minimum=0.0)
        check_number_option(self, "reward_discount", minimum=0.0, maximum=1.0, open_minimum=True)
        # (bounded: at ~1e306 the weighted sums overflowed into a state it then refused to load)
        check_number_option(self, "prior_weight", minimum=0.0, maximum=1e6, finite=True, note="(0: no prior)")
        if not isinstance(self.prior_mode, str) or self.prior_mode not in ("relative", "absolute"):
            raise ValueError(f"prior_mode must be 'relative' or 'absolute', got {self.prior_mode!r}")
        check_number_option(
            self, "prior_transfer_sd", minimum=0.0, open_minimum=True, note="(inf: priors carry no confidence)"
        )
        check_number_option(self, "elimination_z", minimum=0.0, note="(inf disables elimination)")
        check_int_option(self, "elimination_min_samples", minimum=2)
        check_int_option(self, "probe_length", minimum=0, note="(0: no probes)")
        check_number_option(self, "probe_budget", minimum=0.0, maximum=1.0)
        if not isinstance(self.probe_every_bin, bool):
            raise ValueError(f"probe_every_bin must be a bool, got {self.probe_every_bin!r}")
        check_number_option(
            self, "probe_reset_z", minimum=0.0, open_minimum=True, note="(inf: probes never restart a context)"
        )
        check_int_option(self, "seed", minimum=0, none_allowed=True, note="(None: a fresh random seed)")


@dataclasses.dataclass
class ContextState:
    """What Nightjar knows and where it is in the block/bin schedule, for one context.

    Own observations (`weight`, `reward_sum`, `seconds_sum`, `count`, `reward_moments`) and the prior copied
    from a neighbouring context at creation (`prior_*`, in that context's units; None: no prior for the arm)
    are kept apart; `NightjarPlanner` combines them (choices 10 and 13).
    """

    num_arms: int
    block: int  # j: the current block holds 2^(j-1) decisions
    decisions_in_block: int = 0
    bin_index: int = 0  # k, 1-based within the block (0 before the first bin)
    bin_length: int = 0  # decisions in the current bin
    decisions_in_bin: int = 0
    arm: int | None = None  # the current bin's arm
    exploring: bool = False  # whether the current bin is an exploration bin
    probe_arm: int | None = None  # a dominated arm this bin probes for its first `probe_remaining` decisions
    probe_remaining: int = 0
    pending_probe: int | None = None  # the arm of a probe decision whose observation has not arrived yet
    probe_credit: float = 0.0  # seconds of expected regret probes may still spend (accrues probe_budget)
    weight: list[float] = dataclasses.field(default_factory=list)  # [num_arms] (discounted) own observations
    reward_sum: list[float] = dataclasses.field(default_factory=list)  # [num_arms] sum of own rewards
    seconds_sum: list[float] = dataclasses.field(default_factory=list)  # [num_arms] sum of own step seconds
    decisions: list[int] = dataclasses.field(default_factory=list)  # [num_arms] decisions that chose the arm
    count: list[int] = dataclasses.field(default_factory=list)  # [num_arms] own observations (undiscounted)
    reward_moments: list[list[float]] = dataclasses.field(default_factory=list)  # [num_arms][2] Σr, Σr² (own)
    prior_reward: list[float | None] = dataclasses.field(default_factory=list)  # [num_arms] neighbour's mean
    prior_seconds: list[float | None] = dataclasses.field(default_factory=list)  # [num_arms] neighbour's s̄
    prior_variance: list[float | None] = dataclasses.field(default_factory=list)  # [num_arms] var of that mean
    prior_obs_variance: list[float | None] = dataclasses.field(default_factory=list)  # [num_arms] per step
    switch_seconds: float | None = None  # learned switch cost (None: never measured here)

    def __post_init__(self) -> None:
        for name in ("weight", "reward_sum", "seconds_sum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.num_arms)
        for name in ("prior_reward", "prior_seconds", "prior_variance", "prior_obs_variance"):
            if not getattr(self, name):
                setattr(self, name, [None] * self.num_arms)
        if not self.decisions:
            self.decisions = [0] * self.num_arms
        if not self.count:
            self.count = [0] * self.num_arms
        if not self.reward_moments:
            self.reward_moments = [[0.0, 0.0] for _ in range(self.num_arms)]

    def reward_variance(self, arm: int) -> float:
        """Sample variance of the arm's own rewards (needs count >= 2)."""
        n, (total, squares) = self.count[arm], self.reward_moments[arm]
        return max(squares - total * total / n, 0.0) / (n - 1)


@register_planner("nightjar")
class NightjarPlanner(Planner):
    """Per-context blocked bandit over γ with priced switching (see module docstring)."""

    Options = NightjarOptions

    def __init__(self, gamma_max: int, options: NightjarOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.contexts: dict[int, ContextState] = {}
        self._rng = np.random.default_rng(self.options.seed)
        self._all_switch_steps = 0  # observations that were all switch time (for rate-limiting their warning)

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
        """Start a new context from the nearest visited context's estimates (choices 10 and 13)."""
        if self.options.prior_weight <= 0:
            return
        visited = [c for c, s in self.contexts.items() if any(self._has_estimate(s, a) for a in range(s.num_arms))]
        if not visited:
            return
        source_context = min(visited, key=lambda c: (abs(c - context), c))
        source, hops = self.contexts[source_context], abs(source_context - context)
        tau = self.options.prior_transfer_sd
        for arm in range(self.gamma_max + 1):
            if not self._has_estimate(source, arm):
                continue
            mean, variance = self._posterior(source, arm)
            state.prior_reward[arm] = mean
            state.prior_seconds[arm] = self.mean_seconds(source, arm)
            if variance is not None and math.isfinite(tau):
                transfer = tau * mean  # (products, not ** 2: an overflow gives inf rather than OverflowError)
                prior_variance = variance + hops * transfer * transfer
                # An infinite variance carries no confidence, as with tau = inf.
                state.prior_variance[arm] = prior_variance if math.isfinite(prior_variance) else None
            state.prior_obs_variance[arm] = self._observation_variance(source, arm)

    # ----------------------------------------------------------------------------------- estimates per arm
    def _has_prior(self, state: ContextState, arm: int) -> bool:
        return self.options.prior_weight > 0 and state.prior_reward[arm] is not None

    def _has_estimate(self, state: ContextState, arm: int) -> bool:
        return state.weight[arm] > 0 or self._has_prior(state, arm)

    def _scales(self, state: ContextState) -> tuple[float, float]:
        """(reward, seconds) factors mapping the prior's values to this context (choice 13): own totals over
        what the prior predicts for the same observations; 1 when absolute or nothing to compare yet."""
        if self.options.prior_mode == "absolute":
            return 1.0, 1.0
        own_r = prior_r = own_s = prior_s = 0.0
        for arm in range(state.num_arms):
            if state.weight[arm] > 0 and self._has_prior(state, arm):
                own_r += state.reward_sum[arm]
                prior_r += state.weight[arm] * state.prior_reward[arm]
                own_s += state.seconds_sum[arm]
                prior_s += state.weight[arm] * state.prior_seconds[arm]
        reward_scale = own_r / prior_r if own_r > 0 and prior_r > 0 else 1.0
        seconds_scale = own_s / prior_s if own_s > 0 and prior_s > 0 else 1.0
        return reward_scale, seconds_scale

    def _blended_mean(self, state: ContextState, arm: int, own_sum: float, prior: float | None, which: int) -> float:
        """Own mean with the prior (rescaled by `_scales(state)[which]`) counted as `prior_weight` observations."""
        total, weight = own_sum, state.weight[arm]
        if self._has_prior(state, arm):
            w = self.options.prior_weight
            total += w * self._scales(state)[which] * prior
            weight += w
        return total / weight

    def mean_reward(self, state: ContextState, arm: int) -> float:
        """Estimated reward (tokens/s/seq): own mean, with the (rescaled) prior as `prior_weight` observations."""
        return self._blended_mean(state, arm, state.reward_sum[arm], state.prior_reward[arm], 0)

    def mean_seconds(self, state: ContextState, arm: int) -> float:
        """Estimated step seconds of the arm in this context (same weighting as `mean_reward`)."""
        return self._blended_mean(state, arm, state.seconds_sum[arm], state.prior_seconds[arm], 1)

    def _observation_variance(self, state: ContextState, arm: int) -> float | None:
        """Variance of one step's reward: own sample variance once there are enough own observations, else the
        prior's (rescaled); None if neither is known."""
        if state.count[arm] >= self.options.elimination_min_samples:
            return state.reward_variance(arm)
        prior = state.prior_obs_variance[arm]
        if prior is not None and self._has_prior(state, arm):
            return self._scales(state)[0] ** 2 * prior
        return None

    def _posterior(self, state: ContextState, arm: int) -> tuple[float, float | None]:
        """(mean, variance) of the arm's mean reward for the dominance test (choice 13).

        With a prior that carries confidence, the neighbour's (rescaled) estimate and the own observations are
        combined by precision; otherwise the mean is `mean_reward`'s and the variance comes from the own
        observations alone (None while there are fewer than `elimination_min_samples`)."""
        observations = self._observation_variance(state, arm)
        prior = state.prior_variance[arm] if self._has_prior(state, arm) else None
        if prior is not None:
            scale = self._scales(state)[0]
            prior = scale * scale * prior  # in this context's units
            if not math.isfinite(prior):  # (overflowed: no confidence, as with tau = inf, never 0 precision)
                prior = None
        n = state.weight[arm]
        if prior is None:
            mean = self.mean_reward(state, arm)
            if observations is None or state.count[arm] < self.options.elimination_min_samples:
                return mean, None
            return mean, observations / n
        prior_mean = scale * state.prior_reward[arm]
        precision = 1.0 / max(prior, 1e-300)
        weighted = precision * prior_mean
        if observations is not None and n > 0:
            own_mean = state.reward_sum[arm] / n
            own_precision = n / max(observations, 1e-12 * own_mean * own_mean, 1e-300)
            precision += own_precision
            weighted += own_precision * own_mean
        return weighted / precision, 1.0 / precision

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        state = self._state(self.context_of(batch_size))
        if state.arm is None or state.decisions_in_bin >= state.bin_length:
            self._start_bin(state)
        assert state.arm is not None
        arm = state.arm
        if state.probe_remaining > 0 and state.probe_arm is not None:
            arm = state.probe_arm
            state.probe_remaining -= 1
            state.pending_probe = arm
        state.decisions_in_bin += 1
        state.decisions_in_block += 1
        state.decisions[arm] += 1
        return arm

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
        state.probe_arm, state.probe_remaining = None, 0
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
        tried = [a for a in arms if self._has_estimate(state, a)]
        bin_seconds = state.bin_length * (
            float(np.mean([self.mean_seconds(state, a) for a in tried])) if tried else 0.0
        )

        def crossing_allowed(arm: int) -> bool:
            crosses = previous is not None and (previous == 0) != (arm == 0)
            if not crosses or switch_cost <= 0:
                return True
            if bin_seconds <= 0:  # nothing measured yet: we cannot judge, let it learn
                return True
            return switch_cost <= self.options.max_explore_switch_overhead * bin_seconds

        untried = [a for a in arms if not self._has_estimate(state, a) and crossing_allowed(a)]
        if untried:
            anchor = previous if previous is not None else self.gamma_max
            return min(untried, key=lambda a: (abs(a - anchor), -a)), True
        if not tried:  # every arm untried but none allowed (cannot happen: the anchor never crosses)
            return (previous if previous is not None else 0), False

        means = {a: self.mean_reward(state, a) for a in tried}

        def value(arm: int) -> float:
            reward = means[arm]
            if draft_behind and arm > 0 and switch_cost > 0:
                seconds = self.mean_seconds(state, arm)
                reward *= seconds / (seconds + switch_cost / state.bin_length)
            return reward

        greedy = max(tried, key=lambda a: (value(a), -abs(a - (previous or 0))))
        explore_probability = min(1.0, self.options.explore_scale / state.bin_index)
        if self._rng.random() < explore_probability:
            if self.options.explore_arms == "neighbors":
                candidates = [a for a in (greedy - 1, greedy + 1) if 0 <= a <= self.gamma_max]
            else:
                candidates = [a for a in arms if a != greedy]
            candidates = [a for a in candidates if crossing_allowed(a)]
            dominated = [a for a in candidates if self._dominated(state, a, greedy)]
            plausible = [a for a in candidates if a not in dominated]
            if plausible:  # the paper's exploration bin
                return self._least_played(state, plausible), True
            self._maybe_probe(state, dominated, greedy, means, previous, switch_cost)
        elif self.options.probe_every_bin:
            # every arm, whatever `explore_arms` says: a wrongly eliminated arm need not be next to the greedy one
            candidates = [a for a in arms if a != greedy and crossing_allowed(a)]
            self._maybe_probe(state, [a for a in candidates if self._dominated(state, a, greedy)], greedy, means,
                              previous, switch_cost)
        return greedy, False

    def _maybe_probe(self, state: ContextState, dominated: list[int], greedy: int, means: dict[int, float],
                     previous: int | None, switch_cost: float) -> None:
        """A short re-check of a dominated arm, paid from the context's probe credit (choice 14)."""
        if not dominated or self.options.probe_length <= 0:
            return
        arm = self._least_played(state, dominated)
        length = min(self.options.probe_length, state.bin_length)
        crossing = previous is not None and (previous == 0) != (arm == 0)
        # Its expected regret: the share of the greedy's reward it loses, over its step time, plus a switch.
        loss = max(0.0, 1.0 - means[arm] / means[greedy]) if means[greedy] > 0 else 1.0
        cost = length * self.mean_seconds(state, arm) * loss + (switch_cost if crossing else 0.0)
        if cost <= state.probe_credit:
            state.probe_credit -= cost
            state.probe_arm, state.probe_remaining = arm, length

    def _least_played(self, state: ContextState, candidates: list[int]) -> int:
        fewest = min(state.decisions[a] for a in candidates)
        least_played = [a for a in candidates if state.decisions[a] == fewest]
        return int(least_played[self._rng.integers(len(least_played))])

    def _dominated(self, state: ContextState, arm: int, greedy: int) -> bool:
        """Whether `arm` is confidently worse than `greedy` (choices 12-13): mean gap > z standard errors."""
        if math.isinf(self.options.elimination_z):
            return False
        mean_arm, variance_arm = self._posterior(state, arm)
        mean_greedy, variance_greedy = self._posterior(state, greedy)
        if variance_arm is None or variance_greedy is None:
            return False
        return mean_greedy - mean_arm > self.options.elimination_z * math.sqrt(variance_arm + variance_greedy)

    # ------------------------------------------------------------------------------------------- learning
    def _observe(self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float) -> None:
        context = self.context_of(batch_size)
        state = self._state(context)
        if switch_seconds > 0:
            if state.switch_seconds is None:
                state.switch_seconds = switch_seconds
            else:
                w = self.options.switch_cost_smoothing
                state.switch_seconds = (1 - w) * state.switch_seconds + w * switch_seconds
        reward = step_reward(batch_size, num_tokens, seconds, switch_seconds)
        if reward is None:
            self._all_switch_steps += 1
            # (once, then every ALL_SWITCH_WARN_EVERY-th: a caller that only ever reports such steps warned per step)
            level = logging.WARNING if self._all_switch_steps % ALL_SWITCH_WARN_EVERY == 1 else logging.DEBUG
            logger.log(level, "step with no time outside the switch (seconds=%s); reward skipped (%d such steps so "
                       "far; logged once every %d)", seconds, self._all_switch_steps, ALL_SWITCH_WARN_EVERY)
            return
        if state.pending_probe is not None:
            probed, state.pending_probe = state.pending_probe, None
            if probed == gamma and self._stale(state, gamma, reward):
                # Restart the context as change-detecting bandits do: forget its own and prior statistics and
                # start again from the first block (short bins); keep the learned switch cost and probe credit.
                fresh = ContextState(num_arms=state.num_arms, block=self.options.first_block_exponent)
                fresh.switch_seconds, fresh.probe_credit = state.switch_seconds, state.probe_credit
                self.contexts[context] = state = fresh
        d = self.options.reward_discount
        state.weight[gamma] = d * state.weight[gamma] + 1.0
        state.reward_sum[gamma] = d * state.reward_sum[gamma] + reward
        state.seconds_sum[gamma] = d * state.seconds_sum[gamma] + (seconds - switch_seconds)
        state.count[gamma] += 1
        state.probe_credit += self.options.probe_budget * (seconds - switch_seconds)
        state.reward_moments[gamma][0] += reward
        state.reward_moments[gamma][1] += reward * reward

    def _stale(self, state: ContextState, arm: int, reward: float) -> bool:
        """Change detection on a probe (choice 14): whether the probe's reward lies more than `probe_reset_z`
        predictive standard deviations above what the arm's estimate predicts (one-sided: only an arm getting
        better can matter to a context that does not play it)."""
        if math.isinf(self.options.probe_reset_z):
            return False
        mean, variance = self._posterior(state, arm)
        observations = self._observation_variance(state, arm)
        if variance is None or observations is None:
            return False
        return reward - mean > self.options.probe_reset_z * math.sqrt(variance + observations)

    # ------------------------------------------------------------------------------------------- inspection
    def best_arms(self) -> dict[int, int]:
        """Greedy arm (best mean reward, no switch charge) per visited context with data."""
        best = {}
        for context, state in self.contexts.items():
            tried = [a for a in range(self.gamma_max + 1) if self._has_estimate(state, a)]
            if tried:
                best[context] = max(tried, key=lambda a, s=state: self.mean_reward(s, a))
        return best

    def _learned_state(self) -> dict[str, Any]:
        return {
            "contexts": {str(c): dataclasses.asdict(s) for c, s in self.contexts.items()},
            "rng": self._rng.bit_generator.state,
        }

    def _identity(self) -> dict[str, Any]:
        return {"bucket_edges": self.options.bucket_edges}

    def _load_learned_state(self, learned: dict[str, Any]) -> None:
        keys = list(learned["contexts"])
        bad = [k for k in keys if not isinstance(k, str) or not k.isascii() or not k.isdigit() or str(int(k)) != k]
        if bad:  # ("03" and "3" were one context, one dropped without a word; "abc" a bare int() error)
            raise ValueError(f"state's learned contexts must be keyed by context numbers written plainly ('0', '7'), "
                             f"got {short_repr(bad[0])}")
        contexts = {int(c): ContextState(**s) for c, s in learned["contexts"].items()}
        num_contexts = len(self.options.bucket_edges)
        for context, state in contexts.items():
            if not 0 <= context < num_contexts:
                raise ValueError(f"state's context {context} is outside 0..{num_contexts - 1} (the bucket_edges)")
            if state.num_arms != self.gamma_max + 1:
                raise ValueError(f"state's context {context} has {state.num_arms!r} arms, expected "
                                 f"{self.gamma_max + 1}")
            lists = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.default_factory is list}
            for name, value in lists.items():  # (a string or a number here skipped every check and failed in select)
                if not isinstance(value, list):
                    raise ValueError(f"state's context {context} has {name}={short_repr(value)}; allowed: a list, "
                                     f"one entry per arm 0..{self.gamma_max}")
            check_arm_lists(self.gamma_max, **lists)
            _check_context_lists(context, state, self.gamma_max)
            _check_context_scalars(context, state, self.gamma_max)
        self._rng.bit_generator.state = learned["rng"]
        self.contexts = contexts


def _check_context_lists(context: int, state: ContextState, gamma_max: int) -> None:
    """A loaded context's per-arm lists, each entry of the kind its field holds (``check_arm_lists`` let any entry be
    None or a list, and a count 2.5: a ``weight`` of None was a TypeError at the next decision): a ValueError naming
    the field and what is allowed."""
    def fail(field: str, allowed: str) -> None:
        raise ValueError(f"state's context {context} has {field}={short_repr(getattr(state, field))}; allowed: "
                         f"{allowed}, one per arm 0..{gamma_max}")

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    for field in ("weight", "reward_sum", "seconds_sum"):
        if not all(number(v) for v in getattr(state, field)):
            fail(field, "a finite number >= 0")
    for field in ("decisions", "count"):
        if not all(number(v) and is_int(v) for v in getattr(state, field)):
            fail(field, "an int >= 0")
    if not all(isinstance(m, list) and len(m) == 2 and all(number(x) for x in m) for m in state.reward_moments):
        fail("reward_moments", "a [sum of rewards, sum of their squares] pair of finite numbers >= 0")
    for field in ("prior_reward", "prior_seconds", "prior_variance", "prior_obs_variance"):
        if not all(v is None or number(v) for v in getattr(state, field)):
            fail(field, "None (no prior) or a finite number >= 0")
    if any(r is not None and s is None for r, s in zip(state.prior_reward, state.prior_seconds, strict=True)):
        fail("prior_seconds", "a number wherever prior_reward has one (both come from the same neighbour)")


def _check_context_scalars(context: int, state: ContextState, gamma_max: int) -> None:
    """A loaded context's scalar fields (its lists: ``check_arm_lists``): a ValueError naming the field and what is
    allowed, so a hand-edited or corrupted state fails as it loads, not at the next decision (an ``arm`` of 7 with
    γ_max 4 was an IndexError in ``select``)."""
    def fail(field: str, allowed: str) -> None:
        raise ValueError(f"state's context {context} has {field}={getattr(state, field)!r}; allowed: {allowed}")

    for field in ("arm", "probe_arm", "pending_probe"):
        value = getattr(state, field)
        if value is not None and not (is_int(value) and 0 <= value <= gamma_max):
            fail(field, f"None or an arm, an int in 0..{gamma_max}")
    if not (is_int(state.block) and 1 <= state.block <= MAX_BLOCK):  # (a block of 5000 overflowed a float in select)
        fail("block", f"an int in 1..{MAX_BLOCK}")
    for field in ("decisions_in_block", "bin_index", "bin_length", "decisions_in_bin", "probe_remaining"):
        value = getattr(state, field)
        if not (is_int(value) and value >= 0):
            fail(field, "an int >= 0")
    if not isinstance(state.exploring, bool):
        fail("exploring", "true or false")
    credit = state.probe_credit
    if isinstance(credit, bool) or not isinstance(credit, (int, float)) or not math.isfinite(credit):
        fail("probe_credit", "a finite number")
    switch = state.switch_seconds
    if switch is not None and (isinstance(switch, bool) or not isinstance(switch, (int, float))
                               or not math.isfinite(switch) or switch < 0):
        fail("switch_seconds", "None or a finite number >= 0")
