"""vLLM-shaped outputs: ``RequestOutput`` with ``.outputs[i]`` = ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``): the model's ``log_softmax`` value, its rank
    there (1 = most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the generated token's entry first, then the top-k asked for (a dict keeps that order; the
# generated token appears once when it is among them).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's): ``index`` among the request's ``n``, the ``text`` and
    ``token_ids`` so far (a stop string's text left out; a stop token's id kept, its text not), why it finished
    (``finish_reason``; ``stop_reason``: the stop string or token id that ended it, None for EOS or a length), what
    the latest step added (``delta_text``, ``delta_token_ids``: streaming) and, when asked for, log-probabilities."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    delta_text: str = ""  # text added by the latest step (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None  # one entry per token of token_ids, when the request asked for them
    cumulative_logprob: float | None = None  # the sum of the generated tokens' log-probabilities (same condition)

    lora_request = None  # (vLLM's: no LoRA adapters here)

    def finished(self) -> bool:
        """Whether the sequence ended (a method, as vLLM's ``CompletionOutput.finished()``; ``RequestOutput.finished``
        is an attribute there and here)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timestamps, ``time.monotonic()`` readings (differences are latencies; vLLM's are
    ``time.time()``), and the latencies they give."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def itls(self) -> list[float]:
        """Inter-token latencies (tokens committed in one speculative step share a time: their ITL is 0)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the engine returns for one request after a step (vLLM's): its prompt (text, when it was given as text,
    and token ids), one :class:`CompletionOutput` per sequence, whether it ``finished``, its ``metrics``
    (timestamps), and ``error`` with the field at fault when the engine could not serve it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # with error: the request field at fault when the request itself could not be served (a structured output whose
    # constraint came to a dead end: "structured_outputs"); None: the engine failed
    error_field: str | None = None
    # with SamplingParams.prompt_logprobs: one {token id: Logprob} per prompt token (None for the first, which nothing
    # predicts), as vLLM; complete once the prompt's prefill is done (every output after the first token)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prefix caching: the prompt tokens whose K/V its first admission found cached (0 with it off), as vLLM's
    num_cached_tokens: int = 0

    # vLLM's fields for what this engine does not serve (encoder-decoder models, LoRA, KV transfer, multimodal
    # inputs), at the values vLLM gives a plain text request, so code that reads them runs
    encoder_prompt = None
    encoder_prompt_token_ids = None
    lora_request = None
    kv_transfer_params = None

    @property
    def multi_modal_placeholders(self) -> dict:
        return {}
