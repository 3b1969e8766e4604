"""Prefix caching (``enable_prefix_caching``): requests whose first tokens fill the same pages share those pages'
K/V. The allocator's reference counts and cached free pages, the scheduler's admission after a hit, and through the
engine (fake model of known logits, then stories260K): the same tokens as without it, hits counted, no page lost."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from nightjar_jax.cache.allocator import OutOfPagesError, PageAllocator, page_hashes
from nightjar_jax.config import SchedulerConfig
from nightjar_jax.engine.request import FinishReason, Request
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.engine.scheduler import Scheduler
from tests.engine.helpers import VOCAB, fake_engine, generate_outputs, greedy, run_all

RNG = np.random.default_rng(0)
SHARED = [int(t) for t in RNG.integers(1, VOCAB, 13)]
# page size 4: the shared 13 tokens fill 3 pages; a prompt of exactly 3 pages, and one sharing only 2
PROMPTS = [SHARED + [int(t) for t in RNG.integers(1, VOCAB, k)] for k in (1, 3, 6, 9)] + [SHARED[:12],
                                                                                          SHARED[:8] + [5]]


# ---- allocator (no JAX) -------------------------------------------------------------------------------------------
def test_page_hashes_chain_every_token_before_a_page():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and len(set(a)) == 2  # (the 9th token fills no page)
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # page 1's hash covers page 0's tokens too
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, upto=1) == a[:1]
    start = a[:1]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=start) is start and start == a


def test_shared_pages_are_counted_and_cached_free_pages_handed_out_last():
    alloc = PageAllocator(8, 4)  # 7 usable
    table = alloc.allocate(3)
    hashes = page_hashes(list(range(12)), 4)
    for p, h in zip(table, hashes, strict=True):
        alloc.register(p, h)
    alloc.register(table[0], b"another hash")  # (a page is registered once: a no-op)
    assert alloc.lookup(hashes) == table and alloc.lookup([hashes[0], b"?", hashes[2]]) == table[:1]
    assert alloc.num_unheld(table) == 0
    alloc.share(table[:2])  # a second request holds the first two
    alloc.free(table)
    assert alloc.num_free == 5 and alloc.num_cached_free == 1  # page 3 cached free; pages 1-2 still held once
    alloc.free(table[:2])
    assert alloc.num_free == 7 and alloc.num_cached_free == 3 and alloc.lookup(hashes) == table
    alloc.check()
    # plain free pages go first; then the cached ones, a prefix's last page before its first
    got = alloc.allocate(4)
    assert set(got).isdisjoint(table) and alloc.lookup(hashes) == table
    assert alloc.allocate(1) == [table[2]] and alloc.lookup(hashes) == table[:2]
    assert alloc.num_unheld(table[:2]) == 2
    alloc.share(table[:2])  # a cached free page can be held again, and is no longer free
    assert alloc.num_free == 0 and alloc.num_cached_free == 0
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="not registered"):
        alloc.share(got[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.register(0, b"x")
    alloc.check()


def test_free_and_share_are_all_or_nothing_and_sizes_are_checked():
    """A bad page later in the list raises before any hold is dropped or taken: ``free`` used to release the pages
    before it, and a registered page released that way was lost for good (neither held nor free)."""
    a = PageAllocator(num_pages=8, page_size=4)
    held = a.allocate(2)
    a.register(held[0], b"h0")
    for bad, message in (([held[0], 99], "page 99 is not allocated"), ([held[0], held[0]], f"page {held[0]} is not")):
        with pytest.raises(ValueError, match=message):
            a.free(bad)
        assert a.num_free == 5 and a.num_cached_free == 0  # (nothing dropped)
    a.free([held[1]])
    a.free([held[0]])  # (its last hold: a cached free page)
    assert (a.num_free, a.num_cached_free) == (7, 1)
    with pytest.raises(ValueError, match="page 5 is not registered"):
        a.share([held[0], 5])
    assert a.num_cached_free == 1 and a.num_unheld([held[0]]) == 1  # (no hold taken)
    a.check()
    for call in (a.allocate, a.can_allocate, a.pages_for):
        with pytest.raises(ValueError, match="must be >= 0"):
            call(-3)
    with pytest.raises(ValueError, match="page_size=0 must be an integer >= 1"):
        page_hashes([1, 2, 3], 0)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        page_hashes([1, -1, 3, 4], 2)


def test_detach_extension_moves_a_shared_page_once_and_forgets_cached_extension_pages():
    alloc = PageAllocator(4, 2)  # base ids 1-3, extension ids 4-7
    alloc.attach_extension(4)
    base = alloc.allocate(3)
    ext = alloc.allocate(3)
    assert ext == [4, 5, 6]
    alloc.register(ext[0], b"h0")
    alloc.register(ext[1], b"h1")
    alloc.share([ext[0]])  # held by two tables
    a, b = [base[0], ext[0], ext[2]], [ext[0]]
    alloc.free([base[1], base[2], ext[1]])  # ext[1] cached free: its contents go with the extension
    with pytest.raises(ValueError, match="every sequence"):
        alloc.detach_extension([a])  # (b also holds page 4)
    src, dst = alloc.detach_extension([a, b])
    assert src == [4, 6] and sorted(dst) == [base[1], base[2]]
    assert a == [base[0], dst[0], dst[1]] and b == [dst[0]]
    assert alloc.lookup([b"h0", b"h1"]) == [dst[0]]  # the moved page keeps its hash; the cached free one is gone
    alloc.check()
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 3
    alloc.check()


def test_draft_marks_go_with_the_pages_hash():
    """A registered page can be marked as holding the draft's K/V too; the mark goes when its hash does (eviction,
    reset) and all marks go when the draft's pool does."""
    alloc = PageAllocator(6, 4)  # ids 1-5
    hashes = page_hashes(list(range(1, 13)), 4)
    pages = alloc.allocate(3)
    alloc.register(pages[0], hashes[0])
    alloc.register(pages[1], hashes[1])
    alloc.mark_draft([pages[1]])
    assert alloc.draft_prefix(alloc.lookup(hashes)) == 0  # (a leading run: page 0's draft K/V are missing)
    alloc.mark_draft(pages)  # the third page is not registered: not marked
    alloc.check()
    assert alloc.lookup(hashes) == pages[:2] and alloc.draft_prefix(pages[:2]) == 2
    alloc.free(pages)  # cached free: the marks stay with the pages
    assert alloc.draft_prefix(alloc.lookup(hashes)) == 2
    taken = alloc.allocate(4)  # the 3 plain free pages, then the least recently freed cached one (page 2's)
    assert pages[1] in taken and alloc.lookup(hashes) == pages[:1] and alloc.draft_prefix(pages[:1]) == 1
    alloc.check()
    alloc.forget_draft()  # (the draft was offloaded: its pool is gone)
    assert alloc.draft_prefix(pages[:1]) == 0
    alloc.mark_draft(pages[:1])
    alloc.reset_prefix_cache()
    alloc.check()
    alloc.register(pages[2], hashes[0])
    assert alloc.draft_prefix(alloc.lookup(hashes)) == 0  # (registered again: its draft K/V not known)


