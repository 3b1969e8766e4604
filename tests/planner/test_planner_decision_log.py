"""JSONL decision logging and replay."""

from __future__ import annotations

import json

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
