"""llama2.c ``.bin`` checkpoints (legacy v0 export), e.g. Karpathy's tinyllamas ``stories260K.bin``.

Layout: a header of 7 int32 ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)``, then float32
arrays stacked over layers in PyTorch ``[out, in]`` order: tok_embeddings, attention_norm, wq, wk, wv, wo,
ffn_norm, w1, w2, w3, final norm, freq_cis_real, freq_cis_imag, and ``wcls`` only when ``vocab_size`` is negative
(a positive vocab_size means the classifier is shared with the embedding). wq/wk are in Meta's interleaved RoPE
layout (pairs 2i, 2i+1); we permute their rows per head to HF's rotate-half layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from nightjar_jax.config import ModelConfig

logger = logging.getLogger(__name__)

HEADER_INTS = 7


def interleaved_to_rotate_half(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Permute ``[num_heads * head_dim, in]`` rows from interleaved RoPE pairs to HF rotate-half halves.

    Per head, rows ``(0, 1, 2, 3, ...)`` = ``(x0, y0, x1, y1, ...)`` become ``(x0, x1, ..., y0, y1, ...)``.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def rotate_half_to_interleaved(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`interleaved_to_rotate_half` (what llama.cpp's converter applies)."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def load_llama2c(path: str | Path, *, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and HF-named float32 state dict of a llama2.c v0 ``.bin`` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"llama2.c checkpoint {path} does not exist")
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < HEADER_INTS * 4:
        raise ValueError(f"{path}: too small for a llama2.c header ({raw.size} bytes)")
    dim, hidden, num_layers, num_heads, num_kv_heads, vocab, seq_len = (
        int(x) for x in raw[: HEADER_INTS * 4].view(np.int32)
    )
    if min(dim, hidden, num_layers, num_heads, num_kv_heads, seq_len) <= 0 or vocab == 0 or dim % num_heads:
        if raw[:4].tobytes() == b"PK\x03\x04" or raw[0] == 0x80:  # (a zip or a pickle: torch.save's; only with an
            # implausible header: a llama2.c dim of 128, 384, ... starts with 0x80 too)
            raise ValueError(f"{path}: a PyTorch checkpoint (torch.save's zip or pickle), not a llama2.c export: "
                             f"PyTorch .bin weights are not read here (they run code as they load); save them as "
                             f"safetensors in an HF folder (config.json + *.safetensors) and give the folder")
        raise ValueError(
            f"{path}: implausible llama2.c header (dim={dim}, hidden_dim={hidden}, n_layers={num_layers}, "
            f"n_heads={num_heads}, n_kv_heads={num_kv_heads}, vocab_size={vocab}, seq_len={seq_len}); "
            "only the legacy v0 export is supported"
        )
    if num_kv_heads > num_heads or num_heads % num_kv_heads:
        raise ValueError(f"{path}: llama2.c header has n_kv_heads={num_kv_heads} for n_heads={num_heads}: allowed "
                         "a divisor of n_heads (each KV head serves n_heads / n_kv_heads query heads)")
    shared = vocab > 0
    vocab = abs(vocab)
    head_dim = dim // num_heads
    kv_dim = num_kv_heads * head_dim
    L = num_layers
    shapes = [
        ("tok_embeddings", (vocab, dim)),
        ("attention_norm", (L, dim)),
        ("wq", (L, dim, dim)),
        ("wk", (L, kv_dim, dim)),
        ("wv", (L, kv_dim, dim)),
        ("wo", (L, dim, dim)),
        ("ffn_norm", (L, dim)),
        ("w1", (L, hidden, dim)),
        ("w2", (L, dim, hidden)),
        ("w3", (L, hidden, dim)),
        ("norm", (dim,)),
        ("freq_cis_real", (seq_len, head_dim // 2)),
        ("freq_cis_imag", (seq_len, head_dim // 2)),
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    floats = raw[HEADER_INTS * 4 :]
    need = sum(int(np.prod(s)) for _, s in shapes) * 4
    if floats.size != need:
        raise ValueError(
            f"{path}: expected {need} bytes of float32 weights after the header for dim={dim}, n_layers={L}, "
            f"vocab={vocab} ({'shared' if shared else 'separate'} classifier), found {floats.size}"
        )
    data = floats.view(np.float32)
    w: dict[str, np.ndarray] = {}
    offset = 0
    for key, shape in shapes:
        n = int(np.prod(shape))
        w[key] = data[offset : offset + n].reshape(shape)
        offset += n

    state: dict[str, np.ndarray] = {"model.embed_tokens.weight": w["tok_embeddings"], "model.norm.weight": w["norm"]}
    for i in range(L):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = w["attention_norm"][i]
        state[p + "post_attention_layernorm.weight"] = w["ffn_norm"][i]
        state[p + "self_attn.q_proj.weight"] = interleaved_to_rotate_half(w["wq"][i], num_heads)
        state[p + "self_attn.k_proj.weight"] = interleaved_to_rotate_half(w["wk"][i], num_kv_heads)
        state[p + "self_attn.v_proj.weight"] = w["wv"][i]
        state[p + "self_attn.o_proj.weight"] = w["wo"][i]
        state[p + "mlp.gate_proj.weight"] = w["w1"][i]
        state[p + "mlp.down_proj.weight"] = w["w2"][i]
        state[p + "mlp.up_proj.weight"] = w["w3"][i]
    if not shared:
        state["lm_head.weight"] = w["wcls"]
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=L,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shared,
        max_position_embeddings=seq_len,
        bos_token_id=1,
        eos_token_ids=(2, 1),  # (llama2.c's run.c ends a story at BOS, which its models write between stories)
        name=name or path.stem,
    )
    logger.info("read llama2.c checkpoint %s (%d layers, dim %d, vocab %d)", path, L, dim, vocab)
    return cfg, state
