"""What an offload and reload of the draft costs the requests that run through it: the mean accepted length of the
steps after a mark, for the same greedy requests run without a move and with the draft sent to host memory at a
step and brought back ``--away-steps`` (γ = 0) steps later, one engine per run in one process. Their outputs must be
equal (checked). For a feature draft (EAGLE) the gap shows what its contexts' features are worth: they travel to host
memory with its weights and come back (``ModelRunner.offload_draft``); the positions decoded while it was away have
none.

    python scripts/bench_reload_acceptance.py --out results/bench_reload_acceptance.json        # SmolLM2 + eagle
    python scripts/bench_reload_acceptance.py --model stories260k --draft stories260k@skip=2 --num-prompts 2 \\
        --max-tokens 24 --offload-at 4 --mark 6 --out /tmp/reload.json                            # smoke
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    dataset_texts,
    machine_note,
    model_spec,
    non_negative_int,
    positive_int,
    writable_out,
    write_json,
)

DATASET = "/work/shared/datasets/mt_bench/vicuna_bench_question.jsonl"


def run(args, texts: list[str], offload_at: int | None) -> dict:
    """Step the requests to the end; with ``offload_at`` the draft leaves before that step and returns after
    ``args.away_steps`` steps. Accepted length counted over the decode steps from ``args.mark`` on."""
    from nightjar_jax import LLM, SamplingParams

    llm = LLM(args.model, draft_model=args.draft, planner=f"static:{args.gamma}", num_speculative_tokens=args.gamma,
              prompt_lookup_max=0, draft_offload="auto", max_num_seqs=len(texts))
    engine, s = llm.engine, llm.engine.stats
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    chat = engine.tokenizer is not None and engine.tokenizer.chat_template is not None
    for i, text in enumerate(texts):
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]) if chat else text
        engine.add_request(prompt, sp, request_id=str(i))
    step, mark, outputs, away = 0, None, {}, 0
    while engine.has_unfinished_requests():
        if step == offload_at:
            engine._offload_draft()
            for _ in range(args.away_steps):
                away += engine.draft_offloaded  # (the steps it was really away: the policy may bring it back)
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.outputs[0].token_ids
            if engine.draft_offloaded:  # (the policy may have brought it back already)
                engine._reload_draft()
        if step == args.mark:
            mark = (s.num_accepted_tokens, sum(s.drafted_per_position[:1]))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.num_free_pages == engine.num_total_pages
    if mark is None:
        raise SystemExit(f"the requests finished before step {args.mark}: raise --max-tokens or lower --mark")
    accepted, chains = s.num_accepted_tokens - mark[0], sum(s.drafted_per_position[:1]) - mark[1]
    return {"mean_accepted_length": 1 + accepted / chains if chains else 1.0, "speculative_steps": chains,
            "offloads": s.num_draft_offloads, "reloads": s.num_draft_reloads, "away_steps": away,
            "feature_draft": engine.runner.feature_draft, "outputs": [outputs[str(i)] for i in range(len(texts))]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", type=model_spec)
    p.add_argument("--draft", default="smollm2-eagle", type=model_spec, help="the draft that moves (a model)")
    p.add_argument("--dataset", default=DATASET, help="JSONL of {'turns': [...]} (first turns are the prompts)")
    p.add_argument("--num-prompts", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--gamma", type=positive_int, default=4, help="γ of every step (>= 1: a draft that never "
                   "drafts has no acceptance to compare)")
    p.add_argument("--offload-at", type=non_negative_int, default=10,
                   help="the step before which the draft leaves (< --max-tokens: the run must reach it)")
    p.add_argument("--away-steps", type=positive_int, default=2, help="γ = 0 steps run while it is away")
    p.add_argument("--mark", type=non_negative_int, default=20,
                   help="count acceptance over the steps from this one on (< --max-tokens)")
    p.add_argument("--out", default="results/bench_reload_acceptance.json", type=writable_out)
    args = p.parse_args(argv)
    # (a run takes at most a prefill step per prompt and max_tokens - 1 decode steps, fewer as drafts are accepted:
    # a step at or past --max-tokens is certainly never reached, and a draft that never moved compares nothing)
    for flag, step in (("--offload-at", args.offload_at), ("--mark", args.mark)):
        if step >= args.max_tokens:
            p.error(f"{flag} {step}: the requests finish within --max-tokens {args.max_tokens} steps; allowed "
                    f"0..{args.max_tokens - 1}")
    return args


def check_moved(moved: dict, offload_at: int) -> None:
    """SystemExit unless the draft left and came back in the moved run (else "moved / still" compares two runs
    without a move)."""
    if moved["offloads"] < 1 or moved["reloads"] < 1:
        raise SystemExit(f"the draft never moved (offloads {moved['offloads']}, reloads {moved['reloads']}): the "
                         f"requests finished before step {offload_at}; lower --offload-at or raise --max-tokens")


def main() -> None:
    args = parse_args()
    texts = dataset_texts(args.dataset, default=DATASET)
    texts = (texts * args.num_prompts)[: args.num_prompts]

    still = run(args, texts, None)
    moved = run(args, texts, args.offload_at)
    if moved["outputs"] != still["outputs"]:
        raise SystemExit("outputs differ between the runs: the move was not lossless")
    check_moved(moved, args.offload_at)
    # (the label says the steps the draft was away: the engine's own policy may bring it back before
    # --away-steps, while requests still run, and the table said --away-steps all the same)
    early = "" if moved["away_steps"] == args.away_steps else f" (of --away-steps {args.away_steps}: the engine " \
        "brought it back as the load fell)"
    rows = {"no move": still, f"away before step {args.offload_at} for {moved['away_steps']} steps{early}": moved}
    print(f"\n{args.model} + {args.draft} (feature draft: {still['feature_draft']}), {len(texts)} greedy requests "
          f"of {args.max_tokens} tokens, γ = {args.gamma}; acceptance from step {args.mark} on\n")
    print("| run | mean accepted length | speculative sequence-steps | offloads / reloads |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['mean_accepted_length']:.3f} | {r['speculative_steps']} | "
              f"{r['offloads']} / {r['reloads']} |")
    ratio = moved["mean_accepted_length"] / still["mean_accepted_length"]
    print(f"\nmoved / still: {ratio:.3f}; outputs equal")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "ratio": ratio,
                          "runs": {k: {f: v for f, v in r.items() if f != "outputs"} for k, r in rows.items()}})


if __name__ == "__main__":
    main()
