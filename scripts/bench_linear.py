"""CPU linear kernel vs XLA's dot inside a whole decode step (what ``linear_impl="auto"`` chooses from).

For each row count (batch x query slots: a decode batch of B sequences, or one sequence verifying γ + 1 slots), one
jitted forward + LM-head step of the model is timed with ``linear_impl="xla"`` and with ``"cpu"`` (every product on
the kernel), interleaved, ``--repeats`` times each; the median is kept. Prints a table and writes JSON.

    python scripts/bench_linear.py --rows 1,2,3,4,5,6,8,12,16,32

The ratio (xla / cpu > 1: the kernel is faster) is what sets ``NN_ROWS`` in ``kernels_pallas/linear/cpu.py``.

``--products-only`` times the step's linear layers alone (every layer's q/k/v, o_proj, MLP and the head as the model
dispatches them, attention replaced by its query), against a JAX read of the same number of bytes, interleaved: how
close the products come to the memory bandwidth (one row) or the FMA rate (more rows).

    python scripts/bench_linear.py --products-only --rows 1,5,12

Weights are random (``load_format=dummy`` shapes of the preset); timings do not depend on their values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    int_list,
    machine_note,
    model_spec,
    non_negative_int,
    positive_int,
    writable_out,
    write_json,
)
from nightjar_jax.linear import pack_state  # noqa: E402
from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, init_model, make_model_fns  # noqa: E402
from nightjar_jax.models.presets import get_preset  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", type=model_spec, help="a preset")
    p.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32", type=int_list(1, as_text=True),
                   help="decode batch sizes (one query slot each)")
    p.add_argument("--verify", default="2,3,5", type=int_list(1, allow_empty=True, as_text=True),
                   help="query slots of one sequence (γ + 1), verify-shaped ('' for none)")
    p.add_argument("--context", type=non_negative_int, default=64, help="tokens already in each sequence's cache")
    p.add_argument("--repeats", type=positive_int, default=12, help="timed runs per shape (the median is kept)")
    p.add_argument("--products-only", action="store_true",
                   help="time the linear layers alone (no attention) against a read of their bytes")
    p.add_argument("--kernel-impl", default="cpu", choices=("cpu", "auto"),
                   help="the kernel side: every product on the kernel (cpu) or what auto dispatch picks")
    p.add_argument("--out", default="results/bench_linear.json", type=writable_out)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    cfg = get_preset(args.model).config
    if cfg.dtype != "float32":
        cfg = dataclasses.replace(cfg, dtype="float32")  # the kernel is float32-only
    if args.products_only:
        products_only(cfg, args)
        return
    steps = {}
    for impl in ("xla", "cpu"):
        graphdef, state = init_model(cfg, seed=0, linear_impl=args.kernel_impl if impl == "cpu" else impl)
        if impl == "cpu":  # the weights as the engine holds them (packed panels where the kernel takes them)
            state = pack_state(state, args.kernel_impl)
        hidden_fn, logits_fn = make_model_fns(graphdef)

        def step(state, tokens, kv, md, hidden_fn=hidden_fn, logits_fn=logits_fn):
            hidden, kv = hidden_fn(state, tokens, kv, md)
            return logits_fn(state, hidden), kv

        steps[impl] = (jax.jit(step, donate_argnums=2), state)
    shapes = [(b, 1) for b in map(int, args.rows.split(","))] + [(1, int(q)) for q in args.verify.split(",")
                                                                  if q.strip()]
    page = 16
    rows = []
    print(f"# {machine_note()['date']}  model {args.model}  context {args.context}  repeats {args.repeats}")
    print("| shape (seqs x slots) | rows | XLA dot ms | kernel ms | XLA / kernel |")
    print("|---|---:|---:|---:|---:|")
    for seqs, slots in shapes:
        pages_per_seq = (args.context + slots + page - 1) // page
        kv = {impl: allocate_kv_cache(cfg, num_pages=seqs * pages_per_seq + 1, page_size=page) for impl in steps}
        tokens = jnp.ones((seqs, slots), jnp.int32)
        tables = np.arange(1, seqs * pages_per_seq + 1, dtype=np.int32).reshape(seqs, pages_per_seq)
        md = BatchMetadata(block_tables=jnp.asarray(tables), context_lens=jnp.full((seqs,), args.context + slots,
                                                                                   jnp.int32))
        times = {impl: [] for impl in steps}
        for r in range(args.repeats + 2):  # the first two: compile and warm up
            for impl, (fn, state) in steps.items():
                t0 = time.perf_counter()
                out, kv[impl] = fn(state, tokens, kv[impl], md)
                out.block_until_ready()
                if r >= 2:
                    times[impl].append(time.perf_counter() - t0)
        xla_ms, cpu_ms = (1e3 * float(np.median(times[i])) for i in ("xla", "cpu"))
        rows.append({"seqs": seqs, "slots": slots, "rows": seqs * slots, "xla_ms": xla_ms, "kernel_ms": cpu_ms})
        print(f"| {seqs} x {slots} | {seqs * slots} | {xla_ms:.1f} | {cpu_ms:.1f} | {xla_ms / cpu_ms:.2f}x |",
              flush=True)
    write_json(args.out, {"args": vars(args), "machine": machine_note(), "rows": rows})
    print(f"wrote {args.out}")


def products_fn(graphdef):
    """The model's linear layers in a decode step's order and dispatch (``DecoderLayer.first_qkv`` and
    ``after_attention``, as ``forward`` calls them), attention replaced by its query: ``x [rows, hidden]`` -> logits."""

    def run(state, x):
        model = nnx.merge(graphdef, state)
        layers = list(model.layers)
        qkv = layers[0].first_qkv(x)
        for i, layer in enumerate(layers):
            x, qkv = layer.after_attention(qkv[0], x, layers[i + 1] if i + 1 < len(layers) else None)
        return model.logits(model.norm(x))

    return jax.jit(run)


def products_only(cfg, args) -> None:
    fns = {}
    for impl in ("xla", "cpu"):
        graphdef, state = init_model(cfg, seed=0, linear_impl=args.kernel_impl if impl == "cpu" else impl)
        if impl == "cpu":
            state = pack_state(state, args.kernel_impl)
        fns[impl] = (products_fn(graphdef), state)
    state = fns["cpu"][1]
    nbytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(state) if a.ndim >= 2)
    flat = jnp.ones(nbytes // 4, jnp.float32)
    read = jax.jit(jnp.sum)
    rows = []
    print(f"# {machine_note()['date']}  model {args.model}  products only  weights {nbytes / 1e6:.0f} MB  "
          f"repeats {args.repeats}")
    print("| rows | XLA dot ms | kernel ms | read ms | XLA / kernel | kernel / read |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in map(int, args.rows.split(",")):
        x = jnp.full((m, cfg.hidden_size), 0.1, jnp.float32)
        times = {"xla": [], "cpu": [], "read": []}
        for r in range(args.repeats + 2):  # the first two: compile and warm up
            for name in times:
                t0 = time.perf_counter()
                out = read(flat) if name == "read" else fns[name][0](fns[name][1], x)
                out.block_until_ready()
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
        ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        rows.append({"rows": m, "xla_ms": ms["xla"], "kernel_ms": ms["cpu"], "read_ms": ms["read"],
                     "weight_bytes": nbytes})
        print(f"| {m} | {ms['xla']:.2f} | {ms['cpu']:.2f} | {ms['read']:.2f} | {ms['xla'] / ms['cpu']:.2f}x | "
              f"{ms['cpu'] / ms['read']:.2f}x |", flush=True)
    write_json(args.out, {"args": vars(args), "machine": machine_note(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
