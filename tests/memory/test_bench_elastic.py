"""``scripts/bench_elastic.py`` on stories260K: both modes serve the burst with identical greedy outputs, ``auto``
offloads and runs more requests at once on the extension, and the JSON holds every column."""

from __future__ import annotations

import json
import sys

from nightjar_jax.testing import load_script


def test_bench_elastic_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_elastic.py", "bench_elastic_t")
    out = tmp_path / "elastic.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_elastic.py", "--model", "stories260k", "--draft", "stories260k@skip=2", "--num-prompts", "6",
        "--max-tokens", "12", "--prompt-len", "32", "--kv-cache-bytes", "160KiB", "--warmup-rounds", "0",
        "--rounds", "1", "--out", str(out)])
    bench.main()  # (raises if the two modes' outputs differed or pages leaked)
    summary = json.loads(out.read_text())["summary"]
    off, auto = summary["off"], summary["auto"]
    assert off["offloads"] == 0 and auto["offloads"] >= 1 and auto["extension_pages"] > 0
    assert auto["most_running"] > off["most_running"]
    assert auto["device_bytes_peak"] <= auto["device_bytes_start"]
    assert "| auto |" in capsys.readouterr().out
