"""Static token trees (``nightjar_jax/spec/tree.py``): construction, greedy tree verification, the tree attention
mask in the reference and CPU kernels, and tree steps in the engine: fake models with exact expectations, then the
tiny real model with a layer-skip draft (the feature draft's tree steps are in test_eagle_engine.py). Greedy SD
with a tree == AR token for token, pages all freed, more tokens accepted than the chain, no steady-state compiles."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from helpers import VOCAB, fake_engine, greedy, run_all  # noqa: E402

from kernels_pallas.paged_attention import cpu, paged_attention, paged_attention_reference  # noqa: E402
from nightjar_jax.spec.rejection import tree_greedy_verify  # noqa: E402
from nightjar_jax.spec.tree import DEFAULT_TREE_ORDER, MAX_TREE_NODES, chain_paths, make_tree, tree_for  # noqa: E402
from nightjar_jax.testing import fake_greedy_continuation  # noqa: E402
from tests.kernels.paged_cases import assert_close, make_case  # noqa: E402
from tests.spec.test_rejection import _chi_square_p_value  # noqa: E402

# root -> a(0) -> c(0,0) -> e(0,0,0); a -> d(0,1); root -> b(1) -> f(1,0)
PATHS = [(1, 0), (0,), (0, 0, 0), (1,), (0, 1), (0, 0)]


def test_make_tree_orders_and_indexes_nodes():
    t = make_tree(PATHS)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parent.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert t.depth_of.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert t.level_starts == (0, 1, 3, 6, 7) and t.depth == 3 and t.num_nodes == 6
    assert [t.top_k(d) for d in range(4)] == [2, 2, 1, 0]
    assert np.flatnonzero(t.ancestors[6]).tolist() == [0, 1, 3, 6]  # (0,0,0): root, (0,), (0,0), itself
    assert np.flatnonzero(t.ancestors[5]).tolist() == [0, 2, 5]
    assert t.path_nodes[6].tolist() == [0, 1, 3, 6] and t.path_nodes[2].tolist() == [0, 2, 2, 2]


@pytest.mark.parametrize("paths, message", [
    ([], "at least one node"),
    ([(0,), (0, 1, 0)], "no parent"),
    ([(0,), (0,)], "twice"),
    ([(0,), (-2,)], "ranks >= 0"),
    ([(0,), (0, -1)], "COPY = -1 only"),  # a copied node hangs only from the root or another copied node
    ([(r,) for r in range(MAX_TREE_NODES + 1)], f"at most {MAX_TREE_NODES}"),
])
def test_make_tree_rejects_bad_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        make_tree(paths)


def test_default_order_is_prefix_closed_and_trees_are_its_prefixes():
    seen = set()
    for p in DEFAULT_TREE_ORDER:
        assert len(p) == 1 or p[:-1] in seen
        seen.add(p)
    assert DEFAULT_TREE_ORDER[0] == (0,)
    t = tree_for(24, 3)
    assert t.num_nodes == 24 and t.depth <= 3
    assert set(t.paths) == set([p for p in DEFAULT_TREE_ORDER if len(p) <= 3][:24])
    assert make_tree(chain_paths(4)).paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    with pytest.raises(ValueError, match="num_nodes >= 1"):
        tree_for(0, 4)


def test_tree_greedy_verify_takes_the_deepest_agreeing_branch():
    t = make_tree(PATHS)  # nodes: 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
    tokens = jnp.asarray([[9, 10, 20, 11, 12, 21, 13],
                          [9, 10, 20, 11, 12, 21, 13],
                          [9, 10, 20, 11, 12, 21, 13]], jnp.int32)
    # row 0: target says 20 after the root (node 2), then 21 (node 5), then 7: branch 2 -> 5, bonus 7
    # row 1: 10 (node 1), 11 (node 3), 13 (node 6), then 8: the full depth, bonus 8
    # row 2: as row 1 but node 6 lies past the context limit (invalid): stops at node 3, bonus 13
    argmax = jnp.asarray([[20, 0, 21, 0, 0, 7, 0],
                          [10, 11, 0, 13, 0, 0, 8],
                          [10, 11, 0, 13, 0, 0, 8]], jnp.int32)
    valid = jnp.ones((3, 7), bool).at[2, 6].set(False)
    out, k, path = tree_greedy_verify(tokens, argmax, valid, t)
    assert k.tolist() == [2, 3, 2]
    assert out.tolist() == [[20, 21, 7, -1], [10, 11, 13, 8], [10, 11, 13, -1]]
    assert path[:, :3].tolist() == [[0, 2, 5], [0, 1, 3], [0, 1, 3]] and int(path[1, 3]) == 6


def _tree_case(q_len, window, seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((q_len, window)) < 0.5
    mask[np.arange(q_len), window - q_len + np.arange(q_len)] = True  # every query sees itself
    return jnp.asarray(mask)


def _dense_tree_attention(case, mask):
    """Per sequence: gather keys 0..ctx-1 in order, mask = causal & tree window, softmax."""
    q, k_pages, v_pages, bt, cl = (np.asarray(a, np.float32) if a.dtype != jnp.int32 else np.asarray(a)
                                   for a in case.args)
    s_, q_len, h, d = q.shape
    kvh, _, ps, _ = k_pages.shape
    window = mask.shape[1]
    out = np.zeros_like(q)
    for s in range(s_):
        ctx = int(cl[s])
        keys = np.stack([k_pages[:, bt[s, p // ps], p % ps] for p in range(ctx)], 1)  # [kvh, ctx, d]
        vals = np.stack([v_pages[:, bt[s, p // ps], p % ps] for p in range(ctx)], 1)
        for i in range(q_len):
            pos = ctx - q_len + i
            vis = np.asarray([p <= pos and (p < ctx - window or bool(mask[i, p - (ctx - window)]))
                              for p in range(ctx)])
            for head in range(h):
                g = head // (h // kvh)
                sc = keys[g] @ q[s, i, head] * case.scale
                sc = np.where(vis, sc, -np.inf)
                w = np.exp(sc - sc.max())
                out[s, i, head] = (w / w.sum()) @ vals[g]
    return out


@pytest.mark.parametrize("q_len, window", [(5, 5), (3, 7)])
def test_reference_tree_mask_matches_dense(q_len, window):
    case = make_case([12, 19], q_len=q_len, num_q_heads=4, num_kv_heads=2, page_size=4)
    mask = _tree_case(q_len, window)
    got = paged_attention_reference(*case.args, scale=case.scale, tree_mask=mask)
    np.testing.assert_allclose(np.asarray(got), _dense_tree_attention(case, np.asarray(mask)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cpu_kernel_tree_mask_matches_reference(dtype):
    if jax.default_backend() != "cpu":
        pytest.skip(f"the CPU kernel runs on the CPU backend only, not {jax.default_backend()!r}")
    if not cpu.available():
        pytest.skip(f"CPU kernel unavailable here: {cpu.unavailable_reason()}")
    # 20 queries x GQA 2 = 40 rows per head: three 16-row blocks; a 26-key window; contexts across pages
    case = make_case([25, 37], q_len=20, num_q_heads=4, num_kv_heads=2, page_size=8, dtype=dtype)
    mask = _tree_case(20, 26, seed=3)
    want = paged_attention_reference(*case.args, scale=case.scale, tree_mask=mask)
    got = jax.jit(lambda *a: cpu.paged_attention_cpu(*a, scale=case.scale, tree_mask=mask))(*case.args)
    assert_close(got, want)
    with pytest.raises(ValueError, match="tree_mask"):
        cpu.paged_attention_cpu(*case.args, scale=case.scale, tree_mask=mask[:, :10])


@pytest.mark.parametrize("backend, dtype, q_len, window, tuning", [
    ("gpu", jnp.float32, 20, 40, {"block_rows": 16}),  # 40 rows per head: 3 q blocks; 2 bit words
    ("gpu", jnp.bfloat16, 5, 70, {}),  # 3 words, the last partial
    ("gpu", jnp.float32, 4, 40, {"num_splits": 3, "pages_per_block": 1}),  # keys split: the window spans splits
    ("tpu", jnp.float32, 20, 40, {"block_rows": 16}),
    ("tpu", jnp.bfloat16, 3, 33, {}),  # window key 32 is the second word's bit 0
], ids=["gpu-f32-3blocks", "gpu-bf16-3words", "gpu-f32-split", "tpu-f32-3blocks", "tpu-bf16-33"])
def test_pallas_bodies_tree_mask_match_reference(backend, dtype, q_len, window, tuning):
    """The Pallas bodies under a tree mask == the reference (compiled on their own accelerator, else interpreted);
    the mask changes the output."""
    case = make_case([window + 5, window + 21], q_len=q_len, num_q_heads=4, num_kv_heads=2, page_size=8,
                     dtype=dtype)
    mask = _tree_case(q_len, window, seed=window)
    want = paged_attention_reference(*case.args, scale=case.scale, tree_mask=mask)
    got = paged_attention(*case.args, scale=case.scale, backend=backend, tree_mask=mask,
                          interpret=jax.default_backend() != backend, **tuning)
    assert_close(got, want)
    causal = paged_attention_reference(*case.args, scale=case.scale)
    assert float(jnp.abs(got.astype(jnp.float32) - causal.astype(jnp.float32)).max()) > 0.05


def test_tree_words_pack_each_folded_row_and_tree_visible_unpacks_them():
    """The Pallas bodies' mask format: per folded row (query x group head, padded), ceil(M / 32) int32 words whose
    bits are that query's mask row; ``tree_visible`` reads a key's bit back, and keys before the window stay visible."""
    from kernels_pallas.paged_attention.layout import QueryBlocking, tree_visible, tree_words

    q_len, window, group = 5, 70, 2
    mask = _tree_case(q_len, window, seed=5)
    blocking = QueryBlocking.choose(q_len, group, 16)
    words = tree_words(mask, blocking)
    assert len(words) == 3 and all(w.shape == (blocking.num_q_blocks * blocking.block_rows, 1) for w in words)
    index = blocking.row_query_index()[:, 0]
    context_len = 100
    key_pos = jnp.arange(context_len, dtype=jnp.int32)[None, :]
    seen = np.asarray(tree_visible(words, key_pos, jnp.int32(context_len - window)))
    for r, query in enumerate(index):
        if query < 0:  # padding row: no bits, so only keys before the window
            assert seen[r].tolist() == [k < context_len - window for k in range(context_len)]
        else:
            assert seen[r, : context_len - window].all()
            assert seen[r, context_len - window :].tolist() == np.asarray(mask[query]).tolist()


@pytest.mark.parametrize("impl", ["pallas", "reference", "cpu"])
def test_every_implementation_rejects_a_bad_tree_mask(impl):
    """Shape and dtype alike everywhere (the CPU kernel cast a float mask's 0.5 to False; the reference failed on
    floats with a cryptic error)."""
    from nightjar_jax.attention import paged_attention as attend

    case = make_case([9], q_len=3, num_q_heads=2, num_kv_heads=1, page_size=4)
    with pytest.raises(ValueError, match=r"tree_mask \(3, 2\) must be \[q_len=3, M >= q_len\]"):
        attend(*case.args, scale=case.scale, tree_mask=jnp.ones((3, 2), bool), impl=impl)
    for dtype in (jnp.int32, jnp.float32):
        with pytest.raises(ValueError, match="tree_mask dtype must be bool"):
            attend(*case.args, scale=case.scale, tree_mask=jnp.full((3, 4), 0.5).astype(dtype), impl=impl)


# ---- the engine, fake models ------------------------------------------------------------------------------------

PROMPTS = [[5, 6, 7], list(range(1, 21)), [42, 1], [3, 3], list(range(30, 43))]


def _expected(prompt, n):
    return fake_greedy_continuation(prompt, n, VOCAB)


def _force_gamma(engine, choose):
    engine._select_gamma = lambda: choose() if engine.scheduler.num_decoding() else 0


@pytest.mark.parametrize("nodes", [10, 24])
def test_fake_tree_equals_ar_and_accepts_second_choices(nodes):
    """The draft's top choice is wrong whenever the prefix length is a multiple of 3, its second choice right: a
    tree with rank-1 branches accepts where the chain stops."""
    counts = {}
    for tree in (0, nodes):
        eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=4, spec_tree_nodes=tree,
                          prompt_lookup_max=0)  # (the draft's trees alone; lookup's copy branch: test_lookup.py)
        _force_gamma(eng, lambda: 4)
        eng.record_steps = True
        for i, p in enumerate(PROMPTS):
            eng.add_request(p, greedy(17), request_id=str(i))
        assert run_all(eng) == {str(i): _expected(p, 17) for i, p in enumerate(PROMPTS)}
        assert eng.num_free_pages == eng.num_total_pages
        assert all(s["tree_nodes"] == tree for s in eng.stats.step_log)
        counts[tree] = sum(len(s["accepted"]) for s in eng.stats.step_log), eng.stats.num_accepted_tokens
    (chain_steps, chain_acc), (tree_steps, tree_acc) = counts[0], counts[nodes]
    assert tree_acc / tree_steps > chain_acc / chain_steps  # more accepted per sequence-step
    assert tree_steps < chain_steps


def test_fake_tree_random_gamma_preemption_eos_and_context_limit():
    rng = random.Random(0)
    eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=4, spec_tree_nodes=10, num_pages=24,
                      max_num_seqs=5)
    _force_gamma(eng, lambda: rng.randint(0, 4))
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(30), request_id=str(i))
    assert run_all(eng) == {str(i): _expected(p, 30) for i, p in enumerate(PROMPTS)}
    assert eng.stats.num_preemptions > 0
    assert eng.num_free_pages == eng.num_total_pages
    # EOS inside an accepted branch, max_tokens mid-branch, and the context limit (nodes past it never accepted)
    cont = _expected(PROMPTS[0], 12)
    eng = fake_engine(draft=True, runner_up=True, eos=cont[4], num_speculative_tokens=4, spec_tree_nodes=10,
                      max_model_len=14)
    _force_gamma(eng, lambda: 4)
    eng.add_request(PROMPTS[0], greedy(12), request_id="eos")
    eng.add_request(PROMPTS[3], greedy(3, ignore_eos=True), request_id="max")
    eng.add_request(PROMPTS[2], greedy(50, ignore_eos=True), request_id="limit")
    done = run_all(eng)
    assert done["eos"] == cont[:5]
    assert done["max"] == _expected(PROMPTS[3], 3)
    assert done["limit"] == _expected(PROMPTS[2], 12)  # 2 prompt tokens, context 14
    assert eng.num_free_pages == eng.num_total_pages


def test_sampled_and_greedy_requests_share_tree_steps():
    """A sampled request in the batch: the step verifies the tree by rejection sampling (lossless: the fake target
    puts ~0.996 of its mass on its greedy token, so a sampled run at temperature 1 follows it almost surely), and
    the greedy request's output is exact."""
    from nightjar_jax.engine.sampling_params import SamplingParams

    eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=8, prompt_lookup_max=0)
    _force_gamma(eng, lambda: 3)
    eng.record_steps = True
    eng.add_request(PROMPTS[0], greedy(12), request_id="g")
    eng.add_request(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=12, seed=1), request_id="s")
    done = run_all(eng)
    assert done["g"] == _expected(PROMPTS[0], 12)
    assert len(done["s"]) == 12
    assert {s["tree_nodes"] for s in eng.stats.step_log} == {8}
    assert eng.stats.num_accepted_tokens > 0
    assert eng.num_free_pages == eng.num_total_pages


