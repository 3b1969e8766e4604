"""End-to-end tests of the OpenAI-compatible server: a real ``python -m nightjar_jax.serve`` subprocess on a
loopback port with stories260k, driven by the official ``openai`` client and raw ``httpx`` for bad input."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

API_KEY = "test-key"
MODEL = "tiny-stories"
CHAT_TEMPLATE = ("{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n"
                 "{% endif %}{% if greeting is defined %}{{ greeting }}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
NUM_PAGES = 257  # 256 usable pages of 16 tokens: 64 concurrent requests of <= 64 tokens fit
MAX_MODEL_LEN = 256


SERVER_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "8",
    "--num-pages",
    str(NUM_PAGES),
    "--api-key",
    API_KEY,
    "--served-model-name",
    MODEL,
    "tiny",
    "--chat-template",
    CHAT_TEMPLATE,
    "--shutdown-timeout",
    "3",
    "--enable-auto-tool-choice",
    "--reasoning-parser",
    "qwen3",
    "--enable-sleep-mode",
    "--enable-weight-updates",
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path, body, *, key=API_KEY, raw=None, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


# ---- happy paths ------------------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").json() == httpx.post(server.url + "/ping").json() == {"status": "ok"}
    from nightjar_jax import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny"]  # (--served-model-name with two names)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump() == models.data[0].model_dump()
    assert client.models.retrieve("tiny").id == "tiny"
    answer = client.completions.create(model="tiny", prompt="Once", max_tokens=2)
    assert answer.model == MODEL  # (responses carry the first name, as vLLM)
    with pytest.raises(openai.NotFoundError, match="does not exist; this server serves 'tiny-stories' .also named "
                                                   "'tiny'."):
        client.completions.create(model="gpt-4", prompt="Once", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    assert httpx.get(server.url + f"/v1/models/{MODEL}").status_code == 401  # (no key)


def test_completion_usage_and_stream_match(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    resp = client.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_continuous_usage_stats_in_every_chunk(server):
    body = {**GOOD, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    frames = [json.loads(line[6:]) for line in post(server, "/v1/completions", body).text.splitlines()
              if line.startswith("data: {")]
    per_choice: dict[int, list[int]] = {}
    for frame in frames[:-1]:
        usage = frame["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        per_choice.setdefault(frame["choices"][0]["index"], []).append(usage["completion_tokens"])
    assert sorted(per_choice) == [0, 1]
    for counts in per_choice.values():  # each choice's own count, growing to its max_tokens
        assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 24
    # chat: each choice's role chunk carries its usage too (its prompt, nothing generated yet), as vLLM's
    chat = {**CHAT, "max_tokens": 4, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    frames = [json.loads(line[6:]) for line in post(server, "/v1/chat/completions", chat).text.splitlines()
              if line.startswith("data: {")]
    roles = [f for f in frames if f["choices"] and f["choices"][0]["delta"].get("role")]
    assert len(roles) == 2 and all(f["usage"]["completion_tokens"] == 0 for f in roles)
    assert all("usage" in f for f in frames)
    assert roles[0]["usage"]["prompt_tokens"] == frames[-1]["usage"]["prompt_tokens"] > 0  # (one prompt, n = 2)
    body["stream_options"] = {"continuous_usage_stats": True}  # (as vLLM: it takes effect with include_usage)
    frames = [json.loads(line[6:]) for line in post(server, "/v1/completions", body).text.splitlines()
              if line.startswith("data: {")]
    assert frames and all("usage" not in f for f in frames)


def test_tokenize_and_detokenize(server, client):
    """vLLM's /tokenize and /detokenize: the ids the completion endpoints count (usage), and back."""
    resp = post(server, "/tokenize", {"model": MODEL, "prompt": "Once upon a time"}).json()
    assert resp == {"count": 5, "max_model_len": MAX_MODEL_LEN, "tokens": [1, 403, 407, 261, 378]}
    bare = post(server, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert bare["tokens"] == [403, 407, 261, 378]
    spelled = post(server, "/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}).json()
    assert spelled["token_strs"] == ["<s>", "\u2581Once", "\u2581upon", "\u2581a", "\u2581time"]  # (vLLM's field)
    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])
    # vLLM's add_special_tokens on chat: false encodes the template's text alone (stories260K adds a BOS otherwise)
    bare_chat = post(server, "/tokenize", {"messages": messages, "add_special_tokens": False}).json()
    assert bare_chat["tokens"] == chat["tokens"][1:]
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"add_special_tokens": False}).usage
    assert usage.prompt_tokens == bare_chat["count"]
    # special tokens written out, as vLLM's /detokenize decodes them (they were dropped: [1] read "")
    assert post(server, "/detokenize", {"tokens": [1, 403, 407, 261, 378]}).json() == {"prompt": "<s> Once upon a time"}
    assert post(server, "/detokenize", {"tokens": [403, 407, 261, 378, 2]}).json() == {"prompt": "Once upon a time</s>"}
    for path, body in [("/tokenize", {"prompt": "x", "messages": messages}), ("/tokenize", {}),
                       ("/detokenize", {"tokens": [1, 99999]}), ("/detokenize", {"tokens": "abc"}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})]:
        r = post(server, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["message"], (path, body)
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401


def test_logit_bias(client, server):
    """OpenAI's logit_bias: +100 on one token makes greedy decoding repeat it; the ids must be the vocabulary's."""
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                      logit_bias={"403": 100}, logprobs=0)
    lp = resp.choices[0].logprobs
    assert len(set(lp.tokens)) == 1 and lp.tokens[0].strip() == "Once"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"403": 100})
    assert chat.choices[0].message.content.split() == ["Once"] * 3


