"""The feature draft's pipeline (``scripts/distill_draft.py features``, ``scripts/distill_eagle.py``, issue 8).

The unrolled chain (training-time test) must give, at depth j and slot p, exactly what drafting does when serving:
the draft run causally over slots 0..c with the target's features, then fed its own outputs for j - 1 more slots.
The offline replay must count decode steps the way the engine does. End to end on the tiny stories260K model as
the target: stored features score the target's own greedy tokens, a short training run learns, and its export
loads as a draft whose greedy speculative decoding equals the target's.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax import LLM, SamplingParams
from nightjar_jax.config import ModelConfig
from nightjar_jax.testing import load_script

TINY = "stories260k"


@pytest.fixture(scope="module")
def eagle():
    return load_script("distill_eagle.py", "distill_eagle_t")


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8, head_vocab_size=16, feature_size=32, name="tiny-eagle")


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unrolled_chain_equals_sequential_drafting(eagle, num_layers) -> None:
    rng = np.random.default_rng(0)
    cfg = CFG.replace(num_layers=num_layers)
    params = eagle.init_params(cfg, 0, rng.standard_normal((16, 32)).astype(np.float32))
    params = {k: jnp.asarray(v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)) for k, v in params.items()}
    t, depths = 12, 4
    emb = jnp.asarray(rng.standard_normal((1, t, 32)).astype(np.float32))
    h = jnp.asarray(rng.standard_normal((1, t, 32)).astype(np.float32))
    outs = eagle.ttt_forward(cfg, params, emb, h, depths)
    # one compile per prefix length instead of every op run eagerly per shape (54 s -> a few here)
    one_depth = jax.jit(lambda e, f: eagle.ttt_forward(cfg, params, e, f, 1)[0])
    for c in range(0, t - depths + 1):
        feat_in = np.zeros((t, 32), np.float32)  # slot p's feature input
        feat_in[1 : c + 1] = np.asarray(h[0, :c])
        for j in range(1, depths + 1):
            p = c + j - 1
            shifted = np.zeros((1, t, 32), np.float32)  # ttt_forward shifts by one: h'[p] = feat_in[p + 1]
            shifted[0, :-1] = feat_in[1:]
            ref = one_depth(emb[:, : p + 1], jnp.asarray(shifted[:, : p + 1]))[0, p]
            np.testing.assert_allclose(np.asarray(outs[j - 1][0, p]), np.asarray(ref), rtol=2e-4, atol=2e-5,
                                       err_msg=f"chain start {c}, depth {j}")
            if p + 1 < t:
                feat_in[p + 1] = np.asarray(ref)


def test_grown_draft_starts_as_the_shallower_one(eagle) -> None:
    """Layers added on top of a trained draft (``train --num-layers 2 --init-from`` a 1-layer run) start with zero
    output projections: the grown draft's every depth equals the shallower draft's until training moves them."""
    rng = np.random.default_rng(1)
    head = rng.standard_normal((16, 32)).astype(np.float32)
    one = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
           for k, v in eagle.init_params(CFG, 0, head).items()}
    deep_cfg = CFG.replace(num_layers=2)
    grown = eagle.init_params(deep_cfg, 5, head, zero_out_layers=1) | one
    assert "model.layers.1.mlp.up_proj.weight" in grown and not grown["model.layers.1.mlp.down_proj.weight"].any()
    emb = jnp.asarray(rng.standard_normal((1, 10, 32)).astype(np.float32))
    h = jnp.asarray(rng.standard_normal((1, 10, 32)).astype(np.float32))
    a = eagle.ttt_forward(CFG, {k: jnp.asarray(v) for k, v in one.items()}, emb, h, 3)
    b = eagle.ttt_forward(deep_cfg, {k: jnp.asarray(v) for k, v in grown.items()}, emb, h, 3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_replay_counts_decode_steps(eagle) -> None:
    tokens = np.array([5, 6, 7, 10, 11, 12, 13, 14, 15])  # prompt of 3, response of 6
    preds = np.full((2, len(tokens)), -1)
    preds[0, 3], preds[1, 4] = 11, 12  # from c = 3: depth 1 and 2 right -> 2 accepted, commit 3
    preds[0, 6] = 99  # from c = 6: wrong -> 0 accepted, commit 1; then c = 7: nothing right; c = 8 = end
    steps, accepted = eagle.replay_accepted(preds, tokens, 3, 2)
    assert (steps, accepted) == (3, 2)


@pytest.fixture(scope="module")
def tiny(eagle, tmp_path_factory):
    """The eagle script with the tiny model as its target, and two greedy responses of it as training data."""
    saved = eagle.dd.TARGET
    eagle.dd.TARGET = TINY
    llm = LLM(TINY, draft_model=None, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=128)
    prompts = [[1, 403, 261, 374, 302], [1, 70, 45, 321]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    path = tmp_path_factory.mktemp("eagle") / "data.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            f.write(json.dumps({"id": f"p{i}", "kind": "greedy", "prompt_ids": p,
                                "response_ids": list(o.outputs[0].token_ids)}) + "\n")
    yield eagle, path, prompts, [list(o.outputs[0].token_ids) for o in outs]
    eagle.dd.TARGET = saved


def test_features_rerun_adds_only_new_rows(tiny, tmp_path) -> None:
    """A rerun with one more --data file computes the new rows only (new parts after the old ones) and leaves
    every row's features as one run over both files gives."""
    eagle, data, _, _ = tiny
    dd = eagle.dd
    lines = data.read_text(encoding="utf-8").splitlines()
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(lines[0] + "\n", encoding="utf-8")
    second.write_text(lines[1] + "\n", encoding="utf-8")
    args = dict(tokens_per_batch=128, rows_per_part=1, layers="")
    dd.cmd_features(argparse.Namespace(data=[str(first)], out=str(tmp_path / "inc"), **args))
    before = (tmp_path / "inc" / "part-00000.npz").stat().st_mtime_ns
    dd.cmd_features(argparse.Namespace(data=[str(first), str(second)], out=str(tmp_path / "inc"), **args))
    assert sorted(p.name for p in (tmp_path / "inc").glob("part-*.npz")) == ["part-00000.npz", "part-00001.npz"]
    assert (tmp_path / "inc" / "part-00000.npz").stat().st_mtime_ns == before  # not recomputed
    dd.cmd_features(argparse.Namespace(data=[str(first), str(second)], out=str(tmp_path / "inc"), **args))
    assert len(list((tmp_path / "inc").glob("part-*.npz"))) == 2  # nothing left to run
    dd.cmd_features(argparse.Namespace(data=[str(data)], out=str(tmp_path / "one"), **args))
    rows = dd.load_rows([str(data)])
    inc, one = eagle.load_features(tmp_path / "inc", rows), eagle.load_features(tmp_path / "one", rows)
    for r in rows:
        np.testing.assert_array_equal(inc[dd.row_key(r)], one[dd.row_key(r)])


