"""OpenAI / vLLM request and response shapes, in process over stories260K: ``stop_reason`` on every choice, vLLM's
fields accepted at their neutral values (``null``) and their other values a 400 naming them, completions'
``add_special_tokens``, the chat message shapes OpenAI refuses, ``tool_choice`` "required" with no tools, and the
wording of a few 400s (a ``json_schema`` without ``name``, NaN for a number, the Responses API's paths)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import stories_chat_llm

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm():
    return stories_chat_llm()


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s"))) as c:
        yield c
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def ok(client, path, body):
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def error(client, path, body, raw=None):
    resp = client.post(path, json=body) if raw is None else client.post(
        path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_stop_reason_is_the_stop_string_or_token_id_that_ended_a_choice(client):
    base = {"prompt": "Once", "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    free = ok(client, "/v1/completions", base)["choices"][0]
    assert "stop_reason" in free and free["stop_reason"] is None  # (EOS or the length: None, as vLLM)
    word = free["text"].split()[1]
    stopped = ok(client, "/v1/completions", {**base, "stop": [word]})["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == word
    token = free["token_ids"][2]
    by_id = ok(client, "/v1/completions", {**base, "stop_token_ids": [token]})["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == token
    # streamed: every choice chunk carries the key, null until the one with the finish reason
    frames = events(client.post("/v1/completions", json={**base, "stop": [word], "stream": True}))
    assert all("stop_reason" in f["choices"][0] for f in frames)
    assert [f["choices"][0]["stop_reason"] for f in frames if f["choices"][0]["finish_reason"]] == [word]
    assert all(f["choices"][0]["stop_reason"] is None for f in frames if not f["choices"][0]["finish_reason"])

    chat = {"messages": USER, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    free = ok(client, "/v1/chat/completions", chat)["choices"][0]
    assert "stop_reason" in free and free["stop_reason"] is None
    token = free["token_ids"][1]
    by_id = ok(client, "/v1/chat/completions", {**chat, "stop_token_ids": [token], "n": 2})["choices"]
    assert [(c["finish_reason"], c["stop_reason"]) for c in by_id] == [("stop", token)] * 2
    frames = events(client.post("/v1/chat/completions", json={**chat, "stop_token_ids": [token], "stream": True}))
    last = [f["choices"][0] for f in frames if f["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", token)]
    # beam search: the end-of-sequence token that finished a sequence, as vLLM's (None at the length)
    beams = ok(client, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "n": 2, "use_beam_search": True})
    assert all("stop_reason" in c and (c["stop_reason"] is None) == (c["finish_reason"] == "length")
               for c in beams["choices"])
    beams = ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "n": 2, "use_beam_search": True})
    assert all("stop_reason" in c for c in beams["choices"])


def test_completions_take_add_special_tokens(client, llm):
    base = {"prompt": "Once upon", "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    ids = llm.engine.tokenizer.encode("Once upon", add_special_tokens=False)
    with_bos = ok(client, "/v1/completions", base)["choices"][0]["prompt_token_ids"]
    assert with_bos[1:] == ids and with_bos[0] != ids[0]
    for body in ({**base, "add_special_tokens": False}, {**base, "add_special_tokens": False, "echo": True}):
        out = ok(client, "/v1/completions", body)
        assert out["choices"][0]["prompt_token_ids"] == ids and out["usage"]["prompt_tokens"] == len(ids)
        assert not body.get("echo") or out["choices"][0]["text"].startswith("Once upon")
    assert ok(client, "/v1/completions", {**base, "add_special_tokens": True})["choices"][0]["prompt_token_ids"] \
        == with_bos
    # token ids are the prompt as given
    out = ok(client, "/v1/completions", {**base, "prompt": with_bos, "add_special_tokens": False})
    assert out["choices"][0]["prompt_token_ids"] == with_bos
    beam = ok(client, "/v1/completions", {**base, "add_special_tokens": False, "use_beam_search": True})
    assert beam["choices"][0]["prompt_token_ids"] == ids
    assert error(client, "/v1/completions", {**base, "add_special_tokens": "no"})["param"] == "add_special_tokens"


# vLLM's request fields whose default is None, accepted at it (and at their other neutral values)
NEUTRAL = [
    ("guided_decoding_backend", None), ("guided_whitespace_pattern", None), ("cache_salt", None),
    ("kv_transfer_params", None), ("vllm_xargs", None), ("vllm_xargs", {}), ("logits_processors", None),
    ("logits_processors", []),
]
CHAT_NEUTRAL = [("documents", None), ("mm_processor_kwargs", None), ("mm_processor_kwargs", {}),
                ("thinking_token_budget", None), ("functions", None), ("function_call", None)]
# and a 400 naming the field (and what it takes) at any other value
NOT_SERVED = [
    ("/v1/completions", "guided_decoding_backend", "outlines", "allowed 'xgrammar' or 'auto'"),
    ("/v1/chat/completions", "guided_whitespace_pattern", r"[\n ]*", "is not supported by this server"),
    ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}, "is not supported by this server"),
    ("/v1/completions", "vllm_xargs", {"a": 1}, "is not supported by this server"),
    ("/v1/chat/completions", "logits_processors", ["my.module:Proc"], "is not supported by this server"),
    ("/v1/completions", "prompt_embeds", "AAAA", "send the prompt as text or token ids"),
    ("/v1/chat/completions", "mm_processor_kwargs", {"x": 1}, "is not supported by this server"),
    ("/v1/chat/completions", "thinking_token_budget", 100, "is not supported by this server"),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}], "use 'tools'"),
    ("/v1/chat/completions", "function_call", "auto", "use 'tool_choice'"),
]


def test_vllm_fields_are_accepted_at_their_neutral_values(client):
    for name, value in NEUTRAL:
        ok(client, "/v1/completions", {"prompt": "Once", "max_tokens": 2, name: value})
        ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, name: value})
    for name, value in CHAT_NEUTRAL:
        ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, name: value})
    ok(client, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "prompt_embeds": None})
    # xgrammar runs the structured outputs: naming it (or "auto") is fine
    for backend in ("xgrammar", "auto"):
        out = ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "guided_choice": ["yes", "no"],
                                                  "guided_decoding_backend": backend})
        assert out["choices"][0]["message"]["content"] in ("yes", "no")
    for path, name, value, fragment in NOT_SERVED:
        body = {"prompt": "Once"} if path == "/v1/completions" else {"messages": USER}
        err = error(client, path, {**body, "max_tokens": 2, name: value})
        assert err["param"] == name and fragment in err["message"], (name, err)


@pytest.mark.parametrize("messages,param,fragment", [
    ([{"role": "user"}], "messages[0].content", "a user message needs 'content'"),
    ([{"role": "system", "content": None}, *USER], "messages[0].content", "a system message needs 'content'"),
    ([{"role": "developer"}, *USER], "messages[0].content", "a developer message needs 'content'"),
    ([{"role": "assistant"}], "messages[0].content", "needs 'content' or 'tool_calls'"),
    ([{"role": "user", "content": []}], "messages[0].content", "at least one text part"),
    ([*USER, {"role": "assistant", "content": "x", "tool_calls": "bad"}], "messages[1].tool_calls",
     "a list of tool calls"),
    ([*USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}], "messages[1].tool_calls",
     "a list of tool calls"),
    ([*USER, {"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}], "messages[1].tool_calls",
     "a list of tool calls"),
    ([*USER, {"role": "tool", "content": "42"}], "messages[1].tool_call_id", "a tool message needs 'tool_call_id'"),
    ([*USER, {"role": "tool", "content": "42", "tool_call_id": 5}], "messages[1].tool_call_id", ""),
    ([*USER, {"role": "tool", "tool_call_id": "c1"}], "messages[1].content", "a tool message needs 'content'"),
])
def test_chat_messages_openai_refuses_are_400s(client, messages, param, fragment):
    for path in ("/v1/chat/completions", "/tokenize"):
        err = error(client, path, {"messages": messages, "max_tokens": 2} if path != "/tokenize"
                    else {"messages": messages})
        assert err["param"] == param and fragment in err["message"], err


def test_chat_messages_openai_takes_are_served(client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for messages in ([{"role": "user", "content": ""}],
                     [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1",
                                                                           "content": "42"}],
                     [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}],
                     [*USER, {"role": "assistant", "content": None, "refusal": "I can't"}, *USER]):
        ok(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})


def test_tokenize_refuses_empty_messages_as_chat_does(client):
    chat = error(client, "/v1/chat/completions", {"messages": []})
    tok = error(client, "/tokenize", {"messages": []})
    assert chat["param"] == tok["param"] == "messages" and chat["message"] == tok["message"]


def test_tokenize_checks_tools_as_chat_does(client):
    """A malformed tool on /tokenize was the template's TypeError blamed on 'messages', and one without its 'type'
    a 200 there and a 400 on chat (QA, 2026-12-07)."""
    for tools in ([{"type": "function"}], [{"function": {"name": "f", "parameters": {"type": "object"}}}]):
        chat = error(client, "/v1/chat/completions", {"messages": USER, "tools": tools})
        tok = error(client, "/tokenize", {"messages": USER, "tools": tools})
        assert chat["param"] == tok["param"] == "tools" and chat["message"] == tok["message"]
        assert "'tools'[0] must be {'type': 'function'" in tok["message"]


def test_tool_choice_required_or_auto_with_no_tools_is_none(client):
    """"required" beside an empty tools list generates plainly (vLLM's rule), and so does "auto" (no tool to call:
    it was a 400 here; vLLM's needs --enable-auto-tool-choice); tools missing or null beside a tool_choice is a 400."""
    plain = ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "temperature": 0})
    for choice in ("required", "auto"):
        out = ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "temperature": 0, "tools": [],
                                                  "tool_choice": choice})
        assert out["choices"][0]["message"] == plain["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "length" and "tool_calls" not in out["choices"][0]["message"]
    ok(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": [], "tool_choice": "required",
                                        "use_beam_search": True})
    # a named function must be among the tools; "required" without a tools list is still a 400
    named = {"type": "function", "function": {"name": "get_weather"}}
    err = error(client, "/v1/chat/completions", {"messages": USER, "tools": [], "tool_choice": named})
    assert err["param"] == "tool_choice" and "'get_weather'" in err["message"]
    for choice in ("required", "auto"):
        err = error(client, "/v1/chat/completions", {"messages": USER, "tool_choice": choice})
        assert err["param"] == "tool_choice" and "needs 'tools'" in err["message"]


