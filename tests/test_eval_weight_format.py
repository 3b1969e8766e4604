"""``scripts/eval_weight_format.py``: the per-position comparison of two models' logits, and its prefill."""

from __future__ import annotations

import numpy as np
import pytest

from nightjar_jax.testing import load_script


def test_compare_counts_argmax_kl_and_perplexity() -> None:
    ev = load_script("eval_weight_format.py", "eval_weight_format_t")
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((5, 7)).astype(np.float32)
    tokens = [0, 3, 1, 6, 2]
    same = ev.compare(ref, ref.copy(), tokens)
    assert same["argmax_equal"] == 5 and same["kl_sum"] == 0.0 and same["max_abs_logit_diff"] == 0.0
    assert same["nll_ref_sum"] == same["nll_cand_sum"] > 0 and same["next_tokens"] == 4
    cand = ref.copy()
    cand[2] = 0.0  # one position flattened to uniform
    res = ev.compare(ref, cand, tokens)
    assert res["argmax_equal"] == 4
    p = np.exp(ref[2].astype(np.float64) - ref[2].max())
    p /= p.sum()
    np.testing.assert_allclose(res["kl_sum"], (p * np.log(p * 7)).sum(), rtol=1e-9)
    np.testing.assert_allclose(res["nll_cand_sum"] - res["nll_ref_sum"], np.log(7) + np.log(p[tokens[3]]),
                               rtol=1e-9)


def test_prefill_logits_are_the_models_and_ignore_the_padding() -> None:
    ev = load_script("eval_weight_format.py", "eval_weight_format_t2")
    from nightjar_jax import LLM

    handle = LLM("stories260k", draft_model=None, max_model_len=300).engine.runner.target
    tokens = [1, 400, 18, 29, 33, 7, 250]
    full = ev.prefill_logits(handle, tokens)
    assert full.shape == (len(tokens), handle.config.vocab_size)
    np.testing.assert_allclose(ev.prefill_logits(handle, tokens[:4]), full[:4], rtol=1e-5, atol=1e-5)  # causal
    assert ev.held_as(handle.model_state()) in ([], ["float32"])  # stories260k: float32 (packed where the kernel runs)


def test_prefill_logits_and_held_as_read_a_stacked_model(monkeypatch) -> None:
    # the engine stacks a packed model's per-layer weights (ModelHandle.stack_layers): the script reads them per layer
    from kernels_pallas.linear import cpu
    from nightjar_jax import LLM

    if not cpu.packing_supported():
        pytest.skip("weights are packed (and stacked) only where the kernel takes packed weights")
    ev = load_script("eval_weight_format.py", "eval_weight_format_t3")
    tokens = [1, 400, 18, 29, 33, 7, 250]
    logits = {}
    for stack in ("1", "0"):
        monkeypatch.setenv("NIGHTJAR_STACK_LAYERS", stack)
        handle = LLM("tiny-gqa", load_format="dummy", draft_model=None, max_model_len=300).engine.runner.target
        assert handle.stacked == (stack == "1")
        assert ev.held_as(handle.model_state()) == ["float32"]
        logits[stack] = ev.prefill_logits(handle, tokens)
    np.testing.assert_array_equal(logits["1"], logits["0"])
