"""A real server for the benchmark scripts that measure it over HTTP (``bench_soak.py``, ``bench_serve.py``): start
``python -m nightjar_jax.serve`` on a free port with its output in a log, wait for ``/health``, stop it, and read
``/metrics`` as numbers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(flags: list[str], log) -> tuple[subprocess.Popen, str]:
    """``python -m nightjar_jax.serve <flags> --port <free>`` (its output to ``log``, an open file); returns at once
    with its process and URL (:func:`wait_healthy`). The source checkout this module is in is on its path, installed
    or not."""
    port = free_port()
    cmd = [sys.executable, "-m", "nightjar_jax.serve", *flags, "--port", str(port)]
    print("server:", " ".join(cmd), flush=True)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float) -> None:
    """Until ``url``'s ``/health`` answers 200; SystemExit with the log's end if the server exits or never does."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; the end of its log ({log.name}):\n"
                             + log_tail(log))
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer /health in {timeout:.0f} s; its log: {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL after a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_tail(log) -> str:
    log.flush()
    with open(log.name, errors="replace") as f:
        return f.read()[-3000:]


def scrape_metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """``/metrics`` as {sample name with its labels, e.g. ``nightjar_decode_steps_total{gamma="2"}``: value}."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", headers=headers or {}, timeout=60).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            pass
    return values
