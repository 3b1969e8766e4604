"""The planner interface: one γ per decode step, learned from what past steps produced.

Vocabulary (shared by every planner module, after Nightjar, arXiv 2512.22420, §4):

- **γ (gamma)**: the speculative length of one decode step; γ = 0 is plain autoregressive (AR) decoding.
- **arm**: one candidate γ ∈ {0, ..., γ_max}.
- **decision**: one call of `Planner.select` — the γ for one decode step of the whole batch.
- **observation**: one call of `Planner.observe` — what that step produced:
  `num_tokens` committed over the whole batch in `seconds` of wall time, of which `switch_seconds` were spent
  on a draft-KV catch-up (or a draft reload) because speculation was switched back on.
- **reward**: committed tokens per second per sequence, `num_tokens / step_seconds / batch_size`, where
  `step_seconds = seconds - switch_seconds` (the switch cost is modelled separately, see `nightjar.py`).
- **switch**: a change of the chosen γ between consecutive decisions (`Planner.num_switches`).

Contract for callers (the engine, the simulator, replay):

    gamma = planner.select(batch_size, queue_len=..., free_pages=..., draft_on_device=...)
    ... run the step with gamma ...
    planner.observe(gamma, batch_size, num_tokens, seconds, switch_seconds)

`seconds` is the full wall time of the step *including* `switch_seconds` (so `switch_seconds <= seconds`).
With `draft_on_device=False` every planner returns 0 (the draft cannot run). Planners are plain Python/numpy,
never import JAX, and their learned state round-trips through JSON (`to_json` / `Planner.from_json`,
`save` / `Planner.load`) for warm starts.

New planners subclass `Planner`, define a frozen `Options` dataclass, implement `_select` / `_observe`
(and `_learned_state` / `_load_learned_state` if they learn), and register with `@register_planner("name")`.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import json
import logging
import math
import numbers
import os
import stat
import uuid
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from nightjar_jax.engine.sampling_params import short_repr  # (no JAX: a leaf module)

if TYPE_CHECKING:
    from nightjar_jax.planner.decision_log import DecisionLogger

logger = logging.getLogger(__name__)

STATE_FORMAT = "nightjar-jax/planner-state/v1"

# What `select` / `observe` accept (docs/planner.md, "Validation"). The bounds are far beyond any real decode
# step; they keep every planner's arithmetic finite: a reward is at most MAX_TOKENS_PER_SEQUENCE /
# MIN_STEP_SECONDS ~ 7e13 tokens/s/seq, so its square and its sums over any run fit a float. (Unbounded, a step
# of 1e-160 s gave rewards of 1e160 whose squares overflowed, and a batch of 2**62 overflowed int64 in `dsd`.)
MAX_BATCH_SIZE = 2**20  # sequences in one decode step
MAX_TOKENS_PER_SEQUENCE = 2**16  # tokens one sequence commits in one step (γ accepted drafts + 1 in practice)
MIN_STEP_SECONDS = 1e-9  # a step's wall time, and its time outside the switch unless that is 0
MAX_STEP_SECONDS = 86_400.0  # one day
# γ_max a planner takes (and a loaded state may name): far past any draft length (the engine serves at most 16); a
# state naming 10**9 allocated per-arm lists of that length as it loaded
MAX_GAMMA = 1024

_REGISTRY: dict[str, type[Planner]] = {}


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Options of a planner that has none."""


def _check_format(state: Any) -> None:
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"not a planner state (format {found!r}, expected {STATE_FORMAT!r})")


