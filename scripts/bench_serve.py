"""Online serving benchmark (vLLM's ``vllm bench serve``): requests from a dataset sent to the OpenAI server at a
request rate (Poisson arrivals, or all at once: ``inf``), each streamed, timed from the client: time to first token
(TTFT), time per output token after it (TPOT), the gaps between streamed chunks (ITL: with speculative decoding a
chunk may carry several tokens), end-to-end latency, and the throughput each rate reached. Nightjar's claim is a
planner that speculates at low load and stops under high load, so the server runs once per ``--planners`` entry
(started here, the same flags but ``--planner``) over every ``--request-rates`` entry, after an unmeasured pass of
every prompt at once (it compiles what the runs use); each run also reads the server's ``/metrics`` before and
after: the decode steps per γ the planner chose (n-gram lookup's copying steps run at γ_max whatever it chose), the
drafts' acceptance, the tokens a decode step committed over its batch, and the steps that still compiled. Greedy
requests (the default, temperature 0) must give every planner the same text: the run checks it (speculation is
lossless) and exits 1 if a text differs or a request failed.

    python scripts/bench_serve.py --out results/bench_serve.json    # SmolLM2 + its draft; nightjar, static:4, ar
    python scripts/bench_serve.py --model stories260k --draft-model stories260k@skip=2 --endpoint completions \\
        --planners nightjar,ar --request-rates 2,inf --num-prompts 8 --max-tokens 16 --out /tmp/serve.json  # smoke
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --request-rates 1,inf --out /tmp/s.json  # a running one
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    DEFAULT_DATASET,
    check_planner,
    dataset_texts,
    draft_spec,
    float_in_range,
    fmt,
    http_url,
    machine_note,
    model_spec,
    planner_list,
    positive_int,
    writable_out,
    write_json,
)
from nightjar_jax.bench.serving import launch_server, scrape_metrics, stop_server, wait_healthy  # noqa: E402


def rate_list(text: str) -> list[float]:
    """``--request-rates``: a comma list of requests per second, each > 0, or ``inf`` (all at once)."""
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (value > 0):  # (NaN too)
            raise argparse.ArgumentTypeError(f"expected a comma list of request rates (requests per second > 0, or "
                                             f"inf: all at once), got {text!r}")
        out.append(value)
    if len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"expected a comma list of request rates without duplicates, got {text!r}")
    return out


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: exponential gaps of mean 1 / ``rate`` (a Poisson
    process; the first at 0), or all at 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def send(client, url: str, endpoint: str, model: str, text: str, args, record: dict) -> None:
    """One streamed request; fills ``record``: the chunks' arrival times (seconds after ``record["sent"]``), the text,
    the usage's output tokens, and an error if any."""
    import httpx

    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    chunks, parts, record["sent"] = [], [], time.perf_counter()
    try:
        with client.stream("POST", url + path, json=body, timeout=args.request_timeout,
                           headers=auth_headers(args)) as resp:
            if resp.status_code != 200:
                record["error"] = f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}"
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = str(event["error"])[:300]
                    return
                if event.get("usage"):
                    record["output_tokens"] = event["usage"]["completion_tokens"]
                    record["prompt_tokens"] = event["usage"]["prompt_tokens"]
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                    if piece:
                        chunks.append(time.perf_counter() - record["sent"])
                        parts.append(piece)
    except httpx.HTTPError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record["end"] = time.perf_counter() - record["sent"]
        record["chunks"], record["text"] = chunks, "".join(parts)


