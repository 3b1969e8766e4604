"""``scripts/check_lossless.py``: greedy SD against plain decoding, prompt by prompt, on a tiny pair."""

from __future__ import annotations

from nightjar_jax.testing import load_script


def test_first_difference_counts_values_and_lengths() -> None:
    check = load_script("check_lossless.py", "check_lossless_t")
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert check.first_difference([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it stops
    assert check.first_difference([], [4]) == 0


def test_compare_reports_every_planner_and_no_difference_on_a_lossless_pair() -> None:
    check = load_script("check_lossless.py", "check_lossless_t2")
    prompts = [[1, 403, 261, 374, 302, 70, 45], [1, 70, 45, 321, 2, 9, 400, 33]]
    rows = check.compare("stories260k", "stories260k@skip=2", prompts, "auto", ["static:3", "nightjar"],
                         max_tokens=12, gamma=3, max_model_len=64, max_num_seqs=2)
    assert [r["planner"] for r in rows] == ["ar (reference, batch 1)", "static:3", "nightjar"]
    assert rows[1]["batch"] == 2
    assert all(r["prompts"] == 2 and r["tokens"] == rows[0]["tokens"] > 0 for r in rows)
    assert all(r["differing"] == [] for r in rows)
    assert rows[1]["drafted"] > 0  # static:3 drafted every decode step
