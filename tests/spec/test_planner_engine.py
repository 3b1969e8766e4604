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


def _nightjar_engine(**kwargs):
    return fake_engine(draft=True, num_speculative_tokens=3, planner="nightjar", **kwargs)


def _run_prompts(eng, max_tokens=20):
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, greedy(max_tokens), request_id=str(i))
    assert run_all(eng) == {str(i): fake_greedy_continuation(p, max_tokens, VOCAB) for i, p in enumerate(PROMPTS)}


def test_planner_state_carries_what_the_planner_learned_into_the_next_run(tmp_path):
    from nightjar_jax.planner import Planner

    path = tmp_path / "state" / "planner.json"  # (its folder is created)
    first = _nightjar_engine(planner_state=path)  # (a pathlib path, held as its str)
    assert Planner.load(path).num_decisions == 0  # written at start: a path that cannot be written fails there
    _run_prompts(first)
    learned = first.planner.state_dict()["learned"]
    assert first.planner.num_observations > 0
    first.close()
    saved = json.loads(path.read_text())
    assert saved["learned"] == learned and saved["counters"]["num_observations"] == first.planner.num_observations

    start = Planner.load(path)
    log = tmp_path / "decisions.jsonl"
    second = _nightjar_engine(planner_state=str(path), planner_log=log)
    assert second.planner.to_json() == start.to_json()  # warm: as saved, estimates, rng and counters
    assert second.planner_switches == 0  # (this run's, for /metrics)
    _run_prompts(second, 40)  # (lossless from a warm start too)
    second.close()
    assert Planner.load(path).num_observations == second.planner.num_observations > first.planner.num_observations
    assert second.planner_switches == second.planner.num_switches - start.num_switches
    # the warm run's log replays through the state it started from
    from nightjar_jax.planner import replay

    assert replay(log, start).all_match


def test_a_warm_started_dsd_goes_on_from_its_fit(tmp_path):
    """dsd counts observations for its warm-up and refits: reset to 0 at a warm start (as they were), it ran its
    warm-up cycle again and never refit in a run shorter than the last (QA, 2026-12-07)."""
    from nightjar_jax.planner import Planner

    path = tmp_path / "dsd.json"
    first = fake_engine(draft=True, num_speculative_tokens=3, planner="dsd", planner_state=path)
    _run_prompts(first, 40)
    first.close()
    saved = Planner.load(path)
    second = fake_engine(draft=True, num_speculative_tokens=3, planner="dsd", planner_state=path)
    assert second.planner.to_json() == saved.to_json()
    for _ in range(8):  # (past its warm-up: it chooses from its fit, not the cycle 0, 1, 2, 3 again)
        assert second.planner.select(1) == saved.select(1)


def test_planner_state_is_saved_when_the_engine_is_collected_without_close(tmp_path):
    import gc

    from nightjar_jax.planner import Planner

    path = tmp_path / "planner.json"

    def run():
        eng = _nightjar_engine(planner_state=path)
        _run_prompts(eng)
        return eng.planner.num_observations

    observed = run()
    gc.collect()
    assert Planner.load(path).num_observations == observed > 0


def test_planner_state_path_is_fixed_at_start_and_a_symlink_keeps_pointing(tmp_path, monkeypatch):
    from nightjar_jax.planner import Planner

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    eng = _nightjar_engine(planner_state="rel.json")
    monkeypatch.chdir(tmp_path / "b")  # (a later save went to b/rel.json)
    _run_prompts(eng)
    eng.close()
    assert Planner.load(tmp_path / "a" / "rel.json").num_observations > 0 and not (tmp_path / "b" / "rel.json").exists()

    (tmp_path / "store").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "store" / "state.json")  # (dangling until the first save)
    eng = _nightjar_engine(planner_state=link)
    _run_prompts(eng)
    eng.close()
    assert link.is_symlink() and Planner.load(tmp_path / "store" / "state.json").num_observations > 0


def test_planner_state_is_saved_while_decoding(tmp_path, monkeypatch):
    from nightjar_jax.engine import engine as engine_module
    from nightjar_jax.planner import Planner

    monkeypatch.setattr(engine_module, "PLANNER_STATE_SAVE_SECONDS", 0.0)  # (due after every observed step)
    path = tmp_path / "planner.json"
    eng = _nightjar_engine(planner_state=path)
    _run_prompts(eng)
    # not closed: a process killed now keeps what the last observed step taught
    assert Planner.load(path).num_observations == eng.planner.num_observations > 0


def test_planner_state_of_another_planner_or_gamma_max_is_a_config_error(tmp_path):
    from nightjar_jax.config import ConfigError

    path = tmp_path / "planner.json"
    _nightjar_engine(planner_state=path).close()
    before = path.read_text()
    with pytest.raises(ConfigError, match=r"holds what planner 'nightjar' learned with γ_max 3; this engine runs "
                                          r"'nightjar' with γ_max 2: give another path, or remove the file"):
        fake_engine(draft=True, num_speculative_tokens=2, planner="nightjar", planner_state=path)
    with pytest.raises(ConfigError, match=r"holds what planner 'nightjar' .* this engine runs 'banditspec'"):
        fake_engine(draft=True, num_speculative_tokens=3, planner="banditspec", planner_state=path)
    assert path.read_text() == before  # (a refused state is left as it was)


@pytest.mark.parametrize("content", ["", '{"format": "nightjar-jax/planner-state/v1", "spec"', '{"a": 1}\n',
                                     "[" * 100_000 + "]" * 100_000],  # (nested past the recursion limit)
                         ids=["empty", "cut", "not-a-state", "too-deep"])