def auth_headers(args) -> dict[str, str]:
    """The API key's header (``--api-key``, default ``$OPENAI_API_KEY``), if one is set."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def run_rate(url: str, endpoint: str, model: str, texts: list[str], rate: float, args) -> list[dict]:
    """Every text sent at its arrival time (a thread each, so a slow answer never delays the next arrival)."""
    import httpx

    records = [{"index": i} for i in range(len(texts))]
    limits = httpx.Limits(max_connections=len(texts) + 4, max_keepalive_connections=len(texts) + 4)
    with httpx.Client(limits=limits) as client:
        start = time.perf_counter()
        threads = []
        for i, at in enumerate(arrival_times(len(texts), rate, args.seed)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            thread = threading.Thread(target=send, args=(client, url, endpoint, model, texts[i], args, records[i]))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        duration = time.perf_counter() - start
    for r in records:
        r["duration"] = duration
    return records


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, median and p99 in milliseconds (None without values)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": 1e3 * statistics.fmean(values), "p50": 1e3 * statistics.median(values), "p99": 1e3 * p99}


def summarize(records: list[dict], before: dict[str, float], after: dict[str, float], gamma_max: int) -> dict:
    """The client's latencies and throughput, and the server's speculation counters over the run."""
    done = [r for r in records if "error" not in r]  # (an answer with no text, an EOS first, is done too)
    duration = records[0]["duration"] if records else 0.0
    output = sum(r.get("output_tokens", 0) for r in done)
    ttft = [r["chunks"][0] for r in done if r["chunks"]]
    tpot = [(r["end"] - r["chunks"][0]) / (r["output_tokens"] - 1) for r in done
            if r.get("output_tokens", 0) > 1 and r["chunks"]]
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = {g: delta(f'nightjar_decode_steps_total{{gamma="{g}"}}') for g in range(gamma_max + 1)}
    total_steps = sum(steps.values())
    drafted, accepted = delta("nightjar_spec_draft_tokens_total"), delta("nightjar_spec_accepted_tokens_total")
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "duration_s": duration, "request_throughput": len(done) / duration if duration else None,
        "output_throughput": output / duration if duration else None, "output_tokens": output,
        "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r["end"] for r in done]),
        "decode_steps_per_gamma": {str(g): int(n) for g, n in steps.items()},
        "mean_gamma": sum(g * n for g, n in steps.items()) / total_steps if total_steps else None,
        "acceptance": accepted / drafted if drafted else None,
        # the tokens decode steps committed (each request's first came from its prefill) per decode step
        "tokens_per_decode_step": (delta("nightjar_generation_tokens_total") - len(done)) / total_steps
        if total_steps else None,
        # steps that compiled a variant during the run: its latencies then hold compile time
        "compiling_steps": int(delta("nightjar_decode_steps_compiling_total")),
    }


def measure(url: str, label: str, args, texts: list[str], endpoint: str, model: str) -> dict:
    """One server: a warm-up pass (every prompt at once, unmeasured: it compiles the batch sizes and the γ variants
    the planner tries), then each rate in turn."""
    import httpx

    headers = auth_headers(args)
    try:  # (an unreachable --url was a traceback after a whole warm-up pass of failed requests)
        httpx.get(url + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise SystemExit(f"the server at {url} does not answer /health: {type(exc).__name__}: {exc}") from None
    run_rate(url, endpoint, model, texts, math.inf, args)
    gamma_max = _gamma_max(url, headers)
    out = {}
    for rate in args.request_rates:
        before = scrape_metrics(url, headers)
        records = run_rate(url, endpoint, model, texts, rate, args)
        summary = summarize(records, before, scrape_metrics(url, headers), gamma_max)
        out[_rate_key(rate)] = {"summary": summary, "records": records}
        print(f"{label} @ {_rate_key(rate)} req/s: {summary['completed']}/{summary['requests']} done, "
              f"{summary['output_throughput'] or 0:.1f} tok/s, mean γ {fmt(summary['mean_gamma'], '.2f')}",
              flush=True)
    return out


def _gamma_max(url: str, headers: dict) -> int:
    gammas = [int(name.split('gamma="')[1].split('"')[0]) for name in scrape_metrics(url, headers)
              if name.startswith("nightjar_decode_steps_total{")]
    return max(gammas, default=0)


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def table(results: dict) -> str:
    rows = ["| planner | rate (req/s) | done | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
            "ITL p50 / p99 (ms) | E2E mean (ms) | mean γ | accepted | tok / decode step | compiling steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rates in results.items():
        for rate, run in rates.items():
            s = run["summary"]
            rows.append(
                f"| {label} | {rate} | {s['completed']}/{s['requests']} | {fmt(s['request_throughput'], '.2f')} | "
                f"{fmt(s['output_throughput'], '.1f')} | {fmt(s['ttft_ms']['p50'], '.0f')} / "
                f"{fmt(s['ttft_ms']['p99'], '.0f')} | {fmt(s['tpot_ms']['p50'], '.1f')} / "
                f"{fmt(s['tpot_ms']['p99'], '.1f')} | {fmt(s['itl_ms']['p50'], '.1f')} / "
                f"{fmt(s['itl_ms']['p99'], '.1f')} | {fmt(s['e2e_ms']['mean'], '.0f')} | "
                f"{fmt(s['mean_gamma'], '.2f')} | {fmt(s['acceptance'], '.1%')} | "
                f"{fmt(s['tokens_per_decode_step'], '.2f')} | {s['compiling_steps']} |")
    return "\n".join(rows)


def text_mismatches(results: dict) -> list[str]:
    """Greedy texts that differ between any two runs of the same prompt (every planner, every rate)."""
    texts: dict[int, set[str]] = {}
    for rates in results.values():
        for run in rates.values():
            for r in run["records"]:
                if "error" not in r:
                    texts.setdefault(r["index"], set()).add(r["text"])
    return [f"prompt {i}: {len(t)} different texts" for i, t in sorted(texts.items()) if len(t) > 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", type=http_url, default=None, help="a running server to measure (no server started; "
                    "--planners then names nothing: the server's own planner runs)")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="the server's --model (with --url: the requests' model, the server's served name)")
    ap.add_argument("--draft-model", type=draft_spec, default="auto",
                    help="the server's --draft-model (default: the target's pair)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="the servers' API key (default $OPENAI_API_KEY; a started server is given it too)")
    ap.add_argument("--planners", type=planner_list(), default=None,
                    help="comma list: one server each, --planner set to it (default: nightjar,static:4,ar)")
    ap.add_argument("--request-rates", type=rate_list, default="1,4,inf",
                    help="comma list of requests per second (Poisson arrivals), inf: all at once (default 1,4,inf)")
    ap.add_argument("--num-prompts", type=positive_int, default=32)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--temperature", type=float_in_range(0, 100), default=0.0,
                    help="0 (default): greedy, and every planner's texts must agree")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                    help="chat (the model's template) or completions (the prompt as text; models without one)")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="JSONL with 'turns' (the first turns are the prompts)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=16, help="the server's --max-num-seqs")
    ap.add_argument("--server-warmup", choices=("full", "request", "none"), default="full",
                    help="the servers' --warmup (default full: every step variant compiled before the runs, so a γ "
                    "the planner tries at a new batch size does not compile inside a measured run)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                    help="one more word for the servers' command line (repeat: --server-arg=--max-model-len "
                    "--server-arg=1024)")
    ap.add_argument("--seed", type=int, default=0, help="the arrivals' seed")
    ap.add_argument("--request-timeout", type=float_in_range(1, 86400), default=600.0)
    ap.add_argument("--start-timeout", type=float_in_range(1, 86400), default=900.0,
                    help="seconds a server may take to load and warm up")
    ap.add_argument("--out", type=writable_out, default="results/bench_serve.json")
    args = ap.parse_args(argv)
    if args.url is not None and args.planners is not None:
        ap.error("argument --planners: with --url no server is started, so no planner can be set (the running "
                 "server's own planner is measured)")
    if args.planners is None:
        args.planners = ["nightjar", "static:4", "ar"]
    if args.url is None:
        try:  # (the servers' model, checked before one starts; with --url it is only the served name)
            model_spec(args.model)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"argument --model: {exc}")
        mine = ("--model", "--draft-model", "--planner", "--max-num-seqs", "--warmup", "--port", "--host",
                "--api-key", "--served-model-name")
        taken = [a for a in args.server_arg if a.split("=", 1)[0] in mine]
        if taken:  # (a --planner there ran every server under it, each labelled with its own planner)
            ap.error(f"argument --server-arg: {taken[0]} is set by this script (its own flag, or the server's port "
                     f"and names): allowed any other server flag")
        gamma_max = 0 if args.draft_model.lower() in ("none", "") else _server_gamma_max(args.server_arg)
        for planner in args.planners:  # (a static:9 at γ_max 4 failed after the earlier planners' whole runs)
            try:
                check_planner(planner, gamma_max)
            except argparse.ArgumentTypeError as exc:
                ap.error(f"argument --planners: {exc}")
    return args


def _server_gamma_max(server_args: list[str]) -> int:
    """The γ_max the servers will run: --num-speculative-tokens among --server-arg, else the engine's default."""
    from nightjar_jax.config import SpecConfig

    for i, arg in enumerate(server_args):
        name, _, value = arg.partition("=")
        if name == "--num-speculative-tokens":
            value = value or (server_args[i + 1] if i + 1 < len(server_args) else "")
            return int(value) if value.isdigit() else SpecConfig().num_speculative_tokens
    return SpecConfig().num_speculative_tokens


