"""Run every planner on dynamic traces in the simulator and print a comparison table (issue 6).

    python scripts/sim_planners.py --out results.json

Planners: ar, static:1..γmax, banditspec, dsd, table, nightjar (cold start), nightjar+warm (its state after
one run on a different-seed trace of the same preset, loaded through to_json/from_json: "the second day"),
and two hindsight references built from the static runs (oracle:phase, oracle:phase×bucket: per phase / per
phase × batch bucket, the static γ with the most decode tokens per sequence-second). They are references, not
upper bounds: they are scored by tok/busy-s (prefill included) on their own trajectory, so a static row can beat
them (the script then prints a note). `--nightjar-variant NAME=JSON` adds rows NAME and NAME+warm: nightjar with
those options (e.g. an ablation or the behaviour before a change, to compare both in one run); NAME is letters,
digits, '_', '-', '.', not a planner's name nor 'oracle', and each variant needs its own. `--seeds 0,1,2`
repeats everything per seed: full tables for the first seed, then a summary over seeds (mean, min and max of
"vs best static" / "vs oracle").
Metrics: tok/s = output tokens / (first arrival .. last finish), which is arrival-limited (nearly equal for all
planners) whenever the system keeps up; tok/busy-s = output tokens / device-busy seconds (what the policy costs
to serve the trace); per-phase tok/s of wall time (a saturated phase shows capacity); request latency.
Exit status: 0 when nightjar (cold start) passes every check the script prints after its tables ("yes"), 1 when
one says NO, 2 for bad flags or profiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar_jax.bench.common import (  # noqa: E402
    existing_file,
    finite_or_none,
    float_at_least,
    int_list,
    make_parent,
    name_list,
    non_negative_int,
    positive_float,
    positive_int,
    writable_out,
)
from nightjar_jax.planner import Planner, known_planners, make_planner  # noqa: E402
from nightjar_jax.planner.base import strict_json_options  # noqa: E402
from nightjar_jax.sim import (  # noqa: E402
    PRESETS,
    CostProfile,
    SimConfig,
    SimResult,
    Simulator,
    build_oracles,
    low_burst_low,
    make_trace,
    oscillating,
)
from nightjar_jax.sim.workload import DEFAULT_OUTPUT_LENGTHS, DEFAULT_PROMPT_LENGTHS  # noqa: E402


def preset_phases(preset: str, phase_seconds: float, rate_scale: float = 1.0):
    if preset == "low-burst-low":
        phases = low_burst_low(seconds=phase_seconds)
    elif preset == "oscillating":
        phases = oscillating(period_seconds=2 * phase_seconds)
    else:
        phases = PRESETS[preset]()
    if rate_scale == 1.0:
        return phases
    return [dataclasses.replace(p, rate_per_second=p.rate_per_second * rate_scale) for p in phases]


MIN_PHASE_SECONDS = 1.0  # 1-second phases still draw ~28 (low-burst-low) / ~69 (oscillating) requests
AUTO_HIGH_LOAD = 1.5  # --rate-scale auto: the busiest phase arrives at this multiple of AR capacity


def ar_capacity_requests_per_second(profile: CostProfile, samples: int = 200_000) -> float:
    """Requests/s that AR (γ = 0) serves at the profile's largest batch on the default trace lengths:
    1 / (E[out] · step_seconds(B, 0, E[prompt] + E[out]/2) / B + E[prompt] · prefill seconds per token),
    with B = the profile's max_num_seqs (the prefill's fixed cost is shared by a step's prompts; left out)."""
    rng = np.random.default_rng(0)
    out = DEFAULT_OUTPUT_LENGTHS.sample(rng, samples).mean()
    prompt = DEFAULT_PROMPT_LENGTHS.sample(rng, samples).mean()
    batch = profile.max_num_seqs
    per_request = out * profile.step_seconds(batch, 0, prompt + out / 2) / batch
    return 1.0 / (per_request + prompt * profile.prefill_seconds_per_token)


def auto_rate_scale(profile: CostProfile, preset: str, phase_seconds: float) -> float:
    """Scale that puts the preset's busiest phase at AUTO_HIGH_LOAD x AR capacity (other phases keep their ratio
    to it: low-burst-low's lows land at 1.5 · 2/24 = 0.125x, oscillating's at 1.5 · 3/20 = 0.225x)."""
    busiest = max(p.rate_per_second for p in preset_phases(preset, phase_seconds))
    return AUTO_HIGH_LOAD * ar_capacity_requests_per_second(profile) / busiest


