"""SGLang's ``POST /update_weights_from_disk`` (``serve --enable-weight-updates``) over stories260K in process: new
weights from a checkpoint on disk serve from the next request, the old ones come back the same way, and a checkpoint
that cannot be loaded (or a sleeping engine) changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from nightjar_jax import LLM
from nightjar_jax.models.loader import load_checkpoint
from nightjar_jax.models.orbax_io import save_orbax
from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine

BODY = {"prompt": [1, 403, 407, 261], "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    llm = LLM("stories260k", max_model_len=128, num_pages=64)
    ckpt = load_checkpoint("stories260k")
    rng = np.random.default_rng(1)
    noisy = {k: np.asarray(v) + (rng.normal(0, 0.3, np.shape(v)).astype(np.float32) if "proj" in k else 0)
             for k, v in ckpt.state_dict.items()}
    path = save_orbax(tmp_path_factory.mktemp("ckpt") / "noisy", ckpt.config, noisy)
    return llm, str(path)


def client_for(llm, **settings) -> TestClient:
    return TestClient(build_app(AsyncEngine(llm.engine), ServerSettings("s", **settings)))


def text(client) -> str:
    resp = client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_the_endpoint_needs_the_flag(setup):
    llm, path = setup
    with client_for(llm) as client:
        assert client.post("/update_weights_from_disk", json={"model_path": path}).status_code == 404


def test_new_weights_from_disk_serve_at_once(setup):
    llm, path = setup
    with client_for(llm, enable_weight_updates=True, enable_sleep_mode=True) as client:
        before = text(client)
        resp = client.post("/update_weights_from_disk", json={"model_path": path})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"success": True, "message": "updated the target weights", "recompiles": False}
        changed = text(client)
        assert changed != before
        for body, param, fragment in [
            ({"model_path": "/nonexistent/ckpt"}, "model_path", "could not be loaded"),
            ({}, "model_path", "give 'model_path'"),
            ({"model_path": path, "load_format": "dummy"}, "load_format", "is not supported"),
            ({"draft_model_path": "stories260k"}, "draft_model_path", "this engine has no draft"),
        ]:
            bad = client.post("/update_weights_from_disk", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            assert fragment in bad.json()["error"]["message"]
        assert text(client) == changed  # (nothing changed)
        # the RL loop's order: sleep, update (which wakes the weights with the new ones), wake the KV cache
        assert client.post("/sleep", params={"level": "2"}).status_code == 200
        assert client.post("/update_weights_from_disk", json={"model_path": "stories260k"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # (the KV cache sleeps on)
        assert client.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
        assert text(client) == before
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_an_update_waits_for_the_requests_in_flight(setup):
    """As SGLang's: requests in flight finish under the old weights, and one sent after the update was asked for
    runs under the new ones: no output mixes them."""
    import asyncio

    from nightjar_jax.engine.sampling_params import SamplingParams

    llm, path = setup
    ae = AsyncEngine(llm.engine)
    ae.start()
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = [1, 403, 407, 261]

    async def final(stream):
        out = None
        while (item := await stream.next()) is not None:
            out = item[1]
        return out.outputs[0].token_ids

    async def go():
        old = await final(await ae.add([prompt], [sp]))  # (the old weights' answer, alone)
        first = await ae.add([prompt], [sp])
        await first.next()  # it runs
        update = asyncio.ensure_future(ae.call(lambda e: e.update_weights(path),
                                               drain=lambda e: e.has_unfinished_requests()))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(ae.add([prompt], [sp]))  # (queued behind the update)
        first_tokens = await final(first)
        await update
        second_tokens = await final(await second)
        new = await final(await ae.add([prompt], [sp]))  # (the new weights' answer, alone)
        await ae.call(lambda e: e.update_weights("stories260k"))
        return old, first_tokens, second_tokens, new

    try:
        old, first_tokens, second_tokens, new = asyncio.run(go())
    finally:
        ae.stop()
    assert old != new
    assert first_tokens == old and second_tokens == new


def test_a_bad_update_is_refused_before_it_waits_or_loads(setup, tmp_path, monkeypatch):
    """A path that does not exist, an empty one, or a checkpoint of another architecture (its config read alone) is
    a 400 before the update waits for the requests in flight (which held every new request meanwhile) or loads a
    whole second model; the error names the fields that differ, not the whole config."""
    import json

    from nightjar_jax.models.orbax_io import CONFIG_FILE, FORMAT_NAME, FORMAT_VERSION

    llm, path = setup
    other = tmp_path / "other"
    other.mkdir()  # (its config alone: loading its weights would fail otherwise)
    config = llm.engine.target.config.replace(vocab_size=1024, num_layers=7).to_dict()
    (other / CONFIG_FILE).write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "config": config}))
    ae = AsyncEngine(llm.engine)
    with TestClient(build_app(ae, ServerSettings("s", enable_weight_updates=True))) as client:
        before = text(client)

        async def never(*args, **kwargs):
            pytest.fail("a bad update reached the engine (a wait for the requests in flight, a load)")

        monkeypatch.setattr(ae, "call", never)
        for body, param, fragments in [
            ({"model_path": "/nonexistent/typo"}, "model_path", ["model path '/nonexistent/typo' does not exist"]),
            ({"model_path": ""}, "model_path", ["model_path must be a non-empty path"]),
            ({"model_path": str(other)}, "model_path", ["of another architecture", "vocab_size 1024 vs 512",
                                                        "num_layers 7 vs 5"]),
            ({"model_path": "smollm2-135m-instruct"}, "model_path", ["vocab_size 49152 vs 512"]),  # (a preset's)
            ({"model_path": "no-such-preset"}, "model_path", ["unknown model preset"]),
            ({"model_path": path, "draft_model_path": "stories260k"}, "draft_model_path", ["has no draft"]),
        ]:
            bad = client.post("/update_weights_from_disk", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            message = bad.json()["error"]["message"]
            assert all(f in message for f in fragments) and "ModelConfig(" not in message, message
        monkeypatch.undo()
        assert text(client) == before


def test_a_bad_draft_beside_a_good_target_is_the_field_named(tmp_path):
    """Both paths given, the draft's a llama2.c file of another architecture (a format whose config is not read
    before the load): the 400 names draft_model_path, not model_path (the QA agent's finding)."""
    import numpy as np

    from nightjar_jax import LLM

    dim, hidden, layers, heads, vocab, seq = 32, 64, 2, 4, 512, 64
    floats = (vocab * dim + layers * dim + 4 * layers * dim * dim + layers * dim + 3 * layers * hidden * dim + dim
              + 2 * seq * (dim // heads // 2))
    other = tmp_path / "other.bin"
    other.write_bytes(np.array([dim, hidden, layers, heads, heads, vocab, seq], np.int32).tobytes()
                      + np.random.default_rng(0).normal(0, 0.02, floats).astype(np.float32).tobytes())
    llm = LLM("stories260k", draft_model="stories260k@skip=2", max_model_len=64, num_pages=16)
    with client_for(llm, enable_weight_updates=True, enable_sleep_mode=True) as client:
        before = text(client)
        bad = client.post("/update_weights_from_disk", json={"model_path": "stories260k",
                                                              "draft_model_path": str(other)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft_model_path", bad.text
        assert "another architecture" in bad.json()["error"]["message"]
        assert text(client) == before
        # asleep at level 2, an update of the target alone loads the draft again from its checkpoint: one that
        # became another model is the server's state, not the request's (a 400 named a field it never sent)
        assert client.post("/sleep", params={"level": 2}).status_code == 200
        real_load = llm.engine._load
        llm.engine._load = lambda spec, tokenizer_spec, dtype=None: (
            real_load(str(other), tokenizer_spec, dtype) if "@skip" in spec else real_load(spec, tokenizer_spec, dtype))
        try:
            failed = client.post("/update_weights_from_disk", json={"model_path": "stories260k"})
        finally:
            llm.engine._load = real_load
        assert failed.status_code == 500 and "could not be loaded again" in failed.json()["error"]["message"]
        assert "the engine still sleeps" in failed.json()["error"]["message"]
        assert client.get("/is_sleeping").json()["is_sleeping"] is True
        assert client.post("/wake_up").status_code == 200 and text(client) == before


def test_sglangs_optional_fields_and_abort_all_requests(setup):
    """SGLang's clients send its request's other fields (abort_all_requests, weight_version, flush_cache, ...): they
    were 400s ("Extra inputs are not permitted"). abort_all_requests ends the requests in flight at once (finish
    reason "abort") instead of waiting for them; weight_version comes back in the answer; what cannot be honoured
    (flush_cache false, keep_pause true) is a 400 naming the field."""
    import json
    import threading

    llm, path = setup
    with client_for(llm, enable_weight_updates=True) as client:
        for body, param in [({"model_path": path, "flush_cache": False}, "flush_cache"),
                            ({"model_path": path, "keep_pause": True}, "keep_pause"),
                            ({"model_path": path, "abort_all_requests": "yes"}, "abort_all_requests")]:
            bad = client.post("/update_weights_from_disk", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        started, chunks = threading.Event(), []

        def stream():
            body = {"prompt": [1, 403, 407, 261], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        resp = client.post("/update_weights_from_disk", json={
            "model_path": path, "abort_all_requests": True, "weight_version": "step-7", "flush_cache": True,
            "is_async": False, "torch_empty_cache": False, "recapture_cuda_graph": False, "token_step": 7})
        reader.join(60)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"success": True, "message": "updated the target weights", "recompiles": False,
                               "num_aborted_requests": 1, "weight_version": "step-7"}
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "abort" and sum(len(c["choices"][0]["text"]) > 0 for c in chunks) < 120
        assert client.post("/update_weights_from_disk", json={"model_path": "stories260k"}).status_code == 200
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
