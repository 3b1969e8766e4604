"""``scripts/bench_engine.py``'s interleaved batch-1 measurement: every decode step is followed by one read of the
weights' bytes, so each step has the floor of its own moment."""

from __future__ import annotations

import numpy as np
import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.bench.common import BUILT_IN_PROMPTS, ReadProbe, make_prompt_ids, state_bytes
from nightjar_jax.testing import load_script


def test_interleaved_batch1_pairs_every_decode_step_with_a_read_and_frees_its_pages() -> None:
    bench = load_script("bench_engine.py", "bench_engine_t")
    llm = LLM("stories260k", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_pages=16,
              draft_model=None)
    weight_bytes = state_bytes(llm.engine.runner.target.model_state())
    probe = ReadProbe(weight_bytes + 3)  # rounded down to whole float32s
    assert probe.num_bytes == (weight_bytes + 3) // 4 * 4
    prompt = [1, 400, 18, 29]
    res = bench.interleaved_batch1(llm, prompt, 7, probe)

    assert res["steps"] == 7 and len(res["step_ms"]) == len(res["read_ms"]) == 7  # decode steps only
    assert all(v > 0 for v in res["step_ms"] + res["read_ms"])
    ratios = np.array(res["step_ms"]) / np.array(res["read_ms"])
    assert res["step_over_read_median"] == np.median(ratios)
    q1, q3 = res["step_over_read_quartiles"]
    assert q1 <= res["step_over_read_median"] <= q3
    assert res["read_gbs_peak"] >= res["read_gbs_median"] > 0
    fast = np.array(res["read_ms"]) <= 1.25 * min(res["read_ms"])  # the fastest read's level
    assert res["fast_pairs"] == fast.sum() >= 1
    assert res["step_over_read_fast_median"] == np.median(ratios[fast])
    assert res["step_over_read_slow_median"] == (np.median(ratios[~fast]) if (~fast).any() else None)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages  # the request finished, its pages are back

    # the decode steps were the engine's ordinary greedy steps: the same tokens as a plain generate
    ref = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert res["token_ids"] == ref


def test_host_share_of_a_batch_not_run_yet_warms_it_first(monkeypatch) -> None:
    """bench_engine's --host-batch outside --batch-sizes: its shapes compiled inside the timed steps and calls (a
    3.5-42 ms "step" with a 0.4-3.9% host share, QA 2026-12-07); ``warm`` runs the workload once untimed first."""
    from nightjar_jax.bench import common

    llm = LLM("stories260k", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_pages=32,
              draft_model=None)
    stats = llm.engine.stats
    real = common.run_decode_workload
    compiles: list[tuple[bool, int]] = []  # (timed, decode steps that compiled) per workload run

    def counted(*args, **kwargs):
        before = stats.num_compiling_decode_steps
        run = real(*args, **kwargs)
        compiles.append((getattr(llm.engine.runner._forward_sample, "__name__", None) == "timed",
                         stats.num_compiling_decode_steps - before))
        return run

    monkeypatch.setattr(common, "run_decode_workload", counted)
    prompts = [[1, 400, 18, 29], [1, 29, 18], [1, 18]]
    share = common.host_share(llm, prompts, 6, warm=True)
    assert [timed for timed, _ in compiles] == [False, True] and compiles[0][1] >= 1 and compiles[1][1] == 0
    assert share["batch_size"] == 3 and 0 <= share["host_fraction"] < 1


class _ChatTokenizer:
    """Characters as ids; the chat template wraps the question in fixed markers."""

    def apply_chat_template(self, messages):
        return "<u>" + messages[0]["content"] + "</u><a>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_chat_prompts_keep_whole_questions_that_fit() -> None:
    tok = _ChatTokenizer()
    texts = ["short?", "a much longer question than the limit allows?", "mid question"]
    prompts, source = make_prompt_ids(tok, texts, 5, 22, vocab_size=256, chat=True)
    assert source == "dataset-chat"
    # a missing default dataset's fallback says so (it read "dataset-chat": two questions over and over)
    assert make_prompt_ids(tok, list(BUILT_IN_PROMPTS), 3, 40, vocab_size=256, chat=True)[1] == "built-in-chat"
    assert make_prompt_ids(tok, list(BUILT_IN_PROMPTS), 3, 8, vocab_size=256)[1] == "built-in"
    fits = [tok.encode("<u>short?</u><a>"), tok.encode("<u>mid question</u><a>")]
    assert prompts == [fits[0], fits[1], fits[0], fits[1], fits[0]]  # the long one skipped, the others in turn
    with pytest.raises(ValueError, match="no question of the dataset fits in 5 tokens"):
        make_prompt_ids(tok, texts, 2, 5, vocab_size=256, chat=True)
    with pytest.raises(ValueError, match="chat template"):
        make_prompt_ids(None, texts, 2, 20, vocab_size=256, chat=True)


class _FixedOutputs:
    """An engine stand-in whose greedy outputs are given (``generate`` as LLM's, one output per request)."""

    def __init__(self, outs):
        self.outs = outs

    def generate(self, reqs, sp, use_tqdm=False):
        assert sp.temperature == 0 and sp.ignore_eos and len(reqs) == len(self.outs)

        class _O:
            def __init__(self, ids):
                self.outputs = [type("C", (), {"token_ids": ids})()]

        return [_O(ids) for ids in self.outs]


def test_greedy_agreement_counts_tokens_before_the_first_difference() -> None:
    bench = load_script("bench_engine.py", "bench_engine_t3")
    a = _FixedOutputs([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    b = _FixedOutputs([[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]])
    res = bench.greedy_agreement(a, b, [[1], [2], [3]], 4)
    assert res["sequences"] == 3 and res["equal_sequences"] == 1
    assert res["common_prefix"] == [4, 2, 0]
    assert res["equal_tokens"] == 6 / 12
    same = bench.greedy_agreement(a, a, [[1], [2], [3]], 4)
    assert same["equal_sequences"] == 3 and same["equal_tokens"] == 1.0
