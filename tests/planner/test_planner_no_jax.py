"""The planner and the simulator are host-side logic: importing them must not import JAX."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, sys
for name in ("nightjar_jax.planner", "nightjar_jax.sim", "nightjar_jax.sim.simulator", "nightjar_jax.sim.oracle"):
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax")))
assert not bad, bad
"""


def test_planner_and_sim_do_not_import_jax():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=60)


DIR_CODE = """
import sys
import nightjar_jax
names = dir(nightjar_jax)
assert {"LLM", "SamplingParams", "make_engine_config", "make_planner", "__version__"} <= set(names), names
assert sorted(nightjar_jax.__all__) == sorted(n for n in names if n in nightjar_jax.__all__)
bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax")))
assert not bad, bad
"""


def test_dir_lists_the_lazy_public_names_without_importing_them():
    """``dir(nightjar_jax)`` (tab completion) listed none of the lazily imported names; it lists them now, and
    still imports nothing heavy."""
    subprocess.run([sys.executable, "-c", DIR_CODE], check=True, timeout=60)
