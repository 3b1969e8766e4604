"""Sampling on the CPU backend: the greedy argmax as a C++ kernel (``cpu.py``), which XLA:CPU runs slowly.

The engine's sampler (``nightjar_jax.engine.sampler.argmax``) calls it on the CPU backend and keeps its jnp form
everywhere else.
"""
