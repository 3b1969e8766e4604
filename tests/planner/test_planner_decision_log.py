"""JSONL decision logging and replay."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from planner_synthetic_env import SyntheticEnv, run

from nightjar_jax.planner import DecisionLogger, make_planner, read_log, replay


def test_log_has_one_line_per_decision_with_observation(tmp_path):
    path = tmp_path / "decisions.jsonl"
    planner = make_planner("nightjar", 3, decision_log=path)
    run(planner, SyntheticEnv(seed=1), [2, 5, 9] * 20)
    planner.select(4)  # a decision with no observation (run stopped)
    planner.close()
    records = read_log(path)
    assert len(records) == 61
    first = records[0]
    assert set(first) >= {
        "planner",
        "decision",
        "context",
        "batch_size",
        "gamma",
        "num_tokens",
        "seconds",
        "switch_seconds",
        "reward",
    }
    assert first["gamma"] == first["observed_gamma"] and first["reward"] > 0
    assert records[-1]["observed_gamma"] is None and records[-1]["gamma"] == planner.last_gamma
    json.dumps(records)  # plain JSON all the way


def test_replay_reproduces_the_logged_decisions(tmp_path):
    path = tmp_path / "run.jsonl"
    with DecisionLogger(path) as log:
        planner = make_planner("nightjar", 4, seed=7)
        planner.attach_logger(log)
        gammas, _ = run(planner, SyntheticEnv(seed=2, switch_seconds=0.05), [1, 3, 20, 70, 200] * 200)
    result = replay(path, make_planner("nightjar", 4, seed=7))
    assert result.num_records == 1000 and result.all_match
    assert result.replayed_gammas == gammas
    other = replay(path, make_planner("static:1", 4))
    assert other.num_matching < other.num_records  # another planner disagrees somewhere


def test_a_log_nobody_closed_is_written_out_at_exit(tmp_path):
    """A process that exits without closing its logger (an LLM's engine, a server's) still writes every line, the
    pending decision included: lines sit in a buffer until the 64th, so a lightly used server's log was empty."""
    import subprocess
    import sys

    path = tmp_path / "exit.jsonl"
    code = ("from nightjar_jax.planner import make_planner\n"
            f"p = make_planner('nightjar', 3, decision_log={str(path)!r})\n"
            "for b in (2, 5, 9):\n"
            "    p.select(b)\n"
            "    p.observe(p.last_gamma, b, b, 0.01)\n"
            "p.select(4)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    records = read_log(path)
    assert [r["batch_size"] for r in records] == [2, 5, 9, 4] and records[-1]["observed_gamma"] is None


class _FailingFile:
    """A log file whose writes fail as on a full disk, once `fail` is set."""

    def __init__(self) -> None:
        self.fail, self.lines, self.closed = False, [], False

    def write(self, text: str) -> int:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")

    def close(self) -> None:
        self.closed = True
        self.flush()


def test_a_failing_log_warns_once_stops_and_never_breaks_the_planner(tmp_path, caplog):
    """A write error escaped select/observe (and LLMEngine.step) after the planner had already moved on."""
    path = tmp_path / "full.jsonl"
    log = DecisionLogger(path, flush_every=1)
    log._file.close()
    log._file = broken = _FailingFile()
    planner = make_planner("nightjar", 3)
    planner.attach_logger(log)
    with caplog.at_level(logging.WARNING, logger="nightjar_jax.planner.decision_log"):
        run(planner, SyntheticEnv(seed=1), [2, 5] * 5)
        broken.fail = True
        run(planner, SyntheticEnv(seed=1), [2, 5] * 50)
        planner.close()
    assert planner.num_decisions == planner.num_observations == 110
    assert len(broken.lines) == 10 and broken.closed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert "No space left on device" in warnings[0].getMessage() and isinstance(log.failed, OSError)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_log_on_a_full_disk_does_not_fail_steps(caplog):
    planner = make_planner("nightjar", 4, decision_log="/dev/full")
    with caplog.at_level(logging.WARNING, logger="nightjar_jax.planner.decision_log"):
        for _ in range(300):
            planner.observe(planner.select(3), 3, 3, 0.01)
        planner.close()
    assert planner.num_observations == 300
    assert sum("/dev/full" in r.getMessage() for r in caplog.records) == 1


def test_records_after_close_are_dropped(tmp_path):
    """observe raised RuntimeError after close (having counted the observation); select logged nothing."""
    path = tmp_path / "closed.jsonl"
    planner = make_planner("static:2", 4, decision_log=path)
    planner.observe(planner.select(1), 1, 3, 0.01)
    planner.close()
    planner.observe(planner.select(1), 1, 3, 0.01)
    planner.select(1)
    planner.close()
    assert planner.num_observations == 2 and len(read_log(path)) == 1


def test_the_documented_log_example_matches_what_the_code_writes():
    """docs/planner.md showed "context": 6 for batch 9 (5 with the default fine buckets)."""
    from nightjar_jax.planner import decision_log

    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    block = docs.split('```json\n', 1)[1].split("```", 1)[0]
    planner = make_planner("nightjar", 4)
    for example in (block, decision_log.__doc__.split("e.g.", 1)[1].split("}", 1)[0] + "}"):
        record = json.loads(" ".join(example.split()))
        assert record["context"] == planner.context_of(record["batch_size"]), example


def test_a_close_from_another_thread_never_raises_into_the_writer(tmp_path):
    """The exit hook closes the log on the main thread while a server's engine thread (a daemon) may be writing: a
    write to the just-closed file raised ValueError out of Planner.observe, so out of engine.step."""
    import threading

    log = DecisionLogger(tmp_path / "race.jsonl", flush_every=1)
    planner = make_planner("nightjar", 3)
    planner.attach_logger(log)
    errors = []

    def writer():
        try:
            for _ in range(3000):
                planner.select(4)
                planner.observe(planner.last_gamma, 4, 4, 0.01)
        except Exception as exc:  # noqa: BLE001 - what the test is about
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    while log.num_lines < 50:
        pass
    log.close()
    thread.join()
    assert errors == [] and log.num_lines == len(read_log(tmp_path / "race.jsonl"))


def test_a_log_cut_short_replays_and_a_foreign_file_is_a_clear_error(tmp_path, caplog):
    """A killed server leaves a last line cut short: it is skipped with a warning (the whole replay failed with a
    JSONDecodeError naming neither file nor line); a bad line elsewhere, or a file of something else (a planner
    state, a JSON list), is a ValueError naming the file and line."""
    path = tmp_path / "run.jsonl"
    with DecisionLogger(path) as log:
        planner = make_planner("nightjar", 4, seed=7)
        planner.attach_logger(log)
        run(planner, SyntheticEnv(seed=2), [1, 3, 20] * 20)
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-1]) + lines[-1][:13])
    with caplog.at_level(logging.WARNING, logger="nightjar_jax.planner.decision_log"):
        result = replay(cut, make_planner("nightjar", 4, seed=7))
    assert result.num_records == len(lines) - 1 and result.all_match
    assert "last line is cut short" in caplog.text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + lines[1][:13] + "\n" + lines[2])
    with pytest.raises(ValueError, match=r"decision log '.*bad.jsonl' line 2 is not JSON"):
        read_log(bad)
    for name, content in [("state.json", make_planner("nightjar", 4).to_json()), ("list.jsonl", "[1, 2]\n")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=f"{name}' line 1 is not a decision record"):
            replay(tmp_path / name, make_planner("nightjar", 4))


