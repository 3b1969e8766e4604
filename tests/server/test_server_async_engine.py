"""``AsyncEngine`` on the fake model (exact tokens): groups, atomic adds, aborts, step failures, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.server.async_engine import AsyncEngine
from nightjar_jax.testing import fake_greedy_continuation, fake_model

VOCAB = 97


@pytest.fixture(scope="module")
def engine():
    config = make_engine_config(model="fake", page_size=4, num_pages=64, max_num_seqs=4, max_model_len=128)
    return LLMEngine(config, target=fake_model(VOCAB, max_len=128))


@pytest.fixture
def async_engine(engine):
    ae = AsyncEngine(engine)
    ae.start()
    yield ae
    ae.stop()
    assert not ae.is_alive
    assert engine.num_free_pages == engine.num_total_pages


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def drain(stream) -> dict[int, list]:
    outs: dict[int, list] = {}
    async for index, out in stream:
        outs.setdefault(index, []).append(out)
    return outs


def test_group_outputs_exact(async_engine):
    prompts = [[1, 2, 3], [4, 5]]

    async def go():
        stream = await async_engine.add(prompts, [greedy(6), greedy(3)])
        return await drain(stream)

    outs = asyncio.run(go())
    for i, prompt in enumerate(prompts):
        final = outs[i][-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == fake_greedy_continuation(prompt, [6, 3][i], VOCAB)
        streamed = [t for o in outs[i] for t in o.outputs[0].delta_token_ids]
        assert streamed == final.outputs[0].token_ids


def test_bad_member_rejects_whole_group(async_engine, engine):
    async def go():
        await async_engine.add([[1, 2], [1, VOCAB + 5]], [greedy(2), greedy(2)])

    with pytest.raises(ValueError, match="token ids"):
        asyncio.run(go())
    assert engine.requests == {} and not engine.has_unfinished_requests()


def test_abort_frees_pages(async_engine, engine):
    stream_box = {}

    def abort_after_first(out):  # runs on the engine thread: abort lands after a known number of steps
        stream_box["stream"].abort()

    async def go():
        stream = await async_engine.add([[1, 2, 3]], [greedy(100)])
        stream_box["stream"] = stream
        async_engine.hooks.on_output.append(abort_after_first)
        try:
            return await drain(stream)
        finally:
            async_engine.hooks.on_output.remove(abort_after_first)

    outs = asyncio.run(go())
    final = outs[0][-1]
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 100
    assert engine.num_free_pages == engine.num_total_pages


def test_step_failure_errors_requests_and_keeps_serving(async_engine, engine, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device on fire")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def go(prompt):
        return await drain(await async_engine.add([prompt], [greedy(20)]))

    failed = asyncio.run(go([7, 8]))[0][-1]
    assert failed.outputs[0].finish_reason == "error" and "device on fire" in failed.error
    ok = asyncio.run(go([7, 8]))[0][-1]
    assert ok.outputs[0].token_ids == fake_greedy_continuation([7, 8], 20, VOCAB)


def test_stop_aborts_in_flight(engine, caplog):
    ae = AsyncEngine(engine)
    ae.start()

    async def go():
        stream = await ae.add([[1, 2, 3]], [greedy(120)])
        ae.hooks.on_output.append(lambda out: ae.stop())  # from the engine thread itself: must not join
        return await drain(stream)

    final = asyncio.run(go())[0][-1]
    ae._thread.join(10)
    assert not ae.is_alive
    assert final.outputs[0].finish_reason == "abort"
    assert engine.num_free_pages == engine.num_total_pages
    # the count is logged where they are aborted, once (the server's shutdown logged it after the timeout's stop had
    # aborted them: "aborting 0", QA 2026-12-07)
    assert caplog.text.count("shutting down: aborting 1 in-flight request(s)") == 1
    ae.stop()
    assert caplog.text.count("shutting down: aborting") == 1

    async def after():
        await ae.add([[1]], [greedy(1)])

    with pytest.raises(RuntimeError, match="shutting down"):
        asyncio.run(after())


def test_stop_closes_the_engine_on_its_thread(engine, monkeypatch):
    """Stopping ends with ``engine.close()`` (the planner's decision log written out), from the engine thread: a
    server's --planner-log lost its buffered lines on a clean shutdown."""
    closed = []
    monkeypatch.setattr(engine, "close", lambda: closed.append(threading.current_thread().name))
    ae = AsyncEngine(engine)
    ae.start()
    ae.stop()
    assert not ae.is_alive and closed == ["nightjar-engine"]


def test_http_answers_a_failed_step_with_500_and_a_stream_with_an_error_event(engine, monkeypatch):
    """Requests the engine failed on are not answered 200 with finish reason "error": a whole response is a 500
    naming the failure, a stream under way ends with an OpenAI-shaped error event before [DONE]; the server serves on
    and frees every page."""
    import json

    from fastapi.testclient import TestClient

    from nightjar_jax.server.app import ServerSettings, build_app

    real_step = engine.step
    calls = {"n": 0, "fail_at": 2}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("device on fire")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    body = {"prompt": [7, 8], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(AsyncEngine(engine), ServerSettings("fake"))) as client:
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 500, resp.text
        err = resp.json()["error"]
        assert err["type"] == "internal_error" and "device on fire" in err["message"]

        calls.update(n=0, fail_at=4)
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error" and "device on fire" in error["message"]

        calls.update(n=0, fail_at=-1)
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == ""  # (the fake model has no tokenizer)
        assert ok.json()["usage"]["completion_tokens"] == 20
    assert engine.num_free_pages == engine.num_total_pages


def test_group_priority_reaches_the_scheduler():
    """A group's priority (the API's ``priority``) orders admission on a "priority" engine: three groups queued
    behind a request holding the one slot run most urgent first once it is aborted (no timing involved: each add
    returns once the engine thread has queued it)."""
    config = make_engine_config(model="fake", page_size=4, num_pages=600, max_num_seqs=1, max_model_len=2048,
                                scheduling_policy="priority")
    ae = AsyncEngine(LLMEngine(config, target=fake_model(VOCAB, max_len=2048)))
    ae.start()
    finished: list[str] = []

    async def go():
        blocker = await ae.add([[1, 2, 3]], [greedy(2000)], request_id="blocker")
        await blocker.next()  # its first output: it holds the slot
        queued = {name: await ae.add([[1, 2, 3]], [greedy(3)], request_id=name, priority=priority)
                  for name, priority in [("low", 5), ("high", -1), ("mid", 2)]}
        ae.abort(blocker.request_ids)  # the slot frees only now

        async def done(name, stream):
            await drain(stream)
            finished.append(name)

        await asyncio.gather(drain(blocker), *(done(name, stream) for name, stream in queued.items()))

    try:
        asyncio.run(go())
    finally:
        ae.stop()
    assert finished == ["high", "mid", "low"]
    assert ae.engine.num_free_pages == ae.engine.num_total_pages


def test_automatic_ids_never_meet_a_callers(async_engine, engine, monkeypatch):
    """A group without a caller's id (a beam search's steps) gets "req-N", held like a caller's: ids callers hold
    are skipped (a Responses request_id "req-0" made a beam step's "req-0-0" a duplicate, a 400 for a client that
    sent no id), and a caller cannot take one in flight; each is free again once its group ended."""
    async_engine.claim("req-0")
    async_engine.claim("req-1")
    gate, step = threading.Event(), engine.step  # (the group stays in flight until checked: 3 fake steps could end
    monkeypatch.setattr(engine, "step", lambda: (gate.wait(30), step())[1])  # it first on a busy machine)

    async def run():
        stream = await async_engine.add([[1, 2, 3]], [greedy(3)])
        (rid,) = stream.request_ids
        assert rid.rsplit("-", 1)[0] not in ("req-0", "req-1")
        with pytest.raises(ValueError, match="already in use"):
            async_engine.claim(rid.rsplit("-", 1)[0])
        gate.set()
        await drain(stream)
        return rid.rsplit("-", 1)[0]

    base = asyncio.run(run())
    async_engine.claim(base)  # (released when its group ended)
    for held in ("req-0", "req-1", base):
        async_engine.release(held)


def test_stop_answers_queued_adds_at_once(engine, monkeypatch):
    """An add queued behind a long step (a compile on a fresh server) is answered "shutting down" as soon as the
    engine stops, not after the step: a short --shutdown-timeout cancelled such handlers while they waited (bare
    500s, cut streams). What runs is still aborted, and every page comes back."""
    import threading
    import time

    ae = AsyncEngine(engine)
    ae.start()
    in_step, real_step = threading.Event(), engine.step

    def slow_step():
        in_step.set()
        time.sleep(1.5)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)

    async def go():
        running = await ae.add([[1, 2, 3]], [greedy(50)])
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        queued = asyncio.ensure_future(ae.add([[4, 5]], [greedy(5)]))
        await asyncio.sleep(0.05)  # (queued behind the step)
        t0 = time.monotonic()
        threading.Thread(target=ae.stop, daemon=True).start()
        with pytest.raises(RuntimeError, match="shutting down"):
            await queued
        answered = time.monotonic() - t0
        final = (await drain(running))[0][-1]
        return answered, final

    answered, final = asyncio.run(go())
    ae._thread.join(10)
    assert answered < 1.0 and final.outputs[0].finish_reason == "abort"
    assert engine.num_free_pages == engine.num_total_pages