class Planner(abc.ABC):
    """Abstract planner: `select` a γ per decode step, `observe` what the step produced.

    Attributes read by the engine and metrics:
      `gamma_max`: the largest γ this planner may return.
      `num_switches`: how many times the returned γ changed between consecutive decisions.
      `last_gamma`: the γ returned by the latest `select` (None before the first).
      `num_decisions` / `num_observations`: call counters.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions

    def __init__(self, gamma_max: int, options: Any = None, *, spec: str | None = None) -> None:
        _check_gamma_max(gamma_max)
        self.gamma_max = int(gamma_max)
        self.options = options if options is not None else self.Options()
        self.spec = spec or self.name  # the name make_planner was called with, e.g. "static:3"
        self.num_switches = 0
        self.num_decisions = 0
        self.num_observations = 0
        self.last_gamma: int | None = None
        self._logger: DecisionLogger | None = None

    # ----------------------------------------------------------------------------------------- public API
    def select(
        self,
        batch_size: int,
        *,
        queue_len: int = 0,
        free_pages: int | None = None,
        draft_on_device: bool = True,
    ) -> int:
        """Return γ ∈ {0..gamma_max} for the next decode step of `batch_size` sequences.

        `queue_len` (waiting requests) and `free_pages` (free KV pages) are context a planner may use; the
        built-in planners use only the batch size. With `draft_on_device=False` the result is always 0.
        """
        _check_int("batch_size", batch_size, minimum=1, maximum=MAX_BATCH_SIZE)
        _check_int("queue_len", queue_len, minimum=0)
        if not isinstance(draft_on_device, (bool, np.bool_)):  # (a string 'False' is truthy: speculation on)
            raise ValueError(f"draft_on_device must be a bool, got {draft_on_device!r}")
        draft_on_device = bool(draft_on_device)
        if free_pages is not None:
            _check_int("free_pages", free_pages, minimum=0)
            free_pages = int(free_pages)
        batch_size, queue_len = int(batch_size), int(queue_len)
        if draft_on_device and self.gamma_max > 0:
            gamma = int(self._select(batch_size, queue_len=queue_len, free_pages=free_pages))
        else:
            gamma = 0  # the draft cannot run; its reload cost arrives later as switch_seconds
        if not 0 <= gamma <= self.gamma_max:
            raise RuntimeError(f"{type(self).__name__} chose gamma={gamma} outside 0..{self.gamma_max}")
        if self.last_gamma is not None and gamma != self.last_gamma:
            self.num_switches += 1
        self.last_gamma = gamma
        self.num_decisions += 1
        if self._logger is not None:
            self._logger.on_select(
                planner=self.spec,
                decision=self.num_decisions,
                context=self.context_of(batch_size),
                batch_size=batch_size,
                queue_len=queue_len,
                free_pages=free_pages,
                draft_on_device=draft_on_device,
                gamma=gamma,
            )
        return gamma

    def observe(
        self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float = 0.0
    ) -> None:
        """Record what a step with `gamma` over `batch_size` sequences produced.

        `batch_size`: 1..MAX_BATCH_SIZE.
        `num_tokens`: tokens committed in the step over the whole batch (0..batch_size * MAX_TOKENS_PER_SEQUENCE).
        `seconds`: wall time of the step, including `switch_seconds` (MIN_STEP_SECONDS..MAX_STEP_SECONDS).
        `switch_seconds`: draft catch-up / reload time paid in this step (0 <= switch_seconds <= seconds); when
        the rest, `seconds - switch_seconds`, is under MIN_STEP_SECONDS the step counts as all switch (its reward
        is skipped).
        """
        _check_int("gamma", gamma, minimum=0, maximum=self.gamma_max)
        _check_int("batch_size", batch_size, minimum=1, maximum=MAX_BATCH_SIZE)
        _check_int("num_tokens", num_tokens, minimum=0)
        gamma, batch_size, num_tokens = int(gamma), int(batch_size), int(num_tokens)
        if num_tokens > batch_size * MAX_TOKENS_PER_SEQUENCE:
            raise ValueError(
                f"num_tokens must be <= batch_size * {MAX_TOKENS_PER_SEQUENCE} = {batch_size * MAX_TOKENS_PER_SEQUENCE}"
                f" (tokens committed over the batch in one step), got {num_tokens}"
            )
        times = []
        for field, value in (("seconds", seconds), ("switch_seconds", switch_seconds)):
            try:  # (any number float() reads: a numpy or jax scalar, a Decimal; not a bool or a string)
                if isinstance(value, (bool, str, bytes)):
                    raise TypeError
                times.append(float(value))
            except (TypeError, ValueError):
                raise ValueError(f"{field} must be a number of seconds, got {value!r}") from None
        seconds, switch_seconds = times
        if not MIN_STEP_SECONDS <= seconds <= MAX_STEP_SECONDS:  # (False for NaN)
            raise ValueError(
                f"seconds must be in [{MIN_STEP_SECONDS}, {MAX_STEP_SECONDS}] (a step's wall time), got {seconds!r}"
            )
        if not 0 <= switch_seconds <= seconds:
            raise ValueError(f"switch_seconds must be in [0, seconds={seconds}], got {switch_seconds!r}")
        if 0 < seconds - switch_seconds < MIN_STEP_SECONDS:
            # (a rounding leftover of a step that was all switch, e.g. a catch-up timed a hair short of its step: a
            # reward over it would be ~1e13 tokens/s; counted as all switch, its reward is skipped)
            switch_seconds = seconds
        self.num_observations += 1
        self._observe(gamma, batch_size, num_tokens, seconds, switch_seconds)
        if self._logger is not None:
            self._logger.on_observe(
                gamma=gamma,
                batch_size=batch_size,
                num_tokens=num_tokens,
                seconds=seconds,
                switch_seconds=switch_seconds,
                reward=step_reward(batch_size, num_tokens, seconds, switch_seconds),
            )

    def context_of(self, batch_size: int) -> int | None:
        """The context id a contextual planner files `batch_size` under (None: no context)."""
        return None

    def attach_logger(self, decision_logger: DecisionLogger | None) -> None:
        """Log every decision and observation as JSONL (opt-in); None detaches. (Anything else was taken, and the
        next decision failed on it, inside serving.)"""
        if decision_logger is not None and not (callable(getattr(decision_logger, "on_select", None))
                                                and callable(getattr(decision_logger, "on_observe", None))):
            raise ValueError(f"attach_logger takes a DecisionLogger or None, got {short_repr(decision_logger)} (for "
                             "a path: make_planner(..., decision_log=path) or DecisionLogger(path))")
        self._logger = decision_logger

    def close(self) -> None:
        """Flush and close the attached decision logger, if any (call at engine shutdown)."""
        if self._logger is not None:
            self._logger.close()

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: enough to rebuild this planner and continue where it stopped."""
        return {
            "format": STATE_FORMAT,
            "spec": self.spec,
            "gamma_max": self.gamma_max,
            "options": strict_json_options(dataclasses.asdict(self.options)),
            "counters": {
                "num_switches": self.num_switches,
                "num_decisions": self.num_decisions,
                "num_observations": self.num_observations,
                "last_gamma": self.last_gamma,
            },
            "learned": self._learned_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and learned state saved by `state_dict`.

        The planner kind and gamma_max must match, and so must the options that give the state its meaning
        (`_identity`: e.g. nightjar's bucket_edges, which map context ids to batch sizes; static's K). The state is
        checked before anything is restored: a refused state leaves this planner as it was. A malformed one (a key
        missing, a value of the wrong type) is a ValueError too.
        """
        try:
            self._load_state_dict(state)
        except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as error:
            what = f"no {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"malformed planner state ({type(error).__name__}: {what}): load a state saved by "
                             f"state_dict / to_json") from None

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        _check_format(state)
        base = str(state["spec"]).split(":", 1)[0]
        if base != self.name or state["gamma_max"] != self.gamma_max:
            raise ValueError(
                f"state is for planner {state['spec']!r} with gamma_max={state['gamma_max']}, "
                f"this is {self.spec!r} with gamma_max={self.gamma_max}"
            )
        if type(self)._identity is not Planner._identity:
            try:
                options = options_from_json(state["options"])
                saved = make_planner(state["spec"], state["gamma_max"], **options)._identity()
            except (TypeError, ValueError) as error:
                raise ValueError(f"state for {state['spec']!r} has invalid options: {error}") from None
            mine = self._identity()
            differ = sorted(k for k in mine if saved.get(k) != mine[k])
            if differ:
                raise ValueError(
                    f"state is for {state['spec']!r} with "
                    + ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
                    + f"; this planner ({self.spec!r}) has "
                    + ", ".join(f"{k}={mine[k]!r}" for k in differ)
                    + ": the state means something else here; build the planner from the state instead "
                    "(Planner.from_json / Planner.load)"
                )
        counters = state["counters"]
        values = {}
        for field in ("num_switches", "num_decisions", "num_observations"):
            _check_int(f"state counter {field}", counters[field], minimum=0)
            values[field] = int(counters[field])
        last_gamma = counters["last_gamma"]
        if last_gamma is not None:
            _check_int("state counter last_gamma", last_gamma, minimum=0, maximum=self.gamma_max)
            last_gamma = int(last_gamma)
        self._load_learned_state(state["learned"])
        for field, value in values.items():
            setattr(self, field, value)
        self.last_gamma = last_gamma

    def to_json(self) -> str:
        return json.dumps(self.state_dict())

    @staticmethod
    def from_json(text: str) -> Planner:
        """Rebuild a planner (of whatever registered kind) from `to_json` output; a malformed state is a ValueError,
        as in `load_state_dict`."""
        try:
            state = json.loads(text)
        except json.JSONDecodeError as error:  # (a file cut short by a crash mid-save, a decision log's lines, ...)
            raise ValueError(f"not a planner state: invalid JSON ({error}): load a state saved by state_dict / "
                             f"to_json") from None
        except RecursionError:  # (JSON nested past Python's recursion limit: a traceback out of serve)
            raise ValueError("not a planner state: JSON nested too deep to read: load a state saved by state_dict / "
                             "to_json") from None
        _check_format(state)
        try:
            planner = make_planner(state["spec"], state["gamma_max"], **options_from_json(state["options"]))
        except (KeyError, TypeError) as error:
            what = f"no {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"malformed planner state ({type(error).__name__}: {what}): load a state saved by "
                             f"state_dict / to_json") from None
        planner.load_state_dict(state)
        return planner

    def save(self, path: str | Path) -> None:
        """Write ``to_json`` to ``path`` atomically: a crash mid-save leaves the previous file, not a cut one (a new
        file beside it, moved over it; it keeps the old file's permissions, and a file this process may not write
        is a PermissionError, as a plain write would be)."""
        path = Path(path)
        mode = None
        if path.exists():
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            mode = stat.S_IMODE(path.stat().st_mode)
        text = self.to_json()
        partial = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.partial")  # (one per save: threads too)
        try:
            partial.write_text(text, encoding="utf-8")
            if mode is not None:
                os.chmod(partial, mode)
            try:
                os.replace(partial, path)
            except OSError as exc:  # a bind-mounted file (a container's one-file volume) cannot be replaced: EBUSY;
                if exc.errno not in (errno.EBUSY, errno.EXDEV):  # written in place, as a plain write would
                    raise
                path.write_text(text, encoding="utf-8")
        finally:
            partial.unlink(missing_ok=True)

    @staticmethod
    def load(path: str | Path) -> Planner:
        """``from_json`` of a file; a file that is not a planner state's JSON (truncated by a crash mid-save, empty,
        binary, a decision log) is a ValueError naming it."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"planner state {str(path)!r} is not UTF-8 text: load a file written by save / "
                             f"to_json") from None
        try:
            return Planner.from_json(text)
        except ValueError as error:
            raise ValueError(f"planner state {str(path)!r}: {error}") from None

    # ----------------------------------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def _select(self, batch_size: int, *, queue_len: int, free_pages: int | None) -> int:
        """Choose γ (inputs validated; only called when the draft is on device and gamma_max > 0)."""

    def _observe(self, gamma: int, batch_size: int, num_tokens: int, seconds: float, switch_seconds: float) -> None:
        """Learn from one step (inputs validated). Default: nothing to learn."""
        del gamma, batch_size, num_tokens, seconds, switch_seconds

    def _learned_state(self) -> dict[str, Any]:
        return {}

    def _load_learned_state(self, learned: dict[str, Any]) -> None:
        """Restore `_learned_state` output; validate it all before assigning anything (ValueError if malformed)."""
        del learned

    def _identity(self) -> dict[str, Any]:
        """Option values that give this planner's state its meaning; `load_state_dict` refuses a state saved
        under other values. Default: none."""
        return {}

    @classmethod
    def _options_from_spec_argument(cls, argument: str, gamma_max: int) -> dict[str, Any]:
        """Options encoded after the colon of a spec such as "static:3"."""
        raise ValueError(f"planner {cls.name!r} takes no ':' argument, got {argument!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, gamma_max={self.gamma_max}, options={self.options})"


def step_reward(batch_size: int, num_tokens: int, seconds: float, switch_seconds: float = 0.0) -> float | None:
    """Committed tokens per second per sequence of one step, excluding switch time (None if undefined)."""
    step_seconds = seconds - switch_seconds
    if step_seconds <= 0:
        return None
    return num_tokens / step_seconds / batch_size


def strict_json_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as strict JSON holds them: an infinite number (``prior_transfer_sd=inf``, a documented value) as the
    string "inf" / "-inf" (``json.dumps`` wrote the bare token Infinity, which JSON parsers other than Python's
    refuse); :func:`options_from_json` reads them back."""
    def strict(v: Any) -> Any:
        return ("inf" if v > 0 else "-inf") if isinstance(v, float) and math.isinf(v) else v

    return {k: strict(v) for k, v in options.items()}


def options_from_json(options: Any) -> Any:
    if not isinstance(options, dict):  # (a malformed state: make_planner's TypeError says so)
        return options
    return {k: float(v) if isinstance(v, str) and v in ("inf", "-inf") else v for k, v in options.items()}


def register_planner(name: str):
    """Class decorator: make a `Planner` subclass available to `make_planner(name, ...)`."""

    def decorate(cls: type[Planner]) -> type[Planner]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"planner name {name!r} already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def known_planners() -> list[str]:
    """Registered planner names (a spec may add ':ARG' where the planner takes one, e.g. 'static:2')."""
    return sorted(_REGISTRY)


def planner_class(name: str) -> type[Planner]:
    """The registered class of a planner spec (``name`` or ``name:ARG``); ValueError naming the known ones."""
    cls = _REGISTRY.get(name.partition(":")[0])
    if cls is None:
        raise ValueError(f"unknown planner {name!r}; known planners: {', '.join(known_planners())}")
    return cls


def make_planner(
    name: str, gamma_max: int, *, decision_log: str | Path | DecisionLogger | None = None, **options: Any
) -> Planner:
    """Build a registered planner by name.

    `name` is a registered name or `name:ARG` (e.g. "static:3"). `options` are fields of that planner's frozen
    `Options` dataclass. `decision_log` (a path or a `DecisionLogger`) turns on JSONL decision logging.
    Raises ValueError for unknown names, bad gamma_max and bad options.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"planner name must be a non-empty string, got {name!r}")
    _check_gamma_max(gamma_max)
    gamma_max = int(gamma_max)
    base, colon, argument = name.partition(":")
    cls = planner_class(name)
    if colon and not argument.strip():  # ("static:" acted as "static" without a word)
        raise ValueError(f"planner spec {name!r} has an empty argument after ':': give one, or write {base!r}")
    if argument:
        from_spec = cls._options_from_spec_argument(argument, gamma_max)
        for field, value in from_spec.items():
            # Equal values are fine (`from_json` passes a state's spec and its options); different ones would
            # leave the spec naming one planner and the options building another.
            if field in options and options[field] != value:
                raise ValueError(
                    f"planner spec {name!r} sets {field}={value!r}, but the option {field}={options[field]!r} "
                    f"disagrees; give {field} once (in the spec or as an option)"
                )
        options = {**from_spec, **options}  # (the option as given: its own checks see it, gamma=2.0 too)
    field_names = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - field_names)
    if unknown:
        raise ValueError(
            f"planner {base!r} has no option(s) {unknown}; its options are: {sorted(field_names) or 'none'}"
        )
    planner = cls(gamma_max, cls.Options(**options), spec=name)
    if decision_log is not None:
        from nightjar_jax.planner.decision_log import DecisionLogger

        try:
            logger = decision_log if isinstance(decision_log, DecisionLogger) else DecisionLogger(decision_log)
        except OSError as exc:  # (a folder, a read-only place: it was the raw IsADirectoryError)
            why = exc.strerror or exc
            raise ValueError(f"decision_log={str(decision_log)!r} cannot be opened to append to ({why}): give the "
                             f"path of a JSONL file (its folder is created)") from None
        planner.attach_logger(logger)
    return planner


