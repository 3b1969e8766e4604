"""The engine on the real stories260K model: continuous batching equals running alone, steady-state steps do not
compile, speculative decoding with a derived draft equals AR, and the Pallas attention path (interpreted on CPU)
gives the reference's tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.models.llama import kv_values

PROMPTS = ["Once upon a time", "The cat sat on the mat and", "Lily had a red ball. One day", "Tom was sad because"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    return LLM("stories260k", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_pages=128)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def test_a_story_ends_at_bos(llm):
    """stories260K writes BOS (1) between stories, never EOS (2); llama2.c's run.c stops there. A completion ran on
    into the next story until max_tokens (QA: BOS generated at 251); it now ends there, finish reason "stop"."""
    assert set(llm.engine.target.config.eos_token_ids) == {1, 2}
    out = llm.generate(["Lily and Tom"], SamplingParams(temperature=0, max_tokens=240))[0].outputs[0]
    assert out.finish_reason == "stop" and 1 not in out.token_ids[:-1] and len(out.token_ids) < 240
    assert out.text.rstrip().endswith(".")


def test_golden_greedy_text(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    text = out.outputs[0].text
    assert text.startswith(", there was a little girl named Lily. She loved to play outside in the park.")


def test_a_stop_string_completed_under_min_tokens_does_not_stop(llm):
    """As in vLLM, stop strings are not checked under min_tokens, and later only one ending in the new text stops:
    "girl named Lily" ends with the 10th token, so with min_tokens 11 it does not stop the request (the text used
    to stop at the 11th token with the stop string's first letter in it), and with 10 it does."""
    def run(min_tokens):
        params = SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens, stop=["girl named Lily"])
        return llm.generate(["Once upon a time"], params)[0].outputs[0]

    stopped, past = run(10), run(11)
    assert (stopped.finish_reason, stopped.text) == ("stop", ", there was a little ")
    assert past.finish_reason == "length" and past.text.startswith(", there was a little girl named Lily. She")


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(llm):
    """As in vLLM, ``include_stop_str_in_output`` keeps the text of the stop token id that ended the request too
    (it was dropped whatever the flag)."""
    was = 286  # (" was": ", there was a little girl")
    def run(include):
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[was], include_stop_str_in_output=include)
        return llm.generate(["Once upon a time"], params)[0].outputs[0]

    kept, dropped = run(True), run(False)
    assert kept.token_ids == dropped.token_ids and kept.token_ids[-1] == was and kept.stop_reason == was
    assert (kept.text, dropped.text) == (", there was", ", there")


def test_stop_strings_cut_where_the_first_one_ends(llm):
    """Of two stop strings completed by the same token, the one that ends first wins: the text stops where it would
    if the tokens had come a character at a time (", there" comes as "," then " there": " " ends at 2, ", ther" at
    6; the one starting first used to win, cutting to ""). Either order of the list, with and without the stop."""
    for stop in ([" ", ", ther"], [", ther", " "]):
        for include, text in ((False, ","), (True, ", ")):
            params = SamplingParams(temperature=0, max_tokens=8, stop=stop, include_stop_str_in_output=include)
            out = llm.generate(["Once upon a time"], params)[0].outputs[0]
            assert (out.text, out.stop_reason, out.finish_reason) == (text, " ", "stop")
    # the same end: the longer (earlier) one wins
    params = SamplingParams(temperature=0, max_tokens=8, stop=["here", "there"])
    assert llm.generate(["Once upon a time"], params)[0].outputs[0].stop_reason == "there"


def test_bytes_that_never_complete_a_character_reach_the_text(llm):
    """Byte tokens that never complete a UTF-8 character were held back for good: the text was "" beside 5 tokens.
    At the output's end they read as a whole decode writes them (U+FFFD), streamed and not."""
    tok = llm.engine.tokenizer
    stray = tok.token_to_id("<0x80>")  # (a continuation byte alone: never a character)
    for allowed in ([stray], [tok.token_to_id("<0xE2>"), tok.token_to_id("<0x82>")]):
        params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=allowed)
        out = llm.generate(["Once upon a time"], params)[0]
        ids = out.outputs[0].token_ids
        assert len(ids) == 5
        full = tok.decode(out.prompt_token_ids + ids)
        assert out.outputs[0].text == full[len("Once upon a time"):] and "\ufffd" in out.outputs[0].text
    engine = llm.engine
    rid = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[stray]))
    deltas, final = [], None
    while final is None:
        for o in engine.step():
            if o.request_id == rid:
                deltas.append(o.outputs[0].delta_text)
                final = o if o.finished else None
    assert "".join(deltas) == final.outputs[0].text == "\ufffd" * 5


