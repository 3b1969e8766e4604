"""Token sampling on device: per-request temperature, top-k, top-p, min-p and seeds, as pure jnp functions.

Vocabulary
- **logits**: the model's raw scores over the vocabulary, ``[B, ..., V] float32`` (``V`` = vocabulary size).
- **processed distribution**: the distribution a request actually samples from, obtained from the logits by
  temperature scaling, then min-p, then top-k, then top-p (nucleus) over what min-p kept (vLLM's order), then
  renormalisation. A greedy request
  (temperature 0) has the one-hot distribution of ``argmax(logits)``.
- **draft / target**: in speculative decoding (see ``nightjar_jax.spec.rejection``) the small draft model proposes
  tokens and the target model verifies them. Both must go through :func:`processed_probs` with the same
  :class:`SamplingTensors`; rejection sampling is lossless only with respect to the *processed* target
  distribution (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", §2.3;
  Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Alg. 2).
- **request key**: the PRNG key of one request at one generation step,
  ``fold_in(fold_in(key(seed), step), salt)``. It depends only on the request's seed, how many tokens it has
  generated, and a salt naming the use (plain sampling, verification, drafting), never on the batch slot or on
  the other requests in the batch. That is what makes a seeded request reproducible under continuous batching.
  An unseeded request's speculative steps draw from their own streams (``SALT_VERIFY`` / ``SALT_DRAFT``: rejection
  sampling, the same distribution as a plain step's ``SALT_SAMPLE``); a seeded one's (``SamplingTensors.exact``)
  verify each position against the token a plain step would draw there (:func:`plain_draws`), so its tokens do not
  depend on γ or on whether it speculated at all.

JIT notes: every function here is traceable with static shapes; the sampling parameters are arrays, so changing
them never recompiles. Top-k/top-p find their thresholds by bisection (64 passes over the logits, no sort) and
run only when some non-greedy row of the batch asks for them (``lax.cond``). Under ``vmap`` a ``lax.cond``
becomes a select and both branches run, so call these on the whole batch rather than vmapping over rows.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Salts name the independent random streams a request draws from at one step.
SALT_SAMPLE = 0  # plain (autoregressive) sampling
SALT_VERIFY = 1  # rejection sampling in the verify pass
SALT_DRAFT = 2  # the draft proposer's samples

NO_ACCEPT_LIMIT = 2**30  # SamplingTensors.max_accept of a row that may accept every draft
BANNED = -1e30  # the bias that keeps a token from being generated (exp(-1e30 - max) = 0; no inf - inf)
MAX_SCALING_TEMPERATURE = 1e30  # temperatures above it scale logits as it does (1 / t stays a normal float32)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32: x [..., V] -> [..., V-less] int32 (ties: the lowest index, as
    ``jnp.argmax``; a row with NaN gives its first NaN, as ``jnp.argmax``).

    float32 on the CPU backend: the C++ kernel of ``kernels_pallas/sampling`` when it builds (0.29 ms for 32 rows of
    49,152 logits on a 2-vCPU Xeon, where the form below took 1.40 ms). Elsewhere two plain reductions, the row max,
    then the lowest index holding it: XLA:CPU lowers ``argmax`` to a variadic (value, index) reduce that does not
    vectorise (on a 2-core CPU 49,152 logits took ~0.23 ms per row-batch of 1 and ~3.3 ms at 32 rows, against
    ~0.04 ms and ~0.5 ms for the two passes then).
    """
    if x.dtype == jnp.float32 and x.ndim >= 1 and x.shape[-1] > 0 and jax.default_backend() == "cpu":
        from kernels_pallas.sampling import cpu

        if cpu.available():  # 0.29 ms instead of 1.40 for 32 rows of 49,152 logits (kernels_pallas/sampling)
            return cpu.argmax_cpu(x)
    vocab = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]; NaN if the row has one
    hit = (x == top) | jnp.isnan(x)  # [..., V] bool
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


ITERATED_TOP_K = 4  # top_k_ids: argmax passes up to here, lax.top_k beyond


