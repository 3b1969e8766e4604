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