def test_completion_text_reads_as_it_does_after_the_prompt(llm):
    """The text of a completion is the full decode less the prompt's: a SentencePiece first token keeps its leading
    space (decoded alone, "▁upon" after "Once" would lose it)."""
    tok = llm.engine.tokenizer
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        full = tok.decode(out.prompt_token_ids + out.outputs[0].token_ids)
        assert full.startswith(prompt)
        assert out.outputs[0].text == full[len(prompt):]
    out = llm.generate([{"prompt_token_ids": [1, 403]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].text == " upon a time"  # "Once" + " upon a time"


def test_staggered_submission_equals_alone(llm, alone):
    engine = llm.engine
    ids, done = [], {}
    for step in range(10_000):
        if step % 3 == 0 and len(ids) < len(PROMPTS):  # a new request every third step
            ids.append(engine.add_request(PROMPTS[len(ids)], GREEDY, request_id=f"stag-{len(ids)}"))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if len(done) == len(PROMPTS):
            break
    assert [done[f"stag-{i}"] for i in range(len(PROMPTS))] == alone
    assert engine.num_free_pages == engine.num_total_pages


def test_steady_state_steps_do_not_compile(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1)
    # warm every variant these workloads use (in the reversed order the 32-token budget leaves a prompt one token
    # short, which a 2-row prefill finishes: a shape of its own)
    llm.generate(PROMPTS, [GREEDY, params, GREEDY, params])
    llm.generate(PROMPTS[::-1], [params, GREEDY, params, GREEDY])
    before = engine.runner.compiled_cache_sizes()
    outs = llm.generate(PROMPTS[::-1], [params, GREEDY, params, GREEDY])
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert engine.runner.compiled_cache_sizes() == before


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    a = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS, sp)[0].outputs[0].token_ids
    assert a == b


def test_vllm_sampling_fields_detokenize_best_of_spaces(llm):
    """vLLM's ``detokenize=False``: the same tokens, no text, log-probabilities without decoded tokens; stop strings
    need the text. ``best_of`` (None or n) and ``spaces_between_special_tokens`` (True) are taken at the values
    served; others are errors naming the field (each was a TypeError: an unexpected keyword)."""
    import pytest

    with_text = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=1))[0].outputs[0]
    ids_only = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                                                         detokenize=False))[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == "" and with_text.text
    assert all(lp.decoded_token is None for entry in ids_only.logprobs for lp in entry.values())
    assert SamplingParams(n=2, best_of=2, temperature=1.0).best_of == 2
    for kwargs, field in (({"stop": ["x"], "detokenize": False}, "stop"), ({"best_of": 3}, "best_of"),
                          ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}=") as info:
            SamplingParams(**kwargs)
        assert info.value.field == field


def test_generate_numbers_its_outputs_across_calls(llm):
    """``RequestOutput.request_id`` from LLM.generate counts on across calls ("0", "1", then "2", ...), as vLLM's
    request counter: each call started again at "0", so two calls' results shared ids."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = [int(o.request_id) for o in llm.generate(PROMPTS[:2], sp)]
    second = [int(o.request_id) for o in llm.generate(PROMPTS[:2], sp)]
    assert first[1] == first[0] + 1 and second == [first[1] + 1, first[1] + 2]


def test_seeds_past_two_to_the_32_are_their_own(llm):
    """Seeds 5 and 5 + 2**32 sample different tokens in the engine (it took seeds mod 2**32: the same 30 tokens),
    and each is reproducible."""
    def run(seed):
        sp = SamplingParams(temperature=1.0, max_tokens=30, seed=seed)
        return llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids

    low, high = run(5), run(5 + 2**32)
    assert low != high and high == run(5 + 2**32)


def test_first_scheduled_time_precedes_the_first_token(llm):
    """``RequestMetrics``: arrival <= first scheduled <= first token, for a one-token prompt too (whose first step
    is a decode step: its first_scheduled_time was None)."""
    for prompt in ([1], PROMPTS[1]):
        m = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_n_completions(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    top = llm.generate([PROMPTS[0]], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2**63 - 1))[0]
    wrapped = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=8, seed=0))[0]
    assert top.outputs[1].token_ids == wrapped.outputs[0].token_ids  # seed + 1 wraps to 0 (it used to raise)
    # best_of = n (as ported vLLM code writes it) runs: it raised, each sequence's params having n=1 beside best_of
    ranked = llm.generate([PROMPTS[0]], SamplingParams(n=3, best_of=3, temperature=1.0, max_tokens=8, seed=7))[0]
    assert [c.token_ids for c in ranked.outputs] == [c.token_ids for c in out.outputs]


def test_use_tqdm_takes_a_bar_factory_and_counts_prompts(llm):
    """vLLM's ``use_tqdm`` may be a callable that makes the bar (it was taken as True: the default bar); the bar
    counts prompts, not their n sequences."""
    made = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed = kwargs, 0, False
            made.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    llm.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1), use_tqdm=Bar)
    (bar,) = made
    assert bar.kwargs["total"] == 2 and bar.n == 2 and bar.closed


def test_a_failed_or_interrupted_generate_leaves_no_request_behind(llm, monkeypatch):
    engine = llm.engine
    real_step, calls = engine.step, {"n": 0}

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    assert not engine.has_unfinished_requests() and engine.num_free_pages == engine.num_total_pages
    monkeypatch.setattr(engine, "step", real_step)
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].finish_reason == "length"


def test_speculative_decoding_with_layer_skip_draft_equals_ar(llm, alone):
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
             max_model_len=256, max_num_seqs=4, num_pages=128)
    outs = sd.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    stats = sd.engine.stats
    assert stats.num_drafted_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_drafted_tokens
    # log-probabilities: a verify pass reads the target's logits at each committed position, as plain decoding does
    with_lp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    spec = [o.outputs[0] for o in sd.generate(PROMPTS, with_lp)]
    plain = [o.outputs[0] for o in llm.generate(PROMPTS, with_lp)]
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        for tok, x, y in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert list(x) == list(y) and x[tok].rank == 1  # greedy: the same ids, the token the top-1
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3) and a.cumulative_logprob < 0


def test_prompt_logprobs_score_a_prompt_as_its_generation_did(llm):
    """A prompt that continues with its own greedy generation scores those tokens, in one prefill pass, as the
    decode steps that generated them did (as lm-evaluation-harness's loglikelihood reads them)."""
    gen = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, logprobs=1))[0]
    prompt = gen.prompt_token_ids + gen.outputs[0].token_ids
    scored = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    plp = scored.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and scored.outputs[0].logprobs is None
    n = len(gen.prompt_token_ids)
    for j, (tok, want) in enumerate(zip(gen.outputs[0].token_ids, gen.outputs[0].logprobs, strict=True)):
        entry = plp[n + j]
        assert next(iter(entry)) == tok and entry[tok].rank == 1 and len(entry) == 3
        assert entry[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)
        assert entry[tok].decoded_token == want[tok].decoded_token


