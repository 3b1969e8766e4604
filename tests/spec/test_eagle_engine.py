"""A feature draft (EAGLE) in the engine: the runner feeds it the target's hidden states (issue 8).

On the tiny stories260K model as target and a random one-layer feature draft: greedy speculative decoding equals
plain decoding, and every draft token the engine proposes equals the one the training forward of
``scripts/distill_eagle.py`` computes from the target's features at the same step (so the paged feature pool, the
first step over the not-yet-run tokens and the fed-back features in later steps are wired as trained). With the
draft packed as the shipped one is (bfloat16 panels), no compiled decode step runs an XLA dot. The same holds for a
draft with fused features (EAGLE-3: it also reads the target's residual stream after layers 1 and 3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nightjar_jax.config import make_engine_config
from nightjar_jax.engine.engine import LLMEngine
from nightjar_jax.engine.runner import ModelHandle
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.models.llama import HEAD_TOKEN_IDS, state_from_hf
from nightjar_jax.models.loader import load_checkpoint, load_model
from nightjar_jax.testing import load_script

TINY = "stories260k"
GAMMA = 3


FUSED_LAYERS = (1, 3)  # stories260K has 5 layers


def _setup(layers: tuple[int, ...] = ()):
    eagle = load_script("distill_eagle.py", "distill_eagle_e")
    tckpt = load_checkpoint(TINY)
    tcfg = tckpt.config
    tparams = {k: jnp.asarray(np.asarray(v, np.float32)) for k, v in tckpt.state_dict.items()}
    head_ids = np.arange(0, tcfg.vocab_size, 2, dtype=np.int32)  # a subset head: the even ids
    dcfg = eagle.eagle_config(tcfg, 96, len(head_ids), layers=layers)
    rng = np.random.default_rng(1)
    table = np.asarray(tckpt.state_dict["model.embed_tokens.weight"], np.float32)
    dparams = eagle.init_params(dcfg, 0, table[head_ids])
    if layers:  # a random mix of every layer (not the identity on the final state that training starts from)
        d = tcfg.hidden_size
        dparams["fuse.weight"] = (rng.standard_normal((d, (len(layers) + 1) * d)) / np.sqrt(d)).astype(np.float32)
    dparams = {k: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in dparams.items()}
    graphdef, state = state_from_hf(dcfg, dparams | {HEAD_TOKEN_IDS: head_ids}, source="test draft")
    draft = ModelHandle(dcfg, graphdef, state)
    _, tgraph, tstate = load_model(TINY)
    target = ModelHandle(tcfg, tgraph, tstate)
    return eagle, tcfg, tparams, dcfg, {k: jnp.asarray(v) for k, v in dparams.items()}, head_ids, target, draft


@pytest.fixture(scope="module")
def setup():
    return _setup()


@pytest.fixture(scope="module")
def fused_setup():
    """The same with fused features (EAGLE-3, ``ModelConfig.feature_layers``): the draft also reads the target's
    residual stream after layers 1 and 3, mixed by its ``fuse`` matrix."""
    return _setup(FUSED_LAYERS)


def _engine(target, draft, tree_nodes: int = 0, prompt_lookup_max: int = 0, **kwargs) -> LLMEngine:
    cfg = make_engine_config(model=TINY, page_size=4, num_pages=96, max_num_seqs=2, max_num_batched_tokens=16,
                             compilation_cache_dir=None, planner=f"static:{GAMMA}" if draft else "static",
                             num_speculative_tokens=GAMMA, max_model_len=96, spec_tree_nodes=tree_nodes,
                             prompt_lookup_max=prompt_lookup_max, **kwargs)
    return LLMEngine(cfg, target=target, draft=draft)


PROMPTS = [[1, 403, 261, 374, 302, 70, 45], [1, 70, 45, 321, 2, 9, 400, 33, 12, 101, 7, 8, 300, 5, 6, 99, 98]]


def _run(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id="r")
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = list(o.outputs[0].token_ids) if o.finished else out
    assert engine.num_free_pages == engine.num_total_pages  # nothing leaked
    return out


def _check_proposals(setup, engine: LLMEngine, ar_engine: LLMEngine) -> int:
    """Run PROMPTS through ``engine`` (greedy SD) and ``ar_engine``; outputs must be equal, and every draft token
    the engine's ``propose`` made must equal the training forward's at the same step. Returns tokens checked."""
    eagle, tcfg, tparams, dcfg, dparams, head_ids, target, draft = setup
    import distill_draft as dd  # on sys.path once distill_eagle is loaded

    assert engine.runner.feature_draft
    inner = engine.runner._propose
    calls: list[tuple[int, np.ndarray]] = []

    def capture(*args):
        out = inner(*args)
        calls.append((int(np.asarray(args[7])[0]), np.asarray(out[0])[0]))  # committed n, draft tokens [γ]
        return out

    engine.runner._propose = capture

    # the training forward, one depth, over the target's embedding of ``tokens``; slots up to the chain's start read
    # the target's (fused) features, later ones the draft's outputs, so the fusion is applied up front
    unfused = {k: v for k, v in dparams.items() if k != "fuse.weight"}

    @jax.jit
    def depth1(tokens, shifted):
        emb = tparams["model.embed_tokens.weight"][tokens][None]
        return eagle.ttt_forward(dcfg, unfused, emb, shifted, 1)[0][0]
    checked = 0
    for prompt in PROMPTS:
        calls.clear()
        sd = _run(engine, prompt)
        assert sd == _run(ar_engine, prompt)  # lossless
        seq = np.asarray(prompt + sd, np.int32)
        h = dd.causal_forward(tcfg, tparams, jnp.asarray(seq[None]), return_hidden=True,
                              hidden_layers=dcfg.feature_layers or ())
        h = np.asarray(eagle.fuse_features(dcfg, dparams, h))[0]  # [T, H] (as it is without fusion)
        length = len(seq) + GAMMA + 1
        for n, drafts in calls:
            c = n - 1  # the chain starts at the last committed token, with the target's feature of c - 1
            toks = list(seq[: c + 1])
            feat_in = np.zeros((c + GAMMA + 1, h.shape[1]), np.float32)  # slot p's feature input
            feat_in[1 : c + 1] = h[:c]
            for j in range(GAMMA):
                p = c + j
                # one padded length per prompt (one compile): the forward is causal, so slot p ignores the tail
                shifted = np.zeros((1, length, h.shape[1]), np.float32)  # ttt_forward shifts features by one
                shifted[0, :p] = feat_in[1 : p + 1]
                padded = np.zeros(length, np.int32)
                padded[: len(toks)] = toks
                out = depth1(jnp.asarray(padded), jnp.asarray(shifted))[p]
                want = int(head_ids[int(jnp.argmax(out @ dparams["lm_head.weight"].T))])
                assert int(drafts[j]) == want, f"n={n} depth {j + 1}: engine {drafts[j]}, training forward {want}"
                checked += 1
                toks.append(int(drafts[j]))
                feat_in[p + 1] = np.asarray(out)
    engine.runner._propose = inner
    return checked


def test_feature_draft_proposals_match_training_forward(setup) -> None:
    *_, target, draft = setup
    assert _check_proposals(setup, _engine(target, draft), _engine(target, None)) >= 20


def test_fused_feature_draft_proposals_match_training_forward(fused_setup) -> None:
    """The target's passes store its residual stream after the draft's ``feature_layers`` beside its final state
    (a pool 3x as wide); the draft mixes them (``Llama._fuse``) where it reads the target's features and reads its
    own outputs in later steps, as training's ``fuse_features`` and ``ttt_forward`` do."""
    *_, dcfg, _, _, target, draft = fused_setup
    engine = _engine(target, draft)
    assert engine.runner.features.shape[-1] == (len(FUSED_LAYERS) + 1) * dcfg.feature_size
    assert _check_proposals(fused_setup, engine, _engine(target, None)) >= 20
    with pytest.raises(ValueError, match=r"after layers \[1, 5\].* has 5 layers"):
        _engine(target, ModelHandle(dcfg.replace(feature_layers=(1, 5)), draft.graphdef, draft.state))


