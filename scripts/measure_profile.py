"""Measure a cost profile with the real engine, for the planner simulator (issue 6).

Writes a ``nightjar-jax/cost-profile/v1`` JSON (``kind: "measured"``, see ``nightjar_jax/sim/profile.py``) that
``scripts/sim_planners.py --profile`` replays workloads against. One ``LLM`` is built with
``num_speculative_tokens = γ_max``; γ is forced per step (``engine._select_gamma``, through
``nightjar_jax.bench.common.run_decode_workload``), so every grid cell reuses that engine's compiled variants.

What is measured, and how:

- step_seconds[b][γ][c]: median wall seconds of the decode steps that ran at the full batch ``b`` (the engine's
  ``step_log``: schedule → device → output bookkeeping), minus the draft catch-up paid inside the step, over
  ``--repeats`` timed runs of ``b`` prompts of exactly ``p`` tokens generating ``--output-len`` tokens each
  (greedy, ``ignore_eos``). The context axis is ``p + output_len // 2`` (the mean context of those steps). Before
  timing, each (p, b, γ) workload is run once untimed: that compiles every variant it meets (the batch bucket, the
  smaller buckets it shrinks into as sequences finish at different steps, prefill and catch-up shapes); only what
  is met compiles. The default grid took 941 s on 2 shared CPU cores at load average 3-6 (the JAX compilation
  cache held entries from earlier runs); ``--repeats 1``, fewer ``--batch-sizes`` or shorter ``--prompt-lens`` cut it.
- acceptance_per_position: conditional α_i = P(accept i | accepted 1..i-1), from the engine's
  ``accepted_per_position / drafted_per_position`` counters over the γ = γ_max runs (P(k > i) ratios).
- catchup_seconds: least squares of (catch-up seconds, catch-up tokens) of the first step of every timed γ > 0
  run (the draft's prefill of the prompts it has not seen: b·(p - 2) tokens).
- prefill_seconds: least squares of (step seconds, prompt tokens) over prefill steps of single prompts and of
  batches at several lengths.

    python scripts/measure_profile.py --out nightjar_jax/sim/profiles/measured_stories260k_cpu.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    DEFAULT_DATASET,
    dataset_texts,
    draft_gap,
    draft_model,
    int_at_least,
    int_list,
    machine_note,
    make_prompt_ids,
    model_spec,
    pages_needed,
    positive_int,
    run_decode_workload,
    writable_out,
)
from nightjar_jax.config import DTYPES, VLLM_DTYPES  # noqa: E402
from nightjar_jax.sim.profile import CostProfile  # noqa: E402

MIN_PROMPT_LEN = 2  # a one-token prompt takes no prefill step to time (seen: "prefill: nan ms (0 steps)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stories260k", type=model_spec)
    p.add_argument("--draft", default="stories260k@skip=2", type=draft_model,
                   help="the draft model whose cost and acceptance are measured ('auto': the target's paired draft)")
    # (the profile's axes must be strictly increasing: checked here, not after the minutes of measuring)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", type=int_list(1, increasing=True, as_text=True),
                   help="strictly increasing batch sizes")
    # (0 wrote NaN acceptance rates into the JSON: there is no speculation to measure)
    p.add_argument("--gamma-max", type=positive_int, default=4,
                   help="largest γ measured (>= 1: the profile holds speculative steps and the draft's acceptance)")
    p.add_argument("--prompt-lens", default="64,384", type=int_list(MIN_PROMPT_LEN, increasing=True, as_text=True),
                   help=f"strictly increasing prompt lengths >= {MIN_PROMPT_LEN} (context axis = p + output_len//2)")
    p.add_argument("--output-len", type=int_at_least(2), default=24,
                   help="tokens generated per sequence in a timed run (>= 2: the first comes from the prefill)")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="timed runs per cell (median over their full-batch steps)")
    p.add_argument("--max-model-len", type=positive_int, default=512)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    p.add_argument("--dtype", default="float32", choices=(*DTYPES, *VLLM_DTYPES))
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="JSONL with 'turns' (the default, where absent: "
                   "synthetic ids)")
    p.add_argument("--kv-budget-pages", type=positive_int, default=None,
                   help="simulator KV budget written to the profile (default: max batch × 1024 tokens of pages)")
    p.add_argument("--device-note", default=None, help="device description (default: JAX backend + platform)")
    p.add_argument("--out", default="nightjar_jax/sim/profiles/measured_profile.json", type=writable_out)
    args = p.parse_args(argv)
    gap = draft_gap(args.draft, args.model)
    if gap:  # ("auto" for a target without a pair: an IndexError after the models loaded)
        p.error(f"argument --draft: {gap}: the profile measures a draft model's cost and acceptance")
    longest = max(int(n) for n in args.prompt_lens.split(",")) + args.output_len + args.gamma_max + 2
    if longest > args.max_model_len:  # (was a bare SystemExit after JAX had loaded)
        p.error(f"argument --max-model-len: {args.max_model_len} is too short: the longest prompt + --output-len + "
                f"--gamma-max + 2 = {longest} tokens must fit (raise it, or shorten --prompt-lens)")
    return args


def default_kv_budget_pages(max_batch: int, page_size: int, gamma_max: int) -> int:
    """The simulator's KV budget: max batch x 1024 tokens of pages, and never less than the longest request its
    default workloads draw (else every sim_planners run of the profile fails: "a request of N tokens can never fit")."""
    from nightjar_jax.sim.workload import DEFAULT_OUTPUT_LENGTHS, DEFAULT_PROMPT_LENGTHS

    longest = DEFAULT_PROMPT_LENGTHS.maximum + DEFAULT_OUTPUT_LENGTHS.maximum + gamma_max + 1
    return max(max_batch * (1024 // page_size), -(-longest // page_size))


def least_squares(tokens: list[float], seconds: list[float]) -> tuple[float, float]:
    """(fixed, per_token) of seconds ≈ fixed + per_token · tokens, both clamped to >= 0 (ValueError on no sample:
    there is nothing to fit, and a NaN must not reach the profile)."""
    if not tokens:
        raise ValueError("no sample to fit")
    x, y = np.asarray(tokens, float), np.asarray(seconds, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(max(np.median(y), 0.0)), 0.0
    per_token, fixed = np.polyfit(x, y, 1)
    if fixed < 0:  # refit through the origin
        return 0.0, float(max((x @ y) / (x @ x), 0.0))
    return float(fixed), float(max(per_token, 0.0))


def measure_prefill(llm, prompts_by_len: dict[int, list[list[int]]], max_batch: int) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of every prefill step of a few generate(max_tokens=1) calls (untimed run first)."""
    from nightjar_jax import SamplingParams

    engine = llm.engine
    runner = engine.runner
    samples: list[tuple[int, float]] = []
    inner = runner.execute_prefill
    step_tokens: list[int] = []

    def counting(batch):
        step_tokens.append(int(sum(batch.num_new_tokens)))
        return inner(batch)

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine._select_gamma = lambda: 0
    runner.execute_prefill = counting
    try:
        for prompts in prompts_by_len.values():
            for count in (1, 4, min(16, max_batch)):
                reqs = [{"prompt_token_ids": p} for p in prompts[:count]]
                for timed in (False, True):
                    for r in reqs:
                        engine.add_request(r, sp)
                    while engine.has_unfinished_requests():
                        step_tokens.clear()
                        t0 = time.perf_counter()
                        engine.step()
                        dt = time.perf_counter() - t0
                        if timed and step_tokens:
                            samples.append((step_tokens[0], dt))
    finally:
        runner.execute_prefill = inner
    return samples


