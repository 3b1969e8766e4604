"""Engine behaviour on the fake model of known logits: exact tokens under chunking, preemption, abort, bad input."""

from __future__ import annotations

import pytest
from helpers import VOCAB, fake_engine, greedy, run_all

from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.testing import fake_greedy_continuation

PROMPTS = [[5, 6, 7], list(range(1, 21)), [42], [3, 3], list(range(30, 43))]


def expected(prompt, n):
    return fake_greedy_continuation(prompt, n, VOCAB)


@pytest.mark.parametrize("budget", [64, 16, 5])
def test_chunked_prefill_gives_exact_tokens(budget):
    eng = fake_engine(max_num_batched_tokens=budget)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(12), request_id=str(i))
    done = run_all(eng)
    assert {k: v for k, v in done.items()} == {str(i): expected(p, 12) for i, p in enumerate(PROMPTS)}
    assert eng.num_free_pages == eng.num_total_pages


def first_token_order(eng) -> list[str]:
    """Step until idle; the request ids in the order their first tokens came."""
    order = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if len(out.outputs[0].token_ids) == 1 and out.outputs[0].delta_token_ids:
                order.append(out.request_id)
    return order


def test_admission_order_is_fcfs_with_slot_limit():
    eng = fake_engine(max_num_seqs=2)
    for i, p in enumerate(PROMPTS):
        if len(p) > 1:  # a 1-token prompt needs no prefill: its first token comes from a decode step
            eng.add_request(p, greedy(4), request_id=str(i))
    assert first_token_order(eng) == ["0", "1", "3", "4"]


def test_preemption_and_resume_give_the_same_tokens():
    # 12 usable pages of 4 tokens for 5 requests growing to ~40 tokens each forces preemptions.
    eng = fake_engine(num_pages=13, max_num_seqs=5)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(24), request_id=str(i))
    done = run_all(eng)
    assert eng.stats.num_preemptions > 0
    assert done == {str(i): expected(p, 24) for i, p in enumerate(PROMPTS)}
    assert eng.num_free_pages == eng.num_total_pages


def test_priority_scheduling_orders_admission_and_keeps_tokens_through_preemptions():
    """scheduling_policy "priority" (vLLM's): the most urgent request (lowest value) is admitted first, equal ones in
    arrival order; under page pressure, with speculation, the preemptions fall on the least urgent and every output
    is the one a lone run gives. An fcfs engine refuses a non-zero priority, alone."""
    eng = fake_engine(max_num_seqs=2, scheduling_policy="priority")
    prompts = [p for p in PROMPTS if len(p) > 1]
    for i, (p, prio) in enumerate(zip(prompts, [3, 1, 3, 0], strict=True)):
        eng.add_request(p, greedy(4), request_id=str(i), priority=prio)
    assert first_token_order(eng) == ["3", "1", "0", "2"]

    eng = fake_engine(num_pages=13, max_num_seqs=5, scheduling_policy="priority", draft=True,
                      num_speculative_tokens=2)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(24), request_id=str(i), priority=-i)  # the last added is the most urgent
    done = run_all(eng)
    assert eng.stats.num_preemptions > 0
    assert done == {str(i): expected(p, 24) for i, p in enumerate(PROMPTS)}
    assert eng.num_free_pages == eng.num_total_pages

    fcfs = fake_engine()
    for bad, match in [(1, "needs scheduling_policy='priority'"), (True, "must be an integer"),
                       (1.5, "must be an integer")]:
        with pytest.raises(ValueError, match=match) as err:
            fcfs.add_request([5, 6], greedy(2), priority=bad)
        assert err.value.field == "priority"
    assert not fcfs.has_unfinished_requests()
    fcfs.add_request([5, 6], greedy(2), priority=0)
    assert run_all(fcfs) and fcfs.num_free_pages == fcfs.num_total_pages