def test_chat_renders_conversations_with_the_template(llm):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    chat = [{"role": "user", "content": "Tell me a story."}]
    sp = SamplingParams(temperature=0, max_tokens=8)
    one = llm.chat(chat, sp, chat_template=template)
    assert len(one) == 1 and one[0].prompt == "user: Tell me a story.\nassistant:"
    assert one[0].outputs[0].token_ids == llm.generate([one[0].prompt], sp)[0].outputs[0].token_ids
    two = llm.chat([chat, chat + [{"role": "assistant", "content": "Once"}]], sp, chat_template=template)
    assert [o.outputs[0].token_ids for o in two][0] == one[0].outputs[0].token_ids and len(two) == 2
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(chat, sp)  # stories260k has none of its own
    with pytest.raises(ValueError, match="a 'content' that is a string or a list of text parts"):
        llm.chat([{"role": "user"}], sp, chat_template=template)
    # OpenAI's content parts, as the server takes them: joined with newlines, as vLLM joins them
    (parts,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                                      {"type": "text", "text": "a story."}]}], sp,
                        chat_template=template)
    assert parts.prompt == one[0].prompt.replace("Tell me a story.", "Tell me\na story.")
    # a template that does not parse or render is a ValueError saying so (jinja's own types leaked)
    with pytest.raises(ValueError, match="the chat template does not parse"):
        llm.chat(chat, sp, chat_template="{% for %}")
    with pytest.raises(ValueError, match="could not render these messages: 'foo' is undefined"):
        llm.chat(chat, sp, chat_template="{{ foo.bar }}")
    with pytest.raises(ValueError, match="template kwargs must be a dict"):
        llm.chat(chat, sp, chat_template=template, chat_template_kwargs=5)
    # parameters and prompts of the wrong type
    for bad in ({"temperature": 0}, [{"temperature": 0}], 0.5):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
            llm.generate(["Once"], bad)
    with pytest.raises(TypeError, match="prompts must be a prompt"):
        llm.generate(None, sp)
    with pytest.raises(ValueError, match="model=None is invalid"):
        LLM(None)
    with pytest.raises(ValueError, match="at least one conversation"):
        llm.chat([], sp, chat_template=template)
    # tools reach the template; an assistant turn with tool calls may have no content (OpenAI's form)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = "{% for t in tools %}tool {{ t['function']['name'] }}\n{% endfor %}" + template
    called = [*chat, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    (out,) = llm.chat(called, sp, chat_template=with_tools, tools=tools)
    assert out.prompt == "tool get_weather\nuser: Tell me a story.\nassistant: \nassistant:"
    # the call's arguments reach the template as an object (vLLM's LLM.chat), not the API's JSON string
    args_template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}" \
                    "{% endfor %}{% endfor %}"
    called[-1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert llm.chat(called, SamplingParams(max_tokens=1), chat_template=args_template)[0].prompt == \
        '{"city": "Paris"}'
    (cont,) = llm.chat([*chat, {"role": "assistant", "content": "Once"}], sp, chat_template=template,
                       add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt == "user: Tell me a story.\nassistant: Once"
    kwargs_template = "{{ style }} " + template
    (styled,) = llm.chat(chat, sp, chat_template=kwargs_template, chat_template_kwargs={"style": "Sad."})
    assert styled.prompt == "Sad. user: Tell me a story.\nassistant:"
    with pytest.raises(ValueError, match="or None beside 'tool_calls'"):
        llm.chat([{"role": "user", "content": None}], sp, chat_template=template)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_vocabulary_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="vocabulary"):
        LLM("stories260k", draft_model="llama-68m", load_format="dummy", max_model_len=128, num_pages=16)


def test_bfloat16_on_cpu_warns_that_float32_is_faster(caplog):
    """bf16 products on XLA:CPU are emulated (6 tok/s against ~47 in float32 for SmolLM2 at batch 1): say so."""
    import logging

    if jax.default_backend() != "cpu":
        pytest.skip(f"a CPU-backend warning; this backend is {jax.default_backend()!r}")
    with caplog.at_level(logging.WARNING, logger="nightjar_jax.engine.engine"):
        LLM("stories260k", dtype="bfloat16", max_model_len=64, num_pages=16)
    assert any("bfloat16 on the CPU backend" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nightjar_jax.engine.engine"):
        LLM("stories260k", max_model_len=64, num_pages=16)
    assert not any("bfloat16" in r.getMessage() for r in caplog.records)


def test_pallas_attention_gives_the_same_tokens(alone):
    pytest.importorskip("kernels_pallas.paged_attention")
    llm = LLM("stories260k", attention_impl="pallas", max_model_len=256, max_num_seqs=2, num_pages=64)
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(PROMPTS[:2], sp)
    assert [o.outputs[0].token_ids for o in outs] == [a[:8] for a in alone[:2]]


def test_bfloat16_kv_cache_holds_twice_the_pages_and_keeps_the_text(alone):
    """kv_cache_dtype="bfloat16" under the float32 model: bfloat16 pools, twice the pages from the same bytes, and
    (K and V rounded, q and the sums float32) the float32 cache's greedy text on these prompts; the pages all come
    back, and an unknown dtype is a clear error naming the allowed ones."""
    budget = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_bytes=2**20)
    f32 = LLM("stories260k", **budget)
    bf16 = LLM("stories260k", kv_cache_dtype="bfloat16", **budget)
    assert {str(p.dtype) for p in jax.tree.leaves(f32.engine.runner.kv)} == {"float32"}
    # on CPU held as bfloat16 bit patterns (scattered in place; llama.kv_storage_dtype), elsewhere as bfloat16
    held = "uint16" if jax.default_backend() == "cpu" else "bfloat16"
    assert {str(p.dtype) for p in jax.tree.leaves(bf16.engine.runner.kv)} == {held}
    assert {str(kv_values(p).dtype) for p in jax.tree.leaves(bf16.engine.runner.kv)} == {"bfloat16"}
    assert abs(bf16.engine.runner.num_pages - 2 * f32.engine.runner.num_pages) <= 1  # the budget's floor division
    outs = bf16.generate(PROMPTS, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for g, w in zip(got, alone, strict=True) for a, b in zip(g, w, strict=True))
    assert got[0][:8] == alone[0][:8] and same >= 0.9 * sum(len(w) for w in alone), (got, alone)
    assert bf16.engine.num_free_pages == bf16.engine.num_total_pages
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float16' is invalid: allowed one of \('auto', "):
        LLM("stories260k", kv_cache_dtype="float16", **budget)


def test_bfloat16_kv_cache_through_the_pallas_body_keeps_the_text(alone):
    """The same bfloat16 pools read by the Pallas body (what a GPU runs; interpreted here): q and the sums stay
    float32, so the float32 cache's text holds as on the CPU kernel. When the body rounded q and the probabilities
    to bfloat16, 80 of these 96 tokens matched here, and on an H200 48 (2026-12-04)."""
    budget = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_bytes=2**20)
    bf16 = LLM("stories260k", kv_cache_dtype="bfloat16", attention_impl="pallas", **budget)
    got = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, GREEDY)]
    same = sum(a == b for g, w in zip(got, alone, strict=True) for a, b in zip(g, w, strict=True))
    assert got[0][:8] == alone[0][:8] and same >= 0.9 * sum(len(w) for w in alone), (got, alone)
    assert bf16.engine.num_free_pages == bf16.engine.num_total_pages


