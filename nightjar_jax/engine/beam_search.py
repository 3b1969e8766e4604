"""Beam search (vLLM's ``LLM.beam_search`` and the API's ``use_beam_search``), host side, no JAX.

As vLLM does, the search runs on top of the engine rather than inside its step: every search step asks the engine
for one greedy token of each live beam (prompt + the beam's tokens so far), with the ``2 x beam_width`` most likely
next tokens' log-probabilities. Each beam's candidates extend it; a candidate that is an end-of-sequence token
finishes its beam (``ignore_eos`` off), the others compete, and the ``beam_width`` best by cumulative
log-probability live on. With prefix caching (on by default) a beam's full pages are computed once and shared by
the beams that extend it, so a step recomputes only each beam's last, partly filled page.

The search ends when no beam is left or the beams hold ``max_tokens`` tokens (or the context is full); the
``beam_width`` best sequences of those finished and those still live are returned, ranked by vLLM's
length-penalized score ``cum_logprob / length ** length_penalty`` (``length``: the prompt's tokens and the generated
ones, the end-of-sequence token excluded, as vLLM counts them; HF's counts the generated ones alone).

Vocabulary:
- **beam**: a prompt's partial output with its cumulative log-probability (:class:`BeamSearchSequence`).
- **candidates** of a beam: the beam extended by one of the top next tokens.
- **expansion**: the engine's answer for one beam, ``{token id: log-probability}`` of its top next tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nightjar_jax.engine.outputs import Logprob
from nightjar_jax.engine.sampling_params import (
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
    plain_number,
    short_repr,
)

# each beam asks for twice the beam width of candidates (as vLLM): enough that beam_width survive even when up to
# beam_width of them are end-of-sequence tokens
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# past this the ranking key's length term (length_penalty x log length) would leave a float's range: the length alone
# decides long before it (at 1e6 a one-token difference outweighs any log-probability)
MAX_LENGTH_PENALTY = 1e6


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, its fields in its order: ``beam_width`` sequences kept per step (and returned),
    up to ``max_tokens`` generated tokens each; ``ignore_eos`` keeps end-of-sequence tokens as ordinary tokens;
    ``temperature`` is taken as vLLM takes it and changes nothing (the search ranks by the model's own
    log-probabilities and samples nothing; vLLM's steps sample one token that at most adds a candidate);
    ``length_penalty`` is the exponent of the length in the ranking score (1: the mean log-probability per token; 0:
    the sum, which favours short sequences; > 1 favours long ones); ``include_stop_str_in_output`` keeps the
    end-of-sequence token that finished a sequence at the end of its tokens (its text follows the tokenizer's
    ``skip_special_tokens``; the score's length never counts it)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens", "temperature", "length_penalty"):  # (NumPy scalars: their numbers)
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        checks = [
            (_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
             f"an integer in [1, {MAX_BEAM_WIDTH}] (each beam asks for 2 x beam_width log-probabilities, at most "
             f"{MAX_LOGPROBS})"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean"),
            (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and 0 <= self.temperature <= 100, "temperature", "a number in [0, 100] (it changes nothing: see above)"),
            (isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a boolean"),
            (isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
             and abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
             f"a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidRequestError(f"BeamSearchParams.{name}={short_repr(getattr(self, name))} is invalid: "
                                          f"allowed {allowed}", name)

    def step_params(self) -> SamplingParams:
        """What each search step asks the engine for, per live beam: one greedy token and the top candidates."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * self.beam_width,
                              skip_special_tokens=False)


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search: its generated ``tokens`` (an end-of-sequence token that finished it is among
    them only with ``include_stop_str_in_output``; unlike vLLM's ``LLM.beam_search``, the prompt's are not: they are
    ``BeamSearchOutput.prompt_token_ids``), each token's log-probability, their sum and the length-penalized
    ``score`` it was ranked by; ``text`` (the tokens' text, decoded after the prompt's so that a first token's
    leading space is kept, as ``generate`` keeps it) is filled once the search is done."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"; None while live
    stop_reason: int | None = None  # the end-of-sequence token that finished it
    text: str | None = None
    score: float = 0.0

    def extend(self, token: int, logprob: float) -> BeamSearchSequence:
        return BeamSearchSequence(self.tokens + [token], self.logprobs + [logprob], self.cum_logprob + logprob)

    @property
    def token_logprobs(self) -> list[dict[int, Logprob]]:
        """The generated tokens' log-probabilities in the engine's per-token form (``SampleLogprobs``)."""
        return [{t: Logprob(lp)} for t, lp in zip(self.tokens, self.logprobs, strict=True)]


