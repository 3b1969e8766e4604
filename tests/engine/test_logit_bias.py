"""``SamplingParams.logit_bias`` (OpenAI's): added to the logits before sampling, greedy rows included, in plain,
speculative (chain and tree) and sampled steps alike, on the fake model whose logits are 10 at its next token and 0
elsewhere."""

from __future__ import annotations

import pytest
from helpers import VOCAB, fake_engine, generate_outputs, greedy

from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.testing import fake_greedy_continuation

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [3]]


def _biased_greedy(prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    """The fake model's greedy tokens with a bias: its token scores 10, every other 0, each plus its bias."""
    from nightjar_jax.testing import fake_next_token

    seq = list(prompt)
    for _ in range(n):
        scores = {t: bias.get(t, 0.0) for t in range(VOCAB)}
        nxt = fake_next_token(seq, VOCAB)
        scores[nxt] += 10.0
        best = max(scores.values())
        seq.append(min(t for t, s in scores.items() if s == best))
    return seq[len(prompt):]


BIASES = [{42: 20.0}, {42: 5.0, 7: 9.5}, {t: -100.0 for t in range(0, VOCAB, 2)}]


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_logit_bias_moves_greedy_tokens_in_every_step_kind(kind):
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3),
              "tree": dict(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(**kwargs)
    params = [greedy(8, logit_bias=b) for b in BIASES]
    outs = generate_outputs(eng, PROMPTS, params)
    for out, prompt, bias in zip(outs, PROMPTS, BIASES, strict=True):
        assert out.token_ids == _biased_greedy(prompt, 8, bias)
    assert outs[0].token_ids == [42] * 8
    # beside unbiased requests, which keep the model's tokens
    mixed = generate_outputs(eng, PROMPTS, [greedy(8), params[0], greedy(8)])
    assert mixed[0].token_ids == fake_greedy_continuation(PROMPTS[0], 8, VOCAB)
    assert mixed[1].token_ids == [42] * 8
    assert mixed[2].token_ids == fake_greedy_continuation(PROMPTS[2], 8, VOCAB)


def test_logit_bias_in_sampled_rows_and_logprobs_stay_the_models():
    eng = fake_engine(draft=True, num_speculative_tokens=2)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=10, logit_bias={42: 100.0}, logprobs=0),
              SamplingParams(temperature=1.0, seed=4, max_tokens=10,
                             logit_bias={t: -100.0 for t in range(VOCAB) if t != 9})]
    out = generate_outputs(eng, PROMPTS[:2], params)
    assert out[0].token_ids == [42] * 10 and out[1].token_ids == [9] * 10
    # log-probabilities are the model's own (before the bias, as vLLM's): 42 is not the fake model's token here
    assert all(entry[42].logprob < -9 for entry in out[0].logprobs)


@pytest.mark.parametrize("bias, match", [({-1: 1.0}, "logit_bias"), ({3: 101.0}, "logit_bias"),
                                         ({"3": 1.0}, "logit_bias"), ([3], "logit_bias")])
def test_bad_logit_bias_is_a_clear_error(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_logit_bias_ids_past_the_vocabulary_are_rejected_alone():
    eng = fake_engine()
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 97\)"):
        eng.add_request([5, 6], greedy(4, logit_bias={VOCAB: 1.0}))
    assert not eng.has_unfinished_requests()


def _penalized_greedy(prompt: list[int], n: int, bias: dict[int, float], presence: float, frequency: float):
    from nightjar_jax.testing import fake_next_token

    seq, counts = list(prompt), {}
    for _ in range(n):
        scores = {t: bias.get(t, 0.0) - (presence + frequency * counts[t] if t in counts else 0.0)
                  for t in range(VOCAB)}
        scores[fake_next_token(seq, VOCAB)] += 10.0
        best = max(scores.values())
        tok = min(t for t, s in scores.items() if s == best)
        seq.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
    return seq[len(prompt):]


