"""Draft-free n-gram speculation (``draft_model="ngram"``, vLLM's "ngram" method): no draft model; each decode step's
drafts are n-gram lookup's copies from the request's own tokens, a row without one capped at no draft. Greedy
outputs equal plain decoding (fake model with mixed rows, stories260K), the step variants are all warmed up, and the
configuration errors are clear. The sampled distribution: tests/spec/test_spec_distribution.py."""

from __future__ import annotations

import logging
import re

import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.config import ConfigError
from nightjar_jax.testing import fake_greedy_continuation
from tests.engine.helpers import VOCAB, fake_engine, run_all

NGRAM = dict(draft_model="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def test_fake_model_rows_with_and_without_copies_keep_their_tokens():
    engine = fake_engine(**NGRAM, max_num_seqs=6)
    assert engine.draft is None and engine.gamma_max == 3
    # prompts that repeat tokens (lookup copies) beside prompts that do not (capped at no draft)
    prompts = [[5, 6, 5, 6, 5], [9, 9, 9, 9], list(range(10, 17)), [3, 4, 3, 4, 3, 4], [40, 41, 42], [7, 7]]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=20)) for p in prompts]
    done = run_all(engine)
    for rid, p in zip(ids, prompts, strict=True):
        assert done[rid] == fake_greedy_continuation(p, 20, VOCAB)
    s = engine.stats
    assert s.num_drafted_tokens > 0 and s.decode_steps_per_gamma.get(3, 0) > 0
    assert engine.num_free_pages == engine.num_total_pages


@pytest.fixture(scope="module")
def stories_pair():
    opts = dict(max_model_len=256, num_pages=96, max_num_seqs=4)
    return LLM("stories260k", draft_model="ngram", num_speculative_tokens=4, planner="static", **opts), \
        LLM("stories260k", draft_model="none", **opts)


PROMPTS = ["Once upon a time, there was a little girl named Lily. Lily liked to play. One day, Lily",
           "The dog ran and ran. The dog ran and ran. The dog", "Tom had a red ball."]


def test_greedy_ngram_speculation_equals_plain_decoding(stories_pair):
    ngram, plain = stories_pair
    sp = SamplingParams(temperature=0, max_tokens=48)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
    got = [o.outputs[0].token_ids for o in ngram.generate(PROMPTS, sp)]
    assert got == want
    s = ngram.engine.stats
    assert s.num_accepted_tokens > 0 and s.num_decode_steps < plain.engine.stats.num_decode_steps
    assert ngram.engine.num_free_pages == ngram.engine.num_total_pages


def test_warmup_covers_every_ngram_step(stories_pair):
    ngram, _ = stories_pair
    engine = ngram.engine
    # (the γ the static planner runs and the plain steps, the contexts these prompts reach: what the full warm-up
    # builds for them, at a fraction of its compiles)
    engine.runner.warmup(gammas=[0, engine.gamma_max], max_context=128)
    compiling = engine.stats.num_compiling_decode_steps
    steps = engine.stats.decode_steps_per_gamma.get(4, 0)
    for temperature in (0.0, 0.8):  # greedy and sampled verifies of copied drafts
        ngram.generate(PROMPTS, SamplingParams(temperature=temperature, seed=3, max_tokens=24))
    assert engine.stats.decode_steps_per_gamma.get(4, 0) > steps
    assert engine.stats.num_compiling_decode_steps == compiling  # (no decode step compiled)


def test_the_planner_sees_the_ngram_steps():
    """The planner chooses γ for steps with copies and is shown what they cost and committed (without its
    observations it kept γ_max wherever lookup found something, at batch 4 on this CPU 0.54x plain decoding)."""
    llm = LLM("stories260k", draft_model="ngram", num_speculative_tokens=4, max_model_len=256, num_pages=96,
              max_num_seqs=4)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64))
    planner = llm.engine.planner
    assert planner.num_decisions > 0 and planner.num_observations > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_lookup_max=0), "needs prompt_lookup_max >= 1"),
    (dict(spec_tree_nodes=8), "spec_tree_nodes needs a draft model"),
    (dict(num_speculative_tokens=0), "needs num_speculative_tokens >= 1"),
    (dict(draft_offload="auto"), r"draft_offload='auto' moves a draft model's weights .* \(draft_model='ngram'\)"),
])
def test_ngram_configuration_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        fake_engine(**{**NGRAM, **kwargs})


def test_tree_without_a_draft_is_a_config_error(caplog):
    """spec_tree_nodes with no draft at all was ignored (plain decoding without a word); a draft with
    num_speculative_tokens=0 is loaded for nothing, which a warning says."""
    with pytest.raises(ConfigError, match=r"spec_tree_nodes=8 needs a draft model .*\(draft_model='none'\)"):
        fake_engine(draft_model="none", spec_tree_nodes=8)
    with pytest.raises(ConfigError, match=r"draft_offload='auto' .* has none \(draft_model='none'\)"):
        fake_engine(draft_model="none", draft_offload="auto")  # (elastic memory was off without a word)
    with pytest.raises(ConfigError, match=r"has none \(draft_model='auto' found no default draft for this model\)"):
        fake_engine(draft_offload="auto")  # (it said "(draft_model='auto')", as though one had been asked for)
    with caplog.at_level(logging.WARNING, logger="nightjar_jax"):
        eng = fake_engine(draft=True, num_speculative_tokens=0)
    assert eng.gamma_max == 0 and "num_speculative_tokens=0: the draft" in caplog.text


def test_speculation_values_without_a_draft_are_warned(caplog):
    """num_speculative_tokens / prompt_lookup_max set (away from their defaults) with no draft model were unused
    without a word; a warning names them, and the defaults alone say nothing."""
    with caplog.at_level(logging.WARNING, logger="nightjar_jax"):
        eng = fake_engine(draft_model="none", num_speculative_tokens=7, prompt_lookup_max=5)
    assert eng.gamma_max == 0
    assert ("num_speculative_tokens=7, prompt_lookup_max=5: no effect, this engine has no draft model "
            "(draft_model='none')") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nightjar_jax"):
        fake_engine(draft_model="none")
        fake_engine(**NGRAM)  # (ngram uses them)
    assert "no effect" not in caplog.text


def test_config_errors_come_before_any_weights_load(monkeypatch):
    """What the config alone decides (no draft for trees or elastic memory, ngram's needs, the grammar cache's limit)
    is refused before the target loads: the model path here does not exist, and its error never comes."""
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine

    def config(**kw):
        return make_engine_config(model="/nonexistent/model.gguf", compilation_cache_dir=None, **kw)

    for kw, message in [(dict(draft_model="none", draft_offload="auto"), "draft_offload='auto'"),
                        (dict(draft_model="none", spec_tree_nodes=4), "spec_tree_nodes=4 needs a draft model"),
                        (dict(draft_model="ngram", prompt_lookup_max=0), "needs prompt_lookup_max >= 1")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            LLMEngine(config(**kw))
    monkeypatch.setenv("NIGHTJAR_XGRAMMAR_CACHE_MB", "-1")
    with pytest.raises(ConfigError, match="NIGHTJAR_XGRAMMAR_CACHE_MB"):
        LLMEngine(config(draft_model="none"))
    monkeypatch.delenv("NIGHTJAR_XGRAMMAR_CACHE_MB")
    with pytest.raises(FileNotFoundError):  # (a good config gets as far as the load)
        LLMEngine(config(draft_model="none"))
