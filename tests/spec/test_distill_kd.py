"""Distillation on the target's logits (``scripts/distill_draft.py teacher`` and ``train --teacher``, issue 8).

On the tiny stories260K model standing in for the target (the script's ``TARGET`` swapped): the stored top-k is
the target's own ranking at exactly the response positions (its top-1 there is the engine's greedy token), the
batches carry it at the label positions, a missing row is a clear error, and a few KD training steps run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.testing import load_script

TINY = "stories260k"


@pytest.fixture(scope="module")
def distill():
    mod = load_script("distill_draft.py", "distill_draft_kd")
    mod.TARGET = TINY  # the tiny model plays the target
    return mod


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two greedy responses of the tiny target, as ``generate`` writes them."""
    llm = LLM(TINY, draft_model=None, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=128)
    prompts = [[1, 403, 261, 374, 302], [1, 70, 45, 321]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    path = tmp_path_factory.mktemp("kd") / "data.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            row = {"id": f"p{i}", "kind": "greedy", "prompt_ids": p, "response_ids": list(o.outputs[0].token_ids)}
            f.write(json.dumps(row) + "\n")
    return path


def run_teacher(distill, data: Path, out: Path, top_k: int = 4) -> None:
    distill.cmd_teacher(argparse.Namespace(data=[str(data)], out=str(out), top_k=top_k, tokens_per_batch=128,
                                           rows_per_part=1))


def test_teacher_top1_is_the_greedy_token(distill, data, tmp_path) -> None:
    run_teacher(distill, data, tmp_path / "teacher")
    assert sorted(p.name for p in (tmp_path / "teacher").iterdir()) == ["part-00000.npz", "part-00001.npz"]
    rows = distill.load_rows([str(data)])
    teacher = distill.load_teacher(tmp_path / "teacher", rows)
    for r in rows:
        ids, logp = teacher[distill.row_key(r)]
        response = r["tokens"][r["num_prompt"]:]
        assert ids.shape == logp.shape == (len(response), 4)
        assert ids.dtype == np.uint16 and logp.dtype == np.float16
        np.testing.assert_array_equal(ids[:, 0], response)  # greedy: the target's top-1 is what it wrote
        lp = logp.astype(np.float32)
        assert (np.diff(lp, axis=1) <= 0).all() and (np.exp(lp).sum(axis=1) <= 1.0 + 1e-2).all()
    # a resumed run skips the parts that exist
    before = (tmp_path / "teacher" / "part-00000.npz").stat().st_mtime_ns
    run_teacher(distill, data, tmp_path / "teacher")
    assert (tmp_path / "teacher" / "part-00000.npz").stat().st_mtime_ns == before

    # the batches carry the top-k at the label positions of the response, nothing elsewhere
    batches = distill.make_batches(rows, 256, 0.2, seed=0, teacher=teacher)  # both rows in one [2, 128] batch
    assert len(batches) == 1
    tok, lab, wts, cand, (tids, tprob) = batches[0]
    assert cand is None and tids.shape == tprob.shape == tok.shape + (4,)
    for j in range(tok.shape[0]):
        resp = wts[j] >= 1.0
        np.testing.assert_array_equal(tids[j, resp, 0], lab[j, resp])
        assert (tprob[j, resp].sum(-1) > 0).all() and (tprob[j, ~resp] == 0).all()

    # a row the teacher has not seen: a clear error naming it
    extra = dict(rows[0], id="unseen")
    with pytest.raises(SystemExit, match="unseen"):
        distill.load_teacher(tmp_path / "teacher", rows + [extra])
    with pytest.raises(SystemExit, match="no part"):
        distill.load_teacher(tmp_path, rows)


def test_train_with_teacher_runs_and_needs_a_subset_head(distill, data, tmp_path) -> None:
    run_teacher(distill, data, tmp_path / "teacher")
    args = argparse.Namespace(
        data=[str(data)], workdir=str(tmp_path / "wd"), resume=False, init_from="", hidden=64, num_layers=1,
        intermediate=128, head_vocab=256, steps=3, tokens_per_batch=128, lr=1e-3, num_candidates=256,
        num_frequent=64, embedding_lr_scale=0.1, warmup=1, weight_decay=0.01, clip=1.0, prompt_weight=0.2,
        val_every=2, eval_every=3, save_minutes=100.0, max_minutes=0.0, seed=0, prompt_text=False,
        teacher=str(tmp_path / "teacher"), kd_weight=0.5,
    )
    distill.cmd_train(args)
    log = [json.loads(line) for line in open(tmp_path / "wd" / "train_log.jsonl", encoding="utf-8")]
    assert [r["step"] for r in log] == [1, 2, 3]
    # the rate each step applied (warm-up from 0 over 1 step, then the peak): step 1 logged step 2's before
    assert [r["lr"] for r in log[:2]] == [0.0, pytest.approx(1e-3)]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in log)
    assert (tmp_path / "wd" / "final_params.npz").exists()
    with pytest.raises(SystemExit, match="--head-vocab"):
        distill.cmd_train(argparse.Namespace(**{**vars(args), "head_vocab": 0, "workdir": str(tmp_path / "wd2")}))
