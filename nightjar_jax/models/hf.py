"""Hugging Face checkpoints: ``config.json`` -> :class:`ModelConfig`, ``*.safetensors`` -> HF-named numpy arrays.

A local HF folder holds ``config.json``, either ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and tokenizer files. Safetensors are read by a small header parser over a
memory map (so bf16 works without torch, and nothing is copied until the model is built). Every shard is opened
and every tensor's dtype/shape checked before any array is handed out, so a bad folder fails with one error.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from nightjar_jax.config import DTYPES, ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

# (LLaMAForCausalLM: the name early conversions wrote, which vLLM's registry maps to Llama too)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "LLaMAForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]

_SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_HF_DTYPES = {"float32": "float32", "float64": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json", name: str | None = None) -> ModelConfig:
    """Map an HF Llama ``config.json`` dict onto :class:`ModelConfig`; unsupported features, and a config that is not
    a JSON object, lacks a required field or holds a value of the wrong type, raise ``ValueError`` naming it."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: must be a JSON object (an HF config), got {type(hf).__name__}")
    try:
        return _config_from_hf(hf, source, name)
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{source}: a field holds a value of the wrong type ({e})") from None
    except ValueError as e:  # (ModelConfig's range checks, float("abc"), ...: named after the file)
        if str(e).startswith(source):
            raise
        raise type(e)(f"{source}: {e}") from None


def _whole(key: str, value: Any) -> int:
    """An integer field (``1024``, or ``1024.0`` as some writers store it); 512.7, "512" or true is a ValueError
    (``int()`` truncated 512.7 to 512 without a word)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} must be an integer")
    return value


def _real(key: str, value: Any) -> float:
    """A number field; a string or a bool is a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}={value!r} must be a number")
    return float(value)