def test_abort_frees_pages_at_once_and_others_continue():
    eng = fake_engine()
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(p, greedy(20), request_id=str(i))
    for _ in range(4):
        eng.step()
    used_before = eng.num_total_pages - eng.num_free_pages
    out = eng.abort_request("1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.num_total_pages - eng.num_free_pages < used_before
    done = run_all(eng)
    assert done == {"0": expected(PROMPTS[0], 20), "2": expected(PROMPTS[2], 20)}
    assert eng.num_free_pages == eng.num_total_pages
    assert eng.abort_request("1") is None  # already gone: no error


def test_stop_conditions_eos_stop_ids_max_tokens_and_context_limit():
    cont = expected(PROMPTS[0], 10)
    eng = fake_engine(eos=cont[3])
    eng.add_request(PROMPTS[0], greedy(10), request_id="eos")
    eng.add_request(PROMPTS[0], greedy(10, ignore_eos=True), request_id="ignore")
    eng.add_request(PROMPTS[0], greedy(10, stop_token_ids=[cont[1]]), request_id="stopid")
    done = run_all(eng)
    assert done["eos"] == cont[:4] and done["stopid"] == cont[:2] and done["ignore"] == cont
    eng = fake_engine(max_model_len=10)
    eng.add_request(PROMPTS[0], greedy(100), request_id="ctx")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 7


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], greedy(4), "empty"),
        ([1, VOCAB + 5], greedy(4), r"\[0, 97\)"),
        ([1] * 300, greedy(4), "context limit"),
        ("text", greedy(4), "no tokenizer"),
        (3.5, greedy(4), "must be a string"),
        ([True, False], greedy(4), r"integers in \[0, 97\): got \[True, False\]"),  # (bools are not ids)
        ({"prompt_token_ids": None}, greedy(4), "'prompt_token_ids' must be a list of token ids, got NoneType"),
        ({"prompt_token_ids": 5}, greedy(4), "must be a list of token ids, got int"),
    ],
)
def test_bad_requests_are_rejected_alone(prompt, params, match):
    eng = fake_engine(max_model_len=256)
    eng.add_request(PROMPTS[0], greedy(5), request_id="good")
    with pytest.raises(ValueError, match=match) as info:
        eng.add_request(prompt, params)
    assert info.value.field == "prompt"  # (a server answers with the parameter at fault)
    assert run_all(eng) == {"good": expected(PROMPTS[0], 5)}
    assert eng.num_free_pages == eng.num_total_pages


def test_ids_given_by_the_engine_skip_ids_callers_chose():
    eng = fake_engine()
    eng.add_request(PROMPTS[0], greedy(2), request_id="1")
    given = [eng.add_request(PROMPTS[0], greedy(2)) for _ in range(3)]
    assert "1" not in given and len(set(given)) == 3
    assert set(run_all(eng)) == {"1", *given}


def test_add_request_with_n_runs_n_sequences_under_one_id():
    """vLLM's ``LLMEngine.add_request`` with ``n > 1``: sequences ``"{i}_{id}"`` (seeds ``seed + i``, as
    ``LLM.generate`` gives them), each output under the parent's id with its ``index``, ``finished`` with the last
    sequence; aborting the parent aborts them all, its pages back at once. It was an error."""
    from nightjar_jax.engine.llm import LLM
    from nightjar_jax.engine.sampling_params import SamplingParams

    eng = fake_engine(draft=True, num_speculative_tokens=2)
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)
    assert eng.add_request(PROMPTS[0], sampled, request_id="p") == "p"
    assert sorted(eng.requests) == ["0_p", "1_p", "2_p"]
    finals, flags = {}, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == "p" and len(out.outputs) == 1
            flags.append(out.finished)
            if out.outputs[0].finished():
                finals[out.outputs[0].index] = out.outputs[0].token_ids
    assert flags[-1] and not any(flags[:-1]) and sorted(finals) == [0, 1, 2]
    (whole,) = LLM.from_engine(eng).generate([PROMPTS[0]], sampled, use_tqdm=False)
    assert {c.index: c.token_ids for c in whole.outputs} == finals
    eng.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=40), request_id="q")
    eng.step()
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(PROMPTS[0], greedy(2), request_id="q")  # (the parent's id is taken too)
    with pytest.raises(ValueError, match="'1_r', one of the n=2 sequences of 'r', is already in use"):
        eng.add_request(PROMPTS[1], greedy(2), request_id="1_r") and eng.add_request(
            PROMPTS[0], SamplingParams(n=2, max_tokens=2), request_id="r")
    last = eng.abort_request("q")
    assert last.request_id == "q" and last.finished and last.outputs[0].finish_reason == "abort"
    assert set(eng.requests) == {"1_r"}
    with pytest.raises(ValueError, match="max_tokens"):  # (a bad request: nothing of it queued)
        eng.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=0))
    run_all(eng)
    assert not eng.requests and eng.num_free_pages == eng.num_total_pages


