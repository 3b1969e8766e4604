"""``nightjar_jax/memory/host.py``: the process's resident bytes, and glibc's malloc_trim handing freed heap back to
the system (freed chunks between live ones stay resident until it runs); ``NIGHTJAR_MALLOC_TRIM=0`` turns it off.
The engine calls it at a sleep, a weight update and a drop of compiled variants (tests/engine/test_sleep_mode.py)."""

from __future__ import annotations

import platform

from nightjar_jax.memory import host

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_resident_bytes_reads_the_process():
    rss = host.resident_bytes()
    if platform.system() == "Linux":
        assert isinstance(rss, int) and rss > 10 * 2**20  # (a Python process with numpy loaded)
    else:
        assert rss is None


def test_trim_hands_freed_heap_between_live_chunks_back(monkeypatch):
    monkeypatch.setenv("NIGHTJAR_MALLOC_TRIM", "1")
    assert host.trim() is GLIBC
    # 40 MB of 100 kB chunks, each followed by a small live one: freeing the big ones leaves holes inside the heap
    # that free() cannot give back, only malloc_trim can
    blocks, pins = [], []
    for _ in range(400):
        blocks.append(bytearray(100_000))
        pins.append(bytearray(2_000))
    del blocks
    freed = host.resident_bytes()
    assert host.trim() is GLIBC
    if GLIBC:
        assert host.resident_bytes() < freed - 20 * 2**20
    assert len(pins) == 400


def test_trim_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("NIGHTJAR_MALLOC_TRIM", "0")
    assert host.trim() is False
