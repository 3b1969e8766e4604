"""Fit a static speculative token tree for a feature draft (``nightjar_jax/spec/tree.py``), and replay it offline.

For every start slot ``c`` of a target-greedy sequence, the draft's unrolled chain along that sequence
(``distill_eagle.ttt_forward``, the same inputs the engine's tree gives the branch that matches the target) ranks
the target's token at each depth ``j``: the rank path ``(r1, .., rj)`` is the tree node the target's continuation
passes through. A tree commits, per decode step, the longest prefix of that path it contains, so its expected
accepted length is the sum over its nodes of how often the path passes through them, and adding nodes in order of
decreasing frequency (parents before children) gives the best tree of every size for that data.

``fit`` counts rank paths on the draft's validation split (training data, never the held-out prompts) and writes the
order ``spec/tree.py`` loads; ``replay`` measures trees of several sizes on the held-out prompts' target-greedy
responses (an ``eval_draft.py`` result), stepping like the engine (greedy, the longest accepted branch + one
target token per step)::

    python scripts/fit_spec_tree.py fit --workdir runs/eagle/wd7 --data runs/eagle3data/data.jsonl \\
        --features runs/eagle/features --out nightjar_jax/spec/default_tree.json
    python scripts/fit_spec_tree.py replay --workdir runs/eagle/wd7 --reference results/eval_draft_eagle4b.json
    # a fitted order instead of the shipped one (fit's --out; serve's --spec-tree-file):
    python scripts/fit_spec_tree.py replay --workdir runs/eagle/wd7 --reference results/eval_draft_eagle4b.json \\
        --tree-file runs/eagle/tree.json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import distill_draft as dd  # noqa: E402
import distill_eagle as de  # noqa: E402

from nightjar_jax.bench.common import (  # noqa: E402
    existing_file,
    int_list,
    make_parent,
    non_negative_int,
    positive_int,
    writable_out,
)
from nightjar_jax.spec.tree import chain_paths, load_tree_order  # noqa: E402

logger = logging.getLogger("fit_spec_tree")
NOT_IN_HEAD = 10**6  # the rank of a token the draft's subset head cannot propose


def rank_paths(ranks: np.ndarray, start: int, end: int, c: int) -> tuple[int, ...]:
    """The target's rank path from start slot ``c``: ``ranks[j, c + j]`` for depths ``j + 1`` while in range."""
    return tuple(int(ranks[j, c + j]) for j in range(ranks.shape[0]) if c + j < end)


def path_counts(records: list[dict[str, Any]]) -> collections.Counter:
    """How often the target's continuation passes through each rank path, over every start slot."""
    counts: collections.Counter = collections.Counter()
    for r in records:
        for c in range(r["start"], r["end"]):
            p = rank_paths(r["ranks"], r["start"], r["end"], c)
            for k in range(1, len(p) + 1):
                if p[k - 1] >= NOT_IN_HEAD:
                    break
                counts[p[:k]] += 1
    return counts


def greedy_order(counts: collections.Counter, max_nodes: int, max_rank: int) -> list[tuple[int, ...]]:
    """Rank paths by decreasing count among those whose parent is already taken (so every prefix of the result is
    prefix-closed and, counts falling along a path, the best tree of its size for these counts)."""
    order: list[tuple[int, ...]] = []
    taken = set()
    frontier = {p for p in counts if len(p) == 1 and p[0] < max_rank}
    while frontier and len(order) < max_nodes:
        best = max(frontier, key=lambda p: (counts[p], -len(p), tuple(-r for r in p)))
        frontier.discard(best)
        order.append(best)
        taken.add(best)
        frontier |= {p for p in counts if len(p) == len(best) + 1 and p[:-1] == best and p[-1] < max_rank}
    return order


def replay(records: list[dict[str, Any]], tree: set[tuple[int, ...]]) -> tuple[int, int]:
    """Greedy decode steps over the records with this tree: (target steps, accepted drafts)."""
    steps = accepted = 0
    for r in records:
        c = r["start"]
        while c < r["end"]:
            p = rank_paths(r["ranks"], r["start"], r["end"], c)
            k = 0
            while k < len(p) and p[: k + 1] in tree:
                k += 1
            steps += 1
            accepted += k
            c += k + 1
    return steps, accepted


