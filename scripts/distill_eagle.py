"""Train a feature draft for SmolLM2-135M-Instruct (issue 8): the draft reads the target's hidden state.

A token-only draft must rebuild the target's context from tokens with a small fraction of its compute and tops out
near α ≈ 0.3 on the data this machine can make (docs/benchmarks.md). A feature draft (EAGLE, Li et al. 2024) is
handed the target's final hidden state ``h[p - 1]`` with token ``x[p]`` and predicts ``h[p]`` (so the next token
through the head): the target has already done the hard part.

Vocabulary
- slot ``p``: the draft's input at position ``p`` is ``fc([embed(x[p]), f[p - 1]])`` (the target's embedding table,
  shared, not stored with the draft); ``f[p - 1]`` is the target's final normed hidden state ``h[p - 1]`` where the
  target has run (depth 1), else the draft's own output for ``p - 1`` (depth ≥ 2). Slot 0 gets zeros.
- depth ``j``: a chain that starts at slot ``c`` (the last committed token; the target has run up to ``c - 1``)
  proposes ``x[c + j]`` at depth ``j`` from slot ``c + j - 1``. In a real decode step the draft's KV for slots
  ``< c`` was made with the target's features, so the depth-``j`` query at slot ``p`` sees the depth-1 keys at
  slots ``<= p - j + 1`` and the depth-``i`` key of its own chain at slot ``p - j + i`` for ``i = 2..j``.
  Training unrolls the chain this way (training-time test, EAGLE-3) with dense masks, so every depth trains on the
  inputs it sees when serving; :func:`simulate` runs the same forward on held-out target responses and replays
  the greedy decode steps, which is what the engine measures.
- loss per depth: cross-entropy against the target's distribution over the subset head's ids (computed from the
  stored features through the target's own head rows) plus a smooth-L1 regression of the output onto ``h[p]``.
- fused features (EAGLE-3): with a features folder made by ``features --layers 3,15``, ``f`` where the target has
  run is ``fuse([rms(r_3), rms(r_15), h])`` (the residual stream after those layers, RMS-normalised, and the final
  state; :func:`fuse_features`, the engine's ``Llama._fuse``); ``fuse`` starts as ``[0, 0, I]``, so a fused draft
  ``--init-from`` an unfused one starts as it. ``--final-only`` trains on the same folder without fusion (a control).
- depth of the draft: ``--num-layers`` decoder layers after ``fc`` (default one, as EAGLE). ``--init-from`` a
  shallower run grows it: the loaded layers keep their weights and each new layer starts with zero output
  projections, so training starts from the shallower draft's exact predictions and adds capacity from there.

Stages::

    python scripts/distill_draft.py features --data D1 D2 --out runs/eagle/features   # the target's h, f16
    python scripts/distill_eagle.py train --data D1 D2 --features runs/eagle/features --workdir runs/eagle/wd
    python scripts/distill_eagle.py simulate --workdir runs/eagle/wd        # held-out greedy acceptance (offline)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import distill_draft as dd  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    existing_file,
    float_in_range,
    make_parent,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    writable_out,
)

logger = logging.getLogger("distill_eagle")


# ---- data --------------------------------------------------------------------------------------------------------


def load_features(path: Path, rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """``features``' parts as {row key: h [len(tokens), hidden] float16}; every row must be covered."""
    out: dict[str, np.ndarray] = {}
    for part in sorted(path.glob("part-*.npz")):
        z = np.load(part)
        offsets = np.concatenate([[0], np.cumsum(z["counts"])])
        if "feats" not in z.files:
            raise SystemExit(f"--features {path}: {part.name} holds no features (keys {', '.join(z.files)}): give "
                             f"distill_draft.py features' --out, not teacher's")
        feats = z["feats"]
        for i, key in enumerate(z["keys"]):
            out[str(key)] = feats[offsets[i] : offsets[i + 1]]
    if not out:
        raise SystemExit(f"--features {path}: no part-*.npz files there; run distill_draft.py features first")
    for r in rows:
        got = out.get(dd.row_key(r))
        if got is None or len(got) != len(r["tokens"]):
            raise SystemExit(
                f"--features {path}: no features for row {r['id']} ({r['kind']}) of {len(r['tokens'])} tokens; "
                "run `distill_draft.py features` with the same --data files first"
            )
    return out


