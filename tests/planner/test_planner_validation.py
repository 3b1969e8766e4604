"""Validation at the door: option types and ranges, spec/option conflicts, and observation bounds.

docs/planner.md: an out-of-range or wrongly typed option names the field, the value given and what is allowed;
`select` / `observe` take bounded inputs (`MAX_BATCH_SIZE`, `MAX_TOKENS_PER_SEQUENCE`, `MIN_STEP_SECONDS`,
`MAX_STEP_SECONDS`), so the planners' arithmetic stays finite on anything they accept.
"""

from __future__ import annotations

import json
import logging
import re
import warnings

import numpy as np
import pytest

from nightjar_jax.planner import Planner, make_planner
from nightjar_jax.planner.base import MAX_BATCH_SIZE, MAX_STEP_SECONDS, MAX_TOKENS_PER_SEQUENCE, MIN_STEP_SECONDS

ALL_SPECS = ["ar", "static", "static:2", "banditspec", "dsd", "table", "nightjar"]
EDGES = "bucket_edges must be a sequence of ints increasing strictly from 1, e.g. (1, 2, 4, 8)"
TABLE = "table must be a sequence of (max_batch, gamma) int pairs, e.g. ((4, 2), (16, 1)), or None"


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("nightjar", {"seed": -1}, "seed must be an int >= 0 or None (None: a fresh random seed), got -1"),
        ("nightjar", {"seed": 1.5}, "seed must be an int >= 0 or None (None: a fresh random seed), got 1.5"),
        ("nightjar", {"seed": True}, "seed must be an int >= 0 or None (None: a fresh random seed), got True"),
        ("nightjar", {"bucket_edges": None}, f"{EDGES}, got None"),
        ("nightjar", {"bucket_edges": "abc"}, f"{EDGES}, got 'abc'"),
        ("nightjar", {"bucket_edges": {1, 2}}, f"{EDGES}, got {{1, 2}}"),
        ("nightjar", {"bucket_edges": (1, 2.5, 4)}, f"{EDGES}; 2.5 in (1, 2.5, 4) is not an int"),
        ("nightjar", {"bucket_edges": (1, True)}, f"{EDGES}; True in (1, True) is not an int"),
        ("nightjar", {"first_block_exponent": 2.5}, "first_block_exponent must be an int in 1..30, got 2.5"),
        ("nightjar", {"explore_scale": "x"}, "explore_scale must be a number >= 0, got 'x'"),
        ("nightjar", {"explore_scale": True}, "explore_scale must be a number >= 0, got True"),
        ("nightjar", {"explore_arms": ["all"]}, "explore_arms must be 'all' or 'neighbors', got ['all']"),
        ("nightjar", {"switch_cost_smoothing": "0.3"}, "switch_cost_smoothing must be a number in (0, 1], got '0.3'"),
        ("nightjar", {"reward_discount": 0}, "reward_discount must be a number in (0, 1], got 0"),
        ("nightjar", {"prior_weight": None}, "prior_weight must be a number in [0, 1e+06] (0: no prior), got None"),
        # (1e308 was taken, and a planner's saved state then overflowed into one it refused to load)
        ("nightjar", {"prior_weight": 1e308}, "prior_weight must be a number in [0, 1e+06] (0: no prior), got 1e+308"),
        ("nightjar", {"prior_mode": None}, "prior_mode must be 'relative' or 'absolute', got None"),
        ("nightjar", {"prior_transfer_sd": None}, "prior_transfer_sd must be a number > 0 (inf: priors carry no"),
        ("nightjar", {"elimination_z": float("nan")}, "elimination_z must be a number >= 0 (inf disables elimination)"),
        ("nightjar", {"elimination_min_samples": True}, "elimination_min_samples must be an int >= 2, got True"),
        ("nightjar", {"probe_length": 1.0}, "probe_length must be an int >= 0 (0: no probes), got 1.0"),
        ("nightjar", {"probe_budget": "0"}, "probe_budget must be a number in [0, 1], got '0'"),
        ("banditspec", {"exploration": None}, "exploration must be a finite number >= 0, got None"),
        ("banditspec", {"exploration": float("inf")}, "exploration must be a finite number >= 0, got inf"),
        ("dsd", {"default_gamma": None}, "default_gamma must be an int >= 0 (clipped to gamma_max), got None"),
        ("dsd", {"default_gamma": 1.5}, "default_gamma must be an int >= 0 (clipped to gamma_max), got 1.5"),
        ("dsd", {"warmup_steps": True}, "warmup_steps must be an int >= 0 or None (None: 2 * (gamma_max + 1)), got"),
        ("dsd", {"ridge": "0"}, "ridge must be a finite number >= 0, got '0'"),
        ("dsd", {"refit_every": 0}, "refit_every must be an int >= 1, got 0"),
        ("static", {"gamma": 2.0}, "gamma must be an int >= 0 or None (None: gamma_max), got 2.0"),
        ("table", {"table": 5}, f"{TABLE}, got 5"),
        ("table", {"table": "ab"}, f"{TABLE}, got 'ab'"),
        ("table", {"table": ((4,),)}, "table row 0 must be a (max_batch, gamma) pair of ints, got (4,)"),
        ("table", {"table": ((4, 2.9),)}, "table row 0 must be a (max_batch, gamma) pair of ints, got (4, 2.9)"),
        (
            "table",
            {"table": ((4, 2), (8, True))},
            "table row 1 must be a (max_batch, gamma) pair of ints, got (8, True)",
        ),
        ("table", {"table": ((4, 2), "ab")}, "table row 1 must be a (max_batch, gamma) pair of ints, got 'ab'"),
    ],
)
def test_a_wrongly_typed_option_names_the_field_the_value_and_what_is_allowed(spec, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_planner(spec, 4, **options)


def test_numpy_and_int_values_are_accepted_and_stored_as_plain_python_values():
    planner = make_planner(
        "nightjar", 4, seed=np.int64(3), bucket_edges=np.array([1, 2, 4]), explore_scale=1, probe_length=np.int32(2)
    )
    options = planner.options
    assert options.seed == 3 and type(options.seed) is int
    assert options.bucket_edges == (1, 2, 4) and all(type(e) is int for e in options.bucket_edges)
    assert options.explore_scale == 1.0 and type(options.explore_scale) is float
    assert type(options.probe_length) is int
    table = make_planner("table", 4, table=[[4, np.int64(2)], (16, 1)])
    assert table.options.table == ((4, 2), (16, 1)) and type(table.options.table[0][1]) is int
    for p in (planner, table, make_planner("dsd", 4, default_gamma=np.int64(2), ridge=np.float32(0.5))):
        json.loads(p.to_json())  # (numpy scalars would not serialise)
        assert Planner.from_json(p.to_json()).options == p.options


def test_a_spec_argument_and_a_disagreeing_option_are_an_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "planner spec 'static:2' sets gamma=2, but the option gamma=3 "
            "disagrees; give gamma once (in the spec or as an option)"
        ),
    ):
        make_planner("static:2", 4, gamma=3)
    # Agreeing values are one planner (from_json passes both the spec and its options).
    assert make_planner("static:2", 4, gamma=2).select(1) == 2
    assert make_planner("static", 4, gamma=3).select(1) == 3
    clone = Planner.from_json(make_planner("static:2", 4).to_json())
    assert clone.spec == "static:2" and clone.select(1) == 2


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_observations_outside_the_documented_bounds_are_rejected_at_the_door(spec):
    planner = make_planner(spec, 4)
    cases = [
        (dict(batch_size=2**62), f"batch_size must be in 1..{MAX_BATCH_SIZE}, got {2**62}"),
        (
            dict(num_tokens=2 * MAX_TOKENS_PER_SEQUENCE + 1),
            f"num_tokens must be <= batch_size * {MAX_TOKENS_PER_SEQUENCE} = {2 * MAX_TOKENS_PER_SEQUENCE} "
            f"(tokens committed over the batch in one step), got {2 * MAX_TOKENS_PER_SEQUENCE + 1}",
        ),
        (
            dict(seconds=1e-160),
            f"seconds must be in [{MIN_STEP_SECONDS}, {MAX_STEP_SECONDS}] (a step's wall time), got 1e-160",
        ),
        (dict(seconds=2 * MAX_STEP_SECONDS), f"seconds must be in [{MIN_STEP_SECONDS}, {MAX_STEP_SECONDS}]"),
        (dict(seconds=float("nan")), "seconds must be in [1e-09, 86400.0] (a step's wall time), got nan"),
        (dict(seconds="0.01"), "seconds must be a number of seconds, got '0.01'"),
        (dict(switch_seconds=None), "switch_seconds must be a number of seconds, got None"),
    ]
    for change, message in cases:
        observation = dict(gamma=1, batch_size=2, num_tokens=3, seconds=0.01, switch_seconds=0.0) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            planner.observe(**observation)
    with pytest.raises(ValueError, match=re.escape(f"batch_size must be in 1..{MAX_BATCH_SIZE}, got {2**62}")):
        planner.select(2**62)
    assert planner.num_observations == 0
    # a rounding leftover outside the switch counts as all switch (its reward, ~1e12 tokens/s, is skipped)
    planner.observe(gamma=1, batch_size=2, num_tokens=3, seconds=0.5, switch_seconds=0.5 - 1e-12)
    assert planner.num_observations == 1
    planner.observe(1, 2, 3, 0.5, switch_seconds=0.5)  # a step that was all switch: still accepted


