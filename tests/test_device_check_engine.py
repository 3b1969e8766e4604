"""scripts/device_check_engine.py runs (``--smoke``: tiny presets on the CPU) and writes every section's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_engine_smoke_writes_each_section(tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check_engine.py"), "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bandwidth"]["jax_gbs"] > 0
    names = [s["name"] for s in result["sections"]]
    assert names == ["ar tiny-gqa", "spec tiny-gqa+tiny-mha", "elastic tiny-gqa+tiny-mha",
                     "sleep tiny-gqa+tiny-mha"], result["sections"]
    assert not any("error" in s or "skipped" in s for s in result["sections"]), result["sections"]
    ar, spec, elastic, sleep = result["sections"]
    # both levels freed the engine's device bytes and came back to the same greedy tokens without compiling
    for level in ("level1", "level2"):
        assert sleep[level]["freed_bytes"] == sleep["engine_bytes"] > 0 and sleep[level]["outputs_equal"]
        assert sleep[level]["new_compiles"] == 0 and sleep[level]["wake_s"] > 0
    # the draft's bytes became extension pages, a γ = 0 request ran on them, the draft came back and speculated
    assert elastic["draft_bytes"] > 0 and elastic["extension_pages"] > 0 and elastic["offload_s"] > 0
    assert elastic["reload_s"] > 0 and elastic["ext_step_ms"] > 0 and "skipped_decode" not in elastic
    assert {int(g) for g in elastic["ext_gamma_steps"]} == {0}
    assert {int(g) for g in elastic["spec_after_reload_gamma_steps"]} == {4}
    assert [r["batch_size"] for r in ar["rows"]] == [1, 2]
    assert all(r["tpot_ms"] > 0 and r["tokens_per_s"] > 0 for r in ar["rows"])
    assert all(0 < r["forward_call_ms"] and r["host_ms"] > -r["forward_call_ms"] for r in ar["rows"])
    assert ar["weight_bytes"] > 0 and ar["floor_ms"] > 0 and ar["rows"][0]["floor_ratio"] > 0
    assert [(r["batch_size"], r["gamma"]) for r in spec["rows"]] == [(1, 0), (1, 1), (1, 2), (1, 4)]
    assert spec["rows"][0]["vs_gamma0"] == 1.0
    # a forced γ is the γ every decode step ran
    assert all(set(r["gamma_steps"]) == {str(r["gamma"])} or set(r["gamma_steps"]) == {r["gamma"]}
               for r in spec["rows"]), spec["rows"]


def test_device_check_engine_rejects_bad_arguments_clearly():
    script = str(ROOT / "scripts" / "device_check_engine.py")
    for argv, message in [(["--spec", "llama-7b"], "expected TARGET+DRAFT"),
                          (["--batch-sizes", "1,x"], "comma list of integers >= 1"),
                          (["--gammas", "-1"], "comma list of integers >= 0"),
                          # (any --dtype was taken: each section then failed on it, after the bandwidth probe)
                          (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'")]:
        proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr[-500:])
