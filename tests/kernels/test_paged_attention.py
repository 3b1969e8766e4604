"""Paged attention kernels vs the jnp reference, interpreted on CPU (tiny shapes).

Coverage: fp32 / bf16; page sizes 4 / 8 / 16; GQA ratios 1, 2, 4, 8; q_len 1 (decode), 2..8 (verify, gamma + 1)
and a 24-token prefill chunk tiled into several q blocks; context lengths 1, page boundary -1 / 0 / +1 and longer,
mixed in one batch; context < q_len (left-padded ragged chunks); shuffled page ids; NaN in every slot a kernel
must not read (see ``paged_cases.py``), with two tests showing that a stray read does turn into NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import kernel_gpu, layout, paged_attention, paged_attention_reference
from tests.kernels.paged_cases import assert_close, make_case

F32, BF16 = jnp.float32, jnp.bfloat16


def boundary_context_lens(page_size: int, q_len: int) -> list[int]:
    """Length 1, the q_len minimum, both sides of the first two page boundaries, and a longer one."""
    lens = [1, q_len, page_size - 1, page_size, page_size + 1, 2 * page_size - 1, 2 * page_size + 1, 3 * page_size + 2]
    return sorted({max(n, 1) for n in lens})


# (dtype, page_size, num_q_heads, num_kv_heads, q_len): GQA ratio = num_q_heads // num_kv_heads.
DECODE_VERIFY_CASES = [
    (F32, 4, 2, 2, 1),  # ratio 1 decode
    (BF16, 4, 4, 2, 1),  # ratio 2 decode
    (F32, 8, 8, 2, 4),  # ratio 4 verify (gamma 3)
    (BF16, 8, 8, 1, 8),  # ratio 8 verify (gamma 7)
    (F32, 16, 4, 4, 2),  # ratio 1 verify (gamma 1)
    (BF16, 16, 8, 2, 5),  # ratio 4 verify (gamma 4)
]


def _case_id(case) -> str:
    dtype, page_size, num_q_heads, num_kv_heads, q_len = case
    return f"{jnp.dtype(dtype).name}-ps{page_size}-g{num_q_heads // num_kv_heads}-q{q_len}"


def _check(case, **kwargs) -> None:
    expected = paged_attention_reference(*case.args, scale=case.scale)
    actual = paged_attention(*case.args, scale=case.scale, **kwargs)
    assert_close(actual, expected)


@pytest.mark.parametrize("params", DECODE_VERIFY_CASES, ids=_case_id)
def test_gpu_body_decode_and_verify(params):
    dtype, page_size, num_q_heads, num_kv_heads, q_len = params
    case = make_case(
        boundary_context_lens(page_size, q_len),
        q_len=q_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        dtype=dtype,
    )
    _check(case, backend="gpu")


@pytest.mark.parametrize("pages_per_block", [1, 2, 8])
def test_gpu_body_pages_per_block(pages_per_block):
    """max_pages_per_seq (5) is not a multiple of pages_per_block 2 or 8: the padded block-table tail is read."""
    case = make_case([1, 3, 4, 5, 13], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4)
    _check(case, backend="gpu", pages_per_block=pages_per_block, block_rows=16)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_gpu_body_prefill_chunks(dtype):
    """24-token chunks, 3 q blocks of 8 queries x group 2; right-aligned ragged rows (context < q_len)."""
    case = make_case([5, 24, 37, 50], q_len=24, num_q_heads=4, num_kv_heads=2, page_size=8, dtype=dtype)
    _check(case, backend="gpu", block_rows=16, pages_per_block=2)


@pytest.mark.parametrize(
    "case_kwargs, context_lens, tuning",
    [
        ({"q_len": 1, "num_q_heads": 4, "num_kv_heads": 2, "page_size": 4}, [1, 3, 4, 5, 13, 40],
         {"num_splits": 4, "pages_per_block": 2}),  # decode; 40 keys reach the last split, 1 key only the first
        ({"q_len": 5, "num_q_heads": 8, "num_kv_heads": 2, "page_size": 8, "dtype": BF16}, [5, 9, 41],
         {"num_splits": 3, "pages_per_block": 1}),  # verify; 7 iterations in splits of 3, 3 and 1
        ({"q_len": 24, "num_q_heads": 4, "num_kv_heads": 2, "page_size": 8}, [5, 24, 37, 50],
         {"num_splits": 2, "pages_per_block": 2, "block_rows": 16}),  # prefill, 3 q blocks x 2 splits
        ({"q_len": 1, "num_q_heads": 8, "num_kv_heads": 1, "page_size": 4}, [2, 29],
         {"num_splits": 0, "pages_per_block": 1}),  # auto: 2 programs -> as many splits as iterations (8)
    ],
    ids=["decode-4", "verify-3-bf16", "prefill-2", "auto"],
)
def test_gpu_body_split_keys(case_kwargs, context_lens, tuning):
    """Keys split into ranges, each its own program, merged in order (flash-decoding) == the reference; the
    pools are NaN wherever nothing may read, so an empty or partial split reads nothing it must not."""
    case = make_case(context_lens, **case_kwargs)
    _check(case, backend="gpu", **tuning)
    unsplit = paged_attention(*case.args, scale=case.scale, backend="gpu", **{**tuning, "num_splits": 1})
    split = paged_attention(*case.args, scale=case.scale, backend="gpu", **tuning)
    assert_close(split, unsplit)


def test_split_keys_keep_a_stray_read_visible_and_pick_their_count():
    """A NaN read inside one split reaches the merged output (not hidden by its weight); ``auto_num_splits`` fills
    about SPLIT_TARGET_PROGRAMS programs, never more splits than loop iterations, and none for a large grid."""
    case = make_case([5, 9], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=4)
    over = paged_attention(*case.args[:4], case.context_lens + 1, scale=case.scale, backend="gpu", num_splits=2,
                           pages_per_block=1)
    assert np.isnan(np.asarray(over)).all(axis=(1, 2, 3)).all()
    assert kernel_gpu.auto_num_splits(8, 256) == 16  # batch 1, 8 KV heads, 4096 keys in 256 iterations
    assert kernel_gpu.auto_num_splits(8, 3) == 3
    assert kernel_gpu.auto_num_splits(3, 256) == 64  # ceil(128 / 3) = 43 -> 64
    assert kernel_gpu.auto_num_splits(512, 256) == 1
    one_row = layout.QueryBlocking.choose(1, 4, 64)
    assert kernel_gpu.split_plan(1, 8, one_row, 17, 0) == (2, 9)  # 16 asked, 17 iterations: ranges of 2, 9 run
    assert kernel_gpu.split_plan(64, 8, one_row, 17, 0) == (0, 1) == kernel_gpu.split_plan(1, 8, one_row, 17, 1)
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        paged_attention(*case.args, scale=case.scale, backend="gpu", num_splits=-1)


@pytest.mark.parametrize(
    "params, context_lens, tuning",
    [
        ((F32, 4, 4, 2, 1), [1, 3, 4, 5, 9], {}),
        ((BF16, 8, 8, 2, 4), [2, 7, 8, 9, 17], {"pages_per_block": 1}),
        ((F32, 8, 2, 2, 8), [8, 15, 16, 17], {"pages_per_block": 2}),
        ((F32, 8, 4, 1, 20), [6, 20, 33], {"block_rows": 16, "pages_per_block": 2}),  # prefill, 5 q blocks
    ],
    ids=["decode-g2", "verify-g4-bf16", "verify-q8", "prefill-g4"],
)
def test_tpu_body_interpreted(params, context_lens, tuning):
    """The Mosaic TPU body (scalar-prefetched block tables) under the TPU interpreter on CPU."""
    dtype, page_size, num_q_heads, num_kv_heads, q_len = params
    case = make_case(
        context_lens,
        q_len=q_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        dtype=dtype,
    )
    _check(case, backend="tpu", interpret=True, **tuning)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_q_dtype_differs_from_pages(backend):
    """fp32 q over a bf16 pool (kv_cache_dtype="bfloat16" under a float32 model): q and the sums stay float32 as in
    the reference (K and V widened tile by tile), to float32 tolerance, the output fp32. The body used to round q
    to bfloat16 first, ~1e-2 off. A bf16 q over an fp32 pool is widened to fp32."""
    case = make_case([5, 9], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=BF16)
    q = jax.random.normal(jax.random.key(1), case.q.shape, F32)
    expected = paged_attention_reference(q, *case.args[1:], scale=case.scale)
    actual = paged_attention(q, *case.args[1:], scale=case.scale, backend=backend, interpret=True)
    assert actual.dtype == F32 and expected.dtype == F32
    assert_close(actual, expected)
    f32 = make_case([5, 9], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4)
    narrow_q = f32.q.astype(BF16)
    expected = paged_attention_reference(narrow_q, *f32.args[1:], scale=f32.scale)
    actual = paged_attention(narrow_q, *f32.args[1:], scale=f32.scale, backend=backend, interpret=True)
    assert actual.dtype == BF16
    assert_close(actual, expected)


def test_auto_backend_under_jit():
    """The model calls the kernel inside its own jit, with backend="auto" (interpreted GPU body on CPU)."""
    case = make_case([3, 9], q_len=3, num_q_heads=4, num_kv_heads=2, page_size=4)
    expected = paged_attention_reference(*case.args, scale=case.scale)
    actual = jax.jit(functools.partial(paged_attention, scale=case.scale))(*case.args)
    assert_close(actual, expected)


def test_nan_fill_catches_reading_one_slot_past_the_context():
    """Claiming one more token than was written makes the kernel read a NaN slot: the NaN fill is in place."""
    case = make_case([3, 4, 8], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    out = paged_attention(*case.args[:4], case.context_lens + 1, scale=case.scale, backend="gpu")
    assert np.isnan(np.asarray(out)).all(axis=(1, 2, 3)).all()


def test_nan_fill_catches_masking_values_by_multiply(monkeypatch):
    """A body that zeroes past-context values by multiplying (0 * nan = nan) instead of selecting must fail."""

    def broken_step(q, k, v, key_pos_row, key_pos_col, *args, **kwargs):
        v = v * (key_pos_col < args[1]).astype(v.dtype)  # args[1] is context_len
        return unmasked_step(q, k, v, key_pos_row, jnp.full_like(key_pos_col, -1), *args, **kwargs)

    unmasked_step = layout.online_softmax_step
    monkeypatch.setattr(kernel_gpu, "online_softmax_step", broken_step)
    case = make_case([3, 9], q_len=2, num_q_heads=2, num_kv_heads=1, page_size=4)
    # __wrapped__: trace afresh instead of reusing the jit cache entry of the correct body.
    out = kernel_gpu.paged_attention_gpu.__wrapped__(*case.args, scale=case.scale, interpret=True)
    assert np.isnan(np.asarray(out)).any()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"][0]}, "q must be"),
        (lambda a: {**a, "q": a["q"].astype(jnp.float16)}, "q dtype"),
        (lambda a: {**a, "k_pages": a["k_pages"].astype(BF16)}, "k_pages and v_pages must share a dtype"),
        (lambda a: {**a, "v_pages": a["v_pages"][:, :1]}, "v_pages shape"),
        (
            lambda a: {
                **a,
                "q": jnp.zeros((2, 1, 3, 16)),
                "k_pages": jnp.concatenate([a["k_pages"]] * 2),
                "v_pages": jnp.concatenate([a["v_pages"]] * 2),
            },
            "multiple of num_kv_heads",
        ),
        (
            lambda a: {
                **a,
                "block_tables": a["block_tables"].astype(jnp.int64 if jax.config.x64_enabled else jnp.int16),
            },
            "block_tables dtype",
        ),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables must be"),
        (lambda a: {**a, "context_lens": a["context_lens"][:, None]}, "context_lens must be"),
        (lambda a: {**a, "backend": "cuda"}, "backend="),
        (lambda a: {**a, "pages_per_blok": 2}, "unknown tuning"),
        (lambda a: {**a, "backend": "gpu", "interpret": False, "pages_per_block": 3}, "power of two"),
    ],
)
def test_wrapper_rejects_bad_inputs(change, message):
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    names = ("q", "k_pages", "v_pages", "block_tables", "context_lens")
    kwargs = change(dict(zip(names, case.args, strict=True)))
    with pytest.raises(ValueError, match=message):
        paged_attention(**kwargs, scale=case.scale)


def _lower_for(platform: str, body, tree_window: int = 0, **kwargs) -> str:
    """Lower (not run) a compiled body for ``platform`` from this CPU host; returns the StableHLO text.
    ``tree_window``: also pass a ``[q_len, tree_window]`` tree mask (speculative token trees)."""
    from jax import export

    dtype = BF16
    shapes = [
        jax.ShapeDtypeStruct((4, 4, 32, 128), dtype),  # q: llama-3-8b-like GQA 32 / 8, verify gamma 3
        jax.ShapeDtypeStruct((8, 64, 16, 128), dtype),  # k_pages
        jax.ShapeDtypeStruct((8, 64, 16, 128), dtype),  # v_pages
        jax.ShapeDtypeStruct((4, 16), jnp.int32),  # block_tables
        jax.ShapeDtypeStruct((4,), jnp.int32),  # context_lens
    ]
    if tree_window:
        shapes.append(jax.ShapeDtypeStruct((4, tree_window), jnp.bool_))
    fn = jax.jit(functools.partial(body, scale=128**-0.5, interpret=False, **kwargs))
    # The Triton custom call has no serialisation-compatibility guarantee; we only want the lowering.
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(fn, platforms=[platform], disabled_checks=checks)(*shapes).mlir_module()


def test_gpu_body_lowers_to_triton():
    """Runs the Pallas -> Triton IR lowering on CPU (needs jaxlib's Triton bindings); Triton compile is not run."""
    text = _lower_for("cuda", kernel_gpu.paged_attention_gpu)
    assert "__gpu$xla.gpu.triton" in text


def test_split_gpu_body_lowers_to_triton():
    """The split body (a fourth grid axis, a loop from a program-dependent start, three float32 outputs) lowers to
    Triton IR too, with and without a tree mask."""
    for tree_window in (0, 40):
        text = _lower_for("cuda", kernel_gpu.paged_attention_gpu, tree_window=tree_window, num_splits=4)
        assert "__gpu$xla.gpu.triton" in text and "_split4" in text


def test_tpu_body_lowers_to_mosaic():
    """Runs the Pallas -> Mosaic lowering on CPU; Mosaic's own TPU compile passes (layouts) are not run."""
    from kernels_pallas.paged_attention import kernel_tpu

    text = _lower_for("tpu", kernel_tpu.paged_attention_tpu)
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_bodies_lower_with_a_tree_mask(platform):
    """A 4-query tree step over a 40-key window (two bit words): the shifts and selects lower too."""
    from kernels_pallas.paged_attention import kernel_tpu

    body = kernel_gpu.paged_attention_gpu if platform == "cuda" else kernel_tpu.paged_attention_tpu
    text = _lower_for(platform, body, tree_window=40)
    assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text
    assert "_tree" in text  # the kernel's name marks the tree variant


def test_float32_products_ask_for_full_precision_in_kernel_and_reference():
    """On a GPU, XLA's default precision feeds float32 products TF32 inputs (~1e-3 off): the reference oracle and
    the kernel's dots must both ask for HIGHEST, or they disagree by more than the float32 tolerance (seen on an
    H200, 2026-12-04: every float32 case failed while the reference took the default). The reference computes in
    float32 for every input dtype; the kernel's bf16 dots keep the default (bf16 inputs are exact on tensor cores)."""
    highest = "precision=(Precision.HIGHEST, Precision.HIGHEST)"

    def jaxpr(fn, case) -> str:
        return str(jax.make_jaxpr(functools.partial(fn, scale=case.scale))(*case.args))

    f32 = make_case([5, 9], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=4)
    bf16 = make_case([5, 9], q_len=1, num_q_heads=4, num_kv_heads=2, page_size=4, dtype=BF16)
    kernel = functools.partial(paged_attention, backend="gpu")
    for fn, case in [(paged_attention_reference, f32), (paged_attention_reference, bf16), (kernel, f32)]:
        text = jaxpr(fn, case)
        assert text.count("dot_general[") == text.count(highest) == 2, text
    text = jaxpr(kernel, bf16)
    assert text.count("dot_general[") == 2 and highest not in text, text


def _pallas_gpu(**kw):
    return paged_attention(**kw, backend="gpu", interpret=True)


@pytest.mark.parametrize("attend", [paged_attention_reference, _pallas_gpu], ids=["reference", "pallas"])
@pytest.mark.parametrize("change, message", [
    # (silent before: the reference broadcast a short context_lens, and gathers clamp an id past the pool; the
    # Pallas body read page 0 for a context past its table)
    (lambda a: {**a, "context_lens": a["context_lens"][:1]}, "context_lens must be"),
    (lambda a: {**a, "v_pages": a["v_pages"][:, :2]}, "v_pages shape"),
    (lambda a: {**a, "block_tables": a["block_tables"].at[1, 0].set(99)}, r"block_tables\[1, 0\]=99 is out of range"),
    (lambda a: {**a, "block_tables": a["block_tables"].at[0, 0].set(-1)}, r"block_tables\[0, 0\]=-1 is out of range"),
    (lambda a: {**a, "context_lens": a["context_lens"].at[0].set(99)}, r"context_lens\[0\]=99 is out of range"),
    (lambda a: {**a, "context_lens": a["context_lens"].at[1].set(-3)}, r"context_lens\[1\]=-3 is out of range"),
    (lambda a: {**a, "q": a["q"][..., :0], "k_pages": a["k_pages"][..., :0], "v_pages": a["v_pages"][..., :0]},
     "head_dim .* is 0: must be at least 1"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "block_tables dtype"),
])
def test_every_implementation_checks_shapes_and_concrete_values(attend, change, message):
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    names = ("q", "k_pages", "v_pages", "block_tables", "context_lens")
    with pytest.raises(ValueError, match=message):
        attend(**change(dict(zip(names, case.args, strict=True))), scale=case.scale)


def test_padding_entries_are_not_checked_and_empty_inputs_give_zeros():
    """Entries past a context's pages are padding (any value); no rows or no keys: zeros, as the reference gives
    (the Pallas bodies raised on an empty grid)."""
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    q, k, v, table, ctx = case.args
    padded = table.at[0, 1:].set(12345)  # (sequence 0 holds one page)
    assert_close(paged_attention_reference(q, k, v, padded, ctx, scale=case.scale),
                 paged_attention_reference(*case.args, scale=case.scale))
    for args in ((q[:0], k, v, table[:0], ctx[:0]), (q, k, v, table[:, :0], jnp.zeros_like(ctx))):
        want = paged_attention_reference(*args, scale=case.scale)
        got = _pallas_gpu(**dict(zip(("q", "k_pages", "v_pages", "block_tables", "context_lens"), args, strict=True)),
                          scale=case.scale)
        assert got.shape == want.shape == args[0].shape and not np.asarray(got).any() and not np.asarray(want).any()


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_a_layer_past_the_stacked_pools_is_an_error(impl):
    """Indexing clamps: layer 7 of 2 read layer 1 without a word (the CPU kernel already refused it)."""
    from nightjar_jax.attention import paged_attention as attend

    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    q, k, v, table, ctx = case.args
    stacked_k, stacked_v = jnp.stack([k, k]), jnp.stack([v, v])
    with pytest.raises(ValueError, match=r"layer 7 of pools stacked over 2 layers: allowed 0 \.\. 1"):
        attend(q, stacked_k, stacked_v, table, ctx, scale=case.scale, impl=impl, layer=7)
    assert_close(attend(q, stacked_k, stacked_v, table, ctx, scale=case.scale, impl=impl, layer=1),
                 paged_attention_reference(*case.args, scale=case.scale))


def test_the_reference_takes_what_the_cpu_kernel_takes():
    """The reference computes in float32 whatever it is given, as the CPU kernel casts: numpy int64 tables and
    lengths, a numpy or jax scalar scale and a float16 q stay accepted (the shared checks refused them); the Pallas
    bodies keep their int32 / Python-float contract."""
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    q, k, v, table, ctx = case.args
    want = paged_attention_reference(*case.args, scale=case.scale)
    loose = paged_attention_reference(q, k, v, np.asarray(table, np.int64), np.asarray(ctx, np.int64),
                                      scale=jnp.float32(case.scale))
    assert_close(loose, want)
    half = paged_attention_reference(q.astype(jnp.float16), k, v, table, ctx, scale=np.float32(case.scale))
    assert half.dtype == jnp.float16
    with pytest.raises(ValueError, match="block_tables dtype must be int32"):
        paged_attention(q, k, v, jnp.asarray(table, jnp.int16), ctx, scale=case.scale, backend="gpu")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 1e39, True])
