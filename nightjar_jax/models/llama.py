"""The Llama family as Flax NNX modules, reading and writing a paged KV cache.

Vocabulary
- batch: ``num_seqs`` sequences, each with ``q_len`` slots for new (query) tokens in a padded ``[num_seqs, q_len]``
  array. Ragged chunks are right-aligned: a sequence with ``query_len < q_len`` new tokens is left-padded. Slot
  ``i`` sits at position ``context_len - q_len + i``; slots ``i < q_len - query_len`` are padding: their K/V go to
  page 0 (the reserved padding page) and their outputs are ignored. A padding row has ``query_len = 0``.
- KV cache: one ``(k_pages, v_pages)`` pair per layer, each ``[num_kv_heads, num_pages, page_size, head_dim]``, or
  (:class:`StackedKV`, where the engine stacks the weights over the layers) two arrays ``[num_layers, ...]``. The
  forward pass writes the new tokens' K/V into the pages named by the block tables, then attends.
- prefill: ``q_len`` = a chunk of the prompt; decode: ``q_len = 1``; verify (speculative decoding): ``q_len = γ + 1``.

The model is called under ``jax.jit`` over a split ``(graphdef, state)`` (see :func:`make_forward`), never
``nnx.jit`` in the hot loop. RoPE uses HF's rotate-half layout; Llama 3 frequency scaling is supported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nightjar_jax.attention import check_impl as check_attention_impl
from nightjar_jax.attention import paged_attention
from nightjar_jax.config import ModelConfig, RopeScaling
from nightjar_jax.linear import (
    attn_out_mlp,
    compute_dtype,
    embed,
    linear,
    linear_residual,
    rms_linear_many,
    rms_norm,
    rms_swiglu,
)
from nightjar_jax.linear import check_impl as check_linear_impl


class StackedKV(NamedTuple):
    """Every layer's K and V pools as two arrays ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]``:
    the engine's cache where the model's weights are stacked over the layers (``ModelHandle.stack_layers``), so a
    step dispatches 2 donated pools instead of 2 per layer. The forward pass writes and attends one layer of them at
    a time in place (the CPU attention kernel reads the layer's pools in place; other implementations take the
    slice)."""

    k: jax.Array
    v: jax.Array
    # an extension pool (elastic memory, ``nightjar_jax.memory``): page ids from ``k.shape[2]`` on address these
    k_ext: jax.Array | None = None  # [num_layers, num_kv_heads, extension_pages, page_size, head_dim]
    v_ext: jax.Array | None = None


# per layer: (k_pages, v_pages), or (k_pages, v_pages, k_ext, v_ext) with an extension pool; or StackedKV
KVCache = tuple[tuple[jax.Array, ...], ...] | StackedKV


class LayerKV(NamedTuple):
    """Layer ``layer`` of a :class:`StackedKV`, as a decoder layer reads and updates it (inside a traced step)."""

    k: jax.Array  # [L, KVH, pages, page, dim]
    v: jax.Array
    layer: int
    k_ext: jax.Array | None = None  # [L, KVH, extension pages, page, dim] (StackedKV.k_ext)
    v_ext: jax.Array | None = None


def split_take(take, pool: jax.Array, ext: jax.Array | None, ids: jax.Array, lead: int) -> jax.Array:
    """``take(pool, ids)`` where ``ids`` are page ids of a base pool (``< base``, its page count) and of an extension
    pool after it (``ext``; None: no extension). ``take(p, i)`` indexes the page axis of ``p`` with ``i``; the
    result holds ``ids``' dimensions after ``lead`` others (to place the choice of pool)."""
    if ext is None:
        return take(pool, ids)
    base = pool.shape[-3]
    in_base = ids < base
    a = take(pool, jnp.where(in_base, ids, 0))
    b = take(ext, jnp.where(in_base, 0, ids - base))
    return jnp.where(in_base.reshape((1,) * lead + in_base.shape + (1,) * (a.ndim - lead - in_base.ndim)), a, b)


def split_page_ids(page_ids: jax.Array, base: int, extension: int) -> tuple[jax.Array, jax.Array]:
    """Page ids as ids into the base pool and into the extension; an id of the other pool maps one past that pool's
    last page, where a ``mode="drop"`` scatter drops it."""
    in_base = page_ids < base
    return jnp.where(in_base, page_ids, base), jnp.where(in_base, extension, page_ids - base)


def kv_extension_pages(kv_cache: KVCache) -> int:
    """Pages of the extension pool attached to ``kv_cache`` (0: none)."""
    ext = kv_cache.k_ext if isinstance(kv_cache, StackedKV) else (kv_cache[0][2] if len(kv_cache[0]) == 4 else None)
    return 0 if ext is None else ext.shape[-3]