@pytest.mark.parametrize("tree_nodes", [0, 4], ids=["chain", "tree"])
def test_speculative_decoding_over_a_bfloat16_kv_cache_equals_its_ar(tree_nodes):
    """Both models' pools bfloat16 (held as bit patterns on CPU): verify rows read what decode rows read, and a token
    tree's accepted nodes move their K/V bits into place, so greedy SD equals AR over the same cache dtype."""
    common = dict(max_model_len=256, max_num_seqs=4, num_pages=128, kv_cache_dtype="bfloat16")
    ar = LLM("stories260k", **common).generate(PROMPTS, GREEDY)
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
             spec_tree_nodes=tree_nodes, **common)
    outs = sd.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ar]
    assert sd.engine.stats.num_accepted_tokens > 0
    assert sd.engine.num_free_pages == sd.engine.num_total_pages


def test_generate_priorities_need_the_priority_policy(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="got 2 priorities for 1 prompts"):
        llm.generate(["Once"], sp, priority=[0, 0])
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        llm.generate(["Once"], sp, priority=[1])
    assert llm.generate(["Once"], sp, priority=[0])[0].outputs[0].token_ids == \
        llm.generate(["Once"], sp)[0].outputs[0].token_ids
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_vllm_llm_options_block_size_and_no_ops():
    """vLLM's ``LLM(block_size=)`` is the page size; ``enforce_eager`` / ``disable_log_stats`` /
    ``enable_chunked_prefill`` (booleans) are taken and change nothing, ``speculative_config`` (a dict) sets the
    speculation options (each was a ConfigError: an unknown option); bad values and two names of one option fail
    before the model loads."""
    llm = LLM("stories260k", block_size=8, enforce_eager=True, disable_log_stats=False, max_model_len=64,
              num_pages=16, max_num_seqs=2, enable_chunked_prefill=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert llm.engine.config.cache.page_size == 8
    spec = llm.engine.config.spec  # (vLLM's speculative_config dict, read as serve --speculative-config reads it)
    assert (spec.draft_model, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 3)
    assert llm.llm_engine is llm.engine  # (vLLM's name)
    with pytest.raises(ValueError, match=r"enforce_eager='yes' is invalid: allowed True or False"):
        LLM("stories260k", enforce_eager="yes")
    with pytest.raises(ValueError, match="block_size and page_size are one option"):
        LLM("stories260k", block_size=8, page_size=16)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False: prefill is always chunked here"):
        LLM("stories260k", enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="speculative_config sets num_speculative_tokens=2 but "
                                         "num_speculative_tokens=3 is given too"):
        LLM("stories260k", num_speculative_tokens=3,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="^speculative_config key 'bogus' is not supported"):
        LLM("stories260k", speculative_config={"bogus": 1})
    with pytest.raises(ValueError, match="^speculative_config must be a JSON object of keys"):  # (named the CLI flag)
        LLM("stories260k", speculative_config="ngram")
    # vLLM's methods this engine does not serve say so (a bare AttributeError named nothing)
    with pytest.raises(AttributeError, match="LLM.embed is vLLM's embedding API, which nightjar-jax does not serve"):
        llm.embed(["x"])
    assert not hasattr(llm, "encode") and not hasattr(llm, "no_such_thing")


def test_vllm_prompt_types_and_chat_template_files(llm, tmp_path):
    """``TokensPrompt`` / ``TextPrompt`` (vLLM's prompt dicts) generate as their text does; a prompt's
    ``multi_modal_data`` is refused (the model never saw it: it was dropped without a word); ``LLM.chat``'s
    ``chat_template`` reads a file, as ``serve --chat-template`` does, and a name that is no file is an error (it
    was rendered as the template: the prompt was the name)."""
    from nightjar_jax import TextPrompt, TokensPrompt

    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_ids, by_text = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt=PROMPTS[0])], GREEDY)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    # a 1-D NumPy array of ids is a prompt too, as in the dict form (it was "got ndarray"); a 2-D one is not
    assert llm.generate([np.asarray(ids)], GREEDY)[0].outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="a 1-D NumPy array of them"):
        llm.generate([np.asarray([ids])], GREEDY)
    with pytest.raises(ValueError, match="a prompt's 'multi_modal_data' is not served"):
        llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": 1}}, GREEDY)
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    chat = llm.chat([{"role": "user", "content": PROMPTS[0]}], GREEDY, chat_template=str(template))[0]
    assert chat.prompt == PROMPTS[0] and chat.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="chat_template 'chatml' looks like a path, but no such file can be read"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template="chatml")
    assert not llm.engine.has_unfinished_requests()