@pytest.mark.parametrize(
    ("spec", "options"),
    [
        ("nightjar", {}),
        ("nightjar", {"prior_transfer_sd": 1e300, "elimination_min_samples": 2, "probe_every_bin": True}),
        ("nightjar", {"prior_mode": "absolute", "reward_discount": 0.5}),
        ("banditspec", {}),
        ("dsd", {}),
        ("table", {}),
    ],
)
def test_extreme_but_accepted_observations_never_crash_nor_leave_the_arms(spec, options):
    # The corners of what `observe` accepts: the largest reward (every sequence commits the most tokens in the
    # shortest step), the smallest (one token over the largest batch in the longest step), zero, and switch-only
    # steps, over the smallest and largest batches. Any float overflow (a numpy RuntimeWarning) fails the test.
    rng = np.random.default_rng(0)
    planner = make_planner(spec, 4, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(600):
            batch = int(rng.choice([1, 2, 3, 5, 64, 1000, MAX_BATCH_SIZE]))
            gamma = planner.select(batch)
            assert 0 <= gamma <= 4
            corner = step % 5
            if corner == 0:
                num_tokens, seconds, switch = batch * MAX_TOKENS_PER_SEQUENCE, MIN_STEP_SECONDS, 0.0
            elif corner == 1:
                num_tokens, seconds, switch = 1, MAX_STEP_SECONDS, 0.0
            elif corner == 2:
                num_tokens, seconds, switch = 0, MIN_STEP_SECONDS, 0.0
            elif corner == 3:
                num_tokens, seconds, switch = batch, MAX_STEP_SECONDS, MAX_STEP_SECONDS - MIN_STEP_SECONDS * 1e5
            else:
                num_tokens, seconds, switch = batch * (gamma + 1), 0.02, 0.02
            planner.observe(gamma, batch, num_tokens, seconds, switch)
        assert all(0 <= planner.select(b) <= 4 for b in (1, 7, 300, MAX_BATCH_SIZE))
        Planner.from_json(planner.to_json())


def test_a_neighbour_prior_whose_transfer_variance_overflows_carries_no_confidence():
    # Before: (prior_transfer_sd * mean) ** 2 raised OverflowError when a new context was seeded.
    planner = make_planner("nightjar", 4, prior_transfer_sd=1e300, elimination_min_samples=2)
    for _ in range(40):
        gamma = planner.select(1)
        planner.observe(gamma, 1, gamma + 1, 0.01)
    assert 0 <= planner.select(64) <= 4  # a new context, seeded from batch 1's
    state = planner.contexts[planner.context_of(64)]
    assert all(v is None for v in state.prior_variance)  # as with prior_transfer_sd=inf
    assert any(r is not None for r in state.prior_reward)  # the means still carry over


def test_an_empty_spec_argument_is_an_error():
    """``static:`` acted as plain ``static`` without a word."""
    with pytest.raises(ValueError, match=re.escape("planner spec 'static:' has an empty argument after ':'")):
        make_planner("static:", 4)


def test_numbers_of_any_kind_and_a_none_seed_are_accepted():
    """observe() took any number float() reads before its checks (a numpy 0-d array, a jax scalar, a Decimal),
    and NightjarOptions(seed=None) a fresh random seed: both stay so."""
    from decimal import Decimal

    planner = make_planner("nightjar", 2, seed=None)
    for seconds in (np.array(0.01), np.float32(0.02), Decimal("0.03")):
        planner.observe(gamma=1, batch_size=2, num_tokens=3, seconds=seconds, switch_seconds=np.array(0.0))
    assert planner.num_observations == 3 and planner.select(2) in (0, 1, 2)


def test_load_state_dict_refuses_a_state_that_means_something_else_here():
    """Only the kind and gamma_max were checked: a nightjar state filed its statistics under context ids of other
    batch sizes, static:3 loaded a static:2 state, last_gamma 9 entered a gamma_max=4 planner, and a 2-arm
    banditspec state failed later inside select."""
    source = make_planner("nightjar", 4)
    for b in (1, 2, 3, 5, 9, 300):
        source.observe(source.select(b), b, b, 0.01)
    coarse = make_planner("nightjar", 4, bucket_edges=(1, 64))
    before = coarse.to_json()
    mismatch = r"bucket_edges=\(1, 2, 3, .*this planner \('nightjar'\) has bucket_edges=\(1, 64\)"
    with pytest.raises(ValueError, match=mismatch):
        coarse.load_state_dict(source.state_dict())
    assert coarse.to_json() == before  # refused states change nothing
    make_planner("nightjar", 4, explore_scale=0.9).load_state_dict(source.state_dict())  # tuning options may differ

    with pytest.raises(ValueError, match="with gamma=2; this planner .* has gamma=3"):
        make_planner("static:3", 4).load_state_dict(make_planner("static:2", 4).state_dict())
    make_planner("static:4", 4).load_state_dict(make_planner("static", 4).state_dict())  # one planner, two names
    with pytest.raises(ValueError, match="table="):
        make_planner("table", 4).load_state_dict(make_planner("table", 4, table=((8, 1),)).state_dict())

    state = source.state_dict()
    state["counters"]["last_gamma"] = 9
    target = make_planner("nightjar", 4)
    with pytest.raises(ValueError, match=re.escape("last_gamma must be in 0..4, got 9")):
        target.load_state_dict(state)
    assert target.contexts == {} and target.last_gamma is None

    state = make_planner("banditspec", 4).state_dict()
    state["learned"]["counts"] = [1, 2]
    with pytest.raises(ValueError, match=re.escape("learned counts has 2 entries, expected 5")):
        make_planner("banditspec", 4).load_state_dict(state)
    state = source.state_dict()
    state["learned"]["contexts"]["99"] = state["learned"]["contexts"]["0"]
    with pytest.raises(ValueError, match="context 99 is outside 0..17"):
        make_planner("nightjar", 4).load_state_dict(state)


def _trained(spec: str):
    planner = make_planner(spec, 3)
    for i in range(60):
        b = 1 + i % 5
        planner.observe(planner.select(b), b, 2 * b, 0.01 + 0.001 * (i % 3))
    return planner


@pytest.mark.parametrize("spec, corrupt, message", [
    # taken, then failed inside a later decision ("math domain error", "cannot convert float NaN to integer")
    ("banditspec", lambda s: s["learned"]["counts"].__setitem__(3, -5), "learned counts must hold whole numbers >= 0"),
    # coerced: a string count int("7"), a fraction int(2.9) = 2, a number-string sum; a fit's acceptance rate over 1
    # (its expected tokens grew without bound) or a string (QA, 2026-12-06)
    ("banditspec", lambda s: s["learned"]["counts"].__setitem__(0, "7"),
     r"learned counts must hold whole numbers >= 0 \(counts\), one per arm, got \['7', "),
    ("banditspec", lambda s: s["learned"]["counts"].__setitem__(0, 2.9), "learned counts must hold whole numbers"),
    ("banditspec", lambda s: s["learned"].__setitem__("reward_sums", "abcd"),
     "learned reward_sums must be a list, one entry per arm 0..3, got 'abcd'"),
    ("dsd", lambda s: s["learned"]["steps_per_gamma"].__setitem__(1, 2.5), "learned steps_per_gamma must hold whole"),
    ("dsd", lambda s: s["learned"]["tokens_per_seq_sum"].__setitem__(1, "4"),
     "learned tokens_per_seq_sum must hold finite numbers >= 0, one per arm"),
    ("dsd", lambda s: s["learned"].__setitem__("fit", {"alpha": 1.5, "coefficients": None, "fitted_at": 3}),
     r"fit alpha must be null or a number in \[0, 1\] \(an acceptance rate\), got 1.5"),
    ("dsd", lambda s: s["learned"].__setitem__("fit", {"alpha": "0.7", "coefficients": None, "fitted_at": 3}),
     "fit alpha must be null or a number in"),
    ("dsd", lambda s: s["learned"].__setitem__("fit", {"alpha": 0.5, "coefficients": None, "fitted_at": "3"}),
     "fit fitted_at must be an int >= -1"),
    ("banditspec", lambda s: s["learned"]["reward_sums"].__setitem__(0, float("nan")),
     "learned reward_sums must hold finite numbers"),
    ("dsd", lambda s: s["learned"]["gram"][0].__setitem__(0, None), "gram and moment must hold finite numbers"),
    ("nightjar", lambda s: next(iter(s["learned"]["contexts"].values()))["reward_sum"].__setitem__(1, float("inf")),
     "learned reward_sum must hold finite numbers"),
    # a KeyError, a TypeError, an OverflowError
    ("banditspec", lambda s: s.pop("counters"), r"malformed planner state \(KeyError: no 'counters'\)"),
    ("dsd", lambda s: s.__setitem__("counters", "x"), r"malformed planner state \(TypeError"),
    ("nightjar", lambda s: s["learned"].pop("rng"), r"malformed planner state \(KeyError: no 'rng'\)"),
    # a context's scalars: taken, then an IndexError (arm 7), a RuntimeError (arm -1) or a TypeError (arm 2.5) in
    # the next select, or a planner that silently misbehaved (QA, 2026-12-06)
    *[("nightjar", lambda s, f=field, v=value: next(iter(s["learned"]["contexts"].values())).__setitem__(f, v),
       f"has {field}={value!r}; allowed: {allowed}")
      for field, value, allowed in [
          ("arm", 7, "None or an arm, an int in 0..3"), ("arm", -1, "None or an arm"), ("arm", 2.5, "None or an arm"),
          ("pending_probe", 99, "None or an arm"), ("probe_arm", True, "None or an arm"),
          ("block", 0, "an int in 1..64"), ("bin_length", -1, "an int >= 0"), ("probe_remaining", 1.5, "an int >= 0"),
          ("exploring", "yes", "true or false"), ("probe_credit", float("inf"), "a finite number"),
          ("switch_seconds", -1.0, "None or a finite number >= 0"),
          # taken, then an OverflowError (block 5000), an IndexError or a TypeError in the next select (QA, 2026-12-06)
          ("block", 5000, "an int in 1..64")]],
    ("nightjar", lambda s: next(iter(s["learned"]["contexts"].values())).__setitem__("reward_moments", [[1.0]] * 4),
     r"reward_moments=\[\[1.0\], .*allowed: a \[sum of rewards, sum of their squares\] pair of finite numbers >= 0"),
    ("nightjar", lambda s: next(iter(s["learned"]["contexts"].values())).__setitem__("reward_moments", [1.0] * 4),
     "allowed: a \\[sum of rewards"),
    # entries of the wrong kind: taken, then a TypeError in the next select or observe (QA, 2026-12-07)
    *[("nightjar", lambda s, f=field, v=value: next(iter(s["learned"]["contexts"].values()))[f].__setitem__(0, v),
       f"has {field}=.*; allowed: {allowed}" if field != "prior_reward" else allowed)
      for field, value, allowed in [
          ("weight", None, "a finite number >= 0"), ("weight", [1.0], "a finite number >= 0"),
          ("reward_sum", None, "a finite number"), ("seconds_sum", [1.0], "a finite number"),
          ("count", 2.5, "an int >= 0"), ("decisions", None, "an int >= 0"), ("decisions", [1], "an int >= 0"),
          ("reward_moments", [None, None], r"a \[sum of rewards"), ("reward_moments", [[1], [1]], r"a \[sum"),
          ("prior_variance", [1.0], r"None \(no prior\) or a finite number >= 0"),
          ("prior_reward", 5.0, "has prior_seconds=.*; allowed: a number wherever prior_reward has one")]],
    ("nightjar", lambda s: next(iter(s["learned"]["contexts"].values())).__setitem__("weight", "abcd"),
     "has weight='abcd'; allowed: a list, one entry per arm 0..3"),
])
def test_a_corrupt_learned_state_is_refused_whole(spec, corrupt, message):
    """A state whose learned values are out of their domain, or whose keys or types are wrong, is a ValueError at
    load, and the planner is left as it was."""
    state = json.loads(_trained(spec).to_json())
    corrupt(state)
    target = make_planner(spec, 3)
    before = target.to_json()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert target.to_json() == before


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: s.pop("spec"), r"malformed planner state \(KeyError: no 'spec'\)"),
    (lambda s: s.pop("options"), r"malformed planner state \(KeyError: no 'options'\)"),
    (lambda s: s.__setitem__("options", None), r"malformed planner state \(TypeError"),
    (lambda s: s.clear(), "not a planner state"),
])
def test_from_json_refuses_a_malformed_state_with_a_value_error(corrupt, message):
    """Planner.from_json read the spec and options before load_state_dict's checks: a KeyError or TypeError."""
    state = json.loads(make_planner("nightjar", 3).to_json())
    corrupt(state)
    with pytest.raises(ValueError, match=message):
        Planner.from_json(json.dumps(state))
    with pytest.raises(ValueError, match="not a planner state \\(format 'list'"):
        Planner.from_json("[]")


