"""The server in process over stories260K, for what the subprocess tests' settings do not cover: a structured
output's constraint compiles off the engine's thread, before its request is queued, so a slow one does not stall the
requests already running; the Responses API counts a thought's tokens as generated (deepseek_r1's parser); a
prompt that opens the thought makes the output reasoning (qwen3's parser)."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.engine.structured import GrammarBackend
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import stories_chat_llm


def test_a_constraint_compiles_off_the_engine_thread(monkeypatch):
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64)
    threads = []
    compile_ = GrammarBackend.compile

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarBackend, "compile", recording)
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "guided_regex": "(red|blue) [a-z]+"}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"].startswith(("red ", "blue "))
    # the server's compile ran in a worker thread; the engine's matcher (on its thread) found it cached there
    assert threads and threads[0] != "nightjar-engine"
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_tokenize_encodes_off_the_event_loop(monkeypatch):
    """/tokenize encoded on the event loop: a megabyte of text held every other connection (streams, /health) for a
    second. It now encodes in a worker thread, as a completion's prompt does."""
    import asyncio

    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=16)
    tok = llm.engine.tokenizer
    encode = tok.encode
    on_loop = []

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # (no loop runs in this thread)
            on_loop.append(False)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", recording)
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        resp = client.post("/tokenize", json={"prompt": "Once upon a time"})
        assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == encode("Once upon a time") and on_loop == [False]


def test_responses_count_the_thoughts_generated_tokens():
    """deepseek_r1 reads an output without ``<think>`` as all thought: its reasoning tokens are every generated
    token. They were the thought's text encoded again, which this tokenizer splits into one more token (a leading
    space of its own): 21 reasoning tokens of 20."""
    llm = stories_chat_llm()
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="deepseek_r1"))) as client:
        resp = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 20, "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["usage"]["output_tokens"] == 20 and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 20
    # the thought was cut off by max_output_tokens: incomplete, as the response and its message (it said completed)
    assert body["status"] == "incomplete" and [item["status"] for item in body["output"]] == ["incomplete"] * 2
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="deepseek_r1"))) as client:
        lines = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 20, "temperature": 0,
                                                   "stream": True}).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(item["type"], item["status"]) for item in done] == [("reasoning", "incomplete"), ("message", "incomplete")]