def test_features_train_export_serve(tiny, tmp_path) -> None:
    eagle, data, prompts, greedy = tiny
    dd = eagle.dd
    dd.cmd_features(argparse.Namespace(data=[str(data)], out=str(tmp_path / "feats"), tokens_per_batch=128,
                                       rows_per_part=1, layers=""))
    rows = dd.load_rows([str(data)])
    feats = eagle.load_features(tmp_path / "feats", rows)
    from nightjar_jax.models.loader import load_checkpoint

    table = np.asarray(load_checkpoint(TINY).state_dict["model.embed_tokens.weight"], np.float32)
    for r in rows:  # the stored features score the target's greedy tokens through its own (tied) head
        h = feats[dd.row_key(r)].astype(np.float32)
        span = dd.response_labels(r)
        np.testing.assert_array_equal((h[span] @ table.T).argmax(-1), np.asarray(r["tokens"])[span.start + 1 :])

    wd = tmp_path / "wd"
    train_args = dict(data=[str(data)], features=str(tmp_path / "feats"), workdir=str(wd), init_from="",
                      num_layers=1, intermediate=64, head_vocab=128, freeze_head=True, depths=2, depth_decay=0.8,
                      reg_weight=1.0, steps=30, tokens_per_batch=256, lr=3e-3, warmup=5, weight_decay=0.0, clip=1.0,
                      prompt_weight=0.2, val_every=1000, eval_every=10, max_minutes=0.0, seed=0, final_only=False)
    eagle.cmd_train(argparse.Namespace(**train_args))
    log = [json.loads(x) for x in (wd / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 30 and all(len(r["top1_per_depth"]) == 2 for r in log)
    assert np.mean([r["loss"] for r in log[-5:]]) < np.mean([r["loss"] for r in log[:5]])  # it learns
    assert "val_top1_per_depth" in log[-1]

    # a continued run on other data keeps the head's token ids (its rows are those ids' rows)
    other = tmp_path / "other.jsonl"  # renamed so the other row trains (the first sorted id is validation)
    first_row, second_row = (json.loads(x) for x in data.read_text(encoding="utf-8").splitlines())
    other.write_text(json.dumps(dict(first_row, id="z")) + "\n" + json.dumps(dict(second_row, id="a")) + "\n",
                     encoding="utf-8")
    dd.cmd_features(argparse.Namespace(data=[str(other)], out=str(tmp_path / "feats"), tokens_per_batch=128,
                                       rows_per_part=1, layers=""))  # only the two renamed rows run
    # ... and may grow a layer (``--num-layers 2``), but not lose one
    cont = dict(train_args, data=[str(other)], workdir=str(tmp_path / "wd_cont"),
                init_from=str(wd / "last_params.npz"), steps=3, num_layers=2)
    eagle.cmd_train(argparse.Namespace(**cont))
    np.testing.assert_array_equal(np.load(tmp_path / "wd_cont" / "head_token_ids.npy"),
                                  np.load(wd / "head_token_ids.npy"))
    grown = np.load(tmp_path / "wd_cont" / "last_params.npz")
    assert grown["model.layers.1.mlp.down_proj.weight"].any()  # the new layer trained
    with pytest.raises(SystemExit, match="--head-vocab"):
        eagle.cmd_train(argparse.Namespace(**dict(cont, head_vocab=64, workdir=str(tmp_path / "wd_bad"))))
    with pytest.raises(SystemExit, match="does not fit this draft"):  # another MLP width: not its weights
        eagle.cmd_train(argparse.Namespace(**dict(cont, intermediate=32, workdir=str(tmp_path / "wd_bad3"))))
    with pytest.raises(SystemExit, match="2 layers, --num-layers is 1"):
        eagle.cmd_train(argparse.Namespace(**dict(cont, num_layers=1, workdir=str(tmp_path / "wd_bad2"),
                                                  init_from=str(tmp_path / "wd_cont" / "last_params.npz"))))

    out = tmp_path / "export"  # the grown 2-layer draft: export checks its paged forward against training's
    eagle.cmd_export(argparse.Namespace(workdir=str(tmp_path / "wd_cont"), out=str(out), params="last",
                                        dtype="float32"))
    llm = LLM(TINY, draft_model=str(out), num_speculative_tokens=3, planner="static:3", max_num_seqs=2,
              max_model_len=128, max_num_batched_tokens=128)
    assert llm.engine.runner.feature_draft
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    assert llm.engine.stats.num_drafted_tokens > 0
    sampled = llm.generate(prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in sampled] == [30, 30]  # sampled SD (rejection sampling) runs too
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_fused_features_train_export_serve(tiny, tmp_path) -> None:
    """EAGLE-3's fused features: ``features --layers 1,3`` stores the target's residual stream after layers 1 and 3
    before its final state; a fused draft grown from an unfused one starts as it (``fuse`` passes the final state
    through) and learns to mix all three; ``--final-only`` trains the control on the same folder; the export's
    paged forward is checked, and the engine serves it losslessly."""
    eagle, data, prompts, greedy = tiny
    dd = eagle.dd
    feat_args = dict(data=[str(data)], tokens_per_batch=128, rows_per_part=1)
    dd.cmd_features(argparse.Namespace(out=str(tmp_path / "plain"), layers="", **feat_args))
    dd.cmd_features(argparse.Namespace(out=str(tmp_path / "fused"), layers="1,3", **feat_args))
    rows = dd.load_rows([str(data)])
    plain = eagle.load_features(tmp_path / "plain", rows)
    fused = eagle.load_features(tmp_path / "fused", rows)
    width = plain[dd.row_key(rows[0])].shape[1]
    for r in rows:  # [after layer 1, after layer 3, final]: the final state is the unfused folder's
        f = fused[dd.row_key(r)]
        assert f.shape == (len(r["tokens"]), 3 * width)
        np.testing.assert_array_equal(f[:, -width:], plain[dd.row_key(r)])
        assert not np.array_equal(f[:, :width], f[:, width : 2 * width])
    with pytest.raises(SystemExit, match=r"--layers 0,3: .*1\.\.4"):  # stories260K has 5 layers
        dd.cmd_features(argparse.Namespace(out=str(tmp_path / "bad"), layers="0,3", **feat_args))
    for bad in ("3,1", "1,x", "2,2"):
        with pytest.raises(SystemExit, match=f"--layers {bad}: .*comma-separated, increasing"):
            dd.cmd_features(argparse.Namespace(out=str(tmp_path / "bad"), layers=bad, **feat_args))
    with pytest.raises(SystemExit, match="holds features of layers"):  # one folder, one set of layers
        dd.cmd_features(argparse.Namespace(out=str(tmp_path / "fused"), layers="2", **feat_args))
    (tmp_path / "plain" / "layers.json").unlink()  # a folder made before --layers existed: the final state alone
    with pytest.raises(SystemExit, match=r"holds features of layers \(none\)"):
        dd.cmd_features(argparse.Namespace(out=str(tmp_path / "plain"), layers="1,3", **feat_args))

    train_args = dict(data=[str(data)], features=str(tmp_path / "fused"), workdir=str(tmp_path / "ctl"),
                      init_from="", num_layers=1, intermediate=64, head_vocab=128, freeze_head=True, depths=2,
                      depth_decay=0.8, reg_weight=1.0, steps=10, tokens_per_batch=256, lr=3e-3, warmup=2,
                      weight_decay=0.0, clip=1.0, prompt_weight=0.2, val_every=1000, eval_every=5, max_minutes=0.0,
                      seed=0, final_only=True)
    eagle.cmd_train(argparse.Namespace(**train_args))  # the control: the final state alone
    ctl = dict(np.load(tmp_path / "ctl" / "last_params.npz"))
    assert "fuse.weight" not in ctl
    assert json.loads((tmp_path / "ctl" / "draft_config.json").read_text())["feature_layers"] is None

    from nightjar_jax.config import ModelConfig as Cfg

    wd = tmp_path / "wd"
    eagle.cmd_train(argparse.Namespace(**dict(train_args, workdir=str(wd), final_only=False, steps=10,
                                              init_from=str(tmp_path / "ctl" / "last_params.npz"))))
    cfg = Cfg(**json.loads((wd / "draft_config.json").read_text()))
    assert cfg.feature_layers == (1, 3)
    # before training, the grown draft is the control: fuse = [0, 0, I]
    start = eagle.init_params(cfg, 0, ctl["lm_head.weight"]) | ctl
    start["fuse.weight"] = np.concatenate([np.zeros((width, 2 * width), np.float32), np.eye(width, dtype=np.float32)],
                                          axis=1)  # (what train sets before it loads --init-from's weights)
    r = rows[0]
    h = jnp.asarray(fused[dd.row_key(r)][None].astype(np.float32))
    table = eagle.dd.target_params()[1]["model.embed_tokens.weight"]
    emb = table[jnp.asarray(r["tokens"])][None]
    a = eagle.ttt_forward(cfg.replace(feature_layers=None), {k: jnp.asarray(v) for k, v in ctl.items()}, emb,
                          h[..., -width:], 2)
    b = eagle.ttt_forward(cfg, {k: jnp.asarray(v) for k, v in start.items()}, emb, h, 2)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    # and train's own start is that: one step at learning rate 0 leaves every weight where train put it
    eagle.cmd_train(argparse.Namespace(**dict(train_args, workdir=str(tmp_path / "wd0"), final_only=False, steps=1,
                                              lr=0.0, init_from=str(tmp_path / "ctl" / "last_params.npz"))))
    untrained = dict(np.load(tmp_path / "wd0" / "last_params.npz"))
    assert untrained.keys() == start.keys()
    for k, v in untrained.items():
        np.testing.assert_array_equal(v, start[k], err_msg=k)
    trained = np.load(wd / "last_params.npz")["fuse.weight"]
    assert np.abs(trained[:, : 2 * width]).max() > 1e-3  # it learned to read the earlier layers

    out = tmp_path / "export"
    eagle.cmd_export(argparse.Namespace(workdir=str(wd), out=str(out), params="last", dtype="float32"))
    llm = LLM(TINY, draft_model=str(out), num_speculative_tokens=3, planner="static:3", max_num_seqs=2,
              max_model_len=128, max_num_batched_tokens=128)
    assert llm.engine.runner.feature_layers == (1, 3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    assert llm.engine.stats.num_drafted_tokens > 0
    assert llm.engine.num_free_pages == llm.engine.num_total_pages


def test_offline_replays_say_what_reference_they_need(eagle, tmp_path) -> None:
    """``simulate`` (and ``fit_spec_tree.py replay``) score an ``eval_draft.py`` result's outputs: a missing,
    unreadable or output-less file is a clear error naming the command that makes one, before any model loads."""
    cases = {"missing.json": None, "bad.json": "{not json", "empty.json": json.dumps({"sd_outputs": {}}),
             "other.json": json.dumps({"mean_accepted_length": 1.7})}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text, encoding="utf-8")
        with pytest.raises(SystemExit, match=r"--reference .*run `python scripts/eval_draft.py --out "):
            eagle.cmd_simulate(argparse.Namespace(workdir=str(tmp_path / "no_workdir"), params="last",
                                                  reference=str(path), gamma=4, out=""))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"sd_outputs": {"mt_bench/81": [1, 2]}}), encoding="utf-8")
    assert eagle.load_reference(good)["sd_outputs"] == {"mt_bench/81": [1, 2]}