def test_gamma_max_may_be_a_numpy_integer_but_not_a_bool_or_float():
    for spec in ("nightjar", "dsd", "static", "table", "banditspec", "ar"):
        planner = make_planner(spec, np.int64(4))
        assert planner.gamma_max == 4 and type(planner.gamma_max) is int
        json.loads(planner.to_json())
    for bad in (True, np.float64(4.0), np.int64(-1)):
        with pytest.raises(ValueError, match=r"gamma_max must be an int in 0\.\.1024"):
            make_planner("nightjar", bad)
    state = json.loads(make_planner("banditspec", 4).to_json())
    state["gamma_max"] = 10**9  # (per-arm lists of a billion entries were allocated as it loaded)
    with pytest.raises(ValueError, match=r"gamma_max must be an int in 0\.\.1024, got 1000000000"):
        Planner.from_json(json.dumps(state))


def test_load_names_a_file_that_is_not_a_planner_state(tmp_path):
    """A state file cut short (a crash mid-save), binary, empty, or a decision log: a ValueError naming the file, not
    a bare JSONDecodeError or UnicodeDecodeError."""
    planner = _trained("nightjar")
    path = tmp_path / "state.json"
    for content, message in [(planner.to_json()[:300].encode(), "not a planner state: invalid JSON"),
                             (b"", "not a planner state: invalid JSON"),
                             (b'{"a": 1}\n{"b": 2}\n', "not a planner state: invalid JSON .Extra data"),
                             (b"\xff\xfe\x00", "is not UTF-8 text")]:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"planner state '{re.escape(str(path))}'.*{message}"):
            Planner.load(path)
    planner.save(path)
    assert Planner.load(path).to_json() == planner.to_json()