# ---- scheduler (no JAX) -------------------------------------------------------------------------------------------
def _request(i: int, ids: list[int], **kw) -> Request:
    return Request(str(i), list(ids), SamplingParams(temperature=0, max_tokens=4, **kw), seed=0)


def test_admission_shares_the_cached_prefix_and_leaves_the_last_token_to_compute():
    alloc = PageAllocator(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc, 64, prefix_caching=True)
    first = _request(0, list(range(1, 14)))  # 13 tokens: 3 full pages
    sched.add(first)
    batch = sched.schedule_prefill()
    assert batch.num_new_tokens == [13] and first.num_cached_tokens == 0
    first.num_computed = 13
    sched.cache_computed(first)
    assert first.num_registered_pages == 3
    same = _request(1, list(range(1, 14)))  # the same 13: 3 pages shared, its 13th token computed
    exact = _request(2, list(range(1, 13)))  # exactly 3 pages: only 2 shared (its last token must be computed)
    logprobs = _request(3, list(range(1, 14)), prompt_logprobs=0)  # asks for every prompt position's scores
    for r in (same, exact, logprobs):
        sched.add(r)
    batch = sched.schedule_prefill()
    assert batch.requests == [same, exact, logprobs] and batch.num_new_tokens == [1, 4, 13]
    assert same.block_table[:3] == first.block_table[:3] and same.num_computed == 12 and same.num_cached_tokens == 12
    assert exact.block_table[:2] == first.block_table[:2] and exact.block_table[2] != first.block_table[2]
    assert exact.num_cached_tokens == 8
    assert set(logprobs.block_table).isdisjoint(first.block_table)
    assert (sched.num_prefix_queries, sched.num_prefix_hits) == (13 + 13 + 12, 12 + 8)
    for r in (first, same, exact, logprobs):
        sched.finish(r, FinishReason.STOP)
    assert alloc.num_free == 15
    alloc.check()


