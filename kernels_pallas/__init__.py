"""Pallas kernels for nightjar-jax.

This package imports jax only, never ``nightjar_jax``: each kernel lives in its own folder with a
``kernel.py`` (the Pallas bodies for GPU/TPU, runnable interpreted on CPU) and a ``reference.py`` (pure jnp,
the oracle in tests and the CPU fallback).
"""
