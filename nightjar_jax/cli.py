"""Command-line flags for the engine, generated 1:1 from the config dataclasses.

Every flat field of :func:`nightjar_jax.config.engine_config_fields` becomes one flag (``max_num_seqs`` ->
``--max-num-seqs``) whose type comes from the field's annotation. Every flag defaults to ``None`` ("not given"), so
the dataclass default stays the single source of truth; :func:`engine_config_from_args` drops unset flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any

from nightjar_jax.config import (
    ATTENTION_IMPLS,
    DRAFT_OFFLOAD,
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_IMPLS,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    VLLM_DTYPES,
    WEIGHT_FORMATS,
    ConfigError,
    EngineConfig,
    SpecConfig,
    engine_config_fields,
    make_engine_config,
)

# What bad flags raise while an engine starts: an invalid config value (ConfigError is a ValueError), an unknown
# preset or an unreadable checkpoint or path, a bad sampling value. `generate` and `serve` report them in one line (the
# traceback at debug level) and exit with code 2.
logger = logging.getLogger(__name__)

STARTUP_ERRORS = (ValueError, OSError)  # (OSError: a cache dir that is a file, a log path that is a folder, ...)


_CHOICES = {"dtype": (*DTYPES, *VLLM_DTYPES), "load_format": LOAD_FORMATS, "attention_impl": ATTENTION_IMPLS,
            "linear_impl": LINEAR_IMPLS, "weight_format": WEIGHT_FORMATS, "kv_cache_dtype": KV_CACHE_DTYPES,
            "draft_offload": DRAFT_OFFLOAD, "scheduling_policy": SCHEDULING_POLICIES}
_HELP = {
    "dtype": "weights' and activations' dtype: the checkpoint's own when left out (vLLM's auto); vLLM's float is "
             "float32, and half / float16 run as bfloat16 (no float16 compute here)",
    "max_model_len": "the longest sequence (prompt + output) in tokens; vLLM's forms too: 4096, 4k (4000), 4K (4096), "
                     "25.6k",
    "scheduling_policy": "fcfs: requests in arrival order; priority: by each request's 'priority' (lower first, "
                         "ties by arrival), the lowest priority preempted first",
    "model": "a preset name (e.g. stories260k), a local folder / GGUF file, or a Hugging Face repo id",
    "tokenizer": "tokenizer folder or file (None: the model's own)",
    "reasoning_parser": "a thinking model's <think> format (vLLM's): deepseek_r1 (the template opens the thought) or "
                        "qwen3 (the model opens it, or not); structured outputs start after the thought, and serve "
                        "returns chat answers' thoughts as reasoning_content",
    "draft_model": "draft model for speculative decoding (same spec forms as --model), auto (the target preset's "
                   "shipped draft), none, or ngram (no draft model: n-gram lookup's copies alone)",
    "num_speculative_tokens": "γ_max: the most draft tokens per step",
    "spec_tree_nodes": "decode steps verify a token tree of up to this many drafted nodes (depth γ; with n-gram "
                       "lookup on, plus a copy branch of γ nodes; needs a draft model); 0: a chain",
    "spec_tree_min_gamma": "the smallest γ whose steps use the token tree (smaller γ: chains); "
                           "num_speculative_tokens: only γ_max, so the planner picks AR, chain or tree by load",
    "spec_tree_file": "JSON with the tree's rank-path 'order' (scripts/fit_spec_tree.py fit); default: the shipped one",
    "prompt_lookup_max": "requests draft by n-gram lookup where their last n tokens (this many down to "
                         "--prompt-lookup-min) occurred before: the tokens that followed are verified (0: off)",
    "prompt_lookup_min": "the shortest suffix n-gram lookup matches (with --prompt-lookup-max > 0)",
    "planner": "who picks γ each step: a planner name (static, nightjar, banditspec, dsd, ...)",
    "planner_log": "a JSONL file to append every γ decision and its reward to (opt-in)",
    "planner_state": "a JSON file keeping what the planner learned across runs: read at start if it exists (a "
                     "state of this planner and γ_max), written at shutdown and every minute while decoding",
    "kv_cache_bytes": "KV cache memory budget in bytes (suffixes K, M, G, KiB, MiB, GiB allowed)",
    "gpu_memory_utilization": "vLLM's: the share of a GPU/TPU's memory the engine may hold; the KV pool gets it less "
                              "what the weights hold, instead of --kv-cache-bytes (the CPU backend keeps "
                              "--kv-cache-bytes, as vLLM's CPU backend)",
    "trust_remote_code": "vLLM's flag, accepted: no checkpoint code is ever run here (every model is this package's "
                         "Llama)",
    "tensor_parallel_size": "vLLM's flag: 1, the only value (the engine runs on one device)",
    "num_pages": "KV pages (overrides --kv-cache-bytes)",
    "kv_cache_dtype": "KV pools' dtype: auto (the model's), or bfloat16 under a float32 model (opt-in, lossy: K/V "
                      "rounded when written; twice the tokens per byte, half the bytes attention reads)",
    "draft_offload": "elastic memory: auto moves the draft's weights to host memory when KV pages stay short and "
                     "gives its device bytes to the KV cache (an extension pool) until the load falls; off keeps it",
    "offload_low_watermark": "memory pressure: fewer free KV pages than this fraction of the pool while the planner "
                             "chose γ = 0 (or, whatever it chose, a request waiting for pages or a preemption)",
    "reload_high_watermark": "the draft comes back when no request waits and free pages exceed the extension plus "
                             "this fraction of the pool",
    "offload_persist_steps": "steps in a row a condition must hold before the draft moves",
    "compilation_cache_dir": "JAX persistent compilation cache folder ('' disables)",
    "enable_prefix_caching": "prefix caching: a request whose first tokens fill the same KV pages as an earlier or "
                             "running request's shares those pages instead of computing them again",
    "generation_config": "default sampling values for fields a request leaves unset: auto (the model's "
                         "generation_config.json, as vLLM), vllm (ignore it), or a folder / file path",
    "override_generation_config": "JSON object set on top of the generation config, e.g. "
                                  "'{\"temperature\": 0.7, \"max_new_tokens\": 256}'",
    "weight_format": "CPU kernel weights: compact (GGUF Q4_1 / Q8_0 and bfloat16 values in those layouts, the same "
                     "results from a fifth to a half of the bytes), auto (compact plus float32 for products of more "
                     "than 8 rows), f32, w4a8 (opt-in, lossy: Q4_1 weights times int8-quantized activations, "
                     "AVX512-VNNI, or AVX2's vpmaddubsw)",
}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"256MiB"`` -> 268435456; plain integers pass through."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else "?"
    unit = unit if unit.endswith("ib") else unit.removesuffix("b")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 268435456, 256MiB, 1G)")
    return int(m.group(1)) * _UNITS[unit]


_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_token_count(text: str) -> int:
    """vLLM's human-readable token counts: ``"4096"``, ``"4k"`` (4000), ``"4K"`` (4096), ``"25.6k"`` (25600)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if m is None or (not m.group(2) and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: an integer, or one with k / m / g "
                                         "(powers of 1000) or K / M / G (of 1024), e.g. 4096, 4k, 4K")
    value = Decimal(m.group(1)) * _TOKEN_UNITS[m.group(2)]  # (exact: 25.6 * 1000 is 25600.000000000004 in floats)
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens ({value})")
    return int(value)


