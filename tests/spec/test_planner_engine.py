"""The planner wired into the engine: it picks γ every decode step, output stays lossless, and the opt-in JSONL
log of decisions and rewards replays through a fresh planner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from helpers import VOCAB, fake_engine, greedy, run_all  # noqa: E402

from nightjar_jax.testing import fake_greedy_continuation  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(1, 21)), [42, 1], [3, 3], list(range(30, 43))]


@pytest.mark.parametrize("planner", ["nightjar", "banditspec", "dsd", "table", "ar"])
def test_planner_drives_gamma_losslessly(planner, tmp_path):
    log = tmp_path / "decisions.jsonl"
    eng = fake_engine(draft=True, num_speculative_tokens=3, planner=planner, planner_log=str(log))
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(25), request_id=str(i))
    assert run_all(eng) == {str(i): fake_greedy_continuation(p, 25, VOCAB) for i, p in enumerate(PROMPTS)}
    # the engine's shutdown writes the last record, which stays pending when the last decode step compiled (no
    # observation completes it); detaching the logger alone lost it in runs where that happened
    eng.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == eng.stats.num_decode_steps
    gammas = {r["gamma"] for r in records}
    assert gammas <= set(range(4))
    if planner == "ar":
        assert gammas == {0}
    # a step that compiled a variant is not shown to the planner (it timed the compiler): no observation fields
    unobserved = [r for r in records if r.get("seconds") is None]
    assert len(unobserved) == eng.stats.num_compiling_decode_steps > 0
    assert eng.planner.num_observations == eng.stats.num_decode_steps - eng.stats.num_compiling_decode_steps


def test_a_planner_log_that_cannot_be_opened_is_a_config_error(tmp_path):
    """A folder as planner_log was a bare IsADirectoryError from deep in the engine's build (QA, 2026-12-06)."""
    from nightjar_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"planner_log='.*' cannot be opened to append to \(Is a directory\)"):
        fake_engine(draft=True, num_speculative_tokens=3, planner="nightjar", planner_log=str(tmp_path))


def test_engine_log_replays_through_the_planner(tmp_path):
    from nightjar_jax.planner import make_planner, read_log, replay

    log = tmp_path / "decisions.jsonl"
    eng = fake_engine(draft=True, num_speculative_tokens=3, planner="nightjar", planner_log=str(log))
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(20), request_id=str(i))
    run_all(eng)
    eng.close()
    records = read_log(log)
    assert records
    result = replay(log, make_planner("nightjar", 3))
    assert result.all_match  # the compiling steps' missing observations replay as they ran


def test_nightjar_planner_chooses_among_ar_chains_and_a_tree():
    """spec_tree_min_gamma = γ_max: the bandit's arms are AR, chains and the tree. Its first bins play γ_max (the
    tree) and then the nearest untried arms (chains); which arms follow depends on measured step times, so only
    that much is pinned. Steps at γ_max verify the tree, the others a chain, and the output stays the AR tokens."""
    eng = fake_engine(draft=True, runner_up=True, num_speculative_tokens=3, planner="nightjar", spec_tree_nodes=8,
                      spec_tree_min_gamma=3, num_pages=48, max_num_seqs=5)
    eng.record_steps = True
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(40), request_id=str(i))
    assert run_all(eng) == {str(i): fake_greedy_continuation(p, 40, VOCAB) for i, p in enumerate(PROMPTS)}
    log = eng.stats.step_log
    gammas = {s["gamma"] for s in log}
    assert 3 in gammas and gammas & {1, 2}
    assert {s["tree_nodes"] for s in log if s["gamma"] == 3} == {8 + 3}  # 8 draft nodes + lookup's copy branch
    assert {s["tree_nodes"] for s in log if s["gamma"] < 3} == {0}
    assert eng.num_free_pages == eng.num_total_pages
