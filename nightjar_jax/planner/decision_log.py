"""Opt-in JSONL log of planner decisions, and `replay` to feed a logged run back through a planner.

One line per decision (a `select` and the `observe` that followed it), e.g.

    {"planner": "nightjar", "decision": 17, "context": 5, "batch_size": 9, "queue_len": 0, "free_pages": 812,
     "draft_on_device": true, "gamma": 2, "observed_gamma": 2, "num_tokens": 21, "seconds": 0.0113,
     "switch_seconds": 0.0, "reward": 206.5}

Observation fields are null when a decision was not followed by an observation (the run stopped, or the engine's
step compiled a variant: its seconds timed the compiler, so the planner is not shown them).
Replaying a log through a fresh planner of the same kind, options and seed reproduces its decisions exactly,
because planners see nothing but these fields (and their own seeded RNG).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import IO, Any

from nightjar_jax.engine.sampling_params import short_repr
from nightjar_jax.planner.base import Planner, is_int

logger = logging.getLogger(__name__)

_OBSERVATION_FIELDS = ("observed_gamma", "num_tokens", "seconds", "switch_seconds", "reward")


class DecisionLogger:
    """Writes one JSON line per planner decision to `path` (appends; `close()` or use as a context manager).

    The log is a diagnostic and must never break serving: a write or flush that fails (disk full, file system gone)
    logs one warning naming the path and the error, and the logger stops (`failed` is set; later records are
    dropped). Records that arrive after `close()` are dropped too (an engine closed and then stepped again).
    """

    def __init__(self, path: str | Path, *, flush_every: int = 64) -> None:
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise ValueError(f"a decision log's path must be a file path (str or PathLike), got {short_repr(path)}")
        if not is_int(flush_every) or flush_every < 1:
            raise ValueError(f"flush_every must be an int >= 1 (records between flushes), got "
                             f"{short_repr(flush_every)}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._pending: dict[str, Any] | None = None
        self._flush_every = max(1, flush_every)
        self.num_lines = 0
        self.failed: OSError | None = None  # the error that stopped the log, if one did
        # (writes and close under one lock: the exit hook closes on the main thread while a server's engine thread,
        # a daemon, may still be writing; a write to the just-closed file raised ValueError out of engine.step)
        self._lock = threading.RLock()
        # closed at interpreter exit too (its buffered lines and a pending record written): a server's or an LLM's
        # engine that nobody closed lost its last lines, or a lightly used server's whole log, on a clean exit
        ref = weakref.ref(self)
        atexit.register(lambda: (log := ref()) is not None and log.close())

    def on_select(self, **decision: Any) -> None:
        """Called by `Planner.select`: starts a record (writing the previous one if it had no observation)."""
        with self._lock:
            if self._pending is not None:
                self._write(self._pending)
            self._pending = {**decision, **dict.fromkeys(_OBSERVATION_FIELDS)}

    def on_observe(self, *, gamma: int, **observation: Any) -> None:
        """Called by `Planner.observe`: completes the pending record and writes it."""
        with self._lock:
            record = self._pending if self._pending is not None else {"decision": None, "gamma": None}
            record.update(observed_gamma=gamma, **observation)
            self._pending = None
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:  # closed, or stopped by a failed write
                return
            try:
                self._file.write(json.dumps(record) + "\n")
                self.num_lines += 1
                if self.num_lines % self._flush_every == 0:
                    self._file.flush()
            except OSError as error:
                self._stop(error)

    def _stop(self, error: OSError) -> None:
        self.failed = error
        logger.warning("decision log %s: %s; decision logging stopped (serving goes on)", self.path, error)
        file, self._file = self._file, None
        self._pending = None
        try:
            file.close()  # (flushes the buffer again, which fails the same way)
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            if self._pending is not None:
                self._write(self._pending)
                self._pending = None
            if self._file is None:  # the pending record's write failed
                return
            try:
                self._file.close()
            except OSError as error:
                self._stop(error)
            self._file = None

    def __enter__(self) -> DecisionLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a decision log, in order. A last line cut short (the log flushes every few records, so a
    killed server leaves one) is skipped with a warning; any other line that is not a JSON object is a ValueError
    naming the file and line."""
    with Path(path).open(encoding="utf-8") as f:
        lines = f.readlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not line.endswith("\n"):
                logger.warning("decision log %s: its last line is cut short (a run that was killed?): skipped", path)
                continue
            raise ValueError(f"decision log {str(path)!r} line {number} is not JSON ({error})") from None
        if not isinstance(record, dict) or "gamma" not in record:
            raise ValueError(f"decision log {str(path)!r} line {number} is not a decision record (a JSON object with "
                             f"'gamma', as DecisionLogger writes), got {short_repr(record)}")
        records.append(record)
    return records


