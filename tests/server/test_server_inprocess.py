"""The server in process over stories260K, for what the subprocess tests' settings do not cover: a structured
output's constraint compiles off the engine's thread, before its request is queued, so a slow one does not stall the
requests already running; the Responses API counts a thought's tokens as generated (deepseek_r1's parser)."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from nightjar_jax import LLM
from nightjar_jax.engine.structured import GrammarBackend
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine


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


def test_responses_count_the_thoughts_generated_tokens():
    """deepseek_r1 reads an output without ``<think>`` as all thought: its reasoning tokens are every generated
    token. They were the thought's text encoded again, which this tokenizer splits into one more token (a leading
    space of its own): 21 reasoning tokens of 20."""
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64)
    llm.engine.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                          "{% endfor %}assistant:")
    with TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", reasoning_parser="deepseek_r1"))) as client:
        resp = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 20, "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["usage"]["output_tokens"] == 20 and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 20
