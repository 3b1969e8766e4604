"""Static speculative token trees: which draft candidates a decode step verifies at once (host side, no JAX).

A chain proposes one token per depth; a tree proposes several (the draft's top-ranked tokens) and the target
verifies every branch in one pass with a tree attention mask, then commits the longest branch it agrees with
(SpecInfer, Medusa, EAGLE). The tree is static — a fixed set of nodes, so each (batch size, γ, tree) is one
compiled variant — and described by rank paths:

- node: a rank path ``(r1, ..., rd)``: the ``r1``-th most likely draft token after the last committed token, then
  the ``r2``-th most likely after that one, and so on; its depth is ``d``. Node 0 is the root (the last committed
  token, depth 0). A tree's paths are prefix-closed (every node's parent is in the tree).
- order: nodes sorted by depth, then by their parent's index, then by rank, so each depth is one contiguous run of
  indices and a node's parent comes before it.
- slots: in a decode step with ``n`` committed tokens, node ``i`` is written at KV position ``n - 1 + i`` and
  rotated as position ``n - 1 + depth(i)``; after verification the accepted branch's KV entries move to positions
  ``n .. n + k - 1`` (docs/architecture.md, "Token trees").

``DEFAULT_TREE_ORDER`` ranks candidate nodes by how often the target's greedy token followed that rank path for
the shipped SmolLM2 feature draft on its validation split (training data; never the held-out benchmark prompts), so
the first ``N`` paths with depth ``<= γ`` are the ``N``-node tree with the most expected accepted tokens for that
draft (each node adds the probability that the target's continuation passes through it); it is produced by
``scripts/fit_spec_tree.py fit``, which writes the same file for any feature draft (``spec_tree_file``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_TREE_NODES = 128
# The rank of a node whose token n-gram lookup copies (``nightjar_jax/spec/lookup.py``), not a draft candidate: a
# tree may carry one such chain from the root, ``(COPY,), (COPY, COPY), ...`` (:func:`with_copy_branch`). Sorted
# first among siblings, so the copy node is the first node of each level it reaches.
COPY = -1


@dataclass(frozen=True)
class SpecTree:
    """A static token tree of ``num_nodes`` drafted nodes (plus the root) and depth ``depth``."""

    paths: tuple[tuple[int, ...], ...]  # node 1..N's rank paths, in node order
    parent: np.ndarray = field(repr=False)  # [N + 1] int32; parent[0] = 0
    depth_of: np.ndarray = field(repr=False)  # [N + 1] int32; depth_of[0] = 0
    rank: np.ndarray = field(repr=False)  # [N + 1] int32: rank among its parent's draft candidates (root: 0)
    ancestors: np.ndarray = field(repr=False)  # [N + 1, N + 1] bool: ancestors[i, j] = j is i or an ancestor of i
    path_nodes: np.ndarray = field(repr=False)  # [N + 1, depth + 1] int32: i's ancestor at each depth (i beyond)
    level_starts: tuple[int, ...]  # level_starts[d] = first node index at depth d (d = 0..depth + 1)
    children: np.ndarray = field(repr=False)  # [N + 1, max children] int32: each node's children by rank, -1 pad

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def prefixes(self) -> np.ndarray:
        """[N + 1, N + 1] bool: the drafted nodes each node's token follows (its ancestors and itself, not the
        root: ``sampler.apply_penalties``)."""
        prefix = self.ancestors.copy()
        prefix[:, 0] = False
        return prefix

    @property
    def depth(self) -> int:
        return len(self.level_starts) - 2

    @property
    def copy_depth(self) -> int:
        """Nodes of the copy branch (:data:`COPY`): the first node of levels 1 .. copy_depth; 0 without one."""
        return sum(1 for p in self.paths if p[-1] == COPY)

    def level(self, d: int) -> range:
        """Node indices at depth ``d``."""
        return range(self.level_starts[d], self.level_starts[d + 1])

    def top_k(self, d: int) -> int:
        """How many ranked candidates a depth-``d`` node's children need (0 at the deepest level; copied nodes
        need none)."""
        children = [self.rank[i] for i in self.level(d + 1) if self.rank[i] != COPY] if d < self.depth else []
        return int(max(children)) + 1 if children else 0

    def ranked(self, d: int) -> range:
        """Node indices at depth ``d`` that are draft candidates (the level without its copied node)."""
        level = self.level(d)
        return range(level.start + (d <= self.copy_depth), level.stop)


def make_tree(paths) -> SpecTree:
    """Validate rank paths and order them (module docstring). Errors say what is wrong and what is allowed."""
    paths = [tuple(int(r) for r in p) for p in paths]
    if not paths:
        raise ValueError("a speculative tree needs at least one node (rank path), e.g. [(0,)]")
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"a speculative tree has {len(paths)} nodes: allowed at most {MAX_TREE_NODES}")
    seen = set()
    for p in paths:
        copied = bool(p) and all(r == COPY for r in p)
        if not p or (any(r < 0 for r in p) and not copied):
            raise ValueError(f"tree node {p}: a rank path is a non-empty tuple of ranks >= 0 (or, for the copy "
                             f"branch, of COPY = {COPY} only)")
        if p in seen:
            raise ValueError(f"tree node {p} is given twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree node {p} has no parent {p[:-1]} in the tree: rank paths must be prefix-closed")
    depth = max(len(p) for p in paths)
    index: dict[tuple[int, ...], int] = {(): 0}
    ordered: list[tuple[int, ...]] = []
    for d in range(1, depth + 1):
        level = sorted((p for p in paths if len(p) == d), key=lambda p: (index[p[:-1]], p[-1]))
        for p in level:
            index[p] = len(ordered) + 1
            ordered.append(p)
    n = len(ordered) + 1
    parent = np.zeros(n, np.int32)
    depth_of = np.zeros(n, np.int32)
    rank = np.zeros(n, np.int32)
    ancestors = np.eye(n, dtype=bool)
    path_nodes = np.zeros((n, depth + 1), np.int32)
    for i, p in enumerate(ordered, start=1):
        parent[i], depth_of[i], rank[i] = index[p[:-1]], len(p), p[-1]
        ancestors[i] = ancestors[parent[i]]
        ancestors[i, i] = True
    for i in range(n):
        chain = [i]
        while chain[-1] != 0:
            chain.append(int(parent[chain[-1]]))
        chain = chain[::-1]  # root .. i
        path_nodes[i] = chain + [i] * (depth + 1 - len(chain))
    starts = [0] + [1 + sum(1 for p in ordered if len(p) < d) for d in range(1, depth + 1)] + [n]
    kids = [[i for i in range(1, n) if parent[i] == j] for j in range(n)]  # in node order = by rank
    children = np.full((n, max(len(k) for k in kids)), -1, np.int32)
    for j, k in enumerate(kids):
        children[j, : len(k)] = k
    return SpecTree(tuple(ordered), parent, depth_of, rank, ancestors, path_nodes, tuple(starts), children)


def chain_prefixes(num_tokens: int) -> np.ndarray:
    """A chain's :attr:`SpecTree.prefixes`: [K, K] bool for the last committed token and K - 1 drafts, position j
    following drafts 1 .. j."""
    prefix = np.tril(np.ones((num_tokens, num_tokens), bool))
    prefix[:, 0] = False
    return prefix


def chain_paths(gamma: int) -> list[tuple[int, ...]]:
    """The chain as a tree: the top-ranked token at every depth."""
    return [(0,) * d for d in range(1, gamma + 1)]


def tree_for(num_nodes: int, gamma: int, order=None) -> SpecTree:
    """The first ``num_nodes`` paths of ``order`` (default :data:`DEFAULT_TREE_ORDER`) no deeper than ``gamma`` (all
    of them where the order has fewer). The order lists parents before children, so any prefix is prefix-closed."""
    if num_nodes < 1 or gamma < 1:
        raise ValueError(f"a tree needs num_nodes >= 1 and gamma >= 1; got num_nodes={num_nodes}, gamma={gamma}")
    order = DEFAULT_TREE_ORDER if order is None else order
    return make_tree([p for p in order if len(p) <= gamma][:num_nodes])


def with_copy_branch(tree: SpecTree, gamma: int) -> SpecTree:
    """``tree`` plus a chain of ``gamma`` nodes from the root whose tokens n-gram lookup copies (:data:`COPY`):
    a row with a match verifies the copied continuation beside the draft's candidates in the same target pass
    (greedy or by recursive rejection sampling: any node tokens are valid point-mass proposals); a row without one
    marks those nodes invalid."""
    if gamma < 1:
        raise ValueError(f"a copy branch needs gamma >= 1; got {gamma}")
    return make_tree([*tree.paths, *((COPY,) * d for d in range(1, gamma + 1))])


def load_tree_order(path: str | None = None) -> tuple[tuple[int, ...], ...]:
    """Rank paths from a JSON file with ``"order"`` (``scripts/fit_spec_tree.py fit`` writes one; None: the
    shipped ``default_tree.json``), checked to list parents before children. Errors name the file and the fault."""
    import json
    from pathlib import Path

    source = Path(path) if path is not None else Path(__file__).with_name("default_tree.json")
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"spec tree file {source}: cannot read it as JSON ({error})") from error
    order = data.get("order") if isinstance(data, dict) else None
    if not isinstance(order, list) or not order:
        raise ValueError(f"spec tree file {source}: needs a non-empty list 'order' of rank paths, e.g. [[0], [0, 0]]")
    try:
        paths = tuple(tuple(int(r) for r in p) for p in order)
    except (TypeError, ValueError) as error:
        raise ValueError(f"spec tree file {source}: each entry of 'order' must be a list of ranks ({error})") from error
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        if not p or min(p) < 0 or p in seen or (len(p) > 1 and p[:-1] not in seen):
            raise ValueError(f"spec tree file {source}: entry {list(p)} is empty, negative, repeated or comes before "
                             "its parent; 'order' must list parents before children")
        seen.add(p)
    return paths


DEFAULT_TREE_ORDER = load_tree_order()
