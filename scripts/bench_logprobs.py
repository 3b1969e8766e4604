"""What log-probabilities cost: decode tokens/s with ``SamplingParams.logprobs`` off, 0, 5 and 20, and the time to
score a prompt (``prompt_logprobs``, as the completions API's ``echo`` asks) against prefilling it plainly.

One engine (the target alone, plain decoding: the variants differ only in what the step returns), the workloads
interleaved round by round so they share this shared machine's minutes; medians over rounds, ratios against "off"
from the same rounds. Every variant is compiled in a warm-up round first (its first use compiles it).

    python scripts/bench_logprobs.py --batch-sizes 1,32 --rounds 5 --out results/bench_logprobs.json
    python scripts/bench_logprobs.py --model stories260k --batch-sizes 1,4 --rounds 2 --output-len 8   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    int_at_least,
    int_list,
    machine_note,
    model_spec,
    positive_int,
    run_decode_workload,
    writable_out,
    write_json,
)
from nightjar_jax.config import WEIGHT_FORMATS  # noqa: E402

MAX_BATCHED_TOKENS = 512  # the engine's max_num_batched_tokens: a scored prompt is prefilled in one chunk

DECODE_VARIANTS = (None, 0, 5, 20)  # SamplingParams.logprobs


def prompts_for(vocab_size: int, batch_size: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Synthetic prompt ids (what is scored does not change what a step costs)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, vocab_size, prompt_len - 1).tolist() for _ in range(batch_size)]


def score_seconds(llm, prompt: list[int], prompt_logprobs: int | None) -> float:
    """Wall seconds to prefill ``prompt`` and sample one token, scoring the prompt when ``prompt_logprobs`` is set."""
    from nightjar_jax import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    if prompt_logprobs is not None and (len(out.prompt_logprobs) != len(prompt) or out.prompt_logprobs[-1] is None):
        raise RuntimeError("the prompt was not scored in full")
    return seconds


def run(llm, batch_sizes: list[int], rounds: int, prompt_len: int, output_len: int, score_len: int) -> dict:
    vocab = llm.engine.target.config.vocab_size
    decode: dict[int, dict] = {}
    for b in batch_sizes:
        prompts = prompts_for(vocab, b, prompt_len, seed=b)
        samples: dict = {v: [] for v in DECODE_VARIANTS}
        for r in range(rounds + 1):  # round 0 compiles each variant's shapes and is not kept
            for v in DECODE_VARIANTS:
                run_ = run_decode_workload(llm, prompts, output_len, gamma=0, logprobs=v)
                if r:
                    samples[v].append(run_.tokens_per_second)
        off = statistics.median(samples[None])
        decode[b] = {("off" if v is None else str(v)): {
            "tokens_per_second": statistics.median(samples[v]), "vs_off": statistics.median(samples[v]) / off,
            "samples": samples[v]} for v in DECODE_VARIANTS}
    prompt = prompts_for(vocab, 1, score_len, seed=0)[0]
    scoring: dict = {"off": [], "0": [], "5": []}
    for r in range(rounds + 1):
        for key in scoring:
            seconds = score_seconds(llm, prompt, None if key == "off" else int(key))
            if r:
                scoring[key].append(seconds)
    off = statistics.median(scoring["off"])
    score = {k: {"seconds": statistics.median(v), "vs_off": statistics.median(v) / off, "samples": v}
             for k, v in scoring.items()}
    return {"decode": decode, "score_prompt": score, "score_len": score_len}


def print_table(result: dict) -> None:
    print("\ndecode tokens/s (median over rounds) and the ratio to logprobs off, same rounds")
    print(f"{'batch':>6} | " + " | ".join(f"{name:>16}" for name in ("off", "logprobs=0", "logprobs=5",
                                                                         "logprobs=20")))
    for b, row in result["decode"].items():
        cells = [f"{row['off']['tokens_per_second']:8.1f}        "]
        cells += [f"{row[k]['tokens_per_second']:8.1f} ({row[k]['vs_off']:.3f}x)" for k in ("0", "5", "20")]
        print(f"{b:>6} | " + " | ".join(cells))
    s = result["score_prompt"]
    print(f"\nscoring a {result['score_len']}-token prompt (prefill + 1 token), median seconds: off "
          f"{s['off']['seconds']:.3f}, prompt_logprobs=0 {s['0']['seconds']:.3f} ({s['0']['vs_off']:.2f}x), "
          f"prompt_logprobs=5 {s['5']['seconds']:.3f} ({s['5']['vs_off']:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", type=model_spec)
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS)
    p.add_argument("--batch-sizes", default="1,32", type=int_list(1, as_text=True))
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=int_at_least(2), default=32, help=">= 2: the first comes from the prefill")
    p.add_argument("--score-len", type=int_at_least(2), default=256,
                   help=f"2 to {MAX_BATCHED_TOKENS} (a prompt's first token has no log-probability: one token scores "
                   "nothing)")
    p.add_argument("--out", default="results/bench_logprobs.json", type=writable_out)
    args = p.parse_args()
    if args.score_len > MAX_BATCHED_TOKENS:
        p.error(f"argument --score-len: {args.score_len} is over the engine's {MAX_BATCHED_TOKENS} batched tokens")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]

    from nightjar_jax import LLM

    llm = LLM(args.model, draft_model=None, weight_format=args.weight_format, max_num_seqs=max(batch_sizes),
              max_model_len=max(args.prompt_len + args.output_len, args.score_len) + 16,
              max_num_batched_tokens=MAX_BATCHED_TOKENS)
    result = run(llm, batch_sizes, args.rounds, args.prompt_len, args.output_len, args.score_len)
    print_table(result)
    write_json(args.out, {"machine": machine_note(), "args": vars(args), **result})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
