"""Greedy speculative decoding against plain decoding, token for token, on real prompts (the lossless invariant).

Decodes each prompt greedily with the target alone, then with its draft under each ``--planners`` entry (``static:4``:
γ = 4 every step; ``nightjar``: the bandit's γ sequence), and reports per planner the prompts whose tokens left plain
decoding's and where. Default: SmolLM2-135M-Instruct with its default draft on the held-out MT-Bench / Spec-Bench
prompts of ``distill_draft.py`` (chat template), at both the default weights and ``w4a8``, whose int8 rounding of the
products turns any last-bit difference between a verify row and one-row decoding into a different token (so a
kernel whose row's result depends on the other rows of its call shows here within a few dozen tokens).

    python scripts/check_lossless.py                                   # 16 held-out prompts x 128 tokens
    python scripts/check_lossless.py --weight-formats w4a8 --prompts 28 --max-tokens 256 --out results/lossless.json
    python scripts/check_lossless.py --max-num-seqs 4     # SD batched: verify steps of 4 sequences' rows

Prints a table and writes JSON; exits 1 when any output differs (so it can gate a change), 3 when nothing was
checked (no prompt fits, or a speculative run drafted no token: its outputs are plain decoding's), 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from nightjar_jax.bench.common import (  # noqa: E402
    check_planner,
    draft_gap,
    draft_spec,
    int_in_range,
    name_list,
    planner_list,
    positive_int,
    smollm2_model,
    writable_out,
)
from nightjar_jax.config import WEIGHT_FORMATS  # noqa: E402
from nightjar_jax.planner import known_planners  # noqa: E402

# distill_draft.heldout_ids(): the first 2 MT-Bench questions of each of its 8 categories and the first 4 Spec-Bench
# questions of each of its 5 own categories (eval_draft.py keeps the 28 of them under 384 tokens; this script all)
NUM_HELDOUT_PROMPTS = 36
DIFFERS, NOTHING_CHECKED = 1, 3  # exit codes (2: argparse's usage error)


def first_difference(want: list[int], got: list[int]) -> int | None:
    """Index of the first token where ``got`` leaves ``want`` (a length difference counts), None when equal."""
    for i, (a, b) in enumerate(zip(want, got, strict=False)):  # lengths may differ
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def compare(model: str, draft: str, prompts: list, weight_format: str, planners: list[str], max_tokens: int,
            gamma: int, max_model_len: int, max_num_seqs: int = 1) -> list[dict]:
    """One row per planner: the prompts whose greedy SD tokens left the target's plain greedy tokens. The
    reference is always one prompt at a time (batch 1); ``max_num_seqs`` > 1 runs the SD engines batched, so their
    verify steps carry several sequences' rows at once."""
    from nightjar_jax import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    common = dict(max_model_len=max_model_len, max_num_batched_tokens=512, weight_format=weight_format)
    t0 = time.perf_counter()
    ar = LLM(model, draft_model=None, max_num_seqs=1, **common)
    want = [o.outputs[0].token_ids for o in ar.generate(prompts, params)]
    del ar
    rows = [{"weight_format": weight_format, "planner": "ar (reference, batch 1)", "batch": 1, "prompts": len(prompts),
             "tokens": sum(len(t) for t in want), "differing": [], "seconds": time.perf_counter() - t0}]
    for planner in planners:
        t0 = time.perf_counter()
        sd = LLM(model, draft_model=draft, planner=planner, num_speculative_tokens=gamma, max_num_seqs=max_num_seqs,
                 **common)
        got = [o.outputs[0].token_ids for o in sd.generate(prompts, params)]
        stats = sd.engine.stats
        diffs = [(i, first_difference(w, g)) for i, (w, g) in enumerate(zip(want, got, strict=True))]
        rows.append({"weight_format": weight_format, "planner": planner, "batch": max_num_seqs, "prompts": len(prompts),
                     "tokens": sum(len(t) for t in got), "differing": [{"prompt": i, "first_token": d}
                                                                       for i, d in diffs if d is not None],
                     "drafted": stats.num_drafted_tokens, "accepted": stats.num_accepted_tokens,
                     "seconds": time.perf_counter() - t0})
        del sd
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", type=smollm2_model,
                    help="a model with SmolLM2's tokenizer (the prompts are SmolLM2 token ids)")
    ap.add_argument("--draft", default="auto", type=draft_spec,
                    help="the draft (default: the target preset's paired draft; 'ngram': n-gram lookup's copies); "
                         "not none: a run that drafts nothing checks nothing")
    ap.add_argument("--weight-formats", default="auto,w4a8", type=name_list(WEIGHT_FORMATS),
                    help=f"comma-separated engine weight formats, each of {WEIGHT_FORMATS}")
    ap.add_argument("--planners", default="static:4,nightjar", type=planner_list(),
                    help="comma-separated planners for the SD runs, each one of "
                         f"{known_planners()}, or NAME:ARG (static:K)")
    ap.add_argument("--gamma", type=positive_int, default=4, help="num_speculative_tokens (γ_max)")
    ap.add_argument("--prompts", type=int_in_range(1, NUM_HELDOUT_PROMPTS), default=16,
                    help=f"first N held-out prompts (at most {NUM_HELDOUT_PROMPTS})")
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--max-model-len", type=positive_int, default=1024)
    ap.add_argument("--max-num-seqs", type=positive_int, default=1,
                    help="the SD engines' batch (the reference decodes one prompt at a time)")
    ap.add_argument("--out", default="results/check_lossless.json", type=writable_out)
    args = ap.parse_args(argv)
    gap = draft_gap(args.draft, args.model)
    if gap:
        ap.error(f"argument --draft: {gap}: the check compares speculative decoding with plain decoding, so it needs "
                 "'auto' (a model with a paired draft), 'ngram' or a draft model")
    for planner in args.planners:  # (its argument against --gamma: "static:8" at --gamma 4 failed after the models)
        try:
            check_planner(planner, args.gamma)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"argument --planners: {exc}")
    return args


