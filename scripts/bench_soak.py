"""A soak of the OpenAI server: a real ``python -m nightjar_jax.serve`` (started here, or ``--url``'s) under
``--clients`` concurrent clients sending a mixed load for ``--duration`` seconds: completions and chat, streamed or
not, n 1-3, log-probabilities, stop strings, seeds, JSON-schema / regex / choice outputs, tool calls, beam search,
prompt log-probabilities and echo, a shared prefix with and without ``cache_salt``, ``/tokenize``, ``/metrics``,
prefix-cache resets, and clients that leave mid-stream or time out on a long request.

Every ``--interval`` seconds a fixed greedy probe runs ``--probe-repeats`` times through the loaded server, and the
server's resident memory, memory maps, open files and threads (``/proc``, Linux) and its metrics (steps that
compiled a variant, variant drops, free pages) are sampled. At the end the clients stop, and once nothing runs or
waits every KV page must be free. Prints a table per interval and writes JSON. Exits 1 when a request failed (an
answer other than 2xx, a stream that ended without ``[DONE]`` or with an error event), the probe's text changed, or
pages stayed held: the soak's correctness is checked, its timings are recorded.

    python scripts/bench_soak.py --out results/bench_soak.json          # the soak of docs/benchmarks.md (24 minutes)
    python scripts/bench_soak.py --duration 20 --interval 10 --clients 2 --warmup request --draft-model none \\
        --out /tmp/soak.json                                                              # smoke (a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    draft_spec,
    fmt,
    http_url,
    machine_note,
    model_spec,
    positive_float,
    positive_int,
    writable_out,
    write_json,
)
from nightjar_jax.bench.serving import launch_server, log_tail, scrape_metrics, stop_server, wait_healthy  # noqa: E402

MODEL = "stories260k"
# stories260K ships no chat template: "<role>: <content>" lines, then "assistant:"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
WORDS = ("once upon a time there was little girl named lily she loved to play in the park with her dog ball tree "
         "sun happy big red").split()
PREFIX = ("Once upon a time, there was a little girl named Lily. She liked to play outside with her friends in the "
          "big green park. ")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
PROBE_PROMPT = "Once upon a time, there was a little dog named Max."
DISCONNECT_SHARE = 0.15  # of streamed requests: the client closes the stream after its first 1-4 events
METRICS = {  # the /metrics samples kept per interval, by short name
    "compiling": "nightjar_decode_steps_compiling_total",
    "drops": "nightjar_compile_evictions_total",
    "free": "nightjar_kv_pages_free",
    "usable": "nightjar_kv_pages_usable",
    "running": "nightjar_num_requests_running",
    "waiting": "nightjar_num_requests_waiting",
    "preemptions": "nightjar_preemptions_total",
}


class Soak:
    """The clients' shared state: counts by request kind, the failures (kept, up to 200), a gate that pauses them."""

    def __init__(self, url: str, model: str, headers: dict):
        self.url, self.model, self.headers = url, model, headers
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.inflight = 0
        self.served = self.failed = self.disconnects = 0
        self.by_kind: dict[str, list[int]] = {}  # kind -> [served, failed]
        self.failures: list[dict] = []
        self.load_s: float | None = None  # seconds from the load's start until its clients were told to stop

    def end_load(self, t0: float) -> None:
        """Tell the clients to stop (each finishes the request it has running); the load's length is kept."""
        if self.load_s is None:
            self.load_s = round(time.time() - t0, 2)
        self.stop.set()

    def record(self, kind: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            counts = self.by_kind.setdefault(kind, [0, 0])
            counts[0 if ok else 1] += 1
            if ok:
                self.served += 1
            else:
                self.failed += 1
                if len(self.failures) < 200:
                    self.failures.append({"t": time.time(), "kind": kind, "detail": detail[:1000]})

    def post(self, client: httpx.Client, kind: str, path: str, body: dict) -> None:
        resp = client.post(self.url + path, json=body, headers=self.headers, timeout=300)
        self.record(kind, 200 <= resp.status_code < 300, f"{resp.status_code} {resp.text} <- {json.dumps(body)}")

    def stream(self, client: httpx.Client, kind: str, path: str, body: dict, leave_after: int | None) -> None:
        """A streamed request, read to its ``[DONE]``, or closed after ``leave_after`` events (a client gone)."""
        body = dict(body, stream=True)
        with client.stream("POST", self.url + path, json=body, headers=self.headers, timeout=300) as resp:
            if resp.status_code != 200:
                resp.read()
                self.record(kind, False, f"{resp.status_code} {resp.text} <- {json.dumps(body)}")
                return
            events = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line.startswith('data: {"error"'):
                    self.record(kind, False, f"error event {line} <- {json.dumps(body)}")
                    return
                if line.strip() == "data: [DONE]":
                    self.record(kind, True)
                    return
                events += 1
                if leave_after is not None and events >= leave_after:
                    with self.lock:
                        self.disconnects += 1
                    return
        self.record(kind, False, f"the stream ended without [DONE] <- {json.dumps(body)}")

    def one(self, client: httpx.Client, rng: random.Random) -> None:
        """One request of the mix (its kind drawn by ``rng``)."""
        m = self.model

        def text(k: int) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(k))

        def send(kind: str, path: str, body: dict, streamable: bool = True) -> None:
            if streamable and rng.random() < 0.5:
                leave = rng.randint(1, 4) if rng.random() < DISCONNECT_SHARE else None
                self.stream(client, kind + "_stream", path, body, leave)
            else:
                self.post(client, kind, path, body)

        max_tokens = rng.randint(4, 40)
        k = rng.random()
        if k < 0.16:
            body = {"model": m, "prompt": text(rng.randint(2, 20)), "max_tokens": max_tokens, "n": rng.randint(1, 3),
                    "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 99)}
            if rng.random() < 0.5:
                body["logprobs"] = rng.randint(0, 5)
            if rng.random() < 0.4:
                body["stop"] = [rng.choice(WORDS), "."]
            send("completion", "/v1/completions", body)
        elif k < 0.32:
            messages = [{"role": "system", "content": "You tell stories."},
                        {"role": "user", "content": text(rng.randint(2, 12))}]
            body = {"model": m, "messages": messages, "max_tokens": max_tokens, "n": rng.randint(1, 3),
                    "temperature": rng.choice([0, 0.8])}
            if rng.random() < 0.4:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 4))
            if rng.random() < 0.3:
                body["stop"] = ["the"]
            if rng.random() < 0.5:
                leave = rng.randint(1, 4) if rng.random() < DISCONNECT_SHARE else None
                self.stream(client, "chat_stream", "/v1/chat/completions",
                            dict(body, stream_options={"include_usage": True}), leave)
            else:
                self.post(client, "chat", "/v1/chat/completions", body)
        elif k < 0.44:
            which = rng.choice(["json", "regex", "choice", "response_format"])
            if which == "response_format":
                body = {"model": m, "messages": [{"role": "user", "content": text(4)}], "max_tokens": 40,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
                send("structured_" + which, "/v1/chat/completions", body)
                return
            spec = {"json": SCHEMA, "regex": "[a-z]{2,6} [0-9]{1,3}", "choice": ["yes", "no", "maybe so"]}[which]
            body = {"model": m, "prompt": text(5), "max_tokens": 40, "temperature": rng.choice([0, 0.9]),
                    "structured_outputs": {which: spec}}
            send("structured_" + which, "/v1/completions", body)
        elif k < 0.52:
            choice = rng.choice([{"type": "function", "function": {"name": "get_weather"}}, "required", "auto"])
            body = {"model": m, "messages": [{"role": "user", "content": "weather in " + text(2)}], "tools": TOOLS,
                    "tool_choice": choice, "max_tokens": 60}
            send("tools", "/v1/chat/completions", body)
        elif k < 0.58:
            body = {"model": m, "prompt": text(rng.randint(3, 10)), "max_tokens": rng.randint(4, 16),
                    "n": rng.randint(2, 3), "use_beam_search": True, "temperature": 0}
            self.post(client, "beam_search", "/v1/completions", body)
        elif k < 0.64:
            body = {"model": m, "prompt": text(rng.randint(3, 20)), "max_tokens": 8,
                    "prompt_logprobs": rng.randint(0, 3), "temperature": 0}
            if rng.random() < 0.3:
                body["echo"] = True
            self.post(client, "prompt_logprobs", "/v1/completions", body)
        elif k < 0.82:
            body = {"model": m, "prompt": PREFIX + text(rng.randint(1, 8)), "max_tokens": max_tokens,
                    "temperature": rng.choice([0, 0.7])}
            if rng.random() < 0.3:
                body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
            if rng.random() < 0.3:
                body["n"] = 2
            send("shared_prefix", "/v1/completions", body)
        elif k < 0.88:
            messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": text(3)}]
            body = {"model": m, "messages": messages, "max_tokens": max_tokens, "cache_salt": rng.choice(["x", "y"])}
            self.post(client, "chat_salted", "/v1/chat/completions", body)
        elif k < 0.93:
            if rng.random() < 0.5:
                self.post(client, "tokenize", "/tokenize", {"model": m, "prompt": text(8)})
            else:
                self.post(client, "tokenize_chat", "/tokenize",
                          {"model": m, "messages": [{"role": "user", "content": text(4)}]})
        elif k < 0.97:
            resp = client.get(self.url + "/metrics", headers=self.headers, timeout=60)
            self.record("metrics", resp.status_code == 200, f"{resp.status_code} {resp.text[:200]}")
        elif k < 0.985:
            self.post(client, "reset_prefix_cache", "/reset_prefix_cache", {})
        else:  # a client that gives up on a long request at 0.3 s, before its answer (the server aborts it)
            body = {"model": m, "prompt": text(5), "max_tokens": 200, "temperature": 0.8, "ignore_eos": True}
            try:
                resp = client.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=0.3)
                self.record("completion_timeout", 200 <= resp.status_code < 300, f"{resp.status_code} {resp.text}")
            except httpx.TimeoutException:
                with self.lock:
                    self.disconnects += 1

    def worker(self, index: int, seed: int) -> None:
        rng = random.Random(seed * 1000 + index)
        client = httpx.Client()
        while not self.stop.is_set():
            self.gate.wait()
            if self.stop.is_set():
                break
            with self.lock:
                self.inflight += 1
            try:
                self.one(client, rng)
            except Exception as exc:  # a connection dropped or a read timed out: a failure, counted
                self.record("exception", False, repr(exc))
                client.close()
                client = httpx.Client()
            finally:
                with self.lock:
                    self.inflight -= 1
        client.close()