def test_every_impl_refuses_a_non_finite_scale(scale):
    """A NaN or infinite scale gave NaN on the reference and Pallas paths and zeros on the CPU kernel: each is now
    the same clear error."""
    from nightjar_jax.attention import paged_attention as dispatch
    from nightjar_jax.attention import resolve_impl

    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    impls = ["reference", "pallas"] + (["cpu"] if resolve_impl("auto") == "cpu" else [])
    for impl in impls:
        with pytest.raises(ValueError, match="scale must be a (finite float32|real) number"):
            dispatch(*case.args, scale=scale, impl=impl)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_gpu_body_loads_no_padding_entry_past_the_context(monkeypatch, num_splits):
    """Block-table entries past a context are padding and may hold anything (``validate_inputs`` checks only the
    pages a context covers). The body gathered all ``pages_per_block`` ids of its last iteration, so a compiled one
    loaded pages 1e6 or -7 pages off the pool; it now reads the last visible page's id instead (as the TPU body's
    index_map does). The ids the body loads, logged while interpreted, all lie in the pool, and the output stays."""
    case = make_case([3, 9, 6], q_len=2, num_q_heads=4, num_kv_heads=2, page_size=4)
    q, k, v, table, ctx = case.args
    num_pages = k.shape[1]
    garbage = np.array(table)
    for s, pages in enumerate(-(-np.asarray(ctx) // 4)):
        garbage[s, pages:] = [10**6, -7, 2**31 - 1, 5 * num_pages][: garbage.shape[1] - pages]
    seen = []
    load = kernel_gpu._load_pages

    def logged(pool_ref, ext_ref, page_ids):
        jax.debug.callback(lambda ids: seen.append(np.asarray(ids)), page_ids)
        return load(pool_ref, ext_ref, page_ids)

    monkeypatch.setattr(kernel_gpu, "_load_pages", logged)
    # __wrapped__: trace afresh (the jit cache may hold a body traced without the log)
    out = kernel_gpu.paged_attention_gpu.__wrapped__(q, k, v, jnp.asarray(garbage), ctx, scale=case.scale,
                                                     interpret=True, pages_per_block=4, num_splits=num_splits)
    out = np.asarray(out)
    jax.effects_barrier()
    ids = np.concatenate(seen)
    assert ids.size and ((ids >= 0) & (ids < num_pages)).all(), sorted(set(ids.tolist()))
    assert_close(jnp.asarray(out), paged_attention_reference(*case.args, scale=case.scale))


def test_visible_page_ids_repeat_the_last_visible_page():
    table = jnp.asarray([7, 3, 10**6, -7, 5, 9, 1, 2], jnp.int32)
    ids = kernel_gpu.visible_page_ids(table, jnp.int32(0), 4, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(ids), [7, 3, 3, 3])
    ids = kernel_gpu.visible_page_ids(table, jnp.int32(1), 4, jnp.int32(7))
    np.testing.assert_array_equal(np.asarray(ids), [5, 9, 1, 2])


def _tree_rows_case():
    case = make_case([6, 3], q_len=3, num_q_heads=2, num_kv_heads=1, page_size=4)
    mask = np.tril(np.ones((3, 3), bool))
    mask[0, :] = False  # row 0 allows no key; with context 3 (= M) the query sees nothing
    return case, mask


def test_a_tree_row_that_allows_no_key_is_refused_or_zero():
    """A concrete mask whose row allows no key at or before itself breaks the contract (ancestors and itself): the
    reference gave NaN where the context is the window and every kernel 0. Concrete: every implementation refuses
    it; traced (jit): the reference gives 0, as the kernels."""
    from kernels_pallas.paged_attention import cpu

    case, mask = _tree_rows_case()
    impls = [paged_attention_reference, functools.partial(paged_attention, backend="gpu")]
    if cpu.available():
        impls.append(cpu.paged_attention_cpu)
    for attend in impls:
        with pytest.raises(ValueError, match=r"tree_mask row 0 allows no key at or before its own column 0"):
            attend(*case.args, scale=case.scale, tree_mask=jnp.asarray(mask))
    outs = [np.asarray(jax.jit(lambda m, f=f: f(*case.args, scale=case.scale, tree_mask=m))(jnp.asarray(mask)))
            for f in impls]
    want = outs[0]
    assert np.isfinite(want).all() and not want[1, 0].any()  # sequence 1 (context 3 = M), query 0: zeros
    assert want[0, 0].any()  # sequence 0 still sees the keys before the window
    for got in outs[1:]:
        assert_close(jnp.asarray(got), jnp.asarray(want))


def test_a_tree_row_seeing_only_an_ancestor_is_accepted():
    case, mask = _tree_rows_case()
    mask[0, 0] = True
    mask[1, 1] = False  # row 1 sees its parent (column 0) only
    got = paged_attention(*case.args, scale=case.scale, tree_mask=jnp.asarray(mask), backend="gpu")
    assert_close(got, paged_attention_reference(*case.args, scale=case.scale, tree_mask=jnp.asarray(mask)))


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1)], ids=["f32", "f64", "i64"])
def test_pallas_takes_numpy_scalar_scales(scale):
    """A numpy real scale (the reference and the CPU kernel took it; the Pallas wrapper refused np.float32)."""
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    assert_close(paged_attention(*case.args, scale=scale, backend="gpu"),
                 paged_attention_reference(*case.args, scale=float(scale)))
    with pytest.raises(ValueError, match="scale must be a Python or numpy real number"):
        paged_attention(*case.args, scale="0.3", backend="gpu")
    with pytest.raises(ValueError, match="scale must be a finite float32 number"):
        paged_attention(*case.args, scale=np.float32("nan"), backend="gpu")


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_grad_through_the_pallas_bodies_is_a_clear_error(backend):
    """jax.grad failed deep inside Pallas with an empty AssertionError (GPU) or NotImplementedError (TPU); the
    forward pass (jit, vmap) is unchanged."""
    case = make_case([3, 5], q_len=1, num_q_heads=2, num_kv_heads=1, page_size=4)
    q, k, v, table, ctx = case.args
    attend = functools.partial(paged_attention, scale=case.scale, backend=backend)
    with pytest.raises(ValueError, match="not differentiable; use paged_attention_reference for gradients"):
        jax.grad(lambda x: attend(x, k, v, table, ctx).sum())(q)
    if backend == "gpu":
        want = paged_attention_reference(*case.args, scale=case.scale)
        assert_close(jax.jit(attend)(*case.args), want)
        batched = jax.vmap(lambda x: attend(x, k, v, table, ctx))(jnp.stack([q, 2 * q]))
        assert_close(batched[0], want)