def acceptance_from_counts(accepted: list[int], drafted: list[int]) -> list[float]:
    """Conditional α_i from counts of 'draft i accepted' (implies 1..i-1 accepted) over drafts made at i."""
    survive = [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)]
    alphas, prev = [], 1.0
    for s in survive:
        alphas.append(min(1.0, s / prev) if prev > 0 else 0.0)
        prev = s
    return alphas


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    from nightjar_jax import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompt_lens = [int(p) for p in args.prompt_lens.split(",")]
    gammas = list(range(args.gamma_max + 1))
    max_batch = max(batch_sizes)
    texts = dataset_texts(args.dataset, default=DEFAULT_DATASET, fallback=())  # (before the model loads)
    meta = machine_note()
    started = time.perf_counter()
    print(f"# {meta['date']}  cpus={meta['cpu_count']}  load={meta['loadavg_at_start']}", flush=True)

    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max_batch,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_pages=pages_needed(max_batch, max(prompt_lens), args.output_len, args.gamma_max),
              dtype=args.dtype, draft_model=args.draft, num_speculative_tokens=args.gamma_max)
    engine = llm.engine
    vocab = engine.target.config.vocab_size
    prompts = {p: make_prompt_ids(llm.get_tokenizer(), texts, max_batch, p, vocab)[0] for p in prompt_lens}
    source = make_prompt_ids(llm.get_tokenizer(), texts, 1, 8, vocab)[1]
    # ---- decode step grid ------------------------------------------------------------------------------------------
    grid = np.zeros((len(batch_sizes), len(gammas), len(prompt_lens)))
    catchup_samples: list[tuple[int, float]] = []
    acc_counts = [0] * args.gamma_max
    drafted_counts = [0] * args.gamma_max
    for ic, plen in enumerate(prompt_lens):
        for ib, b in enumerate(batch_sizes):
            for ig, gamma in enumerate(gammas):
                # Untimed warm-up of the same workload: compiles every variant it meets (the full batch's bucket,
                # the smaller buckets it shrinks into as sequences finish, prefill and catch-up shapes).
                run_decode_workload(llm, prompts[plen][:b], args.output_len, gamma)
                seconds: list[float] = []
                for _ in range(args.repeats):
                    tokens_before = engine.stats.num_catchup_tokens
                    accepted0 = list(engine.stats.accepted_per_position)
                    drafted0 = list(engine.stats.drafted_per_position)
                    engine.stats.step_log = log = KeptStepLog()
                    run = run_decode_workload(llm, prompts[plen][:b], args.output_len, gamma)
                    seconds += [s["seconds"] - s["catchup_seconds"] for s in log.kept if s["batch_size"] == b]
                    if gamma > 0 and run.catchup_seconds > 0:
                        catchup_samples.append((engine.stats.num_catchup_tokens - tokens_before,
                                                run.catchup_seconds))
                    if gamma == args.gamma_max:
                        for i in range(args.gamma_max):
                            acc_counts[i] += engine.stats.accepted_per_position[i] - accepted0[i]
                            drafted_counts[i] += engine.stats.drafted_per_position[i] - drafted0[i]
                grid[ib, ig, ic] = statistics.median(seconds)
            row = " ".join(f"γ{g}={1e3 * grid[ib, g, ic]:7.2f}ms" for g in gammas)
            print(f"p={plen:4d} b={b:3d}: {row}  load={os.getloadavg()[0]:.1f}  "
                  f"[{time.perf_counter() - started:.0f}s]", flush=True)

    # ---- prefill ---------------------------------------------------------------------------------------------------
    prefill = measure_prefill(llm, {p: prompts[p] for p in prompt_lens}, max_batch)
    if not prefill or not catchup_samples:
        raise SystemExit(f"no {'prefill step' if not prefill else 'draft catch-up'} was measured at prompt lengths "
                         f"{prompt_lens}: the profile would hold NaN; use longer --prompt-lens")
    prefill_fixed, prefill_per_token = least_squares([t for t, _ in prefill], [s for _, s in prefill])
    catch_fixed, catch_per_token = least_squares([t for t, _ in catchup_samples], [s for _, s in catchup_samples])
    alphas = acceptance_from_counts(acc_counts, drafted_counts)
    print(f"prefill: {1e3 * prefill_fixed:.2f} ms + {1e6 * prefill_per_token:.2f} µs/token ({len(prefill)} steps); "
          f"catch-up: {1e3 * catch_fixed:.2f} ms + {1e6 * catch_per_token:.2f} µs/token "
          f"({len(catchup_samples)} runs); α = {[round(a, 3) for a in alphas]}", flush=True)

    load_end = os.getloadavg()
    device = args.device_note or f"{meta['jax_backend']} ({meta['platform']}, {meta['cpu_count']} cpus)"
    contexts = [p + args.output_len // 2 for p in prompt_lens]
    profile = CostProfile(
        batch_sizes=tuple(batch_sizes), gammas=tuple(gammas), context_lengths=tuple(contexts),
        step_seconds_grid=tuple(tuple(tuple(float(x) for x in grid[ib, ig]) for ig in range(len(gammas)))
                                for ib in range(len(batch_sizes))),
        acceptance_per_position=tuple(alphas),
        prefill_fixed_seconds=prefill_fixed, prefill_seconds_per_token=prefill_per_token,
        catchup_fixed_seconds=catch_fixed, catchup_seconds_per_token=catch_per_token,
        reload_seconds=0.0,
        kv_budget_pages=args.kv_budget_pages or default_kv_budget_pages(max_batch, engine.config.cache.page_size,
                                                                        args.gamma_max),
        page_size=engine.config.cache.page_size, max_num_seqs=max_batch, kind="measured",
        label=f"MEASURED by the engine: {args.model} target + {args.draft} draft, {args.dtype}, {device}",
        notes=(
            f"scripts/measure_profile.py on {meta['date']}; machine {meta['platform']}, {meta['cpu_count']} cpus "
            f"(shared), jax {meta['jax']} backend {meta['jax_backend']}; load average at start "
            f"{tuple(round(x, 2) for x in meta['loadavg_at_start'])}, at end {tuple(round(x, 2) for x in load_end)}. "
            f"Step seconds: median full-batch decode step (catch-up excluded) over {args.repeats} timed greedy runs "
            f"of b prompts x {args.output_len} output tokens ({source} prompts of {prompt_lens} tokens; context "
            f"axis = prompt + {args.output_len // 2}), each (prompt, batch, gamma) workload run once untimed "
            f"first (compiles what it meets). Acceptance: engine counters over the gamma={args.gamma_max} runs. "
            f"Prefill and catch-up: least squares over {len(prefill)} prefill steps / {len(catchup_samples)} "
            f"first-speculative-step catch-ups. "
            f"reload_seconds 0 (draft always on device). kv_budget_pages is a simulator default (max batch x 1024 "
            f"tokens), not a device limit. Measured in {time.perf_counter() - started:.0f} s."
        ),
        device=device, target=args.model, draft=args.draft,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    profile.save(args.out)
    CostProfile.from_json(args.out)  # round-trip check
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f}s", flush=True)


class KeptStepLog(list):
    """A step log whose ``clear()`` keeps what it held in ``kept``: ``run_decode_workload`` sums the engine's
    step log and clears it; the per-step seconds (for medians) are read from here afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[dict] = []

    def clear(self) -> None:
        self.kept.extend(self)
        super().clear()


if __name__ == "__main__":
    main()
