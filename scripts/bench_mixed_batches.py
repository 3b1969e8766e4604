"""Speculation beside requests whose bias at a position depends on the tokens before it. Presence / frequency /
repetition penalties: a verify counts the drafts before each position (``sampler.apply_penalties``). Structured
outputs: a speculative step walks the drafts (a chain's, or each branch of a token tree's) through the constraint
and verifies them under its mask at each position. So both kinds speculate. (Before, a batch holding either
decoded plainly for as long as that request ran.)

One batch of chat requests (greedy, MT-Bench questions) per mix, through a speculative engine at a fixed γ and
through a plain engine over the same target (what such a batch ran before), alternating ``--repeats`` times.
Prints per mix and engine: decode steps, tokens per decode step, drafts accepted per speculating row and step, and
decode tokens/s with its ratio to the plain engine's in the same run; writes JSON.

    python scripts/bench_mixed_batches.py --out results/bench_mixed_batches.json                 # SmolLM2-135M
    python scripts/bench_mixed_batches.py --model stories260k --draft-model stories260k --num-prompts 2 \\
        --max-tokens 8 --out /tmp/mixed.json                                                       # smoke
    python scripts/bench_mixed_batches.py --gamma 4 --spec-tree-nodes 16 --out results/bench_mixed_batches_tree.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    dataset_texts,
    draft_spec,
    machine_note,
    model_spec,
    non_negative_int,
    positive_int,
    writable_out,
    write_json,
)

DATASET = "/work/shared/datasets/mt_bench/vicuna_bench_question.jsonl"
SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 400}},
    "required": ["topic", "answer"],
    "additionalProperties": False,
}


def mixes(num: int, structured: bool) -> dict[str, list[dict]]:
    """Mix name -> each request's extra sampling fields: a quarter of the batch (at least one), or all of it."""
    some = max(1, num // 4)
    penalty = {"presence_penalty": 0.5, "frequency_penalty": 0.5}
    out = {"none": [{}] * num, f"penalties {some}/{num}": [penalty] * some + [{}] * (num - some),
           f"penalties {num}/{num}": [penalty] * num, f"repetition {num}/{num}": [{"repetition_penalty": 1.2}] * num}
    if structured:
        from nightjar_jax import StructuredOutputs

        schema = {"structured_outputs": StructuredOutputs(json=SCHEMA)}
        out[f"json schema {some}/{num}"] = [schema] * some + [{}] * (num - some)
        out[f"json schema {num}/{num}"] = [schema] * num
    return out


def run(llm, prompts: list, params: list) -> dict:
    """One batch to completion; the engine's decode steps (its step log) and drafts over it."""
    engine = llm.engine
    stats = engine.stats
    engine.record_steps = True
    stats.step_log.clear()
    accepted = stats.num_accepted_tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.num_free_pages == engine.num_total_pages
    steps = [s for s in stats.step_log if not s["compiled"]]
    committed = sum(s["committed"] for s in steps)
    seconds = sum(s["seconds"] for s in steps)
    # rows that speculated, per step (chain or tree; not those that accepted no draft by rule)
    row_steps = sum(len(s["accepted"]) - sum(s.get("plain_rows") or []) for s in stats.step_log if s["gamma"])
    return {"decode_steps": len(steps), "committed": committed, "tokens_per_step": committed / max(len(steps), 1),
            "accepted_per_row_step": (stats.num_accepted_tokens - accepted) / row_steps if row_steps else 0.0,
            "decode_tokens_per_second": committed / seconds if seconds else float("nan"),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "compiled_steps": len(stats.step_log) - len(steps), "texts": [o.outputs[0].text for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_spec, default="smollm2-135m-instruct")
    p.add_argument("--draft-model", type=draft_spec, default=None,
                   help="the speculative engine's draft (default: the model's own)")
    p.add_argument("--gamma", type=positive_int, default=3, help="the speculative engine's fixed γ")
    p.add_argument("--spec-tree-nodes", type=non_negative_int, default=0,
                   help="the speculative engine's token tree at γ (0: chains; with n-gram lookup, a copy branch too)")
    p.add_argument("--dataset", default=DATASET, help="JSONL of {'turns': [...]} (first turns are the questions)")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--no-structured", action="store_true", help="leave out the structured-output mix (no xgrammar)")
    p.add_argument("--out", type=writable_out, default="results/bench_mixed_batches.json")
    args = p.parse_args()
    texts = dataset_texts(args.dataset, default=p.get_default("dataset"))  # (before the model loads)
    from nightjar_jax import LLM, SamplingParams

    common = dict(max_num_seqs=args.num_prompts, enable_prefix_caching=False)
    draft = {} if args.draft_model is None else {"draft_model": args.draft_model}
    engines = {"speculative": LLM(args.model, planner="static", num_speculative_tokens=args.gamma,
                                  spec_tree_nodes=args.spec_tree_nodes, **draft, **common),
               "plain": LLM(args.model, draft_model="none", **common)}
    tok = engines["plain"].engine.tokenizer
    texts = (texts * args.num_prompts)[: args.num_prompts]
    prompts = ([tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
               if tok.chat_template is not None else texts)
    params = {m: [SamplingParams(temperature=0, max_tokens=args.max_tokens, **extra) for extra in fields]
              for m, fields in mixes(args.num_prompts, not args.no_structured).items()}
    for llm in engines.values():  # warm-up: every mix's step variants (the dense-bias ones compile on first use)
        for m in params:
            run(llm, prompts, params[m])
    rows: dict[tuple[str, str], list[dict]] = {(m, e): [] for m in params for e in engines}
    for _ in range(args.repeats):
        for m in params:
            for e, llm in engines.items():
                rows[(m, e)].append(run(llm, prompts, params[m]))

    shape = f"a {args.spec_tree_nodes}-node tree" if args.spec_tree_nodes else "a chain"
    print(f"\n{args.model}, {args.num_prompts} chat requests at once, greedy, up to {args.max_tokens} tokens; "
          f"speculative: γ = {args.gamma}, {shape}; medians of {args.repeats}\n")
    print("| mix | engine | tokens | decode steps | tokens / step | accepted / row-step | decode tok/s | x plain |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    table = []
    for m in params:
        base = statistics.median(r["decode_tokens_per_second"] for r in rows[(m, "plain")])
        for e in engines:
            rs = rows[(m, e)]
            tps = statistics.median(r["decode_tokens_per_second"] for r in rs)
            first = rs[0]
            print(f"| {m} | {e} | {first['tokens']} | {first['decode_steps']} | {first['tokens_per_step']:.2f} | "
                  f"{first['accepted_per_row_step']:.2f} | {tps:.1f} | {tps / base:.2f} |")
            # (the median last: the first run's own figure, spread in, overwrote it, so the JSON disagreed with
            # the table)
            table.append({"mix": m, "engine": e, "tokens_per_second_ratio_to_plain": tps / base,
                          **{k: v for k, v in first.items() if k != "texts"}, "decode_tokens_per_second": tps,
                          "runs": [r["decode_tokens_per_second"] for r in rs]})
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "rows": table})


if __name__ == "__main__":
    main()
