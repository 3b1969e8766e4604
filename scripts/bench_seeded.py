"""Seeded against unseeded sampled requests under speculation: acceptance, and whether a seed repeats its tokens at
every γ (see docs/benchmarks.md, "Seeded requests at any γ").

A seeded request's speculative steps verify its drafts against the tokens plain steps would draw and commit those
(``SamplingTensors.exact``, ``nightjar_jax/spec/rejection.py``), so its tokens do not depend on γ; an unseeded one
keeps rejection sampling. This measures what the first costs: the share of drafted tokens accepted, per
temperature, for the same prompts with and without seeds, at a static γ; and checks the price buys what it says:
each seeded output is compared token for token with the same request decoded without a draft.

    python scripts/bench_seeded.py --prompts 16 --max-tokens 64 --out results/bench_seeded.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    draft_gap,
    draft_model,
    fmt,
    int_in_range,
    machine_note,
    model_spec,
    positive_float,
    positive_int,
    writable_out,
    write_json,
)

SEED_BASE = 1000  # request i is seeded SEED_BASE + i
NUM_HELDOUT_PROMPTS = 36  # the held-out MT-Bench / Spec-Bench prompts (distill_draft.load_prompts("heldout"))


def measure(llm, prompts: list[list[int]], temperature: float, max_tokens: int, seeded: bool) -> dict:
    """One batch of ``prompts`` at ``temperature``: the outputs' token ids and the drafts accepted / drafted."""
    from nightjar_jax import SamplingParams

    stats = llm.engine.stats
    accepted, drafted = stats.num_accepted_tokens, stats.num_drafted_tokens
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                             seed=SEED_BASE + i if seeded else None) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    accepted, drafted = stats.num_accepted_tokens - accepted, stats.num_drafted_tokens - drafted
    return {"temperature": temperature, "seeded": seeded, "accepted": accepted, "drafted": drafted,
            "acceptance": accepted / drafted if drafted else None, "seconds": seconds,
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def run(spec_llm, plain_llm, prompts: list[list[int]], temperatures: list[float], max_tokens: int) -> list[dict]:
    """Per temperature: unseeded and seeded through the speculating engine (acceptance), and the seeded requests
    through the plain one (how many outputs are token for token the plain decoding's)."""
    rows = []
    for temperature in temperatures:
        for seeded in (False, True):
            row = measure(spec_llm, prompts, temperature, max_tokens, seeded)
            if seeded:
                plain = measure(plain_llm, prompts, temperature, max_tokens, True)["outputs"]
                row["same_as_plain"] = sum(a == b for a, b in zip(row["outputs"], plain, strict=True))
            rows.append(row)
    return rows


def table(rows: list[dict], num_prompts: int) -> str:
    lines = [f"{'temperature':>11} {'requests':>9} {'accepted/drafted':>17} {'acceptance':>10} "
             f"{'same tokens as no draft':>24}"]
    for r in rows:
        same = f"{r['same_as_plain']}/{num_prompts}" if "same_as_plain" in r else "-"
        lines.append(f"{r['temperature']:>11g} {'seeded' if r['seeded'] else 'unseeded':>9} "
                     f"{r['accepted']:>8}/{r['drafted']:<8} {fmt(r['acceptance'], '.3f'):>10} {same:>24}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_spec, default="smollm2-135m-instruct",
                   help="the target (default: %(default)s)")
    p.add_argument("--draft", type=draft_model, default="auto", help="its draft (default: the preset's shipped one)")
    p.add_argument("--gamma", type=int_in_range(1, 16), default=4, help="the static γ (default: %(default)s)")
    p.add_argument("--prompts", type=int_in_range(1, NUM_HELDOUT_PROMPTS), default=16,
                   help=f"the first N held-out chat prompts, at most {NUM_HELDOUT_PROMPTS} (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--temperatures", type=lambda t: [positive_float(x) for x in t.split(",")], default=[0.7, 1.0],
                   help="comma-separated (default: 0.7,1.0)")
    p.add_argument("--out", type=writable_out, default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    gap = draft_gap(args.draft, args.model)
    if gap:
        p.error(f"argument --draft: {gap}: the benchmark measures speculative steps, so it needs a draft model")
    from nightjar_jax.models.loader import load_checkpoint  # (the held-out prompts are chats: a model without a
    # template failed after both engines had loaded)

    if getattr(load_checkpoint(args.model, load_format="dummy").tokenizer, "chat_template", None) is None:
        p.error(f"argument --model: {args.model} has no chat template (the prompts are held-out chat questions): "
                "give a chat model, e.g. smollm2-135m-instruct")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from distill_draft import chat_ids, load_prompts

    from nightjar_jax import LLM

    spec_llm = LLM(args.model, draft_model=args.draft, planner="static", num_speculative_tokens=args.gamma)
    plain_llm = LLM(args.model, draft_model="none")
    tokenizer = spec_llm.engine.tokenizer
    prompts = [chat_ids(tokenizer, p["text"]) for p in load_prompts("heldout")[: args.prompts]]
    rows = run(spec_llm, plain_llm, prompts, args.temperatures, args.max_tokens)
    print(table(rows, len(prompts)))
    if args.out:
        write_json(args.out, {"machine": machine_note(), "args": vars(args),
                              "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]})


if __name__ == "__main__":
    main()