def top_k_ids(x: jax.Array, k: int) -> jax.Array:
    """The ids of the ``k`` largest entries of each row, largest first (ties: the lowest index first, as
    :func:`argmax`, so id 0 is always the argmax): x [..., V] -> [..., k] int32.

    Up to ``ITERATED_TOP_K`` ids: ``k`` passes of :func:`argmax`, each masking the id it found; beyond it
    ``lax.top_k``. Inside a token tree's draft program XLA:CPU lowered ``lax.top_k`` with k = 1 to a full sort of
    the 49,152-id rows (~5 ms per row, against ~0.05 ms for one pass here), while larger k took its TopK call.
    """
    vocab = x.shape[-1]
    if not 0 <= k <= vocab:  # (k passes of argmax found id 0 again past the row's end)
        raise ValueError(f"top_k_ids: k={k} must be in [0, {vocab}], the entries of a row")
    if k == 0:  # (it was jnp.stack of nothing: "Need at least one array to stack")
        return jnp.zeros(x.shape[:-1] + (0,), jnp.int32)
    if k > ITERATED_TOP_K:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    out = []
    for _ in range(k):
        best = argmax(x)
        out.append(best)
        x = jnp.where(ids == best[..., None], -jnp.inf, x)
    return jnp.stack(out, axis=-1)


class Penalties(NamedTuple):
    """Presence / frequency / repetition penalties of a batch's rows (neutral where a row has none), applied on the
    device by :func:`apply_penalties` at every position a step scores, with a speculative step's drafts before each
    position counted as generated."""

    presence: jax.Array  # [B] float32 (0: off)
    frequency: jax.Array  # [B] float32 (0: off)
    repetition: jax.Array  # [B] float32 (1: off)
    counts: jax.Array  # [B, V] int32: times each token was generated
    prompt: jax.Array  # [B, V] bool: the tokens of the prompt (the repetition penalty's, with the generated ones)


class SamplingTensors(NamedTuple):
    """Per-request sampling parameters for one batch, on device. Padding rows should be greedy."""

    temperature: jax.Array  # [B] float32; 0 means greedy
    top_k: jax.Array  # [B] int32; 0 (or >= V) means off
    top_p: jax.Array  # [B] float32 in (0, 1]; 1 means off
    min_p: jax.Array  # [B] float32 in [0, 1]; 0 means off, 1 keeps only the most likely tokens
    seeds: jax.Array  # [B] uint32 per-request seed
    steps: jax.Array  # [B] int32 number of tokens this request has generated so far
    # logit_bias (None when no row has one): ids [B, M] int32 and values [B, M] float32 added to the logits before
    # anything else (padding: id 0, value 0); or, with structured outputs' masks or allowed_token_ids in the batch,
    # ids None and values a dense [B, V] float32 bias; see apply_logit_bias (penalties: ``penalties`` below)
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    # [B] int32: the most drafts each row may accept in a speculative step (None: no limit). The engine sets
    # ``Request.draft_limit``: under min_tokens, the drafts that keep it under (a limit that never depends on the
    # drafts: one that did would bias sampled rows); ``NO_ACCEPT_LIMIT`` else
    max_accept: jax.Array | None = None
    penalties: Penalties | None = None  # when a row has presence / frequency / repetition penalties
    # [B, P, V] bool: the tokens each row may take at each of a verify's P positions (None: all; structured
    # outputs', ``TokenConstraint.walk``: a chain's positions, or a tree's nodes), applied after the bias:
    # apply_allowed
    allowed: jax.Array | None = None
    # [B] bool: seeded sampled rows, whose speculative steps commit exactly the tokens plain steps would draw (each
    # position verified against plain_draws' token, not by rejection sampling; spec/rejection.py), so a seeded
    # request's tokens do not depend on the γ the planner chose. None: no such row
    exact: jax.Array | None = None

    @classmethod
    def create(
        cls,
        batch_size: int,
        *,
        temperature: float | np.ndarray | list = 0.0,
        top_k: int | np.ndarray | list = 0,
        top_p: float | np.ndarray | list = 1.0,
        min_p: float | np.ndarray | list = 0.0,
        seeds: int | np.ndarray | list = 0,
        steps: int | np.ndarray | list = 0,
    ) -> SamplingTensors:
        """Builds the tensors from scalars (broadcast to the batch) or per-row sequences (host side). Each value is
        checked as ``SamplingParams`` checks it (a ValueError naming the field and what is allowed): a negative
        temperature sampled the reversed distribution, a NaN or a min_p over 1 removed every token (token 0 drawn),
        top_k 2.7 was cut to 2."""

        def column(name: str, value: object, dtype: type, whole: bool, low: float, high: float,
                   allowed: str) -> jax.Array:
            raw = np.asarray(value, dtype=object)
            if raw.ndim > 1 or (raw.ndim == 1 and raw.shape[0] != batch_size):
                raise ValueError(f"SamplingTensors.create: {name} has shape {raw.shape} for batch_size {batch_size}: "
                                 f"give one value, or one per row")
            flat = raw.reshape(-1)
            kind = numbers.Integral if whole else numbers.Real
            bad = [v for v in flat if not (isinstance(v, kind) and not isinstance(v, (bool, np.bool_))
                                           and low <= v <= high)]  # (NaN fails the comparison)
            if bad:
                raise ValueError(f"SamplingTensors.create: {name}={bad[0]!r} is invalid: allowed {allowed}")
            values = fold_seeds([int(v) for v in flat]) if name == "seeds" else flat
            return jnp.asarray(np.broadcast_to(values.astype(dtype).reshape(raw.shape), (batch_size,)))

        return cls(
            temperature=column("temperature", temperature, np.float32, False, 0.0, float(np.finfo(np.float32).max),
                               "a finite float >= 0 (0: greedy)"),
            top_k=column("top_k", top_k, np.int32, True, -1, 2**31 - 1, "an integer in [-1, 2**31) (0 or -1: off)"),
            top_p=column("top_p", top_p, np.float32, False, np.nextafter(0, 1), 1.0, "a float in (0, 1]"),
            min_p=column("min_p", min_p, np.float32, False, 0.0, 1.0, "a float in [0, 1]"),
            seeds=column("seeds", seeds, np.uint32, True, -(2**63), 2**64 - 1,
                         "an integer in [-2**63, 2**64) (a 64-bit seed)"),
            steps=column("steps", steps, np.int32, True, 0, 2**31 - 1, "an integer in [0, 2**31)"),
        )


