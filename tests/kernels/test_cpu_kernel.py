"""The CPU paged-attention custom call (``kernels_pallas/paged_attention/cpu.py``) vs the jnp reference.

Same cases as the Pallas bodies (``paged_cases.py``: NaN in every slot the kernel must not read, shuffled pages):
fp32 / bf16, page sizes 4 / 8 / 16, GQA 1..8, decode, verify (q_len 2..8), prefill chunks longer than the kernel's
16-row block, left-padded rows (context < q_len), context 0 rows; under jit and vmap-free batching; bad block-table
entries and bad dtypes give clear errors. Skips only when no C++ compiler exists (the reason is printed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import cpu, paged_attention_reference
from nightjar_jax.attention import paged_attention, resolve_impl
from tests.kernels.paged_cases import assert_close, make_case
from tests.kernels.test_paged_attention import DECODE_VERIFY_CASES, _case_id, boundary_context_lens

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu.available():
        pytest.skip(f"CPU kernel unavailable here: {cpu.unavailable_reason()}")


def _check(case) -> None:
    expected = paged_attention_reference(*case.args, scale=case.scale)
    actual = jax.jit(lambda *a: cpu.paged_attention_cpu(*a, scale=case.scale))(*case.args)
    assert_close(actual, expected)


@pytest.mark.parametrize("params", DECODE_VERIFY_CASES, ids=_case_id)
def test_decode_and_verify(params):
    dtype, page_size, num_q_heads, num_kv_heads, q_len = params
    _check(make_case(boundary_context_lens(page_size, q_len), q_len=q_len, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, page_size=page_size, dtype=dtype))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_prefill_chunks_and_left_padding(dtype):
    # 24 query rows x GQA 4 = 96 rows per head: six 16-row blocks; contexts below q_len are left-padded rows
    _check(make_case([3, 24, 40, 57], q_len=24, num_q_heads=8, num_kv_heads=2, page_size=8, dtype=dtype))


def test_context_zero_rows_are_zero():
    case = make_case([5, 9], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    out = cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages, case.block_tables,
                                  jnp.asarray([0, 9], jnp.int32), scale=case.scale)
    assert np.all(np.asarray(out[0]) == 0) and np.isfinite(np.asarray(out)).all()


def test_auto_picks_the_cpu_kernel_and_matches_reference():
    assert resolve_impl("auto") == "cpu"
    case = make_case([1, 17, 33], q_len=2, num_q_heads=6, num_kv_heads=3, page_size=16, head_dim=64)
    assert_close(paged_attention(*case.args, scale=case.scale, impl="auto"),
                 paged_attention_reference(*case.args, scale=case.scale))


@pytest.mark.parametrize("head_dim", [8, 12, 40, 128])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_head_sizes_cover_every_vector_path(head_dim, dtype):
    # 8: 8-key dot products, scalar value sums; 12: scalar everywhere (not a multiple of 8); 40: one 32-wide value
    # chunk plus a scalar tail; 128: four chunks. Contexts leave partial 8-key groups and partial pages; q_len 3
    # with GQA 2 gives blocks whose rows see different numbers of keys.
    for page_size in (4, 16):
        case = make_case([1, 7, 8, 9, 30, 41], q_len=3, num_q_heads=4, num_kv_heads=2, page_size=page_size,
                         head_dim=head_dim, dtype=dtype, seed=head_dim + page_size)
        _check(case)


def _traced(case, **kwargs):
    """The kernel under jit with traced tables and lengths: its own range checks answer, not validate_inputs'."""
    return jax.jit(lambda bt, cl: cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages, bt, cl,
                                                          scale=case.scale, **kwargs))


def test_bad_page_id_is_an_error_not_a_crash():
    case = make_case([5, 9], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    bt = case.block_tables.at[1, 0].set(case.k_pages.shape[1] + 7)
    with pytest.raises(Exception, match=r"block-table entry is outside \[0, num_pages \+ extension pages\)"):
        np.asarray(_traced(case)(bt, case.context_lens))
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]=\d+ is out of range"):  # concrete: the shared check
        cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages, bt, case.context_lens, scale=case.scale)