def test_spec_tree_nodes_is_validated():
    from nightjar_jax.config import make_engine_config

    with pytest.raises(ValueError, match="spec_tree_nodes"):
        make_engine_config(model="fake", spec_tree_nodes=MAX_TREE_NODES + 1)
    with pytest.raises(ValueError, match=r"spec_tree_min_gamma.*at most num_speculative_tokens=4"):
        make_engine_config(model="fake", spec_tree_nodes=8, spec_tree_min_gamma=5)
    with pytest.raises(ValueError, match="spec_tree_min_gamma"):
        make_engine_config(model="fake", spec_tree_min_gamma=0)
    assert make_engine_config(model="fake", spec_tree_min_gamma=5).spec.spec_tree_min_gamma == 5  # no tree: unused


def test_tree_only_from_spec_tree_min_gamma_and_chains_below():
    """spec_tree_min_gamma = γ_max: steps at γ_max verify the tree, smaller γ a chain, γ = 0 plain decoding; every
    mix of them commits the AR tokens, the scheduler reserves each step's own lookahead, and all pages come back."""
    rng = random.Random(1)
    eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=3, spec_tree_nodes=9,
                      spec_tree_min_gamma=3, num_pages=40, max_num_seqs=5, prompt_lookup_max=0)
    assert sorted(eng.runner.trees) == [3]
    assert [eng.runner.lookahead(g) for g in range(4)] == [0, 1, 2, 9]
    _force_gamma(eng, lambda: rng.randint(0, 3))
    eng.record_steps = True
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(25), request_id=str(i))
    assert run_all(eng) == {str(i): _expected(p, 25) for i, p in enumerate(PROMPTS)}
    assert eng.num_free_pages == eng.num_total_pages
    log = eng.stats.step_log
    assert {s["gamma"] for s in log} == {0, 1, 2, 3}
    assert all(s["tree_nodes"] == (9 if s["gamma"] == 3 else 0) for s in log)