def check_rows(rows: int, given: int, what: str = "the SamplingTensors' rows") -> None:
    """A ``ValueError`` unless ``given`` (per-row tensors' length) is ``rows`` (the batch's): one row's tensors
    broadcast over a batch, every row on one PRNG key, with no error."""
    if given != rows:
        raise ValueError(f"{what}: {given} for a batch of {rows} rows (one per row: SamplingTensors.create(batch, "
                         f"...) with the batch's size)")


def apply_logit_bias(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """logits [B, ..., V] + each row's ``logit_bias`` (OpenAI's: added to the logits before sampling, greedy rows
    included, so -100 bans a token and +100 all but forces it); unchanged when the batch has none (static: the
    tensors' structure). Every step applies it to the target's logits and the draft's alike, so speculative decoding
    stays lossless with respect to the biased distribution."""
    if st.bias_values is None:
        return logits
    batch = logits.shape[0]
    if st.bias_ids is None:  # a dense [B, V] bias (structured outputs' masks, allowed_token_ids)
        return logits + st.bias_values.reshape((batch,) + (1,) * (logits.ndim - 2) + (logits.shape[-1],))
    ids = st.bias_ids.reshape((batch,) + (1,) * (logits.ndim - 2) + st.bias_ids.shape[1:])  # [B, 1.., M]
    values = st.bias_values.reshape(ids.shape).astype(logits.dtype)
    ids = jnp.broadcast_to(ids, logits.shape[:-1] + ids.shape[-1:])
    values = jnp.broadcast_to(values, ids.shape)
    vocab, width = logits.shape[-1], ids.shape[-1]
    biased = jax.vmap(lambda row, i, v: row.at[i].add(v))(
        logits.reshape(-1, vocab), ids.reshape(-1, width), values.reshape(-1, width))
    return biased.reshape(logits.shape)


def apply_allowed(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """logits [B, P, V] with the tokens ``st.allowed`` [B, P, V] does not allow banned (None: unchanged)."""
    if st.allowed is None:
        return logits
    return jnp.where(st.allowed, logits, jnp.asarray(BANNED, logits.dtype))


def apply_penalties(logits: jax.Array, st: SamplingTensors, tokens: jax.Array | None = None,
                    prefix: np.ndarray | None = None) -> jax.Array:
    """logits [B, P, V] (after the logit bias) with each row's penalties (None ``st.penalties``: unchanged), vLLM's
    order: the repetition penalty (a token of the prompt or generated: its logit divided by it when positive,
    multiplied when negative), then ``- frequency * count - presence * [count > 0]`` over the generated tokens.

    A verify's positions follow drafts: ``tokens`` [B, K] (its input: the last committed token, then the drafts or
    tree nodes) and ``prefix`` [P, K] bool (static; the drafted tokens in position p's prefix: a chain's position j
    follows drafts 0 .. j - 1, ``spec.tree.chain_prefixes``; a tree node its ancestors and itself,
    ``SpecTree.prefixes``) add those to the counts. Without them every position sees the committed tokens alone
    (a plain step's one position, a prefill's last, the draft's proposals)."""
    pen = st.penalties
    if pen is None:
        return logits
    batch, num_positions = logits.shape[:2]
    counts = jnp.broadcast_to(pen.counts[:, None, :].astype(jnp.float32), logits.shape)  # [B, P, V]
    if tokens is not None:
        occurs = jnp.broadcast_to(jnp.asarray(prefix, jnp.float32)[None], (batch, *prefix.shape))  # [B, P, K]
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None, None], occurs.shape)
        positions = jnp.broadcast_to(jnp.arange(num_positions)[None, :, None], occurs.shape)
        ids = jnp.broadcast_to(tokens[:, None, :], occurs.shape)
        counts = counts.at[rows, positions, ids].add(occurs)
    seen = pen.prompt[:, None, :] | (counts > 0)
    r = pen.repetition[:, None, None].astype(logits.dtype)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - pen.frequency[:, None, None] * counts - pen.presence[:, None, None] * (counts > 0)


