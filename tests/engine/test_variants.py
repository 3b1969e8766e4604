"""Compiled step variants dropped one family at a time, least used first (nightjar_jax/engine/variants.py):
a server under a steady mixed load dropped every variant each time the process ran short of memory maps, and
compiled again at once those its steps used."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from nightjar_jax.engine.variants import VariantJit, drop_least_used, tick


def scale(x, k):
    return x * k


def test_families_split_by_static_arguments_and_shapes_and_equal_counts_drop_oldest_first():
    f = VariantJit(scale, static_argnums=(1,))
    for n in (2, 3, 4):
        np.testing.assert_array_equal(f(jnp.ones(n), 2), 2 * np.ones(n))
    f(jnp.ones(2), 2)  # (2,) is now the most recent of the three
    f(jnp.ones(2), 3)  # another static value: another family
    assert len(f.families) == 4 and f._cache_size() == 4
    since = tick()
    f(jnp.ones(5), 2)  # used in the "current step": kept whatever happens
    # one family per round until enough: the oldest, (3,) with k=2, goes first
    drops = []
    assert drop_least_used([f], since, enough=lambda: bool(drops.append(1)) or True, rounds=4) == 1
    assert sorted(f.families) == [((2,), 2), ((2,), 3), ((4,), 2), ((5,), 2)]
    # never enough: everything older than `since` goes, the current step's family stays
    assert drop_least_used([f], since, enough=lambda: False) == 3
    assert list(f.families) == [((5,), 2)] and f._cache_size() == 1
    # a dropped family compiles again on use, with the same result
    np.testing.assert_array_equal(f(jnp.ones(3), 2), 2 * np.ones(3))
    assert f._cache_size() == 2
    f.clear_cache()
    assert f._cache_size() == 0 and not f.families


def test_a_static_argument_passed_either_way_is_static():
    """jax.jit infers static names from numbers (and back) when given one of them; VariantJit passed both, empty,
    which turned that off: a static argument given by keyword was traced (a TypeError for a shape)."""
    def zeros(x, n):
        return x + jnp.zeros(n)

    by_number, by_name = VariantJit(zeros, static_argnums=(1,)), VariantJit(zeros, static_argnames=("n",))
    for f in (by_number, by_name):
        np.testing.assert_array_equal(f(jnp.ones(3), n=3), np.ones(3))
        np.testing.assert_array_equal(f(jnp.ones(3), 3), np.ones(3))
        assert f._cache_size() == sum(j._cache_size() for j in f.families.values())


class Tensors(NamedTuple):
    temperature: jnp.ndarray
    bias: jnp.ndarray | None = None


def biased(x, st):
    return x * st.temperature + (0 if st.bias is None else st.bias)


def test_an_optional_field_makes_its_own_family():
    """A NamedTuple argument's optional fields (the sampling tensors' logit bias, penalties, masks) split families:
    they were one family, so a plain step's use kept a biased variant's executables with it."""
    f = VariantJit(biased)
    plain, with_bias = Tensors(jnp.ones(2)), Tensors(jnp.ones(2), jnp.ones(2))
    f(jnp.ones(2), plain)
    f(jnp.ones(2), with_bias)
    assert len(f.families) == 2 and f._cache_size() == 2
    since = tick()
    f(jnp.ones(2), plain)
    assert drop_least_used([f], since, enough=lambda: False) == 1 and f._cache_size() == 1


def test_the_least_called_goes_first_and_counts_age():
    """A family a load keeps calling outranks a newer one called once (least recently used dropped the busy one when
    the variants in use outgrew the maps); each drop halves the counts, so a load that moved on stops protecting
    its old variants."""
    f = VariantJit(scale, static_argnums=(1,))
    for _ in range(3):
        f(jnp.ones(2), 1)  # busy, then idle
    f(jnp.ones(3), 1)  # newer, called once
    since = tick()
    f(jnp.ones(4), 1)  # the current step's
    assert drop_least_used([f], since, enough=lambda: True, rounds=2) == 1
    assert sorted(f.families) == [((2,), 1), ((4,), 1)] and f.uses[((2,), 1)] == 1.5
    for _ in range(2):
        f(jnp.ones(5), 1)
    # counts now: (4,) 0.5, (2,) 1.5, (5,) 2: one family per drop, the least called first
    assert drop_least_used([f], tick(), enough=lambda: True, rounds=3) == 1 and ((4,), 1) not in f.families
    # halved again, the old busy family (0.75) goes before the newly busy one (1.0)
    assert drop_least_used([f], tick(), enough=lambda: True, rounds=2) == 1 and list(f.families) == [((5,), 1)]


class Penalties(NamedTuple):
    presence: jnp.ndarray


class WithPenalties(NamedTuple):
    temperature: jnp.ndarray
    penalties: Penalties | None = None


def penalized(x, st):
    return x * st.temperature - (0 if st.penalties is None else st.penalties.presence)


def test_a_nested_optional_field_makes_its_own_family():
    """The sampling tensors' penalties are a NamedTuple of arrays: present or absent they read the same to a key of
    shapes (None), so a penalties-only batch ran in the plain family (the final review)."""
    f = VariantJit(penalized)
    f(jnp.ones(2), WithPenalties(jnp.ones(2)))
    f(jnp.ones(2), WithPenalties(jnp.ones(2), Penalties(jnp.ones(2))))
    assert len(f.families) == 2 and f._cache_size() == 2


def test_ranks_span_functions():
    """Families of several step functions are ranked together (equal counts: on one clock, the oldest across them
    goes first)."""
    a, b = VariantJit(scale, static_argnums=(1,)), VariantJit(scale, static_argnums=(1,))
    a(jnp.ones(2), 1)
    b(jnp.ones(2), 1)
    a(jnp.ones(3), 1)
    assert drop_least_used([a, b], tick(), enough=lambda: True, rounds=3) == 1
    assert list(a.families) == [((3,), 1)] and list(b.families) == [((2,), 1)]


def test_an_engine_drops_its_oldest_variants_and_keeps_the_current_steps():
    """stories260K: the variants of earlier batches (batch sizes, log-probabilities) go; the current step's stay
    compiled (its next run compiles nothing), and outputs are unchanged."""
    from nightjar_jax import LLM, SamplingParams

    llm = LLM("stories260k", draft_model="none", max_model_len=128, num_pages=64)
    runner = llm.engine.runner
    for k in (1, 3, 5):
        llm.generate(["Once upon"] * k, SamplingParams(max_tokens=3, temperature=0, logprobs=k), use_tqdm=False)
    since = tick()
    params = SamplingParams(max_tokens=3, temperature=0)
    (before,) = llm.generate(["Once upon"], params, use_tqdm=False)
    compiled = runner.num_compiled()
    current = [(f, k) for f in runner._step_fns().values() for k in f.families if f.last_used[k] >= since]
    assert current and compiled > len(current)
    dropped, total = runner.evict_least_used(0.0, since)  # (0: never enough, everything older goes)
    assert total == compiled  # (no page migrations here)
    assert dropped > 0 and runner.num_compiled() == compiled - dropped
    assert all(k in f.families for f, k in current)
    (after,) = llm.generate(["Once upon"], params, use_tqdm=False)
    assert runner.num_compiled() == compiled - dropped  # (nothing compiled again)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
