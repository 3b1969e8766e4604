"""A real ``python -m nightjar_jax.serve`` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts the server with stories260k plus ``args`` and waits for ``/health``; ``stop()`` sends SIGTERM."""

    def __init__(self, args: list[str], model: str = "stories260k", startup_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.setdefault("NIGHTJAR_JAX_CACHE", os.path.expanduser("~/.cache/nightjar_jax/jax_cache_tests"))
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "nightjar_jax.serve", "--model", model, "--port", str(self.port)]
        cmd += ["--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (with labels), e.g. ``nightjar_kv_pages_free``."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(nightjar_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
