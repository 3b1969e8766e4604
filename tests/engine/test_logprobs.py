"""Log-probabilities of generated tokens (``SamplingParams.logprobs``) through every step kind: prefill, plain
decoding, speculative chains (with n-gram lookup), token trees and preemption, on the fake model whose logits are
known exactly (10 at its next token, 0 elsewhere), so each value is checked, not just its shape."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import VOCAB, fake_engine, generate_outputs, greedy

from nightjar_jax.engine.sampler import logprobs_bucket, token_logprobs
from nightjar_jax.engine.sampling_params import MAX_LOGPROBS, SamplingParams

# log_softmax of a one-hot x 10 row over VOCAB ids: the hot id, and every other id
TOP = -math.log1p((VOCAB - 1) * math.exp(-10.0))
REST = TOP - 10.0
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [3]]


def _check_entries(tokens: list[int], logprobs: list[dict], num_top: int, cumulative: float) -> None:
    """Every token greedy under the fake model: its own entry is the top one; the others are the REST ids."""
    assert len(logprobs) == len(tokens)
    for tok, entry in zip(tokens, logprobs, strict=True):
        first = next(iter(entry))
        assert first == tok  # the generated token's entry comes first
        assert entry[tok].logprob == pytest.approx(TOP, abs=1e-5) and entry[tok].rank == 1
        assert len(entry) == max(1, num_top)  # the generated token is the top-1: no extra entry
        others = [lp for t, lp in entry.items() if t != tok]
        assert all(lp.logprob == pytest.approx(REST, abs=1e-5) for lp in others)
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, max(1, num_top) + 1))
        # ties among the REST ids: the lowest ids first, as argmax
        rest_ids = [t for t in entry if t != tok]
        assert rest_ids == sorted(rest_ids)
    assert cumulative == pytest.approx(len(tokens) * TOP, abs=1e-4)


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_logprobs_are_the_models_and_leave_the_tokens_alone(kind):
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3),
              "tree": dict(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(**kwargs)
    plain = generate_outputs(eng, PROMPTS, [greedy(9)] * 3)
    asked = [greedy(9, logprobs=k) for k in (0, 3, MAX_LOGPROBS)]
    outs = generate_outputs(eng, PROMPTS, asked)
    for out, ref, sp in zip(outs, plain, asked, strict=True):
        assert out.token_ids == ref.token_ids and ref.logprobs is None and ref.cumulative_logprob is None
        _check_entries(out.token_ids, out.logprobs, sp.logprobs, out.cumulative_logprob)
    if kind != "ar":
        assert eng.stats.num_accepted_tokens > 0  # the speculative steps ran and accepted drafts
    # a batch mixing requests with and without: only the asking ones carry them, and the tokens do not move
    mixed = generate_outputs(eng, PROMPTS, [greedy(9), greedy(9, logprobs=2), greedy(9)])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]
    assert mixed[0].logprobs is None and mixed[2].logprobs is None
    _check_entries(mixed[1].token_ids, mixed[1].logprobs, 2, mixed[1].cumulative_logprob)


def test_sampled_tokens_carry_their_own_logprob_and_rank():
    """Sampling at a high temperature draws ids other than the model's top one: each token's entry then holds its
    own (lower) log-probability and rank, with the top-1 beside it."""
    eng = fake_engine()
    outs = generate_outputs(eng, PROMPTS, [SamplingParams(temperature=100.0, seed=s, max_tokens=12, logprobs=1)
                                    for s in range(3)])
    off_top = 0
    for out in outs:
        for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
            if entry[tok].rank == 1:
                assert entry[tok].logprob == pytest.approx(TOP, abs=1e-5) and len(entry) == 1
            else:
                off_top += 1
                assert entry[tok].logprob == pytest.approx(REST, abs=1e-5) and entry[tok].rank > 1
                (top_id, top), = [(t, lp) for t, lp in entry.items() if t != tok]
                assert top.rank == 1 and top.logprob == pytest.approx(TOP, abs=1e-5)
    assert off_top > 0


def test_logprobs_survive_preemption():
    eng = fake_engine(num_pages=13, max_num_seqs=5)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    roomy = generate_outputs(fake_engine(), prompts, [greedy(20)] * 5)
    finals = {}
    ids = [eng.add_request(p, greedy(20, logprobs=1, prompt_logprobs=0)) for p in prompts]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert eng.stats.num_preemptions > 0 and eng.num_free_pages == eng.num_total_pages
    for i, want, prompt in zip(ids, roomy, prompts, strict=True):
        out = finals[i].outputs[0]
        assert out.token_ids == want.token_ids
        _check_entries(out.token_ids, out.logprobs, 1, out.cumulative_logprob)
        # the prompt scored once (a recomputed prefill keeps the first values): one entry per token after the first
        plp = finals[i].prompt_logprobs
        assert plp[0] is None and [list(e) for e in plp[1:]] == [[t] for t in prompt[1:]]


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.5, True, "3"])
def test_bad_logprobs_value_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"logprobs=.*allowed None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=bad)


def test_token_logprobs_matches_numpy_and_buckets():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 50)).astype(np.float32)
    tokens = np.array([[4, 7, -1], [0, 49, 13]], np.int32)
    got = token_logprobs(logits, tokens, 5)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    chosen = np.take_along_axis(ref, np.clip(tokens, 0, 49)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got.logprob), chosen, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.rank), 1 + (ref > chosen[..., None]).sum(-1))
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.argsort(-ref, axis=-1, kind="stable")[..., :5])
    np.testing.assert_allclose(np.asarray(got.top_logprobs), -np.sort(-ref, axis=-1)[..., :5], atol=1e-5)
    assert np.asarray(token_logprobs(logits, tokens, 0).top_ids).shape == (2, 3, 0)
    assert [logprobs_bucket(k) for k in (0, 1, 5, 6, 20)] == [0, 5, 5, 20, 20]
    with pytest.raises(ValueError, match="outside"):
        logprobs_bucket(21)


@pytest.mark.parametrize("budget", [16, 4])
def test_prompt_logprobs_score_each_prompt_token_under_the_model(budget):
    """``prompt_logprobs``: the first prompt token gets None, every later one the model's log-probability after the
    tokens before it (the fake model predicts 31 x sum + count of its prefix: a prompt built to follow it scores TOP
    throughout, one that breaks it REST from the break on), whole or in chunks of 4 (budget). Generation is
    unchanged."""
    from nightjar_jax.testing import fake_next_token

    follows = [5]
    while len(follows) < 9:
        follows.append(fake_next_token(follows, VOCAB))
    broken = follows[:4] + [(follows[4] + 1) % VOCAB] + follows[5:]
    eng = fake_engine(max_num_batched_tokens=budget)
    plain = generate_outputs(eng, [follows, broken], [greedy(5)] * 2)
    ids = [eng.add_request(p, greedy(5, prompt_logprobs=2)) for p in (follows, broken)]
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs[0].token_ids and out.prompt_logprobs is not None:
                assert all(e is not None for e in out.prompt_logprobs[1:])  # complete once tokens come out
            if out.finished:
                finals[out.request_id] = out
    outs = [finals[i] for i in ids]
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[0].outputs[0].logprobs is None  # (only the prompt's asked)
    for out, prompt in zip(outs, (follows, broken), strict=True):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for j in range(1, len(prompt)):
            entry = plp[j]
            assert next(iter(entry)) == prompt[j] and len(entry) in (2, 3)
            want = TOP if prompt[j] == fake_next_token(prompt[:j], VOCAB) else REST
            assert (want == REST) == (prompt is broken and j >= 4)
            assert entry[prompt[j]].logprob == pytest.approx(want, abs=1e-5)
            top = [lp for lp in entry.values() if lp.rank == 1]
            assert top and top[0].logprob == pytest.approx(TOP, abs=1e-5)
    assert eng.num_free_pages == eng.num_total_pages


def test_prompt_token_logprobs_in_slices_equal_the_whole_chunk():
    import jax.numpy as jnp

    from nightjar_jax.engine.runner import prompt_token_logprobs

    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(3, 48, 8)).astype(np.float32))  # 3 slices of 16 positions
    head = jnp.asarray(rng.normal(size=(8, 30)).astype(np.float32))
    targets = jnp.asarray(rng.integers(-1, 30, size=(3, 48)).astype(np.int32))
    got = prompt_token_logprobs(lambda h: h @ head, hidden, targets, 4)
    want = token_logprobs(hidden @ head, targets, 4)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
