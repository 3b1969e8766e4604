"""vLLM's request extras on the chat and completion endpoints, in process over stories260K: ``request_id`` (and the
X-Request-Id header), ``return_tokens_as_token_ids``, chat's ``echo``, a request's own ``chat_template`` (with
``--trust-request-chat-template`` only) and text parts' ``cache_control``; and vLLM's HTTP-front settings (CORS,
X-Request-Id response headers, no FastAPI docs)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import stories_chat_llm

OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def llm():
    return stories_chat_llm()


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", trust_request_chat_template=True))) as c:
        yield c
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def chat(client, messages, **body):
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_request_id_names_the_response(client):
    body = chat(client, [{"role": "user", "content": "Hi"}], request_id="my-id-1")
    assert body["id"] == "chatcmpl-my-id-1"
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "abc"})
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-abc"
    # the header wins over the body, as in vLLM
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "abc"},
                       headers={"X-Request-Id": "from-header"})
    assert resp.json()["id"] == "cmpl-from-header"
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id"
    # control characters name no response and break log lines (an X-Request-Id header's are replaced); other text
    # is an id
    for path, body in (("/v1/completions", {"prompt": "Once", "max_tokens": 2}),
                       ("/v1/responses", {"input": "Once", "max_output_tokens": 2})):
        for bad in ("a\nb\u0000", "x\u2028y", "id\u202e"):  # (a newline and NUL, a line separator, a bidi override)
            resp = client.post(path, json={**body, "request_id": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id", resp.text
            assert "control character" in resp.json()["error"]["message"]
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "h\u00e9-1"})
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-h\u00e9-1"


def test_a_request_id_in_flight_is_a_400(client, llm, monkeypatch):
    """Two requests in flight may not share an id: the second is a 400 naming request_id, the first is served."""
    import time

    step = llm.engine.step  # (paced: on a loaded machine the first request finished before the second came)
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.01), step())[1])
    body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True, "request_id": "dup"}
    with client.stream("POST", "/v1/completions", json=body) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # (the first is under way)
        resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "dup"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "request_id" and "'cmpl-dup' is in use by a request in flight" in err["message"]
        assert [line for line in lines if line][-1] == "data: [DONE]"
    # once it finished, the id is free again
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "dup"})
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-dup"
    # n = 2, its first member done and the second streaming: the id is still in flight (the engine's own check is
    # per member, so "cmpl-P-0" finished let a second request share "cmpl-P"); a beam search holds its id too
    body = {"prompt": "Once upon a time", "n": 2, "stream": True, "request_id": "P", "temperature": 0}
    with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 60, "ignore_eos": True}) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        client.app.state.async_engine.abort(["cmpl-P-0"])  # (as if member 0 had finished)
        for extra in ({}, {"use_beam_search": True, "n": 2}):
            resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "P",
                                                         **extra})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id", resp.text
        assert [line for line in lines if line][-1] == "data: [DONE]"
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "P",
                                                 "use_beam_search": True, "n": 2})
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-P"
    # an empty X-Request-Id header counts as none (vLLM takes it)
    resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "request_id": "Q"},
                       headers={"X-Request-Id": ""})
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-Q"


def test_return_tokens_as_token_ids(client):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    as_ids = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    lps = as_ids["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lps["tokens"]) and lps["token_logprobs"] == plain["token_logprobs"]
    assert all(k.startswith("token_id:") for top in lps["top_logprobs"] for k in top)
    msgs = [{"role": "user", "content": "Hi"}]
    content = chat(client, msgs, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)["choices"][0][
        "logprobs"]["content"]
    ids = [int(c["token"].split(":")[1]) for c in content]
    assert ids and content[0]["bytes"] == list(content[0]["token"].encode())
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    # the ids are the generated tokens: they decode to the answer's text
    text = chat(client, msgs)["choices"][0]["message"]["content"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text.lstrip()  # (SentencePiece)


def test_chat_logprob_bytes_rebuild_a_character_split_over_byte_tokens(client):
    """OpenAI's ``bytes``: "€" comes as the byte tokens <0xE2> <0x82> <0xAC>, each reading U+FFFD as text; their
    bytes are the character's, so joined they decode to it (they were U+FFFD's UTF-8, three times)."""
    tok = client.app.state.async_engine.engine.tokenizer
    euro = [tok.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ask = dict(logprobs=True, top_logprobs=1, max_tokens=3, structured_outputs={"regex": "€"})
    body = chat(client, [{"role": "user", "content": "Hi"}], **ask)
    content = body["choices"][0]["logprobs"]["content"]
    by_id = chat(client, [{"role": "user", "content": "Hi"}], **ask, return_tokens_as_token_ids=True)
    assert [int(c["token"].split(":")[1]) for c in by_id["choices"][0]["logprobs"]["content"]] == euro
    assert [c["token"] for c in content] == ["\ufffd"] * 3 and body["choices"][0]["message"]["content"] == "€"
    assert bytes(sum((c["bytes"] for c in content), [])).decode("utf-8") == "€"


def test_return_token_ids(client):
    """vLLM's ``return_token_ids``: the prompt's and the output's token ids beside the text, whole and streamed (the
    prompt's with the first chunk, each chunk's new ids after), equal to what /tokenize and the logprobs say; chat
    puts the prompt's on the response, a completion on each choice; beam search too; off, none of the fields."""
    prompt = "Once upon a time"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}
    whole = client.post("/v1/completions", json={**body, "return_token_ids": True, "n": 2}).json()
    expected_prompt = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    for choice in whole["choices"]:
        by_logprobs = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        assert choice["prompt_token_ids"] == expected_prompt and choice["token_ids"] == by_logprobs
        assert client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == \
            choice["text"].lstrip()
    assert whole["usage"]["completion_tokens"] == 2 * len(whole["choices"][0]["token_ids"])
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    echo = client.post("/v1/completions", json={**body, "return_token_ids": True, "echo": True}).json()["choices"][0]
    assert echo["token_ids"] == whole["choices"][0]["token_ids"]  # (the generated ids, echo or not)

    resp = client.post("/v1/completions", json={**body, "return_token_ids": True, "stream": True})
    chunks = [e for e in events(resp) if e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == expected_prompt
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]

    msgs = [{"role": "user", "content": "Hi"}]
    answer = chat(client, msgs, return_token_ids=True)
    rendered = client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert answer["prompt_token_ids"] == rendered and answer["choices"][0]["token_ids"]
    assert client.post("/detokenize", json={"tokens": answer["choices"][0]["token_ids"]}).json()["prompt"] == \
        answer["choices"][0]["message"]["content"].lstrip()
    assert "prompt_token_ids" not in chat(client, msgs) and "token_ids" not in chat(client, msgs)["choices"][0]
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                     "stream": True, "return_token_ids": True})
    chunks = [e for e in events(resp) if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == rendered and all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == answer["choices"][0]["token_ids"]

    beams = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "n": 2, "use_beam_search": True,
                                                 "return_token_ids": True}).json()["choices"]
    assert len(beams) == 2 and all(c["prompt_token_ids"] == expected_prompt for c in beams)
    for c in beams:
        assert client.post("/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] == c["text"].lstrip()
    beam_chat = chat(client, msgs, n=2, use_beam_search=True, return_token_ids=True)
    assert beam_chat["prompt_token_ids"] == rendered and all(c["token_ids"] for c in beam_chat["choices"])


def test_chat_echo_starts_the_answer_with_the_assistants_last_message(client):
    msgs = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    cont = dict(add_generation_prompt=False, continue_final_message=True)
    plain = chat(client, msgs, **cont)["choices"][0]["message"]["content"]
    echoed = chat(client, msgs, echo=True, **cont)["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                     "echo": True, "stream": True, **cont})
    chunks = events(resp)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""},
                                                              {"content": "Once upon"}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == echoed
    # the last message a user's: nothing to echo under a generation prompt; without one, the answer continues the
    # last message, whoever wrote it (vLLM's rule)
    user_last = [{"role": "user", "content": "Hi"}]
    assert (chat(client, user_last, echo=True)["choices"][0]["message"]["content"]
            == chat(client, user_last)["choices"][0]["message"]["content"])
    own = chat(client, user_last, echo=True, **cont)["choices"][0]["message"]["content"]
    assert own == "Hi" + chat(client, user_last, **cont)["choices"][0]["message"]["content"]


def test_request_chat_template_and_cache_control(client, llm):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]
    ids = client.post("/tokenize", json={"messages": msgs, "chat_template": OTHER_TEMPLATE,
                                         "add_generation_prompt": False}).json()["tokens"]
    assert ids == llm.engine.tokenizer.encode("[user] Hi ")
    body = chat(client, msgs, chat_template=OTHER_TEMPLATE)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert chat(client, msgs)["usage"]["prompt_tokens"] == len(llm.engine.tokenizer.encode("user: Hi\nassistant:"))
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{% for %}"})
    assert resp.status_code == 400 and "could not apply the chat template" in resp.json()["error"]["message"]
    # continue_final_message: a template that drops the last message leaves no place to continue (a 400); an empty
    # last message continues from its start, as transformers renders it
    drops = "{% for m in messages %}{{ m['role'] }}:{% endfor %}"
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": drops, "max_tokens": 2,
                                                     "continue_final_message": True, "add_generation_prompt": False})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "continue_final_message"
    assert "does not render the last message" in resp.json()["error"]["message"]
    empty = [{"role": "user", "content": ""}]
    ids = client.post("/tokenize", json={"messages": empty, "chat_template": OTHER_TEMPLATE,
                                         "continue_final_message": True, "add_generation_prompt": False}).json()
    assert ids["tokens"] == llm.engine.tokenizer.encode("[user] ")
    # vLLM's documents (RAG) reach the template
    rag = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[0].content }}"
    body = chat(client, msgs, chat_template=rag, documents=[{"title": "A", "text": "cats purr"}])
    assert body["usage"]["prompt_tokens"] == len(llm.engine.tokenizer.encode("[A] cats purr\nHi"))
    resp = client.post("/tokenize", json={"prompt": "Hi", "chat_template": OTHER_TEMPLATE})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
    # an empty template is the server's own (vLLM's `request.chat_template or ...`); it read as "no template"
    assert chat(client, msgs, chat_template="")["usage"]["prompt_tokens"] == chat(client, msgs)["usage"][
        "prompt_tokens"]
    # text parts join with a newline, as vLLM joins them (they ran together: "Once upona time")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]}]
    ids = client.post("/tokenize", json={"messages": parts, "add_generation_prompt": False}).json()["tokens"]
    assert ids == llm.engine.tokenizer.encode("user: Once upon\na time\nassistant:")


