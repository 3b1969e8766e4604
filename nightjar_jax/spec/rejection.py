"""Lossless verification of drafted tokens: speculative (rejection) sampling, and its greedy limit.

Vocabulary (one verify step of one request)
- **γ (gamma)**: the number of tokens the draft proposed this step.
- **draft tokens** ``d_0 .. d_{γ-1}``: the draft model's proposals; ``q_i`` is the draft's *processed
  distribution* at position i (the one ``d_i`` was drawn from, see ``nightjar_jax.engine.sampler``).
- **target distribution** ``p_0 .. p_γ``: the target's processed distribution at the γ + 1 verified positions
  (position i predicts the token after the prefix plus ``d_0 .. d_{i-1}``), with the *same* sampling parameters
  as the draft. The output is distributed exactly as sampling from ``p`` token by token.
- **accepted**: ``d_i`` is accepted while ``u_i < p_i(d_i) / q_i(d_i)``, ``u_i ~ U[0, 1)``. ``num_accepted`` is
  the length of the accepted prefix, in [0, γ], and at most the row's ``SamplingTensors.max_accept`` when set: a
  row limited to k accepts no draft past k, and its final token is then a draw from ``p_k`` itself (the bonus rule:
  no draft was tried there), so its output stays distributed as ``p``.
- **recovered token**: at the first rejection i, a draw from the residual ``norm(max(p_i - q_i, 0))``.
- **bonus token**: when all γ drafts are accepted, a free draw from ``p_γ``.
- **committed tokens**: ``output[:num_accepted + 1]`` — the accepted drafts, then the recovered or bonus token.
  Entries after ``num_accepted`` are :data:`PAD_TOKEN` (-1).

Algorithm: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Alg. 1 and
Appendix A.1 (proof that the output is distributed as p); Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Alg. 2. Greedy rows (temperature 0) use the exact limit case through
``argmax``: accept while ``d_i == argmax p_i``, then commit ``argmax`` at the first mismatch (or the bonus).

Randomness: the uniform ``u_i`` and the draw at position i come from ``fold_in(fold_in(k, i), 0)`` and
``fold_in(fold_in(k, i), 1)`` with ``k = request_keys(st, salt)``, so results depend on the request's seed, step
and γ only, not on γ's padding or the batch.

Seeded rows (``SamplingTensors.exact``): their tokens must not depend on γ (the planner's choice follows the load),
so they are verified like greedy rows with the argmax replaced by the token a plain step would draw at each position
(``plain``: :func:`nightjar_jax.engine.sampler.plain_draws`, the ``SALT_SAMPLE`` stream at step + i): d_i is accepted
while it equals that token, and the token at the first mismatch (or the bonus) is that token too. The committed
tokens are then exactly plain decoding's, whatever γ was, and so distributed as p. The draft draws d_i by inverse
CDF with the same uniform as the plain draw at its position (``draft_sample``'s ``position``), which makes it agree
with the target's draw where q is close to p; acceptance is lower than rejection sampling's (an agreement of
coupled draws, at most sum(min(p, q))), the price of reproducibility.

Worked example (γ = 3, greedy): drafts [5, 7, 2], target argmax per position [5, 7, 9, 4] -> d_0 and d_1 match,
d_2 does not: num_accepted = 2, output = [5, 7, 9, -1] (three committed tokens).

Token trees: :func:`tree_greedy_verify` applies the greedy rule along every branch of a static tree (the deepest
node whose branch the target agrees with is committed, then the target's token after it);
:func:`tree_rejection_sample` walks the tree by recursive rejection sampling, with each node's children as
point-mass drafts, lossless for any sampling parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nightjar_jax.engine.sampler import (
    SALT_DRAFT,
    SALT_SAMPLE,
    SALT_VERIFY,
    SamplingTensors,
    argmax,
    check_rows,
    plain_draws,
    processed_probs,
    request_keys,
    sample,
    sample_from_probs,
)

PAD_TOKEN = -1  # fills output positions after the committed tokens


def _commit(draft_tokens: jax.Array, accepted: jax.Array, final_token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Assembles the outputs from per-position acceptance.

    draft_tokens: [B, γ] int32; accepted: [B, γ] bool; final_token: [B] int32 (recovered or bonus) or
    [B, γ + 1] int32 (the candidate final token at every position; the one at num_accepted is used).
    Returns output_tokens [B, γ + 1] int32 and num_accepted [B] int32.
    """
    batch, gamma = draft_tokens.shape
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [B] int32
    position = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]  # [1, γ + 1] int32
    padded_drafts = jnp.concatenate([draft_tokens, jnp.full((batch, 1), PAD_TOKEN, jnp.int32)], axis=1)
    if final_token.ndim == 1:
        final_token = jnp.broadcast_to(final_token[:, None], (batch, gamma + 1))
    output = jnp.where(
        position < num_accepted[:, None],
        padded_drafts,
        jnp.where(position == num_accepted[:, None], final_token, PAD_TOKEN),
    )  # [B, γ + 1] int32
    return output.astype(jnp.int32), num_accepted