def test_output_kind_says_what_each_step_returns():
    """vLLM's ``SamplingParams.output_kind``: CUMULATIVE (everything so far, each step), DELTA (the step's tokens and
    text; joined, the whole), FINAL_ONLY (one output, at the end; n > 1: every sequence in it); ``LLM.generate``
    returns whole outputs whatever the kind."""
    from nightjar_jax import RequestOutputKind
    from nightjar_jax.engine.llm import LLM
    from nightjar_jax.engine.sampling_params import SamplingParams

    eng = fake_engine(draft=True, num_speculative_tokens=2)
    want = expected(PROMPTS[0], 10)
    seen: dict[str, list] = {"c": [], "d": [], "f": [], "n": []}
    for rid, kind, n in (("c", RequestOutputKind.CUMULATIVE, 1), ("d", RequestOutputKind.DELTA, 1),
                         ("f", RequestOutputKind.FINAL_ONLY, 1), ("n", RequestOutputKind.FINAL_ONLY, 3)):
        eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, n=n, output_kind=kind),
                        request_id=rid)
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["c"]) > 2 and seen["c"][-1].outputs[0].token_ids == want
    assert [t for o in seen["d"] for t in o.outputs[0].token_ids] == want and len(seen["d"]) == len(seen["c"])
    assert all(o.outputs[0].token_ids == o.outputs[0].delta_token_ids for o in seen["d"])
    assert len(seen["f"]) == 1 and seen["f"][0].finished and seen["f"][0].outputs[0].token_ids == want
    assert seen["f"][0].outputs[0].delta_token_ids == want  # (its one output: everything is new)
    (whole,) = seen["n"]
    assert whole.finished and [c.index for c in whole.outputs] == [0, 1, 2]
    assert all(c.token_ids == want for c in whole.outputs) and not eng._parent_finals
    (delta_gen,) = LLM.from_engine(eng).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, output_kind=RequestOutputKind.DELTA),
        use_tqdm=False)
    assert delta_gen.outputs[0].token_ids == want
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1,
                                               output_kind=RequestOutputKind.DELTA), request_id="p")
    with_prompt = []
    while eng.has_unfinished_requests():
        with_prompt += [o.prompt_logprobs is not None for o in eng.step()]
    assert with_prompt.count(True) == 1 and with_prompt[0]  # (DELTA: the prompt's log-probabilities once, first)
    for bad in (3, "delta", True):
        with pytest.raises(ValueError, match="output_kind=.* is invalid: allowed a RequestOutputKind"):
            SamplingParams(output_kind=bad)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert eng.num_free_pages == eng.num_total_pages


def test_stop_reason_is_the_stop_token_asked_for_and_none_at_eos():
    """vLLM's ``stop_reason``: the id of a ``stop_token_ids`` token that ended the request, None when the
    end-of-sequence token did (it was the EOS id: code telling a natural end from a stop token by ``is None`` erred);
    an EOS also listed in stop_token_ids is named."""
    cont = expected(PROMPTS[0], 10)
    eng = fake_engine(eos=cont[3])
    for rid, params in (("eos", greedy(10)), ("stopid", greedy(10, stop_token_ids=[cont[1]])),
                        ("eos-named", greedy(10, stop_token_ids=[cont[3]]))):
        eng.add_request(PROMPTS[0], params, request_id=rid)
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
    assert {rid: (c.finish_reason, c.stop_reason) for rid, c in finals.items()} == {
        "eos": ("stop", None), "stopid": ("stop", cont[1]), "eos-named": ("stop", cont[3])}


def test_a_request_id_is_a_non_empty_string():
    """vLLM's ids are strings: an int id came back as an int in the outputs, an empty one named nothing. Both are an
    error naming request_id; a duplicate of one in flight too."""
    eng = fake_engine()
    eng.add_request(PROMPTS[0], greedy(2), request_id="a")
    for bad, match in ((5, "non-empty string"), ("", "non-empty string"), ("a", "already in use")):
        with pytest.raises(ValueError, match=match) as info:
            eng.add_request(PROMPTS[0], greedy(2), request_id=bad)
        assert info.value.field == "request_id"
    assert run_all(eng) == {"a": expected(PROMPTS[0], 2)}


def test_a_pool_larger_than_free_memory_is_a_config_error():
    """num_pages / kv_cache_bytes past the memory the device has free: a ConfigError naming both sizes, before any
    allocation (the process was killed for memory, or the page allocator raised MemoryError)."""
    import jax

    from nightjar_jax.config import ConfigError
    from nightjar_jax.engine.engine import available_memory_bytes

    assert available_memory_bytes(jax.devices()[0]) > 0
    with pytest.raises(ConfigError, match=r"num_pages=99999999999: .* GiB\) is more than the .* GiB of memory"):
        fake_engine(num_pages=99_999_999_999)