def test_presence_and_frequency_penalties_lower_generated_tokens_and_turn_speculation_off():
    """Token 42 biased to 11.5 beats the model's 10 until penalties bring it down: presence 1 + frequency 1 per time
    leaves it at 9.5 after once (the model's token wins), at 11.5 - 1 - 1 x 1 = 9.5; with frequency 0.5 alone it wins
    three times (11.5, 11.0, 10.5, then 10.0 ties the model's token and the lower id wins). A batch holding a
    penalized request decodes without speculation; the others keep their exact tokens and speculate again after."""
    eng = fake_engine(draft=True, num_speculative_tokens=3)
    cases = [(1.0, 1.0), (0.0, 0.5), (-2.0, 0.0)]
    params = [greedy(10, logit_bias={42: 11.5}, presence_penalty=p, frequency_penalty=f) for p, f in cases]
    outs = generate_outputs(eng, PROMPTS, params)
    for out, prompt, (p, f) in zip(outs, PROMPTS, cases, strict=True):
        assert out.token_ids == _penalized_greedy(prompt, 10, {42: 11.5}, p, f), (p, f)
    assert outs[0].token_ids.count(42) == 1 and outs[2].token_ids == [42] * 10  # (a negative penalty rewards)
    assert eng.stats.num_drafted_tokens == 0 and eng.stats.decode_steps_per_gamma.keys() == {0}
    # preemption keeps the counts (the request keeps them; a recompute appends no output again)
    small = fake_engine(num_pages=13, max_num_seqs=5)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    p = [greedy(20, logit_bias={42: 11.5}, frequency_penalty=0.5)] * 5
    got = generate_outputs(small, prompts, p)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in got] == [_penalized_greedy(q, 20, {42: 11.5}, 0.0, 0.5) for q in prompts]
    # unpenalized requests afterwards speculate again
    plain = generate_outputs(eng, PROMPTS, [greedy(10)] * 3)
    assert [o.token_ids for o in plain] == [fake_greedy_continuation(q, 10, VOCAB) for q in PROMPTS]
    assert eng.stats.num_drafted_tokens > 0


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_penalized_requests_accept_no_draft_while_their_batch_speculates(kind):
    """Penalized requests (greedy, and sampled with a seed) beside greedy ones: the steps they share speculate, the
    penalized rows accept no draft and commit one token each (the sampled one drawn as a plain step draws it, so its
    tokens are those it gets alone, where every step is plain), the greedy rows accept drafts; every request gets its
    reference tokens, and the drafts counted are the speculating rows' alone."""
    kwargs = {"chain": dict(num_speculative_tokens=3),
              "tree": dict(runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(draft=True, **kwargs)
    sampled = SamplingParams(temperature=8.0, seed=5, max_tokens=12, presence_penalty=0.5)  # (nearly uniform)
    alone = generate_outputs(eng, [PROMPTS[1]], [sampled])[0].token_ids
    assert eng.stats.num_drafted_tokens == 0  # (a batch of penalized requests alone decodes plainly)
    eng.record_steps = True
    params = [greedy(12), greedy(12, logit_bias={42: 11.5}, frequency_penalty=0.5), greedy(12), sampled]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    outs = generate_outputs(eng, prompts, params)
    assert outs[0].token_ids == fake_greedy_continuation(PROMPTS[0], 12, VOCAB)
    assert outs[1].token_ids == _penalized_greedy(PROMPTS[1], 12, {42: 11.5}, 0.0, 0.5)
    assert outs[2].token_ids == fake_greedy_continuation(PROMPTS[2], 12, VOCAB)
    assert outs[3].token_ids == alone
    shared = [s for s in eng.stats.step_log if s["gamma"] > 0 and s["plain_rows"] is not None]
    assert shared and all(s["gamma"] == 3 and (s["tree_nodes"] > 0) == (kind == "tree") for s in shared)
    for s in shared:  # rows 1 and 3 while all four run
        assert all(k == 0 for k, plain in zip(s["accepted"], s["plain_rows"], strict=True) if plain)
    assert any(s["plain_rows"] == [False, True, False, True] and sum(s["accepted"]) > 0 for s in shared)
    drafted = sum((s["tree_nodes"] or s["gamma"]) * (s["batch_size"] - sum(s["plain_rows"] or []))
                  for s in eng.stats.step_log if s["gamma"] > 0)
    assert eng.stats.num_drafted_tokens == drafted > 0


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_outside_their_range_are_clear_errors(field):
    with pytest.raises(ValueError, match=rf"{field}=2.5 is invalid: allowed a float in \[-2, 2\]"):
        SamplingParams(**{field: 2.5})


def _min_tokens_greedy(prompt: list[int], eos: int, stop_ids: set[int], min_tokens: int, max_tokens: int):
    """The fake model's greedy tokens with its stop ids banned for the first min_tokens, stopping at one after."""
    from nightjar_jax.testing import fake_next_token

    seq, out = list(prompt), []
    while len(out) < max_tokens:
        banned = stop_ids | {eos} if len(out) < min_tokens else set()
        nxt = fake_next_token(seq, VOCAB)
        tok = nxt if nxt not in banned else min(t for t in range(VOCAB) if t not in banned)  # the rest tie at 0
        seq.append(tok)
        out.append(tok)
        if tok in stop_ids | {eos}:
            break
    return out


@pytest.mark.parametrize("kind", ["ar", "chain"])
def test_min_tokens_bans_stop_ids_until_reached(kind):
    """EOS is the model's third token: with min_tokens 6 it is banned for six tokens (the model's runner-up, id 0
    here, comes instead), then the request runs until EOS comes back or max_tokens; a request accepts no draft while
    it is under min_tokens, and drafts again after."""
    cont = fake_greedy_continuation(PROMPTS[0], 12, VOCAB)
    eos = cont[2]
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3)}[kind]
    eng = fake_engine(eos=eos, **kwargs)
    params = [greedy(12, min_tokens=6), greedy(12), greedy(12, min_tokens=2, stop_token_ids=[cont[0]])]
    outs = generate_outputs(eng, [PROMPTS[0]] * 3, params)
    assert outs[1].token_ids == cont[:3] and outs[1].finish_reason == "stop"  # EOS at the third token, as before
    assert outs[0].token_ids == _min_tokens_greedy(PROMPTS[0], eos, set(), 6, 12)
    assert len(outs[0].token_ids) > 6 and eos not in outs[0].token_ids[:6]
    assert outs[2].token_ids == _min_tokens_greedy(PROMPTS[0], eos, {cont[0]}, 2, 12)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