class DraftRanker:
    """The draft's ranks of a sequence's tokens at every depth, from the target's features."""

    def __init__(self, workdir: Path, params: str, depths: int):
        import jax
        import jax.numpy as jnp

        from nightjar_jax.config import ModelConfig

        self.cfg = ModelConfig(**json.loads((workdir / "draft_config.json").read_text()))
        z = np.load(workdir / f"{params}_params.npz")
        self.params = {k: jnp.asarray(z[k]) for k in z.files}
        head_ids = np.load(workdir / "head_token_ids.npy")
        self.tcfg, self.tparams = dd.target_params()
        self.head_index = np.full(self.tcfg.vocab_size, -1, np.int64)
        self.head_index[head_ids] = np.arange(len(head_ids))
        cfg, p, table = self.cfg, self.params, self.tparams["model.embed_tokens.weight"]

        @jax.jit
        def logits(tokens, h):
            outs = de.ttt_forward(cfg, p, table[tokens], h, depths)
            return jnp.stack([o @ p["lm_head.weight"].T for o in outs])  # [depths, B, T, head]

        self._logits = logits
        layers = self.cfg.feature_layers or ()  # a fused draft reads more of the target's layers
        self._hidden = jax.jit(lambda t: dd.causal_forward(self.tcfg, self.tparams, t, return_hidden=True,
                                                           hidden_layers=layers))

    def ranks(self, seq: np.ndarray, start: int, h: np.ndarray | None = None) -> np.ndarray:
        """``[depths, len(seq)]``: at slot ``p`` the rank of ``seq[p + 1]`` in the depth-``j`` logits (slots from
        ``start``; ``NOT_IN_HEAD`` elsewhere or where the head lacks the token). ``h``: stored target features."""
        import jax.numpy as jnp

        t = dd.bucket_of({"tokens": seq})
        tokens = np.zeros((1, t), np.int32)
        tokens[0, : len(seq)] = seq
        if h is None:
            feats = self._hidden(jnp.asarray(tokens))
        else:
            feats = np.zeros((1, t, self.tcfg.hidden_size), np.float32)
            feats[0, : len(seq)] = h.astype(np.float32)
        lg = np.asarray(self._logits(jnp.asarray(tokens), jnp.asarray(feats)))[:, 0]  # [depths, T, head]
        out = np.full((lg.shape[0], len(seq)), NOT_IN_HEAD, np.int64)
        for p in range(start, len(seq) - 1):
            col = self.head_index[seq[p + 1]]
            if col >= 0:
                out[:, p] = (lg[:, p] > lg[:, p, col][:, None]).sum(axis=-1)
        return out


def cmd_fit(args: argparse.Namespace) -> None:
    rows = dd.load_rows(args.data)
    val_ids = sorted({r["id"] for r in rows})[:: args.val_every]  # distill_eagle train's validation split
    val_rows = [r for r in rows if r["id"] in set(val_ids) and r["kind"] == "greedy"]
    rng = np.random.default_rng(args.seed)
    val_rows = [val_rows[i] for i in sorted(rng.choice(len(val_rows), min(args.rows, len(val_rows)), replace=False))]
    feats = de.load_features(Path(args.features), val_rows)
    ranker = DraftRanker(Path(args.workdir), args.params, args.depths)
    records = []
    for r in val_rows:
        seq = np.asarray(r["tokens"], np.int32)
        records.append({"start": r["num_prompt"], "end": len(seq) - 1,
                        "ranks": ranker.ranks(seq, r["num_prompt"], feats[dd.row_key(r)])})
    order = greedy_order(path_counts(records), args.max_nodes, args.max_rank)
    steps, acc = replay(records, set(chain_paths(4)))
    print(f"{len(records)} validation rows; chain (γ = 4) replays {1 + acc / steps:.3f}")
    for n in (8, 16, 32, 48, 64):
        steps, acc = replay(records, set([p for p in order if len(p) <= 4][:n]))
        print(f"  {n:3d} nodes (depth <= 4): {1 + acc / steps:.3f} on the validation rows")
    Path(make_parent(args.out)).write_text(json.dumps({
        "what": "rank paths in decreasing frequency of the target's greedy continuation (scripts/fit_spec_tree.py)",
        "draft_workdir": str(args.workdir), "params": args.params, "data": args.data,
        "validation_rows": len(records), "val_every": args.val_every, "depths": args.depths,
        "order": [list(p) for p in order],
    }) + "\n")
    print(f"wrote {len(order)} paths to {args.out}")


