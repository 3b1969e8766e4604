"""Elastic memory through the engine (fake model of known logits): under KV pressure the draft goes to host memory
and its device bytes become an extension KV pool; when the load falls live extension pages migrate back and the
draft returns. Outputs equal plain greedy decoding, no page leaks, and the device bytes never exceed the start's."""

from __future__ import annotations

import jax
import pytest

from nightjar_jax.config import ConfigError
from nightjar_jax.testing import fake_greedy_continuation
from tests.engine.helpers import VOCAB, fake_engine, greedy

PROMPTS = [[(7 * i + j) % VOCAB for j in range(6 + i % 5)] for i in range(10)]


def run_watching(engine, prompts, lengths):
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, lengths, strict=True)]
    start = sum(engine.runner.device_bytes().values())
    peak, ext_used, offloaded_steps, done = start, 0, 0, {}
    speculated_after_reload = False
    while engine.has_unfinished_requests():
        steps_before, was_offloaded = engine.stats.num_decode_steps, engine.draft_offloaded
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, sum(engine.runner.device_bytes().values()))
        ext_used = max(ext_used, engine.allocator.extension_pages_used())
        offloaded_steps += engine.draft_offloaded
        if was_offloaded:  # (a move happens after the step it follows)
            assert engine.stats.num_decode_steps == steps_before or engine.stats.last_gamma == 0
        elif engine.stats.num_draft_reloads and engine.stats.num_decode_steps > steps_before:
            speculated_after_reload |= engine.stats.last_gamma > 0
    assert engine.num_free_pages == engine.num_total_pages
    return [done[i] for i in ids], start, peak, ext_used, offloaded_steps, speculated_after_reload


def run_stepping(engine, prompts, params, on_extension=None):
    """Step ``engine`` through the requests; returns their token ids in order and whether any step ran with live
    extension pages (``on_extension()`` is called after each such step)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done, ext_seen = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if engine.allocator.extension_pages_used():
            ext_seen = True
            if on_extension is not None:
                on_extension()
    return [done[i] for i in ids], ext_seen


def test_offload_extends_the_pool_and_reload_migrates_it_back():
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, reload_high_watermark=0.0, prompt_lookup_max=0)
    assert engine.runner.draft_on_device
    # two long requests, then a burst: the long ones grow into extension pages and still run as the pool empties
    lengths = [60, 60] + [12] * 8
    outs, start, peak, ext_used, offloaded_steps, resumed = run_watching(engine, PROMPTS, lengths)
    for p, o, n in zip(PROMPTS, outs, lengths, strict=True):
        assert o == fake_greedy_continuation(p, n, VOCAB)
    s = engine.stats
    assert s.num_draft_offloads >= 1 and s.num_draft_reloads >= 1
    assert offloaded_steps > 0 and ext_used > 0  # requests ran on extension pages
    assert s.num_migrated_pages > 0  # live extension pages moved into the base pool at the reload
    assert peak <= start  # the extension never held more than the draft gave back
    assert engine.runner.draft_on_device and not engine.draft_offloaded and engine.allocator.num_extension == 0
    assert resumed and s.num_catchup_tokens > 0  # after the reload the draft caught up and speculated again


def test_the_first_switch_after_a_reload_pays_for_it(monkeypatch):
    """DESIGN.md, "Planner": a reload the memory policy makes while requests run is charged to the next switch from
    γ = 0 to γ > 0, as switch seconds inside the step's seconds the planner observes; each reload once."""
    import time

    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, reload_high_watermark=0.0, prompt_lookup_max=0, planner="static")
    real_reload = engine.runner.reload_draft
    # (a reload of 0.5 s: far above what a step's own catch-up takes on a loaded machine, so the bounds below tell a
    # reload charged once from none or two)
    monkeypatch.setattr(engine.runner, "reload_draft", lambda: (time.sleep(0.5), real_reload())[1])
    seen = []
    real_observe = engine.planner.observe
    monkeypatch.setattr(engine.planner, "observe", lambda gamma, batch_size, num_tokens, seconds, switch_seconds=0.0:
                        (seen.append((gamma, seconds, switch_seconds, engine.stats.num_draft_reloads)),
                         real_observe(gamma, batch_size, num_tokens, seconds, switch_seconds=switch_seconds))[1])
    lengths = [60, 60] + [12] * 8
    outs, *_ = run_watching(engine, PROMPTS, lengths)
    for p, o, n in zip(PROMPTS, outs, lengths, strict=True):
        assert o == fake_greedy_continuation(p, n, VOCAB)
    reloads = engine.stats.num_draft_reloads
    assert reloads >= 2
    # each reload (0.5 s here) is charged to the switch after it, once: never two in one switch, none before
    # the first; a switch the planner does not see (its step compiled a variant) takes its reload with it
    charged = [(sec, sw) for _, sec, sw, _ in seen if sw >= 0.5]
    assert 1 <= len(charged) <= reloads and all(sec >= sw and sw < 1.0 for sec, sw in charged)
    assert all(sw < 0.5 for _, _, sw, n in seen if n == 0)
    assert engine._uncharged_reload_seconds == 0.0  # (the last reload's switch came, or it was made idle)