def _within_limit(accepted: jax.Array, max_accept: jax.Array | None) -> jax.Array:
    """accepted [B, γ] bool with the drafts past each row's ``max_accept`` [B] (None: no limit) not accepted."""
    if max_accept is None:
        return accepted
    if jnp.shape(max_accept) != accepted.shape[:1]:
        raise ValueError(f"max_accept has shape {tuple(jnp.shape(max_accept))}, needs [{accepted.shape[0]}] (one "
                         f"limit per row of the batch)")
    return accepted & (jnp.arange(accepted.shape[1])[None, :] < max_accept[:, None])


def greedy_verify(
    draft_tokens: jax.Array, target_logits: jax.Array, max_accept: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Verification when every row is greedy; needs no probability tensors.

    draft_tokens: [B, γ] int32; target_logits: [B, γ + 1, V] f32; max_accept: [B] int32 the most drafts a row may
    accept (``SamplingTensors.max_accept``; None: all).
    Returns output_tokens [B, γ + 1] int32 (the target's argmax chain up to num_accepted, then -1) and
    num_accepted [B] int32 in [0, γ].
    """
    if draft_tokens.ndim != 2:
        raise ValueError(f"greedy_verify: draft_tokens has shape {tuple(draft_tokens.shape)}, needs [B, γ]")
    batch, gamma = draft_tokens.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, gamma + 1):
        raise ValueError(f"greedy_verify: target_logits has shape {tuple(target_logits.shape)}, needs [{batch}, "
                         f"{gamma + 1}, V] for draft_tokens [{batch}, {gamma}] (the last position: the bonus)")
    draft_tokens = draft_tokens.astype(jnp.int32)
    target_argmax = argmax(target_logits)  # [B, γ + 1] int32
    accepted = _within_limit(draft_tokens == target_argmax[:, :-1], max_accept)  # [B, γ] bool
    return _commit(draft_tokens, accepted, target_argmax)


def _residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
    """max(p - q, 0), unnormalised (the sampler normalises), or p where the residual has no mass (p == q).

    p, q: [B, V] f32 probabilities. Returns [B, V] f32.
    """
    residual = jnp.maximum(p - q, 0.0)  # [B, V] f32
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0  # [B, 1] bool
    return jnp.where(has_mass, residual, p)


def rejection_sample(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    st: SamplingTensors,
    *,
    salt: int = SALT_VERIFY,
    plain: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1) for a batch.

    draft_tokens: [B, γ] int32 tokens the draft proposed.
    draft_probs: [B, γ, V] f32 the draft's processed distribution q at each drafted position.
    target_probs: [B, γ + 1, V] f32 the target's processed distribution p (last position: bonus).
    st: the batch's sampling tensors (temperature 0 rows are verified greedily via argmax of p).
    plain: [B, γ + 1] int32 the tokens plain steps would draw at each position (:func:`exact_plain_draws`), needed
    when ``st.exact`` is set: those rows accept a draft while it equals that token and commit it at the end.
    Returns output_tokens [B, γ + 1] int32 (committed = output[:num_accepted + 1], the rest -1) and
    num_accepted [B] int32 in [0, γ].
    """
    batch, gamma = draft_tokens.shape
    check_rows(batch, st.temperature.shape[0])
    for name, probs, positions in (("draft_probs", draft_probs, gamma), ("target_probs", target_probs, gamma + 1)):
        if probs.shape[:2] != (batch, positions):
            raise ValueError(f"rejection_sample: {name} has shape {tuple(probs.shape)}, needs [{batch}, {positions}, "
                             f"V] for draft_tokens [{batch}, {gamma}]")
    if draft_probs.shape[-1] != target_probs.shape[-1]:
        raise ValueError(f"rejection_sample: draft_probs cover {draft_probs.shape[-1]} tokens and target_probs "
                         f"{target_probs.shape[-1]}: draft and target must share one vocabulary")
    if st.exact is not None and (plain is None or plain.shape != (batch, gamma + 1)):
        raise ValueError(f"rejection_sample: rows with SamplingTensors.exact need plain [{batch}, {gamma + 1}] (the "
                         f"plain steps' tokens, exact_plain_draws), got "
                         f"{None if plain is None else tuple(plain.shape)}")
    draft_tokens = draft_tokens.astype(jnp.int32)
    greedy = st.temperature == 0  # [B] bool
    exact = None if st.exact is None else st.exact & ~greedy  # [B] bool
    keys = request_keys(st, salt)  # [B] key
    position_keys = jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(jnp.arange(gamma + 1)))(keys)
    # position_keys: [B, γ + 1] key; stream 0 = acceptance uniform, stream 1 = recovered/bonus draw.
    uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0))))(position_keys[:, :gamma])
    # uniforms: [B, γ] f32 in [0, 1)

    p_draft = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]  # [B, γ] f32
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]  # [B, γ] f32
    # u < p/q written without the division: q(d) = 0 (never drawn) accepts iff p(d) > 0.
    sampled_accept = uniforms * q_draft < p_draft  # [B, γ] bool
    target_argmax = argmax(target_probs)  # [B, γ + 1] int32
    greedy_accept = draft_tokens == target_argmax[:, :gamma]  # [B, γ] bool
    accepted = jnp.where(greedy[:, None], greedy_accept, sampled_accept)  # [B, γ] bool
    if exact is not None:  # (as greedy rows, the plain steps' tokens in place of the argmax)
        accepted = jnp.where(exact[:, None], draft_tokens == plain[:, :gamma], accepted)
    accepted = _within_limit(accepted, st.max_accept)
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [B] int32

    # Only one final draw per row is ever used, so gather its position first and draw over [B, V], not
    # [B, γ + 1, V]. At position γ (all accepted) there is no q: the residual with q = 0 is p itself (bonus); so
    # at a row's max_accept, where the draft after it was never tried.
    rows = jnp.arange(batch)
    p_final = target_probs[rows, num_accepted]  # [B, V] f32
    if gamma == 0:  # static: nothing drafted, the bonus token alone
        q_final = jnp.zeros_like(p_final)  # [B, V] f32
    else:
        rejected = num_accepted < gamma  # [B] bool: the draft at num_accepted was tried and rejected
        if st.max_accept is not None:
            rejected = rejected & (num_accepted < st.max_accept)
        q_final = jnp.where(
            rejected[:, None], draft_probs[rows, jnp.minimum(num_accepted, gamma - 1)], 0.0
        )  # [B, V] f32
    final_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(position_keys[rows, num_accepted])  # [B] key
    drawn = sample_from_probs(_residual_probs(p_final, q_final), final_keys)  # [B] int32
    final_token = jnp.where(greedy, target_argmax[rows, num_accepted], drawn)  # [B] int32
    if exact is not None:
        final_token = jnp.where(exact, plain[rows, num_accepted].astype(jnp.int32), final_token)
    return _commit(draft_tokens, accepted, final_token)


