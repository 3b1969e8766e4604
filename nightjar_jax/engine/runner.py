"""The model runner: owns the device state (weights, KV pools) and the jitted step functions.

Every step function is jitted with the KV pools donated and runs at a shape from a small, known set:
- ``forward_sample[S, T]``: the target over ``T`` new tokens for ``S`` sequences, then sampling of the next token
  at the last position. Prefill chunks use ``T`` from the prefill buckets; plain decoding (γ = 0) is ``T = 1``.
- ``propose[S, γ]``: γ fused draft decode steps (``lax.fori_loop``) returning draft tokens (and, for sampled
  requests, the draft's processed distributions).
- ``verify[S, γ]``: one target pass over ``γ + 1`` positions, then rejection sampling.
- ``draft_fill[S, T]``: the draft over tokens it missed (catch-up after γ = 0 steps, or a fresh prompt).
A feature draft (``ModelConfig.feature_size``, EAGLE-style) also reads the target's final hidden states: the target's
passes write them into ``features`` (paged like the KV cache); ``draft_fill`` and the first ``propose`` step read
the one at the previous position, and the draft embeds its tokens with the target's table
(``ModelHandle.embedding``). See docs/architecture.md, "Feature drafts".
``S`` is a batch bucket (powers of two up to ``max_num_seqs``); ``T`` a chunk bucket (powers of two). Each
function also has a greedy variant (static ``all_greedy``) that skips the vocabulary-sized distributions.
Variants compile on first use (kept across runs by JAX's persistent compilation cache) or all at once in
:meth:`ModelRunner.warmup`; after that a step never compiles. Only committed token ids come back to the host (and
their log-probabilities for the requests that ask: ``SamplingParams.logprobs``, a static ``num_logprobs`` variant).
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nightjar_jax.config import ModelConfig, resolve_kv_dtype
from nightjar_jax.engine.outputs import Logprob, SampleLogprobs
from nightjar_jax.engine.request import Request
from nightjar_jax.engine.sampler import (
    BANNED,
    NO_ACCEPT_LIMIT,
    SALT_SAMPLE,
    SALT_VERIFY,
    Penalties,
    SamplingTensors,
    TokenLogprobs,
    apply_allowed,
    apply_logit_bias,
    apply_penalties,
    argmax,
    logprobs_bucket,
    processed_probs,
    sample,
    token_logprobs,
    top_k_ids,
)
from nightjar_jax.engine.scheduler import ScheduledBatch
from nightjar_jax.engine.variants import VariantJit, drop_least_used
from nightjar_jax.memory import host
from nightjar_jax.models.llama import (
    BatchMetadata,
    KVCache,
    StackedKV,
    allocate_kv_cache,
    attach_kv_extension,
    detach_kv_extension,
    kv_extension_pages,
    kv_page_size,
    make_model_fns,
    position_pages,
    read_previous_features,
    split_page_ids,
    split_take,
    write_feature_pages,
)
from nightjar_jax.spec.lookup import NgramIndex
from nightjar_jax.spec.rejection import (
    as_plain_steps,
    draft_sample,
    exact_plain_draws,
    greedy_verify,
    rejection_sample,
    tree_greedy_verify,
    tree_rejection_sample,
)
from nightjar_jax.spec.tree import SpecTree, chain_prefixes, tree_for, with_copy_branch

logger = logging.getLogger(__name__)

# Shares of vm.max_map_count (ModelRunner.maps_short): a warm-up stops past the first (leaving room for variants
# compiled on first use), and a step that compiled drops the least used variants past the second
# (LLMEngine)
WARMUP_MAP_SHARE = 0.6
EVICT_MAP_SHARE = 0.85
# after a drop that left the process short (the maps are held elsewhere), the next waits until the process holds
# this share of the limit more than right after it: the engine's own variants grew enough for a drop to help
EVICT_REGROWTH_SHARE = 0.05
EVICT_CEILING_SHARE = 0.95  # ... but past this share it drops after every step that compiled, whatever the cause
# a drop (ModelRunner.evict_least_used) goes down to this share of the limit, least used variants first, and keeps the
# current step's
EVICT_TARGET_SHARE = 0.6


class _MapsShort(Exception):
    """A warm-up stops: the process is short of memory maps (``ModelRunner.maps_short``)."""


def memory_map_usage() -> tuple[int, int] | None:
    """``(memory maps this process holds, vm.max_map_count)`` on Linux; None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return used, limit

# (SALT_SAMPLE and SALT_VERIFY: sampler's; a row without drafts in a verify draws with SALT_SAMPLE as a plain step
# does, rejection.as_plain_steps)
SALT_DRAFT = 16  # draft sampling at draft position i uses SALT_DRAFT + i


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def buckets_up_to(limit: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit if not out or limit > out[-1] else out[-1])
    return sorted(set(out))


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def buffer_key(x) -> int:
    """What identifies an array's buffer: ``jax.device_put`` of an uncommitted array to the device it is on
    (:func:`commit_to_device`) returns a new array over the same buffer, so two models' leaves may differ by ``id``
    and still share their bytes (deleting one deletes both). ``id`` where the array has no single buffer."""
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # (several shards, deleted, or not an array)
        return id(x)


def commit_to_device(tree):
    """``tree``'s arrays committed to the default device (the same buffers: ``jax.device_put`` to the device they
    are on copies nothing)."""
    return jax.device_put(tree, jax.devices()[0])


@jax.jit
def _all_finite(arrays: tuple) -> jax.Array:
    """Per array: whether every value is finite (``ModelHandle.nonfinite``)."""
    return jnp.stack([jnp.isfinite(x).all() for x in arrays])


@dataclass
class ModelHandle:
    """A model split for jit: config, graph definition and flat state (weights on device)."""

    config: ModelConfig
    graphdef: nnx.GraphDef | None
    state: nnx.State | dict
    fns: tuple | None = None  # (hidden_fn, logits_fn); derived from graphdef unless given (fake models)

    def __post_init__(self) -> None:
        if self.fns is None:
            self.fns = make_model_fns(self.graphdef)
        self._flat: tuple[object, tuple] | None = None  # (the state object the leaves came from, leaves)
        self.users = weakref.WeakSet()  # the runners stepping with these weights (several: LLM.from_engine)
        self._home: list | None = None  # the leaves' device shardings while they are offloaded (move_to)
        self._embed_index: int | None = None  # position of the embedding table among the leaves
        self.treedef = jax.tree.structure(self.state)
        # stack_layers: for each leaf of the model's own state, (index among the leaves, layer or -1), and that
        # state's structure and key paths
        self._plan: list[tuple[int, int]] | None = None
        self._layer_treedef = None
        self._layer_paths: list[tuple[str, ...]] | None = None

    def stack_layers(self) -> bool:
        """Hold each per-layer weight kind as one array stacked over the layers (``[L, ...]``: SmolLM2-135M's 270
        per-layer arrays become 9) where the CPU kernels read every per-layer weight: the CPU backend with the linear
        kernels built and the state packed for them (``nightjar_jax.linear.pack_state``). Each jitted step then
        dispatches ~12 weight arrays instead of ~270; after a decode step has streamed the weights through the
        caches, every array costs the host's dispatch a few cache misses (docs/benchmarks.md). Inside the step
        :meth:`unflatten` hands the model each layer's weights as a ``LayerView`` (``kernels_pallas/linear/cpu.py``),
        which the kernels take as the stacked array and a layer attribute (anything else as the slice). ``state``
        becomes the tuple of arrays. Returns whether it stacked; ``NIGHTJAR_STACK_LAYERS=0`` turns it off."""
        from kernels_pallas.linear import cpu

        if (self._plan is not None or self.graphdef is None or os.environ.get("NIGHTJAR_STACK_LAYERS", "1") == "0"
                or jax.default_backend() != "cpu" or not cpu.available()):
            return False
        flat = jax.tree_util.tree_flatten_with_path(self.state)[0]
        if not any(cpu.is_packed(leaf) for _, leaf in flat):
            return False
        keys = [tuple(getattr(k, "key", getattr(k, "name", k)) for k in path) for path, _ in flat]
        groups: dict[tuple, list[tuple[int, int]]] = {}  # the path after the layer index -> [(layer, leaf index)]
        for j, key in enumerate(keys):
            if len(key) > 2 and key[0] == "layers" and isinstance(key[1], int):
                groups.setdefault(key[2:], []).append((key[1], j))
        layers = self.config.num_layers
        leaves: list = []
        plan: list[tuple[int, int] | None] = [None] * len(flat)
        for members in groups.values():
            members.sort()
            arrays = [flat[j][1] for _, j in members]
            if [i for i, _ in members] == list(range(layers)) and len({(a.shape, a.dtype) for a in arrays}) == 1:
                for i, j in members:
                    plan[j] = (len(leaves), i)
                leaves.append(jnp.stack(arrays))
        for j, (_, leaf) in enumerate(flat):
            if plan[j] is None:  # not per-layer, or a kind whose layers differ
                plan[j] = (len(leaves), -1)
                leaves.append(leaf)
        self._layer_treedef = jax.tree.structure(self.state)
        self._layer_paths = [tuple(str(k) for k in key) for key in keys]
        self._plan = plan
        self.state = tuple(leaves)
        self.treedef = jax.tree.structure(self.state)
        self._flat = None
        self._embed_index = None
        return True

    @property
    def stacked(self) -> bool:
        return self._plan is not None

    def model_state(self) -> nnx.State | dict:
        """The state as the model reads it, per layer (stacked: each layer's weights a ``LayerView``, whose
        ``value()`` is its slice): for looking at the weights outside a jitted step (their bytes, their layouts).
        A jitted function takes :meth:`leaves` and calls :meth:`unflatten` inside."""
        return self.unflatten(self.leaves())

    def nonfinite(self) -> str | None:
        """The path of the first floating-point array holding NaN or an infinity, or None (one host sync for all)."""
        paths, arrays = [], []
        for path, x in jax.tree_util.tree_flatten_with_path(self.state)[0]:
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
                paths.append(path)
                arrays.append(x)
        if not arrays:
            return None
        ok = np.asarray(_all_finite(tuple(arrays)))  # (one compiled reduction: eager ones compiled per shape)
        bad = [p for p, good in zip(paths, ok, strict=True) if not good]
        if not bad:
            return None
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in bad[0]]
        return ".".join(names[:-1] if names[-1] == "value" and len(names) > 1 else names)  # (nnx's Variable.value)

    def leaves(self) -> tuple:
        """The state's arrays as a flat tuple, for the jitted steps (which rebuild the state with :meth:`unflatten`).

        A jitted call flattens its arguments on every call; for an ``nnx.State`` of a 30-layer model (273 arrays)
        that costs ~0.65 ms of Python per call on the project's CPU, against ~0.1 ms for a tuple. Cached until
        ``state`` is replaced (which must keep the same structure: the compiled steps rebuild it from ``treedef``).
        """
        if self._flat is None or self._flat[0] is not self.state:
            leaves, treedef = jax.tree.flatten(self.state)
            if treedef != self.treedef:
                raise ValueError("ModelHandle.state was replaced by a state of a different structure")
            self._flat = (self.state, tuple(leaves))
        return self._flat[1]

    def unflatten(self, leaves) -> nnx.State | dict:
        """The model's state from :meth:`leaves` (inside a jitted step); stacked (:meth:`stack_layers`), each
        per-layer weight as a ``LayerView`` of its stacked array."""
        if self._plan is None:
            return jax.tree.unflatten(self.treedef, leaves)
        from kernels_pallas.linear.cpu import LayerView

        return jax.tree.unflatten(self._layer_treedef,
                                  [leaves[k] if i < 0 else LayerView(leaves[k], i) for k, i in self._plan])

    def commit(self) -> None:
        """Commit the weights to the default device (no copy). A jitted step's compiled variants are keyed on
        whether their inputs are committed, and weights that come back from host memory are: committing them from
        the start keeps every step on the variants compiled (or warmed up) before an offload."""
        self.state = commit_to_device(self.state)
        self._flat = None

    def move_to(self, memory_kind: str, keep: frozenset[int] = frozenset()) -> int:
        """Move the weights to ``memory_kind`` (``device``, or a host kind such as ``pinned_host``) with
        ``jax.device_put``, wait, and delete the old copies at once. Arrays whose :func:`buffer_key` is in ``keep``
        (shared with another model) stay where they are. Returns the bytes moved. The structure is unchanged, so the
        compiled steps take the moved weights as they are (once they are back on the device)."""
        leaves = self.leaves()
        if memory_kind == "device" and self._home is not None:  # back where they were (the same shardings: the
            # compiled steps keep their cache keys); arrays that stayed (kept) are left alone
            targets = [None if sh is None or x.sharding.memory_kind == sh.memory_kind else sh
                       for x, sh in zip(leaves, self._home, strict=True)]
        else:
            self._home = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
            targets = [None if sh is None or buffer_key(x) in keep else sh.with_memory_kind(memory_kind)
                       for x, sh in zip(leaves, self._home, strict=True)]
        moved = tuple(x if sh is None else jax.device_put(x, sh) for x, sh in zip(leaves, targets, strict=True))
        jax.block_until_ready(moved)
        seen: set[int] = set()
        nbytes = 0
        for x, y in zip(leaves, moved, strict=True):
            if isinstance(x, jax.Array) and x is not y and id(x) not in seen:
                seen.add(id(x))
                nbytes += x.nbytes
                x.delete()
        self.state = jax.tree.unflatten(self.treedef, moved)
        self._flat = None
        return nbytes

    def embedding(self) -> jax.Array:
        """The token embedding table ``[vocab, hidden]`` (a feature draft embeds its tokens with the target's)."""
        if self._embed_index is None:
            paths = self._layer_paths or [tuple(str(getattr(k, "key", k)) for k in path)
                                          for path, _ in jax.tree_util.tree_flatten_with_path(self.state)[0]]
            found = [i for i, p in enumerate(paths) if "embed_tokens" in p and "embedding" in p]
            if not found:
                raise ValueError(f"{self.config.name} has no embed_tokens.embedding (a feature draft needs a target "
                                 "with its own embedding table)")
            self._embed_index = found[0] if self._plan is None else self._plan[found[0]][0]
        return self.leaves()[self._embed_index]


