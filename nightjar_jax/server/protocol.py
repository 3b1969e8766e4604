"""OpenAI-compatible request bodies (pydantic) and the OpenAI error shape.

Unknown fields are rejected (``extra="forbid"``), but the fields the official clients commonly send are accepted
at their neutral values (``user``, ``prompt_cache_key``, ...; ``store`` at any value, nothing stored); a non-neutral
value of a field this server does not implement is a 400 that names the field. ``logprobs`` (completions: the top-k,
0-20; chat: ``logprobs`` true with ``top_logprobs`` 0-20) returns the generated tokens' log-probabilities in the
OpenAI shapes (see ``app.py``); completions' ``echo`` prepends the prompt (and its tokens' log-probabilities).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, field_validator

from nightjar_jax.engine.beam_search import BeamSearchParams
from nightjar_jax.engine.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams, short_repr


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The ranges of the number fields SamplingParams checks (pydantic only takes them as numbers), for the 400 of a
# value that is no finite number
_CHECKED_RANGES = {"presence_penalty": "[-2, 2]", "frequency_penalty": "[-2, 2]",
                   "repetition_penalty": "[0.000001, 100]", "logit_bias": "[-100, 100]"}


def number_range(model: type[BaseModel] | None, name: str) -> str:
    """The range the number field ``name`` of ``model`` takes, as ``[0, 100]`` or ``(0, 1]`` ("" when unknown)."""
    if name in _CHECKED_RANGES:
        return _CHECKED_RANGES[name]
    field = model.model_fields.get(name) if model is not None else None
    bounds = {k: getattr(m, k) for m in (field.metadata if field else ()) for k in ("ge", "gt", "le", "lt")
              if getattr(m, k, None) is not None}
    low = next(((k, v) for k, v in bounds.items() if k in ("ge", "gt")), None)
    high = next(((k, v) for k, v in bounds.items() if k in ("le", "lt")), None)
    if low and high:
        return f"{'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    if low or high:
        kind, value = low or high
        return f"{ {'ge': '>=', 'gt': '>', 'le': '<=', 'lt': '<'}[kind]} {value}"
    return ""


# Per request: the sequences a completions request may queue (its prompts x n), and the tools of a chat request
# (OpenAI's limit)
MAX_SEQUENCES_PER_REQUEST = 4096
MAX_TOOLS = 128

# A token id is a JSON integer: not true / false or "5" (lax parsing would read them as 1 / 0 / 5).
TokenId = StrictInt


def _no_control_characters(value: str) -> str:
    """A body's ``request_id`` names the response (its ``id``) and the server's log lines: control and format
    characters (a newline, NUL, a bidi override) and line or paragraph separators are refused, as in an
    X-Request-Id header (where any non-printable-ASCII id is replaced)."""
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"request_id holds the control character {bad!r}: give printable text")
    return value


# vLLM's request_id field (1-256 characters, no control characters)
RequestId = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_no_control_characters)]


class _Strict(BaseModel):
    # unknown fields are 400s, and so are values of the wrong JSON type (as OpenAI's API answers): "5" or 5.0 for
    # an integer, "yes" or 1 for a boolean (an integer for a number is fine), NaN or Infinity for a number
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # (OpenAI's padding of chunks against size side channels: none is sent)


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)  # (vLLM's range; 1 keeps only the most likely tokens)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # (vLLM's 64-bit range)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: no stop (EOS, stop ids, stop strings) before this many tokens
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; only its default (see unsupported)
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0  # [-2, 2] (SamplingParams checks); speculative steps count drafts
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # vLLM's: [1e-6, 100], 1 (or none) = off; over prompt and output tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: the only tokens the output may hold
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's: keep the prompt's last k tokens (-1: as many as fit)
    priority: StrictInt = 0  # vLLM's: lower is served first (serve --scheduling-policy priority; else only 0)
    # vLLM's: the prompt's tokens' log-probabilities (each with this many most likely tokens), as "prompt_logprobs"
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured outputs (nightjar_jax/engine/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # object, or vLLM's older guided_* fields; at most one of them per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: the response's n choices per prompt are the n best sequences of a beam search of width n
    # (nightjar_jax/engine/beam_search.py), ranked by cum_logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the response's id is "cmpl-<request_id>" / "chatcmpl-<request_id>" (an X-Request-Id header wins, as
    # in vLLM); two requests in flight may not share one
    request_id: RequestId | None = None
    # vLLM's: log-probabilities' tokens as "token_id:<id>" instead of their text (for text that is not valid UTF-8)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the token ids beside the text (an RL trainer's tokens, no re-encoding): a completion choice's
    # "prompt_token_ids" and "token_ids"; chat: "prompt_token_ids" on the response, "token_ids" on each choice.
    # Streamed: the prompt's with the first chunk (a completion choice's first), each chunk's new tokens after.
    return_token_ids: bool | None = None
    # Accepted at their neutral values only (see unsupported).
    user: str | None = None
    safety_identifier: str | None = None  # (OpenAI's successor of 'user')
    prompt_cache_key: str | None = None  # (prefix caching needs no key: it finds shared prefixes by their tokens)
    prompt_cache_retention: str | None = None
    best_of: int | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's stored completions: taken and not stored, as vLLM takes it (SDKs send it; nothing is kept here)
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's, None by default: accepted at their neutral values only too
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's: prefix-cache pages are shared only between requests with the same salt (tenants kept apart)
    cache_salt: str | None = Field(default=None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_null(cls, value: Any) -> Any:
        return 1 if value is None else value  # (OpenAI's n is nullable: null is the default, 1)

    def unsupported(self) -> list[tuple[str, bool, str]]:
        """(field, is_set_to_a_value_this_server_cannot_honour, what the 400 adds: "" or what to do instead)."""
        return [
            ("best_of", self.best_of is not None and self.best_of != self.n,
             f"best_of must be at least n={self.n}, as vLLM's"
             if isinstance(self.best_of, int) and self.best_of < self.n
             else f"allowed null or n ({self.n}): ranking extra sequences is not served here, nor in vLLM V1"),
            ("spaces_between_special_tokens", not self.spaces_between_special_tokens, ""),
            ("service_tier", self.service_tier not in (None, "auto", "default"), ""),
            ("guided_decoding_backend", self.guided_decoding_backend not in (None, "xgrammar", "auto"),
             "structured outputs run on xgrammar here: allowed 'xgrammar' or 'auto' (or leave it out)"),
            ("guided_whitespace_pattern", self.guided_whitespace_pattern is not None, ""),
            ("kv_transfer_params", self.kv_transfer_params is not None, "no KV cache is transferred between servers"),
            ("vllm_xargs", bool(self.vllm_xargs), ""),
            ("logits_processors", bool(self.logits_processors), ""),
        ]

    def check_unsupported(self) -> None:
        for name, bad, why in self.unsupported():
            if bad:
                raise APIError(400, f"'{name}'={short_repr(getattr(self, name))} is not supported by this server"
                                    + (f": {why}" if why else ""), param=name)
        if isinstance(self.stop, list) and not all(self.stop):
            raise APIError(400, "'stop' strings must be non-empty", param="stop")
        if isinstance(self.stop, str) and not self.stop:
            raise APIError(400, "'stop' must be a non-empty string", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' applies to streamed responses only: set 'stream': true or leave "
                                "it out", param="stream_options")
        if not self.use_beam_search and self.length_penalty != 1.0:
            raise APIError(400, "'length_penalty' ranks the sequences of a beam search: set 'use_beam_search': true "
                                "or leave it out", param="length_penalty")

    def beam_conflicts(self) -> list[str]:
        """Fields set to values a beam search cannot honour: it ranks the model's own log-probabilities (no
        sampling, penalty, bias or constraint applies), ends sequences at EOS or the length, and answers whole."""
        return [name for name, bad in [
            ("stream", bool(self.stream)),
            ("temperature", self.temperature not in (None, 0)),
            ("top_p", self.top_p not in (None, 1)),
            ("top_k", self.top_k not in (None, 0, -1)),
            ("min_p", self.min_p not in (None, 0)),
            ("stop", bool(self.stop)),
            ("stop_token_ids", bool(self.stop_token_ids)),
            ("min_tokens", self.min_tokens != 0),
            ("presence_penalty", bool(self.presence_penalty)),
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("repetition_penalty", self.repetition_penalty not in (None, 1)),
            ("logit_bias", bool(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids is not None),
            ("bad_words", bool(self.bad_words)),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is not None),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            (self.structured_field(), self.structured() is not None),
        ] if bad]

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """``use_beam_search``'s parameters (width ``n``); a field it cannot honour, or a bad value, is a 400."""
        bad = self.beam_conflicts()
        if bad:
            raise APIError(400, f"'{bad[0]}' is not supported with 'use_beam_search': a beam search returns the n "
                                f"best whole sequences by the model's own log-probabilities (leave '{bad[0]}' out, or "
                                f"turn 'use_beam_search' off)", param=bad[0])
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    length_penalty=self.length_penalty,
                                    include_stop_str_in_output=self.include_stop_str_in_output)
        except InvalidRequestError as exc:
            name = {"beam_width": "n"}.get(exc.field, exc.field)
            raise APIError(400, str(exc).replace(f"BeamSearchParams.{exc.field}", f"'{name}' (the beam width)"
                                                 if name == "n" else f"'{name}'"), param=name) from None

    def sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters for this request; ``defaults`` (the model's generation config,
        ``LLMEngine.generation_defaults``) fill the sampling fields and ``max_tokens`` it leaves unset."""
        defaults = defaults or {}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        kwargs: dict[str, Any] = dict(
            n=1,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            seed=self.seed,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            logit_bias=self.token_bias(),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(defaults.get("repetition_penalty", 1.0) if self.repetition_penalty is None
                                else self.repetition_penalty),
            structured_outputs=self.structured(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            value = defaults.get(name) if value is None else value
            if value is not None:
                kwargs[name] = value
        return SamplingParams(**kwargs)

    def structured(self) -> dict[str, Any] | None:
        """The request's output constraint as vLLM's ``structured_outputs`` object (None: unconstrained), from
        whichever of ``response_format``, ``structured_outputs`` and ``guided_*`` it set."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                for key, kind_, name in (("name", str, "a string"), ("description", str, "a string"),
                                         ("strict", bool, "a boolean")):
                    if isinstance(spec, dict) and spec.get(key) is not None and not isinstance(spec[key], kind_):
                        raise APIError(400, f"'response_format.json_schema.{key}' must be {name}, got "
                                            f"{short_repr(spec[key])}", param="response_format")
                if not isinstance(schema, dict):
                    raise APIError(400, "'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., "
                                        "'schema': {...}} with the schema an object", param="response_format")
                if spec.get("name") is None:  # (OpenAI's and vLLM's required field)
                    raise APIError(400, "'response_format.json_schema.name' is missing: 'response_format' of type "
                                        "'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}",
                                   param="response_format")
                given.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise APIError(400, f"'response_format' type {short_repr(kind)} is not supported: allowed 'text', "
                                    "'json_object', 'json_schema'", param="response_format")
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        given += [(f"guided_{k}", {k: v}) for k, v in guided.items() if v is not None]
        if len(given) > 1:
            raise APIError(400, f"set one output constraint, not {len(given)}: {', '.join(n for n, _ in given)}",
                           param=given[1][0])
        return given[0][1] if given else None

    def structured_field(self) -> str:
        """The request field that set the output constraint: the ``param`` its errors name (the engine's name for
        them all is ``structured_outputs``)."""
        fmt = self.response_format
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            return "response_format"
        if self.structured_outputs is not None:
            return "structured_outputs"
        return next((f"guided_{k}" for k in ("json", "regex", "choice", "grammar")
                     if getattr(self, f"guided_{k}") is not None), "structured_outputs")

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids as JSON strings) as integers."""
        if not self.logit_bias:
            return None
        # (int() would take "5_0" or " 5 ", and refuse digits past Python's 4300 with its own message)
        bad = [k for k in self.logit_bias if not re.fullmatch(r"-?[0-9]{1,18}", k)]
        if bad:
            raise APIError(400, f"'logit_bias' keys must be token ids written as decimal integers (\"50\"): got "
                                f"{short_repr(bad[0])}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    def num_logprobs(self) -> int | None:
        """The top log-probabilities each generated token carries (None: none asked)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (None: none asked)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries its request's usage so far (vLLM's ``continuous_usage_stats``, which like
        vLLM takes effect with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


