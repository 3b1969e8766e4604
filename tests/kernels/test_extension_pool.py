"""Paged attention over a base pool plus an extension pool (elastic memory: page ids from the base pool's page count
on address the extension) gives what the same pages in one pool give: the CPU kernel and both Pallas bodies
(interpreted: the GPU body's masked loads, the TPU body's parked page inputs) bit for bit, the reference through the
dispatcher; both Pallas bodies with an extension lower for their platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import cpu, paged_attention_reference
from kernels_pallas.paged_attention import paged_attention as pallas_paged_attention
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
    bad = case.block_tables.at[0, 0].set(10_000)  # an id past both pools
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]=10000 is out of range"):  # concrete: validate_inputs
        cpu.paged_attention_cpu(case.q, k, v, bad, case.context_lens, scale=case.scale, k_ext=ke, v_ext=ve)
    with pytest.raises(Exception, match="extension pages"):  # traced: the kernel's own check
        np.asarray(jax.jit(lambda bt: cpu.paged_attention_cpu(case.q, k, v, bt, case.context_lens, scale=case.scale,
                                                               k_ext=ke, v_ext=ve))(bad))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_dispatcher_reads_both_pools(case, impl):
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


@pytest.mark.parametrize("backend,tuning", [
    ("gpu", {}),
    ("gpu", {"pages_per_block": 2, "num_splits": 3}),  # flash-decoding ranges over both pools
    ("tpu", {}),
])
def test_pallas_bodies_read_the_extension_in_place(case, backend, tuning):
    """Both bodies, interpreted, on the split pools give what they give on the one pool, bit for bit; a tree step
    too. The pools' unread slots are NaN (``paged_cases``): a page read from the wrong pool, or a masked-off read
    let into a score, would show."""
    base = case.k_pages.shape[1] // 2
    bt = np.asarray(case.block_tables)
    assert (bt >= base).any() and ((bt > 0) & (bt < base)).any()  # the tables use both pools
    (k, ke), (v, ve) = split(case.k_pages, base), split(case.v_pages, base)
    tree = jnp.asarray(np.tril(np.ones((3, 3), bool)) & np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))
    for tree_mask in (None, tree):
        run = lambda *pools, tree_mask=tree_mask, **ext: pallas_paged_attention(  # noqa: E731
            case.q, *pools, case.block_tables, case.context_lens, scale=case.scale, backend=backend,
            interpret=True, tree_mask=tree_mask, **ext, **tuning)
        whole = run(case.k_pages, case.v_pages)
        assert np.isfinite(np.asarray(whole)).all()
        np.testing.assert_array_equal(np.asarray(run(k, v, k_ext=ke, v_ext=ve)), np.asarray(whole))


def test_pallas_wrapper_rejects_a_bad_extension(case):
    base = case.k_pages.shape[1] // 2
    (k, ke), (v, ve) = split(case.k_pages, base), split(case.v_pages, base)
    run = lambda **ext: pallas_paged_attention(  # noqa: E731
        case.q, k, v, case.block_tables, case.context_lens, scale=case.scale, interpret=True, **ext)
    for ext, message in [
        ({"k_ext": ke}, "come together"),
        ({"k_ext": ke[:, :, :2], "v_ext": ve[:, :, :2]}, "page_size"),
        ({"k_ext": ke.astype(jnp.bfloat16), "v_ext": ve.astype(jnp.bfloat16)}, "dtype"),
        ({"k_ext": ke, "v_ext": ve[:, :1]}, "v_ext shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(**ext)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_pallas_bodies_with_an_extension_lower(platform):
    """Lower (not run) the bodies with an extension pool for their platform from this CPU host: the GPU body's
    masked gathers to Triton IR, the TPU body's parked index_maps and per-page selects to Mosaic."""
    import functools

    from jax import export

    from kernels_pallas.paged_attention import kernel_gpu, kernel_tpu

    body = kernel_gpu.paged_attention_gpu if platform == "cuda" else kernel_tpu.paged_attention_tpu
    bf16 = jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct((4, 4, 32, 128), bf16),  # q: GQA 32 / 8, verify gamma 3
        jax.ShapeDtypeStruct((8, 64, 16, 128), bf16),  # k_pages
        jax.ShapeDtypeStruct((8, 64, 16, 128), bf16),  # v_pages
        jax.ShapeDtypeStruct((4, 16), jnp.int32),  # block_tables
        jax.ShapeDtypeStruct((4,), jnp.int32),  # context_lens
        None,  # no tree mask
        jax.ShapeDtypeStruct((8, 24, 16, 128), bf16),  # k_ext
        jax.ShapeDtypeStruct((8, 24, 16, 128), bf16),  # v_ext
    ]
    fn = jax.jit(functools.partial(body, scale=128**-0.5, interpret=False))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(fn, platforms=[platform], disabled_checks=checks)(*shapes).mlir_module()
    assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text
    assert "_ext" in text  # the kernel's name marks the extension variant