def test_a_hit_starts_the_draft_after_the_pages_holding_its_kv():
    """Pages registered after the draft ran over them are marked; a later request that finds them cached starts
    its draft after them (no catch-up over them), and after the leading marked pages only."""
    alloc = PageAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc, 64, prefix_caching=True)
    first = _request(0, list(range(1, 18)))  # 17 tokens: 4 full pages
    sched.add(first)
    sched.schedule_prefill()
    first.num_computed = 17
    sched.cache_computed(first)
    assert first.num_registered_pages == 4 and alloc.draft_prefix(first.block_table[:4]) == 0
    first.num_draft_computed = 10  # the draft's catch-up ran over 10 tokens: pages 0 and 1
    sched.cache_computed(first)
    assert first.num_draft_cached_pages == 2 and alloc.draft_prefix(first.block_table[:4]) == 2
    second = _request(1, list(range(1, 18)) + [40])
    sched.add(second)
    sched.schedule_prefill()
    assert second.num_computed == 16 and second.num_draft_computed == 8 and second.num_draft_cached_pages == 2
    assert sched.num_prefix_hits == 16 and sched.num_prefix_draft_hits == 8
    second.num_computed = 18
    second.num_draft_computed = 17  # its draft caught up: it marks the shared pages 2 and 3
    sched.cache_computed(second)
    assert alloc.draft_prefix(first.block_table[:4]) == 4
    sched._preempt(second)  # (its pages freed: its marks start over with its next admission)
    assert second.num_draft_computed == 0 and second.num_draft_cached_pages == 0
    for r in (first, second):
        sched.finish(r, FinishReason.STOP)
    assert alloc.num_free == 31
    alloc.check()


def test_a_waiter_shares_the_last_page_of_a_prompt_that_fills_its_pages():
    """A prompt of exactly 4 pages is prefilling in chunks; a request that extends it by a page waits until all 4
    are computed, the one holding the first's last token included, and shares them (it was admitted while the
    first computed its 4th page, and computed that page itself: 12 cached tokens instead of 16)."""
    alloc = PageAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12), alloc, 64, prefix_caching=True)
    first = _request(0, list(range(1, 17)))  # 16 tokens: 4 full pages
    longer = _request(1, list(range(1, 21)))  # the same 16 and 4 more
    sched.add(first)
    sched.add(longer)
    assert sched.schedule_prefill().requests == [first]  # (it waits for page 0)
    first.num_computed = 12
    sched.cache_computed(first)
    assert sched.schedule_prefill().requests == [first]  # it waits for page 3, which only the first is computing
    first.num_computed = 16
    sched.cache_computed(first)
    batch = sched.schedule_prefill()
    assert batch.requests == [longer] and batch.num_new_tokens == [4]
    assert longer.block_table[:4] == first.block_table[:4] and longer.num_cached_tokens == 16
    for r in (first, longer):
        sched.finish(r, FinishReason.STOP)
    assert alloc.num_free == 31
    alloc.check()


