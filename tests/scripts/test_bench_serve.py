"""``scripts/bench_serve.py``, the online serving benchmark: Poisson arrivals, the client's latency figures, the
server's speculation counters per run, and a real run over two servers (stories260K, a layer-skip draft): every
request served, greedy texts equal across planners, the JSON and table written."""

from __future__ import annotations

import json
import math
import sys

import pytest

from nightjar_jax.testing import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_serve.py", "bench_serve_t")


def test_arrivals_and_percentiles(bench):
    assert bench.arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = bench.arrival_times(2000, 4.0, 1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and all(g >= 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 0.25) < 0.03
    assert bench.arrival_times(5, 2.0, 7) == bench.arrival_times(5, 2.0, 7)  # (seeded)
    p = bench.percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.0) and p["mean"] == pytest.approx(50.5)
    assert bench.percentiles([]) == {"mean": None, "p50": None, "p99": None}


def test_summary_reads_latencies_and_the_servers_counters(bench):
    records = [{"index": 0, "chunks": [0.1, 0.2, 0.4], "end": 0.5, "output_tokens": 5, "duration": 2.0},
               {"index": 1, "chunks": [], "end": 0.1, "error": "HTTP 400", "duration": 2.0},
               # an answer with no text (an EOS first) is done, not failed (it was "failed", with no error)
               {"index": 2, "chunks": [], "end": 0.05, "output_tokens": 1, "duration": 2.0}]
    before = {'nightjar_decode_steps_total{gamma="0"}': 1, 'nightjar_decode_steps_total{gamma="2"}': 0,
              "nightjar_spec_draft_tokens_total": 0, "nightjar_spec_accepted_tokens_total": 0,
              "nightjar_generation_tokens_total": 0}
    after = {'nightjar_decode_steps_total{gamma="0"}': 2, 'nightjar_decode_steps_total{gamma="2"}': 3,
             "nightjar_spec_draft_tokens_total": 6, "nightjar_spec_accepted_tokens_total": 3,
             "nightjar_generation_tokens_total": 8, "nightjar_decode_steps_compiling_total": 1}
    s = bench.summarize(records, before, after, gamma_max=2)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["tpot_ms"]["mean"] == pytest.approx(100)
    assert s["itl_ms"]["mean"] == pytest.approx(150) and s["e2e_ms"]["mean"] == pytest.approx(275)
    assert s["decode_steps_per_gamma"] == {"0": 1, "1": 0, "2": 3} and s["mean_gamma"] == pytest.approx(1.5)
    # decode steps' tokens: the 8 generated less the 2 completed requests' first ones (their prefills')
    assert s["acceptance"] == 0.5 and s["tokens_per_decode_step"] == 1.5 and s["compiling_steps"] == 1


def test_a_run_over_two_planners(bench, tmp_path, capsys, monkeypatch):
    out = tmp_path / "serve.json"
    monkeypatch.setattr(sys, "argv", ["bench_serve.py"])
    code = bench.main(["--model", "stories260k", "--draft-model", "stories260k@skip=2", "--endpoint", "completions",
                       "--planners", "static:2,ar", "--request-rates", "8,inf", "--num-prompts", "4", "--max-tokens",
                       "8", "--server-warmup", "request", "--server-arg=--max-model-len", "--server-arg=256",
                       "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"static:2", "ar"} and result["text_mismatches"] == []
    for planner, rates in result["results"].items():
        assert set(rates) == {"8", "inf"}
        for run in rates.values():
            s = run["summary"]
            assert (s["completed"], s["failed"]) == (4, 0) and s["output_tokens"] > 0
            assert all(r["text"] and r["chunks"] for r in run["records"])
            steps = s["decode_steps_per_gamma"]
            assert sum(steps.values()) > 0 and (planner != "static:2" or steps["2"] > 0)
    assert "| static:2 | inf |" in capsys.readouterr().out


def test_url_mode_takes_any_served_name_and_an_api_key(bench, monkeypatch):
    """With --url, --model is the server's served name (any name: it was checked as a model to load, refusing a
    --served-model-name); the API key comes from --api-key or $OPENAI_API_KEY (there was none: every request 401)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sekrit")
    args = bench.parse_args(["--url", "http://127.0.0.1:8000/", "--model", "my-served-name"])
    assert args.url == "http://127.0.0.1:8000" and args.model == "my-served-name"
    assert bench.auth_headers(args) == {"Authorization": "Bearer sekrit"}
    monkeypatch.delenv("OPENAI_API_KEY")
    assert bench.auth_headers(bench.parse_args(["--url", "http://127.0.0.1:8000"])) == {}
    with pytest.raises(SystemExit, match="does not answer /health"):  # (a traceback after a failed warm-up pass)
        bench.measure("http://127.0.0.1:1", "server", args, ["x"], "completions", "m")
