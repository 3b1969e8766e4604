"""Paged attention on the CPU backend: a C++ XLA FFI custom call (``cpu_kernel.cc``), built on first use.

XLA:CPU runs the pure-jnp reference slowly: its page gather is a scalar loop (~2 GB/s on the project's 2-core
machine) and the per-sequence batched dots are tiny; at batch 32 the reference attention took more than half of a
SmolLM2-135M decode step. The kernel reads each key/value row in place, once per block of query rows, and only
below the context length. Contract and results: those of ``reference.py`` (tests compare the two).

Build: ``g++ -O3 -march=native`` against jaxlib's FFI headers (``jax.ffi.include_dir()``), into
``$NIGHTJAR_CACHE_DIR/cpu_kernels`` (default ``~/.cache/nightjar_jax/cpu_kernels``), keyed by the source, jax's
version, the compiler and this CPU's feature flags; the build takes ~10 s once. ``available()`` is False (with the
reason in :func:`unavailable_reason`) when there is no C++ compiler or the build fails; the engine then uses the
reference. ``NIGHTJAR_CPU_KERNEL=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGETS = {  # pool dtype -> FFI target name
    jnp.dtype(jnp.float32): "nightjar_paged_attention_f32",
    jnp.dtype(jnp.bfloat16): "nightjar_paged_attention_bf16",
}
_SYMBOLS = {  # FFI target name -> handler symbol in the built library
    "nightjar_paged_attention_f32": "NjPagedAttentionF32",
    "nightjar_paged_attention_bf16": "NjPagedAttentionBF16",
}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("NIGHTJAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nightjar_jax")
    return Path(root) / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (tried $CXX, g++, c++, clang++)")
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jax.__version__, jaxlib.__version__, cxx, version, " ".join(FLAGS),
                 _cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    out = _cache_dir() / f"paged_attention_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp_so)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp_so, out)  # atomic: a concurrent build of the same key writes the same bytes
    logger.info("built the CPU paged-attention kernel: %s", out)
    return out


def _load() -> None:
    """Build (once per key), load and register the FFI targets; records the failure reason instead of raising."""
    with _lock:
        if "ok" in _state:
            return
        if os.environ.get("NIGHTJAR_CPU_KERNEL", "1") == "0":
            _state.update(ok=False, reason="disabled by NIGHTJAR_CPU_KERNEL=0")
            return
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build()))
            for target, symbol in _SYMBOLS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state.update(ok=True, reason="", lib=lib)
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use the reference
            logger.warning("CPU paged-attention kernel unavailable, using the reference: %s", e)
            _state.update(ok=False, reason=str(e))


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    _load()
    return bool(_state["ok"])


def unavailable_reason() -> str:
    _load()
    return str(_state["reason"])


def paged_attention_cpu(
    q: jax.Array,  # [num_seqs, q_len, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [num_seqs, max_pages_per_seq] int32
    context_lens: jax.Array,  # [num_seqs] int32
    *,
    scale: float,
) -> jax.Array:  # [num_seqs, q_len, num_q_heads, head_dim], dtype of q
    """The reference's contract as a CPU custom call: K and V pools of one dtype (float32 or bfloat16) and one
    shape; q is cast to the pools' dtype (as the Pallas wrapper does) and the result back to q's dtype."""
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {unavailable_reason()}")
    dtype = jnp.dtype(k_pages.dtype)
    if dtype not in TARGETS or v_pages.dtype != dtype:
        raise ValueError(
            f"CPU paged attention takes k_pages and v_pages of one dtype in {[str(d) for d in TARGETS]}; got "
            f"{k_pages.dtype}, {v_pages.dtype}"
        )
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [KVH, pages, page, dim]")
    if q.ndim != 4 or q.shape[3] != k_pages.shape[3] or q.shape[2] % k_pages.shape[0]:
        raise ValueError(
            f"q {q.shape} must be [seqs, q_len, heads, {k_pages.shape[3]}] with heads a multiple of "
            f"num_kv_heads={k_pages.shape[0]}"
        )
    call = jax.ffi.ffi_call(TARGETS[dtype], jax.ShapeDtypeStruct(q.shape, dtype), vmap_method="sequential")
    out = call(
        q.astype(dtype), k_pages, v_pages, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
        scale=np.float32(scale),
    )
    return out.astype(q.dtype)
