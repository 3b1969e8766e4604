"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): an idle engine hands its device memory back (weights to host
memory or discarded, the KV cache discarded) and takes it again without recompiling; requests sent while it sleeps
are refused, nothing is lost, and outputs after a wake-up equal those before."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import EngineSleepingError, LLMEngine
from nightjar_jax.engine.llm import LLM
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.testing import fake_greedy_continuation, fake_model
from tests.engine.helpers import VOCAB, fake_engine, generate_outputs, greedy

PROMPTS = [[(5 * i + j) % VOCAB for j in range(5 + i)] for i in range(4)]


def device_total(engine) -> int:
    return sum(engine.runner.device_bytes().values())


def check_outputs(engine, n: int = 14) -> None:
    outs = generate_outputs(engine, PROMPTS, [greedy(n)] * len(PROMPTS))
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == fake_greedy_continuation(p, n, VOCAB)


def with_weights(handle: ModelHandle, state: dict) -> ModelHandle:
    """The fake model ``handle`` carrying ``state`` as its weights (the fake's logits ignore them)."""
    return ModelHandle(handle.config, None, state, fns=handle.fns)


def test_level_1_frees_every_device_byte_and_wakes_without_recompiling():
    target = with_weights(fake_model(VOCAB), {"w": jnp.arange(4096, dtype=jnp.float32)})
    draft = with_weights(fake_model(VOCAB, perturb=5), {"d": jnp.ones(2048, jnp.float32)})
    engine = LLMEngine(make_engine_config(model="fake", page_size=4, num_pages=64, max_num_seqs=4,
                                          max_num_batched_tokens=16, compilation_cache_dir=None, planner="static",
                                          num_speculative_tokens=3),
                       target=target, draft=draft)
    check_outputs(engine)
    before = engine.runner.device_bytes()
    assert before["target_weights"] == 4096 * 4 and before["draft_weights"] == 2048 * 4
    compiled = engine.runner.num_compiled()

    freed = engine.sleep(1)
    assert freed == sum(before.values())
    assert device_total(engine) == 0 and engine.is_sleeping and engine.sleep_level == 1
    # the weights wait in host memory
    host = {x.sharding.memory_kind for x in (*engine.target.leaves(), *engine.draft.leaves())}
    assert host <= {"pinned_host", "unpinned_host"}

    with pytest.raises(EngineSleepingError, match="wake_up"):
        engine.add_request(PROMPTS[0], greedy(4))
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.num_free_pages == 0  # (no pool while the KV cache sleeps, as the metrics' gauge says)
    with pytest.raises(EngineSleepingError):
        engine.warmup()

    engine.wake_up()
    assert not engine.is_sleeping and engine.sleep_level == 0
    assert engine.runner.device_bytes() == before
    assert engine.num_free_pages == engine.num_total_pages
    check_outputs(engine)
    assert engine.stats.num_drafted_tokens > 0  # (it speculated after the wake-up too)
    assert engine.runner.num_compiled() == compiled  # the same variants: shapes, dtypes and shardings came back
    assert engine.stats.num_sleeps == 1


def test_sleep_is_refused_while_requests_are_unfinished_and_nothing_is_released():
    engine = fake_engine(draft=True, num_speculative_tokens=2)
    ids = [engine.add_request(p, greedy(10)) for p in PROMPTS]
    engine.step()
    before = engine.runner.device_bytes()
    with pytest.raises(RuntimeError, match="4 request\\(s\\) are unfinished"):
        engine.sleep(1)
    assert not engine.is_sleeping and engine.runner.device_bytes() == before
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    for rid, p in zip(ids, PROMPTS, strict=True):
        assert done[rid] == fake_greedy_continuation(p, 10, VOCAB)
    engine.sleep(1)  # idle now
    assert engine.is_sleeping


@pytest.mark.parametrize("level", [0, 3, True, "1", None, 1.0])
def test_bad_levels_and_tags_are_errors(level):
    engine = fake_engine()
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2"):
        engine.sleep(level)
    assert not engine.is_sleeping
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep(1)
    with pytest.raises(ValueError, match="tags must be among \\['weights', 'kv_cache'\\]: got \\['kv'\\]"):
        engine.wake_up(["weights", "kv"])
    assert engine.is_sleeping  # (a bad tag wakes nothing)
    engine.wake_up()
    engine.wake_up()  # awake: a no-op
    check_outputs(engine)


def test_a_failed_sleep_releases_nothing(monkeypatch):
    """Moving the weights fails (host memory short, say): the draft already moved comes back, no pool is released,
    the engine is awake and serves."""
    engine = fake_engine(draft=True, num_speculative_tokens=2)
    before = engine.runner.device_bytes()

    def fail(memory_kind):
        raise RuntimeError("no host memory")

    monkeypatch.setattr(engine.runner, "_move_target", fail)
    with pytest.raises(RuntimeError, match="no host memory"):
        engine.sleep(1)
    assert not engine.is_sleeping and engine.runner.device_bytes() == before
    check_outputs(engine)


def test_weights_another_engine_serves_are_not_taken_from_it():
    """``LLM.from_engine`` over a loaded target: sleeping or updating one engine would pull the shared weights
    from under the other's steps, so both are refused while the other lives."""
    import gc

    engine = fake_engine()
    other = LLMEngine(make_engine_config(model="fake", page_size=4, num_pages=32, compilation_cache_dir=None),
                      target=engine.target)
    for action in (lambda: engine.sleep(1), lambda: engine.update_weights(engine.target)):
        with pytest.raises(RuntimeError, match="shared with another engine"):
            action()
    assert not engine.is_sleeping
    check_outputs(other)
    del other
    gc.collect()
    engine.sleep(1)  # (the other engine is gone)
    engine.wake_up("weights")  # (one tag as a string)
    engine.wake_up()
    check_outputs(engine)