def feature_layers(path: Path) -> list[int]:
    """The layer counts whose residual stream a features folder holds before the final state (its
    ``layers.json``; none: the final state only)."""
    spec = path / "layers.json"
    return json.loads(spec.read_text()) if spec.exists() else []


def make_batches(rows, feats, tokens_per_batch: int, prompt_weight: float, seed: int) -> list[tuple]:
    """Shuffled length-bucketed batches: tokens [B, T] int32, h [B, T, H] float16, weights [B, T] float32
    (slot p's label is x[p + 1]: weight 1 for a response token, ``prompt_weight`` for a prompt token, 0 on
    padding and the last slot)."""
    rng = np.random.default_rng(seed)
    by_bucket: dict[int, list[dict[str, Any]]] = {b: [] for b in dd.BUCKETS}
    for r in rows:
        by_bucket[dd.bucket_of(r)].append(r)
    hidden = next(iter(feats.values())).shape[1]
    batches = []
    for t, group in by_bucket.items():
        group = list(group)
        rng.shuffle(group)
        bsz = max(1, tokens_per_batch // t)
        for s in range(0, len(group), bsz):
            tok = np.zeros((bsz, t), np.int32)
            h = np.zeros((bsz, t, hidden), np.float16)
            wts = np.zeros((bsz, t), np.float32)
            for j, r in enumerate(group[s : s + bsz]):
                n = len(r["tokens"])
                tok[j, :n] = r["tokens"]
                h[j, :n] = feats[dd.row_key(r)]
                wts[j, : n - 1] = prompt_weight
                wts[j, dd.response_labels(r)] = 1.0
            batches.append((tok, h, wts))
    return [batches[i] for i in rng.permutation(len(batches))]


# ---- model -------------------------------------------------------------------------------------------------------


def eagle_config(target_cfg: Any, intermediate: int, head_vocab: int, num_layers: int = 1,
                 layers: tuple[int, ...] = ()) -> Any:
    """``num_layers`` decoder layers at the target's width and head layout, a subset head; ``feature_size`` marks a
    feature draft (its forward takes the target's hidden states and embedding table), ``layers`` a fused one
    (``feature_layers``: it also reads the target's residual stream after those layers)."""
    return target_cfg.replace(
        feature_layers=tuple(layers) or None,
        num_layers=num_layers,
        intermediate_size=intermediate,
        tie_word_embeddings=False,
        head_vocab_size=head_vocab,
        feature_size=target_cfg.hidden_size,
        dtype="float32",
        name="smollm2-eagle",
    )


def init_params(cfg: Any, seed: int, head_rows: np.ndarray, zero_out_layers: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights. ``fc`` starts as [0, I] (the feature passes through), the head as the target's
    own rows for the subset ids (the target's features already score tokens there). Layers from
    ``zero_out_layers`` on (``0``: none) start with zero output projections (``o_proj``, ``down_proj``): they add
    nothing to the residual stream, so a draft grown from a shallower one starts as that draft's exact function."""
    rng = np.random.default_rng(seed)
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def lin(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * scale / math.sqrt(inp)).astype(np.float32)

    fc = np.concatenate([lin(d, d, 0.5), np.eye(d, dtype=np.float32)], axis=1)  # [d, 2d]: (embedding, feature)
    params = {"fc.weight": fc}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out_scale = 0.0 if 0 < zero_out_layers <= i else 0.5
        params |= {
            p + "self_attn.q_proj.weight": lin(cfg.num_heads * hd, d),
            p + "self_attn.k_proj.weight": lin(cfg.num_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": lin(cfg.num_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": lin(d, cfg.num_heads * hd, out_scale),
            p + "mlp.gate_proj.weight": lin(f, d),
            p + "mlp.up_proj.weight": lin(f, d),
            p + "mlp.down_proj.weight": lin(d, f, out_scale),
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        }
    return params | {
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": head_rows.astype(np.float32).copy(),
    }


def fuse_features(cfg: Any, params: dict[str, Any], h: Any) -> Any:
    """The draft's view of the target's features: ``h`` itself [..., H], or with fused features (``fuse.weight``
    [H, k * H]; ``features --layers``) ``fuse([rms(l_1), .., rms(l_(k-1)), h_final])``: each earlier layer's
    residual stream RMS-normalised (no weight), the final normed state as it is (EAGLE-3's fusion)."""
    import jax
    import jax.numpy as jnp

    if "fuse.weight" not in params:
        return h
    d = cfg.hidden_size
    parts = [h[..., i * d : (i + 1) * d] for i in range(h.shape[-1] // d)]
    parts = [x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) for x in parts[:-1]]
    return jnp.concatenate([*parts, h[..., -d:]], axis=-1) @ params["fuse.weight"].T


def ttt_forward(cfg: Any, params: dict[str, Any], emb: Any, h: Any, depths: int) -> list[Any]:
    """The unrolled chain (module docstring): emb [B, T, H] (the target's embedding of x), h [B, T, H] (the
    target's features; [B, T, k * H] fused, see :func:`fuse_features`) -> per depth ``j = 1..depths`` the draft's
    output features [B, T, H] at every slot."""
    import jax
    import jax.numpy as jnp

    from nightjar_jax.models.llama import rope_inv_freq

    def norm(x: Any, w: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w

    def shift(x: Any, k: int) -> Any:  # x[:, p - k] at slot p (zeros before the start)
        return jnp.pad(x, ((0, 0), (k, 0)) + ((0, 0),) * (x.ndim - 2))[:, : x.shape[1]]

    b, t, _ = emb.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    g = nh // nkv
    inv_freq = jnp.asarray(rope_inv_freq(hd, cfg.rope_theta, cfg.rope_scaling))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    slot = jnp.arange(t)
    keys: list[list[tuple[Any, Any]]] = [[] for _ in range(cfg.num_layers)]  # per layer, per depth: (k, v)
    outs = []
    feat_in = shift(fuse_features(cfg, params, h), 1)
    for j in range(1, depths + 1):
        x = jnp.concatenate([emb, feat_in], axis=-1) @ params["fc.weight"].T
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            q, k, v = dd.qkv_projections(cfg, params, p, norm(x, params[p + "input_layernorm.weight"]), positions,
                                         inv_freq)
            lk = keys[layer]
            lk.append((k, v))
            q = q.reshape(b, t, nkv, g, hd) / math.sqrt(hd)
            k1, v1 = lk[0]
            s1 = jnp.einsum("bqkgd,bskd->bkgqs", q, k1)  # depth-1 keys at slots <= p - j + 1
            s1 = jnp.where(slot[None, :] <= slot[:, None] - (j - 1), s1, -1e30)
            diag_s, diag_v = [], []
            for i in range(2, j + 1):  # the chain's own depth-i key at slot p - (j - i)
                ki, vi = (shift(a_, j - i) for a_ in lk[i - 1])
                diag_s.append(jnp.einsum("bqkgd,bqkd->bkgq", q, ki)[..., None])
                diag_v.append(vi)
            scores = jnp.concatenate([s1, *diag_s], axis=-1) if diag_s else s1
            w = jax.nn.softmax(scores, axis=-1)
            attn = jnp.einsum("bkgqs,bskd->bqkgd", w[..., :t], v1)
            for i, vi in enumerate(diag_v):
                attn = attn + w[..., t + i].transpose(0, 3, 1, 2)[..., None] * vi[:, :, :, None, :]
            x = x + attn.reshape(b, t, nh * hd) @ params[p + "self_attn.o_proj.weight"].T
            a = norm(x, params[p + "post_attention_layernorm.weight"])
            gate = a @ params[p + "mlp.gate_proj.weight"].T
            up = a @ params[p + "mlp.up_proj.weight"].T
            x = x + (jax.nn.silu(gate) * up) @ params[p + "mlp.down_proj.weight"].T
        out = norm(x, params["model.norm.weight"])
        outs.append(out)
        feat_in = shift(out, 1)
    return outs


# ---- training ----------------------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    from nightjar_jax.models.loader import load_checkpoint

    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = load_checkpoint(dd.TARGET)
    tcfg = ckpt.config
    table = np.asarray(ckpt.state_dict["model.embed_tokens.weight"], np.float32)  # [V, H], tied head
    rows = dd.load_rows(args.data)
    feats = load_features(Path(args.features), rows)
    layers = feature_layers(Path(args.features))
    if args.final_only and layers:  # a control run: the same rows and order, the final state alone
        feats = {k: v[:, -tcfg.hidden_size :] for k, v in feats.items()}
        layers = []
    cfg = eagle_config(tcfg, args.intermediate, args.head_vocab, args.num_layers, tuple(layers))
    (workdir / "draft_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    val_ids = set(sorted({r["id"] for r in rows})[:: max(1, args.val_every)])
    train_rows = [r for r in rows if r["id"] not in val_ids]
    val_rows = [r for r in rows if r["id"] in val_ids and r["kind"] == "greedy"]
    if not train_rows or not val_rows:  # (a bare "need at least one array to concatenate")
        raise SystemExit(f"--data holds {len({r['id'] for r in rows})} prompt(s): one in --val-every "
                         f"{args.val_every} goes to validation, which leaves {len(train_rows)} training and "
                         f"{len(val_rows)} validation sequences; give more prompts (or a larger --val-every)")
    counts = np.bincount(
        np.concatenate([np.asarray(r["tokens"][r["num_prompt"] :], np.int64) for r in train_rows]),
        minlength=tcfg.vocab_size,
    )
    if args.init_from:  # the head's rows belong to the ids it was trained with, not to this data's most frequent
        init_ids = Path(args.init_from).parent / "head_token_ids.npy"
        if not init_ids.exists():
            raise SystemExit(f"--init-from {args.init_from}: no head_token_ids.npy beside it (the head's token ids)")
        head_ids = np.load(init_ids).astype(np.int32)
        if len(head_ids) != args.head_vocab:
            raise SystemExit(f"--init-from {args.init_from}: its head has {len(head_ids)} ids, --head-vocab is "
                             f"{args.head_vocab}")
    else:  # the most frequent response ids, end-of-sequence ids always in
        eos = [int(t) for t in tcfg.eos_token_ids]
        order = [int(t) for t in np.argsort(-counts, kind="stable") if int(t) not in eos]
        head_ids = np.sort(np.asarray(eos + order[: args.head_vocab - len(eos)], np.int32))
    np.save(workdir / "head_token_ids.npy", head_ids)
    logger.info(
        "%d train rows, %d validation rows; subset head: %d ids cover %.2f%% of response tokens",
        len(train_rows), len(val_rows), len(head_ids), 100 * counts[head_ids].sum() / counts.sum(),
    )
    init_layers = 0
    if args.init_from:
        z = dict(np.load(args.init_from))
        init_layers = 1 + max(int(k.split(".")[2]) for k in z if k.startswith("model.layers."))
        if init_layers > cfg.num_layers:
            raise SystemExit(f"--init-from {args.init_from}: it has {init_layers} layers, --num-layers is "
                             f"{cfg.num_layers} (a draft can grow from a shallower one, not shrink)")
    params = init_params(cfg, args.seed, table[head_ids], zero_out_layers=init_layers)
    if layers:  # fused features: fuse starts as [0, .., 0, I] (the final state passes through, as without fusion)
        d = cfg.hidden_size
        zeros = np.zeros((d, len(layers) * d), np.float32)
        params["fuse.weight"] = np.concatenate([zeros, np.eye(d, dtype=np.float32)], axis=1)
    if args.init_from:  # its layers 0..init_layers-1; deeper layers start as no-ops (zero output projections)
        grown = {k for k in params if k.startswith("model.layers.") and int(k.split(".")[2]) >= init_layers}
        if "fuse.weight" not in z:  # a draft without fusion: it starts as that draft (fuse passes the final state)
            grown |= {"fuse.weight"} & set(params)
        bad = sorted(k for k in set(params) - grown if k not in z or z[k].shape != params[k].shape)
        if bad or set(z) - set(params):
            raise SystemExit(f"--init-from {args.init_from} does not fit this draft (--intermediate "
                             f"{args.intermediate}, --head-vocab {args.head_vocab}): missing or other-shaped "
                             f"{bad[:4]}, unknown {sorted(set(z) - set(params))[:4]}")
        params |= z
        logger.info("initialised from %s (%d of %d layers)", args.init_from, init_layers, cfg.num_layers)
    params = {k: jnp.asarray(v) for k, v in params.items()}
    table_dev = jnp.asarray(table)
    teacher_head = jnp.asarray(table[head_ids])  # the target's head rows for the subset: its logits from h
    d_model = cfg.hidden_size
    h_scale = float(np.sqrt(np.mean(np.square(feats[dd.row_key(train_rows[0])][:, -d_model:].astype(np.float32)))))
    logger.info("feature RMS %.3f", h_scale)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 2), args.steps,
                                                  args.lr * 0.05)
    frozen = {"lm_head.weight"} if args.freeze_head else set()
    tx = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.multi_transform(
            {"train": optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay,
                                  mask=lambda p: jax.tree.map(lambda v: v.ndim == 2, p)),
             "frozen": optax.set_to_zero()},
            {k: ("frozen" if k in frozen else "train") for k in params},
        ),
    )
    opt_state = tx.init(params)

    def loss_fn(p, tok, h, wts):
        outs = ttt_forward(cfg, p, table_dev[tok], h.astype(jnp.float32), args.depths)
        hf = h[..., -d_model:].astype(jnp.float32)  # the final normed state: the teacher and the regression's target
        t_logp = jax.nn.log_softmax(hf @ teacher_head.T, axis=-1)  # target's distribution over the subset
        t_prob = jnp.exp(t_logp)
        t_top = jnp.argmax(t_logp, axis=-1)
        total, stats = 0.0, []
        for j, out in enumerate(outs, start=1):
            w = wts * (jnp.arange(tok.shape[1]) >= j - 1)[None]  # depth j needs a chain start c = p - j + 1 >= 0
            logits = out @ p["lm_head.weight"].T
            logp = jax.nn.log_softmax(logits, axis=-1)
            ce = -jnp.sum(t_prob * logp, axis=-1)
            reg = jnp.mean(optax.huber_loss(out / h_scale, hf / h_scale), axis=-1)
            denom = jnp.maximum(jnp.sum(w), 1.0)
            loss_j = jnp.sum((ce + args.reg_weight * reg) * w) / denom
            total = total + loss_j * args.depth_decay ** (j - 1)
            resp = (wts >= 1.0) * (jnp.arange(tok.shape[1]) >= j - 1)[None]
            hits = jnp.sum((jnp.argmax(logits, axis=-1) == t_top) * resp) / jnp.maximum(jnp.sum(resp), 1.0)
            stats.append(hits)
        return total, jnp.stack(stats)

    @jax.jit
    def train_step(p, o, tok, h, wts):
        (loss, hits), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, tok, h, wts)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss, hits

    eval_step = jax.jit(loss_fn)
    val_batches = make_batches(val_rows, feats, args.tokens_per_batch, 0.0, seed=0)

    def validate(p) -> tuple[float, list[float]]:
        ls, hs = [], []
        for tok, h, wts in val_batches:
            loss, hits = eval_step(p, tok, h, wts)
            ls.append(float(loss))
            hs.append(np.asarray(hits))
        return float(np.mean(ls)), np.mean(hs, axis=0).round(4).tolist()

    log = open(workdir / "train_log.jsonl", "a", encoding="utf-8")
    bar = tqdm(total=args.steps, desc="train-eagle", unit="step")
    t0 = time.perf_counter()
    step, epoch, best = 0, 0, -1.0
    batches = make_batches(train_rows, feats, args.tokens_per_batch, args.prompt_weight, args.seed)
    while step < args.steps:
        if step and step % len(batches) == 0:
            epoch += 1
            batches = make_batches(train_rows, feats, args.tokens_per_batch, args.prompt_weight, args.seed + epoch)
        tok, h, wts = batches[step % len(batches)]
        params, opt_state, loss, hits = train_step(params, opt_state, tok, h, wts)
        step += 1
        rec: dict[str, Any] = {"step": step, "epoch": epoch, "loss": float(loss),
                               "top1_per_depth": np.asarray(hits).round(4).tolist(),
                               "elapsed_s": round(time.perf_counter() - t0, 1)}
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", d1=f"{float(hits[0]):.3f}", ep=epoch)
        out_of_time = args.max_minutes > 0 and time.perf_counter() - t0 > args.max_minutes * 60
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            rec["val_loss"], rec["val_top1_per_depth"] = validate(params)
            logger.info("step %d: val loss %.3f, val top-1 per depth %s", step, rec["val_loss"],
                        rec["val_top1_per_depth"])
            score = float(np.mean(rec["val_top1_per_depth"]))
            np.savez(workdir / "last_params.npz", **{k: np.asarray(v) for k, v in params.items()})
            if score > best:
                best = score
                np.savez(workdir / "best_params.npz", **{k: np.asarray(v) for k, v in params.items()})
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if out_of_time:
            logger.info("stopping after %.1f minutes (--max-minutes)", args.max_minutes)
            break
    bar.close()


# ---- offline acceptance --------------------------------------------------------------------------------------------


def replay_accepted(preds: np.ndarray, tokens: np.ndarray, num_prompt: int, gamma: int) -> tuple[int, int]:
    """Replay greedy speculative decoding over a target-greedy sequence: ``preds[j - 1, p]`` is the draft's depth-j
    token at slot p, ``tokens`` prompt + response. Steps start at slot ``c = num_prompt`` (the first response token
    comes from prefill), accept the longest prefix of ``preds[j - 1, c + j - 1] == tokens[c + j]``, commit it plus
    one target token. Returns (target steps, accepted drafts)."""
    steps = accepted = 0
    c, end = num_prompt, len(tokens) - 1
    while c < end:
        k = 0
        while k < gamma and c + k + 1 <= end and preds[k, c + k] == tokens[c + k + 1]:
            k += 1
        steps += 1
        accepted += k
        c += k + 1
    return steps, accepted


def load_reference(path: Path) -> dict[str, Any]:
    """An ``eval_draft.py`` result whose ``sd_outputs`` (lossless speculative outputs: the target's greedy
    responses) the offline replays score; a clear error when there is none."""
    how = f"run `python scripts/eval_draft.py --out {path}` first (its sd_outputs are the target's greedy responses)"
    if not path.is_file():
        raise SystemExit(f"--reference {path}: no such file; {how}")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"--reference {path}: not JSON ({e}); {how}") from None
    if not isinstance(result, dict) or not isinstance(result.get("sd_outputs"), dict) or not result["sd_outputs"]:
        raise SystemExit(f"--reference {path}: no sd_outputs in it; {how}")
    return result


def cmd_simulate(args: argparse.Namespace) -> None:
    """Held-out acceptance, greedy, without the engine: the held-out prompts' target-greedy responses from an
    ``eval_draft.py`` result (lossless SD output = the target's greedy output), the target's features over them,
    the unrolled draft, then :func:`replay_accepted`."""
    import jax
    import jax.numpy as jnp

    from nightjar_jax.config import ModelConfig

    result = load_reference(Path(args.reference))  # (before the models load: a missing file fails at once)
    workdir = Path(args.workdir)
    cfg = ModelConfig(**json.loads((workdir / "draft_config.json").read_text()))
    z = np.load(workdir / f"{args.params}_params.npz")
    params = {k: jnp.asarray(z[k]) for k in z.files}
    head_ids = np.load(workdir / "head_token_ids.npy")
    layers = cfg.feature_layers or ()
    tcfg, tparams = dd.target_params()
    tok = dd.target_tokenizer()
    prompts = {p["id"]: dd.chat_ids(tok, p["text"]) for p in dd.load_prompts("heldout")}

    @jax.jit
    def preds_for(tokens):
        h = dd.causal_forward(tcfg, tparams, tokens, return_hidden=True, hidden_layers=layers)
        outs = ttt_forward(cfg, params, tparams["model.embed_tokens.weight"][tokens], h, args.gamma)
        return jnp.stack([jnp.asarray(head_ids)[jnp.argmax(o @ params["lm_head.weight"].T, axis=-1)] for o in outs])

    per_source: dict[str, list[int]] = {}
    for pid, out in result["sd_outputs"].items():
        seq = np.asarray(prompts[pid] + list(out), np.int32)
        t = dd.bucket_of({"tokens": seq})
        padded = np.zeros((1, t), np.int32)
        padded[0, : len(seq)] = seq
        preds = np.asarray(preds_for(jnp.asarray(padded)))[:, 0]
        steps, acc = replay_accepted(preds, seq, len(prompts[pid]), args.gamma)
        s = per_source.setdefault("mt_bench" if pid.startswith("mt_bench") else "spec_bench", [0, 0])
        s[0] += steps
        s[1] += acc
    tot = [sum(v[0] for v in per_source.values()), sum(v[1] for v in per_source.values())]
    label = f"mean acc. len (γ={args.gamma})"
    print(f"{'':12s} {'target steps':>12s} {label:>20s}")
    for name, (steps, acc) in [("all", tot), *per_source.items()]:
        print(f"{name:12s} {steps:12d} {1 + acc / max(steps, 1):20.3f}")
    if args.out:
        Path(make_parent(args.out)).write_text(json.dumps({
            "workdir": str(workdir), "params": args.params, "gamma": args.gamma,
            "mean_accepted_length": 1 + tot[1] / max(tot[0], 1),
            "per_source": {k: 1 + v[1] / max(v[0], 1) for k, v in per_source.items()},
        }, indent=1) + "\n")


def cmd_export(args: argparse.Namespace) -> None:
    """bf16 weights + config -> an orbax checkpoint folder (the shipped draft's format); checks that the paged
    :class:`Llama` (as a feature draft, reading the target's features from the pool) reproduces the training
    forward's depth-1 logits on the target's features of a short chat."""
    import jax.numpy as jnp
    import ml_dtypes

    from nightjar_jax.config import ModelConfig
    from nightjar_jax.models.llama import HEAD_TOKEN_IDS, BatchMetadata, allocate_kv_cache, make_model_fns
    from nightjar_jax.models.loader import load_model
    from nightjar_jax.models.orbax_io import save_orbax

    workdir = Path(args.workdir)
    cfg = ModelConfig(**{**json.loads((workdir / "draft_config.json").read_text()), "dtype": args.dtype})
    params = dict(np.load(workdir / f"{args.params}_params.npz"))
    head_ids = np.load(workdir / "head_token_ids.npy").astype(np.int32)
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in params.items()} | {HEAD_TOKEN_IDS: head_ids}
    out = Path(args.out)
    save_orbax(out, cfg, bf16)

    tcfg, tparams = dd.target_params()
    tokens = np.asarray([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]],
                        np.int32) % cfg.vocab_size  # a SmolLM2 chat opening (any ids for other targets)
    t = tokens.shape[1]
    h = dd.causal_forward(tcfg, tparams, jnp.asarray(tokens), return_hidden=True,
                          hidden_layers=cfg.feature_layers or ())  # [1, T, H] ([1, T, (k + 1) * H] fused)
    emb = tparams["model.embed_tokens.weight"]
    shipped = {k: jnp.asarray(np.asarray(v, np.float32)) for k, v in bf16.items() if k != HEAD_TOKEN_IDS}
    ref = np.asarray(ttt_forward(cfg, shipped, emb[jnp.asarray(tokens)], h, 1)[0] @ shipped["lm_head.weight"].T)
    ckpt, graphdef, state = load_model(str(out), dtype="float32")
    kv = allocate_kv_cache(ckpt.config, num_pages=2, page_size=t)
    md = BatchMetadata(jnp.asarray([[1]], jnp.int32), jnp.asarray([t], jnp.int32), jnp.asarray([t], jnp.int32))
    hidden_fn, logits_fn = make_model_fns(graphdef)
    feats = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # f[p - 1] at slot p
    hidden, _ = hidden_fn(state, jnp.asarray(tokens), kv, md, features=feats, embed_table=emb)
    paged = np.asarray(logits_fn(state, hidden))[..., head_ids]
    dd.check_export(paged, ref, out)


