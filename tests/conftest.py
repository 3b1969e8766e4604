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


@pytest.fixture(scope="module", autouse=True)
def _room_for_compiles():
    """Memory maps for a test module's compiles. An xdist worker runs hundreds of tests' engines in one process;
    every compiled variant holds ~250-400 of its maps, and past 60% of vm.max_map_count a warm-up stops early
    (``ModelRunner.maps_short``): a test that checks that steps after its warm-up compile nothing failed in a worker
    that had gathered 41k maps (the CI clone check, 2026-12-07). Past 35% when a module starts, the compiled
    executables are dropped (``jax.clear_caches``). Per module, not per test: engines are module-scoped at most, so
    none that compiled before the drop runs after it (a test counting its engine's compiles would count the
    recompiles)."""
    import sys

    if "jax" in sys.modules:  # (nothing compiled yet otherwise; the no-JAX tests stay so)
        from nightjar_jax.engine.runner import memory_map_usage

        used, limit = memory_map_usage() or (0, 1)
        if used > 0.35 * limit:
            import gc

            import jax

            jax.clear_caches()
            gc.collect()
    yield
