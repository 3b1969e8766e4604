"""``scripts/bench_seeded.py``: seeded and unseeded rows per temperature, the seeded outputs checked against the same
requests decoded without a draft."""

from __future__ import annotations

from nightjar_jax import LLM
from nightjar_jax.testing import load_script

PROMPTS = [[1, 403, 261, 374, 302, 70, 45, 403, 261, 374], [1, 70, 45, 321, 2, 9, 400, 33], [1, 5, 6, 5, 6, 5]]


def test_seeded_rows_repeat_plain_decoding_and_count_acceptance(capsys) -> None:
    bench = load_script("bench_seeded.py", "bench_seeded_t")
    spec = LLM("stories260k", draft_model="stories260k@skip=2", planner="static", num_speculative_tokens=3,
               max_model_len=64)
    plain = LLM("stories260k", draft_model="none", max_model_len=64)
    rows = bench.run(spec, plain, PROMPTS, [1.0], max_tokens=12)
    assert [(r["temperature"], r["seeded"]) for r in rows] == [(1.0, False), (1.0, True)]
    assert all(r["drafted"] > 0 and 0 <= r["accepted"] <= r["drafted"] for r in rows)
    assert rows[1]["same_as_plain"] == len(PROMPTS) and "same_as_plain" not in rows[0]
    text = bench.table(rows, len(PROMPTS))
    assert "unseeded" in text and f"{len(PROMPTS)}/{len(PROMPTS)}" in text