# ---- the engine, the tiny real model -----------------------------------------------------------------------------

REAL_PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day a big"]


@pytest.fixture(scope="module")
def real_ar():
    from nightjar_jax import LLM, SamplingParams

    llm = LLM("stories260k", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_pages=128,
              draft_model=None)
    return [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, SamplingParams(temperature=0, max_tokens=24))]


@pytest.mark.parametrize("impl", ["auto", "reference", "pallas"])
def test_real_model_tree_equals_ar_and_steady_state_compiles_nothing(real_ar, impl):
    from nightjar_jax import LLM, SamplingParams

    llm = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_pages=128, spec_tree_nodes=10,
              attention_impl=impl)
    sp = SamplingParams(temperature=0, max_tokens=24)
    assert [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, sp)] == real_ar
    eng = llm.engine
    assert eng.num_free_pages == eng.num_total_pages
    assert eng.runner.compiled_cache_sizes()["verify_tree"] >= 1
    before = eng.runner.compiled_cache_sizes()
    assert [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, sp)] == real_ar
    assert eng.runner.compiled_cache_sizes() == before
    # the sampled path (rejection sampling down the tree) with top_k = 1 is deterministic: it must equal greedy
    sampled = SamplingParams(temperature=0.8, top_k=1, max_tokens=24, seed=7)
    assert [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, sampled)] == real_ar
    assert eng.num_free_pages == eng.num_total_pages