def attach_kv_extension(kv_cache: KVCache, num_pages: int) -> KVCache:
    """``kv_cache`` with zeroed extension pools of ``num_pages`` pages (page ids ``base ..`` address them)."""
    if kv_extension_pages(kv_cache):
        raise RuntimeError("the K/V cache already has an extension pool")

    def zeros(pool):
        shape = list(pool.shape)
        shape[-3] = num_pages
        return jnp.zeros(shape, pool.dtype)

    if isinstance(kv_cache, StackedKV):
        return StackedKV(kv_cache.k, kv_cache.v, zeros(kv_cache.k), zeros(kv_cache.v))
    return tuple((k, v, zeros(k), zeros(v)) for k, v in kv_cache)


def detach_kv_extension(kv_cache: KVCache) -> tuple[KVCache, list[jax.Array]]:
    """The base pools alone, and the extension's arrays (for the caller to delete)."""
    if isinstance(kv_cache, StackedKV):
        return StackedKV(kv_cache.k, kv_cache.v), [a for a in (kv_cache.k_ext, kv_cache.v_ext) if a is not None]
    return tuple(layer[:2] for layer in kv_cache), [a for layer in kv_cache for a in layer[2:]]


def kv_page_size(kv_cache: KVCache) -> int:
    """Tokens per page of a K/V cache (either layout)."""
    return kv_cache.k.shape[3] if isinstance(kv_cache, StackedKV) else kv_cache[0][0].shape[2]


class BatchMetadata(NamedTuple):
    """Where a batch's tokens live in the paged cache (a pytree; all arrays on device)."""

    block_tables: jax.Array  # [num_seqs, max_pages_per_seq] int32, padding entries 0
    context_lens: jax.Array  # [num_seqs] int32, tokens in cache after this step's writes (0 = padding row)
    # [num_seqs] int32, real new tokens (right-aligned in the q_len slots; 0 = padding row). None: every slot at a
    # non-negative position is real.
    query_lens: jax.Array | None = None
    # A speculative token tree (nightjar_jax/spec/tree.py): [q_len, M] bool, which of the last M key positions each
    # slot sees (its ancestors and itself); None: causal.
    tree_mask: jax.Array | None = None
    # [q_len] int32 subtracted from each slot's position for RoPE (a tree node at KV slot n - 1 + i is rotated as
    # position n - 1 + depth(i)); None: RoPE at the slot's position.
    rope_offsets: jax.Array | None = None