def test_planner_state_that_is_not_a_state_is_a_config_error(tmp_path, content):
    from nightjar_jax.config import ConfigError

    path = tmp_path / "planner.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"planner_state='.*planner.json' cannot be read as a planner state \(.*\): "
                                          r"give the path of a state an earlier run wrote, or a new path"):
        _nightjar_engine(planner_state=path)
    assert path.read_text() == content


def test_planner_state_in_a_place_that_cannot_be_written_is_a_config_error(tmp_path):
    from nightjar_jax.config import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"planner_state='.*' cannot be written \(.*\): give the path of a JSON "
                                          r"file in a writable folder"):
        _nightjar_engine(planner_state=blocker / "planner.json")  # (its "folder" is a file)
    with pytest.raises(ConfigError, match=r"cannot be read as a planner state \(Is a directory\)"):
        _nightjar_engine(planner_state=tmp_path)


def test_planner_state_without_a_draft_is_left_alone(tmp_path):
    path = tmp_path / "planner.json"
    eng = fake_engine(draft=False, planner="nightjar", planner_state=path)
    assert eng.gamma_max == 0 and eng.save_planner_state() is False
    eng.close()
    assert not path.exists()


def test_planner_state_config_checks_its_type():
    from nightjar_jax.config import ConfigError, make_engine_config

    with pytest.raises(ConfigError, match=r"planner_state=3 is invalid: allowed None \(start cold\) or a path"):
        make_engine_config(model="fake", planner_state=3)
    with pytest.raises(ConfigError, match=r"planner_state='' is invalid"):
        make_engine_config(model="fake", planner_state="")


def test_a_warm_planner_state_warms_the_gammas_it_chose_first(tmp_path, monkeypatch):
    """With what the planner learned, the full warm-up compiles the γ it would choose at each batch bucket before
    the other speculating variants (a warm-up the memory maps stop then leaves the unlikely ones to first use)."""
    from nightjar_jax.planner import make_planner

    planner = make_planner("nightjar", 3)
    for gamma, tokens in enumerate([1, 2, 5, 2]):  # at batch 1, γ = 2 commits the most per second
        for _ in range(10):
            planner.observe(gamma, 1, tokens, 0.01)
    path = tmp_path / "planner.json"
    planner.save(path)
    eng = _nightjar_engine(planner_state=path)
    buckets = eng.runner.shapes.decode_buckets
    order = eng._speculative_warmup_order()
    assert order[0] == (1, 2) and sorted(order) == [(b, g) for b in buckets for g in (1, 2, 3)]
    cold = _nightjar_engine()._speculative_warmup_order()
    assert cold == [(b, g) for b in buckets for g in (1, 2, 3)]  # (nothing learned: smaller buckets first)

    calls = []
    monkeypatch.setattr(eng.runner, "warmup", lambda **kw: calls.append((kw.get("batch_sizes"), kw["gammas"])) or [])
    monkeypatch.setattr(eng.runner, "warmup_prefill", lambda **kw: [])
    eng.warmup(sampled=False)
    assert calls[0] == (None, [0]) and calls[1:len(order) + 1] == [([b], [g]) for b, g in order]


def test_a_closed_engine_collected_later_does_not_write_over_a_newer_ones_state(tmp_path):
    """A closed engine's exit-time save wrote its old state over the file a newer engine had saved since (QA review,
    2026-12-07): a save is skipped when nothing changed since the engine's last one."""
    import gc

    from nightjar_jax.planner import Planner

    path = tmp_path / "planner.json"
    first = _nightjar_engine(planner_state=path)
    _run_prompts(first)
    first.close()
    second = _nightjar_engine(planner_state=path)
    _run_prompts(second, 40)
    second.close()
    newer = Planner.load(path).num_observations
    assert newer > first.planner.num_observations
    del first
    gc.collect()  # (its finalizer runs now)
    assert Planner.load(path).num_observations == newer


def test_planner_state_saves_survive_a_busy_file_and_a_planner_that_changes_meanwhile(tmp_path, monkeypatch):
    """os.replace cannot move a file over a bind-mounted one (EBUSY: a container's one-file volume): it is written in
    place. A planner changed by the engine thread while another writes it (RuntimeError: a dict changed size) is
    written again, and a save that keeps failing warns instead of raising out of close()."""
    import errno
    import os

    from nightjar_jax.planner import Planner

    path = tmp_path / "planner.json"
    eng = _nightjar_engine(planner_state=path)
    _run_prompts(eng)

    def busy(src, dst):
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(os, "replace", busy)
    assert eng.save_planner_state() and Planner.load(path).num_observations == eng.planner.num_observations
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planner.json"]
    monkeypatch.undo()

    calls = []
    real_save = type(eng.planner).save

    def flaky(self, target):
        calls.append(target)
        if len(calls) < 3:
            raise RuntimeError("dictionary changed size during iteration")
        real_save(self, target)

    monkeypatch.setattr(type(eng.planner), "save", flaky)
    eng.planner.observe(0, 1, 1, 0.01)  # (something new to save)
    assert eng.save_planner_state() and len(calls) == 3
    monkeypatch.setattr(type(eng.planner), "save", lambda self, target: (_ for _ in ()).throw(RuntimeError("x")))
    eng.planner.observe(0, 1, 1, 0.01)
    assert eng.save_planner_state() is False
    eng.close()  # (warns, does not raise)