@pytest.mark.parametrize("spec", ["static", "nightjar", "dsd"])
def test_draft_on_device_must_be_a_bool(spec):
    """The string 'False' is truthy: it turned speculation on."""
    planner = make_planner(spec, 4)
    for bad in ("False", 0, None):
        with pytest.raises(ValueError, match="draft_on_device must be a bool"):
            planner.select(3, draft_on_device=bad)
    assert planner.select(3, draft_on_device=np.bool_(False)) == 0 and planner.num_decisions == 1


def test_steps_that_are_all_switch_warn_once_then_rarely(caplog):
    """Nightjar warned on every such step."""
    from nightjar_jax.planner.nightjar import ALL_SWITCH_WARN_EVERY

    planner = make_planner("nightjar", 4)
    with caplog.at_level(logging.DEBUG, logger="nightjar_jax.planner.nightjar"):
        for _ in range(ALL_SWITCH_WARN_EVERY + 10):
            planner.observe(planner.select(3), 3, 3, 0.01, switch_seconds=0.01)
    records = [r for r in caplog.records if "no time outside the switch" in r.getMessage()]
    assert len(records) == ALL_SWITCH_WARN_EVERY + 10
    assert [i for i, r in enumerate(records) if r.levelno == logging.WARNING] == [0, ALL_SWITCH_WARN_EVERY]


def test_a_state_keys_its_contexts_by_plain_numbers():
    """'03' and '3' were one context (one dropped without a word); 'abc' a bare int() error."""
    import json

    from nightjar_jax.planner import Planner

    planner = make_planner("nightjar", 2)
    for batch in (1, 3, 1, 3):
        planner.observe(planner.select(batch), batch, batch, 0.01)
    state = json.loads(planner.to_json())
    contexts = state["learned"]["contexts"]
    for bad in ("03", "abc", "-1", "٣"):
        broken = json.loads(json.dumps(state))
        broken["learned"]["contexts"] = {**contexts, bad: next(iter(contexts.values()))}
        with pytest.raises(ValueError, match="keyed by context numbers written plainly"):
            Planner.from_json(json.dumps(broken))
    assert Planner.from_json(json.dumps(state)).to_json() == planner.to_json()
