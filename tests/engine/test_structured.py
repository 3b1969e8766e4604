"""Structured outputs (``SamplingParams.structured_outputs``): the constraint's validation without JAX, then
stories260K through the engine (a draft drafting for itself, so speculation is on for the unconstrained requests):
every constrained output satisfies its constraint, greedy and sampled, prefill and decode, through preemptions;
bad constraints are a clear error for that request only."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest

from nightjar_jax.engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")  # (the `structured` extra; the `test` extra installs it)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "name": {"type": "string", "maxLength": 12}},
    "required": ["ok", "n", "name"],
    "additionalProperties": False,
}


# ---- the constraint's validation (no JAX) ---------------------------------------------------------------------------
def test_exactly_one_valid_constraint():
    assert StructuredOutputs(regex="[a-z]+").kind == "regex"
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(InvalidRequestError, match="exactly one of json, json_object, regex, choice, grammar; got none"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="got json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="x")
    with pytest.raises(InvalidRequestError, match="choice=.* allowed a non-empty list of non-empty strings"):
        StructuredOutputs(choice=["a", ""])
    with pytest.raises(InvalidRequestError, match="unknown keys \\['pattern'\\]"):
        StructuredOutputs.from_dict({"pattern": "x"})
    # vLLM's other keys: disable_any_whitespace either way (compact JSON is any-whitespace JSON too), the two others
    # at null (each was "unknown keys")
    for flag in (True, False):  # (disable_fallback too: one backend, no fallback to turn off)
        assert StructuredOutputs.from_dict({"json_object": True, "disable_any_whitespace": flag}).json_object
        assert StructuredOutputs.from_dict({"json_object": True, "disable_fallback": flag}).json_object
    assert StructuredOutputs.from_dict({"regex": "a", "whitespace_pattern": None, "structural_tag": None}).regex
    for key, value in (("whitespace_pattern", "[ ]?"), ("structural_tag", "{}"), ("disable_any_whitespace", "yes"),
                       ("disable_fallback", "yes")):
        with pytest.raises(InvalidRequestError, match=f"structured_outputs.{key}"):
            StructuredOutputs.from_dict({"json_object": True, key: value})
    sp = SamplingParams(structured_outputs={"choice": ["yes", "no"]})  # (vLLM's object, as a dict)
    assert sp.structured_outputs == StructuredOutputs(choice=("yes", "no"))
    with pytest.raises(InvalidRequestError, match="structured_outputs=.* allowed None, a StructuredOutputs or a dict"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(min_tokens=3, structured_outputs={"regex": "[a-z]+"}).min_tokens == 3  # (vLLM's: both)


# ---- the engine (stories260K) ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from nightjar_jax import LLM

    # a pool that preempts when four long requests run together (test_preemption...)
    return LLM("stories260k", draft_model="stories260k", num_speculative_tokens=3, planner="static", page_size=4,
               max_model_len=256, max_num_seqs=4, num_pages=48)


def _generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
    return [o.outputs[0] for o in outs]


HOLD_CASES = [  # (a constraint, a check that its output holds)
    (StructuredOutputs(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
    (StructuredOutputs(regex=r"(red|blue) [0-9]{2}!"), lambda t: re.fullmatch(r"(red|blue) [0-9]{2}!", t)),
    (StructuredOutputs(json=SCHEMA), lambda t: set(json.loads(t)) == {"ok", "n", "name"}
     and isinstance(json.loads(t)["ok"], bool) and 0 <= json.loads(t)["n"] <= 99),
    (StructuredOutputs(grammar='root ::= "Lily is " ("happy" | "sad") "."'),
     lambda t: t in ("Lily is happy.", "Lily is sad.")),
    # characters past the BMP, as written (a choice's rule escaped them as UTF-16 surrogate pairs, which the grammar
    # read as two code points: invalid UTF-8 out; QA, 2026-12-06)
    (StructuredOutputs(choice=["\U0001F600", "x \U0001D54F \u4e2d"]),
     lambda t: t in ("\U0001F600", "x \U0001D54F \u4e2d")),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_kind_of_constraint_holds(llm, temperature):
    prompts = ["Once upon a time", "The little dog"]
    for spec, holds in HOLD_CASES:
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=48, structured_outputs=spec)
        for out in _generate(llm, prompts, params):
            assert out.finish_reason == "stop" and holds(out.text), (spec, out.text)
    # any JSON object: stories260K writes a story into its first key; it starts as an object does
    out = _generate(llm, prompts[:1], SamplingParams(temperature=temperature, max_tokens=16,
                                                     structured_outputs=StructuredOutputs(json_object=True)))[0]
    assert out.text.startswith('{"')


def test_constrained_and_plain_requests_share_batches(llm):
    """A chain step walks a constrained row's drafts through its constraint (the mask at each position, up to the
    first draft it refuses), so constrained requests speculate beside plain ones; every request gets the tokens it
    gets alone."""
    plain = SamplingParams(temperature=0, max_tokens=40)
    alone = [o.token_ids for o in _generate(llm, ["Once upon a time", "The little dog"], plain)]
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    spec = StructuredOutputs(regex=r"[a-z ]{20,30}\.")
    pattern = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs=spec)
    pattern_alone = _generate(llm, ["Lily saw a big"], pattern)[0].token_ids
    engine, log = llm.engine, llm.engine.stats.step_log
    engine.record_steps, start = True, len(log)
    try:
        outs = _generate(llm, ["Once upon a time", "Is it sunny?", "The little dog", "Lily saw a big"],
                         [plain, choice, plain, pattern])
    finally:
        engine.record_steps = False
    assert [outs[0].token_ids, outs[2].token_ids] == alone and outs[1].text in ("yes", "no")
    assert re.fullmatch(r"[a-z ]{20,30}\.", outs[3].text)
    assert outs[3].token_ids == pattern_alone  # (the same speculation decisions: a static γ)
    steps = [s for s in log[start:] if s["gamma"] == 3]
    assert steps and all(s["plain_rows"] is None for s in steps)  # (every row may accept drafts)
    assert sum(s["accepted"][3] for s in steps if len(s["accepted"]) == 4) > 0


GREEDY_CASES = [StructuredOutputs(choice=["yes", "no", "maybe not"]), StructuredOutputs(regex=r"[a-z ,]{30,60}\."),
                StructuredOutputs(json=SCHEMA), StructuredOutputs(grammar='root ::= "Lily is " ("happy" | "sad") "."')]


@pytest.fixture(scope="module")
def plain_llm():
    from nightjar_jax import LLM

    return LLM("stories260k", draft_model="none", page_size=4, max_model_len=256, max_num_seqs=4)


def test_greedy_constrained_speculation_equals_plain_decoding(llm, plain_llm):
    """Greedy constrained requests give the tokens of plain decoding, every kind, four at once; their chain steps
    accepted drafts (the mask at each position is the constraint's after the drafts before it: a mask of the next
    position alone at every position would refuse most of them, or let banned tokens through)."""
    prompts = ["Once upon a time", "The little dog", "Lily saw a big", "Tom and his mom"]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec) for spec in GREEDY_CASES]
    want = [o.token_ids for o in _generate(plain_llm, prompts, params)]
    stats = llm.engine.stats
    accepted = stats.num_accepted_tokens
    assert [o.token_ids for o in _generate(llm, prompts, params)] == want
    assert stats.num_accepted_tokens - accepted > 10


def test_tree_steps_walk_a_constrained_rows_branches(plain_llm):
    """With token trees configured (a copy branch too: n-gram lookup on) constrained rows speculate in tree steps,
    beside a plain request: greedy tokens equal plain decoding's, every kind, sampled outputs hold, and the
    constrained rows accept drafts there (each node's mask is the constraint's after its branch: the mask of the
    next position alone would refuse most of them, or let banned tokens through)."""
    from nightjar_jax import LLM

    tree = LLM("stories260k", draft_model="stories260k", num_speculative_tokens=3, spec_tree_nodes=6,
               planner="static", page_size=4, max_model_len=256, max_num_seqs=4)
    prompts = ["Once upon a time", "The little dog", "Lily saw a big", "Tom and his mom"]
    for cases in (GREEDY_CASES[1:], GREEDY_CASES[:1]):  # (the choice ends in one step: apart)
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec) for spec in cases]
        params.append(SamplingParams(temperature=0, max_tokens=40))
        want = [o.token_ids for o in _generate(plain_llm, prompts[: len(params)], params)]
        tree.engine.record_steps = True
        tree.engine.stats.step_log.clear()
        assert [o.token_ids for o in _generate(tree, prompts[: len(params)], params)] == want
        # the steps with every row (each row's index its request's); before, the constrained rows accepted 0 there
        steps = [s for s in tree.engine.stats.step_log if s["tree_nodes"] and len(s["accepted"]) == len(params)]
        assert steps and not any(s.get("plain_rows") for s in steps)
        if len(cases) > 1:
            assert sum(sum(s["accepted"][:-1]) for s in steps) >= 2 * len(steps)  # (chains: about the same)
    # sampled: every kind holds, its rows in tree steps beside each other and a sampled plain request
    kinds = HOLD_CASES[:4]  # (one of each kind, a prompt each)
    params = [SamplingParams(temperature=1.0, seed=5, max_tokens=48, structured_outputs=spec) for spec, _ in kinds]
    outs = _generate(tree, [*prompts, "Once upon a time"], [*params, SamplingParams(temperature=1.0, max_tokens=32)])
    for (spec, holds), out in zip(kinds, outs[:-1], strict=True):
        assert out.finish_reason == "stop" and holds(out.text), (spec, out.text)


def test_preemption_keeps_the_constraint(llm):
    """Four long constrained requests in a pool that holds three: preempted ones recompute and go on under their
    constraint from where they were (their matchers keep their state); the tokens are those of each run alone."""
    spec = StructuredOutputs(regex=r"[a-z ]{150,200}\.")
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs=spec)
    prompts = ["Once upon a time", "The little dog", "Lily saw a big", "Tom and his mom"]
    alone = [_generate(llm, [p], params)[0] for p in prompts]
    before = llm.engine.stats.num_preemptions
    together = _generate(llm, prompts, params)
    assert llm.engine.stats.num_preemptions > before
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(re.fullmatch(r"[a-z ]{150,200}\.", o.text) for o in together)


def test_ignore_eos_still_ends_a_complete_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    out = _generate(llm, ["Is it sunny?"], params)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_allowed_token_ids_and_min_tokens_beside_a_constraint(llm, plain_llm):
    """As vLLM applies them with a structured output: a token must pass the constraint and ``allowed_token_ids``, and
    ``min_tokens`` bans the stop tokens until it is met, speculating or not (greedy: the tokens of plain decoding).
    Where together they leave nothing, at the start it is the request's error naming the field, later the request
    ends with finish reason "error" naming it (a choice complete before min_tokens allows only EOS). Both were
    refused with any structured output."""
    yes, no = ([int(t) for t in _generate(llm, ["Hi"], SamplingParams(temperature=0, max_tokens=8,
                structured_outputs=StructuredOutputs(choice=[word])))[0].token_ids if t not in llm.engine._eos_ids]
               for word in ("yes", "no"))  # (the tokens that spell each as an output)
    choice = StructuredOutputs(choice=["yes", "no"])
    digits = StructuredOutputs(regex="[0-9]+")
    pick = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice,
                          allowed_token_ids=no + sorted(llm.engine._eos_ids))  # (the end too: a complete choice's)
    longer = SamplingParams(temperature=0, max_tokens=12, structured_outputs=digits, min_tokens=6)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=digits, min_tokens=6)
    for engine_llm in (llm, plain_llm):
        outs = _generate(engine_llm, ["Is it sunny?", "Once upon a time", "The little dog"], [pick, longer, sampled])
        assert outs[0].text == "no" and outs[0].finish_reason == "stop"
        assert all(len(o.token_ids) >= 6 and re.fullmatch("[0-9]+", o.text) for o in outs[1:]), outs
    assert [o.token_ids for o in _generate(llm, ["Once upon a time"], longer)] == [
        o.token_ids for o in _generate(plain_llm, ["Once upon a time"], longer)]
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="allowed_token_ids .* hold no token the structured output can start "
                                                  "with") as err:
        engine.add_request("Hi", SamplingParams(max_tokens=4, structured_outputs=choice, allowed_token_ids=[5, 6]))
    assert err.value.field == "allowed_token_ids"
    with pytest.raises(InvalidRequestError, match="min_tokens=1 bans the stop tokens") as err:
        engine.add_request("Hi", SamplingParams(max_tokens=4, structured_outputs=choice, min_tokens=1,
                                                allowed_token_ids=yes[:1], stop_token_ids=yes[:1]))
    assert err.value.field == "min_tokens"
    for params, field in [  # (a choice complete, min_tokens not met; a space no allowed token starts)
        (SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice, min_tokens=max(len(yes), len(no)) + 2),
         "min_tokens"),
        (SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["yes yes"]),
                        allowed_token_ids=yes), "allowed_token_ids"),
    ]:
        (out,) = llm.generate(["Is it sunny?"], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "error" and out.error_field == field, (field, out)
        assert out.outputs[0].text in ("yes", "no"), out  # (the output before the dead end kept)
    # under min_tokens a row with nothing left may draw a stop id (greedy: token 0, here one): the field blamed is
    # still the one that left nothing, allowed_token_ids (it read min_tokens)
    (out,) = llm.generate(["Is it sunny?"], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["yes yes"]), min_tokens=5,
        allowed_token_ids=[*yes, 0], stop_token_ids=[0]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and out.error_field == "allowed_token_ids", out
    assert not engine.has_unfinished_requests() and engine.num_free_pages == engine.num_total_pages


@pytest.mark.parametrize("spec, message", [
    ({"regex": "(unclosed"}, "the regex constraint does not compile"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "the json constraint does not compile"),
    ({"json": "{not json"}, "the json constraint does not compile"),
    ({"grammar": "root ::= missing_rule"}, "the grammar constraint does not compile"),
    # vLLM converts Lark grammars; this backend does not, and said only "Unexpected character: ':'"
    ({"grammar": 'start: "a"'}, r"Unexpected character.*a Lark grammar \(`start: ...`\) is not converted"),
    # what xgrammar would compile as if it were absent (an output breaking it ended with "stop"): refused whole
    ({"json": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}},
     r"the JSON schema asks for 'uniqueItems' at #, which the grammar backend \(xgrammar\) cannot enforce"),
    ({"json": json.dumps({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$",
                                                                  "maxLength": 3}}})},
     r"'minLength' / 'maxLength' beside 'pattern' at #/properties/s"),
    # a schema nested 1,000 levels deep compiled for over a minute (QA, 2026-12-07)
    ({"json": functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(1000), {"type": "integer"})},
     r"the JSON schema nests more than 128 levels deep \(objects and lists inside one another\): allowed up to 128"),
])
def test_a_bad_constraint_is_that_requests_error_only(llm, spec, message):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=message) as err:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert err.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests() and engine.num_free_pages == engine.num_total_pages
    assert _generate(llm, ["Once upon a time"], SamplingParams(temperature=0, max_tokens=4))[0].text


def test_a_deep_schema_is_refused_by_name_under_a_low_recursion_limit(llm):
    """add_request's copy of the params deep-copied the schema and overflowed the recursion limit before the
    backend's depth check (a RecursionError in CI, whose limit left less room than here): the constraint is shared,
    not copied, and the check names it."""
    import sys

    deep = functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(1000), {"type": "integer"})
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)
    try:
        with pytest.raises(InvalidRequestError, match="nests more than 128 levels deep"):
            llm.engine.add_request("Once upon a time", SamplingParams(max_tokens=4, structured_outputs={"json": deep}))
    finally:
        sys.setrecursionlimit(limit)
    assert not llm.engine.has_unfinished_requests()


def test_sampled_constrained_speculation_is_distributed_as_plain_decoding():
    """A sampled constrained request under chain speculation, with a draft that differs from the target: its second
    token (after a forced " was": " a", " very" or " ") is distributed as plain decoding's (chi-square over 3000
    seeds). A helper's version of this test, run before the draft proposed its first token under the mask, caught
    a bias from a limit on the row's drafts that depended on them (p = 4e-10); with that mask the draft is not
    refused at this position, so ``test_the_walk_bans_a_refused_draft_and_limits_nothing`` and test_rejection's
    ``test_a_constraint_that_refuses_drafts_is_lossless_through_its_mask_alone`` pin that fix."""
    from scipy.stats import chi2_contingency

    from nightjar_jax import LLM

    opts = dict(planner="static", page_size=4, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    plain = LLM("stories260k", draft_model="none", **opts)
    spec = LLM("stories260k", draft_model="stories260k@layers=2", num_speculative_tokens=3, prompt_lookup_max=0,
               **opts)
    tok = plain.engine.tokenizer
    was, a, very = 286, 261, 399
    constraint = StructuredOutputs(regex=" was(" + "|".join(re.escape(tok.token_text(t)) for t in (a, very)) + ")")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=2, structured_outputs=constraint)
              for s in range(3000)]
    counts = []
    for llm in (plain, spec):
        outs = _generate(llm, ["The little dog"] * len(params), params)
        second = [o.token_ids[1] for o in outs if o.token_ids[0] == was and len(o.token_ids) > 1]
        assert len(second) > 2500
        counts.append([second.count(t) for t in sorted(set(second))])
    assert len(counts[0]) == len(counts[1]) >= 3
    assert spec.engine.stats.num_drafted_tokens > spec.engine.stats.num_accepted_tokens > 0
    assert chi2_contingency(np.array(counts))[1] > 1e-3


def test_the_walk_bans_a_refused_draft_and_limits_nothing(llm):
    """``RequestGrammar.walk``: a mask per position up to the first draft the constraint refuses (banned there), the
    matcher rolled back after. ``ModelRunner._walk_constraints`` gives the row no limit on its accepted drafts: the
    verify rejects the refused draft through its mask, into the residual (``test_rejection``'s
    ``test_a_constraint_that_refuses_drafts_is_lossless_through_its_mask_alone`` shows why a limit there biases)."""
    from nightjar_jax.engine.request import Request
    from nightjar_jax.engine.sampler import NO_ACCEPT_LIMIT

    spec = StructuredOutputs(choice=["yes", "no"])
    probe = llm.engine.grammar_backend().matcher(spec)
    first = probe.allowed()
    ok = int(np.flatnonzero(first)[0])
    assert probe.accept(ok)
    second = probe.allowed()
    refused = int(np.flatnonzero(~second)[0])
    request = Request("walk", [1, 2, 3], SamplingParams(structured_outputs=spec), 0,
                      grammar=llm.engine.grammar_backend().matcher(spec))
    masks = request.grammar.walk([ok, refused, ok])
    assert masks.shape == (4, len(first)) and (masks[0] == first).all() and (masks[1] == second).all()
    assert not masks[1, refused] and masks[2:].all()  # (after the refused draft: unreached, every token)
    assert (request.grammar.allowed() == first).all()  # (rolled back)
    runner = llm.engine.runner
    st = runner._sampling_tensors([request], 2, grammar_masks=False)
    assert list(st.max_accept) == [NO_ACCEPT_LIMIT] * 2
    first_masks = np.ones((2, 1, len(first)), bool)
    first_masks[0, 0] = first
    walked = runner._walk_constraints([request], np.array([[ok, refused, ok], [0, 0, 0]], np.int32), st, None,
                                      first_masks)
    assert list(walked.max_accept) == [NO_ACCEPT_LIMIT] * 2
    assert (walked.allowed[0] == masks).all() and walked.allowed[1].all()


def test_the_walk_follows_each_branch_of_a_tree(llm):
    """``RequestGrammar.walk`` over a token tree: node i's mask is the constraint's after its branch (root .. i); a
    node the constraint refuses is banned in its parent's mask, and it and its descendants allow every token
    (unreached); the matcher is rolled back. A chain's walk is the same over its one branch."""
    from nightjar_jax.spec.tree import make_tree

    spec = StructuredOutputs(regex=r"[a-z]{2,5} [a-z]+\.")
    backend = llm.engine.grammar_backend()

    def after(tokens):  # the constraint's mask after ``tokens``, from a fresh matcher
        grammar = backend.matcher(spec)
        assert all(grammar.accept(t) for t in tokens)
        return grammar.allowed()

    root = after([])
    t1, t1b = (int(t) for t in np.flatnonzero(root)[:2])
    refused = int(np.flatnonzero(~root)[0])
    t2, r2 = int(np.flatnonzero(after([t1]))[0]), int(np.flatnonzero(~after([t1]))[0])
    # node 1 = t1, 2 = refused, 3 = t1b; under 1: 4 = t2, 5 = r2 (refused there); under the refused 2: 6
    tree = make_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    grammar = backend.matcher(spec)
    masks = grammar.walk([t1, refused, t1b, t2, r2, t1], None, tree.children)
    assert masks.shape == (7, len(root)) and (grammar.allowed() == root).all()  # (rolled back)
    assert (masks[0] == root).all() and not masks[0, refused]
    assert (masks[1] == after([t1])).all() and not masks[1, r2]
    assert (masks[3] == after([t1b])).all() and (masks[4] == after([t1, t2])).all()
    assert masks[2].all() and masks[5].all() and masks[6].all()  # (refused, or under a refused node: unreached)
    chain = grammar.walk([t1, t2, refused])  # a chain: one branch
    assert (chain[:3] == np.stack([root, after([t1]), after([t1, t2])])).all()