def test_request_chat_template_needs_the_servers_trust(llm):
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as client:
        resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "chat_template": OTHER_TEMPLATE})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
        image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
        resp = client.post("/v1/chat/completions", json={"messages": [image]})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"].startswith(
            "'messages[0].content': content parts of type 'image_url' are not supported: the models this server runs "
            "read text")


def test_cors_request_id_headers_and_docs(llm):
    """vLLM's defaults allow any origin (a browser client's preflight passes, its answer carries the header); with
    enable_request_id_headers every response carries X-Request-Id (the request's own, else a new one), streams
    included; disable_fastapi_docs drops /docs and /openapi.json."""
    settings = ServerSettings("s", enable_request_id_headers=True, disable_fastapi_docs=True)
    with TestClient(build_app(AsyncEngine(llm.engine), settings)) as client:
        pre = client.options("/v1/completions", headers={"Origin": "http://ui.example", "Access-Control-Request-Method":
                                                         "POST", "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://ui.example")
        body = {"prompt": "Once", "max_tokens": 2}
        resp = client.post("/v1/completions", json=body, headers={"Origin": "http://ui.example",
                                                                  "X-Request-Id": "rid-7"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"
        assert resp.headers["x-request-id"] == "rid-7" and resp.json()["id"] == "cmpl-rid-7"
        fresh = client.post("/v1/completions", json=body).headers["x-request-id"]
        assert len(fresh) == 32 and fresh != "rid-7"
        # control characters or raw bytes in the id (they named the response and were echoed in the header): a 400,
        # its answer carrying a new id
        bad = client.post("/v1/completions", json=body, headers=[("X-Request-Id", b"a\x01b\x7fc")])
        assert bad.status_code == 400 and "printable ASCII" in bad.json()["error"]["message"]
        assert len(bad.headers["x-request-id"]) == 32
        with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                           headers={"X-Request-Id": "s-1"}) as stream:
            assert stream.headers["x-request-id"] == "s-1"
            assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", allowed_origins=()))) as client:
        resp = client.post("/v1/completions", json=body, headers={"Origin": "http://ui.example"})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
        assert "x-request-id" not in resp.headers and client.get("/openapi.json").status_code == 200


def test_metrics_under_vllms_names(llm):
    """Dashboards and autoscalers built for vLLM read its names (labelled model_name): the same figures as the
    nightjar_ ones."""
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("served"))) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 5}).status_code == 200
        lines = dict(line.rsplit(" ", 1) for line in client.get("/metrics").text.splitlines()
                     if line and not line.startswith("#"))
        assert client.head("/metrics").status_code == 200  # (a 405: probes that HEAD it read the server as down)
    label = '{model_name="served"}'
    for vllm, ours in [("vllm:num_requests_running", "nightjar_num_requests_running"),
                       ("vllm:num_requests_waiting", "nightjar_num_requests_waiting"),
                       ("vllm:prompt_tokens_total", "nightjar_prompt_tokens_total"),
                       ("vllm:generation_tokens_total", "nightjar_generation_tokens_total"),
                       ("vllm:num_preemptions_total", "nightjar_preemptions_total"),
                       ("vllm:spec_decode_num_draft_tokens_total", "nightjar_spec_draft_tokens_total")]:
        assert lines[vllm + label] == lines[ours], vllm
    assert float(lines["vllm:generation_tokens_total" + label]) >= 10
    assert lines["vllm:kv_cache_usage_perc" + label] == "0.0"  # (nothing in flight: every page free)
    assert lines['vllm:request_success_total{finished_reason="length",model_name="served"}'] == "2.0"
    for histogram in ("time_to_first_token", "e2e_request_latency", "inter_token_latency"):
        assert lines[f"vllm:{histogram}_seconds_count{label}"] == lines[f"nightjar_{histogram}_seconds_count"]
    # vLLM's per-request token counts and phases (its dashboard's panels): one sample per request
    assert lines[f"vllm:request_generation_tokens_sum{label}"] == "10.0"
    prompt = len(llm.engine.tokenizer.encode("Once"))
    assert lines[f"vllm:request_prompt_tokens_sum{label}"] == f"{2.0 * prompt}"
    for phase in ("queue", "prefill", "decode", "inference"):
        assert lines[f"vllm:request_{phase}_time_seconds_count{label}"] == "2.0", phase


