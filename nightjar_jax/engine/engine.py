"""The engine loop: ``step()`` = schedule → plan γ → run → update outputs.

``LLMEngine`` owns one scheduler (host), one runner (device) and one planner (host). Requests come in with
:meth:`LLMEngine.add_request` and leave with a finish reason; :meth:`step` returns a ``RequestOutput`` for every
request that made progress in that step (new tokens, or finished). Bad input raises ``ValueError`` from
``add_request`` for that request only; the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import os
import random
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import jax
import numpy as np

from nightjar_jax.cache.allocator import PageAllocator
from nightjar_jax.config import CacheConfig, ConfigError, EngineConfig, SpecConfig, dtype_bytes
from nightjar_jax.engine import variants
from nightjar_jax.engine.generation_config import generation_defaults, generation_eos_ids
from nightjar_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nightjar_jax.engine.request import FinishReason, Request
from nightjar_jax.engine.runner import (
    EVICT_CEILING_SHARE,
    EVICT_MAP_SHARE,
    EVICT_REGROWTH_SHARE,
    EVICT_TARGET_SHARE,
    DecodeResult,
    ModelHandle,
    ModelRunner,
)
from nightjar_jax.engine.sampler import fold_seeds
from nightjar_jax.engine.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    child_params,
    short_repr,
)
from nightjar_jax.engine.scheduler import ScheduledBatch, Scheduler
from nightjar_jax.memory import ElasticPolicy, MemoryAction, PoolState, host
from nightjar_jax.planner.base import MAX_STEP_SECONDS
from nightjar_jax.spec.tree import load_tree_order

logger = logging.getLogger(__name__)

# Steps the planner runs autoregressively (γ = 0) still verify a fully copied n-gram chain at γ_max when the verify
# has at most this many rows (batch x (γ_max + 1)): batch 1 at γ_max = 4, where the verify streams the weights
# (see LLMEngine._lookup_boost).
LOOKUP_AR_BOOST_MAX_ROWS = 5

# planner_state is saved at close, when the engine is collected, at exit, and after the first observed decode step
# this many seconds after the last save (a process killed outright loses at most that much of what the planner learned)
PLANNER_STATE_SAVE_SECONDS = 60.0


def _save_planner_state(planner, path: str, saved: list) -> bool:
    """``planner.save(path)`` unless nothing changed since the last save (``saved[0]``: its decision and observation
    counts then; a closed engine collected later would otherwise write its old state over a newer engine's); False,
    with a warning, when it failed (serving goes on)."""
    version = (planner.num_decisions, planner.num_observations)
    if saved and saved[0] == version:
        return True
    for attempt in range(3):
        try:
            planner.save(path)
            break
        except RuntimeError:  # (the engine thread changed the planner while it was written: a dict changed size)
            if attempt == 2:
                logger.warning("planner state not saved to %s: the planner kept changing while it was written", path)
                return False
        except OSError as exc:
            logger.warning("planner state not saved to %s: %s", path, exc)
            return False
    saved[:] = [version]
    return True


class EngineSleepingError(RuntimeError):
    """A request (or a step that needs the device) reached an engine put to sleep (:meth:`LLMEngine.sleep`): nothing
    was queued; :meth:`LLMEngine.wake_up` brings it back."""


SLEEP_TAGS = ("weights", "kv_cache")


def _cache_salt(prompt) -> str | None:
    """A prompt dict's ``cache_salt`` (None: none); anything but a non-empty string is an InvalidRequestError."""
    cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string (or left out), got "
                                  f"{short_repr(cache_salt)}", "cache_salt")
    return cache_salt


def is_token_id(x) -> bool:
    """A token id as a prompt may give it: a Python or NumPy integer, not a bool (its range is checked apart)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _prompt_error(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, "prompt")


@dataclass
class EngineStats:
    """Counters and gauges the server's metrics and the benchmarks read."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [γ_max]: drafts accepted at position i
    drafted_per_position: list[int] = field(default_factory=list)
    # sequence-steps whose drafts came from n-gram lookup (SpecConfig.prompt_lookup_max; in a tree step: whose copy
    # branch held a match), and drafts accepted there
    num_lookup_steps: int = 0
    num_lookup_accepted: int = 0
    num_preemptions: int = 0
    # prefix caching (CacheConfig.enable_prefix_caching): tokens of the requests admitted with a lookup, and of those
    # the tokens whose K/V were found cached (vLLM's prefix_cache_queries / prefix_cache_hits)
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_prefix_cache_draft_hits: int = 0  # of the hits, tokens whose draft K/V were cached too (no catch-up)
    num_compiling_decode_steps: int = 0  # decode steps that compiled (or loaded) a variant: not shown to the planner
    num_compile_evictions: int = 0  # times the least used variants were dropped, short of memory maps
    num_catchup_tokens: int = 0
    catchup_seconds: float = 0.0
    last_gamma: int = 0
    last_tree_nodes: int = 0  # drafted nodes per sequence of the latest decode step if it verified a tree, else 0
    decode_steps_per_gamma: dict[int, int] = field(default_factory=dict)  # γ -> decode steps run at it
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    # elastic memory (CacheConfig.draft_offload): the draft's moves (whether it is away now:
    # LLMEngine.draft_offloaded; the extension's pages: allocator.num_extension)
    num_draft_offloads: int = 0
    num_draft_reloads: int = 0
    num_migrated_pages: int = 0  # live extension pages copied into the base pool at reloads
    offload_seconds: float = 0.0  # the moves' time (offloads + reloads, the page migration included)
    num_sleeps: int = 0  # LLMEngine.sleep calls that put the engine to sleep
    num_weight_updates: int = 0  # LLMEngine.update_weights calls
    step_log: list[dict] = field(default_factory=list)  # per decode step (kept only when record_steps)

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens committed per sequence per speculative step (accepted drafts + 1)."""
        n = sum(self.drafted_per_position[:1])
        return 1 + self.num_accepted_tokens / n if n else 1.0


def setup_compilation_cache(path: str | None) -> None:
    """Enable JAX's persistent compilation cache (default ``~/.cache/nightjar_jax/jax_cache``; "" disables)."""
    import jax

    if path == "":
        return
    source = "compilation_cache_dir" if path else "NIGHTJAR_JAX_CACHE" if os.environ.get("NIGHTJAR_JAX_CACHE") else None
    path = path or os.environ.get("NIGHTJAR_JAX_CACHE") or os.path.expanduser("~/.cache/nightjar_jax/jax_cache")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:  # (a file on the way: "[Errno 17] File exists", which named neither what nor why)
        where = f"{source} {path}" if source else f"the default cache folder {path} (NIGHTJAR_JAX_CACHE changes it)"
        raise ConfigError(f"{where}: cannot make the compilation cache folder ({exc.strerror}): it needs a "
                          f"directory, or '' (compilation_cache_dir) to turn the cache off") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _accelerator_memory(device) -> tuple[int, int] | None:
    """An accelerator allocator's (limit, bytes held), or None (the CPU backend, or a device without a limit)."""
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def available_memory_bytes(device) -> int | None:
    """Bytes free for new buffers on ``device``: an accelerator's allocator limit less what it holds, or on the CPU
    the host's ``MemAvailable`` (Linux); None where neither can be read (no check then)."""
    if device.platform != "cpu":
        memory = _accelerator_memory(device)
        return None if memory is None else memory[0] - memory[1]
    return host.proc_bytes("/proc/meminfo", "MemAvailable")


def memory_budget_bytes(device, utilization: float) -> int | None:
    """vLLM's ``gpu_memory_utilization`` on an accelerator: that share of its allocator's limit less what it holds
    now (the weights, loaded first), the bytes left for the KV pool; None on the CPU backend (or where the device
    reports no limit)."""
    memory = _accelerator_memory(device)
    return None if memory is None else int(utilization * memory[0]) - memory[1]


def _blame(field: str, fn, *args, reloaded: bool = False):
    """``fn(*args)``; a ValueError or OSError it raises is tagged with ``update_field`` (``"weights"`` or
    ``"draft_weights"``: which part of a weight update was at fault; the server names the request's field), or with
    ``reloaded_field`` for a part a level-2 update loads again from its own checkpoint (not the request's fault)."""
    try:
        return fn(*args)
    except (ValueError, OSError) as exc:
        setattr(exc, "reloaded_field" if reloaded else "update_field", field)
        raise


