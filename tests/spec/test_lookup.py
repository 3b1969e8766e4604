"""N-gram lookup drafts (``nightjar_jax/spec/lookup.py``, ``SpecConfig.prompt_lookup_max``): the index's proposals,
and the engine verifying them, losslessly, beside a token draft (greedy rows and sampled ones)."""

from __future__ import annotations

import json

import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.config import ConfigError, SpecConfig
from nightjar_jax.spec.lookup import NgramIndex


def _naive(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the latest earlier occurrence of the longest suffix (max_n .. min_n) that occurred before."""
    t = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if t < n + 1:
            continue
        for s in range(t - n - 1, -1, -1):
            if tokens[s : s + n] == tokens[t - n :]:
                return tokens[s + n : min(s + n + k, t)]
    return []


def _index(tokens: list[int], min_n: int, max_n: int) -> NgramIndex:
    idx = NgramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx


def test_proposals_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "5 6" occurred at 0 and 4; "9 5 6" only at 3 -> the 3-gram wins, continuing from position 6
    seq = [5, 6, 1, 9, 5, 6, 2, 3, 4, 8, 9, 5, 6]
    idx = _index(seq, 2, 3)
    assert idx.propose(4) == [2, 3, 4, 8] and len(idx) == len(seq)
    idx.extend([7])
    assert idx.propose(4) == []  # "6 7" and "5 6 7" never occurred before
    # the continuation stops at the sequence's end (a loop copies itself)
    assert _index([1, 2, 1, 2, 1, 2], 2, 2).propose(4) == [1, 2]
    assert _index([3, 4], 2, 2).propose(4) == []  # too short to have occurred before
    assert NgramIndex(1, 3).propose(4) == []  # nothing indexed yet


def test_incremental_index_equals_the_definition_at_every_length() -> None:
    import random

    rng = random.Random(0)
    for min_n, max_n in [(1, 1), (2, 3), (1, 4), (3, 5)]:
        seq = [rng.randrange(4) for _ in range(200)]
        idx = NgramIndex(min_n, max_n)
        t = 0
        while t < len(seq):
            step = rng.choice([1, 1, 2, 5])  # one step commits 1 .. γ + 1 tokens
            idx.extend(seq[t : t + step])
            t = min(len(seq), t + step)
            assert idx.propose(4) == _naive(seq[:t], 4, min_n, max_n), (min_n, max_n, t)


def test_large_ids_do_not_collide_and_bad_input_is_an_error() -> None:
    big = (1 << 32) - 1  # the largest id a key packs (any int32 id fits)
    idx = _index([big, 0, 7, 0, big, 0], 2, 2)  # (big, 0) occurred at 0 and 4; (0, big) at 3
    assert idx.propose(3) == [7, 0, big]
    with pytest.raises(ValueError, match="token id -1 is outside 0 .. 4294967295"):
        _index([1, -1], 2, 2)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex(0, 2)
    with pytest.raises(ConfigError, match="prompt_lookup_min.*at most prompt_lookup_max=2"):
        SpecConfig(prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        SpecConfig(prompt_lookup_max=-1)
    SpecConfig(prompt_lookup_max=0, prompt_lookup_min=5)  # off: the minimum is not checked against it


LOOP = [1, 403, 261, 374, 302, 70, 45, 403, 261, 374, 302, 70, 45, 403, 261, 374]  # repeats itself
PLAIN = [1, 70, 45, 321, 2, 9, 400, 33, 12, 101, 7, 8, 300, 5, 6, 99, 98]


@pytest.fixture(scope="module")
def engines():
    common = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32, num_pages=64)
    ar = LLM("stories260k", draft_model=None, **common)
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static:3",
             prompt_lookup_max=3, prompt_lookup_min=1, **common)  # unigrams too: this model's text rarely loops
    return ar, sd


def test_greedy_lookup_with_a_token_draft_equals_ar(engines) -> None:
    ar, sd = engines
    runner, propose = sd.engine.runner, sd.engine.runner._propose
    calls = []
    runner._propose = lambda *a: calls.append(1) or propose(*a)
    finish, kept = sd.engine._finish, []
    sd.engine._finish = lambda r, reason: finish(r, reason) or kept.append(r.lookup_index)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ar.generate([{"prompt_token_ids": p} for p in (LOOP, PLAIN)], greedy,
                                                       use_tqdm=False)]
    for prompts in ([LOOP], [PLAIN], [LOOP, PLAIN]):  # alone (a copying step skips the draft) and batched
        outs = sd.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want[0 if p is LOOP else 1] for p in prompts]
    runner._propose = propose
    sd.engine._finish = finish
    assert len(kept) == 4 and not any(kept)  # a finished request drops its n-gram tables at once
    s = sd.engine.stats
    assert s.num_lookup_steps > 0 and 0 <= s.num_lookup_accepted <= 3 * s.num_lookup_steps
    assert 0 < len(calls) < s.num_decode_steps  # some steps copied every row's drafts and skipped the draft model
    assert sd.engine.num_free_pages == sd.engine.num_total_pages


def test_sampled_rows_copy_as_point_masses(engines) -> None:
    """Sampled rows verify copied tokens too, as draws from a point mass (rejection sampling stays lossless; the
    distribution test is tests/spec/test_rejection.py): a top-k 1 sampled request (a one-hot target distribution,
    through the rejection path) gives exactly the greedy tokens while copying, beside a T = 0.8 request."""
    ar, sd = engines
    eng = sd.engine
    eng.record_steps = True
    eng.stats.step_log.clear()
    want = ar.generate([{"prompt_token_ids": LOOP}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    outs = sd.generate([{"prompt_token_ids": LOOP}, {"prompt_token_ids": PLAIN}],
                       [SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=24, ignore_eos=True),
                        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want
    assert len(outs[1].outputs[0].token_ids) == 24
    rows = [s["lookup"] for s in eng.stats.step_log if s["gamma"] > 0 and s["batch_size"] == 2]
    assert rows and any(r[0] for r in rows)  # the top-k 1 row copied (verified by rejection sampling)
    assert eng.num_free_pages == eng.num_total_pages


def _lookup_engine_observed(planner: str):
    """A stories260k engine with a layer-skip draft (γ_max = 3), lookup on and its step log recorded, and the γ of
    every step its planner observes."""
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner=planner,
             prompt_lookup_max=3, prompt_lookup_min=1, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32,
             num_pages=64)
    eng = sd.engine
    eng.record_steps = True
    observed: list[int] = []
    observe = eng.planner.observe
    eng.planner.observe = lambda gamma, *a, **k: observed.append(gamma) or observe(gamma, *a, **k)
    return sd, eng, observed


def test_steps_that_copy_every_row_in_full_run_at_gamma_max_unobserved(engines) -> None:
    """The planner asks for γ = 1 of γ_max = 3; a step where every (greedy) row copies all 3 drafts runs at 3
    instead (the draft model skips it), and the planner sees only the steps it chose. Outputs stay AR's."""
    ar, _ = engines
    sd, eng, observed = _lookup_engine_observed(planner="static:1")
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (LOOP, PLAIN)]
    assert [o.outputs[0].token_ids for o in sd.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in ar.generate(prompts, greedy, use_tqdm=False)]
    gammas = [s["gamma"] for s in eng.stats.step_log]
    assert gammas.count(3) > 0 and gammas.count(1) > 0  # boosted copying steps and the planner's own
    assert all(all(s["lookup"]) for s in eng.stats.step_log if s["gamma"] == 3)
    own = [s for s in eng.stats.step_log if s["gamma"] == 1 and not s["compiled"]]  # (compiling steps: unobserved)
    assert set(observed) == {1} and len(observed) == len(own)
    assert eng.num_free_pages == eng.num_total_pages


