"""What priority scheduling buys urgent requests behind a backlog: ``--num-background`` long requests arrive at once
(priority 0), then ``--num-urgent`` short ones (priority -1 under the "priority" policy), one every
``--urgent-interval`` engine steps from step ``--urgent-after``. The same arrivals run under both policies in one
engine (the same compiled steps; the scheduler's policy switched between runs), alternating ``--repeats`` times.
Prints each class's time to first token and end-to-end latency (engine steps and seconds), preemptions and wall
seconds with the ratios priority / fcfs of the same run, and writes JSON. Greedy outputs must be equal (checked):
scheduling changes when a request runs, never its tokens.

    python scripts/bench_priority.py --out results/bench_priority.json                  # SmolLM2-135M
    python scripts/bench_priority.py --model stories260k --num-background 4 --num-urgent 2 --background-tokens 8 \\
        --urgent-tokens 4 --max-num-seqs 2 --repeats 1 --out /tmp/priority.json          # smoke
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
    fmt,
    machine_note,
    make_prompt_ids,
    model_spec,
    non_negative_int,
    positive_int,
    ratio,
    writable_out,
    write_json,
)

DATASET = "/work/shared/datasets/mt_bench/vicuna_bench_question.jsonl"
POLICIES = ("fcfs", "priority")


def run(llm, policy: str, background: list, urgent: list, bg_params, urgent_params, after: int,
        interval: int) -> dict:
    """The arrivals under ``policy``; per class, latencies in steps and seconds."""
    engine = llm.engine
    engine.scheduler.by_priority = policy == "priority"  # (idle between runs: the waiting queue is empty)
    urgent_priority = -1 if policy == "priority" else 0
    preemptions0 = engine.stats.num_preemptions
    arrival_step, first_step, finish_step, done = {}, {}, {}, {}
    bg_ids = [engine.add_request(p, bg_params) for p in background]
    arrival_step.update({rid: 0 for rid in bg_ids})
    urgent_ids: list[str] = []
    step = 0
    t0 = time.perf_counter()
    while len(urgent_ids) < len(urgent) or engine.has_unfinished_requests():
        if len(urgent_ids) < len(urgent) and step >= after and (step - after) % interval == 0:
            rid = engine.add_request(urgent[len(urgent_ids)], urgent_params, priority=urgent_priority)
            urgent_ids.append(rid)
            arrival_step[rid] = step
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first_step:
                first_step[out.request_id] = step
            if out.finished:
                finish_step[out.request_id] = step
                done[out.request_id] = out
        step += 1
    wall = time.perf_counter() - t0
    assert engine.num_free_pages == engine.num_total_pages

    def latencies(ids: list[str]) -> dict:
        outs = [done[i] for i in ids]
        return {
            "ttft_steps": statistics.fmean(first_step[i] - arrival_step[i] for i in ids),
            "e2e_steps": statistics.fmean(finish_step[i] - arrival_step[i] for i in ids),
            "ttft_seconds": statistics.fmean(o.metrics.ttft for o in outs),
            "e2e_seconds": statistics.fmean(o.metrics.finish_time - o.metrics.arrival_time for o in outs),
            "max_ttft_seconds": max(o.metrics.ttft for o in outs),
        }

    return {"policy": policy, "wall_seconds": wall, "steps": step,
            "preemptions": engine.stats.num_preemptions - preemptions0,
            "urgent": latencies(urgent_ids), "background": latencies(bg_ids),
            "outputs": [done[i].outputs[0].token_ids for i in bg_ids + urgent_ids]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", type=model_spec)
    p.add_argument("--draft", default="none", type=draft_spec, help="draft model (default none: scheduling alone)")
    p.add_argument("--dataset", default=DATASET)
    p.add_argument("--num-background", type=positive_int, default=24)
    p.add_argument("--num-urgent", type=positive_int, default=6)
    p.add_argument("--background-tokens", type=positive_int, default=64)
    p.add_argument("--urgent-tokens", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=48)
    p.add_argument("--urgent-after", type=non_negative_int, default=4,
                   help="the first urgent request arrives at this step")
    p.add_argument("--urgent-interval", type=positive_int, default=6, help="then one every this many steps")
    p.add_argument("--max-num-seqs", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=2, help="fcfs / priority pairs, alternating")
    p.add_argument("--out", default="results/bench_priority.json", type=writable_out)
    return p.parse_args(argv)


def policy_ratios(median) -> dict[str, float | None]:
    """priority / fcfs of each class's medians (``median(policy, cls, key)``); None where fcfs's is 0 (e.g. a class
    that never waited under either policy: there is nothing to divide by)."""
    ratios = {f"{cls}_{key}": ratio(median("priority", cls, key), median("fcfs", cls, key))
              for cls in ("urgent", "background") for key in ("ttft_steps", "ttft_seconds", "e2e_seconds")}
    ratios["wall_seconds"] = ratio(median("priority", None, "wall_seconds"), median("fcfs", None, "wall_seconds"))
    return ratios


def main() -> None:
    args = parse_args()
    texts = dataset_texts(args.dataset, default=DATASET)
    from nightjar_jax import LLM, SamplingParams

    llm = LLM(args.model, draft_model=args.draft, max_num_seqs=args.max_num_seqs, scheduling_policy="priority")
    tok = llm.engine.tokenizer
    prompts, source = make_prompt_ids(tok, texts, args.num_background + args.num_urgent, args.prompt_len,
                                      llm.engine.target.config.vocab_size)
    background, urgent = prompts[: args.num_background], prompts[args.num_background:]
    bg_params = SamplingParams(temperature=0, max_tokens=args.background_tokens, ignore_eos=True)
    urgent_params = SamplingParams(temperature=0, max_tokens=args.urgent_tokens, ignore_eos=True)
    schedule = (args.urgent_after, args.urgent_interval)
    for policy in POLICIES:  # compile every shape both runs use
        run(llm, policy, background, urgent, bg_params, urgent_params, *schedule)
    rows: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for _ in range(args.repeats):
        for policy in POLICIES:
            rows[policy].append(run(llm, policy, background, urgent, bg_params, urgent_params, *schedule))
    # every repeat of both policies against the first (the first repeat alone was compared)
    first = rows["fcfs"][0]["outputs"]
    if any(r["outputs"] != first for policy in POLICIES for r in rows[policy]):
        raise SystemExit("outputs differ between the policies or the repeats: scheduling changed tokens")

    def median(policy: str, cls: str | None, key: str) -> float:
        return statistics.median((r[cls] if cls else r)[key] for r in rows[policy])

    print(f"\n{args.model} (draft {args.draft}), max_num_seqs {args.max_num_seqs}: {args.num_background} background "
          f"requests x {args.background_tokens} tokens at step 0, {args.num_urgent} urgent x {args.urgent_tokens} "
          f"from step {args.urgent_after}, one every {args.urgent_interval}; {args.prompt_len}-token {source} "
          f"prompts, greedy; medians of {args.repeats}\n")
    print("| policy | urgent TTFT steps (s) | urgent e2e steps (s) | background TTFT steps (s) | "
          "background e2e steps (s) | preemptions | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for policy in POLICIES:
        cells = [f"{median(policy, c, k + '_steps'):.1f} ({median(policy, c, k + '_seconds'):.2f})"
                 for c in ("urgent", "background") for k in ("ttft", "e2e")]
        print(f"| {policy} | {' | '.join(cells)} | {median(policy, None, 'preemptions'):.0f} | "
              f"{median(policy, None, 'wall_seconds'):.2f} |")
    ratios = policy_ratios(median)
    r = {k: fmt(v, ".3f") for k, v in ratios.items()}  # "n/a" where fcfs's median was 0
    print(f"\npriority / fcfs: urgent TTFT {r['urgent_ttft_seconds']} (steps {r['urgent_ttft_steps']}), urgent e2e "
          f"{r['urgent_e2e_seconds']}; background TTFT {r['background_ttft_seconds']}, e2e "
          f"{r['background_e2e_seconds']}; wall {r['wall_seconds']}; outputs equal")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "ratios": ratios,
                          "runs": {policy: [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
                                   for policy, rs in rows.items()}})


if __name__ == "__main__":
    main()
