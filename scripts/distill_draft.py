"""Distil a small Llama draft for SmolLM2-135M-Instruct (issue 8): data, training, export.

Vocabulary
- target: SmolLM2-135M-Instruct (30 layers, hidden 576, tied 49,152-token head), the model being served.
- draft: a 2-layer Llama with hidden 192 and a tied head over the full vocabulary, initialised from a PCA
  projection of the target's embedding (its head is then a rank-192 copy of the target's).
- sequence-level KD (Kim & Rush 2016): the draft is trained with cross-entropy on the target's own responses to
  chat-templated prompts, which is what speculative decoding asks of it (predict the target's next token).
- held-out split: a fixed set of MT-Bench and Spec-Bench question ids never used for training
  (:data:`HELDOUT_MT_BENCH_PER_CATEGORY`, :data:`HELDOUT_SPEC_BENCH_PER_CATEGORY`); ``scripts/eval_draft.py`` reads
  the same split.

Stages (each resumable; run them in order)::

    python scripts/distill_draft.py generate --data runs/draft/data.jsonl        # target responses (engine)
    python scripts/distill_draft.py train --data runs/draft/data.jsonl --workdir runs/draft [--resume]
    python scripts/distill_draft.py export --workdir runs/draft                  # bf16 -> assets/drafts

On a 1-thread CPU, set ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``.
On a GPU the same commands run in minutes (raise ``--batch-size``).
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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
    with open(path, encoding="utf-8") as f:
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
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                            add_special_tokens=False)


def cmd_generate(args: argparse.Namespace) -> None:
    """Target responses for every train prompt: greedy, then ``--num-sampled`` at temperature 0.7 (appends)."""
    from tqdm import tqdm

    from nightjar_jax.engine.llm import LLM
    from nightjar_jax.engine.sampling_params import SamplingParams

    data = Path(args.data)
    data.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["id"], r["kind"]) for r in _read_jsonl(data)} if data.exists() else set()
    llm = LLM(TARGET, max_num_seqs=args.batch_size, max_model_len=MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS,
              max_num_batched_tokens=512)
    tok = llm.get_tokenizer()
    prompts = load_prompts("train")
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
            SamplingParams(temperature=0.0 if kind == "greedy" else 0.7, max_tokens=MAX_RESPONSE_TOKENS,
                           seed=None if kind == "greedy" else hash((p["id"], kind)) % 2**31)
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


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="target responses to the train prompts (JSONL, resumable)")
    g.add_argument("--data", required=True)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--chunk", type=int, default=64, help="prompts per generate() call (a resume point)")
    g.add_argument("--num-sampled", type=int, default=0, help="extra temperature-0.7 responses per prompt")
    g.add_argument("--limit", type=int, default=0)
    g.set_defaults(fn=cmd_generate)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