# ---- bad_words (vLLM's): the same per-position walk, with BadWords as the constraint ---------------------------------
def _holds_no(sequences, token_ids):
    return not any(token_ids[i:i + len(s)] == s for s in sequences for i in range(len(token_ids)))


def test_bad_words_are_never_written_and_speculation_stays_lossless(llm, plain_llm):
    """Words the greedy output held are banned: neither the chain-speculating engine (its draft is the target, so
    it proposes the banned tokens and the walk's masks must refuse them) nor plain decoding writes them, and their
    greedy tokens are the same; sampled rows hold too."""
    from nightjar_jax.engine.structured import bad_word_sequences

    prompts = ["Once upon a time", "The little dog"]
    base = _generate(plain_llm, prompts, SamplingParams(temperature=0, max_tokens=40))
    words = [base[0].text.split()[2], base[1].text.split()[3].strip(".,"), "play with"]
    sequences = bad_word_sequences(plain_llm.engine.tokenizer, words)
    assert any(len(s) > 1 for s in sequences) and not all(_holds_no(sequences, o.token_ids) for o in base)
    params = SamplingParams(temperature=0, max_tokens=40, bad_words=words)
    plain = _generate(plain_llm, prompts, params)
    accepted = llm.engine.stats.num_accepted_tokens
    assert [o.token_ids for o in _generate(llm, prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.stats.num_accepted_tokens - accepted > 10
    assert all(_holds_no(sequences, o.token_ids) for o in plain)
    assert [o.token_ids for o in plain] != [o.token_ids for o in base]
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, bad_words=words) for s in range(6)]
    assert all(_holds_no(sequences, o.token_ids) for o in _generate(llm, prompts * 3, sampled))


