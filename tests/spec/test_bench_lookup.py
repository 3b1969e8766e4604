"""``scripts/bench_lookup.py``: the four variants decode the same prompts in turn; rows count decode tokens only."""

from __future__ import annotations

import pytest

from nightjar_jax.testing import load_script

PROMPTS = [[1, 403, 261, 374, 302, 70, 45, 403, 261, 374], [1, 70, 45, 321, 2, 9, 400, 33], [1, 5, 6, 5, 6, 5]]


def test_four_variants_are_configured_as_named_and_count_decode_tokens_only() -> None:
    bench = load_script("bench_lookup.py", "bench_lookup_t")
    llms = {v: bench.build(v, 64, model="stories260k", draft="stories260k@skip=2") for v in bench.VARIANTS}
    assert llms["plain"].engine.draft is None
    assert llms["draft alone"].engine.runner.lookup is None
    assert llms["lookup at the planner's γ"].engine._lookup_boost(1) is False  # disabled on that engine
    assert llms["lookup, copying steps at γ_max"].engine.runner.lookup == (2, 3)  # the engine's defaults
    rows = bench.run(llms, PROMPTS, max_tokens=12, warmup=1)
    for name, row in rows.items():
        assert row["tokens"] == 2 * 11, name  # 2 timed prompts, 11 decode tokens each (prefill made the first)
        assert row["tokens_per_second"] > 0 and sum(row["steps_per_gamma"].values()) >= 1
    assert rows["plain"]["steps_per_gamma"] == {0: 22}
    rows = bench.run(llms, PROMPTS + PROMPTS[:1], max_tokens=12, warmup=1, batch_size=2)  # groups of 2, one timed
    assert all(row["tokens"] == 2 * 11 for row in rows.values())


def test_tree_variants_carry_a_copy_branch_only_with_lookup() -> None:
    bench = load_script("bench_lookup.py", "bench_lookup_t2")
    names = bench.tree_variants([3])
    assert names == ["tree of 3, draft alone", "tree of 3 + copy branch"]
    alone, copy = (bench.build(v, 64, model="stories260k", draft="stories260k@skip=2") for v in names)
    assert alone.engine.runner.lookup is None and alone.engine.runner.trees[3].copy_depth == 0
    assert copy.engine.runner.lookup == (2, 3) and copy.engine.runner.trees[3].copy_depth == 3
    assert copy.engine.runner.trees[3].num_nodes == 3 + 3
    rows = bench.run({"alone": alone, "copy": copy}, PROMPTS, max_tokens=12, warmup=1)
    assert all(row["tokens"] == 2 * 11 for row in rows.values())
    with pytest.raises(ValueError, match="unknown variant"):
        bench.build("trees", 64, model="stories260k", draft="stories260k@skip=2")


def test_the_ngram_variant_has_no_draft_model() -> None:
    bench = load_script("bench_lookup.py", "bench_lookup_t3")
    llm = bench.build(bench.NGRAM, 64, model="stories260k")
    assert llm.engine.draft is None and llm.engine.ngram_only and llm.engine.gamma_max == 4
    rows = bench.run({"ngram": llm}, PROMPTS, max_tokens=12, warmup=1)
    assert rows["ngram"]["tokens"] == 2 * 11
