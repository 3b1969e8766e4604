"""A fake model with hand-computable logits, for exact scheduler/engine/server tests (like JetStream's mock).

The fake stores each token (and a presence flag) in the real paged KV cache and "attends" by summing what the
block tables point to, so a lost, stale or misplaced page changes its output. Its next token after a prefix
``t_0 .. t_{n-1}`` is :func:`fake_next_token`: ``(31 * sum(prefix) + n) % vocab_size``, as a one-hot logit of
height 10 (greedy picks it; sampling at temperature 1 picks it with probability ~1). It honours a token tree's
mask (``BatchMetadata.tree_mask``): a tree node's prefix is the committed tokens and its ancestors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.reference import tree_visible
from nightjar_jax.config import ModelConfig
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.models.llama import BatchMetadata, split_take, write_split_kv_pages


def fake_next_token(prefix: list[int], vocab_size: int, perturb: int = 0) -> int:
    n = len(prefix)
    return (31 * sum(prefix) + n + (perturb if n % 3 == 0 else 0)) % vocab_size


def fake_greedy_continuation(prompt: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(fake_next_token(seq, vocab_size))
    return seq[len(prompt):]


def fake_model(
    vocab_size: int = 97, max_len: int = 256, eos_token_id: int | None = None, perturb: int = 0,
    runner_up: bool = False,
) -> ModelHandle:
    """A :class:`ModelHandle` whose logits follow :func:`fake_next_token`; works as target or draft.

    A draft built with ``perturb != 0`` disagrees with the target whenever the prefix length is a multiple of 3,
    so speculative steps see both acceptances and rejections. ``runner_up``: the unperturbed token also gets a
    logit of 5 (the draft's second choice where it disagrees), so a token tree's rank-1 branches get accepted."""
    config = ModelConfig(
        name="fake", vocab_size=vocab_size, hidden_size=2, intermediate_size=2, num_layers=1, num_heads=1,
        num_kv_heads=1, max_position_embeddings=max_len,
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
    )

    def hidden_fn(state, tokens, kv_cache, md: BatchMetadata):
        (pools,) = kv_cache  # (k, v) [1, num_pages, page_size, 2], and an extension (k_ext, v_ext) if attached
        k_pages, v_pages = pools[:2]
        k_ext = pools[2] if len(pools) == 4 else None
        num_seqs, q_len = tokens.shape
        page_size = k_pages.shape[2]
        positions = md.context_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]
        valid = (positions >= 0) & (jnp.arange(q_len)[None, :] >= q_len - md.query_lens[:, None])
        page_ids = jnp.where(valid, jnp.take_along_axis(md.block_tables, jnp.where(valid, positions // page_size, 0),
                                                        axis=1), 0)
        slots = jnp.where(valid, positions % page_size, 0)
        value = jnp.stack([tokens.astype(jnp.float32), jnp.ones_like(tokens, jnp.float32)], axis=-1)
        k_pages, k_ext = write_split_kv_pages(k_pages, k_ext, page_ids, slots, value[None])
        keys = split_take(lambda p, ids: p[0][ids], k_pages, k_ext, md.block_tables, lead=0)
        keys = keys.reshape(num_seqs, -1, 2)  # [S, max_pages * page_size, 2]
        key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (positions >= 0)[:, :, None]  # [S, Q, K]
        if md.tree_mask is not None:  # a tree node sees the committed tokens and its ancestors
            mask &= tree_visible(md.tree_mask, key_pos, md.context_lens)
        total = jnp.sum(jnp.where(mask, keys[:, None, :, 0], 0.0), axis=-1)
        count = jnp.sum(jnp.where(mask, keys[:, None, :, 1], 0.0), axis=-1)
        pools = (k_pages, v_pages) if k_ext is None else (k_pages, v_pages, k_ext, pools[3])
        return jnp.stack([total, count], axis=-1), (pools,)

    def logits_fn(state, hidden):
        total = hidden[..., 0].astype(jnp.int32)
        count = hidden[..., 1].astype(jnp.int32)
        nxt = (31 * total + count + jnp.where(count % 3 == 0, perturb, 0)) % vocab_size
        logits = jax.nn.one_hot(nxt, vocab_size, dtype=jnp.float32) * 10.0
        if runner_up:
            logits += jax.nn.one_hot((31 * total + count) % vocab_size, vocab_size, dtype=jnp.float32) * 5.0
        return logits

    return ModelHandle(config, None, {}, fns=(hidden_fn, logits_fn))


# A plain chat template (stories260K ships none): "<role>: <content>" lines, then "assistant:"
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def stories_chat_llm():
    """stories260K without a draft, small pools and :data:`PLAIN_CHAT_TEMPLATE`: the model of the in-process server
    tests (each file builds its own, module-scoped)."""
    from nightjar_jax import LLM

    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64)
    llm.engine.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return llm


def load_script(filename: str, module_name: str):
    """Import ``scripts/<filename>`` of a source checkout as a fresh module named ``module_name`` (tests of the
    command-line tools; each call builds a new module, so a test may patch its globals)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(module_name, Path(__file__).parents[1] / "scripts" / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
