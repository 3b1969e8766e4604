"""Elastic memory under a burst: the same requests served with ``--draft-offload off`` and ``auto`` on a KV budget
too small for the burst, one engine per mode in one run (greedy: their outputs must be identical, and are checked).

With ``auto`` the engine moves the draft's weights to host memory once requests wait for pages, turns the device
bytes the draft held into extension KV pages (more requests run at once; speculation pauses), and brings the draft
back when the queue has drained. Per mode: wall seconds, output tokens/s and its ratio to ``off`` (from the same
round; also over the steps that compiled nothing, since the planner's exploration meets new variants late),
preemptions, the most requests running at once, the mean decode batch, decode steps at γ > 0, the moves (offloads,
reloads, extension pages, pages migrated, seconds spent moving) and the device bytes at the start and at the peak.
Each mode runs ``--rounds`` bursts after ``--warmup-rounds`` (which compile the variants, the extended layout's
included); the modes alternate round by round so they share this shared machine's minutes.

    python scripts/bench_elastic.py --out results/bench_elastic.json
    python scripts/bench_elastic.py --warmup --out results/bench_elastic_warm.json   # decode variants compiled first
    python scripts/bench_elastic.py --model stories260k --draft stories260k@skip=2 --num-prompts 8 --max-tokens 24 \\
        --prompt-len 32 --kv-cache-bytes 160KiB --warmup-rounds 1 --rounds 1 --out /tmp/elastic.json   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    DEFAULT_DATASET,
    dataset_texts,
    draft_gap,
    draft_model,
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
from nightjar_jax.cli import parse_bytes  # noqa: E402

MODES = ("off", "auto")


def median_of(values: list) -> float | None:
    """The median of the figures that were measured (None: a round with no step that compiled nothing); None when
    no round measured one."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def burst(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt at once and step until idle; what the step loop saw."""
    from nightjar_jax import SamplingParams

    engine = llm.engine
    s = engine.stats
    before = dict(preemptions=s.num_preemptions, offloads=s.num_draft_offloads, reloads=s.num_draft_reloads,
                  migrated=s.num_migrated_pages, move_seconds=s.offload_seconds,
                  spec_steps=sum(n for g, n in s.decode_steps_per_gamma.items() if g > 0))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start_bytes = sum(engine.runner.device_bytes().values())
    compiled = engine.runner.num_compiled()
    t0 = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    done: dict[str, list[int]] = {}
    most_running, batch_sizes, peak_bytes, most_extension = 0, [], start_bytes, 0
    steady_tokens, steady_seconds = 0, 0.0  # over the steps that compiled nothing
    while engine.has_unfinished_requests():
        decode_steps, generated, before_step = s.num_decode_steps, s.num_generated_tokens, engine.runner.num_compiled()
        t_step = time.perf_counter()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if engine.runner.num_compiled() == before_step:
            steady_seconds += time.perf_counter() - t_step
            steady_tokens += s.num_generated_tokens - generated
        most_running = max(most_running, len(engine.scheduler.running))
        if s.num_decode_steps > decode_steps:
            batch_sizes.append(s.last_batch_size)
        peak_bytes = max(peak_bytes, sum(engine.runner.device_bytes().values()))
        most_extension = max(most_extension, engine.allocator.num_extension)
    seconds = time.perf_counter() - t0
    if engine.num_free_pages != engine.num_total_pages:
        raise RuntimeError("KV pages leaked")
    tokens = sum(len(done[i]) for i in ids)
    return {
        "seconds": seconds, "output_tokens": tokens, "tokens_per_second": tokens / seconds,
        "steady_tokens_per_second": ratio(steady_tokens, steady_seconds),  # (None: every step compiled)
        "preemptions": s.num_preemptions - before["preemptions"], "most_running": most_running,
        "mean_decode_batch": statistics.fmean(batch_sizes) if batch_sizes else 0.0,
        "spec_decode_steps": sum(n for g, n in s.decode_steps_per_gamma.items() if g > 0) - before["spec_steps"],
        "decode_steps": len(batch_sizes),
        "offloads": s.num_draft_offloads - before["offloads"], "reloads": s.num_draft_reloads - before["reloads"],
        "extension_pages": most_extension, "migrated_pages": s.num_migrated_pages - before["migrated"],
        "move_seconds": s.offload_seconds - before["move_seconds"],
        "device_bytes_start": start_bytes, "device_bytes_peak": peak_bytes,
        "compiled": engine.runner.num_compiled() - compiled,  # step variants compiled during the burst
        "outputs": [done[i] for i in ids],
    }