def test_penalties_are_served(client):
    """stories260K's greedy story repeats " park" / " She"; penalties of 2 + 2 per time steer it off after "in the
    park" (same prefix, then " with her friends" where plain decoding goes on to "."; deterministic, greedy)."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    again = client.completions.create(**kw, presence_penalty=0.0, frequency_penalty=0.0).choices[0].text
    penalized = client.completions.create(**kw, presence_penalty=2.0, frequency_penalty=2.0)
    text = penalized.choices[0].text
    assert again == plain and penalized.usage.completion_tokens == 48
    prefix = ", there was a little girl named Lily. She loved to play outside in the park"
    assert plain.startswith(prefix + ".") and text.startswith(prefix + " with her friends")
    # vLLM's repetition_penalty (an extra field): 1 is off; 1.5 over prompt and output steers the text elsewhere
    assert client.completions.create(**kw, extra_body={"repetition_penalty": 1.0}).choices[0].text == plain
    repeated = client.completions.create(**kw, extra_body={"repetition_penalty": 1.5})
    assert repeated.usage.completion_tokens == 48 and repeated.choices[0].text != plain


def test_chat_completion(client):
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = text[: text.index(stop)]
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    # vLLM's min_tokens: no stop before that many tokens (the stop string comes earlier, so the text runs on)
    late = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 12})
    assert late.choices[0].text.startswith(cut + stop) and late.usage.completion_tokens >= 12


def test_seed_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt="The dog", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    many = client.completions.create(**kw, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a  # sample j uses seed + j
    assert many.usage.completion_tokens == sum(1 for _ in range(3)) * 12
    again = client.completions.create(**kw, n=3)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    assert len({c.text for c in many.choices}) > 1


def test_prompt_forms(client, server):
    tok_prompt = client.completions.create(model=MODEL, prompt="Once", max_tokens=1, temperature=0)
    assert tok_prompt.usage.prompt_tokens >= 1
    ids = [1, 403, 407]
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert one.usage.prompt_tokens == 3 and len(one.choices) == 1
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert two.usage.prompt_tokens == 5 and len(two.choices) == 2
    assert two.choices[0].text == one.choices[0].text
    strs = client.completions.create(model=MODEL, prompt=["Once", "The cat"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in strs.choices] == [0, 1, 2, 3]
    assert strs.choices[0].text == strs.choices[1].text  # greedy: same prompt, same text


def test_common_openai_fields_accepted(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=2,
        user="u1",
        presence_penalty=0,
        frequency_penalty=0,
        echo=False,
        logprobs=None,
    )
    assert resp.choices[0].text is not None
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        user="u1",
        logprobs=False,
        presence_penalty=0,
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    # what the SDK sends at neutral values, and OpenAI's newer fields beside 'user' (they were 400s as unknown)
    # (in extra_body: the same JSON whatever the installed SDK's version knows)
    neutral = dict(n=None, extra_body={"safety_identifier": "s1", "prompt_cache_key": "k1", "reasoning_effort": None,
                                       "spaces_between_special_tokens": True,
                                       "verbosity": None, "modalities": ["text"], "audio": None, "prediction": None,
                                       "web_search_options": None, "prompt_cache_retention": None,
                                       "moderation": None, "prompt_cache_options": {}})
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True, **neutral,
                                                 stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=None, extra_body={
        "safety_identifier": "s1", "prompt_cache_key": "k1"}).choices[0].text is not None
    responses = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body={
        "safety_identifier": "s1", "prompt": None, "conversation": None, "max_tool_calls": None, "moderation": {},
        "prompt_cache_options": {}, "access_programs": None, "background_options": None, "context_management": [],
        "image": None})
    assert responses.usage.output_tokens == 2


def test_logprobs_completions_and_chat(client):
    """Log-probabilities in OpenAI's two shapes; streamed chunks carry the same values as the whole response."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3)
    resp = client.completions.create(**kw)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == resp.choices[0].text  # greedy, no stop string: the tokens spell the text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) <= 3 and top[token] == value  # greedy: the token is the top-1
        assert max(top.values()) == value
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices[0].logprobs), []) == pytest.approx(
        lp.token_logprobs)
    assert sum((c.choices[0].logprobs.text_offset for c in chunks if c.choices[0].logprobs), []) == lp.text_offset

    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:
        assert [t.token for t in item.top_logprobs][0] == item.token and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode("utf-8") == item.token
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = sum((c.choices[0].logprobs.content for c in stream if c.choices and c.choices[0].logprobs), [])
    # (the same tokens; the values up to rounding: the second request's prefill may start after cached pages, a
    # differently shaped pass)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content] == [[]] * 6
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_tool_calls(client, server):
    """``tool_choice`` naming a function: its arguments, constrained to its parameters' schema, as a tool call;
    ``required``: calls of the tools (one with ``parallel_tool_calls`` false); streamed, the calls come whole in the
    last chunk; ``none``: text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=64, temperature=0)
    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7 and len(args["city"]) <= 12
    # (stories260K, unbounded, keeps adding calls: parallel_tool_calls false makes it one)
    answered = client.chat.completions.create(**{**kw, "max_tokens": 128}, tool_choice="required",
                                              parallel_tool_calls=False)
    required = answered.choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    for call in required.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        assert set(json.loads(call.function.arguments)) == ({"city", "days"} if call.function.name == "get_weather"
                                                            else {"zone"})
    chunks = list(client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [c for d in deltas for c in d.tool_calls or []]
    # the arguments stream as they are written (they came whole, in the last chunk): the first delta carries the
    # call's id, type and name, the rest more of its arguments
    assert len(streamed) > 2 and {c.index for c in streamed} == {0} and streamed[0].function.name == "get_weather"
    assert streamed[0].id.startswith("chatcmpl-tool-") and not any(c.id or c.function.name for c in streamed[1:])
    assert "".join(c.function.arguments for c in streamed) == choice.message.tool_calls[0].function.arguments
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "stop"
    # required: each call once its name is complete, then its arguments as they come
    chunks = list(client.chat.completions.create(**{**kw, "max_tokens": 128}, tool_choice="required",
                                                 parallel_tool_calls=False, stream=True))
    streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert len(streamed) > 2 and {c.index for c in streamed} == {0} and not any(c.id for c in streamed[1:])
    (want,) = required.message.tool_calls
    assert streamed[0].function.name == want.function.name
    assert "".join(c.function.arguments for c in streamed) == want.function.arguments  # (raw text both ways)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # cut short: the calls named so far (their arguments as far as they go), or content before any name, alike
    # whole and streamed (a stream cut before a name carried nothing at all)
    kinds = []
    for max_tokens in (4, answered.usage.completion_tokens - 3):
        short = {**kw, "max_tokens": max_tokens, "tool_choice": "required", "parallel_tool_calls": False}
        whole = client.chat.completions.create(**short).choices[0]
        chunks = list(client.chat.completions.create(**short, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        pieces = [c for d in deltas for c in d.tool_calls or []]
        assert whole.finish_reason == chunks[-1].choices[0].finish_reason == "length"
        kinds.append("calls" if whole.message.tool_calls else "content")
        if whole.message.tool_calls:
            (cut,) = whole.message.tool_calls
            assert (pieces[0].function.name, "".join(c.function.arguments for c in pieces)) == (
                cut.function.name, cut.function.arguments)
            assert not whole.message.content and not any(d.content for d in deltas)
        else:
            assert not pieces and whole.message.content and "".join(d.content or "" for d in deltas) == (
                whole.message.content)
    assert kinds == ["content", "calls"]  # (4 tokens end inside the first name, 3 short of the whole in its arguments)
    # a tool whose parameters refer to their own "$defs" (pydantic's form): under "required" the definitions move
    # to the combined schema's top, where "#/$defs/..." resolves (they were a 400 that the schema does not compile)
    located = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                            "required": ["city"], "additionalProperties": False}}}}}
    refs = client.chat.completions.create(**{**kw, "tools": [located, CLOCK]}, tool_choice="required",
                                          parallel_tool_calls=False).choices[0]
    assert refs.finish_reason == "tool_calls"
    for call in refs.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert (set(args), set(args.get("at", {}))) in (({"at"}, {"city"}), ({"zone"}, set()))
    plain = client.chat.completions.create(**{**kw, "max_tokens": 4}, tool_choice="none")
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    # the template rendered the tools (their names before the messages)
    rendered = "tools: get_weather, get_time\nuser: What is the weather in Paris?\nassistant:"
    assert plain.usage.prompt_tokens == post(server, "/tokenize", {"prompt": rendered}).json()["count"]
    tokenized = post(server, "/tokenize", {"messages": messages, "tools": [WEATHER, CLOCK]}).json()
    assert tokenized["count"] == plain.usage.prompt_tokens
    bad = post(server, "/tokenize", {"prompt": rendered, "tools": [WEATHER]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


# What a model taught to call tools would write; stories260K is made to write it by a regex constraint, which
# tool_choice "auto" leaves to the request.
CALL_REGEX = (r'Let me see\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": '
              r'[1-7]\}\}</tool_call>')


def test_auto_tool_choice(client, server):
    """``tool_choice`` "auto" (the server runs with --enable-auto-tool-choice, parser hermes): calls the model
    writes come back as tool calls and the rest as content, whole or streamed (each call whole, once its block
    closes); a plain answer stays content; ``parallel_tool_calls`` false keeps the first call; a block that is not
    a call stays in the content as written."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=96, temperature=0)
    called = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": CALL_REGEX}}).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content == "Let me see. "
    (call,) = called.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7

    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 extra_body={"structured_outputs": {"regex": CALL_REGEX}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me see. "
    assert not any("<tool" in (d.content or "") for d in deltas)
    streamed = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    two = CALL_REGEX + "\n" + CALL_REGEX.replace("Let me see\\. ", "")
    both = client.chat.completions.create(**{**kw, "max_tokens": 192},
                                          extra_body={"structured_outputs": {"regex": two}}).choices[0]
    assert [c.function.name for c in both.message.tool_calls] == ["get_weather", "get_weather"]
    assert both.message.content == "Let me see. "  # (the newline between the blocks is no content, as vLLM's)
    one = client.chat.completions.create(**{**kw, "max_tokens": 192}, parallel_tool_calls=False,
                                         extra_body={"structured_outputs": {"regex": two}}).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"

    # the next turn: the assistant's call (no content) and the tool's result go back through the template
    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = client.chat.completions.create(**{**kw, "messages": follow, "max_tokens": 6})
    rendered = post(server, "/tokenize", {"messages": follow, "tools": [WEATHER, CLOCK]}).json()
    assert answer.choices[0].message.content and answer.usage.prompt_tokens == rendered["count"]
    assert "18 C, sunny" in post(server, "/detokenize", {"tokens": rendered["tokens"]}).json()["prompt"]

    # a lone surrogate escape in the arguments (UTF-8 cannot carry the character): escaped, not a 500 or a cut stream
    lone = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "\\ud800"\}\}</tool_call>'
    for stream in (False, True):
        out = client.chat.completions.create(**kw, stream=stream, extra_body={"structured_outputs": {"regex": lone}})
        calls = [c for ch in out for c in ch.choices[0].delta.tool_calls or []] if stream else \
            out.choices[0].message.tool_calls
        assert [c.function.arguments for c in calls] == ['{"city": "\\ud800"}']

    plain = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]  # (auto is the default)
    assert plain.message.content and plain.message.tool_calls is None and plain.finish_reason == "length"
    broken = client.chat.completions.create(
        **kw, extra_body={"structured_outputs": {"regex": "<tool_call>(oops|nope)</tool_call>"}}).choices[0]
    assert broken.message.tool_calls is None and broken.finish_reason == "stop"
    assert broken.message.content in ("<tool_call>oops</tool_call>", "<tool_call>nope</tool_call>")