def test_vllm_gauges_and_histograms_read_as_vllms(llm):
    """vLLM's inter-token histogram has one sample per step (the tokens of one speculative step share its time:
    they were 0.0 samples), and its KV usage is the share requests hold: an idle engine asleep reads 0 (it read 1)."""
    from types import SimpleNamespace

    from nightjar_jax.engine.outputs import RequestMetrics
    from nightjar_jax.server.metrics import ServerMetrics

    metrics = ServerMetrics(llm.engine, "m")
    times = [1.0, 1.5, 1.5, 1.5, 2.0]  # (a step that committed three tokens, then one more)
    out = SimpleNamespace(finished=True, outputs=[SimpleNamespace(finish_reason="stop", token_ids=[5] * 5)],
                          prompt_token_ids=[1, 2, 3], metrics=RequestMetrics(0.0, 0.1, 1.0, 2.5, times))
    metrics.on_output(out)
    lines = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if not line.startswith("#"))
    assert lines['vllm:inter_token_latency_seconds_count{model_name="m"}'] == "2.0"
    assert lines["nightjar_inter_token_latency_seconds_count"] == "4.0"
    # the phases: queued 0.1 s, prefill to the first token 0.9 s, decode to the last token 1.0 s, inference 2.4 s
    for phase, seconds in (("queue", 0.1), ("prefill", 0.9), ("decode", 1.0), ("inference", 2.4)):
        assert float(lines[f'vllm:request_{phase}_time_seconds_sum{{model_name="m"}}']) == pytest.approx(seconds)
    assert lines['vllm:request_prompt_tokens_bucket{le="5.0",model_name="m"}'] == "1.0"
    assert lines['vllm:request_prompt_tokens_bucket{le="2.0",model_name="m"}'] == "0.0"
    from nightjar_jax.server.metrics import one_two_five_buckets

    assert one_two_five_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 512)
    assert one_two_five_buckets(500) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    settings = ServerSettings("s", enable_sleep_mode=True)
    with TestClient(build_app(AsyncEngine(llm.engine), settings)) as client:
        assert client.post("/sleep?level=1").status_code == 200
        try:
            text = client.get("/metrics").text
            assert 'vllm:kv_cache_usage_perc{model_name="s"} 0.0' in text and "nightjar_kv_pages_free 0.0" in text
        finally:
            assert client.post("/wake_up").status_code == 200


