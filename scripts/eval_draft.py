"""Issue 8 evaluation: a SmolLM2 draft (default: the shipped default pair's) on held-out MT-Bench and Spec-Bench
prompts.

Prints and writes (JSON) two numbers:
1. acceptance, greedy, γ = 4 (``planner="static:4"``): mean tokens committed per sequence per target step
   (accepted drafts + 1, the engine's ``stats.mean_accepted_length``) and α = accepted / drafted, overall and per
   source, on the held-out split of ``scripts/distill_draft.py`` (never trained on);
2. the draft's cost per token relative to the target's: batch-1 greedy AR decode of each model alone on the same
   prompts, decode steps only (from the engine's step log, after a warm-up run that compiles every shape). A
   feature draft (EAGLE-style, it reads the target's hidden states) cannot decode alone: its cost is its
   ``propose`` time per drafted token inside batch-1 speculative steps, against the target's plain decoding in the
   same engine (:func:`feature_draft_cost`).

``--temperature T`` runs the acceptance part sampled (per-prompt seeds); the goal's numbers are greedy.
``--tree-nodes N`` verifies a static token tree of N drafted nodes of depth γ per step (``spec_tree_nodes``,
``nightjar_jax/spec/tree.py``) instead of a chain: the mean accepted length counts the deepest accepted branch;
the draft's cost is per drafted node, and the run also times whole speculative steps against plain decoding
(tokens per second, same engine, batch 1), since a tree's verify pass carries N + 1 tokens.

    python scripts/eval_draft.py --out results/eval_draft.json
    python scripts/eval_draft.py --tree-nodes 48 --out results/eval_draft_tree48.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from distill_draft import ASSET_DIR, TARGET, chat_ids, heldout_ids, load_prompts, target_tokenizer  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    draft_gap,
    float_in_range,
    int_at_least,
    int_in_range,
    machine_note,
    make_parent,
    non_negative_int,
    positive_int,
    run_decode_workload,
    smollm2_draft,
    writable_out,
)

logger = logging.getLogger("eval_draft")


def tree_file(text: str) -> str:
    """--tree-file: a spec tree order file, read and checked before the models load (it failed after them)."""
    from nightjar_jax.spec.tree import load_tree_order

    try:
        load_tree_order(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def acceptance(args: argparse.Namespace, prompts: list[dict]) -> dict:
    """Greedy SD at a fixed γ over ``prompts`` in one batch; the engine's counters after the run."""
    from nightjar_jax import LLM, SamplingParams

    llm = LLM(
        TARGET,
        draft_model=args.draft,
        num_speculative_tokens=args.gamma,
        planner=f"static:{args.gamma}",
        spec_tree_nodes=args.tree_nodes,
        spec_tree_file=args.tree_file,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        max_num_seqs=len(prompts),
        max_model_len=args.max_prompt_tokens + args.max_tokens + 8,
        max_num_batched_tokens=512,
    )
    engine = llm.engine
    engine.record_steps = True
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p["ids"]} for p in prompts],
        [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
         for i in range(len(prompts))],
        use_tqdm=False,
    )
    seconds = time.perf_counter() - t0
    s = engine.stats
    log = [x for x in s.step_log if x["gamma"] > 0]
    return {
        "num_prompts": len(prompts),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "num_drafted_tokens": s.num_drafted_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "accepted_per_position": list(s.accepted_per_position),
        "drafted_per_position": list(s.drafted_per_position),  # [0]: sequence-steps that drafted (target steps)
        "draft_seconds": sum(x["draft_seconds"] for x in log),
        "verify_seconds": sum(x["verify_seconds"] for x in log),
        "num_spec_steps": len(log),
        "num_lookup_steps": s.num_lookup_steps,  # sequence-steps whose drafts were n-gram lookups
        "num_lookup_accepted": s.num_lookup_accepted,
        "wall_seconds": seconds,
        "outputs": {p["id"]: o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)},
    }


