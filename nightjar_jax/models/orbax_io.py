"""Our own checkpoint format: an orbax PyTree of HF-named arrays plus the config as JSON.

Layout of a checkpoint directory::

    <dir>/nightjar_config.json   # {"format": "nightjar-orbax", "version": 1, "config": ModelConfig.to_dict()}
    <dir>/params/                # orbax PyTreeCheckpointer: {hf_name: array [out, in]} (HF names and layout)
    <dir>/tokenizer/             # optional: copied tokenizer files

Storing HF names/layout keeps one validation path (``state_from_hf``) for every format.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from nightjar_jax.config import ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

CONFIG_FILE = "nightjar_config.json"
FORMAT_NAME = "nightjar-orbax"
FORMAT_VERSION = 1


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def state_to_hf(cfg: ModelConfig, state: Any) -> dict[str, np.ndarray]:
    """HF-named ``[out, in]`` numpy arrays from an NNX ``State`` of :class:`Llama` (inverse of ``state_from_hf``)."""
    from flax import nnx

    from nightjar_jax.models.llama import hf_param_map

    flat = dict(nnx.to_flat_state(state))
    out = {}
    for hf_name, (path, transpose) in hf_param_map(cfg).items():
        leaf = flat[path]
        arr = np.asarray(leaf.get_value() if hasattr(leaf, "get_value") else leaf)
        out[hf_name] = arr.T if transpose else arr
    return out


def save_orbax(
    path: str | Path,
    config: ModelConfig,
    weights: Any,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a checkpoint. ``weights``: an HF-named dict of arrays, an ``nnx.State`` or a ``(graphdef, state)``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if isinstance(weights, tuple) and len(weights) == 2:
        weights = weights[1]
    if isinstance(weights, dict) and all(isinstance(k, str) for k in weights):
        state_dict = {k: np.asarray(v) for k, v in weights.items()}
    else:
        state_dict = state_to_hf(config, weights)
    path.mkdir(parents=True, exist_ok=True)
    params = path / "params"
    if params.exists():
        shutil.rmtree(params)
    ocp.PyTreeCheckpointer().save(params, state_dict)
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        dst = path / "tokenizer"
        dst.mkdir(exist_ok=True)
        files = [src] if src.is_file() else [p for p in src.iterdir() if p.name.startswith(("tokenizer", "special"))]
        for f in files:
            shutil.copy2(f, dst / f.name)
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "config": config.to_dict()}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("saved %d tensors to %s", len(state_dict), path)
    return path


def load_orbax(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Path | None]:
    """Config, HF-named numpy state dict and the tokenizer folder (None if none was saved)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta_path = path / CONFIG_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a checkpoint written by save_orbax)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: unknown format {meta.get('format')!r} version {meta.get('version')!r}")
    fields = dict(meta["config"])
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
    cfg = ModelConfig(**fields)
    if not (path / "params").exists():
        raise FileNotFoundError(f"{path}: params/ is missing")
    restored = ocp.PyTreeCheckpointer().restore(path / "params")
    state_dict = {k: np.asarray(v) for k, v in restored.items()}
    tok = path / "tokenizer"
    return cfg, state_dict, tok if tok.exists() and any(tok.iterdir()) else None
