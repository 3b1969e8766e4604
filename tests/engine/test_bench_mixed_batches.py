"""``scripts/bench_mixed_batches.py`` on stories260K drafting for itself: every mix runs through both engines with
the same tokens; the speculative engine speculates with penalized requests in the batch and takes fewer decode
steps than the plain one (no more with JSON-schema requests)."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from nightjar_jax.testing import load_script


def test_bench_mixed_batches_smoke(tmp_path, monkeypatch, capsys):
    pytest.importorskip("xgrammar")
    bench = load_script("bench_mixed_batches.py", "bench_mixed_batches_t")
    out = tmp_path / "mixed.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_mixed_batches.py", "--model", "stories260k", "--draft-model", "stories260k", "--num-prompts", "4",
        "--max-tokens", "8", "--repeats", "2", "--out", str(out)])
    bench.main()
    rows = {(r["mix"], r["engine"]): r for r in json.loads(out.read_text())["rows"]}
    mixes = {"none", "penalties 1/4", "penalties 4/4", "repetition 4/4", "json schema 1/4", "json schema 4/4"}
    assert {m for m, _ in rows} == mixes
    for m in mixes:
        spec, plain = rows[(m, "speculative")], rows[(m, "plain")]
        assert spec["tokens"] == plain["tokens"] == 32 and plain["accepted_per_row_step"] == 0, m
        assert plain["decode_steps"] == 7 and spec["decode_tokens_per_second"] > 0, m  # (the first token: prefill)
        assert spec["decode_steps"] <= plain["decode_steps"], m
        for row in (spec, plain):  # (the table's median: the first run's figure overwrote it)
            assert row["decode_tokens_per_second"] == statistics.median(row["runs"]) and len(row["runs"]) == 2, m
        if not m.startswith("json"):  # (stories260K's own tokens rarely fit a JSON schema: few drafts accepted)
            assert spec["decode_steps"] < plain["decode_steps"] and spec["accepted_per_row_step"] > 1, m
    assert "| penalties 4/4 | speculative |" in capsys.readouterr().out