def summarize(runs: list[dict]) -> dict:
    """Pool runs: mean accepted length = 1 + accepted / target sequence-steps; α = accepted / drafted."""
    acc = sum(r["num_accepted_tokens"] for r in runs)
    drafted = sum(r["num_drafted_tokens"] for r in runs)
    steps = sum(r["drafted_per_position"][0] for r in runs)
    per_pos_acc = np.sum([r["accepted_per_position"] for r in runs], axis=0)
    per_pos_drafted = np.sum([r["drafted_per_position"] for r in runs], axis=0)
    return {
        "num_prompts": sum(r["num_prompts"] for r in runs),
        "generated_tokens": sum(r["generated_tokens"] for r in runs),
        "target_sequence_steps": steps,
        "mean_accepted_length": 1 + acc / max(steps, 1),
        "accepted_per_drafted": acc / max(drafted, 1),  # counts drafts after a rejection (never acceptable)
        "alpha": float(per_pos_acc[0] / max(per_pos_drafted[0], 1)),  # per-token acceptance: first position
        "acceptance_per_position": (per_pos_acc / np.maximum(per_pos_drafted, 1)).round(4).tolist(),
        "lookup_steps": sum(r.get("num_lookup_steps", 0) for r in runs),
        "lookup_step_share": sum(r.get("num_lookup_steps", 0) for r in runs) / max(steps, 1),
        "lookup_accepted": sum(r.get("num_lookup_accepted", 0) for r in runs),
    }


def decode_cost(model: str, prompts: list[list[int]], output_len: int) -> dict:
    """Seconds per decoded token, batch 1, AR, one prompt at a time (a warm-up run compiles first)."""
    from nightjar_jax import LLM

    llm = LLM(
        model,
        draft_model=None,  # AR alone, even if a default draft pair is configured
        max_num_seqs=1,
        max_model_len=max(len(p) for p in prompts) + output_len + 8,
        max_num_batched_tokens=512,
    )
    run_decode_workload(llm, prompts[:1], output_len)  # warm-up: compile prefill and decode shapes
    seconds = tokens = 0.0
    for p in prompts:
        run = run_decode_workload(llm, [p], output_len)
        seconds += run.decode_seconds
        tokens += run.committed_tokens
    return {"model": model, "decode_seconds": seconds, "decode_tokens": tokens, "seconds_per_token": seconds / tokens}


def feature_draft_cost(draft: str, prompts: list[list[int]], output_len: int, gamma: int,
                       tree_nodes: int = 0, lookup: tuple[int, int] = (2, 0),
                       tree_file: str | None = None) -> tuple[dict, dict]:
    """A feature draft cannot decode alone (it reads the target's hidden states), so both costs come from one
    engine at batch 1: the target's seconds per token in plain decoding (γ = 0) and the draft's seconds per drafted
    token inside speculative steps at ``gamma`` (``propose`` time / (γ x steps): its first step over the accepted
    tokens included), after ``ModelRunner.warmup`` (every greedy decode variant) and a warm-up run of each (prefill
    and catch-up shapes). With a tree, a drafted token is a
    node, and the speculative steps' own tokens per second (``sd_tokens_per_second``, same runs) are kept too
    (as with n-gram ``lookup`` (min n, max n; max 0: off): a step whose rows all copy skips the draft, so the
    draft's time per drafted token then falls below its own cost)."""
    from nightjar_jax import LLM

    llm = LLM(
        TARGET, draft_model=draft, num_speculative_tokens=gamma, planner=f"static:{gamma}", max_num_seqs=1,
        max_model_len=max(len(p) for p in prompts) + output_len + max(gamma, tree_nodes) + 8,
        max_num_batched_tokens=512, spec_tree_nodes=tree_nodes, spec_tree_file=tree_file, prompt_lookup_min=lookup[0],
        prompt_lookup_max=lookup[1],
    )
    llm.engine.runner.warmup(sampled=False)  # every greedy decode variant (the copying steps' chain with trees)
    for g in (0, gamma):
        run_decode_workload(llm, prompts[:1], output_len, gamma=g)  # warm-up: prefill and catch-up shapes
    per_step = tree_nodes or gamma
    t_s = t_n = d_s = d_n = sd_s = sd_n = 0.0
    for p in prompts:
        ar = run_decode_workload(llm, [p], output_len, gamma=0)
        t_s, t_n = t_s + ar.decode_seconds, t_n + ar.committed_tokens
        sd = run_decode_workload(llm, [p], output_len, gamma=gamma)
        d_s, d_n = d_s + sd.draft_seconds, d_n + per_step * sd.num_decode_steps
        sd_s, sd_n = sd_s + sd.decode_seconds, sd_n + sd.committed_tokens
    target = {"model": TARGET, "decode_seconds": t_s, "decode_tokens": t_n, "seconds_per_token": t_s / t_n}
    draft_cost = {"model": draft, "draft_seconds": d_s, "drafted_tokens": d_n, "seconds_per_token": d_s / d_n,
                  "measured": f"inside SD at gamma={gamma}" + (f", tree of {tree_nodes} nodes" if tree_nodes else "")
                  + ", batch 1",
                  "sd_tokens_per_second": sd_n / sd_s, "ar_tokens_per_second": t_n / t_s}
    return target, draft_cost