def run_one(job: tuple) -> SimResult:
    """One (preset, planner) simulation; runs in a worker process."""
    preset, row, spec, options, warm, profile_path, gamma_max, seed, phase_seconds, rate_scale = job
    profile = CostProfile.from_json(profile_path)
    config = SimConfig(gamma_max=gamma_max, seed=seed)
    trace = make_trace(preset_phases(preset, phase_seconds, rate_scale), seed=seed)
    simulator = Simulator(trace, profile, config)
    if not warm:
        return simulator.run(make_planner(spec, gamma_max, **options), name=row)
    # Warm start: learn on another day's trace of the same shape, save, load, then run this trace.
    warmup = Simulator(make_trace(preset_phases(preset, phase_seconds, rate_scale), seed=seed + 1000), profile, config)
    learner = make_planner(spec, gamma_max, **options)
    warmup.run(learner)
    return simulator.run(Planner.from_json(learner.to_json()), name=row)


VARIANT_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # (no ':' nor '+': the static:K, oracle:* and NAME+warm rows)
VARIANT_NAME_FORM = (
    "NAME of letters, digits, '_', '-', '.' that is not a planner's name ({reserved}) nor 'oracle', and not used "
    "by another --nightjar-variant"
)


def reserved_row_names() -> list[str]:
    """Names a variant may not take: every planner's (its rows are ar, static:K, ..., nightjar) and the oracles'."""
    return [*known_planners(), "oracle"]


def variant_name_form() -> str:
    return VARIANT_NAME_FORM.format(reserved=", ".join(known_planners()))


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME=JSON' -> (NAME, options) for --nightjar-variant (JSON may use Infinity)."""
    name, sep, options = text.partition("=")
    reserved = reserved_row_names()
    if not sep or not VARIANT_NAME.fullmatch(name) or name in reserved:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON with a {variant_name_form()}, got {text!r}")
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"bad JSON in {text!r}: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"options of {name!r} must be a JSON object, got {options!r}")
    try:
        make_planner("nightjar", 1, **parsed)  # validate the options now, not in a worker
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error}") from None
    return name, parsed


