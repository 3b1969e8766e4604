"""The server with speculative decoding on: greedy text equals the plain server's, and the speculation metrics
move (stories260k drafts for itself, so every draft token is accepted)."""

from __future__ import annotations

import openai
import pytest
from server_process import ServerProcess

from nightjar_jax.planner import Planner


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    planner_state = tmp_path_factory.mktemp("planner") / "state.json"
    srv = ServerProcess(
        [
            "--planner-state",
            str(planner_state),
            "--draft-model",
            "stories260k",
            "--num-speculative-tokens",
            "3",
            "--planner",
            "static",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--num-pages",
            "33",
            "--enable-prefix-caching",
            "--chat-template",
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    srv.planner_state = planner_state
    yield srv
    srv.stop()


def test_responses_api_with_a_reasoning_parser(spec_server):
    """``--reasoning-parser deepseek_r1`` (its template opens the thought, so an answer that never closes it is all
    thought): /v1/responses returns it as a ``reasoning`` item before an empty message, counts its tokens, and
    streams it as reasoning_text events, the message's index after it; the chat endpoint agrees."""
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model="stories260k", input="Is it raining?", max_output_tokens=8, temperature=0)
    resp = client.responses.create(**kw)
    thought, message = resp.output
    assert thought.type == "reasoning" and thought.content[0].text and message.type == "message"
    assert resp.output_text == "" and 0 < resp.usage.output_tokens_details.reasoning_tokens
    chat = client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "Is it raining?"}],
                                          max_tokens=8, temperature=0).choices[0].message
    assert chat.content is None and chat.reasoning_content == thought.content[0].text
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert kinds[-1] == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))