def test_feature_draft_after_steps_without_it_matches_training_forward(setup) -> None:
    """n-gram lookup (spec/lookup.py): a step where every row copies all γ drafts does not run the draft; the
    next step it runs catches up the tokens it skipped with the target's features. Lookups forced on every other
    decode step (copied tokens that the target mostly rejects): outputs stay AR's and every draft token the draft
    proposes afterwards is still the training forward's."""
    *_, target, draft = setup
    engine = _engine(target, draft, prompt_lookup_max=3)
    proposes = []
    runner, real_propose = engine.runner, engine.runner._propose
    step = {"n": 0}

    def forced(requests, gamma):
        step["n"] += 1
        return [[7] * gamma for _ in requests] if step["n"] % 2 else [[] for _ in requests]

    def counting(*args):
        proposes.append(1)
        return real_propose(*args)

    runner._lookup_drafts = forced
    runner._propose = counting
    assert _check_proposals(setup, engine, _engine(target, None)) >= 10
    assert 0 < len(proposes) < step["n"]  # the draft skipped the forced steps
    assert engine.stats.num_lookup_steps == sum(1 for x in range(1, step["n"] + 1) if x % 2)


def test_feature_draft_after_an_offload_and_reload_matches_training_forward(setup) -> None:
    """Elastic memory: the feature pool goes to host memory with the draft's weights and comes back with them, so
    after a reload the draft catches up from the target's true features and proposes what the training forward does
    (with the pool rebuilt as zeros, as before, its proposals after the reload differed)."""
    *_, target, draft = setup
    engine = _engine(target, draft, draft_offload="auto")
    real_step, steps = engine.step, {"n": 0}
    runner = engine.runner

    def moving_step():
        steps["n"] += 1
        if steps["n"] % 4 == 3:  # between steps, mid-request: away and back (no step ran without the draft)
            engine._offload_draft()
            assert runner.features is None and runner.device_bytes()["draft_pools"] == 0
            engine._reload_draft()
        return real_step()

    engine.step = moving_step
    assert _check_proposals(setup, engine, _engine(target, None)) >= 20
    assert engine.stats.num_draft_offloads == engine.stats.num_draft_reloads >= 4
    assert runner.features.sharding.memory_kind in (None, "device")