def fold_seeds(seeds: int | np.ndarray | list) -> np.ndarray:
    """Host-side: 64-bit seeds (SamplingParams allows [-2**63, 2**63): a negative one is read as its two's
    complement, 2**64 + seed) -> the uint32 the PRNG key takes. A seed in [0, 2**32) is itself; any other is mixed
    whole (splitmix64's finalizer), so seeds that differ only in their high half (5 and 5 + 2**32) draw different
    streams: taking the seed mod 2**32 gave them the same samples."""
    try:
        wide = np.asarray(seeds, dtype=np.uint64)
    except OverflowError:  # (a negative Python int)
        wide = np.asarray(np.asarray(seeds, dtype=object) % 2**64, dtype=np.uint64)
    with np.errstate(over="ignore"):  # (the hash's products wrap mod 2**64 by design)
        z = wide + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    mixed = np.where(wide < np.uint64(2**32), wide, z ^ (z >> np.uint64(32)))
    return (mixed & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def request_keys(st: SamplingTensors, salt: int) -> jax.Array:
    """[B] typed PRNG keys ``fold_in(fold_in(key(seed), step), salt)``, independent of batch composition."""

    def one(seed: jax.Array, step: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), salt)

    return jax.vmap(one)(st.seeds, st.steps)  # [B] key