def test_reasoning_parser(client):
    """``--reasoning-parser qwen3``: an answer that opens with <think> returns the thought as ``reasoning_content``
    and the rest as ``content``, whole or streamed (the pieces joined are the same), beside tool calls too; an
    answer without one is all content. (stories260K is made to think by a regex, which leaves room for it.)"""
    messages = [{"role": "user", "content": "Is it raining?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    thought = r"<think>(I|We) should look outside\.</think>It is (raining|dry)\."
    whole = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": thought}}).choices[0]
    assert whole.message.reasoning_content in ("I should look outside.", "We should look outside.")
    assert whole.message.content in ("It is raining.", "It is dry.") and whole.finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 extra_body={"structured_outputs": {"regex": thought}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.message.content
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)

    call = r'<think>Use the tool\.</think><tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    both = client.chat.completions.create(**{**kw, "max_tokens": 160}, tools=[WEATHER, CLOCK],
                                          extra_body={"structured_outputs": {"regex": call}}).choices[0]
    assert both.message.reasoning_content == "Use the tool." and both.message.content is None
    assert [c.function.name for c in both.message.tool_calls] == ["get_time"] and both.finish_reason == "tool_calls"

    plain = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]
    assert plain.message.content and plain.message.reasoning_content is None


def sse_events(server, path, body) -> list[dict]:
    """A streamed response's events (the JSON of each ``data:`` line before ``[DONE]``)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_prompt_logprobs(server):
    """vLLM's ``prompt_logprobs``: per prompt token (the first null) its log-probability and the k most likely
    tokens', the same values echo shows and the same streamed (with a choice's first chunk) or not; chat puts
    them at the top of the response, as vLLM."""
    body = {"model": MODEL, "prompt": "Once upon a time there was", "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 2}
    whole = post(server, "/v1/completions", body).json()
    (choice,) = whole["choices"]
    plp = choice["prompt_logprobs"]
    ids = post(server, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    assert len(plp) == len(ids) == whole["usage"]["prompt_tokens"] and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]  # (the top 2, the prompt's token maybe one)
    echoed = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    values = echoed["logprobs"]["token_logprobs"][:len(ids)]
    assert values[1:] == [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert all(len(top) <= 2 for top in echoed["logprobs"]["top_logprobs"][1:len(ids)])  # (echo's own k)
    events = sse_events(server, "/v1/completions", body)
    assert [e["choices"][0].get("prompt_logprobs") for e in events if e["choices"]][0] == plp
    assert sum("prompt_logprobs" in e["choices"][0] for e in events if e["choices"]) == 1

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 3,
            "temperature": 0, "prompt_logprobs": 0}
    answer = post(server, "/v1/chat/completions", chat).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in answer["prompt_logprobs"][1:])  # (k = 0: the prompt's own token alone)
    events = sse_events(server, "/v1/chat/completions", chat)
    assert [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e] == [answer["prompt_logprobs"]]
    bad = post(server, "/v1/completions", {**body, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_responses_api(client, server):
    """OpenAI's Responses API, stateless: the input (text, or messages, after the instructions) answered as the
    chat endpoint answers the same messages, whole or streamed through the SDK's typed events; max_output_tokens
    makes it incomplete; text.format constrains it; store true is taken (nothing kept); previous_response_id or
    tool requests are 400s naming the field."""
    kw = dict(model=MODEL, max_output_tokens=12, temperature=0)
    resp = client.responses.create(input="Tell me a story.", instructions="Be brief.", **kw)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}])
    assert resp.output_text == chat.choices[0].message.content and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"

    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}]
    assert client.responses.create(input=parts, **kw).output_text == client.responses.create(
        input="Tell me a story.", **kw).output_text
    events = list(client.responses.create(input="Tell me a story.", instructions="Be brief.", stream=True, **kw,
                                          stream_options={"include_obfuscation": False}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[-1].response.output_text == resp.output_text

    formatted = client.responses.create(input="Answer yes or no.", model=MODEL, max_output_tokens=40, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "a", "schema": {
                                            "type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"], "additionalProperties": False}}})
    assert formatted.status == "completed" and isinstance(json.loads(formatted.output_text)["ok"], bool)
    # max_output_tokens past the context is a cap, as vLLM's: the answer ends at the context length, incomplete
    capped = post(server, "/v1/responses", {"model": MODEL, "input": "Tell me a story. " * 20, "temperature": 0,
                                            "max_output_tokens": 10 ** 6})
    assert capped.status_code == 200, capped.text
    body = capped.json()
    assert body["max_output_tokens"] == 10 ** 6 and body["status"] == "incomplete"
    assert body["usage"]["input_tokens"] + body["usage"]["output_tokens"] == MAX_MODEL_LEN
    stored = post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": True})
    assert stored.status_code == 200 and stored.json()["store"] is False  # (taken, nothing kept: vLLM's, SDKs send it)
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [WEATHER]}, "tools"), ({"input": []}, "input"),
                         ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
                         ({"text": {"format": {"type": "xml"}}}, "text"), ({"max_output_tokens": 0},
                                                                            "max_output_tokens"),
                         ({"max_output_tokens": True}, "max_output_tokens"), ({"input": "hello " * 300}, "input"),
                         ({"text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}}, "text"),
                         ({"background": True}, "background"), ({"reasoning": {"effort": "high"}}, "reasoning"),
                         ({"moderation": {"model": "m"}}, "moderation"),
                         ({"context_management": [{"type": "compaction"}]}, "context_management"),
                         # (as chat's: only beside stream; it was taken with any keys, and without stream)
                         ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
                         ({"stream": True, "stream_options": {"x": 1}}, "stream_options"),
                         ({"stream": True, "stream_options": {"include_obfuscation": "yes"}}, "stream_options")]:
        bad = post(server, "/v1/responses", {"model": MODEL, "input": "hi", **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)
    neutral = {"background": False, "include": [], "stream_options": None,
               "prompt_cache_key": "k", "top_logprobs": 0, "reasoning": {"effort": None}, "store": False}
    assert post(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, **neutral}).json()[
        "status"] == "incomplete"
    long_chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 300}]})
    assert long_chat.status_code == 400 and long_chat.json()["error"]["param"] == "messages"


def test_vllm_chat_and_prompt_fields(client, server):
    """vLLM's ``continue_final_message`` (the text ends inside the last message, which the model continues),
    ``chat_template_kwargs`` (the template's own variables), ``allowed_token_ids``, ``bad_words`` and
    ``truncate_prompt_tokens``
    (the prompt's last k tokens), through the chat and completions endpoints and /tokenize alike."""
    prefill = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = post(server, "/tokenize", body).json()
    cut = post(server, "/tokenize", {"prompt": "user: Tell me a story.\nassistant: Once upon"}).json()
    assert tokenized["tokens"] == cut["tokens"]  # (no "\nassistant:" after it: the template's end is cut off)
    out = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    same = client.completions.create(model=MODEL, prompt="user: Tell me a story.\nassistant: Once upon", max_tokens=6,
                                     temperature=0)
    assert out.choices[0].message.content == same.choices[0].text and out.usage.prompt_tokens == tokenized["count"]

    kwargs = {"messages": prefill[:1], "chat_template_kwargs": {"greeting": "Hello!"}}
    rendered = post(server, "/tokenize", {"prompt": "Hello!\nuser: Tell me a story.\nassistant:"}).json()
    assert post(server, "/tokenize", kwargs).json()["tokens"] == rendered["tokens"]
    out = client.chat.completions.create(model=MODEL, messages=prefill[:1], max_tokens=2,
                                         extra_body={"chat_template_kwargs": {"greeting": "Hello!"}})
    assert out.usage.prompt_tokens == rendered["count"]

    allowed = [403, 407, 261, 378]  # ("Once upon a time")
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=1.0, seed=1,
                                        logprobs=0, stream=stream, extra_body={"allowed_token_ids": allowed})
        chunks = list(out) if stream else [out]
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == 12 and {t.strip() for t in tokens} <= {"Once", "upon", "a", "time"}, tokens

    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    word = plain.choices[0].text.split()[2]
    banned = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                       extra_body={"bad_words": [word]})
    assert word not in banned.choices[0].text.split() and banned.choices[0].text != plain.choices[0].text
    resp = post(server, "/v1/completions", {"prompt": "Once", "bad_words": [""], "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words", resp.text
    resp = post(server, "/v1/completions", {"prompt": "Once", "bad_words": ["a"], "use_beam_search": True, "n": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words", resp.text

    long_ids = [1] + [403, 407, 261, 378] * 100  # 401 tokens, past the 256-token context
    out = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 9})
    alone = client.completions.create(model=MODEL, prompt=long_ids[-9:], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == 9 and out.choices[0].text == alone.choices[0].text
    most = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=1, temperature=0,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert most.usage.prompt_tokens == MAX_MODEL_LEN - 1 and most.usage.completion_tokens == 1
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time, there was", max_tokens=1, temperature=0,
                                       echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert echoed.usage.prompt_tokens == 3 and not echoed.choices[0].text.startswith("Once")


def test_echo_scores_the_prompt_as_generation_scored_it(client, server):
    """``echo`` with ``logprobs`` (how lm-evaluation-harness scores continuations): the prompt's text and tokens come
    first, the first token with null values, and the generated token scores as the same prompt's generation scored
    it. ``max_tokens`` 0 with echo returns the prompt alone, with the same values."""
    gen = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=1)
    prompt_ids = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1).usage.prompt_tokens
    scored = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                       logprobs=1, echo=True)
    choice = scored.choices[0]
    assert choice.text.startswith("Once upon a time") and choice.text.endswith(gen.choices[0].logprobs.tokens[0])
    lp = choice.logprobs
    assert len(lp.tokens) == prompt_ids + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(gen.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    # max_tokens 0: the prompt alone, scored as above
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "logprobs": 1, "echo": True}
    resp = post(server, "/v1/completions", {**body, "max_tokens": 0}).json()
    only = resp["choices"][0]
    assert only["text"] == "Once upon a time" and only["finish_reason"] == "length"
    assert only["logprobs"]["tokens"] == lp.tokens[:-1]
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)
    assert resp["usage"]["completion_tokens"] == 0 and resp["usage"]["prompt_tokens"] == prompt_ids
    plain = post(server, "/v1/completions", {**body, "max_tokens": 4, "logprobs": None}).json()
    assert plain["choices"][0]["text"].startswith("Once upon a time") and plain["choices"][0]["logprobs"] is None
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                            logprobs=1, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), [])[1:] == pytest.approx(lp.token_logprobs[1:])
    # max_tokens 0 streamed (as vLLM): one chunk with the prompt alone, as unstreamed; usage counts nothing generated
    events = sse_events(server, "/v1/completions", {**body, "max_tokens": 0, "stream": True, "n": 2,
                                                    "return_token_ids": True,
                                                    "stream_options": {"include_usage": True}})
    assert sorted(e["choices"][0]["index"] for e in events[:-1]) == [0, 1]
    for e in events[:-1]:  # (n=2 decodes two rows in one batch: stories260K's rows differ ~1e-7 from one row's)
        streamed = e["choices"][0]
        assert set(streamed) == set(only) | {"index", "token_ids", "prompt_token_ids"} and streamed["token_ids"] == []
        assert [streamed[k] for k in ("text", "finish_reason", "stop_reason")] == ["Once upon a time", "length", None]
        assert streamed["logprobs"]["tokens"] == only["logprobs"]["tokens"]
        assert streamed["logprobs"]["text_offset"] == only["logprobs"]["text_offset"]
        assert streamed["logprobs"]["token_logprobs"][1:] == pytest.approx(only["logprobs"]["token_logprobs"][1:],
                                                                           abs=1e-5)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 0
    assert events[-1]["usage"]["prompt_tokens"] == prompt_ids