def _check_replayable(path: str | Path, records: list[dict[str, Any]], planner: Planner) -> None:
    """One run's records whose γ the planner can take: a log appended to by a second run (a restarted server's
    ``--planner-log``) replayed as one run matched partly, without a word; a γ past the planner's ``gamma_max``
    failed midway, the planner fed half the log."""
    previous = None
    for index, record in enumerate(records, 1):
        decision = record.get("decision")
        if decision is not None:
            if previous is not None and is_int(decision) and is_int(previous) and decision <= previous:
                raise ValueError(f"decision log {str(path)!r} holds more than one run: record {index} is decision "
                                 f"{decision} after decision {previous} (a later run appended to the file, e.g. a "
                                 "restarted server's --planner-log): replay each run alone (split the file where "
                                 "the numbers start again)")
            previous = decision
        for field in ("gamma", "observed_gamma"):
            gamma = record.get(field)
            if gamma is not None and (not is_int(gamma) or not 0 <= gamma <= planner.gamma_max):
                raise ValueError(f"decision log {str(path)!r} record {index} has {field}={short_repr(gamma)}, which "
                                 f"this planner (gamma_max={planner.gamma_max}) cannot take: replay it through a "
                                 "planner of the logged run's gamma_max")


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    logged_gammas: list[int | None]  # [num_records] γ the logged planner chose
    replayed_gammas: list[int | None]  # [num_records] γ the replayed planner chose (None: observation only)
    num_matching: int  # records where both agree

    @property
    def num_records(self) -> int:
        return len(self.logged_gammas)

    @property
    def all_match(self) -> bool:
        return self.num_matching == self.num_records


def replay(path: str | Path, planner: Planner) -> ReplayResult:
    """Feed a logged run through `planner`: each record's `select` inputs, then its logged observation.

    The planner is asked for its own γ, but observes what the logged step actually did (counterfactual
    rewards are unknown), so this reproduces the logged planner exactly when `planner` is a fresh planner of
    the same spec, options and seed, and otherwise shows where another planner would have decided differently.
    """
    records = read_log(path)
    _check_replayable(path, records, planner)  # (before the planner sees a record: a refused log changes nothing)
    logged: list[int | None] = []
    replayed: list[int | None] = []
    for record in records:
        chosen = None
        if record.get("batch_size") is not None and record.get("decision") is not None:
            chosen = planner.select(
                record["batch_size"],
                queue_len=record.get("queue_len", 0),
                free_pages=record.get("free_pages"),
                draft_on_device=record.get("draft_on_device", True),
            )
        if record.get("observed_gamma") is not None:
            planner.observe(
                record["observed_gamma"],
                record["batch_size"],
                record["num_tokens"],
                record["seconds"],
                record.get("switch_seconds", 0.0),
            )
        logged.append(record.get("gamma"))
        replayed.append(chosen)
    matching = sum(1 for a, b in zip(logged, replayed, strict=True) if a == b)
    logger.info("replayed %d records from %s: %d match", len(logged), path, matching)
    return ReplayResult(logged_gammas=logged, replayed_gammas=replayed, num_matching=matching)
