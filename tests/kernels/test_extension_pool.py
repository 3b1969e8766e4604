"""Paged attention over a base pool plus an extension pool (elastic memory: page ids from the base pool's page count
on address the extension) gives what the same pages in one pool give: the CPU kernel bit for bit (one layer's pools
and one layer of stacked pools), the reference and the Pallas kernel (interpreted) through the dispatcher."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import cpu, paged_attention_reference
from nightjar_jax.attention import paged_attention
from nightjar_jax.models.llama import split_page_ids, write_split_kv_pages
from tests.kernels.paged_cases import assert_close, make_case


def split(pool, base: int):
    return pool[..., :base, :, :], pool[..., base:, :, :]


@pytest.fixture(scope="module")
def case():
    # 4 sequences on shuffled pages: each table mixes pages of both halves; verify rows (q_len 3), GQA 2
    return make_case([5, 17, 30, 44], q_len=3, num_q_heads=4, num_kv_heads=2, page_size=4)


def test_cpu_kernel_reads_the_extension_in_place(case):
    if jax.default_backend() != "cpu" or not cpu.available():
        pytest.skip(f"the CPU kernel runs on the CPU backend only ({jax.default_backend()} here) and builds with a "
                    f"C++ compiler: {cpu.unavailable_reason() if jax.default_backend() == 'cpu' else ''}")
    base = case.k_pages.shape[1] // 2
    bt = np.asarray(case.block_tables)
    assert (bt >= base).any() and ((bt > 0) & (bt < base)).any()  # the tables use both pools
    (k, ke), (v, ve) = split(case.k_pages, base), split(case.v_pages, base)
    whole = cpu.paged_attention_cpu(*case.args, scale=case.scale)
    parts = cpu.paged_attention_cpu(case.q, k, v, case.block_tables, case.context_lens, scale=case.scale,
                                    k_ext=ke, v_ext=ve)
    np.testing.assert_array_equal(np.asarray(parts), np.asarray(whole))
    # one layer of pools stacked over 2 layers (layer 0 all NaN: reading it would show)
    stack = lambda p: jnp.stack([jnp.full_like(p, jnp.nan), p])  # noqa: E731
    (sk, ske), (sv, sve) = split(stack(case.k_pages), base), split(stack(case.v_pages), base)
    stacked = cpu.paged_attention_cpu(case.q, sk, sv, case.block_tables, case.context_lens, scale=case.scale,
                                      layer=1, k_ext=ske, v_ext=sve)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(whole))
    with pytest.raises(ValueError, match="every dimension but the pages"):
        cpu.paged_attention_cpu(case.q, k, v, case.block_tables, case.context_lens, scale=case.scale,
                                k_ext=ke[:1], v_ext=ve[:1])
    with pytest.raises(Exception, match="extension pages"):  # an id past both pools
        np.asarray(cpu.paged_attention_cpu(case.q, k, v, case.block_tables.at[0, 0].set(10_000),
                                           case.context_lens, scale=case.scale, k_ext=ke, v_ext=ve))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_other_impls_gather_from_both_pools(case, impl):
    base = case.k_pages.shape[1] // 2
    (k, ke), (v, ve) = split(case.k_pages, base), split(case.v_pages, base)
    expected = paged_attention_reference(*case.args, scale=case.scale)
    got = paged_attention(case.q, k, v, case.block_tables, case.context_lens, scale=case.scale, impl=impl,
                          k_ext=ke, v_ext=ve)
    assert_close(got, expected)


def test_writes_land_in_the_pool_holding_the_page():
    pool = jnp.zeros((1, 3, 2, 1))  # base: pages 0..2
    ext = jnp.zeros((1, 2, 2, 1))  # extension: pages 3, 4
    page_ids = jnp.asarray([[1, 3, 4]])
    slots = jnp.asarray([[0, 1, 0]])
    values = jnp.asarray([[[[1.0], [2.0], [3.0]]]])  # [KVH, S, Q, D]
    pool, ext = write_split_kv_pages(pool, ext, page_ids, slots, values)
    assert pool[0, 1, 0, 0] == 1 and float(pool.sum()) == 1
    assert ext[0, 0, 1, 0] == 2 and ext[0, 1, 0, 0] == 3 and float(ext.sum()) == 5
    in_base, in_ext = split_page_ids(page_ids, 3, 2)
    assert in_base.tolist() == [[1, 3, 3]] and in_ext.tolist() == [[2, 0, 1]]
