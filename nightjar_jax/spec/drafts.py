"""Drafts derived from a checkpoint's own weights, for models with no smaller sibling sharing their tokenizer.

A draft spec ``"<model>@skip=2,3"`` loads ``<model>`` and drops the listed decoder layers (layer skip, as in
self-speculative decoding); ``"<model>@layers=4"`` keeps only the first 4 layers (early exit). Both keep the
embedding, final norm and head, so the vocabulary matches the target exactly. Correctness of speculative decoding
never depends on the draft: only acceptance (and so speed) does.
"""

from __future__ import annotations

import re

import numpy as np

from nightjar_jax.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def parse_draft_spec(spec: str) -> tuple[str, list[int] | None, int | None]:
    """``"m@skip=1,2"`` -> ``("m", [1, 2], None)``; ``"m@layers=4"`` -> ``("m", None, 4)``; plain -> no change. A
    path that exists is a model as it stands, ``@`` and all (``/data/run@3/model.gguf``); a spec must name a model
    and at least one layer, in plain decimal digits."""
    import os

    if "@" not in spec or os.path.exists(spec):
        return spec, None, None
    model, _, option = spec.rpartition("@")
    key, _, value = option.partition("=")
    items = value.split(",")
    if model and all(_DIGITS.fullmatch(v) for v in items):
        if key == "skip":
            return model, [int(v) for v in items], None
        if key == "layers" and len(items) == 1:
            return model, None, int(value)
    raise ValueError(f"{spec!r} is no path that exists, and as a derived draft's spec it is invalid: use "
                     "'<model>@skip=i,j,...' (the layers to drop) or '<model>@layers=N' (the first N kept), layers as "
                     "decimal digits")


_DIGITS = re.compile(r"[0-9]+")


def derive_state_dict(
    cfg: ModelConfig, state_dict: dict[str, np.ndarray], *, skip: list[int] | None = None, keep_first: int | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Drop decoder layers from an HF-named state dict, renumbering the rest."""
    if keep_first is not None:
        if not 1 <= keep_first <= cfg.num_layers:
            raise ValueError(f"layers={keep_first} is invalid: allowed 1..{cfg.num_layers}")
        kept = list(range(keep_first))
    else:
        bad = [i for i in skip or [] if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"skip={bad} names layers outside 0..{cfg.num_layers - 1}")
        kept = [i for i in range(cfg.num_layers) if i not in set(skip or [])]
        if not kept:
            raise ValueError("skip removes every layer: at least one must remain")
    new_index = {old: new for new, old in enumerate(kept)}
    out: dict[str, np.ndarray] = {}
    for name, arr in state_dict.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = arr
        elif int(m.group(1)) in new_index:
            out[f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"] = arr
    suffix = f"-skip{','.join(map(str, skip))}" if keep_first is None else f"-first{keep_first}"
    return cfg.replace(num_layers=len(kept), name=cfg.name + suffix), out