def test_gpu_memory_utilization_sizes_the_pool_on_accelerators(monkeypatch):
    """vLLM's gpu_memory_utilization: on an accelerator the KV pool gets that share of the allocator's limit less
    what it holds (the weights); too little is a ConfigError; the CPU backend keeps kv_cache_bytes (as vLLM's CPU
    backend). vLLM's trust_remote_code is accepted and tensor_parallel_size takes 1 only."""
    from types import SimpleNamespace

    from nightjar_jax.config import ConfigError, make_engine_config
    from nightjar_jax.engine import engine as engine_module

    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 1000, "bytes_in_use": 300})
    assert engine_module.memory_budget_bytes(gpu, 0.9) == 600
    assert engine_module.memory_budget_bytes(SimpleNamespace(platform="cpu"), 0.9) is None
    by_bytes = fake_engine(num_pages=None, kv_cache_bytes=1 << 20).num_total_pages
    assert fake_engine(num_pages=None, kv_cache_bytes=1 << 20, gpu_memory_utilization=0.5).num_total_pages == by_bytes
    monkeypatch.setattr(engine_module, "memory_budget_bytes", lambda device, util: 1 << 18)  # (as on a GPU)
    assert fake_engine(num_pages=None, kv_cache_bytes=1 << 20, gpu_memory_utilization=0.5).num_total_pages == \
        by_bytes // 4
    monkeypatch.setattr(engine_module, "memory_budget_bytes", lambda device, util: -5)
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.5 leaves 0.00 GiB"):
        fake_engine(num_pages=None, gpu_memory_utilization=0.5)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            make_engine_config(gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is invalid: allowed 1"):
        make_engine_config(tensor_parallel_size=2)
    assert make_engine_config(trust_remote_code=True, tensor_parallel_size=1).trust_remote_code


def test_prompt_larger_than_pool_is_rejected():
    eng = fake_engine(num_pages=4, max_model_len=256)  # 3 usable pages = 12 tokens
    with pytest.raises(ValueError, match="whole KV pool"):
        eng.add_request(list(range(1, 20)), greedy(2))


def test_a_max_model_len_the_pool_cannot_hold_is_a_warning(caplog, monkeypatch):
    """An explicit max_model_len over what the pool holds is capped with a warning (vLLM refuses to start); it was an
    info line, unseen at the default log level. So is a pool size asked for (num_pages, kv_cache_bytes): a tiny
    --kv-cache-bytes capped the context at info level. The model's own context over the default pool stays an info
    line (the default kv_cache_bytes stood in for here: the fake model's 256 tokens fit the real default)."""
    from types import SimpleNamespace

    import nightjar_jax.engine.engine as engine_module

    with caplog.at_level("INFO", logger="nightjar_jax.engine.engine"):
        assert fake_engine(num_pages=4, max_model_len=256).max_model_len == 12
        assert fake_engine(num_pages=4).max_model_len == 12
        assert fake_engine(num_pages=None, kv_cache_bytes=1024).max_model_len < 256
        monkeypatch.setattr(engine_module, "CacheConfig", lambda: SimpleNamespace(kv_cache_bytes=1024))
        assert fake_engine(num_pages=None, kv_cache_bytes=1024).max_model_len < 256
    levels = [r.levelname for r in caplog.records if "fewer than max_model_len" in r.getMessage()]
    assert levels == ["WARNING", "WARNING", "WARNING", "INFO"]


@pytest.mark.parametrize("draft", [False, True], ids=["ar", "spec"])
def test_a_request_that_fills_the_pool_ends_with_length(draft):
    """A pool smaller than max_model_len caps the context at what the pool holds: a request growing past it used to
    be preempted and then never admitted again (the engine stepped forever); it now ends with "length" there."""
    eng = fake_engine(draft=draft, num_pages=4, max_model_len=256, num_speculative_tokens=3)  # 3 pages = 12 tokens
    assert eng.max_model_len == 12
    prompt = [3, 1, 4, 1, 5]
    eng.add_request(prompt, greedy(30), request_id="long")
    eng.add_request([2, 7], greedy(2), request_id="short")
    done = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert not eng.has_unfinished_requests()
    assert done["long"].finish_reason == "length" and done["long"].token_ids == expected(prompt, 12 - len(prompt))
    assert done["short"].token_ids == expected([2, 7], 2)
    assert eng.num_free_pages == eng.num_total_pages


def test_bad_sampling_values_raise_with_field_names():
    from nightjar_jax.engine.sampling_params import SamplingParams

    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"), ({"min_p": 1.5}, "min_p"),
                          ({"n": 0}, "n"), ({"n": True}, "n"), ({"max_tokens": True}, "max_tokens"),
                          ({"top_k": True}, "top_k"), ({"seed": False}, "seed"), ({"stop": 5}, "stop"),
                          ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
                          ({"ignore_eos": "no"}, "ignore_eos"), ({"skip_special_tokens": 0}, "skip_special_tokens"),
                          ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
                          # (1e-308 is 0 in float32: logits / 0 were inf and NaN; 100,000 stop strings took every
                          # step seconds of host time, for every request in the batch)
                          ({"repetition_penalty": 1e-308}, "repetition_penalty"), ({"stop": ["q"] * 1025}, "stop")]:
        with pytest.raises(ValueError, match=field) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field
    with pytest.raises(ValueError, match=r"logit_bias=\{0: 1000, 1: 1000, .* \.\.\. is invalid") as info:
        SamplingParams(logit_bias={i: 1000 for i in range(2000)})  # (the message quotes the start of what was sent)
    assert len(str(info.value)) < 250


def test_sampling_params_clone_is_a_deep_copy():
    """vLLM's ``SamplingParams.clone()``: equal, and changing the copy's lists or dicts leaves the original alone."""
    from nightjar_jax.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, structured_outputs={"choice": ["a", "b"]})
    copy = sp.clone()
    assert copy == sp and copy is not sp
    copy.stop.append("y")
    copy.logit_bias[4] = 2.0
    assert sp.stop == ["x"] and sp.logit_bias == {3: 1.0} and copy.structured_outputs is not sp.structured_outputs