@pytest.mark.parametrize("which", ["setup", "fused_setup"])
def test_feature_draft_tree_equals_ar(which, request) -> None:
    """Tree steps (nightjar_jax/spec/tree.py) with the feature draft: each node is fed its parent's output feature
    and sees only its ancestors; greedy SD == AR, and the tree accepts at least what the chain does."""
    *_, target, draft = request.getfixturevalue(which)
    ar_engine = _engine(target, None)
    accepted = {}
    for nodes in (0, 12):
        engine = _engine(target, draft, tree_nodes=nodes)
        for prompt in PROMPTS:
            assert _run(engine, prompt) == _run(ar_engine, prompt)
        s = engine.stats
        accepted[nodes] = s.num_accepted_tokens / s.drafted_per_position[0]  # per sequence-step
    assert accepted[12] >= accepted[0]


def _capturing(fn, name: str, shapes: dict):
    """``fn`` that also records its first call's arguments in ``shapes[name]`` (as shapes: donated arrays go)."""

    def call(*args):
        shapes.setdefault(name, (fn, jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, args)))
        return fn(*args)

    return call


@pytest.mark.parametrize("which", ["setup", "fused_setup"])
def test_packed_decode_steps_stay_on_the_kernel(which, request) -> None:
    """With the draft packed for the CPU kernel as the shipped one is (bfloat16 panels: ``pack_state`` on
    bfloat16-valued weights), no compiled step that runs the draft (chain or tree) runs an XLA dot: every product
    stays on the kernel. A product that leaves it takes an unpacked float32 copy of its weight on every call (the
    feature draft's ``fc`` once did, at ~1 ms a pass on SmolLM2). Greedy SD still equals AR. (The target here is not
    packed: its products past the kernel's row range for unpacked weights, 12 rows without AVX-512, take XLA's dot,
    so the steps that run the target alone, ``_forward_sample``, ``_verify`` and ``_verify_tree``, are not checked.)"""
    from kernels_pallas.linear import cpu
    from nightjar_jax.linear import pack_state

    if not cpu.packing_supported():
        pytest.skip(f"packed weights need the CPU linear kernel built with AVX-512 or AVX2 + FMA "
                    f"(available: {cpu.available()})")
    *_, target, draft = request.getfixturevalue(which)
    bf16_valued = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(w.dtype) if w.dtype == jnp.float32 else w,
                               draft.state)
    packed = ModelHandle(draft.config, draft.graphdef, pack_state(bf16_valued, "auto"))
    assert any(cpu.is_compact(w) for w in jax.tree.leaves(packed.state))
    for nodes in (0, 12):
        engine = _engine(target, packed, tree_nodes=nodes)
        runner, shapes = engine.runner, {}
        for name in ("_propose", "_propose_tree", "_draft_fill", "_verify", "_verify_tree", "_forward_sample"):
            setattr(runner, name, _capturing(getattr(runner, name), name, shapes))
        assert _run(engine, PROMPTS[1]) == _run(_engine(target, None), PROMPTS[1])
        drafting = {"_propose_tree", "_verify_tree"} if nodes else {"_propose", "_verify"}
        assert drafting <= set(shapes)
        for name, (fn, args) in shapes.items():
            if name in ("_forward_sample", "_verify", "_verify_tree"):
                continue
            hlo = fn.lower(*args).compile().as_text()
            assert " dot(" not in hlo, f"{name} (tree nodes {nodes}) runs an XLA dot"