def _field_types() -> dict[str, Any]:
    """Flat field name -> its annotation (resolved), over EngineConfig and its nested sections."""
    hints = typing.get_type_hints(EngineConfig)
    out: dict[str, Any] = {}
    for name, section in engine_config_fields().items():
        if section:
            out[name] = typing.get_type_hints(hints[section])[name]
        else:
            out[name] = hints[name]
    return out


def _scalar(annotation: Any) -> type:
    """``int | None`` -> int; ``str`` -> str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if args[0] in (int, float, str, bool) else str


def _defaults() -> dict[str, Any]:
    cfg = EngineConfig()
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for section in ("cache", "scheduler", "spec"):
        sub = getattr(cfg, section)
        out.update({f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)})
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--flag`` per engine config field (all default to None = "use the config default")."""
    group = parser.add_argument_group("engine")
    defaults = _defaults()
    for name, annotation in _field_types().items():
        kind = _scalar(annotation)
        kwargs: dict[str, Any] = dict(dest=name, default=None, type=kind)
        if name == "kv_cache_bytes":
            kwargs["type"] = parse_bytes
        if name == "max_model_len":
            kwargs["type"] = parse_token_count
        if name in _CHOICES:
            kwargs["choices"] = _CHOICES[name]
        if kind is bool:  # --flag / --no-flag
            del kwargs["type"]
            kwargs["action"] = argparse.BooleanOptionalAction
        help_text = _HELP.get(name, name.replace("_", " "))
        kwargs["help"] = f"{help_text} (default: {defaults.get(name)!r})"
        group.add_argument("--" + name.replace("_", "-"), **kwargs)
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="vLLM's form of the speculation flags, e.g. '{\"method\": \"ngram\", "
                       "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or '{\"model\": <draft>, "
                       "\"num_speculative_tokens\": 4}'; keys: " + ", ".join(SPECULATIVE_CONFIG_KEYS))
    # vLLM's launch flags, so its command lines run here: one alias, and switches with nothing to switch
    vllm = parser.add_argument_group("vLLM's flags with no effect here, or another name here")
    vllm.add_argument("--block-size", type=int, default=None, dest="block_size",
                      help="vLLM's name of --page-size (the KV cache's tokens per page)")
    vllm.add_argument("--enforce-eager", action="store_true",
                      help="accepted; changes nothing (no CUDA graphs here: every step is one compiled XLA program)")
    vllm.add_argument("--disable-log-stats", action="store_true",
                      help="accepted; changes nothing (the engine logs no periodic stats: see /metrics)")
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                      help="prefill is always chunked here (by --max-num-batched-tokens), as in vLLM V1: "
                      "--no-enable-chunked-prefill is an error")
    return parser


