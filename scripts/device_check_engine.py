"""The engine end to end on an accelerator, in one call: AR decode throughput against the weights' floor, and the
cost of a speculative step at each γ.

Weights are random (``load_format="dummy"``, created on the device in bfloat16): timings depend on shapes, not
values, and no checkpoint has to travel to the device machine. For each ``--models`` entry it builds an AR engine
(``draft_model=None``) with ``attention_impl="auto"`` (the Pallas kernel on a GPU / TPU) and times greedy decode
at each batch size (``run_decode_workload``: decode steps only, from the engine's step log, after one untimed run
that compiles that batch's shapes; the compile run's wall time is reported too), then one more run with the
jitted forward call timed to its end (``host_share``): the call's time (dispatch + device) and the rest of a step
(the host's scheduling and bookkeeping). The floor of a batch-1 step is the
weights' bytes over the device's read bandwidth, measured here (a jitted float32 sum over ``--bandwidth-mib``).
If the engine fails with the Pallas kernel, the error is recorded and the model is run again with
``attention_impl="reference"`` (XLA), so one failure still leaves numbers.

``--spec TARGET+DRAFT``: one engine with that draft and ``num_speculative_tokens = max(--gammas)``; γ is forced
per step and the step time (draft + verify, from the step log) is reported per batch size and γ, relative to γ = 0.
Acceptance of random weights means nothing (near zero), so tokens per step are not reported as a result.

Then, on the same engine, elastic memory (``elastic`` section, unless ``--no-elastic``): the draft's weights go to
host memory and its bytes become an extension KV pool (``LLMEngine._offload_draft``, timed, with the bytes moved);
every free base page is held so that a batch-1 γ = 0 workload runs on extension pages (the attention kernel
reading the extension in place: on a GPU the Pallas body's masked loads), its step time is compared with the γ = 0
row above; then the draft comes back (timed: the engine reloads it itself once idle) and one γ = max step runs.

Then sleep mode (``sleep`` section, unless ``--no-sleep``), on the same engine: ``LLM.sleep`` at level 1 (weights to
host memory) and level 2 (weights dropped, the dummy weights built again at the wake-up), each timed with the wake-up,
the device's ``bytes_in_use`` (where the backend reports it) before, asleep and after, and a greedy batch after each
wake-up checked equal to the one before with no new compile.

``--smoke``: tiny presets on whatever backend is present (CPU here), to check the script runs.
Prints tables; writes JSON (``--out``). Sections past ``--budget-s`` are recorded as skipped.

    python scripts/device_check_engine.py --out "$OUT/device_check_engine.json"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    host_share,
    int_at_least,
    int_list,
    machine_note,
    memory_bandwidth_gbs,
    model_spec,
    name_list,
    pages_needed,
    positive_float,
    positive_int,
    run_decode_workload,
    state_bytes,
    writable_out,
    write_json,
)
from nightjar_jax.config import DTYPES, VLLM_DTYPES  # noqa: E402

# The flags --smoke sets, full run / smoke (a flag given on the command line wins over either).
DEFAULTS = {
    "models": ("smollm2-135m-instruct,llama-7b", "tiny-gqa"),
    "spec": ("llama-7b+llama-68m", "tiny-gqa+tiny-mha"),
    "batch_sizes": ("1,16,64", "1,2"),
    "spec_batch_sizes": ("1,16", "1"),
    "prompt_len": (128, 16),
    "output_len": (32, 8),
    "bandwidth_mib": (2048, 64),
    "dtype": ("bfloat16", "float32"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def default(name: str) -> str:
        full, smoke = DEFAULTS[name]
        return f"default {full!r}; with --smoke {smoke!r}"

    # (every flag checked here, before any model loads: a bad value used to fail each section, which was then
    # retried with the reference attention, and the run still exited 0)
    p.add_argument("--models", default=None, type=name_list(as_text=True), help=default("models"))
    p.add_argument("--batch-sizes", default=None, type=int_list(1, as_text=True), help=default("batch_sizes"))
    p.add_argument("--spec", default=None, help=f"TARGET+DRAFT, or '' to skip ({default('spec')})")
    p.add_argument("--spec-batch-sizes", default=None, type=int_list(1, as_text=True),
                   help=default("spec_batch_sizes"))
    p.add_argument("--gammas", default="0,1,2,4", type=int_list(0, as_text=True))
    p.add_argument("--prompt-len", type=positive_int, default=None, help=default("prompt_len"))
    p.add_argument("--output-len", type=int_at_least(2), default=None,
                   help=f">= 2: the first token comes from the prefill ({default('output_len')})")
    p.add_argument("--dtype", default=None, choices=(*DTYPES, *VLLM_DTYPES), help=default("dtype"))
    p.add_argument("--bandwidth-mib", type=positive_int, default=None, help=default("bandwidth_mib"))
    p.add_argument("--budget-s", type=positive_float, default=200.0, help="skip sections that would start after this")
    p.add_argument("--no-elastic", action="store_true", help="skip the elastic memory section")
    p.add_argument("--no-sleep", action="store_true", help="skip the sleep mode section")
    p.add_argument("--smoke", action="store_true",
                   help="tiny presets, small batches (for CPU); flags given explicitly still apply")
    p.add_argument("--out", default="results/device_check_engine.json", type=writable_out)
    args = p.parse_args(argv)
    for name, (full, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    for flag, models in (("--models", args.models.split(",")), ("--spec", args.spec.split("+") if args.spec else [])):
        for model in models:
            try:
                model_spec(model)
            except argparse.ArgumentTypeError as e:
                p.error(f"argument {flag}: {e}")
    if args.spec and (args.spec.count("+") != 1 or not all(args.spec.split("+"))):
        p.error(f"--spec {args.spec!r}: expected TARGET+DRAFT (e.g. llama-7b+llama-68m), or '' to skip")
    return args


def failed_sections(result: dict) -> list[str]:
    """The names of the sections that raised (a reference-attention rerun that passed does not undo its failure)."""
    return [s["name"] for s in result["sections"] if "error" in s]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _prompts(vocab_size: int, num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=length).tolist() for _ in range(num)]


def _llm(model: str, args, max_batch: int, gamma_max: int = 0, **kw):
    from nightjar_jax import LLM

    max_len = args.prompt_len + args.output_len + gamma_max + 8
    return LLM(model, load_format="dummy", dtype=args.dtype, max_model_len=max_len, max_num_seqs=max_batch,
               max_num_batched_tokens=max(512, args.prompt_len), page_size=16,
               num_pages=pages_needed(max_batch, args.prompt_len, args.output_len, gamma_max), **kw)


def ar_section(model: str, args, bw_gbs: float, impl: str) -> dict:
    from nightjar_jax.attention import resolve_impl

    batch_sizes = _ints(args.batch_sizes)
    t0 = time.perf_counter()
    llm = _llm(model, args, max(batch_sizes), draft_model=None, attention_impl=impl)
    build_s = time.perf_counter() - t0
    weight_bytes = state_bytes(llm.engine.runner.target.model_state())
    floor_ms = 1e3 * weight_bytes / (bw_gbs * 1e9)
    vocab = llm.engine.target.config.vocab_size
    rows = []
    for b in batch_sizes:
        prompts = _prompts(vocab, b, args.prompt_len, seed=b)
        t1 = time.perf_counter()
        run_decode_workload(llm, prompts, args.output_len)  # compiles this batch's shapes
        compile_run_s = time.perf_counter() - t1
        runs = [run_decode_workload(llm, prompts, args.output_len) for _ in range(2)]
        best = min(runs, key=lambda r: r.tpot_ms)
        host = host_share(llm, prompts, args.output_len)  # the step with the forward call timed to its end
        rows.append({"batch_size": b, "tpot_ms": best.tpot_ms, "tokens_per_s": best.tokens_per_second,
                     "floor_ratio": best.tpot_ms / floor_ms if b == 1 else None,
                     "compile_run_s": compile_run_s, "decode_steps": best.num_decode_steps,
                     "forward_call_ms": host["forward_call_ms"], "host_ms": host["host_ms"]})
        print(f"  {model} [{resolve_impl(impl)}] batch {b:3d}: TPOT {best.tpot_ms:8.3f} ms  "
              f"{best.tokens_per_second:9.1f} tok/s  (first run incl. compile {compile_run_s:.1f} s; forward call "
              f"{host['forward_call_ms']:.3f} ms, the rest of a step {host['host_ms']:.3f} ms)", flush=True)
    return {"model": model, "attention_impl": resolve_impl(impl), "build_s": build_s, "weight_bytes": weight_bytes,
            "floor_ms": floor_ms, "rows": rows}


def spec_section(target: str, draft: str, args, keep: dict | None = None) -> dict:
    gammas = _ints(args.gammas)
    batch_sizes = _ints(args.spec_batch_sizes)
    llm = _llm(target, args, max(batch_sizes), gamma_max=max(gammas), draft_model=draft,
               num_speculative_tokens=max(gammas))
    vocab = llm.engine.target.config.vocab_size
    rows = []
    for b in batch_sizes:
        prompts = _prompts(vocab, b, args.prompt_len, seed=100 + b)
        base = None
        for g in gammas:
            run_decode_workload(llm, prompts, args.output_len, gamma=g)  # compiles
            run = min((run_decode_workload(llm, prompts, args.output_len, gamma=g) for _ in range(2)),
                      key=lambda r: r.decode_seconds / max(r.num_decode_steps, 1))
            step_ms = 1e3 * run.decode_seconds / max(run.num_decode_steps, 1)
            base = step_ms if g == 0 else base
            row = {"batch_size": b, "gamma": g, "step_ms": step_ms,
                   "draft_ms": 1e3 * run.draft_seconds / max(run.num_decode_steps, 1),
                   "verify_ms": 1e3 * run.verify_seconds / max(run.num_decode_steps, 1),
                   "vs_gamma0": step_ms / base if base else None, "gamma_steps": run.gamma_steps}
            rows.append(row)
            print(f"  {target}+{draft} batch {b:3d} γ={g}: step {step_ms:8.3f} ms (draft {row['draft_ms']:.3f}, "
                  f"verify {row['verify_ms']:.3f}) = {row['vs_gamma0'] or 1:.2f}x γ=0", flush=True)
    if keep is not None:
        keep["llm"] = llm
    return {"target": target, "draft": draft, "rows": rows}


def elastic_section(llm, args) -> dict:
    """The draft's moves and a decode on extension pages, on the spec section's engine (module doc)."""
    from nightjar_jax.memory import ElasticPolicy

    engine = llm.engine
    runner, alloc = engine.runner, engine.allocator
    gamma_max = engine.gamma_max
    engine.memory = ElasticPolicy(persist_steps=1_000_000)  # moves by hand below, and the idle reload
    draft_bytes = runner.draft_device_bytes()
    t0 = time.perf_counter()
    engine._offload_draft()
    offload_s = time.perf_counter() - t0
    ext_pages = alloc.num_extension
    out = {"draft_bytes": draft_bytes, "offload_s": offload_s, "offload_gbs": draft_bytes / offload_s / 1e9,
           "extension_pages": ext_pages, "base_pages": alloc.num_pages - 1}
    print(f"  offload: {draft_bytes / 2**20:.1f} MiB of draft in {1e3 * offload_s:.1f} ms "
          f"({out['offload_gbs']:.1f} GB/s) -> {ext_pages} extension pages beside {out['base_pages']}", flush=True)
    # the base pool's free pages held, so the workload's go to the extension (cached pages forgotten first: the
    # allocator hands out a cached base page only after the extension's free pages)
    engine.reset_prefix_cache()
    held = alloc.allocate(alloc.num_free - ext_pages)
    prompts = _prompts(engine.target.config.vocab_size, 1, args.prompt_len, seed=7)
    need = -(-(args.prompt_len + args.output_len + gamma_max + 2) // runner.page_size)
    if need > ext_pages:
        alloc.free(held)
        engine._reload_draft()
        return {**out, "skipped_decode": f"a batch-1 request needs {need} pages, the extension has {ext_pages}"}
    runs = []
    for attempt in range(2):  # the first run compiles the extended layout's variants; the second is timed
        if attempt:
            engine._offload_draft()
            engine.reset_prefix_cache()
            held = alloc.allocate(alloc.num_free - alloc.num_extension)
        reloads, seconds = engine.stats.num_draft_reloads, engine.stats.offload_seconds
        runs.append(run_decode_workload(llm, prompts, args.output_len, gamma=0))
        alloc.free(held)  # (the engine reloaded the draft when it went idle: nothing was left to migrate)
        if engine.draft_offloaded or engine.stats.num_draft_reloads != reloads + 1:
            raise RuntimeError("the engine did not bring the draft back when it went idle")
    ext_run = runs[-1]
    out.update(reload_s=engine.stats.offload_seconds - seconds,
               ext_step_ms=1e3 * ext_run.decode_seconds / max(ext_run.num_decode_steps, 1),
               ext_gamma_steps=ext_run.gamma_steps)
    spec = run_decode_workload(llm, prompts, args.output_len, gamma=gamma_max)  # speculation resumes
    out.update(spec_after_reload_gamma_steps=spec.gamma_steps,
               spec_after_reload_step_ms=1e3 * spec.decode_seconds / max(spec.num_decode_steps, 1))
    engine.memory = None
    print(f"  decode on extension pages: {out['ext_step_ms']:.3f} ms a step (γ steps {ext_run.gamma_steps}); reload "
          f"{1e3 * out['reload_s']:.1f} ms; then γ={gamma_max}: {out['spec_after_reload_step_ms']:.3f} ms a step "
          f"({spec.gamma_steps})", flush=True)
    return out


def _bytes_in_use() -> int | None:
    """The default device's allocated bytes, where the backend reports them (GPU / TPU; None on the CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def sleep_section(llm, args) -> dict:
    """Sleep mode's moves on the spec section's engine (module doc)."""
    from nightjar_jax import SamplingParams

    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in _prompts(engine.target.config.vocab_size, 2, args.prompt_len, 11)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    compiled = engine.runner.num_compiled()
    out: dict = {"engine_bytes": sum(engine.runner.device_bytes().values())}
    for level in (1, 2):
        before = _bytes_in_use()
        t0 = time.perf_counter()
        freed = llm.sleep(level)
        sleep_s = time.perf_counter() - t0
        asleep = _bytes_in_use()
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0
        after = _bytes_in_use()
        same = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == reference
        row = {"freed_bytes": freed, "sleep_s": sleep_s, "wake_s": wake_s, "bytes_in_use_before": before,
               "bytes_in_use_asleep": asleep, "bytes_in_use_after": after, "outputs_equal": same,
               "new_compiles": engine.runner.num_compiled() - compiled}
        out[f"level{level}"] = row
        released = "" if before is None else f", bytes in use {before / 2**20:.0f} -> {asleep / 2**20:.0f} MiB"
        print(f"  level {level}: {freed / 2**20:.1f} MiB freed in {1e3 * sleep_s:.1f} ms{released}; wake-up "
              f"{1e3 * wake_s:.1f} ms; outputs {'equal' if same else 'DIFFER'}, {row['new_compiles']} new compiles",
              flush=True)
        if not same:
            raise RuntimeError(f"greedy outputs after a level-{level} sleep differ from those before")
    return out


