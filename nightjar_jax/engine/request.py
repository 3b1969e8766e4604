"""A request as the engine tracks it: tokens, pages, progress through prefill, and timestamps.

Vocabulary
- tokens: ``prompt_token_ids + output_token_ids``; ``num_tokens`` counts both.
- computed: tokens whose K/V are in the target's cache. A step processes tokens ``[num_computed, num_tokens)``
  and, when it reaches ``num_tokens``, samples the next token. A fresh prompt is "prefilled" up to and including its
  last token (a one-token prompt excepted); a request with output and only its last token unprocessed is "decoding"
  (``num_computed == num_tokens - 1``).
- draft computed: the same for the draft model's cache; it lags behind while γ = 0 and is caught up before the
  next speculative step.
- preemption (by recompute): pages are freed, ``num_computed`` resets to 0, and the request is prefilled again
  over its prompt and the output so far, so no generated token is lost.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from nightjar_jax.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # the request could not be served (message in Request.error)


@dataclass(eq=False)  # identity: a request is an entity (list membership and remove compare by `is`)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # the PRNG key's 32-bit seed: the request's own folded (sampler.fold_seeds), or one the engine drew
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    priority: int = 0  # scheduling_policy "priority": lower is served first (vLLM's)
    arrival_order: int = 0  # the scheduler's count at add(): ties between equal priorities go in arrival order
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    error_field: str | None = None  # the request's field at fault, when the error is the request's own
    block_table: list[int] = field(default_factory=list)  # page ids, logical page order
    num_computed: int = 0
    num_draft_computed: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish_time: float | None = None
    output_text: str = ""  # detokenized output (stop strings trimmed)
    new_text: str = ""  # text produced since the last output, for streaming
    held_text: str = ""  # decoded text held back: it may be the start of a stop string
    detokenizer: object | None = field(default=None, repr=False)
    lookup_index: object | None = field(default=None, repr=False)  # n-gram lookup drafts (spec/lookup.py)
    # one {token id: Logprob} per output token when sampling.logprobs is set (else None)
    output_logprobs: list | None = field(default=None, repr=False)
    # one {token id: Logprob} per prompt token when sampling.prompt_logprobs is set (the first, and any the prefill has
    # not reached yet, None), else None
    prompt_logprobs: list | None = field(default=None, repr=False)
    cumulative_logprob: float | None = None  # the output tokens' log-probabilities summed (when asked for)
    output_counts: dict[int, int] | None = field(default=None, repr=False)  # token -> times generated (penalties)
    # its structured.TokenConstraint (a structured output, bad_words)
    grammar: object | None = field(default=None, repr=False)
    stop_ids: tuple[int, ...] = ()  # the ids that would end it (EOS unless ignore_eos, stop_token_ids): min_tokens
    # prefix caching (engine/scheduler.py): the chained hashes of its full pages so far (computed as needed), how
    # many of its pages are registered, how many of those are marked as holding the draft's K/V too (its first
    # pages), and the prompt tokens its first admission found cached
    page_hashes: list[bytes] = field(default_factory=list, repr=False)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache pages
    num_registered_pages: int = 0
    num_draft_cached_pages: int = 0
    num_cached_tokens: int = 0
    # its pages hold K/V of weights since replaced (it ran through LLMEngine.update_weights), or its first pages'
    # cache entries were forgotten (LLMEngine.reset_prefix_cache): none of them is ever registered, since even the
    # pages it computes afterwards attend to the old ones (and could only be found through the forgotten ones);
    # cleared when a preemption frees its pages (it computes everything again)
    stale_kv: bool = False

    def __post_init__(self) -> None:
        if self.sampling.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
            self.cumulative_logprob = 0.0
        if self.sampling.has_penalties and self.output_counts is None:
            self.output_counts = {}
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token remains to be processed, or, before its first token, once its prompt
        is partly computed: a prompt whose chunks stopped one token short finishes in a prefill step, so its first
        token is a prefill step's draw whatever chunks the budget gave it (left to a decode step, possibly
        speculative, a seeded request's draws depended on how other requests shared the budget). A one-token prompt
        is decoding from the start."""
        return self.num_computed < self.num_tokens - 1 or (not self.output_token_ids
                                                            and 0 < self.num_computed < self.num_tokens)

    @property
    def under_min_tokens(self) -> bool:
        """Fewer output tokens than ``min_tokens``: its stop ids are banned and stop strings not checked yet."""
        return len(self.output_token_ids) < self.sampling.min_tokens

    @property
    def draft_limit(self) -> int | None:
        """The most drafts a speculative step may accept for it (``SamplingTensors.max_accept``; None: no limit),
        where its bias at a drafted position depends on the drafts before it in a way the verify does not follow.
        Under ``min_tokens`` its stop ids are banned at every position of the step: the drafts that keep each
        committed token under it, ``min_tokens - len(output) - 1``. (Penalties need no limit: the verify adds the
        drafts before each position to the counts, ``sampler.apply_penalties``; nor do structured outputs: each
        step walks the drafts through the constraint for a mask per position, ``ModelRunner._walk_constraints``.)"""
        if self.under_min_tokens:
            return self.sampling.min_tokens - len(self.output_token_ids) - 1
        return None

    @property
    def accepts_no_drafts(self) -> bool:
        """A speculative step accepts none of its drafts (``draft_limit`` 0)."""
        return self.draft_limit == 0

    def prompt_logprobs_snapshot(self) -> list | None:
        """``prompt_logprobs`` for an output: a copy while the prefill may still fill it, then the list itself, shared
        by every later output (complete, it never changes: a recomputed prefill keeps the first values; an 8k-token
        prompt is not copied again at each decode step)."""
        if self.prompt_logprobs is None or self.num_computed >= self.num_prompt_tokens:
            return self.prompt_logprobs
        return list(self.prompt_logprobs)

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
