"""Compiled step variants that can be dropped one family at a time, least recently used first.

A ``jax.jit`` function keeps every executable it compiled until ``clear_cache()`` drops them all. On the CPU backend
each executable holds ~100-300 of the process's memory maps, and a compile past ``vm.max_map_count`` kills the
process (``ModelRunner.maps_short``), so the engine must drop variants once it holds too many. Dropping them all
made a server under a steady mixed load (logprobs, structured outputs, beam search, several batch sizes: ~290
variants) drop everything every 3-4 minutes and compile again the variants every step uses, with p95 latency
spikes each time (a soak test, 2026-12-06).

:class:`VariantJit` is called as the ``jax.jit`` function it replaces, but holds one ``jax.jit`` object per
*family*, each over a function object of its own (``jax.jit`` keys executables by function, so jit objects over one
function share them, and one's ``clear_cache`` drops them all): the call's static arguments and the shapes of its
array arguments (pytree arguments, e.g. the weights or
the K/V pools, do not split families: their rare structure changes stay within one). It records when each family
ran last, so :func:`drop_least_recent` can drop the oldest families of several functions and keep the ones steps
use now.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax

_TICK = itertools.count(1)  # one clock for every VariantJit: families of different functions compare by recency


class VariantJit:
    """``jax.jit(fn, **jit_kwargs)``, one jitted object per family of calls (see the module docstring)."""

    def __init__(self, fn: Callable, *, static_argnums: tuple[int, ...] = (), static_argnames: tuple[str, ...] = (),
                 **jit_kwargs: Any):
        self.fn = fn
        self.static_argnums = frozenset(static_argnums)
        self.static_argnames = frozenset(static_argnames)
        self.jit_kwargs = dict(jit_kwargs, static_argnums=static_argnums, static_argnames=static_argnames)
        self.families: dict[tuple, Any] = {}  # family key -> its jax.jit object
        self.last_used: dict[tuple, int] = {}

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        key = []
        for i, a in enumerate(args):
            if i in self.static_argnums:
                key.append(a)
            else:
                shape = getattr(a, "shape", None)
                key.append(shape if isinstance(shape, tuple) else None)
        for name in sorted(kwargs):
            a = kwargs[name]
            key.append((name, a if name in self.static_argnames else getattr(a, "shape", None)))
        return tuple(key)

    def _family(self, key: tuple) -> Any:
        jitted = self.families.get(key)
        if jitted is None:
            # (a function object of its own: jax.jit keys its executables, and clear_cache drops them, by function;
            # jit objects over one function share them)
            jitted = self.families[key] = jax.jit(functools.wraps(self.fn)(lambda *a, **k: self.fn(*a, **k)),
                                                  **self.jit_kwargs)
            self.last_used[key] = 0
        return jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._key(args, kwargs)
        jitted = self._family(key)
        self.last_used[key] = next(_TICK)
        return jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The call's lowering, as a jitted function's ``lower`` (for reading its HLO; it runs nothing)."""
        return self._family(self._key(args, kwargs)).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Executables compiled (or loaded from the persistent cache) over every family, as a jitted function's."""
        return sum(f._cache_size() for f in self.families.values())

    def drop(self, key: tuple) -> int:
        """Drop one family's executables; returns how many."""
        jitted = self.families.pop(key)
        self.last_used.pop(key, None)
        n = jitted._cache_size()
        jitted.clear_cache()
        return n

    def clear_cache(self) -> None:
        """Drop every family, as a jitted function's ``clear_cache``."""
        for key in list(self.families):
            self.drop(key)


def tick() -> int:
    """The clock's next reading: families that run after it was read have a later ``last_used``."""
    return next(_TICK)


def drop_least_recent(fns: Iterable[VariantJit], since: int, enough: Callable[[], bool], rounds: int = 8) -> int:
    """Drop the families of ``fns`` last used before ``since`` (a :func:`tick`), oldest first, in up to ``rounds``
    equal chunks until ``enough()`` says so; those used since (the current step's) stay. Returns how many executables
    it dropped."""
    candidates = sorted(((f.last_used[k], id(f), f, k) for f in fns for k in f.families if f.last_used[k] < since),
                        key=lambda t: t[:2])
    if not candidates:
        return 0
    chunk = -(-len(candidates) // rounds)
    dropped = 0
    for start in range(0, len(candidates), chunk):
        for _, _, f, k in candidates[start:start + chunk]:
            dropped += f.drop(k)
        if enough():
            break
    return dropped
