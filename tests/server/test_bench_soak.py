"""``scripts/bench_soak.py``: a short soak of a real server passes its own checks (every answer 2xx, the probe's
text unchanged, every page free after) and writes its samples; and its checks catch what they are for (a stream
cut short, an error event, a non-2xx answer), on a mock transport."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from nightjar_jax.testing import load_script


def test_bench_soak_smoke(tmp_path, capsys):
    bench = load_script("bench_soak.py", "bench_soak_t")
    out = tmp_path / "soak.json"
    rc = bench.main(["--duration", "6", "--interval", "3", "--clients", "2", "--warmup", "none", "--draft-model",
                     "none", "--probe-repeats", "2", "--out", str(out), "--server-log", str(tmp_path / "server.log")])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0, result["problems"]
    assert result["failed"] == 0 and result["served"] > 0 and result["problems"] == []
    assert len(result["samples"]) == 2 and all(s["probe_text_unchanged"] for s in result["samples"])
    # the load lasts --duration: the clients stop as the last sample starts (its probes ran on as load before)
    assert 6 <= result["load_s"] < 7 and "the load ran" in printed
    assert result["samples"][-1]["rss_mb"] > 0 and result["samples"][-1]["compiling"] >= 1
    assert result["final"]["pages_all_free"] and result["final"]["free"] == result["final"]["usable"]
    assert result["probe"]["text"]
    assert "| steps compiling |" in printed and "requests served, 0 failed" in printed
    assert result["server_log"] == str(tmp_path / "server.log") and (tmp_path / "server.log").exists()


def test_bench_soak_counts_broken_answers_as_failures():
    bench = load_script("bench_soak.py", "bench_soak_t2")

    def handler(request: httpx.Request) -> httpx.Response:
        kind = json.loads(request.content)["prompt"]
        body = {"cut": b"data: {\"x\": 1}\n\n",  # no [DONE]: the stream ended early
                "error": b"data: {\"x\": 1}\n\ndata: {\"error\": {\"message\": \"boom\"}}\n\ndata: [DONE]\n\n",
                "fine": b"data: {\"x\": 1}\n\ndata: [DONE]\n\n"}.get(kind)
        if body is None:
            return httpx.Response(400, json={"error": {"message": "bad"}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    soak = bench.Soak("http://soak.test", "m", {})
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        for kind in ("cut", "error", "fine"):
            soak.stream(client, kind, "/v1/completions", {"prompt": kind}, leave_after=None)
        soak.stream(client, "left", "/v1/completions", {"prompt": "cut"}, leave_after=1)  # a client gone: no failure
        soak.post(client, "bad", "/v1/completions", {"prompt": "bad"})
    assert soak.by_kind == {"cut": [0, 1], "error": [0, 1], "fine": [1, 0], "bad": [0, 1]}
    assert soak.failed == 3 and soak.served == 1 and soak.disconnects == 1
    assert "without [DONE]" in soak.failures[0]["detail"] and "boom" in soak.failures[1]["detail"]


def test_bench_soak_reports_a_server_that_dies(tmp_path, capsys):
    """The failure a soak is for: the server killed mid-load (as a compile past vm.max_map_count kills it) is
    reported with what was sampled before, the JSON written and exit 1 (it was a traceback and no JSON)."""
    bench = load_script("bench_soak.py", "bench_soak_t3")
    started, calls = [], []
    real_start, real_probe = bench.start_server, bench.probe

    def start(*a, **k):
        started.append(real_start(*a, **k))
        return started[-1]

    def probe(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # (the reference, the first sample, then the second sample finds it gone)
            proc = started[0][0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        return real_probe(*a, **k)

    bench.start_server, bench.probe = start, probe
    out = tmp_path / "soak.json"
    rc = bench.main(["--duration", "4", "--interval", "2", "--clients", "1", "--warmup", "none", "--draft-model",
                     "none", "--probe-repeats", "1", "--out", str(out), "--server-log", str(tmp_path / "server.log")])
    result = json.loads(out.read_text())
    assert rc == 1 and len(result["samples"]) == 1 and result["final"] is None
    assert any(p.startswith("the server exited with -9") for p in result["problems"]), result["problems"]
    assert "FAILED: the server exited with -9" in capsys.readouterr().err


def test_bench_soak_schedule_and_arguments(capsys):
    bench = load_script("bench_soak.py", "bench_soak_t4")
    assert bench.sample_times(20, 10) == [10, 20] and bench.sample_times(25, 10) == [10, 20, 25]
    assert bench.sample_times(5, 5) == [5] and bench.sample_times(1.5, 1) == [1, 1.5]
    for argv, message in [
        (["--duration", "5", "--interval", "10"], "--interval 10 is longer than --duration 5"),
        (["--url", "localhost:8000"], "is not an http:// or https:// URL"),
        (["--pid", "12"], "no process 12 is running" if not os.path.exists("/proc/12") else "--pid and --api-key"),
        (["--server-arg=--port=9"], "may not set --port or --host"),
        (["--url", "http://127.0.0.1:9", "--server-log", "/tmp/x.log"], "--server-log is the output of a server"),
        # (these started the server, which failed in its log: exit 1, not a usage error)
        (["--model", "bogus"], "argument --model: unknown model 'bogus'"),
        (["--draft-model", "bogus"], "argument --draft-model: unknown model 'bogus'"),
        (["--num-speculative-tokens", "99"], "argument --num-speculative-tokens: num_speculative_tokens=99"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv
    args = bench.parse_args(["--url", "http://127.0.0.1:9/", "--api-key", "k"])
    assert args.url == "http://127.0.0.1:9"


@pytest.mark.parametrize("sig, code, how", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_bench_soak_stopped_by_sigterm_writes_what_it_sampled(tmp_path, sig, code, how):
    """A SIGTERM (a CI job's timeout) or Ctrl-C mid-load stops the server, writes the JSON with the samples so far
    and a problem saying so, and exits 143 / 130 (the review: the server was left running, then the samples were
    lost; Ctrl-C lost them still, QA 2026-12-07)."""
    import subprocess
    import sys
    from pathlib import Path

    out, log = tmp_path / "soak.json", tmp_path / "server.log"
    script = Path(__file__).parents[2] / "scripts" / "bench_soak.py"
    proc = subprocess.Popen([sys.executable, str(script), "--duration", "120", "--interval", "2", "--clients", "1",
                             "--warmup", "none", "--draft-model", "none", "--probe-repeats", "1", "--out", str(out),
                             "--server-log", str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # (until the first sample's row)
            if line.startswith("| ") and line[2].isdigit():
                break
        proc.send_signal(sig)
        assert proc.wait(120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(out.read_text())
    assert result["samples"] and any(p.startswith(f"stopped by {how}") for p in result["problems"])
    assert not os.path.exists(f"/proc/{result['server_pid']}")  # (stopped and reaped before the script exited)