def test_stop_answers_running_groups_while_a_long_step_runs(engine, monkeypatch):
    """A stop that comes while a step runs for seconds (a compile under new load) answers the running groups at
    once: each member's latest output again, finished with reason "abort" (streams end, handlers answer before
    uvicorn's --shutdown-timeout cancels them: QA saw bare 500s and cut streams). The step's own outputs after it
    are dropped, the engine aborts the requests as it stops, and every page comes back."""
    import time

    ae = AsyncEngine(engine)
    ae.start()
    in_step, real_step, slow = threading.Event(), engine.step, threading.Event()

    def maybe_slow_step():
        if slow.is_set():
            in_step.set()
            time.sleep(3.0)
        return real_step()

    monkeypatch.setattr(engine, "step", maybe_slow_step)

    seen = []  # (the metrics hook sees every final output before its consumer does, the shutdown's answers too)
    ae.hooks.on_output.append(lambda out: seen.append(out.request_id) if out.finished else None)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8], [9], [10, 11]]  # (six: max_num_seqs 4 leaves two waiting)
    params = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=1) for _ in prompts]

    async def go():
        running = await ae.add(prompts, params)
        first = await running.next(timeout=10)  # (a token out before the long step)
        slow.set()
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        t0 = time.monotonic()
        threading.Thread(target=ae.stop, daemon=True).start()
        finals = {}
        async for index, out in running:
            assert not out.finished or out.request_id in seen
            finals[index] = out
        return first, finals, time.monotonic() - t0

    first, finals, answered = asyncio.run(go())
    assert answered < 1.5, answered  # (the step runs 3 s)
    assert set(finals) == set(range(6)) and all(o.finished and o.outputs[0].finish_reason == "abort"
                                                for o in finals.values())
    index, out = first  # (a member with an output keeps its tokens; one without has its prompt, no tokens)
    assert finals[index].outputs[0].token_ids[:len(out.outputs[0].token_ids)] == out.outputs[0].token_ids
    waiting = [o for o in finals.values() if not o.outputs[0].token_ids]
    assert waiting and all(o.prompt_token_ids == prompts[i] and o.outputs[0].logprobs == []
                           for i, o in finals.items() if o in waiting)
    ae._thread.join(10)
    assert not ae.is_alive and engine.num_free_pages == engine.num_total_pages


