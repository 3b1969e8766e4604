r"""Distil a small Llama draft for SmolLM2-135M-Instruct (issue 8): data, training, export.

Vocabulary
- target: SmolLM2-135M-Instruct (30 layers, hidden 576, tied 49,152-token head), the model being served.
- draft: a small Llama (``--num-layers``, ``--hidden``) whose embedding is initialised from a PCA projection of the
  target's; its head is tied to that embedding (full vocabulary) or, with ``--head-vocab N``, an untied head over
  the N most frequent ids of the target's responses (``ModelConfig.head_vocab_size``; initialised from the same
  PCA rows): a cheaper head, and a full softmax over N ids in training instead of a sampled one.
- self-prompts (Magpie, Xu et al. 2024): the target continues its chat template's user header and so writes user
  prompts itself; the kept ones (ended with end-of-turn, unique) are answered like the dataset prompts.
- sequence-level KD (Kim & Rush 2016): the draft is trained with cross-entropy on the target's own responses to
  chat-templated prompts, which is what speculative decoding asks of it (predict the target's next token).
- logit KD (Hinton et al. 2015; DistillSpec, Zhou et al. 2024): ``teacher`` stores the target's top-k
  log-probabilities at every response position once (a cache-free forward, ~700 tokens/s on 2 cores);
  ``train --teacher`` adds a cross-entropy against them (``--kd-weight``), so a sampled response also teaches the
  target's ranking, and a greedy one the margins behind its argmax.
- held-out split: a fixed set of MT-Bench and Spec-Bench question ids never used for training
  (:data:`HELDOUT_MT_BENCH_PER_CATEGORY`, :data:`HELDOUT_SPEC_BENCH_PER_CATEGORY`); ``scripts/eval_draft.py`` reads
  the same split.

Stages (each resumable; run them in order; ``teacher`` and ``features`` run only rows their output folder does not
hold yet, so adding a --data file later costs only its rows)::

    python scripts/distill_draft.py self-prompts --out runs/draft/self.jsonl --num 2048   # optional
    python scripts/distill_draft.py generate --data runs/draft/data.jsonl [--self-prompts runs/draft/self.jsonl]
    python scripts/distill_draft.py teacher --data runs/draft/data.jsonl --out runs/draft/teacher   # optional
    python scripts/distill_draft.py train --data runs/draft/data.jsonl --workdir runs/draft [--resume] \
        [--teacher runs/draft/teacher --kd-weight 0.5]
    python scripts/distill_draft.py export --workdir runs/draft                  # bf16 -> assets/drafts

On a 1-thread CPU, set ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``.
On a GPU the same commands run in minutes (raise ``--batch-size``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nightjar_jax.bench.common import (  # noqa: E402
    existing_file,
    float_in_range,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    writable_out,
)
from nightjar_jax.models.llama import HEAD_TOKEN_IDS  # noqa: E402  (int32 ids of a subset head's rows)

TARGET = "smollm2-135m-instruct"
DATASETS = Path(os.environ.get("NIGHTJAR_DATASETS", "/work/shared/datasets"))
ASSET_DIR = REPO / "nightjar_jax" / "assets" / "drafts" / "smollm2-draft"
# Held out (never trained on): the first 2 MT-Bench questions of each of the 8 categories (16 questions, both
# turns) and the first 4 Spec-Bench questions of each non-MT-Bench category (20). MT-Bench ids are excluded from
# Spec-Bench's copy of MT-Bench too.
HELDOUT_MT_BENCH_PER_CATEGORY = 2
HELDOUT_SPEC_BENCH_PER_CATEGORY = 4
SPEC_BENCH_OWN = ("translation", "summarization", "qa", "math_reasoning", "rag")
MAX_PROMPT_TOKENS = 384  # prompts longer than this are skipped: prefill would cost more than the response
MAX_RESPONSE_TOKENS = 128

logger = logging.getLogger("distill_draft")


# ---- data --------------------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file, gzip-compressed when its name ends in ``.gz`` (the data kept in ``data/distill``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heldout_ids(datasets: Path = DATASETS) -> dict[str, list[int]]:
    """The held-out question ids: ``{"mt_bench": [...], "spec_bench": [...]}`` (Spec-Bench ids of its own sets)."""
    mt = _read_jsonl(datasets / "mt_bench" / "question.jsonl")
    spec = _read_jsonl(datasets / "spec_bench" / "question.jsonl")
    out: dict[str, list[int]] = {"mt_bench": [], "spec_bench": []}
    seen: dict[str, int] = {}
    for q in mt:
        if seen.get(q["category"], 0) < HELDOUT_MT_BENCH_PER_CATEGORY:
            out["mt_bench"].append(q["question_id"])
            seen[q["category"]] = seen.get(q["category"], 0) + 1
    seen = {}
    for q in spec:
        if q["category"] in SPEC_BENCH_OWN and seen.get(q["category"], 0) < HELDOUT_SPEC_BENCH_PER_CATEGORY:
            out["spec_bench"].append(q["question_id"])
            seen[q["category"]] = seen.get(q["category"], 0) + 1
    return out


def load_prompts(split: str, datasets: Path = DATASETS) -> list[dict[str, Any]]:
    """First-turn user prompts: ``[{"id": "spec_bench/181", "category": ..., "text": ...}]``.

    ``split="train"``: Spec-Bench (all categories, MT-Bench copy included) and Vicuna-Bench minus the held-out ids.
    ``split="heldout"``: the held-out MT-Bench and Spec-Bench questions.
    """
    held = heldout_ids(datasets)
    held_mt, held_spec = set(held["mt_bench"]), set(held["spec_bench"])
    spec = _read_jsonl(datasets / "spec_bench" / "question.jsonl")
    out = []
    if split == "heldout":
        for q in _read_jsonl(datasets / "mt_bench" / "question.jsonl"):
            if q["question_id"] in held_mt:
                out.append({"id": f"mt_bench/{q['question_id']}", "category": q["category"], "text": q["turns"][0]})
        for q in spec:
            if q["question_id"] in held_spec:
                out.append({"id": f"spec_bench/{q['question_id']}", "category": q["category"], "text": q["turns"][0]})
        return out
    if split != "train":
        raise ValueError(f"split={split!r} is invalid: allowed 'train' or 'heldout'")
    for q in spec:
        # Spec-Bench ids 81..160 are MT-Bench's own ids
        if q["question_id"] in held_spec or (q["category"] not in SPEC_BENCH_OWN and q["question_id"] in held_mt):
            continue
        out.append({"id": f"spec_bench/{q['question_id']}", "category": q["category"], "text": q["turns"][0]})
    for q in _read_jsonl(datasets / "mt_bench" / "vicuna_bench_question.jsonl"):
        out.append({"id": f"vicuna_bench/{q['question_id']}", "category": q["category"], "text": q["turns"][0]})
    return out


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def self_prompt_prefix(tokenizer: Any) -> list[int]:
    """The chat template up to and including the user turn's header: the target continues it with a user message
    (Magpie, Xu et al. 2024), so it writes its own instructions; the system prompt is the template's default."""
    marker = "\x00PROMPT\x00"
    full = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    return tokenizer.encode(full[: full.index(marker)], add_special_tokens=False)


def load_self_prompts(path: Path) -> list[dict[str, Any]]:
    """Kept self-written prompts (``kept`` true) as train prompts: ``[{"id": "self/17", "category": "self", ...}]``."""
    if not path.exists():
        return []
    return [
        {"id": r["id"], "category": "self", "text": r["text"]} for r in _read_jsonl(path) if r.get("kept", False)
    ]


