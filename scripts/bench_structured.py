"""What a structured output's constraint costs: the same chat requests unconstrained and under each kind of
constraint (JSON schema, any JSON object, regex), one engine, plain decoding (speculation would blur the comparison
with its acceptance, which the constraint changes), alternating ``--repeats`` times. Prints tokens/s
and the mean inter-token latency per mode with the latter's ratio to the unconstrained one in the same run (tokens/s
also moves with the outputs' lengths, which the constraints change; the ITL holds decode steps only), the host time
of the constraint per token (the matcher's mask and its advance, replayed over the generated tokens), and the share
of outputs that finish and parse, and writes JSON.

    python scripts/bench_structured.py --out results/bench_structured.json                  # SmolLM2-135M
    python scripts/bench_structured.py --model stories260k --num-prompts 2 --batch-sizes 1,2 --max-tokens 8 \\
        --out /tmp/so.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    dataset_texts,
    fmt,
    int_list,
    machine_note,
    model_spec,
    positive_int,
    ratio,
    writable_out,
    write_json,
)

DATASET = "/work/shared/datasets/mt_bench/vicuna_bench_question.jsonl"
SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 400},
                   "confidence": {"type": "number"}},
    "required": ["topic", "answer", "confidence"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z ,]{20,300}\."
MAX_NUM_SEQS = 8  # the engine's batch when no --batch-sizes entry is larger
INSTRUCTION = " Answer in JSON with the keys topic, answer and confidence."


def modes():
    from nightjar_jax import StructuredOutputs

    return {"none": None, "json schema": StructuredOutputs(json=SCHEMA),
            "json object": StructuredOutputs(json_object=True),
            "regex": StructuredOutputs(regex=REGEX)}


def run(llm, prompts: list, params, batch: int) -> dict:
    """Generate in groups of ``batch`` requests; returns tokens, wall seconds and outputs."""
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    engine = llm.engine
    assert engine.num_free_pages == engine.num_total_pages
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    itls = [x for o in outs for x in o.metrics.itls()]  # decode steps only: output lengths do not weigh in
    return {"wall_seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall,
            # None: no output had a second token (--max-tokens 1), so there is no inter-token latency
            "mean_itl_seconds": statistics.fmean(itls) if itls else None,
            "outputs": [o.outputs[0] for o in outs]}


def constraint_host_seconds(llm, spec, outputs) -> float:
    """Seconds per token of the constraint's host work (mask + advance), replayed over ``outputs``' tokens."""
    backend = llm.engine.grammar_backend()
    total, count = 0.0, 0
    for out in outputs:
        grammar = backend.matcher(spec)
        t0 = time.perf_counter()
        for tok in out.token_ids:
            allowed = grammar.allowed()
            assert allowed[tok]
            grammar.accept(tok)
        total += time.perf_counter() - t0
        count += len(out.token_ids)
    return total / max(count, 1)


def parses(kind: str, text: str) -> bool:
    """Whether an output is what its constraint asked for: a JSON object, all of the regex, or anything (none)."""
    if kind.startswith("json"):
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return True


def median_or_none(values) -> float | None:
    """The median of the values that exist; None when none does."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", type=model_spec)
    p.add_argument("--dataset", default=DATASET, help="JSONL of {'turns': [...]} (first turns are the questions)")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=96)
    p.add_argument("--batch-sizes", default="1,8", type=int_list(1, as_text=True),
                   help=f"requests per generate() call (the engine's max_num_seqs: {MAX_NUM_SEQS}, or the largest)")
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--out", default="results/bench_structured.json", type=writable_out)
    args = p.parse_args(argv)
    over = [b for b in map(int, args.batch_sizes.split(",")) if b > args.num_prompts]
    if over:  # (a "batch 8" row of 2 prompts held 2 requests per call)
        p.error(f"argument --batch-sizes: {','.join(map(str, over))} is more than --num-prompts {args.num_prompts}: "
                "a generate() call would hold fewer requests than its row says")
    return args


def main() -> None:
    args = parse_args()
    texts = dataset_texts(args.dataset, default=DATASET)
    from nightjar_jax import LLM, SamplingParams

    batches = [int(b) for b in args.batch_sizes.split(",")]
    # (no prefix caching: every run prefills the same chunks, so the warm-up compiled every shape they take; a batch
    # above the engine's max_num_seqs would run in smaller steps than its label says, so the engine takes the largest)
    llm = LLM(args.model, draft_model="none", max_num_seqs=max(MAX_NUM_SEQS, *batches), enable_prefix_caching=False)
    tok = llm.engine.tokenizer
    texts = (texts * args.num_prompts)[: args.num_prompts]
    if tok.chat_template is not None:
        prompts = [tok.apply_chat_template([{"role": "user", "content": t + INSTRUCTION}]) for t in texts]
    else:
        prompts = [t + INSTRUCTION for t in texts]
    specs = modes()
    params = {m: SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=s)
              for m, s in specs.items()}
    for b in batches:  # warm-up: every mode's step variants (the dense-bias one compiles on first use)
        for m in specs:
            run(llm, prompts, params[m], b)
    rows: dict[tuple[int, str], list[dict]] = {(b, m): [] for b in batches for m in specs}
    for _ in range(args.repeats):
        for b in batches:
            for m in specs:
                rows[(b, m)].append(run(llm, prompts, params[m], b))
    host = {m: constraint_host_seconds(llm, s, rows[(batches[0], m)][0]["outputs"])
            for m, s in specs.items() if s is not None}

    print(f"\n{args.model}, {args.num_prompts} chat requests, greedy, up to {args.max_tokens} tokens, plain decoding; "
          f"medians of {args.repeats}\n")
    print("| batch | constraint | tokens | tok/s | mean ITL (ms) | ITL x none | constraint host ms / token | "
          "finished | parse |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    table = []
    for b in batches:
        base = median_or_none(r["mean_itl_seconds"] for r in rows[(b, "none")])
        for m in specs:
            rs = rows[(b, m)]
            tps = statistics.median(r["tokens_per_second"] for r in rs)
            itl = median_or_none(r["mean_itl_seconds"] for r in rs)
            outs = rs[0]["outputs"]
            stop = sum(o.finish_reason == "stop" for o in outs)
            ok = sum(parses(m, o.text) for o in outs)
            ms = host.get(m)
            print(f"| {b} | {m} | {rs[0]['tokens']} | {tps:.1f} | {fmt(itl, '.2f', 1e3)} | {fmt(ratio(itl, base))} | "
                  f"{'-' if ms is None else f'{ms * 1e3:.3f}'} | {stop}/{len(outs)} | {ok}/{len(outs)} |")
            table.append({"batch": b, "constraint": m, "tokens": rs[0]["tokens"], "tokens_per_second": tps,
                          "mean_itl_seconds": itl, "itl_ratio_to_none": ratio(itl, base),
                          "constraint_host_seconds_per_token": ms, "finished": stop, "parsed": ok,
                          "runs": [{k: r[k] for k in ("tokens_per_second", "mean_itl_seconds")} for r in rs]})
    for m in specs:
        print(f"\n{m}: {rows[(batches[0], m)][0]['outputs'][0].text[:200]!r}")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "rows": table})


if __name__ == "__main__":
    main()
