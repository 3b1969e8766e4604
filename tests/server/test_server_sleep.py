"""The server's sleep-mode endpoints (``serve --enable-sleep-mode``: vLLM's POST /sleep, POST /wake_up, GET
/is_sleeping) over the fake model: requests get a 503 while it sleeps, a sleep is refused while a request is in
flight, and after a wake-up the tokens are exact and every page is free."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import pytest
from fastapi.testclient import TestClient

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import fake_greedy_continuation, fake_model

VOCAB = 97
BODY = {"prompt": [7, 8, 9], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    fake = fake_model(VOCAB, max_len=512)
    target = ModelHandle(fake.config, None, {"w": jnp.ones(4096, jnp.float32)}, fns=fake.fns)
    draft = fake_model(VOCAB, max_len=512, perturb=5)
    config = make_engine_config(model="fake", page_size=4, num_pages=200, max_num_seqs=4, max_model_len=512,
                                num_speculative_tokens=2, planner="static", compilation_cache_dir=None)
    return LLMEngine(config, target=target, draft=draft)


def app_client(engine, **settings) -> TestClient:
    return TestClient(build_app(AsyncEngine(engine), ServerSettings("fake", **settings)))


def completion_ok(client) -> None:
    resp = client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    tokens = resp.json()["usage"]["completion_tokens"]
    assert tokens == 12


def test_sleep_endpoints_need_the_flag(engine):
    with app_client(engine) as client:
        assert client.post("/sleep").status_code == 404
        assert client.post("/wake_up").status_code == 404
        assert client.get("/is_sleeping").status_code == 404


def test_sleep_and_wake_up_over_http(engine):
    before = engine.runner.device_bytes()
    with app_client(engine, enable_sleep_mode=True) as client:
        completion_ok(client)
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        bad = client.post("/sleep", params={"level": "3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        assert "level must be given once, as 1" in bad.json()["error"]["message"]
        for params, param in [({"level": ["1", "2"]}, "level"), ({"lvl": "2"}, "lvl")]:
            resp = client.post("/sleep", params=params)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        resp = client.post("/sleep", json={"level": 2})
        assert resp.status_code == 400 and "takes no body" in resp.json()["error"]["message"]
        assert not engine.is_sleeping

        resp = client.post("/sleep")
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"is_sleeping": True, "level": 1, "freed_bytes": sum(before.values())}
        assert sum(engine.runner.device_bytes().values()) == 0
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.get("/health").status_code == 200
        scraped = client.get("/metrics").text
        assert "nightjar_engine_sleep_level 1.0" in scraped and "nightjar_kv_pages_free 0.0" in scraped

        asleep = client.post("/v1/completions", json=BODY)
        assert asleep.status_code == 503 and "POST /wake_up" in asleep.json()["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code in (400, 503)  # (the fake model has no tokenizer: 400 before the engine is asked)
        again = client.post("/sleep", params={"level": "1"})
        assert again.status_code == 409 and "already asleep" in again.json()["error"]["message"]
        bad_tag = client.post("/wake_up", params={"tags": "kv"})
        assert bad_tag.status_code == 400 and bad_tag.json()["error"]["param"] == "tags"

        assert client.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
        assert client.post("/v1/completions", json=BODY).status_code == 503  # (the KV cache still sleeps)
        assert client.post("/wake_up").json() == {"is_sleeping": False}
        assert engine.runner.device_bytes() == before
        assert "nightjar_engine_sleep_level 0.0" in client.get("/metrics").text
        resp = client.post("/v1/completions", json={**BODY, "prompt": [7, 8, 9]})
        assert resp.status_code == 200
    assert engine.num_free_pages == engine.num_total_pages


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def on_engine_thread(engine, go):
    """``asyncio.run(go(ae))`` with a running ``AsyncEngine`` ``ae`` over ``engine``, stopped after."""
    ae = AsyncEngine(engine)
    ae.start()
    try:
        return asyncio.run(go(ae))
    finally:
        ae.stop()


async def final_output(stream):
    final = None
    while (item := await stream.next()) is not None:
        final = item[1]
    return final


def test_sleep_is_refused_while_a_request_runs(engine):
    """The engine thread runs the sleep between two steps: with a request in flight it is refused (the HTTP
    endpoint answers that with a 409), and the request runs on to its exact end."""
    async def go(ae):
        stream = await ae.add([[7, 8, 9]], [greedy(400)])
        await stream.next()  # it runs
        with pytest.raises(RuntimeError, match="1 request\\(s\\) are unfinished"):
            await ae.call(lambda e: e.sleep(1))
        return await final_output(stream)

    final = on_engine_thread(engine, go)
    assert final.outputs[0].token_ids == fake_greedy_continuation([7, 8, 9], 400, VOCAB)
    assert not engine.is_sleeping and engine.num_free_pages == engine.num_total_pages


def test_sleep_endpoints_take_the_api_key(engine):
    with app_client(engine, enable_sleep_mode=True, api_key="k") as client:
        assert client.post("/sleep").status_code == 401
        assert client.get("/is_sleeping").status_code == 401
        assert client.get("/is_sleeping", headers={"Authorization": "Bearer k"}).json() == {"is_sleeping": False}


def test_greedy_tokens_are_exact_after_a_wake_up(engine):
    async def go(ae):
        assert await ae.call(lambda e: e.sleep(1)) > 0
        with pytest.raises(RuntimeError, match="asleep"):
            await ae.add([[3, 1, 4, 1, 5]], [greedy(9)])
        await ae.call(lambda e: e.wake_up())
        return await final_output(await ae.add([[3, 1, 4, 1, 5]], [greedy(9)]))

    final = on_engine_thread(engine, go)
    assert final.outputs[0].token_ids == fake_greedy_continuation([3, 1, 4, 1, 5], 9, VOCAB)
    assert engine.num_free_pages == engine.num_total_pages


def test_sleep_counts_requests_not_yet_queued(engine, monkeypatch):
    """A request still being tokenized (or compiling its constraint) is in flight: POST /sleep is a 409 then, not a
    200 that left the request a 503 once it reached the engine; the request is served whole."""
    import threading

    arrived, go_on = threading.Event(), threading.Event()
    real = engine.tokenize_prompt

    def slow_tokenize(prompt):
        arrived.set()
        go_on.wait(10)
        return real(prompt)

    monkeypatch.setattr(engine, "tokenize_prompt", slow_tokenize)
    with app_client(engine, enable_sleep_mode=True) as client:
        answers = []
        sender = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=BODY)))
        sender.start()
        assert arrived.wait(10)
        refused = client.post("/sleep")
        go_on.set()
        sender.join(30)
        assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"]
        assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 12
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