# vLLM's --speculative-config keys read here (each onto the flag of the same meaning), and its methods
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_DRAFT_METHODS = ("draft_model", "eagle", "eagle3")


def speculative_config(text: str, where: str = "--speculative-config") -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as engine config fields: ``method`` "ngram" is ``draft_model="ngram"``;
    "draft_model", "eagle" and "eagle3" (or no method) take the draft from ``model``; ``num_speculative_tokens``
    and ``prompt_lookup_max`` / ``_min`` keep their names. Anything else is a ``ConfigError`` naming what is read
    (``where``: the flag, or the library's argument)."""
    def pairs(items: list) -> dict:
        keys = [k for k, _ in items]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ConfigError(f"{where} gives {repeated[0]!r} twice: give each key once")
        return dict(items)

    try:
        spec = json.loads(text, object_pairs_hook=pairs)
    except ConfigError:
        raise
    except ValueError as exc:  # (malformed JSON, or a number past Python's 4300-digit limit for reading one)
        raise ConfigError(f"{where} must be a JSON object of keys {', '.join(SPECULATIVE_CONFIG_KEYS)}: "
                          f"{str(exc).split(';')[0]}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{where} key {unknown[0]!r} is not supported: allowed "
                          f"{', '.join(SPECULATIVE_CONFIG_KEYS)}")
    method, model = spec.get("method"), spec.get("model")
    out = {k: spec[k] for k in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min") if k in spec}
    for key, value in out.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} {key} must be an integer, got {json.dumps(value)}")
    if model is not None and (not isinstance(model, str) or model.lower() in ("", "none", "ngram", "auto")):
        raise ConfigError(f"{where} model must name the draft model (a preset, a folder or a file), got "
                          f"{json.dumps(model)}; for n-gram speculation give method 'ngram' and no model")
    if method == "ngram":
        if model is not None:
            raise ConfigError(f"{where} method 'ngram' takes no 'model' (it drafts from the request's own "
                              "tokens)")
        out["draft_model"] = "ngram"
    elif method is None or method in _DRAFT_METHODS:
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where} method {method or 'draft_model'!r} needs 'model': the draft's "
                              "spec (a preset, a folder or a file)")
        out["draft_model"] = model
    else:
        raise ConfigError(f"{where} method {method!r} is not supported: allowed 'ngram', "
                          f"{', '.join(map(repr, _DRAFT_METHODS))}")
    return out