def test_an_internal_error_carries_the_cors_and_request_id_headers(llm, monkeypatch):
    """Starlette's own 500 handler runs outside every middleware: the answer had neither header (a browser saw an
    opaque CORS failure). Two X-Request-Id headers: the first names both the response and its header."""
    settings = ServerSettings("s", enable_request_id_headers=True)
    with TestClient(build_app(AsyncEngine(llm.engine), settings), raise_server_exceptions=False) as client:
        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(llm.engine, "tokenize_prompt", broken)
        resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                           headers={"Origin": "http://ui.example", "X-Request-Id": "e-1"})
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "internal error: boom"
        assert resp.headers["x-request-id"] == "e-1" and resp.headers["access-control-allow-origin"] == "*"
        monkeypatch.undo()
        resp = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                           headers=[("X-Request-Id", "first"), ("X-Request-Id", "second")])
        assert resp.json()["id"] == "cmpl-first" and resp.headers["x-request-id"] == "first"


def test_responses_take_a_request_id(client):
    """vLLM's ResponsesRequest.request_id names the response as given (it was a 400 as an unknown field)."""
    resp = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "request_id": "resp_mine"})
    assert resp.status_code == 200 and resp.json()["id"] == "resp_mine"


def test_sagemaker_invocations_route_chat_and_completions(client):
    """vLLM's /invocations (SageMaker's route, beside /ping): the body's kind picks the endpoint."""
    chat_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    via = client.post("/invocations", json=chat_body).json()
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == client.post("/v1/chat/completions", json=chat_body).json()["choices"][0][
        "message"]
    done = client.post("/invocations", json={"prompt": "Once", "max_tokens": 3, "temperature": 0, "request_id": "iv"})
    assert done.status_code == 200 and done.json()["id"] == "cmpl-iv" and done.json()["object"] == "text_completion"
    stream = client.post("/invocations", json={**chat_body, "stream": True})
    assert stream.text.rstrip().endswith("data: [DONE]")
    bad = client.post("/invocations", json={"input": "Hi"})
    assert bad.status_code == 400 and "'messages') or a completion request" in bad.json()["error"]["message"]
    assert client.post("/invocations", json={"prompt": 5}).status_code == 400  # (the endpoint's own checks)


def test_a_tool_without_a_parameters_type_takes_an_object(client):
    """A function's parameters are an object's schema (OpenAI's): one that leaves 'type' out is read as an object's,
    so a named call's arguments are a JSON object (a schema without a type let the constraint write a string or a
    number; QA, 2026-12-06)."""
    for params in ({"properties": {}, "additionalProperties": False}, {},
                   {"type": ["object", "null"], "properties": {}, "additionalProperties": False}):  # (an object's)
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        body = chat(client, [{"role": "user", "content": "Hi"}], tools=[tool], max_tokens=40,
                    tool_choice={"type": "function", "function": {"name": "f"}})
        (call,) = body["choices"][0]["message"]["tool_calls"]
        if params:  # (no property allowed: the one object is {})
            assert call["function"]["arguments"] == "{}"
        elif body["choices"][0]["finish_reason"] == "stop":  # (any object: a long one may be cut by max_tokens)
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert call["function"]["arguments"].startswith("{"), call