def test_bad_words_beside_a_structured_output(llm, plain_llm):
    """Both at once: the output matches the constraint and holds none of the words, with the tokens of plain
    decoding."""
    from nightjar_jax.engine.structured import bad_word_sequences

    spec = StructuredOutputs(regex=r"[a-z ]{20,40}\.")
    base = _generate(plain_llm, ["Once upon a time"], SamplingParams(temperature=0, max_tokens=48,
                                                                     structured_outputs=spec))[0]
    words = base.text.split()[1:3]
    sequences = bad_word_sequences(plain_llm.engine.tokenizer, words)
    assert not _holds_no(sequences, base.token_ids)
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec, bad_words=words)
    both = _generate(plain_llm, ["Once upon a time"], params)[0]
    assert re.fullmatch(r"[a-z ]{20,40}\.", both.text) and _holds_no(sequences, both.token_ids)
    assert _generate(llm, ["Once upon a time"], params)[0].token_ids == both.token_ids
    # words that ban every token allowed_token_ids leaves: an error (the step drew token 0, outside both)
    only = [seq[0] for seq in bad_word_sequences(plain_llm.engine.tokenizer, ["upon"]) if len(seq) == 1]
    assert only
    with pytest.raises(InvalidRequestError, match="bad_words ban every token the output could start with") as err:
        plain_llm.engine.add_request("Once", SamplingParams(allowed_token_ids=only, bad_words=["upon"]))
    assert err.value.field == "bad_words" and not plain_llm.engine.has_unfinished_requests()
    # ... and where that happens later, after " a": the request ends with an error naming bad_words, holding no
    # token outside allowed_token_ids (the step's row drew from nothing: token 0 greedy, any token sampled)
    tok = plain_llm.engine.tokenizer
    a, the = tok.encode(" a", add_special_tokens=False)[-1], tok.encode(" the", add_special_tokens=False)[-1]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=10, allowed_token_ids=[a, the],
                                bad_words=["a a", "a the"])
        out = plain_llm.generate(["Once upon a time"], params)[0]
        assert out.outputs[0].finish_reason == "error" and "bad_words leave no allowed token" in out.error
        assert set(out.outputs[0].token_ids) <= {a, the} and out.outputs[0].token_ids[-1] == a
    assert plain_llm.engine.num_free_pages == plain_llm.engine.num_total_pages