def test_a_decision_log_that_cannot_be_opened_is_a_value_error(tmp_path):
    """make_planner(decision_log=<a folder>) raised the raw IsADirectoryError; now a ValueError naming the argument,
    as its other bad arguments are (the engine's planner_log says the same through its option)."""
    with pytest.raises(ValueError, match=r"decision_log='.*' cannot be opened to append to \(Is a directory\): give "
                                         r"the path of a JSONL file"):
        make_planner("nightjar", 4, decision_log=tmp_path)
    planner = make_planner("nightjar", 4, decision_log=tmp_path / "sub" / "log.jsonl")  # (the folder is made)
    assert planner.select(1) in range(5)


def test_a_log_of_two_runs_or_of_larger_gammas_is_refused_before_replay(tmp_path):
    """Two runs appended to one file (a restarted server's --planner-log) replayed as one: 444 of 600 matched, no
    word why; a γ past the replaying planner's gamma_max failed midway with the planner half fed. Both are refused
    before the planner sees a record, naming the file and the record."""
    path = tmp_path / "two.jsonl"
    for _ in range(2):
        planner = make_planner("nightjar", 4, seed=3, decision_log=path)
        run(planner, SyntheticEnv(seed=4), [1, 8, 30] * 20)
        planner.close()
    fresh = make_planner("nightjar", 4, seed=3)
    with pytest.raises(ValueError, match=r"holds more than one run: record 61 is decision 1 after decision 60"):
        replay(path, fresh)
    assert fresh.num_decisions == 0  # (untouched)
    one = tmp_path / "one.jsonl"
    one.write_text("".join(open(path).readlines()[:60]))
    assert replay(one, make_planner("nightjar", 4, seed=3)).all_match
    small = make_planner("nightjar", 2, seed=3)
    with pytest.raises(ValueError, match=r"record \d+ has (observed_)?gamma=[34], which this planner \(gamma_max=2\)"):
        replay(one, small)
    assert small.num_decisions == 0


def test_loggers_and_their_arguments_are_checked_where_given(tmp_path):
    """attach_logger took anything and the next select failed inside serving ("'str' object has no attribute
    'on_select'"); decision_log=5 was a TypeError; flush_every=2.5 was taken."""
    planner = make_planner("nightjar", 2)
    with pytest.raises(ValueError, match="attach_logger takes a DecisionLogger or None, got 'x.jsonl'"):
        planner.attach_logger("x.jsonl")
    assert planner.select(1) in range(3)
    with pytest.raises(ValueError, match="a decision log's path must be a file path"):
        make_planner("nightjar", 2, decision_log=5)
    for bad in (2.5, "a", 0, True):
        with pytest.raises(ValueError, match="flush_every must be an int >= 1"):
            DecisionLogger(tmp_path / "log.jsonl", flush_every=bad)


def test_an_llm_closes_its_planner_log(tmp_path):
    """LLM had no close(): a planner_log stayed unwritten until 64 decisions or the process's exit."""
    from nightjar_jax import LLM, SamplingParams

    path = tmp_path / "d.jsonl"
    with LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=2, planner_log=str(path),
             max_model_len=64, num_pages=32) as llm:
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert path.read_text() == ""  # (buffered)
    records = read_log(path)
    assert records and replay(path, make_planner("nightjar", 2)).num_records == len(records)
