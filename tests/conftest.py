"""Test-wide set-up: CPU only, a persistent compilation cache shared by all tests and runs."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NIGHTJAR_JAX_CACHE", os.path.expanduser("~/.cache/nightjar_jax/jax_cache_tests"))

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    from nightjar_jax.engine.engine import setup_compilation_cache

    setup_compilation_cache(None)
    yield