def check_cache_dir(path: str) -> None:
    """``--compilation-cache-dir``: a folder, or one that can be made (the engine makes it); a path that is a file,
    or lies under one, is a ``ConfigError`` naming the flag (it was ``[Errno 17] File exists: ...``)."""
    found = Path(path).expanduser().absolute()
    while not found.exists() and found != found.parent:  # the nearest part of the path that exists
        found = found.parent
    if not found.is_dir():
        raise ConfigError(f"--compilation-cache-dir {path}: {found} is a file: it needs a directory (made if "
                          f"missing), or '' to turn the compilation cache off")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the :class:`EngineConfig` from parsed flags; flags left unset keep the dataclass defaults.
    ``--speculative-config`` sets the speculation fields it names; the same field also given as its own flag with
    another value is a ``ConfigError``."""
    flat = {name: getattr(args, name, None) for name in engine_config_fields()}
    given = {k: v for k, v in flat.items() if v is not None}
    block_size = getattr(args, "block_size", None)
    if block_size is not None:
        if given.get("page_size", block_size) != block_size:
            raise ConfigError(f"--block-size {block_size} and --page-size {given['page_size']} are one option "
                              "(vLLM's name and this engine's): give one")
        given["page_size"] = block_size
    if getattr(args, "enable_chunked_prefill", None) is False:
        raise ConfigError("--no-enable-chunked-prefill: prefill is always chunked here (by --max-num-batched-tokens, "
                          "as in vLLM V1); leave the flag out")
    if given.get("compilation_cache_dir"):
        check_cache_dir(given["compilation_cache_dir"])
    text = getattr(args, "speculative_config", None)
    flags = {name: "--" + name.replace("_", "-") + " " for name in given}  # field -> how the command line gave it
    if block_size is not None:
        flags["page_size"] = "--block-size " if getattr(args, "page_size", None) is None else "--page-size "
    if text is not None:
        for name, value in speculative_config(text).items():
            if name in given and given[name] != value:
                raise ConfigError(f"--speculative-config sets {name}={value!r} but --{name.replace('_', '-')} "
                                  f"gives {given[name]!r}: give it once")
            given[name] = value
            flags.setdefault(name, f"--speculative-config {name}=")
    try:
        config = make_engine_config(**given)
    except ConfigError as exc:  # (it named the config field, "max_num_seqs=0 is invalid", not the flag given)
        message = str(exc)
        if exc.field in flags and message.startswith(f"{exc.field}="):
            raise ConfigError(flags[exc.field] + message.removeprefix(exc.field + "="), exc.field) from None
        raise
    # (the engine warns of a num_speculative_tokens other than the default without a draft; the default given as a
    # flag decoded plainly without a word)
    if given.get("num_speculative_tokens") == SpecConfig().num_speculative_tokens and not _has_drafts(config):
        logger.warning("%s%d has no effect: no draft model (--draft-model %s%s), so every step decodes plainly; give "
                       "--draft-model <model> or ngram", flags["num_speculative_tokens"],
                       given["num_speculative_tokens"], config.spec.draft_model,
                       ", and the model has no paired draft" if config.spec.draft_model == "auto" else "")
    return config


def _has_drafts(config: EngineConfig) -> bool:
    """Whether the engine will have drafts to verify: a draft model (``LLMEngine.resolve_draft_spec``: ``auto`` is
    the preset's pair) or n-gram lookup's alone (``ngram``)."""
    from nightjar_jax.engine.engine import LLMEngine

    return (config.spec.draft_model or "").lower() == "ngram" or LLMEngine.resolve_draft_spec(config) is not None