@pytest.mark.parametrize("planner, offloads", [("static", False), ("ar", True)])
def test_a_full_pool_offloads_only_when_the_planner_stopped_speculating(planner, offloads):
    """Two requests that fit a pool kept under the low watermark (nothing waits, nothing is preempted): a planner
    still choosing γ > 0 keeps its draft on the device; one choosing γ = 0 has it moved (DESIGN.md: offload when
    SD is off). Outputs equal plain greedy decoding either way."""
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=2, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, offload_low_watermark=0.9, prompt_lookup_max=0, planner=planner)
    outs, *_ = run_watching(engine, PROMPTS[:2], [20, 20])
    for p, o in zip(PROMPTS[:2], outs, strict=True):
        assert o == fake_greedy_continuation(p, 20, VOCAB)
    assert engine.stats.num_preemptions == 0
    assert (engine.stats.num_draft_offloads > 0) is offloads


def test_warmup_covers_the_extended_layout():
    """After ``engine.warmup()`` (decode, prefill chunks and the draft's catch-up, in both layouts) a burst through
    offload and reload compiles nothing: no step, offloaded or not, prefill or decode."""
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, reload_high_watermark=0.0, prompt_lookup_max=0)
    ticks = []
    keys = engine.warmup(sampled=False, progress=lambda: ticks.append(1))
    assert len(ticks) == engine.warmup_ticks(sampled=False)
    assert {k[0] for k in keys} == {"forward_sample", "draft_fill", "propose", "verify"}
    assert engine.runner.draft_on_device and engine.allocator.num_extension == 0
    assert engine.stats.num_draft_offloads == engine.stats.num_draft_reloads == 1
    assert engine.num_free_pages == engine.num_total_pages
    compiled = engine.runner.num_compiled()
    for p, n in zip(PROMPTS, [60, 60] + [12] * 8, strict=True):
        engine.add_request(p, greedy(n))
    offloaded_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        offloaded_steps += engine.draft_offloaded
        assert engine.runner.num_compiled() == compiled, engine.runner.compiled_cache_sizes()
    assert engine.stats.num_draft_offloads >= 2 and engine.stats.num_draft_reloads >= 2 and offloaded_steps > 0
    assert engine.stats.num_catchup_tokens > 0  # (the draft's catch-up ran, on a warmed shape)


