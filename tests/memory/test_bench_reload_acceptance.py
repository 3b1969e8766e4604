"""``scripts/bench_reload_acceptance.py`` on stories260K: both runs give the same greedy outputs (checked by the
script), the moved run offloads and reloads once, and the JSON holds each run's acceptance."""

from __future__ import annotations

import json
import sys

from nightjar_jax.testing import load_script


def test_bench_reload_acceptance_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_reload_acceptance.py", "bench_reload_acceptance_t")
    out = tmp_path / "reload.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_reload_acceptance.py", "--model", "stories260k", "--draft", "stories260k@skip=2", "--num-prompts", "2",
        "--max-tokens", "24", "--offload-at", "4", "--mark", "6", "--out", str(out)])
    bench.main()  # (exits if the outputs differ)
    runs = json.loads(out.read_text())["runs"]
    still, moved = runs["no move"], runs["away before step 4 for 2 steps"]
    assert (still["offloads"], still["reloads"]) == (0, 0) and (moved["offloads"], moved["reloads"]) == (1, 1)
    assert moved["away_steps"] == 2 and still["away_steps"] == 0  # (the steps it was really away: the label's)
    assert still["speculative_steps"] > 0 and moved["speculative_steps"] > 0
    assert 1.0 <= moved["mean_accepted_length"] <= 1 + 4 and 1.0 <= still["mean_accepted_length"] <= 1 + 4
    assert "| no move |" in capsys.readouterr().out