def test_reset_stats_counts_from_zero_the_prefix_cache_figures_too():
    """The server's warm-up request was left in the prefix-cache queries (the stats were reset, the scheduler's
    counters they copy each step were not): 6 queries for one 5-token prompt (QA, 2026-12-07)."""
    eng = fake_engine()
    eng.add_request(PROMPTS[1], greedy(2), request_id="warm")
    run_all(eng)
    assert eng.stats.num_prefix_cache_queries == len(PROMPTS[1])
    eng.reset_stats()
    assert eng.stats.num_prefix_cache_queries == 0 and eng.stats.num_decode_steps == 0
    eng.add_request(PROMPTS[0], greedy(2), request_id="a")
    run_all(eng)
    assert eng.stats.num_prefix_cache_queries == len(PROMPTS[0]) and eng.stats.num_prefix_cache_hits == 0


def test_completion_output_finished_is_a_method_as_vllms():
    """vLLM's ``CompletionOutput.finished()`` is a method (``RequestOutput.finished`` an attribute): code written for it
    called a bool here (QA, 2026-12-07)."""
    eng = fake_engine()
    eng.add_request(PROMPTS[0], greedy(2), request_id="a")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.outputs[0].finished() for o in outs] == [False, True] and [o.finished for o in outs] == [False, True]


def test_a_queued_request_keeps_its_params_when_the_caller_changes_them():
    """add_request keeps a checked copy (vLLM copies too): one SamplingParams changed and added again between
    requests leaves the first request as it was asked, and a value set after construction is checked at add."""
    from nightjar_jax.engine.sampling_params import InvalidRequestError

    eng = fake_engine()
    sp = greedy(12, stop_token_ids=[])
    eng.add_request(PROMPTS[0], sp, request_id="a")
    sp.max_tokens = 3
    sp.stop_token_ids.append(expected(PROMPTS[0], 12)[1])
    eng.add_request(PROMPTS[0], sp, request_id="b")
    sp.top_k = "x"
    with pytest.raises(InvalidRequestError, match="top_k='x' is invalid") as info:
        eng.add_request(PROMPTS[1], sp, request_id="c")
    assert info.value.field == "top_k"
    assert run_all(eng) == {"a": expected(PROMPTS[0], 12), "b": expected(PROMPTS[0], 2)}
    assert eng.num_free_pages == eng.num_total_pages


def test_generate_checks_n_set_after_construction_and_priority_shape():
    """LLM.generate read ``sp.n`` before any check: ``sp.n = 0`` returned [None, None] and 2.5 a TypeError naming
    nothing (QA 2026-12-07); ``priority=0`` was "'int' object is not iterable"."""
    from nightjar_jax import LLM
    from nightjar_jax.engine.sampling_params import InvalidRequestError, RequestOutputKind

    eng = fake_engine()
    llm = LLM.from_engine(eng)
    for bad in (0, -1, 2.5):
        sp = greedy(3, output_kind=RequestOutputKind.FINAL_ONLY)
        sp.n = bad
        with pytest.raises(InvalidRequestError, match="SamplingParams.n=") as info:
            llm.generate([PROMPTS[0], PROMPTS[1]], sp)
        assert info.value.field == "n"
    with pytest.raises(TypeError, match="priority must be None or a list of integers, one per prompt, got 0"):
        llm.generate([PROMPTS[0]], greedy(3), priority=0)
    for flag in ("add_generation_prompt", "continue_final_message"):  # ("no" was taken as true)
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
            llm.chat([{"role": "user", "content": "hi"}], **{flag: "no"})
    assert not eng.has_unfinished_requests() and eng.num_free_pages == eng.num_total_pages
    sp = greedy(3)
    sp.n = 2  # (a value set afterwards that is fine runs)
    out = llm.generate([PROMPTS[0]], sp)[0]
    assert [c.token_ids for c in out.outputs] == [expected(PROMPTS[0], 3)] * 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(planner=5), "planner"), (dict(draft_model=5), "draft_model"), (dict(tokenizer=5), "tokenizer"),
    (dict(compilation_cache_dir=5), "compilation_cache_dir"), (dict(tokenizer=""), "tokenizer"),
])
def test_option_types_are_config_errors_and_paths_are_taken(kwargs, field):
    """LLM(planner=5) / draft_model=5 / tokenizer=5 were AttributeErrors deep in the loaders ("'int' object has no
    attribute 'partition'"), compilation_cache_dir=5 a TypeError from os.makedirs (QA 2026-12-07); pathlib paths
    are taken as their text."""
    from pathlib import Path

    from nightjar_jax import LLM
    from nightjar_jax.config import ConfigError, make_engine_config

    with pytest.raises(ConfigError, match=f"^{field}=.* is invalid: allowed ") as info:
        LLM("stories260k", **kwargs)
    assert info.value.field == field
    config = make_engine_config(model=Path("/m"), tokenizer=Path("/t"), draft_model=Path("/d"),
                                compilation_cache_dir=Path("/c"), spec_tree_file=Path("/s.json"))
    assert (config.model, config.tokenizer, config.spec.draft_model, config.compilation_cache_dir,
            config.spec.spec_tree_file) == ("/m", "/t", "/d", "/c", "/s.json")
    assert make_engine_config(draft_model="").spec.draft_model == ""  # ("" is no draft, as 'none')
    with pytest.raises(FileNotFoundError, match="model path '/no/such/model' does not exist"):
        LLM(Path("/no/such/model"))  # (was "model=PosixPath(...) is invalid: allowed a preset name, ...")


