"""Baselines that do not learn: `ar` (always γ = 0), `static:K` (always γ = K) and `table` (batch size → γ).

`table` is modelled on vLLM's batch-size rules for speculative decoding: vLLM turns speculation off above a
batch-size threshold (`speculative_disable_by_batch_size`); we add a step-down of γ before that threshold, as in
its dynamic-speculation proposals. The default table for γ_max = G is

    batch  1..4   -> G
    batch  5..16  -> ceil(G / 2)
    batch 17..32  -> 1
    batch 33..    -> 0

It is a rule of thumb, not a measurement; override it with `table=((max_batch, gamma), ...)` (rows sorted by
`max_batch`: a batch gets the γ of the first row whose bound it does not pass; batches above every bound get
γ = 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nightjar_jax.planner.base import Planner, check_int_option, is_int, is_sequence, register_planner


@register_planner("ar")
class AutoregressivePlanner(Planner):
    """Always γ = 0: plain autoregressive decoding."""

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class StaticOptions:
    gamma: int | None = None  # the fixed γ; None means gamma_max (spec "static" alone)

    def __post_init__(self) -> None:
        check_int_option(self, "gamma", minimum=0, none_allowed=True, note="(None: gamma_max)")


@register_planner("static")
class StaticPlanner(Planner):
    """Always the same γ (`static:K`; plain `static` uses gamma_max)."""

    Options = StaticOptions

    def __init__(self, gamma_max: int, options: StaticOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.gamma = gamma_max if self.options.gamma is None else self.options.gamma
        if self.gamma > gamma_max:
            raise ValueError(f"static gamma K={self.gamma} exceeds gamma_max={gamma_max}; use K in 0..{gamma_max}")

    @classmethod
    def _options_from_spec_argument(cls, argument: str, gamma_max: int) -> dict[str, Any]:
        # (ASCII digits only: int() took " 2", "+2" and other scripts' digits, which the spec then kept)
        if not (argument.isascii() and argument.isdigit()):
            raise ValueError(f"static planner spec must be 'static:K' with an int K >= 0 in digits 0-9, got "
                             f"'static:{argument}'")
        return {"gamma": int(argument)}

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        return self.gamma

    def _identity(self) -> dict[str, Any]:
        return {"gamma": self.gamma}


def default_table(gamma_max: int) -> tuple[tuple[int, int], ...]:
    """The default vLLM-style table for `gamma_max` (see module docstring)."""
    return ((4, gamma_max), (16, math.ceil(gamma_max / 2)), (32, min(1, gamma_max)))


@dataclasses.dataclass(frozen=True)
class TableOptions:
    table: tuple[tuple[int, int], ...] | None = None  # ((max_batch, gamma), ...); None: default_table(gamma_max)

    def __post_init__(self) -> None:
        if self.table is None:
            return
        if not is_sequence(self.table):
            raise ValueError(
                f"table must be a sequence of (max_batch, gamma) int pairs, e.g. ((4, 2), (16, 1)), or None, "
                f"got {self.table!r}"
            )
        pairs = []
        for index, row in enumerate(self.table):
            pair = tuple(row) if is_sequence(row) else None
            if pair is None or len(pair) != 2 or not all(is_int(v) for v in pair):  # (2.9 is not silently 2)
                raise ValueError(f"table row {index} must be a (max_batch, gamma) pair of ints, got {row!r}")
            pairs.append((int(pair[0]), int(pair[1])))
        rows = tuple(pairs)
        if not rows:
            raise ValueError("table must have at least one (max_batch, gamma) row")
        bounds = [b for b, _ in rows]
        if bounds[0] < 1 or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"table max_batch bounds must be >= 1 and strictly increasing, got {bounds}")
        if any(g < 0 for _, g in rows):
            raise ValueError(f"table gammas must be >= 0, got {[g for _, g in rows]}")
        object.__setattr__(self, "table", rows)


@register_planner("table")
class TablePlanner(Planner):
    """γ from a batch-size table (vLLM-style; see module docstring)."""

    Options = TableOptions

    def __init__(self, gamma_max: int, options: TableOptions | None = None, *, spec: str | None = None) -> None:
        super().__init__(gamma_max, options, spec=spec)
        self.table = self.options.table if self.options.table is not None else default_table(gamma_max)
        too_big = [g for _, g in self.table if g > gamma_max]
        if too_big:
            raise ValueError(f"table gammas {too_big} exceed gamma_max={gamma_max}")

    def _identity(self) -> dict[str, Any]:
        return {"table": self.table}

    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        for max_batch, gamma in self.table:
            if batch_size <= max_batch:
                return gamma
        return 0
