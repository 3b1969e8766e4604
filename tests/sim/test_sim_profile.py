"""Cost profiles: schema round trip, interpolation, the labelled synthetic model."""

from __future__ import annotations

import json
import re

import pytest

from nightjar_jax.sim import DEFAULT_PROFILE, CostProfile, build_synthetic_profile
from nightjar_jax.sim.profile import PROFILES_DIR
from nightjar_jax.sim.synthetic import RooflineModel


def test_checked_in_profile_loads_and_is_labelled_synthetic():
    profile = CostProfile.from_json()
    raw = json.loads(DEFAULT_PROFILE.read_text())
    assert raw["kind"] == "synthetic-model" and "SYNTHETIC" in raw["label"] and "not a measurement" in raw["notes"]
    assert profile == build_synthetic_profile()  # the file is what the builder writes
    assert profile.gamma_max >= 4


def test_round_trip(tmp_path):
    profile = build_synthetic_profile(gamma_max=3, batch_sizes=(1, 8, 64), context_lengths=(128, 1024))
    path = tmp_path / "p.json"
    profile.save(path)
    assert CostProfile.from_json(path) == profile


def test_interpolation_is_exact_on_the_grid_and_linear_between():
    profile = CostProfile(
        batch_sizes=(1, 3),
        gammas=(0, 1),
        context_lengths=(100, 300),
        step_seconds_grid=(((1.0, 2.0), (2.0, 3.0)), ((3.0, 4.0), (5.0, 6.0))),
        acceptance_per_position=(0.5,),
        prefill_fixed_seconds=0.1,
        prefill_seconds_per_token=0.01,
        catchup_fixed_seconds=0.2,
        catchup_seconds_per_token=0.001,
        kind="synthetic-model",
    )
    assert profile.step_seconds(1, 0, 100) == 1.0 and profile.step_seconds(3, 1, 300) == 6.0
    assert profile.step_seconds(2, 0, 200) == pytest.approx(2.5)  # mean of the four corners
    assert profile.step_seconds(5, 0, 100) == pytest.approx(5.0)  # linear extrapolation in batch
    assert profile.catchup_seconds(0) == 0.0 and profile.catchup_seconds(100) == pytest.approx(0.3)
    assert profile.expected_tokens(1) == 1.5
    with pytest.raises(ValueError, match="gamma"):
        profile.step_seconds(1, 2, 100)


def test_bad_profiles_are_rejected():
    good = build_synthetic_profile(gamma_max=2, batch_sizes=(1, 2), context_lengths=(10, 20)).to_dict()
    for field, value, message in [
        ("gammas", [0, 2, 1], "gammas"),
        ("batch_sizes", [2, 1], "batch_sizes"),
        ("acceptance_per_position", [0.5], "acceptance"),
        ("kind", "guess", "kind"),
        ("schema", "other", "schema"),
    ]:
        with pytest.raises(ValueError, match=message):
            CostProfile.from_dict({**good, field: value})


def test_synthetic_model_has_the_speculation_crossover():
    profile = CostProfile.from_json()

    def best(batch: int, context: int) -> int:
        rates = [profile.expected_tokens(g) / profile.step_seconds(batch, g, context) for g in range(5)]
        return max(range(5), key=rates.__getitem__)

    assert best(1, 512) >= 2  # memory-bound: speculate deeply
    assert best(256, 256) <= 1  # compute-bound: speculation barely pays or costs
    assert profile.step_seconds(256, 4, 512) > 2 * profile.step_seconds(1, 4, 512)


def _mutated(change) -> dict:
    data = json.loads(json.dumps(CostProfile.from_json().to_dict()))
    change(data)
    return data


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["prefill_seconds"].update(fixed=float("nan")), "prefill_seconds.fixed must be a finite number"),
        (lambda d: d["step_seconds"][0][0].__setitem__(0, float("inf")),
         "step_seconds[0][0][0] must be a number of seconds in [1e-09, 86400]"),
        (lambda d: d["step_seconds"][1][2].__setitem__(3, -0.1), "step_seconds[1][2][3] must be a number of seconds"),
        (lambda d: d["catchup_seconds"].update(per_token=-1.0), "catchup_seconds.per_token must be a finite number"),
        (lambda d: d.update(reload_seconds=float("inf")), "reload_seconds must be a finite number of seconds >= 0"),
        (lambda d: d.update(page_size=0), "page_size must be an int >= 1, got 0"),
        (lambda d: d.update(max_num_seqs=0), "max_num_seqs must be an int >= 1, got 0"),
        (lambda d: d.update(kv_budget_pages=-3), "kv_budget_pages must be an int >= 1, got -3"),
        (lambda d: d["acceptance_per_position"].__setitem__(0, float("nan")), "acceptance_per_position entries"),
        (lambda d: d.update(batch_sizes=[0, *d["batch_sizes"][1:]]), "batch_sizes must be ints >= 1"),
        (lambda d: d.pop("kind"), "kind is required: 'measured'"),
    ],
)
def test_profile_values_are_checked_at_load_naming_the_field(change, message):
    """They used to load and then poison the simulation (NaN tok/s) or fail in the middle of a run."""
    with pytest.raises(ValueError, match=re.escape(message)):
        CostProfile.from_dict(_mutated(change))


