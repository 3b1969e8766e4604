"""``nightjar_jax.bench.common``'s argparse types and its helpers for numbers that may not exist (no model loads)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from nightjar_jax.bench import common


def _parser(**types) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    for flag, type_ in types.items():
        p.add_argument(f"--{flag}", type=type_)
    return p


@pytest.mark.parametrize("type_, good, bad", [
    (common.positive_int, [("1", 1), ("32", 32)], ["0", "-3", "x", "1.5", ""]),
    (common.non_negative_int, [("0", 0), ("7", 7)], ["-1", "x"]),
    (common.int_at_least(2), [("2", 2)], ["1", "0"]),
    (common.positive_float, [("0.5", 0.5), ("3", 3.0)], ["0", "-5", "abc", "inf", "nan", "-inf"]),
    (common.non_negative_float, [("0", 0.0)], ["-0.1", "nan", "inf"]),
])
def test_scalar_types_accept_and_refuse(type_, good, bad) -> None:
    for text, want in good:
        assert type_(text) == want
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            type_(text)


def test_int_list_refuses_empty_duplicates_small_and_unordered() -> None:
    parse = common.int_list(1)
    assert parse("1,4, 16") == [1, 4, 16]
    assert parse("4,1") == [4, 1]  # (order free unless asked)
    for bad in ("", "0", "-1", "1,1", "a,2", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    inc = common.int_list(1, increasing=True)
    assert inc("1,2,8") == [1, 2, 8]
    for bad in ("2,1", "1,1", "32,16"):
        with pytest.raises(argparse.ArgumentTypeError, match="strictly increasing"):
            inc(bad)
    assert common.int_list(0)("0,2") == [0, 2]
    assert common.int_list(1, allow_empty=True)("") == []
    assert common.int_list(1, as_text=True)("1,8") == "1,8"  # checked, kept as given


def test_name_list_and_models() -> None:
    parse = common.name_list(("a", "b"))
    assert parse("a,b") == ["a", "b"]
    for bad in ("", "a,", "c", "a,a"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert common.model_spec("stories260k") == "stories260k"
    assert common.model_spec("stories260k@skip=2") == "stories260k@skip=2"
    assert common.model_spec("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    for bad in ("nosuch", "", "nosuch@skip=1", "./missing/dir"):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown model"):
            common.model_spec(bad)
    assert [common.draft_spec(d) for d in ("none", "", "auto", "ngram")] == ["none", "", "auto", "ngram"]
    assert common.smollm2_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(argparse.ArgumentTypeError, match="SmolLM2's tokenizer"):
        common.smollm2_model("stories260k")


def test_flag_errors_are_usage_errors_naming_the_flag(capsys) -> None:
    p = _parser(repeats=common.positive_int, sizes=common.int_list(1))
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--repeats", "0"])
    assert exc.value.code == 2
    assert "argument --repeats: expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--sizes", ""])
    assert "argument --sizes:" in capsys.readouterr().err


def test_files_and_outputs(tmp_path, capsys) -> None:
    f = tmp_path / "x.json"
    f.write_text("{}")
    assert common.existing_file(str(f)) == str(f)
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        common.existing_file(str(tmp_path / "nope.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write"):
        common.writable_out(str(f / "o.json"))  # under a file
    # a usage error, exit status 2 as argparse's (it was status 1, as a failure of the run)
    with pytest.raises(SystemExit) as exc:
        common.dataset_texts(str(tmp_path / "none.jsonl"))
    assert exc.value.code == 2 and "error: argument --dataset: " in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exc:
        common.dataset_texts(str(empty))
    assert exc.value.code == 2 and "no record with a non-empty first turn" in capsys.readouterr().err
    # the script's own default may be missing (a machine without ../shared): the built-in prompts, said on stderr
    missing_default = str(tmp_path / "default.jsonl")
    assert common.dataset_texts(missing_default, default=missing_default) == list(common.BUILT_IN_PROMPTS)
    assert "not on this machine" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (given, not the default: an error)
        common.dataset_texts(str(tmp_path / "typo.jsonl"), default=missing_default)
    assert "typo.jsonl': no such file" in capsys.readouterr().err


def test_missing_numbers_are_none_and_na(tmp_path) -> None:
    assert common.ratio(0.0, 0.0) is None and common.ratio(1.0, 0) is None and common.ratio(None, 2.0) is None
    assert common.ratio(3.0, 2.0) == 1.5
    assert common.fmt(None) == "n/a" and common.fmt(float("nan")) == "n/a" and common.fmt(0.0123, ".2f", 1e3) == "12.30"
    out = tmp_path / "o.json"
    common.write_json(str(out), {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2.5}})
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": 2.5}}
    assert not any(isinstance(v, float) and math.isnan(v) for v in json.loads(text)["b"])


def test_writable_out_checks_and_the_writer_makes_the_folder(tmp_path, monkeypatch) -> None:
    """Parsing only checks (argparse runs the type on a flag's default too, before it reports another flag's error:
    creating folders there left stray ones behind failed runs); the writer makes a missing folder (sim_planners.py
    wrote with a plain open and failed after the whole run, exit 1, the code of "a check printed NO")."""
    out = tmp_path / "new" / "deeper" / "o.json"
    assert common.writable_out(str(out)) == str(out)
    assert not (tmp_path / "new").exists()
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--out", type=common.writable_out, default=str(tmp_path / "default_dir" / "x.json"))
    p.add_argument("--other", type=int)
    with pytest.raises(SystemExit):
        p.parse_args(["--other", "x"])
    assert p.parse_args([]).out.endswith("x.json") and not (tmp_path / "default_dir").exists()
    assert common.make_parent(out) == out and out.parent.is_dir() and not out.exists()
    f = tmp_path / "file"
    f.write_text("")
    for bad, message in [
        (f / "sub" / "o.json", f"{str(f)!r} is a file, not a folder"),
        (tmp_path, "it is a folder"),
        ("", "expected an output file path"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            common.writable_out(str(bad) if bad != "" else "")
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a writable folder"):
        common.writable_out(str(tmp_path / "locked" / "o.json"))


def test_float_at_least() -> None:
    parse = common.float_at_least(1)
    assert parse("1") == 1.0 and parse("2.5") == 2.5
    for bad in ("0.5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number >= 1"):
            parse(bad)


def test_writable_out_tries_what_the_writer_will_make(tmp_path) -> None:
    """os.access reads mode bits, which root passes everywhere: ``--out /proc/nope/x.json`` was accepted and the
    writer failed after the whole run. The check now makes (and removes) a file or folder where the writer will."""
    before = sorted(tmp_path.iterdir())
    for good in (tmp_path / "o.json", tmp_path / "new" / "deeper" / "o.json"):
        assert common.writable_out(str(good)) == str(good)
    assert sorted(tmp_path.iterdir()) == before  # nothing left behind
    existing = tmp_path / "kept.json"
    existing.write_text("{}")
    assert common.writable_out(str(existing)) == str(existing) and existing.read_text() == "{}"
    import os

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    for bad in ("/proc/nope/x.json", "/proc/x.json"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape("'/proc' is not a writable folder")):
            common.writable_out(bad)


def test_planner_types_take_the_registry(capsys) -> None:
    from nightjar_jax.planner import known_planners

    for name in [*known_planners(), "static:2"]:
        assert common.planner_spec(name) == name
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"unknown planner 'bogus': expected one of "
                                                                   f"{known_planners()}")):
        common.planner_spec("bogus")
    parse = common.planner_list()
    assert parse("static:4,nightjar") == ["static:4", "nightjar"]
    assert common.planner_list(as_text=True)("ar,dsd") == "ar,dsd"
    for bad in ("nightjar,bogus", "", "ar,ar", "x:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    common.check_planner("static", 4)
    common.check_planner("nightjar", 0)
    for bad, gamma_max in (("static:8", 4), ("static:x", 4), ("nightjar:foo", 4), ("static:", 2)):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"planner {bad!r} at γ_max {gamma_max}: ")):
            common.check_planner(bad, gamma_max)


def test_ranges() -> None:
    parse = common.int_in_range(1, 36)
    assert parse("1") == 1 and parse("36") == 36
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer from 1 to 36, got 37"):
        parse("37")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 1"):
        parse("0")
    unit = common.float_in_range(0, 1)
    assert unit("0") == 0.0 and unit("1") == 1.0
    for bad in ("-0.1", "1.5", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number from 0 to 1"):
            unit(bad)