def cmd_self_prompts(args: argparse.Namespace) -> None:
    """Sample ``--num`` user prompts from the target itself (temperature 1, top-p 0.98, seeds 0..num-1; resumable).

    Kept: the sample ended with the end-of-turn token (not cut by ``--max-tokens``), has at least 4 tokens, and its
    text was not seen before (case-insensitive). Every attempt is written, with ``kept``, so a rerun resumes."""
    from nightjar_jax.engine.llm import LLM
    from nightjar_jax.engine.sampling_params import SamplingParams

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _read_jsonl(out) if out.exists() else []
    done = {r["seed"] for r in rows}
    seen = {r["text"].strip().lower() for r in rows if r.get("kept")}
    todo = [s for s in range(args.num) if s not in done]
    if not todo:
        logger.info("%s already has %d attempts", out, args.num)
        return
    from nightjar_jax.models.presets import get_preset

    max_len = args.max_tokens + 64  # the prefix is 31 tokens
    kv_bytes = args.batch_size * (max_len + 16) * get_preset(TARGET).config.kv_bytes_per_token()  # no preemption
    llm = LLM(
        TARGET, draft_model=None, max_num_seqs=args.batch_size, max_model_len=max_len,
        max_num_batched_tokens=512, kv_cache_bytes=kv_bytes,
    )
    prefix = self_prompt_prefix(llm.get_tokenizer())
    kept = 0
    for start in range(0, len(todo), args.chunk):
        seeds = todo[start : start + args.chunk]
        params = [SamplingParams(temperature=1.0, top_p=0.98, max_tokens=args.max_tokens, seed=s) for s in seeds]
        outs = llm.generate([prefix] * len(seeds), params, use_tqdm=False)
        with open(out, "a", encoding="utf-8") as f:
            for s, o in zip(seeds, outs, strict=True):
                c = o.outputs[0]
                text = c.text.strip()
                ok = (c.finish_reason == "stop" and len(c.token_ids) >= 4 and text.lower() not in seen
                      and "<|" not in text)
                if ok:
                    seen.add(text.lower())
                    kept += 1
                f.write(json.dumps({"id": f"self/{s}", "seed": s, "kept": ok, "text": text}) + "\n")
        logger.info("self-prompts: %d / %d attempts, %d kept", start + len(seeds), len(todo), kept)


def cmd_generate(args: argparse.Namespace) -> None:
    """Target responses for every train prompt: greedy, then ``--num-sampled`` at temperature 0.7 (appends)."""
    from tqdm import tqdm

    from nightjar_jax.engine.llm import LLM
    from nightjar_jax.engine.sampling_params import SamplingParams

    data = Path(args.data)
    data.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["id"], r["kind"]) for r in _read_jsonl(data)} if data.exists() else set()
    max_len = MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS
    # KV for every sequence at full length, so a batch never preempts (recompute would waste target time)
    from nightjar_jax.models.presets import get_preset

    kv_bytes = args.batch_size * (max_len + 16) * get_preset(TARGET).config.kv_bytes_per_token()
    llm = LLM(
        TARGET,
        draft_model=None,  # the target alone, even if a default draft pair is configured
        max_num_seqs=args.batch_size,
        max_model_len=max_len,
        max_num_batched_tokens=512,
        kv_cache_bytes=kv_bytes,
    )
    tok = llm.get_tokenizer()
    prompts = load_prompts("train")
    if args.self_prompts:
        prompts += load_self_prompts(Path(args.self_prompts))
    if args.limit:
        prompts = prompts[: args.limit]
    jobs = []
    kinds = ["greedy"] + [f"sample{i}" for i in range(args.num_sampled)]
    for kind in kinds:
        for p in prompts:
            if (p["id"], kind) in done:
                continue
            ids = chat_ids(tok, p["text"])
            if len(ids) > MAX_PROMPT_TOKENS:
                continue
            jobs.append((p, kind, ids))
    logger.info("%d prompts, %d jobs to run (%d done)", len(prompts), len(jobs), len(done))
    bar = tqdm(total=len(jobs), desc="generate", unit="resp")
    num_tokens, t0 = 0, time.perf_counter()
    for start in range(0, len(jobs), args.chunk):
        chunk = jobs[start : start + args.chunk]
        params = [
            SamplingParams(
                temperature=0.0 if kind == "greedy" else 0.7,
                max_tokens=MAX_RESPONSE_TOKENS,
                # crc32, not hash(): str hashes are salted per process, so a resumed run would draw other samples
                seed=None if kind == "greedy" else zlib.crc32(f"{p['id']}/{kind}".encode()) % 2**31,
            )
            for p, kind, _ in chunk
        ]
        outs = llm.generate([ids for _, _, ids in chunk], params, use_tqdm=False)
        with open(data, "a", encoding="utf-8") as f:
            for (p, kind, ids), out in zip(chunk, outs, strict=True):
                resp = list(out.outputs[0].token_ids)
                num_tokens += len(resp)
                f.write(json.dumps({"id": p["id"], "kind": kind, "prompt_ids": ids, "response_ids": resp}) + "\n")
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()


# ---- draft model ---------------------------------------------------------------------------------------------


