"""Compiled step variants that can be dropped one family at a time, least used first.

A ``jax.jit`` function keeps every executable it compiled until ``clear_cache()`` drops them all. On the CPU backend
each executable holds ~100-300 of the process's memory maps, and a compile past ``vm.max_map_count`` kills the
process (``ModelRunner.maps_short``), so the engine must drop variants once it holds too many. Dropping them all
made a server under a steady mixed load (logprobs, structured outputs, beam search, several batch sizes: ~290
variants) drop everything every 3-4 minutes and compile again the variants every step uses, with p95 latency
spikes each time (a soak test, 2026-12-06).

:class:`VariantJit` is called as the ``jax.jit`` function it replaces, but holds one ``jax.jit`` object per
*family*, each over a function object of its own (``jax.jit`` keys executables by function, so jit objects over one
function share them, and one's ``clear_cache`` drops them all): the call's static arguments, the shapes of its array
arguments, and the shapes (or absence) of its tuples' elements: the sampling tensors' optional fields (logit bias,
penalties, structured outputs' masks) and the K/V pools' layout (an elastic-memory extension) each make a family.
The weights are left out of the key (``unkeyed_argnums``). It counts each family's calls
and records when it ran last, so :func:`drop_least_used` can drop the least used families of several functions
(the oldest first among equals) and keep the ones the current step runs. The counts halve at each drop, so a family
a shifted load no longer calls loses its rank.

Least *used*, not least recently used: when the variants a load keeps calling need more maps than the process has,
a least-recently-used drop throws out variants the next steps call again. A soak run with that policy (down to 60%
of the limit; 2026-12-06) dropped ~100 of ~270 variants every ~55 s and compiled more often than dropping them all
(245 against 133 steps that compiled by minute 9; docs/benchmarks.md); a rarely called variant (beam search's
log-probabilities, a seldom batch size) is the one to compile again.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax

_TICK = itertools.count(1)  # one clock for every VariantJit: families of different functions compare by recency


class VariantJit:
    """``jax.jit(fn, **jit_kwargs)``, one jitted object per family of calls (see the module docstring)."""

    def __init__(self, fn: Callable, *, static_argnums: tuple[int, ...] = (), static_argnames: tuple[str, ...] = (),
                 unkeyed_argnums: tuple[int, ...] = (), **jit_kwargs: Any):
        """``unkeyed_argnums``: arguments left out of the family key (the weights: their structure never changes,
        and reading a few hundred arrays' shapes per call would cost more than the key is worth)."""
        self.fn = fn
        # (jax.jit infers static names from numbers, or numbers from names, when only one of them is given: so do
        # the keys)
        params = list(inspect.signature(fn).parameters)
        self.static_argnums = frozenset(static_argnums)
        self.static_argnames = frozenset(static_argnames)
        if not static_argnums:
            self.static_argnums = frozenset(params.index(n) for n in static_argnames if n in params)
        if not static_argnames:
            self.static_argnames = frozenset(params[i] for i in static_argnums if i < len(params))
        self.unkeyed_argnums = frozenset(unkeyed_argnums)
        self.jit_kwargs = dict(jit_kwargs)
        if static_argnums:
            self.jit_kwargs["static_argnums"] = static_argnums
        if static_argnames:
            self.jit_kwargs["static_argnames"] = static_argnames
        self.families: dict[tuple, Any] = {}  # family key -> its jax.jit object
        self.last_used: dict[tuple, int] = {}
        self.uses: dict[tuple, float] = {}  # calls, halved at each drop (drop_least_used)
        self._compiled = 0  # executables over every family (kept as calls compile: summing them grew with them)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        key = []
        for i, a in enumerate(args):
            if i in self.static_argnums:
                key.append(a)
            elif i not in self.unkeyed_argnums:
                key.append(_signature(a))
        for name in sorted(kwargs):
            a = kwargs[name]
            key.append((name, a if name in self.static_argnames else _signature(a)))
        return tuple(key)

    def _family(self, key: tuple) -> Any:
        jitted = self.families.get(key)
        if jitted is None:
            # (a function object of its own: jax.jit keys its executables, and clear_cache drops them, by function;
            # jit objects over one function share them)
            jitted = self.families[key] = jax.jit(functools.wraps(self.fn)(lambda *a, **k: self.fn(*a, **k)),
                                                  **self.jit_kwargs)
            self.last_used[key] = 0
            self.uses[key] = 0
        return jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._key(args, kwargs)
        jitted = self._family(key)
        self.last_used[key] = next(_TICK)
        self.uses[key] += 1
        before = jitted._cache_size()
        try:
            return jitted(*args, **kwargs)
        finally:
            self._compiled += jitted._cache_size() - before

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The call's lowering, as a jitted function's ``lower`` (for reading its HLO; it runs nothing)."""
        return self._family(self._key(args, kwargs)).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Executables compiled (or loaded from the persistent cache) over every family, as a jitted function's."""
        return self._compiled

    def drop(self, key: tuple) -> int:
        """Drop one family's executables; returns how many."""
        jitted = self.families.pop(key)
        self.last_used.pop(key, None)
        self.uses.pop(key, None)
        n = jitted._cache_size()
        jitted.clear_cache()
        # (counted again, not decremented: jax's global executable cache may have evicted entries on its own)
        self._compiled = sum(j._cache_size() for j in self.families.values())
        return n

    def clear_cache(self) -> None:
        """Drop every family, as a jitted function's ``clear_cache``."""
        for key in list(self.families):
            self.drop(key)


def _signature(a: Any, depth: int = 0) -> Any:
    """What of an argument decides its executable beyond static values: an array's shape, None where absent; a
    tuple's (a NamedTuple such as the sampling tensors or the K/V pools) elements' signatures, two levels deep (the
    sampling tensors' penalties, a NamedTuple inside them, present or absent), except a tuple of tuples at the top:
    per-layer pools, every layer's alike, whose key is their count and each layer's length (a pair, or with an
    elastic-memory extension a quadruple)."""
    if a is None:
        return None
    shape = getattr(a, "shape", None)
    if isinstance(shape, tuple):
        return shape
    if isinstance(a, tuple) and depth < 2:
        if depth == 0 and a and isinstance(a[0], tuple):
            return (len(a), len(a[0]))
        return tuple(_signature(x, depth + 1) for x in a)
    return type(a).__name__


def tick() -> int:
    """The clock's next reading: families that run after it was read have a later ``last_used``."""
    return next(_TICK)


def drop_least_used(fns: Iterable[VariantJit], since: int, enough: Callable[[], bool], rounds: int = 8) -> int:
    """Drop the families of ``fns`` last used before ``since`` (a :func:`tick`), the least called first (the oldest
    first among equals), in up to ``rounds`` equal chunks until ``enough()`` says so; those used since (the current
    step's) stay. Then every family's count halves (a load that shifted stops protecting the variants it no longer
    calls). Returns how many executables it dropped."""
    fns = list(fns)
    candidates = sorted(((f.uses[k], f.last_used[k], id(f), f, k) for f in fns for k in f.families
                         if f.last_used[k] < since), key=lambda t: t[:3])
    dropped = 0
    if candidates:
        chunk = -(-len(candidates) // rounds)
        for start in range(0, len(candidates), chunk):
            for *_, f, k in candidates[start:start + chunk]:
                dropped += f.drop(k)
            if enough():
                break
    for f in fns:
        for k in f.uses:
            f.uses[k] /= 2
    return dropped