def test_warmup_while_offloaded_warms_what_runs_then():
    """``warmup()`` under traffic with the draft offloaded warms the γ = 0 variants over the extended pools (what
    every step runs until the reload): it ran the γ > 0 variants with the draft's K/V gone, a TypeError from inside
    the draft's jitted step (QA, 2026-12-06). The requests then finish as plain decoding, every page free."""
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, prompt_lookup_max=0)
    lengths = [60, 60] + [12] * 8
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(PROMPTS, lengths, strict=True)]
    done = {}
    while not engine.draft_offloaded:
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    ticks = []
    keys = engine.warmup(sampled=False, progress=lambda: ticks.append(1))
    assert keys and {k[0] for k in keys} == {"forward_sample"} and len(ticks) == engine.warmup_ticks(sampled=False)
    assert engine.draft_offloaded  # (warming up moves nothing)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in ids] == [fake_greedy_continuation(p, n, VOCAB) for p, n in zip(PROMPTS, lengths,
                                                                                          strict=True)]
    assert engine.num_free_pages == engine.num_total_pages


def test_offload_moves_real_weights_to_host_memory():
    engine = fake_engine(draft=True, draft_offload="auto")
    engine.runner.draft.state = {"w": jax.numpy.ones((64, 64))}  # the fake draft has no weights: give it some
    engine.runner.draft.treedef = jax.tree.structure(engine.runner.draft.state)
    before = engine.runner.device_bytes()
    assert before["draft_weights"] == 64 * 64 * 4
    freed = engine.runner.offload_draft()
    assert freed == before["draft_weights"] + before["draft_pools"]
    (w,) = engine.runner.draft.leaves()
    assert w.sharding.memory_kind in ("pinned_host", "unpinned_host")
    assert engine.runner.device_bytes()["draft_weights"] == 0 and engine.runner.device_bytes()["draft_pools"] == 0
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.runner.offload_draft()
    engine.runner.reload_draft()
    (w,) = engine.runner.draft.leaves()
    assert w.sharding.memory_kind == "device" and float(w.sum()) == 64 * 64
    assert engine.runner.device_bytes() == before


def test_aborting_every_request_while_offloaded_brings_the_draft_back():
    engine = fake_engine(draft=True, num_pages=20, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2)
    ids = [engine.add_request(p, greedy(40)) for p in PROMPTS]
    while not engine.allocator.extension_pages_used():  # until requests hold extension pages
        engine.step()
    assert engine.draft_offloaded and engine.has_unfinished_requests()
    for i in ids:
        engine.abort_request(i)
    assert engine.runner.draft_on_device and engine.allocator.num_extension == 0
    assert engine.stats.num_draft_reloads == 1 and engine.num_free_pages == engine.num_total_pages


def test_arrays_shared_with_the_target_stay_on_the_device():
    engine = fake_engine(draft=True, draft_offload="auto")
    runner = engine.runner
    shared, own = jax.numpy.ones((8, 8)), jax.numpy.ones((16, 16))
    for handle, state in ((runner.target, {"s": shared}), (runner.draft, {"s": shared, "own": own})):
        handle.state, handle.treedef = state, jax.tree.structure(state)
    pools = runner.device_bytes()["draft_pools"]
    assert runner.draft_device_bytes() == own.nbytes + pools
    assert runner.offload_draft() == own.nbytes + pools
    kinds = {x.shape: x.sharding.memory_kind for x in runner.draft.leaves()}
    assert kinds[(8, 8)] == "device" and kinds[(16, 16)] in ("pinned_host", "unpinned_host")
    assert not shared.is_deleted() and own.is_deleted()
    runner.reload_draft()
    assert any(x is shared for x in runner.draft.leaves()) and not shared.is_deleted()
    assert {x.sharding.memory_kind for x in runner.draft.leaves()} == {"device"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft_offload="always"), "draft_offload"),
    (dict(offload_low_watermark=1.5), "offload_low_watermark"),
    (dict(offload_low_watermark=False), "offload_low_watermark=False is invalid"),  # (a bool was taken as 0)
    (dict(planner_log=123), "planner_log=123 is invalid: allowed None"),  # (a pathlib TypeError traceback)
    (dict(planner_log=""), "planner_log='' is invalid"),  # (silently no log)
    (dict(offload_persist_steps=0), "offload_persist_steps"),
])
def test_bad_offload_settings_are_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        fake_engine(draft=True, **kwargs)