def test_responses_take_back_their_reasoning_items():
    """OpenAI's multi-turn pattern sends a response's output items back as input: its reasoning item was a 400
    ("must be a message", QA 2026-12-07). It is the next assistant message's reasoning_content now, which a template
    that renders earlier thoughts gets."""
    llm = stories_chat_llm()
    llm.engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
        "{% endif %}{{ m.content }}\n{% endfor %}assistant: <think>\n")
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="deepseek_r1"))) as client:
        first = client.post("/v1/responses", json={"input": "Tell a story", "max_output_tokens": 6,
                                                   "temperature": 0}).json()
        assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
        turn = [{"role": "user", "content": "Tell a story"}, *first["output"], {"role": "user", "content": "More"}]
        resp = client.post("/v1/responses", json={"input": turn, "max_output_tokens": 2})
        assert resp.status_code == 200, resp.text
        without = client.post("/v1/responses", json={"input": [turn[0], turn[2], turn[3]], "max_output_tokens": 2})
        assert resp.json()["usage"]["input_tokens"] > without.json()["usage"]["input_tokens"]  # (the thought is in)
        bad = client.post("/v1/responses", json={"input": [turn[0], {"type": "reasoning", "summary": [3]}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1]", bad.text
    from nightjar_jax.server.protocol import ResponsesRequest

    got = ResponsesRequest(input=[{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
                                  {"role": "user", "content": "Hi"}]).messages()
    assert got == [{"role": "assistant", "content": "", "reasoning_content": "hmm"}, {"role": "user", "content": "Hi"}]


def test_responses_take_vllms_extra_fields_and_check_text():
    """vLLM's Responses fields (top_k, logit_bias, skip_special_tokens, priority, cache_salt, mm_processor_kwargs)
    were 400s ("Extra inputs are not permitted") where chat takes them; 'text' took any keys, ignored them and echoed
    them; an empty content list was rendered as an empty message (chat's is a 400); the X-Request-Id header was
    ignored; a template failure named chat's 'messages'."""
    llm = stories_chat_llm()
    base = {"input": "Tell me a story.", "max_output_tokens": 8}
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        def post(body, **kw):
            return client.post("/v1/responses", json={**base, **body}, **kw)

        greedy = post({"temperature": 0}).json()["output"][0]["content"][0]["text"]
        top_1 = post({"temperature": 1.0, "top_k": 1, "priority": 0, "cache_salt": "salt", "mm_processor_kwargs": None,
                      "skip_special_tokens": False})
        assert top_1.status_code == 200, top_1.text
        assert top_1.json()["output"][0]["content"][0]["text"] == greedy
        first = llm.engine.tokenizer.encode(greedy, add_special_tokens=False)[0]
        banned = post({"temperature": 0, "logit_bias": {str(first): -100}}).json()
        assert banned["output"][0]["content"][0]["text"] != greedy
        echoed = post({"text": {"format": None}}).json()["text"]
        assert echoed == {"format": {"type": "text"}, "verbosity": "medium"}
        assert post({"text": {"verbosity": "medium"}}).status_code == 200
        assert post({}, headers={"X-Request-Id": "mine-1"}).json()["id"] == "mine-1"
        assert post({}).json()["id"].startswith("resp_")
        for body, param, message in [
                ({"text": {"verbosity": "low"}}, "text", "'text.verbosity'='low' is not supported"),
                ({"text": {"bogus": 1}}, "text", "'text.bogus' is not supported: 'text' holds 'format' and"),
                ({"input": [{"role": "user", "content": []}]}, "input[0].content", "'input[0].content' is an empty"),
                ({"enable_response_messages": True}, "enable_response_messages", "not supported"),
                ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs", "not supported"),
                ({"priority": 5}, "priority", "priority")]:
            bad = post(body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.text)
            assert message in bad.json()["error"]["message"], bad.text
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
    plain = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=16)  # (no chat template)
    with TestClient(build_app(AsyncEngine(plain.engine), ServerSettings("s"))) as client:
        bad = client.post("/v1/responses", json=base)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text


def test_responses_cut_off_fail_and_stored_ones_are_not_found(monkeypatch):
    """A response aborted before its end (a shutdown, a cancel) is "failed" with an error saying so, whole or
    streamed (``response.failed``): it read "completed". The response echoes what the request asked for and what the
    sampling used; a json_schema format needs its name (it was set to "output"); the stored-response endpoints are
    404s that say nothing is stored (a bare "Not Found")."""
    import time

    llm = stories_chat_llm()
    engine, step = llm.engine, llm.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])  # (slow: the abort lands mid-way)
    async_engine = AsyncEngine(engine)
    body = {"input": "Hi", "max_output_tokens": 100, "temperature": 0}
    with TestClient(build_app(async_engine, ServerSettings("s"))) as client:
        for stream in (False, True):
            answer = {}

            def ask(stream=stream, answer=answer):
                answer["resp"] = client.post("/v1/responses", json={**body, "stream": stream})

            asker = threading.Thread(target=ask)
            asker.start()
            deadline = time.monotonic() + 60
            while not engine.requests and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            async_engine.abort(list(engine.requests))
            asker.join(60)
            resp = answer["resp"]
            assert resp.status_code == 200, resp.text
            if stream:
                events = [line for line in resp.text.splitlines() if line.startswith("event: ")]
                assert events[-1] == "event: response.failed", events[-3:]
                final = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")][-1]
                result = final["response"]
            else:
                result = resp.json()
            assert result["status"] == "failed" and "aborted before it finished" in result["error"]["message"]
            assert 0 < result["usage"]["output_tokens"] < 100 and result["output"][0]["status"] == "incomplete"
        assert engine.num_free_pages == engine.num_total_pages
        monkeypatch.setattr(engine, "step", step)
        done = client.post("/v1/responses", json={**body, "max_output_tokens": 3, "parallel_tool_calls": False,
                                                  "tool_choice": "none", "user": "u", "truncation": "disabled"}).json()
        assert (done["parallel_tool_calls"], done["tool_choice"], done["user"], done["truncation"]) == (
            False, "none", "u", "disabled")
        assert (done["temperature"], done["top_p"], done["completed_at"]) == (0.0, 1.0, None)  # (cut: incomplete)
        # the refused features at the values served, as OpenAI's Response object carries them (they were absent: a
        # client reading 'store' could not tell the response was not stored)
        assert (done["store"], done["background"], done["previous_response_id"], done["max_tool_calls"]) == (
            False, False, None, None)
        assert done["reasoning"] == {"effort": None, "summary": None} and done["top_logprobs"] == 0
        unnamed = client.post("/v1/responses", json={**body, "text": {"format": {"type": "json_schema",
                                                                                 "schema": {"type": "object"}}}})
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "text"
        for method, path in (("GET", "resp_1"), ("DELETE", "resp_1"), ("POST", "resp_1/cancel"),
                             ("GET", "resp_1/input_items")):
            gone = client.request(method, f"/v1/responses/{path}")
            assert gone.status_code == 404 and "does not store responses" in gone.json()["error"]["message"], path