def read_metrics(url: str, headers: dict) -> dict[str, float]:
    values = scrape_metrics(url, headers)
    return {short: values.get(name) for short, name in METRICS.items()}


def process_stats(pid: int | None) -> dict:
    """Resident memory (MB), memory maps, open files and threads of ``pid`` (None each off Linux or without one)."""
    out: dict = {"rss_mb": None, "maps": None, "fds": None, "threads": None}
    if pid is None:
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
        with open(f"/proc/{pid}/maps") as f:
            out["maps"] = sum(1 for _ in f)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def probe(soak: Soak, client: httpx.Client, repeats: int) -> tuple[list[float], set[str]]:
    """The fixed greedy probe ``repeats`` times: its latencies and the texts it answered."""
    body = {"model": soak.model, "prompt": PROBE_PROMPT, "max_tokens": 32, "temperature": 0}
    latencies, texts = [], set()
    for _ in range(repeats):
        t0 = time.perf_counter()
        resp = client.post(soak.url + "/v1/completions", json=body, headers=soak.headers, timeout=300)
        latencies.append(time.perf_counter() - t0)
        if resp.status_code != 200:
            soak.record("probe", False, f"{resp.status_code} {resp.text}")
            continue
        texts.add(resp.json()["choices"][0]["text"])
    return latencies, texts


