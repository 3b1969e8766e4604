"""Beam search (``nightjar_jax/engine/beam_search.py``, ``LLM.beam_search``): the search against an exhaustive
enumeration on a toy language model, its end-of-sequence, length and context rules, its parameters' errors; then
through the engine on stories260K: width 1 is greedy decoding, every returned sequence's log-probability is what the
model gives its tokens, nothing leaks, and the beams share their cached pages."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from nightjar_jax import LLM, BeamSearchParams, SamplingParams
from nightjar_jax.engine.beam_search import BeamSearch, beam_score
from nightjar_jax.engine.sampling_params import InvalidRequestError

VOCAB, EOS = 4, 3


def toy_logprobs(prefix: list[int]) -> dict[int, float]:
    """A toy language model: next-token log-probabilities that depend on the whole prefix, without ties."""
    rng = random.Random(str(prefix))
    logits = [rng.gauss(0, 2) for _ in range(VOCAB)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return {t: logits[t] - norm for t in range(VOCAB)}


def toy_expansion(ids: list[int], width: int) -> dict[int, float]:
    ranked = sorted(toy_logprobs(ids).items(), key=lambda kv: -kv[1])
    return dict(ranked[:width])


def run_toy(prompt: list[int], params: BeamSearchParams, max_len: int = 100, eos=frozenset({EOS})):
    search = BeamSearch(None, prompt, params, eos, max_len)
    while not search.done:
        search.advance([toy_expansion(ids, 2 * params.beam_width) for ids in search.pending()])
    return search.best()


def exhaustive(prompt: list[int], max_tokens: int, length_penalty: float) -> list[tuple[float, list[int], str]]:
    """Every sequence the search could return (ended by EOS, or at max_tokens), best score first."""
    found = []
    for n in range(max_tokens + 1):
        for tokens in itertools.product([t for t in range(VOCAB) if t != EOS], repeat=n):
            cum = sum(toy_logprobs(prompt + list(tokens[:i]))[t] for i, t in enumerate(tokens))
            if n < max_tokens:
                end = cum + toy_logprobs(prompt + list(tokens))[EOS]
                found.append((end / (len(prompt) + n) ** length_penalty, list(tokens), "stop"))
            else:  # (vLLM's length: the prompt's tokens and the generated ones, the end-of-sequence token not)
                found.append((cum / (len(prompt) + n) ** length_penalty, list(tokens), "length"))
    return sorted(found, key=lambda f: -f[0])


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_a_wide_enough_beam_finds_the_best_sequences_of_an_exhaustive_search(length_penalty):
    """Width 10 keeps every partial sequence of a 3-token vocabulary (EOS aside) to depth 2: the search's answer
    must be the enumeration's 10 best, in order, with their scores and finish reasons."""
    prompt = [1, 0, 2]
    out = run_toy(prompt, BeamSearchParams(beam_width=10, max_tokens=3, length_penalty=length_penalty))
    best = exhaustive(prompt, 3, length_penalty)[:10]
    assert [s.tokens for s in out.sequences] == [tokens for _, tokens, _ in best]
    assert [s.finish_reason for s in out.sequences] == [reason for _, _, reason in best]
    for seq, (score, _, _) in zip(out.sequences, best, strict=True):
        assert seq.score == pytest.approx(score) and seq.score == beam_score(seq, length_penalty, len(prompt))
        assert seq.cum_logprob == pytest.approx(sum(seq.logprobs) + (toy_logprobs(prompt + seq.tokens)[EOS]
                                                                       if seq.finish_reason == "stop" else 0))
        assert (seq.stop_reason == EOS) == (seq.finish_reason == "stop")


