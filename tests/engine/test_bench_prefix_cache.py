"""``scripts/bench_prefix_cache.py`` on stories260K: the cache on computes fewer prompt tokens than off, its hits
are the difference, the outputs are equal (checked by the script), and the JSON and table hold both runs."""

from __future__ import annotations

import json
import sys

from nightjar_jax.testing import load_script


def test_bench_prefix_cache_smoke(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_prefix_cache.py", "bench_prefix_cache_t")
    out = tmp_path / "prefix.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_prefix_cache.py", "--model", "stories260k", "--num-prompts", "3", "--max-tokens", "4",
        "--system-chars", "200", "--repeats", "1", "--out", str(out)])
    bench.main()  # (exits if the outputs differ)
    result = json.loads(out.read_text())
    (off,), (on,) = result["runs"]["off"], result["runs"]["on"]
    assert off["cache_hits"] == 0 and off["prompt_tokens_computed"] == off["prompt_tokens"]
    assert on["prompt_tokens"] == off["prompt_tokens"] and on["cache_hits"] > 0
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] - on["cache_hits"]
    assert on["cache_hits"] % 16 == 0 and 0 < result["ratios"]["prompt_tokens_computed"] < 1
    assert "| on |" in capsys.readouterr().out


def test_a_system_prompt_past_the_context_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """stories260K at the default --system-chars (~600 tokens) failed with an InvalidRequestError traceback from the
    engine; it is a usage error naming --system-chars, before any request runs."""
    import pytest

    bench = load_script("bench_prefix_cache.py", "bench_prefix_cache_t")
    monkeypatch.setattr(sys, "argv", ["bench_prefix_cache.py", "--model", "stories260k", "--num-prompts", "1",
                                      "--max-tokens", "2", "--repeats", "1", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "argument --system-chars: the longest prompt is" in err, err
    assert "passes stories260k's context of 512" in err and not (tmp_path / "x.json").exists()