def test_pages_to_admit_counts_only_what_a_hit_does_not_cover():
    alloc = PageAllocator(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc, 28, prefix_caching=True)
    first = _request(0, list(range(1, 18)))  # 17 tokens: 4 full pages, 5 pages to admit (prompt + 1)
    sched.add(first)
    sched.schedule_prefill()
    first.num_computed = 17
    sched.finish(first, FinishReason.STOP)  # its 4 full pages stay cached free
    assert alloc.num_cached_free == 4 and alloc.num_free == 7
    again = _request(1, list(range(1, 18)) + [30, 31, 32, 33, 34, 35, 36, 37])  # 25 tokens: 7 pages
    # 4 cached pages (nobody holds them: a free page each) + 3 new = 7 free pages: it fits
    assert sched.pages_to_admit(again) == 7
    sched.add(again)
    assert sched.schedule_prefill().num_new_tokens == [25 - 16]
    assert again.block_table[:4] == first_pages(alloc, again) and alloc.num_free == 0
    sched.finish(again, FinishReason.STOP)
    alloc.check()


def first_pages(alloc: PageAllocator, r: Request) -> list[int]:
    return alloc.lookup(page_hashes(r.all_token_ids, alloc.page_size))[:4]


# ---- the engine (fake model) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", [False, True], ids=["ar", "spec"])
def test_engine_outputs_equal_without_caching_with_hits_and_preemptions(draft: bool):
    uncached = fake_engine(draft=draft, enable_prefix_caching=False)
    want = [o.token_ids for o in generate_outputs(uncached, PROMPTS, [greedy(12)] * len(PROMPTS))]
    engine = fake_engine(draft=draft, enable_prefix_caching=True)
    first = generate_outputs(engine, PROMPTS[:1], [greedy(12)])  # the shared prefix computed once
    assert first[0].token_ids == want[0] and engine.stats.num_prefix_cache_hits == 0
    ids = [engine.add_request(p, greedy(12)) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].outputs[0].token_ids for i in ids] == want
    # every prompt starts with 2 or 3 cached pages of the first run's (the exact-3-page one computes its third)
    assert [done[i].num_cached_tokens for i in ids] == [12, 12, 12, 12, 8, 8]
    assert engine.stats.num_prefix_cache_hits == 64
    assert engine.num_free_pages == engine.num_total_pages
    engine.allocator.check()
    # a pool too small for them all at once: preemptions, and recomputes that find their own pages cached
    engine = fake_engine(draft=draft, enable_prefix_caching=True, num_pages=12)
    got = generate_outputs(engine, PROMPTS * 2, [greedy(12)] * len(PROMPTS) * 2)
    assert [o.token_ids for o in got] == want * 2
    assert engine.stats.num_preemptions > 0 and engine.stats.num_prefix_cache_hits > 0
    engine.allocator.check()


def test_a_burst_behind_one_prefix_computes_it_once():
    """Requests added together whose first pages are the same: the first computes them, the others wait for them
    (admission stops while a running request is still prefilling the page they would compute next) and share them."""
    uncached = fake_engine(enable_prefix_caching=False)
    want = [o.token_ids for o in generate_outputs(uncached, PROMPTS[:4], [greedy(8)] * 4)]
    engine = fake_engine(max_num_batched_tokens=8)  # (on by default; the first prompt takes two prefill steps)
    ids = [engine.add_request(p, greedy(8)) for p in PROMPTS[:4]]
    done, admitted = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        admitted.append(len(engine.scheduler.running))
    assert [done[i].outputs[0].token_ids for i in ids] == want
    assert [done[i].num_cached_tokens for i in ids] == [0, 12, 12, 12]
    assert admitted[:2] == [1, 1] and max(admitted) == 4  # alone until its 3 shared pages were computed
    assert engine.num_free_pages == engine.num_total_pages
    engine.allocator.check()