def exact_plain_draws(logits: jax.Array, st: SamplingTensors) -> jax.Array | None:
    """``plain`` for :func:`rejection_sample`: logits [B, P, V] (processed as a plain step's) -> the tokens plain
    steps would draw at the P positions [B, P] int32 when some row is ``st.exact`` (computed only then: zeros
    else); None when ``st.exact`` is None."""
    if st.exact is None:
        return None
    return jax.lax.cond(jnp.any(st.exact), lambda x: plain_draws(x, st),
                        lambda x: jnp.zeros(x.shape[:2], jnp.int32), logits)


def draft_sample(logits: jax.Array, st: SamplingTensors, salt: int = SALT_DRAFT,
                 position: int | jax.Array = 0) -> tuple[jax.Array, jax.Array]:
    """One draft step: logits [B, V] f32 -> (token [B] int32, probs [B, V] f32 the processed q).

    Greedy rows: argmax and its one-hot. Give draft position j of a step its own stream (a ``salt`` per position,
    or ``st._replace(steps=st.steps + j)``). ``st.exact`` rows draw with the uniform of the plain step at
    ``position`` (``st.steps + position``, ``SALT_SAMPLE``) instead: the draw the target's is compared with.
    """
    probs = processed_probs(logits, st)  # [B, V] f32
    drawn = sample_from_probs(probs, request_keys(st, salt))  # [B] int32
    if st.exact is not None:
        plain_keys = request_keys(st._replace(steps=st.steps + position), SALT_SAMPLE)  # [B] key
        coupled = jax.lax.cond(jnp.any(st.exact), lambda x: sample_from_probs(x, plain_keys), lambda x: drawn, probs)
        drawn = jnp.where(st.exact, coupled, drawn)
    token = jnp.where(st.temperature == 0, argmax(logits), drawn)  # [B] int32
    return token, probs


