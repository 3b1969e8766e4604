"""Kernels for nightjar-jax.

This package imports jax only, never ``nightjar_jax``. Each kernel lives in its own folder:

- ``paged_attention/``: Pallas bodies for GPU (``kernel_gpu.py``) and TPU (``kernel_tpu.py``), runnable interpreted
  on CPU; ``reference.py`` (pure jnp, the oracle in tests and the fallback); ``cpu.py`` + ``cpu_kernel.cc`` (the
  CPU backend's C++ XLA FFI kernel).
- ``linear/``: ``cpu.py`` + ``cpu_kernel.cc``, few-row ``y = x @ W`` on the CPU backend (its reference is XLA's
  dot, which every other backend uses).
- ``sampling/``: ``cpu.py`` + ``cpu_kernel.cc``, the greedy argmax on the CPU backend (its reference is
  ``jnp.argmax``, which every other backend uses).

``cpu_build.py`` builds and registers the C++ kernels (g++ on first use, cached); ``cpu_parallel.h`` is their
shared work-item scheduler on XLA's intra-op thread pool.
"""