def test_json_schema_needs_a_name(client):
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    for path, body in (("/v1/completions", {"prompt": "Once"}), ("/v1/chat/completions", {"messages": USER})):
        err = error(client, path, {**body, "max_tokens": 4, "response_format": fmt})
        assert err["param"] == "response_format" and "'response_format.json_schema.name'" in err["message"]
        assert "{'name': ..., 'schema': {...}}" in err["message"]


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", "NaN", "in [0, 100]"), ("temperature", "Infinity", "in [0, 100]"),
    ("top_p", "NaN", "in (0, 1]"), ("min_p", "-Infinity", "in [0, 1]"),
    ("presence_penalty", "NaN", "in [-2, 2]"), ("frequency_penalty", "Infinity", "in [-2, 2]"),
    ("repetition_penalty", "NaN", "in [0.000001, 100]"), ("length_penalty", "NaN", ""),
])
def test_a_number_that_is_not_finite_says_so(client, field, value, allowed):
    for path, body in (("/v1/completions", '"prompt": "Once"'),
                       ("/v1/chat/completions", f'"messages": {json.dumps(USER)}')):
        err = error(client, path, None, raw=f'{{{body}, "max_tokens": 2, "{field}": {value}}}')
        assert err["param"] == field and "must be a finite number" in err["message"] and allowed in err["message"]
        assert f"(got {value})" in err["message"] and "less than" not in err["message"], err
    err = error(client, "/v1/completions", None, raw='{"prompt": "Once", "logit_bias": {"5": NaN}}')
    assert err["param"] == "logit_bias.5" and "must be a finite number" in err["message"], err


def test_responses_errors_spell_the_path_as_param(client):
    for item, param in (({"role": "user", "content": [{"type": "input_image"}]}, "input[0].content"),
                        ({"role": "user", "content": 5}, "input[0].content"),
                        ({"type": "function_call"}, "input[0]")):
        err = error(client, "/v1/responses", {"input": [item]})
        assert err["param"] == param and err["message"].startswith(f"'{param}'"), err


def test_store_is_taken_and_nothing_stored(client):
    """OpenAI's stored completions: vLLM takes ``store`` true and keeps nothing (SDKs send it); it was a 400 here."""
    body = {"messages": USER, "max_tokens": 2, "temperature": 0}
    assert ok(client, "/v1/chat/completions", {**body, "store": True})["choices"][0]["message"] == ok(
        client, "/v1/chat/completions", body)["choices"][0]["message"]
    assert ok(client, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "store": True})["choices"]