def test_a_cache_salt_shares_pages_only_with_the_same_salt():
    """vLLM's ``cache_salt`` (a prompt dict's key): requests share prefix-cache pages only with requests of the same
    salt, so one tenant cannot time another's prompts through cache hits; unsalted ones share among themselves."""
    assert page_hashes(SHARED, 4, salt="a") != page_hashes(SHARED, 4) != page_hashes(SHARED, 4, salt="b")
    assert page_hashes(SHARED, 4, salt="a") == page_hashes(SHARED, 4, salt="a")
    uncached = fake_engine(enable_prefix_caching=False)
    want = [o.token_ids for o in generate_outputs(uncached, PROMPTS[:2], [greedy(6)] * 2)]
    engine = fake_engine()
    cached = []
    for prompt, salt in [(PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[1], None), (PROMPTS[1], "a")]:
        (out,) = generate_outputs(engine, [prompt if salt is None else {"prompt_token_ids": prompt,
                                                                       "cache_salt": salt}], [greedy(6)])
        assert out.token_ids == want[PROMPTS.index(prompt)]
        cached.append(engine.stats.num_prefix_cache_hits)
    # "b" and the unsalted request found nothing of "a"'s; the second "a" found its 3 shared pages
    assert cached == [0, 0, 0, 12]
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            engine.add_request({"prompt_token_ids": PROMPTS[0], "cache_salt": bad}, greedy(2))
    assert engine.num_free_pages == engine.num_total_pages
    engine.allocator.check()


def test_on_by_default_off_by_flag():
    import argparse

    from nightjar_jax.cli import add_engine_args, engine_config_from_args
    from nightjar_jax.config import ConfigError, make_engine_config

    engine = fake_engine(enable_prefix_caching=False)
    generate_outputs(engine, PROMPTS[:1], [greedy(4)])
    generate_outputs(engine, PROMPTS[:1], [greedy(4)])
    assert engine.stats.num_prefix_cache_hits == 0 and engine.allocator.num_cached_free == 0
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args([])).cache.enable_prefix_caching  # (as vLLM)
    assert engine_config_from_args(parser.parse_args(["--enable-prefix-caching"])).cache.enable_prefix_caching
    assert not engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).cache.enable_prefix_caching
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        make_engine_config(enable_prefix_caching="yes")