def test_fit_spec_tree_counts_orders_and_replays():
    """scripts/fit_spec_tree.py: rank paths counted from every start slot, ordered parents-first by count, and the
    replay steps like the engine (longest path prefix in the tree, plus one target token)."""
    from nightjar_jax.testing import load_script

    fit = load_script("fit_spec_tree.py", "fit_spec_tree_t")
    # ranks[j, p]: the target's token p + 1 at depth j + 1 from start slot p - j; slots 0..5, start 0, end 6
    ranks = np.asarray([[0, 1, 0, 0, 2, 0, 0],
                        [0, 0, 0, 1, 0, 0, 0]])
    rec = {"start": 0, "end": 6, "ranks": ranks}
    counts = fit.path_counts([rec])
    assert counts[(0,)] == 4 and counts[(1,)] == 1 and counts[(2,)] == 1
    assert counts[(0, 0)] == 2 and counts[(1, 0)] == 1 and counts[(0, 1)] == 1 and counts[(2, 0)] == 1
    order = fit.greedy_order(counts, max_nodes=5, max_rank=8)
    assert order[:2] == [(0,), (0, 0)]
    assert all(len(p) == 1 or p[:-1] in order[:i] for i, p in enumerate(order))
    # chain {(0,), (0, 0)}: c=0 path (0, 0) -> 2 accepted, c=3 (0, 0) -> 2 accepted, c=6 done: 2 steps, 4 accepted
    assert fit.replay([rec], {(0,), (0, 0)}) == (2, 4)
    # from slot 1 with (1,) and (1, 0) in the tree: c=1 (1, 0) 2 acc., c=4 (2, 0) none, c=5 (0,) 1: 3 steps, 3 acc.
    assert fit.replay([{"start": 1, "end": 6, "ranks": ranks}], {(0,), (0, 0), (1,), (1, 0)}) == (3, 3)


