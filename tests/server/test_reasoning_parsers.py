"""The reasoning parsers (no engine): what they split from whole outputs, and that streaming in any pieces gives
the same reasoning and content."""

from __future__ import annotations

import random

import pytest

from nightjar_jax.server.reasoning_parsers import ReasoningStream, split

CASES = [
    # (parser, output, reasoning, content)
    ("deepseek_r1", "<think>\nLet me see.</think>\n\nParis.", "\nLet me see.", "\n\nParis."),
    ("deepseek_r1", "Let me see.</think>Paris.", "Let me see.", "Paris."),  # (the template opened the thought)
    ("deepseek_r1", "Still thinking when max_tokens cut it", "Still thinking when max_tokens cut it", None),
    ("deepseek_r1", "</think>Paris.", None, "Paris."),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),  # (the first end closes the thought)
    ("deepseek_r1", "<thin", "<thin", None),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),  # (thinking off)
    ("qwen3", "Paris.</think>", None, "Paris.</think>"),
    ("qwen3", " <think>x</think>", None, " <think>x</think>"),  # (only an output that starts with it)
    ("qwen3", "<think>never closed", "never closed", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "<think></think>Paris.", None, "Paris."),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split(parser, text, reasoning, content):
    assert split(text, parser) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_in_any_pieces_equals_split(parser, text, reasoning, content):
    rng = random.Random(0)
    for sizes in [[1] * len(text), [2] * len(text), [3] * len(text)] + [
            [rng.randint(1, 9) for _ in text] for _ in range(20)]:
        stream, at, out_r, out_c = ReasoningStream(parser), 0, "", ""
        for size in sizes:
            if at >= len(text):
                break
            r, c = stream.feed(text[at:at + size])
            at += size
            assert "think>" not in r or "think>" in (reasoning or "")  # (no tag goes out as reasoning)
            out_r, out_c = out_r + r, out_c + c
        r, c = stream.finish()
        assert ((out_r + r) or None, (out_c + c) or None) == (reasoning, content)


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite': choose one of deepseek_r1, qwen3"):
        ReasoningStream("granite")