# ---- bad input --------------------------------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": "Once", "max_tokens": 2}
BAD_CASES = [
    ("malformed json", "/v1/completions", None, b'{"model": "x", "prompt": ', 400),
    ("not an object", "/v1/completions", [1, 2], None, 400),
    ("invalid utf-8", "/v1/completions", None, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400),
    ("lone surrogate", "/v1/completions", None, b'{"prompt": "\\ud800", "max_tokens": 2}', 400),
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, None, 400),
    ("prompt type", "/v1/completions", {**GOOD, "prompt": {"a": 1}}, None, 400),
    ("unknown field", "/v1/completions", {**GOOD, "bogus": 1}, None, 400),
    ("missing prompt", "/v1/completions", {"model": MODEL}, None, 400),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, None, 400),
    ("huge max_tokens", "/v1/completions", {**GOOD, "max_tokens": 10**12}, None, 400),
    ("bad temperature", "/v1/completions", {**GOOD, "temperature": -1}, None, 400),
    ("n zero", "/v1/completions", {**GOOD, "n": 0}, None, 400),
    ("penalty out of range", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, None, 400),
    ("unsupported suffix", "/v1/completions", {**GOOD, "suffix": "x"}, None, 400),
    ("logit_bias key not an id", "/v1/completions", {**GOOD, "logit_bias": {"x": 1}}, None, 400),
    ("logit_bias value over 100", "/v1/completions", {**GOOD, "logit_bias": {"3": 200}}, None, 400),
    ("logit_bias id past the vocabulary", "/v1/completions", {**GOOD, "logit_bias": {"99999": 1}}, None, 400),
    ("max_tokens 0 without echo", "/v1/completions", {**GOOD, "max_tokens": 0}, None, 400),
    ("logprobs over 20", "/v1/completions", {**GOOD, "logprobs": 21}, None, 400),
    ("negative logprobs", "/v1/completions", {**GOOD, "logprobs": -1}, None, 400),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        None,
        400,
    ),
    (
        "top_logprobs over 20",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        None,
        400,
    ),
    ("empty token-id prompt", "/v1/completions", {**GOOD, "prompt": [[]]}, None, 400),
    ("empty prompt list", "/v1/completions", {**GOOD, "prompt": []}, None, 400),
    ("token id out of range", "/v1/completions", {**GOOD, "prompt": [1, 99999]}, None, 400),
    ("prompt too long", "/v1/completions", {**GOOD, "prompt": [5] * (MAX_MODEL_LEN + 10)}, None, 400),
    ("text prompt too long", "/v1/completions", {**GOOD, "prompt": "Once upon a time " * 200}, None, 400),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, None, 404),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    (
        "chat tools",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        None,
        400,
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        None,
        404,
    ),
    ("body too large", "/v1/completions", None, b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413),
]


