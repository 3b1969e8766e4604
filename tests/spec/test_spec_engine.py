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


def test_a_seeded_request_is_reproducible_for_the_same_speculation_decisions():
    """A seeded sampled request gives the same tokens alone or batched with others when every step runs at the same
    γ; at another γ it draws other tokens from the same distribution (plain and speculative steps sample from
    different random streams; README, ``seed``)."""
    from nightjar_jax.engine.sampling_params import SamplingParams

    seeded = SamplingParams(temperature=3.0, seed=1234, max_tokens=24)

    def run(gamma, others):
        engine = fake_engine(draft=True, num_speculative_tokens=GAMMA_MAX)
        force_gamma(engine, lambda: gamma)
        rid = engine.add_request([3, 1, 4, 1, 5, 9, 2, 6], seeded)
        for i, prompt in enumerate(others):
            engine.add_request(prompt, greedy(30), request_id=f"other-{i}")
        out = run_all(engine)[rid]
        assert engine.num_free_pages == engine.num_total_pages
        return out

    alone = run(3, [])
    assert run(3, PROMPTS[:3]) == alone  # (γ = 0 alone vs batched: tests/engine/test_engine_real.py)
    assert run(0, []) != alone  # (with temperature 3 over 97 tokens a match would be a coincidence)
