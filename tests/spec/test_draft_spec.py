"""Derived drafts' specs (``<model>@skip=...`` / ``<model>@layers=N``) and model paths that hold an ``@``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nightjar_jax.spec.drafts import parse_draft_spec

ASSET = Path(__file__).resolve().parents[2] / "nightjar_jax" / "assets" / "stories260K"


@pytest.mark.parametrize("spec, parsed", [
    ("m@skip=1,2", ("m", [1, 2], None)),
    ("m@layers=4", ("m", None, 4)),
    ("stories260k", ("stories260k", None, None)),
    ("org/model@skip=0", ("org/model", [0], None)),
])
def test_specs_parse(spec, parsed):
    assert parse_draft_spec(spec) == parsed


@pytest.mark.parametrize("spec", [
    "m@skip", "m@skip=", "m@skip=,", "m@skip=1,,2",  # (no layer named: a full copy of the target "drafted")
    "@skip=2",  # (no model: it was the current directory, "not a model folder")
    "m@skip=1_0", "m@layers=+4",  # (int() read these as 10 and 4)
    "m@layers=", "m@layers=1,2", "m@skip=a", "m@other=1",
])
def test_specs_that_name_no_layer_or_no_model_are_refused(spec):
    with pytest.raises(ValueError, match="is no path that exists, and as a derived draft's spec it is invalid"):
        parse_draft_spec(spec)


def test_a_path_with_an_at_sign_is_a_model(tmp_path):
    """A target (or draft) whose path holds '@' was split as a draft spec: "draft spec ... is invalid"."""
    from nightjar_jax import LLM, SamplingParams

    folder = tmp_path / "run@3"
    shutil.copytree(ASSET, folder)
    path = str(folder / "stories260K.bin")
    assert parse_draft_spec(path) == (path, None, None)
    llm = LLM(path, draft_model="none", max_model_len=64, num_pages=16)
    out = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