def cmd_replay(args: argparse.Namespace) -> None:
    from nightjar_jax.spec.tree import tree_for

    result = de.load_reference(Path(args.reference))  # (before the models load: a missing file fails at once)
    order = None if args.tree_file is None else load_tree_order(args.tree_file)  # (checked in main)
    label = "default" if args.tree_file is None else "file"
    ranker = DraftRanker(Path(args.workdir), args.params, args.gamma)
    tok = dd.target_tokenizer()
    prompts = {p["id"]: dd.chat_ids(tok, p["text"]) for p in dd.load_prompts("heldout")}
    records = []
    for pid, out in result["sd_outputs"].items():
        seq = np.asarray(prompts[pid] + list(out), np.int32)
        records.append({"start": len(prompts[pid]), "end": len(seq) - 1,
                        "ranks": ranker.ranks(seq, len(prompts[pid]))})
    rows = []
    for n in [0, *args.nodes]:
        paths = chain_paths(args.gamma) if n == 0 else list(tree_for(n, args.gamma, order).paths)
        steps, acc = replay(records, set(paths))
        rows.append({"nodes": len(paths), "tree": "chain" if n == 0 else label,
                     "mean_accepted_length": 1 + acc / steps, "target_steps": steps})
    print(f"{'tree':>8s} {'nodes':>6s} {'target steps':>13s} {'mean acc. len (γ=' + str(args.gamma) + ')':>22s}")
    for r in rows:
        print(f"{r['tree']:>8s} {r['nodes']:6d} {r['target_steps']:13d} {r['mean_accepted_length']:22.3f}")
    if args.out:
        Path(make_parent(args.out)).write_text(
            json.dumps({"workdir": args.workdir, "gamma": args.gamma, "tree_file": args.tree_file, "rows": rows},
                       indent=1) + "\n")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="count rank paths on the validation split and write the tree order")
    f.add_argument("--workdir", required=True, help="a distill_eagle.py train workdir")
    f.add_argument("--params", choices=["best", "last"], default="last")
    f.add_argument("--data", nargs="+", required=True, type=existing_file)
    f.add_argument("--features", required=True)
    f.add_argument("--val-every", type=positive_int, default=20, help="as distill_eagle.py train's --val-every")
    f.add_argument("--rows", type=positive_int, default=200, help="validation rows to use (a seeded sample)")
    f.add_argument("--seed", type=non_negative_int, default=0)
    f.add_argument("--depths", type=positive_int, default=5)
    f.add_argument("--max-nodes", type=positive_int, default=128)
    f.add_argument("--max-rank", type=positive_int, default=32)
    f.add_argument("--out", required=True, type=writable_out)
    r = sub.add_parser("replay", help="held-out greedy acceptance of trees of several sizes (offline)")
    r.add_argument("--workdir", required=True)
    r.add_argument("--params", choices=["best", "last"], default="last")
    r.add_argument("--reference", required=True, help="an eval_draft.py result (its sd_outputs)")
    r.add_argument("--gamma", type=positive_int, default=4)
    r.add_argument("--nodes", type=int_list(1), default=[8, 16, 24, 32, 48, 64],
                   help="comma-separated tree sizes (drafted nodes, each >= 1)")
    r.add_argument("--tree-file", help="replay the trees of this fitted order (fit's --out, as serve's "
                   "--spec-tree-file) instead of the shipped default_tree.json")
    r.add_argument("--out", type=writable_out, help="also write the rows as JSON here")
    args = ap.parse_args()
    if getattr(args, "tree_file", None) is not None:  # (read before the models load)
        try:
            load_tree_order(args.tree_file)
        except ValueError as error:
            ap.error(f"--tree-file: {error}")
    for flag in ("workdir", "features"):  # (a missing folder was a traceback deep in the loaders)
        folder = getattr(args, flag, None)
        if folder is not None and not os.path.isdir(folder):
            ap.error(f"--{flag} {folder}: no such folder")
    weights = os.path.join(args.workdir, f"{args.params}_params.npz")
    if not os.path.isfile(weights):  # (a FileNotFoundError once the target had loaded)
        ap.error(f"--workdir {args.workdir}: no {args.params}_params.npz (give distill_eagle.py train's --workdir; "
                 f"--params best / last picks its best or last evaluated weights)")
    {"fit": cmd_fit, "replay": cmd_replay}[args.cmd](args)


if __name__ == "__main__":
    main()