def idle_check(soak: Soak, client: httpx.Client, pid: int | None, timeout: float = 120.0) -> dict:
    """Pause the clients, let what runs finish, then wait until nothing runs or waits and every page is free."""
    soak.gate.clear()
    t0 = time.time()
    while soak.inflight and time.time() - t0 < timeout:
        time.sleep(0.1)
    m = read_metrics(soak.url, soak.headers)
    while time.time() - t0 < timeout and not (m["running"] == 0 and m["waiting"] == 0 and m["free"] == m["usable"]):
        time.sleep(0.2)
        m = read_metrics(soak.url, soak.headers)
    return {"seconds": round(time.time() - t0, 2), "clients_in_flight": soak.inflight, **m, **process_stats(pid),
            "pages_all_free": m["free"] == m["usable"] and m["running"] == 0 and m["waiting"] == 0}


def start_server(args, log, template_path: str) -> tuple[subprocess.Popen, str]:
    """Launch the server (its output to ``log``); returns at once with its process and URL (:func:`wait_healthy`)."""
    flags = ["--model", args.model, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
             str(args.max_num_seqs), "--warmup", args.warmup, "--chat-template", template_path,
             "--enable-auto-tool-choice", "--log-level", "warning"]
    if args.draft_model != "none":
        flags += ["--draft-model", args.draft_model, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    else:
        flags += ["--draft-model", "none"]
    return launch_server(flags + args.server_arg, log)


def sample_times(duration: float, interval: float) -> list[float]:
    """Seconds from the load's start at which to sample: every ``interval``, and at ``duration`` itself (the load
    runs that long)."""
    times = [interval * k for k in range(1, int(duration / interval + 1e-9) + 1)]
    if not times or times[-1] < duration - 1e-6:
        times.append(duration)
    return times


def live_pid(text: str) -> int:
    pid = positive_int(text)
    if not os.path.exists(f"/proc/{pid}"):
        raise argparse.ArgumentTypeError(f"no process {pid} is running (give the server's process id, or leave "
                                         f"--pid out: the table then has no memory figures)")
    return pid


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", type=http_url, default=None,
                   help="soak a running server instead of starting one (its /proc figures need --pid; the server "
                   "options below are then not used)")
    p.add_argument("--pid", type=live_pid, default=None, help="with --url: the server's process id")
    p.add_argument("--api-key", default=None, help="with --url: the server's key (not written to the JSON)")
    p.add_argument("--model", default=MODEL, help="the server's model (default stories260k: the mix's prompts and "
                   "its chat template are written for it)")
    p.add_argument("--draft-model", default="stories260k@skip=2",
                   help="the server's draft (default stories260k@skip=2; 'none': no speculation)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3, help="the server's (default 3)")
    p.add_argument("--max-model-len", type=positive_int, default=256, help="the server's (default 256)")
    p.add_argument("--max-num-seqs", type=positive_int, default=8, help="the server's (default 8)")
    p.add_argument("--warmup", default="full", choices=["none", "request", "full"],
                   help="the server's --warmup (default full: the soak measures serving, not the first compiles)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more argument for the server (repeat it; e.g. --server-arg=--max-num-batched-tokens "
                   "--server-arg=128); not --port or --host, which the script sets")
    p.add_argument("--server-log", type=writable_out, default=None,
                   help="the started server's output (default: a bench_soak_server_*.log temporary file)")
    p.add_argument("--startup-timeout", type=positive_float, default=1800.0,
                   help="seconds the server may take to answer /health (default 1800: a full warm-up on a CPU)")
    p.add_argument("--clients", type=positive_int, default=5, help="concurrent clients (default 5)")
    p.add_argument("--duration", type=positive_float, default=1440.0, help="seconds of load (default 24 minutes)")
    p.add_argument("--interval", type=positive_float, default=60.0,
                   help="seconds between samples, at most --duration (default 60)")
    p.add_argument("--probe-repeats", type=positive_int, default=5, help="probes per sample (default 5)")
    p.add_argument("--seed", type=int, default=0, help="the mix's random seed (each client its own stream)")
    p.add_argument("--out", type=writable_out, default="results/bench_soak.json",
                   help="the JSON results (default results/bench_soak.json)")
    args = p.parse_args(argv)
    if args.url is None and (args.pid is not None or args.api_key is not None):
        p.error("--pid and --api-key go with --url (without it the script starts its own server)")
    if args.url is not None and args.server_log is not None:
        p.error("--server-log is the output of a server the script starts: not with --url")
    if args.interval > args.duration:
        p.error(f"--interval {args.interval:g} is longer than --duration {args.duration:g}: nothing would be sampled")
    if any(a.split("=")[0] in ("--port", "--host") for a in args.server_arg):
        p.error("--server-arg may not set --port or --host: the script starts the server on a free local port")
    if args.url is None:  # (the server's own flags, checked before it starts: they failed in its log, exit 1)
        from nightjar_jax.config import ConfigError, SpecConfig

        for flag, check in (("--model", model_spec), ("--draft-model", draft_spec)):
            try:
                check(getattr(args, flag[2:].replace("-", "_")))
            except argparse.ArgumentTypeError as exc:
                p.error(f"argument {flag}: {exc}")
        try:
            SpecConfig(num_speculative_tokens=args.num_speculative_tokens)
        except ConfigError as exc:
            p.error(f"argument --num-speculative-tokens: {exc}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = None
    template_path = None
    if args.url is None:
        if args.server_log is not None:
            log = open(args.server_log, "w+")
        else:
            log = tempfile.NamedTemporaryFile("w+", prefix="bench_soak_server_", suffix=".log", delete=False)
        with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as template:
            template.write(CHAT_TEMPLATE)
        template_path = template.name
    # (a SIGTERM, e.g. a CI job's timeout, ends the script through its cleanup: the server stopped, not left running)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        return soak_run(args, log, template_path)
    except _Terminated:  # (before the load began: nothing to write)
        print("stopped by SIGTERM before the load began", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if template_path is not None:
            os.unlink(template_path)
        if log is not None:
            log.close()


class _Terminated(Exception):
    """A SIGTERM (e.g. a CI job's timeout): the soak stops, its server too, and what it sampled is written."""


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second one must not cut the cleanup short)
    raise _Terminated()


def soak_run(args, log, template_path: str | None) -> int:
    proc = None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    soak = client = None
    samples: list[dict] = []
    problems: list[str] = []
    start = final = None
    reference_text = None
    terminated = 0  # the exit status a signal stopped the soak with (143 SIGTERM, 130 Ctrl-C)
    threads: list[threading.Thread] = []
    try:
        if args.url is None:
            proc, url = start_server(args, log, template_path)
            pid = proc.pid
            wait_healthy(proc, url, log, args.startup_timeout)
        else:
            url, pid = args.url, args.pid
        soak = Soak(url, args.model, headers)
        client = httpx.Client()
        try:
            reference = probe(soak, client, 1)[1]
            start = {"t": 0.0, **process_stats(pid), **read_metrics(url, headers)}
        except httpx.HTTPError as exc:
            raise SystemExit(f"the server at {url} did not answer: {exc!r}") from None
        if len(reference) != 1:
            raise SystemExit(f"the probe failed before the load: {soak.failures}")
        reference_text = reference.pop()
        threads = [threading.Thread(target=soak.worker, args=(i, args.seed), daemon=True)
                   for i in range(args.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        print("| t (s) | served | failed | left | RSS MB | maps | fds | threads | probe p50 s | probe max s "
              "| steps compiling | variant drops | pages free |\n|" + "---:|" * 13, flush=True)
        try:
            final = run_load(args, soak, client, proc, pid, url, headers, t0, threads, samples, problems,
                             reference_text, start)
        except (_Terminated, KeyboardInterrupt) as exc:  # (Ctrl-C kept nothing of a long soak: written too)
            terminated = 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
            how = "SIGTERM" if isinstance(exc, _Terminated) else "Ctrl-C"
            soak.end_load(t0)
            problems.append(f"stopped by {how} at t = {time.time() - t0:.0f} s")
    finally:
        if soak is not None:
            soak.stop.set()
            soak.gate.set()
        if client is not None:
            client.close()
        if proc is not None:
            stop_server(proc)
    return report(args, log, proc, soak, samples, problems, start, final, reference_text, terminated)


def run_load(args, soak, client, proc, pid, url, headers, t0, threads, samples, problems, reference_text, start):
    """The sampling loop, then the idle check; returns the idle check's figures (None when the server failed). The
    table's compiling steps and variant drops count from the soak's start, as its requests do (the JSON keeps the
    server's totals, and ``start``'s); a server soaked with --url had compiled before."""
    final = None
    # the load lasts --duration, whatever the probes take (the samples' probes ran on past it as load)
    timer = threading.Timer(max(0.0, t0 + args.duration - time.time()), soak.end_load, args=(t0,))
    timer.daemon = True
    timer.start()
    for at in sample_times(args.duration, args.interval):
        time.sleep(max(0.0, t0 + at - time.time()))
        try:
            latencies, texts = probe(soak, client, args.probe_repeats)
            sample = {"t": round(time.time() - t0, 1), "served": soak.served, "failed": soak.failed,
                      "left": soak.disconnects, **process_stats(pid), **read_metrics(url, headers),
                      "probe_p50_s": statistics.median(latencies), "probe_max_s": max(latencies),
                      "probe_text_unchanged": texts <= {reference_text}}
        except httpx.HTTPError as exc:  # (the server died or hung: what the soak is for; the rest is kept)
            gone = proc is not None and proc.poll() is not None
            problems.append(f"the server exited with {proc.returncode} at t = {time.time() - t0:.0f} s"
                            if gone else f"the server stopped answering at t = {time.time() - t0:.0f} s: "
                            f"{exc!r}")
            break
        samples.append(sample)
        print(f"| {sample['t']:.0f} | {sample['served']} | {sample['failed']} | {sample['left']} "
              f"| {fmt(sample['rss_mb'], '.0f')} | {fmt(sample['maps'], '.0f')} | {fmt(sample['fds'], '.0f')} "
              f"| {fmt(sample['threads'], '.0f')} | {fmt(sample['probe_p50_s'], '.3f')} "
              f"| {fmt(since(sample, start, 'compiling'), '.0f')} | {fmt(since(sample, start, 'drops'), '.0f')} "
              f"| {fmt(sample['free'], '.0f')}/{fmt(sample['usable'], '.0f')} |",
              flush=True)
    timer.cancel()
    soak.end_load(t0)
    if not problems:
        try:
            final = idle_check(soak, client, pid)
        except httpx.HTTPError as exc:
            problems.append(f"the server stopped answering after the load: {exc!r}")
    soak.gate.set()  # (a client between its stop check and the gate would wait on it for good)
    for t in threads:
        t.join(timeout=330)
    return final


def since(sample: dict, start: dict, key: str) -> float | None:
    """``sample[key]`` less the soak's start's (None when either is missing)."""
    if sample.get(key) is None or start.get(key) is None:
        return None
    return sample[key] - start[key]


def report(args, log, proc, soak, samples, problems, start, final, reference_text, terminated) -> int:
    """Print the summary, write the JSON; the exit code (1 on a problem, 143 after a SIGTERM)."""
    probe_changed = [s["t"] for s in samples if not s["probe_text_unchanged"]]
    if soak.failed:
        problems.append(f"{soak.failed} request(s) failed, e.g. {soak.failures[:3]}")
    if probe_changed:
        problems.append(f"the probe's greedy text changed at t = {probe_changed} s")
    if final is not None and not final["pages_all_free"]:
        problems.append(f"after the load, pages or requests were still held: {final}")
    print(f"\n{soak.served} requests served, {soak.failed} failed, {soak.disconnects} clients left early; by kind "
          f"(served, failed): {json.dumps(soak.by_kind, sort_keys=True)}")
    print(f"the load ran {soak.load_s} s (--duration {args.duration:g}; requests running then were finished)")
    print(f"after the load: {final}")
    if proc is not None:
        print(f"the server's log: {log.name}")
    write_json(args.out, {
        "args": {**vars(args), "api_key": None if args.api_key is None else "(given)"}, "machine": machine_note(),
        "server_log": None if log is None else log.name, "server_pid": None if proc is None else proc.pid,
        "probe": {"prompt": PROBE_PROMPT, "text": reference_text},
        "load_s": soak.load_s, "start": start, "samples": samples, "final": final, "served": soak.served,
        "failed": soak.failed,
        "disconnects": soak.disconnects, "by_kind": soak.by_kind, "failures": soak.failures, "problems": problems,
    })
    print(f"wrote {args.out}")
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        if proc is not None and proc.returncode not in (0, None) and log is not None and not terminated:
            print(f"the end of the server's log:\n{log_tail(log)}", file=sys.stderr)
        return terminated or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
