"""A subset LM head (``ModelConfig.head_vocab_size``, a draft's cheap head): config checks, logits (-inf outside
the subset, equal to the matmul inside), checkpoint validation and an orbax round trip that keeps the int ids."""

from __future__ import annotations

import numpy as np
import pytest

from nightjar_jax.config import ModelConfig
from nightjar_jax.models.llama import HEAD_TOKEN_IDS, hf_param_map, make_model_fns, random_state, state_from_hf
from nightjar_jax.models.loader import load_model
from nightjar_jax.models.orbax_io import save_orbax, state_to_hf

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  max_position_embeddings=64, head_vocab_size=10, name="subset")
IDS = np.array([0, 2, 3, 7, 11, 20, 31, 40, 55, 63], np.int32)


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    _, state = random_state(CFG, seed=seed)
    w = state_to_hf(CFG, state)
    w[HEAD_TOKEN_IDS] = IDS
    return w


def test_config_checks():
    with pytest.raises(ValueError, match="head_vocab_size"):
        CFG.replace(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="head_vocab_size"):
        CFG.replace(head_vocab_size=65)
    with pytest.raises(ValueError, match="head_vocab_size"):
        CFG.replace(head_vocab_size=0)
    full = CFG.replace(head_vocab_size=None)
    assert CFG.num_params() == full.num_params() - (64 - 10) * 16
    assert HEAD_TOKEN_IDS in hf_param_map(CFG) and HEAD_TOKEN_IDS not in hf_param_map(full)


def test_logits_are_minus_inf_outside_the_subset():
    w = _weights()
    graphdef, state = state_from_hf(CFG, w)
    _, logits_fn = make_model_fns(graphdef)
    h = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    out = np.asarray(logits_fn(state, h))
    assert out.shape == (3, 64)
    outside = np.setdiff1d(np.arange(64), IDS)
    assert np.all(np.isneginf(out[:, outside]))
    np.testing.assert_allclose(out[:, IDS], h @ w["lm_head.weight"].T, rtol=1e-5, atol=1e-5)
    assert set(out.argmax(-1)) <= set(IDS.tolist())


@pytest.mark.parametrize(
    "bad",
    [IDS[::-1].copy(), np.where(IDS == 63, 64, IDS), IDS[:-1], IDS.astype(np.float32), np.array([0, 0, *IDS[2:]])],
    ids=["unsorted", "out-of-range", "wrong-count", "float", "duplicate"],
)
def test_bad_token_ids_are_rejected(bad):
    w = _weights()
    w[HEAD_TOKEN_IDS] = bad
    with pytest.raises(ValueError, match=r"lm_head\.token_ids .*strictly increasing integer token ids in \[0, 64\)"):
        state_from_hf(CFG, w, source="ckpt")


def test_orbax_round_trip_keeps_int_ids(tmp_path):
    w = _weights(seed=1)
    save_orbax(tmp_path / "draft", CFG, w)
    ckpt, graphdef, state = load_model(str(tmp_path / "draft"))
    assert ckpt.config == CFG
    back = state_to_hf(CFG, state)
    np.testing.assert_array_equal(back[HEAD_TOKEN_IDS], IDS)
    assert back[HEAD_TOKEN_IDS].dtype == np.int32
    np.testing.assert_array_equal(back["lm_head.weight"], w["lm_head.weight"])