def test_a_beam_search_cut_by_a_shutdown_is_a_503(monkeypatch):
    """A beam search's step (a one-token request, so no output before it ends) that a shutdown during a long step
    answers is a 503 ("shutting down"), as before the shutdown answered running groups itself (it was a 500:
    its aborted step had no log-probabilities to expand)."""
    import time

    from fastapi.testclient import TestClient

    from nightjar_jax.server.app import ServerSettings, build_app
    from nightjar_jax.testing import stories_chat_llm

    llm = stories_chat_llm()
    engine, real_step = llm.engine, llm.engine.step
    ae = AsyncEngine(engine)
    slow, in_step, count = threading.Event(), threading.Event(), [0]

    def maybe_slow_step():
        count[0] += 1
        if slow.is_set() and count[0] > 3:
            in_step.set()
            time.sleep(3.0)
        return real_step()

    monkeypatch.setattr(engine, "step", maybe_slow_step)
    answer = {}
    with TestClient(build_app(ae, ServerSettings("s")), raise_server_exceptions=False) as client:
        slow.set()
        body = {"prompt": "Once upon a time", "max_tokens": 20, "n": 2, "use_beam_search": True}
        asker = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json=body)))
        asker.start()
        assert in_step.wait(60)
        threading.Thread(target=ae.stop, daemon=True).start()
        asker.join(60)
    assert answer["r"].status_code == 503 and "shutting down" in answer["r"].json()["error"]["message"]
    assert engine.num_free_pages == engine.num_total_pages
