"""``scripts/bench_sleep.py`` on stories260K with a layer-skip draft: both levels free the weights and the KV cache,
level 1 holds the weights in host memory and level 2 nothing, no variant recompiles after a wake-up, and the
outputs are equal (checked by the script)."""

from __future__ import annotations

import json
import sys

from nightjar_jax.testing import load_script


def test_bench_sleep_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_sleep.py", "bench_sleep_t")
    out = tmp_path / "sleep.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_sleep.py", "--model", "stories260k", "--draft", "stories260k@skip=2", "--num-prompts", "2",
        "--max-tokens", "8", "--repeats", "1", "--out", str(out)])
    bench.main()  # (exits if the outputs differ)
    runs = json.loads(out.read_text())["runs"]
    (one,), (two,) = runs["1"], runs["2"]
    for run in (one, two):
        parts = run["freed_by_part"]
        assert run["freed_bytes"] == sum(parts.values()) and parts["target_weights"] and parts["target_kv"]
        assert run["device_bytes_left"] == 0 and run["new_compiles"] == 0
        if sys.platform == "linux":  # (the process's resident memory, read from /proc; None elsewhere)
            assert run["rss_awake_bytes"] > 0 and run["rss_asleep_bytes"] > 0
    weights = one["freed_by_part"]["target_weights"] + one["freed_by_part"]["draft_weights"]
    assert one["host_bytes_held"] == weights and two["host_bytes_held"] == 0
    assert "| 2 |" in capsys.readouterr().out