def test_fit_spec_tree_replay_measures_a_tree_file(tmp_path, monkeypatch, capsys):
    """``replay --tree-file``: the trees come from the fitted order in the file (serve's --spec-tree-file), not the
    shipped one; the models are stood in for (ranks given)."""
    import argparse
    import json

    from nightjar_jax.testing import load_script

    fit = load_script("fit_spec_tree.py", "fit_spec_tree_r")
    ranks = np.asarray([[1, 1, 1, 1, 1, 1, 1],  # the target's token is always the draft's second choice
                        [0, 0, 0, 0, 0, 0, 0]])

    class Ranker:
        def __init__(self, workdir, params, depths):
            pass

        def ranks(self, seq, start):
            return ranks

    monkeypatch.setattr(fit, "DraftRanker", Ranker)
    monkeypatch.setattr(fit.de, "load_reference", lambda path: {"sd_outputs": {"p": [5] * 6}})
    monkeypatch.setattr(fit.dd, "target_tokenizer", lambda: None)
    monkeypatch.setattr(fit.dd, "load_prompts", lambda split: [{"id": "p", "text": "x"}])
    monkeypatch.setattr(fit.dd, "chat_ids", lambda tok, text: [9])
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"order": [[1], [1, 0], [0]]}))
    args = argparse.Namespace(reference="r.json", workdir="wd", params="last", gamma=2, nodes=[2],
                              tree_file=str(tree), out=str(tmp_path / "rows.json"))
    fit.cmd_replay(args)
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    # the chain (rank 0 only) accepts nothing: 5 steps; the file's 2-node tree (1,), (1, 0) accepts 2 per step
    assert [(r["tree"], r["nodes"], r["target_steps"]) for r in rows] == [("chain", 2, 5), ("file", 2, 2)]
    assert rows[1]["mean_accepted_length"] == 3.0
    # the shipped order's first two nodes at γ = 2 do not take rank 1 first
    fit.cmd_replay(argparse.Namespace(**{**vars(args), "tree_file": None}))
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][1]["tree"] == "default"