class LLMEngine:
    """The serving engine: a host-side scheduler over a paged KV cache, jitted step variants (plain, speculative at
    each γ, token trees), a planner that picks γ each decode step, and elastic memory for the draft. Add requests
    (``add_request``), call ``step()`` until ``has_unfinished_requests()`` is false, and read the
    :class:`RequestOutput` each step returns; ``abort_request`` frees a request's pages at once. ``LLM`` (offline
    batches) and the server's ``AsyncEngine`` run it. docs/architecture.md describes the loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        target: ModelHandle | None = None,
        draft: ModelHandle | None = None,
        tokenizer=None,
        record_steps: bool = False,
    ):
        """Build from ``config`` (loading the models it names), or from ready ``target``/``draft`` handles."""
        setup_compilation_cache(config.compilation_cache_dir)
        self.config = config
        # the model's recommended sampling values, for the fields a request leaves unset (read before the weights
        # load: a bad file or override fails fast)
        self.generation_defaults = generation_defaults(config)
        # sleep level 2 discards the weights and wake_up loads them again from these specs (target, draft): the
        # config's, for weights this engine loaded itself; update_weights replaces one by its new spec, or by None
        # (weights given as arrays: nothing to load them from again)
        self._weight_specs: dict[str, str | None] = {
            "target": config.model if target is None else None,
            "draft": self.resolve_draft_spec(config) if draft is None else None,
        }
        self.sleep_level = 0  # 0: awake; 1 or 2 while asleep (sleep)
        self._asleep: set[str] = set()  # SLEEP_TAGS still asleep (wake_up may restore them one at a time)
        self._profile: tuple[str, float] | None = None  # a trace under way: its folder and start time
        self._profile_steps = 0
        from nightjar_jax.attention import resolve_impl

        if resolve_impl(config.attention_impl) == "pallas":
            # Import the Pallas lowering modules before the first jit, or a jitted pallas_call compiles twice.
            from kernels_pallas.paged_attention import import_pallas_backends

            import_pallas_backends()
        # (what the config alone decides is checked before any weights load: a bad flag fails in seconds)
        # draft_model "ngram" (vLLM's method): no draft model, n-gram lookup's copies are every step's drafts
        draft_spec = self.resolve_draft_spec(config) if draft is None else None
        no_draft = draft is None and draft_spec is None
        self.ngram_only = no_draft and (config.spec.draft_model or "").lower() == "ngram"
        if self.ngram_only and not config.spec.num_speculative_tokens:
            raise ConfigError("draft_model='ngram' speculates up to num_speculative_tokens copied tokens per step: it "
                              "needs num_speculative_tokens >= 1 (got 0; draft_model='none' decodes plainly)")
        if self.ngram_only and not config.spec.prompt_lookup_max:
            raise ConfigError("draft_model='ngram' speculates with n-gram lookup's copies alone: it needs "
                              "prompt_lookup_max >= 1 (got 0)")
        if self.ngram_only and config.spec.spec_tree_nodes:
            raise ConfigError("spec_tree_nodes needs a draft model to rank a tree's candidates: with "
                              "draft_model='ngram' allowed 0")
        if no_draft and not self.ngram_only and config.spec.spec_tree_nodes:
            # (it was ignored: a user asking for trees got plain decoding without a word)
            raise ConfigError(f"spec_tree_nodes={config.spec.spec_tree_nodes} needs a draft model to rank a tree's "
                              f"candidates, and this engine has none (draft_model={config.spec.draft_model!r}): "
                              f"pass a draft_model, or leave spec_tree_nodes at 0")
        if no_draft and not self.ngram_only:
            # (they were unused without a word: a user asking for γ = 7 got plain decoding)
            unused = [f"{name}={getattr(config.spec, name)}" for name in ("num_speculative_tokens", "prompt_lookup_max")
                      if getattr(config.spec, name) != getattr(SpecConfig(), name)]
            if unused:
                logger.warning("%s: no effect, this engine has no draft model (draft_model=%r) and decodes plainly; "
                               "pass a draft_model, or draft_model='ngram' to speculate with n-gram lookup alone",
                               ", ".join(unused), config.spec.draft_model)
        if no_draft and config.cache.draft_offload == "auto":
            # (it was ignored: elastic memory asked for, none given, and the config still read "auto")
            why = ("draft_model='auto' found no default draft for this model" if config.spec.draft_model == "auto"
                   else f"draft_model={config.spec.draft_model!r}")
            raise ConfigError(f"draft_offload='auto' moves a draft model's weights to host memory to make KV pages, "
                              f"and this engine has none ({why}): pass a draft_model, or leave draft_offload 'off'")
        try:  # (the grammar cache's limit read now: a bad one is the start's error, not a structured request's)
            from nightjar_jax.engine.structured import grammar_cache_bytes

            grammar_cache_bytes()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if target is None:
            target, tokenizer = self._load(config.model, tokenizer_spec=config.tokenizer)
        if target.config.feature_size is not None:  # (it failed at the first step, naming the forward's arguments)
            raise ConfigError(f"{target.config.name} is a feature draft: it reads its target's hidden states and "
                              f"cannot decode alone; load it as a target's draft_model (e.g. "
                              f"LLM('smollm2-135m-instruct', draft_model={target.config.name!r}))")
        if draft_spec is not None:
            try:
                draft, _ = self._load(draft_spec, tokenizer_spec=None)
            except ValueError as exc:  # (the same message as a target's, e.g. an unknown preset: say which model)
                raise ConfigError(f"draft_model {draft_spec!r}: {exc}") from None
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({draft.config.vocab_size} tokens, {draft.config.name}) does not match the "
                f"target's ({target.config.vocab_size} tokens, {target.config.name}): they must share a tokenizer"
            )
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        if jax.default_backend() == "cpu" and target.config.dtype == "bfloat16":
            # XLA:CPU emulates bf16 dots and the C++ kernels take float32: SmolLM2-135M at batch 1 ran 6.1 tok/s in
            # bfloat16 against 45-49 in float32 (Xeon VM with AVX-512 BF16 and AMX, 2026-12-02; docs/benchmarks.md)
            logger.warning("%s runs in bfloat16 on the CPU backend, where its products are several times slower than "
                           "in float32 (XLA:CPU emulates bf16 dots; the CPU kernels take float32): pass "
                           "dtype='float32' (--dtype float32) on CPU", target.config.name)
        sched = config.scheduler
        if sched.max_model_len is not None and sched.max_model_len > target.config.max_position_embeddings:
            # (vLLM refuses too: positions past the model's were never trained, and RoPE tables end there)
            raise ConfigError(f"max_model_len={sched.max_model_len} is more than {target.config.name}'s context of "
                              f"{target.config.max_position_embeddings} tokens: allowed at most that (or leave it out)")
        # the context limit asked for (or the model's), and below it what the base pool can hold
        self.context_limit = sched.max_model_len or target.config.max_position_embeddings
        self.max_model_len = self.context_limit
        num_pages = self._num_pages()
        self._check_pool_fits(num_pages)
        self.allocator = PageAllocator(num_pages, config.cache.page_size)
        pool_tokens = self.allocator.num_usable * config.cache.page_size
        if pool_tokens < self.max_model_len:
            # A request can never hold more tokens than the (base) pool: past it, it would be preempted and then never
            # admitted again (the engine spun forever). vLLM refuses to start here; the pool is sized by bytes by
            # default (often below a model's 8K context), so the context is capped instead: a request ends with
            # finish reason "length" when it fills the pool. A max_model_len or a pool size asked for explicitly is a
            # warning (the model's own context under the default pool only an info line).
            cache = config.cache
            sized = (cache.num_pages is not None or cache.gpu_memory_utilization is not None
                     or cache.kv_cache_bytes != CacheConfig().kv_cache_bytes)
            logger.log(logging.WARNING if sched.max_model_len is not None or sized else logging.INFO,
                       "the KV pool holds %d tokens, fewer than max_model_len %d: requests end (finish reason "
                       "'length') at %d tokens; raise kv_cache_bytes / num_pages for longer ones", pool_tokens,
                       self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        self.scheduler = Scheduler(sched, self.allocator, self.max_model_len,
                                   prefix_caching=config.cache.enable_prefix_caching)
        if draft is not None and not config.spec.num_speculative_tokens:
            logger.warning("num_speculative_tokens=0: the draft %s is loaded (its weights and KV pool take memory) but "
                           "never drafts; draft_model='none' decodes plainly without it", draft.config.name)
        gamma_max = config.spec.num_speculative_tokens if draft is not None or self.ngram_only else 0
        self.runner = ModelRunner(
            target, draft, num_pages=num_pages, page_size=config.cache.page_size, max_model_len=self.max_model_len,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            # the reference gathers the whole block table: widths bucketed to the batch's longest sequence keep that
            # gather in proportion (the kernels read only the pages a context covers, from either pool)
            gamma_max=gamma_max, bucket_pages=resolve_impl(config.attention_impl) == "reference",
            tree_nodes=config.spec.spec_tree_nodes, tree_min_gamma=config.spec.spec_tree_min_gamma, tree_order=(
                None if config.spec.spec_tree_file is None else load_tree_order(config.spec.spec_tree_file)
            ),
            lookup=((config.spec.prompt_lookup_min, config.spec.prompt_lookup_max)
                    if config.spec.prompt_lookup_max else None),
            kv_cache_dtype=config.cache.kv_cache_dtype,
        )
        self.gamma_max = gamma_max
        self.planner = self._make_planner()
        self._planner_switches_at_start = getattr(self.planner, "num_switches", 0)  # (a warm start's go on)
        self.memory: ElasticPolicy | None = None  # elastic memory (draft offload); None: off or no draft
        self._planner_speculates = False  # the planner chose γ > 0 for the last decode step it was asked about
        self._num_compiled_seen = 0  # runner.num_compiled() at the last memory-map check
        self._maps_after_eviction: int | None = None  # the process's memory maps right after this engine's last drop
        self._step_tick = 0  # variants.tick() at the current step's start
        self._warned_maps_elsewhere = False
        if config.cache.draft_offload == "auto" and draft is not None:
            if self.runner.draft_device_bytes() < self.runner.target_page_bytes():
                logger.warning("draft_offload=auto is off: the draft's %d device bytes would not make one KV page "
                               "of the target (%d bytes)", self.runner.draft_device_bytes(),
                               self.runner.target_page_bytes())
            else:
                self.memory = ElasticPolicy(config.cache.offload_low_watermark, config.cache.reload_high_watermark,
                                            config.cache.offload_persist_steps)
        self.stats = EngineStats(accepted_per_position=[0] * gamma_max, drafted_per_position=[0] * gamma_max)
        self.record_steps = record_steps
        self.requests: dict[str, Request] = {}
        # add_request with n > 1 (_add_parent): each parent's sequences not finished yet, and each sequence's parent
        # and index
        self._parents: dict[str, int] = {}
        self._child_of: dict[str, tuple[str, int]] = {}
        self._parent_finals: dict[str, list[CompletionOutput]] = {}  # FINAL_ONLY parents: the sequences done so far
        self._rng = random.Random(config.seed)
        self._grammars = None  # structured outputs' GrammarBackend, built on first use
        self._thought_tags = None  # reasoning_parser's ThoughtTags (reasoning.py), built with the grammar backend
        self._grammars_lock = threading.Lock()
        # held while the draft moves (offload, reload): a reader on another thread (the server's /metrics scrape)
        # takes it never to see a move half made (the draft gone, its extension pool not yet attached: every page
        # looked used). Not held across a step: the engine loop would take it again at once and starve the reader.
        self.state_lock = threading.RLock()
        self._ids = itertools.count()
        self._prev_gamma = 0
        # seconds of draft reloads the memory policy made while requests were in the engine, not yet charged to the
        # planner: the next switch from γ = 0 to γ > 0 pays them (DESIGN.md, "Planner": the switch cost includes a
        # reload when the draft was on host)
        self._uncharged_reload_seconds = 0.0
        # the model's end-of-sequence ids, its tokenizer's, and those its generation_config.json lists (vLLM adds
        # them to every request's stop ids: instruct models' end-of-turn tokens); a constraint may end at any of them
        # (the tokenizer, which engines over one target may share, is left as it is)
        self._eos_ids = frozenset(target.config.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ()) or ()
        ) | frozenset(generation_eos_ids(config, target.config.vocab_size))
        logger.info(
            "engine ready: target %s, draft %s, %d KV pages x %d tokens (%s), max_model_len %d, γ_max %d, planner %s",
            target.config.name, draft.config.name if draft else None, self.allocator.num_usable,
            config.cache.page_size,
            config.cache.kv_dtype(target.config.dtype),
            self.max_model_len, gamma_max, self.planner,
        )

    def close(self) -> None:
        """Flush the planner's decision log and save its ``planner_state`` (if set). The engine stays usable."""
        self.save_planner_state()
        close = getattr(self.planner, "close", None)
        if close is not None:
            close()

    @staticmethod
    def resolve_draft_spec(config: EngineConfig) -> str | None:
        """``draft_model``: a spec, None / "none" (no draft), or "auto" (the target preset's paired draft)."""
        spec = config.spec.draft_model
        if spec is None or spec.lower() in ("none", "", "ngram"):  # (ngram: lookup's copies, no draft model)
            return None
        if spec.lower() == "auto":
            from nightjar_jax.models.presets import default_draft_for

            return default_draft_for(config.model)
        return spec

    # ---- construction helpers -----------------------------------------------------------------------------------
    def _load(self, spec: str, tokenizer_spec: str | None, dtype: str | None = None):
        """Load a model spec (see ``nightjar_jax.models.loader``; ``<model>@skip=...`` derives a layer-skip draft) at
        ``dtype`` (None: the engine's ``dtype``, whose None is each checkpoint's own)."""
        from nightjar_jax.linear import pack_state
        from nightjar_jax.models.llama import state_from_hf
        from nightjar_jax.models.loader import load_checkpoint, load_model
        from nightjar_jax.spec.drafts import derive_state_dict, parse_draft_spec

        cfg = self.config
        dtype = dtype or cfg.dtype
        base, skip, keep_first = parse_draft_spec(spec)
        if skip is None and keep_first is None:
            ckpt, graphdef, state = load_model(
                spec, load_format=cfg.load_format, dtype=dtype, tokenizer=tokenizer_spec, seed=cfg.seed,
                attention_impl=cfg.attention_impl, linear_impl=cfg.linear_impl,
            )
            state = pack_state(state, cfg.linear_impl, weight_format=cfg.weight_format)
            handle = ModelHandle(ckpt.config, graphdef, state)
            del state  # stack_layers replaces the per-layer arrays
            self._check_finite(handle, spec)  # (before stacking: the error names the layer)
            handle.stack_layers()
            return handle, ckpt.tokenizer
        ckpt = load_checkpoint(base, load_format=cfg.load_format, dtype=dtype, tokenizer=tokenizer_spec)
        if ckpt.state_dict is None:
            raise ValueError(f"draft spec {spec!r} derives layers from real weights; load_format=dummy has none")
        model_cfg, sd = derive_state_dict(ckpt.config, ckpt.state_dict, skip=skip, keep_first=keep_first)
        graphdef, state = state_from_hf(
            model_cfg, sd, attention_impl=cfg.attention_impl, linear_impl=cfg.linear_impl, source=spec
        )
        state = pack_state(state, cfg.linear_impl, weight_format=cfg.weight_format)
        handle = ModelHandle(model_cfg, graphdef, state)
        del state
        self._check_finite(handle, spec)
        handle.stack_layers()
        return handle, ckpt.tokenizer

    @staticmethod
    def _check_finite(handle: ModelHandle, source: str) -> None:
        """A checkpoint's NaN or infinity is refused at load: the model would serve garbage (a NaN everywhere reads
        as token 0 on every step) without a word. In every format, after unpacking (a quantized one's scales)."""
        bad = handle.nonfinite()
        if bad is not None:
            raise ValueError(f"{source}: the weights hold NaN or infinite values (in {bad}): weights must be finite")

    def _num_pages(self) -> int:
        cache = self.config.cache
        if cache.num_pages is not None:
            return cache.num_pages
        budget = cache.kv_cache_bytes
        device = jax.devices()[0]
        if cache.gpu_memory_utilization is not None:
            held = memory_budget_bytes(device, cache.gpu_memory_utilization)
            if held is None:
                logger.info("gpu_memory_utilization=%s: the %s backend's KV pool is sized by kv_cache_bytes (%d bytes)",
                            cache.gpu_memory_utilization, device.platform, budget)
            elif held < self._pool_bytes_per_token() * cache.page_size * 2:
                raise ConfigError(f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves "
                                  f"{max(held, 0) / 2**30:.2f} GiB for the KV pool beside what {device.platform} "
                                  f"already holds (the weights): raise it, or size the pool with num_pages")
            else:
                budget = held
        return max(2, budget // (self._pool_bytes_per_token() * cache.page_size))

    def _pool_bytes_per_token(self) -> int:
        """The KV pools' bytes per token: the target's K/V, the draft's, and a feature draft's hidden states."""
        cache = self.config.cache
        per_token = self.target.config.kv_bytes_per_token(cache.kv_dtype(self.target.config.dtype))
        if self.draft is not None:
            per_token += self.draft.config.kv_bytes_per_token(cache.kv_dtype(self.draft.config.dtype))
            if self.draft.config.feature_size is not None:  # the target's hidden state(s) per token, for the draft
                per_token += self.draft.config.feature_pool_width * dtype_bytes(self.target.config.dtype)
        return per_token

    def _check_pool_fits(self, num_pages: int) -> None:
        """A pool larger than the memory the device has free is a ``ConfigError`` before anything is allocated (the
        process was killed for memory after a minute, or failed deep in XLA or the page allocator)."""
        need = num_pages * self.config.cache.page_size * self._pool_bytes_per_token()
        have = available_memory_bytes(jax.devices()[0])
        if have is not None and need > have:
            cache = self.config.cache
            asked = f"num_pages={cache.num_pages}" if cache.num_pages is not None else \
                f"kv_cache_bytes={cache.kv_cache_bytes}"
            raise ConfigError(f"the KV pool asked for ({asked}: {num_pages} pages of {cache.page_size} tokens, "
                              f"{need / 2**30:.2f} GiB) is more than the {have / 2**30:.2f} GiB of memory "
                              f"the {jax.devices()[0].platform} device has free: lower kv_cache_bytes or num_pages")

    def _make_planner(self):
        from nightjar_jax.planner import make_planner
        from nightjar_jax.planner.base import planner_class

        spec = self.config.spec
        name = spec.planner
        if self.gamma_max == 0:  # (nothing to plan, but a misspelt planner is still an error, not ignored)
            planner_class(name)
            if name.startswith("static:"):  # (a fixed γ: checked against this γ_max, as with a draft)
                try:
                    make_planner(name, 0)
                except ValueError as e:
                    raise ValueError(f"{e} (γ_max is 0 here: no draft, or num_speculative_tokens=0)") from None
            else:  # its arguments' form (nightjar:foo), against the largest γ_max the config allows
                make_planner("static:1" if name == "static" else name, 16)
            name = "ar"
        elif name == "static":
            name = f"static:{self.gamma_max}"
        planner = make_planner(name, self.gamma_max)
        self._planner_save_due = math.inf  # (monotonic time of the next periodic save of planner_state; inf: none)
        self._planner_state_path: str | None = None
        self._planner_saved: list = []  # [(decisions, observations)] at the last save of planner_state
        if spec.planner_state is not None and self.gamma_max:
            planner = self._warm_planner(planner, spec.planner_state)
        elif spec.planner_state is not None:
            logger.info("planner_state=%r is neither read nor written: γ_max is 0 (no draft, or "
                        "num_speculative_tokens=0), nothing to plan", spec.planner_state)
        if spec.planner_log:
            from nightjar_jax.planner import DecisionLogger

            try:
                planner.attach_logger(DecisionLogger(spec.planner_log))
            except OSError as exc:  # (a folder, a read-only place: IsADirectoryError, PermissionError, ...)
                raise ConfigError(f"planner_log={spec.planner_log!r} cannot be opened to append to "
                                  f"({exc.strerror or exc}): "
                                  "give the path of a JSONL file (its folder is created)") from None
        return planner

    def _warm_planner(self, planner, path: str):
        """``planner_state``: the planner an earlier run saved, read from ``path`` when it exists (it goes on as it
        was, counters included), else ``planner``, whose state is written there at once (so a path that cannot be
        written fails here, not at shutdown)."""
        from nightjar_jax.planner import Planner

        if os.path.exists(path):
            try:
                saved = Planner.load(path)
            except (OSError, ValueError) as exc:
                what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise ConfigError(f"planner_state={path!r} cannot be read as a planner state ({what}): give the "
                                  "path of a state an earlier run wrote, or a new path to start cold") from None
            if (saved.spec, saved.gamma_max) != (planner.spec, planner.gamma_max):
                raise ConfigError(f"planner_state={path!r} holds what planner {saved.spec!r} learned with γ_max "
                                  f"{saved.gamma_max}; this engine runs {planner.spec!r} with γ_max "
                                  f"{planner.gamma_max}: give another path, or remove the file to start cold")
            logger.info("planner %s warm-started from %s (%d decisions, %d steps observed before)", saved.spec, path,
                        saved.num_decisions, saved.num_observations)
            planner = saved  # (as saved, counters too: dsd's warm-up and refits count its observations)
        # (where the file is now: a relative path does not move with the working directory, and a symlink's
        # target is written, not replaced by a file)
        self._planner_state_path = target = os.path.realpath(path)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            planner.save(target)
        except OSError as exc:  # (a folder, a read-only file or place, ...)
            raise ConfigError(f"planner_state={path!r} cannot be written ({exc.strerror or exc}): give the path of "
                              "a JSON file in a writable folder (the folder is created)") from None
        self._planner_saved = [(planner.num_decisions, planner.num_observations)]
        self._planner_save_due = time.monotonic() + PLANNER_STATE_SAVE_SECONDS
        # written when the engine is collected without close(), or at exit (the finalizer holds the planner, not
        # the engine), if it changed since its last save
        weakref.finalize(self, _save_planner_state, planner, target, self._planner_saved)
        return planner

    @property
    def planner_switches(self) -> int:
        """The γ changes this engine's planner made (a warm-started planner's own count goes on from earlier runs)."""
        return getattr(self.planner, "num_switches", 0) - self._planner_switches_at_start

    def save_planner_state(self) -> bool:
        """Write the planner's learned state to ``planner_state`` now (also done at close, at exit and every
        ``PLANNER_STATE_SAVE_SECONDS`` while decoding); False when there is no such file or the write failed (a
        warning says why: serving goes on)."""
        if self._planner_state_path is None:
            return False
        self._planner_save_due = time.monotonic() + PLANNER_STATE_SAVE_SECONDS
        return _save_planner_state(self.planner, self._planner_state_path, self._planner_saved)

    # ---- requests -------------------------------------------------------------------------------------------------
    def default_sampling_params(self, **fields) -> SamplingParams:
        """:class:`SamplingParams` with the model's recommended values (``self.generation_defaults``, from its
        ``generation_config.json``) for the fields ``fields`` does not give."""
        return SamplingParams(**{**self.generation_defaults, **fields})

    def add_request(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        params: SamplingParams | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ``ValueError`` (nothing queued) on bad input.
        ``priority`` (vLLM's; lower is served first) needs ``scheduling_policy="priority"`` unless it is 0.
        ``arrival_time``: when the request arrived, on vLLM's clock, ``time.time()`` (default: now; a time in the
        future counts as now); its metrics' timestamps (``RequestMetrics``) are ``time.monotonic()`` readings, so it
        is moved onto that clock (TTFT and end-to-end latency then count from it).

        vLLM's ``LLMEngine.add_request(request_id, prompt, params)`` order is read too: a ``SamplingParams`` in the
        third place (where this order has the request id) can only mean it; ``params=`` is vLLM's keyword."""
        if params is not None:
            if sampling_params is not None:
                raise TypeError("add_request takes sampling_params or vLLM's params, not both")
            sampling_params = params
        if isinstance(request_id, SamplingParams) and not isinstance(sampling_params, SamplingParams):
            request_id, prompt, sampling_params = prompt, sampling_params, request_id  # (vLLM's order)
        if self._asleep:
            raise EngineSleepingError(self._sleeping_message())
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams (or None for the defaults), got "
                            f"{short_repr(sampling_params)}: the order is add_request(prompt, sampling_params, "
                            f"request_id), or vLLM's add_request(request_id, prompt, sampling_params)")
        # (a copy: the caller may change its object for the next request while this one waits)
        params = sampling_params.checked_copy() if sampling_params is not None else SamplingParams()
        if not (isinstance(priority, int) and not isinstance(priority, bool)):
            raise InvalidRequestError(f"priority must be an integer (lower is served first), got {priority!r}",
                                      "priority")
        if priority and not self.scheduler.by_priority:
            raise InvalidRequestError(f"priority={priority} needs scheduling_policy='priority' (serve "
                                      f"--scheduling-policy priority); this engine serves in arrival order (fcfs), "
                                      f"where only 0 is allowed", "priority")
        if params.n != 1:
            return self._add_parent(prompt, params, request_id, arrival_time, priority)
        if arrival_time is not None:
            try:  # (numpy scalars are numbers.Real too; 10**400 overflows float())
                ok = isinstance(arrival_time, numbers.Real) and not isinstance(arrival_time, bool) and math.isfinite(
                    float(arrival_time))
            except OverflowError:
                ok = False
            if not ok:
                raise InvalidRequestError(f"arrival_time must be a finite number of seconds on time.time()'s clock, "
                                          f"got {arrival_time!r}", "arrival_time")
        text, ids = self.truncate_prompt(*self.tokenize_prompt(prompt), params)
        cache_salt = _cache_salt(prompt)
        vocab = self.target.config.vocab_size
        if not ids:
            raise _prompt_error("the prompt is empty: at least one token is required")
        bad = [t for t in ids if not (is_token_id(t) and 0 <= t < vocab)]
        if bad:
            raise _prompt_error(f"prompt token ids must be integers in [0, {vocab}): got {bad[:5]}")
        if len(ids) >= self.context_limit:
            raise _prompt_error(
                f"the prompt has {len(ids)} tokens, the context limit is {self.context_limit} "
                f"(prompt + at least one generated token must fit)"
            )
        if len(ids) >= self.max_model_len:  # (capped at what the base pool holds)
            raise _prompt_error(
                f"the prompt has {len(ids)} tokens but the whole KV pool holds {self.max_model_len}: it can never be "
                f"scheduled (prompt + at least one generated token must fit)"
            )
        room = self.max_sequence_len - len(ids)  # (tokens that fit after the prompt)
        if params.min_tokens > room:
            raise InvalidRequestError(
                f"min_tokens={params.min_tokens} cannot be met: the context leaves room for {room} tokens after this "
                f"{len(ids)}-token prompt", "min_tokens")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {vocab}): got {max(params.logit_bias)}", "logit_bias"
            )
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise InvalidRequestError(
                f"allowed_token_ids must be in [0, {vocab}): got {max(params.allowed_token_ids)}", "allowed_token_ids"
            )
        request_id = self._free_request_id(request_id)
        grammar = None if params.structured_outputs is None else self.grammar_backend().matcher(
            params.structured_outputs)
        if grammar is not None and set(np.flatnonzero(grammar.allowed()).tolist()) <= set(self._eos_ids):
            # (no token, or only an end-of-sequence one: a schema nothing matches, {"anyOf": []}, allows just EOS)
            raise InvalidRequestError("the structured output's constraint allows no output at all (no token but an "
                                      "end-of-sequence one can start it): give one that some non-empty text matches",
                                      "structured_outputs")
        if grammar is not None and self.config.reasoning_parser is not None:
            grammar = self._after_thought(grammar, ids)
        if grammar is not None and (params.allowed_token_ids or params.min_tokens):
            self._check_first_token(grammar, params, vocab)
        if params.bad_words:
            grammar = self._with_bad_words(grammar, params, vocab)
        # (the PRNG key's 32 bits, folded once here rather than in every step's sampling tensors)
        seed = int(fold_seeds(params.seed)) if params.seed is not None else self._rng.getrandbits(32)
        req = Request(request_id, [int(t) for t in ids], params, seed, prompt=text, grammar=grammar,
                      priority=priority, cache_salt=cache_salt)
        if params.min_tokens:
            req.stop_ids = self._stop_ids(params, vocab)
            if params.allowed_token_ids and set(params.allowed_token_ids) <= set(req.stop_ids):
                raise InvalidRequestError(
                    f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:5]} are all stop tokens (EOS or "
                    f"stop_token_ids), which min_tokens={params.min_tokens} bans: nothing could be generated; allow a "
                    f"token that does not stop, or drop min_tokens", "allowed_token_ids")
        if arrival_time is not None:  # (time.time() -> time.monotonic(): the same seconds ago; never in the future)
            req.arrival_time = time.monotonic() - max(0.0, time.time() - float(arrival_time))
        if self.tokenizer is not None and params.detokenize:
            from nightjar_jax.models.tokenizer import IncrementalDetokenizer

            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                     prompt_ids=req.prompt_token_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.num_prompt_tokens += len(ids)
        return request_id

    def _free_request_id(self, request_id: str | None) -> str:
        """``request_id`` when it is a non-empty string no running request (or n > 1 parent) holds, else an error;
        None: the next number free."""
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string (or None: the engine numbers it), got "
                                      f"{request_id!r}", "request_id")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests or request_id in self._parents:  # (a caller's id may be a number)
                request_id = str(next(self._ids))
        if request_id in self.requests or request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        return request_id

    def _add_parent(self, prompt, params: SamplingParams, request_id: str | None, arrival_time: float | None,
                    priority: int) -> str:
        """vLLM's ``n > 1`` in ``add_request``: ``n`` requests of one sequence each, ids ``"{i}_{request_id}"``
        (``sampling_params.child_params``: seed ``seed + i`` when seeded), whose outputs come back under the
        parent's id with their ``index``; an output is ``finished`` once every sequence is. Aborting the parent's
        id aborts them all."""
        request_id = self._free_request_id(request_id)
        ids = [f"{i}_{request_id}" for i in range(params.n)]
        taken = [c for c in ids if c in self.requests or c in self._parents]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r}, one of the n={params.n} sequences of "
                                      f"{request_id!r}, is already in use", "request_id")
        added: list[str] = []
        try:  # (the first raises for a bad request, before anything is queued)
            for i, child in enumerate(ids):
                added.append(self.add_request(prompt, child_params(params, i), request_id=child,
                                              arrival_time=arrival_time, priority=priority))
        except BaseException:
            self.abort_request(added)
            raise
        self._parents[request_id] = params.n
        for i, child in enumerate(ids):
            self._child_of[child] = (request_id, i)
        return request_id

    def truncate_prompt(self, text: str | None, ids: list[int], params: SamplingParams
                        ) -> tuple[str | None, list[int]]:
        """``(text, ids)`` after ``params.truncate_prompt_tokens``: the last k ids (-1: as many as this engine
        takes, its context limit less one generated token); the text is None once ids were cut (echo and outputs
        then read the ids)."""
        k = params.truncate_prompt_tokens
        if k == -1:
            k = self.max_sequence_len - 1
        if k is None or len(ids) <= k:
            return text, ids
        return None, ids[-k:]

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt (text, token ids, or ``{"prompt": ..., "prompt_token_ids": ...}``) as ``(text, ids)``: the ids
        :meth:`add_request` would queue (a server that checks lengths first passes them back as the dict)."""
        if isinstance(prompt, dict):
            unserved = [k for k in ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids") if prompt.get(k)]
            if unserved:  # (vLLM's multimodal inputs: dropped without a word, the model never saw the image)
                raise _prompt_error(f"a prompt's {unserved[0]!r} is not served: the models this engine runs read "
                                    "text (give 'prompt' or 'prompt_token_ids' alone)")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple, np.ndarray)):
                    raise _prompt_error(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise _prompt_error("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise _prompt_error("this model has no tokenizer: pass prompt token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1:  # (token ids as a NumPy array, as in the dict form)
            return None, prompt.tolist()
        raise _prompt_error(f"a prompt must be a string, a list of token ids (or a 1-D NumPy array of them) or a "
                            f"dict, got {type(prompt).__name__}")

    def _stop_ids(self, params: SamplingParams, vocab: int) -> tuple[int, ...]:
        """The ids that would end a request (EOS unless ``ignore_eos``, ``stop_token_ids``), which ``min_tokens``
        bans until it is reached; an id past the vocabulary never comes."""
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_ids)
        return tuple(sorted(t for t in stop if t < vocab))

    @staticmethod
    def _emptied_by(mask: np.ndarray, allowed_ids: list[int] | None, stop_ids) -> str | None:
        """The field that leaves ``mask`` (the tokens a constraint allows next) no token: ``allowed_token_ids``
        (``allowed_ids``, all the others banned), then ``min_tokens`` (``stop_ids`` banned, when it is not met:
        else pass none); None when some token is left."""
        if allowed_ids:
            mask = mask & np.isin(np.arange(len(mask)), allowed_ids)
            if not mask.any():
                return "allowed_token_ids"
        if stop_ids:
            mask = mask.copy()
            mask[list(stop_ids)] = False
            if not mask.any():
                return "min_tokens"
        return None

    def _check_first_token(self, grammar, params: SamplingParams, vocab: int) -> None:
        """A structured output beside ``allowed_token_ids`` or ``min_tokens`` (vLLM applies both with it: a token must
        pass all): an error naming the field when together they leave no token to start with."""
        stops = self._stop_ids(params, vocab) if params.min_tokens else ()
        field = self._emptied_by(grammar.allowed(), params.allowed_token_ids, stops)
        if field == "allowed_token_ids":
            raise InvalidRequestError(
                f"allowed_token_ids {short_repr(sorted(params.allowed_token_ids))} hold no token the structured "
                f"output can start with: allow one it can, or drop allowed_token_ids", "allowed_token_ids")
        if field == "min_tokens":
            raise InvalidRequestError(
                f"min_tokens={params.min_tokens} bans the stop tokens (EOS, stop_token_ids), and the structured "
                f"output allows nothing else to start with: drop min_tokens", "min_tokens")

    def _dead_end_field(self, r: Request) -> str:
        """The field a constraint's dead end is blamed on (its mask left the step's row nothing to draw from):
        ``bad_words``, ``allowed_token_ids`` or ``min_tokens`` where they banned every token it allows, else the
        constraint's own."""
        if r.grammar.field == "bad_words":
            return "bad_words"
        stops = r.stop_ids if r.under_min_tokens else ()
        return self._emptied_by(r.grammar.allowed(), r.sampling.allowed_token_ids, stops) or r.grammar.field

    def _with_bad_words(self, grammar, params: SamplingParams, vocab: int):
        """``bad_words`` as a token constraint (``structured.BadWords``), beside a structured output's if any. Words
        that leave no first token (with the structured output, ``allowed_token_ids`` and, under ``min_tokens``, the
        stop ids it bans) are an error: the step would have nothing to draw from."""
        from nightjar_jax.engine.structured import BadWords, BothConstraints, bad_word_sequences

        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer to find the words' tokens, and this "
                                      "model has none: ban token ids with logit_bias instead", "bad_words")
        allowed_ids = frozenset(params.allowed_token_ids) if params.allowed_token_ids else None
        bad = BadWords(bad_word_sequences(self.tokenizer, params.bad_words), vocab, allowed_ids)
        first = bad.allowed() if grammar is None else bad.allowed() & grammar.allowed()
        stops = self._stop_ids(params, vocab) if params.min_tokens else ()
        if not first.any() or self._emptied_by(first, params.allowed_token_ids, stops) is not None:
            raise InvalidRequestError("bad_words ban every token the output could start with (beside "
                                      "allowed_token_ids, a structured output or min_tokens): ban fewer words",
                                      "bad_words")
        return bad if grammar is None else BothConstraints(grammar, bad)

    def _after_thought(self, grammar, ids: list[int]):
        """A structured output under ``reasoning_parser``: applied after the output's thought (``reasoning.py``), or
        from the first token when the prompt closed one (thinking turned off)."""
        from nightjar_jax.engine.reasoning import ANSWERING, END, AfterThought, thought_phase

        tail = 16  # (the prompt's end decides, trailing whitespace aside: read back until a tag would show)
        while True:
            end = self.tokenizer.decode(ids[-tail:], skip_special_tokens=False)
            if len(end.rstrip()) >= len(END) or tail >= len(ids):
                break
            tail *= 4
        phase = thought_phase(self.config.reasoning_parser, end)
        if phase == ANSWERING:
            return grammar
        self.grammar_backend()  # (the tags: built with it)
        return AfterThought(grammar, self._thought_tags, phase)

    def grammar_backend(self):
        """Structured outputs' compiler for this engine's vocabulary, built on the first call (seconds: xgrammar reads
        the vocabulary; the server calls it off the engine's thread before it queues the first such request)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer: this model has none",
                                              "structured_outputs")
                from nightjar_jax.engine.structured import GrammarBackend

                self._grammars = GrammarBackend(self.tokenizer, self.target.config.vocab_size, self._eos_ids)
                if self.config.reasoning_parser is not None:  # (the vocabulary's bytes, read here once: ~0.2 s)
                    from nightjar_jax.engine.reasoning import ThoughtTags

                    self._thought_tags = ThoughtTags(self.tokenizer, self.target.config.vocab_size)
            return self._grammars

    def abort_request(self, request_id: str | Iterable[str]) -> RequestOutput | None | list[RequestOutput | None]:
        """Finish a request at once with reason ``abort``; its pages are freed immediately. Its final output, or
        None when no such request is unfinished (or when it is one of an ``n > 1`` FINAL_ONLY request's sequences
        and not its last: the parent's one output comes with the last); several ids (vLLM's iterable): a list of
        those."""
        if not isinstance(request_id, str):
            ids = list(request_id) if isinstance(request_id, Iterable) else None
            if ids is None or not all(isinstance(rid, str) for rid in ids):
                raise TypeError(f"abort_request takes a request id (a string) or an iterable of them, got "
                                f"{short_repr(request_id)}")
            return [self.abort_request(rid) for rid in ids]
        if request_id in self._parents:  # (n > 1: every sequence; the last output is the finished one)
            outs = [self.abort_request(child) for child, (parent, _) in list(self._child_of.items())
                    if parent == request_id]
            return next((o for o in reversed(outs) if o is not None), None)
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, FinishReason.ABORT)
        if self.memory is not None and not self.runner.draft_on_device and not self.has_unfinished_requests():
            self._reload_draft()  # idle now (an idle engine takes no step that would bring the draft back)
        return self._make_output(req, [])

    def reset_stats(self) -> None:
        """Count from zero again (``stats``, and the scheduler's prefix-cache counters it copies each step): the
        server's warm-up request is not traffic."""
        self.stats = EngineStats(accepted_per_position=[0] * self.gamma_max, drafted_per_position=[0] * self.gamma_max)
        sched = self.scheduler
        sched.num_prefix_queries = sched.num_prefix_hits = sched.num_prefix_draft_hits = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): later requests compute their prompts whole
        until pages are registered again. Running requests keep their pages and register none of them, the ones
        they compute from now on included (``stale_kv``): a page's cache entry is found only through the pages
        before it, and those are forgotten (registered, their later pages were counted as cached and never hit).
        Returns the pages forgotten."""
        for r in self.scheduler.running:
            r.stale_kv = True
        return self.allocator.reset_prefix_cache()

    @property
    def max_sequence_len(self) -> int:
        """The most tokens (prompt + generated) one request may hold: the context limit, capped by the pool."""
        return min(self.context_limit, self.max_model_len)

    def new_beam_search(self, prompt, params):
        """A :class:`~nightjar_jax.engine.beam_search.BeamSearch` for ``prompt`` (text, ids or a prompt dict) on this
        engine's vocabulary, end-of-sequence tokens and context; raises ``ValueError`` for a bad prompt."""
        from nightjar_jax.engine.beam_search import BeamSearch

        _cache_salt(prompt)  # (its steps carry the salt: a bad one fails here, before any search runs)
        text, ids = self.tokenize_prompt(prompt)
        vocab = self.target.config.vocab_size
        if not ids or not all(is_token_id(t) and 0 <= t < vocab for t in ids):
            raise _prompt_error(f"a beam search prompt must be non-empty, its token ids in [0, {vocab})")
        ids = [int(t) for t in ids]
        return BeamSearch(text, ids, params, self._eos_ids, self.max_sequence_len)

    @property
    def draft_offloaded(self) -> bool:
        """Whether the draft is in host memory now (elastic memory)."""
        return self.draft is not None and not self.runner.draft_on_device

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: requests waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def get_tokenizer(self):
        """vLLM's: the model's tokenizer (None when it has none)."""
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_free_pages(self) -> int:
        """Pages free for requests: 0 while the KV cache sleeps (it holds none; the metrics' gauge reads the same)."""
        return 0 if "kv_cache" in self._asleep else self.allocator.num_free

    @property
    def num_total_pages(self) -> int:
        """The pool's usable pages; kept while the KV cache sleeps (the pool that wakes up), when
        :attr:`num_free_pages` reads 0."""
        return self.allocator.num_usable

    # ---- the step -------------------------------------------------------------------------------------------------
    def start_profile(self, profile_dir: str | os.PathLike | None = None) -> str:
        """vLLM's profiler hook on JAX's profiler: trace all the process runs (every compiled call, host work, each
        engine step marked ``engine_step``) into ``profile_dir`` (default: ``$NIGHTJAR_PROFILER_DIR``) until
        :meth:`stop_profile`. Returns the folder. View a run's ``*.trace.json.gz`` in Perfetto (ui.perfetto.dev) or
        the folder in TensorBoard's profile plugin."""
        if self._profile is not None:
            raise RuntimeError(f"a profile is already running (into {self._profile[0]}): stop_profile() first")
        folder = os.fspath(profile_dir) if profile_dir is not None else os.environ.get("NIGHTJAR_PROFILER_DIR", "")
        if not folder:
            raise ValueError("start_profile needs a folder for the trace: pass profile_dir=..., or set "
                             "NIGHTJAR_PROFILER_DIR (serve: --profiler-dir)")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"profile_dir {folder!r} is a file, not a folder")
        try:
            jax.profiler.start_trace(folder)
        except RuntimeError as exc:  # (a trace this engine did not start: jax.profiler runs one at a time)
            raise RuntimeError(f"cannot start a profile: {exc} (a jax.profiler trace started elsewhere in this process "
                               f"must stop first)") from None
        self._profile, self._profile_steps = (os.path.abspath(folder), time.time()), 0
        return self._profile[0]

    def stop_profile(self) -> str:
        """End the trace :meth:`start_profile` began and write it; returns the run's folder
        (``<profile_dir>/plugins/profile/<date>``, holding ``*.trace.json.gz`` and ``*.xplane.pb``)."""
        if self._profile is None:
            raise RuntimeError("no profile is running: start_profile() first")
        folder, started = self._profile
        self._profile = None
        jax.profiler.stop_trace()
        runs = os.path.join(folder, "plugins", "profile")
        written = [os.path.join(runs, d) for d in os.listdir(runs)] if os.path.isdir(runs) else []
        written = [d for d in written if os.path.isdir(d) and os.path.getmtime(d) >= started - 1]
        return max(written, key=os.path.getmtime) if written else folder

    def step(self) -> list[RequestOutput]:
        """One engine step (a prefill chunk or a decode step of every running request); the outputs it produced."""
        if self._profile is None:
            return self._step()
        self._profile_steps += 1
        with jax.profiler.StepTraceAnnotation("engine_step", step_num=self._profile_steps):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self._asleep:  # (asleep, the engine holds no request: nothing to do)
            return []
        t0 = time.perf_counter()
        self._step_tick = variants.tick()  # (a drop of compiled variants keeps those this step runs)
        batch = self.scheduler.schedule_prefill()
        outputs: list[RequestOutput] = []
        if batch is not None:
            self._mark_scheduled(batch.requests)
            sampled, logprobs, prompt_logprobs = self.runner.execute_prefill(batch)
            now = time.monotonic()
            for r, scored in zip(batch.requests, prompt_logprobs or [None] * len(batch.requests), strict=True):
                for index, entry in scored or []:
                    if r.prompt_logprobs[index] is None:  # (a chunk recomputed after a preemption: keep the first)
                        r.prompt_logprobs[index] = self._decode_logprobs(entry, r)
            for i, (r, n, tok) in enumerate(zip(batch.requests, batch.num_new_tokens, sampled, strict=True)):
                r.num_computed += n
                self.scheduler.cache_computed(r)
                if r.num_computed == r.num_tokens:  # the chunk reached the end: the sampled token is real
                    outputs.append(self._append(r, [int(tok)], now, logprobs[i] if logprobs else None))
            self.stats.num_prefill_steps += 1
        else:
            # a batch of requests that accept no draft decodes plainly (the planner neither chooses nor observes
            # those steps): each one token short of min_tokens
            plain_only = (all(r.accepts_no_drafts for r in self.scheduler.running)
                          or not (self.runner.draft_on_device or self.ngram_only)  # (offloaded: γ = 0 until back)
                          or (self.ngram_only and not self._anything_to_copy()))
            gamma = 0 if plain_only else self._select_gamma()
            if not plain_only:
                self._planner_speculates = gamma > 0  # (read by the memory policy: it offloads when SD is off)
            boosted = not plain_only and self._lookup_boost(gamma)
            # a boosted step verifies a copied chain: γ_max positions ahead, not the tree's nodes
            gamma, lookahead = (self.gamma_max, self.gamma_max) if boosted else (gamma, self.runner.lookahead(gamma))
            batch = self.scheduler.schedule_decode(lookahead)
            if batch is None:
                return []
            self._count_preemptions(batch)
            if batch.requests:
                self._mark_scheduled(batch.requests)  # (a one-token prompt's first step is a decode step)
                compiled_before = self.runner.num_compiled()
                result = self.runner.execute_decode(batch, gamma)
                compiled = self.runner.num_compiled() != compiled_before
                now = time.monotonic()
                delivered = 0  # tokens appended: a stop or max_tokens drops the committed tokens after it
                for i, (r, toks) in enumerate(zip(batch.requests, result.committed, strict=True)):
                    r.num_computed = r.num_tokens + len(toks) - 1
                    before = len(r.output_token_ids)
                    outputs.append(self._append(r, toks, now, result.logprobs[i] if result.logprobs else None))
                    delivered += len(r.output_token_ids) - before
                    self.scheduler.cache_computed(r)  # (after the append: the pages hash the tokens committed)
                self._record_decode(batch, result, time.perf_counter() - t0, delivered, compiled,
                                    observe=not (boosted or plain_only))
        if self.memory is not None:
            self._manage_memory(preempted=bool(batch.kind == "decode" and batch.preempted))
        self._check_maps_after_compiles()
        self.stats.num_prefix_cache_queries = self.scheduler.num_prefix_queries
        self.stats.num_prefix_cache_hits = self.scheduler.num_prefix_hits
        self.stats.num_prefix_cache_draft_hits = self.scheduler.num_prefix_draft_hits
        self.stats.num_steps += 1
        self.stats.last_step_seconds = time.perf_counter() - t0
        return [o for o in outputs if o is not None]

    @staticmethod
    def _mark_scheduled(requests) -> None:
        """A request's first step, prefill or decode, starts now (``RequestMetrics.first_scheduled_time``: the
        queue time ends here, before its first token; a preemption's recompute keeps the first)."""
        now = time.monotonic()
        for r in requests:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now

    def _check_maps_after_compiles(self) -> None:
        """After a step that compiled a variant: when the process runs short of memory maps (CPU backend:
        ``ModelRunner.maps_short``), drop the compiled variants before a later compile kills the process; those in
        use come back on their next step (from the persistent compilation cache where it holds them)."""
        compiled = self.runner.num_compiled()
        if compiled == self._num_compiled_seen:
            return
        short = self.runner.maps_short(EVICT_MAP_SHARE)
        if not short:
            self._maps_after_eviction = None  # (the process recovered: a next shortage drops at once)
        usage = self.runner.map_usage() if short else None
        if short and usage is not None and self._maps_after_eviction is not None and (
                usage[0] - self._maps_after_eviction < EVICT_REGROWTH_SHARE * usage[1]
                and usage[0] < EVICT_CEILING_SHARE * usage[1]):  # (near the limit it drops whatever holds the maps)
            # The last eviction left the process short: what holds its maps is not this engine's variants (another
            # engine's, other libraries'). Dropping the few compiled since would only compile them again at once, and
            # did so every step (a 16-token stories260K generate took ~2 s against 0.15 s), so this engine waits until
            # its own have grown again.
            if not self._warned_maps_elsewhere:
                self._warned_maps_elsewhere = True
                logger.warning("this process stays short of memory maps after this engine dropped its compiled "
                               "variants: other engines or libraries in the process hold them. It drops its own "
                               "again only after they grow by %d maps, or past %d%% of the limit. %s",
                               int(EVICT_REGROWTH_SHARE * usage[1]), int(100 * EVICT_CEILING_SHARE), short)
        elif short:
            dropped, total = self.runner.evict_least_used(EVICT_TARGET_SHARE, since=self._step_tick)
            self.stats.num_compile_evictions += 1
            logger.warning("dropped %d of %d compiled step variants, the least used (they compile again on "
                           "use): %s", dropped, total, short)
            after = self.runner.map_usage()
            self._maps_after_eviction = None if after is None else after[0]
        self._num_compiled_seen = self.runner.num_compiled()

    # ---- sleep mode ---------------------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        """Whether any part of the engine (its weights or its KV cache) is asleep (:meth:`sleep`)."""
        return bool(self._asleep)

    @property
    def asleep_parts(self) -> frozenset[str]:
        """Which of ``SLEEP_TAGS`` are asleep now (empty: awake)."""
        return frozenset(self._asleep)

    def _sleeping_message(self) -> str:
        return (f"the engine is asleep (level {self.sleep_level}; {' and '.join(sorted(self._asleep))} released): "
                f"call wake_up() (the server: POST /wake_up) before sending requests")

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode: hand the device's memory back while the engine is not needed (e.g. between rollouts
        of an RL loop, or to lend the accelerator to another job), without tearing the engine down.

        - level 1: the weights (target and draft) go to host memory with ``jax.device_put``; the KV cache is
          discarded (its pages were only a cache: the engine must hold no request).
        - level 2: the weights are discarded too (no host copy); :meth:`wake_up` loads them again from their
          checkpoints (the config's, or the spec the last :meth:`update_weights` gave; refused for weights given
          as handles or arrays, which have none).

        The prefix cache is reset, an offloaded draft comes back first (elastic memory; idle, nothing migrates), and
        the compiled step variants stay: after :meth:`wake_up` no step compiles again. Returns the device bytes
        freed. Raises ``ValueError`` for a bad level, and ``RuntimeError`` when requests are unfinished (finish or
        abort them first: nothing is dropped) or the engine is already asleep."""
        if not isinstance(level, int) or isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights to host memory, KV cache discarded) or 2 (weights and "
                             f"KV cache discarded; wake_up reloads the weights from their checkpoints), got {level!r}")
        if self._asleep:
            raise RuntimeError(f"the engine is already asleep (level {self.sleep_level}): wake_up() first")
        if self.has_unfinished_requests():
            n = len(self.scheduler.running) + len(self.scheduler.waiting)
            raise RuntimeError(f"{n} request(s) are unfinished: sleep needs an idle engine (let them finish, or "
                               f"abort them); nothing was released")
        unloadable = [part for part in ("target", "draft") if (part == "target" or self.draft is not None)
                      and self._weight_specs[part] is None]
        if level == 2 and unloadable:
            raise ValueError(f"sleep level 2 discards the weights and wake_up loads them again from their checkpoint, "
                             f"but the {unloadable[0]}'s weights have none (given as a handle or as arrays, to the "
                             f"engine or to update_weights): use level 1, which keeps them in host memory")
        self._check_not_shared("sleep")
        if self.draft_offloaded:  # (back on the device: one layout to release and restore)
            self._reload_draft()
        self.reset_prefix_cache()
        self.allocator.forget_draft()
        # the weights first: a failed move leaves everything where it was (ModelRunner.offload_weights); the pools'
        # release cannot fail half-way
        freed = self.runner.offload_weights(discard=level == 2)
        self.sleep_level = level
        self._asleep = {"weights"}
        freed += self.runner.release_pools()
        self._asleep.add("kv_cache")
        host.trim()  # (on a CPU the freed bytes reach the system only so: memory/host.py)
        self.stats.num_sleeps += 1
        logger.info("engine asleep (level %d): %d device bytes freed", level, freed)
        return freed

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        """Undo :meth:`sleep`: ``tags`` None wakes everything; ``["weights"]`` or ``["kv_cache"]`` wakes that part
        alone (vLLM's: e.g. the weights first, to update them, then the KV cache). The KV cache comes back empty.
        Waking what is awake is a no-op."""
        tags = list(SLEEP_TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}: got {unknown}")
        t0 = time.perf_counter()
        if "weights" in tags and "weights" in self._asleep:
            if self.sleep_level == 2:
                draft = self._load_again("draft") if self.draft is not None else None
                self.runner.load_weights(self._load_again("target"), draft)
            else:
                self.runner.restore_weights()
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.runner.restore_pools()
            self._asleep.discard("kv_cache")
        if not self._asleep and self.sleep_level:
            logger.info("engine awake after level-%d sleep (%.2f s)", self.sleep_level, time.perf_counter() - t0)
            self.sleep_level = 0

    # ---- weight updates -----------------------------------------------------------------------------------------
    def update_weights(self, weights=None, *, draft_weights=None) -> bool:
        """Serve new weights without a restart (an RL loop's policy after a training step; vLLM's weight sync):
        ``weights`` for the target and ``draft_weights`` for the draft (None: keep), each a checkpoint (a spec or
        path, loaded as at start), an HF-named state dict of arrays (what ``load_checkpoint`` yields, e.g. params
        a JAX training step just wrote back in HF names), or a ``ModelHandle``; of the loaded model's architecture.

        The new weights are built and checked before anything changes (a bad one raises ``ValueError``, a checkpoint
        path that cannot be read an ``OSError`` such as ``FileNotFoundError``; the old weights still served).
        Same layout: nothing recompiles; another layout of the same model (a GGUF target's
        4-bit blocks whose new values are off their grid come back as float32 panels) drops the compiled variants,
        which compile again on first use. Returns whether that happened. The prefix cache is reset (its pages hold
        the old weights' K/V); requests in flight go on under the new weights with the K/V they already computed,
        as in-flight updates do (the server's endpoint waits for them instead). While the weights sleep, the update
        wakes them with the new ones (a part not given comes back as ``wake_up`` brings it; the KV cache may stay
        asleep). The device holds both copies while the new one is built."""
        if weights is None and draft_weights is None:
            raise ValueError("update_weights needs weights, draft_weights or both")
        if draft_weights is not None and self.draft is None:
            raise ValueError("draft_weights given, but this engine has no draft")
        target = None if weights is None else _blame("weights", self._weights_handle, weights, self.target, "weights")
        draft = None if draft_weights is None else _blame("draft_weights", self._weights_handle, draft_weights,
                                                          self.draft, "draft_weights")
        asleep = "weights" in self._asleep
        self._check_not_shared("update_weights", target=target is not None or asleep, draft=draft is not None or asleep)
        # (checked before anything wakes: a refused update leaves sleeping weights asleep, for wake_up to bring back;
        # one checked after the wake left a level-2 engine marked awake with its weights deleted)
        _blame("weights", self.runner.check_weights, target)
        _blame("draft_weights", self.runner.check_weights, None, draft)
        if draft is not None and not self.runner.draft_on_device and self.has_unfinished_requests():
            raise RuntimeError("the draft is offloaded to host memory under load (elastic memory): update its "
                               "weights once it is back (when the load falls), or update the target alone")
        if asleep:  # (woken here: by the new weights, the rest as wake_up brings them back)
            if self.sleep_level == 2:
                missing = [part for part, new in (("target", target), ("draft", draft))
                           if new is None and (part == "target" or self.draft is not None)]
                if any(self._weight_specs[part] is None for part in missing):
                    raise ValueError("the weights sleep at level 2 and the part not given has no checkpoint to load "
                                     "again: give both weights and draft_weights")
                if target is None:
                    target = _blame("weights", self._load_again, "target", reloaded=True)
                if draft is None and self.draft is not None:
                    draft = _blame("draft_weights", self._load_again, "draft", reloaded=True)
            else:
                self.runner.restore_weights()  # (the old weights back: awake whatever follows)
                self._mark_weights_awake()
        if draft is not None and not self.runner.draft_on_device:  # (elastic memory moved it to host memory; idle,
            self._reload_draft()  # checked above: nothing migrates)
        relayout = self.runner.load_weights(target, draft)
        if "weights" in self._asleep:  # (level 2: awake once the new weights are in, not before)
            self._mark_weights_awake()
        for part, given in (("target", weights), ("draft", draft_weights)):
            if given is not None:  # (where a level-2 sleep would load them from again: a spec, else nowhere)
                self._weight_specs[part] = given if isinstance(given, str) else None
        self.reset_prefix_cache()
        self.allocator.forget_draft()
        for r in self.scheduler.running:  # (they go on over K/V of the old weights: none of their pages is cached,
            r.stale_kv = True  # the ones they compute from now on included; a QA run served a later prompt mixed K/V)
        host.trim()  # (the old weights' heap)
        self.stats.num_weight_updates += 1
        logger.info("weights updated (%s)%s", ", ".join(n for n, h in (("target", target), ("draft", draft)) if h),
                    ": a new layout, the step variants compile again" if relayout else "")
        return relayout

    def _load_again(self, part: str) -> ModelHandle:
        """``part``'s ("target" or "draft") weights loaded again from the checkpoint they last came from (a level-2
        sleep dropped them), checked against the loaded model's architecture: the file may have changed since."""
        handle = self._load(self._weight_specs[part], tokenizer_spec=None)[0]
        self.runner.check_weights(*((handle, None) if part == "target" else (None, handle)))
        return handle

    def _mark_weights_awake(self) -> None:
        self._asleep.discard("weights")
        if not self._asleep:
            self.sleep_level = 0

    def _check_not_shared(self, action: str, target: bool = True, draft: bool = True) -> None:
        """Refuse ``action`` on weights another live engine also serves (``LLM.from_engine`` over a loaded target):
        moving or replacing them would pull them from under its steps."""
        import gc

        handles = [h for h, mine in ((self.target, target), (self.draft, draft)) if mine and h is not None]
        for attempt in range(2):
            shared = [h for h in handles if any(u is not self.runner for u in h.users)]
            if not shared or attempt:
                break
            gc.collect()  # (an engine nobody holds any more may still be listed until its cycles are collected)
        if shared:
            raise RuntimeError(f"{action} is refused: {shared[0].config.name}'s weights are shared with another engine "
                               f"(LLM.from_engine over a loaded model), which would lose them; {action} an engine that "
                               f"holds its own weights")

    def _weights_handle(self, weights, current: ModelHandle, field: str) -> ModelHandle:
        """``weights`` (a spec or path, an HF-named state dict, or a handle) as a handle laid out as this engine
        lays out its own (packed, stacked)."""
        if isinstance(weights, (ModelHandle, str)):
            if isinstance(weights, ModelHandle):  # (a spec's load checks its own)
                self._check_finite(weights, field)
                return weights
            # at the dtype served: a checkpoint of the same model saved in another dtype (a trainer's float32 for a
            # bfloat16 server) was refused as "another architecture" when the engine took each checkpoint's own
            return self._load(weights, tokenizer_spec=None, dtype=current.config.dtype)[0]
        if not hasattr(weights, "items"):
            raise ValueError(f"{field} must be a checkpoint spec or path, an HF-named state dict or a ModelHandle, "
                             f"got {type(weights).__name__}")
        from nightjar_jax.linear import pack_state
        from nightjar_jax.models.llama import HEAD_TOKEN_IDS, state_from_hf

        cfg = self.config
        sd = {}
        for name, value in weights.items():
            if not isinstance(name, str):
                raise ValueError(f"{field}: state dict keys must be HF tensor names (strings), got {name!r}")
            arr = np.asarray(value)
            if name != HEAD_TOKEN_IDS and not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
                raise ValueError(f"{field}: tensor {name} is {arr.dtype}: weights must be floating-point arrays "
                                 f"(float32, float16 or bfloat16)")
            if name != HEAD_TOKEN_IDS and not np.isfinite(arr.astype(np.float32)).all():
                raise ValueError(f"{field}: tensor {name} holds NaN or infinite values: weights must be finite")
            sd[name] = arr
        graphdef, state = state_from_hf(current.config, sd, attention_impl=cfg.attention_impl,
                                        linear_impl=cfg.linear_impl, source=field)
        handle = ModelHandle(current.config, graphdef, pack_state(state, cfg.linear_impl,
                                                                  weight_format=cfg.weight_format))
        handle.stack_layers()
        return handle

    # ---- elastic memory -----------------------------------------------------------------------------------------
    def _manage_memory(self, preempted: bool) -> None:
        """After a step: let the policy count it, and make the move it asks for (nightjar_jax/memory/elastic.py)."""
        alloc, sched = self.allocator, self.scheduler
        head = sched.waiting[0] if sched.waiting else None
        blocked = (head is not None and len(sched.running) < sched.config.max_num_seqs
                   and not alloc.can_allocate(sched.pages_to_admit(head)))
        action = self.memory.observe(PoolState(alloc.num_free, alloc.num_pages - 1, alloc.num_extension,
                                               len(sched.waiting), blocked, preempted, len(sched.running),
                                               speculating=self._planner_speculates))
        if action is MemoryAction.OFFLOAD:
            self._offload_draft()
        elif action is MemoryAction.RELOAD:
            seconds = self._reload_draft()
            if self.has_unfinished_requests():  # (requests waited on it; an idle engine's reload delays nobody)
                self._uncharged_reload_seconds += seconds

    def warmup(self, sampled: bool = True, prefill: bool = True, progress=None) -> list[tuple]:
        """Compile before traffic, on padding-only batches: every decode variant (``ModelRunner.warmup``), with
        ``prefill`` the prefill chunks and the draft's catch-up (``ModelRunner.warmup_prefill``), and with elastic
        memory the same over the extended layout (:meth:`warmup_elastic`); while the draft is offloaded, only the
        γ = 0 variants over the extended layout (the draft has no K/V to warm). ``progress()`` is called
        :meth:`warmup_ticks` times. Returns the variant keys compiled; the server's ``--warmup full`` calls it."""
        if self._asleep:
            raise EngineSleepingError(self._sleeping_message())
        self.runner.warmup_stopped = None
        if self.draft_offloaded:  # (memory pressure under traffic: γ = 0 over the extended pools is what runs
            return self._warmup_layout([0], sampled, prefill, progress)  # until the draft is back; it has no K/V)
        keys = self._warmup_layout(None, sampled, prefill, progress)
        if self.runner.warmup_stopped:  # (short of memory maps: warned; the rest compiles on first use)
            return keys
        return keys + self.warmup_elastic(sampled=sampled, prefill=prefill, progress=progress)

    def _warmup_layout(self, gammas: list[int] | None, sampled: bool, prefill: bool, progress) -> list[tuple]:
        """The decode variants at ``gammas`` (None: every γ) over the pools as they are now and, with ``prefill``,
        the prefill chunks (and the catch-up, draft on the device), until memory maps run short. In the order a
        load needs them: plain steps (γ = 0), the chunks every new prompt runs, then the speculating steps, which the
        planner leaves under load (the γ it learned to choose first: ``_speculative_warmup_order``); so a warm-up
        the maps stop (a CPU's vm.max_map_count: a SmolLM2 pair's whole set does not fit the default) leaves γ > 0
        variants to compile on first use, not every prompt's prefill."""
        runner = self.runner
        plain_first = gammas is None and prefill and self.gamma_max > 0
        keys = runner.warmup(gammas=[0] if plain_first else gammas, sampled=sampled, progress=progress)
        if prefill and not runner.warmup_stopped:
            keys += runner.warmup_prefill(sampled=sampled, progress=progress)
        if plain_first:
            for batch_size, gamma in self._speculative_warmup_order():
                if runner.warmup_stopped:
                    break
                keys += runner.warmup(batch_sizes=[batch_size], gammas=[gamma], sampled=sampled, progress=progress)
        return keys

    def _speculative_warmup_order(self) -> list[tuple[int, int]]:
        """The (batch bucket, γ > 0) decode variants in the order the warm-up compiles them: first the γ the planner
        would choose at each bucket when it has learned one (a ``planner_state`` warm start: the maps may stop the
        warm-up before the rest), then every other, smaller buckets first."""
        best_arms = getattr(self.planner, "best_arms", None)
        best = best_arms() if callable(best_arms) else {}
        buckets = self.runner.shapes.decode_buckets
        first = [(b, best[c]) for b in buckets if (c := self.planner.context_of(b)) in best and best[c] > 0]
        rest = [(b, g) for b in buckets for g in range(1, self.gamma_max + 1) if (b, g) not in first]
        return first + rest

    def warmup_ticks(self, sampled: bool = True, prefill: bool = True) -> int:
        """How many times :meth:`warmup` calls its ``progress`` (for a progress bar's total)."""
        runner = self.runner
        widths = len(runner.warmup_widths())
        modes = 2 if sampled else 1
        gammas = 1 if self.draft_offloaded else self.gamma_max + 1
        elastic = self.memory is not None and runner.draft_on_device
        ticks = len(runner.shapes.decode_buckets) * widths * modes * (gammas + elastic)
        if prefill:  # (while offloaded for warmup_elastic: the target's chunks only)
            ticks += runner.warmup_prefill_ticks() + elastic * len(runner.warmup_prefill_shapes()) * widths
        return ticks

    def warmup_elastic(self, sampled: bool = True, prefill: bool = False, progress=None) -> list[tuple]:
        """Compile the variants of the extended layout (γ = 0 decode steps over the pools with an extension: what
        every decode step runs while the draft is offloaded; with ``prefill`` also the prefill chunks over them)
        before traffic, by offloading the draft, warming those up on padding-only batches and reloading it (idle:
        nothing to migrate). A no-op without elastic memory. Returns the variant keys compiled."""
        if self.memory is None or self.has_unfinished_requests() or not self.runner.draft_on_device:
            return []
        self._offload_draft()
        try:
            return self._warmup_layout([0], sampled, prefill, progress)
        finally:
            self._reload_draft()

    def _offload_draft(self) -> None:
        """Draft weights to host memory, its pools released, and an extension KV pool of the bytes they held."""
        with self.state_lock:
            self._offload_draft_locked()

    def _offload_draft_locked(self) -> None:
        t0 = time.perf_counter()
        freed = self.runner.offload_draft()
        self.allocator.forget_draft()  # (its K/V pool went: no cached page holds the draft's K/V now)
        for r in (*self.scheduler.running, *self.scheduler.waiting):
            r.num_draft_computed = r.num_draft_cached_pages = 0
        pages = freed // self.runner.target_page_bytes()
        if pages:
            self.runner.attach_extension(pages)
            self.allocator.attach_extension(pages)
        self.memory.moved(MemoryAction.OFFLOAD)
        s = self.stats
        s.num_draft_offloads += 1
        s.offload_seconds += time.perf_counter() - t0
        logger.info("draft offloaded to host memory: %d device bytes freed, extension pool of %d KV pages "
                    "(%d free of %d)", freed, pages, self.allocator.num_free, self.allocator.num_usable)

    def _reload_draft(self) -> float:
        """Live extension pages migrate into free base pages, the extension goes, and the draft comes back; every
        request's draft KV is then caught up before its next speculative step (the offload set every
        ``num_draft_computed`` to 0, and nothing advances it while the draft is away). Returns its seconds."""
        with self.state_lock:
            return self._reload_draft_locked()

    def _reload_draft_locked(self) -> float:
        t0 = time.perf_counter()
        moved = 0
        if self.allocator.num_extension:
            holders = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.block_table]
            src, dst = self.allocator.detach_extension([r.block_table for r in holders])
            self.runner.detach_extension(src, dst)
            moved = len(src)
        self.runner.reload_draft()
        self.memory.moved(MemoryAction.RELOAD)
        s = self.stats
        s.num_draft_reloads += 1
        s.num_migrated_pages += moved
        seconds = time.perf_counter() - t0
        s.offload_seconds += seconds
        logger.info("draft back on the device: %d live extension pages migrated into the base pool", moved)
        return seconds

    def _anything_to_copy(self) -> bool:
        """Draft-free n-gram speculation: whether lookup finds a continuation for any decoding request (else the
        step decodes plainly: a verify of nothing but capped rows would cost γ positions for one token each)."""
        decoding = [r for r in self.scheduler.running if not r.is_prefilling]
        return any(self.runner._lookup_drafts(decoding, self.gamma_max))

    def _select_gamma(self) -> int:
        batch_size = self.scheduler.num_decoding()
        if self.gamma_max == 0 or batch_size == 0:
            return 0
        gamma = self.planner.select(
            batch_size, queue_len=len(self.scheduler.waiting), free_pages=self.allocator.num_free,
            draft_on_device=True,
        )
        return min(int(gamma), self.gamma_max)

    def _lookup_boost(self, gamma: int) -> bool:
        """Whether this decode step runs at γ_max instead of the planner's γ (1 .. γ_max - 1, or 0 while the
        verify stays within LOOKUP_AR_BOOST_MAX_ROWS rows): every decoding request is greedy and n-gram lookup copies
        all γ_max drafts for it, so the draft model does not run and the longer copy costs only a wider verify (on
        the held-out prompts a copying step accepted 3.16 drafts of 4). Where γ_max has a token tree the step
        verifies the copied chain instead (and reserves γ_max positions, not the tree's nodes). Not when the pool
        lacks one page per request for the longer reservation. The planner does not observe such steps: it did not
        choose them.

        At γ = 0 (the planner found drafting does not pay, e.g. on a CPU where the target's compact weights made a
        batch-1 step ~2x cheaper than the draft's four passes are worth) a copied chain still costs no draft pass;
        past a few rows the verify's products are bound by FMAs, not bytes, so there only small batches."""
        if self.runner.lookup is None or gamma >= self.gamma_max:
            return False
        decoding = [r for r in self.scheduler.running if not r.is_prefilling]
        if gamma == 0 and len(decoding) * (self.gamma_max + 1) > LOOKUP_AR_BOOST_MAX_ROWS:
            return False
        return (bool(decoding) and self.allocator.num_free >= len(decoding)
                and self.runner.lookup_covers(decoding, self.gamma_max))

    def _record_decode(self, batch: ScheduledBatch, result: DecodeResult, seconds: float, committed: int,
                       compiled: bool = False, observe: bool = True) -> None:
        """Step stats; ``committed`` counts the tokens the step delivered to its requests (what the planner's
        tokens/s and the step log's ``committed`` mean), not those verified past a stop or ``max_tokens``."""
        s = self.stats
        s.num_decode_steps += 1
        s.last_gamma = result.gamma
        s.last_tree_nodes = result.tree_nodes
        s.decode_steps_per_gamma[result.gamma] = s.decode_steps_per_gamma.get(result.gamma, 0) + 1
        s.last_batch_size = batch.num_seqs
        if result.gamma > 0:
            s.num_drafted_tokens += result.num_drafted
            s.num_accepted_tokens += sum(result.num_accepted)
            # rows that could not accept drafts (plain_rows) count in no acceptance stat
            speculated = [not p for p in result.plain_rows or [False] * len(result.num_accepted)]
            if result.lookup is not None:
                s.num_lookup_steps += sum(c and sp for c, sp in zip(result.lookup, speculated, strict=True))
                s.num_lookup_accepted += sum(k for k, copied in zip(result.num_accepted, result.lookup, strict=True)
                                             if copied)
            for k, sp in zip(result.num_accepted, speculated, strict=True):
                if not sp:
                    continue
                for i in range(result.gamma):
                    s.drafted_per_position[i] += 1
                    s.accepted_per_position[i] += int(i < k)
            s.num_catchup_tokens += result.catchup_tokens
            s.catchup_seconds += result.catchup_seconds
        switch, observed = 0.0, seconds
        if self._prev_gamma == 0 and result.gamma > 0:  # a switch: the catch-up, and the reload before it, if any
            switch = result.catchup_seconds + self._uncharged_reload_seconds
            observed += self._uncharged_reload_seconds  # (the reload ran between steps: outside the step's time)
            self._uncharged_reload_seconds = 0.0  # (charged to this switch, observed or not, as its catch-up is)
        if compiled:
            s.num_compiling_decode_steps += 1
        if self.gamma_max and not compiled and observe and observed <= MAX_STEP_SECONDS:
            # (past a day, the machine slept mid-step: that time says nothing about γ, and the planner refuses it)
            # A step that compiled a variant (the first of its shape without a full warm-up) timed the compiler,
            # seconds where its arm takes milliseconds: the planner would shun that γ for it, so it does not see it.
            self.planner.observe(result.gamma, batch.num_seqs, committed, observed,
                                 switch_seconds=min(switch, observed))
            if time.monotonic() >= self._planner_save_due:
                self.save_planner_state()
        self._prev_gamma = result.gamma
        if self.record_steps:
            s.step_log.append(dict(
                gamma=result.gamma, batch_size=batch.num_seqs, committed=committed, seconds=seconds,
                draft_seconds=result.draft_seconds, verify_seconds=result.verify_seconds,
                catchup_seconds=result.catchup_seconds, accepted=list(result.num_accepted), lookup=result.lookup,
                tree_nodes=result.tree_nodes, compiled=compiled, plain_rows=result.plain_rows,
            ))

    def _count_preemptions(self, batch: ScheduledBatch) -> None:
        if batch.preempted:
            self.stats.num_preemptions += len(batch.preempted)

    # ---- outputs ------------------------------------------------------------------------------------------------
    def _append(self, r: Request, tokens: list[int], now: float, logprobs: list | None = None) -> RequestOutput | None:
        """Append committed tokens one by one, stopping at the first stop condition (later ones are dropped), with
        their log-probabilities (one ``{token id: Logprob}`` per token) when the request asked for them."""
        if r.is_finished:
            return None
        if r.sampling.logprobs is not None and (logprobs is None or len(logprobs) != len(tokens)):
            raise RuntimeError(f"request {r.request_id} asked for log-probabilities but the step returned "
                               f"{'none' if logprobs is None else len(logprobs)} for {len(tokens)} tokens")
        sp = r.sampling
        eos = self._eos_ids if not sp.ignore_eos else ()
        new_ids: list[int] = []
        for j, tok in enumerate(tokens):
            dead = None
            if r.stop_ids and r.under_min_tokens and tok in r.stop_ids:
                # (banned there: drawn only from a row with nothing left, as the constraints together may leave;
                # which field left it so, the constraint's mask says)
                dead = "min_tokens" if r.grammar is None else self._dead_end_field(r)
            elif r.grammar is not None and not r.grammar.accept(tok):  # (its mask allowed only what it accepts)
                dead = self._dead_end_field(r)
            if dead is not None:
                # a dead end: the step's row had nothing left to draw from (e.g. bad_words beside allowed_token_ids
                # at a later position, or a structured output complete before min_tokens), and what it returned is
                # not kept
                what = {"bad_words": "bad_words leave no allowed token",
                        "allowed_token_ids": "allowed_token_ids hold no token the structured output allows",
                        "min_tokens": f"min_tokens={sp.min_tokens} bans the stop tokens, the only ones the "
                                      f"constraints allow"}.get(dead,
                                                                "the structured output's constraint allows no token")
                r.error = (f"{what} after the output's {len(r.output_token_ids)} tokens: it cannot be completed, and "
                           f"the request ended there")
                r.error_field = dead  # (a dead end of the constraints, not an engine fault)
                self._detokenize(r, [], final=True)
                self._finish(r, FinishReason.ERROR)
                break
            r.output_token_ids.append(tok)
            if r.output_counts is not None:
                r.output_counts[tok] = r.output_counts.get(tok, 0) + 1
            if logprobs is not None and r.output_logprobs is not None:
                r.output_logprobs.append(self._decode_logprobs(logprobs[j], r))
                r.cumulative_logprob += logprobs[j][tok].logprob
            r.token_times.append(now)
            new_ids.append(tok)
            if r.first_token_time is None:
                r.first_token_time = now
            reason: FinishReason | None = None
            text_ids = [tok]
            if (tok in sp.stop_token_ids or tok in eos) and len(r.output_token_ids) > sp.min_tokens:
                # (vLLM's stop_reason: a stop token id the request named; None for the end-of-sequence token)
                reason, r.stop_reason = FinishReason.STOP, tok if tok in sp.stop_token_ids else None
                text_ids = text_ids if sp.include_stop_str_in_output else []  # (vLLM's: the stop token's text too)
            elif r.grammar is not None and r.grammar.is_terminated:  # (complete; ended by an EOS under ignore_eos)
                reason, r.stop_reason = FinishReason.STOP, tok if tok in sp.stop_token_ids else None
                text_ids = text_ids if sp.include_stop_str_in_output else []  # (vLLM's: the stop token's text too)
            elif (sp.max_tokens is not None and len(r.output_token_ids) >= sp.max_tokens) or (
                r.num_tokens >= self.max_model_len
            ):
                reason = FinishReason.LENGTH
            if self._detokenize(r, text_ids, final=reason is not None):
                reason = FinishReason.STOP
            if reason is not None:
                self._finish(r, reason)
                break
        self.stats.num_generated_tokens += len(new_ids)
        return self._make_output(r, new_ids)

    def _decode_logprobs(self, entry: dict, r: Request) -> dict:
        """Fill each entry's ``decoded_token`` (the token's own text) when there is a tokenizer (and the request
        detokenizes)."""
        if self.tokenizer is not None and r.sampling.detokenize:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.token_text(token)
        return entry

    def _detokenize(self, r: Request, ids: list[int], final: bool) -> bool:
        """Extend ``r.output_text`` with ``ids``; returns True when a stop string ended the text (trimmed).

        While stop strings are set, the last ``max(len(stop)) - 1`` characters are held back from the streamed
        text until it is clear they do not start a stop string.

        The last ids' bytes that never completed a character (``max_tokens`` cut one) end the text as U+FFFD
        (``IncrementalDetokenizer.flush``; vLLM drops them, here the text shows the output was cut inside a
        character, as a whole decode does), but that replacement character is made up: no stop string matches in it
        (``stop=["\ufffd"]`` reported a stop there).
        """
        if r.detokenizer is None:
            return False
        emitted = r.output_text
        checked = len(emitted) + len(r.held_text)  # (text whose stop strings earlier calls looked for)
        # (the last ids' held text: its whole characters, then U+FFFD for bytes that never completed one)
        full = emitted + r.held_text + (r.detokenizer.add(ids) if ids else "") + (
            r.detokenizer.flush() if final else "")
        real = len(full.rstrip("\ufffd")) if final else len(full)  # (a stop must end before a made-up U+FFFD)
        sp = r.sampling
        stopped = False
        if sp.stop and not r.under_min_tokens:
            # only a stop string that ends in the new text counts, as in vLLM: one completed under min_tokens is
            # not a stop (and its start may have gone out already). The one that ends first wins (then the longer):
            # where the tokens happen to split the text does not change where it stops
            hits = [(full.find(s, max(0, checked - len(s) + 1)), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0 and i + len(s) <= real]
            if hits:
                i, s = min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
                full = full[: i + len(s)] if sp.include_stop_str_in_output else full[: max(i, len(emitted))]
                r.stop_reason, stopped, final = s, True, True
        hold = 0 if (final or not sp.stop) else max(len(s) for s in sp.stop) - 1
        visible = max(len(emitted), len(full) - hold)
        r.new_text += full[len(emitted) : visible]
        r.output_text, r.held_text = full[:visible], full[visible:]
        return stopped

    def _finish(self, r: Request, reason: FinishReason) -> None:
        if r.held_text:  # the end of the text: nothing more can complete a stop string
            r.new_text += r.held_text
            r.output_text += r.held_text
            r.held_text = ""
        self.scheduler.finish(r, reason)
        r.lookup_index = None  # its n-gram tables (spec/lookup.py) go with it
        r.finish_time = time.monotonic()
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1

    def _make_output(self, r: Request, new_ids: list[int]) -> RequestOutput | None:
        """The request's output after a step (``SamplingParams.output_kind``: everything so far, the step's delta,
        or None until it finishes)."""
        kind = r.sampling.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not r.is_finished:
            return None
        delta, r.new_text = r.new_text, ""
        logprobs = None if r.output_logprobs is None else list(r.output_logprobs)
        comp = CompletionOutput(
            index=0, text=r.output_text, token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason.value if r.finish_reason else None, stop_reason=r.stop_reason,
            delta_text=delta, delta_token_ids=new_ids, logprobs=logprobs, cumulative_logprob=r.cumulative_logprob,
        )
        if kind == RequestOutputKind.DELTA:
            comp.text, comp.token_ids = delta, list(new_ids)
            comp.logprobs = None if logprobs is None else logprobs[len(logprobs) - len(new_ids):]
        elif kind == RequestOutputKind.FINAL_ONLY:  # (its one output: everything is the delta)
            comp.delta_token_ids = list(r.output_token_ids)
        metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.finish_time,
                                 list(r.token_times))
        if r.is_finished:
            self.requests.pop(r.request_id, None)
        # (DELTA: the prompt's log-probabilities with the first output that carries tokens, once, as vLLM's)
        once = kind != RequestOutputKind.DELTA or len(r.output_token_ids) <= len(new_ids)
        out = RequestOutput(r.request_id, r.prompt, list(r.prompt_token_ids), [comp], r.is_finished, metrics,
                            r.error, r.error_field, prompt_logprobs=r.prompt_logprobs_snapshot() if once else None,
                            num_cached_tokens=r.num_cached_tokens)
        link = self._child_of.get(r.request_id)
        if link is not None:  # one of n sequences: under its parent's id, finished with the last of them
            out.request_id, comp.index = link
            if r.is_finished:
                del self._child_of[r.request_id]
                self._parents[out.request_id] -= 1
                if not self._parents[out.request_id]:
                    del self._parents[out.request_id]
            out.finished = out.request_id not in self._parents
            if kind == RequestOutputKind.FINAL_ONLY:  # (every sequence in one output, once the last is done)
                finals = self._parent_finals.setdefault(out.request_id, [])
                finals.append(comp)
                if not out.finished:
                    return None
                out.outputs = sorted(self._parent_finals.pop(out.request_id), key=lambda c: c.index)
        return out