@dataclass
class DecodeResult:
    """What a decode step produced, per request in batch order."""

    committed: list[list[int]]  # tokens to append (1 .. γ + 1 each)
    gamma: int
    num_drafted: int  # γ (or the tree's nodes) x the requests that may accept drafts
    num_accepted: list[int]  # accepted draft tokens per request
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target pass + sampling (the whole step when γ = 0)
    catchup_seconds: float = 0.0
    catchup_tokens: int = 0
    tree_nodes: int = 0  # drafted nodes per request when the step verified a token tree (0: a chain)
    lookup: list[bool] | None = None  # per request: its drafts came from n-gram lookup (None: no lookup this step)
    # per request: it accepted no draft by rule (``Request.accepts_no_drafts``: it committed one token, as a plain
    # step), not counted in the drafts; None when every request of a speculative step could accept drafts
    plain_rows: list[bool] | None = None
    # per request, per committed token: its log-probabilities (the requests that asked; None for the others, and
    # None throughout when no request of the batch asked)
    logprobs: list[SampleLogprobs | None] | None = None


class PrefillResult(NamedTuple):
    """What a prefill step produced, per request in batch order."""

    sampled: np.ndarray  # [num_seqs] the token sampled after each chunk (real only where the chunk ended the tokens)
    logprobs: list | None  # as DecodeResult.logprobs, for the sampled tokens
    # per request: [(prompt token index, {token id: Logprob})] the chunk scored (None: the request did not ask);
    # None throughout when no request asked
    prompt_logprobs: list | None = None


@dataclass
class RunnerShapes:
    decode_buckets: list[int]
    prefill_seq_buckets: list[int]
    prefill_len_buckets: list[int]
    max_pages_per_seq: int
    page_buckets: list[int]  # block-table widths: powers of two (reference attention) or just the maximum


PROMPT_LOGPROBS_SLICE = 16  # positions per pass of prompt_token_logprobs


