"""Default sampling parameters from the model's own ``generation_config.json`` (vLLM's ``--generation-config``).

Model creators ship recommended sampling values beside the weights (Qwen: temperature 0.7, top_p 0.8, top_k 20;
Llama 3: temperature 0.6, top_p 0.9). As vLLM does by default (``generation_config="auto"``), the engine reads them
and uses them for every sampling field a request leaves unset: :meth:`LLM.get_default_sampling_params` (what
``LLM.generate`` uses when given no parameters) and the server's requests alike. A request's own values always win.

Read, as vLLM reads them: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``); a value equal to transformers' own default (temperature 1.0, top_p 1.0,
top_k 50, repetition_penalty 1.0) is not a recommendation and is skipped, and ``do_sample`` is not read (vLLM ignores
it too: a greedy request asks for temperature 0). ``override_generation_config`` (a dict, or JSON text from the
command line) sets any of them on top, ``max_new_tokens`` or ``max_tokens`` alike. ``generation_config="vllm"``
ignores the model's file (the engine's own defaults, :class:`SamplingParams`'s), and a folder or file path reads
that one instead.

The file's ``eos_token_id`` (one id or a list) ends generation too, whatever the mode, as vLLM adds it to every
request's stop ids: instruct models list their end-of-turn tokens there (Llama 3's ``<|eot_id|>``, Qwen2.5's
``<|im_end|>``) beside the config's end-of-sequence id. ``ignore_eos`` ignores them with the rest.

Only local files are read: a folder given as the model, a preset whose source is a shipped asset or an HF repo in
the local cache, an HF repo id in the local cache. GGUF and llama2.c checkpoints carry no such file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from nightjar_jax.config import ConfigError, EngineConfig
from nightjar_jax.engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file that restates them recommends nothing (vLLM reads only the diff)
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
GENERATION_CONFIG_MODES = ("auto", "vllm")


def _model_folder(model: str) -> Path | None:
    """The local folder a model spec's weights come from, without downloading anything (None: none, or a one-file
    checkpoint: GGUF, llama2.c)."""
    folder = _model_path(model)
    return folder if folder is not None and folder.is_dir() else None


def _model_path(model: str) -> Path | None:
    from nightjar_jax.models import hf
    from nightjar_jax.models.loader import _REPO_ID, ASSETS_DIR
    from nightjar_jax.models.presets import PRESETS

    path = Path(model).expanduser()
    if path.exists():
        return path
    source = PRESETS[model.lower()].source if model.lower() in PRESETS else model
    if source is None or source.startswith("gguf-wheel:"):
        return None
    if source.startswith("asset:"):
        return ASSETS_DIR / source.removeprefix("asset:")
    if _REPO_ID.match(source):
        try:
            return hf.snapshot_download_offline_aware(source, local_only=True)
        except ValueError:
            return None
    return None


def _read_json(path: Path) -> tuple[Path, dict[str, Any]]:
    """``path``'s ``generation_config.json`` (or ``path`` itself, a file) and its object; {} when there is none."""
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        return file, {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{file}: not readable as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: must hold a JSON object, got {type(raw).__name__}")
    return file, raw


def read_file(path: Path) -> dict[str, Any]:
    """The sampling defaults ``path`` (a ``generation_config.json``, or a folder holding one) recommends, as
    :class:`SamplingParams` fields; {} when there is no such file. A file that is not a JSON object, or a value
    :class:`SamplingParams` refuses, is a :class:`ConfigError` naming the file."""
    file, raw = _read_json(path)
    found = {field: raw[key] for key, field in KEYS.items()  # (true == 1.0 too, but it is no number: checked)
             if raw.get(key) is not None and not (key in _HF_DEFAULTS and not isinstance(raw[key], bool)
                                                  and raw[key] == _HF_DEFAULTS[key])}
    return _checked(found, str(file))


def _checked(values: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        SamplingParams(**values)
    except (InvalidRequestError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    return values


def parse_override(value: str | dict | None) -> dict[str, Any]:
    """``override_generation_config`` (a dict, or a JSON object's text) as SamplingParams fields."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"override_generation_config={value!r} is not JSON ({e}): give an object such as "
                              "'{\"temperature\": 0.7, \"top_p\": 0.9}'") from None
    allowed = sorted({*KEYS, "max_tokens"})
    if not isinstance(value, dict):
        raise ConfigError(f"override_generation_config must be a JSON object with keys among {allowed}, got "
                          f"{type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ConfigError(f"override_generation_config has unknown key(s) {unknown}: allowed {allowed}")
    if "max_tokens" in value and "max_new_tokens" in value:
        raise ConfigError("override_generation_config sets both max_tokens and max_new_tokens (the same value): "
                          "give one of them")
    return _checked({KEYS.get(k, k): v for k, v in value.items()}, "override_generation_config")


def read_eos_ids(path: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids ``path``'s ``generation_config.json`` lists (``eos_token_id``: one id or a list);
    () when there is no file or no such key. Another value, or an id outside the vocabulary, is a
    :class:`ConfigError` naming the file."""
    file, raw = _read_json(path)
    value = raw.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ConfigError(f"{file}: eos_token_id={value!r} is invalid: allowed a token id or a list of token ids "
                          f"in [0, {vocab_size - 1}]")
    return tuple(ids)


def generation_eos_ids(config: EngineConfig, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids of the generation config ``config`` reads (the model's file under "auto" and "vllm",
    as vLLM reads it in both; the named one otherwise), which end every request's generation."""
    mode = config.generation_config
    folder = _model_folder(config.model) if mode in GENERATION_CONFIG_MODES else Path(mode).expanduser()
    return () if folder is None else read_eos_ids(folder, vocab_size)


def generation_defaults(config: EngineConfig) -> dict[str, Any]:
    """The sampling fields a request leaves unset take these values (empty: :class:`SamplingParams`'s own)."""
    mode = config.generation_config
    if mode == "vllm":
        found: dict[str, Any] = {}
    else:
        folder = _model_folder(config.model) if mode == "auto" else Path(mode).expanduser()
        if mode != "auto" and not folder.exists():
            raise ConfigError(f"generation_config={mode!r}: no such file or folder (allowed: "
                              f"{', '.join(GENERATION_CONFIG_MODES)}, or a folder / {FILE_NAME} path)")
        found = {} if folder is None else read_file(folder)
    override = parse_override(config.override_generation_config)
    found.update(override)
    if found:
        source = {"auto": "the model's generation config", "vllm": "the engine"}.get(mode, mode)
        logger.info("default sampling parameters from %s%s (a request's own values win): %s", source,
                    " and override_generation_config" if override else "", found)
    return found
