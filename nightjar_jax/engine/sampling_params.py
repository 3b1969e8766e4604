"""Per-request sampling parameters (vLLM-compatible names), validated on construction."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any

# The most top log-probabilities a request may ask for per token (vLLM's default ``max_logprobs``; OpenAI's chat API
# allows 20 ``top_logprobs``).
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI's API takes up to 300)
MAX_BAD_WORDS = 1024  # entries of one request's bad_words (each checked on the host per position)
MAX_STOP_STRINGS = 1024  # entries of one request's stop (each looked for in the new text of every step, on the host)
# the smallest repetition penalty: a positive float32 logit divided by less (1e-308 is 0 in float32) left the float
# range (inf, and NaN for a 0 logit)
MIN_REPETITION_PENALTY = 1e-6


class InvalidRequestError(ValueError):
    """A request's input that the engine cannot serve; ``field`` names the parameter at fault (``"prompt"``,
    ``"top_p"``, ...) so a server can point at it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error message quotes what was sent, not all of it)."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, ending in " ..." when cut."""
    return text if len(text) <= limit else text[: limit - 4] + " ..."


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what a request's outputs from ``LLMEngine.step`` carry (``SamplingParams.output_kind``)."""

    CUMULATIVE = 0  # every step: everything so far (text, token ids, log-probabilities), and the step's delta_*
    DELTA = 1  # every step: what the step added (text and token_ids are the delta; cumulative_logprob the sum)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything (n > 1: every sequence, in one output)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's names): ``json`` a JSON schema (a dict or its JSON text), ``json_object`` any
    JSON object, ``regex`` a regular expression the whole output matches, ``choice`` one of these strings exactly,
    ``grammar`` an EBNF grammar (xgrammar's GBNF dialect, ``root ::= ...``)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(set_) if set_ else 'none'}", "structured_outputs")
        checks = {
            "json": isinstance(self.json, (dict, str)),
            "json_object": self.json_object is True,
            "regex": isinstance(self.regex, str) and bool(self.regex),
            "choice": isinstance(self.choice, (list, tuple)) and bool(self.choice)
            and all(isinstance(c, str) and c for c in self.choice),
            "grammar": isinstance(self.grammar, str) and bool(self.grammar.strip()),
        }
        allowed = {"json": "a JSON schema (an object, or its JSON text)", "json_object": "true",
                   "regex": "a non-empty regular expression", "choice": "a non-empty list of non-empty strings",
                   "grammar": "a non-empty EBNF grammar"}
        kind = set_[0]
        if not checks[kind]:
            raise InvalidRequestError(f"structured outputs: {kind}={clip(repr(getattr(self, kind)))} is invalid: "
                                      f"allowed {allowed[kind]}", "structured_outputs")
        if kind == "choice":
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> StructuredOutputs:
        """From a request body's ``structured_outputs`` object (vLLM's), unknown keys refused. vLLM's
        ``disable_any_whitespace`` is taken either way (JSON is written with fixed whitespace here, xgrammar's
        ``", "`` and ``": "`` separators and no other, which any-whitespace JSON allows too), ``disable_fallback``
        too (there is one backend, xgrammar, and no fallback to disable), and
        ``whitespace_pattern`` / ``structural_tag`` at null only."""
        if not isinstance(spec, dict):
            raise InvalidRequestError("structured_outputs must be an object with one of "
                                      f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        spec = dict(spec)
        for key in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(spec.pop(key, False), bool):
                raise InvalidRequestError(f"structured_outputs.{key} must be true or false", "structured_outputs")
        for key, why in (("whitespace_pattern", "JSON is written with fixed whitespace: ', ' and ': ' only"),
                         ("structural_tag", "one constraint over the whole output")):
            if spec.get(key, None) is not None:
                raise InvalidRequestError(f"structured_outputs.{key} is not supported here ({why}): leave it out",
                                          "structured_outputs")
            spec.pop(key, None)
        unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown keys {unknown}: allowed "
                                      f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        return cls(**{k: v for k, v in spec.items() if v is not None})


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 (or at least the vocabulary size) means off, ``top_p`` 1
    means off, ``min_p`` 0 means off.
    ``seed`` makes sampling reproducible per request, independent of what else is in the batch and of the
    speculation: a seeded request's speculative steps verify its drafts against the tokens plain steps would draw and
    commit those (``SamplingTensors.exact``, ``nightjar_jax/spec/rejection.py``), so its tokens are plain
    decoding's at any γ the planner picks. Its drafts are accepted less often than rejection sampling accepts an
    unseeded request's (docs/benchmarks.md, "Seeded requests at any γ").
    ``stop`` strings end the completion (the stop string itself is not included in the text);
    ``stop_token_ids`` end it with the token included in ``token_ids`` but not in the text (with
    ``include_stop_str_in_output`` in the text too, as vLLM; likewise a stop string, and an EOS's text where
    ``skip_special_tokens`` is off).
    ``logprobs`` (None: off) returns, for every generated token, its log-probability and those of the ``logprobs``
    most likely tokens at that position (0: the generated token's alone), from the model's own distribution (the
    log-softmax of its logits, before temperature and filtering, as vLLM's default and the OpenAI API report).
    ``prompt_logprobs`` (None: off) does the same for the prompt's tokens after the first (``RequestOutput.
    prompt_logprobs``; the completions API's ``echo`` with ``logprobs`` reads them), computed in the prefill passes.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100), greedy rows included
    # OpenAI's: subtracted from the logit of every token already generated (presence: once; frequency: per time),
    # in [-2, 2]; speculative steps count the drafts before each position too (sampler.apply_penalties)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (HF's): the logit of every token in the prompt or already generated is divided by it when positive and
    # multiplied by it when negative, before presence / frequency; > 0, 1 = off, > 1 discourages repeats
    repetition_penalty: float = 1.0
    # vLLM's: EOS and stop_token_ids cannot be generated, and stop strings do not end the text, before this many
    # tokens (a speculative step accepts only the drafts that keep it under)
    min_tokens: int = 0
    # a constraint on the output (JSON schema, JSON object, regex, choice, grammar; nightjar_jax/engine/structured.py;
    # a dict is read as vLLM's structured_outputs object); chain steps verify its drafts under its mask
    structured_outputs: StructuredOutputs | dict | None = None
    # vLLM's: the only tokens the request may generate (their logits kept, every other one banned, in the draft's
    # steps too, so speculation stays lossless); None: all
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output may not contain (each tokenized as written and with a leading space; the last token of
    # one is banned wherever the output's last tokens are the rest of it, in speculative steps at every position too)
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1: as many as the engine takes (its context
    # limit less the one token it must generate); None: the whole prompt (too long a prompt is an error)
    truncate_prompt_tokens: int | None = None
    # vLLM's: False leaves the output's text empty and its log-probabilities' decoded_token None (token ids only, no
    # detokenizing per step); stop strings need it
    detokenize: bool = True
    # vLLM's: what LLMEngine.step's outputs of the request carry (RequestOutputKind); LLM.generate reads finished ones
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's fields at the only values served here: best_of None (or n: no extra sequences to rank, as vLLM V1) and
    # spaces_between_special_tokens True
    best_of: int | None = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop_token_ids", "allowed_token_ids"):  # (a NumPy array of ids, e.g. from np.argsort)
            value = getattr(self, name)
            if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
                setattr(self, name, value.tolist())
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                kind = "a string or a list of non-empty strings" if name == "stop" else "a list of token ids"
                raise InvalidRequestError(f"SamplingParams.{name}={short_repr(value)} is invalid: allowed None or "
                                          f"{kind}", name)
            setattr(self, name, list(value or []))
        # NumPy integers as token ids, and NumPy numbers as bias values (np.int64(2) was "not a non-negative integer")
        self.stop_token_ids = [plain_number(t) for t in self.stop_token_ids]
        if isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = [plain_number(t) for t in self.allowed_token_ids]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {plain_number(t): plain_number(v) for t, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.allowed_token_ids, (tuple, set, frozenset)):
            self.allowed_token_ids = sorted(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequestError(f"SamplingParams.structured_outputs={short_repr(self.structured_outputs)} is "
                                      "invalid: allowed None, a StructuredOutputs or a dict", "structured_outputs")
        if self.output_kind in tuple(RequestOutputKind) and not isinstance(self.output_kind, bool):
            self.output_kind = RequestOutputKind(self.output_kind)
        else:
            raise InvalidRequestError(f"SamplingParams.output_kind={short_repr(self.output_kind)} is invalid: allowed "
                                      f"a RequestOutputKind ({', '.join(k.name for k in RequestOutputKind)})",
                                      "output_kind")
        for name in _NUMBER_FIELDS:  # NumPy scalars as Python numbers (np.float64 passed, np.float32 was refused)
            setattr(self, name, plain_number(getattr(self, name)))
        checks = [
            *((isinstance(getattr(self, name), bool), name, "True or False")
              for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize")),
            (not self.stop or self.detokenize is not False, "stop", "no stop strings with detokenize=False (they are "
             "found in the text; stop_token_ids end a request without it)"),
            (self.best_of is None or (_is_id(self.best_of) and self.best_of == self.n), "best_of",
             "None or n (best_of > n ranks extra sequences, which is not served here, nor in vLLM V1)"),
            (self.spaces_between_special_tokens is True, "spaces_between_special_tokens",
             "True (the only value served here)"),
            (_is_id(self.n) and self.n >= 1, "n", "an integer >= 1"),
            (_is_number(self.temperature) and 0 <= self.temperature <= 100, "temperature", "a float in [0, 100]"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a float in (0, 1]"),
            (_is_id(self.top_k), "top_k", "an integer >= 0 (0 or -1: off)"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a float in [0, 1]"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and -(2**63) <= self.seed < 2**63), "seed",
             "None or an integer in [-2**63, 2**63) (vLLM's 64-bit range)"),
            (self.max_tokens is None or (_is_id(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             "None or an integer >= 1"),
            (all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"at most {MAX_STOP_STRINGS} non-empty strings"),
            (all(_is_id(t) for t in self.stop_token_ids), "stop_token_ids", "non-negative integers"),
            (_is_count(self.logprobs), "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]"),
            (_is_count(self.prompt_logprobs), "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]"),
            (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0
             and (not _is_id(self.max_tokens) or self.min_tokens <= self.max_tokens), "min_tokens",
             "an integer >= 0 and at most max_tokens"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "a float in [-2, 2]"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "a float in [-2, 2]"),
            (_is_number(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100,
             "repetition_penalty",
             "a float in [0.000001, 100] (1: off; smaller divides a float32 logit past its range)"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                                         and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 and _is_number(v) and -100 <= v <= 100
                                                 for t, v in self.logit_bias.items())), "logit_bias",
             f"None or a dict of at most {MAX_LOGIT_BIAS} token ids (integers >= 0) to numbers in [-100, 100]"),
            (self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                and all(_is_id(t) for t in self.allowed_token_ids)),
             "allowed_token_ids", "None or a non-empty list of token ids (integers >= 0)"),
            (self.bad_words is None or (isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_BAD_WORDS
                                        and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             "bad_words", f"None or a list of at most {MAX_BAD_WORDS} strings with a non-space character"),
            (self.truncate_prompt_tokens is None or (_is_id(self.truncate_prompt_tokens) and
                                                     self.truncate_prompt_tokens >= 1) or
             self.truncate_prompt_tokens == -1, "truncate_prompt_tokens",
             "None, an integer >= 1 (keep the prompt's last k tokens) or -1 (as many as the engine takes)"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidRequestError(
                    f"SamplingParams.{name}={short_repr(getattr(self, name))} is invalid: allowed {allowed}", name
                )

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy (its lists, dicts and constraint too), to change without touching this one."""
        return copy.deepcopy(self)

    def checked_copy(self) -> SamplingParams:
        """What ``add_request`` keeps: a deep copy, checked again (a field set after construction is checked here).
        The request never sees what its caller changes in this object afterwards (vLLM copies too)."""
        # (the output constraint is shared, not copied: its grammar is compiled as the request is added, and a
        # deeply nested JSON schema, which the grammar backend refuses by name, overflowed deepcopy's recursion)
        new = copy.deepcopy(self, {id(self.structured_outputs): self.structured_outputs})
        new.__post_init__()
        return new


_NUMBER_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
                  "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "truncate_prompt_tokens", "best_of")


def plain_number(x: Any) -> Any:
    """A NumPy integer or float scalar as the Python number it holds; anything else (a NumPy bool too) as it is."""
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        item = x.item()
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            return item
    return x


def _is_count(x: object) -> bool:
    """None or an integer in [0, MAX_LOGPROBS] (not a bool)."""
    return x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_LOGPROBS)


def _is_id(x: object) -> bool:
    """An integer >= 0 (not a bool): a token id or a count."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def child_params(sp: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sequence ``index`` of ``sp.n`` (n = 1 each; seed ``seed + index`` when seeded, past
    ``2**63 - 1`` wrapping to 0 on, so the n sequences differ, each is reproducible, and sequence 0 draws the seed's
    own stream)."""
    if sp.n == 1:
        return sp
    import dataclasses

    # (best_of goes with n: a child of one sequence ranks nothing)
    return dataclasses.replace(sp, n=1, best_of=None, seed=child_seed(sp.seed, index))


def child_seed(seed: int | None, index: int) -> int | None:
    """Sequence ``index``'s seed of a request seeded ``seed``: ``seed + index``, past ``2**63 - 1`` wrapping to 0
    on (sequence 0 draws the seed's own stream)."""
    if seed is None:
        return None
    return seed + index - (2**63 if seed + index >= 2**63 else 0)


StructuredOutputsParams = StructuredOutputs  # (vLLM's name)
