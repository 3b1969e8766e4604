"""``scripts/bench_logprobs.py``: every logprobs variant decodes the same workload and the prompt is scored in full."""

from __future__ import annotations

from nightjar_jax import LLM
from nightjar_jax.testing import load_script


def test_bench_logprobs_rows_for_every_variant(capsys):
    bench = load_script("bench_logprobs.py", "bench_logprobs_t")
    llm = LLM("stories260k", draft_model=None, max_num_seqs=2, max_model_len=96, max_num_batched_tokens=64)
    result = bench.run(llm, [2], rounds=1, prompt_len=8, output_len=4, score_len=40)
    for b in (2,):
        row = result["decode"][b]
        assert list(row) == ["off", "0", "5", "20"] and row["off"]["vs_off"] == 1.0
        assert all(len(cell["samples"]) == 1 and cell["tokens_per_second"] > 0 for cell in row.values())
    assert set(result["score_prompt"]) == {"off", "0", "5"}
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
    bench.print_table(result)
    assert "logprobs=20" in capsys.readouterr().out
