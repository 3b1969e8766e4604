"""The paged KV cache gives the logits of a contiguous computation: shuffled page ids, sequences crossing page
boundaries, chunked prefill + decode, and pages reused after another sequence freed them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax.cache.allocator import PageAllocator
from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_model_fns, random_state
from nightjar_jax.models.presets import get_preset

PAGE = 4
NUM_PAGES = 32
MAX_PAGES = 8


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny-gqa").config
    graphdef, state = random_state(cfg, seed=3)
    hidden_fn, logits_fn = make_model_fns(graphdef)

    @jax.jit
    def run(state, tokens, kv, bt, cl, ql):
        hidden, kv = hidden_fn(state, tokens, kv, BatchMetadata(bt, cl, ql))
        return logits_fn(state, hidden), kv

    return cfg, state, run


def _run(model, kv, tokens, pages, start, num_slots=None):
    """Process ``tokens`` (one sequence) at positions ``start..``; returns logits [len, V] and the cache."""
    cfg, state, run = model
    n = len(tokens)
    q = num_slots or n
    tok = np.zeros((1, q), np.int32)
    tok[0, q - n :] = tokens
    bt = np.zeros((1, MAX_PAGES), np.int32)
    bt[0, : len(pages)] = pages
    logits, kv = run(state, tok, kv, bt, np.array([start + n], np.int32), np.array([n], np.int32))
    return np.asarray(logits[0, q - n :]), kv


def contiguous_logits(model, tokens):
    cfg = model[0]
    kv = allocate_kv_cache(cfg, NUM_PAGES, PAGE)
    pages = list(range(1, 1 + -(-len(tokens) // PAGE)))
    logits, _ = _run(model, kv, tokens, pages, 0)
    return logits


TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=23)]  # crosses 5 page boundaries


def test_shuffled_pages_chunked_prefill_and_decode_match_contiguous(model):
    ref = contiguous_logits(model, TOKENS)
    cfg = model[0]
    kv = allocate_kv_cache(cfg, NUM_PAGES, PAGE)
    pages = [17, 3, 29, 8, 11, 5]  # shuffled physical pages
    got = []
    # chunks of 7 (padded to 8 slots: the pad slot must not overwrite the previous chunk), then decode one by one
    pos = 0
    for chunk in (7, 7):
        logits, kv = _run(model, kv, TOKENS[pos : pos + chunk], pages, pos, num_slots=8)
        got.append(logits)
        pos += chunk
    while pos < len(TOKENS):
        logits, kv = _run(model, kv, TOKENS[pos : pos + 1], pages, pos)
        got.append(logits)
        pos += 1
    np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-5, rtol=1e-5)


def test_pages_reused_after_free_match_contiguous(model):
    cfg = model[0]
    alloc = PageAllocator(NUM_PAGES, PAGE)
    kv = allocate_kv_cache(cfg, NUM_PAGES, PAGE)
    other = [int(t) for t in np.random.default_rng(1).integers(3, 500, size=30)]
    other_pages = alloc.allocate(8)
    _, kv = _run(model, kv, other, other_pages, 0)  # fills pages with another sequence's K/V
    alloc.free(other_pages)
    pages = alloc.allocate(6)
    assert set(pages) & set(other_pages)  # really reused
    logits, kv = _run(model, kv, TOKENS, pages, 0)
    np.testing.assert_allclose(logits, contiguous_logits(model, TOKENS), atol=1e-5, rtol=1e-5)


def test_batch_of_ragged_sequences_matches_each_alone(model):
    cfg, state, run = model
    seqs = [TOKENS[:5], TOKENS[:23], TOKENS[3:12]]
    refs = [contiguous_logits(model, s)[-1] for s in seqs]
    kv = allocate_kv_cache(cfg, NUM_PAGES, PAGE)
    q = 24
    tok = np.zeros((4, q), np.int32)  # one padding row
    bt = np.zeros((4, MAX_PAGES), np.int32)
    next_page = 1
    for i, s in enumerate(seqs):
        tok[i, q - len(s) :] = s
        n = -(-len(s) // PAGE)
        bt[i, :n] = list(range(next_page + n - 1, next_page - 1, -1))  # reversed order
        next_page += n
    cl = np.array([len(s) for s in seqs] + [0], np.int32)
    logits, _ = run(state, tok, kv, bt, cl, cl)
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(np.asarray(logits[i, -1]), ref, atol=1e-5, rtol=1e-5)
    assert jnp.all(jnp.isfinite(logits))


def test_an_eager_call_checks_its_inputs(model):
    """Called eagerly, the model checks what jit cannot: an id outside the vocabulary read a clamped row of the
    embedding (NaN logits past its end, its last row for -1), a query_lens of another length was broadcast, one past
    q_len taken; pools of another head count failed in a broadcast, and an unknown attention impl at the first call."""
    cfg, state, _ = model
    graphdef, _ = random_state(cfg, seed=3)
    hidden_fn, _ = make_model_fns(graphdef)
    kv = allocate_kv_cache(cfg, NUM_PAGES, PAGE)
    bt, cl = jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([3], jnp.int32)

    def call(tokens, query_lens=None, cache=kv):
        return hidden_fn(state, jnp.asarray(tokens, jnp.int32), cache, BatchMetadata(bt, cl, query_lens))

    for bad in (cfg.vocab_size, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside tiny-gqa's vocabulary"):
            call([[5, bad, 6]])
    with pytest.raises(ValueError, match=r"query_lens must be \[num_seqs=1\], got shape \(2,\)"):
        call([[5, 6, 7]], jnp.asarray([3, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"query_lens \[4\]: each is 0 .. q_len=3"):
        call([[5, 6, 7]], jnp.asarray([4], jnp.int32))
    other = allocate_kv_cache(dataclasses.replace(cfg, num_kv_heads=cfg.num_heads), NUM_PAGES, PAGE)
    with pytest.raises(ValueError, match=f"tiny-gqa has {cfg.num_kv_heads} K/V heads"):
        call([[5, 6, 7]], cache=other)
    real = call([[5, 6, 7]], jnp.asarray([3], jnp.int32))[0]
    assert jnp.all(jnp.isfinite(real))
    # a padding slot's id is not read as a token (its output is dropped): -1 there runs, as under jit
    padded = call([[-1, 6, 7]], jnp.asarray([2], jnp.int32))[0]
    np.testing.assert_allclose(padded[0, 1:], call([[0, 6, 7]], jnp.asarray([2], jnp.int32))[0][0, 1:])
    rows = hidden_fn(state, jnp.asarray([[5, 6, 7], [-1, -1, -1]], jnp.int32), kv,
                     BatchMetadata(jnp.asarray([[1, 2], [0, 0]], jnp.int32), jnp.asarray([3, 0], jnp.int32)))[0]
    np.testing.assert_allclose(rows[0], real[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="attention impl 'cuda' is unknown"):
        random_state(cfg, seed=3, attention_impl="cuda")