@pytest.mark.parametrize("name,path,body,raw,status", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input(server, name, path, body, raw, status):
    resp = post(server, path, body, raw=raw)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
# (name, path, body, raw body, the 400's param, a piece of its message): each names the field and what it takes
FIELD_CASES = [
    ("surrogate in prompt", "/v1/completions", None, b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt",
     "lone UTF-16 surrogate"),
    ("surrogate in model", "/v1/completions", None, b'{"prompt": "a", "model": "\\udfff"}', "model", "valid Unicode"),
    ("surrogate in stop", "/v1/completions", None, b'{"prompt": "a", "stop": ["x", "\\ud800"]}', "stop[1]",
     "surrogate"),
    ("surrogate in chat", "/v1/chat/completions", None,
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "surrogate"),
    ("surrogate to tokenize", "/tokenize", None, b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    ("prompt a number", "/v1/completions", {**GOOD, "prompt": 5}, None, "prompt",
     "must be one of: a string, a list of strings, a list of token ids"),
    ("prompt ids and text mixed", "/v1/completions", {**GOOD, "prompt": [1, "a"]}, None, "prompt", 'got [1, "a"]'),
    ("prompt of booleans", "/v1/completions", {**GOOD, "prompt": [True, False]}, None, "prompt", "got [true, false]"),
    ("stop_token_ids a boolean", "/v1/completions", {**GOOD, "stop_token_ids": [True]}, None, "stop_token_ids[0]",
     "valid integer (got true)"),
    ("chat content a number", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, None,
     "messages[0].content", "a list of text parts"),
    ("wrong type names the value", "/v1/completions", {**GOOD, "max_tokens": "many"}, None, "max_tokens",
     '(got "many")'),
    ("penalty names the API field", "/v1/completions", {**GOOD, "presence_penalty": 3}, None, "presence_penalty",
     "'presence_penalty'=3.0 is invalid: allowed a float in [-2, 2]"),
    ("min_tokens over max_tokens", "/v1/completions", {**GOOD, "min_tokens": 20}, None, "min_tokens",
     "at most max_tokens"),
    ("repetition penalty 0", "/v1/completions", {**GOOD, "repetition_penalty": 0}, None, "repetition_penalty",
     "'repetition_penalty'=0.0 is invalid: allowed a float in [0.000001, 100] (1: off"),
    # per request: prompts x n (a 10 KB body of 2,000 prompts with n=128 queued 256,000 sequences), OpenAI's 128 tools,
    # 1024 stop strings (100,000 held every step of every request for seconds)
    ("prompts x n", "/v1/completions", {**GOOD, "prompt": ["x"] * 40, "n": 128}, None, "prompt",
     "40 prompts x n=128 is 5120 sequences: allowed at most 4096"),
    ("too many tools", "/v1/chat/completions", {**CHAT, "tools": [WEATHER] * 129}, None, "tools",
     "129 tools: allowed at most 128"),
    ("too many stop strings", "/v1/completions", {**GOOD, "stop": [f"q{i}" for i in range(1025)]}, None, "stop",
     "at most 1024 non-empty strings"),
    ("chat min_tokens over max_completion_tokens", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 2, "min_tokens": 5}, None, "min_tokens", "'min_tokens'=5"),
    ("logit_bias past the vocabulary", "/v1/completions", {**GOOD, "logit_bias": {"100000": 1}}, None, "logit_bias",
     "[0, 512)"),
    ("logit_bias key with underscores", "/v1/completions", {**GOOD, "logit_bias": {"5_0": 1}}, None, "logit_bias",
     "decimal integers"),
    ("logit_bias key padded", "/v1/completions", {**GOOD, "logit_bias": {" 5 ": 1}}, None, "logit_bias",
     "decimal integers"),
    ("logit_bias too many", "/v1/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(1100)}}, None,
     "logit_bias", "at most 1024"),
    ("stream_options without stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, None,
     "stream_options", "'stream': true"),
    ("prompt plus max_tokens past the context", "/v1/completions", {**GOOD, "max_tokens": MAX_MODEL_LEN - 1}, None,
     "max_tokens", f"the prompt has 2 tokens and 'max_tokens' asks for {MAX_MODEL_LEN - 1} more"),
    ("chat prompt plus max_completion_tokens past the context", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": MAX_MODEL_LEN - 3}, None, "max_completion_tokens", "past the context length"),
    ("tool_choice names no tool", "/v1/chat/completions",
     {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, None,
     "tool_choice", "one of the tools: get_weather"),
    ("tool without a name", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, None,
     "tools", "'tools'[0] must be {'type': 'function'"),
    ("tool_choice without tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, None, "tool_choice",
     "needs 'tools'"),
    # a call's arguments are a JSON object (they came back as a string or a number), and a name names one function
    ("tool parameters not an object's", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}],
      "tool_choice": "required"}, None, "tools", "'parameters' must be an object's JSON schema"),
    ("two tools of one name", "/v1/chat/completions", {**CHAT, "tools": [WEATHER, WEATHER]}, None, "tools",
     "a second function named 'get_weather'"),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {**CHAT, "continue_final_message": True}, None, "continue_final_message", "'add_generation_prompt': false"),
    ("chat_template_kwargs replacing messages", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"messages": []}}, None, "chat_template_kwargs", "may not set messages"),
    ("chat_template_kwargs not an object", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": [1]}, None,
     "chat_template_kwargs", "valid dictionary"),
    ("allowed_token_ids past the vocabulary", "/v1/completions", {**GOOD, "allowed_token_ids": [3, 512]}, None,
     "allowed_token_ids", "[0, 512)"),
    ("allowed_token_ids empty", "/v1/completions", {**GOOD, "allowed_token_ids": []}, None, "allowed_token_ids",
     "a non-empty list of token ids"),
    ("priority without the priority policy", "/v1/completions", {**GOOD, "priority": 2}, None, "priority",
     "needs scheduling_policy='priority' (serve --scheduling-policy priority)"),
    ("priority not an integer", "/v1/chat/completions", {**CHAT, "priority": "high"}, None, "priority",
     "valid integer"),
    ("logit_bias key past 4300 digits", "/v1/completions", {**GOOD, "logit_bias": {"9" * 5000: 1}}, None,
     "logit_bias", "decimal integers"),
    ("min_tokens past the context", "/v1/chat/completions", {**CHAT, "min_tokens": 300}, None, "min_tokens",
     "cannot be met: the context leaves room for"),
    ("service_tier flex", "/v1/completions", {**GOOD, "service_tier": "flex"}, None, "service_tier",
     "is not supported"),
    ("truncate_prompt_tokens a boolean", "/v1/completions", {**GOOD, "truncate_prompt_tokens": True}, None,
     "truncate_prompt_tokens", "valid integer"),
    ("allowed_token_ids all stop tokens under min_tokens", "/v1/completions",
     {**GOOD, "max_tokens": 8, "allowed_token_ids": [2], "min_tokens": 3}, None, "allowed_token_ids",
     "are all stop tokens"),
    ("allowed_token_ids that cannot start a format", "/v1/completions",
     {**GOOD, "allowed_token_ids": [403], "response_format": {"type": "json_object"}}, None, "allowed_token_ids",
     "hold no token the structured output can start with"),
    ("a body nested too deeply", "/v1/completions", None, b'{"prompt": "a", "x": ' + b"[" * 50000 + b"]" * 50000
     + b"}", None, "nested too deeply"),
    ("a number past 4300 digits", "/v1/completions", None, b'{"prompt": "a", "priority": ' + b"9" * 5000 + b"}",
     None, "a number this server cannot read"),
    ("truncate_prompt_tokens 0", "/v1/completions", {**GOOD, "truncate_prompt_tokens": 0}, None,
     "truncate_prompt_tokens", "an integer >= 1"),
    ("tool call and response_format", "/v1/chat/completions",
     {**CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "tool_choice", "one output constraint"),
    ("beam search streamed", "/v1/completions", {**GOOD, "n": 2, "use_beam_search": True, "stream": True}, None,
     "stream", "not supported with 'use_beam_search'"),
    ("beam search sampled", "/v1/chat/completions", {**CHAT, "use_beam_search": True, "temperature": 0.7}, None,
     "temperature", "not supported with 'use_beam_search'"),
    ("beam search with logprobs", "/v1/chat/completions", {**CHAT, "use_beam_search": True, "logprobs": True}, None,
     "logprobs", "not supported with 'use_beam_search'"),
    ("beam search constrained", "/v1/completions", {**GOOD, "use_beam_search": True, "guided_regex": "a+"}, None,
     "guided_regex", "not supported with 'use_beam_search'"),
    ("beam width past 10", "/v1/completions", {**GOOD, "n": 11, "use_beam_search": True}, None, "n",
     "'n' (the beam width)=11 is invalid: allowed an integer in [1, 10]"),
    ("length_penalty without beam search", "/v1/completions", {**GOOD, "length_penalty": 0.5}, None,
     "length_penalty", "set 'use_beam_search': true"),
    ("json_schema name not a string", "/v1/completions", {**GOOD, "response_format": {
        "type": "json_schema", "json_schema": {"name": 5, "schema": {"type": "object"}}}}, None, "response_format",
     "'response_format.json_schema.name' must be a string, got 5"),
    ("json_schema strict not a boolean", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {"type": "object"}}}}, None,
     "response_format", "'response_format.json_schema.strict' must be a boolean"),
    ("spaces_between_special_tokens false", "/v1/completions", {**GOOD, "spaces_between_special_tokens": False},
     None, "spaces_between_special_tokens", "is not supported"),
    ("reasoning_effort on a model without it", "/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, None,
     "reasoning_effort", "is not supported"),
    ("moderation asked for", "/v1/chat/completions", {**CHAT, "moderation": {"model": "m"}}, None, "moderation",
     "is not supported"),
    ("audio output", "/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, None, "modalities",
     "is not supported"),
    ("a stored prompt", "/v1/responses", {"input": "x", "prompt": {"id": "p1"}}, None, "prompt",
     "stored prompts are not served"),
    ("beam search prompt plus max_tokens past the context", "/v1/completions",
     {**GOOD, "n": 2, "use_beam_search": True, "max_tokens": MAX_MODEL_LEN - 1}, None, "max_tokens",
     "past the context length"),
    ("chat beam search past the context", "/v1/chat/completions",
     {**CHAT, "use_beam_search": True, "max_completion_tokens": MAX_MODEL_LEN - 3}, None, "max_completion_tokens",
     "past the context length"),
    ("max_tokens a numeric string", "/v1/completions", {**GOOD, "max_tokens": "3"}, None, "max_tokens",
     'valid integer (got "3")'),
    ("n a float", "/v1/completions", {**GOOD, "n": 2.0}, None, "n", "valid integer (got 2.0)"),
    ("stream a string", "/v1/completions", {**GOOD, "stream": "yes"}, None, "stream", 'valid boolean (got "yes")'),
    ("guided_json a number", "/v1/completions", {**GOOD, "guided_json": 5}, None, "guided_json",
     "must be one of: a JSON object, a string"),
    ("a schema nothing matches", "/v1/completions", {**GOOD, "guided_json": {"anyOf": []}}, None, "guided_json",
     "allows no output at all"),
    ("tools defining one name two ways", "/v1/chat/completions",
     {**CHAT, "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": f"f{i}", "parameters": {
             "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": kind}}}}}
         for i, kind in enumerate(["string", "integer"])]}, None, "tools", "'$defs/A' in two different ways"),
]