def test_elastic_memory_with_shared_pages_on_the_extension():
    """A burst offloads the draft; requests that arrive then compute a prefix on extension pages and share it, and
    the shared pages migrate back (each once) when the draft returns; the outputs equal plain greedy decoding. No
    page is marked as holding the draft's K/V while the draft's pool is away."""
    burst = [[int(t) for t in RNG.integers(1, VOCAB, 6 + i % 5)] for i in range(8)]
    late = [SHARED + [int(t) for t in RNG.integers(1, VOCAB, 1 + i)] for i in range(4)]
    params = [greedy(n) for n in [40, 40] + [12] * 6] + [greedy(24)] * 4
    want = [o.token_ids for o in generate_outputs(fake_engine(enable_prefix_caching=False), burst + late, params)]
    engine = fake_engine(draft=True, num_pages=24, max_num_seqs=6, num_speculative_tokens=3, draft_offload="auto",
                         offload_persist_steps=2, reload_high_watermark=0.0, prompt_lookup_max=0,
                         enable_prefix_caching=True)
    ids = [engine.add_request(p, sp) for p, sp in zip(burst, params[: len(burst)], strict=True)]
    detach, moved_shared = engine.allocator.detach_extension, []

    def watched(tables):  # records the moves of pages more than one table holds
        counts = collections.Counter(p for t in tables for p in t)
        src, dst = detach(tables)
        moved_shared.extend(p for p in src if counts[p] > 1)
        return src, dst

    engine.allocator.detach_extension = watched
    done, shared_on_extension, pending = {}, False, list(zip(late, params[len(burst):], strict=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.allocator.check()
        assert not (engine.draft_offloaded and engine.allocator.num_draft_pages)
        if pending and engine.allocator.extension_pages_used():  # the late ones, one at a time, on the extension
            if len(pending) == len(late) or engine.stats.num_prefix_cache_queries:
                ids.append(engine.add_request(*pending.pop(0)))
        ext = [p for r in engine.scheduler.running for p in r.block_table if p >= engine.allocator.num_pages]
        shared_on_extension |= len(ext) > len(set(ext))
    assert not pending and [done[i] for i in ids] == want
    assert engine.stats.num_draft_offloads >= 1 and engine.stats.num_draft_reloads >= 1
    assert shared_on_extension and moved_shared and engine.stats.num_prefix_cache_hits > 0
    assert engine.num_free_pages == engine.num_total_pages


# ---- the engine (stories260K) ---------------------------------------------------------------------------------------
OPENING = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "


@pytest.fixture(scope="module")
def spec_llm():
    """stories260K drafting for itself with n-gram lookup on, small pages."""
    from nightjar_jax import LLM

    return LLM("stories260k", draft_model="stories260k", num_speculative_tokens=3, planner="static", page_size=4,
               max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, num_pages=96,
               enable_prefix_caching=True)


def _pool_pages(kv, pages: list[int]) -> np.ndarray:
    """K and V of base pages ``pages``: ``[2, layers, kv heads, len(pages), page size, head dim]``."""
    from nightjar_jax.models.llama import StackedKV

    idx = np.asarray(pages, np.int32)
    if isinstance(kv, StackedKV):
        return np.stack([np.asarray(kv.k[:, :, idx]), np.asarray(kv.v[:, :, idx])])
    return np.stack([np.stack([np.asarray(layer[i][:, idx]) for layer in kv]) for i in (0, 1)])


def test_marked_pages_hold_the_drafts_kv(spec_llm):
    """The draft is the target here, so a page marked as holding the draft's K/V must hold the target's K/V in the
    draft's pool too. Checked after every step while requests sharing an opening arrive one after the other: a page
    marked before the draft ran over it (its pool still zero, or an earlier owner's) would differ."""
    engine = spec_llm.engine
    engine.reset_prefix_cache()
    alloc, runner = engine.allocator, engine.runner
    prompts = [OPENING + end for end in ("One day", "Her mom said", "She saw a big", "Lily had a red ball.")]
    pending = list(prompts)
    checked, step = set(), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 6 == 0:
            engine.add_request(pending.pop(0), SamplingParams(temperature=0, max_tokens=16))
        engine.step()
        step += 1
        marked = sorted(alloc._draft)
        if marked:
            target, draft = _pool_pages(runner.kv, marked), _pool_pages(runner.draft_kv, marked)
            np.testing.assert_allclose(draft, target, rtol=2e-3, atol=2e-3 * max(1.0, float(np.abs(target).max())))
            checked.update(marked)
    assert len(checked) > 10 and engine.stats.num_prefix_cache_draft_hits > 0
    assert engine.num_free_pages == engine.num_total_pages
    alloc.check()


def test_real_model_speculation_and_lookup_equal_the_uncached_run(spec_llm):
    """stories260K drafting for itself with n-gram lookup on, small pages: the tokens of the same requests with the
    cache off (same engine, same compiled steps) and on, where each request after the first finds the story's
    opening cached; sampled requests too (their seeds fix their draws; the pool never preempts). The draft's K/V
    come from the cache too: it skips its catch-up over the opening and accepts exactly as many tokens as when it
    ran over it."""
    llm = spec_llm
    llm.reset_prefix_cache()
    prompts = [OPENING + end for end in ("One day", "Her mom said", "She saw a big", "Lily had a red ball.")]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=5, max_tokens=24)]
    sched = llm.engine.scheduler

    stats = llm.engine.stats

    def run():
        before = (stats.num_accepted_tokens, stats.num_drafted_tokens, stats.num_catchup_tokens)
        tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] for sp in params]
        after = (stats.num_accepted_tokens, stats.num_drafted_tokens, stats.num_catchup_tokens)
        return tokens, [b - a for a, b in zip(before, after, strict=True)]

    sched.prefix_caching = False
    want, (accepted, drafted, catchup) = run()
    sched.prefix_caching = True
    earlier = stats.num_prefix_cache_draft_hits
    llm.generate(prompts[:1], params[0], use_tqdm=False)  # the opening computed and cached, the draft's K/V too
    hits, draft_hits = stats.num_prefix_cache_hits, stats.num_prefix_cache_draft_hits
    alloc = llm.engine.allocator
    opened = alloc.lookup(page_hashes(llm.engine.tokenizer.encode(prompts[0]), 4))
    assert draft_hits == earlier and len(opened) > 5 and alloc.draft_prefix(opened) > 5
    got, (accepted_cached, drafted_cached, catchup_cached) = run()
    assert got == want
    assert (accepted_cached, drafted_cached) == (accepted, drafted) and accepted > 0
    assert stats.num_prefix_cache_hits > hits and stats.num_prefix_cache_draft_hits > draft_hits
    assert catchup_cached <= catchup - (stats.num_prefix_cache_draft_hits - draft_hits)
    # (the seeded rows repeat for the same speculation decisions: a preemption, which the cache may cause or spare,
    # would make a recompute draw a token plainly where the other run drew it speculatively)
    assert llm.engine.stats.num_preemptions == 0
    assert llm.engine.num_free_pages == llm.engine.num_total_pages
    llm.engine.allocator.check()


