"""Reasoning in a model's text, split from its answer (vLLM's ``--reasoning-parser``): models that think before they
answer write their thoughts between ``<think>`` and ``</think>``; the chat API returns them as the message's
``reasoning_content`` and the rest as its ``content`` (streamed: ``delta.reasoning_content`` and ``delta.content``).

- ``deepseek_r1`` (DeepSeek-R1 and its distilled Llama and Qwen models): their chat template opens the thought, so
  the output starts inside it (a ``<think>`` the model writes again is dropped). Everything up to the first
  ``</think>`` is reasoning, everything after it content; an output that never closes its thought (cut by
  ``max_tokens``) is all reasoning.
- ``qwen3`` (Qwen3, SmolLM3): the model opens the thought itself, or not at all when thinking is off. An output that
  starts with ``<think>`` reasons until ``</think>``; any other output is all content.

The prompt decides first, for both (vLLM reads the prompt's tokens the same way): a prompt that ends with ``<think>``
(Qwen3-Thinking-2507 and Qwen3.5 templates, DeepSeek-R1-0528's) leaves the output inside the thought, and one that ends
with ``</think>`` (thinking turned off: ``<think>\n\n</think>``) leaves it all content. Only the prompt's end counts
(trailing whitespace aside): earlier turns' thoughts say nothing about this one.

Streaming (:class:`ReasoningStream`) holds back only what could still be one of the tags; joined, its pieces equal
:func:`split` of the whole text, whatever the pieces (:func:`split` is the stream fed once).
"""

from __future__ import annotations

from dataclasses import dataclass

from nightjar_jax.config import REASONING_PARSERS  # noqa: F401 (the names, for callers)
from nightjar_jax.engine.reasoning import ANSWERING, END, START, THINKING, thought_phase
from nightjar_jax.server.tool_parsers import prefix_tail


@dataclass
class ReasoningStream:
    """Splits text that arrives in pieces: :meth:`feed` each piece, then :meth:`finish`; each returns the reasoning
    and the content that are now certain."""

    parser: str
    prompt: str = ""  # the rendered prompt (its end may open or close the thought)
    _state: str = "opening"  # "opening": the output's start (a start tag may come); "thinking"; "answering"
    _held: str = ""
    _opened: bool = False  # the output starts inside the thought (deepseek_r1, or a prompt that opened it)

    def __post_init__(self) -> None:
        phase = thought_phase(self.parser, self.prompt)  # (the engine's reading of the prompt, reasoning.py)
        self._opened = phase == THINKING
        if phase == ANSWERING:  # (thinking off: the template wrote an empty thought)
            self._state = "answering"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``text``'s reasoning and content that are now certain; ``final``: the output ends with it (also
        :meth:`finish`)."""
        if final:
            reasoning, content = self.feed(text)
            more = self.finish()
            return reasoning + more[0], content + more[1]
        text = self._held + text
        self._held = ""
        reasoning = ""
        if self._state == "opening":
            if START.startswith(text) and text != START:  # (still maybe the start tag)
                self._held = text
                return "", ""
            opened = text.startswith(START)
            if opened:
                text = text[len(START):]
            if opened or self._opened:
                self._state = "thinking"
            else:
                self._state = "answering"
        if self._state == "thinking":
            at = text.find(END)
            if at < 0:
                keep = prefix_tail(text, END)
                self._held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(END):]
            self._state = "answering"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The end of the output: held text is what its state says (a lone start of the output: reasoning where the
        output starts inside the thought, else content)."""
        held, self._held = self._held, ""
        if self._state == "thinking" or (self._state == "opening" and self._opened):
            return held, ""
        return "", held


def split(text: str, parser: str, prompt: str = "") -> tuple[str | None, str | None]:
    """The reasoning and the content of a whole output after ``prompt`` (None where empty)."""
    stream = ReasoningStream(parser, prompt)
    reasoning, content = stream.feed(text, final=True)
    return reasoning or None, content or None
