"""Shapes the compiled Pallas bodies can take, checked on the host (no GPU or TPU needed).

GPU (Triton): a key tile (``pages_per_block * page_size`` keys) of at least 16 keys, since ``tl.dot`` needs >= 16
along K and N, and a shared-memory estimate within ``SHARED_MEMORY_BUDGET``, both from
``kernel_gpu.choose_gpu_tiles``. TPU (Mosaic): no bfloat16 pool with page_size 1, a block table within the scalar
memory budget, and no DMA of a padding entry for a q block that sees no key. The TPU index_map runs under the TPU
interpreter; the rest is pure Python or raises before lowering.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import kernel_gpu, kernel_tpu, paged_attention, paged_attention_reference
from tests.kernels.paged_cases import assert_close, make_case

F32, BF16 = jnp.float32, jnp.bfloat16
BUDGET = kernel_gpu.SHARED_MEMORY_BUDGET


def _capture_gpu_params(monkeypatch) -> list[dict]:
    """Replace the GPU body the wrapper calls by one that records its tuning and returns zeros, so the compiled
    path's choices (``interpret=False``) can be read on a CPU host."""
    calls = []

    def fake_body(q, *args, scale, interpret, **params):
        calls.append(params)
        return jnp.zeros_like(q)

    monkeypatch.setattr(importlib.import_module("kernels_pallas.paged_attention"), "paged_attention_gpu", fake_body)
    return calls


@pytest.mark.parametrize("page_size, want_pages", [(1, 16), (2, 8), (4, 4), (16, 4)])
def test_compiled_gpu_key_tile_has_at_least_16_keys(monkeypatch, page_size, want_pages):
    """page 1 with 4 pages per block (4 keys) and page 2 with 1 page crashed Triton's TritonGPUAccelerateMatmul for
    sm_80 / sm_90: left unset, pages_per_block is raised to 16 keys; page 4 and 16 keep the default 4."""
    calls = _capture_gpu_params(monkeypatch)
    case = make_case([1, 5], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=page_size, dtype=BF16)
    paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False)
    assert calls[-1]["pages_per_block"] == want_pages and calls[-1]["num_stages"] == 2
    assert calls[-1]["pages_per_block"] * page_size >= kernel_gpu.MIN_BLOCK_K


@pytest.mark.parametrize("page_size, pages_per_block", [(1, 2), (1, 4), (2, 1), (4, 2)])
def test_compiled_gpu_refuses_a_given_key_tile_under_16_keys(page_size, pages_per_block):
    case = make_case([1, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=page_size)
    with pytest.raises(ValueError, match=rf"pages_per_block={pages_per_block} with page_size={page_size} gives a key "
                                         rf"tile of {pages_per_block * page_size} keys.*at least 16"):
        paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False, pages_per_block=pages_per_block)


def test_shared_memory_estimate_matches_triton():
    """Triton 3.9 for sm_80, ``metadata.shared`` of the lowered body (16 rows unless said), pinned here: the
    estimate is exact for one pool and an upper bound with an extension pool."""
    measured = [  # (block_k, head_dim, itemsize, num_stages, rows, extension) -> bytes
        ((64, 128, 2, 2, 16, False), 55_296),  # bf16 page 16, 4 pages (the default tile)
        ((64, 128, 2, 1, 16, False), 22_528),
        ((256, 128, 2, 2, 16, False), 208_896),  # bf16 page 64, 4 pages: over every budget before
        ((512, 64, 4, 2, 16, False), 430_080),  # f32 page 128, 4 pages
        ((64, 128, 4, 2, 32, False), 122_880),  # f32, a verify of 8 queries x group 4
        ((256, 64, 4, 1, 16, False), 86_016),  # f32 page 128, 2 pages, 1 stage: what choose_gpu_tiles now picks
    ]
    for args, shared in measured:
        assert kernel_gpu.shared_memory_bytes(*args) == shared, args
    assert kernel_gpu.shared_memory_bytes(64, 64, 2, 2, 16, extension=True) >= 45_072  # measured with extension
    assert kernel_gpu.shared_memory_bytes(32, 128, 2, 2, 64, extension=True) >= 61_448  # + tree, 64 rows


