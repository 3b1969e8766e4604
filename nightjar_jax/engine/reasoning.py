"""A thinking model's thought, as the engine sees it (vLLM's ``--reasoning-parser``, on the engine's side): a
structured output starts after the thought.

Models that think before they answer write their thoughts between ``<think>`` and ``</think>``. With a reasoning
parser, vLLM applies a request's structured output (JSON schema, regex, choice, grammar, a tool call's arguments)
to the answer alone: the thought is free text, and the constraint starts after ``</think>``
(``structured_outputs_config.enable_in_reasoning`` off, its default). :class:`AfterThought` does the same for any
:class:`~nightjar_jax.engine.structured.TokenConstraint`, on the bytes of the tokens the request commits, so it
holds for models whose tags are one special token (Qwen3, DeepSeek-R1) and for those where ``</think>`` is several
tokens (``</``, ``think``, ``>`` in SmolLM2's vocabulary).

Where the output starts follows the parsers (``server/reasoning_parsers.py``, which splits the text the same way):

- ``deepseek_r1``: inside the thought (its template opens it).
- ``qwen3``: the model opens the thought with ``<think>`` as its first token, or answers at once: the first token may
  be one that starts with the whole tag (the thought), or one the constraint allows (the answer). Thinking models
  have the tag as one token (Qwen3, SmolLM3, DeepSeek-R1's distills; vLLM's parsers require it); in a vocabulary
  without one (SmolLM2, stories260K), the answer starts at once: offered ``<``, a tiny model under a JSON schema took
  it over ``{`` and wrote a thought it never closed.
- Either parser: a prompt that ends with ``<think>`` leaves the output in the thought, and one that ends with
  ``</think>`` (thinking turned off) leaves it in the answer (the constraint applies from the first token, as
  without a parser).

In the thought every token is allowed except one that would complete ``</think>`` and run past it: the answer's
first byte is the constraint's first. An output that never closes its thought (cut by ``max_tokens``, or ended by
an end-of-sequence token there) is never constrained, as in vLLM.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nightjar_jax.config import REASONING_PARSERS
from nightjar_jax.engine.structured import TokenConstraint

START, END = "<think>", "</think>"
_START, _END = START.encode(), END.encode()

OPENING, THINKING, ANSWERING = "opening", "thinking", "answering"


def thought_phase(parser: str, prompt: str) -> str:
    """Where an output after ``prompt`` starts: ``"answering"`` (the prompt closed a thought), ``"thinking"``
    (deepseek_r1, or a prompt that opened one) or ``"opening"`` (qwen3: the output's own start decides). Only the
    prompt's end counts, trailing whitespace aside: earlier turns' thoughts say nothing about this one."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}: choose one of {', '.join(REASONING_PARSERS)}")
    end = prompt.rstrip()
    if end.endswith(END):
        return ANSWERING
    if parser == "deepseek_r1" or end.endswith(START):
        return THINKING
    return OPENING


def _end_state(k: int, data: bytes) -> tuple[int, int]:
    """After output whose last ``k`` bytes are ``</think>``'s first ``k``, then ``data``: (the new such ``k``, the
    bytes of ``data`` after a completed tag, or -1 when none completed)."""
    text = _END[:k] + data
    at = text.find(_END)
    if at >= 0:
        return 0, len(text) - at - len(_END)
    for j in range(min(len(_END) - 1, len(text)), 0, -1):
        if text.endswith(_END[:j]):
            return j, -1
    return 0, -1


class ThoughtTags:
    """The vocabulary's bytes (special tokens count as none: the text leaves them out) and the masks the thought's
    tags call for, shared by an engine's requests (built with its grammar backend: ~0.2 s for SmolLM2's 49,152
    tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        known = min(vocab_size, tokenizer.vocab_size)
        self.vocab_size = vocab_size
        self.token_bytes = [b"" if i in special else tokenizer.token_bytes(i) for i in range(known)]
        self.token_bytes += [b""] * (vocab_size - known)  # (a model's padded rows past the tokenizer's)
        # in the thought, after k bytes of </think>: all but the tokens that complete it with bytes to spare (those
        # hold its last byte)
        closers = [i for i, b in enumerate(self.token_bytes) if _END[-1:] in b]
        self._thinking = [np.ones(vocab_size, bool) for _ in range(len(_END))]
        for k, mask in enumerate(self._thinking):
            mask[[i for i in closers if _end_state(k, self.token_bytes[i])[1] > 0]] = False
            mask.flags.writeable = False
        # at a qwen3 output's start: the tokens that open the thought, the whole tag and then thought (not a whole
        # </think> too: the answer would start inside the token)
        self.opening = np.zeros(vocab_size, bool)
        self.opening[[i for i, b in enumerate(self.token_bytes)
                      if b.startswith(_START) and _END not in b[len(_START):]]] = True
        self.opening.flags.writeable = False

    def thinking_mask(self, k: int) -> np.ndarray:
        """bool [V], read-only: the tokens allowed in the thought when the output ends with ``k`` bytes of
        ``</think>``."""
        return self._thinking[k]


class AfterThought(TokenConstraint):
    """A token constraint that applies ``inner`` after the output's thought (module docstring). ``phase``: where the
    output starts (:func:`thought_phase`; not ``"answering"``: there ``inner`` applies alone)."""

    def __init__(self, inner: Any, tags: ThoughtTags, phase: str):
        if phase not in (OPENING, THINKING):
            raise ValueError(f"phase must be {OPENING!r} or {THINKING!r}, got {phase!r}")
        self.inner, self.tags, self.vocab_size = inner, tags, inner.vocab_size
        self.field = inner.field
        self._saved: list[tuple] = []  # the state before each accepted token (rollback)
        self.phase = phase
        self._inner_n = 0  # tokens the inner constraint holds (the answer's)
        self._end_k = 0  # thinking: the output's last bytes are </think>'s first _end_k

    def _state(self) -> tuple:
        return self.phase, self._inner_n, self._end_k

    def allowed(self) -> np.ndarray:
        if self.phase == ANSWERING:
            return self.inner.allowed()
        if self.phase == THINKING:
            return self.tags.thinking_mask(self._end_k).copy()
        return self.tags.opening | self.inner.allowed()

    def accept(self, token: int) -> bool:
        token = int(token)
        saved = self._state()
        if self.phase == THINKING:
            if not self.tags.thinking_mask(self._end_k)[token]:
                return False
            self._think(self.tags.token_bytes[token])
        elif self.phase == OPENING and self.tags.opening[token]:  # (the thought, where the constraint allows it too)
            self.phase = THINKING
            self._think(self.tags.token_bytes[token][len(_START):])
        else:
            if not self.inner.accept(token):
                return False
            self._inner_n += 1
            if self.phase == OPENING:
                self.phase = ANSWERING
        self._saved.append(saved)
        return True

    def _think(self, data: bytes) -> None:
        self._end_k, spare = _end_state(self._end_k, data)
        if spare >= 0:  # (the masks let none spare a byte)
            self.phase, self._end_k = ANSWERING, 0

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > len(self._saved):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._saved)} accepted")
        state = self._saved[-n]  # (the inner constraint holds the answer's tokens alone: those after state's)
        self.inner.rollback(self._inner_n - state[1])
        self.phase, self._inner_n, self._end_k = state
        del self._saved[-n:]

    @property
    def is_terminated(self) -> bool:
        return self.phase == ANSWERING and self.inner.is_terminated

