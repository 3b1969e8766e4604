"""One-call device check of the paged attention kernels: correctness vs the reference, time, achieved bandwidth.

On a GPU: for decode (q_len 1), verify (q_len 4, 8) and prefill chunks (q_len 256, 512) at llama-7b (MHA 32/32)
and llama-3-8b (GQA 32/8) head shapes, bf16, page size 16 / 32, batch 1..64, context 512..4096 (mixed lengths in
a batch), it checks ``paged_attention`` (GPU body, compiled) against ``paged_attention_reference`` on a pool whose
unwritten slots are NaN, times both, and for q_len 1 also times ``jax.experimental.pallas.ops.gpu.paged_attention``.
Where ``num_splits=0`` (keys split across programs, the count chosen from the grid's size) would split, that
variant is checked and timed too (``split_us`` / its split count). So is every case with the pool cut in two, the
upper half as an extension pool (elastic memory: the kernel reads each page from the pool holding it; ``ext_us``).

Timing: one jitted executable runs the kernel ``calls_per_run`` times on distinct q slices (one dispatch, nothing
to CSE or hoist); the time of a call is the median over ``runs`` runs after warm-up, divided by
``calls_per_run`` (host wall clock around ``block_until_ready``, so it includes one launch gap per run).

Bandwidth: bytes the call must move = the K and V of the pages holding each sequence's context (whole pages) +
q + output; achieved GB/s = bytes / time, reported as a fraction of the copy bandwidth measured here (``2 * x``
over a 2 GiB array: read + write). Prefill re-reads K/V per q block and is compute-bound, so its fraction is a
lower bound of little meaning; its TFLOP/s is reported too.

``--smoke``: tiny shapes, interpreted on CPU, labelled "cpu-interpret smoke" -- checks only that this runs.
Prints a table; writes JSON (``--out``). Budgeted to < 8 minutes on an H200 (``--budget-s``; cases past the
budget are recorded as skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas.paged_attention import (  # noqa: E402
    import_pallas_backends,
    paged_attention,
    paged_attention_reference,
)
from kernels_pallas.paged_attention.kernel_gpu import GPU_TUNING_DEFAULTS, split_plan  # noqa: E402
from kernels_pallas.paged_attention.layout import QueryBlocking  # noqa: E402
from nightjar_jax.bench.common import positive_float, writable_out  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max abs error vs the reference (outputs are O(1))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_context: int  # longest context in the batch; others are drawn from [max(q_len, max_context // 2), max]
    dtype: str = "bfloat16"


def gpu_cases() -> list[Case]:
    mha = {"num_q_heads": 32, "num_kv_heads": 32, "head_dim": 128}  # llama-7b
    gqa = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}  # llama-3-8b
    return [
        Case("decode mha b1", 1, 1, **mha, page_size=16, max_context=4096),
        Case("decode mha b8", 8, 1, **mha, page_size=16, max_context=2048),
        Case("decode mha b64", 64, 1, **mha, page_size=16, max_context=1024),
        Case("decode gqa b1", 1, 1, **gqa, page_size=16, max_context=4096),
        Case("decode gqa b16", 16, 1, **gqa, page_size=16, max_context=2048),
        Case("decode gqa b64", 64, 1, **gqa, page_size=16, max_context=512),
        Case("decode gqa b32 ps32", 32, 1, **gqa, page_size=32, max_context=1024),
        Case("verify gqa b16 q4", 16, 4, **gqa, page_size=16, max_context=2048),
        Case("verify gqa b16 q8", 16, 8, **gqa, page_size=16, max_context=2048),
        Case("verify mha b8 q4", 8, 4, **mha, page_size=16, max_context=2048),
        Case("prefill gqa b4 q256", 4, 256, **gqa, page_size=16, max_context=512),
        Case("prefill gqa b2 q512", 2, 512, **gqa, page_size=16, max_context=4096),
    ]


def smoke_cases() -> list[Case]:
    return [
        Case("smoke decode gqa", 3, 1, 4, 2, 32, page_size=4, max_context=13, dtype="float32"),
        Case("smoke verify mha", 2, 4, 2, 2, 32, page_size=8, max_context=20),
        Case("smoke prefill gqa", 2, 16, 4, 1, 32, page_size=8, max_context=30),
    ]


def make_inputs(case: Case, seed: int = 0, pages_multiple: int = 16):
    """Shuffled pages, NaN in page 0 and every unwritten slot; block tables padded to ``pages_multiple``."""
    rng = np.random.default_rng(seed)
    low = max(case.q_len, case.max_context // 2)
    context_lens = rng.integers(low, case.max_context + 1, size=case.batch).astype(np.int32)
    context_lens[0] = case.max_context
    pages_needed = -(-context_lens // case.page_size)
    max_pages = -(-int(pages_needed.max()) // pages_multiple) * pages_multiple
    num_pages = 1 + int(pages_needed.sum())
    page_ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    block_tables = np.zeros((case.batch, max_pages), np.int32)
    written = np.zeros((num_pages, case.page_size), bool)
    offset = 0
    for seq in range(case.batch):
        n = int(pages_needed[seq])
        block_tables[seq, :n] = page_ids[offset : offset + n]
        offset += n
        slots = np.arange(int(context_lens[seq]))
        written[block_tables[seq, slots // case.page_size], slots % case.page_size] = True

    dtype = jnp.dtype(case.dtype)
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (case.num_kv_heads, num_pages, case.page_size, case.head_dim)
    mask = jnp.asarray(written)[None, :, :, None]
    k_pages = jnp.where(mask, jax.random.normal(keys[0], shape, dtype), jnp.nan).astype(dtype)
    v_pages = jnp.where(mask, jax.random.normal(keys[1], shape, dtype), jnp.nan).astype(dtype)
    q = jax.random.normal(keys[2], (case.batch, case.q_len, case.num_q_heads, case.head_dim), dtype)
    return q, k_pages, v_pages, jnp.asarray(block_tables), jnp.asarray(context_lens)


def bytes_moved(case: Case, context_lens: np.ndarray) -> int:
    itemsize = jnp.dtype(case.dtype).itemsize
    pages = int((-(-context_lens // case.page_size)).sum())
    kv = 2 * pages * case.num_kv_heads * case.page_size * case.head_dim * itemsize
    q_and_out = 2 * case.batch * case.q_len * case.num_q_heads * case.head_dim * itemsize
    return kv + q_and_out


def attention_flops(case: Case, context_lens: np.ndarray) -> float:
    """2 matmuls x 2 flops per causal (query, key) pair x head_dim x q heads."""
    pairs = sum(
        sum(min(int(n), int(n) - case.q_len + i + 1) for i in range(case.q_len) if n - case.q_len + i >= 0)
        for n in context_lens
    )
    return 4.0 * pairs * case.head_dim * case.num_q_heads


def time_call(fn, q, rest, *, calls_per_run: int, runs: int, warmup: int = 2) -> float:
    """Median seconds per call; each run is one executable calling ``fn`` on ``calls_per_run`` q variants."""
    qs = jnp.stack([q * (1 + i / 64) for i in range(calls_per_run)]).astype(q.dtype)

    @jax.jit
    def many(qs, *rest):
        return [fn(qs[i], *rest) for i in range(calls_per_run)]

    for _ in range(warmup):
        jax.block_until_ready(many(qs, *rest))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(many(qs, *rest))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / calls_per_run


def copy_bandwidth(num_bytes: int, runs: int) -> float:
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    double = jax.jit(lambda x: x * 2)
    jax.block_until_ready(double(x))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(double(x))
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


def pallas_ops_decode(q, k_pages, v_pages, block_tables, context_lens, *, interpret: bool):
    """``jax.experimental.pallas.ops.gpu.paged_attention`` on our layout (q_len 1 only; it takes [batch, heads, d])."""
    from jax.experimental.pallas.ops.gpu import paged_attention as ops_paged_attention

    out = ops_paged_attention.paged_attention(
        q[:, 0] * q.shape[-1] ** -0.5, k_pages, v_pages, block_tables, context_lens, interpret=interpret
    )  # it has no scale argument: fold the scale into q
    return out[:, None]


def run_case(case: Case, *, interpret: bool, calls_per_run: int, runs: int, copy_bw: float) -> dict:
    q, k_pages, v_pages, block_tables, context_lens = make_inputs(case)
    scale = case.head_dim**-0.5
    lens = np.asarray(context_lens)
    kernel = functools.partial(paged_attention, scale=scale, backend="gpu", interpret=interpret)
    reference = jax.jit(functools.partial(paged_attention_reference, scale=scale))
    rest = (k_pages, v_pages, block_tables, context_lens)
    row = dataclasses.asdict(case)
    expected = reference(q, *rest).astype(jnp.float32)
    actual = jax.jit(kernel)(q, *rest).astype(jnp.float32)
    row["max_abs_err"] = float(jnp.max(jnp.abs(actual - expected)))
    row["nan_outputs"] = int(jnp.isnan(actual).sum())
    row["ok"] = row["nan_outputs"] == 0 and row["max_abs_err"] <= TOLERANCE[case.dtype]
    row["bytes"] = bytes_moved(case, lens)
    row["kernel_s"] = time_call(kernel, q, rest, calls_per_run=calls_per_run, runs=runs)
    row["reference_s"] = time_call(reference, q, rest, calls_per_run=calls_per_run, runs=runs)
    row["kernel_GBps"] = row["bytes"] / row["kernel_s"] / 1e9
    row["kernel_bw_fraction"] = row["kernel_GBps"] * 1e9 / copy_bw
    row["kernel_TFLOPs"] = attention_flops(case, lens) / row["kernel_s"] / 1e12
    # keys split across programs (num_splits=0: chosen from the grid's size), where that choice splits at all
    blocking = QueryBlocking.choose(case.q_len, case.num_q_heads // case.num_kv_heads,
                                    GPU_TUNING_DEFAULTS["block_rows"])
    max_iterations = -(-block_tables.shape[1] // GPU_TUNING_DEFAULTS["pages_per_block"])
    _, row["split_num_splits"] = split_plan(case.batch, case.num_kv_heads, blocking, max_iterations, 0)
    if row["split_num_splits"] > 1:
        split = functools.partial(kernel, num_splits=0)
        split_out = jax.jit(split)(q, *rest).astype(jnp.float32)
        row["split_max_abs_err"] = float(jnp.max(jnp.abs(split_out - expected)))
        row["split_ok"] = not bool(jnp.isnan(split_out).any()) and row["split_max_abs_err"] <= TOLERANCE[case.dtype]
        row["ok"] = row["ok"] and row["split_ok"]
        row["split_s"] = time_call(split, q, rest, calls_per_run=calls_per_run, runs=runs)
    # the same pages as a base pool and an extension pool after it (elastic memory), read in place
    half = k_pages.shape[1] // 2
    ext_rest = (k_pages[:, :half], v_pages[:, :half], block_tables, context_lens)
    ext_kernel = functools.partial(kernel, k_ext=k_pages[:, half:], v_ext=v_pages[:, half:])
    ext_out = jax.jit(ext_kernel)(q, *ext_rest).astype(jnp.float32)
    row["ext_max_abs_err"] = float(jnp.max(jnp.abs(ext_out - expected)))
    row["ext_ok"] = not bool(jnp.isnan(ext_out).any()) and row["ext_max_abs_err"] <= TOLERANCE[case.dtype]
    row["ok"] = row["ok"] and row["ext_ok"]
    row["ext_s"] = time_call(ext_kernel, q, ext_rest, calls_per_run=calls_per_run, runs=runs)
    if case.q_len == 1:
        try:
            ops = jax.jit(functools.partial(pallas_ops_decode, interpret=interpret))
            # It masks scores but multiplies probabilities into V, so NaN in unwritten slots leaks (seen on CPU
            # with jax 0.10.2): record that, then compare and time it on a pool with those slots zeroed.
            row["pallas_ops_nan_outputs_on_nan_pool"] = int(jnp.isnan(ops(q, *rest)).sum())
            zeroed = (jnp.nan_to_num(k_pages), jnp.nan_to_num(v_pages), block_tables, context_lens)
            ops_out = ops(q, *zeroed).astype(jnp.float32)
            row["pallas_ops_max_abs_err"] = float(jnp.max(jnp.abs(ops_out - expected)))
            row["pallas_ops_s"] = time_call(ops, q, zeroed, calls_per_run=calls_per_run, runs=runs)
            row["pallas_ops_bw_fraction"] = row["bytes"] / row["pallas_ops_s"] / copy_bw
        except Exception as error:  # a jax version whose ops kernel differs must not stop the check
            row["pallas_ops_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def print_table(rows: list[dict], label: str, copy_bw: float) -> None:
    print(f"\n== paged attention device check: {label} | copy bandwidth {copy_bw / 1e9:.1f} GB/s ==")
    header = (
        f"{'case':24} {'ok':>3} {'max_err':>8} {'kernel_us':>10} {'GB/s':>8} {'bw_frac':>7} {'TFLOP/s':>7} "
        f"{'ref_us':>9} {'ops_us':>9} {'ops_frac':>8} {'split_us':>12} {'ext_us':>9}"
    )
    print(header)
    for row in rows:
        if "error" in row or "skipped" in row:
            print(f"{row['name']:24} {row.get('error', row.get('skipped'))}")
            continue
        ops_us = f"{row['pallas_ops_s'] * 1e6:9.1f}" if "pallas_ops_s" in row else f"{'-':>9}"
        ops_frac = f"{row['pallas_ops_bw_fraction']:8.2f}" if "pallas_ops_s" in row else f"{'-':>8}"
        split_us = (f"{row['split_s'] * 1e6:8.1f} /{row['split_num_splits']:>2}" if "split_s" in row
                    else f"{'-':>12}")
        print(
            f"{row['name']:24} {'yes' if row['ok'] else 'NO':>3} {row['max_abs_err']:8.1e} "
            f"{row['kernel_s'] * 1e6:10.1f} {row['kernel_GBps']:8.1f} {row['kernel_bw_fraction']:7.2f} "
            f"{row['kernel_TFLOPs']:7.2f} {row['reference_s'] * 1e6:9.1f} {ops_us} {ops_frac} {split_us} "
            f"{row['ext_s'] * 1e6:9.1f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted, for CPU")
    parser.add_argument("--out", default="device_check_results.json", type=writable_out)
    parser.add_argument("--budget-s", type=positive_float, default=420.0,
                        help="skip cases that would start after this many seconds (> 0)")
    return parser.parse_args(argv)


def all_ok(rows: list[dict]) -> bool:
    """Every case that ran passed, and at least one ran (a run whose every case was skipped checked nothing)."""
    ran = [row for row in rows if "skipped" not in row]
    return bool(ran) and all(row.get("ok", False) for row in ran)


def main() -> int:
    args = parse_args()

    started = time.perf_counter()
    imported = import_pallas_backends()
    backend = jax.default_backend()
    if args.smoke:
        label, cases, interpret, calls_per_run, runs, copy_bytes = (
            "cpu-interpret smoke",
            smoke_cases(),
            True,
            2,
            3,
            2**24,
        )
    elif backend == "gpu":
        label, cases, interpret, calls_per_run, runs, copy_bytes = "gpu compiled", gpu_cases(), False, 10, 15, 2**31
    else:
        print(f"default backend is {backend!r}: this check needs a GPU (or --smoke)", file=sys.stderr)
        return 2

    copy_bw = copy_bandwidth(copy_bytes, runs=max(runs, 10))
    rows = []
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            rows.append({**dataclasses.asdict(case), "skipped": f"time budget {args.budget_s:.0f}s spent"})
            continue
        try:
            rows.append(run_case(case, interpret=interpret, calls_per_run=calls_per_run, runs=runs, copy_bw=copy_bw))
            print(f"{case.name}: ok={rows[-1]['ok']} err={rows[-1]['max_abs_err']:.1e} "
                  f"{rows[-1]['kernel_s'] * 1e6:.1f} us ({time.perf_counter() - started:.0f} s)", flush=True)
        except Exception as error:
            traceback.print_exc()
            rows.append({**dataclasses.asdict(case), "ok": False, "error": f"{type(error).__name__}: {error}"[:500]})
    print_table(rows, label, copy_bw)

    result = {
        "label": label,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "devices": [str(d) for d in jax.devices()],
        "pallas_backends_imported": imported,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "elapsed_s": time.perf_counter() - started,
        "all_ok": all_ok(rows),
        "cases": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not any("skipped" not in row for row in rows):
        print("no case ran within --budget-s: nothing was checked", file=sys.stderr)
    print(f"\nall_ok={result['all_ok']} elapsed={result['elapsed_s']:.1f}s -> {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