def test_autoregressive_steps_verify_a_full_copy_at_batch_1(engines, monkeypatch) -> None:
    """The planner picks γ = 0 (plain decoding); at batch 1 a step whose lookup copies all γ_max drafts verifies the
    copied chain anyway (no draft pass), unobserved; at batch 2 (more rows than LOOKUP_AR_BOOST_MAX_ROWS) it stays
    plain. Outputs stay AR's and every page comes back."""
    from nightjar_jax.engine import engine as engine_mod

    ar, _ = engines
    sd, eng, observed = _lookup_engine_observed(planner="static:0")
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = ar.generate([{"prompt_token_ids": LOOP}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert sd.generate([{"prompt_token_ids": LOOP}], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    gammas = [s["gamma"] for s in eng.stats.step_log]
    assert gammas.count(3) > 0 and gammas.count(0) > 0  # boosted copying steps and the planner's plain ones
    assert all(all(s["lookup"]) and s["batch_size"] == 1 for s in eng.stats.step_log if s["gamma"] == 3)
    own = [s for s in eng.stats.step_log if s["gamma"] == 0 and not s["compiled"]]  # (compiling steps: unobserved)
    assert set(observed) == {0} and len(observed) == len(own)
    assert eng.num_free_pages == eng.num_total_pages
    # batch 2: 2 x 4 rows > LOOKUP_AR_BOOST_MAX_ROWS: plain steps only
    eng.stats.step_log.clear()
    prompts = [{"prompt_token_ids": p} for p in (LOOP, LOOP[1:])]
    assert [o.outputs[0].token_ids for o in sd.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in ar.generate(prompts, greedy, use_tqdm=False)]
    assert all(s["gamma"] == 0 for s in eng.stats.step_log if s["batch_size"] == 2)
    # with the limit raised, batch 2 copies too
    monkeypatch.setattr(engine_mod, "LOOKUP_AR_BOOST_MAX_ROWS", 8)
    eng.stats.step_log.clear()
    assert [o.outputs[0].token_ids for o in sd.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in ar.generate(prompts, greedy, use_tqdm=False)]
    assert any(s["gamma"] == 3 and s["batch_size"] == 2 for s in eng.stats.step_log)
    assert eng.num_free_pages == eng.num_total_pages


def test_trees_carry_a_copy_branch_and_steps_that_copy_every_row_verify_a_chain(engines, tmp_path) -> None:
    """With lookup on, each token tree carries a chain of γ copied nodes beside the draft's (here 2 nodes of depth
    1, so accepting 2 or more drafts in a tree step means the copy branch was accepted), verified greedy or by
    rejection sampling (a top-k 1 sampled row with a copy branch gives exactly the greedy tokens;
    its distribution: tests/spec/test_tree.py). A step where every greedy row
    copies all γ_max drafts verifies the copied chain instead, boosted from the planner's 2 (γ_max positions
    reserved, not the tree's nodes). Outputs stay AR's, warm-up covers every variant, no page leaks."""
    ar, _ = engines
    order = tmp_path / "tree.json"
    order.write_text(json.dumps({"order": [[0], [1]]}))  # the draft's tree: its top 2 tokens, depth 1
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static:2",
             spec_tree_nodes=2, spec_tree_file=str(order), prompt_lookup_max=3, prompt_lookup_min=1,
             max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32, num_pages=64)
    eng = sd.engine
    runner = eng.runner
    assert runner.trees[2].paths == ((-1,), (0,), (1,), (-1, -1))
    assert [runner.lookahead(g) for g in (1, 2, 3)] == [3, 4, 5]
    runner.warmup(max_context=96)
    sizes = runner.compiled_cache_sizes()
    eng.record_steps = True
    reserved = []
    schedule = eng.scheduler.schedule_decode
    eng.scheduler.schedule_decode = lambda lookahead: reserved.append(lookahead) or schedule(lookahead)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (LOOP, PLAIN)]
    for batch in ([prompts[0]], prompts):
        assert [o.outputs[0].token_ids for o in sd.generate(batch, greedy, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in ar.generate(batch, greedy, use_tqdm=False)]
    log = [s for s in eng.stats.step_log if s["gamma"] > 0]
    copying = [s for s in log if s["tree_nodes"] == 0]
    assert copying and all(s["gamma"] == 3 and all(s["lookup"]) for s in copying)  # boosted to γ_max, a chain
    trees = [s for s in log if s["tree_nodes"] > 0]
    assert trees and all(s["gamma"] == 2 and s["tree_nodes"] == 4 for s in trees)
    assert any(k >= 2 and copied for s in trees for k, copied in zip(s["accepted"], s["lookup"], strict=True))
    assert set(reserved) == {3, 4}  # a copied chain of 3; a tree of 2 + 2 copied nodes

    eng.stats.step_log.clear()  # a top-k 1 sampled row (LOOP, row 0 throughout: the other runs longer)
    want = ar.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = sd.generate(prompts, [SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=32, ignore_eos=True),
                                 SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)],
                       use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want and len(outs[1].outputs[0].token_ids) == 40
    rows = [(s["accepted"][0], s["lookup"][0]) for s in eng.stats.step_log if s["tree_nodes"] and s["batch_size"] == 2]
    assert any(copied for _, copied in rows)  # its tree steps carried a copy branch (distribution: test_tree.py)
    after = runner.compiled_cache_sizes()  # (runner.warmup: decode only; prefill and catch-up: warmup_prefill)
    assert {k: after[k] for k in ("verify", "propose_tree", "verify_tree")} == {
        k: sizes[k] for k in ("verify", "propose_tree", "verify_tree")}
    assert eng.num_free_pages == eng.num_total_pages