def test_top_k_ids_matches_lax_top_k_and_breaks_ties_low():
    from nightjar_jax.engine.sampler import argmax, top_k_ids

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 500)).astype(np.float32))
    for k in (4, 6):  # argmax passes, then lax.top_k
        np.testing.assert_array_equal(np.asarray(top_k_ids(x, k)), np.asarray(jax.lax.top_k(x, k)[1]))
    np.testing.assert_array_equal(np.asarray(top_k_ids(x, 1))[..., 0], np.asarray(argmax(x)))
    ties = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, 3.0, 2.0]])
    assert top_k_ids(ties, 5).tolist() == [[1, 2, 4, 5, 0]]


def test_warmup_compiles_the_tree_variants_so_greedy_decoding_compiles_nothing():
    eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=2, max_num_seqs=2, spec_tree_nodes=5)
    runner = eng.runner
    keys = runner.warmup(max_context=16)
    # trees replace the chain; a greedy chain verify stays for steps where every row copies its drafts (lookup)
    assert {k[0] for k in keys} == {"forward_sample", "propose_tree", "verify_tree", "verify"}
    assert {k[-1] for k in keys if k[0] == "verify"} == {"copied"}
    assert {k[-1] for k in keys if k[0] == "verify_tree"} == {True, False}  # greedy and sampled variants
    sizes = runner.compiled_cache_sizes()
    assert eng.num_free_pages == eng.num_total_pages
    rng = random.Random(0)
    eng._select_gamma = lambda: rng.randint(0, 2)
    from nightjar_jax.engine.sampling_params import SamplingParams

    eng.add_request([7], greedy(8), request_id="0")
    eng.add_request([8], SamplingParams(temperature=0.5, max_tokens=8, seed=3), request_id="1")
    done = run_all(eng)
    assert done["0"] == _expected([7], 8) and len(done["1"]) == 8
    after = runner.compiled_cache_sizes()
    for name in ("forward_sample", "propose_tree", "verify_tree", "verify"):  # draft_fill: catch-up, warmup_prefill
        assert after[name] == sizes[name], name


# ---- sampled tree verification (lossless) ------------------------------------------------------------------------

def _tree_sampling_case(num_rows=20_000, vocab=8, seed=0):
    """A tree (root -> 3 children, the first two with 2 children each) with the target's distribution after each
    node fixed per node (random, seeded), and node tokens distinct among siblings."""
    from nightjar_jax.engine.sampler import SamplingTensors

    tree = make_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1)])
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab, 0.8), size=tree.num_nodes + 1).astype(np.float32)  # [N + 1, V]
    node_tok = np.zeros(tree.num_nodes + 1, np.int32)
    for parent in range(tree.num_nodes + 1):
        kids = [c for c in tree.children[parent] if c >= 0]
        node_tok[kids] = rng.choice(vocab, size=len(kids), replace=False)
    tokens = jnp.asarray(np.broadcast_to(node_tok, (num_rows, tree.num_nodes + 1)))
    target = jnp.asarray(np.broadcast_to(np.log(probs), (num_rows,) + probs.shape))  # logits; T = 1 keeps p
    st = SamplingTensors(np.ones(num_rows, np.float32), np.zeros(num_rows, np.int32), np.ones(num_rows, np.float32),
                         np.zeros(num_rows, np.float32), np.arange(num_rows, dtype=np.uint32),
                         np.zeros(num_rows, np.int32))
    return tree, probs, node_tok, tokens, target, st