class _Terminated(Exception):
    """A SIGTERM: the run stops, its server too, and what was measured is written."""


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second one must not cut the cleanup short)
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = dataset_texts(args.dataset, default=DEFAULT_DATASET)
    texts = (texts * math.ceil(args.num_prompts / max(1, len(texts))))[: args.num_prompts]
    results: dict[str, dict] = {}
    stopped = None  # why the runs stopped early (their results so far are still written)
    # (a SIGTERM, e.g. a job's timeout, stops the server through the finally below: it was left running)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        if args.url is not None:
            results["server"] = measure(args.url, "server", args, texts, args.endpoint, args.model)
        else:
            for planner in args.planners:
                results[planner] = run_server(planner, args, texts)
    except (_Terminated, KeyboardInterrupt, SystemExit) as exc:
        stopped = {_Terminated: "stopped by SIGTERM", KeyboardInterrupt: "interrupted"}.get(type(exc)) or str(exc)
        print(f"\n{stopped}", file=sys.stderr)
        if not results:
            return 128 + signal.SIGTERM if isinstance(exc, _Terminated) else 130 if isinstance(
                exc, KeyboardInterrupt) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print()
    print(table(results))
    mismatches = text_mismatches(results) if args.temperature == 0 else []
    failed = sum(run["summary"]["failed"] for rates in results.values() for run in rates.values())
    if mismatches:
        print(f"\ngreedy texts differ between runs (speculation must be lossless): {mismatches[:5]}")
    if failed:
        print(f"\n{failed} requests failed (their errors are in the JSON)")
    write_json(args.out, {
        "machine": machine_note(), "command": " ".join(sys.argv), "model": args.model, "draft_model": args.draft_model,
        "num_prompts": len(texts), "max_tokens": args.max_tokens, "temperature": args.temperature,
        "endpoint": args.endpoint, "request_rates": [_rate_key(r) for r in args.request_rates],
        "text_mismatches": mismatches, "stopped": stopped, "results": results})
    print(f"\nwrote {args.out}")
    return 1 if mismatches or failed or stopped else 0


def run_server(planner: str, args, texts: list[str]) -> dict:
    """One server under ``planner``: started, measured, stopped (also on a failure, Ctrl-C or SIGTERM); its log is
    kept (and named) when it fails, removed when it served."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="bench_serve_", delete=False)
    flags = ["--model", args.model, "--draft-model", args.draft_model, "--planner", planner,
             "--max-num-seqs", str(args.max_num_seqs), "--warmup", args.server_warmup, "--log-level", "warning",
             "--disable-uvicorn-access-log", *(["--api-key", args.api_key] if args.api_key else []), *args.server_arg]
    served = False
    try:
        proc, url = launch_server(flags, log)
        try:
            wait_healthy(proc, url, log, args.start_timeout)
            out = measure(url, planner, args, texts, args.endpoint, args.model)
            served = True
            return out
        finally:
            stop_server(proc)
    finally:
        log.close()
        if served:
            os.unlink(log.name)
        else:
            print(f"the {planner} server's log is kept: {log.name}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
