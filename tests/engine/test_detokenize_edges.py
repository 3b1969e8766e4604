"""Incremental detokenization's edges in the engine (``LLMEngine._append`` -> ``_detokenize``): a prompt that ends
inside a UTF-8 character the output completes, and an output cut inside one by ``max_tokens``. The ids are fed
through ``_append`` as a step would commit them, so the test picks them (the model would not)."""

from __future__ import annotations

import time

import pytest

from nightjar_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLM("stories260k", max_model_len=128, max_num_seqs=2, num_pages=32).engine


def _commit(engine, prompt_ids: list[int], output_ids: list[int], params: SamplingParams):
    """Queue a request for ``prompt_ids`` and commit ``output_ids`` one at a time; (last output, streamed deltas)."""
    request_id = engine.add_request({"prompt_token_ids": prompt_ids}, params)
    request = engine.requests[request_id]
    deltas, out = [], None
    try:
        for tok in output_ids:
            out = engine._append(request, [tok], time.monotonic())
            deltas.append(out.outputs[0].delta_text)
            if out.finished:
                break
    finally:
        if not request.is_finished:
            engine.abort_request(request_id)
    return out.outputs[0], deltas


def _byte_pieces(tok, ids: list[int]) -> list[int]:
    return [i for i, t in enumerate(ids) if "\ufffd" in tok.token_text(t)]


def test_an_output_that_completes_the_prompts_last_character_streams_it(engine):
    """The prompt's ids end after the first byte of "😀": its decode ends in U+FFFD, and the output's three bytes
    complete the emoji. The text is what decode(prompt + output) has past the prompt's complete text: "😀cd" (the
    length diff read "ab\ufffd" -> "ab😀" as nothing new, and the text was "cd")."""
    tok = engine.tokenizer
    ids = tok.encode("ab😀cd")
    first_byte = _byte_pieces(tok, ids)[0]
    prompt, output = ids[: first_byte + 1], ids[first_byte + 1 :]
    assert tok.decode(prompt).endswith("\ufffd") and tok.decode(prompt + output) == "ab😀cd"
    comp, deltas = _commit(engine, prompt, output, SamplingParams(temperature=0, max_tokens=len(output)))
    assert comp.text == "😀cd" and "".join(deltas) == comp.text and comp.finish_reason == "length"
    # the output leaves it incomplete (a stray "c" after it): the prompt's U+FFFD stays the prompt's
    comp, deltas = _commit(engine, prompt, output[-2:], SamplingParams(temperature=0, max_tokens=2))
    assert comp.text == "cd" == "".join(deltas)


def test_a_character_cut_by_max_tokens_ends_the_text_and_matches_no_stop_string(engine):
    """max_tokens cuts "😀" after a byte: the text ends in U+FFFD (the output was cut inside a character, as a
    decode shows), which is made up and matches no stop string: stop=["\ufffd"] reported finish_reason "stop"."""
    tok = engine.tokenizer
    ids = tok.encode("Hi 😀", add_special_tokens=False)
    cut = _byte_pieces(tok, ids)[1]  # (two of the emoji's four bytes)
    for stop in ([], ["\ufffd"], [" \ufffd"]):
        params = SamplingParams(temperature=0, max_tokens=cut, stop=stop)
        comp, deltas = _commit(engine, [1], ids, params)
        assert (comp.text, comp.finish_reason, comp.stop_reason) == ("Hi \ufffd", "length", None), stop
        assert "".join(deltas) == comp.text
    # a stop string in the complete text before it still stops there
    comp, _ = _commit(engine, [1], ids, SamplingParams(temperature=0, max_tokens=cut, stop=["i "]))
    assert (comp.text, comp.finish_reason, comp.stop_reason) == ("H", "stop", "i ")


def test_a_stop_string_in_the_last_steps_whole_characters_stops_before_a_cut_one(engine):
    """One step commits "Hi" and the first byte of "😀" together (a speculative step commits several tokens), and
    max_tokens ends there: the text held for the incomplete character holds "Hi" too, and a stop string in those
    whole characters stops the output (kept out of the search with the made-up U+FFFD, it was missed: "Hi\ufffd",
    finish reason "length")."""
    tok = engine.tokenizer
    ids = tok.encode("Hi😀", add_special_tokens=False)
    first_byte = _byte_pieces(tok, ids)[0]
    output = ids[: first_byte + 1]
    for stop, include, text in ((["Hi"], False, ""), (["Hi"], True, "Hi"), (["i"], False, "H")):
        params = SamplingParams(temperature=0, max_tokens=len(output), stop=stop, include_stop_str_in_output=include)
        request_id = engine.add_request({"prompt_token_ids": [1]}, params)
        out = engine._append(engine.requests[request_id], output, time.monotonic())
        assert out.finished and (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (
            text, "stop", stop[0]), stop
    assert engine.num_free_pages == engine.num_total_pages


@pytest.mark.parametrize("prompt", ["Hello 中文", "Hi 🇺🇸", "Family 👨\u200d👩\u200d👧", "日本語"])
def test_output_after_a_prompt_ending_in_byte_tokens_reads_as_its_own_decode(engine, prompt):
    """The window the streamed text is read in started on the prompt's last 5 ids, inside a character's run of
    byte tokens: stories260K's byte-fallback decoder then read the whole run, the output's "\\n" (<0x0A>) included,
    as U+FFFD ("Hello 中文" + four "\\n" came out as four U+FFFD; QA, 2026-12-07). Streamed deltas join to the text
    a decode of prompt + output has past the prompt's, for outputs of byte and whole tokens alike."""
    tok = engine.tokenizer
    prompt_ids = tok.encode(prompt)
    assert _byte_pieces(tok, prompt_ids)[-1] >= len(prompt_ids) - 5  # (the window starts inside the byte run)
    newline, word = tok.encode("\n", add_special_tokens=False)[-1], tok.encode(" the", add_special_tokens=False)[-1]
    accent = tok.encode(" é", add_special_tokens=False)
    for output_ids in ([newline] * 4, [word, newline, word], [newline, word] + accent):
        out, deltas = _commit(engine, prompt_ids, output_ids, SamplingParams(max_tokens=len(output_ids),
                                                                             ignore_eos=True))
        whole = tok.decode(prompt_ids + output_ids)
        assert out.text == "".join(deltas) == whole[len(tok.decode(prompt_ids)):], (output_ids, out.text)
        assert "\ufffd" not in out.text
