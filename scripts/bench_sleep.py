"""What sleep mode (``LLM.sleep`` / ``wake_up``, vLLM's) frees and what it costs: for each level, the device bytes
freed (weights and KV cache, by part), the bytes held in host memory while asleep, the seconds to sleep and to wake,
and the first batch after the wake-up against a warm batch of the same prompts (a ratio near 1: nothing recompiled;
the compiled variants are also counted), and the process's resident memory awake and asleep (what the system gets
back: on a CPU host the freed bytes reach it through glibc's malloc_trim, ``nightjar_jax/memory/host.py``;
``--no-trim`` leaves them with the allocator, as before 2026-12-06). Greedy outputs after every wake-up must equal
those before (checked).
Prints a table and writes JSON.

    python scripts/bench_sleep.py --out results/bench_sleep.json            # SmolLM2-135M + smollm2-eagle
    python scripts/bench_sleep.py --model stories260k --draft stories260k@skip=2 --repeats 1 --out /tmp/sleep.json
    python scripts/bench_sleep.py --no-trim --out /tmp/sleep_no_trim.json   # freed heap left with the allocator
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
    int_list,
    machine_note,
    model_spec,
    positive_int,
    writable_out,
    write_json,
)

DATASET = "/work/shared/datasets/mt_bench/vicuna_bench_question.jsonl"


def host_bytes(engine) -> int:
    """Bytes of the engine's weights held in a host memory kind (level 1 keeps them there while asleep)."""
    handles = [engine.target] + ([engine.draft] if engine.draft is not None else [])
    arrays = {id(x): x for h in handles for x in h.leaves() if hasattr(x, "sharding") and not x.is_deleted()}
    return sum(x.nbytes for x in arrays.values() if x.sharding.memory_kind in ("pinned_host", "unpinned_host"))


def timed_generate(llm, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def cycle(llm, level: int, prompts, params, reference) -> dict:
    """One sleep at ``level``, the wake-up, and the first batch after it."""
    from nightjar_jax.memory.host import resident_bytes

    engine = llm.engine
    by_part = engine.runner.device_bytes()
    compiled = engine.runner.num_compiled()
    rss_awake = resident_bytes()
    t0 = time.perf_counter()
    freed = llm.sleep(level)
    sleep_s = time.perf_counter() - t0
    rss_asleep = resident_bytes()
    left = sum(engine.runner.device_bytes().values())
    held = host_bytes(engine)
    t0 = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - t0
    after_s, outputs = timed_generate(llm, prompts, params)
    if outputs != reference:
        raise SystemExit(f"outputs after a level-{level} sleep differ from those before")
    assert engine.num_free_pages == engine.num_total_pages
    return {"level": level, "freed_bytes": freed, "freed_by_part": by_part, "device_bytes_left": left,
            "host_bytes_held": held, "sleep_seconds": sleep_s, "wake_seconds": wake_s,
            "first_batch_seconds": after_s, "new_compiles": engine.runner.num_compiled() - compiled,
            "rss_awake_bytes": rss_awake, "rss_asleep_bytes": rss_asleep}


def sleep_levels(text: str) -> str:
    """--levels: a comma list of LLM.sleep levels, each 1 or 2, once (kept as text: recorded as given)."""
    levels = int_list(1)(text)
    if max(levels) > 2:
        raise argparse.ArgumentTypeError(f"expected a comma list of sleep levels 1 and 2, got {text!r}")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_spec, default="smollm2-135m-instruct")
    p.add_argument("--draft", type=draft_spec, default="auto", help="draft model (default: the target's shipped pair)")
    p.add_argument("--dataset", default=DATASET)
    p.add_argument("--num-prompts", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--levels", type=sleep_levels, default="1,2", help="sleep levels, each of 1 and 2")
    p.add_argument("--repeats", type=positive_int, default=3, help="sleep / wake cycles per level, alternating levels")
    p.add_argument("--no-trim", action="store_true",
                   help="leave the freed heap with the C allocator (NIGHTJAR_MALLOC_TRIM=0), for comparison")
    p.add_argument("--out", type=writable_out, default="results/bench_sleep.json")
    args = p.parse_args()
    if args.no_trim:
        os.environ["NIGHTJAR_MALLOC_TRIM"] = "0"
    levels = [int(x) for x in args.levels.split(",")]
    texts = dataset_texts(args.dataset, args.num_prompts, default=p.get_default("dataset"))  # (before the model loads)
    from nightjar_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    # a static γ and no prefix cache: each batch runs the same step variants (the planner's choices and cache hits
    # would change them from batch to batch, and a new variant would read as a recompile)
    llm = LLM(args.model, draft_model=args.draft, planner="static", enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    prompts = (texts * args.num_prompts)[: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    timed_generate(llm, prompts, params)  # compile
    warm_s, reference = timed_generate(llm, prompts, params)
    rows: dict[int, list[dict]] = {level: [] for level in levels}
    for _ in range(args.repeats):
        for level in levels:
            rows[level].append(cycle(llm, level, prompts, params, reference))
    warm_again, _ = timed_generate(llm, prompts, params)
    warm = statistics.median([warm_s, warm_again])

    def median(level: int, key: str) -> float:
        return statistics.median(r[key] for r in rows[level])

    def rss(level: int, key: str) -> str:
        values = [r[key] for r in rows[level] if r[key] is not None]
        return f"{statistics.median(values) / 2**20:.0f}" if values else "n/a"

    engine = llm.engine
    print(f"\n{args.model} + {engine.draft.config.name if engine.draft else 'no draft'} (loaded in {load_s:.1f} s): "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy; medians of {args.repeats} cycles; a warm batch "
          f"{warm:.2f} s\n")
    print("| level | device MiB freed | of it weights / KV MiB | host MiB held asleep | sleep s | wake s | "
          "first batch after / warm | new compiles | process RSS MiB awake / asleep | outputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for level in levels:
        part = rows[level][0]["freed_by_part"]
        weights = part["target_weights"] + part["draft_weights"]
        kv = part["target_kv"] + part["draft_pools"]
        print(f"| {level} | {median(level, 'freed_bytes') / 2**20:.1f} | {weights / 2**20:.1f} / {kv / 2**20:.1f} | "
              f"{median(level, 'host_bytes_held') / 2**20:.1f} | {median(level, 'sleep_seconds'):.2f} | "
              f"{median(level, 'wake_seconds'):.2f} | {median(level, 'first_batch_seconds') / warm:.2f} | "
              f"{max(r['new_compiles'] for r in rows[level])} | {rss(level, 'rss_awake_bytes')} / "
              f"{rss(level, 'rss_asleep_bytes')} | equal |")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "load_seconds": load_s,
                          "warm_batch_seconds": warm, "runs": {str(level): rs for level, rs in rows.items()}})


if __name__ == "__main__":
    main()
