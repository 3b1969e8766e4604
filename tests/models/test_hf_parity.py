"""Parity with transformers' Llama: tiny random checkpoints saved by ``save_pretrained`` and loaded by us.

Covers MHA and GQA, tied and untied embeddings, Llama 3 rope scaling, a bf16-saved checkpoint and a sharded one.
Last-position logits must agree within 1e-4 absolute (float32 on CPU), and greedy continuations token for token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_forward  # noqa: E402
from nightjar_jax.models.loader import load_model  # noqa: E402

LOGIT_ATOL = 1e-4  # float32 both sides; observed differences are ~1e-6
NUM_NEW = 10
PROMPT = [1, 17, 99, 4, 250, 31, 77]

CASES = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-llama3-rope": dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
    ),
    "bf16-saved": dict(num_attention_heads=4, num_key_value_heads=2, saved_dtype=torch.bfloat16),
    "sharded": dict(num_attention_heads=4, num_key_value_heads=2, max_shard_size="40KB"),
}


def _hf_model(kind: str, folder):
    kw = dict(CASES[kind])
    saved_dtype = kw.pop("saved_dtype", None)
    max_shard_size = kw.pop("max_shard_size", None)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
        initializer_range=0.3,  # large weights: well-separated logits, so greedy has no near-ties
        bos_token_id=1, eos_token_id=2, **kw,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if saved_dtype is not None:
        model = model.to(saved_dtype)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **save_kw)
    if saved_dtype is None:
        return model
    # reference in float32 on the bf16-rounded weights; reloading recomputes rotary inv_freq in float32
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _our_greedy(graphdef, state, cfg, prompt, num_new, page_size=4):
    forward = jax.jit(make_forward(graphdef), donate_argnums=(2,))
    num_pages = -(-(len(prompt) + num_new) // page_size)
    kv = allocate_kv_cache(cfg, num_pages + 1, page_size)
    block_table = jnp.arange(num_pages, 0, -1, dtype=jnp.int32)[None]  # reversed page ids: order must not matter
    logits, kv = forward(state, np.asarray([prompt], np.int32), kv,
                         BatchMetadata(block_table, jnp.asarray([len(prompt)], jnp.int32)))
    first, out, n = np.asarray(logits[0]), [], len(prompt)
    for _ in range(num_new):
        token = int(np.argmax(np.asarray(logits[0])))
        out.append(token)
        n += 1
        logits, kv = forward(state, np.asarray([[token]], np.int32), kv,
                             BatchMetadata(block_table, jnp.asarray([n], jnp.int32)))
    return first, out


def _hf_greedy(model, prompt, num_new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = model(ids).logits[0, -1].numpy()
        out = []
        for _ in range(num_new):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return first, out


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_and_greedy_match_transformers(kind, tmp_path):
    ref = _hf_model(kind, tmp_path)
    if kind == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt, graphdef, state = load_model(str(tmp_path), dtype="float32")
    cfg = ckpt.config
    assert ckpt.load_format == "hf"
    assert cfg.num_kv_heads == CASES[kind]["num_key_value_heads"]
    assert cfg.tie_word_embeddings == CASES[kind].get("tie_word_embeddings", False)
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in CASES[kind])
    ours_logits, ours_tokens = _our_greedy(graphdef, state, cfg, PROMPT, NUM_NEW)
    ref_logits, ref_tokens = _hf_greedy(ref, PROMPT, NUM_NEW)
    np.testing.assert_allclose(ours_logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
    assert ours_tokens == ref_tokens


def test_bf16_checkpoint_keeps_bf16_config(tmp_path):
    _hf_model("bf16-saved", tmp_path)
    ckpt, _, state = load_model(str(tmp_path))
    assert ckpt.config.dtype == "bfloat16"
    leaves = jax.tree.leaves(state)
    assert any(leaf.dtype == jnp.bfloat16 for leaf in leaves)
