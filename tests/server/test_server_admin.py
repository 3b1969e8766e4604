"""The server's admin surface over the fake model, in process: the API key (which paths need it; an empty key is
none), the sleep endpoints' bodies, and the admin endpoints during a shutdown."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest
from fastapi.testclient import TestClient

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import fake_model

KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def engine():
    fake = fake_model(97, max_len=128)
    target = ModelHandle(fake.config, None, {"w": jnp.ones(64, jnp.float32)}, fns=fake.fns)
    config = make_engine_config(model="fake", page_size=4, num_pages=32, max_num_seqs=2, max_model_len=128,
                                draft_model="none", compilation_cache_dir=None)
    return LLMEngine(config, target=target)


def client_for(engine, **settings) -> TestClient:
    return TestClient(build_app(AsyncEngine(engine), ServerSettings("fake", **settings)))


def test_admin_calls_during_a_shutdown_are_503s(engine, caplog):
    """/sleep, /wake_up and /reset_prefix_cache that come while the engine stops get the 503 generation and updates
    get, not a 500 with a traceback ("the engine still serves", "it is still asleep ()")."""
    ae = AsyncEngine(engine)
    with caplog.at_level(logging.INFO), TestClient(build_app(ae, ServerSettings(
            "fake", enable_sleep_mode=True, enable_weight_updates=True))) as client:
        ae.stop()
        for path, body in (("/sleep", None), ("/wake_up", None), ("/reset_prefix_cache", None),
                           ("/update_weights_from_disk", {"model_path": "org/model"}),  # (a repo id: not checked first)
                           ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})):
            resp = client.post(path, json=body)
            assert resp.status_code == 503, (path, resp.text)
            assert resp.json()["error"]["message"] == "the engine is shutting down", path
            assert resp.json()["error"]["type"] == "server_error"
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_which_paths_need_the_key(engine):
    """Documented (README, --help): /v1/* (an unknown /v1 path or method too: 401 first, as vLLM's), /invocations,
    /tokenize, /detokenize, /reset_prefix_cache and the sleep and update endpoints need it; the probes and
    /metrics do not."""
    with client_for(engine, api_key="k", enable_sleep_mode=True, enable_weight_updates=True) as client:
        for method, path in (("get", "/v1/models"), ("get", "/v1/nonexistent"), ("post", "/v1/models"),
                             ("get", "/v1"), ("post", "/invocations"), ("post", "/tokenize"),
                             ("post", "/detokenize"), ("post", "/reset_prefix_cache"), ("post", "/sleep"),
                             ("post", "/wake_up"), ("get", "/is_sleeping"), ("post", "/update_weights_from_disk")):
            resp = client.request(method, path)
            assert resp.status_code == 401, (method, path, resp.status_code)
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/nonexistent", headers=KEY).status_code == 404
        assert client.post("/v1/models", headers=KEY).status_code == 405
        for path in ("/health", "/ping", "/load", "/version", "/metrics", "/openapi.json"):
            assert client.get(path).status_code == 200, path
        assert client.get("/nonexistent").status_code == 404  # (outside /v1: no key asked, as vLLM's)


def test_an_empty_key_is_no_key(engine):
    with client_for(engine, api_key="") as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 200


def test_sleep_endpoints_take_an_empty_object_as_no_body(engine):
    """Client wrappers send json={} (vLLM ignores the body); a body with anything in it is still a 400 (a misspelt
    level must not sleep at the default one)."""
    with client_for(engine, enable_sleep_mode=True) as client:
        bad = client.post("/sleep", json={"level": 2})
        assert bad.status_code == 400 and "takes no body" in bad.json()["error"]["message"]
        assert client.post("/wake_up", content=b"[]").status_code == 400
        resp = client.post("/sleep", params={"level": "1"}, json={})
        assert resp.status_code == 200, resp.text
        assert resp.json()["level"] == 1
        resp = client.post("/wake_up", content=b" { } ", headers={"Content-Type": "application/json"})
        assert resp.status_code == 200 and resp.json() == {"is_sleeping": False}, resp.text


def test_profiler_endpoints_trace_the_engine_steps(engine, tmp_path):
    """vLLM's /start_profile and /stop_profile, served with --profiler-dir (ServerSettings.profiler_dir) only: a
    trace of the requests between them, written where the answer says, holding the engine's steps; a second start
    or a stop with none running is a 409; without the setting the paths are 404s. The library's hooks
    (LLM.start_profile / stop_profile) are the engine's."""
    import gzip
    import json
    import os

    with client_for(engine) as client:
        assert client.post("/start_profile").status_code == 404
    with client_for(engine, api_key="k", profiler_dir=str(tmp_path / "traces")) as client:
        assert client.post("/start_profile").status_code == 401
        started = client.post("/start_profile", headers=KEY)
        assert started.status_code == 200 and started.json()["profile_dir"] == str(tmp_path / "traces")
        again = client.post("/start_profile", headers=KEY)
        assert again.status_code == 409 and "a profile is already running" in again.json()["error"]["message"]
        done = client.post("/v1/completions", headers=KEY, json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert done.status_code == 200
        stopped = client.post("/stop_profile", headers=KEY)
        assert stopped.status_code == 200
        run = stopped.json()["trace_dir"]
        assert run.startswith(str(tmp_path / "traces" / "plugins" / "profile"))
        (trace,) = [f for f in os.listdir(run) if f.endswith(".trace.json.gz")]
        events = json.loads(gzip.decompress((tmp_path / run / trace).read_bytes()))["traceEvents"]
        assert sum(e.get("name") == "engine_step" for e in events) >= 4  # (a prefill and 3+ decode steps)
        none = client.post("/stop_profile", headers=KEY)
        assert none.status_code == 409 and "no profile is running" in none.json()["error"]["message"]


def test_library_profiler_hooks_say_what_is_wrong(engine, tmp_path, monkeypatch):
    from nightjar_jax import LLM

    llm = LLM.from_engine(engine)
    monkeypatch.delenv("NIGHTJAR_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="start_profile needs a folder for the trace: pass profile_dir"):
        llm.start_profile()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        llm.start_profile(str(tmp_path / "file"))
    with pytest.raises(RuntimeError, match="no profile is running: start_profile"):
        llm.stop_profile()
    monkeypatch.setenv("NIGHTJAR_PROFILER_DIR", str(tmp_path / "env"))
    assert llm.start_profile() == str(tmp_path / "env")
    llm.generate([[1, 2, 3]], use_tqdm=False)
    assert llm.stop_profile().startswith(str(tmp_path / "env" / "plugins" / "profile"))