def test_choose_gpu_tiles_fits_the_budget_or_says_what_fits():
    """Every power-of-two page and head size: a 16-key tile within the budget, or a ValueError naming the shape
    and the largest page that fits. The chosen tiles were Triton-compiled for sm_80 and sm_90 (2026-12): shared
    memory at or under the estimate."""
    for itemsize in (2, 4):
        for page_size in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for head_dim in (64, 128, 256):
                for rows, extension in ((16, False), (64, True)):
                    try:
                        ppb, stages = kernel_gpu.choose_gpu_tiles(page_size, head_dim, itemsize, block_rows=rows,
                                                                  extension=extension)
                    except ValueError as error:
                        assert f"page_size={page_size}, head_dim={head_dim}" in str(error)
                        assert "page_size <= " in str(error) or "head_dim" in str(error)
                        continue
                    assert ppb * page_size >= 16 and stages in (1, 2)
                    need = kernel_gpu.shared_memory_bytes(ppb * page_size, head_dim, itemsize, stages, rows, extension)
                    assert need <= BUDGET
    choose = kernel_gpu.choose_gpu_tiles
    assert choose(16, 128, 2, block_rows=16) == (4, 2)  # bf16 llama shapes keep the default
    assert choose(64, 128, 2, block_rows=16) == (1, 2)  # was 4 pages: 208,896 B
    assert choose(128, 64, 4, block_rows=16) == (2, 1)  # was 4 pages x 2 stages: 430,080 B
    assert choose(64, 128, 2, block_rows=16, num_stages=1) == (4, 1)  # a caller's num_stages is kept
    with pytest.raises(ValueError, match=r"page_size=256, head_dim=256, float32.*use page_size <= 64"):
        choose(256, 256, 4, block_rows=16)
    with pytest.raises(ValueError, match=r"pages_per_block=8, num_stages=2 needs ~413696 bytes.*"
                                         r"pages_per_block <= 1 with num_stages=2 fits"):
        choose(64, 128, 2, block_rows=16, pages_per_block=8, num_stages=2)
    with pytest.raises(ValueError, match=r"num_stages=3 needs .* <= 2 with num_stages=1 fits"):
        choose(128, 128, 2, block_rows=16, num_stages=3)


def test_compiled_gpu_wrapper_bounds_shared_memory(monkeypatch):
    """f32 page 128, head_dim 64 took 4 pages x 2 stages (430,080 B of shared memory, no GPU launches that): the
    wrapper now passes what ``choose_gpu_tiles`` picks; a given tile that cannot fit is refused."""
    calls = _capture_gpu_params(monkeypatch)
    case = make_case([1, 130], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=128, head_dim=64, spare_pages=0)
    paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False)
    assert (calls[-1]["pages_per_block"], calls[-1]["num_stages"]) == (1, 1)  # (sized for an extension pool too)
    with pytest.raises(ValueError, match=r"pages_per_block=4, num_stages=2 needs .* over the 98304-byte budget: "
                                         r"pages_per_block <= 1 with num_stages=1 fits"):
        paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False, pages_per_block=4,
                        num_stages=2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False, num_stages=0)


def test_compiled_gpu_tile_is_the_same_with_and_without_an_extension_pool(monkeypatch):
    """A draft offload adds an extension pool: the tile (and so the order of the arithmetic) stays the one chosen
    before it (bf16, head_dim 128, page 16 took 4 pages without the pool and 2 with it)."""
    calls = _capture_gpu_params(monkeypatch)
    case = make_case([1, 40], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=16, head_dim=128, dtype=BF16)
    paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False)
    k_pages, v_pages = case.args[1], case.args[2]
    paged_attention(*case.args, scale=case.scale, backend="gpu", interpret=False, k_ext=k_pages, v_ext=v_pages)
    assert [(c["pages_per_block"], c["num_stages"]) for c in calls] == [(2, 2), (2, 2)]


@pytest.mark.parametrize("page_size, pages_per_block", [(1, 16), (2, 8)])
def test_gpu_body_with_the_tiles_chosen_for_small_pages(page_size, pages_per_block):
    """The tiles the compiled path picks for pages 1 and 2, interpreted: block tables 9..11 pages wide are padded
    to 16 (page 0, NaN), and the loop reads no slot it must not."""
    case = make_case([1, 3, 9, 17], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=page_size)
    want = paged_attention_reference(*case.args, scale=case.scale)
    got = paged_attention(*case.args, scale=case.scale, backend="gpu", pages_per_block=pages_per_block)
    assert_close(got, want)


