"""A feature draft's model pieces (``ModelConfig.feature_size``, EAGLE-style): config checks, its parameter map, the
paged feature pool's write/read convention, and clear errors for a missing input or a mismatched target."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax.config import ModelConfig
from nightjar_jax.engine.runner import ModelHandle, ModelRunner
from nightjar_jax.models.llama import (
    BatchMetadata,
    allocate_kv_cache,
    hf_param_map,
    make_model_fns,
    random_state,
    read_previous_features,
    write_feature_pages,
)

TARGET = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     max_position_embeddings=64, tie_word_embeddings=True, name="t")
DRAFT = TARGET.replace(tie_word_embeddings=False, head_vocab_size=8, feature_size=16, name="f")


def test_config_and_param_map() -> None:
    with pytest.raises(ValueError, match="feature_size"):
        DRAFT.replace(feature_size=0)
    with pytest.raises(ValueError, match="feature_size"):
        DRAFT.replace(tie_word_embeddings=True, head_vocab_size=None)
    m = hf_param_map(DRAFT)
    assert "fc.weight" in m and "model.embed_tokens.weight" not in m
    plain = DRAFT.replace(feature_size=None)
    assert DRAFT.num_params() == plain.num_params() - 64 * 16 + 2 * 16 * 16  # fc instead of an embedding table


def test_feature_pool_write_then_read_previous() -> None:
    """Positions are written through the block tables; a slot at position p reads what position p - 1 holds (zeros at
    position 0 and on padding slots)."""
    pool = jnp.zeros((6, 2, 3))
    bt = jnp.asarray([[3, 1, 4], [2, 5, 0]], jnp.int32)
    vals = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3) + 1
    md = BatchMetadata(bt, jnp.asarray([4, 3], jnp.int32), jnp.asarray([4, 3], jnp.int32))  # row 1: 3 real, 1 pad
    pool = write_feature_pages(pool, vals, md)
    np.testing.assert_array_equal(pool[3, 0], vals[0, 0])  # row 0 position 0 -> page 3 slot 0
    np.testing.assert_array_equal(pool[1, 1], vals[0, 3])  # row 0 position 3 -> page 1 slot 1
    np.testing.assert_array_equal(pool[5, 0], vals[1, 3])  # row 1 position 2 (slot 3) -> page 5 slot 0
    got = np.asarray(read_previous_features(pool, md, 4))
    np.testing.assert_array_equal(got[0, 0], 0)  # position 0 has no previous feature
    np.testing.assert_array_equal(got[0, 1:], np.asarray(vals[0, :3]))
    np.testing.assert_array_equal(got[1, 0], 0)  # padding slot
    np.testing.assert_array_equal(got[1, 1], 0)  # row 1 position 0
    np.testing.assert_array_equal(got[1, 2:], np.asarray(vals[1, 1:3]))


def test_missing_inputs_and_mismatched_target_are_clear_errors() -> None:
    graphdef, state = random_state(DRAFT)
    hidden_fn, _ = make_model_fns(graphdef)
    md = BatchMetadata(jnp.asarray([[1]], jnp.int32), jnp.asarray([2], jnp.int32), jnp.asarray([2], jnp.int32))
    kv = allocate_kv_cache(DRAFT, 2, 4)
    with pytest.raises(ValueError, match="feature draft: pass features= and embed_table="):
        hidden_fn(state, jnp.zeros((1, 2), jnp.int32), kv, md)
    tg, ts = random_state(TARGET.replace(hidden_size=32, num_heads=4, head_dim=8))
    target = ModelHandle(TARGET.replace(hidden_size=32, num_heads=4, head_dim=8), tg, ts)
    with pytest.raises(ValueError, match="reads 16-wide features but the target t has hidden size 32"):
        ModelRunner(target, ModelHandle(DRAFT, graphdef, state), num_pages=4, page_size=4, max_model_len=16,
                    max_num_seqs=1, max_num_batched_tokens=8, gamma_max=2)


def test_fused_features_config_param_map_and_errors() -> None:
    """``feature_layers`` (EAGLE-3's fused features): checked values, the ``fuse`` matrix in the parameter map and
    count, the target's ``hidden_layers`` output, and clear errors for a wrong width or layer."""
    fused = DRAFT.replace(feature_layers=[2, 5])
    assert fused.feature_layers == (2, 5)  # a JSON list becomes a tuple
    for bad in ((), (0,), (3, 2), (2, 2), (True,)):
        with pytest.raises(ValueError, match="feature_layers"):
            DRAFT.replace(feature_layers=bad)
    with pytest.raises(ValueError, match="feature_layers"):
        TARGET.replace(feature_layers=(1,))  # not a feature draft
    assert hf_param_map(fused)["fuse.weight"] == (("fuse", "kernel"), True)
    assert "fuse.weight" not in hf_param_map(DRAFT)
    assert fused.num_params() == DRAFT.num_params() + 3 * 16 * 16
    assert (fused.feature_pool_width, DRAFT.feature_pool_width, TARGET.feature_pool_width) == (48, 16, None)

    target_cfg = TARGET.replace(num_layers=3)
    tg, ts = random_state(target_cfg)
    t_hidden, _ = make_model_fns(tg)
    md = BatchMetadata(jnp.asarray([[1]], jnp.int32), jnp.asarray([2], jnp.int32), jnp.asarray([2], jnp.int32))
    tokens = jnp.asarray([[3, 4]], jnp.int32)
    final, _ = t_hidden(ts, tokens, allocate_kv_cache(target_cfg, 2, 4), md)
    wide, _ = t_hidden(ts, tokens, allocate_kv_cache(target_cfg, 2, 4), md, hidden_layers=(1, 2))
    assert wide.shape == (1, 2, 3 * 16)
    np.testing.assert_array_equal(np.asarray(wide[..., -16:]), np.asarray(final))
    with pytest.raises(ValueError, match=r"hidden_layers \[3\]: layer counts in 1\.\.2"):
        t_hidden(ts, tokens, allocate_kv_cache(target_cfg, 2, 4), md, hidden_layers=(3,))

    fused = DRAFT.replace(feature_layers=(1, 2))
    graphdef, state = random_state(fused)
    d_hidden, _ = make_model_fns(graphdef)
    embed = jnp.zeros((64, 16))
    for width in (16, 48):  # its own outputs, or the target's three layers
        d_hidden(state, tokens, allocate_kv_cache(fused, 2, 4), md, features=jnp.ones((1, 2, width)),
                 embed_table=embed)
    with pytest.raises(ValueError, match="reads 16-wide features or 48-wide fused ones, got 32"):
        d_hidden(state, tokens, allocate_kv_cache(fused, 2, 4), md, features=jnp.ones((1, 2, 32)), embed_table=embed)