def test_numpy_ids_and_numbers_are_taken_in_sampling_and_beam_params():
    """Token ids from NumPy (np.argsort, an ndarray) in stop_token_ids / allowed_token_ids / logit_bias, and NumPy
    beam widths: they were refused as "not non-negative integers" (QA 2026-12-07); NumPy floats as ids and bools
    still are."""
    import numpy as np

    from nightjar_jax.engine.beam_search import BeamSearchParams
    from nightjar_jax.engine.sampling_params import InvalidRequestError, SamplingParams

    sp = SamplingParams(stop_token_ids=np.array([2, 3]), allowed_token_ids=[np.int64(5), np.int32(6)],
                        logit_bias={np.int64(5): np.float32(1.5)})
    assert sp.stop_token_ids == [2, 3] and sp.allowed_token_ids == [5, 6] and sp.logit_bias == {5: 1.5}
    assert all(type(t) is int for t in [*sp.stop_token_ids, *sp.allowed_token_ids, *sp.logit_bias])
    assert SamplingParams(allowed_token_ids=np.arange(3)).allowed_token_ids == [0, 1, 2]
    bp = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(4), length_penalty=np.float32(0.5))
    assert (bp.beam_width, bp.max_tokens, bp.length_penalty) == (2, 4, 0.5) and type(bp.beam_width) is int
    for kwargs, field in [({"stop_token_ids": [np.float64(2.0)]}, "stop_token_ids"),
                          ({"allowed_token_ids": [np.bool_(True)]}, "allowed_token_ids"),
                          ({"logit_bias": {np.int64(-1): 1.0}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field
    # the engine takes them as ids: stop at the token the fake model writes second
    eng = fake_engine()
    second = expected(PROMPTS[0], 12)[1]
    eng.add_request(PROMPTS[0], greedy(12, stop_token_ids=np.array([second])), request_id="a")
    assert run_all(eng) == {"a": expected(PROMPTS[0], 2)}


def test_top_k_past_int32_samples_as_top_k_off():
    """top_k at or past the vocabulary keeps every token; 2**31 and more used to overflow the int32 sampling column
    and fail the whole batch's step."""
    from nightjar_jax.engine.sampling_params import SamplingParams

    eng = fake_engine(max_model_len=256)
    runs = {}
    for top_k in (0, VOCAB, 2**31, 2**40):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=11, max_tokens=8)
        eng.add_request(PROMPTS[1], params, request_id=f"k{top_k}")
        eng.add_request(PROMPTS[0], greedy(5), request_id=f"good{top_k}")
        runs.update(run_all(eng))
    assert runs["k0"] == runs[f"k{VOCAB}"] == runs[f"k{2**31}"] == runs[f"k{2**40}"]
    assert all(runs[f"good{k}"] == expected(PROMPTS[0], 5) for k in (0, VOCAB, 2**31, 2**40))
    assert eng.num_free_pages == eng.num_total_pages


def test_full_warmup_covers_prefill_chunks_and_the_draft_catch_up():
    """``LLMEngine.warmup()``: decode variants, prefill chunks (rows x chunk buckets up to 4x the token budget
    padded) and the draft's catch-up (every pair); then prompts of many lengths, arriving while others decode, at
    random γ (catch-ups after γ = 0 steps), compile nothing."""
    import random

    eng = fake_engine(draft=True, num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=16)
    runner = eng.runner
    assert runner.shapes.prefill_seq_buckets == [1, 2, 4] and runner.shapes.prefill_len_buckets == [8, 16]
    assert runner.warmup_prefill_shapes() == [(1, 8), (1, 16), (2, 8), (2, 16), (4, 8), (4, 16)]  # all <= 64
    assert runner.warmup_prefill_shapes(max_padded_tokens=32) == [(1, 8), (1, 16), (2, 8), (2, 16), (4, 8)]
    ticks = []
    keys = eng.warmup(sampled=False, progress=lambda: ticks.append(1))  # (greedy requests below)
    assert len(ticks) == eng.warmup_ticks(sampled=False)
    assert sum(k[0] == "forward_sample" and k[2] > 1 for k in keys) == 6  # chunks
    assert sum(k[0] == "draft_fill" for k in keys) == 6
    # in the order a load needs them: plain steps, the chunks every prompt runs, then the speculating steps (a
    # warm-up the memory maps stop leaves those to compile on first use, not every new prompt's prefill)
    kinds = ["plain" if k[0] == "forward_sample" and k[2] == 1 else "prefill" if k[0] in ("forward_sample",
             "draft_fill") else "spec" for k in keys]
    assert kinds == sorted(kinds, key=["plain", "prefill", "spec"].index) and kinds.count("spec") > 0, kinds
    assert eng.num_free_pages == eng.num_total_pages
    compiled = runner.num_compiled()
    rng = random.Random(1)
    eng._select_gamma = lambda: rng.randint(0, 2)
    prompts = [[(3 * i + j) % VOCAB for j in range(1 + 5 * i)] for i in range(8)]  # 1 .. 36 tokens
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, greedy(10), request_id=str(i))
    done = {}
    for step in range(10_000):
        if step == 3:
            for i, p in enumerate(prompts[3:], start=3):
                eng.add_request(p, greedy(10), request_id=str(i))
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        assert runner.num_compiled() == compiled, runner.compiled_cache_sizes()
    assert done == {str(i): expected(p, 10) for i, p in enumerate(prompts)}
    assert eng.stats.num_catchup_tokens > 0 and eng.num_free_pages == eng.num_total_pages


def test_compiles_stay_within_the_process_memory_maps(monkeypatch, caplog):
    """On the CPU backend every compiled variant maps ~250 memory regions and a compile past vm.max_map_count kills
    the process: a warm-up that finds 60% of them used stops with a warning that says how to fix it, and past 85% a
    step that compiled drops the least used compiled variants but the step's own (here every other one: the mocked
    usage never falls; the maps are freed, variants compile again on use, outputs unchanged), once while the
    process stays short after it (maps held elsewhere), again after it grows by 5%."""
    import logging

    import jax

    from nightjar_jax.engine import runner as runner_module

    real = runner_module.memory_map_usage()
    if jax.default_backend() != "cpu" or real is None:
        pytest.skip("memory maps are counted on the CPU backend, from Linux's /proc")
    assert 0 < real[0] < real[1]
    eng = fake_engine(draft=True, num_speculative_tokens=2, max_num_seqs=2)
    usage = {"used": 0}
    monkeypatch.setattr(runner_module, "memory_map_usage", lambda: (usage["used"], 100))
    assert eng.runner.maps_short(0.6) is None
    usage["used"] = 70
    with caplog.at_level(logging.WARNING):
        keys = eng.warmup()
    assert 0 < len(keys) < 10  # the first shape's variants, then it stopped
    assert "vm.max_map_count" in eng.runner.warmup_stopped and "sysctl -w vm.max_map_count" in caplog.text
    assert not any(k[0] == "draft_fill" for k in keys)  # prefill and the rest were not started
    eng.add_request([3, 4, 5], greedy(4), request_id="a")
    assert run_all(eng) == {"a": expected([3, 4, 5], 4)}  # 70%: compiles on first use, nothing dropped
    assert eng.stats.num_compile_evictions == 0 and eng.runner.num_compiled() > len(keys)
    usage["used"] = 86
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        eng.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11], greedy(6), request_id="b")
        assert run_all(eng) == {"b": expected([3, 4, 5, 6, 7, 8, 9, 10, 11], 6)}
    # one drop: the process stayed at 86% after it (the maps are held elsewhere), so the variants compiled since are
    # kept, with one warning (they were dropped after every step that compiled one: a 16-token stories260K generate
    # took ~2 s against 0.15 s)
    assert eng.stats.num_compile_evictions == 1 and caplog.text.count("the least used") == 1
    assert caplog.text.count("other engines or libraries in the process hold them") == 1
    assert eng.runner.num_compiled() > 2
    # the process grows by 5% of the limit more: this engine's variants may hold them, and it drops them again
    usage["used"] = 92
    with caplog.at_level(logging.WARNING):
        eng.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], greedy(3), request_id="c")
        assert run_all(eng) == {"c": expected([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 3)}
    assert eng.stats.num_compile_evictions == 2
    # past 95% of the limit it drops after every step that compiled, whatever holds the maps (a compile past the
    # limit kills the process: without the ceiling, 97% right after a drop never dropped again)
    usage["used"] = 97
    evicted = eng.stats.num_compile_evictions
    # (with log-probabilities: a variant none of the earlier steps compiled, where the kept ones compile nothing)
    eng.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
                    SamplingParams(temperature=0, max_tokens=3, logprobs=1), request_id="d")
    assert run_all(eng) == {"d": expected([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], 3)}
    assert eng.stats.num_compile_evictions > evicted
    assert eng.num_free_pages == eng.num_total_pages


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_warmup_compiles_every_decode_variant_so_decoding_compiles_nothing(impl):
    from nightjar_jax.attention import resolve_impl

    eng = fake_engine(draft=True, num_speculative_tokens=2, max_num_seqs=2, attention_impl=impl)
    runner = eng.runner
    keys = runner.warmup(max_context=16)
    if resolve_impl(impl) == "reference":
        widths = [4, 8]  # the reference gathers the whole table: power-of-two widths covering 16 + γ + 1 tokens
    else:
        widths = [runner.shapes.max_pages_per_seq]  # kernels read only up to the context: one full-width table
    assert runner.shapes.page_buckets[: len(widths)] == widths
    # batch sizes x widths x (greedy/sampled x (AR + propose/verify per γ) + greedy verifies of copied drafts per γ:
    # lookup's steps that skip the draft)
    assert len(keys) == len(runner.shapes.decode_buckets) * len(widths) * (2 * (1 + 2 * 2) + 2)
    assert eng.num_free_pages == eng.num_total_pages
    sizes = runner.compiled_cache_sizes()
    # decoding at any batch size / γ after warmup: prompts of one token skip prefill entirely
    import random

    rng = random.Random(0)
    eng._select_gamma = lambda: rng.randint(0, 2)
    for i in range(3):  # (3 requests on 2 slots: batches of 2 and 1)
        eng.add_request([7 + i], greedy(6), request_id=str(i))
    done = run_all(eng)
    assert done == {str(i): expected([7 + i], 6) for i in range(3)}
    after = runner.compiled_cache_sizes()
    assert after["forward_sample"] == sizes["forward_sample"]
    assert after["propose"] == sizes["propose"] and after["verify"] == sizes["verify"]