def fitting_prompts(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> list[list[int]]:
    """The prompts with room for ``max_tokens`` under ``max_model_len``; SystemExit(NOTHING_CHECKED) when none has
    (a run that compared nothing must not pass as lossless)."""
    fit = [p for p in prompts if len(p) + max_tokens <= max_model_len]
    if len(fit) < len(prompts):
        print(f"{len(prompts) - len(fit)} prompts skipped: prompt + --max-tokens over --max-model-len {max_model_len}")
    if not fit:
        shortest = min((len(p) for p in prompts), default=0)
        print(f"no prompt checked: none of the {len(prompts)} prompts fits --max-tokens {max_tokens} in "
              f"--max-model-len {max_model_len} (the shortest has {shortest} tokens); raise --max-model-len or lower "
              "--max-tokens", file=sys.stderr)
        raise SystemExit(NOTHING_CHECKED)
    return fit


def exit_code(rows: list[dict]) -> int:
    """DIFFERS when any output left plain decoding's; else NOTHING_CHECKED, said on stderr, when a speculative run
    drafted no token (its outputs are plain decoding's: equal without checking anything); else 0."""
    if any(r["differing"] for r in rows):
        return DIFFERS
    idle = [f"{r['weight_format']} / {r['planner']}" for r in rows if r.get("drafted") == 0]
    if idle:
        print(f"nothing checked: the speculative run(s) {idle} drafted no token (the planner never speculated, or "
              "the draft proposed nothing): their outputs are plain decoding's", file=sys.stderr)
        return NOTHING_CHECKED
    return 0


def main() -> None:
    args = parse_args()
    formats, planners = args.weight_formats, args.planners

    from distill_draft import chat_ids, load_prompts, target_tokenizer

    tok = target_tokenizer()
    prompts = [chat_ids(tok, p["text"]) for p in load_prompts("heldout")][: args.prompts]
    prompts = fitting_prompts(prompts, args.max_tokens, args.max_model_len)
    rows = []
    for fmt in formats:
        rows += compare(args.model, args.draft, prompts, fmt, planners, args.max_tokens, args.gamma,
                        args.max_model_len, args.max_num_seqs)
    print("| weight format | planner | prompts | tokens | prompts differing (first differing token) | s |")
    print("|---|---|---:|---:|---|---:|")
    for r in rows:
        diff = ", ".join(f"#{d['prompt']} ({d['first_token']})" for d in r["differing"]) or "none"
        print(f"| {r['weight_format']} | {r['planner']} | {r['prompts']} | {r['tokens']} | {diff} | "
              f"{r['seconds']:.0f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens, "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.out}")
    sys.exit(exit_code(rows))


if __name__ == "__main__":
    main()
