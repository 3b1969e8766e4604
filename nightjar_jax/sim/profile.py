"""Cost profiles: what a decode step costs and how often drafts are accepted, as data.

Vocabulary: a **cost surface** gives step seconds as a function of (batch size, γ, mean context length) on a
measured **grid**; between grid points it is interpolated linearly (and extrapolated linearly beyond the batch
and context ranges, clamped to stay positive). **Acceptance per position** α_i is the probability that draft
token i is accepted given drafts 1..i-1 were (Nightjar, arXiv 2512.22420, §2). **Catch-up** is the draft prefill
over tokens it skipped while γ = 0; **reload** moves the draft weights back from host memory.

JSON schema (`schema: "nightjar-jax/cost-profile/v1"`):

    kind                      "measured" or "synthetic-model" (a model, not a measurement); required
    label, notes, device, target, draft   free text
    batch_sizes               [nb] increasing ints
    gammas                    [ng] = 0..gamma_max
    context_lengths           [nc] increasing ints (mean tokens per sequence in the batch)
    step_seconds              [nb][ng][nc] seconds of one decode step (draft + verify for γ > 0)
    acceptance_per_position   [gamma_max] α_1..α_γmax
    prefill_seconds           {"fixed": s, "per_token": s}
    catchup_seconds           {"fixed": s, "per_token": s}
    reload_seconds            seconds to bring the draft back on device
    kv_budget_pages, page_size, max_num_seqs   defaults for the simulator's memory and batch limits (ints >= 1)

Every number is checked at construction and when a file is read, never converted (`ValueError` naming the JSON
field and the allowed range; a float where an int belongs, a string or a bool for a number, a missing field are
refused): step seconds in [1e-9, 86400] (the planners' range of one step), the other costs finite and >= 0 with a
prefill step taking time (``fixed`` or ``per_token`` > 0), acceptances in [0, 1], sizes ints >= 1, gamma_max >= 1.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nightjar_jax.planner.base import MAX_STEP_SECONDS, MIN_STEP_SECONDS, is_int, is_sequence

SCHEMA = "nightjar-jax/cost-profile/v1"
PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES_DIR / "synthetic_llama7b_llama68m_h200.json"


def _axis_weights(axis: Sequence[float], x: float) -> tuple[int, float]:
    """(i, t) with x ≈ axis[i] + t·(axis[i+1] - axis[i]); t outside [0, 1] extrapolates linearly."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


_COST_FIELDS = {  # attribute -> its name in the JSON
    "prefill_fixed_seconds": "prefill_seconds.fixed",
    "prefill_seconds_per_token": "prefill_seconds.per_token",
    "catchup_fixed_seconds": "catchup_seconds.fixed",
    "catchup_seconds_per_token": "catchup_seconds.per_token",
    "reload_seconds": "reload_seconds",
}


