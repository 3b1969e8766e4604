"""Weights stacked over the layers (``ModelHandle.stack_layers``): the CPU kernels take a stacked array and a layer
attribute (``kernels_pallas/linear/cpu.py`` ``LayerView``, ``cpu_kernel.cc`` ``View``), so a step dispatches one
array per weight kind instead of one per layer.

Checked: every fused form on layer views gives the per-layer arrays' results to the bit (packed float32 and 4-bit
panels, the gains too); bad layer indices are clear errors; an engine holding a stacked state produces the same
greedy tokens as one holding per-layer arrays (plain decoding and speculative decoding with a draft, itself stacked),
its K/V pools are stacked too (``StackedKV``), its compiled step has no slice or copy of a stacked weight or pool
(the pools aliased to the outputs), and ``NIGHTJAR_STACK_LAYERS=0`` turns it off.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax import LLM, SamplingParams
from nightjar_jax.linear import attn_out_mlp, linear, linear_many, linear_residual, rms_linear_many, rms_swiglu
from nightjar_jax.models.llama import StackedKV

needs_packing = pytest.mark.skipif(not cpu.packing_supported(),
                                   reason="stacked weights are held where the kernel takes packed weights")

H, INTER, L = 64, 128, 3  # hidden, intermediate, layers


def _layers(rng, make):
    """Per-layer weights of one decoder layer's shapes, L times, and the same stacked: (per layer list, stacked)."""
    shapes = {"q": (H, H), "k": (H, 32), "v": (H, 32), "o": (H, H), "g": (H, INTER), "u": (H, INTER), "d": (INTER, H)}
    per_layer = [{n: make(jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)) for n, s in shapes.items()}
                 | {"gain": jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.float32),
                    "gain2": jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.float32)}
                 for _ in range(L)]
    stacked = {n: jnp.stack([layer[n] for layer in per_layer]) for n in per_layer[0]}
    return per_layer, stacked


def _q4_exact(w):
    """A weight rounded to GGUF Q4_1 values, so pack_q4 takes it (4-bit panels)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    blocks = w.reshape(k // 32, 32, n)
    lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    d = np.float16((hi - lo) / 15).astype(np.float32)
    m = np.float16(lo).astype(np.float32)
    q = np.clip(np.round((blocks - m) / np.where(d == 0, 1, d)), 0, 15)
    return cpu.pack_q4(jnp.asarray((q * d + m).reshape(k, n).astype(np.float32)))


def _forms(p, x, a):
    """Every linear form the model calls, on one layer's weights ``p`` (arrays or layer views)."""
    qkv = rms_linear_many(x, p["gain"], [p["q"], p["k"], p["v"]], 1e-5)
    return [
        *qkv,
        *linear_many(x, [p["g"], p["u"]]),
        linear(x, p["q"]),
        rms_swiglu(x, p["gain"], p["g"], p["u"], 1e-5),
        linear_residual(a, p["o"], x),
        attn_out_mlp(a, x, p["o"], p["gain"], p["g"], p["u"], p["d"], 1e-5),
        *jax.tree.leaves(attn_out_mlp(a, x, p["o"], p["gain"], p["g"], p["u"], p["d"], 1e-5, next_gain=p["gain2"],
                                      next_ws=[p["q"], p["k"], p["v"]], next_eps=1e-6)),
    ]


