r"""Issue 5 benchmark: speculative decoding tokens/s for AR (γ = 0) and γ = 1..γ_max at several batch sizes.

For each model (a target plus its best available draft) one ``LLM`` is built with ``num_speculative_tokens =
γ_max``; γ is forced per step (``engine._select_gamma``) so every (batch, γ) cell reuses that engine's compiled
variants. Per cell: a warm-up run of the same workload (compiles every shape it meets), then ``--repeats``
timed greedy runs (fastest kept) of ``--output-len`` tokens per sequence on real prompts. Reported from the
engine's step log (decode steps only; prefill excluded):

- tok/s: committed tokens / (decode-step seconds - draft catch-up seconds). Catch-up is the draft's own prefill
  of the prompt on the first speculative step; it is excluded like the target's prefill and reported apart. The
  JSON rows' ``tpot_ms``, ``draft_share`` and ``verify_share`` are over the same seconds (``decode_seconds``
  there is the steps' whole wall, catch-up included, ``catchup_seconds`` apart).
- mean accepted length: committed tokens per sequence per decode step (1.0 for AR).
- draft / verify split: seconds in ``propose`` vs the target's verify pass, as a share of decode time.

    python scripts/bench_spec.py --batch-sizes 1,4,16,64 --gamma-max 4 --output-len 32
    python scripts/bench_spec.py --models smollm2-135m-instruct --drafts smollm2-eagle,runs/eagle/export6 \
        --batch-sizes 1 --gammas 2,4                     # two drafts of one target, interleaved
    python scripts/bench_spec.py --models smollm2-135m-instruct --tree-nodes 0,11,48 --batch-sizes 1 --gammas 4
                                                         # chain vs token trees (greedy), interleaved

With ``--tree-nodes`` each draft runs once per node count (0 = the chain; N: ``spec_tree_nodes=N``, a static tree
of N nodes and depth γ verified in one target pass), labelled ``<draft>+treeN``, interleaved like ``--drafts``;
``--tree-min-gamma G`` keeps γ < G chains in the tree variants (``spec_tree_min_gamma``). ``--prompt-lookup 0,3``
likewise runs each draft without and with n-gram lookup drafts (``prompt_lookup_max``; labelled
``<draft>+lookup3``). ``--chat`` feeds whole questions in the model's chat template (``--prompt-len`` then caps
their length) instead of dataset text cut to ``--prompt-len`` tokens.

``--planner NAME`` times the planner instead of forced γ: per batch size, plain decoding (γ = 0, forced) and then
the engine with that planner choosing γ every step, with the share of decode steps each γ got. Before that every γ
runs the workload once forced (compiling its shapes), the planner is rebuilt (forced steps also reach its
``observe``, compile time included), and one untimed planner run starts its learning, which carries on through the
timed runs. With ``--tree-nodes 0,N --tree-min-gamma γ_max`` this shows what offering the planner a tree arm costs
or gains against the chains alone::

    python scripts/bench_spec.py --models smollm2-135m-instruct --planner nightjar --tree-nodes 0,16 \
        --tree-min-gamma 4 --batch-sizes 1,8 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    BUILT_IN_PROMPTS,
    DEFAULT_DATASET,
    check_planner,
    dataset_texts,
    draft_gap,
    draft_spec,
    int_at_least,
    int_in_range,
    int_list,
    machine_note,
    make_prompt_ids,
    name_list,
    non_negative_int,
    pages_needed,
    positive_int,
    run_decode_workload,
    writable_out,
    write_json,
)
from nightjar_jax.config import DTYPES, VLLM_DTYPES  # noqa: E402
from nightjar_jax.planner import known_planners  # noqa: E402

MODELS = {  # target -> best available draft: the distilled draft for SmolLM2 (issue 8), a layer-skip copy for stories
    "smollm2-135m-instruct": "smollm2-eagle",
    "stories260k": "stories260k@skip=2",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), type=name_list(tuple(MODELS), as_text=True),
                   help=f"comma list from {list(MODELS)}")
    p.add_argument("--drafts", default="",
                   help="comma list of drafts (presets or folders) to compare on each target, timed interleaved "
                        "(default: the target's best draft, MODELS); none drafts nothing, so it is refused where a "
                        "γ > 0 runs")
    p.add_argument("--tree-nodes", default="0", type=int_list(0, as_text=True),
                   help="comma list of token-tree sizes per draft (0: the chain), timed interleaved")
    p.add_argument("--prompt-lookup", default="0", type=int_list(0, as_text=True, maximum=64),
                   help="comma list of n-gram lookup sizes per draft (prompt_lookup_max; 0: off, the engine's "
                        "default is 3), labelled +lookupN, timed interleaved")
    p.add_argument("--prompt-lookup-min", type=int_in_range(1, 64), default=2,
                   help="shortest n-gram the lookup matches (prompt_lookup_min; at most each --prompt-lookup > 0)")
    p.add_argument("--tree-min-gamma", type=positive_int, default=1,
                   help="tree variants use the tree at γ >= this, chains below (spec_tree_min_gamma)")
    p.add_argument("--planner", default="",
                   help="time this planner choosing γ (against forced AR) instead of every forced γ: one of "
                        f"{known_planners()}, or NAME:ARG (static:K)")
    p.add_argument("--batch-sizes", default="1,4,16,64", type=int_list(1, as_text=True))
    p.add_argument("--gamma-max", type=non_negative_int, default=4)
    p.add_argument("--gammas", default=None, type=int_list(0, as_text=True),
                   help="comma list of γ to run (default 0..γ_max; 0 = AR is always run)")
    p.add_argument("--prompt-len", type=positive_int, default=32,
                   help="prompt tokens (with --chat: the longest prompt; shorter questions stay whole)")
    p.add_argument("--chat", action="store_true",
                   help="whole questions in the model's chat template (answers, not continued prose)")
    p.add_argument("--output-len", type=int_at_least(2), default=32,
                   help="tokens per sequence (>= 2: the first comes from the prefill, the rest are timed)")
    p.add_argument("--dataset", default=DEFAULT_DATASET,
                   help="JSONL with 'turns' (the default, where absent: synthetic ids; with --chat built-in "
                        "prompts)")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="timed runs per cell (fastest kept; the machine is shared)")
    p.add_argument("--dtype", default="float32", choices=(*DTYPES, *VLLM_DTYPES))
    p.add_argument("--out", default="results/bench_spec.json", type=writable_out)
    args = p.parse_args(argv)
    drafts = args.drafts.split(",") if args.drafts else []
    if not all(d.strip() for d in drafts):
        p.error(f"argument --drafts: {args.drafts!r} has an empty entry: name each draft (leave --drafts out for "
                "each target's best draft)")
    for draft in drafts:
        try:
            draft_spec(draft)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --drafts: {exc}")
    over = [g for g in (args.gammas or "").split(",") if g and int(g) > args.gamma_max]
    if over:
        p.error(f"argument --gammas: {','.join(over)} past --gamma-max {args.gamma_max} (the compiled maximum)")
    if args.gamma_max == 0 and (args.planner or args.drafts):
        p.error("--gamma-max 0 decodes plainly: a --planner or --drafts needs --gamma-max >= 1")
    lookups = [int(n) for n in args.prompt_lookup.split(",")]
    if any(0 < n < args.prompt_lookup_min for n in lookups):
        p.error(f"argument --prompt-lookup-min: {args.prompt_lookup_min} is past a --prompt-lookup of "
                f"{args.prompt_lookup}: allowed at most each size > 0")
    speculates = args.gamma_max > 0 and (args.planner or args.gammas is None
                                          or any(int(g) > 0 for g in args.gammas.split(",")))
    for draft in drafts if speculates else ():  # (every γ > 0 cell of a draft-less entry timed plain decoding)
        gap = next(filter(None, (draft_gap(draft, m, n) for m in args.models.split(",") for n in lookups)), None)
        if gap:
            p.error(f"argument --drafts: {gap}: its γ > 0 cells would time plain decoding (name a draft, or "
                    "--gammas 0 for plain decoding only)")
    if args.chat:  # (a tokenizer without one failed after the models loaded)
        from nightjar_jax.models.loader import load_checkpoint

        plain = [m for m in args.models.split(",")
                 if getattr(load_checkpoint(m, load_format="dummy").tokenizer, "chat_template", None) is None]
        if plain:
            p.error(f"argument --chat: {', '.join(plain)} has no chat template: drop --chat, or give --models "
                    "without it")
    if args.planner:  # (an unknown name was the engine's ValueError, after the models loaded)
        try:
            check_planner(args.planner, args.gamma_max)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --planner: {exc}")
    return args


def bench_model(model: str, args: argparse.Namespace, batch_sizes: list[int], texts: list[str]) -> list[dict]:
    """Every (batch, γ) cell of ``model`` with each draft in ``--drafts`` (default: its best draft). With several
    drafts one engine per draft is built and their timed runs alternate (repeat r of every draft, then r + 1), so
    the drafts are compared under the same minutes of this shared machine."""
    from nightjar_jax import LLM

    max_batch = max(batch_sizes)
    planner = getattr(args, "planner", "") or ""
    tree_min_gamma = getattr(args, "tree_min_gamma", 1)
    trees = [int(n) for n in args.tree_nodes.split(",")]
    lookups = [int(n) for n in (getattr(args, "prompt_lookup", "0") or "0").split(",")]
    variants = {d + ("" if n == 0 else f"+tree{n}") + ("" if m == 0 else f"+lookup{m}"): (d, n, m)
                for d in (args.drafts.split(",") if args.drafts else [MODELS[model]]) for n in trees for m in lookups}
    drafts = list(variants)
    llms = {}
    for name, (draft, nodes, lookup) in variants.items():
        t0 = time.perf_counter()
        lookahead = max(args.gamma_max, nodes)
        llms[name] = LLM(model, max_model_len=512, max_num_seqs=max_batch, max_num_batched_tokens=512,
                         num_pages=pages_needed(max_batch, args.prompt_len, args.output_len, lookahead),
                         dtype=args.dtype, draft_model=draft, num_speculative_tokens=args.gamma_max,
                         spec_tree_nodes=nodes, spec_tree_min_gamma=tree_min_gamma if nodes else 1,
                         prompt_lookup_max=lookup, prompt_lookup_min=getattr(args, "prompt_lookup_min", 2),
                         **({"planner": planner} if planner else {}))
        print(f"loaded {model} + draft {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    first = llms[drafts[0]]
    prompts_all, source = make_prompt_ids(first.get_tokenizer(), texts, max_batch, args.prompt_len,
                                          first.engine.target.config.vocab_size, chat=getattr(args, "chat", False))
    gammas = sorted({0} | {int(g) for g in args.gammas.split(",")}) if args.gammas else range(args.gamma_max + 1)
    if planner:
        gammas = [0, None]  # None: the planner chooses
    rows = []
    for b in batch_sizes:
        prompts = prompts_all[:b]
        for gamma in gammas:
            # Warm-up with the full workload: sequences finish at different steps under speculation, so the batch
            # shrinks through smaller batch buckets whose variants must compile before the timed run.
            for llm in llms.values():
                if gamma is None:  # every arm's shapes compile first, so the planner's timed runs compile nothing;
                    for g in range(args.gamma_max + 1):
                        run_decode_workload(llm, prompts, args.output_len, g)
                    # then a fresh planner: the forced steps (compiles included) reached the old one's observe()
                    llm.engine.planner = llm.engine._make_planner()
                run_decode_workload(llm, prompts, args.output_len, gamma)
            runs: dict[str, list] = {d: [] for d in drafts}
            for _ in range(args.repeats):
                for d in drafts:
                    runs[d].append(run_decode_workload(llms[d], prompts, args.output_len, gamma))
            for d in drafts:
                run = min(runs[d], key=lambda r: (r.decode_seconds - r.catchup_seconds) / r.committed_tokens)
                spec_seconds = run.decode_seconds - run.catchup_seconds  # (catch-up excluded, like prefill)
                row = run.as_dict()
                row.update(model=model, draft=d, tree_nodes=variants[d][1], prompt_lookup_max=variants[d][2],
                           prompt_source=source,
                           tokens_per_second=run.committed_tokens / spec_seconds,
                           tpot_ms=1e3 * spec_seconds / run.num_decode_steps / run.mean_accepted_length,
                           draft_share=run.draft_seconds / spec_seconds,
                           verify_share=run.verify_seconds / spec_seconds)
                rows.append(row)
                if gamma is None:
                    row.update(gamma=f"planner:{planner}")
                print(f"{model:22s} {d:20s} b={b:3d} γ={row['gamma']}: {row['tokens_per_second']:9.1f} tok/s  "
                      f"accepted len {run.mean_accepted_length:4.2f}  draft {100 * row['draft_share']:4.1f}%  "
                      f"verify {100 * row['verify_share']:4.1f}%  steps per γ {run.gamma_steps}  "
                      f"load={os.getloadavg()[0]:.1f}", flush=True)
    del llms
    return rows


def print_table(rows: list[dict], gamma_max: int) -> None:
    gammas = list(range(gamma_max + 1))
    print("| model | draft | batch | "
          + " | ".join("AR tok/s" if g == 0 else f"γ={g} tok/s (x AR; acc len)" for g in gammas) + " |")
    print("|---|---|---:|" + "---:|" * len(gammas))
    cells: dict[tuple, dict] = {(r["model"], r["draft"], r["batch_size"], r["gamma"]): r for r in rows}
    for model, draft, b in dict.fromkeys((r["model"], r["draft"], r["batch_size"]) for r in rows):
        ar = cells[(model, draft, b, 0)]["tokens_per_second"]
        parts = [f"{ar:.1f}"]
        for g in gammas[1:]:
            r = cells.get((model, draft, b, g))
            parts.append(f"{r['tokens_per_second']:.1f} ({r['tokens_per_second'] / ar:.2f}x; "
                         f"{r['mean_accepted_length']:.2f})" if r else "-")
        print(f"| {model} | {draft} | {b} | " + " | ".join(parts) + " |")


def print_planner_table(rows: list[dict]) -> None:
    """``--planner`` runs: per variant and batch, forced AR against the planner, and the planner's γ shares."""
    print("| model | draft | batch | AR tok/s | planner tok/s (x AR; acc len) | decode steps per γ |")
    print("|---|---|---:|---:|---:|---|")
    cells = {(r["model"], r["draft"], r["batch_size"], r["gamma"] == 0): r for r in rows}
    for model, draft, b in dict.fromkeys((r["model"], r["draft"], r["batch_size"]) for r in rows):
        ar, pl = cells[(model, draft, b, True)], cells[(model, draft, b, False)]
        steps = sum(pl["gamma_steps"].values())
        shares = ", ".join(f"γ={g}: {100 * n / steps:.0f}%" for g, n in pl["gamma_steps"].items())
        print(f"| {model} | {draft} | {b} | {ar['tokens_per_second']:.1f} | {pl['tokens_per_second']:.1f} "
              f"({pl['tokens_per_second'] / ar['tokens_per_second']:.2f}x; {pl['mean_accepted_length']:.2f}) | "
              f"{shares} |")


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    meta = machine_note()
    print(f"# {meta['date']}  cpus={meta['cpu_count']}  load={meta['loadavg_at_start']}", flush=True)
    texts = dataset_texts(args.dataset, default=DEFAULT_DATASET, fallback=BUILT_IN_PROMPTS if args.chat else ())
    rows = []
    for model in args.models.split(","):
        rows += bench_model(model, args, batch_sizes, texts)
    print()
    (print_planner_table(rows) if args.planner else print_table(rows, args.gamma_max))
    write_json(args.out, {"args": vars(args), "machine": meta, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