def as_plain_steps(out: jax.Array, first_logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """out [B, 1 + ...] with each sampled row whose ``max_accept`` is 0 (it commits one token) given the token a
    plain step would draw from ``first_logits`` [B, V] (the biased logits after the last committed token): the same
    distribution, but the plain step's random stream (SALT_SAMPLE), so a seeded request's tokens do not depend on
    whether the rest of its batch speculated. Greedy rows (their argmax already) and the others are unchanged."""
    if st.max_accept is None:
        return out
    plain = (st.max_accept == 0) & (st.temperature > 0)  # [B] bool
    token = jax.lax.cond(jnp.any(plain), lambda x: sample(x, st, SALT_SAMPLE), lambda x: out[:, 0], first_logits)
    return out.at[:, 0].set(jnp.where(plain, token, out[:, 0]))


def tree_greedy_verify(tokens: jax.Array, target_argmax: jax.Array, valid: jax.Array, tree) -> tuple[jax.Array, ...]:
    """Greedy verification of a static token tree (``nightjar_jax/spec/tree.py``).

    tokens [B, N + 1] int32: the root (the last committed token) and the drafted nodes in tree order;
    target_argmax [B, N + 1]: the target's greedy token after each node; valid [B, N + 1] bool: nodes that may be
    accepted (a node whose KV slot lies past the context limit may not). A node is accepted when its parent is and
    its token is the target's greedy token after its parent. Draft siblings carry distinct tokens; a copy-branch node
    (``spec/tree.py``) may repeat one, and then both are accepted with the same tokens: the deepest accepted node
    (the first in node order at that depth) is taken, every accepted branch being the target's greedy tokens. Returns
    output_tokens [B, depth + 1] (the deepest accepted node's branch, then the target's token after it, then -1),
    num_accepted [B] (that node's depth) and path [B, depth + 1] (the branch's node index at each depth; beyond
    num_accepted, the deepest accepted node).
    """
    parent = jnp.asarray(tree.parent)
    depth_of = jnp.asarray(tree.depth_of)
    tokens = tokens.astype(jnp.int32)
    match = (tokens == target_argmax[:, parent]) & valid  # [B, N + 1]
    ok = jnp.zeros(tokens.shape, bool).at[:, 0].set(True)
    for d in range(1, tree.depth + 1):
        level = np.arange(tree.level_starts[d], tree.level_starts[d + 1])
        ok = ok.at[:, level].set(ok[:, tree.parent[level]] & match[:, level])
    best = jnp.argmax(jnp.where(ok, depth_of[None, :] + 1, 0), axis=1)  # [B]: the deepest accepted node
    num_accepted = depth_of[best].astype(jnp.int32)
    path = jnp.asarray(tree.path_nodes)[best]  # [B, depth + 1]
    branch = jnp.take_along_axis(tokens, path[:, 1:], axis=1)  # [B, depth]: the branch's tokens at depths 1..
    bonus = jnp.take_along_axis(target_argmax, best[:, None], axis=1)  # [B, 1]
    i = jnp.arange(tree.depth + 1)[None, :]
    padded = jnp.concatenate([branch, jnp.zeros_like(bonus)], axis=1)
    out = jnp.where(i < num_accepted[:, None], padded, jnp.where(i == num_accepted[:, None], bonus, -1))
    return out.astype(jnp.int32), num_accepted, path.astype(jnp.int32)


def tree_rejection_sample(
    tokens: jax.Array, target_logits: jax.Array, valid: jax.Array, tree, st: SamplingTensors, *,
    salt: int = SALT_VERIFY,
) -> tuple[jax.Array, ...]:
    """Lossless verification of a static token tree for any sampling parameters (greedy rows included).

    tokens [B, N + 1] int32 (root, then the nodes in tree order); target_logits [B, N + 1, V] f32: the target's
    logits after each node (the processed distribution ``p`` is computed only for the depth + 1 nodes the walk
    visits, not for all N + 1); valid [B, N + 1] bool as in :func:`tree_greedy_verify`.

    From the root: at the current node with target distribution ``p`` its children's tokens are tried in rank order
    as point-mass drafts (recursive rejection sampling, SpecInfer / EAGLE): child ``t`` is accepted with probability
    ``r(t) / sum(r)``, where ``r`` is ``p`` with the tokens of the children already rejected here removed; on
    acceptance the walk moves to that child, else its token is removed from ``r``. When no child is accepted (or at
    the deepest level) one token is drawn from ``r`` (``p`` at a leaf) and the step ends. Each committed token is
    therefore distributed as ``p``: ``P(t1) = p(t1)``, ``P(t2) = (1 - p(t1)) p(t2) / (1 - p(t1))``, and so on,
    and the residual draw covers the rest; a greedy row's ``p`` is one-hot, which makes this its argmax walk.
    Randomness: per request key (``request_keys(st, salt)``), folded with the depth, then 0 for the draw and
    ``1 + j`` for the ``j``-th child's uniform. ``st.exact`` rows walk as greedy rows do with the token a plain step
    would draw at each depth (``SALT_SAMPLE``, step + depth) in place of the argmax: the child with that token is
    taken, else that token ends the step (plain decoding's tokens, whatever the tree). Returns (output_tokens
    [B, depth + 1], num_accepted [B], path [B, depth + 1]) as :func:`tree_greedy_verify`.
    """
    batch = tokens.shape[0]
    check_rows(batch, st.temperature.shape[0])
    rows = jnp.arange(batch)
    children = jnp.asarray(tree.children)
    keys = request_keys(st, salt)  # [B] key
    exact = None if st.exact is None else st.exact & (st.temperature > 0)  # [B] bool
    cur = jnp.zeros(batch, jnp.int32)  # the walk's node
    done = jnp.zeros(batch, bool)
    num_accepted = jnp.zeros(batch, jnp.int32)
    out, path = [], [cur]
    for d in range(tree.depth + 1):
        depth_keys = jax.vmap(lambda k, d=d: jax.random.fold_in(k, d))(keys)  # [B] key
        p = processed_probs(target_logits[rows, cur], st)  # [B, V]
        residual, nxt = p, jnp.full(batch, -1, jnp.int32)
        if exact is not None:  # the plain step's token after the current node (zeros when no row is exact)
            plain = jax.lax.cond(jnp.any(exact), lambda x, d=d: sample(x, st._replace(steps=st.steps + d), SALT_SAMPLE),
                                 lambda x: jnp.zeros(batch, jnp.int32), target_logits[rows, cur])
        if d < tree.depth:
            total = jnp.sum(p, axis=-1)  # [B]
            for j in range(children.shape[1]):
                child = children[cur, j]  # [B], -1 where the node has fewer children
                safe = jnp.maximum(child, 0)
                tried = (child >= 0) & valid[rows, safe] & (nxt < 0) & ~done
                tok = tokens[rows, safe]
                mass = residual[rows, tok]
                u = jax.vmap(lambda k, j=j: jax.random.uniform(jax.random.fold_in(k, 1 + j)))(depth_keys)
                accept = tried & (u * total < mass)
                if exact is not None:
                    accept = jnp.where(exact, tried & (tok == plain), accept)
                nxt = jnp.where(accept, child, nxt)
                reject = tried & ~accept
                residual = residual.at[rows, tok].set(jnp.where(reject, 0.0, mass))
                total = jnp.where(reject, jnp.maximum(total - mass, 0.0), total)
        empty = jnp.sum(residual, axis=-1, keepdims=True) <= 0  # float dust only: fall back to p
        draw_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(depth_keys)
        draw = sample_from_probs(jnp.where(empty, p, residual), draw_keys)
        if exact is not None:
            draw = jnp.where(exact, plain, draw)
        moved = ~done & (nxt >= 0)
        out.append(jnp.where(done, PAD_TOKEN, jnp.where(moved, tokens[rows, jnp.maximum(nxt, 0)], draw)))
        num_accepted = num_accepted + moved.astype(jnp.int32)
        done = done | ~moved
        cur = jnp.where(moved, nxt, cur)
        if d < tree.depth:
            path.append(cur)
    return jnp.stack(out, axis=1).astype(jnp.int32), num_accepted, jnp.stack(path, axis=1).astype(jnp.int32)
