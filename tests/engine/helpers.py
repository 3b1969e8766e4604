"""Shared helpers for engine tests: build engines on the fake model and run requests to completion."""

from __future__ import annotations

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.testing import fake_model

VOCAB = 97


def fake_engine(*, draft: bool = False, perturb: int = 5, eos: int | None = None, runner_up: bool = False,
                **kwargs) -> LLMEngine:
    opts = dict(page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16, compilation_cache_dir=None,
                planner="static")
    opts.update(kwargs)
    target = fake_model(VOCAB, eos_token_id=eos)
    drafter = fake_model(VOCAB, eos_token_id=eos, perturb=perturb, runner_up=runner_up) if draft else None
    return LLMEngine(make_engine_config(model="fake", **opts), target=target, draft=drafter)


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; returns request id -> output token ids of every finished request."""
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return done


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def generate_outputs(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list:
    """Add every prompt with its params, step until idle; returns each request's final ``CompletionOutput`` in
    prompt order, after checking that every page came back."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert engine.num_free_pages == engine.num_total_pages
    return [done[i] for i in ids]
