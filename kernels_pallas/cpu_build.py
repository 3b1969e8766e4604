"""Build, cache and register the C++ XLA FFI kernels that serve the CPU backend (``*/cpu_kernel.cc``).

Each kernel folder's ``cpu.py`` makes one :class:`CpuKernelLibrary`. On first use the library is compiled with
``g++ -O3 -march=native`` against jaxlib's FFI headers (``jax.ffi.include_dir()``) into
``$NIGHTJAR_CACHE_DIR/cpu_kernels`` (default ``~/.cache/nightjar_jax/cpu_kernels``), keyed by the sources (the
kernel and the shared headers), jax's and jaxlib's versions, the compiler and this CPU's feature flags; a build
takes ~10 s once. When there is no C++ compiler or the build fails, :meth:`CpuKernelLibrary.available` is False and
:meth:`CpuKernelLibrary.unavailable_reason` says why; callers then use their pure-XLA path.
``NIGHTJAR_CPU_KERNEL=0`` disables every CPU kernel.
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

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math")
# included by the kernels; part of the cache key
HEADERS = (Path(__file__).with_name("cpu_parallel.h"), Path(__file__).with_name("cpu_math.h"))


_LOADED: list[CpuKernelLibrary] = []  # libraries loaded in this process, in load order


def cache_dir() -> Path:
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


def cpu_vendor() -> str:
    """``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, ...; "" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


class CpuKernelLibrary:
    """One ``cpu_kernel.cc`` and the FFI targets it defines (``{target name: handler symbol}``)."""

    def __init__(self, name: str, source: Path, symbols: dict[str, str], defines: dict[str, int] | None = None):
        """``defines``: ``-DNAME=value`` for the build (part of the cache key), e.g. a limit that Python's dispatch
        and the kernel must agree on."""
        self.name, self.source, self.symbols = name, source, dict(symbols)
        self.defines = dict(defines or {})
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}

    def _build(self) -> Path:
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (tried $CXX, g++, c++, clang++)")
        import jaxlib

        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
        key = hashlib.sha256()
        define_flags = [f"-D{k}={v}" for k, v in sorted(self.defines.items())]
        parts = (self.source.read_bytes(), *(h.read_bytes() for h in HEADERS), jax.__version__, jaxlib.__version__,
                 cxx, version, " ".join(FLAGS + tuple(define_flags)), _cpu_flags())
        for part in parts:
            key.update(part if isinstance(part, bytes) else part.encode())
        out = cache_dir() / f"{self.name}_{key.hexdigest()[:16]}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            cmd = self._command(cxx, tmp_so)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"building {self.source.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
            os.replace(tmp_so, out)  # atomic: a concurrent build of the same key writes the same bytes
        logger.info("built the CPU %s kernel: %s", self.name, out)
        return out

    def _command(self, cxx: str, out: Path | str, *extra: str) -> list[str]:
        define_flags = [f"-D{k}={v}" for k, v in sorted(self.defines.items())]
        return [cxx, *FLAGS, *define_flags, *extra, f"-I{jax.ffi.include_dir()}", str(self.source), "-o", str(out)]

    def assembly(self) -> str:
        """The kernel compiled as it is built, as assembly text (``-S``): for reading what the compiler made of a
        loop (``scripts/kernel_spills.py``)."""
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (tried $CXX, g++, c++, clang++)")
        proc = subprocess.run(self._command(cxx, "-", "-S"), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {self.source.name} to assembly failed:\n{proc.stderr[-2000:]}")
        return proc.stdout

    def _load(self) -> None:
        """Build (once per key), load and register the targets; records the failure reason instead of raising."""
        with self._lock:
            if "ok" in self._state:
                return
            if os.environ.get("NIGHTJAR_CPU_KERNEL", "1") == "0":
                self._state.update(ok=False, reason="disabled by NIGHTJAR_CPU_KERNEL=0")
                return
            try:
                lib = ctypes.cdll.LoadLibrary(str(self._build()))
                for target, symbol in self.symbols.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                self._state.update(ok=True, reason="", lib=lib)
                _LOADED.append(self)
            except Exception as e:  # noqa: BLE001 - any build/load failure means: use the XLA path
                logger.warning("CPU %s kernel unavailable, using the XLA path: %s", self.name, e)
                self._state.update(ok=False, reason=str(e))

    def available(self) -> bool:
        """Whether the kernel is built and registered (builds it on the first call)."""
        self._load()
        return bool(self._state["ok"])

    def unavailable_reason(self) -> str:
        self._load()
        return str(self._state["reason"])


def spin_us(value: int | None = None) -> int | None:
    """The CPU kernels' helper threads' spin after each call, in microseconds (``cpu_parallel.h``'s SpinTeam; set
    at start-up by ``NIGHTJAR_CPU_SPIN_US``, default 30; 0 hands every call's helpers to XLA's pool). With
    ``value``, sets it first. None when no kernel library is loaded."""
    for library in _LOADED:
        lib = library._state.get("lib")
        if lib is None:
            continue
        if value is not None:
            lib.NightjarSetSpinUs(ctypes.c_int64(int(value)))
        lib.NightjarSpinUs.restype = ctypes.c_int64
        return int(lib.NightjarSpinUs())
    return None


NOT_DIFFERENTIABLE = ("the CPU kernels ({target}) are not differentiable: for gradients build the model with "
                      "attention_impl='reference' and linear_impl='xla' (init_model(config, attention_impl="
                      "'reference', linear_impl='xla')), whose pure-XLA paths compute the same values")


def ffi_call(target: str, result_shape_dtypes, **kwargs):
    """``jax.ffi.ffi_call`` behind a JVP rule that raises a clear error: the C++ kernels have no derivative, and
    ``jax.grad`` through one failed with JAX's generic "The FFI call to ... cannot be differentiated". The forward
    pass is the kernel's, unchanged. The returned callable takes the arrays and the kernel's attributes."""
    call = jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)

    def invoke(*args, **attributes):
        @jax.custom_jvp
        def kernel(*arrays):
            return call(*arrays, **attributes)

        @kernel.defjvp
        def _jvp(primals, tangents):
            raise ValueError(NOT_DIFFERENTIABLE.format(target=target))

        return kernel(*args)

    return invoke
