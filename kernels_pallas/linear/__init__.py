"""Linear layers (``y = x @ W``) on the CPU backend: skinny-matrix C++ kernels for decode and verify.

See ``cpu.py`` (the custom calls and where they beat XLA's dot) and ``README.md`` (measurements).
"""
