"""Gradients through the Flax model, as research code takes them: through the pure-XLA paths they flow (and equal
finite differences); where they cannot (the CPU kernels, a bfloat16 pool held as uint16 bits) ``jax.grad`` is a
clear error instead of JAX's generic FFI message or silently zero gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax.config import ModelConfig
from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, init_model, make_model_fns

CFG = ModelConfig(name="g", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                  num_kv_heads=2)
TOKENS = jnp.asarray([[5, 9, 3, 7]], jnp.int32)
MD = BatchMetadata(jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([4], jnp.int32))


def _loss(attention_impl: str, linear_impl: str, kv_dtype: str | None = None):
    graphdef, state = init_model(CFG, attention_impl=attention_impl, linear_impl=linear_impl)
    hidden_fn, logits_fn = make_model_fns(graphdef)

    def loss(s):
        hidden, _ = hidden_fn(s, TOKENS, allocate_kv_cache(CFG, 3, 2, dtype=kv_dtype), MD)
        return jax.nn.log_softmax(logits_fn(s, hidden))[..., 1].mean()  # (small: finite differences in float32)

    return loss, state


def _leaves(grads) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(grads)}


def test_gradients_flow_through_the_reference_paths():
    loss, state = _loss("reference", "xla", "float32")
    grads = _leaves(jax.grad(loss)(state))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        (leaf,) = [g for path, g in grads.items() if name in path]
        assert np.abs(leaf).max() > 0, name
    # one weight against a central finite difference
    (path,) = [p for p in grads if "v_proj" in p]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    index = [jax.tree_util.keystr(p) for p, _ in leaves].index(path)
    base = [np.asarray(x, np.float64) for _, x in leaves]
    eps, at = 1e-2, (0,) * base[index].ndim

    def shifted(delta):
        values = [b.copy() for b in base]
        values[index][at] += delta
        return float(loss(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(v, jnp.float32) for v in values])))

    numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
    assert grads[path][at] == pytest.approx(numeric, rel=5e-2, abs=1e-4)


def test_a_bfloat16_pool_on_the_cpu_is_a_clear_error_not_zero_gradients():
    if jax.default_backend() != "cpu":
        pytest.skip("bfloat16 pools are held as uint16 bits on the CPU backend only")
    loss, state = _loss("reference", "xla", "bfloat16")
    assert np.isfinite(float(loss(state)))  # (the forward pass is unchanged)
    with pytest.raises(ValueError, match="bfloat16 K/V pool is held as uint16 bit patterns on the CPU backend and "
                                         "carries no gradient"):
        jax.grad(loss)(state)


def test_the_cpu_kernels_say_how_to_get_gradients():
    from kernels_pallas.linear import cpu as linear_cpu
    from kernels_pallas.paged_attention import cpu as attention_cpu

    if not (linear_cpu.available() and attention_cpu.available()):
        pytest.skip("the CPU kernels are not built here")
    for attention_impl, linear_impl in (("cpu", "xla"), ("reference", "cpu")):
        loss, state = _loss(attention_impl, linear_impl, "float32")
        assert np.isfinite(float(jax.jit(loss)(state)))
        with pytest.raises(ValueError, match=r"the CPU kernels \(nightjar_.*\) are not differentiable: for gradients "
                                             r"build the model with attention_impl='reference' and linear_impl='xla'"):
            jax.grad(loss)(state)