def test_a_dead_end_of_both_constraints_is_blamed_on_bad_words():
    """A structured output that allows only what bad_words ban: the dead end is bad_words' (it named the structured
    output, which is fine alone). A token the structured output refuses while others remain is still its own."""
    from nightjar_jax.engine.structured import BothConstraints, TokenConstraint

    class Only(TokenConstraint):
        def __init__(self, ids, field):
            self.ids, self.field, self.vocab_size = set(ids), field, 4

        def allowed(self):
            return np.isin(np.arange(4), sorted(self.ids))

        def accept(self, token):
            return token in self.ids

        def rollback(self, n):
            pass

    both = BothConstraints(Only([1], "structured_outputs"), Only([2, 3], "bad_words"))
    assert not both.allowed().any() and not both.accept(0) and both.field == "bad_words"
    both = BothConstraints(Only([1, 2], "structured_outputs"), Only([2, 3], "bad_words"))
    assert both.allowed().tolist() == [False, False, True, False]
    assert not both.accept(3) and both.field == "structured_outputs"
    assert not both.accept(1) and both.field == "bad_words"


def test_bad_words_walk_and_values():
    """``BadWords`` alone: a one-token word banned everywhere, a longer one's last token after the rest of it, the
    walk's masks after each draft (a tree's branches too), rolled back; bad values are clear errors."""
    from nightjar_jax.engine.structured import BadWords
    from nightjar_jax.spec.tree import make_tree

    bad = BadWords([[5], [7, 8, 9], [3, 4]], vocab_size=12)
    assert not bad.allowed()[5] and bad.allowed().sum() == 11
    assert bad.accept(7) and bad.accept(8) and not bad.allowed()[9] and not bad.accept(9)
    bad.rollback(2)
    masks = bad.walk([3, 4, 1])  # a chain: 4 is refused after 3, so its row is unreached
    assert not masks[0, 5] and not masks[1, 4] and masks[2].all() and masks[3].all()
    assert bad.allowed()[4] and bad.accept(1)  # (rolled back)
    tree = make_tree([(0,), (1,), (0, 0), (1, 0)])  # node 1 = 7, 2 = 3; under 1: 3 = 8; under 2: 4 = 4 (refused)
    masks = bad.walk([7, 3, 8, 4], None, tree.children)
    assert not masks[3, 9] and masks[3].sum() == 10 and not masks[2, 4] and masks[4].all()
    assert SamplingParams(bad_words="word").bad_words == ["word"]
    for value in ([""], ["  "], [3], [None], ["w"] * 1025):
        with pytest.raises(InvalidRequestError, match="bad_words=.* allowed None or a list of at most 1024 strings"):
            SamplingParams(bad_words=value)
    from nightjar_jax.config import make_engine_config
    from nightjar_jax.engine.engine import LLMEngine
    from nightjar_jax.testing import fake_model

    engine = LLMEngine(make_engine_config(model="fake", num_pages=8), target=fake_model(32))  # (no tokenizer)
    with pytest.raises(InvalidRequestError, match="bad_words needs the model's tokenizer") as err:
        engine.add_request([1, 2], SamplingParams(bad_words=["x"]))
    assert err.value.field == "bad_words" and not engine.has_unfinished_requests()