def test_the_context_error_says_what_leaving_max_tokens_out_does(server):
    """Past the context, the 400 suggests leaving the field out only where that runs to the context: chat. A
    completion's default is 16 tokens (OpenAI's and vLLM's), so there it names the most that fits alone."""
    done = post(server, "/v1/completions", {**GOOD, "max_tokens": MAX_MODEL_LEN - 1}).json()["error"]["message"]
    assert "ask for at most" in done and "leave" not in done
    chat = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN - 3}).json()["error"]["message"]
    assert "leave 'max_tokens' out to generate up to the context length" in chat


@pytest.mark.parametrize("name,path,body,raw,param,fragment", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_bad_input_names_the_field_and_what_it_takes(server, name, path, body, raw, param, fragment):
    resp = post(server, path, body, raw=raw)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert len(err["message"]) < 400  # (quotes the start of what was sent, never all of it)


def test_values_at_their_limits_are_served(client, server):
    """Values that used to fail a request (or its whole batch): top_k past int32 is top-k off; a seed at the top of
    its range with n > 1 wraps for the later choices; a prompt plus max_tokens exactly at the context is served."""
    def text(**kw):
        out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, **kw)
        return [c.text for c in out.choices]

    assert text(temperature=1.0, seed=5, extra_body={"top_k": 2**40}) == text(temperature=1.0, seed=5)
    wrapped = text(temperature=1.0, seed=2**63 - 1, n=2)
    assert wrapped[1] == text(temperature=1.0, seed=0)[0]
    # vLLM's 64-bit range: a negative seed (a 400 before) is a seed like any other, its choices seed + j
    negative = text(temperature=1.0, seed=-1, n=2)
    assert negative == text(temperature=1.0, seed=-1, n=2) and negative[0] == text(temperature=1.0, seed=-1)[0]
    assert negative[1] == text(temperature=1.0, seed=0)[0] and negative[0] != text(temperature=1.0, seed=1)[0]
    out = client.completions.create(model=MODEL, prompt=[1, 403], max_tokens=MAX_MODEL_LEN - 2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX_MODEL_LEN - 2
    # without an explicit max_tokens a long prompt still gets what fits (completions' default 16 is a default)
    long_prompt = [1] + [403] * (MAX_MODEL_LEN - 6)
    out = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    _wait_pages_free(server)


def test_beam_search(client, server):
    """vLLM's use_beam_search: n choices per prompt, the n best sequences of a beam search of width n, the same as
    the library's LLM.beam_search on the same model; chat too."""
    from nightjar_jax import LLM, BeamSearchParams

    out = client.completions.create(model=MODEL, prompt=["Once upon a time", "The little dog"], max_tokens=10, n=3,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in out.choices] == list(range(6))
    llm = LLM("stories260k", max_model_len=MAX_MODEL_LEN, num_pages=64)
    ref = llm.beam_search(["Once upon a time", "The little dog"],
                          BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5))
    assert [c.text for c in out.choices] == [s.text for r in ref for s in r.sequences]
    assert [c.finish_reason for c in out.choices] == [s.finish_reason for r in ref for s in r.sequences]
    assert out.usage.completion_tokens == sum(len(s.tokens) for r in ref for s in r.sequences)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story"}],
                                          max_tokens=6, n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    assert all(c.message.role == "assistant" for c in chat.choices)
    _wait_pages_free(server)


