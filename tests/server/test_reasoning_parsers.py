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

# (parser, prompt, output, reasoning, content): the prompt's end opens or closes the thought
PROMPT_CASES = [
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "cut by max_tokens", "cut by max_tokens", None),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "<think>again</think>Paris.", "again", "Paris."),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "Paris.", None, "Paris."),  # (thinking off)
    ("deepseek_r1", "assistant\n<think>\n\n</think>\n\n", "Paris.</think>", None, "Paris.</think>"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "a</think>b", "a", "b"),
    # an earlier turn's thought is not this one's
    ("qwen3", "<think>old</think>old answer\nuser: hi\nassistant:", "Paris.", None, "Paris."),
    ("deepseek_r1", "<think>old</think>old answer\nuser: hi\nassistant:", "a</think>b", "a", "b"),
    ("qwen3", "", "Paris.</think>", None, "Paris.</think>"),
]
ALL_CASES = [(parser, "", *rest) for parser, *rest in CASES] + PROMPT_CASES


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", ALL_CASES)
def test_split(parser, prompt, text, reasoning, content):
    assert split(text, parser, prompt) == (reasoning, content)


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", ALL_CASES)
def test_streamed_in_any_pieces_equals_split(parser, prompt, text, reasoning, content):
    rng = random.Random(0)
    for sizes in [[1] * len(text), [2] * len(text), [3] * len(text)] + [
            [rng.randint(1, 9) for _ in text] for _ in range(20)]:
        stream, at, out_r, out_c = ReasoningStream(parser, prompt), 0, "", ""
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