def test_the_grammar_cache_is_bounded(llm, monkeypatch):
    """Compiled grammars are cached up to NIGHTJAR_XGRAMMAR_CACHE_MB (default 512, as vLLM's): a server given a new
    schema per request grew ~14 KB per schema on stories260K's vocabulary, for as long as it ran. A bad value is the
    engine's start error."""
    from helpers import fake_engine

    from nightjar_jax.config import ConfigError
    from nightjar_jax.engine.structured import DEFAULT_CACHE_MB, GrammarBackend, grammar_cache_bytes

    assert grammar_cache_bytes() == DEFAULT_CACHE_MB << 20
    monkeypatch.setenv("NIGHTJAR_XGRAMMAR_CACHE_MB", "0.03")  # ~31 KB: a couple of schemas
    backend = GrammarBackend(llm.engine.tokenizer, llm.engine.target.config.vocab_size)
    sizes = []
    for i in range(12):
        backend.compile(StructuredOutputs(json={"type": "object", "properties": {f"field{i}": {"type": "string"}}}))
        sizes.append(backend.cache_bytes)
    assert 0 < max(sizes) <= int(0.03 * (1 << 20)), sizes
    monkeypatch.setenv("NIGHTJAR_XGRAMMAR_CACHE_MB", "1e300")  # (past int64: xgrammar refused it at the first use)
    assert grammar_cache_bytes() == 2**62
    for bad in ("0", "-1", "lots", "nan"):
        monkeypatch.setenv("NIGHTJAR_XGRAMMAR_CACHE_MB", bad)
        with pytest.raises(ConfigError, match="NIGHTJAR_XGRAMMAR_CACHE_MB=.* must be a positive number of megabytes"):
            fake_engine()