def test_a_client_gone_mid_body_is_not_an_error(server):
    """A client that closes its connection before sending the whole body: nobody to answer, nothing logged as an
    unhandled error, and the server serves on."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"prompt"')
    assert post(server, "/v1/completions", GOOD).status_code == 200
    time.sleep(0.5)
    assert "unhandled error" not in server.logs() and "ClientDisconnect" not in server.logs()


def test_auth(server):
    assert post(server, "/v1/completions", GOOD, key=None).status_code == 401
    resp = post(server, "/v1/completions", GOOD, key="wrong")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    for key in ("s\u00e9kret", "\u00ff"):  # not ASCII: still a 401 (compare_digest refuses non-ASCII str)
        raw_key = {"Authorization": b"Bearer " + key.encode("utf-8")}
        assert post(server, "/v1/completions", GOOD, key=None, headers=raw_key).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_unknown_route_and_client_errors(server, client):
    resp = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 404 and "error" in resp.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"nope": 1})
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices  # still serving


# ---- disconnects ------------------------------------------------------------------------------------------------
def _wait_metric(server, name: str, at_least: float, timeout: float = 30.0) -> None:
    """Until the server's metric ``name`` reads ``at_least`` (e.g. a beam search or a weight update under way)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metrics().get(name, 0.0) >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"{name} did not reach {at_least} in {timeout} s: {server.metrics()}")


def _wait_load(server, at_least: int, timeout: float = 30.0) -> None:
    """Until ``/load`` (the generation requests the server holds, from their arrival) reads ``at_least``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        load = httpx.get(server.url + "/load", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5).json()
        if load["server_load"] >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"/load did not reach {at_least} in {timeout} s")


def _wait_pages_free(server, timeout=20.0, settled=None) -> dict[str, float]:
    """The metrics once every page is free and no request runs or waits, and ``settled(metrics)`` (if given) holds:
    a scrape reads the engine while its thread works, e.g. mid-way through aborting a group, whose running members
    have freed their pages while the rest are not yet counted (the counters catch up within the abort)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if m["nightjar_kv_pages_free"] == m["nightjar_kv_pages_usable"] and m["nightjar_num_requests_running"] == 0 \
                and m["nightjar_num_requests_waiting"] == 0 and (settled is None or settled(m)):
            return m
        time.sleep(0.1)
    raise AssertionError(f"pages not freed or requests not all counted: {server.metrics()}")


def test_disconnect_mid_stream_frees_pages(server):
    before = server.metrics()['nightjar_requests_total{finish_reason="abort"}']
    # 8 x 240 tokens: about 2 s of work on 2 CPU cores, so it is still running when the client goes away.
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 240,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "n": 8,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 2:
                    # (scraped before leaving the loop: breaking out closes the connection at once, and a warm
                    # server's abort could then land before the scrape)
                    m = server.metrics()
                    assert m["nightjar_kv_pages_free"] < m["nightjar_kv_pages_usable"]  # still generating
                    break
    m = _wait_pages_free(server, settled=lambda m: m['nightjar_requests_total{finish_reason="abort"}'] >= before + 8)
    assert m['nightjar_requests_total{finish_reason="abort"}'] == before + 8


def test_disconnect_non_streaming_frees_pages(server):
    abort, length = 'nightjar_requests_total{finish_reason="abort"}', 'nightjar_requests_total{finish_reason="length"}'
    start = server.metrics()
    # 32 x 240 tokens through 8 sequence slots: four rounds of decoding, so the work outlasts the 0.3 s client
    # timeout however fast attention gets (8 x 240 alone once finished first on the CPU kernel)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 240,
        "ignore_eos": True,
        "n": 32,
        "temperature": 0,
    }
    with pytest.raises(httpx.TimeoutException):
        post_timeout = httpx.Timeout(0.3, connect=5)
        httpx.post(
            server.url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=post_timeout,
        )
    def counts(m):
        return m[abort] - start[abort], m.get(length, 0.0) - start.get(length, 0.0)

    m = _wait_pages_free(server, settled=lambda m: sum(counts(m)) >= 32)
    aborted, finished = counts(m)
    assert aborted + finished == 32  # every sequence accounted for: none left running or lost
    assert aborted >= 8, f"the disconnect aborted only {aborted} of 32 sequences"


def test_disconnect_mid_beam_search_stops_it(server):
    """A beam search runs one short engine group per step: a client gone is still noticed at the server's disconnect
    pace (it used to be checked only within one step, so the search ran to its end), the step's group aborted and
    no later step started."""
    abort, prompt_tokens = 'nightjar_requests_total{finish_reason="abort"}', "nightjar_prompt_tokens_total"
    start = server.metrics()
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "n": 10, "use_beam_search": True,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(0.4, connect=5))
    # the search stops once the server notices (its disconnect pace, 0.5 s): wait until its steps stop coming
    # (pages are free between steps, so free pages alone do not say it stopped)
    deadline, last, still_since = time.time() + 60, None, time.time()
    while time.time() < deadline:
        now = server.metrics()[prompt_tokens]
        if now != last:
            last, still_since = now, time.time()
        elif time.time() - still_since > 2.0:
            break
        time.sleep(0.1)
    after = _wait_pages_free(server)
    assert after[prompt_tokens] == last, "the beam search went on after its client left"
    assert after[abort] >= start[abort]  # (the step's one-token requests may all have finished: nothing to abort)
    # 200 steps of 10 beams, each prompting its 1-token prompt and its tokens so far: a search run to its end adds
    # 10 x (2 + ... + 201) = 202,990 prompt tokens; one stopped by the disconnect far fewer
    assert after[prompt_tokens] - start[prompt_tokens] < 10 * sum(range(2, 202)) / 2


