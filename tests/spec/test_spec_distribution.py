"""End to end through the engine: with temperature and top-k/top-p on, speculative decoding samples from the
target's distribution (two-sample chi-square against plain decoding), and a verifier that ignores the draft's
distribution is detected by the same test (so the test can fail)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from nightjar_jax import LLM, SamplingParams

NUM_SAMPLES = 1500
PROMPT = {"prompt_token_ids": [1, 57, 300, 12]}
PARAMS = dict(temperature=1.0, top_k=5, top_p=0.95, max_tokens=3, ignore_eos=True)


def _samples(prompt=PROMPT, **llm_kwargs) -> list[tuple[int, ...]]:
    llm = LLM("tiny-gqa", load_format="dummy", max_model_len=64, max_num_seqs=64, num_pages=400, seed=0,
              **llm_kwargs)
    if llm.engine.gamma_max:
        llm.engine._select_gamma = lambda: 2
    params = [SamplingParams(seed=1000 + i, **PARAMS) for i in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    if llm.engine.gamma_max:
        assert llm.engine.stats.num_drafted_tokens > 0
    return [tuple(o.outputs[0].token_ids) for o in outs]


def _chi2_two_sample(a: list, b: list, min_count: int = 5) -> float:
    """p-value of the two-sample chi-square test on categories with enough counts (rare ones pooled)."""
    from scipy import stats

    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= min_count]
    rest_a = sum(v for k, v in ca.items() if k not in keys)
    rest_b = sum(v for k, v in cb.items() if k not in keys)
    table = np.array([[ca[k] for k in keys] + [rest_a], [cb[k] for k in keys] + [rest_b]])
    table = table[:, table.sum(axis=0) > 0]
    return stats.chi2_contingency(table)[1]


def _accept_everything(draft_tokens, draft_probs, target_probs, st, *, salt=1, plain=None):
    """A broken verifier: every draft accepted whatever the distributions (the negative controls' patch)."""
    import jax.numpy as jnp

    from nightjar_jax.engine.sampler import request_keys, sample_from_probs

    bonus = sample_from_probs(target_probs[:, -1], request_keys(st, salt))
    out = jnp.concatenate([draft_tokens, bonus[:, None]], axis=1)
    return out, jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)


@pytest.fixture(scope="module")
def ar_samples():
    return _samples()


def _draft_kwargs():
    # a different random model with the same vocabulary: its distribution differs a lot from the target's
    return dict(draft_model="tiny-mha", num_speculative_tokens=2)


def test_speculative_sampling_matches_target_distribution(ar_samples):
    sd = _samples(**_draft_kwargs())
    for part in (slice(0, 2), slice(1, 3)):  # (t1, t2) joint and (t2, t3) joint
        p = _chi2_two_sample([s[part] for s in sd], [s[part] for s in ar_samples])
        assert p > 1e-3, f"SD tokens {part} differ from AR (p={p:.2e})"


def test_verifier_that_ignores_the_draft_distribution_is_detected(ar_samples, monkeypatch):
    import nightjar_jax.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "rejection_sample", _accept_everything)
    broken = _samples(**_draft_kwargs())
    p = _chi2_two_sample([s[0:2] for s in broken], [s[0:2] for s in ar_samples])
    assert p < 1e-6, f"a verifier that ignores the draft went undetected (p={p:.2e})"


@pytest.fixture(scope="module")
def subset_head_draft(tmp_path_factory):
    """tiny-mha's random layers with a head over only half the vocabulary (a draft that gives every other id
    probability 0, as a subset-head draft does): the residual distribution must supply those ids."""
    from nightjar_jax.models.llama import HEAD_TOKEN_IDS, random_state
    from nightjar_jax.models.orbax_io import save_orbax, state_to_hf
    from nightjar_jax.models.presets import get_preset

    cfg = get_preset("tiny-mha").config.replace(head_vocab_size=256, name="tiny-subset")
    _, state = random_state(cfg, seed=5)
    weights = state_to_hf(cfg, state)
    weights[HEAD_TOKEN_IDS] = np.arange(0, 512, 2, dtype=np.int32)
    return str(save_orbax(tmp_path_factory.mktemp("subset") / "draft", cfg, weights))


def test_subset_head_draft_samples_the_target_distribution(ar_samples, subset_head_draft):
    sd = _samples(draft_model=subset_head_draft, num_speculative_tokens=2)
    assert any(t % 2 == 1 for s in sd for t in s), "odd ids (outside the draft's head) must still be sampled"
    for part in (slice(0, 2), slice(1, 3)):
        p = _chi2_two_sample([s[part] for s in sd], [s[part] for s in ar_samples])
        assert p > 1e-3, f"SD tokens {part} with a subset-head draft differ from AR (p={p:.2e})"


# draft-free n-gram speculation (draft_model="ngram"): a prompt that repeats itself, and lookup from one token, so most
# rows copy drafts; rows without a copy are capped at none
REPEATING = {"prompt_token_ids": [1, 57, 300, 12, 57, 300, 12, 57, 300, 12, 57]}
NGRAM = dict(draft_model="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)


@pytest.fixture(scope="module")
def ar_repeating():
    return _samples(prompt=REPEATING)


def test_ngram_speculation_samples_the_target_distribution(ar_repeating):
    sd = _samples(prompt=REPEATING, **NGRAM)
    for part in (slice(0, 2), slice(1, 3)):
        p = _chi2_two_sample([s[part] for s in sd], [s[part] for s in ar_repeating])
        assert p > 1e-3, f"n-gram SD tokens {part} differ from AR (p={p:.2e})"


def test_ngram_verifier_that_accepts_every_copy_is_detected(ar_repeating, monkeypatch):
    import nightjar_jax.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "rejection_sample", _accept_everything)
    broken = _samples(prompt=REPEATING, **NGRAM)
    p = _chi2_two_sample([s[0:3] for s in broken], [s[0:3] for s in ar_repeating])
    assert p < 1e-6, f"a verifier that accepts every copy went undetected (p={p:.2e})"
