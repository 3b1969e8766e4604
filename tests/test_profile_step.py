"""``scripts/profile_step.py``: a traced step's ops summed per step, custom calls named by their target."""

from __future__ import annotations

from nightjar_jax.testing import load_script

HLO = """\
  %ffi_call.12 = f32[1,576]{1,0} custom-call(%a, %b), custom_call_target="nightjar_attn_out_mlp_qkv_f32", x=1
  %ffi_call.7 = f32[1,1,9,64]{3,2,1,0} custom-call(%q, %k), custom_call_target="nightjar_paged_attention_f32"
  %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop
"""


def _event(name: str, dur: float, module: str = "jit_forward_sample") -> dict:
    return {"ph": "X", "name": name, "dur": dur, "args": {"hlo_module": module}}


def test_ops_are_summed_per_step_by_target():
    prof = load_script("profile_step.py", "profile_step_t")
    targets = prof.custom_call_targets(HLO)
    assert targets == {"ffi_call.12": "nightjar_attn_out_mlp_qkv_f32", "ffi_call.7": "nightjar_paged_attention_f32"}
    events = [
        _event("ThunkExecutor::Execute", 9000.0),  # the step itself: not an op
        _event("ffi_call.12", 3000.0), _event("ffi_call.12", 1000.0),
        _event("ffi_call.7", 500.0),
        _event("wrapped_scatter.3", 100.0), _event("wrapped_scatter.4", 300.0),
        _event("ffi_call.12", 7777.0, module="jit_verify"),  # another module
        {"ph": "i", "name": "ffi_call.12", "args": {"hlo_module": "jit_forward_sample"}},  # not a complete event
    ]
    rows = prof.op_table(events, "jit_forward_sample", targets, steps=2)
    assert [(r["op"], r["ms_per_step"], r["calls_per_step"]) for r in rows] == [
        ("nightjar_attn_out_mlp_qkv_f32", 2.0, 1.0),
        ("nightjar_paged_attention_f32", 0.25, 0.5),
        ("wrapped_scatter", 0.2, 1.0),
    ]


def test_runs_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """The whole script on stories260K: a traced step whose ops include the attention calls, one per layer. (A
    prompt of 40 tokens: its ids ran past stories260K's 512-token vocabulary from 32 on, a refused request.)"""
    import json
    import sys

    import pytest

    from kernels_pallas.paged_attention import cpu

    if not cpu.available():
        pytest.skip(f"the CPU attention kernel (the op counted here) is unavailable: {cpu.unavailable_reason()}")
    prof = load_script("profile_step.py", "profile_step_run")
    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--model", "stories260k", "--steps", "2", "--prompt-len",
                                      "40", "--compare-spin-us", "0,30", "--rounds", "1", "--out", str(out)])
    prof.main()
    got = json.loads(out.read_text())
    assert got["module"] == "jit_forward_sample" and got["steps"] == 2
    ops = {r["op"]: r for r in got["rows"]}
    attention = [r for op, r in ops.items() if "paged_attention" in op]
    assert attention and attention[0]["calls_per_step"] == 5  # stories260K has 5 layers
    assert "ms per step in ops" in capsys.readouterr().out
    # the untraced calls: one wall time per step, their median, and the ops' sum beside them
    assert len(got["wall_ms"]) == 2 and all(t > 0 for t in got["wall_ms"])
    assert min(got["wall_ms"]) <= got["wall_ms_median"] <= max(got["wall_ms"])
    assert got["ops_ms_per_step"] == sum(r["ms_per_step"] for r in got["rows"])
    # the host's dispatch of each untraced call: part of its wall time
    assert len(got["dispatch_ms"]) == 2
    assert all(0 < d <= w for d, w in zip(got["dispatch_ms"], got["wall_ms"], strict=True))
    # the interleaved spin comparison: one row per setting, 15 calls each, the first setting the ratios' base
    assert [r["spin_us"] for r in got["spins"]] == [0, 30] and all(r["calls"] == 15 for r in got["spins"])
    assert got["spins"][0]["ratio"] == 1.0 and got["spins"][1]["median_ms"] > 0


def test_bad_spin_list_is_a_clear_error(monkeypatch, capsys):
    """A usage error (exit 2) naming the flag, before any model loads."""
    import sys

    import pytest

    prof = load_script("profile_step.py", "profile_step_bad")
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--compare-spin-us", "0,x"])
    with pytest.raises(SystemExit) as exc:
        prof.main()
    assert exc.value.code == 2
    assert "argument --compare-spin-us: expected a comma list of integers >= 0" in capsys.readouterr().err