def test_unknown_planner_is_an_error_without_a_draft_too():
    """With no draft there is nothing to plan (every step is γ = 0), but a misspelt planner used to be ignored."""
    with pytest.raises(ValueError, match="unknown planner 'bogus'; known planners: .*nightjar"):
        fake_engine(planner="bogus")
    assert fake_engine(planner="nightjar").planner.name == "ar"
    for spec, message in [("static:x", "'static:K' with an int K"), ("static:-1", "'static:K' with an int K >= 0"),
                          ("nightjar:foo", "takes no ':' argument")]:  # (their arguments too: they were ignored)
        with pytest.raises(ValueError, match=message):
            fake_engine(planner=spec)
    # a fixed γ is checked against this γ_max, 0, as it is with a draft (static:5 passed; static:17 named 16)
    for spec in ("static:5", "static:17"):
        with pytest.raises(ValueError, match=rf"static gamma K={spec[7:]} exceeds gamma_max=0; use K in 0\.\.0 "
                                             r"\(γ_max is 0 here: no draft, or num_speculative_tokens=0\)"):
            fake_engine(planner=spec)
    assert fake_engine(planner="static:0").planner.name == "ar"
    assert fake_engine(planner="static").planner.name == "ar"


def test_arrival_time_is_on_vllms_clock():
    """``add_request(arrival_time=time.time())`` as vLLM takes it: latencies count from it (the metrics' own clock is
    time.monotonic(); mixing the two gave TTFTs of about -1.8e9 s). A bad value is that request's error."""
    import time

    from nightjar_jax.engine.sampling_params import InvalidRequestError

    engine = fake_engine()
    engine.add_request([1, 2, 3], greedy(2), request_id="late", arrival_time=time.time() - 5.0)
    engine.add_request([1, 2, 3], greedy(2), request_id="now")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.metrics
    assert 5.0 <= outs["late"].ttft < 60 and 5.0 <= outs["late"].e2e < 60
    assert 0 <= outs["now"].ttft < 5.0
    for bad in (float("nan"), "1.5", True, 10**400):
        with pytest.raises(InvalidRequestError, match="arrival_time"):
            engine.add_request([1, 2, 3], greedy(2), arrival_time=bad)
    import numpy as np

    engine.add_request([1, 2, 3], greedy(2), request_id="numpy", arrival_time=np.float32(time.time()))
    engine.add_request([1, 2, 3], greedy(2), request_id="future", arrival_time=time.time() + 30)  # (counts as now)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.metrics
    assert outs["future"].ttft >= 0 and outs["numpy"].ttft is not None
    assert not engine.has_unfinished_requests() and engine.num_free_pages == engine.num_total_pages


def test_a_compilation_cache_path_through_a_file_names_its_source(tmp_path, monkeypatch):
    """NIGHTJAR_JAX_CACHE (or compilation_cache_dir) at or under a file is a ConfigError naming where the path came
    from (it was "[Errno 17] File exists: ..."); nothing of JAX's configuration changes."""
    from nightjar_jax.config import ConfigError
    from nightjar_jax.engine.engine import setup_compilation_cache

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("NIGHTJAR_JAX_CACHE", str(blocker / "cache"))
    with pytest.raises(ConfigError, match=r"^NIGHTJAR_JAX_CACHE .*a-file/cache: cannot make the compilation cache"):
        setup_compilation_cache(None)
    with pytest.raises(ConfigError, match=r"^compilation_cache_dir .*a-file: cannot make .* it needs a directory"):
        setup_compilation_cache(str(blocker))