def test_real_model_greedy_sd_across_offload_and_reload_equals_ar():
    """stories260K with a layer-skip draft on a pool too small for the batch: the draft goes to host memory, the
    target's stacked pools gain an extension that the CPU kernel reads in place, and after the reload (live pages
    migrated) speculation resumes; every output equals plain greedy decoding."""
    from nightjar_jax import LLM, SamplingParams

    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily had a red ball. One day", "Tom was sad because"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 12, 12, 12)] * 2
    common = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=9, page_size=8)
    ar = [o.outputs[0].token_ids for o in LLM("stories260k", **common).generate(prompts * 2, params)]
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
             draft_offload="auto", offload_persist_steps=2, reload_high_watermark=0.0, **common)
    engine = sd.engine
    assert engine.runner.target.stacked == engine.runner.draft.stacked  # (stacked wherever the CPU kernels build)
    outs = [o.outputs[0].token_ids for o in sd.generate(prompts * 2, params)]
    assert outs == ar
    s = engine.stats
    assert s.num_draft_offloads >= 1 and s.num_draft_reloads >= 1 and s.num_accepted_tokens > 0
    assert engine.runner.draft_on_device and engine.num_free_pages == engine.num_total_pages == 8
    # the same burst again: the same moves, and no step compiles (the pools, the weights and what comes back from
    # host memory are all committed to the device, so the variants' cache keys do not change with a move)
    compiled, offloads = engine.runner.compiled_cache_sizes(), s.num_draft_offloads
    assert [o.outputs[0].token_ids for o in sd.generate(prompts * 2, params)] == ar
    assert s.num_draft_offloads > offloads and engine.runner.compiled_cache_sizes() == compiled


def test_pallas_attention_reads_the_extension_in_place():
    """The same burst with the Pallas kernels (interpreted here): requests run on extension pages, which the kernel
    reads in place at the fixed block-table width (no gather, no width buckets), and every output equals plain
    greedy decoding."""
    from nightjar_jax import LLM, SamplingParams

    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily had a red ball. One day", "Tom was sad because"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 12, 12, 12)]
    common = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_pages=9, page_size=8)
    ar = [o.outputs[0].token_ids for o in LLM("stories260k", **common).generate(prompts, params)]
    sd = LLM("stories260k", draft_model="stories260k@skip=2", num_speculative_tokens=3, planner="static",
             draft_offload="auto", offload_persist_steps=2, reload_high_watermark=0.0, attention_impl="pallas",
             **common)
    engine = sd.engine
    assert len(engine.runner.shapes.page_buckets) == 1  # one width: the kernels stop at each context
    outs, ext_seen = run_stepping(engine, prompts, params)
    assert outs == ar
    assert ext_seen and engine.stats.num_draft_reloads >= 1
    assert engine.num_free_pages == engine.num_total_pages


def test_stacked_pools_offload_and_reload_equal_ar():
    """The same with weights and K/V pools stacked over the layers (``StackedKV``, where the CPU kernels build): the
    extension is stacked too, the kernel reads its layer in place, and the migration copies every layer's pages."""
    from kernels_pallas.linear import cpu
    from nightjar_jax import LLM, SamplingParams
    from nightjar_jax.models.llama import StackedKV

    if jax.default_backend() != "cpu" or not cpu.packing_supported():
        pytest.skip("stacked weights are held on the CPU backend where the CPU linear kernel takes packed weights")
    prompts = [[5, 17, 33, 2, 9], [101, 7, 7, 7, 44, 13, 250], [300, 12], [9, 9, 8], [77, 1, 2, 3], [42]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 40, 10, 10, 10, 10)]
    common = dict(load_format="dummy", seed=3, max_model_len=128, max_num_seqs=6, num_pages=9, page_size=8)
    ar = [o.outputs[0].token_ids for o in LLM("tiny-gqa", **common).generate(prompts, params)]
    sd = LLM("tiny-gqa", draft_model="tiny-mha", num_speculative_tokens=3, planner="static", draft_offload="auto",
             offload_persist_steps=2, reload_high_watermark=0.0, **common)
    engine = sd.engine
    assert isinstance(engine.runner.kv, StackedKV)

    def stacked_extension():
        assert engine.runner.kv.k_ext is not None and engine.runner.kv.k_ext.shape[0] == engine.runner.kv.k.shape[0]

    outs, ext_seen = run_stepping(engine, prompts, params, on_extension=stacked_extension)
    assert outs == ar
    s = engine.stats
    assert ext_seen and s.num_draft_offloads >= 1 and s.num_draft_reloads >= 1 and s.num_migrated_pages > 0
    assert engine.runner.kv.k_ext is None and engine.num_free_pages == engine.num_total_pages == 8