def plain_draws(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The tokens plain steps would draw at P successive positions: logits [B, P, V] f32 (processed as a plain step's
    are: bias, penalties and masks applied; position j's after the tokens before it) -> [B, P] int32, position j
    drawn as :func:`sample` draws with ``st.steps + j`` and ``SALT_SAMPLE`` (greedy rows: the argmax)."""
    batch, positions, vocab = logits.shape
    check_rows(batch, st.temperature.shape[0])

    def rows(x: jax.Array) -> jax.Array:
        return jnp.repeat(jnp.asarray(x), positions, axis=0)

    steps = rows(st.steps) + jnp.tile(jnp.arange(positions, dtype=jnp.int32), batch)
    flat = SamplingTensors(rows(st.temperature), rows(st.top_k), rows(st.top_p), rows(st.min_p), rows(st.seeds),
                           steps)
    return sample(logits.reshape(batch * positions, vocab), flat, SALT_SAMPLE).reshape(batch, positions)


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] with ``ndim`` dimensions, to broadcast against [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (flip the magnitude bits of negatives), so ints can be bisected."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _unsortable(key: jax.Array) -> jax.Array:
    """Inverse of :func:`_sortable`."""
    return jax.lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ jnp.int32(0x7FFFFFFF)), jnp.float32)


def _half_gap(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """floor((hi - lo) / 2) for int32 lo <= hi, without overflow (the gap can exceed 2**31)."""
    return ((hi.astype(jnp.uint32) - lo.astype(jnp.uint32)) >> 1).astype(jnp.int32)


def _top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest logit each row keeps after top-k then top-p, by bisection instead of a sort.

    scaled: [B, ..., V] f32 temperature-scaled logits; top_k: [B, ..., 1] int32 (already clamped to [1, V]);
    top_p: [B, ..., 1] f32. Returns [B, ..., 1] f32, exactly a logit of the row.

    Each search bisects the 2**32 float32 values (as ordered ints), so 32 passes over the row find the exact
    answer: top-k's threshold is the largest t with #{x >= t} >= k (the k-th largest logit); top-p's is the
    smallest t whose strictly-greater mass (within the top-k set, renormalised) is < top_p — the last token of
    the smallest prefix reaching top_p. On CPU this is ~7x faster than sorting 64 x 49152 logits.
    Worked example, V = 4, logits [3, 2, 1, 0] with probabilities [.64, .24, .09, .03], top_k = 3, top_p = 0.8:
    top-k's threshold is 1 (renormalised [.66, .25, .09]); the mass above 2 is .66 < 0.8 and above 1 is
    .91 >= 0.8, so top-p's threshold is 2 and two tokens stay.
    """
    keys = _sortable(scaled)  # [B, ..., V] int32
    lowest = jnp.min(keys, axis=-1, keepdims=True)  # [B, ..., 1] int32
    highest = jnp.max(keys, axis=-1, keepdims=True)  # [B, ..., 1] int32

    def top_k_step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # invariant: #{x >= lo} >= k; the answer lies in [lo, hi]
        mid = hi - _half_gap(lo, hi)  # upper middle, so lo moves up when lo + 1 == hi
        enough = jnp.sum(keys >= mid, axis=-1, keepdims=True) >= top_k  # [B, ..., 1] bool
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    kth_largest, _ = jax.lax.fori_loop(0, 32, top_k_step, (lowest, highest))  # [B, ..., 1] int32
    probs = jax.nn.softmax(jnp.where(keys >= kth_largest, scaled, -jnp.inf), axis=-1)  # [B, ..., V] f32

    def top_p_step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # invariant: mass(x > hi) < p; the answer lies in [lo, hi]
        mid = lo + _half_gap(lo, hi)
        below_p = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p  # [B, ..., 1]
        return jnp.where(below_p, lo, mid + 1), jnp.where(below_p, mid, hi)

    _, nucleus_last = jax.lax.fori_loop(0, 32, top_p_step, (kth_largest, highest))  # [B, ..., 1] int32
    # top_p == 1 means off: float rounding in the sums must not drop the tail.
    threshold = jnp.where(top_p >= 1.0, kth_largest, jnp.maximum(kth_largest, nucleus_last))
    return _unsortable(threshold)


def _top_k_top_p_threshold_by_sort(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Reference for :func:`_top_k_top_p_threshold` (the same result but for ties: by a full sort, this keeps the
    first tokens of a tie in sort order, where the bisection keeps every token tied with the last one kept, as vLLM
    and the module's docstring say; tests compare the two on logits without ties).

    scaled: [B, ..., V] f32 temperature-scaled logits; top_k: [B, ..., 1] int32 (already clamped to [1, V]);
    top_p: [B, ..., 1] f32. Returns [B, ..., 1] f32. Worked example, V = 4, logits sorted [3, 2, 1, 0] with
    probabilities [.64, .24, .09, .03], top_k = 3, top_p = 0.8: top-k keeps ranks 0..2 (renormalised
    [.66, .25, .09]); the exclusive cumulative mass [0, .66, .91] is < 0.8 at ranks 0 and 1, so two tokens stay
    and the threshold is the logit of rank 1 (= 2).
    """
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, ..., V] f32
    rank = jnp.arange(vocab, dtype=jnp.int32)  # [V] int32
    in_top_k = rank < top_k  # [B, ..., V] bool
    probs_sorted = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)  # [B, ..., V] f32
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted  # [B, ..., V] f32 exclusive cumsum
    # Nucleus: the smallest prefix whose mass reaches top_p is the set of ranks whose mass *before* them is
    # still below top_p; rank 0 has mass_before 0 < top_p, so the top token always stays.
    num_nucleus = jnp.sum((mass_before < top_p) & in_top_k, axis=-1, keepdims=True)  # [B, ..., 1] int32
    # top_p == 1 means off: float rounding in the cumsum must not drop the tail.
    num_kept = jnp.where(top_p >= 1.0, top_k, jnp.maximum(num_nucleus, 1))  # [B, ..., 1] int32
    return jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)  # [B, ..., 1] f32


def _filtered_logits(logits: jax.Array, st: SamplingTensors) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Temperature, min-p, top-k and top-p applied to logits [B, ..., V] f32, in that order; removed tokens get -inf.

    Returns (filtered [B, ..., V] f32, whose softmax is the processed distribution of the sampled rows;
    greedy [B, ..., 1] bool; argmax [B, ..., 1] int32 of the raw logits, for the greedy rows).
    """
    check_rows(logits.shape[0], st.temperature.shape[0])
    logits = logits.astype(jnp.float32)
    ndim, vocab = logits.ndim, logits.shape[-1]
    greedy = _per_row(st.temperature == 0, ndim)  # [B, ..., 1] bool
    temperature = _per_row(st.temperature, ndim)  # [B, ..., 1] f32
    # less the row's largest logit, then divided: a tiny temperature (1e-38 is allowed) sent x / t to inf and the min-p
    # floor below to inf + log(0) = NaN, every token was removed and token 0 drawn; now the top token scales to 0, the
    # others towards -inf (the greedy limit)
    top_logit = jnp.max(logits, axis=-1, keepdims=True)  # [B, ..., 1] f32
    infinite_top = top_logit == jnp.inf  # [B, ..., 1] bool
    top_logit = jnp.where(jnp.isfinite(top_logit), top_logit, 0.0)
    # At most MAX_SCALING_TEMPERATURE: XLA divides by multiplying with 1 / t, which a temperature past ~1e38 made a
    # subnormal, flushed to 0, and every scaled logit 0 (-inf ones NaN). Past it the scaled logits are all within
    # 1e-26 of 0 (the distribution is uniform over the kept tokens to float32's precision), so nothing changes.
    scaled = (logits - top_logit) / jnp.where(greedy, 1.0, jnp.minimum(temperature, MAX_SCALING_TEMPERATURE))
    # A banned token (BANNED: a stop id under min_tokens, a constraint, allowed_token_ids) stays removed at any
    # temperature: -1e30 / t is no longer far below the rest past t ~ 1e28, and top-k, top-p and the bans let it
    # through (a row with every token banned keeps them all, as before: that dead end is the engine's to report).
    removed = logits <= BANNED / 2  # [B, ..., V] bool
    removed &= ~jnp.all(removed, axis=-1, keepdims=True)
    # A +inf logit is certain: its tokens share the mass (inf - inf was NaN, and the row's draw token 0).
    scaled = jnp.where(removed, -jnp.inf, jnp.where(infinite_top, jnp.where(logits == jnp.inf, 0.0, -jnp.inf),
                                                    scaled))  # [B, ..., V] f32

    # min-p first, as vLLM's sampler orders them (min-p is one of its logits processors, applied before top-k and
    # top-p): top-p's nucleus is then taken over the mass min-p kept, renormalised. In log space:
    # p(x) >= min_p * p_max  <=>  x >= x_max + log(min_p); log(0) = -inf keeps everything.
    max_logit = jnp.max(scaled, axis=-1, keepdims=True)  # [B, ..., 1] f32; the top token survives every filter
    min_p_floor = max_logit + jnp.log(_per_row(st.min_p, ndim))  # [B, ..., 1] f32
    after_min_p = jnp.where(scaled >= min_p_floor, scaled, -jnp.inf)  # [B, ..., V] f32

    top_k = _per_row(jnp.where((st.top_k <= 0) | (st.top_k >= vocab), vocab, st.top_k), ndim)  # [B, ..., 1]
    top_p = _per_row(st.top_p, ndim)  # [B, ..., 1] f32
    needs_threshold = (st.temperature != 0) & ((st.top_k > 0) & (st.top_k < vocab) | (st.top_p < 1.0))  # [B] bool
    threshold = jax.lax.cond(
        jnp.any(needs_threshold),
        _top_k_top_p_threshold,
        lambda scaled, top_k, top_p: jnp.full(scaled.shape[:-1] + (1,), -jnp.inf, jnp.float32),
        after_min_p,
        top_k,
        top_p,
    )  # [B, ..., 1] f32
    keep = (after_min_p >= threshold) & (scaled >= min_p_floor)  # [B, ..., V] bool
    top = argmax(logits)[..., None]  # [B, ..., 1] int32
    return jnp.where(keep, scaled, -jnp.inf), greedy, top


def processed_logprobs(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Log of the processed distribution: [B, ..., V] f32 logits -> [B, ..., V] f32 log-probabilities.

    Temperature, then min-p (keep tokens with p >= min_p * p_max), then top-k and top-p over what min-p kept
    (keep the smallest set with mass >= p, renormalised; the top token always stays), as vLLM orders them;
    renormalise. Removed tokens get -inf. Tokens tied with the last kept
    logit are all kept, so with ties top-k / top-p may keep slightly more than k / the minimal set. Greedy rows
    (temperature 0) give the one-hot of ``argmax(logits)`` (ties: lowest index): 0 there, -inf elsewhere.
    """
    filtered, greedy, top = _filtered_logits(logits, st)
    one_hot = jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, -jnp.inf)  # [B, ..., V] f32
    return jnp.where(greedy, one_hot, jax.nn.log_softmax(filtered, axis=-1))


def processed_probs(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The processed distribution (see :func:`processed_logprobs`): [B, ..., V] f32 -> [B, ..., V] f32, rows
    summing to 1; greedy rows exactly one-hot."""
    filtered, greedy, top = _filtered_logits(logits, st)
    one_hot = (jnp.arange(logits.shape[-1]) == top).astype(jnp.float32)  # [B, ..., V] f32
    return jnp.where(greedy, one_hot, jax.nn.softmax(filtered, axis=-1))


_CDF_BLOCK = 256  # vocabulary block of the two-level inverse CDF in sample_from_probs


def sample_from_probs(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """One categorical sample per row: probs [B, V] f32 non-negative (unnormalised is fine), keys [B].

    Returns tokens [B] int32. Inverse-CDF sampling with one uniform per row, in two levels so that no scan runs
    over the whole vocabulary: pick the block of _CDF_BLOCK tokens by the cumulative block masses, then the
    token inside it. The Gumbel-max trick (``jax.random.categorical``) needs V random numbers per row; on CPU,
    for 64 x 49152, that took ~350 ms against ~20 ms here. Tokens of probability 0 are never drawn: the chosen
    index is the first whose cumulative mass exceeds the target, and when float rounding pushes the target past
    the end it is clamped to the last token (block) with positive mass. A row with no mass at all draws token 0 (as
    a NaN row does; it drew an id past the vocabulary).
    """
    batch, vocab = probs.shape
    check_rows(batch, keys.shape[0], "keys")
    num_blocks = -(-vocab // _CDF_BLOCK)
    probs = jnp.pad(probs, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab)))  # [B, num_blocks * BLOCK] f32
    blocks = probs.reshape(batch, num_blocks, _CDF_BLOCK)  # [B, num_blocks, BLOCK] f32
    block_mass = jnp.sum(blocks, axis=-1)  # [B, num_blocks] f32
    block_cumulative = jnp.cumsum(block_mass, axis=-1)  # [B, num_blocks] f32
    uniforms = jax.vmap(jax.random.uniform)(keys)  # [B] f32 in [0, 1)
    target = uniforms * block_cumulative[:, -1]  # [B] f32 mass to pass before the drawn token

    rows = jnp.arange(batch)
    last_block = num_blocks - 1 - jnp.argmax((block_mass > 0)[:, ::-1], axis=-1)  # [B] int32
    block = jnp.minimum(jnp.sum(block_cumulative <= target[:, None], axis=-1), last_block)  # [B] int32
    within = blocks[rows, block]  # [B, BLOCK] f32
    remaining = target - (block_cumulative[rows, block] - block_mass[rows, block])  # [B] f32
    last_within = _CDF_BLOCK - 1 - jnp.argmax((within > 0)[:, ::-1], axis=-1)  # [B] int32
    offset = jnp.minimum(jnp.sum(jnp.cumsum(within, axis=-1) <= remaining[:, None], axis=-1), last_within)
    drawn = (block * _CDF_BLOCK + offset).astype(jnp.int32)  # [B] int32
    return jnp.where(block_cumulative[:, -1] > 0, drawn, 0)


def sample_from_logprobs(log_probs: jax.Array, keys: jax.Array) -> jax.Array:
    """:func:`sample_from_probs` for log_probs [B, V] f32 (may hold -inf; unnormalised is fine) -> [B] int32."""
    return sample_from_probs(jnp.exp(log_probs - jnp.max(log_probs, axis=-1, keepdims=True)), keys)


def sample(logits: jax.Array, st: SamplingTensors, salt: int = SALT_SAMPLE) -> jax.Array:
    """Samples one token per request: logits [B, V] f32 -> tokens [B] int32.

    Greedy rows get exactly ``argmax(logits)``; the others a draw from the processed distribution with
    ``request_keys(st, salt)``. When every row is greedy only the argmax runs.
    """
    if logits.ndim != 2:  # (1-D logits were read as a batch of V rows, 3-D failed unpacking a shape)
        raise ValueError(f"sample: logits must be [B, V] (a batch of rows), got shape {tuple(logits.shape)}")
    check_rows(logits.shape[0], st.temperature.shape[0])
    top = argmax(logits)  # [B] int32

    def draw(logits: jax.Array) -> jax.Array:
        filtered, _, _ = _filtered_logits(logits, st)  # [B, V] f32, unnormalised processed log-probs
        drawn = sample_from_logprobs(filtered, request_keys(st, salt))  # [B] int32
        return jnp.where(st.temperature == 0, top, drawn)

    return jax.lax.cond(jnp.all(st.temperature == 0), lambda _: top, draw, logits)


def logprobs_bucket(num_top: int) -> int:
    """The static top-``k`` a step computes when its batch asks for at most ``num_top`` top log-probabilities: 0, 5
    or ``MAX_LOGPROBS``, so at most three variants of a step function compile for log-probabilities."""
    from nightjar_jax.engine.sampling_params import MAX_LOGPROBS

    if not 0 <= num_top <= MAX_LOGPROBS:
        raise ValueError(f"num_top={num_top} is outside [0, {MAX_LOGPROBS}]")
    return 0 if num_top == 0 else 5 if num_top <= 5 else MAX_LOGPROBS


class TokenLogprobs(NamedTuple):
    """What :func:`token_logprobs` returns, on device or (after ``np.asarray``) on the host."""

    logprob: jax.Array  # [...] f32: the chosen token's log-probability
    rank: jax.Array  # [...] int32: 1 + the number of tokens strictly more likely than it
    top_ids: jax.Array  # [..., k] int32: the k most likely tokens, most likely first (ties: the lowest id first)
    top_logprobs: jax.Array  # [..., k] f32


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> TokenLogprobs:
    """The model's log-probabilities (``log_softmax(logits)``: before temperature and filtering) of ``tokens`` and
    of the ``num_top`` most likely tokens: logits [..., V], tokens [...] int (ids outside [0, V), e.g. -1 padding,
    are clipped into it: -1 reads id 0, V or more id V - 1) -> :class:`TokenLogprobs`. ``num_top`` is static (0:
    the chosen tokens' alone)."""
    if jnp.shape(tokens) != logits.shape[:-1]:
        raise ValueError(f"token_logprobs: tokens has shape {tuple(jnp.shape(tokens))}, needs the logits' "
                         f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)}: one token per row of logits)")
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [..., V] f32
    chosen = jnp.clip(tokens.astype(jnp.int32), 0, vocab - 1)[..., None]  # [..., 1] int32
    logprob = jnp.take_along_axis(log_probs, chosen, axis=-1)  # [..., 1] f32
    rank = 1 + jnp.sum(log_probs > logprob, axis=-1, dtype=jnp.int32)  # [...] int32
    if num_top:
        top_ids = top_k_ids(log_probs, num_top)  # [..., k] int32
        top = jnp.take_along_axis(log_probs, top_ids, axis=-1)  # [..., k] f32
    else:
        top_ids = jnp.zeros(tokens.shape + (0,), jnp.int32)
        top = jnp.zeros(tokens.shape + (0,), jnp.float32)
    return TokenLogprobs(logprob[..., 0], rank, top_ids, top)
