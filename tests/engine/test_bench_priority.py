"""``scripts/bench_priority.py`` on stories260K: urgent requests behind a backlog start sooner under the priority
policy than under fcfs (in engine steps, which noise cannot move), the background pays for it, the outputs are equal
(checked by the script), and the JSON and table hold both policies."""

from __future__ import annotations

import json
import sys

from nightjar_jax.testing import load_script


def test_bench_priority_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_priority.py", "bench_priority_t")
    out = tmp_path / "priority.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_priority.py", "--model", "stories260k", "--num-background", "4", "--num-urgent", "2",
        "--background-tokens", "8", "--urgent-tokens", "4", "--max-num-seqs", "2", "--repeats", "1",
        "--out", str(out)])
    bench.main()  # (exits if the outputs differ)
    result = json.loads(out.read_text())
    (fcfs,), (prio,) = result["runs"]["fcfs"], result["runs"]["priority"]
    assert prio["urgent"]["ttft_steps"] < fcfs["urgent"]["ttft_steps"]
    assert prio["background"]["e2e_steps"] >= fcfs["background"]["e2e_steps"]
    assert result["ratios"]["urgent_ttft_steps"] < 1
    assert "| priority |" in capsys.readouterr().out
