"""N-gram lookup drafts at batch 1 (or ``--batch-size``) on held-out chat prompts, with the planner choosing γ
(issue 8; see docs/benchmarks.md, "N-gram lookup drafts beside smollm2-eagle").

Four engines of the same target in one process, each prompt decoded by each in turn (so they share the minutes of
this shared machine): plain decoding (no draft), the draft alone (``prompt_lookup_max=0``), lookup with copying
steps at the planner's γ (``LLMEngine._lookup_boost`` disabled), and the default (lookup, copying steps at γ_max);
``--ngram`` adds draft-free n-gram speculation (``draft_model="ngram"``: no draft model, lookup's copies alone);
``--trees 11,16`` adds, per size N, token trees of N draft nodes alone and with lookup (a copy branch of γ nodes
in each tree; steps where every row copies in full verify the copied chain).
The held-out prompts are ``eval_draft.py``'s (MT-Bench / Spec-Bench ids never trained on), in the chat template.
Decode tokens/s from the engine's step log (prefill excluded), and the steps each γ got.

    python scripts/bench_lookup.py --prompts 14 --max-tokens 96 --out results/bench_lookup.json
    python scripts/bench_lookup.py --prompts 14 --max-tokens 96 --ngram --out results/bench_lookup_ngram.json
    python scripts/bench_lookup.py --prompts 24 --batch-size 4 --out results/bench_lookup_b4.json
    python scripts/bench_lookup.py --prompts 14 --trees 11 --out results/bench_lookup_trees.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from distill_draft import TARGET, chat_ids, load_prompts, target_tokenizer  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    fmt,
    int_list,
    machine_note,
    positive_int,
    ratio,
    writable_out,
    write_json,
)
from nightjar_jax.config import WEIGHT_FORMATS  # noqa: E402

VARIANTS = ("plain", "draft alone", "lookup at the planner's γ", "lookup, copying steps at γ_max")
WARMUP_GROUPS = 2  # the first groups of prompts run untimed (prefill and catch-up shapes, planner start)
NGRAM = "n-gram lookup alone (draft_model ngram)"  # --ngram: no draft model, lookup's copies are every step's drafts


def tree_variants(sizes: list[int]) -> list[str]:
    return [f"tree of {n}{suffix}" for n in sizes for suffix in (", draft alone", " + copy branch")]


def build(variant: str, max_model_len: int, model: str = TARGET, draft: str = "auto", batch_size: int = 1,
          weight_format: str = "auto"):
    from nightjar_jax import LLM

    kw = dict(max_model_len=max_model_len, max_num_seqs=batch_size, max_num_batched_tokens=512,
              weight_format=weight_format)
    if variant == "plain":
        return LLM(model, draft_model=None, **kw)
    if variant == NGRAM:
        return LLM(model, draft_model="ngram", **kw)
    if variant.startswith("tree of "):
        nodes = int(variant.split()[2].rstrip(","))
        return LLM(model, draft_model=draft, spec_tree_nodes=nodes,
                   prompt_lookup_max=0 if variant.endswith("draft alone") else 3, **kw)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: allowed {VARIANTS} or {tree_variants([11])[0]!r}-like")
    llm = LLM(model, draft_model=draft, prompt_lookup_max=0 if variant == "draft alone" else 3, **kw)
    if variant == "lookup at the planner's γ":
        llm.engine._lookup_boost = lambda gamma: False
    return llm


def run(llms: dict, prompts: list[list[int]], max_tokens: int, warmup: int, batch_size: int = 1) -> dict:
    """Each group of ``batch_size`` prompts through every engine in turn, after every engine compiled its greedy
    decode variants (``ModelRunner.warmup``: each γ, and with trees the chain that steps copying every row verify);
    the first ``warmup`` groups untimed (prefill and catch-up shapes, planner start)."""
    from nightjar_jax import SamplingParams

    for llm in llms.values():
        llm.engine.runner.warmup(sampled=False)

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = {k: {"seconds": 0.0, "tokens": 0, "steps_per_gamma": {}} for k in llms}
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    for i, group in enumerate(groups):
        for name, llm in llms.items():
            eng = llm.engine
            eng.record_steps = True
            eng.stats.step_log.clear()
            llm.generate([{"prompt_token_ids": p} for p in group], sp, use_tqdm=False)
            if i < warmup:
                continue
            row = rows[name]
            for s in eng.stats.step_log:
                row["seconds"] += s["seconds"]
                row["tokens"] += s["committed"]
                row["steps_per_gamma"][s["gamma"]] = row["steps_per_gamma"].get(s["gamma"], 0) + 1
    for row in rows.values():
        row["tokens_per_second"] = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
        row["steps_per_gamma"] = dict(sorted(row["steps_per_gamma"].items()))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=positive_int, default=14,
                    help=f"held-out prompts (the first {WARMUP_GROUPS} groups warm up, untimed)")
    ap.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together")
    ap.add_argument("--max-tokens", type=positive_int, default=96)
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    ap.add_argument("--ngram", action="store_true", help=f"add the variant {NGRAM!r}")
    ap.add_argument("--trees", default="", type=int_list(1, allow_empty=True, as_text=True),
                    help="comma-separated tree sizes (draft nodes) to add, e.g. 11,16")
    ap.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                    help="every engine's CPU kernel weights (EngineConfig.weight_format; w4a8: opt-in, lossy)")
    ap.add_argument("--out", default="results/bench_lookup.json", type=writable_out)
    args = ap.parse_args(argv)
    need = (WARMUP_GROUPS + 1) * args.batch_size
    if args.prompts < need:
        ap.error(f"--prompts {args.prompts}: the first {WARMUP_GROUPS} groups of --batch-size {args.batch_size} are "
                 f"warm-up, so at least {need} are needed for one timed group")
    return args


def enough_prompts(num_prompts: int, batch_size: int, max_prompt_tokens: int) -> None:
    """SystemExit unless ``num_prompts`` held-out prompts (those that fit) make a timed group after the warm-up."""
    need = (WARMUP_GROUPS + 1) * batch_size
    if num_prompts < need:
        raise SystemExit(f"only {num_prompts} held-out prompts fit in --max-prompt-tokens {max_prompt_tokens}; "
                         f"{need} are needed ({WARMUP_GROUPS} warm-up groups of {batch_size} and one timed): raise "
                         "--max-prompt-tokens")


def main() -> None:
    args = parse_args()
    tok = target_tokenizer()
    prompts = [ids for ids in (chat_ids(tok, p["text"]) for p in load_prompts("heldout"))
               if len(ids) <= args.max_prompt_tokens][: args.prompts]
    enough_prompts(len(prompts), args.batch_size, args.max_prompt_tokens)  # (before the engines load)
    sizes = [int(n) for n in args.trees.split(",") if n.strip()]
    variants = [*VARIANTS, *([NGRAM] if args.ngram else []), *tree_variants(sizes)]
    # room for the largest tree step's lookahead past the prompt and the output
    room = args.max_prompt_tokens + args.max_tokens + 8 + max([0, *sizes]) + 4
    llms = {v: build(v, room, batch_size=args.batch_size, weight_format=args.weight_format) for v in variants}
    rows = run(llms, prompts, args.max_tokens, warmup=WARMUP_GROUPS, batch_size=args.batch_size)
    plain = rows["plain"]["tokens_per_second"]
    timed = (len(prompts) // args.batch_size - WARMUP_GROUPS) * args.batch_size
    print(f"\n{timed} held-out chat prompts x {args.max_tokens} greedy tokens, batch {args.batch_size}, "
          f"planner-chosen γ, weight_format {args.weight_format}")
    print("| variant | decode tok/s | x plain | steps per γ |")
    print("|---|---:|---:|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens_per_second']:.1f} | {fmt(ratio(row['tokens_per_second'], plain))}x | "
              f"{row['steps_per_gamma']} |")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
