"""``scripts/distill_draft.py train``'s flags: each bad one a usage error (exit 2, one line naming the flag) before any
data or model loads, a workdir that holds a checkpoint refused without --resume, and a resume with other model-shape
flags than the checkpoint's refused naming them. Argument parsing only: no model is built here."""

from __future__ import annotations

import json
import sys

import pytest

from nightjar_jax.testing import load_script

_MODULE: list = []


def script(filename: str):
    """``scripts/distill_draft.py`` as a module, loaded once."""
    assert filename == "distill_draft.py"
    if not _MODULE:
        _MODULE.append(load_script(filename, "distill_draft_flags"))
    return _MODULE[0]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("")
    return str(path)


@pytest.fixture(autouse=True)
def prog(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["distill_draft.py"])  # (argparse names the script by argv[0])


def train_error(argv: list[str], capsys) -> str:
    """The one error line of ``distill_draft.py train`` with ``argv``."""
    with pytest.raises(SystemExit) as exc:
        script("distill_draft.py").parse_args(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("distill_draft.py train: error:"), err
    return err[-1]


def test_train_bad_flags_are_usage_errors(data, tmp_path, capsys) -> None:
    wd = str(tmp_path / "wd")
    a_file = tmp_path / "file"
    a_file.write_text("")
    for argv, fragment in [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--steps", "-5"], "argument --steps"),
        (["--lr", "-1"], "argument --lr: expected a finite number > 0"),
        (["--lr", "0"], "argument --lr"),
        (["--tokens-per-batch", "0"], "argument --tokens-per-batch"),
        (["--hidden", "0"], "argument --hidden"),
        (["--head-vocab", "-1"], "argument --head-vocab"),
        (["--kd-weight", "0.3"], "argument --kd-weight: weighs the --teacher term of the loss: give --teacher too"),
        (["--kd-weight", "2", "--teacher", str(tmp_path)],
         "argument --kd-weight: expected a finite number from 0 to 1"),
        (["--teacher", str(tmp_path / "none"), "--head-vocab", "8"], "argument --teacher:"),
        (["--teacher", str(tmp_path)], "argument --teacher: needs --head-vocab"),
        # (a sampled softmax too small for a batch's labels trained on NaN, exit 0)
        (["--num-candidates", "64"], "argument --num-candidates: 64 must be at least --num-frequent + "
                                     "--tokens-per-batch (8192"),
        (["--num-candidates", "60000"], "at most the vocabulary (49152)"),
        (["--num-frequent", "-5"], "argument --num-frequent: expected an integer >= 0"),
        (["--clip", "nan"], "argument --clip: expected a finite number > 0"),
        (["--weight-decay", "-1"], "argument --weight-decay"), (["--prompt-weight", "-2"], "argument --prompt-weight"),
        (["--embedding-lr-scale", "inf"], "argument --embedding-lr-scale"),
        (["--init-from", str(tmp_path)], "argument --init-from: " + repr(str(tmp_path)) + " is not an exported draft"),
    ]:
        assert fragment in train_error(["--data", data, "--workdir", wd, *argv], capsys), argv
    assert "argument --data: no such file: '/nonexistent.jsonl'" in train_error(
        ["--data", "/nonexistent.jsonl", "--workdir", wd], capsys)
    assert f"argument --workdir: {str(a_file)!r} is a file, not a folder" in train_error(
        ["--data", data, "--workdir", str(a_file)], capsys)
    assert not (tmp_path / "wd").exists()  # (nothing made before the flags pass)


def test_train_defaults_and_kd_weight_with_a_teacher(data, tmp_path) -> None:
    mod = script("distill_draft.py")
    args = mod.parse_args(["train", "--data", data, "--workdir", str(tmp_path / "wd")])
    assert args.kd_weight == 0.5 and args.steps == 2000 and args.lr == 3e-3
    args = mod.parse_args(["train", "--data", data, "--workdir", str(tmp_path / "wd"), "--teacher", str(tmp_path),
                           "--head-vocab", "8", "--kd-weight", "0.25"])
    assert args.kd_weight == 0.25


def saved_run(tmp_path, steps=(3, 5), **config):
    """A workdir as ``train`` leaves it: orbax step folders under ckpt/ and draft_config.json."""
    wd = tmp_path / "run"
    for step in steps:
        (wd / "ckpt" / str(step)).mkdir(parents=True)
    (wd / "ckpt" / "7.orbax-checkpoint-tmp-123").mkdir()  # (a save cut off: not a checkpoint)
    shape = {"hidden_size": 64, "num_layers": 1, "intermediate_size": 128, "head_vocab_size": 512}
    (wd / "draft_config.json").write_text(json.dumps({"vocab_size": 49152, **shape, **config}))
    return wd


def test_train_refuses_a_workdir_with_a_checkpoint_without_resume(data, tmp_path, capsys) -> None:
    """It started over silently: train_log.jsonl appended to, the old checkpoints left beside the new ones."""
    wd = saved_run(tmp_path)
    mod = script("distill_draft.py")
    assert mod.latest_checkpoint_step(wd) == 5 and mod.latest_checkpoint_step(tmp_path / "none") is None
    err = train_error(["--data", data, "--workdir", str(wd), "--hidden", "64", "--num-layers", "1",
                       "--intermediate", "128", "--head-vocab", "512"], capsys)
    assert f"{wd} holds a checkpoint at step 5: pass --resume to continue, or use an empty folder" in err
    empty = tmp_path / "empty"
    (empty / "ckpt").mkdir(parents=True)  # (a run cut before its first save: nothing to continue)
    assert mod.parse_args(["train", "--data", data, "--workdir", str(empty)]).workdir == str(empty)


def test_train_resume_names_the_model_shape_flags_that_differ(data, tmp_path, capsys) -> None:
    """A resume with another --hidden than the checkpoint's was an orbax shape traceback naming no flag."""
    wd = saved_run(tmp_path)
    same = ["--hidden", "64", "--num-layers", "1", "--intermediate", "128", "--head-vocab", "512"]
    mod = script("distill_draft.py")
    assert mod.parse_args(["train", "--data", data, "--workdir", str(wd), "--resume", *same]).resume
    err = train_error(["--data", data, "--workdir", str(wd), "--resume", *same, "--hidden", "32"], capsys)
    assert "argument --resume:" in err and "--hidden 64, not --hidden 32" in err and "--num-layers" not in err
    err = train_error(["--data", data, "--workdir", str(wd), "--resume"], capsys)  # every default differs
    assert ("--hidden 64 --num-layers 1 --intermediate 128 --head-vocab 512, not --hidden 184 --num-layers 2 "
            "--intermediate 640 --head-vocab 0") in err


def test_train_resume_names_the_run_flags_that_differ(data, tmp_path, capsys) -> None:
    """QA, 2026-12-07: a resume checked the model's shape only: another --lr, --seed or --data trained something
    else from the checkpoint without a word. They are compared with the run's train_flags.json; --steps may grow."""
    wd = saved_run(tmp_path)
    same = ["--hidden", "64", "--num-layers", "1", "--intermediate", "128", "--head-vocab", "512"]
    mod = script("distill_draft.py")
    ran = mod.parse_args(["train", "--data", data, "--workdir", str(wd), *same, "--resume"])
    (wd / "train_flags.json").write_text(json.dumps(mod.train_flags(ran)))
    assert mod.parse_args(["train", "--data", data, "--workdir", str(wd), "--resume", *same, "--steps", "5000"])
    err = train_error(["--data", data, "--workdir", str(wd), "--resume", *same, "--lr", "0.01", "--seed", "3"],
                      capsys)
    assert "argument --resume: the run in" in err and "--lr 0.003" in err and "--seed 0" in err, err
    assert "--warmup" not in err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--lr", "-1"], "argument --lr: expected a finite number > 0"),
    (["--depth-decay", "1.5"], "argument --depth-decay: expected a finite number from 0 to 1"),
    (["--data", "/no/such.jsonl"], "argument --data"),
    (["--features", "/no/such/folder"], "argument --features: '/no/such/folder': no such folder"),
])
def test_distill_eagle_train_flags_are_checked_before_anything_loads(argv, message, data, tmp_path, capsys):
    """``distill_eagle.py train`` took any number (a negative learning rate trained; 0 steps failed inside optax)
    and paths that do not exist (a traceback once its data loaded): usage errors naming the flag now."""
    eagle = load_script("distill_eagle.py", "distill_eagle_flags")
    base = {"--data": data, "--features": str(tmp_path), "--workdir": str(tmp_path / "w")}
    given = dict(zip(argv[::2], argv[1::2], strict=True))
    flat = [x for k, v in {**base, **given}.items() for x in (k, v)]
    with pytest.raises(SystemExit) as exc:
        eagle.parse_args(["train", *flat])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err
    workdir_file = tmp_path / "file"
    workdir_file.write_text("")
    with pytest.raises(SystemExit):
        eagle.parse_args(["train", "--data", data, "--features", str(tmp_path), "--workdir", str(workdir_file)])
    assert "is a file, not a folder" in capsys.readouterr().err
    args = eagle.parse_args(["train", *[x for k, v in base.items() for x in (k, v)]])
    assert args.steps == 2000 and args.lr == 1e-3


