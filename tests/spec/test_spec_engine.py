"""Speculative decoding in the engine on the fake models: greedy SD == AR token for token, at every fixed γ,
with γ changing randomly every step (0 included), with preemption, and at the edges (all rejected / all accepted,
EOS inside the accepted run, max_tokens mid-run, the context limit)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from helpers import VOCAB, fake_engine, greedy, run_all  # noqa: E402

from nightjar_jax.testing import fake_greedy_continuation  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(1, 21)), [42, 1], [3, 3], list(range(30, 43))]
GAMMA_MAX = 4


def expected(prompt, n):
    return fake_greedy_continuation(prompt, n, VOCAB)


def force_gamma(engine, choose):
    engine._select_gamma = lambda: choose() if engine.scheduler.num_decoding() else 0


@pytest.mark.parametrize("gamma", range(1, GAMMA_MAX + 1))
def test_fixed_gamma_equals_ar(gamma):
    eng = fake_engine(draft=True, num_speculative_tokens=GAMMA_MAX)
    force_gamma(eng, lambda: gamma)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(17), request_id=str(i))
    assert run_all(eng) == {str(i): expected(p, 17) for i, p in enumerate(PROMPTS)}
    s = eng.stats
    assert s.num_drafted_tokens > 0 and 0 < s.num_accepted_tokens < s.num_drafted_tokens  # both outcomes seen
    assert eng.num_free_pages == eng.num_total_pages


def test_random_gamma_every_step_with_preemption_equals_ar():
    rng = random.Random(0)
    eng = fake_engine(draft=True, num_speculative_tokens=GAMMA_MAX, num_pages=16, max_num_seqs=5)
    force_gamma(eng, lambda: rng.randint(0, GAMMA_MAX))
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(30), request_id=str(i))
    assert run_all(eng) == {str(i): expected(p, 30) for i, p in enumerate(PROMPTS)}
    assert eng.stats.num_preemptions > 0
    assert eng.stats.num_catchup_tokens > 0  # γ = 0 stretches were caught up
    assert eng.num_free_pages == eng.num_total_pages


def test_all_rejected_and_all_accepted():
    # A draft that always agrees (perturb 0) is accepted at every position: γ + 1 tokens per step.
    eng = fake_engine(draft=True, perturb=0, num_speculative_tokens=GAMMA_MAX)
    force_gamma(eng, lambda: GAMMA_MAX)
    eng.add_request(PROMPTS[0], greedy(20), request_id="a")
    eng.record_steps = True
    assert run_all(eng) == {"a": expected(PROMPTS[0], 20)}
    assert eng.stats.num_accepted_tokens == eng.stats.num_drafted_tokens
    assert all(s["committed"] == GAMMA_MAX + 1 for s in eng.stats.step_log[:-1])
    # the step log counts delivered tokens: the last step verified γ + 1 but max_tokens keeps only the rest
    assert sum(s["committed"] for s in eng.stats.step_log) == 20 - 1  # the first token came from prefill
    # A draft that always disagrees: every draft rejected, exactly one (target) token per step, output unchanged.
    eng = fake_engine(draft=True, perturb=0, num_speculative_tokens=GAMMA_MAX)
    eng.draft = eng.runner.draft = _always_wrong_draft()
    eng.runner._build_jitted()
    force_gamma(eng, lambda: 2)
    eng.add_request(PROMPTS[0], greedy(9), request_id="b")
    assert run_all(eng) == {"b": expected(PROMPTS[0], 9)}
    assert eng.stats.num_accepted_tokens == 0 and eng.stats.num_drafted_tokens > 0


def _always_wrong_draft():
    import jax
    import jax.numpy as jnp

    from nightjar_jax.testing import fake_model

    base = fake_model(VOCAB)
    hidden_fn, logits_fn = base.fns

    def wrong_logits(state, hidden):
        right = jnp.argmax(logits_fn(state, hidden), axis=-1)
        return jax.nn.one_hot((right + 1) % VOCAB, VOCAB, dtype=jnp.float32) * 10.0

    base.fns = (hidden_fn, wrong_logits)
    return base


def test_eos_inside_accepted_run_and_max_tokens_mid_run():
    cont = expected(PROMPTS[0], 12)
    eng = fake_engine(draft=True, perturb=0, eos=cont[2], num_speculative_tokens=GAMMA_MAX)
    force_gamma(eng, lambda: GAMMA_MAX)
    eng.add_request(PROMPTS[0], greedy(12), request_id="eos")  # EOS is the 3rd token of a 5-token run
    eng.add_request(PROMPTS[3], greedy(3, ignore_eos=True), request_id="max")  # max_tokens inside the first run
    done = run_all(eng)
    assert done["eos"] == cont[:3]
    assert done["max"] == expected(PROMPTS[3], 3)
    assert eng.num_free_pages == eng.num_total_pages


def test_context_limit_clips_speculation():
    eng = fake_engine(draft=True, perturb=0, num_speculative_tokens=GAMMA_MAX, max_model_len=11)
    force_gamma(eng, lambda: GAMMA_MAX)
    eng.add_request(PROMPTS[0], greedy(50), request_id="a")  # 3 prompt tokens: 8 may be generated
    eng.add_request(PROMPTS[2], greedy(50), request_id="b")
    done = run_all(eng)
    assert done == {"a": expected(PROMPTS[0], 8), "b": expected(PROMPTS[2], 9)}
    assert eng.num_free_pages == eng.num_total_pages


@pytest.mark.parametrize("spec", [{}, dict(spec_tree_nodes=6), dict(prompt_lookup_max=2, prompt_lookup_min=1)],
                         ids=["chain", "tree", "lookup"])
def test_a_seeded_request_gives_the_same_tokens_whatever_the_speculation(spec):
    """A seeded sampled request's tokens do not depend on γ: the same alone or batched (with sampled unseeded
    requests, which keep rejection sampling), at γ = 0, at a fixed γ, at a γ drawn every step, through preemptions,
    under top-k / top-p and a presence penalty, with a token tree or n-gram lookup's copies. Each speculative step
    verifies the row's drafts against the tokens plain steps would draw (``SamplingTensors.exact``). They differed
    at another γ (plain and speculative steps drew from different random streams), so a seeded request's output
    followed the planner's choices, that is the server's load."""
    from nightjar_jax.engine.sampling_params import SamplingParams

    seeded = [SamplingParams(temperature=1.0, seed=1234, max_tokens=24),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, seed=7, max_tokens=24)]

    def run(choose, others, **kw):
        engine = fake_engine(draft=True, runner_up=True, num_speculative_tokens=GAMMA_MAX, **{**spec, **kw})
        force_gamma(engine, choose)
        ids = [engine.add_request(list(range(3 + i, 12 + i)), sp) for i, sp in enumerate(seeded)]
        for i, prompt in enumerate(others):
            engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=30), request_id=f"other-{i}")
        done = run_all(engine)
        assert engine.num_free_pages == engine.num_total_pages
        return [done[i] for i in ids], engine.stats

    plain, _ = run(lambda: 0, [])
    rng = random.Random(0)
    for choose, others, kw in [(lambda: 3, [], {}), (lambda: GAMMA_MAX, PROMPTS[:3], {}),
                               (lambda: rng.randint(0, GAMMA_MAX), PROMPTS, dict(num_pages=20, max_num_seqs=5))]:
        out, stats = run(choose, others, **kw)
        assert out == plain
        assert stats.num_accepted_tokens > 0  # (drafts were accepted, not only rejected)
        if "num_pages" in kw:
            assert stats.num_preemptions > 0
