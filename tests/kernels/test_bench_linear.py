"""``scripts/bench_linear.py --products-only``: the model's linear layers in a decode step's dispatch (the layer
calls with the next q/k/v, the head), kernel against XLA, and the table/JSON it writes."""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.models.llama import init_model
from nightjar_jax.models.presets import get_preset
from nightjar_jax.testing import load_script


@pytest.fixture(scope="module")
def bench():
    if not cpu.available():
        pytest.skip(f"CPU linear kernel unavailable here: {cpu.unavailable_reason()}")
    return load_script("bench_linear.py", "bench_linear_t")


def test_products_chain_is_the_same_on_the_kernel_and_on_xla(bench):
    cfg = get_preset("tiny-gqa").config
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, cfg.hidden_size)), jnp.float32)
    outs = {}
    for impl in ("xla", "cpu"):
        graphdef, state = init_model(cfg, seed=1, linear_impl=impl)
        fn = bench.products_fn(graphdef)
        text = fn.lower(state, x).as_text()
        assert ("nightjar_attn_out_mlp_qkv_f32" in text) == (impl == "cpu")  # the layer calls, as in a decode step
        outs[impl] = np.asarray(fn(state, x))
    assert outs["cpu"].shape == (3, cfg.vocab_size) and np.isfinite(outs["cpu"]).all()
    np.testing.assert_allclose(outs["cpu"], outs["xla"], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kernel_impl", ["cpu", "auto"])  # every product on the kernel, or auto's choice
def test_products_only_writes_a_row_per_row_count(bench, tmp_path, capsys, kernel_impl):
    out = tmp_path / "products.json"
    args = argparse.Namespace(model="tiny-gqa", rows="1,3", repeats=1, out=str(out), kernel_impl=kernel_impl)
    bench.products_only(get_preset("tiny-gqa").config, args)
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 3]
    assert all(r["kernel_ms"] > 0 and r["xla_ms"] > 0 and r["read_ms"] > 0 and r["weight_bytes"] > 0 for r in rows)
    assert "| 3 |" in capsys.readouterr().out