PromptField = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: int | None = Field(default=16, ge=0)  # 0: only with echo (score the prompt, generate nothing)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: whether a text prompt's encoding adds the tokenizer's special tokens (BOS); token ids are as given
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None  # (vLLM's: only null)

    def unsupported(self) -> list[tuple[str, bool, str]]:
        return super().unsupported() + [
            ("suffix", bool(self.suffix), ""),
            ("prompt_embeds", self.prompt_embeds is not None, "send the prompt as text or token ids"),
        ]

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens'=0 needs 'echo': true (score the prompt only); otherwise at least 1",
                           param="max_tokens")

    def beam_conflicts(self) -> list[str]:
        return super().beam_conflicts() + [name for name, bad in [
            ("echo", bool(self.echo)), ("logprobs", self.logprobs is not None)] if bad]

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the response holds the prompt (and its log-probabilities) alone."""
        return bool(self.echo) and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        """max_tokens for the engine: a prompt-only request still runs one step (its token is dropped)."""
        return 1 if self.prompt_only else self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo's (its logprobs) or vLLM's prompt_logprobs, the larger when both are asked (echo shows its own)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string or a list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[union-attr]
        # ("" is a prompt, as in the library and vLLM: a tokenizer that adds BOS makes it one token, else the engine
        # refuses it as empty; an empty list of token ids is no prompt)
        if not prompts or not all(isinstance(x, str) or x for x in prompts):
            raise APIError(400, "'prompt' is empty: give at least one non-empty prompt", param="prompt")
        if len(prompts) * self.n > MAX_SEQUENCES_PER_REQUEST:  # (10 KB of prompts x n=128 queued 256,000 sequences)
            raise APIError(400, f"{len(prompts)} prompts x n={self.n} is {len(prompts) * self.n} sequences: allowed at "
                                f"most {MAX_SEQUENCES_PER_REQUEST} per request (send the rest in more requests)",
                           param="prompt")
        return prompts


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # (Anthropic-style prompt-caching hints some clients send: unused)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients echo back extra keys (refusal, annotations, ...)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {short_repr(kind)} are not supported: the models this "
                                 f"server runs read text; allowed {{\"type\": \"text\", \"text\": ...}} parts")
        return value

    def check(self, i: int) -> None:
        """OpenAI's rules for a message's shape, each a 400 naming the field (``messages[i].content``): content
        given, and not an empty list of parts (an assistant's may be left out beside its tool calls or a refusal, as
        the API's own answers carry them); ``tool_calls`` a list of ``{"function": {"name": ...}}``; a tool message
        answers a ``tool_call_id``."""
        at, extra = f"messages[{i}]", self.model_extra or {}
        calls = extra.get("tool_calls")
        if self.content == []:
            raise APIError(400, f"'{at}.content' is an empty list: give a string or at least one text part",
                           param=f"{at}.content")
        if self.content is None and not (self.role == "assistant" and (calls or extra.get("refusal") is not None)):
            needs = "an assistant message needs 'content' or 'tool_calls'" if self.role == "assistant" else \
                f"a {self.role} message needs 'content'"
            raise APIError(400, f"'{at}.content' is missing: {needs} (a string or a list of text parts)",
                           param=f"{at}.content")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise APIError(400, f"'{at}.tool_calls' must be a list of tool calls {{'id': ..., 'type': 'function', "
                                f"'function': {{'name': <a string>, 'arguments': ...}}}}; got {short_repr(calls)}",
                           param=f"{at}.tool_calls")
        if self.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            raise APIError(400, f"'{at}.tool_call_id' must be a string: a tool message needs 'tool_call_id', the id "
                                f"of the call it answers; got {short_repr(extra.get('tool_call_id'))}",
                           param=f"{at}.tool_call_id")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # (vLLM joins text parts with newlines)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message instead of a new one
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking...)
    # vLLM's: a Jinja template for this request instead of the model's (serve --trust-request-chat-template)
    chat_template: str | None = None
    # vLLM's: the answer's content starts with the last message when it is the answer's role's (the assistant's;
    # without a generation prompt, the last message's own): with continue_final_message, the whole message
    echo: bool = False
    # vLLM's: whether encoding the rendered text adds the tokenizer's special tokens (BOS); with true (here the
    # default) a BOS the template wrote itself is kept once; false: only what the template wrote (vLLM's default)
    add_special_tokens: bool = True
    # OpenAI's, accepted at their neutral values only (see unsupported)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: Any = None  # (OpenAI's deprecated forms of tools and tool_choice)
    function_call: Any = None
    documents: list[dict[str, Any]] | None = None  # vLLM's (RAG): the chat template's documents
    # vLLM's, accepted at their neutral values only (see unsupported)
    mm_processor_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    _tool_parser: str | None = PrivateAttr(default=None)  # the server's parser for tool_choice "auto", if any

    def unsupported(self) -> list[tuple[str, bool, str]]:
        return super().unsupported() + [
            ("reasoning_effort", self.reasoning_effort is not None, ""),
            ("verbosity", self.verbosity is not None, ""),
            ("audio", self.audio is not None, ""),
            ("prediction", self.prediction is not None, ""),
            ("web_search_options", self.web_search_options is not None, ""),
            ("moderation", bool(self.moderation), ""),
            ("prompt_cache_options", bool(self.prompt_cache_options), ""),
            ("modalities", self.modalities not in (None, ["text"]), ""),
            ("functions", self.functions is not None, "OpenAI's deprecated 'functions': use 'tools'"),
            ("function_call", self.function_call is not None, "OpenAI's deprecated 'function_call': use 'tool_choice'"),
            ("mm_processor_kwargs", bool(self.mm_processor_kwargs), "the models this server runs read text"),
            ("thinking_token_budget", self.thinking_token_budget is not None, ""),
        ]

    def served_tool_choice(self) -> Any:
        """``tool_choice`` as served: "required" with an empty ``tools`` list is "none" (vLLM's rule); so is "auto"
        with an empty list, with no tool to call (vLLM keeps it "auto", a 400 without --enable-auto-tool-choice; only
        ``tools`` missing or null beside a ``tool_choice`` is an error here)."""
        return "none" if self.tool_choice in ("required", "auto") and self.tools == [] else self.tool_choice

    def allow_auto_tools(self, parser: str | None) -> None:
        """``tool_choice`` "auto" parses calls from free text with ``parser`` (the server's
        ``--tool-call-parser``); None: "auto" is refused, as vLLM refuses it without ``--enable-auto-tool-choice``."""
        self._tool_parser = parser

    def tool_call(self) -> tuple[str, list[dict[str, Any]]] | None:
        """How the answer calls tools: ``("named", [tool])`` (``tool_choice`` names a function: the output is its
        arguments), ``("required", tools)`` (a JSON array of ``{"name", "parameters"}``, at least one, at most one
        with ``parallel_tool_calls`` false), ``("auto", tools)`` (``tool_choice`` "auto", OpenAI's default when tools
        are given: the model writes what it likes, and the server's tool-call parser finds calls in it, see
        ``tool_parsers.py``; a 400 when the server has no parser enabled), or None (no tools, or ``tool_choice``
        "none")."""
        if not self.tools:
            choice = self.served_tool_choice()
            fn = choice.get("function") if isinstance(choice, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                raise APIError(400, f"'tool_choice' names the function {short_repr(fn['name'])}, which is not among "
                                    f"'tools' (none given)", param="tool_choice")
            if choice not in (None, "none"):
                raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
            return None
        tools = checked_tools(self.tools)
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if choice == "none":
            return None
        if choice == "required":
            return "required", tools
        if choice == "auto":
            if self._tool_parser is None:
                raise APIError(400, "'tool_choice' 'auto' (the default with 'tools') needs a parser of this model's "
                                    "tool-call format, which this server was started without (serve "
                                    "--enable-auto-tool-choice --tool-call-parser hermes): set 'required', name a "
                                    "function ({'type': 'function', 'function': {'name': ...}}) or 'none'",
                               param="tool_choice")
            return "auto", tools
        fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        named = [t for t in tools if t["name"] == name]
        if not named:
            known = ", ".join(t["name"] for t in tools)
            raise APIError(400, f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', "
                                f"'function': {{'name': <one of the tools: {known}>}}}}; got {short_repr(choice)}",
                           param="tool_choice")
        return "named", named

    def structured_field(self) -> str:
        """``tools`` when a named or required tool call sets the constraint (their parameters' schemas)."""
        call = self.tool_call()
        return "tools" if call is not None and call[0] != "auto" else super().structured_field()

    def structured(self) -> dict[str, Any] | None:
        """The output constraint: a tool call's (:meth:`tool_call`), or the one the sampling fields set."""
        other = super().structured()
        call = self.tool_call()
        if call is None:
            return other
        mode, tools = call
        if mode == "auto":  # (free text: the model chooses, the parser reads; a format the request sets still holds)
            return other
        if other is not None:
            raise APIError(400, "set one output constraint, not 2: a tool call (tool_choice) and "
                                "response_format / structured_outputs / guided_*", param="tool_choice")
        if mode == "named":
            return {"json": tools[0]["parameters"]}
        # each tool's definitions ($defs, or draft-7 "definitions") move to the top of the combined schema, where
        # their "#/$defs/..." references resolve (vLLM's rule; the same name defined two ways is a 400)
        defs: dict[str, dict[str, Any]] = {}
        calls = []
        for i, t in enumerate(tools):
            # its other local references ("#", "#/properties/...") to where its parameters now sit: they pointed at
            # the combined array (a recursive "#" nested whole calls in the arguments)
            params = _rebase_refs(dict(t["parameters"]), f"#/items/anyOf/{i}/properties/parameters")
            for key in ("$defs", "definitions"):
                found = params.pop(key, None)
                if not isinstance(found, dict):
                    continue
                for name, schema in found.items():
                    if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                        raise APIError(400, f"tools define '{key}/{name}' in two different ways: with tool_choice "
                                            f"'required' the tools' definitions share one schema, so give each "
                                            f"name one definition", param="tools")
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        one = {"maxItems": 1} if self.parallel_tool_calls is False else {}  # (OpenAI's: one call at most)
        return {"json": {"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}, **defs}}

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for i, message in enumerate(self.messages):
            message.check(i)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def beam_conflicts(self) -> list[str]:
        return super().beam_conflicts() + [name for name, bad in [
            ("logprobs", bool(self.logprobs)), ("top_logprobs", self.top_logprobs is not None),
            ("tools", bool(self.tools)), ("tool_choice", self.served_tool_choice() not in (None, "none"))] if bad]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` but the definitions' ("#/$defs/...", "#/definitions/...": they move to the
    combined schema's top) read from ``base``, the JSON pointer where the schema now sits."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not ref.startswith(("#/$defs/",
                                                                                             "#/definitions/")):
        out["$ref"] = base + ref[1:]
    return out


def checked_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``tools`` (OpenAI's function definitions) checked, as ``{"name", "parameters"}`` each; an
    ``APIError`` naming ``tools`` for what OpenAI refuses (chat and ``/tokenize`` alike)."""
    if len(tools) > MAX_TOOLS:  # (a "required" call's grammar over thousands of tools took seconds and GBs)
        raise APIError(400, f"{len(tools)} tools: allowed at most {MAX_TOOLS}, as OpenAI's", param="tools")
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        params = fn.get("parameters", {"type": "object", "properties": {}}) if isinstance(fn, dict) else None
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) and isinstance(params, dict)):
            raise APIError(400, f"'tools'[{i}] must be {{'type': 'function', 'function': {{'name': <1-64 "
                                f"letters, digits, '_', '.' or '-'>, 'parameters': <a JSON schema object, "
                                f"optional>}}}}", param="tools")
        kind = params.get("type", "object")  # (none: OpenAI's parameters are an object's; {} is "no parameters")
        if not (kind == "object" or (isinstance(kind, list) and "object" in kind)):  # (["object", "null"]: as
            #                                                                           an object's: a call has one)
            raise APIError(400, f"'tools'[{i}] ({name}): 'parameters' must be an object's JSON schema (a call's "
                                f"arguments are a JSON object, as OpenAI's), got 'type' {short_repr(kind)}",
                                param="tools")
        if any(t["name"] == name for t in checked):  # (the name is all a call says of which function it calls)
            raise APIError(400, f"'tools'[{i}]: a second function named {name!r}: give each tool its own name",
                           param="tools")
        checked.append({"name": name, "parameters": {**params, "type": "object"}})
    return checked


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # (the ids the completion endpoints would see: they encode the same way)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (with messages, as on /v1/chat/completions)
    tools: list[dict[str, Any]] | None = None  # (with messages: rendered as /v1/chat/completions renders them)
    return_token_strs: bool = False  # vLLM's: each token's string too (the vocabulary's, as "token_strs")

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        for i, message in enumerate(self.messages or []):
            message.check(i)
        for name in ("tools", "chat_template"):
            if getattr(self, name) and self.messages is None:
                raise APIError(400, f"'{name}' goes with 'messages' (a chat template renders them), not with "
                                    f"'prompt'", param=name)
        if self.tools:  # (as chat checks them: a malformed one was a template error blamed on 'messages')
            checked_tools(self.tools)


class UpdateWeightsRequest(_Strict):
    """SGLang's ``POST /update_weights_from_disk`` (``serve --enable-weight-updates``): new weights from a checkpoint
    the server can read, for the target (``model_path``) and/or the draft (``draft_model_path``)."""

    model_path: str | None = None
    draft_model_path: str | None = None
    load_format: str | None = None  # (SGLang's; only the engine's own is read: None or "auto")
    # SGLang's other fields (an RL loop's client sends them)
    abort_all_requests: bool = False  # True: the requests in flight end at once (finish reason "abort"), no wait
    weight_version: str | None = None  # echoed in the answer
    flush_cache: bool = True  # the prefix cache is always forgotten (its K/V were the old weights'): False is a 400
    keep_pause: bool = False  # (no pause / continue_generation here: True is a 400)
    is_async: bool = False  # (accepted: the update is one engine call either way)
    torch_empty_cache: bool = False  # (CUDA's allocator: nothing to do here)
    recapture_cuda_graph: bool = False  # (CUDA graphs: a new layout's steps recompile anyway)
    token_step: int = 0  # (the trainer's step: accepted)

    def check(self) -> None:
        if self.model_path is None and self.draft_model_path is None:
            raise APIError(400, "give 'model_path' (the target's new checkpoint), 'draft_model_path' or both",
                           param="model_path")
        for name in ("model_path", "draft_model_path"):
            value = getattr(self, name)
            if value is not None and not value.strip():  # ("" was read as the current directory)
                raise APIError(400, f"{name} must be a non-empty path", param=name)
        if self.load_format not in (None, "auto"):
            raise APIError(400, f"'load_format' {short_repr(self.load_format)} is not supported: checkpoints load as "
                                "at start ('auto' or leave it out)", param="load_format")
        if not self.flush_cache:
            raise APIError(400, "'flush_cache' false is not supported: cached prefixes hold K/V the old weights "
                                "computed, so an update always forgets them (true, or leave it out)",
                           param="flush_cache")
        if self.keep_pause:
            raise APIError(400, "'keep_pause' true is not supported: this server has no pause / continue_generation; "
                                "requests queued behind the update run as soon as it is done (false, or leave it out)",
                           param="keep_pause")


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


def prompt_logprobs_json(entries: list[dict | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), ``{token id: {logprob, rank,
    decoded_token}}``, the asked top tokens plus the prompt's own."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def top_entries(entries: list[dict | None], tokens: list[int], k: int) -> list[dict | None]:
    """Each ``{token id: Logprob}`` entry cut to its ``k`` most likely tokens plus ``tokens[i]`` (the one that came)."""
    return [None if e is None else {t: lp for t, lp in e.items() if t == tok or (lp.rank is not None and lp.rank <= k)}
            for e, tok in zip(entries, tokens, strict=True)]


def _token_text(lp: Any, token: int, as_ids: bool = False) -> str:
    return lp.decoded_token if lp.decoded_token is not None and not as_ids else f"token_id:{token}"


def completion_logprobs(token_ids: list[int], logprobs: list[dict | None], text_offset: int = 0,
                        token_text=None, as_ids: bool = False) -> tuple[dict, int]:
    """The legacy completions ``logprobs`` object for tokens and their ``{token id: Logprob}`` entries
    (``CompletionOutput.logprobs``, or with ``echo`` ``RequestOutput.prompt_logprobs`` first, whose first entry is
    None: its token gets null values, its text from ``token_text(id)``): ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token, the asked top-k plus the token itself, keyed by text, as OpenAI) and ``text_offset``
    (each token's start in the text, counting from ``text_offset``; with ``as_ids``, in the joined ``token_id:<id>``
    strings, as vLLM counts them). Returns the object and the offset after the last
    token (for the next streamed chunk). ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): every token is written
    ``token_id:<id>``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, logprobs, strict=True):
        if entry is None:
            text = token_text(token) if token_text is not None and not as_ids else f"token_id:{token}"
            value, top = None, None
        else:
            text = _token_text(entry[token], token, as_ids)
            value, top = entry[token].logprob, {_token_text(lp, t, as_ids): lp.logprob for t, lp in entry.items()}
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out, text_offset


def chat_logprobs(token_ids: list[int], logprobs: list[dict], num_top: int, as_ids: bool = False,
                  token_bytes: Any = None) -> dict:
    """The chat completions ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` with the
    ``num_top`` most likely tokens at each position (most likely first); ``as_ids``: tokens written
    ``token_id:<id>`` (their bytes those of that string, as vLLM). ``token_bytes(id)`` (``Tokenizer.token_bytes``):
    a token's own bytes, so that a character split over byte tokens (whose text reads U+FFFD) can be rebuilt from
    them; without it, the UTF-8 of its text."""
    content = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        top = sorted(entry.items(), key=lambda item: -item[1].logprob)[:num_top]
        content.append({
            **_chat_token(token, entry[token], as_ids, token_bytes),
            "top_logprobs": [_chat_token(t, lp, as_ids, token_bytes) for t, lp in top],
        })
    return {"content": content}


def _chat_token(token: int, lp: Any, as_ids: bool = False, token_bytes: Any = None) -> dict:
    text = _token_text(lp, token, as_ids)
    raw = token_bytes(token) if token_bytes is not None and text == lp.decoded_token else text.encode("utf-8")
    return {"token": text, "logprob": lp.logprob, "bytes": list(raw)}


class ResponsesRequest(_Strict):
    """OpenAI's Responses API (``POST /v1/responses``), stateless: text in (a string, or messages whose content is
    text or ``input_text`` / ``output_text`` parts), text out, as one chat completion through the chat template.
    ``instructions`` become a system message first; ``text.format`` is ``response_format``. ``store`` true is taken
    and nothing stored (the response says ``store: false``), as vLLM does without a store: OpenAI's default is true,
    so SDKs send it. vLLM's extra fields are served as on chat: ``top_k``, ``logit_bias``, ``skip_special_tokens``,
    ``priority``, ``cache_salt``, ``request_id`` (``mm_processor_kwargs`` and ``enable_response_messages`` at their
    neutral values). ``text`` holds ``format`` and ``verbosity`` (only OpenAI's default, "medium"). Not served (a 400
    naming the field): ``previous_response_id``, tools, ``n`` > 1 (it has none), and input items other than
    messages."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    # vLLM's extra fields (its ResponsesRequest), served as chat serves them
    top_k: int | None = Field(default=None, ge=-1)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    priority: StrictInt = 0
    cache_salt: str | None = Field(default=None, min_length=1)
    mm_processor_kwargs: dict[str, Any] | None = None
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    # sent by clients, accepted at their neutral values (see check)
    background: bool | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # (prefix caching needs no key: it finds shared prefixes by their tokens)
    prompt_cache_retention: str | None = None
    # vLLM's: the response's id (as given; else "resp_<new id>"), held while the request is in flight
    request_id: RequestId | None = None
    safety_identifier: str | None = None  # (OpenAI's successor of 'user')
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    access_programs: Any = None
    background_options: dict[str, Any] | None = None
    context_management: Any = None
    image: dict[str, Any] | None = None

    def check(self) -> None:
        unsupported = [
            ("previous_response_id", self.previous_response_id is not None,
             "responses are not stored here: send the whole conversation as 'input'"),
            ("tools", bool(self.tools), "tools are served on /v1/chat/completions"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tools are served on /v1/chat/completions"),
            ("truncation", self.truncation not in (None, "disabled"), "allowed 'disabled'"),
            ("reasoning", any(v is not None for v in (self.reasoning or {}).values()),
             "no reasoning options are served (a thinking model's thought is split off by serve --reasoning-parser)"),
            ("background", bool(self.background), "responses run in the foreground"),
            ("include", bool(self.include), "no extra output data is served"),
            ("top_logprobs", bool(self.top_logprobs), "log-probabilities are served on /v1/chat/completions"),
            ("service_tier", self.service_tier not in (None, "auto", "default"), "allowed 'auto' or 'default'"),
            ("prompt", self.prompt is not None, "stored prompts are not served: send the text as 'input'"),
            ("conversation", self.conversation is not None,
             "conversations are not stored here: send the whole conversation as 'input'"),
            ("max_tool_calls", self.max_tool_calls is not None, "tools are served on /v1/chat/completions"),
            ("moderation", bool(self.moderation), "no moderation is run here"),
            ("prompt_cache_options", bool(self.prompt_cache_options),
             "prefix caching needs no options: it finds shared prefixes by their tokens"),
            ("access_programs", bool(self.access_programs), "not served"),
            ("background_options", bool(self.background_options), "responses run in the foreground"),
            ("context_management", bool(self.context_management),
             "no context is managed here: send the conversation as 'input'"),
            ("image", bool(self.image), "the models this server runs write text"),
            ("mm_processor_kwargs", bool(self.mm_processor_kwargs), "the models this server runs read text"),
            ("enable_response_messages", self.enable_response_messages, "no raw messages are returned"),
            ("previous_input_messages", self.previous_input_messages is not None,
             "send the whole conversation as 'input'"),
            ("stream_options", self.stream_options is not None and not self.stream,
             "it applies to streamed responses only: set 'stream': true or leave it out"),
            ("stream_options", bool(set(self.stream_options or {}) - {"include_obfuscation"}) or not isinstance(
                (self.stream_options or {}).get("include_obfuscation"), (bool, type(None))),
             "its one key is 'include_obfuscation', a boolean (no padding is sent)"),
        ]
        for name, bad, why in unsupported:
            if bad:
                raise APIError(400, f"'{name}'={short_repr(getattr(self, name))} is not supported by this server: "
                                    f"{why}", param=name)
        text = self.text or {}
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:  # (they were taken and ignored, and echoed back as if served)
            raise APIError(400, f"'text.{unknown[0]}' is not supported: 'text' holds 'format' and 'verbosity'",
                           param="text")
        if text.get("verbosity") not in (None, "medium"):  # (as chat's 'verbosity', not served)
            raise APIError(400, f"'text.verbosity'={short_repr(text['verbosity'])} is not supported by this server: "
                                f"allowed 'medium' (OpenAI's default), or leave it out", param="text")

    def echoed_text(self) -> dict[str, Any]:
        """``text`` as the response echoes it: always with a ``format`` (``{"type": "text"}`` unless one was given)
        and OpenAI's ``verbosity``."""
        text = self.text or {}
        return {**text, "format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or
                "medium"}

    def messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            if not self.input:
                raise APIError(400, "'input' is empty: give the text or the messages to answer", param="input")
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise APIError(400, "'input' is empty: give the text or the messages to answer", param="input")
        thought: str | None = None  # a reasoning item's text, for the assistant message after it
        for i, item in enumerate(self.input):
            role, content = item.get("role"), item.get("content")
            if item.get("type") == "reasoning":  # (an earlier response's output sent back, as OpenAI's multi-turn
                # pattern does: the assistant turn's thought, which interleaved-thinking templates render)
                parts = [*(item.get("content") or []), *(item.get("summary") or [])]
                if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
                    raise APIError(400, f"'input[{i}]' reasoning item's 'content' / 'summary' must be lists of "
                                        f"{{'type': 'reasoning_text' | 'summary_text', 'text': ...}}",
                                   param=f"input[{i}]")
                thought = (thought + "\n" if thought else "") + "\n".join(p["text"] for p in parts)
                continue
            if item.get("type", "message") != "message" or role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"'input[{i}]' must be a message {{'role': 'user' | 'system' | 'developer' | "
                                    f"'assistant', 'content': ...}}: other items (function calls, images, ...) are "
                                    f"not served", param=f"input[{i}]")
            if isinstance(content, list):
                if not content:  # (as chat's: a message of no parts)
                    raise APIError(400, f"'input[{i}].content' is an empty list: give the message's text, or text "
                                        f"parts", param=f"input[{i}].content")
                if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                           and isinstance(p.get("text"), str) for p in content):
                    raise APIError(400, f"'input[{i}].content' parts must be {{'type': 'input_text' | 'output_text', "
                                        f"'text': ...}}", param=f"input[{i}].content")
                content = "\n".join(p["text"] for p in content)  # (as chat parts are joined)
            if not isinstance(content, str):
                raise APIError(400, f"'input[{i}].content' must be text or a list of text parts",
                               param=f"input[{i}].content")
            if thought is not None and role != "assistant":  # (a thought with no answer after it: its own turn)
                out.append({"role": "assistant", "content": "", "reasoning_content": thought})
                thought = None
            out.append({"role": role, "content": content, **(
                {"reasoning_content": thought} if thought is not None else {})})
            thought = None
        if thought is not None:
            out.append({"role": "assistant", "content": "", "reasoning_content": thought})
        return out

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat API's ``response_format``."""
        fmt = (self.text or {}).get("format")
        if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
            return None
        if isinstance(fmt, dict) and fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)
                and isinstance(fmt.get("name"), str) and fmt["name"]):  # (OpenAI's: the name is required)
            return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"]}}
        raise APIError(400, "'text.format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                            "'json_schema', 'name': <a string>, 'schema': {...}}", param="text")

    def as_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (what the engine serves)."""
        self.check()
        return ChatCompletionRequest(messages=self.messages(), model=self.model,
                                     max_completion_tokens=self.max_output_tokens, temperature=self.temperature,
                                     top_p=self.top_p, response_format=self.response_format(), user=self.user,
                                     top_k=self.top_k, logit_bias=self.logit_bias,
                                     skip_special_tokens=self.skip_special_tokens, priority=self.priority,
                                     cache_salt=self.cache_salt)
