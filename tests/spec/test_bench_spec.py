"""``scripts/bench_spec.py --drafts`` / ``--tree-nodes``: several drafts of one target, or one draft as a chain and
as token trees, timed interleaved, one row per cell and variant."""

from __future__ import annotations

import argparse

from nightjar_jax.testing import load_script


def test_two_drafts_of_one_target_give_a_row_per_cell_and_draft() -> None:
    bench = load_script("bench_spec.py", "bench_spec_t")
    args = argparse.Namespace(drafts="stories260k@skip=2,stories260k@layers=3", tree_nodes="0", gamma_max=2, gammas="2",
                              prompt_len=8, output_len=6, repeats=2, dtype="float32")
    rows = bench.bench_model("stories260k", args, [1], ["Once upon a time there was a little dog."])
    cells = sorted((r["draft"], r["gamma"]) for r in rows)
    assert cells == [("stories260k@layers=3", 0), ("stories260k@layers=3", 2),
                     ("stories260k@skip=2", 0), ("stories260k@skip=2", 2)]
    for r in rows:
        assert r["committed_tokens"] == 5  # output_len - 1 decode tokens (prefill made the first), never more
        assert r["tokens_per_second"] > 0
        assert (r["mean_accepted_length"] == 1.0) if r["gamma"] == 0 else (1.0 <= r["mean_accepted_length"] <= 3.0)
    bench.print_table(rows, 2)


def test_chain_and_tree_variants_of_one_draft() -> None:
    bench = load_script("bench_spec.py", "bench_spec_t2")
    args = argparse.Namespace(drafts="stories260k@skip=2", tree_nodes="0,6", gamma_max=2, gammas="2",
                              prompt_len=8, output_len=6, repeats=1, dtype="float32")
    rows = bench.bench_model("stories260k", args, [1], ["Once upon a time there was a little dog."])
    cells = sorted((r["draft"], r["tree_nodes"], r["gamma"]) for r in rows)
    assert cells == [("stories260k@skip=2", 0, 0), ("stories260k@skip=2", 0, 2),
                     ("stories260k@skip=2+tree6", 6, 0), ("stories260k@skip=2+tree6", 6, 2)]
    for r in rows:
        assert r["committed_tokens"] == 5 and r["tokens_per_second"] > 0
        assert (r["mean_accepted_length"] == 1.0) if r["gamma"] == 0 else (1.0 <= r["mean_accepted_length"] <= 3.0)


def test_planner_mode_times_forced_ar_against_the_planner_with_a_tree_arm() -> None:
    """``--planner``: per variant, forced AR and the planner's own choice of γ (tree only at γ_max here), with the
    steps each γ got (which γ the planner plays depends on measured times: only that they are arms is pinned)."""
    bench = load_script("bench_spec.py", "bench_spec_t3")
    args = argparse.Namespace(drafts="stories260k@skip=2", tree_nodes="0,6", tree_min_gamma=2, planner="nightjar",
                              gamma_max=2, gammas=None, prompt_len=8, output_len=12, repeats=1, dtype="float32")
    rows = bench.bench_model("stories260k", args, [2], ["Once upon a time there was a little dog."])
    cells = sorted((r["draft"], str(r["gamma"])) for r in rows)
    assert cells == [("stories260k@skip=2", "0"), ("stories260k@skip=2", "planner:nightjar"),
                     ("stories260k@skip=2+tree6", "0"), ("stories260k@skip=2+tree6", "planner:nightjar")]
    for r in rows:
        assert r["committed_tokens"] == 2 * 11 and r["tokens_per_second"] > 0
        assert set(r["gamma_steps"]) <= {0, 1, 2} and sum(r["gamma_steps"].values()) == r["num_decode_steps"]
        if r["gamma"] == 0:
            assert r["gamma_steps"] == {0: r["num_decode_steps"]}
    bench.print_planner_table(rows)
