"""Bad flags of the scripts are usage errors (exit 2, one line naming the flag) before any model loads, and the
helpers behind the QA fixes (nothing compared, a class that never waited, no ITL, ...) say so instead of passing.
Argument parsing and pure functions only: no model is built here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_MODULES: dict = {}


def script(filename: str):
    """``scripts/<filename>`` as a module (``nightjar_jax.testing.load_script``'s way, registered in sys.modules
    as well: a script's dataclasses resolve their string annotations through it)."""
    if filename not in _MODULES:
        import importlib.util
        from pathlib import Path

        name = "flags_" + filename.removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[2] / "scripts" / filename)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[filename] = mod
    return _MODULES[filename]


BAD_FLAGS = [
    ("fit_spec_tree.py", ["fit", "--workdir", "/tmp", "--features", "/tmp", "--out", "/tmp/x.json", "--data",
                          "/no/such.jsonl"], "--data"),
    ("fit_spec_tree.py", ["fit", "--workdir", "/no/such", "--features", "/tmp", "--out", "/tmp/x.json", "--data",
                          __file__], "--workdir /no/such: no such folder"),
    # (a FileNotFoundError once the target had loaded)
    ("fit_spec_tree.py", ["fit", "--workdir", "/tmp", "--features", "/tmp", "--out", "/tmp/x.json", "--data",
                          __file__], "--workdir /tmp: no last_params.npz"),
    ("fit_spec_tree.py", ["replay", "--workdir", "/tmp", "--reference", "/tmp/r.json", "--tree-file", __file__],
     "cannot read it as JSON"),
    ("bench_spec.py", ["--models", "nosuch"], "--models"),
    ("bench_spec.py", ["--gammas", "5", "--gamma-max", "2"], "past --gamma-max 2"),
    ("bench_spec.py", ["--batch-sizes", "0"], "--batch-sizes"),
    ("bench_spec.py", ["--batch-sizes", ""], "--batch-sizes"),
    ("bench_spec.py", ["--repeats", "0"], "--repeats"),
    ("bench_spec.py", ["--output-len", "0"], "--output-len"),
    ("bench_spec.py", ["--prompt-lookup", "-1"], "--prompt-lookup"),
    ("bench_spec.py", ["--drafts", "nosuch"], "--drafts"),
    ("bench_spec.py", ["--gamma-max", "0", "--planner", "nightjar"], "--gamma-max 0"),
    ("check_lossless.py", ["--prompts", "0"], "--prompts"),
    ("check_lossless.py", ["--model", "stories260k"], "SmolLM2's tokenizer"),
    ("check_lossless.py", ["--weight-formats", ""], "--weight-formats"),
    ("check_lossless.py", ["--planners", ""], "--planners"),
    ("bench_priority.py", ["--urgent-interval", "0"], "--urgent-interval"),
    ("bench_priority.py", ["--urgent-after", "-3"], "--urgent-after"),
    ("bench_priority.py", ["--num-urgent", "0"], "--num-urgent"),
    ("bench_priority.py", ["--num-background", "0"], "--num-background"),
    ("bench_priority.py", ["--repeats", "0"], "--repeats"),
    ("bench_priority.py", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("bench_priority.py", ["--prompt-len", "0"], "--prompt-len"),
    ("bench_priority.py", ["--model", "nosuch"], "--model"),
    ("bench_priority.py", ["--draft", "nosuch"], "--draft"),
    ("bench_linear.py", ["--repeats", "0"], "--repeats"),
    ("bench_linear.py", ["--rows", ""], "--rows"),
    ("bench_linear.py", ["--rows", "-2"], "--rows"),
    ("bench_linear.py", ["--rows", "0"], "--rows"),
    ("bench_linear.py", ["--verify", "-1"], "--verify"),
    ("bench_linear.py", ["--context", "-5"], "--context"),
    ("bench_structured.py", ["--batch-sizes", "0"], "--batch-sizes"),
    ("bench_structured.py", ["--batch-sizes", ""], "--batch-sizes"),
    ("bench_structured.py", ["--repeats", "0"], "--repeats"),
    ("bench_structured.py", ["--max-tokens", "0"], "--max-tokens"),
    ("measure_profile.py", ["--batch-sizes", "2,1"], "strictly increasing"),
    ("measure_profile.py", ["--batch-sizes", "1,1"], "--batch-sizes"),
    ("measure_profile.py", ["--batch-sizes", ""], "--batch-sizes"),
    ("measure_profile.py", ["--batch-sizes", "0"], "--batch-sizes"),
    ("measure_profile.py", ["--prompt-lens", "32,16"], "--prompt-lens"),
    ("measure_profile.py", ["--prompt-lens", "1"], "--prompt-lens"),
    ("measure_profile.py", ["--repeats", "0"], "--repeats"),
    ("measure_profile.py", ["--output-len", "1"], "--output-len"),
    ("bench_seeded.py", ["--draft", "none"], "--draft"),
    # (a model without a chat template failed in chat_ids after both engines had loaded)
    ("bench_seeded.py", ["--model", "stories260k", "--draft", "stories260k@skip=2"],
     "argument --model: stories260k has no chat template"),
    # (a bare SystemExit once JAX had loaded)
    ("measure_profile.py", ["--max-model-len", "16", "--prompt-lens", "32"],
     "argument --max-model-len: 16 is too short"),
    # (a "batch 8" row of 2 prompts held 2 requests per generate() call)
    ("bench_structured.py", ["--num-prompts", "2"], "argument --batch-sizes: 8 is more than --num-prompts 2"),
    ("bench_seeded.py", ["--prompts", "99"], "--prompts"),
    ("bench_seeded.py", ["--temperatures", "0.7,0"], "--temperatures"),
    ("bench_lookup.py", ["--prompts", "2"], "--prompts 2"),
    ("bench_lookup.py", ["--prompts", "8", "--batch-size", "4"], "--prompts 8"),
    ("bench_lookup.py", ["--trees", "0"], "--trees"),
    ("device_check.py", ["--smoke", "--budget-s", "0"], "--budget-s"),
    ("device_check.py", ["--smoke", "--budget-s", "-5"], "--budget-s"),
    ("device_check_engine.py", ["--models", "nosuch"], "--models"),
    ("device_check_engine.py", ["--models", ""], "--models"),
    ("device_check_engine.py", ["--prompt-len", "0"], "--prompt-len"),
    ("device_check_engine.py", ["--output-len", "0"], "--output-len"),
    ("device_check_engine.py", ["--spec", "nosuch+tiny-mha"], "--spec"),
    ("device_check_engine.py", ["--budget-s", "0"], "--budget-s"),
    ("eval_draft.py", ["--gamma", "0"], "--gamma"),
    ("bench_reload_acceptance.py", ["--gamma", "0"], "--gamma"),
    ("bench_reload_acceptance.py", ["--max-tokens", "24", "--offload-at", "100", "--mark", "6"], "--offload-at 100"),
    ("bench_reload_acceptance.py", ["--max-tokens", "24", "--offload-at", "4", "--mark", "30"], "--mark 30"),
    # section 11 / 12 of the QA report
    ("bench_engine.py", ["--batch-sizes", ""], "--batch-sizes"),
    ("bench_engine.py", ["--batch-sizes", "0"], "--batch-sizes"),
    ("bench_engine.py", ["--batch-sizes", "1,1"], "--batch-sizes"),
    ("bench_engine.py", ["--repeats", "0"], "--repeats"),
    ("bench_engine.py", ["--host-batch", "0"], "--host-batch"),
    ("bench_engine.py", ["--output-len", "0"], "--output-len"),
    ("bench_engine.py", ["--prompt-len", "0"], "--prompt-len"),
    ("bench_engine.py", ["--model", "nosuch"], "--model"),
    ("bench_logprobs.py", ["--batch-sizes", ""], "--batch-sizes"),
    ("bench_logprobs.py", ["--output-len", "0"], "--output-len"),
    ("bench_logprobs.py", ["--prompt-len", "0"], "--prompt-len"),
    ("bench_logprobs.py", ["--score-len", "0"], "--score-len"),
    ("bench_logprobs.py", ["--weight-format", "bogus"], "--weight-format"),
    ("bench_logprobs.py", ["--score-len", "600"], "--score-len"),
    ("bench_prefix_cache.py", ["--repeats", "0"], "--repeats"),
    ("bench_prefix_cache.py", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_prefix_cache.py", ["--page-size", "0"], "--page-size"),
    ("bench_mixed_batches.py", ["--repeats", "0"], "--repeats"),
    ("bench_mixed_batches.py", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_mixed_batches.py", ["--max-tokens", "0"], "--max-tokens"),
    ("bench_mixed_batches.py", ["--gamma", "0"], "--gamma"),
    ("bench_mixed_batches.py", ["--draft-model", "nosuch"], "--draft-model"),
    ("bench_sleep.py", ["--levels", ""], "--levels"),
    ("bench_sleep.py", ["--levels", "3"], "--levels"),
    ("bench_sleep.py", ["--levels", "0"], "--levels"),
    ("bench_sleep.py", ["--repeats", "0"], "--repeats"),
    ("bench_sleep.py", ["--max-tokens", "0"], "--max-tokens"),
    ("bench_sleep.py", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_elastic.py", ["--rounds", "0"], "--rounds"),
    ("bench_elastic.py", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_elastic.py", ["--kv-cache-bytes", "0"], "--kv-cache-bytes"),
    ("bench_elastic.py", ["--persist-steps", "-1"], "--persist-steps"),
    ("eval_weight_format.py", ["--model", "stories260k"], "SmolLM2's tokenizer"),
    ("eval_weight_format.py", ["--max-prompt-tokens", "1"], "--max-prompt-tokens"),
    ("kernel_spills.py", ["--out", __file__ + "/x.json"], "--out"),  # (under a file: checked before the compile)
    # planner names of nightjar_jax.planner's registry, and their argument against γ_max, before the models load
    ("check_lossless.py", ["--planners", "nightjar,bogus"], "argument --planners: unknown planner 'bogus'"),
    ("check_lossless.py", ["--planners", "static:8", "--gamma", "4"], "static gamma K=8 exceeds gamma_max=4"),
    ("check_lossless.py", ["--planners", "static:x"], "argument --planners:"),
    ("bench_spec.py", ["--planner", "bogus"], "argument --planner: unknown planner 'bogus'"),
    ("bench_spec.py", ["--planner", "static:9", "--gamma-max", "4"], "argument --planner:"),
    ("check_lossless.py", ["--prompts", "37"], "argument --prompts: expected an integer from 1 to 36, got 37"),
    # --out checked before the run (a folder failed after it with IsADirectoryError)
    ("eval_weight_format.py", ["--out", "/tmp"], "argument --out: cannot write '/tmp': it is a folder"),
    ("profile_step.py", ["--out", "/tmp"], "argument --out: cannot write '/tmp': it is a folder"),
    ("profile_step.py", ["--steps", "0"], "argument --steps"),
    ("profile_step.py", ["--compare-spin-us", "1,x"], "argument --compare-spin-us"),
    ("profile_step.py", ["--kv-cache-dtype", "float16"], "argument --kv-cache-dtype"),
    ("profile_step.py", ["--model", "nosuch"], "argument --model"),
    # a run that speculates nothing (no draft, or γ > 0 cells of plain decoding) is refused before the models load
    ("check_lossless.py", ["--draft", "none"], "argument --draft: 'none' is no draft"),
    ("check_lossless.py", ["--planners", "static:2", "--draft", "none"], "argument --draft: 'none' is no draft"),
    ("bench_spec.py", ["--drafts", "none"], "argument --drafts: 'none' is no draft"),
    ("bench_spec.py", ["--drafts", ","], "argument --drafts: ',' has an empty entry"),
    ("bench_spec.py", ["--drafts", "ngram"], "argument --drafts: 'ngram' drafts only by n-gram lookup"),
    ("bench_spec.py", ["--models", "stories260k", "--drafts", "auto"], "argument --drafts: 'auto' is no draft"),
    ("bench_spec.py", ["--output-len", "1"], "argument --output-len: expected an integer >= 2"),
    ("bench_spec.py", ["--dtype", "float99"], "argument --dtype: invalid choice: 'float99'"),
    ("bench_spec.py", ["--prompt-lookup-min", "5", "--prompt-lookup", "3"], "argument --prompt-lookup-min: 5 is past"),
    ("bench_spec.py", ["--prompt-lookup", "0,65"],
     "argument --prompt-lookup: expected a comma list of integers in [0, 64]"),
    ("bench_spec.py", ["--chat", "--models", "stories260k"], "argument --chat: stories260k has no chat template"),
    ("bench_engine.py", ["--dtype", "float99"], "argument --dtype: invalid choice: 'float99'"),
    ("measure_profile.py", ["--draft", "none"], "argument --draft: 'none' is no draft model, and one is needed"),
    ("measure_profile.py", ["--draft", "ngram"], "argument --draft: 'ngram' is no draft model, and one is needed"),
    ("measure_profile.py", ["--draft", "auto"], "argument --draft: 'auto' is no draft for 'stories260k'"),
    ("measure_profile.py", ["--gamma-max", "0"], "argument --gamma-max: expected an integer >= 1"),
    ("measure_profile.py", ["--dtype", "float99"], "argument --dtype: invalid choice"),
    ("eval_draft.py", ["--draft", "nosuch"], "argument --draft: unknown model 'nosuch'"),
    ("eval_draft.py", ["--draft", "none"], "argument --draft: 'none' is no draft model"),
    ("eval_draft.py", ["--temperature", "-1"], "argument --temperature: expected a finite number from 0 to 100"),
    ("eval_draft.py", ["--prompt-lookup-max", "-1"], "argument --prompt-lookup-max: expected an integer >= 0"),
    # (a one-token prompt has no log-probability to score: it crashed after the whole decode benchmark)
    ("bench_logprobs.py", ["--score-len", "1"], "argument --score-len: expected an integer >= 2, got 1"),
    # (it was refused after every acceptance run: the whole run lost)
    ("eval_draft.py", ["--draft", "smollm2-draft", "--tree-nodes", "6"],
     "argument --tree-nodes: the cost measurement supports feature drafts only (smollm2-draft is a token draft"),
    # (checked before the models load: it failed after them, with a traceback)
    ("eval_draft.py", ["--tree-nodes", "4", "--tree-file", "/nope.json"],
     "argument --tree-file: spec tree file /nope.json: cannot read it as JSON"),
    ("eval_draft.py", ["--prompt-lookup-max", "2", "--prompt-lookup-min", "3"], "argument --prompt-lookup-min: 3"),
    ("profile_step.py", ["--model", "stories260k", "--verify"], "argument --verify: it needs a draft"),
    # (a ConfigError traceback once the engine was built: bench_engine's after 16 s of work)
    ("profile_step.py", ["--model", "stories260k", "--prompt-len", "100000"],
     "argument --prompt-len: --prompt-len + the 64 tokens decoded past it is 100064 tokens, past stories260k's "
     "context of 512"),
    ("bench_engine.py", ["--model", "stories260k", "--prompt-len", "500", "--output-len", "32"],
     "argument --prompt-len: --prompt-len + --output-len is 532 tokens, past stories260k's context of 512"),
    ("bench_elastic.py", ["--draft", "none"], "argument --draft: 'none' is no draft model, and one is needed"),
    ("bench_elastic.py", ["--model", "stories260k", "--draft", "auto"], "argument --draft: 'auto' is no draft for "
                                                                        "'stories260k'"),
    ("eval_draft.py", ["--draft", "stories260k"], "argument --draft: 'stories260k' does not share SmolLM2's "
                                                  "vocabulary, as a draft for it must"),
    ("eval_weight_format.py", ["--reference", "w4a8", "--candidate", "w4a8"],
     "argument --candidate: w4a8 is the --reference too"),
    ("bench_serve.py", ["--request-rates", "0"], "argument --request-rates: expected a comma list of request rates"),
    ("bench_serve.py", ["--request-rates", "1,1"], "without duplicates"),
    ("bench_serve.py", ["--planners", "nosuch"], "argument --planners:"),
    ("bench_serve.py", ["--url", "http://127.0.0.1:1", "--planners", "ar"],
     "argument --planners: with --url no server is started"),
    # (each of these started servers first: static:9 after the earlier planners' whole runs, their results lost)
    ("bench_serve.py", ["--planners", "ar,static:9"], "argument --planners: planner 'static:9' at γ_max 4"),
    ("bench_serve.py", ["--draft-model", "bogus"], "argument --draft-model: unknown model 'bogus'"),
    ("bench_serve.py", ["--model", "bogus"], "argument --model: unknown model 'bogus'"),
    ("bench_serve.py", ["--url", "notaurl"], "argument --url: 'notaurl' is not an http:// or https:// URL"),
    ("bench_serve.py", ["--server-arg=--planner", "--server-arg=ar"], "argument --server-arg: --planner is set by"),
    ("fit_spec_tree.py", ["fit", "--workdir", "/tmp", "--data", "README.md", "--features", "/tmp", "--out",
                          "/tmp/x.json", "--seed", "-4"], "argument --seed: expected an integer >= 0, got -4"),
]


def test_bench_engine_interleaved_steps_zero_skips() -> None:
    """The help says "0: skip" and the run checks > 0, but the flag's type refused 0."""
    mod = script("bench_engine.py")
    assert mod.parse_args(["--interleaved-steps", "0"]).interleaved_steps == 0
    with pytest.raises(SystemExit):
        mod.parse_args(["--interleaved-steps", "-1"])


def test_check_lossless_prompts_bound_is_the_held_out_split() -> None:
    """--prompts past the held-out prompts ran fewer than asked; the bound is the split's size (36: eval_draft.py's
    28 are those under 384 tokens, a filter this script does not apply)."""
    mod = script("check_lossless.py")
    assert mod.parse_args(["--prompts", str(mod.NUM_HELDOUT_PROMPTS)]).prompts == mod.NUM_HELDOUT_PROMPTS
    assert mod.parse_args(["--planners", "static:4,nightjar,ar"]).planners == ["static:4", "nightjar", "ar"]
    draft = script("distill_draft.py")
    if not (draft.DATASETS / "mt_bench" / "question.jsonl").is_file():
        pytest.skip("no datasets on this machine")
    assert len(draft.load_prompts("heldout")) == mod.NUM_HELDOUT_PROMPTS


def test_scripts_units_say_mib_where_they_divide_by_2_to_the_20() -> None:
    """bench_engine printed the same weights as "N MiB" and "N MB" (1e6); bench_sleep's "MB" columns were MiB."""
    for name in ("bench_engine.py", "bench_sleep.py"):
        text = (Path(__file__).parents[2] / "scripts" / name).read_text()
        assert " MB" not in text and "1e6:" not in text, name


def test_help_shows_backslash_continuations_as_written() -> None:
    """A module docstring (the scripts' --help) that is not raw drops a "\\" at a line's end with the newline:
    bench_spec.py and distill_draft.py printed their continued example commands joined on one line."""
    import ast

    for path in sorted((Path(__file__).parents[2] / "scripts").glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        doc = ast.get_docstring(tree, clean=False)
        if doc is None:
            continue
        segment = ast.get_source_segment(source, tree.body[0])
        written = sum(line.endswith("\\") for line in segment.splitlines())
        shown = sum(line.endswith("\\") for line in doc.splitlines())
        assert shown == written, path.name


@pytest.mark.parametrize("filename, argv, fragment", BAD_FLAGS, ids=[f"{f}:{' '.join(a)}" for f, a, _ in BAD_FLAGS])
def test_bad_flag_is_a_usage_error(filename, argv, fragment, capsys, monkeypatch) -> None:
    mod = script(filename)
    monkeypatch.setattr(sys, "argv", [filename, *argv])
    with pytest.raises(SystemExit) as exc:  # (a script without parse_args fails in main's, before any model loads)
        getattr(mod, "parse_args", None)() if hasattr(mod, "parse_args") else mod.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert fragment in err[-1] and err[-1].startswith((f"{filename}: error:", f"{filename} fit: error:")), err


SIM_BAD = [
    (["--phase-seconds", "0"], "--phase-seconds"), (["--phase-seconds", "-5"], "--phase-seconds"),
    (["--presets", "nosuch"], "--presets"), (["--presets", ""], "--presets"), (["--jobs", "0"], "--jobs"),
    (["--gamma-max", "-1"], "--gamma-max"), (["--gamma-max", "0"], "--gamma-max"),
    (["--rate-scale", "abc"], "--rate-scale"), (["--rate-scale", "inf"], "--rate-scale"),
    (["--profile", "/nonexistent.json"], "--profile"), (["--gamma-max", "12"], "exceeds the profile"),
    (["--seeds", "0,0"], "--seeds"),
    (["--phase-seconds", "0.01"], "argument --phase-seconds: expected a finite number >= 1"),
    # a variant named as another row replaced that row's result (and the oracles built from the static rows)
    *[(["--nightjar-variant", f"{name}={{}}"], "argument --nightjar-variant: expected NAME=JSON with a NAME of letters")
      for name in ("ar", "static", "static:2", "dsd", "banditspec", "table", "nightjar", "nightjar+warm",
                   "oracle", "oracle:phase", "oracle:phase×bucket", "v+warm", "", "a b")],
    (["--nightjar-variant", "v={}", "--nightjar-variant", 'v={"explore_scale":0.1}'],
     "argument --nightjar-variant: NAME 'v' given more than once"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    # (numpy's "lam value too large", naming nothing)
    (["--rate-scale", "1e300", "--presets", "oscillating"], "requests (3e+300/s for 60 s); a trace holds at most"),
]


@pytest.mark.parametrize("argv, fragment", SIM_BAD, ids=[" ".join(a) for a, _ in SIM_BAD])
def test_sim_planners_bad_flags(argv, fragment, monkeypatch, capsys) -> None:
    mod = script("sim_planners.py")
    monkeypatch.setattr(sys, "argv", ["sim_planners.py", *argv])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err.strip().splitlines()[-1]


def test_sim_planners_variant_names_that_are_new_pass() -> None:
    mod = script("sim_planners.py")
    for name in ("before", "peb05", "min32", "v-1.b_c"):
        assert mod.parse_variant(f"{name}={{}}") == (name, {})


def test_sim_planners_notes_a_static_row_that_beats_an_oracle() -> None:
    """oracle:phase is a hindsight reference, not an upper bound: static:2 beat it by 0.62% on low-burst-low seed 0,
    while the script and docs called it best in hindsight and an upper reference."""
    from types import SimpleNamespace

    mod = script("sim_planners.py")

    def rows(**busy):
        return {name.replace("_", ":"): SimpleNamespace(busy_throughput=value) for name, value in busy.items()}

    statics = ["ar", "static:1", "static:2"]
    results = rows(ar=2189, static_1=2350, static_2=2373, oracle_phase=2371, **{"oracle_phase×bucket": 2545})
    notes = mod.oracle_notes(results, statics)
    assert len(notes) == 1 and notes[0].startswith("note: static:2 beats oracle:phase by +0.08%")
    assert "not upper bounds" in notes[0]
    assert mod.oracle_notes(rows(ar=1, static_1=2, static_2=3, oracle_phase=3.5), statics) == []
    assert "upper reference" not in (Path(mod.__file__).parents[1] / "nightjar_jax" / "sim" / "oracle.py").read_text()


def test_sim_planners_refuses_a_profile_too_small_for_its_workloads(tmp_path, monkeypatch, capsys) -> None:
    """A profile whose KV budget cannot hold the longest request is one usage error, not a worker traceback."""
    import json

    from nightjar_jax.sim.profile import CostProfile

    path = tmp_path / "small.json"
    CostProfile.from_json(None).save(path)
    small = json.loads(path.read_text())
    small["kv_budget_pages"] = 8
    path.write_text(json.dumps(small))
    monkeypatch.setattr(sys, "argv", ["sim_planners.py", "--profile", str(path), "--phase-seconds", "5"])
    with pytest.raises(SystemExit) as exc:
        script("sim_planners.py").main()
    assert exc.value.code == 2 and "can never fit" in capsys.readouterr().err


# ---- 1. check_lossless: a run that compared nothing fails ---------------------------------------------------------
def test_check_lossless_fails_when_no_prompt_fits(capsys) -> None:
    mod = script("check_lossless.py")
    assert mod.fitting_prompts([[1] * 10, [1] * 50], 8, 40) == [[1] * 10]
    assert "1 prompts skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # (not 1: that says the outputs differ)
        mod.fitting_prompts([[1] * 35, [1] * 50], 8, 40)
    assert exc.value.code == mod.NOTHING_CHECKED == 3 and "no prompt checked" in capsys.readouterr().err


def test_check_lossless_fails_when_nothing_was_drafted(capsys) -> None:
    """A speculative run that drafted no token decoded plainly: its equal outputs checked nothing (it passed with
    drafted=0). Its exit code is neither 0 nor 1 (outputs differ), which wins where both hold."""
    mod = script("check_lossless.py")
    ref = {"weight_format": "auto", "planner": "ar (reference, batch 1)", "differing": []}
    sd = {"weight_format": "auto", "planner": "nightjar", "differing": [], "drafted": 12}
    assert mod.exit_code([ref, sd]) == 0
    assert mod.exit_code([ref, sd, sd | {"planner": "ar", "drafted": 0}]) == mod.NOTHING_CHECKED
    assert "['auto / ar'] drafted no token" in capsys.readouterr().err
    differing = sd | {"differing": [{"prompt": 0, "first_token": 3}]}
    assert mod.exit_code([ref, differing, sd | {"drafted": 0}]) == mod.DIFFERS == 1


# ---- 2. a --dataset that was given must exist (it silently became synthetic prompts) -----------------------------
@pytest.mark.parametrize("filename", ["bench_engine.py", "bench_spec.py", "measure_profile.py", "bench_elastic.py"])
def test_missing_dataset_is_an_error_before_any_model_loads(filename, monkeypatch, capsys) -> None:
    import nightjar_jax

    mod = script(filename)
    monkeypatch.setattr(nightjar_jax, "LLM", None)  # (a model load would fail here with a TypeError, not exit)
    monkeypatch.setattr(mod, "memory_bandwidth_gbs", None, raising=False)  # (bench_engine's first minute)
    monkeypatch.setattr(sys, "argv", [filename, "--dataset", "/no/such.jsonl", "--out", "/tmp/flags_x.json"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2  # (a usage error, as argparse's: it was status 1)
    assert f"{filename}: error: argument --dataset: '/no/such.jsonl': no such file" in capsys.readouterr().err


@pytest.mark.parametrize("filename", ["bench_engine.py", "bench_spec.py", "measure_profile.py"])
def test_missing_default_dataset_keeps_synthetic_prompts(filename, monkeypatch, tmp_path, capsys) -> None:
    """Where the default dataset is absent (no ../shared) these scripts go on with their synthetic token ids."""
    import nightjar_jax

    mod = script(filename)
    monkeypatch.setattr(mod, "DEFAULT_DATASET", str(tmp_path / "question.jsonl"))
    monkeypatch.setattr(nightjar_jax, "LLM", None)  # (past the dataset: the first model load fails, TypeError)
    monkeypatch.setattr(mod, "memory_bandwidth_gbs", None, raising=False)
    monkeypatch.setattr(sys, "argv", [filename, "--out", str(tmp_path / "x.json")])
    with pytest.raises(TypeError):
        mod.main()
    assert "is not on this machine: using synthetic token ids" in capsys.readouterr().err


# ---- 4 / 9. bench_spec: tok/s and TPOT over the same seconds (catch-up excluded) ------------------------------
def test_bench_spec_tpot_and_tokens_per_second_share_their_seconds(monkeypatch) -> None:
    from nightjar_jax.bench.common import DecodeRun

    mod = script("bench_spec.py")
    run = DecodeRun(batch_size=4, gamma=2, num_decode_steps=10, decode_seconds=1.5, committed_tokens=80,
                    draft_seconds=0.3, verify_seconds=0.6, catchup_seconds=0.5, total_seconds=2.0,
                    mean_accepted_length=2.0, gamma_steps={2: 10})

    class FakeLLM:
        def __init__(self, *a, **k):
            self.engine = type("E", (), {"target": type("T", (), {"config": type("C", (), {"vocab_size": 512})})})

        def get_tokenizer(self):
            return None

    import nightjar_jax

    monkeypatch.setattr(nightjar_jax, "LLM", FakeLLM)
    monkeypatch.setattr(mod, "run_decode_workload", lambda *a, **k: run)
    args = mod.parse_args(["--models", "stories260k", "--batch-sizes", "4", "--gammas", "2", "--gamma-max", "2",
                           "--repeats", "1"])
    rows = mod.bench_model("stories260k", args, [4], [])
    row = next(r for r in rows if r["gamma"] == 2)
    assert row["tokens_per_second"] == pytest.approx(80 / 1.0)
    # batch x tokens per sequence per second: tok/s x TPOT (s) = batch
    assert row["tokens_per_second"] * row["tpot_ms"] / 1e3 == pytest.approx(row["batch_size"])


# ---- 5. eval_draft: no prompt under --max-prompt-tokens is an error, not an IndexError in summarize -------------
def test_eval_draft_no_fitting_prompt_is_an_error() -> None:
    mod = script("eval_draft.py")
    prompts = [{"id": "a", "ids": [1] * 5}, {"id": "b", "ids": [1] * 9}]
    fit, skipped = mod.fitting_prompts(prompts, 5)
    assert [p["id"] for p in fit] == ["a"] and [p["id"] for p in skipped] == ["b"]
    with pytest.raises(SystemExit, match="no prompt fits --max-prompt-tokens 1: the shortest .* has 5 tokens"):
        mod.fitting_prompts(prompts, 1)


def test_eval_draft_auto_names_the_paired_draft() -> None:
    from nightjar_jax.models.presets import default_draft_for

    mod = script("eval_draft.py")
    if default_draft_for(mod.TARGET) is None:
        pytest.skip("the target's paired draft is not installed here")
    assert mod.parse_args(["--draft", "auto"]).draft == default_draft_for(mod.TARGET)


# ---- 2. bench_priority: a class that never waited has no ratio ----------------------------------------------------
def test_bench_priority_ratios_are_none_where_fcfs_is_zero() -> None:
    mod = script("bench_priority.py")
    medians = {("priority", "urgent", "ttft_steps"): 0.0, ("fcfs", "urgent", "ttft_steps"): 0.0,
               ("priority", "urgent", "ttft_seconds"): 0.01, ("fcfs", "urgent", "ttft_seconds"): 0.02}
    ratios = mod.policy_ratios(lambda policy, cls, key: medians.get((policy, cls, key), 1.0))
    assert ratios["urgent_ttft_steps"] is None
    assert ratios["urgent_ttft_seconds"] == 0.5 and ratios["wall_seconds"] == 1.0


# ---- 3 / 9. bench_structured: no ITL at one token; the regex must match whole ------------------------------------
def test_bench_structured_parse_and_missing_itl() -> None:
    mod = script("bench_structured.py")
    assert mod.parses("regex", "Once upon a time there was a dog.")
    assert not mod.parses("regex", "C") and not mod.parses("regex", "Once upon a time there was a dog. And")
    assert mod.parses("json object", '{"a": 1}') and not mod.parses("json schema", "C")
    assert mod.parses("none", "anything")
    assert mod.median_or_none([None, None]) is None and mod.median_or_none([None, 2.0, 4.0]) == 3.0


def test_bench_structured_batch_sizes_kept_as_given() -> None:
    args = script("bench_structured.py").parse_args(["--batch-sizes", "8,16", "--num-prompts", "16"])
    assert args.batch_sizes == "8,16" and script("bench_structured.py").MAX_NUM_SEQS == 8


# ---- 3 / 5. measure_profile: nothing to fit is an error, the KV budget holds the simulator's longest request -----
def test_measure_profile_fit_and_budget() -> None:
    mod = script("measure_profile.py")
    with pytest.raises(ValueError, match="no sample"):
        mod.least_squares([], [])
    assert mod.least_squares([10, 20], [1.0, 2.0]) == pytest.approx((0.0, 0.1), abs=1e-9)
    assert mod.default_kv_budget_pages(64, 16, 4) == 64 * 64  # the default grid's budget is unchanged
    from nightjar_jax.sim.workload import DEFAULT_OUTPUT_LENGTHS, DEFAULT_PROMPT_LENGTHS

    longest = DEFAULT_PROMPT_LENGTHS.maximum + DEFAULT_OUTPUT_LENGTHS.maximum + 4 + 1
    assert mod.default_kv_budget_pages(2, 16, 4) * 16 >= longest


# ---- 4. bench_lookup: too few prompts after the length filter, before any engine loads ---------------------------
def test_bench_lookup_needs_a_timed_group() -> None:
    mod = script("bench_lookup.py")
    mod.enough_prompts(3, 1, 384)
    with pytest.raises(SystemExit, match="only 2 held-out prompts fit"):
        mod.enough_prompts(2, 1, 64)


# ---- 6. device checks: nothing ran is not ok; failed sections fail the run; --smoke keeps given flags -----------
def test_device_check_all_ok_needs_a_case() -> None:
    mod = script("device_check.py")
    assert not mod.all_ok([])
    assert not mod.all_ok([{"name": "a", "skipped": "budget"}])
    assert mod.all_ok([{"ok": True}, {"skipped": "budget"}])
    assert not mod.all_ok([{"ok": True}, {"ok": False}])


def test_device_check_engine_smoke_honours_given_flags_and_failures_count() -> None:
    mod = script("device_check_engine.py")
    smoke = mod.parse_args(["--smoke"])
    assert (smoke.models, smoke.batch_sizes, smoke.prompt_len, smoke.dtype) == ("tiny-gqa", "1,2", 16, "float32")
    given = mod.parse_args(["--smoke", "--batch-sizes", "4", "--prompt-len", "24"])
    assert (given.batch_sizes, given.prompt_len, given.models) == ("4", 24, "tiny-gqa")
    full = mod.parse_args([])
    assert (full.models, full.batch_sizes, full.dtype) == ("smollm2-135m-instruct,llama-7b", "1,16,64", "bfloat16")
    assert mod.parse_args(["--spec", ""]).spec == ""
    result = {"sections": [{"name": "ar a", "error": "X"}, {"name": "ar a (reference attention)"}]}
    assert mod.failed_sections(result) == ["ar a"]
    assert mod.failed_sections({"sections": [{"name": "ar a"}, {"name": "s", "skipped": "budget"}]}) == []


# ---- 7. eval_draft: the header names the γ run ---------------------------------------------------------------------
def test_eval_draft_header_names_gamma() -> None:
    mod = script("eval_draft.py")
    assert "(γ=2)" in mod.table_header(2) and "(γ=4)" not in mod.table_header(2)


# ---- 8. bench_reload_acceptance: a draft that never moved compares nothing ----------------------------------------
def test_bench_reload_acceptance_refuses_a_run_without_a_move() -> None:
    mod = script("bench_reload_acceptance.py")
    mod.check_moved({"offloads": 1, "reloads": 1}, 4)
    with pytest.raises(SystemExit, match="never moved"):
        mod.check_moved({"offloads": 0, "reloads": 0}, 100)


def test_bench_elastic_medians_skip_rounds_without_a_steady_step() -> None:
    """A round where every step compiled has no steady rate: it was 0.0 and its ratio a ZeroDivisionError (no JSON
    written); it is None, left out of the medians, "n/a" in the table."""
    mod = script("bench_elastic.py")
    assert mod.median_of([None, None]) is None
    assert mod.median_of([1.0, None, 3.0]) == 2.0