def test_tree_rejection_sample_commits_tokens_distributed_as_the_target():
    from nightjar_jax.spec.rejection import tree_rejection_sample

    tree, probs, node_tok, tokens, target, st = _tree_sampling_case()
    valid = jnp.ones(tokens.shape, bool)
    out, k, path = jax.jit(lambda *a: tree_rejection_sample(*a, tree, st))(tokens, target, valid)
    out, k, path = np.asarray(out), np.asarray(k), np.asarray(path)
    vocab = probs.shape[1]
    # first token ~ p(root)
    assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), probs[0]) > 1e-3
    # second token, given the first is a child's token: ~ p(that child); given any other token: the step ended
    for child in (1, 2, 3):
        rows = out[:, 0] == node_tok[child]
        assert (k[rows] >= 1).all() and (path[rows, 1] == child).all()
        assert _chi_square_p_value(np.bincount(out[rows, 1], minlength=vocab), probs[child]) > 1e-3
    others = ~np.isin(out[:, 0], node_tok[[1, 2, 3]])
    assert (k[others] == 0).all() and (out[others, 1] == -1).all()
    # the third token after an accepted second-level node ~ p(that node) (a leaf: its bonus draw)
    rows = (path[:, 1] == 1) & (out[:, 1] == node_tok[4])
    assert (k[rows] == 2).all() and _chi_square_p_value(np.bincount(out[rows, 2], minlength=vocab), probs[4]) > 1e-3
    # negative control: the first token is far from a different distribution
    assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), np.roll(probs[0], 1)) < 1e-6
    # and acceptance happens as often as the children's mass says: P(k >= 1) = p_root(children's tokens)
    assert abs((k >= 1).mean() - probs[0][node_tok[[1, 2, 3]]].sum()) < 0.015


def test_tree_rejection_sample_under_a_mask_never_accepts_a_banned_node():
    """A structured output's masks in a tree step (``RequestGrammar.walk``): the target's logits banned where the
    constraint refuses, node 1's token among them at the root. Recursive rejection sampling rejects node 1 (p = 0)
    into the residual, never accepts it, and commits tokens distributed as the masked target (chi-square, with a
    negative control: the unmasked target)."""
    from nightjar_jax.engine.sampler import BANNED
    from nightjar_jax.spec.rejection import tree_rejection_sample

    tree, probs, node_tok, tokens, _, st = _tree_sampling_case()
    vocab = probs.shape[1]
    allowed = np.ones(probs.shape, bool)
    allowed[0, ::2] = False  # half the vocabulary at the root,
    allowed[0, node_tok[1]] = False  # node 1's token among it,
    allowed[0, node_tok[[2, 3]]] = True  # its siblings' not
    allowed[2, node_tok[6]] = False  # and node 6's under node 2
    masked = np.where(allowed, probs, 0)
    masked /= masked.sum(axis=-1, keepdims=True)
    logits = np.where(allowed, np.log(probs), BANNED).astype(np.float32)
    target = jnp.asarray(np.broadcast_to(logits, (tokens.shape[0],) + logits.shape))
    out, k, path = (np.asarray(x) for x in jax.jit(lambda *a: tree_rejection_sample(*a, tree, st))(
        tokens, target, jnp.ones(tokens.shape, bool)))
    assert not np.isin(path, [1, 6]).any() and allowed[0, out[:, 0]].all()
    assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), masked[0]) > 1e-3
    assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), probs[0]) < 1e-6  # (negative control)
    rows = out[:, 0] == node_tok[2]
    assert (path[rows, 1] == 2).all() and allowed[2, out[rows, 1]].all()
    assert _chi_square_p_value(np.bincount(out[rows, 1], minlength=vocab), masked[2]) > 1e-3


