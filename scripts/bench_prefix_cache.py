"""What prefix caching buys a chat workload whose requests share a long system prompt: the same requests, arriving
one every ``--interval-steps`` engine steps, run with the cache off and on in one engine (the same compiled steps;
the cache is emptied between runs), alternating ``--repeats`` times. Prints prompt tokens computed, the cache's hits,
mean time to first token, and the run's wall seconds with their ratios (on / off, same run), and writes JSON. Greedy
outputs must be equal (checked).

    python scripts/bench_prefix_cache.py --out results/bench_prefix_cache.json              # SmolLM2-135M, 16 requests
    python scripts/bench_prefix_cache.py --model stories260k --num-prompts 4 --max-tokens 8 --system-chars 240 \\
        --out /tmp/prefix.json                                                               # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

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
# A system prompt of the length assistants ship with (this project's own words).
SYSTEM = (
    "You are a careful, friendly assistant for a small engineering team. Answer the user's question directly in "
    "the first sentence, then give the reasoning or the steps that support it. Prefer short paragraphs and plain "
    "words over jargon; when a technical term is needed, define it the first time it appears. When the question is "
    "ambiguous, state the reading you chose and answer that one instead of asking back. When you are unsure of a "
    "fact, say so and say how the user could check it. Never invent references, numbers or quotations. For code, "
    "give a complete, runnable example in the language the user asked for, with comments only where the code does "
    "something surprising, and mention the versions it assumes. For comparisons, use a small table with one row per "
    "option and one column per criterion the user cares about. For plans, number the steps and say what each one "
    "needs before it can start. Keep answers under three hundred words unless the user asks for more, and end with "
    "one sentence that says what the user should do next."
)


def run(llm, prompts: list, params, interval: int) -> dict:
    """Add the prompts one every ``interval`` steps (0: all at once) and step to the end; returns counts, TTFTs and
    wall seconds."""
    engine = llm.engine
    stats = engine.stats
    hits0, queries0, draft_hits0 = (stats.num_prefix_cache_hits, stats.num_prefix_cache_queries,
                                    stats.num_prefix_cache_draft_hits)
    catchup0, catchup_s0 = stats.num_catchup_tokens, stats.catchup_seconds
    done, step, added = {}, 0, []
    t0 = time.perf_counter()
    while len(added) < len(prompts) or engine.has_unfinished_requests():
        while len(added) < len(prompts) and (interval == 0 or step % interval == 0):
            added.append(engine.add_request(prompts[len(added)], params))
            if interval:
                break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    wall = time.perf_counter() - t0
    assert engine.num_free_pages == engine.num_total_pages
    outs = [done[i] for i in added]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    hits = stats.num_prefix_cache_hits - hits0
    return {"wall_seconds": wall, "steps": step, "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": prompt_tokens - hits, "cache_hits": hits,
            "cache_queries": stats.num_prefix_cache_queries - queries0,
            "cache_draft_hits": stats.num_prefix_cache_draft_hits - draft_hits0,
            "draft_catchup_tokens": stats.num_catchup_tokens - catchup0,
            "draft_catchup_seconds": stats.catchup_seconds - catchup_s0,
            "mean_ttft_seconds": statistics.fmean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs),
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_spec, default="smollm2-135m-instruct")
    p.add_argument("--draft", type=draft_spec, default="none",
                   help="draft model (default none: the prefill's share alone)")
    p.add_argument("--dataset", default=DATASET, help="JSONL of {'turns': [...]} (first turns are the questions)")
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--interval-steps", type=non_negative_int, default=4,
                   help="a new request every this many engine steps (0: "
                   "all at once, a burst)")
    p.add_argument("--repeats", type=positive_int, default=2, help="off / on pairs, alternating")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--system-chars", type=non_negative_int, default=len(SYSTEM),
                   help="cut the system prompt to this many "
                   "characters (stories260K's small vocabulary makes it ~600 tokens whole)")
    p.add_argument("--system-repeats", type=positive_int, default=1,
                   help="the system prompt this many times over (a longer "
                   "shared prefix)")
    p.add_argument("--out", type=writable_out, default="results/bench_prefix_cache.json")
    args = p.parse_args()
    texts = dataset_texts(args.dataset, default=p.get_default("dataset"))  # (before the model loads)
    from nightjar_jax import LLM, SamplingParams

    llm = LLM(args.model, draft_model=args.draft, page_size=args.page_size, max_num_seqs=8,
              enable_prefix_caching=True)
    tok = llm.engine.tokenizer
    system = "\n\n".join([SYSTEM[: args.system_chars]] * args.system_repeats)
    texts = (texts * args.num_prompts)[: args.num_prompts]
    if tok is not None and tok.chat_template is not None:
        prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": t}])
                   for t in texts]
    else:
        prompts = [system + "\n\n" + t for t in texts]
    longest = max(len(llm.engine.tokenize_prompt(q)[1]) for q in prompts)
    if longest + args.max_tokens > llm.engine.max_model_len:  # (each request runs to --max-tokens: ignore_eos)
        p.error(f"argument --system-chars: the longest prompt is {longest} tokens (a system prompt of "
                f"{args.system_chars} characters x {args.system_repeats}), and with --max-tokens {args.max_tokens} "
                f"it passes {args.model}'s context of {llm.engine.max_model_len}: give a smaller --system-chars (e.g. "
                f"240 for stories260k) or --max-tokens")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sched = llm.engine.scheduler
    for mode in ("off", "on"):  # compile the shapes both runs use (the cache's shorter prefill chunks too)
        llm.reset_prefix_cache()
        sched.prefix_caching = mode == "on"
        run(llm, prompts, params, args.interval_steps)
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            llm.reset_prefix_cache()
            sched.prefix_caching = mode == "on"
            rows[mode].append(run(llm, prompts, params, args.interval_steps))
    # every repeat, cache on and off, against the first without it (the first repeat alone was compared)
    first = rows["off"][0]["outputs"]
    if any(r["outputs"] != first for mode in ("off", "on") for r in rows[mode]):
        raise SystemExit("outputs differ with the cache on or between repeats: prefix caching was not lossless")

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    print(f"\n{args.model} (draft {args.draft}), {args.num_prompts} chat requests sharing a "
          f"{len(tok.encode(system)) if tok else '?'}-token system prompt, "
          f"{f'one every {args.interval_steps} steps' if args.interval_steps else 'all at once'}, "
          f"{args.max_tokens} greedy tokens each, page size {args.page_size}; medians of {args.repeats}\n")
    print("| cache | prompt tokens | computed | hits | draft catch-up tokens (s) | mean TTFT (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in ("off", "on"):
        print(f"| {mode} | {median(mode, 'prompt_tokens'):.0f} | {median(mode, 'prompt_tokens_computed'):.0f} | "
              f"{median(mode, 'cache_hits'):.0f} | {median(mode, 'draft_catchup_tokens'):.0f} "
              f"({median(mode, 'draft_catchup_seconds'):.2f}) | {median(mode, 'mean_ttft_seconds'):.3f} | "
              f"{median(mode, 'wall_seconds'):.2f} |")
    ratios = {key: median("on", key) / median("off", key)
              for key in ("prompt_tokens_computed", "mean_ttft_seconds", "wall_seconds")}
    print(f"\non / off: prompt tokens computed {ratios['prompt_tokens_computed']:.3f}, mean TTFT "
          f"{ratios['mean_ttft_seconds']:.3f}, wall {ratios['wall_seconds']:.3f}; outputs equal")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "ratios": ratios,
                          "runs": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
                                   for m, rs in rows.items()}})


if __name__ == "__main__":
    main()