def prompt_token_logprobs(logits_fn, hidden: jax.Array, targets: jax.Array, num_top: int) -> TokenLogprobs:
    """:func:`token_logprobs` at every position of a prefill chunk, ``PROMPT_LOGPROBS_SLICE`` positions at a time
    (``lax.map``): hidden [S, T, H], targets [S, T] -> [S, T] fields. The whole chunk's logits at once would be an
    [S, T, V] float32 array (32 x 512 positions x 49,152 ids: 3 GiB) and more as large beside it; a slice holds
    [S, 16, V]."""
    num_seqs, q_len = targets.shape
    width = math.gcd(q_len, PROMPT_LOGPROBS_SLICE)
    h = hidden.reshape(num_seqs, q_len // width, width, -1).swapaxes(0, 1)  # [T / w, S, w, H]
    t = targets.reshape(num_seqs, q_len // width, width).swapaxes(0, 1)  # [T / w, S, w]
    out = jax.lax.map(lambda ht: token_logprobs(logits_fn(ht[0]), ht[1], num_top), (h, t))
    return TokenLogprobs(*(x.swapaxes(0, 1).reshape((num_seqs, q_len) + x.shape[3:]) for x in out))


def _logprobs_arg(requests: list[Request], field: str = "logprobs") -> dict:
    """The step functions' ``num_logprobs`` keyword (``num_prompt_logprobs`` for ``field="prompt_logprobs"``) for a
    batch: absent when no request asks (the variants without them run), else the static top-k bucket covering the
    largest request."""
    asked = [getattr(r.sampling, field) for r in requests if getattr(r.sampling, field) is not None]
    return {f"num_{field}": logprobs_bucket(max(asked))} if asked else {}


def host_logprobs(lp: TokenLogprobs | None, requests: list[Request], committed: list[list[int]],
                  field: str = "logprobs", columns: list[list[int]] | None = None) -> list | None:
    """Device log-probabilities of a step ([S, ...] arrays, ``...`` = positions or none) -> per request, the
    positions of its ``committed`` tokens as ``{token id: Logprob}`` (the chosen token first, then its top k, k =
    the request's ``field``); None for requests that did not ask. ``columns[i]``: the positions of row i the tokens
    sit at (default 0, 1, ...). Returns None when ``lp`` is None."""
    if lp is None:
        return None
    logprob, rank, top_ids, top = (np.asarray(a) for a in lp)
    if logprob.ndim == 1:  # one position per row: [S] -> [S, 1]
        logprob, rank, top_ids, top = logprob[:, None], rank[:, None], top_ids[:, None], top[:, None]
    out: list = []
    for i, (r, tokens) in enumerate(zip(requests, committed, strict=True)):
        k = getattr(r.sampling, field)
        cols = range(len(tokens)) if columns is None else columns[i]
        out.append(None if k is None else [
            _position_logprobs(token, float(logprob[i, j]), int(rank[i, j]), top_ids[i, j, :k], top[i, j, :k])
            for j, token in zip(cols, tokens, strict=True)])
    return out


def _position_logprobs(token: int, logprob: float, rank: int, top_ids: np.ndarray, top: np.ndarray) -> dict:
    entry = {int(token): Logprob(logprob, rank)}
    for k, (t, v) in enumerate(zip(top_ids.tolist(), top.tolist(), strict=True)):
        entry.setdefault(int(t), Logprob(float(v), k + 1))
    return entry




def _row_bias(r: Request) -> dict[int, float]:
    """A request's additive logit bias this step: its ``logit_bias``, and its stop ids banned while it is under
    ``min_tokens``."""
    bias = dict(r.sampling.logit_bias or {})
    if r.stop_ids and r.under_min_tokens:
        bias.update({t: BANNED for t in r.stop_ids})
    return bias


def _copies_everything(looked_up: list[list[int]], requests: list[Request], gamma: int) -> bool:
    """Every request greedy and its n-gram lookup copying all γ drafts: a step the draft model skips."""
    return all(r.sampling.greedy and len(p) == gamma for p, r in zip(looked_up, requests, strict=True))


class ModelRunner:
    def __init__(
        self,
        target: ModelHandle,
        draft: ModelHandle | None,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        gamma_max: int,
        bucket_pages: bool = True,
        tree_nodes: int = 0,
        tree_order=None,
        tree_min_gamma: int = 1,
        lookup: tuple[int, int] | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """``bucket_pages``: pad block tables to a power-of-two width covering the batch's longest sequence instead
        of ``max_model_len``. The reference attention gathers the whole table, so on CPU this keeps attention cost
        proportional to the context; the Pallas kernels stop at each context length and need one width only.

        ``tree_nodes``: decode steps at γ verify a static token tree of up to this many drafted nodes and depth γ
        (``nightjar_jax/spec/tree.py``; 0: always a chain), greedy or sampled (lossless either way), at every
        γ >= ``tree_min_gamma`` (smaller γ stay chains); ``tree_order`` the rank paths the trees are cut from
        (default: the shipped order).

        ``lookup``: (min n, max n) of n-gram lookup drafts (``nightjar_jax/spec/lookup.py``): in chain steps in
        place of the draft's tokens, in trees as a copy branch of γ nodes (``with_copy_branch``), and a step
        where every row is greedy and copies all γ drafts verifies the copied chain without the draft, tree or
        not; None: the draft's tokens only.

        ``kv_cache_dtype``: the K/V pools' dtype (``CacheConfig.kv_cache_dtype``; ``auto``: each model's own)."""
        self.target = target
        self.lookup = lookup
        self.draft = draft
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_model_len = max_model_len
        # draft-free n-gram speculation (vLLM's "ngram" method): no draft model, every step's drafts are n-gram
        # lookup's copies, a row without one capped at no draft
        self.ngram_only = draft is None and lookup is not None and gamma_max > 0
        self.gamma_max = gamma_max if draft is not None or self.ngram_only else 0
        self.trees: dict[int, SpecTree] = {}
        if tree_nodes and self.gamma_max and draft is not None:
            # with lookup on, each tree carries a copy branch of γ nodes beside the draft's tree_nodes
            self.trees = {g: with_copy_branch(tree_for(tree_nodes, g, tree_order), g) if lookup
                          else tree_for(tree_nodes, g, tree_order)
                          for g in range(max(tree_min_gamma, 1), self.gamma_max + 1)}
        max_pages = -(-(max_model_len + self.max_lookahead() + 1) // page_size)
        self.shapes = RunnerShapes(
            decode_buckets=buckets_up_to(max_num_seqs),
            prefill_seq_buckets=buckets_up_to(max_num_seqs),
            prefill_len_buckets=buckets_up_to(next_power_of_two(max_num_batched_tokens), start=8),
            max_pages_per_seq=max_pages,
            page_buckets=buckets_up_to(max_pages, start=4) if bucket_pages else [max_pages],
        )
        # a model whose weights are stacked over its layers has its K/V pools stacked too (StackedKV: 2 donated
        # arrays per step instead of 2 per layer)
        self.kv_cache_dtype = kv_cache_dtype
        # every device array committed (ModelHandle.commit): the same compiled variants before and after a draft
        # offload / reload, whose moves commit what they move
        target.commit()
        target.users.add(self)
        if draft is not None:
            draft.commit()
            draft.users.add(self)
        self.kv: KVCache = self._new_target_pool()
        # A feature draft (EAGLE) reads the target's final hidden state at the previous position: the target's
        # passes write them into this per-token pool, paged like the KV cache (same block tables).
        self.feature_draft = draft is not None and draft.config.feature_size is not None
        if self.feature_draft and draft.config.feature_size != target.config.hidden_size:
            raise ValueError(
                f"feature draft {draft.config.name} reads {draft.config.feature_size}-wide features but the "
                f"target {target.config.name} has hidden size {target.config.hidden_size}"
            )
        # a fused feature draft (EAGLE-3) also reads the target's residual stream after these layers: the pool holds
        # them before the final state, (k + 1) x as wide
        self.feature_layers: tuple[int, ...] = (draft.config.feature_layers or ()) if self.feature_draft else ()
        if self.feature_layers and self.feature_layers[-1] >= target.config.num_layers:
            raise ValueError(
                f"feature draft {draft.config.name} reads the target's residual stream after layers "
                f"{list(self.feature_layers)}, but target {target.config.name} has {target.config.num_layers} layers "
                f"(each must be below it)"
            )
        self.draft_kv: KVCache | None = None
        self.features: jax.Array | None = None
        # while the draft is offloaded: the feature pool in host memory and its device sharding (offload_draft)
        self._features_away: tuple[jax.Array, jax.sharding.Sharding] | None = None
        self.draft_on_device = draft is not None  # False while the draft is offloaded (offload_draft)
        self.warmup_stopped: str | None = None  # why a warm-up stopped early (maps_short), None if none did
        if draft is not None:
            self._allocate_draft_pools()
        self._build_jitted()

    def _allocate_draft_pools(self, features: jax.Array | None = None) -> None:
        """The draft's K/V pools, and a feature draft's feature pool (``features``: the pool brought back, else
        zeros): the draft's device memory besides its weights, released and rebuilt with it."""
        draft = self.draft
        self.draft_kv = commit_to_device(allocate_kv_cache(draft.config, self.num_pages, self.page_size,
                                                           resolve_kv_dtype(self.kv_cache_dtype, draft.config.dtype),
                                                           stacked=draft.stacked))
        if self.feature_draft:
            self.features = features if features is not None else commit_to_device(
                jnp.zeros((self.num_pages, self.page_size, self.draft.config.feature_pool_width),
                          jnp.dtype(self.target.config.dtype)))

    # ---- elastic memory (nightjar_jax.memory decides; these make the moves) ----------------------------------------
    def target_page_bytes(self) -> int:
        """Device bytes of one page of the target's K/V pools (every layer, K and V)."""
        return sum(a.nbytes for a in jax.tree.leaves(self.kv)) // (self.num_pages + kv_extension_pages(self.kv))

    def device_bytes(self) -> dict[str, int]:
        """The engine's device arrays by part: what the memory budget counts (on CPU "device" is the host's memory
        kind ``device``; weights offloaded to a host memory kind are not counted)."""
        def on_device(tree) -> int:
            return sum(a.nbytes for a in jax.tree.leaves(tree) if isinstance(a, jax.Array) and not a.is_deleted()
                       and a.sharding.memory_kind in (None, "device"))

        return {
            "target_weights": on_device(self.target.leaves()),
            "target_kv": on_device(self.kv),
            "draft_weights": on_device(self.draft.leaves()) if self.draft is not None else 0,
            "draft_pools": on_device((self.draft_kv, self.features)),
        }

    def draft_device_bytes(self) -> int:
        """What offloading the draft frees: its weights and pools on the device (shared arrays excepted)."""
        if self.draft is None or not self.draft_on_device:
            return 0
        shared = self._shared_with_target()
        weights = sum(x.nbytes for x in {buffer_key(x): x for x in self.draft.leaves()
                                          if isinstance(x, jax.Array) and buffer_key(x) not in shared}.values())
        return weights + self.device_bytes()["draft_pools"]

    def _shared_with_target(self) -> frozenset[int]:
        """:func:`buffer_key` of the target's weight arrays (a draft that shares them keeps them)."""
        return frozenset(buffer_key(x) for x in self.target.leaves())

    def offload_draft(self) -> int:
        """Move the draft's weights, and a feature draft's feature pool, to host memory (``pinned_host`` where the
        device has it) and release its K/V pools. Returns the device bytes freed (weights + pools). Until
        :meth:`reload_draft` only γ = 0 steps may run.

        The feature pool goes to host memory rather than away: the target's features of every context computed so
        far come back with the draft, which catches its K/V up from them as it would have computed it (the
        positions decoded while it was away have none: their slots hold zeros or an earlier page owner's, which
        only lowers acceptance there)."""
        if self.draft is None:
            raise RuntimeError("this engine has no draft to offload (draft_model none, or ngram)")
        if not self.draft_on_device:
            raise RuntimeError("the draft is already offloaded")
        host = self._host_kind()
        freed = self.draft.move_to(host, keep=self._shared_with_target())  # (arrays shared with the target stay)
        if self.features is not None:
            home = self.features.sharding
            away = jax.device_put(self.features, home.with_memory_kind(host))
            jax.block_until_ready(away)
            self._features_away = (away, home)
        pools = [a for a in jax.tree.leaves((self.draft_kv, self.features)) if isinstance(a, jax.Array)]
        self.draft_kv = self.features = None
        for a in pools:
            freed += a.nbytes
            a.delete()
        self.draft_on_device = False
        return freed

    def attach_extension(self, num_pages: int) -> None:
        """Zeroed extension K/V pools of ``num_pages`` pages after the base pool (page ids ``num_pages ..``)."""
        self.kv = commit_to_device(attach_kv_extension(self.kv, num_pages))

    def detach_extension(self, src: list[int], dst: list[int]) -> None:
        """Copy the extension pages ``src`` (global page ids) into the base pages ``dst`` (every layer, K and V; the
        pools donated), then free the extension."""
        if src:
            size = next_power_of_two(len(src))  # few variants: padding copies page 0 of the extension to page 0
            s = np.zeros(size, np.int32)
            d = np.zeros(size, np.int32)
            s[: len(src)] = np.asarray(src) - self.num_pages
            d[: len(dst)] = dst
            self.kv = self._migrate_pages(self.kv, s, d)
        self.kv, arrays = detach_kv_extension(self.kv)
        for a in arrays:
            a.delete()

    def reload_draft(self) -> None:
        """Bring the draft's weights and a feature draft's feature pool back to the device and rebuild its K/V pools
        (zeroed: every request's draft K/V must be caught up)."""
        if self.draft_on_device:
            raise RuntimeError("the draft is on the device")
        self.draft.move_to("device")
        features = None
        if self._features_away is not None:
            away, home = self._features_away
            features = jax.device_put(away, home)  # (the sharding it left: the compiled steps keep their keys)
            jax.block_until_ready(features)
            away.delete()
            self._features_away = None
        self._allocate_draft_pools(features)
        self.draft_on_device = True

    # ---- sleep mode (vLLM's LLM.sleep / wake_up; the engine decides, these make the moves) ---------------------------
    def _host_kind(self) -> str:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
        return "pinned_host" if "pinned_host" in kinds else "unpinned_host"

    def _weight_handles(self) -> list[ModelHandle]:
        return [self.target] + ([self.draft] if self.draft is not None and self.draft is not self.target else [])

    def _move_target(self, memory_kind: str) -> int:
        """The target's weights to ``memory_kind`` (:meth:`ModelHandle.move_to`); the draft's arrays that were the
        target's (a draft sharing weights with it) become the moved ones, so the draft holds no deleted array."""
        draft = self.draft if self.draft is not None and self.draft is not self.target else None
        old_keys = [buffer_key(x) for x in self.target.leaves()]
        draft_keys = [buffer_key(x) for x in draft.leaves()] if draft is not None else []  # (before: the move
        # deletes the target's old arrays, and with them a draft's aliases of them)
        moved = self.target.move_to(memory_kind)
        new = dict(zip(old_keys, self.target.leaves(), strict=True))
        if any(k in new for k in draft_keys):
            draft.state = jax.tree.unflatten(draft.treedef, [new.get(k, x) for x, k in
                                                             zip(draft.leaves(), draft_keys, strict=True)])
            draft._flat = None
        return moved

    def release_pools(self) -> int:
        """Delete the K/V pools and a feature draft's feature pool (their contents are lost: the engine holds no
        request then). Returns the device bytes freed; :meth:`restore_pools` builds them again, zeroed."""
        if kv_extension_pages(self.kv):
            raise RuntimeError("the extension pool is attached: detach it (reload the draft) before releasing pools")
        pools = {id(a): a for a in jax.tree.leaves((self.kv, self.draft_kv, self.features)) if isinstance(a, jax.Array)}
        freed = 0
        for a in pools.values():
            freed += a.nbytes
            a.delete()
        self.kv = self.draft_kv = self.features = None
        return freed

    def restore_pools(self) -> None:
        """Zeroed pools of the shapes, dtypes and shardings the compiled steps were built for (no step recompiles)."""
        self.kv = self._new_target_pool()
        if self.draft is not None and self.draft_on_device:
            self._allocate_draft_pools()

    def _new_target_pool(self) -> KVCache:
        target = self.target
        return commit_to_device(allocate_kv_cache(target.config, self.num_pages, self.page_size,
                                                  resolve_kv_dtype(self.kv_cache_dtype, target.config.dtype),
                                                  stacked=target.stacked))

    def offload_weights(self, discard: bool = False) -> int:
        """Every model's weights (target and draft) to host memory with ``jax.device_put``, or, with ``discard``,
        deleted (:meth:`load_weights` then takes new ones). Returns the device bytes freed. A draft already in
        host memory (elastic memory) stays there (or is deleted with ``discard``)."""
        if discard:
            arrays = {buffer_key(x): x for h in self._weight_handles() for x in h.leaves()
                      if isinstance(x, jax.Array) and not x.is_deleted()}
            freed = sum(x.nbytes for x in arrays.values() if x.sharding.memory_kind in (None, "device"))
            for x in arrays.values():
                x.delete()
            return freed
        host = self._host_kind()
        freed = 0
        draft_moved = self.draft is not None and self.draft is not self.target and self.draft_on_device
        if draft_moved:
            freed += self.draft.move_to(host, keep=self._shared_with_target())
        try:
            return freed + self._move_target(host)
        except BaseException:  # (ModelHandle.move_to deletes nothing until every array has moved)
            if draft_moved:
                self.draft.move_to("device")
            raise

    def restore_weights(self) -> None:
        """Bring back what :meth:`offload_weights` moved to host memory (the shardings they left: the compiled
        steps keep their cache keys)."""
        self._move_target("device")
        if self.draft is not None and self.draft is not self.target and self.draft_on_device:
            self.draft.move_to("device")

    def check_weights(self, target: ModelHandle | None, draft: ModelHandle | None = None) -> list[tuple]:
        """A ``ValueError`` unless :meth:`load_weights` can take ``target`` and ``draft`` (None: kept): each of the
        loaded model's architecture. Changes nothing; returns the (current, new) handle pairs."""
        import dataclasses

        pairs = [(m, n) for m, n in ((self.target, target), (self.draft, draft)) if n is not None]
        for mine, new in pairs:
            if mine is None:
                raise ValueError("new draft weights for an engine without a draft")
            if dataclasses.replace(new.config, name=mine.config.name) != mine.config:
                from nightjar_jax.models.loader import config_differences

                raise ValueError(f"new weights for {mine.config.name} are of another architecture (theirs vs the "
                                 f"loaded model's: {', '.join(config_differences(new.config, mine.config))}); only "
                                 f"weights of the loaded model's config can replace its own")
        return pairs

    def load_weights(self, target: ModelHandle | None, draft: ModelHandle | None = None) -> bool:
        """Take ``target``'s (and ``draft``'s; None: keep) weights in place of the current ones, committed to the
        device. The same architecture is required (every config field but the name). With the same structure,
        shapes and dtypes no step recompiles; with another layout of the same model (e.g. float32 panels in place of
        a GGUF's 4-bit blocks, when the new values are not on its grid) the handle takes the new layout and every
        compiled variant is dropped: they compile again on first use. Returns whether that happened. Checks every
        pair before changing anything."""
        pairs = self.check_weights(target, draft)
        relayout = []
        for mine, new in pairs:
            same = new.treedef == mine.treedef and all(
                (x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(mine.leaves(), new.leaves(), strict=True))
            relayout.append(not same)
        for (mine, new), other in zip(pairs, relayout, strict=True):
            if other:  # (the jitted steps rebuild the state from the handle's current layout when they trace)
                for name in ("treedef", "_plan", "_layer_treedef", "_layer_paths"):
                    setattr(mine, name, getattr(new, name))
            mine.state = commit_to_device(new.state)
            mine._flat = mine._home = mine._embed_index = None
        if any(relayout):
            self.evict_compiled()
        return any(relayout)

    def lookahead(self, gamma: int) -> int:
        """Speculative positions a decode step at ``gamma`` writes past the committed tokens (γ, or the tree's
        nodes): the scheduler reserves pages for them."""
        return max(gamma, self.trees[gamma].num_nodes) if gamma in self.trees else gamma

    def max_lookahead(self) -> int:
        return max([self.gamma_max] + [t.num_nodes for t in self.trees.values()])

    # ---- jitted step functions --------------------------------------------------------------------------------
    def _build_jitted(self) -> None:
        t_hidden, t_logits = self.target.fns
        width = self.target.config.hidden_size
        fused = {"hidden_layers": self.feature_layers} if self.feature_layers else {}

        def target_pass(state, tokens, kv, md, feats):
            """The target's final hidden states [S, T, H] and K/V; with a feature pool, its features written there
            (a fused draft's: the residual stream after ``feature_layers`` too)."""
            if feats is None:
                hidden, kv = t_hidden(state, tokens, kv, md)
                return hidden, kv, feats
            hidden, kv = t_hidden(state, tokens, kv, md, **fused)
            feats = write_feature_pages(feats, hidden, md)
            return (hidden[..., -width:] if fused else hidden), kv, feats

        def forward_sample(leaves, kv, feats, tokens, block_tables, context_lens, query_lens, st, all_greedy,
                           num_logprobs=None, prompt_targets=None, num_prompt_logprobs=None):
            """... -> (next_tokens [S], kv, feats, (log-probabilities of next_tokens, of prompt_targets)), each None
            unless asked. ``num_logprobs`` / ``num_prompt_logprobs`` (static; None: off) are the top-k they carry
            (:func:`token_logprobs`); prompt_targets [S, T] int32: the token after each position (-1: none wanted),
            scored under the logits at that position."""
            state = self.target.unflatten(leaves)
            md = BatchMetadata(block_tables, context_lens, query_lens)
            hidden, kv, feats = target_pass(state, tokens, kv, md, feats)
            plp = None
            if num_prompt_logprobs is not None:  # every position's logits (T x the head's cost): opt-in
                plp = prompt_token_logprobs(lambda h: t_logits(state, h), hidden, prompt_targets, num_prompt_logprobs)
            raw = t_logits(state, hidden[:, -1])  # [S, V] f32
            logits = apply_penalties(apply_logit_bias(raw, st)[:, None], st)[:, 0]
            if all_greedy:
                next_tokens = argmax(logits)
            else:
                next_tokens = sample(logits, st, SALT_SAMPLE)
            lp = None if num_logprobs is None else token_logprobs(raw, next_tokens, num_logprobs)
            return next_tokens, kv, feats, (lp, plp)

        self._forward_sample = VariantJit(forward_sample, unkeyed_argnums=(0,), donate_argnums=(1, 2),
                                          static_argnums=(8,), static_argnames=("num_logprobs", "num_prompt_logprobs"))

        def migrate_pages(kv, src, dst):
            """Base pages ``dst`` [n] := extension pages ``src`` [n] (ids within the extension), every layer."""
            if isinstance(kv, StackedKV):
                return StackedKV(kv.k.at[:, :, dst].set(kv.k_ext[:, :, src]),
                                 kv.v.at[:, :, dst].set(kv.v_ext[:, :, src]), kv.k_ext, kv.v_ext)
            return tuple((k.at[:, dst].set(ke[:, src]), v.at[:, dst].set(ve[:, src]), ke, ve) for k, v, ke, ve in kv)

        self._migrate_pages = VariantJit(migrate_pages, donate_argnums=(0,))

        def verify(leaves, kv, feats, last_tokens, draft_tokens, draft_probs, copied, block_tables, context_lens, st,
                   all_greedy, num_logprobs=None):
            """last_tokens [S]; draft_tokens [S, γ]; context_lens [S] = n + γ; copied [S, γ] bool: drafts that
            n-gram lookup copied (their draft distribution is a point mass on the copied token). Returns (out
            [S, γ + 1], num_accepted [S], kv, feats, the log-probabilities of out under the target, or None)."""
            state = self.target.unflatten(leaves)
            tokens = jnp.concatenate([last_tokens[:, None], draft_tokens], axis=1)  # [S, γ + 1]
            query_lens = jnp.where(context_lens > 0, tokens.shape[1], 0).astype(jnp.int32)
            md = BatchMetadata(block_tables, context_lens, query_lens)
            # (features: only the accepted positions' are read later; the rest are overwritten first)
            hidden, kv, feats = target_pass(state, tokens, kv, md, feats)
            raw = t_logits(state, hidden)  # [S, γ + 1, V]
            logits = apply_penalties(apply_logit_bias(raw, st), st, tokens, chain_prefixes(tokens.shape[1]))
            logits = apply_allowed(logits, st)
            if all_greedy:
                out, num_accepted = greedy_verify(draft_tokens, logits, st.max_accept)
            else:
                target_probs = processed_probs(logits, st)
                point_mass = jax.nn.one_hot(draft_tokens, target_probs.shape[-1], dtype=jnp.float32)
                # (draft-free n-gram speculation has no draft distribution: every draft is a copy, or capped by
                # st.max_accept where there is none)
                draft_probs = point_mass if draft_probs is None else jnp.where(copied[..., None], point_mass,
                                                                              draft_probs)
                out, num_accepted = rejection_sample(draft_tokens, draft_probs, target_probs, st, salt=SALT_VERIFY,
                                                     plain=exact_plain_draws(logits, st))
                out = as_plain_steps(out, logits[:, 0], st)
            # out[:, j] (j <= num_accepted) is the target's token after position j, under logits[:, j]
            lp = None if num_logprobs is None else token_logprobs(raw, out, num_logprobs)
            return out, num_accepted, kv, feats, lp

        self._verify = VariantJit(verify, unkeyed_argnums=(0,), donate_argnums=(1, 2), static_argnums=(10,),
                                  static_argnames=("num_logprobs",))
        if self.draft is None:
            return
        d_hidden, d_logits = self.draft.fns

        def draft_inputs(feats, embed, md, q_len):
            """A feature draft's extra inputs for slots read from the stored target features (else none)."""
            if feats is None:
                return {}
            return {"features": read_previous_features(feats, md, q_len), "embed_table": embed}

        def draft_fill(leaves, kv, feats, embed, tokens, block_tables, context_lens, query_lens):
            state = self.draft.unflatten(leaves)
            md = BatchMetadata(block_tables, context_lens, query_lens)
            _, kv = d_hidden(state, tokens, kv, md, **draft_inputs(feats, embed, md, tokens.shape[1]))
            return kv

        def propose(leaves, kv, feats, embed, tokens, first_lens, block_tables, context_lens, st, gamma, all_greedy):
            """tokens [S, W]: the committed tokens the draft has not run yet, right-aligned (``first_lens`` [S] of
            them; a token draft re-runs the last two, W = 2); context_lens [S] = committed tokens n.

            A feature draft's first step reads the target's stored features; each later step is fed the draft's
            own output for the previous position (the target has not run there yet). ``st.allowed`` [S, 1, V]
            (structured outputs' next-token masks; None: none) bans tokens at the first drafted position only."""
            state = self.draft.unflatten(leaves)
            num_seqs = tokens.shape[0]
            vocab = self.draft.config.vocab_size
            real = (context_lens > 0).astype(jnp.int32)  # [S]: 0 for padding rows

            def draft_step(i, tok_in, q_lens, kv, extra):
                md = BatchMetadata(block_tables, context_lens + i * real, q_lens)
                hidden, kv = d_hidden(state, tok_in, kv, md, **extra)
                logits = apply_penalties(apply_logit_bias(d_logits(state, hidden[:, -1]), st)[:, None], st)[:, 0]
                if isinstance(i, int) and i == 0 and st.allowed is not None:  # (the first step: before the loop)
                    logits = apply_allowed(logits[:, None], st)[:, 0]
                feature = hidden[:, -1:] if feats is not None else None
                if all_greedy:
                    return argmax(logits), None, kv, feature
                tok, probs = draft_sample(logits, st, SALT_DRAFT + i, position=i)
                return tok, probs, kv, feature

            md0 = BatchMetadata(block_tables, context_lens, first_lens)
            tok, probs, kv, feature = draft_step(0, tokens, first_lens, kv,
                                                 draft_inputs(feats, embed, md0, tokens.shape[1]))
            draft_tokens = jnp.zeros((num_seqs, gamma), jnp.int32).at[:, 0].set(tok)
            draft_probs = None
            if not all_greedy:
                draft_probs = jnp.zeros((num_seqs, gamma, vocab), jnp.float32).at[:, 0].set(probs)

            def body(i, carry):
                draft_tokens, draft_probs, kv, feature = carry
                prev = jax.lax.dynamic_slice_in_dim(draft_tokens, i - 1, 1, axis=1)  # [S, 1]
                extra = {} if feature is None else {"features": feature, "embed_table": embed}
                tok, probs, kv, feature = draft_step(i, prev, real, kv, extra)
                draft_tokens = jax.lax.dynamic_update_slice_in_dim(draft_tokens, tok[:, None], i, axis=1)
                if draft_probs is not None:
                    draft_probs = jax.lax.dynamic_update_slice_in_dim(draft_probs, probs[:, None], i, axis=1)
                return draft_tokens, draft_probs, kv, feature

            draft_tokens, draft_probs, kv, _ = jax.lax.fori_loop(
                1, gamma, body, (draft_tokens, draft_probs, kv, feature)
            )
            return draft_tokens, draft_probs, kv

        def propose_tree(leaves, kv, feats, embed, tokens, first_lens, block_tables, context_lens, copy_tokens, st,
                         gamma):
            """Greedy drafts for the static tree at ``gamma`` -> node tokens [S, N] in tree order. The first step is
            ``propose``'s (the committed tokens the draft has not run, ending at the root, slot n - 1); then one
            draft pass per depth over that depth's nodes, each at KV slot n - 1 + i, rotated as position
            n - 1 + depth, seeing the committed tokens and its ancestors (tree mask), fed its parent's output
            feature (a feature draft). A node's children are its parent's top-ranked draft tokens; the copy
            branch's nodes (``tree.copy_depth`` of them, first in their levels) take ``copy_tokens`` [S, copy
            depth] (n-gram lookup's, from the host) instead. The ranks are those of the draft's logits with each
            row's bias (``st``: its logit_bias, and penalties over the committed tokens; ``st.allowed`` [S, 1, V],
            structured outputs' next-token masks, for the root's candidates)."""
            tree = self.trees[gamma]
            state = self.draft.unflatten(leaves)
            real = (context_lens > 0).astype(jnp.int32)
            md0 = BatchMetadata(block_tables, context_lens, first_lens)
            hidden, kv = d_hidden(state, tokens, kv, md0, **draft_inputs(feats, embed, md0, tokens.shape[1]))
            outs = hidden[:, -1:]  # [S, nodes of the level just run, H]: the root's output
            node_tokens = []
            for d in range(1, tree.depth + 1):
                level, above = tree.level(d), tree.level(d - 1)
                parents = np.asarray([tree.parent[i] - above.start for i in level])
                ranked = np.asarray([i - level.start for i in tree.ranked(d)], np.int64)
                toks = []
                if d <= tree.copy_depth:
                    toks.append(copy_tokens[:, d - 1 : d].astype(jnp.int32))
                if len(ranked):
                    # the draft's head runs only over the nodes of the level above that have ranked children
                    # (60 nodes: 25 head rows per step instead of 47)
                    expanded, parent_row = np.unique(parents[ranked], return_inverse=True)
                    logits = apply_penalties(apply_logit_bias(d_logits(state, outs[:, expanded]), st), st)
                    if d == 1:  # (the root's candidates: under structured outputs' next-token masks, if any)
                        logits = apply_allowed(logits, st)
                    top = top_k_ids(logits, tree.top_k(d - 1))  # [S, |expanded|, k]
                    toks.append(top[:, parent_row, tree.rank[level.start + ranked]].astype(jnp.int32))
                toks = jnp.concatenate(toks, axis=1)  # [S, |level|]
                node_tokens.append(toks)
                if d == tree.depth:
                    break
                md = BatchMetadata(
                    block_tables, (context_lens + level.stop - 1) * real, real * len(level),
                    tree_mask=jnp.asarray(tree.ancestors[level.start : level.stop, 1 : level.stop]),
                    rope_offsets=jnp.asarray(np.arange(level.start, level.stop) - d, jnp.int32),
                )
                extra = {} if feats is None else {"features": outs[:, parents], "embed_table": embed}
                outs, kv = d_hidden(state, toks, kv, md, **extra)
            return jnp.concatenate(node_tokens, axis=1), kv

        def verify_tree(leaves, kv, feats, last_tokens, node_tokens, copy_valid, block_tables, context_lens, st,
                        gamma, all_greedy, num_logprobs=None):
            """One target pass over the root and the tree's nodes (tree mask; context_lens = n + N), acceptance
            (greedy: the deepest agreeing branch; sampled: recursive rejection sampling down the tree, lossless), then
            the accepted branch's K/V (and features) moved from the nodes' slots n - 1 + i to positions
            n .. n + k - 1. ``copy_valid`` [S, copy depth]: the copy branch's nodes a row may accept (it copied a
            token there). ``st.allowed`` [S, N + 1, V] (None: none): structured outputs' masks, node i's row for
            the token after its branch (``TokenConstraint.walk``)."""
            tree = self.trees[gamma]
            num_nodes = tree.num_nodes
            state = self.target.unflatten(leaves)
            tokens = jnp.concatenate([last_tokens[:, None], node_tokens], axis=1)  # [S, N + 1]
            real = context_lens > 0
            md = BatchMetadata(
                block_tables, context_lens, jnp.where(real, num_nodes + 1, 0).astype(jnp.int32),
                tree_mask=jnp.asarray(tree.ancestors),
                rope_offsets=jnp.asarray(np.arange(num_nodes + 1) - tree.depth_of, jnp.int32),
            )
            hidden, kv, feats = target_pass(state, tokens, kv, md, feats)
            raw = t_logits(state, hidden)  # [S, N + 1, V]
            logits = apply_allowed(apply_penalties(apply_logit_bias(raw, st), st, tokens, tree.prefixes), st)
            n = context_lens - num_nodes  # committed tokens
            slots = n[:, None] - 1 + jnp.arange(num_nodes + 1)[None, :]
            valid = slots < self.max_model_len
            if tree.copy_depth:
                copy_nodes = np.asarray([tree.level_starts[d] for d in range(1, tree.copy_depth + 1)])
                valid = valid.at[:, copy_nodes].set(valid[:, copy_nodes] & copy_valid)
            if st.max_accept is not None:  # no node deeper than a row may accept
                valid = valid & (jnp.asarray(tree.depth_of)[None, :] <= st.max_accept[:, None])
            if all_greedy:
                out, num_accepted, path = tree_greedy_verify(tokens, argmax(logits), valid, tree)
            else:
                out, num_accepted, path = tree_rejection_sample(tokens, logits, valid, tree, st)
                out = as_plain_steps(out, logits[:, 0], st)
            depth = jnp.arange(1, tree.depth + 1)[None, :]
            keep = depth <= num_accepted[:, None]
            src = jnp.where(keep, n[:, None] - 1 + path[:, 1:], n[:, None] - 1 + depth)  # [S, depth]
            dst = n[:, None] - 1 + depth
            kv, feats = move_slots(kv, feats, src, dst, block_tables, real)
            lp = None
            if num_logprobs is not None:  # out[:, j] is the target's token after the branch's node path[:, j]
                branch_logits = jnp.take_along_axis(raw, path[:, :, None], axis=1)  # [S, depth + 1, V]
                lp = token_logprobs(branch_logits, out, num_logprobs)
            return out, num_accepted, kv, feats, lp

        def move_slots(kv, feats, src, dst, block_tables, real):
            """Copy every layer's K/V (and the feature pool's rows) from positions ``src`` to ``dst`` [S, m]
            (padding rows: page 0)."""
            sp, so = position_pages(block_tables, src, real[:, None] & (src >= 0), kv_page_size(kv))
            dp, do = position_pages(block_tables, dst, real[:, None] & (dst >= 0), kv_page_size(kv))

            def move(p, ext, lead):  # p [..lead.., pages, page, dim] and its extension (None: none)
                pre = (slice(None),) * lead
                rows = split_take(lambda a, ids: a[(*pre, ids, so)], p, ext, sp, lead)
                if ext is None:
                    return p.at[(*pre, dp, do)].set(rows), None
                db, de = split_page_ids(dp, p.shape[-3], ext.shape[-3])
                return p.at[(*pre, db, do)].set(rows, mode="drop"), ext.at[(*pre, de, do)].set(rows, mode="drop")

            if isinstance(kv, StackedKV):  # every layer at once
                (k, ke), (v, ve) = move(kv.k, kv.k_ext, 2), move(kv.v, kv.v_ext, 2)
                moved = StackedKV(k, v, ke, ve)
            else:
                moved = []
                for layer in kv:
                    ext = layer[2:] or (None, None)
                    (k, ke), (v, ve) = move(layer[0], ext[0], 1), move(layer[1], ext[1], 1)
                    moved.append((k, v) if ke is None else (k, v, ke, ve))
                moved = tuple(moved)
            if feats is not None:
                feats = feats.at[dp, do].set(feats[sp, so])
            return moved, feats

        self._propose_tree = VariantJit(propose_tree, unkeyed_argnums=(0,), donate_argnums=(1,), static_argnums=(10,))
        self._verify_tree = VariantJit(verify_tree, unkeyed_argnums=(0,), donate_argnums=(1, 2), static_argnums=(9, 10),
                                       static_argnames=("num_logprobs",))
        self._draft_fill = VariantJit(draft_fill, unkeyed_argnums=(0,), donate_argnums=(1,))
        self._propose = VariantJit(propose, unkeyed_argnums=(0,), donate_argnums=(1,), static_argnums=(9, 10))

    # ---- host-side batch assembly -------------------------------------------------------------------------------
    def _block_tables(self, requests: list[Request], num_rows: int, lookahead: int = 0) -> np.ndarray:
        """``[num_rows, width]`` int32 page ids (0 = padding page); ``width`` covers every position written or read
        this step (up to ``num_tokens + lookahead``)."""
        needed = max(
            (max(len(r.block_table), -(-(r.num_tokens + lookahead + 1) // self.page_size)) for r in requests),
            default=1,
        )
        width = bucket_for(min(needed, self.shapes.max_pages_per_seq), self.shapes.page_buckets)
        bt = np.zeros((num_rows, width), np.int32)
        for i, r in enumerate(requests):
            bt[i, : len(r.block_table)] = r.block_table
        return bt

    def _sampling_tensors(self, requests: list[Request], num_rows: int, grammar_masks: bool = True) -> SamplingTensors:
        """The batch's sampling tensors. ``grammar_masks``: a structured output's next-token mask in its dense bias
        (else a speculative step applies one per position after its drafts are known: :meth:`_walk_constraints`)."""
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        steps = np.zeros(num_rows, np.int32)
        # seeded sampled rows: their speculative steps commit exactly plain decoding's tokens (SamplingTensors.exact)
        exact = np.zeros(num_rows, bool)
        # the drafts a row may accept (Request.draft_limit): under min_tokens those that keep it under (always an
        # array: one structure, no step variant more)
        max_accept = np.full(num_rows, NO_ACCEPT_LIMIT, np.int32)
        vocab = self.target.config.vocab_size
        for i, r in enumerate(requests):
            sp = r.sampling
            # (top_k >= V keeps every token, as 0 does: clamped, any Python int fits the int32 column)
            temperature[i], top_k[i], top_p[i], min_p[i] = sp.temperature, min(sp.top_k, vocab), sp.top_p, sp.min_p
            seeds[i] = r.seed  # (folded to 32 bits when the request was added)
            exact[i] = sp.seed is not None and sp.temperature > 0
            steps[i] = len(r.output_token_ids)
            if r.draft_limit is not None:
                max_accept[i] = r.draft_limit
        bias_ids = bias_values = None
        biases = [_row_bias(r) for r in requests]
        widest = max((len(b) for b in biases), default=0)
        # penalties: each row's factors and counts, applied on the device (apply_penalties, which a verify extends
        # with each position's drafts)
        penalties = None
        if any(r.sampling.has_penalties for r in requests):
            penalties = Penalties(np.zeros(num_rows, np.float32), np.zeros(num_rows, np.float32),
                                  np.ones(num_rows, np.float32), np.zeros((num_rows, vocab), np.int32),
                                  np.zeros((num_rows, vocab), bool))
            for i, r in enumerate(requests):
                sp = r.sampling
                if sp.has_penalties:
                    penalties.presence[i], penalties.frequency[i] = sp.presence_penalty, sp.frequency_penalty
                    penalties.repetition[i] = sp.repetition_penalty
                    if r.output_counts:
                        penalties.counts[i, list(r.output_counts)] = list(r.output_counts.values())
                    if sp.repetition_penalty != 1:
                        penalties.prompt[i, r.prompt_token_ids] = True
        # structured outputs' constraints and allowed_token_ids: one dense [S, V] bias (a shape that never grows),
        # the logit biases in it
        if any(r.grammar is not None or r.sampling.allowed_token_ids for r in requests):
            dense = np.zeros((num_rows, vocab), np.float32)
            for i, r in enumerate(requests):
                for token, value in biases[i].items():
                    dense[i, token] += value
                if r.grammar is not None and grammar_masks:  # only the tokens its constraint allows next
                    dense[i, ~r.grammar.allowed()] = BANNED
                if r.sampling.allowed_token_ids:  # at every position: the draft's and the verify's alike
                    banned = np.ones(vocab, bool)
                    banned[r.sampling.allowed_token_ids] = False
                    dense[i, banned] = BANNED
            return SamplingTensors(temperature, top_k, top_p, min_p, seeds, steps, None, dense, max_accept, penalties,
                                   exact=exact)
        if widest:  # a static width per batch: powers of two from 8 (a few variants, compiled on first use)
            width = max(8, next_power_of_two(widest))
            bias_ids, bias_values = np.zeros((num_rows, width), np.int32), np.zeros((num_rows, width), np.float32)
            for i, bias in enumerate(biases):
                for j, (token, value) in enumerate(bias.items()):
                    bias_ids[i, j], bias_values[i, j] = token, value
        return SamplingTensors(temperature, top_k, top_p, min_p, seeds, steps, bias_ids, bias_values, max_accept,
                               penalties, exact=exact)

    def _walk_constraints(self, requests: list[Request], drafts: np.ndarray, st: SamplingTensors,
                          tree: SpecTree | None, first_masks: np.ndarray) -> SamplingTensors:
        """``st`` for a verify with structured outputs: each such row's allowed tokens at every position
        (``TokenConstraint.walk`` over its drafts ``drafts`` [S, γ], or over its tree's node tokens [S, N] along
        ``tree``'s branches). The first draft of a branch the constraint refuses is banned by its parent's mask, so
        the verify rejects it and draws from the residual, as rejection sampling must; what follows it (all tokens
        allowed: no mask) is never reached. No limit on the row's accepted drafts: one at that draft would draw
        from the target's distribution instead of the residual, biased, since whether it applies depends on the
        sampled draft. ``first_masks`` [S, 1, V]: the next-token masks the draft proposed under, reused."""
        allowed = np.ones((drafts.shape[0], drafts.shape[1] + 1, self.target.config.vocab_size), bool)
        children = None if tree is None else tree.children
        for i, r in enumerate(requests):
            if r.grammar is not None:
                allowed[i] = r.grammar.walk(drafts[i], first_masks[i, 0], children)
        return st._replace(allowed=allowed)

    # ---- steps --------------------------------------------------------------------------------------------------
    def execute_prefill(self, batch: ScheduledBatch) -> PrefillResult:
        """Run prefill chunks: the sampled token per request ``[num_seqs]`` and, when a request asked, their
        log-probabilities (:func:`host_logprobs`; both meaningful only for requests whose chunk reached the end of
        their tokens), and the log-probabilities of the prompt tokens each chunk scored."""
        num_rows = bucket_for(batch.num_seqs, self.shapes.prefill_seq_buckets)
        q_len = bucket_for(max(batch.num_new_tokens), self.shapes.prefill_len_buckets)
        tokens = np.zeros((num_rows, q_len), np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        query_lens = np.zeros(num_rows, np.int32)
        prompt_arg = _logprobs_arg(batch.requests, "prompt_logprobs")
        targets = np.full((num_rows, q_len), -1, np.int32) if prompt_arg else None
        scored: list[list[int]] = []  # per request: the prompt positions (token indices) its chunk scores
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            start = r.num_computed
            tokens[i, q_len - n :] = r.all_token_ids[start : start + n]  # right-aligned (left padding)
            context_lens[i] = start + n
            query_lens[i] = n
            # position p's logits score prompt token p + 1: the chunk's positions whose next token is a prompt token
            # (after a preemption a recomputed chunk scores them again; the engine keeps the first values)
            wanted = list(range(start + 1, min(start + n, r.num_prompt_tokens - 1) + 1))
            scored.append(wanted if r.sampling.prompt_logprobs is not None else [])
            if targets is not None and scored[-1]:
                targets[i, q_len - n : q_len - n + len(wanted)] = [r.prompt_token_ids[j] for j in wanted]
        if prompt_arg:
            prompt_arg["prompt_targets"] = targets
        out, logprobs, plp = self._run_forward_sample(batch.requests, tokens, context_lens, query_lens, num_rows,
                                                      **prompt_arg)
        prompt = None
        if plp is not None:
            ids = [[r.prompt_token_ids[j] for j in w] for r, w in zip(batch.requests, scored, strict=True)]
            cols = [[q_len - n + j for j in range(len(w))] for n, w in zip(batch.num_new_tokens, scored, strict=True)]
            entries = host_logprobs(plp, batch.requests, ids, "prompt_logprobs", cols)
            prompt = [None if e is None else list(zip(w, e, strict=True)) for w, e in zip(scored, entries, strict=True)]
        return PrefillResult(out, logprobs, prompt)

    def _run_forward_sample(self, requests, tokens, context_lens, query_lens, num_rows, **prompt_arg):
        """-> (next token per request [num_seqs], log-probabilities per request or None, the prompt's device
        log-probabilities or None)."""
        all_greedy = all(r.sampling.greedy for r in requests)
        st = self._sampling_tensors(requests, num_rows)
        bt = self._block_tables(requests, num_rows)
        next_tokens, self.kv, self.features, (lp, plp) = self._forward_sample(
            self.target.leaves(), self.kv, self.features, tokens, bt, context_lens, query_lens, st, all_greedy,
            **_logprobs_arg(requests), **prompt_arg,
        )
        out = np.asarray(next_tokens)[: len(requests)]
        return out, host_logprobs(lp, requests, [[int(t)] for t in out]), plp

    def execute_decode(self, batch: ScheduledBatch, gamma: int) -> DecodeResult:
        """One decode step at speculative length ``gamma`` (0: plain autoregressive)."""
        requests = batch.requests
        num_rows = bucket_for(len(requests), self.shapes.decode_buckets)
        if gamma == 0 or (self.draft is None and not self.ngram_only):
            t0 = time.perf_counter()
            tokens = np.zeros((num_rows, 1), np.int32)
            context_lens = np.zeros(num_rows, np.int32)
            for i, r in enumerate(requests):
                tokens[i, 0] = r.token_at(r.num_tokens - 1)
                context_lens[i] = r.num_tokens
            query_lens = (context_lens > 0).astype(np.int32)
            out, logprobs, _ = self._run_forward_sample(requests, tokens, context_lens, query_lens, num_rows)
            return DecodeResult([[int(t)] for t in out], 0, 0, [0] * len(requests),
                                verify_seconds=time.perf_counter() - t0, logprobs=logprobs)
        if gamma > self.gamma_max:
            raise ValueError(f"gamma={gamma} exceeds the compiled maximum {self.gamma_max}")
        if self.draft is not None and not self.draft_on_device:
            raise RuntimeError(f"a decode step at gamma={gamma} needs the draft, which is offloaded to host memory")

        looked_up = self._lookup_drafts(requests, gamma) if self.lookup is not None else None
        # Every row greedy and copying all γ drafts: the draft model does not run this step (its catch-up and first
        # step next time cover the tokens it skips; greedy verification needs no draft probabilities), and the step
        # verifies the copied chain even where γ has a token tree. Without a draft model (ngram_only) every step is
        # such a step, each row's drafts its copies, capped at their number (none where lookup found nothing).
        skip_draft = self.ngram_only or (looked_up is not None and _copies_everything(looked_up, requests, gamma))
        tree = None if skip_draft else self.trees.get(gamma)
        if tree is not None and batch.lookahead < tree.num_nodes:
            raise RuntimeError(f"a tree step at gamma={gamma} writes {tree.num_nodes} positions ahead but the "
                               f"scheduler reserved {batch.lookahead}")
        t0 = time.perf_counter()  # (after the lookup: catch-up seconds are the draft's alone, as the planner reads)
        width = self.first_step_width(gamma)
        catchup_tokens = 0 if skip_draft else self.catch_up_draft(requests, keep=width)
        t1 = time.perf_counter()

        all_greedy = all(r.sampling.greedy for r in requests)
        # a step walks a structured output's drafts (a chain's, or a tree's branches) through its constraint; its
        # draft proposes the first token (a tree: the root's candidates) under the constraint's mask, the rest
        # without one
        walk = any(r.grammar is not None for r in requests)
        st = self._sampling_tensors(requests, num_rows, grammar_masks=not walk)
        if self.ngram_only:  # a row accepts at most the tokens lookup copied for it
            copies = np.zeros(num_rows, np.int32)
            copies[: len(requests)] = [len(p) for p in looked_up]
            np.minimum(st.max_accept, copies, out=st.max_accept)
        draft_st, first_masks = st, None
        if walk:  # the draft's first proposal under the constraint's next-token mask
            first_masks = np.ones((num_rows, 1, self.target.config.vocab_size), bool)
            for i, r in enumerate(requests):
                if r.grammar is not None:
                    first_masks[i, 0] = r.grammar.allowed()
            draft_st = st._replace(allowed=first_masks)
        bt = self._block_tables(requests, num_rows, lookahead=gamma if tree is None else tree.num_nodes)
        first = np.zeros((num_rows, width), np.int32)  # right-aligned tokens the draft has not run yet
        first_lens = np.zeros(num_rows, np.int32)
        n = np.zeros(num_rows, np.int32)
        for i, r in enumerate(requests):
            m = width if not self.feature_draft else r.num_tokens - r.num_draft_computed  # 1 .. width
            m = min(m, width)  # (more only when this step and the last skip the draft: only first[:, -1] is read)
            first[i, width - m :] = [r.token_at(j) for j in range(r.num_tokens - m, r.num_tokens)]
            first_lens[i] = m
            n[i] = r.num_tokens
        draft_probs = None
        if skip_draft:
            draft_tokens = np.zeros((num_rows, gamma), np.int32)
        elif tree is not None:
            # the copy branch (with lookup on): each row's copied tokens, valid up to its match's length
            copy_tokens = np.zeros((num_rows, tree.copy_depth), np.int32)
            copy_valid = np.zeros((num_rows, tree.copy_depth), bool)
            for i, prop in enumerate(looked_up or []):
                copy_tokens[i, : len(prop)] = prop  # (at most γ = copy depth tokens)
                copy_valid[i, : len(prop)] = True
            draft_tokens, self.draft_kv = self._propose_tree(
                self.draft.leaves(), self.draft_kv, self.features, self._embed(), first, first_lens, bt, n,
                copy_tokens, draft_st, gamma,
            )
        else:
            draft_tokens, draft_probs, self.draft_kv = self._propose(
                self.draft.leaves(), self.draft_kv, self.features, self._embed(), first, first_lens, bt, n, draft_st,
                gamma, all_greedy,
            )
        if not skip_draft:
            draft_tokens.block_until_ready()
        copied = np.zeros((num_rows, gamma), bool)
        if tree is None and looked_up is not None and any(looked_up):
            drafts = np.array(draft_tokens)
            for i, prop in enumerate(looked_up):
                drafts[i, : len(prop)] = prop  # a shorter match keeps the draft's tokens after it (rarely accepted)
                copied[i, : len(prop)] = True
            # placed as the draft's own tokens were (committed to the device): jit keys its executables on that, so
            # a host array here would compile a second verify variant that no warm-up builds
            draft_tokens = drafts if skip_draft else jax.device_put(drafts, draft_tokens.sharding)
        if walk:
            st = self._walk_constraints(requests, np.asarray(draft_tokens), st, tree, first_masks)
        t2 = time.perf_counter()
        drafted = gamma if tree is None else tree.num_nodes
        verify_lens = np.where(n > 0, n + drafted, 0).astype(np.int32)
        if tree is not None:
            out, num_accepted, self.kv, self.features, lp = self._verify_tree(
                self.target.leaves(), self.kv, self.features, first[:, -1], draft_tokens, copy_valid, bt, verify_lens,
                st, gamma, all_greedy, **_logprobs_arg(requests),
            )
        else:
            out, num_accepted, self.kv, self.features, lp = self._verify(
                self.target.leaves(), self.kv, self.features, first[:, -1], draft_tokens, draft_probs, copied, bt,
                verify_lens, st, all_greedy, **_logprobs_arg(requests),
            )
        out_np, acc_np = np.asarray(out), np.asarray(num_accepted)
        t3 = time.perf_counter()
        committed, accepted = [], []
        for i, r in enumerate(requests):
            k = int(acc_np[i])
            committed.append([int(t) for t in out_np[i, : k + 1]])
            accepted.append(k)
            # A token draft's KV now holds positions up to n - 1 + min(k, γ - 1); a feature draft's only up to
            # n - 1: its later slots were fed its own features, not the target's (see docs/architecture.md). After
            # a tree, either draft's KV holds n - 1: the accepted branch's draft entries sit at the nodes' slots.
            # A token draft's KV past n - 1 holds its own drafts, not the copied ones of a lookup row: run again.
            # After a step without the draft, it has run nothing new.
            if skip_draft:
                continue
            chain_kept = 0 if (self.feature_draft or tree is not None or copied[i, 0]) else min(k, gamma - 1)
            r.num_draft_computed = int(n[i]) + chain_kept
        # rows that could accept no draft: by rule, or (draft-free) with nothing copied
        plain = [r.accepts_no_drafts or (self.ngram_only and not looked_up[i]) for i, r in enumerate(requests)]
        return DecodeResult(
            committed, gamma, drafted * (len(requests) - sum(plain)), accepted,
            draft_seconds=t2 - t1, verify_seconds=t3 - t2, catchup_seconds=t1 - t0, catchup_tokens=catchup_tokens,
            tree_nodes=0 if tree is None else tree.num_nodes,
            lookup=None if looked_up is None else [bool(p) for p in looked_up],
            logprobs=host_logprobs(lp, requests, committed), plain_rows=plain if any(plain) else None,
        )

    def lookup_covers(self, requests: list[Request], gamma: int) -> bool:
        """Whether a chain step at ``gamma`` would copy all γ drafts of every request, each greedy: a step the draft
        model skips (``execute_decode``)."""
        if self.lookup is None or not requests:
            return False
        return _copies_everything(self._lookup_drafts(requests, gamma), requests, gamma)

    def _lookup_drafts(self, requests: list[Request], gamma: int) -> list[list[int]]:
        """Per request, the n-gram lookup drafts (up to γ tokens; ``nightjar_jax/spec/lookup.py``), [] where it has
        no match. Lossless for every request: greedy verification compares drafts with the target's argmax, and
        rejection sampling takes a copied token as a draw from a point mass on it (accepted with probability p(t),
        else a draw from p without t); a shorter copy's later positions keep the draft's own draws and
        distributions, valid proposals whatever precedes them."""
        out: list[list[int]] = []
        for r in requests:
            if r.lookup_index is None:
                r.lookup_index = NgramIndex(*self.lookup)
            index = r.lookup_index
            index.extend([r.token_at(j) for j in range(len(index), r.num_tokens)])  # only what is new
            out.append(index.propose(gamma))
        return out

    def first_step_width(self, gamma: int) -> int:
        """Tokens ``propose`` runs in its first draft step: a token draft re-runs the last two committed tokens; a
        feature draft runs every committed token it has not run with the target's features, up to γ + 1 (the
        accepted drafts and the target's token of the previous step)."""
        return gamma + 1 if self.feature_draft else 2

    def _embed(self) -> jax.Array | None:
        return self.target.embedding() if self.feature_draft else None

    def catch_up_draft(self, requests: list[Request], keep: int = 2) -> int:
        """Run the draft over committed tokens it has not seen, up to (not including) the last ``keep``, which the
        next ``propose`` processes itself. Returns the number of tokens processed."""
        total = 0
        budget = self.shapes.prefill_len_buckets[-1]
        while True:
            todo = [(r, r.num_tokens - keep - r.num_draft_computed) for r in requests]
            todo = [(r, m) for r, m in todo if m > 0]
            if not todo:
                return total
            todo = todo[: self.shapes.prefill_seq_buckets[-1]]
            num_rows = bucket_for(len(todo), self.shapes.prefill_seq_buckets)
            chunk = min(budget, max(m for _, m in todo))
            q_len = bucket_for(chunk, self.shapes.prefill_len_buckets)
            tokens = np.zeros((num_rows, q_len), np.int32)
            context_lens = np.zeros(num_rows, np.int32)
            query_lens = np.zeros(num_rows, np.int32)
            rows = [r for r, _ in todo]
            for i, (r, m) in enumerate(todo):
                c = min(m, chunk)
                start = r.num_draft_computed
                tokens[i, q_len - c :] = r.all_token_ids[start : start + c]
                context_lens[i] = start + c
                query_lens[i] = c
                r.num_draft_computed += c
                total += c
            bt = self._block_tables(rows, num_rows)
            self.draft_kv = self._draft_fill(
                self.draft.leaves(), self.draft_kv, self.features, self._embed(), tokens, bt, context_lens, query_lens
            )

    # ---- compilation ----------------------------------------------------------------------------------------------
    def warmup_widths(self, max_context: int | None = None) -> list[int]:
        """Block-table widths a batch reaches with contexts up to ``max_context`` (default ``max_model_len``)."""
        limit = -(-((max_context or self.max_model_len) + self.max_lookahead() + 1) // self.page_size)
        top = bucket_for(min(limit, self.shapes.max_pages_per_seq), self.shapes.page_buckets)
        return [w for w in self.shapes.page_buckets if w <= top]

    def warmup(
        self,
        batch_sizes: list[int] | None = None,
        gammas: list[int] | None = None,
        sampled: bool = True,
        max_context: int | None = None,
        progress=None,
    ) -> list[tuple]:
        """Compile the decode variants ahead of time by running them on padding-only batches (every write lands
        on the reserved page 0, so no real state changes): every batch bucket, γ, greedy/sampled mode and
        block-table width up to the one covering ``max_context`` tokens (default: ``max_model_len``).
        Returns the variant keys compiled. Stops early, with a warning, when the process runs short of memory
        maps (:meth:`maps_short`; ``self.warmup_stopped`` then says why)."""
        return self._stopping_when_maps_short(self._warmup_decode, batch_sizes, gammas, sampled, max_context,
                                              progress)

    def _stopping_when_maps_short(self, fn, *args) -> list[tuple]:
        """``fn(keys, *args)``, which appends the variant keys it compiles to ``keys``; returns them, also when it
        stopped because memory maps ran short."""
        keys: list[tuple] = []
        try:
            fn(keys, *args)
        except _MapsShort as stop:
            self.warmup_stopped = str(stop)
            logger.warning("warm-up stopped after %d variants: %s", len(keys), stop)
        return keys

    def _tick(self, progress) -> None:
        """One warm-up shape done: report it, and stop the warm-up if memory maps run short."""
        if progress is not None:
            progress()
        short = self.maps_short(WARMUP_MAP_SHARE)
        if short:
            raise _MapsShort(short)

    @staticmethod
    def map_usage() -> tuple[int, int] | None:
        """:func:`memory_map_usage`: the process's memory maps and the limit (None: unknown)."""
        return memory_map_usage()

    def maps_short(self, share: float) -> str | None:
        """Why compiling more variants is unsafe, or None. On the CPU backend XLA maps every kernel of a compiled
        executable into memory separately (~250 maps for a SmolLM2 step variant), and once a process holds
        ``vm.max_map_count`` maps (65530 by default on Linux) the next compile fails with "LLVM compilation error:
        Cannot allocate memory" and the process dies. Past ``share`` of the limit this says so."""
        if jax.default_backend() != "cpu":
            return None
        usage = memory_map_usage()
        if usage is None or usage[0] < share * usage[1]:
            return None
        return (f"{usage[0]} of this process's {usage[1]} memory maps (vm.max_map_count) are in use, ~250 per "
                f"compiled step variant on the CPU backend, and a compile past the limit kills the process: raise "
                f"it (sysctl -w vm.max_map_count=262144) or compile fewer variants (fewer --max-num-seqs / "
                f"--max-num-batched-tokens buckets, --warmup request)")

    def _warmup_decode(self, keys, batch_sizes, gammas, sampled, max_context, progress) -> None:
        sizes = batch_sizes or self.shapes.decode_buckets
        gammas = list(range(self.gamma_max + 1)) if gammas is None else gammas
        modes = [True, False] if sampled else [True]
        widths = self.warmup_widths(max_context)
        for num_rows in sizes:
            zeros = np.zeros(num_rows, np.int32)
            st = self._sampling_tensors([], num_rows)
            for width in widths:
                bt = np.zeros((num_rows, width), np.int32)
                for all_greedy in modes:
                    for gamma in gammas:
                        if gamma == 0:
                            _, self.kv, self.features, _ = self._forward_sample(
                                self.target.leaves(), self.kv, self.features, np.zeros((num_rows, 1), np.int32), bt,
                                zeros, zeros, st, all_greedy,
                            )
                            keys.append(("forward_sample", num_rows, 1, width, all_greedy))
                        elif self.ngram_only:  # no draft pass: copied drafts from the host, no probabilities
                            out, _, self.kv, self.features, _ = self._verify(
                                self.target.leaves(), self.kv, self.features, zeros,
                                np.zeros((num_rows, gamma), np.int32), None, np.ones((num_rows, gamma), bool),
                                bt, zeros, st, all_greedy,
                            )
                            out.block_until_ready()
                            keys.append(("verify", num_rows, gamma, width, all_greedy, "copied"))
                        elif gamma in self.trees:  # a configured tree replaces the chain at this γ
                            first = np.zeros((num_rows, self.first_step_width(gamma)), np.int32)
                            no_copy = np.zeros((num_rows, self.trees[gamma].copy_depth), np.int32)
                            tokens, self.draft_kv = self._propose_tree(
                                self.draft.leaves(), self.draft_kv, self.features, self._embed(), first, zeros, bt,
                                zeros, no_copy, st, gamma,
                            )
                            out, _, self.kv, self.features, _ = self._verify_tree(
                                self.target.leaves(), self.kv, self.features, zeros, tokens, no_copy.astype(bool), bt,
                                zeros, st, gamma, all_greedy,
                            )
                            out.block_until_ready()
                            keys += [("propose_tree", num_rows, gamma, width),
                                     ("verify_tree", num_rows, gamma, width, all_greedy)]
                        else:
                            first = np.zeros((num_rows, self.first_step_width(gamma)), np.int32)
                            tokens, probs, self.draft_kv = self._propose(
                                self.draft.leaves(), self.draft_kv, self.features, self._embed(), first, zeros, bt,
                                zeros, st, gamma, all_greedy,
                            )
                            out, _, self.kv, self.features, _ = self._verify(
                                self.target.leaves(), self.kv, self.features, zeros, tokens, probs,
                                np.zeros((num_rows, gamma), bool), bt, zeros, st, all_greedy,
                            )
                            out.block_until_ready()
                            keys += [("propose", num_rows, gamma, width, all_greedy),
                                     ("verify", num_rows, gamma, width, all_greedy)]
                        if gamma and self.lookup is not None and all_greedy and not self.ngram_only:
                            # steps that copy every row's γ drafts: no draft pass, host tokens, no probabilities
                            out, _, self.kv, self.features, _ = self._verify(
                                self.target.leaves(), self.kv, self.features, zeros,
                                np.zeros((num_rows, gamma), np.int32), None, np.ones((num_rows, gamma), bool),
                                bt, zeros, st, True,
                            )
                            out.block_until_ready()
                            keys.append(("verify", num_rows, gamma, width, "copied"))
                        self._tick(progress)

    def warmup_prefill_shapes(self, max_padded_tokens: int | None = None) -> list[tuple[int, int]]:
        """``(rows, chunk length)`` buckets whose prefill chunks :meth:`warmup_prefill` compiles: every pair whose
        padded tokens are at most ``max_padded_tokens`` (default: 4x the step's token budget, since a prefill batch's
        rows and longest chunk each round up to at most twice what they hold; a pair past it needs one long chunk
        beside many short ones, and compiles on first use)."""
        limit = 4 * self.shapes.prefill_len_buckets[-1] if max_padded_tokens is None else max_padded_tokens
        return [pair for pair in self.catch_up_shapes() if pair[0] * pair[1] <= limit]

    def catch_up_shapes(self) -> list[tuple[int, int]]:
        """``(rows, chunk length)`` buckets of the draft's catch-up (:meth:`catch_up_draft`): every pair, since each
        row takes up to a whole chunk of the token budget."""
        shapes = self.shapes
        return [(rows, length) for rows in shapes.prefill_seq_buckets for length in shapes.prefill_len_buckets]

    def warmup_prefill_ticks(self, max_context: int | None = None) -> int:
        """How many times :meth:`warmup_prefill` calls its ``progress``."""
        draft = self.draft is not None and self.draft_on_device
        shapes = self.catch_up_shapes() if draft else self.warmup_prefill_shapes()
        return len(shapes) * len(self.warmup_widths(max_context))

    def warmup_prefill(self, sampled: bool = True, max_context: int | None = None, progress=None) -> list[tuple]:
        """Compile the prefill-chunk variants (``forward_sample[S, T, W]``, greedy and sampled, for the shapes of
        :meth:`warmup_prefill_shapes`; the log-probability variants still compile on first use) and, while the
        draft is on the device, its catch-up (``draft_fill[S, T, W]``, :meth:`catch_up_shapes`), for every width up
        to ``max_context``, by running them on padding-only batches as :meth:`warmup` does (every write lands on
        page 0). ``progress()`` is called once per shape and width. Returns the keys compiled.

        What it costs: each variant compiles once (the persistent compilation cache keeps them across starts) and
        runs once over its padded tokens; on an accelerator those runs take milliseconds, on a 2-core CPU the
        largest SmolLM2 chunks take seconds each. Stops early as :meth:`warmup` does."""
        return self._stopping_when_maps_short(self._warmup_prefill, sampled, max_context, progress)

    def _warmup_prefill(self, keys, sampled, max_context, progress) -> None:
        modes = [True, False] if sampled else [True]
        draft = self.draft is not None and self.draft_on_device
        target_shapes = set(self.warmup_prefill_shapes())
        for num_rows, q_len in self.catch_up_shapes() if draft else sorted(target_shapes):
            zeros = np.zeros(num_rows, np.int32)
            tokens = np.zeros((num_rows, q_len), np.int32)
            st = self._sampling_tensors([], num_rows)
            for width in self.warmup_widths(max_context):
                bt = np.zeros((num_rows, width), np.int32)
                for all_greedy in modes if (num_rows, q_len) in target_shapes else []:
                    out, self.kv, self.features, _ = self._forward_sample(
                        self.target.leaves(), self.kv, self.features, tokens, bt, zeros, zeros, st, all_greedy,
                    )
                    out.block_until_ready()
                    keys.append(("forward_sample", num_rows, q_len, width, all_greedy))
                if draft:
                    self.draft_kv = self._draft_fill(
                        self.draft.leaves(), self.draft_kv, self.features, self._embed(), tokens, bt, zeros, zeros,
                    )
                    jax.block_until_ready(self.draft_kv)
                    keys.append(("draft_fill", num_rows, q_len, width))
                self._tick(progress)

    def num_compiled(self) -> int:
        """Executables compiled (or loaded from the persistent cache) so far, over every step function: a step that
        moved it spent part of its time compiling. (A step function replaced by a plain wrapper, as some tests do,
        is not counted.)"""
        return sum(f._cache_size() for f in self._step_fns().values() if hasattr(f, "_cache_size"))

    def compiled_cache_sizes(self) -> dict[str, int]:
        """Number of compiled executables per step function (grows only when a new variant compiles)."""
        return {name: f._cache_size() for name, f in self._step_fns().items()}

    def evict_compiled(self) -> int:
        """Drop every compiled step variant (after the device work in flight is done); returns how many. They compile
        again on their next use, from JAX's persistent compilation cache where it holds them (~0.3 s a SmolLM2
        variant here against ~2 s to compile). The memory maps they held are freed (``maps_short``)."""
        jax.block_until_ready((self.kv, self.features, self.draft_kv))
        dropped = self.num_compiled()
        for fn in (*self._step_fns().values(), self._migrate_pages):
            fn.clear_cache()
        if dropped:
            host.trim()  # (the executables' heap back to the system, not only to the allocator: memory/host.py)
        return dropped

    def evict_least_used(self, share: float, since: int) -> tuple[int, int]:
        """Drop the least used compiled variants (by family: ``nightjar_jax/engine/variants.py``) until the
        process holds less than ``share`` of its memory-map limit, keeping the families used since ``since`` (a
        ``variants.tick()``: the current step's); returns how many executables it dropped, and of how many. The
        variants a load keeps calling stay compiled, where dropping them all compiled them again at every drop."""
        jax.block_until_ready((self.kv, self.features, self.draft_kv))
        fns = [f for f in (*self._step_fns().values(), self._migrate_pages) if isinstance(f, VariantJit)]

        def enough() -> bool:
            usage = memory_map_usage()
            return usage is None or usage[0] < share * usage[1]

        total = sum(f._cache_size() for f in fns)
        dropped = drop_least_used(fns, since, enough)
        if dropped:
            host.trim()
        return dropped, total

    def _step_fns(self) -> dict:
        fns = {"forward_sample": self._forward_sample}
        if self.ngram_only:
            fns.update(verify=self._verify)
        if self.draft is not None:
            fns.update(draft_fill=self._draft_fill, propose=self._propose, verify=self._verify)
            if self.trees:
                fns.update(propose_tree=self._propose_tree, verify_tree=self._verify_tree)
        return fns
