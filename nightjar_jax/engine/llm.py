"""``LLM``: the offline, vLLM-style entry point over :class:`LLMEngine`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.beam_search import BeamSearchOutput, BeamSearchParams, expansion
from nightjar_jax.engine.engine import LLMEngine, is_token_id
from nightjar_jax.engine.outputs import CompletionOutput, RequestOutput
from nightjar_jax.engine.sampling_params import RequestOutputKind, SamplingParams, child_params, short_repr
from nightjar_jax.models.tokenizer import load_chat_template, template_message

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate completions for a batch of prompts with continuous batching and speculative decoding.

    >>> llm = LLM("stories260k", max_model_len=256)
    >>> out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, **kwargs: Any):
        if isinstance(model, os.PathLike):  # (a pathlib.Path to a checkpoint)
            model = os.fspath(model)
        if not isinstance(model, str) or not model:
            raise ValueError(f"model={model!r} is invalid: allowed a preset name, a local path or an HF repo id "
                             f"(leave it out for the default, {DEFAULT_MODEL})")
        self.engine = LLMEngine(make_engine_config(model=model, **_vllm_options(kwargs)))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere, e.g. ``LLMEngine(config, target=other.engine.target, tokenizer=...)``:
        a second engine (another draft, planner or pool) over a target already loaded, without loading it again."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def close(self) -> None:
        """Write out what the engine buffers (a ``planner_log``'s last decisions: it flushes every 64, and at exit);
        the LLM stays usable. Also ``with LLM(...) as llm:``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of :attr:`engine`."""
        return self.engine

    def __getattr__(self, name: str) -> Any:
        if name in _VLLM_UNSERVED:  # (vLLM's methods this engine does not have: say so, not a bare AttributeError)
            raise AttributeError(f"LLM.{name} is vLLM's {_VLLM_UNSERVED[name]}, which nightjar-jax does not serve: it "
                                 "generates text (generate, chat, beam_search)")
        raise AttributeError(f"'LLM' object has no attribute {name!r}")

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _next_request_id(self) -> str:
        """The next output's ``request_id``: "0", "1", ... over this LLM's whole life, as vLLM numbers them (each
        call starting again at "0" gave two calls' outputs the same ids)."""
        counter = self.__dict__.setdefault("_request_counter", itertools.count())  # (from_engine skips __init__)
        return str(next(counter))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``enable_prefix_caching``); returns the pages forgotten."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode (:meth:`LLMEngine.sleep`): level 1 moves the weights to host memory and discards the KV
        cache, level 2 discards both; returns the device bytes freed. Generating raises until :meth:`wake_up`."""
        return self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` released (``tags``: ``["weights"]`` and/or ``["kv_cache"]``; None: all)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def start_profile(self, profile_dir: str | None = None) -> str:
        """vLLM's: trace what follows with JAX's profiler into ``profile_dir`` (default ``$NIGHTJAR_PROFILER_DIR``;
        ``LLMEngine.start_profile``) until :meth:`stop_profile`. Returns the folder."""
        return self.engine.start_profile(profile_dir)

    def stop_profile(self) -> str:
        """vLLM's: end the trace and write it; returns the run's folder (its ``*.trace.json.gz`` opens in
        Perfetto)."""
        return self.engine.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the parameters :meth:`generate` and :meth:`chat` use when given none: :class:`SamplingParams`'s
        defaults with the model's recommended values from its ``generation_config.json`` (engine option
        ``generation_config``; ``nightjar_jax/engine/generation_config.py``) on top."""
        return self.engine.default_sampling_params()

    def update_weights(self, weights=None, *, draft_weights=None) -> bool:
        """New weights without a restart (:meth:`LLMEngine.update_weights`): a checkpoint spec or path, an HF-named
        state dict or a ``ModelHandle``, for the target and/or the draft. Returns whether the step variants must
        compile again (a new layout of the same model)."""
        return self.engine.update_weights(weights, draft_weights=draft_weights)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``n > 1`` fans a prompt out into
        ``n`` sequences (seeds ``seed + i``, wrapping past 2**63 - 1 to 0, when seeded) returned as
        ``outputs[0..n-1]``. ``priority`` (vLLM's; one per prompt, lower first) needs
        ``scheduling_policy="priority"``. If a step raises (or the call is interrupted), this call's unfinished
        requests are aborted (their pages freed) before the exception propagates. ``lora_request`` (vLLM's) may only be
        None: no LoRA adapters are served here."""
        _no_lora(lora_request)
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{short_repr(sampling_params)}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # checked here (add_request checks each sequence's copy again): n, read below, may have been set after
        # construction (sp.n = 0 returned None outputs)
        checked = {id(p): p.checked_copy() for p in params}
        params = [checked[id(p)] for p in params]
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority must be None or a list of integers, one per prompt, got {short_repr(priority)}")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.engine
        children: dict[str, tuple[int, int]] = {}  # engine request id -> (prompt index, completion index)
        try:
            for i, (prompt, sp, prio) in enumerate(zip(prompts, params, priorities, strict=True)):
                if sp.output_kind != RequestOutputKind.FINAL_ONLY:  # (it reads finished outputs, as vLLM's)
                    sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                for j in range(sp.n):
                    child = child_params(sp, j)
                    rid = engine.add_request(prompt, child, request_id=f"gen-{id(self)}-{i}-{j}", priority=prio)
                    children[rid] = (i, j)
        except Exception:
            for rid in children:
                engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        left = [sp.n for sp in params]  # per prompt: sequences still running (the bar counts prompts, as vLLM's)
        bar = _progress(len(prompts), use_tqdm)
        try:
            while len(finals) < len(children):
                for out in engine.step():
                    if out.finished and out.request_id in children:
                        finals[out.request_id] = out
                        i = children[out.request_id][0]
                        left[i] -= 1
                        if bar is not None and not left[i]:
                            bar.update(1)
        except BaseException:  # a failed step, or Ctrl-C in a notebook: the next call must not inherit these requests
            for rid in children:
                if rid not in finals:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        results: list[RequestOutput | None] = [None] * len(prompts)
        for rid, (i, j) in sorted(children.items(), key=lambda kv: kv[1]):
            out = finals[rid]
            comp: CompletionOutput = out.outputs[0]
            comp.index = j
            if results[i] is None:
                out.request_id = self._next_request_id()  # (counted across calls, as vLLM's request_counter)
                results[i] = out
            else:
                results[i].outputs.append(comp)
        return results  # type: ignore[return-value]


    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool | Callable[..., Any] | None = None, lora_request: None = None,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt, the ``params.beam_width`` best sequences of a beam search
        (``nightjar_jax/engine/beam_search.py``), best first. Every search step asks the engine, in one batch over
        all prompts' live beams, for each beam's most likely next tokens (``generate`` with one greedy token and
        ``2 x beam_width`` log-probabilities); prefix caching keeps the beams' shared pages computed once. Bad
        prompts raise ``ValueError`` before anything runs. ``concurrency_limit`` (vLLM's): at most this many prompts'
        searches at a time, in prompt order (None: all)."""
        _no_lora(lora_request)
        if concurrency_limit is not None and not (is_token_id(concurrency_limit) and concurrency_limit >= 1):
            raise ValueError(f"concurrency_limit must be None or an int >= 1 (prompts searched at a time), got "
                             f"{short_repr(concurrency_limit)}")
        prompts = _prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}")
        searches = [self.engine.new_beam_search(p, params) for p in prompts]
        # (each search's steps carry its prompt's cache_salt: they share prefix-cache pages with that tenant only)
        salts = {id(s): {"cache_salt": p["cache_salt"]} if isinstance(p, dict) and "cache_salt" in p else {}
                 for s, p in zip(searches, prompts, strict=True)}
        step = params.step_params()
        width = 2 * params.beam_width
        bar = _progress(len(searches), use_tqdm, desc="beam search")
        try:
            while not all(s.done for s in searches):
                live = [s for s in searches if not s.done][:concurrency_limit]
                asks = [(s, ids) for s in live for ids in s.pending()]
                outs = self.generate([{"prompt_token_ids": ids, **salts[id(s)]} for s, ids in asks], step,
                                     use_tqdm=False)
                for s in live:
                    mine = [out for (owner, _), out in zip(asks, outs, strict=True) if owner is s]
                    s.advance([expansion(o.outputs[0].logprobs[0], width) for o in mine])
                    if s.done and bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        tokenizer = self.engine.tokenizer
        detokenize = None if tokenizer is None else tokenizer.decode
        return [s.best(detokenize) for s in searches]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | Callable[..., Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them, each
        rendered with the model's chat template (or ``chat_template``), then generated as :meth:`generate` does; one
        output per conversation. ``tools`` (OpenAI function definitions) go to templates that render them (the
        calls a model writes can be read with ``nightjar_jax.server.tool_parsers.parse``); an assistant turn may
        carry ``tool_calls`` with ``content`` None. ``continue_final_message`` (with ``add_generation_prompt``
        False) continues each conversation's last message; ``chat_template_kwargs`` are more template variables.
        ``chat_template_content_format`` (vLLM's): "auto" gives a template that loops over a message's content a
        list of text parts, others a string (text parts joined by newlines); "string" / "openai" choose."""
        _no_lora(lora_request)
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):  # ("no" was taken as true)
                raise TypeError(f"{name} must be True or False, got {short_repr(flag)}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be None or a list of tool definitions (dicts, OpenAI's {{'type': "
                             f"'function', 'function': {{'name': ..., 'parameters': ...}}}}), got {short_repr(tools)}")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one to render the conversation")
        messages = list(messages)
        conversations = [messages] if messages and isinstance(messages[0], dict) else [list(c) for c in messages]
        if not conversations or not all(conversations):
            raise ValueError("chat needs at least one conversation of at least one message")
        for conversation in conversations:
            for m in conversation:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                        isinstance(m.get("content"), str) or _text_parts(m.get("content")) is not None
                        or (m.get("content") is None and m.get("tool_calls"))):
                    raise ValueError(f"each message must be a dict with a string 'role' and a 'content' that is a "
                                     f"string or a list of text parts ({{'type': 'text', 'text': ...}}; or None "
                                     f"beside 'tool_calls'): got {short_repr(m)}")
        conversations = [[template_message(m) for m in c] for c in conversations]
        if chat_template is not None:  # (a file's path read, as serve --chat-template; a name that is no file refused)
            chat_template = load_chat_template(chat_template, "chat_template")
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, tools=tools,
                                                 continue_final_message=continue_final_message,
                                                 template_kwargs=chat_template_kwargs,
                                                 content_format=chat_template_content_format) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(f"lora_request={short_repr(lora_request)}: LoRA adapters are not served here (vLLM's "
                         f"argument; only None is taken)")


def _text_parts(content: Any) -> list[str] | None:
    """OpenAI's content parts ``[{"type": "text", "text": ...}, ...]`` as their texts (None: not such a list)."""
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return None
    return [p["text"] for p in content]


# vLLM's LLM options that tune what this engine does not have (CUDA graphs, per-step stats logging; chunked prefill is
# always on): taken, when a boolean, and nothing changes (every step here runs a compiled variant; stats are kept,
# not logged per step)
_VLLM_NO_OPS = ("enforce_eager", "disable_log_stats", "enable_chunked_prefill")

# vLLM's LLM methods for what this engine does not do: name -> what they are
_VLLM_UNSERVED = {
    "encode": "pooling (embeddings, rewards) API", "embed": "embedding API", "classify": "classification API",
    "score": "scoring (cross-encoder) API", "reward": "reward-model API", "apply_model": "model-access hook",
    "collective_rpc": "worker RPC",
}


def _vllm_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)`` as the engine takes them: vLLM's ``block_size`` is ``page_size`` (the KV cache's tokens per
    page), and :data:`_VLLM_NO_OPS` are dropped."""
    kwargs = dict(kwargs)
    if kwargs.get("enable_chunked_prefill") is False:
        raise ValueError("enable_chunked_prefill=False: prefill is always chunked here (by max_num_batched_tokens, as "
                         "in vLLM V1); leave it out")
    for name in _VLLM_NO_OPS:
        if name in kwargs:
            value = kwargs.pop(name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={short_repr(value)} is invalid: allowed True or False (vLLM's option; it "
                                 f"changes nothing here)")
            logger.info("%s=%s is vLLM's option and changes nothing here", name, value)
    spec = kwargs.pop("speculative_config", None)
    if spec is not None:  # (vLLM's dict, or its JSON text, read as serve --speculative-config reads it)
        import json

        from nightjar_jax.cli import speculative_config

        if not isinstance(spec, (dict, str)):
            raise ValueError(f"speculative_config={short_repr(spec)} is invalid: allowed a dict (vLLM's) or its JSON")
        try:
            text = spec if isinstance(spec, str) else json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"speculative_config={short_repr(spec)} is not JSON data: {exc}") from None
        for name, value in speculative_config(text, where="speculative_config").items():
            if kwargs.get(name) is not None and kwargs[name] != value:
                raise ValueError(f"speculative_config sets {name}={value!r} but {name}={kwargs[name]!r} is given too: "
                                 "give it once")
            kwargs[name] = value
    if "block_size" in kwargs:
        if kwargs.get("page_size") is not None:
            raise ValueError("block_size and page_size are one option (vLLM's name and this engine's): give one")
        kwargs["page_size"] = kwargs.pop("block_size")
    return kwargs


def _prompt_list(prompts: Any) -> list:
    """``generate``'s and ``beam_search``'s prompts as a list of prompts: one prompt (a string, a dict, or token ids
    as a list or tuple of Python or NumPy integers) becomes a list of one; a list or tuple of prompts stays one."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and is_token_id(prompts[0])):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt (a string, token ids or a dict) or a list of them, got "
                        f"{type(prompts).__name__}")
    return list(prompts)


def _progress(total: int, use_tqdm, desc: str = "generate"):
    """A progress bar over ``total`` prompts, as vLLM's ``use_tqdm``: True, False, None (shown from 64 prompts) or a
    callable that makes the bar in tqdm's place (``tqdm(total=, desc=, unit=)``)."""
    if use_tqdm is False or (use_tqdm is None and total < 64):
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit="req")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req")