def draft_config(hidden: int, num_layers: int, intermediate: int, head_vocab: int = 0) -> Any:
    """The draft's :class:`ModelConfig`: the target's tokenizer, RoPE and special ids; 64-wide heads, GQA 3:1.

    ``head_vocab > 0``: an untied LM head over only that many ids (``head_vocab_size``), else the tied full head."""
    from nightjar_jax.models.presets import get_preset

    t = get_preset(TARGET).config
    num_heads = max(1, round(hidden / 64))
    num_heads += (-num_heads) % 3 if num_heads >= 3 else 0
    return t.replace(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=max(1, num_heads // 3),
        head_dim=64,
        tie_word_embeddings=head_vocab == 0,
        head_vocab_size=head_vocab or None,
        dtype="float32",
        name="smollm2-draft",
    )


def load_init_from(path: str, cfg: Any) -> dict[str, np.ndarray]:
    """A shipped draft (``export``'s folder, e.g. the previous version) as float32 starting weights for ``train``
    (warm start: more data for a draft that already learned the target's habits). Its architecture must be the
    one ``train`` was asked for; ``lm_head.token_ids`` stays in the result for the subset head."""
    from nightjar_jax.models.orbax_io import load_orbax

    got, state, _ = load_orbax(path)
    fields = ("hidden_size", "num_layers", "intermediate_size", "head_vocab_size", "num_heads", "num_kv_heads")
    diff = {f: (getattr(got, f), getattr(cfg, f)) for f in fields if getattr(got, f) != getattr(cfg, f)}
    if diff:
        raise ValueError(f"--init-from {path}: its architecture differs from the requested one (its, asked): {diff}")
    return {k: (np.asarray(v, np.int32) if k == HEAD_TOKEN_IDS else np.asarray(v, np.float32))
            for k, v in state.items()}


def init_params(cfg: Any, seed: int, head_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """HF-named float32 weights: embedding (= tied head) from the target's by PCA, layers random. With a subset
    head (``head_ids``), its rows start as the PCA embedding's rows of those ids (a tied start, then untied).

    The target's logits are ``h @ E.T`` with ``E`` [49152, 576]; with ``V`` [576, D] the top right singular vectors
    of ``E``, ``E @ V`` keeps the directions the target's head uses most, so the draft starts with the target's
    token geometry and only its layers must learn to land the final hidden state there.
    """
    from nightjar_jax.models.loader import load_checkpoint

    emb = np.asarray(load_checkpoint(TARGET).state_dict["model.embed_tokens.weight"], np.float32)  # [V, 576]
    eigval, eigvec = np.linalg.eigh(emb.T.astype(np.float64) @ emb)  # ascending
    proj = eigvec[:, ::-1][:, : cfg.hidden_size].astype(np.float32)  # [576, D]
    emb_d = emb @ proj  # [V, D]
    logger.info(
        "PCA embedding: rank %d keeps %.1f%% of the energy",
        cfg.hidden_size,
        100 * eigval[::-1][: cfg.hidden_size].sum() / eigval.sum(),
    )
    rng = np.random.default_rng(seed)
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def lin(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * scale / math.sqrt(inp)).astype(np.float32)

    # final-norm gain so that initial logits have unit scale (the PCA rows are large: tied head logits of ~30)
    gain = 1.0 / (float(np.sqrt(np.mean(emb_d**2))) * math.sqrt(d))
    out = {"model.embed_tokens.weight": emb_d, "model.norm.weight": np.full(d, gain, np.float32)}
    if head_ids is not None:
        out["lm_head.weight"] = emb_d[head_ids].copy()
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = lin(cfg.num_heads * hd, d)
        out[p + "self_attn.k_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        out[p + "self_attn.v_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        out[p + "self_attn.o_proj.weight"] = lin(d, cfg.num_heads * hd, depth_scale)
        out[p + "mlp.gate_proj.weight"] = lin(f, d)
        out[p + "mlp.up_proj.weight"] = lin(f, d)
        out[p + "mlp.down_proj.weight"] = lin(d, f, depth_scale)
        out[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
    return out


def head_weight(params: dict[str, Any]) -> Any:
    """The LM head's ``[rows, hidden]`` matrix: the subset head's own, or the tied embedding."""
    return params.get("lm_head.weight", params["model.embed_tokens.weight"])


def qkv_projections(cfg: Any, params: dict[str, Any], prefix: str, x: Any, positions: Any, inv_freq: Any
                    ) -> tuple[Any, Any, Any]:
    """One layer's (normed) input x [B, T, D] -> q [B, T, heads, hd] and k, v [B, T, kv_heads, hd], RoPE applied
    to q and k (HF names under ``prefix``, e.g. ``model.layers.0.``)."""
    from nightjar_jax.models.llama import apply_rope

    b, t, _ = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = apply_rope((x @ params[prefix + "self_attn.q_proj.weight"].T).reshape(b, t, nh, hd), positions, inv_freq)
    k = apply_rope((x @ params[prefix + "self_attn.k_proj.weight"].T).reshape(b, t, nkv, hd), positions, inv_freq)
    v = (x @ params[prefix + "self_attn.v_proj.weight"].T).reshape(b, t, nkv, hd)
    return q, k, v


def causal_forward(cfg: Any, params: dict[str, Any], tokens: Any, *, return_hidden: bool = False,
                   hidden_layers: tuple[int, ...] = ()) -> Any:
    """Plain (cache-free) causal forward over HF-named params: tokens [B, T] int32 -> logits [B, T, V] float32.

    The same math as :class:`nightjar_jax.models.llama.Llama` (rotate-half RoPE, RMSNorm in float32, SwiGLU, GQA,
    tied head), so trained weights load into the paged model unchanged; ``export`` checks the logits agree.
    ``return_hidden``: the final normed hidden state [B, T, D] instead of logits; with ``hidden_layers`` (layer
    counts ``1 .. num_layers - 1``) the residual stream after each of those layers comes first, concatenated on the
    last axis: [B, T, (len(hidden_layers) + 1) * D] (fused features, EAGLE-3).
    """
    import jax
    import jax.numpy as jnp

    from nightjar_jax.models.llama import rope_inv_freq

    def norm(x: Any, w: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w

    b, t = tokens.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv_freq = jnp.asarray(rope_inv_freq(hd, cfg.rope_theta, cfg.rope_scaling))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    emb = params["model.embed_tokens.weight"]
    x = emb[tokens]  # [B, T, D]
    bad = [n for n in hidden_layers if not 1 <= n < cfg.num_layers]
    if bad:
        raise ValueError(f"hidden_layers {bad}: a layer count in 1..{cfg.num_layers - 1} (the final state comes last)")
    taken = []
    for i in range(cfg.num_layers):
        if i in hidden_layers:
            taken.append(x)
        p = f"model.layers.{i}."
        h = norm(x, params[p + "input_layernorm.weight"])
        q, k, v = qkv_projections(cfg, params, p, h, positions, inv_freq)
        q = q.reshape(b, t, nkv, nh // nkv, hd)  # query heads grouped by their KV head
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(hd)  # [B, KV, G, T, T]
        scores = jnp.where(causal, scores, -1e30)
        attn = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, nh * hd)
        x = x + attn @ params[p + "self_attn.o_proj.weight"].T
        h = norm(x, params[p + "post_attention_layernorm.weight"])
        gate = h @ params[p + "mlp.gate_proj.weight"].T
        x = x + (jax.nn.silu(gate) * (h @ params[p + "mlp.up_proj.weight"].T)) @ params[p + "mlp.down_proj.weight"].T
    x = norm(x, params["model.norm.weight"])
    if hidden_layers:
        return jnp.concatenate([*taken, x], axis=-1)
    return x if return_hidden else x @ head_weight(params).T  # [B, T, D] or [B, T, V or head rows]


# ---- training ------------------------------------------------------------------------------------------------------


def load_sequences(path: Path, max_len: int) -> list[dict[str, Any]]:
    """Training rows: ``tokens`` = prompt + response (+ EOS when the target stopped), ``num_prompt`` tokens."""
    rows = []
    for r in _read_jsonl(path):
        toks = (r["prompt_ids"] + r["response_ids"])[:max_len]
        if len(toks) > len(r["prompt_ids"]):
            rows.append({"id": r["id"], "kind": r["kind"], "tokens": toks, "num_prompt": len(r["prompt_ids"])})
    return rows


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    """The training rows of several response files, in file order; a response in two files (same id and kind)
    counts once. ``teacher`` and ``train`` both read rows this way, so their orders agree."""
    rows, seen = [], set()
    for path in paths:
        for r in load_sequences(Path(path), max(BUCKETS)):
            if (r["id"], r["kind"]) not in seen:
                seen.add((r["id"], r["kind"]))
                rows.append(r)
    return rows


def row_key(r: dict[str, Any]) -> str:
    return f"{r['id']}\t{r['kind']}"


def response_labels(r: dict[str, Any]) -> slice:
    """The positions whose label (next token) is a target-written token: ``num_prompt - 1 .. len(tokens) - 2``
    (empty for a prompt-text row, whose ``num_prompt`` is past its end)."""
    return slice(r["num_prompt"] - 1, len(r["tokens"]) - 1)


def teacher_positions(r: dict[str, Any]) -> int:
    """How many :func:`response_labels` positions ``r`` has (the teacher's top-k rows for it)."""
    return max(0, len(r["tokens"]) - r["num_prompt"])


def bucket_of(r: dict[str, Any]) -> int:
    """The smallest of :data:`BUCKETS` that holds the row (batches are padded to it)."""
    return next(b for b in BUCKETS if len(r["tokens"]) <= b)


def target_params() -> tuple[Any, dict[str, Any]]:
    """The target's config and its HF-named weights as float32 device arrays (for :func:`causal_forward`)."""
    import jax.numpy as jnp

    from nightjar_jax.models.loader import load_checkpoint

    ckpt = load_checkpoint(TARGET)
    return ckpt.config, {k: jnp.asarray(np.asarray(v, np.float32)) for k, v in ckpt.state_dict.items()}


def target_parts(rows: list[dict[str, Any]], out: Path, rows_per_part: int, desc: str) -> Any:
    """Yield ``(part path, rows, progress bar)`` for the rows no part in ``out`` holds yet (by :func:`row_key`),
    ``rows_per_part`` at a time, in new parts numbered after the existing ones: a rerun resumes, and a rerun with
    more --data files runs only the new rows. The bar counts tokens (:func:`bucketed_batches` advances it)."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    last = -1
    for part in sorted(out.glob("part-*.npz")):
        try:
            with np.load(part) as z:  # reads the keys only
                done.update(str(k) for k in z["keys"])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # (parts are written whole since)
            raise SystemExit(f"{part} is not a whole part ({type(exc).__name__}: {exc}); a run killed while "
                             "writing it left it: delete it and run again (its rows are computed anew)") from None
        last = max(last, int(part.stem.split("-")[1]))
    todo = [r for r in rows if row_key(r) not in done]
    total = sum(len(r["tokens"]) for r in todo)
    logger.info("%d rows, %d already in %s; %d rows (%d tokens) to run", len(rows), len(rows) - len(todo), out,
                len(todo), total)
    bar = tqdm(total=total, desc=desc, unit="tok")
    for i, s in enumerate(range(0, len(todo), rows_per_part)):
        yield out / f"part-{last + 1 + i:05d}.npz", todo[s : s + rows_per_part], bar
    bar.close()


def save_part(part: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` of one part, written beside it and renamed into place: a part that exists is whole (a run killed
    while writing one left half a zip, and every later run failed on it with a bare BadZipFile)."""
    partial = part.with_name(part.name + ".partial")  # (not part-*.npz: the readers never see it)
    with open(partial, "wb") as f:
        np.savez(f, **arrays)
    os.replace(partial, part)


def bucketed_batches(chunk: list[dict[str, Any]], tokens_per_batch: int, bar: Any = None) -> Any:
    """Yield ``(row indices, tokens [B, T] int32)``: ``chunk``'s rows grouped by :func:`bucket_of`, zero-padded to a
    fixed batch shape per bucket (one compile each)."""
    by_bucket: dict[int, list[int]] = {b: [] for b in BUCKETS}
    for j, r in enumerate(chunk):
        by_bucket[bucket_of(r)].append(j)
    for t, idx in by_bucket.items():
        bsz = max(1, tokens_per_batch // t)
        for b0 in range(0, len(idx), bsz):
            sel = idx[b0 : b0 + bsz]
            tok = np.zeros((bsz, t), np.int32)
            for i, j in enumerate(sel):
                tok[i, : len(chunk[j]["tokens"])] = chunk[j]["tokens"]
            yield sel, tok
            if bar is not None:
                bar.update(sum(len(chunk[j]["tokens"]) for j in sel))


def check_export(paged: np.ndarray, ref: np.ndarray, out: Path) -> None:
    """Refuse an export whose paged forward disagrees with the training forward; log its size on disk."""
    err = float(np.max(np.abs(paged - ref)))
    same_argmax = bool((paged.argmax(-1) == ref.argmax(-1)).all())
    logger.info("paged vs training forward: max |logit diff| %.2e, argmax equal %s", err, same_argmax)
    if err > 1e-2 or not same_argmax:
        raise SystemExit(f"paged forward disagrees with the training forward (max diff {err})")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    logger.info("exported %s: %.2f MB on disk", out, size / 1e6)


def cmd_teacher(args: argparse.Namespace) -> None:
    """The target's top-k log-probabilities at every response position of the training rows (for ``train
    --teacher``: distillation on the target's logits, not only on its sampled tokens). One ``part-NNNNN.npz`` per
    ``--rows-per-part`` rows (a resume point): ``keys`` (id and kind), ``counts`` (positions per row), ``ids``
    [positions, k] uint16 and ``logp`` [positions, k] float16, rows in :func:`load_rows` order."""
    import jax
    import jax.numpy as jnp

    out = Path(args.out)
    rows = load_rows(args.data)
    cfg, params = target_params()
    if cfg.vocab_size > np.iinfo(np.uint16).max + 1:
        raise SystemExit(f"vocab {cfg.vocab_size} does not fit the uint16 id store")
    k = args.top_k

    @jax.jit
    def topk(p: dict[str, Any], tok: Any) -> tuple[Any, Any]:
        logp = jax.nn.log_softmax(causal_forward(cfg, p, tok), axis=-1)
        vals, ids = jax.lax.top_k(logp, k)
        return vals, ids

    for part, chunk, bar in target_parts(rows, out, args.rows_per_part, "teacher"):
        got: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for sel, tok in bucketed_batches(chunk, args.tokens_per_batch, bar):
            vals, ids = (np.asarray(a) for a in topk(params, jnp.asarray(tok)))
            for i, j in enumerate(sel):
                span = response_labels(chunk[j])
                got[j] = (ids[i, span].astype(np.uint16), vals[i, span].astype(np.float16))
        save_part(
            part,
            keys=np.asarray([row_key(r) for r in chunk]),
            counts=np.asarray([teacher_positions(r) for r in chunk], np.int32),
            ids=np.concatenate([got[j][0] for j in range(len(chunk))]),
            logp=np.concatenate([got[j][1] for j in range(len(chunk))]),
        )
    logger.info("teacher top-%d in %s", k, out)


def cmd_features(args: argparse.Namespace) -> None:
    """The target's final (normed) hidden state at every position of the training rows, for a feature draft
    (``distill_eagle.py train``: the draft reads the target's hidden state at position p - 1 with token p). One
    ``part-NNNNN.npz`` per ``--rows-per-part`` rows (a resume point): ``keys``, ``counts`` (= row lengths) and
    ``feats`` [positions, hidden] float16, rows in :func:`load_rows` order. ``--layers 3,15`` also stores the
    residual stream after those layers, first: ``feats`` [positions, 3 * hidden] (EAGLE-3's fused features), and
    the folder's ``layers.json`` names them (every part of a folder has the same layers)."""
    import jax
    import jax.numpy as jnp

    out = Path(args.out)
    rows = load_rows(args.data)
    cfg, params = target_params()
    try:
        layers = tuple(int(v) for v in args.layers.split(",")) if args.layers else ()
        if list(layers) != sorted(set(layers)):
            raise ValueError("increasing layer counts, each once")
        causal_forward(cfg, params, jnp.zeros((1, 1), jnp.int32), hidden_layers=layers)
    except ValueError as e:
        raise SystemExit(f"--layers {args.layers}: {e} (e.g. 3,15: comma-separated, increasing)") from None
    spec = out / "layers.json"
    held = json.loads(spec.read_text()) if spec.exists() else [] if any(out.glob("part-*.npz")) else None
    if held is not None and tuple(held) != layers:  # (parts without layers.json hold the final state alone)
        raise SystemExit(f"--layers {args.layers or '(none)'}: {out} holds features of layers {held or '(none)'}; "
                         "use another --out")
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(list(layers)) + "\n")

    @jax.jit
    def hidden(p: dict[str, Any], tok: Any) -> Any:
        return causal_forward(cfg, p, tok, return_hidden=True, hidden_layers=layers).astype(jnp.float16)

    for part, chunk, bar in target_parts(rows, out, args.rows_per_part, "features"):
        got: dict[int, np.ndarray] = {}
        for sel, tok in bucketed_batches(chunk, args.tokens_per_batch, bar):
            h = np.asarray(hidden(params, jnp.asarray(tok)))
            for i, j in enumerate(sel):
                got[j] = h[i, : len(chunk[j]["tokens"])]
        save_part(
            part,
            keys=np.asarray([row_key(r) for r in chunk]),
            counts=np.asarray([len(r["tokens"]) for r in chunk], np.int32),
            feats=np.concatenate([got[j] for j in range(len(chunk))]),
        )
    logger.info("target features in %s", out)


def load_teacher(path: Path, rows: list[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``teacher``'s parts as {row key: (ids [positions, k], logp [positions, k])}; every response row of ``rows``
    must be covered (a clear error names the first that is not)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for part in sorted(path.glob("part-*.npz")):
        z = np.load(part)
        offsets = np.concatenate([[0], np.cumsum(z["counts"])])
        for i, key in enumerate(z["keys"]):
            out[str(key)] = (z["ids"][offsets[i] : offsets[i + 1]], z["logp"][offsets[i] : offsets[i + 1]])
    if not out:
        raise SystemExit(f"--teacher {path}: no part-*.npz files there; run `teacher` with the same --data first")
    for r in rows:
        got = out.get(row_key(r))
        if got is None or len(got[0]) != teacher_positions(r):
            raise SystemExit(
                f"--teacher {path}: no top-k for response {r['id']} ({r['kind']}) with {teacher_positions(r)} "
                "positions; run `teacher` with the same --data files first"
            )
    logger.info("teacher: top-%d at the response positions of %d rows", next(iter(out.values()))[0].shape[1], len(rows))
    return out


def target_tokenizer() -> Any:
    """The target's tokenizer: without its weights when the GGUF is cached; on a fresh machine the real load
    fetches it (the dummy load never downloads, and has no tokenizer then)."""
    from nightjar_jax.models.loader import load_checkpoint

    return load_checkpoint(TARGET, load_format="dummy").tokenizer or load_checkpoint(TARGET).tokenizer


def prompt_text_rows(skip_ids: set[str], max_len: int) -> list[dict[str, Any]]:
    """Train prompts with no target response (long Spec-Bench documents, prompts not generated yet) as plain
    language-model rows (every label weighted ``--prompt-weight``): human text that costs no target compute."""
    tok = target_tokenizer()
    rows = []
    for p in load_prompts("train"):
        if p["id"] not in skip_ids:
            toks = chat_ids(tok, p["text"])[:max_len]
            rows.append({"id": p["id"], "kind": "prompt", "tokens": toks, "num_prompt": len(toks) + 1})
    return rows


BUCKETS = (128, 256, 512)
VOCAB = 49152


def make_batches(
    rows: list[dict[str, Any]],
    tokens_per_batch: int,
    prompt_weight: float,
    seed: int,
    frequent: np.ndarray | None = None,
    num_candidates: int = 8192,
    teacher: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> list[Any]:
    """Shuffled, length-bucketed batches: (tokens [B, T] int32, labels [B, T] int32, weights [B, T] float32,
    candidates [C] int32, teacher): ``teacher`` is None or (ids [B, T, k] int32, probabilities [B, T, k] float32,
    0 where a position has no teacher top-k) from :func:`load_teacher`.

    ``labels[t] = tokens[t + 1]``; weight 1 where the label is a target-written token, ``prompt_weight`` where it
    is a prompt token, 0 on padding. One fixed list per epoch seed, so a resumed run sees the same order.

    Sampled softmax: the training loss normalises over ``candidates`` only (the ``frequent`` ids, every label of the
    batch, and random other ids as negatives), and ``labels`` index into it. The head over all 49,152 ids costs
    ~6x the draft's layers; the served draft still uses the full tied head, and the random negatives keep rare
    ids' logits low there (validation reports top-1 with the full head).
    """
    rng = np.random.default_rng(seed)
    by_bucket: dict[int, list[dict[str, Any]]] = {b: [] for b in BUCKETS}
    for r in rows:
        by_bucket[bucket_of(r)].append(r)
    batches = []
    for t, group in by_bucket.items():
        rng.shuffle(group)
        bsz = max(1, tokens_per_batch // t)
        for s in range(0, len(group), bsz):
            chunk = group[s : s + bsz]
            tok = np.zeros((bsz, t), np.int32)
            lab = np.zeros((bsz, t), np.int32)
            wts = np.zeros((bsz, t), np.float32)
            teach = None
            if teacher is not None:
                k = next(iter(teacher.values()))[0].shape[1]
                teach = (np.zeros((bsz, t, k), np.int32), np.zeros((bsz, t, k), np.float32))
            for j, r in enumerate(chunk):
                n = len(r["tokens"])
                tok[j, :n] = r["tokens"]
                lab[j, : n - 1] = r["tokens"][1:]
                wts[j, : n - 1] = prompt_weight
                wts[j, response_labels(r)] = 1.0
                if teach is not None and teacher_positions(r):
                    ids, logp = teacher[row_key(r)]
                    teach[0][j, response_labels(r)] = ids
                    teach[1][j, response_labels(r)] = np.exp(logp.astype(np.float32))
            if frequent is None:
                batches.append((tok, lab, wts, None, teach))
                continue
            cand = np.unique(np.concatenate([frequent, lab[wts > 0]]))
            if len(cand) < num_candidates:
                rest = np.setdiff1d(rng.integers(0, VOCAB, 4 * num_candidates), cand)
                cand = np.concatenate([cand, rng.permutation(rest)[: num_candidates - len(cand)]])
            cand = np.sort(cand[:num_candidates]).astype(np.int32)  # labels always fit: |frequent| << C
            lab = np.where(wts > 0, np.searchsorted(cand, lab), 0).astype(np.int32)
            batches.append((tok, lab, wts, cand, teach))
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]



def _grad_norm(tree):
    """The gradients' global L2 norm (``optax.tree.norm`` where this optax has it; ``optax.global_norm`` before)."""
    import optax

    tree_ns = getattr(optax, "tree", None)
    return tree_ns.norm(tree) if tree_ns is not None and hasattr(tree_ns, "norm") else optax.global_norm(tree)


def cmd_train(args: argparse.Namespace) -> None:
    """AdamW (warmup-cosine, global-norm clipping) on the target's responses; orbax checkpoints; ``--resume``."""
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    # (main's parse_args refuses these first, check_train_args; kept for callers that build the args themselves)
    if args.teacher and not args.head_vocab:
        raise SystemExit("--teacher needs --head-vocab N (the KD loss is over the subset head's ids)")
    if args.kd_weight is None:  # (the flag's default: 0.5 where a teacher is given; no teacher, no KD term)
        args.kd_weight = 0.5
    if not 0.0 <= args.kd_weight <= 1.0:
        raise SystemExit(f"--kd-weight {args.kd_weight}: allowed 0..1 (the top-k term's share of the loss)")
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = draft_config(args.hidden, args.num_layers, args.intermediate, args.head_vocab)
    (workdir / "draft_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    # the flags that set what a step computes, as given (a resume checks them: check_train_args)
    (workdir / "train_flags.json").write_text(json.dumps(train_flags(args), indent=2) + "\n")
    rows = load_rows(args.data)
    teacher = load_teacher(Path(args.teacher), rows) if args.teacher else None
    if args.prompt_text:
        rows += prompt_text_rows({r["id"] for r in rows}, max(BUCKETS))
    val_ids = sorted({r["id"] for r in rows})[:: max(1, args.val_every)]  # a fixed 1-in-N slice of train prompts
    val_set = set(val_ids)
    train_rows = [r for r in rows if r["id"] not in val_set]
    val_rows = [r for r in rows if r["id"] in val_set and r["kind"] == "greedy"]
    if not train_rows or not val_rows:  # (a bare "need at least one array to concatenate")
        raise SystemExit(f"--data holds {len({r['id'] for r in rows})} prompt(s): one in --val-every "
                         f"{args.val_every} goes to validation, which leaves {len(train_rows)} training and "
                         f"{len(val_rows)} validation sequences; give more prompts (or a larger --val-every)")
    n_resp = sum(len(r["tokens"]) - r["num_prompt"] for r in train_rows)
    logger.info(
        "%d train sequences (%d response tokens), %d validation sequences", len(train_rows), n_resp, len(val_rows)
    )
    val_batches = make_batches(val_rows, args.tokens_per_batch, 0.0, seed=0)

    warmup = min(args.warmup, args.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.05)

    def is_embedding(path: str) -> str:
        return "embedding" if path == "model.embed_tokens.weight" else "layers"

    # the most frequent ids of the target's responses: always softmax candidates (full head), or the subset head
    counts = np.bincount(
        np.concatenate([np.asarray(r["tokens"][r["num_prompt"] :], np.int64) for r in train_rows]), minlength=VOCAB
    )
    head_ids = None
    warm = load_init_from(args.init_from, cfg) if args.init_from else None
    warm_ids = None if warm is None else warm.pop(HEAD_TOKEN_IDS, None)
    if args.head_vocab:
        ids_path = workdir / "head_token_ids.npy"
        if args.resume and ids_path.exists():
            head_ids = np.load(ids_path)
        elif warm_ids is not None:  # keep the warm start's head ids: its head rows belong to them
            head_ids = warm_ids
            np.save(ids_path, head_ids)
        else:
            eos = [int(t) for t in cfg.eos_token_ids]  # the draft must be able to propose end-of-turn
            order = [int(t) for t in np.argsort(-counts, kind="stable") if int(t) not in eos]
            head_ids = np.sort(np.asarray(eos + order[: args.head_vocab - len(eos)], np.int32))
            np.save(ids_path, head_ids)
        logger.info(
            "subset head: %d ids cover %.2f%% of response tokens", len(head_ids),
            100 * counts[head_ids].sum() / counts.sum(),
        )
    resuming = args.resume and (workdir / "ckpt").exists() and any((workdir / "ckpt").iterdir())
    if resuming:
        init = _abstract_params(cfg)
    elif warm is not None:
        init = warm
        logger.info("initialised from %s", args.init_from)
    else:
        init = init_params(cfg, args.seed, head_ids)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    labels = {k: is_embedding(k) for k in params}

    def adamw(lr_scale: float) -> optax.GradientTransformation:
        return optax.adamw(
            lambda s: schedule(s) * lr_scale,
            b1=0.9,
            b2=0.98,
            weight_decay=args.weight_decay,
            mask=lambda p: jax.tree.map(lambda v: v.ndim == 2, p),
        )

    tx = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.multi_transform({"embedding": adamw(args.embedding_lr_scale), "layers": adamw(1.0)}, labels),
    )
    opt_state = tx.init(params)
    step = 0
    mngr = ocp.CheckpointManager(workdir / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    if args.resume and mngr.latest_step() is not None:
        step = mngr.latest_step()
        target = {"params": params, "opt_state": opt_state}
        restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]
        logger.info("resumed from step %d", step)

    head_ids_dev = None if head_ids is None else jnp.asarray(head_ids)

    def subset_loss_fn(p: dict[str, Any], tok: Any, lab: Any, wts: Any, teach: Any = None) -> tuple[Any, Any]:
        """Full softmax over the subset head; labels outside it carry no loss and count as misses.

        With ``teach`` (the target's top-k at response positions): ``(1 - kd) * CE(label) + kd * CE(teacher)``, the
        second a cross-entropy against the target's top-k probabilities renormalised over the ids the head has
        (forward KL to that distribution up to a constant): the target's whole ranking, not one sampled token."""
        logits = causal_forward(cfg, p, tok)  # [B, T, N]
        sub = jnp.clip(jnp.searchsorted(head_ids_dev, lab), 0, len(head_ids) - 1)
        in_head = head_ids_dev[sub] == lab
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, sub[..., None], axis=-1)[..., 0]
        w = wts * in_head
        loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
        if teach is not None:
            tids, tprob = teach
            tsub = jnp.clip(jnp.searchsorted(head_ids_dev, tids), 0, len(head_ids) - 1)
            tp = tprob * (head_ids_dev[tsub] == tids)
            mass = jnp.sum(tp, axis=-1)  # [B, T]
            tp = tp / jnp.maximum(mass, 1e-9)[..., None]
            kd_nll = -jnp.sum(tp * jnp.take_along_axis(logp, tsub, axis=-1), axis=-1)
            kmask = (mass > 0) * (wts >= 1.0)
            kd_loss = jnp.sum(kd_nll * kmask) / jnp.maximum(jnp.sum(kmask), 1.0)
            loss = (1.0 - args.kd_weight) * loss + args.kd_weight * kd_loss
        resp = (wts >= 1.0).astype(jnp.float32)
        hits = jnp.sum((head_ids_dev[jnp.argmax(logits, axis=-1)] == lab) * resp)
        return loss, (hits, jnp.sum(resp))

    def loss_fn(p: dict[str, Any], tok: Any, lab: Any, wts: Any, cand: Any, teach: Any = None) -> tuple[Any, Any]:
        if head_ids is not None:
            return subset_loss_fn(p, tok, lab, wts, teach)
        if cand is None:
            logits = causal_forward(cfg, p, tok)  # full head (validation)
        else:
            hidden = causal_forward(cfg, p, tok, return_hidden=True)
            logits = hidden @ p["model.embed_tokens.weight"][cand].T  # [B, T, C]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, lab[..., None], axis=-1)[..., 0]
        loss = jnp.sum(nll * wts) / jnp.maximum(jnp.sum(wts), 1.0)
        resp = (wts >= 1.0).astype(jnp.float32)
        hits = jnp.sum((jnp.argmax(logits, axis=-1) == lab) * resp)
        return loss, (hits, jnp.sum(resp))

    @jax.jit
    def train_step(p, o, tok, lab, wts, cand, teach):
        (loss, (hits, n)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, tok, lab, wts, cand, teach)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss, hits / jnp.maximum(n, 1.0), _grad_norm(grads)

    @jax.jit
    def eval_step(p, tok, lab, wts):
        return loss_fn(p, tok, lab, wts, None)

    def validate(p: Any) -> tuple[float, float]:
        tot_loss = tot_hits = tot_n = 0.0
        for tok, lab, wts, _, _ in val_batches:
            loss, (hits, n) = eval_step(p, tok, lab, wts)
            tot_loss += float(loss) * float(n)
            tot_hits, tot_n = tot_hits + float(hits), tot_n + float(n)
        return tot_loss / max(tot_n, 1.0), tot_hits / max(tot_n, 1.0)

    def save(s: int) -> None:
        mngr.save(s, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))

    frequent = np.argsort(-counts)[: args.num_frequent].astype(np.int32)
    frequent = frequent[counts[frequent] > 0]
    logger.info(
        "%d distinct response ids; %d always-candidates cover %.1f%% of response tokens",
        int((counts > 0).sum()),
        len(frequent),
        100 * counts[frequent].sum() / counts.sum(),
    )

    def batches_for(epoch: int) -> list[Any]:
        return make_batches(
            train_rows, args.tokens_per_batch, args.prompt_weight, args.seed + epoch,
            None if head_ids is not None else frequent, args.num_candidates, teacher,
        )

    log = open(workdir / "train_log.jsonl", "a", encoding="utf-8")
    epoch_batches: dict[int, list[Any]] = {}
    bar = tqdm(total=args.steps, initial=step, desc="train", unit="step")
    t_start, last_save = time.perf_counter(), time.perf_counter()
    run_loss = run_acc = None
    best_top1 = -1.0
    if resuming and (workdir / "best_params.npz").exists():  # keep the best point of the earlier run
        best_top1 = max((r.get("val_top1", -1.0) for r in _read_jsonl(workdir / "train_log.jsonl")), default=-1.0)
    while step < args.steps:
        n_per_epoch = len(epoch_batches.setdefault(0, batches_for(0)))
        epoch, index = divmod(step, n_per_epoch)
        if epoch not in epoch_batches:
            epoch_batches = {0: epoch_batches[0], epoch: batches_for(epoch)}
        tok, lab, wts, cand, teach = epoch_batches[epoch][index]
        params, opt_state, loss, acc, gnorm = train_step(params, opt_state, tok, lab, wts, cand, teach)
        step += 1
        loss, acc = float(loss), float(acc)
        run_loss = loss if run_loss is None else 0.95 * run_loss + 0.05 * loss
        run_acc = acc if run_acc is None else 0.95 * run_acc + 0.05 * acc
        bar.update(1)
        bar.set_postfix(loss=f"{run_loss:.3f}", acc=f"{run_acc:.3f}", ep=epoch)
        rec: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "resp_top1": acc,
            "grad_norm": float(gnorm),
            "lr": float(schedule(step - 1)),  # (the rate this step applied: optax counts updates from 0)
            "elapsed_s": round(time.perf_counter() - t_start, 1),
        }
        if step % args.eval_every == 0 or step == args.steps:
            rec["val_loss"], rec["val_top1"] = validate(params)
            logger.info("step %d: val loss %.3f, val top-1 %.3f", step, rec["val_loss"], rec["val_top1"])
            if rec["val_top1"] > best_top1:  # export --params best picks the best validation point (early stopping)
                best_top1 = rec["val_top1"]
                np.savez(workdir / "best_params.npz", **_final_arrays(params, head_ids), step=step)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        out_of_time = args.max_minutes > 0 and time.perf_counter() - t_start > args.max_minutes * 60
        if time.perf_counter() - last_save > args.save_minutes * 60 or step == args.steps or out_of_time:
            save(step)
            last_save = time.perf_counter()
        if out_of_time:
            logger.info(
                "--max-minutes %.1f reached at step %d of %d; --resume continues", args.max_minutes, step, args.steps
            )
            break
    mngr.wait_until_finished()
    bar.close()
    np.savez(workdir / "final_params.npz", **_final_arrays(params, head_ids))
    logger.info("done: %d steps, params in %s", step, workdir / "final_params.npz")


def _final_arrays(params: dict[str, Any], head_ids: np.ndarray | None) -> dict[str, np.ndarray]:
    out = {k: np.asarray(v) for k, v in params.items()}
    if head_ids is not None:
        out[HEAD_TOKEN_IDS] = head_ids
    return out


def _abstract_params(cfg: Any) -> dict[str, np.ndarray]:
    """Zero arrays with the draft's parameter shapes (restore target for a resumed run)."""
    from flax import nnx

    from nightjar_jax.models.llama import hf_param_map, init_model

    _, abstract = init_model(cfg, abstract=True)
    flat = dict(nnx.to_flat_state(abstract))
    out = {}
    for name, (path, transpose) in hf_param_map(cfg).items():
        if name == HEAD_TOKEN_IDS:
            continue  # a constant, not trained (kept in the workdir)
        shape = tuple(flat[path].get_value().shape)
        out[name] = np.zeros(shape[::-1] if transpose else shape, np.float32)
    return out


# ---- export ------------------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> None:
    """bf16 weights + config -> ``nightjar_jax/assets/drafts/smollm2-draft`` (our orbax format); checks that the
    paged :class:`Llama` reproduces the training forward's logits."""
    import jax.numpy as jnp
    import ml_dtypes

    from nightjar_jax.config import ModelConfig
    from nightjar_jax.models.orbax_io import save_orbax

    workdir = Path(args.workdir)
    cfg = ModelConfig(
        **{
            **json.loads((workdir / "draft_config.json").read_text()),
            "rope_scaling": None,
            "eos_token_ids": (2,),
            "dtype": args.dtype,
        }
    )
    loaded = dict(np.load(workdir / f"{args.params}_params.npz"))
    logger.info("exporting %s_params.npz (step %s)", args.params, loaded.pop("step", "final"))
    params = loaded
    bf16 = {k: v if np.issubdtype(v.dtype, np.integer) else v.astype(ml_dtypes.bfloat16) for k, v in params.items()}
    out = Path(args.out)
    save_orbax(out, cfg, bf16)
    # paged forward of the shipped weights == training forward (same bf16-rounded weights, float32 math)
    from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_model_fns
    from nightjar_jax.models.loader import load_model

    ckpt, graphdef, state = load_model(str(out), dtype="float32")
    tokens = np.asarray(
        [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]], np.int32
    )
    page_size, t = 16, tokens.shape[1]
    kv = allocate_kv_cache(ckpt.config, num_pages=4, page_size=page_size)
    md = BatchMetadata(
        block_tables=jnp.asarray([[1, 2, 3]], jnp.int32),
        context_lens=jnp.asarray([t], jnp.int32),
        query_lens=jnp.asarray([t], jnp.int32),
    )
    hidden_fn, logits_fn = make_model_fns(graphdef)
    hidden, _ = hidden_fn(state, jnp.asarray(tokens), kv, md)
    paged = np.asarray(logits_fn(state, hidden))
    ref = np.asarray(
        causal_forward(
            ckpt.config,
            {k: jnp.asarray(v.astype(np.float32)) for k, v in bf16.items() if k != HEAD_TOKEN_IDS},
            jnp.asarray(tokens),
        )
    )
    if HEAD_TOKEN_IDS in bf16:  # the paged model scatters the subset's logits into the full vocabulary
        paged = paged[..., bf16[HEAD_TOKEN_IDS]]
    check_export(paged, ref, out)


# train's flags that set the draft's shape, by the draft_config.json field each one sets (a resumed run must match)
SHAPE_FLAGS = {"hidden_size": "--hidden", "num_layers": "--num-layers", "intermediate_size": "--intermediate",
               "head_vocab_size": "--head-vocab"}
# train's flags that change what the steps after a checkpoint compute (a resume must give them as the run did;
# --steps may grow: the warm-up-cosine schedule then stretches over the new total)
RUN_FLAGS = ("data", "tokens_per_batch", "lr", "num_candidates", "num_frequent", "embedding_lr_scale", "warmup",
             "weight_decay", "clip", "prompt_weight", "val_every", "seed", "prompt_text", "teacher", "kd_weight")


def train_flags(args: argparse.Namespace) -> dict:
    """:data:`RUN_FLAGS` as JSON values, paths resolved (a resume from another folder names the same files)."""
    flags = {name: getattr(args, name) for name in RUN_FLAGS}
    flags["data"] = [str(Path(p).resolve()) for p in args.data]
    flags["teacher"] = str(Path(args.teacher).resolve()) if args.teacher else ""
    return flags


def latest_checkpoint_step(workdir: Path) -> int | None:
    """The newest step ``train``'s orbax manager holds in ``workdir/ckpt`` (a finished step is a folder named by
    the step; one being written has a temporary suffix), None when it holds none."""
    ckpt = workdir / "ckpt"
    if not ckpt.is_dir():
        return None
    return max((int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit()), default=None)


def check_train_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``train``'s flags against each other and its --workdir, before any data or model loads (each was a traceback
    or a silent surprise after them): a usage error naming the flag."""
    workdir = Path(args.workdir)
    if workdir.exists() and not workdir.is_dir():
        parser.error(f"argument --workdir: {args.workdir!r} is a file, not a folder")
    if args.teacher and not Path(args.teacher).is_dir():
        parser.error(f"argument --teacher: {args.teacher!r}: no such folder (give `teacher`'s --out)")
    if args.teacher and not args.head_vocab:
        parser.error("argument --teacher: needs --head-vocab N (the KD loss is over the subset head's ids)")
    if args.init_from and not (Path(args.init_from) / "nightjar_config.json").is_file():
        parser.error(f"argument --init-from: {args.init_from!r} is not an exported draft (no nightjar_config.json "
                     f"in it): give `export`'s --out folder")
    needed = min(VOCAB, args.num_frequent + args.tokens_per_batch)
    if not args.head_vocab and not needed <= args.num_candidates <= VOCAB:
        parser.error(f"argument --num-candidates: {args.num_candidates} must be at least --num-frequent + "
                     f"--tokens-per-batch ({needed}: the frequent ids and every label of a batch are candidates) and "
                     f"at most the vocabulary ({VOCAB})")
    if args.kd_weight is None:
        args.kd_weight = 0.5
    elif not args.teacher:
        parser.error("argument --kd-weight: weighs the --teacher term of the loss: give --teacher too")
    step = latest_checkpoint_step(workdir)
    if step is None:
        return
    if not args.resume:
        parser.error(f"{args.workdir} holds a checkpoint at step {step}: pass --resume to continue, or use an empty "
                     "folder")
    saved = workdir / "draft_config.json"  # (train writes it at its start: the shape the checkpoint holds)
    if not saved.is_file():
        return
    config = json.loads(saved.read_text())
    given = {"hidden_size": args.hidden, "num_layers": args.num_layers, "intermediate_size": args.intermediate,
             "head_vocab_size": args.head_vocab or None}
    differ = [field for field in SHAPE_FLAGS if config.get(field) != given[field]]
    if differ:
        def flags(values: dict) -> str:
            return " ".join(f"{SHAPE_FLAGS[f]} {values.get(f) or 0}" for f in differ)

        parser.error(f"argument --resume: the checkpoint in {args.workdir} (step {step}) was trained with "
                     f"{flags(config)}, not {flags(given)} ({saved.name}): give the same flags to resume, or use an "
                     "empty folder")
    ran = workdir / "train_flags.json"  # (runs from before it was written: the shape checked above only)
    if ran.is_file():
        before, now = json.loads(ran.read_text()), json.loads(json.dumps(train_flags(args)))
        changed = [name for name in RUN_FLAGS if name in before and before[name] != now[name]]
        if changed:  # (a resume with another --lr or --data silently trained something else from the checkpoint)
            parser.error(f"argument --resume: the run in {args.workdir} was started with "
                         + ", ".join(f"--{n.replace('_', '-')} {before[n]!r}" for n in changed)
                         + f", not {', '.join(repr(now[n]) for n in changed)} ({ran.name}): give the same flags to "
                         "resume (--steps may grow)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="target responses to the train prompts (JSONL, resumable)")
    g.add_argument("--data", required=True, type=writable_out, help="the responses' JSONL (written; resumed)")
    g.add_argument("--batch-size", type=positive_int, default=32)
    g.add_argument("--chunk", type=positive_int, default=64, help="prompts per generate() call (a resume point)")
    g.add_argument("--num-sampled", type=non_negative_int, default=0, help="extra temperature-0.7 responses per prompt")
    g.add_argument("--limit", type=non_negative_int, default=0, help="answer the first N train prompts (0: all)")
    g.add_argument("--self-prompts", default="", help="also answer the kept prompts of this self-prompts JSONL")
    g.set_defaults(fn=cmd_generate)
    sp = sub.add_parser("self-prompts", help="the target writes user prompts (Magpie); JSONL, resumable")
    sp.add_argument("--out", required=True, type=writable_out)
    sp.add_argument("--num", type=positive_int, required=True, help="attempts (seeds 0..num-1) the file should hold")
    sp.add_argument("--batch-size", type=positive_int, default=64)
    sp.add_argument("--chunk", type=positive_int, default=128)
    sp.add_argument("--max-tokens", type=positive_int, default=96)
    sp.set_defaults(fn=cmd_self_prompts)
    t = sub.add_parser("train", help="train the draft (orbax checkpoints in --workdir/ckpt, --resume)")
    t.add_argument("--data", required=True, nargs="+", type=existing_file,
                   help="one or more response files (generate's JSONL; .jsonl.gz too, e.g. data/distill/smollm2)")
    t.add_argument("--workdir", required=True)
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --workdir from its last checkpoint, with the same flags "
                   "(train_flags.json; --steps may grow, the learning-rate schedule then stretching over the new "
                   "total)")
    t.add_argument("--init-from", default="", help="start from this exported draft's weights (same architecture)")
    t.add_argument("--hidden", type=positive_int, default=184)
    t.add_argument("--num-layers", type=positive_int, default=2)
    t.add_argument("--intermediate", type=positive_int, default=640)
    t.add_argument("--head-vocab", type=non_negative_int, default=0,
                   help="untied LM head over the N most frequent response ids (0: tied head over all 49,152)")
    t.add_argument("--steps", type=positive_int, default=2000)
    t.add_argument("--tokens-per-batch", type=positive_int, default=4096)
    t.add_argument("--lr", type=positive_float, default=3e-3)
    t.add_argument("--num-candidates", type=positive_int, default=8192,
                   help="softmax candidates per batch (sampled softmax)")
    t.add_argument("--num-frequent", type=non_negative_int, default=4096,
                   help="most frequent response ids, always candidates")
    t.add_argument("--embedding-lr-scale", type=non_negative_float, default=0.1,
                   help="the PCA-initialised embedding learns slower")
    t.add_argument("--warmup", type=non_negative_int, default=50)
    t.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    t.add_argument("--clip", type=positive_float, default=1.0, help="the gradients' global-norm limit")
    t.add_argument("--prompt-weight", type=non_negative_float, default=0.2,
                   help="loss weight of prompt tokens (response: 1)")
    t.add_argument("--val-every", type=positive_int, default=20,
                   help="every N-th train prompt id is kept for validation")
    t.add_argument("--eval-every", type=positive_int, default=100)
    t.add_argument("--save-minutes", type=non_negative_float, default=3.0)
    t.add_argument("--max-minutes", type=non_negative_float, default=0.0,
                   help="stop (checkpointed) after this long; 0: no limit")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--prompt-text", action="store_true", help="also train on prompts that have no response yet")
    t.add_argument("--teacher", default="", help="`teacher`'s output folder: also distil the target's top-k logits")
    t.add_argument("--kd-weight", type=float_in_range(0, 1), default=None,
                   help="with --teacher: weight of the top-k cross-entropy, 0..1 (1 - it: the sampled token's; "
                        "default 0.5)")
    t.set_defaults(fn=cmd_train)
    for name, fn, reader, what in (
        ("teacher", cmd_teacher, "train", "the target's top-k log-probabilities at the response positions"),
        ("features", cmd_features, "distill_eagle.py train", "the target's final hidden state at every position"),
    ):  # one cache-free target pass over the training rows each, in resumable parts
        tp = sub.add_parser(name, help=f"{what} (resumable)")
        tp.add_argument("--data", required=True, nargs="+", type=existing_file,
                        help=f"the response files `{reader}` will read, same order")
        tp.add_argument("--out", required=True)
        tp.add_argument("--tokens-per-batch", type=positive_int, default=2048)
        tp.add_argument("--rows-per-part", type=positive_int, default=256)
        tp.set_defaults(fn=fn)
        if name == "teacher":
            tp.add_argument("--top-k", type=positive_int, default=16)
        else:
            tp.add_argument("--layers", default="",
                            help="also the residual stream after these layer counts, e.g. 3,15 (EAGLE-3 fusion)")
    e = sub.add_parser("export", help="write the bf16 checkpoint to the assets folder and check the paged forward")
    e.add_argument("--workdir", required=True)
    e.add_argument("--out", default=str(ASSET_DIR))
    e.add_argument("--params", choices=("final", "best"), default="best",
                   help="the last step's weights, or those of the best validation top-1 (default)")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype recorded in the config (weights stay bf16)")
    e.set_defaults(fn=cmd_export)
    args = ap.parse_args(argv)
    if args.cmd == "train":
        check_train_args(t, args)
    if args.cmd == "export":
        missing = [f for f in ("draft_config.json", f"{args.params}_params.npz")
                   if not (Path(args.workdir) / f).is_file()]
        if missing:  # (a run stopped before its first evaluation has no best_params.npz: a FileNotFoundError)
            e.error(f"argument --workdir: {args.workdir!r} holds no {', '.join(missing)}: give `train`'s --workdir "
                    "(best_params.npz is written at its first evaluation; --params final takes the last step's)")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            e.error(f"argument --out: {args.out!r} is a file: give a folder (it is created)")
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
