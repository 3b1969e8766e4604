"""What a lossy weight format costs in quality: teacher-forced next-token logits of the same model held two ways.

``weight_format="w4a8"`` (int8-quantized activations on the GGUF's 4-bit weights; kernels_pallas/linear/README.md)
changes the numbers the model computes; the exact formats (``auto``, ``compact``, ``f32``) do not. This script runs
every held-out chat prompt of ``eval_draft.py`` (MT-Bench / Spec-Bench ids never trained on) through both models as
one prefill and compares, at every position: the argmax (how often the greedy next token is the same), the KL
divergence of the candidate's next-token distribution from the reference's, and each model's perplexity on the
prompt's own next tokens (human-written text).

    python scripts/eval_weight_format.py                                   # w4a8 against auto, 28 prompts
    python scripts/eval_weight_format.py --candidate f32 --prompts 4       # a control: identical (KL 0)

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nightjar_jax.bench.common import (  # noqa: E402
    int_at_least,
    machine_note,
    positive_int,
    smollm2_model,
    writable_out,
    write_json,
)
from nightjar_jax.config import WEIGHT_FORMATS  # noqa: E402

PAGE = 16
BUCKET = 128  # prefill lengths padded to a multiple of this (few compiled shapes)
_FNS: dict[int, tuple] = {}  # graphdef id -> its jitted (hidden_fn, logits_fn)


def prefill_logits(handle, tokens: list[int]) -> np.ndarray:
    """Logits ``[len(tokens), V]`` of one prefill of ``tokens`` (padded at the end to a multiple of BUCKET: causal
    attention, so the real positions do not see the padding)."""
    import jax
    import jax.numpy as jnp

    from nightjar_jax.models.llama import BatchMetadata, allocate_kv_cache, make_model_fns

    n = len(tokens)
    padded = -(-n // BUCKET) * BUCKET
    fns = _FNS.get(id(handle))
    if fns is None:  # over the handle's leaves (a stacked state is rebuilt per layer inside, ModelHandle.unflatten)
        model_hidden, model_logits = make_model_fns(handle.graphdef)
        fns = _FNS[id(handle)] = (jax.jit(lambda leaves, *a: model_hidden(handle.unflatten(leaves), *a)),
                                  jax.jit(lambda leaves, h: model_logits(handle.unflatten(leaves), h)))
    hidden_fn, logits_fn = fns
    pages = padded // PAGE
    kv = allocate_kv_cache(handle.config, num_pages=pages + 1, page_size=PAGE)
    md = BatchMetadata(block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                       context_lens=jnp.asarray([padded], jnp.int32))
    ids = jnp.asarray([tokens + [0] * (padded - n)], jnp.int32)
    hidden, _ = hidden_fn(handle.leaves(), ids, kv, md)
    return np.asarray(logits_fn(handle.leaves(), hidden))[0, :n]


def held_as(state) -> list[str]:
    """How a model's packed linear weights are held: ``w4a8``, ``q4`` (exact 4-bit), or the panels' dtype."""
    import jax

    from kernels_pallas.linear import cpu

    return sorted({"w4a8" if cpu.is_w4a8(w) else "q4" if cpu.is_q4(w) else str(w.dtype)
                   for w in jax.tree.leaves(state) if cpu.is_packed(w)})


def compare(ref: np.ndarray, cand: np.ndarray, tokens: list[int]) -> dict:
    """Per-position comparison of two logit arrays ``[n, V]`` (float64 softmax)."""
    lr = ref.astype(np.float64) - ref.max(axis=1, keepdims=True)
    lc = cand.astype(np.float64) - cand.max(axis=1, keepdims=True)
    lpr = lr - np.log(np.exp(lr).sum(axis=1, keepdims=True))
    lpc = lc - np.log(np.exp(lc).sum(axis=1, keepdims=True))
    kl = (np.exp(lpr) * (lpr - lpc)).sum(axis=1)
    nxt = np.asarray(tokens[1:])
    return {"positions": len(tokens), "argmax_equal": int((ref.argmax(1) == cand.argmax(1)).sum()),
            "kl_sum": float(kl.sum()), "kl_max": float(kl.max()),
            "nll_ref_sum": float(-lpr[np.arange(len(nxt)), nxt].sum()),
            "nll_cand_sum": float(-lpc[np.arange(len(nxt)), nxt].sum()), "next_tokens": len(nxt),
            "max_abs_logit_diff": float(np.abs(ref - cand).max())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", type=smollm2_model,
                    help="a model with SmolLM2's tokenizer (the prompts are SmolLM2 token ids)")
    ap.add_argument("--reference", default="auto", choices=WEIGHT_FORMATS)
    ap.add_argument("--candidate", default="w4a8", choices=WEIGHT_FORMATS)
    ap.add_argument("--prompts", type=positive_int, default=28, help="held-out chat prompts (eval_draft.py's)")
    ap.add_argument("--max-prompt-tokens", type=int_at_least(2), default=512,
                    help="longer held-out prompts are skipped (>= 2: a prompt's next tokens are compared)")
    ap.add_argument("--out", default="results/eval_weight_format.json", type=writable_out)
    args = ap.parse_args(argv)
    if args.reference == args.candidate:
        ap.error(f"argument --candidate: {args.candidate} is the --reference too: compare two different formats")
    return args


def main() -> None:
    args = parse_args()

    from distill_draft import chat_ids, load_prompts, target_tokenizer

    from nightjar_jax import LLM

    tok = target_tokenizer()
    prompts = [ids for ids in (chat_ids(tok, p["text"]) for p in load_prompts("heldout"))
               if 2 <= len(ids) <= args.max_prompt_tokens][: args.prompts]
    if not prompts:
        raise SystemExit(f"no held-out prompt fits in --max-prompt-tokens {args.max_prompt_tokens}: nothing to compare")
    if len(prompts) < args.prompts:  # (the JSON's "prompts" says how many ran)
        print(f"note: {len(prompts)} held-out prompts fit in --max-prompt-tokens {args.max_prompt_tokens}, fewer "
              f"than --prompts {args.prompts}: comparing those", file=sys.stderr)
    handles = {}
    for fmt in (args.reference, args.candidate):
        llm = LLM(args.model, draft_model=None, weight_format=fmt, max_model_len=args.max_prompt_tokens + BUCKET)
        handles[fmt] = llm.engine.runner.target
    held = {f: held_as(h.model_state()) for f, h in handles.items()}
    rows = [compare(prefill_logits(handles[args.reference], ids), prefill_logits(handles[args.candidate], ids), ids)
            for ids in prompts]
    pos = sum(r["positions"] for r in rows)
    nxt = sum(r["next_tokens"] for r in rows)
    summary = {
        "prompts": len(rows), "positions": pos,
        "argmax_agreement": sum(r["argmax_equal"] for r in rows) / pos,
        "mean_kl": sum(r["kl_sum"] for r in rows) / pos,
        "max_kl": max(r["kl_max"] for r in rows),
        "perplexity_reference": float(np.exp(sum(r["nll_ref_sum"] for r in rows) / nxt)),
        "perplexity_candidate": float(np.exp(sum(r["nll_cand_sum"] for r in rows) / nxt)),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
    }
    print(f"{args.model}: {args.candidate} (linear layers held as {held[args.candidate]}) against {args.reference} "
          f"({held[args.reference]}), {len(rows)} held-out chat prompts, {pos} positions, teacher-forced")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| next-token argmax equal | {summary['argmax_agreement']:.4f} |")
    print(f"| mean KL(reference ‖ candidate), nats | {summary['mean_kl']:.2e} |")
    print(f"| largest KL at one position | {summary['max_kl']:.2e} |")
    print(f"| perplexity on the prompts' own next tokens: reference / candidate | "
          f"{summary['perplexity_reference']:.3f} / {summary['perplexity_candidate']:.3f} |")
    print(f"| largest logit difference | {summary['max_abs_logit_diff']:.3f} |")
    write_json(args.out, {"machine": machine_note(), "args": vars(args), "held_as": held, "summary": summary,
                          "per_prompt": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