def existing_folder(text: str) -> str:
    """A type for a folder that exists (``--features``: ``distill_draft.py features``'s --out)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no such folder")
    return text


def new_or_folder(text: str) -> str:
    """A type for a work folder: one that exists, or a path where one can be made (not a file)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the feature draft on stored target features")
    t.add_argument("--data", required=True, nargs="+", type=existing_file)
    t.add_argument("--features", required=True, type=existing_folder)
    t.add_argument("--workdir", required=True, type=new_or_folder)
    t.add_argument("--init-from", default="", help="a workdir's *_params.npz to start from")
    t.add_argument("--intermediate", type=positive_int, default=1536)
    t.add_argument("--num-layers", type=positive_int, default=1,
                   help="decoder layers; with --init-from a shallower draft, the new layers start as no-ops")
    t.add_argument("--head-vocab", type=positive_int, default=8192)
    t.add_argument("--freeze-head", action="store_true", help="keep the target's head rows")
    t.add_argument("--depths", type=positive_int, default=3, help="chain depths unrolled in training")
    t.add_argument("--depth-decay", type=float_in_range(0, 1), default=0.8,
                   help="loss weight of depth j: decay ** (j - 1)")
    t.add_argument("--reg-weight", type=non_negative_float, default=1.0, help="weight of the feature regression")
    t.add_argument("--steps", type=positive_int, default=2000)
    t.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    t.add_argument("--lr", type=positive_float, default=1e-3)
    t.add_argument("--warmup", type=non_negative_int, default=50)
    t.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    t.add_argument("--clip", type=positive_float, default=1.0)
    t.add_argument("--prompt-weight", type=non_negative_float, default=0.2)
    t.add_argument("--val-every", type=positive_int, default=20)
    t.add_argument("--eval-every", type=positive_int, default=100)
    t.add_argument("--max-minutes", type=non_negative_float, default=0.0)
    t.add_argument("--seed", type=non_negative_int, default=0)
    t.add_argument("--final-only", action="store_true",
                   help="read only the final state where the features hold more layers (a control for fusion)")
    t.set_defaults(fn=cmd_train)
    s = sub.add_parser("simulate", help="offline held-out greedy acceptance (replayed decode steps)")
    s.add_argument("--workdir", required=True)
    s.add_argument("--params", choices=("best", "last"), default="best")
    s.add_argument("--reference", default="results/eval_draft.json",
                   help="an eval_draft.py result: its sd_outputs are the target's greedy responses")
    s.add_argument("--gamma", type=positive_int, default=4)
    s.add_argument("--out", default=None, type=writable_out, help="also write the result as JSON here")
    s.set_defaults(fn=cmd_simulate)
    e = sub.add_parser("export", help="bf16 orbax checkpoint folder + a paged-forward check")
    e.add_argument("--workdir", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--params", choices=("best", "last"), default="best")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype recorded in the config (weights stay bf16)")
    e.set_defaults(fn=cmd_export)
    args = ap.parse_args(argv)
    if args.cmd == "train" and (Path(args.workdir) / "train_log.jsonl").exists():
        # (a rerun appended to the run's log and replaced its best weights with its own, worse ones; this command
        # has no --resume: --init-from continues from a run's weights, with a fresh optimizer)
        t.error(f"argument --workdir: {args.workdir!r} holds a training run (train_log.jsonl): give a new --workdir "
                f"(--init-from {Path(args.workdir) / 'last_params.npz'} starts from its weights)")
    if args.cmd == "train" and args.init_from and not Path(args.init_from).is_file():
        t.error(f"argument --init-from: {args.init_from!r}: no such file (give a workdir's last_params.npz or "
                f"best_params.npz)")
    if args.cmd in ("simulate", "export"):  # (both read a trained workdir)
        workdir = Path(args.workdir)
        missing = [f for f in ("draft_config.json", f"{args.params}_params.npz", "head_token_ids.npy")
                   if not (workdir / f).is_file()]
        if missing:
            (s if args.cmd == "simulate" else e).error(
                f"argument --workdir: {args.workdir!r} holds no {', '.join(missing)}: give `train`'s --workdir "
                f"(its {args.params}_params.npz is written at the first evaluation)")
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