def table_header(gamma: int) -> str:
    """The acceptance table's header, labelled with the γ the runs used."""
    return f"{'':16s} {'prompts':>8s} {f'mean acc. len (γ={gamma})':>20s} {'α (pos. 1)':>11s} {'accepted/drafted':>17s}"


def is_feature_draft(draft: str) -> bool:
    """Whether ``draft`` (a checkpoint folder or a preset name) reads the target's hidden states."""
    from nightjar_jax.models.loader import load_checkpoint

    return load_checkpoint(draft).config.feature_size is not None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(ASSET_DIR.parent / "smollm2-eagle"), type=smollm2_draft,
                    help="a draft checkpoint folder or preset ('auto': the target's paired draft; default: the "
                         "default pair's feature draft)")
    ap.add_argument("--gamma", type=positive_int, default=4)
    ap.add_argument("--tree-nodes", type=non_negative_int, default=0,
                    help="verify a token tree of this many nodes (0: a chain)")
    ap.add_argument("--tree-file", default=None, type=tree_file,
                    help="the tree's rank-path order (spec_tree_file; default: nightjar_jax/spec/default_tree.json)")
    ap.add_argument("--prompt-lookup-max", type=int_in_range(0, 64), default=0,
                    help="n-gram lookup drafts (SpecConfig.prompt_lookup_max; 0: the draft's only)")
    ap.add_argument("--prompt-lookup-min", type=int_in_range(1, 64), default=2,
                    help="shortest n-gram the lookup matches (at most --prompt-lookup-max when that is > 0)")
    ap.add_argument("--temperature", type=float_in_range(0, 100), default=0.0,
                    help="sampling temperature of the acceptance runs (0: greedy, the goal's setting); the cost runs "
                         "stay greedy")
    ap.add_argument("--seed", type=int, default=0, help="per-prompt seeds seed + i (sampled acceptance runs)")
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=384, help="longer held-out prompts are skipped")
    ap.add_argument("--cost-prompts", type=positive_int, default=4, help="held-out prompts timed for the cost ratio")
    ap.add_argument("--cost-tokens", type=int_at_least(2), default=32,
                    help="tokens per cost run (>= 2: the first comes from the prefill)")
    ap.add_argument("--limit", type=non_negative_int, default=0, help="first N held-out prompts only (smoke runs)")
    ap.add_argument("--out", default="results/eval_draft.json", type=writable_out)
    args = ap.parse_args(argv)
    if args.prompt_lookup_max and args.prompt_lookup_min > args.prompt_lookup_max:
        ap.error(f"argument --prompt-lookup-min: {args.prompt_lookup_min} is past --prompt-lookup-max "
                 f"{args.prompt_lookup_max}: allowed at most it")
    if args.draft.lower() == "auto":  # (the cost runs load the draft alone: by its name)
        gap = draft_gap(args.draft, TARGET)
        if gap:
            ap.error(f"argument --draft: {gap}")
        from nightjar_jax.models.presets import default_draft_for

        args.draft = default_draft_for(TARGET)
    if args.tree_nodes and not is_feature_draft(args.draft):  # (before the acceptance runs, not after them)
        ap.error(f"argument --tree-nodes: the cost measurement supports feature drafts only ({args.draft} is a token "
                 "draft, whose cost is its own plain decoding): leave --tree-nodes out for it")
    return args


