"""``scripts/bench_structured.py`` on stories260K: every mode runs the same requests (their tokens counted), the
constrained ones report their constraint's host time, and the JSON and table hold every row."""

from __future__ import annotations

import json
import sys

import pytest

from nightjar_jax.testing import load_script

pytest.importorskip("xgrammar")


def test_bench_structured_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_structured.py", "bench_structured_t")
    out = tmp_path / "structured.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_structured.py", "--model", "stories260k", "--num-prompts", "2", "--max-tokens", "6",
        "--batch-sizes", "2", "--repeats", "1", "--out", str(out)])
    bench.main()
    rows = {r["constraint"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "json schema", "json object", "regex"}
    assert rows["none"]["itl_ratio_to_none"] == 1 and rows["none"]["constraint_host_seconds_per_token"] is None
    for name, row in rows.items():
        assert row["tokens"] == 12 and row["tokens_per_second"] > 0 and row["mean_itl_seconds"] > 0, name
        if name != "none":
            assert row["constraint_host_seconds_per_token"] > 0
    assert "| 2 | json schema |" in capsys.readouterr().out
