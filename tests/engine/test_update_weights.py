"""Weight updates without a restart (``LLMEngine.update_weights``, an RL loop's weight sync): new weights from a state
dict, a checkpoint or a handle serve at once, the same layout compiles nothing, another layout of the same model
(4-bit blocks <-> float32 panels) compiles again and gives the same tokens as an engine built on those weights, bad
weights change nothing, and a draft's weights update with speculation staying lossless."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.linear import cpu
from nightjar_jax import LLM, EngineSleepingError, LLMEngine, SamplingParams
from nightjar_jax.config import make_engine_config
from nightjar_jax.models.llama import random_state
from nightjar_jax.models.loader import load_checkpoint
from nightjar_jax.models.orbax_io import state_to_hf
from nightjar_jax.models.presets import PRESETS

GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
PROMPT = "Once upon a time"


def tokens(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def noisy(sd: dict, scale: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: v + rng.normal(0, scale, v.shape).astype(v.dtype) if "proj" in k else v for k, v in sd.items()}


@pytest.fixture(scope="module")
def stories():
    llm = LLM("stories260k", max_model_len=128, num_pages=64)
    sd = {k: np.asarray(v) for k, v in load_checkpoint("stories260k").state_dict.items()}
    return llm, sd, tokens(llm)


def test_new_weights_serve_at_once_and_the_old_come_back(stories):
    llm, sd, ref = stories
    engine = llm.engine
    compiled = engine.runner.num_compiled()
    assert llm.update_weights(sd) is False  # the same layout
    assert tokens(llm) == ref and engine.runner.num_compiled() == compiled

    changed = noisy(sd, 0.3)
    assert llm.update_weights(changed) is False
    new = tokens(llm)
    assert new != ref and engine.runner.num_compiled() == compiled
    # the tokens an engine built on those weights from the start gives
    fresh = LLM.from_engine(LLMEngine(make_engine_config(model="stories260k", max_model_len=128, num_pages=64),
                                      target=engine._weights_handle(changed, engine.target, "weights"),
                                      tokenizer=engine.tokenizer))
    assert tokens(fresh) == new
    assert llm.update_weights("stories260k") is False  # a checkpoint spec, loaded as at start
    assert tokens(llm) == ref
    assert engine.stats.num_weight_updates == 3
    assert engine.num_free_pages == engine.num_total_pages


def test_a_checkpoint_saved_in_another_dtype_loads_at_the_served_one(stories, tmp_path):
    """The same model saved as bfloat16 (a trainer's save for a float32 server, or the other way round) was refused as
    "another architecture (dtype bfloat16 vs float32)" by an engine on the default dtype (each checkpoint's own):
    it loads at the dtype served, as vLLM's and SGLang's weight updates cast (QA, 2026-12-07)."""
    from nightjar_jax.models.orbax_io import save_orbax

    llm, sd, ref = stories
    ckpt = load_checkpoint("stories260k")
    folder = save_orbax(tmp_path / "bf16", ckpt.config.replace(dtype="bfloat16"), ckpt.state_dict)
    assert load_checkpoint(str(folder)).config.dtype == "bfloat16" and llm.engine.target.config.dtype == "float32"
    assert llm.update_weights(str(folder)) is False  # (float32 again: the same layout, nothing compiles)
    assert llm.engine.target.config.dtype == "float32"
    bf16 = tokens(llm)  # (the weights rounded to bfloat16: near the original's, greedy tokens may differ)
    assert len(bf16) == len(ref)
    assert llm.update_weights("stories260k") is False and tokens(llm) == ref


def test_a_level_2_sleep_keeps_the_updated_weights(stories):
    """Level 2 loads the weights again from their checkpoint: after an update from arrays there is none, so level 2
    is refused (level 1 keeps them); after an update from a checkpoint, level 2 loads that one."""
    llm, sd, ref = stories
    llm.update_weights(noisy(sd, 0.3))
    new = tokens(llm)
    with pytest.raises(ValueError, match="the target's weights have none"):
        llm.sleep(2)
    llm.sleep(1)
    llm.wake_up()
    assert tokens(llm) == new
    llm.update_weights("stories260k")
    llm.sleep(2)
    llm.wake_up()
    assert tokens(llm) == ref


def test_the_prefix_cache_goes_with_the_old_weights(stories):
    llm, sd, ref = stories
    long_prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun"
    llm.generate([long_prompt], GREEDY)
    assert llm.engine.allocator.num_cached_free > 0
    llm.update_weights(sd)
    assert llm.engine.allocator.num_cached_free == 0


@pytest.mark.parametrize("bad, message", [
    (lambda sd: {k: v for k, v in sd.items() if "norm" not in k}, "missing tensors"),
    (lambda sd: {**sd, "model.extra.weight": np.zeros(3, np.float32)}, "unexpected tensors"),
    (lambda sd: {k: (v[:, :-1] if k.endswith("q_proj.weight") else v) for k, v in sd.items()}, "shape"),
    (lambda sd: [1, 2], "must be a checkpoint spec or path, an HF-named state dict or a ModelHandle"),
    (lambda sd: {**sd, 5: np.zeros(3, np.float32)}, "keys must be HF tensor names"),
    (lambda sd: {k: (v.astype(np.int64) if k == "model.norm.weight" else v) for k, v in sd.items()},
     "model.norm.weight is int64: weights must be floating-point"),
    (lambda sd: {k: (np.full_like(v, np.nan) if k == "model.norm.weight" else v) for k, v in sd.items()},
     "model.norm.weight holds NaN or infinite values"),
    (lambda sd: {**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1},
     "lm_head.weight differs from model.embed_tokens.weight"),
])
def test_bad_weights_change_nothing(stories, bad, message):
    llm, sd, ref = stories
    with pytest.raises(ValueError, match=message):
        llm.update_weights(bad(sd))
    assert tokens(llm) == ref


def test_weights_of_another_model_or_no_weights_are_errors(stories):
    llm, sd, ref = stories
    engine = llm.engine
    other = dataclasses.replace(engine.target, config=dataclasses.replace(engine.target.config, num_layers=1))
    with pytest.raises(ValueError, match="another architecture"):
        llm.update_weights(other)
    with pytest.raises(ValueError, match="needs weights, draft_weights or both"):
        llm.update_weights()
    with pytest.raises(ValueError, match="this engine has no draft"):
        llm.update_weights(draft_weights=sd)
    assert tokens(llm) == ref


@pytest.mark.parametrize("level", [1, 2])
def test_an_update_wakes_sleeping_weights_with_the_new_ones(stories, level):
    """vLLM's RL loop: sleep, update the weights (which wakes them with the new ones; the KV cache sleeps on),
    wake the KV cache; the same tokens as an awake update."""
    llm, sd, ref = stories
    changed = noisy(sd, 0.3, seed=5)
    llm.update_weights(changed)
    want = tokens(llm)
    llm.update_weights("stories260k")
    llm.sleep(level)
    with pytest.raises(EngineSleepingError):
        tokens(llm)
    llm.update_weights(changed)
    assert llm.engine.asleep_parts == {"kv_cache"}
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping() and llm.engine.sleep_level == 0
    assert tokens(llm) == want
    llm.update_weights("stories260k")
    assert tokens(llm) == ref


@pytest.mark.parametrize("level", [1, 2])
def test_a_refused_update_leaves_sleeping_weights_asleep(stories, level):
    """Weights of another architecture given while the weights sleep: refused before anything wakes, so the sleep
    stands and wake_up brings the old weights back. At level 2 the engine was marked awake with its weights
    deleted, and every later request failed ("Array has been deleted"; the QA agent's finding)."""
    llm, sd, ref = stories
    engine = llm.engine
    other = dataclasses.replace(engine.target, config=dataclasses.replace(engine.target.config, num_layers=1),
                                state=jax.tree.map(jnp.copy, engine.target.state))  # (its own arrays: sleep moves
    llm.sleep(level)  # the engine's)
    with pytest.raises(ValueError, match="another architecture"):
        llm.update_weights(other)
    assert engine.asleep_parts == {"weights", "kv_cache"} and engine.sleep_level == level
    llm.wake_up()
    assert not llm.is_sleeping() and tokens(llm) == ref


def test_a_level_2_update_whose_reloaded_part_is_refused_leaves_the_weights_asleep(monkeypatch):
    """At level 2 an update loads the part it was not given (here the draft) again from its checkpoint: one that
    became another architecture meanwhile was refused only after the weights were marked awake (the review's
    finding); now the sleep stands and wake_up serves the old weights."""
    llm = LLM("stories260k", draft_model="stories260k@skip=2", max_model_len=64, num_pages=16)
    engine = llm.engine
    ref = tokens(llm)
    llm.sleep(2)
    real_load = engine._load

    def load(spec, tokenizer_spec, dtype=None):
        handle, tok = real_load(spec, tokenizer_spec, dtype)
        if "@skip" in spec:  # (the draft's file, rewritten as another model)
            handle = dataclasses.replace(handle, config=dataclasses.replace(handle.config, num_layers=5))
        return handle, tok

    monkeypatch.setattr(engine, "_load", load)
    with pytest.raises(ValueError, match="another architecture") as refused:
        llm.update_weights("stories260k")
    assert refused.value.reloaded_field == "draft_weights"  # (not the request's fault: the server answers 500)
    assert engine.asleep_parts == {"weights", "kv_cache"} and engine.sleep_level == 2
    monkeypatch.setattr(engine, "_load", real_load)
    llm.wake_up()
    assert tokens(llm) == ref


def q4_exact_hf(w: np.ndarray) -> np.ndarray:
    """An HF ``[out, in]`` weight rounded to GGUF Q4_1 values over blocks of 32 inputs (what pack_q4 takes)."""
    out, k = w.shape
    blocks = w.reshape(out, k // 32, 32)
    lo, hi = blocks.min(axis=2, keepdims=True), blocks.max(axis=2, keepdims=True)
    d = np.float16((hi - lo) / 15).astype(np.float32)
    m = np.float16(lo).astype(np.float32)
    q = np.clip(np.round((blocks - m) / np.where(d == 0, 1, d)), 0, 15)
    return (q * d + m).reshape(out, k).astype(np.float32)


@pytest.mark.skipif(not cpu.packing_supported(), reason="the 4-bit layout exists where the CPU kernel packs weights")
def test_another_layout_of_the_same_model_compiles_again_with_the_same_tokens():
    cfg = PRESETS["tiny-gqa"].config
    base = {k: np.asarray(v, np.float32) for k, v in state_to_hf(cfg, random_state(cfg, seed=3)[1]).items()}
    on_grid = {k: q4_exact_hf(v) if k.endswith("proj.weight") else v for k, v in base.items()}
    opts = dict(load_format="dummy", max_model_len=128, num_pages=32)
    auto = LLM("tiny-gqa", **opts)  # float32 panels (random weights are off the 4-bit grid)
    f32 = LLM("tiny-gqa", weight_format="f32", **opts)  # float32 panels whatever the values
    before = [x.dtype for x in auto.engine.target.leaves()]
    tokens(auto)
    assert auto.update_weights(on_grid) is True  # now 4-bit blocks (with float32 beside): another layout
    assert [x.dtype for x in auto.engine.target.leaves()] != before
    assert auto.engine.runner.num_compiled() == 0  # (the old variants were dropped)
    assert f32.update_weights(on_grid) is False
    assert tokens(auto) == tokens(f32)  # the 4-bit kernels rebuild each weight exactly
    assert auto.update_weights(base) is True and f32.update_weights(base) is False  # and back
    assert tokens(auto) == tokens(f32)


def test_draft_weights_update_and_speculation_stays_lossless():
    llm = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
              max_model_len=128, num_pages=64)
    ar = LLM.from_engine(LLMEngine(make_engine_config(model="stories260k", max_model_len=128, num_pages=64),
                                   target=llm.engine.target, tokenizer=llm.engine.tokenizer))
    ref = tokens(ar)
    assert tokens(llm) == ref
    drafted = llm.engine.stats.num_drafted_tokens
    assert llm.update_weights(draft_weights="stories260k@skip=4") is False  # another layer skipped: same shapes
    assert tokens(llm) == ref and llm.engine.stats.num_drafted_tokens > drafted


def test_a_handle_holding_nan_is_refused():
    """Weights given as a handle or loaded from a checkpoint are checked as a state dict's are: NaN serves garbage."""
    import jax.numpy as jnp

    from nightjar_jax.engine.runner import ModelHandle
    from nightjar_jax.testing import fake_model

    fake = fake_model(97)
    engine = LLMEngine(make_engine_config(model="fake", page_size=4, num_pages=16, compilation_cache_dir=None),
                       target=ModelHandle(fake.config, None, {"w": jnp.ones(8)}, fns=fake.fns))
    with pytest.raises(ValueError, match="NaN or infinite values"):
        engine.update_weights(ModelHandle(fake.config, None, {"w": jnp.full(8, jnp.nan)}, fns=fake.fns))
    (w,) = engine.target.leaves()
    assert bool(jnp.all(w == 1))


def test_a_request_running_through_an_update_caches_none_of_its_pages():
    """A request part-way through its prefill when the weights change goes on over K/V of the old weights: none of
    its pages may be cached, the ones it computes after the update included (they attend to the old ones). A QA run
    found a later prompt reading such pages through the prefix cache: its greedy tokens differed from the new
    weights' own."""
    llm = LLM("stories260k", max_model_len=128, num_pages=64, page_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine = llm.engine
    sd = {k: np.asarray(v) for k, v in load_checkpoint("stories260k").state_dict.items()}
    prompt = ("Once upon a time there was a little girl named Lily who liked to play in the park with her dog and "
              "her ball every day")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), request_id="through")
    for _ in range(3):
        engine.step()
    running = engine.scheduler.running[0]
    assert 0 < running.num_computed < len(running.prompt_token_ids)  # (part-way through its prefill)
    llm.update_weights(noisy(sd, 0.3))
    while engine.has_unfinished_requests():
        engine.step()
    first = llm.generate([prompt], params)[0]  # computes its prompt under the new weights, and caches it
    again = llm.generate([prompt], params)[0]  # reads the prefix cache
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].cumulative_logprob == pytest.approx(first.outputs[0].cumulative_logprob, abs=1e-4)
    engine.allocator.check()
    assert engine.num_free_pages == engine.num_total_pages