def test_level_2_needs_weights_it_can_load_again():
    engine = fake_engine()
    with pytest.raises(ValueError, match="the target.s weights have none .*use level 1"):
        engine.sleep(2)
    assert not engine.is_sleeping
    check_outputs(engine)


def test_waking_one_part_at_a_time():
    engine = fake_engine(draft=True, num_speculative_tokens=2)
    before = engine.runner.device_bytes()
    engine.sleep(1)
    engine.wake_up(["weights"])
    assert engine.is_sleeping  # the KV cache still sleeps: requests are still refused
    with pytest.raises(EngineSleepingError, match="kv_cache released"):
        engine.add_request(PROMPTS[0], greedy(4))
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping and engine.runner.device_bytes() == before
    check_outputs(engine)


def test_a_draft_sharing_the_targets_weights_keeps_them_live():
    shared = jnp.arange(1024, dtype=jnp.float32)
    target = with_weights(fake_model(VOCAB), {"w": shared})
    draft = with_weights(fake_model(VOCAB, perturb=5), {"w": shared, "d": jnp.ones(256, jnp.float32)})
    engine = LLMEngine(make_engine_config(model="fake", page_size=4, num_pages=64, max_num_seqs=4,
                                          max_num_batched_tokens=16, compilation_cache_dir=None, planner="static",
                                          num_speculative_tokens=2),
                       target=target, draft=draft)
    engine.sleep(1)
    engine.wake_up()
    (t_w,) = engine.target.leaves()
    d_d, d_w = engine.draft.leaves()
    assert d_w is t_w and not t_w.is_deleted() and not d_d.is_deleted()
    assert jnp.array_equal(t_w, jnp.arange(1024, dtype=jnp.float32))
    assert {x.sharding.memory_kind for x in (t_w, d_d)} <= {None, "device"}
    check_outputs(engine)


def test_an_offloaded_draft_comes_back_before_the_sleep():
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         prompt_lookup_max=0)
    before = engine.runner.device_bytes()
    engine._offload_draft()  # (as the memory policy does under a burst; idle here)
    assert engine.draft_offloaded and engine.allocator.num_extension
    engine.sleep(1)
    assert device_total(engine) == 0 and engine.allocator.num_extension == 0
    engine.wake_up()
    assert not engine.draft_offloaded and engine.runner.device_bytes() == before
    check_outputs(engine)
    assert engine.stats.num_drafted_tokens > 0


def test_the_prefix_cache_does_not_survive_a_sleep():
    engine = fake_engine(enable_prefix_caching=True)
    check_outputs(engine)
    assert engine.allocator.num_cached_free > 0
    engine.sleep(1)
    engine.wake_up()
    assert engine.allocator.num_cached_free == 0  # (the pages came back zeroed: a stale hit would read zeros)
    check_outputs(engine)
    assert engine.scheduler.num_prefix_hits == 0


@pytest.fixture(scope="module")
def stories():
    return LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
               max_model_len=128, num_pages=32, max_num_seqs=2, max_num_batched_tokens=32)


@pytest.mark.parametrize("level", [1, 2])
def test_a_real_pair_generates_the_same_after_either_level(stories, level):
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["Once upon a time", "The little dog"]
    ref = [o.outputs[0].token_ids for o in stories.generate(prompts, sp)]
    engine = stories.engine
    before, compiled = engine.runner.device_bytes(), engine.runner.num_compiled()
    old_weights = engine.target.leaves()
    assert stories.sleep(level) == sum(before.values())
    assert stories.is_sleeping() and device_total(engine) == 0
    if level == 2:  # nothing kept anywhere: wake_up loads the checkpoints again
        assert all(x.is_deleted() for x in old_weights)
    with pytest.raises(EngineSleepingError):
        stories.generate(prompts, sp)
    stories.wake_up()
    assert engine.runner.device_bytes() == before
    assert [o.outputs[0].token_ids for o in stories.generate(prompts, sp)] == ref
    assert engine.runner.num_compiled() == compiled
    assert engine.num_free_pages == engine.num_total_pages


def test_a_sleep_an_update_and_a_drop_of_variants_hand_the_heap_back(monkeypatch):
    """On a CPU the bytes a sleep frees go back to the C allocator, not the system, until glibc's malloc_trim runs
    (``nightjar_jax/memory/host.py``: the default pair at level 2 held 2,412 MiB resident asleep, 624 MiB with it):
    the engine trims after a sleep, a weight update and a drop of compiled variants."""
    from nightjar_jax.memory import host

    calls = []
    monkeypatch.setattr(host, "trim", lambda: calls.append(1) or True)
    engine = fake_engine()
    check_outputs(engine)
    engine.sleep(1)
    assert len(calls) == 1
    engine.wake_up()
    engine.update_weights(engine.target)
    assert len(calls) == 2
    engine.runner.evict_compiled()
    assert len(calls) == 3
    check_outputs(engine)
    from nightjar_jax.engine import variants

    dropped, _ = engine.runner.evict_least_used(0.0, since=variants.tick())  # (every family ran before the tick)
    assert dropped > 0 and len(calls) == 4
    engine.runner.evict_least_used(0.0, since=0)  # (nothing ran before tick 0: nothing dropped, no trim)
    assert len(calls) == 4