def test_reset_prefix_cache_forgets_every_page_and_keeps_running_requests():
    engine = fake_engine(enable_prefix_caching=True)
    generate_outputs(engine, PROMPTS[:1], [greedy(4)])
    assert engine.allocator.num_cached_free > 0
    rid = engine.add_request(PROMPTS[1], greedy(8))
    engine.step()  # admitted with a hit: it holds shared pages
    assert engine.requests[rid].num_cached_tokens == 12
    assert engine.reset_prefix_cache() > 0
    assert engine.allocator.num_cached_free == 0 and engine.allocator.lookup(engine.requests[rid].page_hashes) == []
    engine.allocator.check()
    # the running request registers none of its pages, the later ones included: each is found only through the
    # ones before it, which are forgotten (they were counted as cached and never hit, QA 2026-12-07)
    run_all(engine)
    assert engine.allocator.num_cached_free == 0
    again = generate_outputs(engine, PROMPTS[:1], [greedy(4)])  # nothing cached: computed whole
    assert engine.stats.num_prefix_cache_hits == 12 and again
    assert engine.num_free_pages == engine.num_total_pages
    engine.allocator.check()


def test_a_request_through_a_weight_update_caches_nothing_until_a_preemption_recomputes_it():
    """A request running when the weights change (``LLMEngine.update_weights``) holds K/V of the old weights: none of
    its pages is registered while it runs, and no waiting request waits for it to register its prefix; a preemption,
    which frees its pages and computes everything again, clears the mark (Request.stale_kv)."""
    eng = fake_engine(enable_prefix_caching=True, max_num_batched_tokens=2)
    prompt = [(3 * j + 1) % VOCAB for j in range(16)]
    eng.add_request(prompt, greedy(3), request_id="through")
    eng.step()  # (one 2-token chunk of its prefill: less than a page, so its first page is still to register)
    running = eng.scheduler.running[0]
    assert running.is_prefilling and not running.stale_kv
    eng.update_weights(eng.target)
    assert running.stale_kv
    eng.add_request(prompt, greedy(3), request_id="after")
    waiting = eng.scheduler.waiting[0]
    assert not eng.scheduler._awaits_prefix(waiting)  # (the stale one will never register those pages)
    run_all(eng)
    assert eng.allocator.num_cached_free == 16 // 4  # ("after"'s pages only: "through" registered none)
    # a preemption frees the pages and clears the mark: the recompute is under the new weights
    eng.add_request(prompt, greedy(3), request_id="again")
    eng.step()
    again = eng.scheduler.running[0]
    again.stale_kv = True
    eng.scheduler._free_pages(again)
    assert not again.stale_kv and again.block_table == []
    eng.abort_request("again")
    eng.allocator.check()
    assert eng.num_free_pages == eng.num_total_pages
