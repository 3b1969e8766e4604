"""Structured outputs through the server in process (stories260K): a constraint compiles off the engine's thread,
before its request is queued, so a slow one does not stall the requests already running."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from nightjar_jax import LLM
from nightjar_jax.engine.structured import GrammarBackend
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine


def test_a_constraint_compiles_off_the_engine_thread(monkeypatch):
    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=32)
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