def test_a_prompt_that_opens_the_thought_makes_the_output_reasoning():
    """qwen3 reads an output as a thought when the template's prompt opened it (``<think>`` at its end, as
    Qwen3-Thinking-2507's and Qwen3.5's templates end): the whole 12-token output, never closed, is reasoning in chat,
    streamed chat and the Responses API. It was all content: qwen3 looked for the start tag in the output only."""
    llm = stories_chat_llm()
    llm.engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: <think>\n")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="qwen3"))) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"], message
        chunks = [json.loads(line[6:]) for line in client.post(
            "/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert not any(d.get("content") for d in deltas)
        resp = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 12, "temperature": 0}).json()
        assert [item["type"] for item in resp["output"]] == ["reasoning", "message"]
        assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 12
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_templates_get_tool_call_arguments_as_objects_and_earlier_thoughts():
    """As vLLM renders a conversation: an assistant's tool-call ``arguments`` (a JSON string in the API) reach the
    template as an object (``{}`` for none; a string that is no JSON object stays as written), and its
    ``reasoning_content`` / ``reasoning`` reach it too. The arguments were the string (``| tojson`` wrote it quoted
    again) and the thought was dropped."""
    llm = stories_chat_llm()
    llm.engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}[{{ m.reasoning_content or m.reasoning or '' }}]"
        "{% for tc in m.tool_calls or [] %}<{{ tc.function.name }} {{ tc.function.arguments | tojson }}>"
        "{% endfor %}{{ m.content or '' }}\n{% endfor %}assistant:")

    def call(arguments):
        return {"id": "c", "type": "function", "function": {"name": "get", "arguments": arguments}}

    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "look it up",
                 "tool_calls": [call('{"city": "Paris"}'), call(""), call("not json"), call({"city": "Nice"})]},
                {"role": "tool", "tool_call_id": "c", "content": "sunny"},
                {"role": "assistant", "content": "Sunny.", "reasoning": "said it"}]
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        resp = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
        assert resp.status_code == 200, resp.text
        text = client.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert 'assistant[look it up]<get {"city": "Paris"}><get {}><get "not json"><get {"city": "Nice"}>' in text
    assert "assistant[said it]Sunny." in text