def test_killed_parts_used_workdirs_and_too_little_data_are_clear(tiny, tmp_path) -> None:
    """QA, 2026-12-07: a part half written by a killed run failed every later run with a bare BadZipFile (parts are
    now written whole, and a broken one is named); `distill_eagle train` into a used workdir appended to its log and
    replaced its best weights with worse ones; one prompt of data left no training rows ("need at least one array
    to concatenate"); `distill_draft export` of a run with no best_params.npz was a FileNotFoundError."""
    eagle, data, _, _ = tiny
    dd = eagle.dd
    feats = tmp_path / "feats"
    args = dict(tokens_per_batch=128, rows_per_part=1, layers="")
    dd.cmd_features(argparse.Namespace(data=[str(data)], out=str(feats), **args))
    assert not list(feats.glob("*.partial"))  # (written beside, renamed into place)
    part = sorted(feats.glob("part-*.npz"))[-1]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    with pytest.raises(SystemExit, match=r"part-00001.npz is not a whole part .*delete it and run again"):
        dd.cmd_features(argparse.Namespace(data=[str(data)], out=str(feats), **args))
    used = tmp_path / "used"
    used.mkdir()
    (used / "train_log.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as exit_:
        eagle.parse_args(["train", "--data", str(data), "--features", str(feats), "--workdir", str(used)])
    assert exit_.value.code == 2
    one = tmp_path / "one.jsonl"
    one.write_text(data.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    part.unlink()
    train_args = dict(data=[str(one)], features=str(feats), workdir=str(tmp_path / "wd1"), init_from="",
                      num_layers=1, intermediate=64, head_vocab=128, freeze_head=True, depths=2, depth_decay=0.8,
                      reg_weight=1.0, steps=2, tokens_per_batch=256, lr=3e-3, warmup=1, weight_decay=0.0, clip=1.0,
                      prompt_weight=0.2, val_every=1000, eval_every=1, max_minutes=0.0, seed=0, final_only=False)
    with pytest.raises(SystemExit, match=r"--data holds 1 prompt\(s\).* which leaves 0 training"):
        eagle.cmd_train(argparse.Namespace(**train_args))
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "draft_config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        dd.parse_args(["export", "--workdir", str(empty), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