def test_context_longer_than_the_block_table_is_an_error():
    case = make_case([5, 9], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    too_long = jnp.asarray([5, 4 * case.block_tables.shape[1] + 1], jnp.int32)
    with pytest.raises(Exception, match="context length .* outside"):
        np.asarray(_traced(case)(case.block_tables, too_long))
    with pytest.raises(ValueError, match=r"context_lens\[1\]=\d+ is out of range"):
        cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages, case.block_tables, too_long, scale=case.scale)


_NAMES = ("q", "k_pages", "v_pages", "block_tables", "context_lens")


@pytest.mark.parametrize("change, message", [
    # each was cast silently (an integer q gave integer zeros, a float table or length was truncated, a string
    # scale parsed), crashed the process (page_size 0: SIGFPE in the kernel) or raised a bare ZeroDivisionError
    (lambda a: {**a, "q": (a["q"] * 10).astype(jnp.int32)}, "q dtype int32 is not supported"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32) + 0.7},
     "block_tables dtype must be an integer type"),
    (lambda a: {**a, "context_lens": a["context_lens"].astype(jnp.float32) + 0.9},
     "context_lens dtype must be an integer type"),
    (lambda a: {**a, "scale": "0.25"}, "scale must be a real number, got str"),
    (lambda a: {**a, "block_tables": np.asarray(a["block_tables"], np.int64) + np.int64(2**32) * (
        np.arange(a["block_tables"].shape[1]) == 0)}, r"block_tables\[0, 0\]=\d+ is out of range"),
    (lambda a: {**a, "context_lens": np.asarray([2**32 - 1, 9], np.uint32)},
     r"context_lens\[0\]=4294967295 is out of range"),
    (lambda a: {**a, "k_pages": a["k_pages"][:, :, :0], "v_pages": a["v_pages"][:, :, :0],
                "context_lens": jnp.zeros_like(a["context_lens"])}, r"page_size \(k_pages axis 2\) is 0"),
    (lambda a: {**a, "k_pages": a["k_pages"][:0], "v_pages": a["v_pages"][:0]}, r"num_kv_heads .* is 0"),
    (lambda a: {**a, "q": a["q"][:, :, :, :0], "k_pages": a["k_pages"][..., :0], "v_pages": a["v_pages"][..., :0]},
     r"head_dim .* is 0"),
], ids=["int-q", "float-table", "float-ctx", "str-scale", "int64-id", "uint32-ctx", "page-size-0", "kv-heads-0",
        "head-dim-0"])