def test_metrics_show_the_offloaded_draft_and_the_extension():
    from prometheus_client import generate_latest

    from nightjar_jax.server.metrics import ServerMetrics

    engine = fake_engine(draft=True, draft_offload="auto")
    metrics = ServerMetrics(engine)

    def scrape() -> dict[str, float]:
        lines = generate_latest(metrics.registry).decode().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}

    before = scrape()
    assert before["nightjar_draft_offloaded"] == 0 and before["nightjar_kv_extension_pages"] == 0
    engine._offload_draft()
    m = scrape()
    ext = engine.allocator.num_extension
    assert ext > 0 and m["nightjar_draft_offloaded"] == 1 and m["nightjar_kv_extension_pages"] == ext
    assert m["nightjar_draft_offloads_total"] == 1
    assert m["nightjar_kv_pages_usable"] == before["nightjar_kv_pages_usable"] + ext
    engine._reload_draft()
    m = scrape()
    assert m["nightjar_draft_offloaded"] == 0 and m["nightjar_draft_reloads_total"] == 1
    assert m["nightjar_kv_pages_usable"] == before["nightjar_kv_pages_usable"] == m["nightjar_kv_pages_free"]


def test_a_scrape_never_sees_an_offload_half_made(monkeypatch):
    """/metrics reads the engine from the HTTP thread. An offload drops the draft before it attaches the extension
    pool; a scrape in between read the draft offloaded, no extension and every page used (2 of 132 scrapes under
    load). Scrapes now never read mid-move (``LLMEngine.state_lock``): one started mid-offload waits for its end and
    sees the extension. (Steps do not hold the lock: the engine loop would take it again at once, and a scrape under
    load waited until the engine was idle.)"""
    import threading

    from prometheus_client import generate_latest

    from nightjar_jax.server.metrics import ServerMetrics

    engine = fake_engine(draft=True, draft_offload="auto")
    metrics = ServerMetrics(engine)
    attach, scraped, halfway = engine.allocator.attach_extension, {}, threading.Event()

    def slow_attach(pages):  # (the window: the draft is gone, the extension not yet there)
        halfway.set()
        scraper.join(timeout=0.5)
        assert scraper.is_alive()  # (the scrape waits for the offload to end)
        return attach(pages)

    def scrape():
        halfway.wait()
        lines = generate_latest(metrics.registry).decode().splitlines()
        scraped.update({line.split()[0]: float(line.split()[1]) for line in lines
                        if line and not line.startswith("#")})

    monkeypatch.setattr(engine.allocator, "attach_extension", slow_attach)
    scraper = threading.Thread(target=scrape)
    scraper.start()
    engine._offload_draft()
    scraper.join(timeout=30)
    ext = engine.allocator.num_extension
    assert ext > 0 and scraped["nightjar_draft_offloaded"] == 1 and scraped["nightjar_kv_extension_pages"] == ext
    assert scraped["nightjar_kv_pages_free"] == scraped["nightjar_kv_pages_usable"] == engine.num_total_pages