def test_width_one_is_greedy_and_eos_rules():
    prompt = [2, 2]
    greedy, seq = [], list(prompt)
    while len(greedy) < 6:
        nxt = max(toy_logprobs(seq).items(), key=lambda kv: kv[1])[0]
        if nxt == EOS:
            break
        greedy.append(nxt)
        seq.append(nxt)
    (one,) = run_toy(prompt, BeamSearchParams(beam_width=1, max_tokens=6)).sequences
    assert one.tokens == greedy
    # ignore_eos: EOS is an ordinary token, every sequence runs to max_tokens
    out = run_toy(prompt, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    assert all(len(s.tokens) == 5 and s.finish_reason == "length" for s in out.sequences)
    assert any(EOS in s.tokens for s in run_toy(prompt, BeamSearchParams(beam_width=8, max_tokens=5,
                                                                         ignore_eos=True)).sequences)


def test_include_stop_str_in_output_keeps_the_eos_token_and_the_ranking():
    """vLLM's ``include_stop_str_in_output``: a sequence that an end-of-sequence token finished keeps it last, with
    its log-probability; the scores (whose length never counts it) and the ranking are unchanged. ``temperature``
    is taken and changes nothing."""
    params = dict(beam_width=6, max_tokens=4, length_penalty=1.0)
    plain = run_toy([1, 0, 2], BeamSearchParams(**params)).sequences
    kept = run_toy([1, 0, 2], BeamSearchParams(**params, include_stop_str_in_output=True, temperature=0.8)).sequences
    assert any(s.finish_reason == "stop" for s in plain)
    for a, b in zip(plain, kept, strict=True):
        assert (a.score, a.cum_logprob, a.finish_reason, a.stop_reason) == (b.score, b.cum_logprob, b.finish_reason,
                                                                            b.stop_reason)
        eos = [EOS] if a.finish_reason == "stop" else []
        assert b.tokens == a.tokens + eos and len(b.logprobs) == len(b.tokens)
        assert sum(b.logprobs) == pytest.approx(b.cum_logprob)  # (with the EOS token's, kept)


@pytest.mark.parametrize("keep", [False, True])
def test_several_end_tokens_end_a_beam_once(keep):
    """A model with several end-of-sequence ids (stories260K's 1 and 2, Llama 3's): a beam whose candidates hold two
    of them finished twice, equal but for the id (the same text without include_stop_str_in_output). It ends once, at
    its most likely one (QA, 2026-12-07). The server passes include_stop_str_in_output on to the search."""
    from nightjar_jax.server.protocol import CompletionRequest

    search = BeamSearch(None, [5], BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=keep),
                        frozenset({1, 2}), 100)
    search.advance([{2: -0.3, 1: -0.1, 7: -3.0, 8: -4.0}])
    assert [(s.tokens, s.stop_reason, s.cum_logprob) for s in search.finished] == [([1] if keep else [], 1, -0.1)]
    assert [b.tokens for b in search.beams] == [[7], [8]]
    req = CompletionRequest(prompt="x", n=2, use_beam_search=True, include_stop_str_in_output=keep)
    assert req.beam_search_params(8).include_stop_str_in_output is keep


@pytest.mark.parametrize("length_penalty", [1e6, -1e6])
def test_extreme_length_penalties_rank_without_overflow(length_penalty):
    """``length ** 1e6`` overflows a float: the ranking is computed in log space, longest first for a huge
    penalty and shortest first for a hugely negative one."""
    out = run_toy([1, 0, 2], BeamSearchParams(beam_width=6, max_tokens=4, length_penalty=length_penalty))
    lengths = [len(s.tokens) for s in out.sequences]
    assert lengths == sorted(lengths, reverse=length_penalty > 0)
    assert all(s.score <= 0 for s in out.sequences)


def test_the_context_ends_the_beams():
    out = run_toy([0, 1, 2], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True), max_len=7)
    assert [len(s.tokens) for s in out.sequences] == [4, 4]  # 3 + 4 tokens fill the 7-token context
    assert all(s.finish_reason == "length" for s in out.sequences)
    with pytest.raises(InvalidRequestError, match="the prompt has 7 tokens, the context limit is 7"):
        BeamSearch(None, list(range(7)), BeamSearchParams(beam_width=2, max_tokens=4), frozenset(), 7)


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, length_penalty=1e308), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, include_stop_str_in_output=1), "include_stop_str_in_output"),
])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=f"BeamSearchParams.{field}=.* is invalid: allowed") as err:
        BeamSearchParams(**kwargs)
    assert err.value.field == field


@pytest.fixture(scope="module")
def stories():
    return LLM("stories260k", max_model_len=128, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.mark.parametrize("prompt", ["Once upon a time", "The dog"])
def test_width_one_through_the_engine_is_greedy_decoding(stories, prompt):
    """Same tokens, log-probability and text as greedy ``generate`` (after "The dog" the first token's leading
    space is part of the text: the sequence is decoded after its prompt)."""
    g = stories.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=0))[0].outputs[0]
    (out,) = stories.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=12))
    (seq,) = out.sequences
    assert seq.tokens == g.token_ids and seq.text == g.text
    assert seq.cum_logprob == pytest.approx(g.cumulative_logprob, abs=1e-4)


