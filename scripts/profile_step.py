"""Where a decode step's time goes: the target's jitted step traced with ``jax.profiler`` and summed per op.

Runs a real engine (default: SmolLM2, batch 1, plain decoding), captures the arguments of one decode step
(``forward_sample``; ``--verify`` the γ-token verify instead, with the default draft), replays that step ``--steps``
times inside ``jax.profiler.trace(..., create_perfetto_trace=True)`` and sums each op's time over the XLA thunks of
the step's module, custom calls named by their target (``nightjar_paged_attention_f32``, ...) through the compiled
HLO. Prints a table (ms per step, calls per step) and writes JSON. Timings are the profiler's: each op a little slower
than untraced, the shares are what to read. The same step is also timed untraced first (``--steps`` calls, median):
its wall time against the ops' sum shows what runs between the ops, and the time until the call returned is the
host's dispatch (arguments parsed and handed over, ~1 ms at batch 1 for SmolLM2's 273 weight and 60 KV leaves).
``--weight-format`` as the engine's (``w4a8``: int8 activations).

``--compare-spin-us 0,30`` also times the untraced step under each spin of the CPU kernels' helper threads
(``kernels_pallas/cpu_parallel.h``; 0: XLA's pool wakes a helper per call, and packed products at 1-8 rows take
small panel groups instead of one wide item per thread), interleaved in blocks of 15 calls so the
machine's drift falls on every setting alike, and prints each median against the first's.

    python scripts/profile_step.py                       # batch 1 decode step of SmolLM2
    python scripts/profile_step.py --batch-size 4 --verify --out results/profile_verify_b4.json
    python scripts/profile_step.py --compare-spin-us 0,30 --rounds 12
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nightjar_jax.bench.common import (  # noqa: E402
    context_error,
    draft_gap,
    int_list,
    make_parent,
    model_spec,
    positive_int,
    writable_out,
)
from nightjar_jax.config import KV_CACHE_DTYPES, WEIGHT_FORMATS  # noqa: E402

CUSTOM_CALL = re.compile(r"%(\S+) = .*? custom-call\(.*?custom_call_target=\"([^\"]+)\"")


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """``{instruction name: custom-call target}`` of an optimized HLO module's text."""
    return {m.group(1): m.group(2) for m in CUSTOM_CALL.finditer(hlo_text)}


def op_table(trace_events: list[dict], module: str, targets: dict[str, str], steps: int) -> list[dict]:
    """Per op of ``module``'s thunks: ms and calls per step (custom calls by target, other ops by name without
    their numeric suffix: ``wrapped_scatter.3`` -> ``wrapped_scatter``), largest first."""
    total, calls = collections.defaultdict(float), collections.Counter()
    for e in trace_events:
        if e.get("ph") != "X" or e.get("args", {}).get("hlo_module") != module:
            continue
        if e["name"] == "ThunkExecutor::Execute":
            continue
        key = targets.get(e["name"], re.sub(r"\.\d+$", "", e["name"]))
        total[key] += e["dur"]  # microseconds
        calls[key] += 1
    rows = [{"op": k, "ms_per_step": v / steps / 1e3, "calls_per_step": calls[k] / steps} for k, v in total.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def compare_spins(replay, spins: list[int], rounds: int, block: int = 15) -> list[dict]:
    """Times ``replay()`` (a jitted step, blocking) under each helper-thread spin, interleaved: every round runs
    ``block`` calls per setting (after 3 unrecorded). Prints and returns per-setting medians against the first's."""
    import jax

    from kernels_pallas import cpu_build

    before = cpu_build.spin_us()
    if before is None:
        print("no CPU kernel library is loaded: nothing to compare")
        return []
    walls: dict[int, list[float]] = {v: [] for v in spins}
    try:
        for _ in range(rounds):
            for v in spins:
                cpu_build.spin_us(v)
                for _ in range(3):
                    jax.block_until_ready(replay())
                for _ in range(block):
                    t0 = time.perf_counter()
                    jax.block_until_ready(replay())
                    walls[v].append(1e3 * (time.perf_counter() - t0))
    finally:
        cpu_build.spin_us(before)
    base = float(np.median(walls[spins[0]]))
    rows = [{"spin_us": v, "median_ms": float(np.median(w)), "p10_ms": float(np.percentile(w, 10)),
             "ratio": float(np.median(w)) / base, "calls": len(w)} for v, w in walls.items()]
    print(f"| helper spin (us) | median ms | p10 ms | x spin {spins[0]} |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['spin_us']} | {r['median_ms']:.3f} | {r['p10_ms']:.3f} | {r['ratio']:.3f} |")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", type=model_spec)
    ap.add_argument("--batch-size", type=positive_int, default=1)
    ap.add_argument("--prompt-len", type=positive_int, default=200, help="tokens of context before the traced step")
    ap.add_argument("--verify", action="store_true", help="trace the verify step at --gamma instead of plain decode")
    ap.add_argument("--gamma", type=positive_int, default=4)
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                    help="the engine's CPU kernel weights (EngineConfig.weight_format)")
    ap.add_argument("--compare-spin-us", default="", type=int_list(0, allow_empty=True),
                    help="comma-separated helper-thread spins (microseconds) to time the step under, interleaved")
    ap.add_argument("--rounds", type=positive_int, default=8, help="--compare-spin-us: rounds of 15 calls per setting")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the K/V pools' dtype (auto: the model's, or bfloat16)")
    ap.add_argument("--out", default="results/profile_step.json", type=writable_out)
    args = ap.parse_args(argv)
    too_long = context_error(args.model, args.prompt_len + 64, "--prompt-len + the 64 tokens decoded past it")
    if too_long:
        ap.error(f"argument --prompt-len: {too_long}")
    if args.verify and draft_gap("auto", args.model):  # (else the engine's ValueError on static:γ, γ_max 0)
        ap.error(f"argument --verify: it needs a draft, and {args.model} has no default draft installed")
    return args