def test_the_cpu_kernel_refuses_what_the_reference_refuses(change, message):
    """The reverse of ``test_the_reference_takes_what_the_cpu_kernel_takes``: both run the reference's checks
    (``validate_inputs``), so both raise the same ValueError before any kernel runs."""
    case = make_case([5, 9], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    kwargs = change({**dict(zip(_NAMES, case.args, strict=True)), "scale": case.scale})
    for attend in (paged_attention_reference, cpu.paged_attention_cpu):
        with pytest.raises(ValueError, match=message):
            attend(**kwargs)


def test_wide_traced_ids_and_lengths_saturate_instead_of_wrapping():
    """Under jit the values are not checked in Python: an int64 id 2**32 + p was cast to page p and read it, and
    a uint32 length 2**32 - 1 was reported as -1. They now saturate to int32's range, which the kernel refuses."""
    case = make_case([5, 9], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    with jax.enable_x64(True):
        wide = jnp.asarray(np.asarray(case.block_tables, np.int64)).at[0, 0].add(2**32)
        with pytest.raises(Exception, match=r"block-table entry is outside"):
            np.asarray(_traced(case)(wide, case.context_lens))
    with pytest.raises(Exception, match="context length 2147483647 outside"):
        np.asarray(_traced(case)(case.block_tables, jnp.asarray([2**32 - 1, 9], jnp.uint32)))
    good = _traced(case)(case.block_tables.astype(jnp.uint32), case.context_lens.astype(jnp.uint32))
    assert_close(good, paged_attention_reference(*case.args, scale=case.scale))


def test_pools_of_different_dtypes_or_shapes_are_rejected():
    case = make_case([5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    with pytest.raises(ValueError, match="one dtype"):
        cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages.astype(BF16), case.block_tables,
                                case.context_lens, scale=case.scale)
    with pytest.raises(ValueError, match="must both be"):  # a shorter V pool would be read out of bounds
        cpu.paged_attention_cpu(case.q, case.k_pages, case.v_pages[:, :-1], case.block_tables,
                                case.context_lens, scale=case.scale)


def test_float32_q_over_bfloat16_pools_stays_float32():
    # kv_cache_dtype="bfloat16" under a float32 model: q and the output keep float32 (the reference computes the
    # same: float32 q against the pools' values widened), at float32's tolerance, on one chunk and on several
    case = make_case([5, 9, 300], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=BF16)
    q32 = case.q.astype(F32) * 1.001  # values a bfloat16 q could not hold
    args = (q32, case.k_pages, case.v_pages, case.block_tables, case.context_lens)
    out = jax.jit(lambda *a: cpu.paged_attention_cpu(*a, scale=case.scale))(*args)
    assert out.dtype == F32
    assert_close(out, paged_attention_reference(*args, scale=case.scale))


@pytest.mark.parametrize("bits", [False, True], ids=["bf16-pools", "bf16-bits"])
def test_float16_q_over_bfloat16_pools_computes_in_float32(bits):
    """A float16 q was rounded to bfloat16 first: 13x the reference's error (QA, 2026-12-07); now it computes as a
    float32 q does, and comes back as float16."""
    case = make_case([5, 9, 300], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=BF16)
    q16 = (case.q.astype(F32) * 1.001).astype(jnp.float16)  # values a bfloat16 q could not hold
    pools = [jax.lax.bitcast_convert_type(p, jnp.uint16) if bits else p for p in (case.k_pages, case.v_pages)]
    out = cpu.paged_attention_cpu(q16, *pools, case.block_tables, case.context_lens, scale=case.scale)
    assert out.dtype == jnp.float16
    want = paged_attention_reference(q16, case.k_pages, case.v_pages, case.block_tables, case.context_lens,
                                      scale=case.scale)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-3, rtol=0)
    assert np.array_equal(np.asarray(out), np.asarray(cpu.paged_attention_cpu(
        q16.astype(F32), *pools, case.block_tables, case.context_lens, scale=case.scale).astype(jnp.float16)))


@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=["f32-q", "bf16-q"])
def test_uint16_pools_are_read_as_bfloat16_bit_patterns(q_dtype):
    # how the engine holds bfloat16 pools on CPU (llama.kv_storage_dtype): the same bits as the bfloat16 pools
    case = make_case([5, 9, 300], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=BF16)
    q = case.q.astype(q_dtype)
    bits = [jax.lax.bitcast_convert_type(p, jnp.uint16) for p in (case.k_pages, case.v_pages)]
    run = jax.jit(lambda k, v: cpu.paged_attention_cpu(q, k, v, case.block_tables, case.context_lens,
                                                       scale=case.scale))
    out = run(*bits)
    assert out.dtype == q_dtype
    np.testing.assert_array_equal(np.asarray(out.astype(F32)),
                                  np.asarray(run(case.k_pages, case.v_pages).astype(F32)))


def test_other_q_dtypes_are_cast_to_the_pool_dtype_like_the_pallas_wrapper():
    case = make_case([5, 9], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=F32)
    q16 = case.q.astype(BF16)
    out = cpu.paged_attention_cpu(q16, case.k_pages, case.v_pages, case.block_tables, case.context_lens,
                                  scale=case.scale)
    assert out.dtype == BF16
    want = paged_attention_reference(q16.astype(F32), *case.args[1:], scale=case.scale)
    assert_close(out, want.astype(BF16))


@pytest.mark.parametrize("dtype", [F32, jnp.uint16], ids=["f32", "bf16-bits"])
def test_one_layer_of_stacked_pools_in_place(dtype):
    # the engine's stacked cache (llama.StackedKV): pools [L, KVH, NP, PS, D], the kernel reading layer i in place
    # one page layout for every layer (the block tables are shared), different values per layer
    c = make_case([5, 9, 300], q_len=3, num_q_heads=4, num_kv_heads=2, page_size=4,
                  dtype=F32 if dtype == F32 else BF16)
    layers = [(c.k_pages * (1.0 + i) - i, c.v_pages * (0.5 + i) + i) for i in range(3)]

    def pool(p):
        return p if dtype == F32 else jax.lax.bitcast_convert_type(p, jnp.uint16)

    k = jnp.stack([pool(lk) for lk, _ in layers])
    v = jnp.stack([pool(lv) for _, lv in layers])
    q, bt, cl = c.q.astype(F32), c.block_tables, c.context_lens
    for i, (lk, lv) in enumerate(layers):
        got = jax.jit(lambda k, v, i=i: cpu.paged_attention_cpu(q, k, v, bt, cl, scale=c.scale, layer=i))(k, v)
        want = cpu.paged_attention_cpu(q, pool(lk), pool(lv), bt, cl, scale=c.scale)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # the dispatch point: the kernel in place, any other implementation on the slice
        if dtype == F32:
            assert_close(got, paged_attention(q, k, v, bt, cl, scale=c.scale, impl="reference", layer=i))
    with pytest.raises(ValueError, match="layer 3 of pools stacked over 3 layers"):
        cpu.paged_attention_cpu(q, k, v, bt, cl, scale=1.0, layer=3)
    with pytest.raises(ValueError, match=r"must both be \[layers, KVH, pages, page, dim\]"):
        cpu.paged_attention_cpu(q, k[0], v[0], bt, cl, scale=1.0, layer=0)


# ---- long contexts: many pages per row block, rows of one block on both sides of a page boundary ----

LONG_CONTEXTS = [1, 127, 128, 129, 200, 256, 257, 300, 520]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size, q_len", [(16, 1), (12, 5), (16, 24)])
def test_long_contexts_match_reference(dtype, page_size, q_len):
    # page size 12: keys that never align with the 8-key dot products; q_len 24 with GQA 3: 72 rows, five blocks,
    # rows of one block seeing different numbers of pages
    case = make_case(LONG_CONTEXTS, q_len=q_len, num_q_heads=6, num_kv_heads=2, page_size=page_size,
                     dtype=dtype, seed=page_size + q_len)
    _check(case)


def test_tree_mask_window_across_page_boundaries_in_long_contexts():
    from tests.spec.test_tree import _tree_case

    case = make_case([131, 140, 300], q_len=9, num_q_heads=4, num_kv_heads=2, page_size=16, seed=5)
    mask = _tree_case(9, 12, seed=1)  # window keys ctx - 12 .. ctx - 1: across a page boundary for each context
    want = paged_attention_reference(*case.args, scale=case.scale, tree_mask=mask)
    got = jax.jit(lambda *a: cpu.paged_attention_cpu(*a, scale=case.scale, tree_mask=mask))(*case.args)
    assert_close(got, want)


@pytest.mark.parametrize("head_dim", [16, 40, 64])
def test_a_row_does_not_depend_on_its_batch(head_dim):
    """A batch equals each sequence run alone, and each verify row the decode of its position, bitwise: a key's
    score must not depend on how many keys its call's widest row reads (a verify row once scored a page's last
    keys in a scalar loop where its one-row decode scored them 8 at a time: different last bits, and with w4a8's
    int8 rounding of the products after it, different greedy tokens from speculative and plain decoding), nor a
    row's weighted sum of values on the other rows of its group (head sizes 16 and 40 sum the last 16 / 8 columns
    in a loop the compiler vectorizes with reassociation: it ran over the group's widest row, and on AVX-512, where
    rows go three to a group, a 5-row verify pass differed from one-row decoding in the last bit). Contexts 3 and
    21 end a verify pass inside a page's first 8-key group and past its second; two query heads per KV head put rows
    of two positions in one group."""
    q_len, heads, kv_heads = 6, 4, 2
    case = make_case([125, 131, 259, 9, 27], q_len=q_len, num_q_heads=heads, num_kv_heads=kv_heads, page_size=16,
                     head_dim=head_dim, seed=9)
    run = jax.jit(lambda q, bt, cl: cpu.paged_attention_cpu(q, case.k_pages, case.v_pages, bt, cl,
                                                            scale=case.scale))
    batch = np.asarray(run(case.q, case.block_tables, case.context_lens))
    for s, ctx in enumerate(np.asarray(case.context_lens)):
        alone = np.asarray(run(case.q[s:s + 1], case.block_tables[s:s + 1], case.context_lens[s:s + 1]))
        np.testing.assert_array_equal(alone[0], batch[s])
        for i in range(q_len):  # query i sits at position ctx - q_len + i: decode it with that context
            one = np.asarray(run(case.q[s:s + 1, i:i + 1], case.block_tables[s:s + 1],
                                 jnp.asarray([ctx - q_len + i + 1], jnp.int32)))
            np.testing.assert_array_equal(one[0, 0], batch[s, i])


# ---- keys split into chunks (~256 keys each, at fixed positions) and merged: contexts of several chunks ----

CHUNKED_CONTEXTS = [255, 256, 257, 511, 513, 1100]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size, q_len", [(16, 1), (12, 5)])
def test_contexts_of_several_chunks_match_reference(dtype, page_size, q_len):
    # page size 12: chunks of 252 keys; q_len 5: a block's rows on both sides of a chunk boundary (ctx 257, 513)
    case = make_case(CHUNKED_CONTEXTS, q_len=q_len, num_q_heads=6, num_kv_heads=2, page_size=page_size,
                     dtype=dtype, seed=page_size + 7 * q_len)
    _check(case)


def test_chunked_rows_do_not_depend_on_their_batch():
    """Chunks sit at fixed key positions, so a long row merges the same partial sums whatever else is in the call:
    a batch of one short and two long contexts equals each sequence run alone, bitwise."""
    case = make_case([40, 700, 1100], q_len=1, num_q_heads=6, num_kv_heads=2, page_size=16, seed=11)
    run = jax.jit(lambda q, bt, cl: cpu.paged_attention_cpu(q, case.k_pages, case.v_pages, bt, cl,
                                                            scale=case.scale))
    batch = np.asarray(run(case.q, case.block_tables, case.context_lens))
    for s in range(3):
        alone = np.asarray(run(case.q[s:s + 1], case.block_tables[s:s + 1], case.context_lens[s:s + 1]))
        np.testing.assert_array_equal(alone[0], batch[s])


def test_what_the_kernel_cannot_take_is_said_before_it_runs_and_auto_takes_the_reference():
    """QA, 2026-12-07: a traced scale (compiled into the call) was a tracer-conversion error, head_dim 520 a run-time
    error from inside the call after the compile; impl 'auto' now takes the reference for both, impl 'cpu' says
    why. layer= over rank-4 pools sliced the KV-head axis off as the layers and blamed a rank-3 pool."""
    q, k = jnp.ones((1, 1, 2, 16), F32), jnp.ones((1, 3, 4, 16), F32)
    bt, cl = jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([5], jnp.int32)
    want = paged_attention_reference(q, k, k, bt, cl, scale=0.25)
    got = jax.jit(lambda s: paged_attention(q, k, k, bt, cl, scale=s, impl="auto"))(jnp.float32(0.25))
    assert_close(got, want)
    with pytest.raises(ValueError, match="the CPU attention kernel takes a concrete scale"):
        jax.jit(lambda s: paged_attention(q, k, k, bt, cl, scale=s, impl="cpu"))(jnp.float32(0.25))
    wide_q, wide_k = jnp.ones((1, 2, 2, 520), F32), jnp.ones((1, 3, 4, 520), F32)
    assert_close(paged_attention(wide_q, wide_k, wide_k, bt, cl, scale=0.1, impl="auto"),
                 paged_attention_reference(wide_q, wide_k, wide_k, bt, cl, scale=0.1))
    with pytest.raises(ValueError, match="takes head_dim up to 512, got 520"):
        cpu.paged_attention_cpu(wide_q, wide_k, wide_k, bt, cl, scale=0.1)
    # float16 pools (the reference takes them; the kernel float32 / bfloat16 only): auto fell to the kernel's error
    half_q, half_k = q.astype(jnp.float16), k.astype(jnp.float16)
    got = paged_attention(half_q, half_k, half_k, bt, cl, scale=0.25, impl="auto")
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(paged_attention_reference(half_q, half_k, half_k, bt,
                                                                                       cl, scale=0.25)))
    with pytest.raises(ValueError, match="CPU paged attention takes k_pages and v_pages of one dtype"):
        paged_attention(half_q, half_k, half_k, bt, cl, scale=0.25, impl="cpu")
    rank4 = jnp.ones((2, 6, 4, 16), F32)
    for impl in ("reference", "cpu"):
        with pytest.raises(ValueError, match=r"must (both )?be (stacked over the layers, )?\[layers, KVH, pages"):
            paged_attention(q, rank4, rank4, bt, cl, scale=0.25, impl=impl, layer=0)
