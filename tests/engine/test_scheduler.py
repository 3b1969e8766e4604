"""Scheduler and allocator (host side, no JAX): admission, chunking, preemption, abort, page accounting."""

from __future__ import annotations

import sys

import pytest

from nightjar_jax.cache.allocator import OutOfPagesError, PageAllocator
from nightjar_jax.config import SchedulerConfig
from nightjar_jax.engine.request import FinishReason, Request
from nightjar_jax.engine.sampling_params import SamplingParams
from nightjar_jax.engine.scheduler import Scheduler


def make(num_pages=16, page_size=4, max_num_seqs=4, budget=8, max_len=128, policy="fcfs"):
    alloc = PageAllocator(num_pages, page_size)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, scheduling_policy=policy)
    return Scheduler(config, alloc, max_len), alloc


def req(rid, n, priority=0):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0), seed=0, priority=priority)


def test_allocator_reserves_page_zero_and_detects_double_free():
    alloc = PageAllocator(5, 4)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and alloc.num_free == 0
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    alloc.free(pages[:2])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="page 0"):
        alloc.free([0])


def test_fcfs_admission_and_chunked_prefill_budget():
    sched, alloc = make(budget=8)
    a, b, c = req("a", 5), req("b", 6), req("c", 3)
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule()
    assert batch.kind == "prefill"
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new_tokens == [5, 3]
    a.num_computed, b.num_computed = 5, 3
    batch = sched.schedule()  # b continues first (already running), then c is admitted
    assert [r.request_id for r in batch.requests] == ["b", "c"] and batch.num_new_tokens == [3, 3]


def test_a_fresh_prompts_last_token_is_prefilled_whatever_its_chunks():
    """A chunk that leaves a fresh prompt one token short does not hand that token to a decode step: the first
    token is always sampled by a prefill step, so a seeded request's draws do not depend on how other requests
    shared the budget (a decode step may be speculative). With output, the last token is a decode step's."""
    sched, _ = make(budget=8)
    a, b = req("a", 2), req("b", 7)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [2, 6]  # b's chunk leaves its last prompt token
    a.num_computed, b.num_computed = 2, 6
    a.output_token_ids.append(9)  # a's first token came with its chunk
    assert b.is_prefilling and not a.is_prefilling and sched.num_decoding() == 1
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.requests == [b] and batch.num_new_tokens == [1]
    b.num_computed = 7
    b.output_token_ids.append(9)
    assert not b.is_prefilling and sched.schedule().kind == "decode"
    assert not req("c", 1).is_prefilling  # a one-token prompt decodes from the start (the same in every batch)


def test_admission_waits_for_pages_and_slots():
    sched, alloc = make(num_pages=5, page_size=4, max_num_seqs=1, budget=64)
    a, b = req("a", 8), req("b", 2)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["a"]  # one slot only
    assert len(a.block_table) == 3  # pages for 8 prompt tokens + 1
    assert list(sched.waiting) == [b]


def test_decode_preempts_latest_and_requeues_at_front():
    sched, alloc = make(num_pages=5, page_size=4, budget=64)  # 4 usable pages
    a, b = req("a", 4), req("b", 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    a.num_computed = b.num_computed = 4
    a.output_token_ids = [9]
    b.output_token_ids = [9]  # both now 5 tokens, 2 pages each: pool full
    assert alloc.num_free == 0
    a.output_token_ids += [9, 9, 9, 9]  # a needs a third page for its next decode
    a.num_computed = a.num_tokens - 1
    b.num_computed = b.num_tokens - 1
    batch = sched.schedule(lookahead=0)
    assert batch.kind == "decode" and [r.request_id for r in batch.requests] == ["a"]
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert sched.waiting[0] is b and b.num_computed == 0 and b.block_table == []


def test_priority_admission_order_and_ties_in_arrival_order():
    """scheduling_policy "priority": admitted lowest value first, equal values in arrival order; fcfs ignores
    priorities (the engine refuses non-zero ones there)."""
    for policy, expected in [("priority", ["c", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d"])]:
        sched, _ = make(max_num_seqs=1, budget=64, policy=policy)
        for r in (req("a", 3, 0), req("b", 3, 5), req("c", 3, -2), req("d", 3, 0)):
            sched.add(r)
        assert [r.request_id for r in sched.waiting] == expected
        batch = sched.schedule()
        assert [r.request_id for r in batch.requests] == expected[:1]


def test_priority_preempts_the_least_urgent_and_requeues_it_in_order():
    """Out of pages, the victim is the running request latest in (priority, arrival) order, here the first
    admitted (fcfs would take the last); it goes back to the waiting queue at its place in that order. Decode
    candidates go most urgent first, so no request scheduled this step is taken as a victim after it."""
    sched, alloc = make(num_pages=5, page_size=4, budget=64, policy="priority")  # 4 usable pages
    a, b = req("a", 4, priority=3), req("b", 4, priority=1)
    sched.add(a)
    sched.add(b)
    assert [r.request_id for r in sched.waiting] == ["b", "a"]
    sched.schedule()
    for r in (a, b):
        r.num_computed = 4
        r.output_token_ids = [9]  # 5 tokens, 2 pages each: the pool is full
    assert alloc.num_free == 0
    b.output_token_ids += [9, 9, 9, 9]  # b needs a third page for its next decode
    a.num_computed, b.num_computed = a.num_tokens - 1, b.num_tokens - 1
    late = req("z", 2, priority=2)
    sched.add(late)
    batch = sched.schedule(lookahead=0)
    assert batch.kind == "decode" and batch.requests == [b] and batch.preempted == [a]
    assert list(sched.waiting) == [late, a] and a.num_computed == 0 and a.block_table == []
    assert sched.running == [b]


def test_priority_never_schedules_a_victim():
    """Two running requests each need a page and one is free: the urgent one (admitted second) gets it and the
    other is preempted, and not after it was put in this step's batch (which would run it on freed pages)."""
    sched, alloc = make(num_pages=6, page_size=4, budget=64, policy="priority")  # 5 usable pages
    x, y = req("x", 4, priority=5), req("y", 4, priority=0)
    sched.add(x)
    sched.schedule()  # x admitted alone first
    sched.add(y)
    sched.schedule()
    assert sched.running == [x, y] and alloc.num_free == 1
    for r in (x, y):
        r.output_token_ids = [9] * 5  # 9 tokens: a third page each
        r.num_computed = r.num_tokens - 1
    batch = sched.schedule(lookahead=0)
    assert batch.requests == [y] and batch.preempted == [x] and x.block_table == []
    assert all(p not in x.block_table for p in y.block_table) and len(y.block_table) == 3


def test_finish_frees_pages_from_any_queue():
    sched, alloc = make()
    a, b = req("a", 5), req("b", 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    assert alloc.num_free == alloc.num_usable and not sched.has_unfinished()


def test_host_scheduler_imports_no_jax():
    import subprocess

    code = (
        "import sys; import nightjar_jax.engine.scheduler, nightjar_jax.cache.allocator, "
        "nightjar_jax.engine.beam_search; "
        "assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