@needs_packing
@pytest.mark.parametrize("layout", ["f32", "q4"])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_layer_views_give_the_per_layer_results_to_the_bit(layout, rows):
    rng = np.random.default_rng(rows)
    make = cpu.pack if layout == "f32" else _q4_exact
    per_layer, stacked = _layers(rng, make)
    assert cpu.is_packed(per_layer[0]["q"])
    x = jnp.asarray(rng.standard_normal((rows, H)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((rows, H)), jnp.float32)

    @jax.jit
    def on_views(stacked, x, a):
        return [_forms({n: cpu.LayerView(s, i) for n, s in stacked.items()}, x, a) for i in range(L)]

    @jax.jit
    def on_arrays(per_layer, x, a):
        return [_forms(p, x, a) for p in per_layer]

    for got, want in zip(on_views(stacked, x, a), on_arrays(per_layer, x, a), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_packing
def test_layer_view_bounds_and_values():
    w = cpu.pack(jnp.ones((H, 32), jnp.float32))
    stacked = jnp.stack([w, 2 * w])
    view = cpu.LayerView(stacked, 1)
    assert view.shape == w.shape and view.dtype == w.dtype and view.ndim == 3 and cpu.is_packed(view)
    assert view[...] is view
    np.testing.assert_array_equal(np.asarray(view.value()), 2 * np.asarray(w))
    np.testing.assert_array_equal(np.asarray(cpu.value(view)), np.asarray(jnp.asarray(view)))
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=f"layer {bad} of a weight stacked over 2 layers"):
            cpu.LayerView(stacked, bad)
    # the kernel checks its layers attribute too: out of range, and one entry per weight operand
    x = jnp.ones((1, H), jnp.float32)
    call = jax.ffi.ffi_call("nightjar_linear_f32", jax.ShapeDtypeStruct((1, 32), jnp.float32))
    with pytest.raises(Exception, match="layer 2 of a stacked operand"):
        jax.block_until_ready(call(x, stacked, layers=np.asarray([2], np.int64)))
    with pytest.raises(Exception, match="one entry per weight / gain operand"):
        jax.block_until_ready(call(x, w, layers=np.asarray([-1, -1], np.int64)))


PROMPTS = [[5, 17, 33, 2, 9], [101, 7, 7, 7, 44, 13, 250], [300, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _engine(monkeypatch, stack: bool, **kw):
    monkeypatch.setenv("NIGHTJAR_STACK_LAYERS", "1" if stack else "0")
    return LLM("tiny-gqa", load_format="dummy", seed=3, max_model_len=128, num_pages=64, **kw)


@needs_packing
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_stacked_engine_equals_per_layer_engine(monkeypatch, tree_nodes):
    outs = {}
    for stack in (True, False):
        llm = _engine(monkeypatch, stack, draft_model="tiny-mha", num_speculative_tokens=3, planner="static:3",
                      spec_tree_nodes=tree_nodes)
        runner = llm.engine.runner
        assert runner.target.stacked == stack and runner.draft.stacked == stack
        # the K/V pools likewise: two [L, ...] arrays per model, or a pair per layer
        assert isinstance(runner.kv, StackedKV) == stack and isinstance(runner.draft_kv, StackedKV) == stack
        layers = llm.engine.target.config.num_layers
        if stack:  # the 9 per-layer kinds stacked: embedding, final norm, inv_freq and 9 stacked arrays
            assert len(runner.target.leaves()) == 12
        else:
            assert len(runner.target.leaves()) == 3 + 9 * layers
        # the same weights either way, as the model reads them
        per_layer = [np.asarray(cpu.value(w)) for w in jax.tree.leaves(runner.target.model_state())]
        outs[stack] = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], per_layer)
        assert llm.engine.num_free_pages == llm.engine.num_total_pages
    assert outs[True][0] == outs[False][0]
    for a, b in zip(outs[True][1], outs[False][1], strict=True):
        np.testing.assert_array_equal(a, b)


@needs_packing
def test_stacked_step_slices_no_weight(monkeypatch):
    llm = _engine(monkeypatch, True, draft_model=None)
    runner = llm.engine.runner
    step, captured = runner._forward_sample, []

    def capture(*args, **kw):
        captured.append(args)
        return step(*args, **kw)

    runner._forward_sample = capture
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    runner._forward_sample = step
    hlo = step.lower(*captured[-1]).compile().as_text()
    names = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.uint8): "u8", jnp.dtype(jnp.int8): "s8"}
    layers = llm.engine.target.config.num_layers
    stacked = [leaf for leaf in runner.target.leaves() if leaf.ndim >= 2 and leaf.shape[0] == layers]
    assert len(stacked) == 9

    def sliced(dtype: str, shape: tuple[int, ...]) -> list[str]:
        """Instructions slicing or copying out an array of ``shape`` (or ``[1, *shape]``: a dynamic slice)."""
        dims = ",".join(map(str, shape))
        return [ln for ln in hlo.splitlines() if re.search(r"\} (slice|dynamic-slice|copy)\(", ln)
                and (f"{dtype}[{dims}]{{" in ln or f"{dtype}[1,{dims}]{{" in ln)]

    for leaf in stacked:  # one layer's slice of a stacked weight would be an instruction of its per-layer shape
        if leaf.ndim > 2:  # (a norm gain's [H] is also the shape of an activation row: the weights stand for both)
            assert not sliced(names[leaf.dtype], leaf.shape[1:])
    # the stacked pools are written in place: donated (aliased to the outputs), never copied whole or per layer
    assert isinstance(runner.kv, StackedKV)
    assert not sliced("f32", runner.kv.k.shape) and not sliced("f32", runner.kv.k.shape[1:])
    assert re.search(r"input_output_alias=\{ \{1\}: \(\d+, \{\}, may-alias\), \{2\}: \(\d+", hlo)