def test_max_logprobs_and_request_logging(caplog):
    """vLLM's ``--max-logprobs`` caps what a request may ask (completions' logprobs, chat's top_logprobs,
    prompt_logprobs: a 400 naming the field), and ``--enable-log-requests`` logs each request as it is queued."""
    llm = stories_chat_llm()
    settings = ServerSettings("s", max_logprobs=2, log_requests=True)
    with TestClient(build_app(AsyncEngine(llm.engine), settings)) as client, caplog.at_level("INFO"):
        ok = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "logprobs": 2,
                                                  "request_id": "logged-1"})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
        for path, body, field in [
                ("/v1/completions", {"prompt": "Once", "max_tokens": 2, "logprobs": 3}, "logprobs"),
                ("/v1/completions", {"prompt": "Once", "max_tokens": 2, "prompt_logprobs": 5}, "prompt_logprobs"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                          "logprobs": True, "top_logprobs": 3}, "top_logprobs")]:
            resp = client.post(path, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
            assert "more than this server's --max-logprobs 2" in resp.json()["error"]["message"]
    assert any("request cmpl-logged-1 queued: 1 prompt(s)" in r.getMessage() for r in caplog.records)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_cache_salt_keeps_tenants_prefix_caches_apart():
    """vLLM's ``cache_salt``: a prompt computed under one salt is a cache hit for the same salt only (usage's
    ``cached_tokens``); an empty salt is a 400. It was a 400 whatever its value."""
    llm = stories_chat_llm()
    prompt = "Once upon a time there was a little girl named Lily. She loved to play outside in the park."

    def cached(salt, path="/v1/completions"):
        body = {"max_tokens": 2, "temperature": 0, **({} if salt is None else {"cache_salt": salt})}
        body |= {"prompt": prompt} if path == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]}
        resp = client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        assert cached("tenant-a") == 0
        assert cached("tenant-b") == 0 and cached(None) == 0
        assert cached("tenant-a") > 0 and cached("tenant-b") > 0 and cached(None) > 0
        assert cached("tenant-c", "/v1/chat/completions") == 0 and cached("tenant-c", "/v1/chat/completions") > 0
        resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "cache_salt": ""})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
        # a beam search's steps are salted too
        prompt = "The sun was shining and the birds were singing in the tall green trees by the river bank."
        beam = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2, "use_beam_search": True,
                                                    "cache_salt": "tenant-d"})
        assert beam.status_code == 200, beam.text
        assert cached(None) == 0 and cached("tenant-d") > 0
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_a_waiting_metrics_scrape_does_not_stall_the_event_loop():
    """/metrics waits out a draft move (``LLMEngine.state_lock``); it renders off the event loop, so /health answers
    meanwhile. Rendered on the loop, a scrape stalled /health and every stream for as long as it waited (seconds
    under load, when steps held the lock)."""
    import time

    llm = stories_chat_llm()
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        scraped = {}
        with llm.engine.state_lock:  # (as a draft move holds it)
            scraper = threading.Thread(target=lambda: scraped.update(resp=client.get("/metrics")))
            scraper.start()
            time.sleep(0.3)
            prober = threading.Thread(target=lambda: scraped.update(health=client.get("/health")))
            prober.start()
            prober.join(timeout=5)
            answered = not prober.is_alive()
            still_waiting = scraper.is_alive()
        scraper.join(timeout=30)
        prober.join(timeout=30)
        assert answered and still_waiting and scraped["health"].status_code == 200
        assert scraped["resp"].status_code == 200 and "nightjar_kv_pages_usable" in scraped["resp"].text