@dataclass
class BeamSearchOutput:
    """A prompt's result: its ``beam_width`` best sequences, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


def _log_neg_score(seq: BeamSearchSequence, length_penalty: float, prompt_len: int = 0) -> float:
    """``log(-score)`` (scores are <= 0: log-probabilities): the ranking key, best first when ascending, computed
    in log space so that no ``length_penalty`` overflows it (``length ** 1e6`` would)."""
    if seq.cum_logprob >= 0:
        return -math.inf
    return math.log(-seq.cum_logprob) - length_penalty * math.log(max(prompt_len + _length(seq), 1))


def _length(seq: BeamSearchSequence) -> int:
    """The generated tokens a score counts: an end-of-sequence token kept at the end is not one (as vLLM's)."""
    kept_eos = seq.stop_reason is not None and bool(seq.tokens) and seq.tokens[-1] == seq.stop_reason
    return len(seq.tokens) - kept_eos


def beam_score(seq: BeamSearchSequence, length_penalty: float, prompt_len: int = 0) -> float:
    """``cum_logprob / length ** length_penalty``, ``length`` the prompt's ``prompt_len`` tokens and the generated
    ones (at least 1; vLLM's ``get_beam_search_score``, whose sequences hold the prompt); -inf or -0.0 where an
    extreme ``length_penalty`` takes it past a float's range (the ranking itself never is: :func:`_log_neg_score`)."""
    try:
        return -math.exp(_log_neg_score(seq, length_penalty, prompt_len))
    except OverflowError:
        return -math.inf


class BeamSearch:
    """One prompt's search state: :meth:`pending` gives the token ids to expand, :meth:`advance` takes the
    engine's expansions of them, until :attr:`done`; then :meth:`best`."""

    def __init__(self, prompt: str | None, prompt_ids: list[int], params: BeamSearchParams, eos_ids: frozenset[int],
                 max_len: int):
        self.prompt, self.prompt_ids, self.params = prompt, list(prompt_ids), params
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.max_len = max_len  # the most tokens (prompt + generated) a sequence may hold
        if len(self.prompt_ids) >= max_len:
            raise InvalidRequestError(f"the prompt has {len(self.prompt_ids)} tokens, the context limit is {max_len} "
                                      f"(prompt + at least one generated token must fit)", "prompt")
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence([])]
        self.finished: list[BeamSearchSequence] = []
        self._retire_full()

    @property
    def done(self) -> bool:
        return not self.beams

    def pending(self) -> list[list[int]]:
        """Prompt + tokens of each live beam, in :attr:`beams` order (what :meth:`advance` expects answers for)."""
        return [self.prompt_ids + b.tokens for b in self.beams]

    def advance(self, expansions: list[dict[int, float]]) -> None:
        """One search step: ``expansions[i]`` holds the top next tokens of ``beams[i]`` and their log-probabilities."""
        if len(expansions) != len(self.beams):
            raise ValueError(f"got {len(expansions)} expansions for {len(self.beams)} beams")
        candidates: list[BeamSearchSequence] = []
        for beam, tops in zip(self.beams, expansions, strict=True):
            # a beam ends once, at its most likely end-of-sequence token: a model with several (Llama 3's) finished
            # one sequence per id, equal but for that id (the same text without include_stop_str_in_output)
            ends = [(token, logprob) for token, logprob in tops.items() if token in self.eos_ids]
            if ends:
                token, logprob = max(ends, key=lambda e: e[1])  # (the first of equals: the engine's order)
                keep = self.params.include_stop_str_in_output
                self.finished.append(BeamSearchSequence(beam.tokens + [token] * keep, beam.logprobs + [logprob] * keep,
                                                        beam.cum_logprob + logprob, "stop", token))
            candidates += [beam.extend(token, logprob) for token, logprob in tops.items() if token not in self.eos_ids]
        # (candidates of one step all have the same length: the score ranks them as cum_logprob does; a stable
        # sort keeps the engine's order, most likely first, between equal scores)
        candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self._retire_full()

    def _retire_full(self) -> None:
        """Beams at max_tokens, or whose next token the context cannot hold, finish with reason "length"."""
        live = []
        for b in self.beams:  # (the engine takes prompts shorter than max_len: one token must fit after them)
            if len(b.tokens) >= self.params.max_tokens or len(self.prompt_ids) + len(b.tokens) >= self.max_len:
                b.finish_reason = "length"
                self.finished.append(b)
            else:
                live.append(b)
        self.beams = live

    def best(self, detokenize=None) -> BeamSearchOutput:
        """The ``beam_width`` best sequences by score (``detokenize(ids)`` fills their text when given: the text of
        prompt + tokens past the prompt's, so that a first token's leading space stays, as in ``generate``)."""
        lp, prompt_len = self.params.length_penalty, len(self.prompt_ids)
        for seq in self.finished:
            seq.score = beam_score(seq, lp, prompt_len)
        ranked = sorted(self.finished, key=lambda s: _log_neg_score(s, lp, prompt_len))[: self.params.beam_width]
        if detokenize is not None:
            head = detokenize(self.prompt_ids)
            for seq in ranked:
                whole = detokenize(self.prompt_ids + seq.tokens)
                seq.text = whole[len(head):] if whole.startswith(head) else detokenize(seq.tokens)
        return BeamSearchOutput(self.prompt, self.prompt_ids, ranked)


def expansion(logprobs: dict[int, Logprob], width: int) -> dict[int, float]:
    """A one-token request's log-probabilities as an expansion: its ``width`` most likely tokens (the generated
    token comes first in the dict and is among them: greedy)."""
    ranked = sorted(logprobs.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 0, -kv[1].logprob))
    return {t: lp.logprob for t, lp in ranked[:width]}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