def _config_from_hf(hf: dict[str, Any], source: str, name: str | None) -> ModelConfig:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: architectures={archs!r} is invalid: allowed a list of class names, e.g. "
                         f"{list(SUPPORTED_ARCHITECTURES[:1])}")
    # architectures names the class transformers builds, so it decides when given (a Qwen2ForCausalLM with
    # model_type "llama" loaded, and ran Llama's graph over Qwen2's weights); model_type only when it is absent
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported or (not archs and model_type not in ("llama", "mistral")):
        raise ValueError(
            f"{source}: unsupported architecture {unsupported or model_type!r} (model_type={model_type!r}); "
            f"only Llama-family models ({', '.join(SUPPORTED_ARCHITECTURES)}) are supported"
        )
    if (model_type == "mistral" or "MistralForCausalLM" in archs) and hf.get("sliding_window") is not None:
        # (by architectures too: a MistralForCausalLM with model_type "llama" or none ran full attention)
        raise ValueError(f"{source}: sliding_window={hf['sliding_window']} is unsupported (full attention only)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{source}: {flag}=true is unsupported (Llama projections without bias only)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is unsupported (SwiGLU with silu only)")

    # transformers >= 5 writes rope_parameters (with rope_theta inside); older versions rope_scaling + rope_theta
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):  # (dict("abc") was "dictionary update sequence element #0 ...")
        raise ValueError(f"{rope_key}={rope!r} is invalid: allowed null or an object with rope_type 'default' or "
                         f"'llama3' and its factors")
    rope = dict(rope)
    rope_theta = _real("rope_theta", rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        if "factor" in rope and "rope_type" not in rope and "type" not in rope:
            # (a factor with no type was dropped: the model ran unscaled; transformers cannot build it)
            raise ValueError(f"{source}: {rope_key} has a factor but no rope_type: allowed rope_type 'llama3' with "
                             f"its factors, or no factor (default RoPE)")
        rope_scaling = None
    elif rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise ValueError(f"{rope_key} of rope_type 'llama3' is missing {missing}: allowed an object with "
                             f"{list(keys)}")
        rope_scaling = RopeScaling(
            factor=_real(f"{rope_key}.factor", rope["factor"]),
            low_freq_factor=_real(f"{rope_key}.low_freq_factor", rope["low_freq_factor"]),
            high_freq_factor=_real(f"{rope_key}.high_freq_factor", rope["high_freq_factor"]),
            original_max_position_embeddings=_whole(f"{rope_key}.original_max_position_embeddings",
                                                    rope["original_max_position_embeddings"]),
        )
    else:
        raise ValueError(f"{source}: rope_scaling type {rope_type!r} is unsupported (allowed: default, llama3)")

    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (_whole("eos_token_id", eos),)
    torch_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = _HF_DTYPES.get(str(torch_dtype).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"{source}: dtype {torch_dtype!r} is unsupported (allowed: {sorted(_HF_DTYPES)})")
    num_heads = _whole("num_attention_heads", hf["num_attention_heads"])
    # only null / absent means "as many as num_attention_heads", as in transformers (`or` read 0 as that too; the
    # load then failed on k_proj's shape)
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else _whole("num_key_value_heads", kv_heads)
    if kv_heads < 1 or (num_heads > 0 and num_heads % kv_heads):
        raise ValueError(f"num_key_value_heads={kv_heads} is invalid: allowed a positive divisor of "
                         f"num_attention_heads={num_heads} (or null: num_attention_heads)")
    vocab_size = _whole("vocab_size", hf["vocab_size"])
    bos = hf.get("bos_token_id")
    if bos is not None and not 0 <= _whole("bos_token_id", bos) < vocab_size:
        # (eos ids were range-checked by ModelConfig; a bos outside the vocabulary loaded, then every text prompt
        # failed with an out-of-range token id)
        raise ValueError(f"bos_token_id={bos!r} is invalid: allowed null or an id in [0, {vocab_size}) (vocab_size "
                         f"is {vocab_size})")
    tied = hf.get("tie_word_embeddings") or False  # (null: untied, as transformers reads it)
    if not isinstance(tied, bool):  # (bool("false") is True)
        raise ValueError(f"tie_word_embeddings={tied!r} must be true or false")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=_whole("hidden_size", hf["hidden_size"]),
        intermediate_size=_whole("intermediate_size", hf["intermediate_size"]),
        num_layers=_whole("num_hidden_layers", hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=hf.get("head_dim"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=_real("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=tied,
        max_position_embeddings=_whole("max_position_embeddings", hf.get("max_position_embeddings", 2048)),
        bos_token_id=None if bos is None else _whole("bos_token_id", bos),
        eos_token_ids=eos_ids,
        dtype=dtype,
        name=name or hf.get("_name_or_path") or model_type or "llama",
    )


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no config.json (not an HF model folder)")
    return config_from_hf(_read_json(path), source=str(path), name=folder.name)


def _read_json(path: Path) -> Any:
    """A JSON file's value; one that does not parse is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


# ---- safetensors ------------------------------------------------------------------------------------------------


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (truncated header)")
        n = int.from_bytes(raw_len, "little")
        if n <= 0 or n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}, not an "
                         f"object)")
    header.pop("__metadata__", None)
    for name, info in header.items():  # (a KeyError or numpy's offset error named no file)
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
        offsets = info.get("data_offsets") if ok else None
        ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]
        if not ok:
            raise ValueError(f"{path}: tensor {name}'s header entry is corrupt (want {{'dtype': str, 'shape': "
                             f"[non-negative ints], 'data_offsets': [begin, end], 0 <= begin <= end}}, got "
                             f"{str(info)[:120]})")
    # the tensors' byte ranges tile the data from 0, as the safetensors library requires (two entries over the same
    # bytes loaded as two tensors sharing them: a model silently wrong)
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
    at = 0
    for begin, end, name in spans:
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves the bytes {at}..{begin} unused"
            raise ValueError(f"{path}: tensor {name}'s data_offsets [{begin}, {end}] {what}: a safetensors file's "
                             "tensors cover its data end to end, each once (corrupt or hand-edited header)")
        at = end
    return header, 8 + n


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read-only numpy views of every tensor in one safetensors file (memory-mapped, any dtype incl. bf16)."""
    path = Path(path)
    header, data_start = _safetensors_header(path)
    size = os.path.getsize(path)
    buf = None
    if size > data_start:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dt = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * dt.itemsize or data_start + end > size:
            raise ValueError(f"{path}: tensor {name} is truncated or corrupt (shape {shape}, {info['dtype']})")
        if count == 0:
            out[name] = np.zeros(shape, dt)
            continue
        out[name] = np.frombuffer(buf, dtype=dt, count=count, offset=data_start + begin).reshape(shape)
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (incl. ml_dtypes bfloat16) as safetensors, atomically (tmp file + rename)."""
    inverse = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        arr = np.ascontiguousarray(arr).reshape(arr.shape)  # (ascontiguousarray makes a 0-d array 1-d)
        span = [offset, offset + arr.nbytes]
        header[name] = {"dtype": inverse[arr.dtype], "shape": list(arr.shape), "data_offsets": span}
        arrays[name] = arr
        offset += arr.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(f"{path}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays.values():
            f.write(arr.reshape(-1).view(np.uint8).data)  # (bytes: a bfloat16 array exports no buffer of its own)
    os.replace(tmp, path)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (all shards of the index, each checked to exist)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: not a safetensors index (want {{'weight_map': {{tensor name: shard file "
                             f"name}}}})")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise FileNotFoundError(f"{index}: shard file(s) {missing} are missing from {folder}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir())[:12]
        hint = " (PyTorch .bin weights are not supported; convert to safetensors)" if any(
            n.endswith(".bin") for n in found) else ""
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files found (folder has {found}){hint}")
    return files


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and HF-named state dict (memory-mapped numpy views) of a local HF folder."""
    folder = Path(folder)
    cfg = read_config(folder)
    state: dict[str, np.ndarray] = {}
    for path in weight_files(folder):
        for name, arr in read_safetensors(path).items():
            if name in state:
                raise ValueError(f"{path}: tensor {name} appears in more than one shard")
            state[name] = arr
    logger.info("read %d tensors from %s", len(state), folder)
    return cfg, state


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model"))


def snapshot_download_offline_aware(repo_id: str, *, timeout_s: float = 10.0, local_only: bool = False) -> Path:
    """Resolve an HF repo id to a local snapshot folder (config, safetensors, tokenizer files only).

    Fails fast with an actionable message when there is no network and the repo is not in the local HF cache.
    """
    message = (
        f"cannot download {repo_id}: no network / not in local HF cache; "
        "pass a local folder, run once with network (the model is then read from the HF cache) or use "
        "--load-format dummy"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ValueError(message) from e
    try:
        # local cache first: works offline and costs no request
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure here just means "not cached"
        pass
    if local_only or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ValueError(message)
    try:
        logger.info("downloading %s from the HF hub", repo_id)
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=timeout_s))
    except Exception as e:  # noqa: BLE001 - connection errors come in many types
        # (huggingface_hub's messages run over several lines: the first says what failed, e.g. a ConnectError)
        raise ValueError(f"{message} ({type(e).__name__}: {first_line(e, 120)})") from None


def first_line(error: object, limit: int = 80) -> str:
    """The first non-blank line of an error's message, cut to ``limit`` characters (ending "..." when cut): the
    loaders' one-line errors quote a library's cause with it (huggingface_hub's, orbax's and numpy's run over
    lines)."""
    line = next((part.strip() for part in str(error).splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def cast_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is invalid: allowed {DTYPES}")
    return name