def test_every_shipped_profile_loads_and_says_its_kind():
    paths = sorted(PROFILES_DIR.glob("*.json"))
    assert len(paths) >= 3
    for path in paths:
        assert CostProfile.from_json(path).kind in ("measured", "synthetic-model")


def test_cost_queries_refuse_what_is_off_the_profile():
    profile = CostProfile.from_json()
    assert profile.expected_tokens(0) == 1.0 and profile.expected_tokens(profile.gamma_max) > 1.0
    for gamma in (-1, profile.gamma_max + 1, 1.0, True):
        with pytest.raises(ValueError, match="gamma must be an int in 0"):
            profile.expected_tokens(gamma)
    with pytest.raises(ValueError, match="mean_context"):
        profile.step_seconds(8, 1, float("nan"))
    with pytest.raises(ValueError, match="batch_size"):
        profile.step_seconds(0, 1, 100.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(batch_sizes=[1.7, *d["batch_sizes"][1:]]), "batch_sizes must be ints >= 1, got [1.7"),
        (lambda d: d.update(batch_sizes=["1", *d["batch_sizes"][1:]]), "batch_sizes must be ints >= 1, got ['1'"),
        (lambda d: d.update(kv_budget_pages=100.9), "kv_budget_pages must be an int >= 1, got 100.9"),
        (lambda d: d.update(kv_budget_pages="12"), "kv_budget_pages must be an int >= 1, got '12'"),
        (lambda d: d.update(kv_budget_pages=float("inf")), "kv_budget_pages must be an int >= 1, got inf"),
        (lambda d: d.update(max_num_seqs=True), "max_num_seqs must be an int >= 1, got True"),
        (lambda d: d["step_seconds"][0][0].__setitem__(0, True), "step_seconds[0][0][0] must be a number of seconds"),
        (lambda d: d["step_seconds"][0][0].__setitem__(0, "0.5"), "step_seconds[0][0][0] must be a number of seconds"),
        (lambda d: d["step_seconds"][0][0].__setitem__(0, 1e-12), "step_seconds[0][0][0] must be a number of seconds"),
        (lambda d: d["step_seconds"][0][0].__setitem__(0, 1e5), "step_seconds[0][0][0] must be a number of seconds"),
        (lambda d: d["step_seconds"].__setitem__(0, 0.1), "step_seconds[0] must be a list, got 0.1"),
        (lambda d: d["acceptance_per_position"].__setitem__(0, "0.5"), "acceptance_per_position entries"),
        (lambda d: d.update(gammas=[0, 1.0, *d["gammas"][2:]]), "gammas must be 0..gamma_max"),
        (lambda d: d.update(prefill_seconds=0.1), 'prefill_seconds must be an object {"fixed": seconds'),
        (lambda d: d.update(prefill_seconds={"fixed": 0, "per_token": 0}), "a prefill step must take time"),
        (lambda d: d.pop("batch_sizes"), "the profile has no 'batch_sizes' field"),
        (lambda d: d.update(label=3), "label must be a string, got 3"),
    ],
)
def test_profile_files_are_read_without_converting_anything(change, message):
    """int()/float() ran before the checks: 1.7 became the batch size 1, "12" 12 pages, True one second; a missing
    field raised a bare KeyError, a number where an object belongs a TypeError, an infinite page count an
    OverflowError; step seconds the planners refuse (1e-12) crashed the simulation mid-run."""
    with pytest.raises(ValueError, match=re.escape(message)):
        CostProfile.from_dict(_mutated(change))


def test_a_profile_needs_a_speculative_step_and_a_json_object():
    data = build_synthetic_profile(gamma_max=1, batch_sizes=(1, 2), context_lengths=(10, 20)).to_dict()
    assert CostProfile.from_dict(data).gamma_max == 1
    data.update(gammas=[0], step_seconds=[[row[0]] for row in data["step_seconds"]], acceptance_per_position=[])
    with pytest.raises(ValueError, match="gamma_max >= 1"):
        CostProfile.from_dict(data)
    with pytest.raises(ValueError, match="not a cost profile: schema 'a JSON list, not an object'"):
        CostProfile.from_dict([1, 2])


def test_the_roofline_model_checks_its_parameters():
    for kwargs, message in [
        ({"bandwidth": 0}, "bandwidth must be a finite number > 0, got 0"),
        ({"overlap": float("nan")}, "overlap must be a finite number >= 0"),
        ({"page_size": 16.0}, "page_size must be an int >= 1"),
        ({"acceptance_per_position": (0.5, 1.5)}, "acceptance_per_position must be numbers in [0, 1]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            RooflineModel(**kwargs)
    for gamma_max in (-1, 0, 7, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"gamma_max must be an int in 1..6 (the model's acceptance "
                                                        f"entries), got {gamma_max!r}")):
            build_synthetic_profile(gamma_max=gamma_max)