def main() -> None:
    args = parse_args()
    spins = args.compare_spin_us

    import jax

    from nightjar_jax import LLM, SamplingParams

    name = "_verify" if args.verify else "_forward_sample"
    llm = LLM(args.model, draft_model="auto" if args.verify else None, num_speculative_tokens=args.gamma,
              planner=f"static:{args.gamma}" if args.verify else "static", max_num_seqs=args.batch_size,
              max_model_len=args.prompt_len + 64, max_num_batched_tokens=max(512, args.prompt_len),
              weight_format=args.weight_format, kv_cache_dtype=args.kv_cache_dtype,
              # (lookup off for a verify; without a draft the option has no effect, and said so in a warning)
              **({"prompt_lookup_max": 0} if args.verify else {}))
    runner = llm.engine.runner
    step_fn, captured = getattr(runner, name), []

    def capture(*a):
        captured.append(a)
        return step_fn(*a)

    setattr(runner, name, capture)
    # (ids within the vocabulary: 100..1099 were out of range for stories260K's 512 tokens)
    vocab = llm.engine.target.config.vocab_size
    span = max(1, min(1000, vocab - 100))
    prompts = [[(7 * i + 13 * j) % span + min(100, vocab - span) for j in range(args.prompt_len)]
               for i in range(args.batch_size)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    setattr(runner, name, step_fn)
    if not captured:
        raise SystemExit(f"no {name.strip('_')} step ran")
    a = captured[-1]

    def replay():
        # the donated pools are the runner's current ones; every other argument as captured
        if args.verify:
            out, _, runner.kv, runner.features, _ = step_fn(a[0], runner.kv, runner.features, *a[3:])
        else:
            out, runner.kv, runner.features, _ = step_fn(a[0], runner.kv, runner.features, *a[3:])
        return out

    jax.block_until_ready(replay())
    walls, dispatches = [], []
    for _ in range(args.steps):  # untraced: the step's wall time, ops and the gaps between them
        t0 = time.perf_counter()
        out = replay()
        dispatches.append(1e3 * (time.perf_counter() - t0))  # the host's share: the call returns before the step ends
        jax.block_until_ready(out)
        walls.append(1e3 * (time.perf_counter() - t0))
    spin_rows = compare_spins(replay, spins, args.rounds) if spins else []
    hlo = step_fn.lower(a[0], runner.kv, runner.features, *a[3:]).compile().as_text()
    module = "jit_" + ("verify" if args.verify else "forward_sample")
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(args.steps):
                jax.block_until_ready(replay())
        path = glob.glob(os.path.join(tmp, "plugins", "profile", "*", "perfetto_trace.json.gz"))
        if not path:
            raise SystemExit("the profiler wrote no perfetto trace")
        with gzip.open(path[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    rows = op_table(events, module, custom_call_targets(hlo), args.steps)
    total = sum(r["ms_per_step"] for r in rows)
    wall = float(np.median(walls))
    outside = (f"{wall - total:.3f} ms outside the ops" if wall >= total else
               f"the ops took {total - wall:.3f} ms more traced than the whole call untraced (the profiler's own "
               "cost: nothing measurable outside them)")
    print(f"{module}, batch {args.batch_size}, {args.steps} traced steps: {total:.3f} ms per step in ops; untraced "
          f"the call took {wall:.3f} ms (median of {args.steps}): {outside}; "
          f"{float(np.median(dispatches)):.3f} ms of it dispatching the call (until it returned)")
    print("| op | ms per step | share | calls per step |\n|---|---:|---:|---:|")
    for r in rows[:20]:
        print(f"| {r['op']} | {r['ms_per_step']:.3f} | {r['ms_per_step'] / total:.1%} | {r['calls_per_step']:.0f} |")
    with open(make_parent(args.out), "w") as f:
        json.dump({"module": module, "batch_size": args.batch_size, "steps": args.steps, "rows": rows,
                   "ops_ms_per_step": total, "wall_ms": walls, "wall_ms_median": wall,
                   "dispatch_ms": dispatches, "dispatch_ms_median": float(np.median(dispatches)),
                   "spins": spin_rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