def test_a_copy_branch_duplicating_a_draft_node_stays_lossless():
    """The copy branch (n-gram lookup's tokens, tried first among the root's children) may repeat a draft
    candidate's token: recursive rejection sampling still commits tokens distributed as the target (the duplicate
    has no mass left once tried), accepts the repeated token through the copy node, and never through copy nodes
    a row marks invalid."""
    from nightjar_jax.spec.rejection import tree_rejection_sample
    from nightjar_jax.spec.tree import COPY, with_copy_branch

    tree = with_copy_branch(make_tree([(0,), (1,), (0, 0)]), 2)
    assert tree.paths == ((COPY,), (0,), (1,), (COPY, COPY), (0, 0)) and tree.copy_depth == 2
    assert [list(tree.ranked(d)) for d in (1, 2)] == [[2, 3], [5]] and [tree.top_k(d) for d in (0, 1)] == [2, 1]
    _, probs, _, _, _, st = _tree_sampling_case(num_rows=20_000, seed=3)
    probs = probs[: tree.num_nodes + 1].copy()
    probs[1] = probs[2]  # the copied node 1 and the draft's node 2 carry the same token: the same context
    node_tok = np.asarray([0, 5, 5, 2, 6, 1], np.int32)  # root; copy 5, draft 5 and 2; copy 6; draft 1
    rows = 20_000
    tokens = jnp.asarray(np.broadcast_to(node_tok, (rows, tree.num_nodes + 1)))
    target = jnp.asarray(np.broadcast_to(np.log(probs), (rows,) + probs.shape))
    vocab = probs.shape[1]
    run = jax.jit(lambda *a: tree_rejection_sample(*a, tree, st))
    for copy_ok in (True, False):
        valid = np.ones((rows, tree.num_nodes + 1), bool)
        valid[:, [1, 4]] = copy_ok
        out, k, path = (np.asarray(x) for x in run(tokens, target, jnp.asarray(valid)))
        assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), probs[0]) > 1e-3
        five = out[:, 0] == 5
        assert (path[five, 1] == (1 if copy_ok else 2)).all()  # the copy node is tried first; the twin never
        assert _chi_square_p_value(np.bincount(out[five, 1], minlength=vocab), probs[1]) > 1e-3
        assert copy_ok or not np.isin(path, [1, 4]).any()
    assert _chi_square_p_value(np.bincount(out[:, 0], minlength=vocab), np.roll(probs[0], 1)) < 1e-6  # control


def test_tree_rejection_sample_greedy_rows_match_tree_greedy_verify():
    from nightjar_jax.engine.sampler import SamplingTensors
    from nightjar_jax.spec.rejection import tree_rejection_sample

    tree, probs, node_tok, tokens, target, _ = _tree_sampling_case(num_rows=64, seed=2)
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((64, tree.num_nodes + 1, 8)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, 8, (64, tree.num_nodes + 1)).astype(np.int32))
    greedy = SamplingTensors(np.zeros(64, np.float32), np.zeros(64, np.int32), np.ones(64, np.float32),
                             np.zeros(64, np.float32), np.arange(64, dtype=np.uint32), np.zeros(64, np.int32))
    from nightjar_jax.engine.sampler import argmax

    valid = jnp.asarray(rng.random((64, tree.num_nodes + 1)) < 0.9)
    want = tree_greedy_verify(tokens, argmax(logits), valid, tree)
    got = tree_rejection_sample(tokens, logits, valid, tree, greedy)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_spec_tree_file_orders_and_errors(tmp_path):
    """A tree order from a file (what ``fit_spec_tree.py fit`` writes): a chain-shaped order makes tree steps
    accept exactly what the chain does; bad files fail with the file and the fault named."""
    import json

    from nightjar_jax.spec.tree import load_tree_order

    chain_file = tmp_path / "chain.json"
    chain_file.write_text(json.dumps({"order": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    assert load_tree_order(str(chain_file)) == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    logs = {}
    for name, kwargs in {"chain": {}, "file": {"spec_tree_nodes": 4, "spec_tree_file": str(chain_file)}}.items():
        eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=4, **kwargs)
        _force_gamma(eng, lambda: 4)
        eng.record_steps = True
        for i, p in enumerate(PROMPTS):
            eng.add_request(p, greedy(17), request_id=str(i))
        assert run_all(eng) == {str(i): _expected(p, 17) for i, p in enumerate(PROMPTS)}
        logs[name] = [(s["accepted"], s["committed"]) for s in eng.stats.step_log]
    assert logs["file"] == logs["chain"]
    for text, fault in [("not json", "cannot read"), ('{"order": []}', "non-empty list"),
                        ('{"order": [[0, 1], [0]]}', "before its parent"), ('{"order": [["a"]]}', "list of ranks")]:
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=fault):
            load_tree_order(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        load_tree_order(str(tmp_path / "missing.json"))
