"""Typed, frozen configuration for every subsystem.

Each dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message that names
the field, the value it got and what is allowed. CLI flags map 1:1 onto these fields (``--max-num-seqs`` ->
``EngineConfig.max_num_seqs``), see :func:`nightjar_jax.cli.add_engine_args`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """An invalid configuration value: the message names the field and the allowed values. ``field``: the config
    field at fault where one is (the command line names its flag instead)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "pallas", "cpu", "reference")
LINEAR_IMPLS = ("auto", "cpu", "xla")  # nightjar_jax/linear.py
WEIGHT_FORMATS = ("auto", "compact", "f32", "w4a8")  # how the CPU kernel holds linear weights (linear.py pack_state)
LOAD_FORMATS = ("auto", "hf", "safetensors", "gguf", "llama2c", "orbax", "dummy")
KV_CACHE_DTYPES = ("auto", *DTYPES)  # auto: each model's own dtype
DRAFT_OFFLOAD = ("off", "auto")  # elastic memory: never move the draft, or offload / reload it by load
# vLLM's --reasoning-parser: how a thinking model marks its thought (nightjar_jax/engine/reasoning.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's: arrival order, or each request's priority (lower first)


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: allowed {allowed}", field=name)


def _fspath_fields(config: Any, *names: str) -> None:
    """A frozen config's path fields given as ``pathlib.Path`` (os.PathLike) held as their ``str``."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, os.PathLike):
            object.__setattr__(config, name, os.fspath(value))


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    _check(ok, name, value, f"an integer in [{low}, {'inf' if high is None else high}]")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type == "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _check(self.factor >= 1.0, "rope_scaling.factor", self.factor, "a float >= 1")
        _check(
            0 < self.low_freq_factor < self.high_freq_factor,
            "rope_scaling.low_freq_factor",
            (self.low_freq_factor, self.high_freq_factor),
            "0 < low_freq_factor < high_freq_factor",
        )
        _check_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings, 1)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama-family model (target or draft).

    Attention uses HF's rotate-half RoPE layout; checkpoints in Meta's interleaved layout (llama2.c, GGUF) are
    permuted by their loaders.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    dtype: str = "float32"  # parameter and activation dtype; softmax and norms run in float32
    name: str = "llama"
    # A draft's cheap LM head: an untied head over only this many token ids (the checkpoint's int32
    # ``lm_head.token_ids``, sorted and unique); every other id gets logit -inf (probability 0). None: full head.
    head_vocab_size: int | None = None
    # A feature draft (EAGLE): its input at position p is fc([embed(x[p]), f[p - 1]]) with f the target's final
    # hidden state (this width) where the target has run, else the draft's own output; it has no embedding table of
    # its own (the target's is passed in). None: a plain token-input model.
    feature_size: int | None = None
    # A feature draft with fused features (EAGLE-3): f above is then fuse([rms(r_1), .., rms(r_k), h]) where r_i is
    # the target's residual stream after each of these layer counts (RMS-normalised, no weight) and h its final
    # hidden state; ``fuse`` is the draft's [(k + 1) * feature_size -> feature_size] matrix. None: h alone.
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            _check_int(f, getattr(self, f), 1)
        if self.head_dim is None:
            _check(
                self.hidden_size % self.num_heads == 0,
                "hidden_size",
                self.hidden_size,
                f"a multiple of num_heads={self.num_heads} when head_dim is not given",
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_int("head_dim", self.head_dim, 1)
        _check(self.head_dim % 2 == 0, "head_dim", self.head_dim, "an even integer (RoPE rotates pairs)")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads}",
        )
        _check(isinstance(self.rope_theta, numbers.Real) and not isinstance(self.rope_theta, bool)
               and 0 < self.rope_theta < math.inf, "rope_theta", self.rope_theta, "a finite positive float")
        _check(isinstance(self.tie_word_embeddings, bool), "tie_word_embeddings", self.tie_word_embeddings,
               "True or False")
        _check(0 < self.rms_norm_eps < 1, "rms_norm_eps", self.rms_norm_eps, "a float in (0, 1)")
        _check_int("max_position_embeddings", self.max_position_embeddings, 1)
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        eos = self.eos_token_ids
        # (HF's config.json writes one id as a plain int: it was "'int' object is not iterable")
        eos = () if eos is None else (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else tuple(eos)
        object.__setattr__(self, "eos_token_ids", eos)
        for t in eos:
            _check_int("eos_token_ids[]", t, 0, self.vocab_size - 1)
        if self.bos_token_id is not None:  # (as the EOS ids: an id outside the vocabulary was taken)
            _check_int("bos_token_id", self.bos_token_id, 0, self.vocab_size - 1)
        if isinstance(self.rope_scaling, dict):  # (HF's form: its "rope_type" key was an unexpected keyword)
            scaling = dict(self.rope_scaling)
            kind = scaling.pop("rope_type", scaling.pop("type", "llama3"))
            fields = {f.name for f in dataclasses.fields(RopeScaling)}
            _check(kind == "llama3" and set(scaling) <= fields, "rope_scaling", self.rope_scaling,
                   f"None, a RopeScaling, or a dict of rope_type 'llama3' and the keys {sorted(fields)}")
            object.__setattr__(self, "rope_scaling", RopeScaling(**scaling))
        if self.head_vocab_size is not None:
            _check_int("head_vocab_size", self.head_vocab_size, 1, self.vocab_size)
            _check(
                not self.tie_word_embeddings,
                "head_vocab_size",
                self.head_vocab_size,
                "None when tie_word_embeddings is true (a subset head is its own untied matrix)",
            )
        if self.feature_size is not None:
            _check_int("feature_size", self.feature_size, 1)
            _check(
                not self.tie_word_embeddings,
                "feature_size",
                self.feature_size,
                "None when tie_word_embeddings is true (a feature draft has no embedding table to tie its head to)",
            )
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            object.__setattr__(self, "feature_layers", layers)
            _check(self.feature_size is not None, "feature_layers", layers, "None for a model without feature_size")
            _check(len(layers) > 0 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers)
                   and list(layers) == sorted(set(layers)), "feature_layers", layers,
                   "a non-empty increasing tuple of layer counts >= 1 (the target's layers before its last)")

    @property
    def feature_pool_width(self) -> int | None:
        """A feature draft's per-token width in the engine's feature pool: the target's final state, and for a fused
        draft its residual stream after each of ``feature_layers`` too. None for a model without ``feature_size``."""
        if self.feature_size is None:
            return None
        return (len(self.feature_layers or ()) + 1) * self.feature_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        hd = self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else (self.head_vocab_size or v) * d
        if self.feature_size is not None:  # fc([embedding, feature]) instead of an embedding table
            fs = self.feature_size
            fuse = 0 if self.feature_layers is None else (len(self.feature_layers) + 1) * fs * fs
            return 2 * fs * d + fuse + self.num_layers * per_layer + d + head
        return v * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """Bytes of K and V for one token over all layers, in ``kv_dtype`` (default: the model's dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(kv_dtype or self.dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The K/V pools' dtype for a model of ``model_dtype`` under ``kv_cache_dtype`` (``auto``: the model's own);
    an unknown ``kv_cache_dtype`` is a :class:`ConfigError` naming the allowed ones."""
    _check(kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2}[dtype]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``num_pages`` counts page 0, which is reserved as the padding target and never handed to a sequence. When
    ``num_pages`` is None it is derived from ``kv_cache_bytes``. ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``):
    the pools' element type, ``auto`` each model's own; ``bfloat16`` under a float32 model (opt-in, lossy: K and V
    rounded to bfloat16 when written, q and the sums stay float32) holds twice the tokens in the same bytes and
    halves what attention reads per step.
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int = 256 * 2**20
    # vLLM's: the share of the accelerator's memory the engine may hold; the KV pool gets it less what the weights
    # (and anything else) already hold when the pool is sized, instead of kv_cache_bytes. On the CPU backend the pool
    # is sized by kv_cache_bytes (as vLLM's CPU backend sizes it by VLLM_CPU_KVCACHE_SPACE). None: kv_cache_bytes.
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    # Elastic memory (Nightjar's offload, nightjar_jax/memory): "auto" moves the draft's weights to host memory
    # when KV pages stay short for offload_persist_steps steps and turns the device bytes it held (weights and
    # pools) into an extension KV pool for the target; they come back when the load falls. "off": the draft stays.
    draft_offload: str = "off"
    offload_low_watermark: float = 0.05  # pressure: fewer free base pages than this fraction (or a blocked queue)
    reload_high_watermark: float = 0.25  # reload: no queue and free pages >= the extension + this fraction of base
    offload_persist_steps: int = 8  # steps a condition must hold before the move
    # Prefix caching (vLLM's --enable-prefix-caching, on by default there too): a request whose first tokens fill the
    # same pages as an earlier or running request's shares those pages' K/V instead of computing them
    # (nightjar_jax/cache, engine/scheduler.py). False: every request computes its whole prompt.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("page_size", self.page_size, 1, 1024)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", self.enable_prefix_caching,
               "true or false")
        if self.num_pages is not None:
            _check_int("num_pages", self.num_pages, 2)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        util = self.gpu_memory_utilization
        _check(util is None or (isinstance(util, int | float) and not isinstance(util, bool) and 0 < util <= 1),
               "gpu_memory_utilization", util, "None or a fraction in (0, 1]")
        resolve_kv_dtype(self.kv_cache_dtype, "float32")  # validates
        _check(self.draft_offload in DRAFT_OFFLOAD, "draft_offload", self.draft_offload, f"one of {DRAFT_OFFLOAD}")
        for name in ("offload_low_watermark", "reload_high_watermark"):
            value = getattr(self, name)
            _check(isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1, name, value,
                   "a fraction in [0, 1)")
        _check_int("offload_persist_steps", self.offload_persist_steps, 1)

    def kv_dtype(self, model_dtype: str) -> str:
        """The pools' dtype for a model of ``model_dtype``."""
        return resolve_kv_dtype(self.kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # prefill token budget per step (chunked prefill)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # "fcfs": admitted in arrival order, the last admitted preempted first; "priority": admitted by each request's
    # priority (lower first; ties in arrival order), the lowest-priority latest arrival preempted first (vLLM's)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
               f"one of {SCHEDULING_POLICIES}")
        _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which draft, how many tokens, and who picks γ each step."""

    # A model spec, None / "none" for no draft, "auto": the target preset's paired draft when it ships one, or
    # "ngram": no draft model, n-gram lookup's copies (prompt_lookup_*) as every step's drafts (vLLM's ngram method).
    draft_model: str | None = "auto"
    num_speculative_tokens: int = 4  # gamma_max: variants gamma in 0..this are compiled
    # A planner name (see nightjar_jax.planner): "nightjar" adapts γ to the load (γ = 0 when speculation does not
    # pay); "static" always uses num_speculative_tokens.
    planner: str = "nightjar"
    planner_log: str | None = None  # JSONL path for decisions and rewards (opt-in)
    # A JSON file that keeps the planner's learned state across runs (a warm start): read at start when it exists
    # (a state of this planner and γ_max, e.g. one an earlier run wrote), written at start, at close (llm.close(),
    # server shutdown), when the engine is collected or at exit, and every minute while decoding. None: each run
    # starts cold.
    planner_state: str | None = None
    # Decode steps at γ verify a static token tree of up to this many drafted nodes, depth γ (the draft's
    # top-ranked tokens per node; nightjar_jax/spec/tree.py) instead of a chain of γ, greedy or sampled (recursive
    # rejection sampling down the tree, lossless); 0: always a chain.
    spec_tree_nodes: int = 0
    # The smallest γ whose decode steps use the tree; smaller γ stay chains. With the default 1 every γ > 0 uses
    # it; with num_speculative_tokens, only γ_max does, so the planner chooses between AR, chains and the tree by
    # load (a wide verify pays at low load, where a target pass is memory-bound, and not at high load).
    spec_tree_min_gamma: int = 1
    # The tree's rank-path order: a JSON file with "order" (scripts/fit_spec_tree.py fit writes one for a draft);
    # None: nightjar_jax/spec/default_tree.json (fitted to smollm2-eagle).
    spec_tree_file: str | None = None
    # N-gram lookup drafts (nightjar_jax/spec/lookup.py): in chain decode steps, a request whose last n tokens (n
    # from prompt_lookup_max down to prompt_lookup_min) occurred before verifies the tokens that followed them
    # instead of the draft's (lossless: sampled rows take a copy as a draw from a point mass); token trees carry
    # them as a copy branch of γ extra nodes. 0: off.
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        _fspath_fields(self, "draft_model", "planner_log", "planner_state", "spec_tree_file")
        _check(self.draft_model is None or isinstance(self.draft_model, str), "draft_model", self.draft_model,
               "None or 'none' (no draft), 'auto', 'ngram' or a model spec (a preset, path or repo id; "
               "'<target>@<layers>' for a layer-skip draft)")
        _check(isinstance(self.planner, str) and bool(self.planner), "planner", self.planner,
               "a planner name, e.g. 'nightjar', 'static' or 'static:2'")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, 16)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 0, 64)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check(not self.prompt_lookup_max or self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               self.prompt_lookup_min, f"at most prompt_lookup_max={self.prompt_lookup_max} when lookup is on")
        _check(self.planner_log is None or (isinstance(self.planner_log, str | os.PathLike)
                                            and bool(os.fspath(self.planner_log))),
               "planner_log", self.planner_log, "None (no log) or a path to a JSONL file")
        _check(self.planner_state is None or (isinstance(self.planner_state, str) and bool(self.planner_state)),
               "planner_state", self.planner_state, "None (start cold) or a path to a JSON file")
        _check_int("spec_tree_nodes", self.spec_tree_nodes, 0, 128)
        _check_int("spec_tree_min_gamma", self.spec_tree_min_gamma, 1, 16)
        _check(not self.spec_tree_nodes or self.spec_tree_min_gamma <= max(self.num_speculative_tokens, 1),
               "spec_tree_min_gamma", self.spec_tree_min_gamma,
               f"at most num_speculative_tokens={self.num_speculative_tokens} when spec_tree_nodes > 0 (no γ would "
               "use the tree)")
        _check(self.spec_tree_file is None or (isinstance(self.spec_tree_file, str) and bool(self.spec_tree_file)),
               "spec_tree_file", self.spec_tree_file, "None or a path to a JSON file with an 'order' of rank paths")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; the CLI flags map 1:1 onto these fields (nested configs flatten)."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str | None = None  # None: the checkpoint's / preset's dtype
    attention_impl: str = "auto"
    linear_impl: str = "auto"  # linear layers: CPU kernels for few-row products (auto), or always XLA's dot (xla)
    # the CPU kernel's weights (nightjar_jax/linear.py pack_state): "compact" holds weights that are exactly GGUF
    # Q4_1 / Q8_0 or bfloat16 values in those layouts (the same results to the bit from 0.75 / 1.125 / 2 bytes per
    # weight), "auto" the same with float32 beside them for products of more than 8 rows, "f32" float32 only;
    # "w4a8" (opt-in, lossy): GGUF Q4_1 weights multiplied with int8-quantized activations (AVX512-VNNI)
    weight_format: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    compilation_cache_dir: str | None = None  # None: ~/.cache/nightjar_jax/jax_cache; "" disables
    # default sampling values for the fields a request leaves unset (nightjar_jax/engine/generation_config.py):
    # "auto" reads the model's generation_config.json (as vLLM does), "vllm" ignores it, or a folder / file path
    generation_config: str = "auto"
    # set on top of those: a dict, or JSON text, e.g. {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256}
    override_generation_config: str | dict | None = None
    # vLLM's: a thinking model's parser (deepseek_r1, qwen3): a structured output starts after the thought
    # (nightjar_jax/engine/reasoning.py); the server also splits chat answers' thoughts off as reasoning_content
    reasoning_parser: str | None = None
    # vLLM's: accepted, and nothing changes: no code is run from a checkpoint here (every architecture is this
    # package's own Llama), so there is no remote code to trust
    trust_remote_code: bool = False
    # vLLM's: the engine runs on one device; 1 is the only value
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _fspath_fields(self, "model", "tokenizer", "compilation_cache_dir")
        _check(isinstance(self.model, str) and bool(self.model), "model", self.model, "a preset, path or repo id")
        _check(self.tokenizer is None or (isinstance(self.tokenizer, str) and bool(self.tokenizer)), "tokenizer",
               self.tokenizer, "None (the model's own) or a tokenizer's path or preset")
        _check(self.compilation_cache_dir is None or isinstance(self.compilation_cache_dir, str),
               "compilation_cache_dir", self.compilation_cache_dir, "None (the default folder), a folder's path or "
               "'' (no persistent cache)")
        _check(isinstance(self.trust_remote_code, bool), "trust_remote_code", self.trust_remote_code,
               "true or false")
        _check(self.tensor_parallel_size == 1 and not isinstance(self.tensor_parallel_size, bool),
               "tensor_parallel_size", self.tensor_parallel_size, "1 (the engine runs on one device)")
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format, f"one of {LOAD_FORMATS}")
        _check(self.dtype is None or self.dtype in DTYPES, "dtype", self.dtype,
               f"None or one of {DTYPES} (make_engine_config also takes vLLM's {', '.join(VLLM_DTYPES)})")
        _check(
            self.attention_impl in ATTENTION_IMPLS, "attention_impl", self.attention_impl, f"one of {ATTENTION_IMPLS}"
        )
        _check(self.linear_impl in LINEAR_IMPLS, "linear_impl", self.linear_impl, f"one of {LINEAR_IMPLS}")
        _check(self.weight_format in WEIGHT_FORMATS, "weight_format", self.weight_format, f"one of {WEIGHT_FORMATS}")
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check(isinstance(self.generation_config, str) and bool(self.generation_config), "generation_config",
               self.generation_config, "auto, vllm, or a folder / generation_config.json path")
        _check(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
               self.reasoning_parser, f"None or one of {REASONING_PARSERS}")
        _check(self.override_generation_config is None or isinstance(self.override_generation_config, (str, dict)),
               "override_generation_config", self.override_generation_config, "None, a dict or a JSON object's text")


AttentionImpl = Literal["auto", "pallas", "reference"]


_NESTED = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}


def engine_config_fields() -> dict[str, str]:
    """Flat field name -> owning section ("" for EngineConfig itself); the CLI and ``LLM(**kwargs)`` use these."""
    out = {f.name: "" for f in dataclasses.fields(EngineConfig) if f.name not in _NESTED}
    for section, cls in _NESTED.items():
        out.update({f.name: section for f in dataclasses.fields(cls)})
    return out


# vLLM's other --dtype values: "auto" is the checkpoint's own (None here), "float" float32, and "half" / "float16"
# bfloat16 (float16 is no compute dtype here; vLLM's CPU backend casts it to bfloat16 the same way, with a warning)
VLLM_DTYPES = {"auto": None, "float": "float32", "half": "bfloat16", "float16": "bfloat16"}


def engine_dtype(dtype: str | None) -> str | None:
    """An engine ``dtype`` from vLLM's values too (:data:`VLLM_DTYPES`); others pass through to be checked."""
    if isinstance(dtype, str) and dtype in VLLM_DTYPES:
        if dtype in ("half", "float16"):
            logging.getLogger(__name__).warning("dtype=%s runs as bfloat16 (float16 is not a compute dtype here)",
                                                dtype)
        return VLLM_DTYPES[dtype]
    return dtype


def make_engine_config(**kwargs: Any) -> EngineConfig:
    """Build an :class:`EngineConfig` from flat keyword arguments (``max_num_seqs=8, page_size=16, ...``).

    ``None`` values are ignored so callers can pass unset CLI flags through. ``dtype`` also takes vLLM's ``auto``,
    ``float``, ``half`` and ``float16`` (:data:`VLLM_DTYPES`).
    """
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": engine_dtype(kwargs["dtype"])}
    fields = engine_config_fields()
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ConfigError(f"unknown engine option(s) {unknown}: allowed {sorted(fields)}")
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for key, value in kwargs.items():
        if value is None and key not in ("draft_model",):
            continue
        section = fields[key]
        (nested[section] if section else top)[key] = value
    for section, cls in _NESTED.items():
        top[section] = cls(**nested[section])
    return EngineConfig(**top)