# ---- concurrency ------------------------------------------------------------------------------------------------
def test_64_concurrent_streams_match_sequential(server, client):
    prompts = [
        f"Once upon a time there was a {w}" for w in ("dog", "cat", "girl", "boy", "bird", "tree", "ball", "car")
    ]
    prompts = [f"{p}{' and' * (i // 8)}" for i, p in enumerate(prompts * 8)]  # 64 distinct prompts
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
    ]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run_all())
    assert all(reason is not None for _, reason in results)
    assert [text for text, _ in results] == expected
    _wait_pages_free(server)


# ---- shutdown (runs last: it stops the module's server) ---------------------------------------------------------
def test_sleep_mode_round_trip(server, client):
    """vLLM's sleep endpoints on the real server: level 2 frees the weights and the KV cache (stories260k's
    checkpoint is loaded again at the wake-up), requests meanwhile get a 503, and greedy answers after it are the
    same as before."""
    before = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    _wait_pages_free(server)  # (a sleep with requests in flight is a 409)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(server.url + "/sleep", params={"level": 2}, headers=auth, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["is_sleeping"] and resp.json()["freed_bytes"] > 0
    assert httpx.get(server.url + "/is_sleeping", headers=auth).json() == {"is_sleeping": True}
    with pytest.raises(openai.InternalServerError, match="wake_up"):
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    resp = httpx.post(server.url + "/wake_up", headers=auth, timeout=60)
    assert resp.status_code == 200 and resp.json() == {"is_sleeping": False}
    after = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert after.choices[0].text == before.choices[0].text
    assert server.metrics()["nightjar_engine_sleep_level"] == 0

    # a beam search runs many engine steps with the engine idle between them: a sleep waits for it (409), it ends
    # whole, and the sleep succeeds after
    done = {}

    def search():
        done["out"] = client.completions.create(model=MODEL, prompt="Once", max_tokens=200, n=8,
                                                extra_body={"use_beam_search": True, "ignore_eos": True})

    worker = threading.Thread(target=search)
    worker.start()
    _wait_load(server, 1)  # (the search has arrived: a fixed sleep raced it on a loaded machine)
    refused = httpx.post(server.url + "/sleep", headers=auth, timeout=60)
    running = worker.is_alive()
    worker.join(120)
    assert running, "the beam search ended before the sleep was tried: make it longer"
    assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"], refused.text
    assert len(done["out"].choices) == 8 and all(c.finish_reason == "length" for c in done["out"].choices)
    assert httpx.post(server.url + "/sleep", headers=auth, timeout=60).status_code == 200
    assert httpx.post(server.url + "/wake_up", headers=auth, timeout=60).status_code == 200


def test_a_weight_update_waits_for_a_beam_search(server, client):
    """A weight update waits for what is in flight, a beam search between its steps included, whose steps go ahead
    of it (no deadlock: the search needs its next step admitted to finish)."""
    done = {}

    def search():
        done["out"] = client.completions.create(model=MODEL, prompt="Once", max_tokens=120, n=6,
                                                extra_body={"use_beam_search": True, "ignore_eos": True})
        done["t"] = time.monotonic()

    worker = threading.Thread(target=search)
    worker.start()
    _wait_metric(server, "nightjar_beam_searches", 1)  # (under way: a fixed sleep raced it on a loaded machine)
    assert worker.is_alive(), "the beam search ended before the update was asked for: make it longer"
    resp = post(server, "/update_weights_from_disk", {"model_path": "stories260k"})
    updated = time.monotonic()
    worker.join(120)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    # (an update that did not wait returns at once, while the search runs on for a second or more)
    assert updated > done["t"] - 0.2, f"the update returned {done['t'] - updated:.2f} s before the search ended"
    assert len(done["out"].choices) == 6


def test_a_beam_search_sent_while_an_update_waits_runs_after_it(server, client):
    """A beam search that arrives while a weight update waits for the requests in flight waits for the update, as
    any other request does (it ran at once, its steps going ahead of the update, under the old weights). Sizes: the
    long request (64 x 200 tokens through 8 slots) still runs well after the search is sent, and the search (24
    tokens, a step each) takes long enough after the update that two client threads' clocks order them."""
    times = {}

    def long_request():
        client.completions.create(model=MODEL, prompt="Once", max_tokens=200, n=64, temperature=0,
                                  extra_body={"ignore_eos": True})

    def update():
        times["update"] = (post(server, "/update_weights_from_disk", {"model_path": "stories260k"}).status_code,
                           time.monotonic())

    threads = [threading.Thread(target=long_request), threading.Thread(target=update)]
    threads[0].start()
    _wait_metric(server, "nightjar_num_requests_running", 1)  # (in the engine: the update must wait for it)
    threads[1].start()
    _wait_metric(server, "nightjar_weight_updates_waiting", 1)
    assert threads[0].is_alive() and threads[1].is_alive(), "the long request ended too soon: make it longer"
    beam = client.completions.create(model=MODEL, prompt="Once", max_tokens=24, n=2,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    ended = time.monotonic()
    for t in threads:
        t.join(120)
    assert len(beam.choices) == 2 and times["update"][0] == 200
    assert ended > times["update"][1], f"the search ended {times['update'][1] - ended:.2f} s before the update"


def test_the_body_is_read_as_json_only_under_a_json_media_type(server):
    """As FastAPI reads vLLM's bodies: no Content-Type, application/json (with a charset) or application/*+json; a
    text/plain or form body (what a browser may send cross-site without a preflight) was read as JSON too, now a 415."""
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 2}).encode()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for kind, status in ((None, 200), ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
                         ("text/plain", 415), ("application/x-www-form-urlencoded", 415)):
        headers = {**auth, **({"Content-Type": kind} if kind else {})}
        resp = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=60)
        assert resp.status_code == status, (kind, resp.text)
        if status == 415:
            assert "send it with Content-Type: application/json" in resp.json()["error"]["message"]


def test_zz_sigterm_graceful_shutdown(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "stream": True, "temperature": 0}
    frames: list[str] = []

    def stream():
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {API_KEY}"},
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    frames.append(line)

    # one that cannot finish within --shutdown-timeout (3 s): the engine aborts it a little before, so it still
    # ends well-formed (uvicorn used to cancel its handler: a stream cut with no [DONE], a bare 500 and a traceback)
    long_frames: list[str] = []

    def long_stream():
        with httpx.stream("POST", server.url + "/v1/completions", json={
                **body, "prompt": ["Once", "The"], "max_tokens": 250, "n": 128, "ignore_eos": True}, timeout=30,
                headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            long_frames.extend(line for line in resp.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=stream), threading.Thread(target=long_stream)]
    for t, started in zip(threads, (frames, long_frames), strict=True):  # (in this order: the short one first)
        t.start()
        deadline = time.time() + 10
        while not started and time.time() < deadline:
            time.sleep(0.01)
    assert server.stop() == 0, server.logs()
    for t in threads:
        t.join(10)
    assert frames and frames[-1] == "data: [DONE]"  # the in-flight stream was allowed to finish
    assert long_frames and long_frames[-1] == "data: [DONE]", long_frames[-3:]
    reasons = {json.loads(f[6:])["choices"][0]["finish_reason"] for f in long_frames[:-1]}
    assert "abort" in reasons and "Exception in ASGI application" not in server.logs()