@pytest.mark.parametrize("padding", [10**6, -7])
def test_tpu_body_dmas_no_padding_entry_for_an_empty_context(padding):
    """A sequence with context 0 has only padding in its table row, which may hold anything; the index_map read
    its first entry (``last_page = max(-1, 0)``) and the TPU interpreter raised "Out-of-bounds block index". It
    now DMAs page 0; the other sequences' padding entries are garbage too."""
    case = make_case([5, 1, 9], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=4)
    q, k, v, table, ctx = case.args
    ctx = ctx.at[1].set(0)
    garbage = np.array(table)
    for s, pages in enumerate(-(-np.asarray(ctx) // 4)):
        garbage[s, pages:] = padding
    want = paged_attention_reference(q, k, v, table, ctx, scale=case.scale)
    got = paged_attention(q, k, v, jnp.asarray(garbage), ctx, scale=case.scale, backend="tpu", interpret=True)
    assert_close(got, want)
    assert not np.asarray(got)[1].any()


def test_tpu_index_map_keeps_every_page_inside_the_pools():
    """The index_map itself (the interpreter indexes a negative block like Python, so -7 read page 3 silently there
    and only 10**6 raised): no keys -> page 0; ids out of range under jit -> clamped into the pools; with an
    extension, each input's index inside its own pool."""
    from kernels_pallas.paged_attention.layout import QueryBlocking

    blocking = QueryBlocking.choose(1, 2, 128)
    table = jnp.asarray([[-7, -7, -7, -7], [3, 10**6, -7, 5], [12, 2, 0, 0]], jnp.int32).reshape(-1)
    ctx = jnp.asarray([0, 6, 8], jnp.int32)  # page 4: sequence 1 reads logical pages 0, 1
    kwargs = {"blocking": blocking, "pages_per_block": 2, "page_size": 4, "padded_pages_per_seq": 4}

    def pages(pool=None, base_pages=0, total_pages=10):
        return [[int(kernel_tpu._page_index_map(j, **kwargs, total_pages=total_pages, pool=pool,
                                                base_pages=base_pages)(s, 0, 0, step, table, ctx)[1])
                 for step in range(2) for j in range(2)] for s in range(3)]

    assert pages() == [[0, 0, 0, 0], [3, 9, 9, 9], [9, 2, 2, 2]]
    # base pool of 8 pages + an extension of 5: page 9 is extension page 1, 12 is extension page 4
    assert pages("base", 8, 13) == [[0, 0, 0, 0], [3, 0, 0, 0], [0, 2, 2, 2]]
    assert pages("ext", 8, 13) == [[0, 0, 0, 0], [0, 4, 4, 4], [4, 0, 0, 0]]


def test_compiled_tpu_refuses_bfloat16_pools_with_page_size_1():
    """Mosaic failed to verify bf16 ``[1, head_dim]`` page blocks ('vector.broadcast' op ... same element type); the
    wrapper now says so before lowering. float32 page 1 and bf16 page 2 stay allowed; interpreted, bf16 page 1
    still runs."""
    case = make_case([1, 3], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=1, dtype=BF16)
    with pytest.raises(ValueError, match="page_size=1 with a bfloat16 KV pool does not lower to Mosaic.*>= 2"):
        paged_attention(*case.args, scale=case.scale, backend="tpu", interpret=False)
    kernel_tpu.check_compiled_tpu_shapes(1, F32, 4, 8)
    kernel_tpu.check_compiled_tpu_shapes(2, BF16, 4, 8)
    assert_close(paged_attention(*case.args, scale=case.scale, backend="tpu", interpret=True),
                 paged_attention_reference(*case.args, scale=case.scale))


def test_compiled_tpu_refuses_a_block_table_over_the_smem_budget():
    """The whole block table is scalar-prefetched into SMEM (1 MiB up to v6e): past the budget the wrapper says
    so before lowering rather than the TPU compile failing with RESOURCE_EXHAUSTED."""
    from jax import export

    kernel_tpu.check_compiled_tpu_shapes(16, BF16, 256, 511)  # 4 * 256 * 512 = 512 KiB: fits
    with pytest.raises(ValueError, match=r"block table \[256, 512\] int32 .* over the 524288-byte budget"):
        kernel_tpu.check_compiled_tpu_shapes(16, BF16, 256, 512)
    shapes = [jax.ShapeDtypeStruct((256, 1, 2, 128), BF16), jax.ShapeDtypeStruct((1, 64, 16, 128), BF16),
              jax.ShapeDtypeStruct((1, 64, 16, 128), BF16), jax.ShapeDtypeStruct((256, 600), jnp.int32),
              jax.ShapeDtypeStruct((256,), jnp.int32)]
    body = jax.jit(lambda *a: kernel_tpu.paged_attention_tpu(*a, scale=0.1, interpret=False))
    with pytest.raises(ValueError, match=r"block table \[256, 600\]"):
        export.export(body, platforms=["tpu"])(*shapes)