def test_llm_engine_takes_vllms_call_forms(llm):
    """vLLM's ``LLMEngine`` calls: ``add_request(request_id, prompt, params)`` (its order; this engine's is prompt
    first, so the id was read as the prompt), ``abort_request`` of several ids, ``get_num_unfinished_requests``,
    ``get_tokenizer``; a non-SamplingParams in the params' place is a TypeError naming both orders."""
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4)
    assert engine.add_request("vllm-order", PROMPTS[0], sp) == "vllm-order"
    assert engine.add_request(PROMPTS[0], sp, "ours") == "ours"
    assert engine.add_request(request_id="kw", prompt=PROMPTS[0], params=sp) == "kw"  # (vLLM's keywords)
    assert engine.get_num_unfinished_requests() == 3 and engine.get_tokenizer() is engine.tokenizer
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["vllm-order"].outputs[0].token_ids == done["ours"].outputs[0].token_ids == done["kw"].outputs[
        0].token_ids
    assert done["vllm-order"].prompt == PROMPTS[0]
    engine.add_request("a", PROMPTS[0], sp)
    engine.add_request("b", PROMPTS[1], sp)
    outs = engine.abort_request(["a", "b", "never"])
    assert [o.outputs[0].finish_reason if o else None for o in outs] == ["abort", "abort", None]
    assert engine.get_num_unfinished_requests() == 0 and engine.num_free_pages == engine.num_total_pages
    for bad in (None, 5, ["a", 5]):  # (a bare TypeError "'NoneType' object is not iterable" before)
        with pytest.raises(TypeError, match=r"abort_request takes a request id \(a string\) or an iterable of them"):
            engine.abort_request(bad)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .* vLLM's add_request"):
        engine.add_request(PROMPTS[0], "not params")


def test_generate_takes_token_ids_as_a_tuple_or_numpy_integers(llm):
    """One prompt of token ids given as a tuple, or as a list of NumPy integers, is one prompt (each id was read
    as a prompt of its own: "a prompt must be ... got int"); its ids come back as Python ints."""
    import numpy as np

    ids = [1, 403, 407, 261, 378]
    want = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    for prompt in (tuple(ids), [np.int64(t) for t in ids], [np.int32(t) for t in ids]):
        outs = llm.generate(prompt, GREEDY)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == want
        assert all(type(t) is int for t in outs[0].prompt_token_ids)
    assert [o.outputs[0].token_ids for o in llm.generate((ids, tuple(ids)), GREEDY)] == [want, want]
    with pytest.raises(TypeError, match="prompts must be a prompt .* got int"):
        llm.generate(5, GREEDY)
    from nightjar_jax import BeamSearchParams  # (beam_search reads prompts the same way)

    beams = BeamSearchParams(beam_width=2, max_tokens=3)
    want = [s.tokens for s in llm.beam_search([ids], beams)[0].sequences]
    assert [s.tokens for s in llm.beam_search([np.int64(t) for t in ids], beams)[0].sequences] == want