def positive_bytes(text: str) -> int:
    """--kv-cache-bytes: a byte count (``parse_bytes``) above 0."""
    value = parse_bytes(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a byte count > 0 (e.g. 24MiB), got {text!r}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=model_spec, default="smollm2-135m-instruct")
    ap.add_argument("--draft", type=draft_model, default="auto",
                    help="draft model spec (default: the target's paired draft); a model: its weights are what moves")
    ap.add_argument("--num-prompts", type=positive_int, default=16)
    ap.add_argument("--prompt-len", type=positive_int, default=128, help="chat prompts up to this many tokens")
    ap.add_argument("--max-tokens", type=positive_int, default=96)
    ap.add_argument("--kv-cache-bytes", type=positive_bytes, default=parse_bytes("24MiB"), help="> 0, e.g. 24MiB")
    ap.add_argument("--max-num-seqs", type=positive_int, default=16)
    ap.add_argument("--persist-steps", type=non_negative_int, default=4, help="--offload-persist-steps")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--warmup-rounds", type=non_negative_int, default=2,
                    help="bursts per mode first, not kept (they compile)")
    ap.add_argument("--warmup", action="store_true",
                    help="compile every greedy decode variant first (LLMEngine.warmup without prefill chunks: for auto "
                         "the extended layout's too)")
    ap.add_argument("--dataset", default=DEFAULT_DATASET,
                    help="JSONL with 'turns' (the default, where absent: built-in prompts)")
    ap.add_argument("--out", type=writable_out, default="results/bench_elastic.json")
    args = ap.parse_args()
    gap = draft_gap(args.draft, args.model)
    if gap:
        ap.error(f"argument --draft: {gap}; elastic memory moves a draft model's weights")
    texts = dataset_texts(args.dataset, default=DEFAULT_DATASET)  # (before the models load)

    from nightjar_jax import LLM

    common = dict(draft_model=args.draft, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.prompt_len + args.max_tokens + 16, offload_persist_steps=args.persist_steps)
    llms = {mode: LLM(args.model, draft_offload=mode, **common) for mode in MODES}
    warmup = {}
    if args.warmup:
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            # decode variants only: with prefill chunks too, two SmolLM2 engines' variants in one process pass
            # Linux's default vm.max_map_count (~250 memory maps a variant on the CPU backend; runner.maps_short)
            keys = llm.engine.warmup(sampled=False, prefill=False)
            warmup[mode] = {"seconds": time.perf_counter() - t0, "variants": len(keys)}
            print(f"warm-up {mode}: {len(keys)} variants in {warmup[mode]['seconds']:.0f} s", flush=True)
    engine = llms["off"].engine
    tok = engine.tokenizer
    chat = tok is not None and getattr(tok, "chat_template", None) is not None
    prompts, source = make_prompt_ids(tok, texts, args.num_prompts, args.prompt_len,
                                      engine.target.config.vocab_size, chat=chat)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.warmup_rounds + args.rounds):  # the first compile (the extended layout's variants too)
        for mode in MODES:
            result = burst(llms[mode], prompts, args.max_tokens)
            print(f"round {r} {mode}: {result['tokens_per_second']:.1f} tok/s (steps that compiled nothing: "
                  f"{fmt(result['steady_tokens_per_second'], '.1f')}), most running {result['most_running']}, "
                  f"offloads {result['offloads']}, variants compiled {result['compiled']}", flush=True)
            if r >= args.warmup_rounds:
                runs[mode].append(result)
    for a, b in zip(runs["off"], runs["auto"], strict=True):
        if a["outputs"] != b["outputs"]:
            raise RuntimeError("greedy outputs differ between draft_offload off and auto")
    summary = {}
    for mode in MODES:
        rs = runs[mode]
        summary[mode] = {k: median_of([x[k] for x in rs]) for k in rs[0] if k != "outputs"}
        for key in ("tokens_per_second", "steady_tokens_per_second"):
            summary[mode][key.replace("tokens_per_second", "ratio_vs_off")] = median_of(
                [ratio(x[key], o[key]) for x, o in zip(rs, runs["off"], strict=True)])
    cfg = engine.runner
    print(f"\n{args.model} + {engine.draft.config.name}, {args.num_prompts} prompts ({source}) x {args.max_tokens} "
          f"tokens, KV budget {args.kv_cache_bytes / 2**20:.2f} MiB = {cfg.num_pages - 1} pages of "
          f"{cfg.page_size} tokens; medians of {args.rounds} round(s)")
    cols = ["tokens_per_second", "ratio_vs_off", "steady_tokens_per_second", "steady_ratio_vs_off", "most_running",
            "mean_decode_batch", "preemptions",
            "spec_decode_steps", "decode_steps", "offloads", "reloads", "extension_pages", "migrated_pages",
            "move_seconds", "compiled"]
    print("| mode | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for mode in MODES:
        print(f"| {mode} | " + " | ".join(fmt(summary[mode][c], ".3g") for c in cols) + " |")
    for mode in MODES:
        print(f"{mode}: device bytes start {summary[mode]['device_bytes_start'] / 2**20:.1f} MiB, "
              f"peak {summary[mode]['device_bytes_peak'] / 2**20:.1f} MiB")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "prompt_source": source,
                          "num_pages": cfg.num_pages, "page_size": cfg.page_size, "warmup": warmup,
                          "summary": summary,
                          "runs": {m: [{k: v for k, v in x.items() if k != "outputs"} for x in runs[m]]
                                   for m in MODES}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