@pytest.mark.parametrize("schema, found", [
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "'contains' at #"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a"),
    ({"allOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
     "'allOf' of 2 schemas at # (one is enforced)"),
    ({"type": "object", "properties": {"k": {}}, "if": {"required": ["k"]}, "then": {"required": ["v"]}}, "'if' at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at #"),
    ({"$ref": "https://example.com/s.json"}, "'$ref' to 'https://example.com/s.json' at #"),
    ({"$defs": {"A": {"type": "object"}}, "$ref": "#/$defs/A", "required": ["b"]}, "'required' beside '$ref' at #"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' on a non-integer at #"),
    ({"type": "array", "items": [{"type": "string", "pattern": "^a+$", "minLength": 2}]},
     "'minLength' / 'maxLength' beside 'pattern' at #/items/0"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False},
     "'required' [\"b\"] at #, which 'properties' lacks"),
    # oneOf is compiled as anyOf: branches that may both match are refused ({"v": 10} matched both and came back
    # with "stop", QA 2026-12-07), branches that cannot both match are enforced as they are
    ({"type": "object", "properties": {"v": {"oneOf": [{"type": "integer", "minimum": 0},
                                                      {"type": "integer", "maximum": 10}]}}},
     "'oneOf' at #/properties/v whose branches 0 and 1 may both match (exactly one must: use 'anyOf'"),
    ({"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "integer"}]}, "'oneOf' at # whose branches 1 and 2"),
    ({"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]}, "'oneOf' at # whose branches 0 and 1"),  # (1 == 1.0)
    ({"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "object"}}}, "'oneOf' at #"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}},  # (k not required: {} matches both)
                {"type": "object", "properties": {"k": {"const": "b"}}}]}, "'oneOf' at #"),
    ({"oneOf": [{"type": "string"}, {"type": ["null", "integer"]}, {"enum": [True, 3]}]},
     "'oneOf' at # whose branches 1 and 2"),
    ({"oneOf": [{"type": "string"}, {"type": ["null", "integer"]}, {"type": "boolean"}, {"const": 2.5}]}, None),
    ({"oneOf": [{"const": "x"}, {"enum": ["y", 1]}]}, None),
    ({"oneOf": [{"const": 10**400}, {"const": "x"}]}, None),  # (an integer past a float's range: no OverflowError)
    ({"oneOf": [{"const": 10**400}, {"type": "integer"}]}, "'oneOf' at # whose branches 0 and 1"),
    # pydantic's discriminated union: $refs to objects that each require the tag with their own const
    ({"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
      "discriminator": {"propertyName": "pet", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}},
      "$defs": {"Cat": {"type": "object", "properties": {"pet": {"const": "cat", "type": "string"}, "lives": {
                    "type": "integer"}}, "required": ["pet", "lives"]},
                "Dog": {"type": "object", "properties": {"pet": {"enum": ["dog"], "type": "string"}},
                        "required": ["pet"]}}}, None),
    # (review, 2026-12-07) objects one of which allows only its own properties while the other requires another;
    # branches written as allOf of one $ref; OpenAPI's discriminator, which names the branch
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
                {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}, None),
    ({"oneOf": [{"allOf": [{"$ref": "#/$defs/A"}]}, {"allOf": [{"$ref": "#/$defs/B"}], "description": "b"}],
      "$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                "B": {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}}}, None),
    ({"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "discriminator": {"propertyName": "k"},
      "$defs": {"A": {"type": "object", "properties": {"k": {"type": "string"}}},
                "B": {"type": "object", "properties": {"k": {"type": "string"}}}}}, None),
    ({"oneOf": [{"type": "object", "properties": [1]}, {"type": "object", "properties": {"k": {}}}]}, "'oneOf' at #"),
    # enforced: none found (a property merely named like a keyword is no keyword)
    ({"type": "object", "properties": {"uniqueItems": {"type": "integer", "multipleOf": 5, "minimum": 0},
                                       "when": {"type": "string", "format": "date-time"},
                                       "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                       "ref": {"$ref": "#/$defs/R", "description": "d"}},
      "$defs": {"R": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]}},
      "required": ["when"], "additionalProperties": False}, None),
    ({"allOf": [{"type": "object"}]}, None),
    # what pydantic and OpenAPI generate (a format is an annotation; annotations beside a $ref)
    ({"type": "object", "properties": {"url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
                                       "blob": {"type": "string", "format": "binary"},
                                       "n": {"type": "integer", "format": "int64"},
                                       "k": {"type": ["integer", "null"], "multipleOf": 5},
                                       "old": {"$ref": "#/$defs/R", "deprecated": True, "readOnly": True}},
      "$defs": {"R": {"type": "string"}}}, None),
])
def test_unenforced_schema_features_are_found(schema, found):
    from nightjar_jax.engine.structured import unenforced_schema_feature

    got = unenforced_schema_feature(schema)
    assert got == found if found is None else got.startswith(found), got


def test_a_long_oneof_is_checked_in_one_pass(monkeypatch):
    """The "enum with descriptions" pattern, thousands of const branches, and discriminated objects are compared as
    one set (pairwise, 2000 branches took ~10 s per request, before the grammar cache); a long oneOf with neither is
    taken as vLLM takes it, past MAX_ONEOF_PAIRS (review, 2026-12-07)."""
    from nightjar_jax.engine import structured

    def pairwise(*args):
        raise AssertionError("compared pairwise")

    monkeypatch.setattr(structured, "_exclusive", pairwise)
    consts = [{"const": f"v{i}", "description": str(i)} for i in range(2000)]
    assert structured.unenforced_schema_feature({"oneOf": consts}) is None
    assert structured.unenforced_schema_feature({"oneOf": [*consts, {"enum": ["x", "v7"]}]}).startswith(
        "'oneOf' at # whose branches 7 and 2000")
    tagged = [{"type": "object", "properties": {"t": {"const": i}, "x": {}}, "required": ["t"]} for i in range(500)]
    assert structured.unenforced_schema_feature({"oneOf": tagged}) is None
    assert structured.unenforced_schema_feature({"oneOf": [{"type": "object"}] * 100}) is None  # (past the pairs)