def rate_scale_arg(text: str) -> str:
    """--rate-scale: 'auto' or a finite number > 0 (kept as text: the report records it as given)."""
    if text != "auto":
        try:
            positive_float(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected 'auto' or a finite number > 0, got {text!r}") from None
    return text


def oracle_notes(results: dict[str, SimResult], static_rows: list[str]) -> list[str]:
    """A line per oracle row that some static row beats in tok/busy-s (the oracles are references, not bounds)."""
    notes = []
    for oracle in (spec for spec in results if spec.startswith("oracle:")):
        best = max(static_rows, key=lambda s: results[s].busy_throughput)
        gap = results[best].busy_throughput / results[oracle].busy_throughput - 1
        if gap > 0:
            notes.append(
                f"note: {best} beats {oracle} by {gap:+.2%} tok/busy-s: the oracles pick a phase's γ by the static "
                "runs' decode tokens per sequence-second and run their own trajectory, so they are hindsight "
                "references, not upper bounds"
            )
    return notes


WORKLOADS = tuple(dict.fromkeys(("low-burst-low", "oscillating", *PRESETS)))  # what preset_phases knows


def _default_sigterm() -> None:
    """A worker dies of SIGTERM (forked, it inherited the main process's handler, which its own loop caught)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=None, type=existing_file,
                        help="cost profile JSON (default: the synthetic model)")
    parser.add_argument("--presets", default="low-burst-low,oscillating", type=name_list(WORKLOADS, as_text=True),
                        help=f"comma-separated workload presets, of {list(WORKLOADS)}")
    parser.add_argument("--gamma-max", type=positive_int, default=4, help="at most the profile's γ_max")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--seeds", default=None, type=int_list(0, as_text=True),
                        help="comma-separated seeds, each once (overrides --seed); summary over them")
    parser.add_argument(
        "--nightjar-variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME=JSON",
        help="also run nightjar with these options as rows NAME and NAME+warm (repeatable)",
    )
    parser.add_argument("--out", default=None, type=writable_out, help="write all results as JSON here")
    parser.add_argument("--phase-seconds", type=float_at_least(MIN_PHASE_SECONDS), default=60.0,
                        help=f"length of each load phase (>= {MIN_PHASE_SECONDS:g}: shorter phases draw few or no "
                        "requests)")
    parser.add_argument("--jobs", type=positive_int, default=os.cpu_count(), help="worker processes")
    parser.add_argument(
        "--rate-scale",
        default="1.0",
        type=rate_scale_arg,
        help="multiply every phase's arrival rate by this (default 1.0), or 'auto': per preset, scale so the "
        f"busiest phase arrives at {AUTO_HIGH_LOAD}x the profile's AR capacity at its max batch (see "
        "ar_capacity_requests_per_second); the other phases keep their ratio to it. For profiles far from the "
        "default's device (e.g. one measured on a CPU)",
    )
    args = parser.parse_args()
    variant_names = [name for name, _ in args.nightjar_variant]
    repeated = sorted({name for name in variant_names if variant_names.count(name) > 1})
    if repeated:
        parser.error(f"argument --nightjar-variant: NAME {', '.join(map(repr, repeated))} given more than once; "
                     f"expected NAME=JSON with a {variant_name_form()}")

    try:
        profile = CostProfile.from_json(args.profile)
    except (ValueError, KeyError, TypeError) as error:
        parser.error(f"argument --profile: {args.profile!r} is not a cost profile: {error}")
    if args.gamma_max > profile.gamma_max:
        parser.error(f"argument --gamma-max: {args.gamma_max} exceeds the profile's γ_max {profile.gamma_max}; "
                     f"allowed 1..{profile.gamma_max}")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    print(f"profile: {profile.label} [kind={profile.kind}]")
    report: dict = {"profile": profile.label, "profile_kind": profile.kind, "gamma_max": args.gamma_max, "runs": {}}
    all_ok = True
    presets = args.presets.split(",")
    statics = {0: "ar", **{g: f"static:{g}" for g in range(1, args.gamma_max + 1)}}
    rows = [(spec, spec, {}, False) for spec in [*statics.values(), "banditspec", "dsd", "table", "nightjar"]]
    rows.append(("nightjar+warm", "nightjar", {}, True))
    for name, options in args.nightjar_variant:
        rows += [(name, "nightjar", options, False), (f"{name}+warm", "nightjar", options, True)]
    learners = ["nightjar", "nightjar+warm"] + [r for name, _ in args.nightjar_variant for r in (name, f"{name}+warm")]
    if args.nightjar_variant:
        # (an infinite option as the planner state writes it, "inf": json.dumps wrote the bare token Infinity)
        report["nightjar_variants"] = {name: strict_json_options(options) for name, options in args.nightjar_variant}
    if args.rate_scale == "auto":
        scales = {preset: auto_rate_scale(profile, preset, args.phase_seconds) for preset in presets}
        print(
            f"rate scale auto: AR capacity {ar_capacity_requests_per_second(profile):.3g} req/s at batch "
            f"{profile.max_num_seqs}; busiest phase at {AUTO_HIGH_LOAD}x -> "
            + ", ".join(f"{preset} x{scale:.4g}" for preset, scale in scales.items())
        )
    else:
        scales = dict.fromkeys(presets, float(args.rate_scale))
        if scales and not all(s > 0 for s in scales.values()):
            parser.error("--rate-scale must be > 0 or 'auto'")
    for seed in seeds:  # a trace the profile cannot hold fails here in one line, not in every worker
        for preset in presets:
            try:
                Simulator(make_trace(preset_phases(preset, args.phase_seconds, scales[preset]), seed=seed), profile,
                          SimConfig(gamma_max=args.gamma_max, seed=seed))
            except ValueError as error:
                parser.error(f"{preset} (seed {seed}) against {args.profile or 'the synthetic profile'}: {error}")
    if args.rate_scale != "1.0":
        report["rate_scale"] = {"arg": args.rate_scale, "per_preset": scales}
    jobs = [(seed, preset, row) for seed in seeds for preset in presets for row in rows]
    started = time.perf_counter()
    previous = signal.getsignal(signal.SIGTERM)
    with ProcessPoolExecutor(max_workers=args.jobs, initializer=_default_sigterm) as pool:

        def stop(signum, frame):  # (a SIGTERM to this process alone left its workers hung for good)
            for worker in list((getattr(pool, "_processes", None) or {}).values()):
                worker.terminate()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        try:
            finished = list(
                pool.map(
                    run_one,
                    [
                        (preset, *row, args.profile, args.gamma_max, seed, args.phase_seconds, scales[preset])
                        for seed, preset, row in jobs
                    ],
                )
            )
        finally:
            signal.signal(signal.SIGTERM, previous)
    all_results = {(seed, preset): {} for seed in seeds for preset in presets}
    for (seed, preset, row), result in zip(jobs, finished, strict=True):
        all_results[seed, preset][row[0]] = result
    relative: dict = {preset: {} for preset in presets}  # preset -> row -> [(vs best static, vs oracle) per seed]
    for seed in seeds:
        config = SimConfig(gamma_max=args.gamma_max, seed=seed)
        for preset in presets:
            trace = make_trace(preset_phases(preset, args.phase_seconds, scales[preset]), seed=seed)
            simulator = Simulator(trace, profile, config)
            results = all_results[seed, preset]
            static_results = {g: results[s] for g, s in statics.items()}
            for oracle in build_oracles(static_results, trace, config.bucket_edges, args.gamma_max):
                results[oracle.spec] = simulator.run(oracle)
            elapsed = time.perf_counter() - started
            best_static = max(statics.values(), key=lambda s: results[s].busy_throughput)
            oracle = results["oracle:phase"]
            for spec, result in results.items():
                relative[preset].setdefault(spec, []).append(
                    (
                        result.busy_throughput / results[best_static].busy_throughput - 1,
                        result.busy_throughput / oracle.busy_throughput - 1,
                    )
                )
            checks = {}
            for spec in learners:
                r = results[spec]
                checks[spec] = {
                    "tok/busy-s >= every static": all(
                        r.busy_throughput >= results[s].busy_throughput for s in statics.values()
                    ),
                    "tok/busy-s within 5% of oracle:phase": r.busy_throughput >= 0.95 * oracle.busy_throughput,
                    "wall tok/s within 0.5% of every static": all(
                        r.throughput >= 0.995 * results[s].throughput for s in statics.values()
                    ),
                    "every phase within 5% of oracle:phase": all(
                        a >= 0.95 * b for a, b in zip(r.phase_throughput(), oracle.phase_throughput(), strict=True)
                    ),
                    "mean latency <= every static's": r.latencies.mean()
                    <= min(results[s].latencies.mean() for s in statics.values()),
                }
            checks = {k: {c: bool(v) for c, v in d.items()} for k, d in checks.items()}
            all_ok &= all(checks["nightjar"].values())
            if seed != seeds[0]:
                continue
            phases = trace.phases
            print(
                f"\n### {preset}{f' (seed {seed})' if len(seeds) > 1 else ''}: {trace.num_requests} requests, "
                f"{int(trace.output_lengths.sum())} output tokens, "
                f"phases {[f'{p.name} {p.duration_seconds:g}s@{p.rate_per_second:g}/s' for p in phases]} "
                f"(all presets simulated in {elapsed:.0f} s so far)\n"
            )
            header = (
                "| planner | tok/s | tok/busy-s | vs best static | vs oracle:phase | mean lat s | p90 lat s | "
                + " | ".join(f"{p.name} tok/s" for p in phases)
                + " | switches | γ histogram |"
            )
            print(header)
            print("|" + "---|" * (header.count("|") - 1))
            for spec, result in results.items():
                s = result.summary()
                histogram = " ".join(f"{g}:{n}" for g, n in sorted(result.gamma_counts.items()))
                print(
                    f"| {spec} | {result.throughput:.0f} | {result.busy_throughput:.0f} | "
                    f"{result.busy_throughput / results[best_static].busy_throughput - 1:+.2%} | "
                    f"{result.busy_throughput / oracle.busy_throughput - 1:+.2%} | {s['mean_latency_seconds']:.2f} | "
                    f"{s['p90_latency_seconds']:.2f} | "
                    + " | ".join(f"{x:.0f}" for x in result.phase_throughput())
                    + f" | {result.num_switches} | {histogram} |"
                )
            for spec in learners:
                print(f"\n{spec}: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks[spec].items()))
            notes = oracle_notes(results, list(statics.values()))
            for line in notes:
                print(f"\n{line}")
            report["runs"][preset] = {
                "seed": seed,
                "phases": [vars(p) for p in phases],
                "results": {spec: r.summary() for spec, r in results.items()},
                "checks": checks,
                "oracle_notes": notes,
                "seconds_to_simulate": elapsed,
            }
    if len(seeds) > 1:
        report["seeds"] = seeds
        report["summary"] = {}
        for preset in presets:
            print(f"\n### {preset}: tok/busy-s over seeds {seeds} (mean [min, max])\n")
            print("| planner | vs best static | vs oracle:phase | seeds >= every static |")
            print("|---|---|---|---|")
            report["summary"][preset] = {}
            for spec, values in relative[preset].items():
                vs_static, vs_oracle = (np.asarray(v) for v in zip(*values, strict=True))
                cell = [f"{x.mean():+.2%} [{x.min():+.2%}, {x.max():+.2%}]" for x in (vs_static, vs_oracle)]
                print(f"| {spec} | {cell[0]} | {cell[1]} | {int(np.sum(vs_static >= 0))}/{len(seeds)} |")
                report["summary"][preset][spec] = {
                    "vs_best_static": vs_static.tolist(),
                    "vs_oracle_phase": vs_oracle.tolist(),
                }
    if args.out:
        Path(make_parent(args.out)).write_text(json.dumps(finite_or_none(report), indent=1))
        print(f"\nwrote {args.out}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