def test_beam_sequences_carry_the_models_log_probabilities(stories):
    prompts = ["Once upon a time", "The little dog"]
    outs = stories.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5))
    engine = stories.engine
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt == prompt and len(out.sequences) == 3
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(s.tokens) for s in out.sequences}) == 3
        for seq in out.sequences:
            # the model's own log-probabilities of the sequence's tokens, scored as a prompt
            (scored,) = stories.generate([{"prompt_token_ids": out.prompt_token_ids + seq.tokens}],
                                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
            lps = [entry[t].logprob for entry, t in zip(scored.prompt_logprobs[len(out.prompt_token_ids):],
                                                        seq.tokens, strict=True)]
            assert seq.logprobs == pytest.approx(lps, abs=1e-4)
            if seq.finish_reason == "length":
                assert seq.cum_logprob == pytest.approx(sum(lps), abs=1e-3)
            head = engine.tokenizer.decode(out.prompt_token_ids)
            assert seq.text == engine.tokenizer.decode(out.prompt_token_ids + seq.tokens)[len(head):]
    assert engine.num_free_pages == engine.num_total_pages and not engine.has_unfinished_requests()


def test_beams_share_their_cached_pages(stories):
    engine = stories.engine
    hits = engine.stats.num_prefix_cache_hits
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her"
    stories.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=6))
    assert engine.stats.num_prefix_cache_hits > hits  # (the prompt's full pages computed once for every beam)


def test_a_salted_beam_search_shares_pages_with_its_salt_only(stories):
    """A prompt dict's cache_salt reaches the search's steps (they were sent unsalted): a later request of the same
    prompt finds its pages under that salt only."""
    engine = stories.engine
    prompt = "The sun was shining and the birds were singing in the tall green trees by the river bank today."
    stories.beam_search({"prompt": prompt, "cache_salt": "tenant-b"}, BeamSearchParams(beam_width=2, max_tokens=3))
    params = SamplingParams(temperature=0, max_tokens=1)
    (plain,) = stories.generate([prompt], params, use_tqdm=False)
    (salted,) = stories.generate([{"prompt": prompt, "cache_salt": "tenant-b"}], params, use_tqdm=False)
    assert plain.num_cached_tokens == 0 and salted.num_cached_tokens > 0
    assert engine.num_free_pages == engine.num_total_pages


def test_a_bad_prompt_fails_before_anything_runs(stories):
    engine = stories.engine
    steps = engine.stats.num_steps
    with pytest.raises(ValueError, match="context limit"):
        stories.beam_search(["Once", [1] * 200], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(TypeError, match="takes a BeamSearchParams"):
        stories.beam_search("Once", SamplingParams())
    # an empty cache_salt is refused as generate refuses it (it ran unsalted, sharing the unsalted requests' pages)
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
        stories.beam_search(["Once", {"prompt": "Once", "cache_salt": ""}],
                            BeamSearchParams(beam_width=2, max_tokens=4))
    assert engine.stats.num_steps == steps and not engine.has_unfinished_requests()


def test_vllm_keywords_concurrency_limit_and_lora_request(stories):
    """vLLM's LLM.beam_search(concurrency_limit=, lora_request=), generate's and chat's lora_request and the output
    fields vLLM code reads (QA, 2026-12-07: TypeErrors and AttributeErrors): a limit searches that many prompts at a
    time with the same results; a LoRA request is refused by name; the fields hold vLLM's plain-text values."""
    prompts = ["Once upon a time", "The dog", "Lily saw"]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    whole = stories.beam_search(prompts, params, lora_request=None)
    assert [[s.tokens for s in o.sequences] for o in stories.beam_search(prompts, params, concurrency_limit=1)] == \
        [[s.tokens for s in o.sequences] for o in whole]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit must be None or an int >= 1"):
            stories.beam_search(prompts, params, concurrency_limit=bad)
    for call in (lambda: stories.beam_search(prompts, params, lora_request="adapter"),
                 lambda: stories.generate(prompts, lora_request=object()),
                 lambda: stories.chat([{"role": "user", "content": "hi"}], lora_request="adapter")):
        with pytest.raises(ValueError, match="LoRA adapters are not served here"):
            call()
    with pytest.raises(ValueError, match="tools must be None or a list of tool definitions"):
        stories.chat([{"role": "user", "content": "hi"}], tools="nope")
    out = stories.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=None)[0]
    assert (out.encoder_prompt, out.encoder_prompt_token_ids, out.lora_request, out.kv_transfer_params,
            out.multi_modal_placeholders, out.outputs[0].lora_request) == (None, None, None, None, {}, None)