@pytest.mark.parametrize("argv, message", [
    (["generate", "--data", "{tmp}/g.jsonl", "--chunk", "-1"], "generate: error: argument --chunk: expected"),
    (["generate", "--data", "{tmp}/g.jsonl", "--limit", "-3"], "argument --limit: expected an integer >= 0"),
    (["generate", "--data", "{tmp}/g.jsonl", "--batch-size", "0"], "argument --batch-size"),
    (["self-prompts", "--out", "{tmp}/s.jsonl", "--num", "-5"], "argument --num: expected an integer >= 1"),
    (["self-prompts", "--out", "{tmp}/s.jsonl", "--num", "4", "--max-tokens", "0"], "argument --max-tokens"),
    (["teacher", "--data", "{data}", "--out", "{tmp}/t", "--top-k", "0"], "argument --top-k"),
    (["teacher", "--data", "{data}", "--out", "{tmp}/t", "--tokens-per-batch", "0"], "argument --tokens-per-batch"),
    (["features", "--data", "{data}", "--out", "{tmp}/t", "--rows-per-part", "0"], "argument --rows-per-part"),
    (["export", "--workdir", "/nonexistent"], "export: error: argument --workdir: '/nonexistent' holds no "
                                              "draft_config.json"),
    (["export", "--workdir", "{tmp}", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
])
def test_other_commands_bad_flags_are_usage_errors(argv, message, data, tmp_path, capsys) -> None:
    """generate / self-prompts / teacher / features / export took any integer (a negative --chunk wrote nothing and
    exited 0, --limit -3 dropped the last 3 prompts, --top-k 0 wrote an empty teacher) and export any --dtype or
    --workdir (tracebacks)."""
    argv = [a.format(tmp=tmp_path, data=data) for a in argv]
    with pytest.raises(SystemExit) as exc:
        script("distill_draft.py").parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["train", "--data", "{data}", "--features", "{tmp}", "--workdir", "{tmp}/w", "--init-from", "/nope.npz"],
     "train: error: argument --init-from: '/nope.npz': no such file"),
    (["export", "--workdir", "/nonexistent", "--out", "{tmp}/e"],
     "export: error: argument --workdir: '/nonexistent' holds no draft_config.json, best_params.npz"),
    (["simulate", "--workdir", "{tmp}", "--params", "last"], "holds no draft_config.json, last_params.npz"),
    (["export", "--workdir", "{tmp}", "--out", "{tmp}/e", "--dtype", "bogus"], "argument --dtype: invalid choice"),
])
def test_distill_eagle_other_commands_check_their_folders(argv, message, data, tmp_path, capsys) -> None:
    """distill_eagle.py export / simulate on a folder train never wrote, or train --init-from a missing file: a
    FileNotFoundError traceback; export --dtype bogus a ConfigError one."""
    eagle = load_script("distill_eagle.py", "distill_eagle_flags")
    with pytest.raises(SystemExit) as exc:
        eagle.parse_args([a.format(tmp=tmp_path, data=data) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err