def fitting_prompts(prompts: list[dict], max_prompt_tokens: int) -> tuple[list[dict], list[dict]]:
    """(the prompts of at most ``max_prompt_tokens`` ids, the longer ones); SystemExit when none fits (the
    acceptance runs had nothing to run)."""
    fit = [p for p in prompts if len(p["ids"]) <= max_prompt_tokens]
    if not fit:
        shortest = min((len(p["ids"]) for p in prompts), default=0)
        raise SystemExit(f"no prompt fits --max-prompt-tokens {max_prompt_tokens}: the shortest of the "
                         f"{len(prompts)} held-out prompts has {shortest} tokens")
    return fit, [p for p in prompts if len(p["ids"]) > max_prompt_tokens]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()

    tok = target_tokenizer()
    prompts, skipped = fitting_prompts([p | {"ids": chat_ids(tok, p["text"])} for p in load_prompts("heldout")],
                                       args.max_prompt_tokens)
    if args.limit:
        prompts = prompts[: args.limit]
    logger.info(
        "%d held-out prompts (%d longer than %d tokens skipped: %s)",
        len(prompts),
        len(skipped),
        args.max_prompt_tokens,
        [p["id"] for p in skipped],
    )
    machine = machine_note()
    runs = {}
    for src in ("mt_bench", "spec_bench"):  # one SD run per source; the pooled numbers sum their counters
        sub = [p for p in prompts if p["id"].startswith(src)]
        if sub:
            runs[src] = acceptance(args, sub)
    outputs = {k: v for r in runs.values() for k, v in r.pop("outputs").items()}
    acc = summarize(list(runs.values()))
    sources = {src: summarize([r]) for src, r in runs.items()}
    draft_s = sum(r["draft_seconds"] for r in runs.values())
    verify_s = sum(r["verify_seconds"] for r in runs.values())
    cost_ids = [p["ids"] for p in prompts[: args.cost_prompts]]
    if is_feature_draft(args.draft):
        target_cost, draft_cost = feature_draft_cost(args.draft, cost_ids, args.cost_tokens, args.gamma,
                                                     args.tree_nodes, (args.prompt_lookup_min, args.prompt_lookup_max),
                                                     args.tree_file)
    else:  # (a token draft with --tree-nodes: refused by parse_args)
        target_cost = decode_cost(TARGET, cost_ids, args.cost_tokens)
        draft_cost = decode_cost(args.draft, cost_ids, args.cost_tokens)
    ratio = draft_cost["seconds_per_token"] / target_cost["seconds_per_token"]

    print(f"\nheld-out split: {heldout_ids()}  (used {len(prompts)}, skipped {[p['id'] for p in skipped]})")
    shape = f"tree of {args.tree_nodes} nodes, depth {args.gamma}" if args.tree_nodes else f"chain, γ = {args.gamma}"
    print(f"speculation: {shape}; acceptance runs at temperature {args.temperature}")
    print(table_header(args.gamma))
    for name, r in [("all held-out", acc), *sources.items()]:
        print(
            f"{name:16s} {r['num_prompts']:8d} {r['mean_accepted_length']:20.3f} {r['alpha']:11.3f} "
            f"{r['accepted_per_drafted']:17.3f}"
        )
    print(f"acceptance per draft position: {acc['acceptance_per_position']}")
    if args.prompt_lookup_max:
        lk = acc["lookup_steps"]
        print(f"n-gram lookup (n {args.prompt_lookup_min}-{args.prompt_lookup_max}): drafts of {lk} of "
              f"{acc['target_sequence_steps']} sequence-steps ({100 * acc['lookup_step_share']:.0f}%), mean accepted "
              f"length there {1 + acc['lookup_accepted'] / max(lk, 1):.3f}")
    print(f"inside SD (batched): draft {draft_s:.1f} s, verify {verify_s:.1f} s over the same steps")
    print(
        f"\nbatch-1 AR decode: target {1e3 * target_cost['seconds_per_token']:.2f} ms/token, draft "
        f"{1e3 * draft_cost['seconds_per_token']:.2f} ms/token -> draft cost / target cost = {ratio:.3f}"
    )
    if "sd_tokens_per_second" in draft_cost:
        print(f"batch-1 decode, same engine: speculative {draft_cost['sd_tokens_per_second']:.1f} tok/s, plain "
              f"{draft_cost['ar_tokens_per_second']:.1f} tok/s")
    payload = {
        "machine": machine,
        "command": " ".join(sys.argv),
        "heldout_ids": heldout_ids(),
        "skipped_prompts": [p["id"] for p in skipped],
        "gamma": args.gamma,
        "tree_nodes": args.tree_nodes,
        "tree_file": args.tree_file,
        "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "acceptance": acc,
        "per_source": sources,
        "runs": runs,
        "sd_draft_seconds": draft_s,
        "sd_verify_seconds": verify_s,
        "target_cost": target_cost,
        "draft_cost": draft_cost,
        "draft_cost_ratio": ratio,
        "sd_outputs": outputs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(make_parent(args.out)).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
