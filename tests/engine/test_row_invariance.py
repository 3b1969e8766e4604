"""A verify step's rows equal one-row decoding to the bit, on the CPU kernels, for every weight layout the engine holds.

The lossless invariant (greedy speculative decoding == plain decoding, token for token) needs each target row's
logits not to depend on how many query rows its step had: a γ + 1-row verify pass must give position p the logits a
one-row decode of p gives. Comparing tokens on tiny random models cannot see a last-bit difference (their logits
never tie), so this compares the logits themselves: after a prefill of n tokens (contexts that end mid-way through
an 8-key group of a 16-token page, where attention once scored a page's last keys in another order), one 5-row
pass against five one-row passes from the same cache. Float32 panels (`auto` on a float32 model), 4-bit panels with
float32 beside them (`auto` on a Q4_1 model), and `w4a8`, whose int8 rounding turned such differences into
different tokens on SmolLM2 (docs/benchmarks.md, "Greedy SD on `w4a8` left plain decoding").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.linear import pack_state
from nightjar_jax.models.llama import BatchMetadata, init_model
from nightjar_jax.models.presets import get_preset
from tests.kernels.test_cpu_linear_w4a8 import _quantized_model

Q = 5  # a verify step at γ = 4


def _engine(fmt: str) -> LLMEngine:
    if fmt == "f32 model":
        cfg = get_preset("tiny-gqa").config
        graphdef, state = init_model(cfg, seed=3, linear_impl="auto")
        weight_format = "auto"
    else:
        cfg, graphdef, state = _quantized_model("tiny-gqa", 4)
        weight_format = "auto" if fmt == "q4 model" else "w4a8"
    target = ModelHandle(cfg, graphdef, pack_state(state, "auto", weight_format=weight_format))
    target.stack_layers()
    ecfg = make_engine_config(model="tiny-gqa", page_size=16, num_pages=16, max_num_seqs=1, max_model_len=96,
                              compilation_cache_dir=None, weight_format=weight_format)
    return LLMEngine(ecfg, target=target)


@pytest.mark.skipif(not cpu.packing_supported(), reason="the engine packs weights for the CPU kernels only there")
@pytest.mark.parametrize("fmt", ["f32 model", "q4 model", "w4a8"])
def test_a_verify_pass_equals_one_row_decoding_bitwise(fmt):
    if fmt == "w4a8" and not cpu.w4a8_supported():
        pytest.skip("w4a8 needs AVX512-VNNI, or AVX2 and F16C")
    runner = _engine(fmt).runner
    t_hidden, t_logits = runner.target.fns

    def step(leaves, kv, tokens, bt, cl, ql):
        state = runner.target.unflatten(leaves)
        hidden, kv = t_hidden(state, tokens, kv, BatchMetadata(bt, cl, ql))
        return t_logits(state, hidden), kv

    f = jax.jit(step)
    leaves = runner.target.leaves()
    seq = [(37 * j) % 400 + 3 for j in range(48)]
    bt = np.zeros((1, 4), np.int32)
    bt[0] = [1, 2, 3, 4]
    for n in (3, 12, 21):  # each a page's last keys left over after whole 8-key groups, for several rows of the pass
        _, kv = f(leaves, runner.kv, jnp.asarray([seq[:n]], jnp.int32), bt, np.array([n], np.int32),
                  np.array([n], np.int32))
        one, kv1 = [], kv
        for i in range(Q):
            logits, kv1 = f(leaves, kv1, jnp.asarray([[seq[n + i]]], jnp.int32), bt, np.array([n + i + 1], np.int32),
                            np.array([1], np.int32))
            one.append(np.asarray(logits)[0, 0])
        verify, _ = f(leaves, kv, jnp.asarray([seq[n:n + Q]], jnp.int32), bt, np.array([n + Q], np.int32),
                      np.array([Q], np.int32))
        np.testing.assert_array_equal(np.asarray(verify)[0], np.stack(one), err_msg=f"{fmt}, context {n}")