def _jnp_dtype(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` float32, with Llama 3 scaling when given (as HF computes it)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x ``[num_seqs, q_len, num_heads, head_dim]``, positions ``[num_seqs, q_len]`` int32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [num_seqs, q_len, head_dim // 2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype=dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def _linear(d_in: int, d_out: int, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """GQA self-attention over the paged cache, with its pre-norm and residual add: ``x + attn(norm(x))``.

    The norm rides in the q/k/v call and the residual add in o_proj's (:func:`rms_linear_many`,
    :func:`linear_residual`): one custom call each on the CPU kernel, the plain composition elsewhere."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention_impl: str, linear_impl: str):
        dtype = _jnp_dtype(cfg.dtype)
        self.linear_impl = linear_impl
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, dtype, rngs)
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, dtype, rngs)
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, dtype, rngs)
        self.attention_impl = attention_impl

    def __call__(
        self,
        x: jax.Array,  # [num_seqs, q_len, hidden]: the residual stream
        norm: RMSNorm,  # the pre-attention norm
        positions: jax.Array,  # [num_seqs, q_len] int32
        inv_freq: jax.Array,  # [head_dim // 2] float32
        kv: tuple[jax.Array, jax.Array],  # each [num_kv_heads, num_pages, page_size, head_dim]
        md: BatchMetadata,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:  # x + attention, updated (k, v) pages
        out, kv = self.attend(x, norm, positions, inv_freq, kv, md)
        return linear_residual(out, self.o_proj.kernel[...], x, impl=self.linear_impl), kv

    def qkv_weights(self) -> list[jax.Array]:
        return [p.kernel[...] for p in (self.q_proj, self.k_proj, self.v_proj)]

    def qkv(self, x: jax.Array, norm: RMSNorm) -> list[jax.Array]:
        """``[q, k, v]`` of ``norm(x)`` (one custom call on the CPU kernel)."""
        return rms_linear_many(x, norm.weight[...], self.qkv_weights(), norm.eps, impl=self.linear_impl)

    def attend(self, x, norm, positions, inv_freq, kv, md, qkv=None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``__call__`` before o_proj: the attention output ``[num_seqs, q_len, heads * head_dim]`` (what o_proj
        projects) and the updated (k, v) pages. ``qkv``: ``rms_linear_many(x, norm, q/k/v)`` when the caller
        already has it (the previous layer's fused call computed it)."""
        num_seqs, q_len, _ = x.shape
        q, k, v = self.qkv(x, norm) if qkv is None else qkv
        q = q.reshape(num_seqs, q_len, self.num_heads, self.head_dim)
        k = k.reshape(num_seqs, q_len, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_seqs, q_len, self.num_kv_heads, self.head_dim)
        rope_pos = jnp.maximum(positions if md.rope_offsets is None else positions - md.rope_offsets[None, :], 0)
        q = apply_rope(q, rope_pos, inv_freq)
        k = apply_rope(k, rope_pos, inv_freq)

        if isinstance(kv, LayerKV):  # a layer of stacked pools
            layer, k_pages, v_pages, k_ext, v_ext = kv.layer, kv.k, kv.v, kv.k_ext, kv.v_ext
        else:  # one layer's pools: (k, v) or, with an extension pool, (k, v, k_ext, v_ext)
            layer, (k_pages, v_pages), (k_ext, v_ext) = None, kv[:2], (kv[2:] or (None, None))
        page_size = k_pages.shape[-2]
        page_ids, slots, _ = page_slots(md, q_len, page_size)  # padding writes land on the reserved page 0
        # [num_kv_heads, num_seqs, q_len, head_dim] scattered into [num_kv_heads, num_pages, page_size, head_dim]
        k_pages, k_ext = write_split_kv_pages(k_pages, k_ext, page_ids, slots, k.transpose(2, 0, 1, 3), layer=layer)
        v_pages, v_ext = write_split_kv_pages(v_pages, v_ext, page_ids, slots, v.transpose(2, 0, 1, 3), layer=layer)

        out = paged_attention(
            q,
            k_pages,
            v_pages,
            md.block_tables,
            md.context_lens,
            scale=1.0 / math.sqrt(self.head_dim),
            impl=self.attention_impl,
            tree_mask=md.tree_mask,
            layer=layer,
            k_ext=k_ext,
            v_ext=v_ext,
        )
        if layer is not None:
            new_kv = LayerKV(k_pages, v_pages, layer, k_ext, v_ext)
        else:
            new_kv = (k_pages, v_pages) if k_ext is None else (k_pages, v_pages, k_ext, v_ext)
        return out.reshape(num_seqs, q_len, self.num_heads * self.head_dim), new_kv


class MLP(nnx.Module):
    """SwiGLU with its pre-norm and residual add: ``x + down(silu(gate(norm(x))) * up(norm(x)))``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, linear_impl: str):
        dtype = _jnp_dtype(cfg.dtype)
        self.linear_impl = linear_impl
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

    def __call__(self, x: jax.Array, norm: RMSNorm) -> jax.Array:
        impl = self.linear_impl
        h = rms_swiglu(x, norm.weight[...], self.gate_proj.kernel[...], self.up_proj.kernel[...], norm.eps, impl=impl)
        return linear_residual(h, self.down_proj.kernel[...], x, impl=impl)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention_impl: str, linear_impl: str):
        dtype = _jnp_dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, rngs, attention_impl, linear_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, rngs, linear_impl)

    def __call__(self, x, positions, inv_freq, kv, md):
        """``x + attn(norm(x))``, then ``+ mlp(norm(·))``."""
        x, kv, _ = self.forward(x, positions, inv_freq, kv, md)
        return x, kv

    def forward(self, x, positions, inv_freq, kv, md, qkv=None, next_layer: DecoderLayer | None = None):
        """``__call__``, given this layer's q/k/v when the previous layer computed them (``qkv``), and also computing
        ``next_layer``'s (returned third; None without a next layer). After attention, o_proj with its residual add,
        the whole MLP and the next layer's norm and q/k/v are one :func:`attn_out_mlp` (one custom call per layer
        on the CPU kernel, the plain composition elsewhere)."""
        out, kv = self.self_attn.attend(x, self.input_layernorm, positions, inv_freq, kv, md, qkv=qkv)
        x, next_qkv = self.after_attention(out, x, next_layer)
        return x, kv, next_qkv

    def first_qkv(self, x: jax.Array) -> list[jax.Array]:
        """This layer's q/k/v of the residual stream ``x`` (what ``forward`` computes when not handed them)."""
        return self.self_attn.qkv(x, self.input_layernorm)

    def after_attention(self, out: jax.Array, x: jax.Array, next_layer: DecoderLayer | None = None):
        """``(x + o_proj(out), then + mlp(norm(·)); next_layer's q/k/v of that or None)`` as one
        :func:`attn_out_mlp`."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        extra = {}
        if next_layer is not None:
            next_norm = next_layer.input_layernorm
            extra = dict(next_gain=next_norm.weight[...], next_ws=next_layer.self_attn.qkv_weights(),
                         next_eps=next_norm.eps)
        result = attn_out_mlp(out, x, attn.o_proj.kernel[...], norm.weight[...], mlp.gate_proj.kernel[...],
                              mlp.up_proj.kernel[...], mlp.down_proj.kernel[...], norm.eps, impl=mlp.linear_impl,
                              **extra)
        return result if next_layer is not None else (result, None)


class Llama(nnx.Module):
    """A Llama-family causal LM. ``__call__`` returns final hidden states; :meth:`logits` applies the LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention_impl: str = "auto", linear_impl: str = "auto"):
        dtype = _jnp_dtype(cfg.dtype)
        self.config = cfg
        self.linear_impl = check_linear_impl(linear_impl)
        check_attention_impl(attention_impl)
        if cfg.feature_size is None:
            self.embed_tokens = nnx.Embed(
                cfg.vocab_size,
                cfg.hidden_size,
                dtype=dtype,
                param_dtype=dtype,
                embedding_init=nnx.initializers.normal(0.02),
                rngs=rngs,
            )
            self.fc = None
        else:  # a feature draft: fc([the target's embedding of x, feature]); no table of its own
            self.embed_tokens = None
            self.fc = _linear(2 * cfg.feature_size, cfg.hidden_size, dtype, rngs)
        # fused features (EAGLE-3, ``ModelConfig.feature_layers``): the target's layers mixed into one feature
        self.fuse = None if cfg.feature_layers is None else _linear(
            (len(cfg.feature_layers) + 1) * cfg.feature_size, cfg.feature_size, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, attention_impl, linear_impl) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        head_vocab = cfg.head_vocab_size or cfg.vocab_size
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, head_vocab, dtype, rngs)
        # subset head: the vocabulary id of each head row (a draft proposes only these ids)
        self.head_token_ids = (
            None if cfg.head_vocab_size is None else nnx.Variable(jnp.arange(cfg.head_vocab_size, dtype=jnp.int32))
        )
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))

    def __call__(
        self,
        tokens: jax.Array,  # [num_seqs, q_len] int32
        kv_cache: KVCache,
        md: BatchMetadata,
        features: jax.Array | None = None,  # feature draft: [num_seqs, q_len, feature_size], f[p - 1] at slot p
        embed_table: jax.Array | None = None,  # feature draft: the target's [vocab, feature_size] embedding
        hidden_layers: tuple[int, ...] = (),  # a fused draft's target: also the residual stream after these layers
    ) -> tuple[jax.Array, KVCache]:  # hidden [num_seqs, q_len, hidden], updated cache
        """Final hidden states and the updated cache. With ``hidden_layers`` (layer counts ``1 .. num_layers - 1``)
        the hidden states are ``[num_seqs, q_len, (len(hidden_layers) + 1) * hidden]``: the residual stream after
        each of those layers, then the final state (a fused feature draft's input, ``ModelConfig.feature_layers``).
        A fused draft's ``features`` are either that wide (the target's, mixed by ``fuse``) or ``feature_size``
        wide (its own outputs, in later draft steps)."""
        self._check_inputs(tokens, kv_cache, md)
        positions, _ = slot_positions(md, tokens.shape[1])
        bad = [n for n in hidden_layers if not 1 <= n < len(self.layers)]
        if bad:
            raise ValueError(f"hidden_layers {bad}: layer counts in 1..{len(self.layers) - 1} "
                             f"({self.config.name} has {len(self.layers)} layers; the final state comes last)")
        if self.fc is None:
            x = embed(self.embed_tokens.embedding[...], tokens)
        else:
            if features is None or embed_table is None:
                raise ValueError(f"{self.config.name} is a feature draft: pass features= and embed_table=")
            dtype = compute_dtype(self.fc.kernel[...])  # float32 for a compact (bfloat16-panel) kernel's float32 values
            if features.shape[-1] != self.config.feature_size:
                features = self._fuse(features.astype(dtype))
            inputs = jnp.concatenate([embed(embed_table, tokens).astype(dtype), features.astype(dtype)], axis=-1)
            x = linear(inputs, self.fc.kernel[...], impl=self.linear_impl)
        inv_freq = self.inv_freq[...]
        new_cache = []
        qkv = None  # each layer's q/k/v come out of the previous layer's fused call
        layers = list(self.layers)
        stacked = isinstance(kv_cache, StackedKV)
        if stacked and kv_cache.k.shape[0] != len(layers):
            raise ValueError(f"stacked K/V pools {kv_cache.k.shape} hold {kv_cache.k.shape[0]} layers; "
                             f"{self.config.name} has {len(layers)}")
        taken = []
        for i, layer in enumerate(layers):
            if i in hidden_layers:
                taken.append(x)
            next_layer = layers[i + 1] if i + 1 < len(layers) else None
            kv = LayerKV(kv_cache.k, kv_cache.v, i, kv_cache.k_ext, kv_cache.v_ext) if stacked else kv_cache[i]
            x, kv, qkv = layer.forward(x, positions, inv_freq, kv, md, qkv=qkv, next_layer=next_layer)
            if stacked:  # the next layer writes into the pools this one wrote
                kv_cache = StackedKV(kv.k, kv.v, kv.k_ext, kv.v_ext)
            else:
                new_cache.append(kv)
        hidden = self.norm(x)
        if hidden_layers:
            hidden = jnp.concatenate([*(t.astype(hidden.dtype) for t in taken), hidden], axis=-1)
        return hidden, kv_cache if stacked else tuple(new_cache)

    def _check_inputs(self, tokens: jax.Array, kv_cache: KVCache, md: BatchMetadata) -> None:
        """Shapes always (at trace time); the token ids' and query lengths' values where they are concrete (an eager
        call: under jit they are tracers). An id outside the vocabulary read a clamped row of the embedding (NaN
        logits past the end, the last row for -1), and a query_lens of the wrong length was broadcast."""
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array [num_seqs, q_len], got "
                             f"{tokens.dtype}{list(tokens.shape)}")
        num_seqs, q_len = tokens.shape
        if md.query_lens is not None and md.query_lens.shape != (num_seqs,):
            raise ValueError(f"BatchMetadata.query_lens must be [num_seqs={num_seqs}], got shape "
                             f"{tuple(md.query_lens.shape)}")
        if md.rope_offsets is not None and md.rope_offsets.shape != (q_len,):
            raise ValueError(f"BatchMetadata.rope_offsets must be [q_len={q_len}], got shape "
                             f"{tuple(md.rope_offsets.shape)}")
        if not isinstance(kv_cache, StackedKV) and len(kv_cache) != len(self.layers):
            raise ValueError(f"the K/V cache has {len(kv_cache)} layers; {cfg.name} has {len(self.layers)}")
        pool = kv_cache.k if isinstance(kv_cache, StackedKV) else kv_cache[0][0]
        want = (cfg.num_kv_heads, cfg.head_dim)
        got = (pool.shape[-4], pool.shape[-1])
        if got != want:
            raise ValueError(f"the K/V pools hold {got[0]} heads of {got[1]} (shape {tuple(pool.shape)}); "
                             f"{cfg.name} has {want[0]} K/V heads of {want[1]} (allocate_kv_cache(config, ...))")
        concrete = not any(isinstance(a, jax.core.Tracer) for a in (tokens, md.context_lens, md.query_lens))
        if not concrete or not tokens.size:
            return
        lens = None if md.query_lens is None else np.asarray(md.query_lens)
        if lens is not None and (lens.min() < 0 or lens.max() > q_len):
            raise ValueError(f"BatchMetadata.query_lens {lens.tolist()}: each is 0 .. q_len={q_len} (the real new "
                             f"tokens of a row, right-aligned in its slots)")
        # the real slots' ids (padding slots' outputs are dropped: -1 there is padding, as under jit)
        slot = np.arange(q_len)[None, :]
        real = np.asarray(md.context_lens)[:, None] - q_len + slot >= 0
        if lens is not None:
            real &= slot >= q_len - lens[:, None]
        ids = np.asarray(tokens)[real]
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside {cfg.name}'s vocabulary: allowed 0 .. "
                             f"{cfg.vocab_size - 1}")

    def _fuse(self, features: jax.Array) -> jax.Array:
        """The target's fused features ``[..., (k + 1) * F]`` -> ``[..., F]``: each earlier layer's residual stream
        RMS-normalised (float32, no weight), the final state as it is, then ``fuse`` (EAGLE-3's fusion)."""
        f = self.config.feature_size
        k = len(self.config.feature_layers or ())
        if self.fuse is None or features.shape[-1] != (k + 1) * f:
            raise ValueError(f"{self.config.name} reads {f}-wide features"
                             + (f" or {(k + 1) * f}-wide fused ones" if self.fuse is not None else "")
                             + f", got {features.shape[-1]}")
        parts = []
        for i in range(k):
            r = features[..., i * f : (i + 1) * f].astype(jnp.float32)
            r = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + self.config.rms_norm_eps)
            parts.append(r.astype(features.dtype))
        x = jnp.concatenate([*parts, features[..., k * f :]], axis=-1)
        return linear(x, self.fuse.kernel[...], impl=self.linear_impl)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head in the model dtype with float32 output. hidden ``[..., hidden]`` -> ``[..., vocab]``."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...]
            out = linear(hidden, w, impl=self.linear_impl, transposed=True, out_dtype=jnp.float32)
        else:
            w = self.lm_head.kernel[...]
            out = linear(hidden, w, impl=self.linear_impl, out_dtype=jnp.float32)
        out = out.astype(jnp.float32)
        if self.head_token_ids is not None:  # scatter the subset's logits into the full vocabulary, -inf elsewhere
            full = jnp.full(out.shape[:-1] + (self.config.vocab_size,), -jnp.inf, jnp.float32)
            out = full.at[..., self.head_token_ids[...]].set(out, indices_are_sorted=True, unique_indices=True)
        return out


def make_forward(graphdef: nnx.GraphDef) -> Callable[..., tuple[jax.Array, KVCache]]:
    """A pure function ``(state, tokens, kv_cache, md) -> (logits of the last position, kv_cache)``.

    Callers jit it (with the cache donated). ``state`` is the flat ``nnx.State`` from :func:`nnx.split`.
    """

    def forward_last_logits(state: nnx.State, tokens: jax.Array, kv_cache: KVCache, md: BatchMetadata):
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(tokens, kv_cache, md)
        return model.logits(hidden[:, -1]), kv_cache

    return forward_last_logits


def slot_positions(md: BatchMetadata, q_len: int) -> tuple[jax.Array, jax.Array]:
    """Each slot's position ``[num_seqs, q_len]`` and whether it holds a real new token (see the module docstring)."""
    positions = md.context_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    valid = positions >= 0
    if md.query_lens is not None:
        valid &= jnp.arange(q_len, dtype=jnp.int32)[None, :] >= q_len - md.query_lens[:, None]
    return positions, valid


def page_slots(md: BatchMetadata, q_len: int, page_size: int, offset: int = 0) -> tuple[jax.Array, ...]:
    """Where position ``p + offset`` of every real slot at position ``p`` lives in a paged pool: page ids and
    in-page slots ``[num_seqs, q_len]`` (page 0, slot 0 where the slot is padding or that position is negative), and
    the mask of slots that have one."""
    positions, valid = slot_positions(md, q_len)
    target = positions + offset
    ok = valid & (target >= 0)
    return (*position_pages(md.block_tables, target, ok, page_size), ok)


def position_pages(block_tables: jax.Array, positions: jax.Array, ok: jax.Array, page_size: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Page ids and in-page slots of ``positions [num_seqs, m]`` through the block tables; page 0, slot 0 where
    ``ok`` is False."""
    pages = jnp.take_along_axis(block_tables, jnp.where(ok, positions // page_size, 0), axis=1)
    return jnp.where(ok, pages, 0), jnp.where(ok, positions % page_size, 0)


def kv_storage_dtype(dtype: str) -> jnp.dtype:
    """How a K/V pool of ``dtype`` is held: bfloat16 on the CPU backend as its 16-bit patterns (``uint16``), since
    XLA:CPU copies a whole bfloat16 pool to scatter into it (widening it to float32) where it scatters integers in
    place: 60 pool copies per SmolLM2 decode step, 33 ms of a batch-1 step at 1,000 tokens of context (2026-12-04).
    Every other dtype and backend as itself. :func:`kv_values` reads either as values."""
    dt = _jnp_dtype(dtype)
    return jnp.dtype(jnp.uint16) if dt == jnp.bfloat16 and jax.default_backend() == "cpu" else jnp.dtype(dt)


def kv_values(pages: jax.Array) -> jax.Array:
    """A K/V pool as its values: a ``uint16`` pool (bfloat16 bit patterns, :func:`kv_storage_dtype`) as bfloat16."""
    return jax.lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == jnp.uint16 else pages


@jax.custom_jvp
def _bfloat16_bits(values: jax.Array) -> jax.Array:
    """``values`` rounded to bfloat16, as ``uint16`` bit patterns (a CPU pool's storage, :func:`kv_storage_dtype`)."""
    return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)


@_bfloat16_bits.defjvp
def _bfloat16_bits_jvp(primals, tangents):  # (integer bits carry no derivative: gradients were silently zero)
    raise ValueError("a bfloat16 K/V pool is held as uint16 bit patterns on the CPU backend and carries no gradient "
                     "(k_proj and v_proj would get zeros): for gradients use a float32 pool, "
                     "allocate_kv_cache(config, num_pages, page_size, dtype='float32')")


def write_kv_pages(pages: jax.Array, page_ids: jax.Array, slots: jax.Array, values: jax.Array,
                   layer: int | None = None, mode: str | None = None) -> jax.Array:
    """``pages [KVH, num_pages, page_size, D]`` with ``values [KVH, num_seqs, q_len, D]`` (rounded to the pool's
    dtype) at ``(page_ids, slots) [num_seqs, q_len]``, in place (the pools are donated); a ``uint16`` pool gets the
    values' bfloat16 bit patterns. With ``layer``, ``pages`` holds every layer (``[L, KVH, ...]``, :class:`StackedKV`)
    and that layer's are written. ``mode="drop"``: writes to a page id past the pool's last are dropped."""
    if pages.dtype == jnp.uint16:
        values = _bfloat16_bits(values)
    values = values.astype(pages.dtype)
    if layer is None:
        return pages.at[:, page_ids, slots].set(values, mode=mode)
    # the layer index and the (page, slot) arrays sit apart: numpy's rule puts the indexed dimensions first
    return pages.at[layer, :, page_ids, slots].set(values.transpose(1, 2, 0, 3), mode=mode)


def write_split_kv_pages(pages: jax.Array, ext: jax.Array | None, page_ids: jax.Array, slots: jax.Array,
                         values: jax.Array, layer: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """:func:`write_kv_pages` over a base pool and its extension (None: no extension): each page id's values go to
    the pool that holds it."""
    if ext is None:
        return write_kv_pages(pages, page_ids, slots, values, layer), None
    in_base, in_ext = split_page_ids(page_ids, pages.shape[-3], ext.shape[-3])
    return (write_kv_pages(pages, in_base, slots, values, layer, mode="drop"),
            write_kv_pages(ext, in_ext, slots, values, layer, mode="drop"))


def write_feature_pages(pool: jax.Array, values: jax.Array, md: BatchMetadata) -> jax.Array:
    """Scatter ``values [num_seqs, q_len, H]`` into a per-token pool ``[num_pages, page_size, H]`` at the slots'
    positions (the target's hidden states, for a feature draft); padding slots land on page 0."""
    pages, slots, _ = page_slots(md, values.shape[1], pool.shape[1])
    return pool.at[pages, slots].set(values.astype(pool.dtype))


def read_previous_features(pool: jax.Array, md: BatchMetadata, q_len: int) -> jax.Array:
    """The stored feature at position ``p - 1`` for every slot at position ``p`` ``[num_seqs, q_len, H]`` (zeros at
    position 0 and on padding slots): a feature draft's input."""
    pages, slots, ok = page_slots(md, q_len, pool.shape[1], offset=-1)
    return jnp.where(ok[..., None], pool[pages, slots], 0)


def allocate_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: str | None = None, *,
                      stacked: bool = False) -> KVCache:
    """Zeroed K/V pools for every layer: ``num_layers`` pairs of ``[num_kv_heads, num_pages, page_size, head_dim]``
    in ``dtype`` (default: the model's; bfloat16 on the CPU backend held as its bit patterns,
    :func:`kv_storage_dtype`); ``stacked``: one :class:`StackedKV` of ``[num_layers, ...]`` pools instead."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    dt = kv_storage_dtype(dtype or cfg.dtype)
    if stacked:
        return StackedKV(jnp.zeros((cfg.num_layers, *shape), dt), jnp.zeros((cfg.num_layers, *shape), dt))
    return tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers))


def init_model(
    cfg: ModelConfig, *, seed: int = 0, attention_impl: str = "auto", linear_impl: str = "auto",
    abstract: bool = False,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build a model and split it. ``abstract=True`` only shapes the state (no memory, for loading weights)."""
    def build():
        return Llama(cfg, rngs=nnx.Rngs(seed), attention_impl=attention_impl, linear_impl=linear_impl)

    model = nnx.eval_shape(build) if abstract else build()
    return nnx.split(model)


def hf_param_map(cfg: ModelConfig) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """HF state-dict name -> (NNX state path, transpose?) for every parameter of ``cfg``.

    HF stores linear weights ``[out, in]``; NNX kernels are ``[in, out]``.
    """
    m: dict[str, tuple[tuple[Any, ...], bool]] = {"model.norm.weight": (("norm", "weight"), False)}
    if cfg.feature_size is None:
        m["model.embed_tokens.weight"] = (("embed_tokens", "embedding"), False)
    else:
        m["fc.weight"] = (("fc", "kernel"), True)
    if cfg.feature_layers is not None:
        m["fuse.weight"] = (("fuse", "kernel"), True)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m[f"{p}self_attn.{name}.weight"] = (("layers", i, "self_attn", name, "kernel"), True)
        for name in ("gate_proj", "up_proj", "down_proj"):
            m[f"{p}mlp.{name}.weight"] = (("layers", i, "mlp", name, "kernel"), True)
        m[f"{p}input_layernorm.weight"] = (("layers", i, "input_layernorm", "weight"), False)
        m[f"{p}post_attention_layernorm.weight"] = (("layers", i, "post_attention_layernorm", "weight"), False)
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = (("lm_head", "kernel"), True)
    if cfg.head_vocab_size is not None:
        m[HEAD_TOKEN_IDS] = (("head_token_ids",), False)
    return m


HEAD_TOKEN_IDS = "lm_head.token_ids"  # int32 [head_vocab_size]: the vocabulary id of each row of a subset head


def _check_head_token_ids(cfg: ModelConfig, ids: np.ndarray, source: str) -> None:
    ok = (
        ids.ndim == 1
        and np.issubdtype(ids.dtype, np.integer)
        and ids.size == cfg.head_vocab_size
        and bool(np.all(ids >= 0))
        and bool(np.all(ids < cfg.vocab_size))
        and bool(np.all(np.diff(ids) > 0))
    )
    if not ok:
        raise ValueError(
            f"{source}: tensor {HEAD_TOKEN_IDS} must be {cfg.head_vocab_size} strictly increasing integer token ids "
            f"in [0, {cfg.vocab_size}); got dtype {ids.dtype}, shape {ids.shape}"
        )


def state_from_hf(
    cfg: ModelConfig, state_dict: dict[str, np.ndarray], *, attention_impl: str = "auto", linear_impl: str = "auto",
    source: str = "checkpoint",
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build ``(graphdef, state)`` from an HF-named, HF-layout state dict of numpy arrays.

    Every name and shape is checked before any device array is made, so a bad checkpoint raises one error naming
    the tensor and loads nothing. ``lm_head.weight`` in a tied checkpoint is accepted if it equals the embedding.
    """
    pmap = hf_param_map(cfg)
    graphdef, abstract = init_model(cfg, attention_impl=attention_impl, linear_impl=linear_impl, abstract=True)
    flat = dict(nnx.to_flat_state(abstract))
    extra = sorted(set(state_dict) - set(pmap))
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # tied checkpoints sometimes store a copy of the embedding
    extra = [k for k in extra if not k.endswith("rotary_emb.inv_freq")]
    missing = sorted(set(pmap) - set(state_dict))
    if missing:
        raise ValueError(f"{source}: missing tensors for {cfg.name}: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise ValueError(f"{source}: unexpected tensors (unsupported architecture?): {extra[:8]}")
    dtype = _jnp_dtype(cfg.dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" in state_dict and "model.embed_tokens.weight" in state_dict:
        if not np.array_equal(np.asarray(state_dict["lm_head.weight"]),
                              np.asarray(state_dict["model.embed_tokens.weight"])):
            raise ValueError(f"{source}: lm_head.weight differs from model.embed_tokens.weight, but {cfg.name} ties "
                             f"them (tie_word_embeddings): leave lm_head.weight out, or give it equal to the embedding")
    if cfg.head_vocab_size is not None:
        _check_head_token_ids(cfg, np.asarray(state_dict[HEAD_TOKEN_IDS]), source)
    for hf_name, (path, transpose) in pmap.items():
        arr = state_dict[hf_name]
        kind = np.dtype(arr.dtype)
        if hf_name != HEAD_TOKEN_IDS and not (np.issubdtype(kind, np.floating) or kind.name == "bfloat16"):
            # (integer or bool weights were cast to the model's float dtype without a word: a wrong model)
            raise ValueError(f"{source}: tensor {hf_name} is {kind.name}: weights must be floating-point "
                             f"(float32, float16 or bfloat16)")
        want = tuple(flat[path].get_value().shape)
        got = tuple(arr.shape[::-1]) if transpose else tuple(arr.shape)
        if got != want:
            raise ValueError(f"{source}: tensor {hf_name} has shape {tuple(arr.shape)}, expected "
                             f"{want[::-1] if transpose else want} for {cfg.name}")
    for hf_name, (path, transpose) in pmap.items():
        arr = np.asarray(state_dict[hf_name])
        arr = arr.T if transpose else arr
        flat[path] = flat[path].replace(jnp.asarray(arr, dtype=jnp.int32 if hf_name == HEAD_TOKEN_IDS else dtype))
    inv = flat[("inv_freq",)]
    flat[("inv_freq",)] = inv.replace(jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))
    return graphdef, nnx.from_flat_state(flat)


def random_state(
    cfg: ModelConfig, *, seed: int = 0, attention_impl: str = "auto", linear_impl: str = "auto"
) -> tuple[nnx.GraphDef, nnx.State]:
    """Random weights (``load_format="dummy"``), created directly on device in the model dtype."""
    return init_model(cfg, seed=seed, attention_impl=attention_impl, linear_impl=linear_impl)


def make_model_fns(graphdef: nnx.GraphDef):
    """Pure ``(hidden_fn, logits_fn)`` over a flat state, for the runner's jitted step functions.

    ``hidden_fn(state, tokens [S, Q], kv_cache, md) -> (hidden [S, Q, H], kv_cache)``;
    ``logits_fn(state, hidden [..., H]) -> logits [..., V] float32``.
    """

    def hidden_fn(state: nnx.State, tokens: jax.Array, kv_cache: KVCache, md: BatchMetadata, **feature_inputs):
        return nnx.merge(graphdef, state)(tokens, kv_cache, md, **feature_inputs)

    def logits_fn(state: nnx.State, hidden: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state).logits(hidden)

    return hidden_fn, logits_fn
