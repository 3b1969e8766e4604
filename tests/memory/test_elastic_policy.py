"""The elastic memory policy and the allocator's extension range (host side, no JAX)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nightjar_jax.cache.allocator import OutOfPagesError, PageAllocator
from nightjar_jax.memory import DraftPlacement, ElasticPolicy, MemoryAction, PoolState


def state(free=50, base=100, ext=0, waiting=0, blocked=False, preempted=False, num_running=3,
          speculating=False) -> PoolState:
    return PoolState(free, base, ext, waiting, blocked, preempted, num_running, speculating)


def test_offload_after_persisting_pressure_and_reload_after_persisting_calm():
    policy = ElasticPolicy(low_watermark=0.05, high_watermark=0.25, persist_steps=3)
    assert policy.observe(state(blocked=True)) is None
    assert policy.observe(state(preempted=True)) is None
    assert policy.observe(state(free=4)) is MemoryAction.OFFLOAD  # 4 < 5% of 100: the third step in a row
    policy.moved(MemoryAction.OFFLOAD)
    assert policy.placement is DraftPlacement.HOST
    # on host: calm needs no waiting request and free >= extension + 25% of base
    assert policy.observe(state(free=64, ext=40)) is None  # 64 < 40 + 25
    assert policy.observe(state(free=65, ext=40)) is None
    assert policy.observe(state(free=65, ext=40, waiting=1)) is None  # resets
    assert policy.observe(state(free=80, ext=40)) is None
    assert policy.observe(state(free=80, ext=40)) is None
    assert policy.observe(state(free=80, ext=40)) is MemoryAction.RELOAD
    policy.moved(MemoryAction.RELOAD)
    assert policy.placement is DraftPlacement.DEVICE


def test_a_full_pool_moves_the_draft_only_when_sd_is_off():
    """DESIGN.md: offload when SD is off, by the planner's choice (γ = 0) or because load forces it. Few free pages
    alone do not move a draft the planner still runs; a blocked or preempted request does."""
    policy = ElasticPolicy(low_watermark=0.05, persist_steps=2)
    for _ in range(5):
        assert policy.observe(state(free=1, speculating=True)) is None
    assert policy.observe(state(free=1, speculating=False)) is None
    assert policy.observe(state(free=1, speculating=False)) is MemoryAction.OFFLOAD
    policy = ElasticPolicy(low_watermark=0.05, persist_steps=2)
    assert policy.observe(state(free=1, speculating=True, blocked=True)) is None
    assert policy.observe(state(free=30, speculating=True, preempted=True)) is MemoryAction.OFFLOAD


def test_an_idle_engine_reloads_at_once():
    policy = ElasticPolicy(persist_steps=5)
    policy.moved(MemoryAction.OFFLOAD)
    assert policy.observe(state(free=10, ext=40, num_running=1)) is None
    assert policy.observe(state(free=139, ext=40, num_running=0)) is MemoryAction.RELOAD


def test_a_calm_step_resets_the_pressure_count():
    policy = ElasticPolicy(persist_steps=2)
    assert policy.observe(state(blocked=True)) is None
    assert policy.observe(state()) is None
    assert policy.observe(state(blocked=True)) is None
    assert policy.observe(state(blocked=True)) is MemoryAction.OFFLOAD


@pytest.mark.parametrize("kwargs", [dict(low_watermark=1.0), dict(high_watermark=-0.1), dict(persist_steps=0)])
def test_bad_policy_settings_are_rejected(kwargs):
    with pytest.raises(ValueError, match="must be"):
        ElasticPolicy(**kwargs)


def test_extension_pages_are_handed_out_after_base_pages_and_migrate_back():
    alloc = PageAllocator(6, 4)  # base ids 1..5
    a = alloc.allocate(3)  # [1, 2, 3]
    alloc.attach_extension(4)  # ids 6..9
    assert alloc.num_usable == 5 + 4 and alloc.num_free == 2 + 4
    b = alloc.allocate(4)  # base 4, 5 first, then the extension
    assert b == [4, 5, 6, 7]
    alloc.free([2])
    assert alloc.allocate(1) == [2]  # a freed base page goes before the extension's
    alloc.free([b.pop()])  # 7
    c = alloc.allocate(2)
    assert c == [8, 9]  # a freed extension page goes under the other free extension pages
    with pytest.raises(ValueError, match="every sequence"):
        alloc.detach_extension([a, b])  # c's pages missing: they would leak
    with pytest.raises(OutOfPagesError):
        alloc.detach_extension([a, b, c])  # 3 live extension pages, no free base page
    alloc.free(a)  # 1, 2, 3 free
    tables = [b, c]
    src, dst = alloc.detach_extension(tables)
    assert sorted(src) == [6, 8, 9] and sorted(dst) == [1, 2, 3]
    assert all(p < 6 for t in tables for p in t) and tables[0][:2] == [4, 5]
    assert alloc.num_extension == 0 and alloc.num_usable == 5 and alloc.num_free == 0
    alloc.free(tables[0])
    alloc.free(tables[1])
    assert alloc.num_free == alloc.num_usable


def test_extension_misuse_is_rejected():
    alloc = PageAllocator(4, 2)
    with pytest.raises(RuntimeError, match="no extension"):
        alloc.detach_extension([])
    with pytest.raises(ValueError, match="at least 1"):
        alloc.attach_extension(0)
    alloc.attach_extension(2)
    with pytest.raises(RuntimeError, match="already attached"):
        alloc.attach_extension(2)


def test_memory_policy_imports_no_jax():
    code = ("import sys; import nightjar_jax.memory; "
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_watermarks_that_undo_each_other_are_a_warning(caplog):
    """A reload watermark at or under the offload's was taken without a word: under load a reload can leave fewer
    free pages than the offload's threshold, and the draft then moved back and forth (8 offloads and 8 reloads in 40
    steps, QA). It stays allowed (a reload as soon as the queue empties), with a warning."""
    with caplog.at_level("WARNING", logger="nightjar_jax.memory.elastic"):
        ElasticPolicy(low_watermark=0.05, high_watermark=0.25)
        assert not caplog.records
        ElasticPolicy(low_watermark=0.9, high_watermark=0.0)
    assert len(caplog.records) == 1
    assert "reload_high_watermark=0.0 is not above offload_low_watermark=0.9" in caplog.records[0].getMessage()