def test_prefix_caching_reports_cached_prompt_tokens(spec_server):
    """``--enable-prefix-caching``: a prompt whose first pages an earlier request computed gets the same text, and
    its usage and the metrics count the cached tokens (whole 16-token pages, its last token computed), the draft's
    K/V included."""
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    opening = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    first = client.completions.create(model="stories260k", prompt=opening, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens > 16 and first.usage.prompt_tokens_details.cached_tokens == 0
    before = spec_server.metrics()
    again = client.completions.create(model="stories260k", prompt=opening, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (first.usage.prompt_tokens - 1) // 16 * 16 > 0
    m = spec_server.metrics()
    assert m["nightjar_prefix_cache_hits_total"] - before["nightjar_prefix_cache_hits_total"] == cached
    # the first request's draft ran over its whole prompt: the hit pages hold the draft's K/V too
    assert m["nightjar_prefix_cache_draft_hits_total"] - before["nightjar_prefix_cache_draft_hits_total"] == cached
    assert m["nightjar_prefix_cache_queries_total"] - before["nightjar_prefix_cache_queries_total"] == \
        first.usage.prompt_tokens
    assert m["nightjar_kv_pages_cached"] >= cached // 16
    assert m["nightjar_kv_pages_free"] == m["nightjar_kv_pages_usable"]


def test_reset_prefix_cache_and_server_load(spec_server):
    """vLLM's ``POST /reset_prefix_cache``: the next request computes its prompt whole (no cached tokens) and writes
    the same text; ``GET /load`` counts the generation requests in flight, a stream until its last frame."""
    import httpx

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    opening = "Once upon a time, there was a little boy named Tom. He liked to run in the big green park."
    first = client.completions.create(model="stories260k", prompt=opening, max_tokens=8, temperature=0)
    assert client.completions.create(model="stories260k", prompt=opening, max_tokens=8,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens > 0
    reset = httpx.post(spec_server.url + "/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json()["success"] and reset.json()["pages_forgotten"] > 0
    assert spec_server.metrics()["nightjar_kv_pages_cached"] == 0
    again = client.completions.create(model="stories260k", prompt=opening, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.choices[0].text == first.choices[0].text
    again_reset = httpx.post(spec_server.url + "/reset_prefix_cache", json={}, timeout=60)  # (a body is ignored)
    assert again_reset.status_code == 200 and again_reset.json()["pages_forgotten"] >= 0

    list(client.completions.create(model="stories260k", prompt=opening, max_tokens=16, temperature=0, stream=True))
    assert httpx.get(spec_server.url + "/load", timeout=60).json() == {"server_load": 0}  # (all ended: none left)


def test_load_tracking_counts_requests_until_their_last_frame():
    """The middleware behind ``GET /load``: a POST to a generation route counts from its arrival until its response
    has been sent whole (a stream: its last frame), under a root path too; other routes do not count."""
    import asyncio

    from nightjar_jax.server.app import _LoadTracking

    async def run():
        gate, counter, seen = asyncio.Event(), [0], []

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            seen.append(counter[0])
            await gate.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def send(message):
            pass

        tracked = _LoadTracking(app, counter)
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": ""}
        tasks = [asyncio.create_task(tracked(scope, None, send)),
                 asyncio.create_task(tracked({**scope, "path": "/proxy/v1/completions", "root_path": "/proxy"},
                                             None, send)),
                 asyncio.create_task(tracked({**scope, "path": "/tokenize"}, None, send))]
        while len(seen) < 3:
            await asyncio.sleep(0)
        assert counter == [2]  # (two generation streams open; /tokenize is not counted)
        gate.set()
        await asyncio.gather(*tasks)
        assert counter == [0]

    asyncio.run(run())


def test_structured_outputs_through_the_api(spec_server):
    """``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and ``guided_*``: the text
    satisfies the constraint (speculating, beside other requests); a bad or doubled
    constraint is a 400 naming its field, and the server serves on. Under this server's deepseek_r1 the output
    starts in a thought and the constraint after it: prompts that close the thought (``</think>``, as a template
    with thinking off ends) are constrained from the first token; one that does not leaves stories260K, which
    never closes a thought, unconstrained, as vLLM does."""
    import json
    import re

    import httpx

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
                                                                                "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}

    def complete(**body):
        return client.completions.create(model="stories260k", prompt="Once upon a time</think>", max_tokens=32,
                                         temperature=0, extra_body=body).choices[0]

    got = complete(response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert got.finish_reason == "stop" and set(json.loads(got.text)) == {"ok", "n"}
    assert complete(response_format={"type": "json_object"}).text.startswith("{")
    assert complete(structured_outputs={"choice": ["yes", "no"]}).text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", complete(guided_regex="[0-9]{3}").text)
    assert complete(guided_choice=["red", "blue"], n=2).text in ("red", "blue")
    thought = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=8, temperature=0,
                                        extra_body={"guided_regex": "[0-9]{3}"}).choices[0]
    assert thought.finish_reason == "length" and not re.fullmatch(r"[0-9]{3}", thought.text)  # (all thought)

    def error(**body) -> dict:
        r = httpx.post(spec_server.url + "/v1/completions", json={"model": "stories260k", "prompt": "Hi</think>",
                                                                  **body}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    e = error(response_format={"type": "json_object"}, guided_regex="[0-9]")
    assert e["param"] == "guided_regex" and "one output constraint, not 2" in e["message"]
    e = error(response_format={"type": "xml"})
    assert e["param"] == "response_format" and "allowed 'text', 'json_object', 'json_schema'" in e["message"]
    e = error(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e["param"] == "response_format" and "'schema'" in e["message"]
    e = error(structured_outputs={"regex": "(unclosed"})
    assert e["param"] == "structured_outputs" and "the regex constraint does not compile" in e["message"]
    e = error(structured_outputs={"regex": "a", "choice": ["b"]})
    assert e["param"] == "structured_outputs" and "exactly one of" in e["message"]
    # errors name the field the constraint came from, without xgrammar's time and C++ source line
    e = error(guided_regex="[a-")
    assert e["param"] == "guided_regex" and "does not compile" in e["message"] and ".cc:" not in e["message"]
    e = error(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert e["param"] == "response_format"
    # a constraint no text matches: refused before it is queued; one that comes to a dead end after its first
    # tokens: the request's own 400, streamed as an error event before [DONE] (not an engine failure's 500)
    e = error(guided_regex="[^\\s\\S]")
    assert e["param"] == "guided_regex" and "allows no output at all" in e["message"]
    e = error(guided_regex="ab[^\\s\\S]", max_tokens=8)
    assert e["param"] == "guided_regex" and "could not be completed" in e["message"], e
    assert "kept" not in e["message"], e  # (a 400 carries no output: it must not promise the output so far)
    with httpx.stream("POST", spec_server.url + "/v1/completions", timeout=60, json={
            "model": "stories260k", "prompt": "Hi</think>", "guided_regex": "ab[^\\s\\S]", "max_tokens": 8,
            "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert [ev["error"]["param"] for ev in events if "error" in ev] == ["guided_regex"]
    # the output before the dead end streams in full, before the error: the failing step's tokens were dropped
    # (a speculative step commits several; usage counted them)
    texts = [ev["choices"][0]["text"] for ev in events if ev.get("choices")]
    assert "".join(texts) == "ab" and all(ev["choices"][0]["finish_reason"] is None for ev in events
                                          if ev.get("choices")), events
    assert complete().text  # (and the server serves on)


def test_speculative_server_metrics(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    before = spec_server.metrics()
    out = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=16, temperature=0)
    assert out.choices[0].text.startswith(", there was a little girl named Lily")
    assert out.usage.completion_tokens == 16
    m = spec_server.metrics()
    assert m["nightjar_spec_gamma"] == 3
    drafted = m["nightjar_spec_draft_tokens_total"] - before["nightjar_spec_draft_tokens_total"]
    accepted = m["nightjar_spec_accepted_tokens_total"] - before["nightjar_spec_accepted_tokens_total"]
    assert drafted > 0 and accepted == drafted  # the draft is the target: every draft token is accepted
    steps = m['nightjar_decode_steps_total{gamma="3"}'] - before['nightjar_decode_steps_total{gamma="3"}']
    assert steps > 0 and m['nightjar_decode_steps_total{gamma="0"}'] == before['nightjar_decode_steps_total{gamma="0"}']
    assert m["nightjar_spec_tree_nodes"] == 0  # a chain
    assert 0 <= m["nightjar_decode_steps_compiling_total"] <= m['nightjar_decode_steps_total{gamma="3"}']
    for pos in (1, 2, 3):  # every position drafted in every sequence-step, and accepted
        key = f'nightjar_spec_accepted_per_position_total{{position="{pos}"}}'
        assert m[key] - before[key] == steps
        key = f'nightjar_spec_drafted_per_position_total{{position="{pos}"}}'
        assert m[key] - before[key] == steps
    # n-gram lookup is on by default (--prompt-lookup-max 3): its sequence-steps are some of the steps above
    lookup = m["nightjar_spec_lookup_steps_total"] - before["nightjar_spec_lookup_steps_total"]
    lookup_acc = m["nightjar_spec_lookup_accepted_tokens_total"] - before["nightjar_spec_lookup_accepted_tokens_total"]
    assert 0 <= lookup <= steps and 0 <= lookup_acc <= 3 * lookup
    assert m["nightjar_draft_offloaded"] == 0 and m["nightjar_draft_offloads_total"] == 0
    assert m["nightjar_draft_reloads_total"] == 0 and "nightjar_planner_switches_total" in m
    assert m["nightjar_kv_pages_free"] == m["nightjar_kv_pages_usable"]
    assert spec_server.stop() == 0
    # --planner-state: the shutdown wrote what the planner saw (a static planner learns nothing: its counters)
    state = Planner.load(spec_server.planner_state)
    assert state.spec == "static:3" and state.num_decisions >= steps > 0


def test_server_with_token_trees():
    """``--spec-tree-nodes``: greedy text unchanged, a sampled request served, each step drafts the tree's nodes
    and (the draft being the target) accepts its whole top-ranked branch."""
    srv = ServerProcess(["--draft-model", "stories260k", "--num-speculative-tokens", "3", "--planner", "static",
                         "--spec-tree-nodes", "6", "--max-model-len", "128", "--max-num-seqs", "4",
                         "--num-pages", "40", "--prompt-lookup-max", "0"])  # (no copy branch: 6 nodes exactly)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        before = srv.metrics()
        out = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=16, temperature=0)
        assert out.choices[0].text.startswith(", there was a little girl named Lily")
        m = srv.metrics()
        drafted = m["nightjar_spec_draft_tokens_total"] - before["nightjar_spec_draft_tokens_total"]
        accepted = m["nightjar_spec_accepted_tokens_total"] - before["nightjar_spec_accepted_tokens_total"]
        assert drafted > accepted > 0 and drafted % 6 == 0  # 6 nodes per sequence-step, a depth-3 branch accepted
        assert m["nightjar_spec_tree_nodes"] == 6
        deep = 'nightjar_spec_accepted_per_position_total{position="3"}'
        assert m[deep] - before[deep] > 0
        sampled = client.completions.create(model="stories260k", prompt="The dog", max_tokens=12, temperature=0.8,
                                             seed=3, extra_body={"ignore_eos": True})
        assert sampled.usage.completion_tokens == 12
        assert srv.metrics()["nightjar_kv_pages_free"] == m["nightjar_kv_pages_usable"]
    finally:
        assert srv.stop() == 0


def test_server_with_draft_offload_serves_a_burst():
    """``--draft-offload auto`` with ``--warmup full`` (which warms the extended layout too): a burst on a pool too
    small for it offloads the draft, every request gets plain greedy's text, and the draft is back afterwards."""
    import concurrent.futures

    from nightjar_jax import LLM, SamplingParams

    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily had a red ball. One day", "Tom was sad because",
               "The sun was"]
    plain = LLM("stories260k", max_model_len=128, num_pages=64, draft_model=None)
    want = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24))]
    srv = ServerProcess(["--draft-model", "stories260k", "--num-speculative-tokens", "1", "--planner", "static",
                         "--max-model-len", "128", "--max-num-seqs", "4", "--num-pages", "9", "--page-size", "8",
                         "--max-num-batched-tokens", "16",  # (fewer prefill chunk shapes for the full warm-up)
                         "--draft-offload", "auto", "--offload-persist-steps", "2", "--warmup", "full"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(prompt: str) -> str:
            out = client.completions.create(model="stories260k", prompt=prompt, max_tokens=24, temperature=0)
            return out.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(ask, prompts))
        assert got == want
        m = srv.metrics()
        assert m["nightjar_draft_offloads_total"] >= 1 and m["nightjar_draft_reloads_total"] >= 1
        assert m["nightjar_draft_offloaded"] == 0 and m["nightjar_kv_extension_pages"] == 0
        assert m["nightjar_kv_pages_free"] == m["nightjar_kv_pages_usable"] == 8
        assert m["nightjar_decode_steps_compiling_total"] == 0  # the full warm-up built every step of the burst
        assert m["nightjar_compile_evictions_total"] == 0
    finally:
        assert srv.stop() == 0, srv.logs()

