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


ALLOWED = [[42], [3, 9, 42, 60], list(range(1, VOCAB, 2))]


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_allowed_token_ids_in_every_step_kind(kind):
    """vLLM's ``allowed_token_ids``: only those tokens, the model's own where it is allowed, else the best allowed
    one (the fake model's: the lowest id), in plain, chain and tree steps alike (greedy SD equal to AR), beside
    requests without it and with a logit bias on top."""
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3),
              "tree": dict(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(**kwargs)
    outs = generate_outputs(eng, PROMPTS, [greedy(8, allowed_token_ids=a) for a in ALLOWED])
    for out, prompt, allowed in zip(outs, PROMPTS, ALLOWED, strict=True):
        banned = {t: -1000.0 for t in range(VOCAB) if t not in allowed}
        assert out.token_ids == _biased_greedy(prompt, 8, banned)
        assert set(out.token_ids) <= set(allowed)
    assert outs[0].token_ids == [42] * 8
    assert outs[2].token_ids != fake_greedy_continuation(PROMPTS[2], 8, VOCAB)  # (the mask changed something)
    bias = {9: 50.0}
    mixed = generate_outputs(eng, PROMPTS, [greedy(8), greedy(8, allowed_token_ids=ALLOWED[1], logit_bias=bias),
                                            greedy(8, logit_bias={42: 20.0})])
    assert mixed[0].token_ids == fake_greedy_continuation(PROMPTS[0], 8, VOCAB)
    assert mixed[1].token_ids == [9] * 8
    assert mixed[2].token_ids == [42] * 8


def test_allowed_token_ids_in_sampled_rows_and_errors():
    eng = fake_engine(draft=True, num_speculative_tokens=2)
    allowed = [4, 8, 15, 16, 23, 42]
    outs = generate_outputs(eng, PROMPTS, [SamplingParams(temperature=1.5, seed=s, max_tokens=24,
                                                          allowed_token_ids=allowed) for s in range(3)])
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o.token_ids}) > 1  # (sampled: not one token)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 97\)"):
        eng.add_request([5, 6], greedy(4, allowed_token_ids=[3, VOCAB]))
    for bad in ([], [-1], ["3"]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=[3], structured_outputs={"choice": ["a"]}).allowed_token_ids == [3]
    # every allowed token a stop token that min_tokens bans: nothing could be generated (it used to sample banned ones)
    eos_engine = fake_engine(eos=7)
    for allowed, stops in [([7], []), ([7, 9], [9])]:
        with pytest.raises(ValueError, match="are all stop tokens"):
            eos_engine.add_request([5, 6], greedy(4, allowed_token_ids=allowed, stop_token_ids=stops, min_tokens=2))
    out = generate_outputs(eos_engine, [[5, 6]], [greedy(4, allowed_token_ids=[7, 9], min_tokens=2, ignore_eos=True)])
    assert out[0].token_ids and set(out[0].token_ids) <= {7, 9}
    assert not eng.has_unfinished_requests() and eng.num_free_pages == eng.num_total_pages


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens, generated from as if they were the prompt; -1
    takes as many as the engine can (a prompt past the context then runs instead of being refused); a k that still
    leaves the prompt too long is the same clear error as without it."""
    eng = fake_engine(draft=True, num_speculative_tokens=2, max_model_len=32)
    prompt = list(range(10, 50))  # 40 tokens: past the 32-token context
    for k in (None, 40):
        with pytest.raises(ValueError, match="the prompt has 40 tokens"):
            eng.add_request(prompt, greedy(4, truncate_prompt_tokens=k))
    cases = [(prompt, 5, prompt[-5:]), (prompt, -1, prompt[-(eng.context_limit - 1):]), (prompt[:3], 5, prompt[:3])]
    ids = [eng.add_request(p, greedy(4, truncate_prompt_tokens=k)) for p, k, _ in cases]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert eng.num_free_pages == eng.num_total_pages
    for rid, (_, _, kept) in zip(ids, cases, strict=True):
        n = min(4, eng.context_limit - len(kept))  # (-1: one token fits after its 31)
        assert done[rid].prompt_token_ids == kept
        assert done[rid].outputs[0].token_ids == fake_greedy_continuation(kept, n, VOCAB)
    assert len(cases[1][2]) == 31


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


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_presence_and_frequency_penalties_lower_generated_tokens(kind):
    """Token 42 biased to 11.5 beats the model's 10 until penalties bring it down: presence 1 + frequency 1 per time
    leaves it at 9.5 after once (the model's token wins), at 11.5 - 1 - 1 x 1 = 9.5; with frequency 0.5 alone it wins
    three times (11.5, 11.0, 10.5, then 10.0 ties the model's token and the lower id wins). Speculative steps count
    the drafts before each position (the draft proposes 42 at every position of a step from the committed counts
    alone): penalized requests accept drafts and get the exact tokens, beside unpenalized ones that keep theirs."""
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3),
              "tree": dict(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(**kwargs)
    cases = [(1.0, 1.0), (0.0, 0.5), (-2.0, 0.0), (0.0, 0.0)]
    params = [greedy(10, logit_bias={42: 11.5}, presence_penalty=p, frequency_penalty=f) for p, f in cases]
    prompts = [*PROMPTS, [20, 21]]
    outs = generate_outputs(eng, prompts, params)
    for out, prompt, (p, f) in zip(outs, prompts, cases, strict=True):
        assert out.token_ids == _penalized_greedy(prompt, 10, {42: 11.5}, p, f), (p, f)
    assert outs[0].token_ids.count(42) == 1 and outs[2].token_ids == [42] * 10  # (a negative penalty rewards)
    assert outs[1].token_ids[:3] == [42] * 3 and outs[1].token_ids[3] != 42
    if kind != "ar":
        assert eng.stats.num_accepted_tokens > 0 and 0 not in eng.stats.decode_steps_per_gamma
    # preemption keeps the counts (the request keeps them; a recompute appends no output again)
    small = fake_engine(num_pages=13, max_num_seqs=5, **kwargs)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    p = [greedy(20, logit_bias={42: 11.5}, frequency_penalty=0.5)] * 5
    got = generate_outputs(small, prompts, p)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in got] == [_penalized_greedy(q, 20, {42: 11.5}, 0.0, 0.5) for q in prompts]


def _repetition_greedy(prompt: list[int], n: int, bias: dict[int, float], repetition: float) -> list[int]:
    """vLLM's repetition penalty on the fake model: a token of the prompt or already generated has its score divided
    by it when positive, multiplied when negative."""
    from nightjar_jax.testing import fake_next_token

    seq = list(prompt)
    for _ in range(n):
        scores = {t: bias.get(t, 0.0) for t in range(VOCAB)}
        scores[fake_next_token(seq, VOCAB)] += 10.0
        scores = {t: (s / repetition if s > 0 else s * repetition) if t in seq else s for t, s in scores.items()}
        best = max(scores.values())
        seq.append(min(t for t, s in scores.items() if s == best))
    return seq[len(prompt):]


@pytest.mark.parametrize("kind", ["ar", "chain", "tree"])
def test_repetition_penalty_over_prompt_and_output(kind):
    """The model's token scores 10 and token 42 8 (a bias): with repetition 2 a model token already in the prompt or
    the output falls to 5 and 42 wins, until 42 itself is seen (4); a penalty below 1 rewards repeats; -3 on a
    token seen goes to -6. Speculative steps count the drafts before each position as seen."""
    kwargs = {"ar": {}, "chain": dict(draft=True, num_speculative_tokens=3),
              "tree": dict(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eng = fake_engine(**kwargs)
    cases = [({42: 8.0}, 2.0), ({42: 8.0}, 0.5), ({}, 1.5), ({7: -3.0, 42: 8.0}, 1.3)]
    prompts = [[11, 12, 13, 14, 15], [5, 6, 7], [3], [20, 21, 42]]
    params = [greedy(12, logit_bias=bias, repetition_penalty=r) for bias, r in cases]
    outs = generate_outputs(eng, prompts, params)
    for out, prompt, (bias, r) in zip(outs, prompts, cases, strict=True):
        assert out.token_ids == _repetition_greedy(prompt, 12, bias, r), (bias, r)
    assert 42 in outs[0].token_ids and outs[0].token_ids != fake_greedy_continuation(prompts[0], 12, VOCAB)
    if kind != "ar":
        assert eng.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_min_tokens_limits_the_drafts_a_step_accepts(kind):
    """Under min_tokens a request's stop ids are banned at every position of a step, so it accepts only the drafts
    that keep it under (``Request.draft_limit``): with a draft that always agrees, EOS (the fifth token) and a stop id
    (the fourth) still come right after min_tokens 3. A request one token short accepts none (limit 0) while its
    batch speculates: a sampled one draws that token as a plain step does, so it equals the token it gets alone,
    where that step is plain."""
    kwargs = {"chain": dict(num_speculative_tokens=3),
              "tree": dict(runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8)}[kind]
    eos = fake_greedy_continuation([5, 6, 7], 5, VOCAB)[4]
    eng = fake_engine(draft=True, perturb=0, eos=eos, **kwargs)
    sampled = SamplingParams(temperature=8.0, seed=5, max_tokens=6, min_tokens=2)  # (nearly uniform)
    alone = generate_outputs(eng, [PROMPTS[1]], [sampled])[0].token_ids
    eng.record_steps = True
    stop = fake_greedy_continuation([3], 4, VOCAB)[3]
    params = [greedy(12, min_tokens=3), greedy(12, min_tokens=3, stop_token_ids=[stop]), greedy(12), sampled]
    outs = generate_outputs(eng, [[5, 6, 7], [3], [20, 21], PROMPTS[1]], params)
    assert outs[0].token_ids == fake_greedy_continuation([5, 6, 7], 5, VOCAB) and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == fake_greedy_continuation([3], 4, VOCAB) and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == fake_greedy_continuation([20, 21], 12, VOCAB)
    assert outs[3].token_ids[:2] == alone[:2]
    # the first decode step: one token each (prefilled), but none yet for the one-token prompt [3] (it decodes from
    # the start): the sampled request accepts no draft, the min_tokens-3 ones 3 - 1 - 1 and 3 - 0 - 1
    first = eng.stats.step_log[0]
    assert first["gamma"] == 3 and first["plain_rows"] == [False, False, False, True]
    assert first["accepted"] == [1, 2, 3, 0]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_outside_their_range_are_clear_errors(field):
    with pytest.raises(ValueError, match=rf"{field}=2.5 is invalid: allowed a float in \[-2, 2\]"):
        SamplingParams(**{field: 2.5})
    for bad in (0, -1.0, 101.0, True):
        with pytest.raises(ValueError, match=r"repetition_penalty=.* is invalid: allowed a float in \[0.000001, 100\]"):
            SamplingParams(repetition_penalty=bad)


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