def is_int(value: Any) -> bool:
    """Whether `value` is an integer: a Python int or a numpy integer (engines and simulators pass those
    around), never a bool (True would silently be 1) nor a float (2.9 would silently be 2)."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def is_sequence(value: Any) -> bool:
    """Whether `value` is an ordered collection of items (list, tuple, range, numpy array), not a string,
    set or mapping (whose items are characters, unordered or keys)."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, AbstractSet, Mapping))


def check_int_option(
    options: Any, field: str, *, minimum: int, maximum: int | None = None, none_allowed: bool = False, note: str = ""
) -> None:
    """Validate the int field `field` of a frozen `options` dataclass (in `__post_init__`) and store it as an int.

    Raises ValueError naming the field, what is allowed (`note` explains special values, e.g. "(0: no probes)")
    and the value given.
    """
    value = getattr(options, field)
    if value is None and none_allowed:
        return
    allowed = f"an int >= {minimum}" if maximum is None else f"an int in {minimum}..{maximum}"
    allowed += " or None" if none_allowed else ""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{field} must be {allowed}{f' {note}' if note else ''}, got {value!r}")
    object.__setattr__(options, field, int(value))


def check_number_option(
    options: Any,
    field: str,
    *,
    minimum: float,
    maximum: float = math.inf,
    open_minimum: bool = False,
    finite: bool = False,
    note: str = "",
) -> None:
    """Validate the real-number field `field` of a frozen `options` dataclass and store it as a float.

    Allowed: `minimum` <= value (or < with `open_minimum`) <= `maximum`; NaN never, inf only without `finite`.
    Ints are numbers here (explore_scale=1 is fine); bools and strings are not. Raises ValueError naming the
    field, what is allowed and the value given.
    """
    value = getattr(options, field)
    low = f"> {minimum:g}" if open_minimum else f">= {minimum:g}"
    if math.isinf(maximum):
        allowed = f"a {'finite ' if finite else ''}number {low}"
    else:
        allowed = f"a number in {'(' if open_minimum else '['}{minimum:g}, {maximum:g}]"
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        number = float(value)
        ok = (number > minimum if open_minimum else number >= minimum) and number <= maximum
        ok = ok and (math.isfinite(number) or not finite)
    if not ok:
        raise ValueError(f"{field} must be {allowed}{f' {note}' if note else ''}, got {value!r}")
    object.__setattr__(options, field, number)