def main() -> None:
    args = parse_args()
    import jax

    started = time.perf_counter()
    result: dict = {"args": vars(args), "machine": machine_note(), "devices": [str(d) for d in jax.devices()],
                    "sections": []}
    print(f"backend {jax.default_backend()}: {jax.devices()}", flush=True)
    bw = memory_bandwidth_gbs(args.bandwidth_mib << 20)
    result["bandwidth"] = bw
    print(f"device read bandwidth (jitted float32 sum over {args.bandwidth_mib} MiB): best {bw['jax_gbs']:.0f} GB/s, "
          f"median {bw['jax_median_gbs']:.0f} GB/s", flush=True)

    def run(name: str, fn) -> dict | None:
        if time.perf_counter() - started > args.budget_s:
            result["sections"].append({"name": name, "skipped": f"time budget {args.budget_s:.0f}s spent"})
            print(f"{name}: skipped (budget)", flush=True)
            return None
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        try:
            out = {"name": name, **fn(), "seconds": time.perf_counter() - t0}
        except Exception as e:  # one failure must not cost the other sections' numbers
            out = {"name": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                   "seconds": time.perf_counter() - t0}
            print(f"  FAILED: {out['error']}\n{out['traceback']}", flush=True)
        result["sections"].append(out)
        write_json(args.out, result)  # after every section: a killed run keeps what it measured
        return out

    for model in args.models.split(","):
        out = run(f"ar {model}", lambda m=model: ar_section(m, args, bw["jax_gbs"], "auto"))
        if out is not None and "error" in out:
            run(f"ar {model} (reference attention)", lambda m=model: ar_section(m, args, bw["jax_gbs"], "reference"))
    if args.spec:
        target, draft = args.spec.split("+")
        kept: dict = {}
        out = run(f"spec {args.spec}", lambda: spec_section(target, draft, args, keep=kept))
        if not args.no_elastic and out is not None and "llm" in kept:
            run(f"elastic {args.spec}", lambda: elastic_section(kept["llm"], args))
        if not args.no_sleep and out is not None and "llm" in kept:
            run(f"sleep {args.spec}", lambda: sleep_section(kept["llm"], args))
    result["total_s"] = time.perf_counter() - started
    write_json(args.out, result)
    print(json.dumps({"sections": [(s["name"], "error" in s, "skipped" in s) for s in result["sections"]]}))
    failed = failed_sections(result)
    if failed:
        print(f"FAILED sections: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