_REQUIRED = object()  # (from_dict: a field without a default)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Step cost surface and acceptance per position (see module docstring for the JSON schema)."""

    batch_sizes: tuple[int, ...]
    gammas: tuple[int, ...]
    context_lengths: tuple[int, ...]
    step_seconds_grid: tuple[tuple[tuple[float, ...], ...], ...]  # [nb][ng][nc]
    acceptance_per_position: tuple[float, ...]  # [gamma_max]
    prefill_fixed_seconds: float
    prefill_seconds_per_token: float
    catchup_fixed_seconds: float
    catchup_seconds_per_token: float
    reload_seconds: float = 0.0
    kv_budget_pages: int = 10_000
    page_size: int = 16
    max_num_seqs: int = 256
    kind: str | None = None  # required: "measured" or "synthetic-model" (no default: the two must not be confused)
    label: str = ""
    notes: str = ""
    device: str = ""
    target: str = ""
    draft: str = ""

    def __post_init__(self) -> None:
        nb, ng, nc = len(self.batch_sizes), len(self.gammas), len(self.context_lengths)
        if self.kind is None:
            raise ValueError(
                "kind is required: 'measured' (measured by the engine, e.g. scripts/measure_profile.py) or "
                "'synthetic-model' (a model, not a measurement)"
            )
        if self.kind not in ("measured", "synthetic-model"):
            raise ValueError(f"kind must be 'measured' or 'synthetic-model', got {self.kind!r}")
        if ng < 2 or not all(is_int(g) for g in self.gammas) or list(self.gammas) != list(range(ng)):
            raise ValueError(f"gammas must be 0..gamma_max with gamma_max >= 1 (a profile without a γ > 0 step "
                             f"compares no speculation), got {list(self.gammas)}")
        for name, axis, minimum in (("batch_sizes", self.batch_sizes, 1), ("context_lengths", self.context_lengths, 0)):
            if not all(is_int(x) for x in axis) or (axis and axis[0] < minimum):
                raise ValueError(f"{name} must be ints >= {minimum}, got {list(axis)}")
            if not axis or any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
                raise ValueError(f"{name} must be non-empty and strictly increasing, got {list(axis)}")
        shape = (len(self.step_seconds_grid), *{len(row) for row in self.step_seconds_grid})
        if shape != (nb, ng) or any(len(cell) != nc for row in self.step_seconds_grid for cell in row):
            raise ValueError(f"step_seconds must have shape [{nb}][{ng}][{nc}] (batch, gamma, context)")
        for ib, row in enumerate(self.step_seconds_grid):
            for ig, cell in enumerate(row):
                for ic, s in enumerate(cell):
                    if not (_is_number(s) and MIN_STEP_SECONDS <= s <= MAX_STEP_SECONDS):
                        raise ValueError(f"step_seconds[{ib}][{ig}][{ic}] must be a number of seconds in "
                                         f"[{MIN_STEP_SECONDS:g}, {MAX_STEP_SECONDS:g}], got {s!r}")
        if len(self.acceptance_per_position) != self.gamma_max:
            raise ValueError(f"acceptance_per_position must have gamma_max={self.gamma_max} entries")
        if any(not (_is_number(a) and 0 <= a <= 1) for a in self.acceptance_per_position):
            raise ValueError(
                f"acceptance_per_position entries must be in [0, 1], got {list(self.acceptance_per_position)}"
            )
        for field, name in _COST_FIELDS.items():
            value = getattr(self, field)
            if not (_is_number(value) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.prefill_fixed_seconds == 0 and self.prefill_seconds_per_token == 0:
            raise ValueError("prefill_seconds.fixed and prefill_seconds.per_token are both 0: a prefill step must "
                             "take time (one of them > 0)")
        for field in ("kv_budget_pages", "page_size", "max_num_seqs"):
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")

    @property
    def gamma_max(self) -> int:
        return len(self.gammas) - 1

    # ------------------------------------------------------------------------------------------- costs
    def step_seconds(self, batch_size: int, gamma: int, mean_context: float) -> float:
        """Seconds of one decode step (bilinear in batch and context on the grid; γ must be on the grid)."""
        if not is_int(gamma) or not 0 <= gamma <= self.gamma_max:
            raise ValueError(f"gamma must be an int in 0..{self.gamma_max} for this profile, got {gamma!r}")
        if not batch_size >= 1:  # (False for NaN)
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if not 0 <= mean_context < math.inf:
            raise ValueError(f"mean_context must be a finite number >= 0, got {mean_context!r}")
        ib, tb = _axis_weights(self.batch_sizes, batch_size)
        ic, tc = _axis_weights(self.context_lengths, mean_context)
        nb, nc = len(self.batch_sizes), len(self.context_lengths)

        def at(i: int, j: int) -> float:
            return self.step_seconds_grid[min(i, nb - 1)][gamma][min(j, nc - 1)]

        low = at(ib, ic) + tc * (at(ib, ic + 1) - at(ib, ic))
        high = at(ib + 1, ic) + tc * (at(ib + 1, ic + 1) - at(ib + 1, ic))
        value = low + tb * (high - low)
        return max(value, 0.25 * self.step_seconds_grid[0][gamma][0])  # extrapolation must stay positive

    def prefill_seconds(self, num_tokens: int) -> float:
        return self.prefill_fixed_seconds + self.prefill_seconds_per_token * num_tokens

    def catchup_seconds(self, num_tokens: int) -> float:
        """Draft catch-up over `num_tokens` skipped tokens (0 if none)."""
        return self.catchup_fixed_seconds + self.catchup_seconds_per_token * num_tokens if num_tokens > 0 else 0.0

    def expected_tokens(self, gamma: int) -> float:
        """Expected committed tokens per sequence per step: 1 + Σ_i Π_{j<=i} α_j."""
        if not is_int(gamma) or not 0 <= gamma <= self.gamma_max:
            raise ValueError(f"gamma must be an int in 0..{self.gamma_max} for this profile, got {gamma!r}")
        total, survive = 1.0, 1.0
        for alpha in self.acceptance_per_position[:gamma]:
            survive *= alpha
            total += survive
        return total

    # ------------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": self.kind,
            "label": self.label,
            "notes": self.notes,
            "device": self.device,
            "target": self.target,
            "draft": self.draft,
            "batch_sizes": list(self.batch_sizes),
            "gammas": list(self.gammas),
            "context_lengths": list(self.context_lengths),
            "step_seconds": [[list(cell) for cell in row] for row in self.step_seconds_grid],
            "acceptance_per_position": list(self.acceptance_per_position),
            "prefill_seconds": {"fixed": self.prefill_fixed_seconds, "per_token": self.prefill_seconds_per_token},
            "catchup_seconds": {"fixed": self.catchup_fixed_seconds, "per_token": self.catchup_seconds_per_token},
            "reload_seconds": self.reload_seconds,
            "kv_budget_pages": self.kv_budget_pages,
            "page_size": self.page_size,
            "max_num_seqs": self.max_num_seqs,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        """A profile from its JSON object. Values are passed on as read, never converted (2.9 is not the batch
        size 2, "0.5" not a number), so each is checked by name; a missing or misshapen field is refused."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object"
            raise ValueError(f"not a cost profile: schema {got!r}, expected {SCHEMA!r}")

        def field(name: str, default: Any = _REQUIRED) -> Any:
            if name in data:
                return data[name]
            if default is _REQUIRED:
                raise ValueError(f"the profile has no {name!r} field (required; see the schema in {__name__})")
            return default

        def items(name: str, value: Any) -> tuple:
            if not is_sequence(value):
                raise ValueError(f"{name} must be a list, got {value!r}")
            return tuple(value)

        def number(value: Any) -> Any:  # an int is that number; anything else goes on as read, to be checked
            return float(value) if _is_number(value) else value

        def costs(name: str) -> tuple[Any, Any]:
            value = field(name)
            if not isinstance(value, dict) or set(value) != {"fixed", "per_token"}:
                raise ValueError(f'{name} must be an object {{"fixed": seconds, "per_token": seconds}}, got {value!r}')
            return number(value["fixed"]), number(value["per_token"])

        grid = items("step_seconds", field("step_seconds"))
        grid = tuple(
            tuple(tuple(number(s) for s in items(f"step_seconds[{ib}][{ig}]", cell))
                  for ig, cell in enumerate(items(f"step_seconds[{ib}]", row)))
            for ib, row in enumerate(grid)
        )
        prefill_fixed, prefill_per_token = costs("prefill_seconds")
        catchup_fixed, catchup_per_token = costs("catchup_seconds")
        text = {name: field(name, "") for name in ("label", "notes", "device", "target", "draft")}
        for name, value in text.items():
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        return cls(
            batch_sizes=items("batch_sizes", field("batch_sizes")),
            gammas=items("gammas", field("gammas")),
            context_lengths=items("context_lengths", field("context_lengths")),
            step_seconds_grid=grid,
            acceptance_per_position=tuple(
                number(a) for a in items("acceptance_per_position", field("acceptance_per_position"))
            ),
            prefill_fixed_seconds=prefill_fixed,
            prefill_seconds_per_token=prefill_per_token,
            catchup_fixed_seconds=catchup_fixed,
            catchup_seconds_per_token=catchup_per_token,
            reload_seconds=number(field("reload_seconds", 0.0)),
            kv_budget_pages=field("kv_budget_pages", 10_000),
            page_size=field("page_size", 16),
            max_num_seqs=field("max_num_seqs", 256),
            kind=field("kind", None),
            **text,
        )

    @classmethod
    def from_json(cls, path: str | Path | None = None) -> CostProfile:
        """Load a profile file (default: the checked-in synthetic llama-7b/llama-68m H200 model)."""
        return cls.from_dict(json.loads(Path(path or DEFAULT_PROFILE).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))