def test_a_named_function_with_no_answer_text_is_no_call():
    """deepseek_r1 reads an output without ``<think>`` as all thought: a named function's answer then has no text,
    and it came back as a call with arguments "" (no JSON), streamed too; it is no call now, as "required"'s."""
    from nightjar_jax.testing import PLAIN_CHAT_TEMPLATE

    # (the engine's parser: the constraint starts after the thought, which this model never closes)
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64, reasoning_parser="deepseek_r1")
    llm.engine.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="deepseek_r1"))) as client:
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["message"]["reasoning_content"] and not choice["message"].get("tool_calls"), choice
        assert choice["finish_reason"] == "length"
        chunks = [json.loads(line[6:]) for line in client.post(
            "/v1/chat/completions", json={**body, "stream": True}).text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == choice["message"]["reasoning_content"]
        assert not any(d.get("tool_calls") for d in deltas), deltas
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_an_empty_text_prompt_is_a_prompt():
    """"" was a 400 on the server ("'prompt' is empty") where the library and vLLM take it: a tokenizer that adds BOS
    makes it one token (stories260K's), and the engine refuses it only when it comes out empty."""
    llm = stories_chat_llm()
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        resp = client.post("/v1/completions", json={"prompt": "", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == 1 and resp.json()["choices"][0]["text"]
        bad = client.post("/v1/completions", json={"prompt": [[]], "max_tokens": 4})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        tok = llm.engine.tokenizer
        add_bos, tok.add_bos = getattr(tok, "add_bos", None), False  # (a tokenizer without BOS: no token at all)
        try:
            assert tok.encode("") == []
            none = client.post("/v1/completions", json={"prompt": "", "max_tokens": 4})
            assert none.status_code == 400 and "the prompt is empty" in none.json()["error"]["message"], none.text
        finally:
            tok.add_bos = add_bos
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_best_of_is_n_or_left_out():
    """best_of equal to n is served (nothing extra to rank); under n it is vLLM's own 400 ("at least n"), over n a
    400 saying what is allowed. Both said only "not supported by this server"."""
    llm = stories_chat_llm()
    body = {"prompt": "Once", "max_tokens": 2, "temperature": 0}
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        ok = client.post("/v1/completions", json={**body, "n": 2, "best_of": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
        for n, best_of, message in [(2, 1, "best_of must be at least n=2"),
                                    (1, 3, "allowed null or n (1): ranking extra sequences is not served here")]:
            bad = client.post("/v1/completions", json={**body, "n": n, "best_of": best_of})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of", bad.text
            assert message in bad.json()["error"]["message"]
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_a_client_gone_before_the_first_frame_aborts_its_request():
    """A streaming client that disconnects before the response starts: the response is cancelled before its
    generator ever runs, so the generator's abort never ran and the request went on to max_tokens, holding its pages
    (QA's hypothesis; reproduced here with a send that is slow to start the response). The response aborts it."""
    import asyncio

    llm = stories_chat_llm()
    app = build_app(AsyncEngine(llm.engine), ServerSettings("s"))
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()

    async def call() -> list[str]:
        messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.sleep(3600)

        sent = []

        async def send(message):
            sent.append(message["type"])
            if message["type"] == "http.response.start":
                await asyncio.sleep(1)  # (the disconnect is seen first: the response is cancelled here)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await app(scope, receive, send)
        return sent

    with TestClient(app) as client:
        sent = client.portal.call(call)
        assert "http.response.body" not in sent, sent  # (no frame went out: the generator never started)
        engine = llm.engine
        for _ in range(200):  # (the abort is a command to the engine thread)
            if not engine.has_unfinished_requests():
                break
            client.portal.call(asyncio.sleep, 0.02)
        assert not engine.has_unfinished_requests()
        assert engine.stats.num_generated_tokens < 100  # (aborted, not run to max_tokens)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


PARTS_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% for p in m.content %}{% if p['type'] == 'text' %}"
                  "{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:"
                  "{% endif %}")


def test_a_template_that_loops_over_content_parts_gets_them():
    """vLLM's --chat-template-content-format auto: a template that loops over a message's content got the content
    as one string (its characters have no 'type'), rendered no text, and the user's message was lost without a
    word (QA, 2026-12-07); it now gets [{"type": "text", "text"}] parts, a string as one part. "string" forces the
    old form; a request template that does not parse is blamed on 'chat_template', not 'messages'."""
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=16)
    llm.engine.tokenizer.chat_template = PARTS_TEMPLATE
    messages = [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    want = "system: Be kind.user: Hellothereassistant:"  # (trim_blocks, as transformers': no newline after a tag)

    def rendered(client, **extra):
        resp = client.post("/tokenize", json={"messages": messages, **extra})
        assert resp.status_code == 200, resp.text
        return client.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]

    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", trust_request_chat_template=True))) as c:
        assert rendered(c).endswith(want)
        resp = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "chat_template": "{{ x "})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template", resp.text
        assert "does not parse" in resp.json()["error"]["message"]
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings(
            "s", chat_template_content_format="string"))) as c:
        assert rendered(c).endswith("system: user: assistant:")  # (what every request got before)
    # the library: LLM.chat as the server, the tokenizer as transformers' (content as given) unless asked
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(messages, content_format="auto") == want
    assert tok.apply_chat_template(messages[:1]) == "system: assistant:"  # (transformers': as given)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2))
    assert tok.decode(out[0].prompt_token_ids).endswith(want)
    # continuing the last message in parts: the marker rides in its last part
    prefill = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True,
                                   content_format="auto") == "system: Be kind.user: Hellothereassistant: Hi"
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_chat_content_format_reads_the_template():
    from nightjar_jax.models.tokenizer import ChatTemplateArgumentError, chat_content_format

    assert chat_content_format(PARTS_TEMPLATE) == "openai"
    vision = ("{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
              "{%- for content in message['content'] %}{{ content['text'] }}{% endfor %}{% endif %}{% endfor %}")
    assert chat_content_format(vision) == "openai"
    assert chat_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    lines = "{% for m in messages %}{% for line in m['content'].split('\\n') %}{{ line }}{% endfor %}{% endfor %}"
    assert chat_content_format(lines) == "string"  # (a loop over the string's lines, not over parts: review)
    assert chat_content_format("{%- for p in message.content | selectattr('type', 'eq', 'text') -%}") == "openai"
    assert chat_content_format(PARTS_TEMPLATE, "string") == "string"
    with pytest.raises(ChatTemplateArgumentError, match="content format 'parts' is invalid: allowed auto, string"):
        chat_content_format(PARTS_TEMPLATE, "parts")