def check_arm_lists(gamma_max: int, **lists: Any) -> None:
    """ValueError unless every list of a loaded state has one entry per arm (gamma_max + 1), each None (no value yet)
    or a finite number >= 0 (counts, sums of rewards and seconds, variances: none is negative), or a list of them.
    A negative count or a NaN sum was taken and failed later, inside a decision ("math domain error")."""
    def bad(value: Any) -> bool:
        if isinstance(value, list):
            return any(bad(v) for v in value)
        if value is None:
            return False
        return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0

    for field, values in lists.items():
        if len(values) != gamma_max + 1:
            raise ValueError(
                f"state's learned {field} has {len(values)} entries, expected {gamma_max + 1} (one per arm "
                f"0..{gamma_max})"
            )
        if bad(list(values)):
            raise ValueError(f"state's learned {field} must hold finite numbers >= 0 (or None), got {values!r}")


def learned_arm_list(learned: dict[str, Any], field: str, gamma_max: int, *, counts: bool = False) -> list:
    """A loaded state's per-arm list ``learned[field]`` as floats (``counts``: as ints), checked as ``check_arm_lists``
    checks it and stricter: one finite number >= 0 per arm, no None (these planners have no "no value yet"), counts
    whole. A hand-edited state's strings and fractions ("7", 2.9) were coerced (``int("7")``, ``int(2.9)`` = 2)."""
    values = learned[field]
    if not isinstance(values, list):
        raise ValueError(f"state's learned {field} must be a list, one entry per arm 0..{gamma_max}, got "
                         f"{short_repr(values)}")
    if len(values) != gamma_max + 1:
        check_arm_lists(gamma_max, **{field: values})  # (its message for a list of the wrong length)
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)
    if not ok or (counts and not all(is_int(v) for v in values)):
        what = "whole numbers >= 0 (counts)" if counts else "finite numbers >= 0"
        raise ValueError(f"state's learned {field} must hold {what}, one per arm, got {short_repr(values)}")
    return [int(v) if counts else float(v) for v in values]


def _check_gamma_max(gamma_max: Any) -> None:
    if not is_int(gamma_max) or not 0 <= gamma_max <= MAX_GAMMA:
        raise ValueError(f"gamma_max must be an int in 0..{MAX_GAMMA}, got {short_repr(gamma_max)}")


def _check_int(field: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if not is_int(value):
        raise ValueError(f"{field} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{field} must be {allowed}, got {value}")
