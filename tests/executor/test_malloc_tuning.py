"""glibc malloc settings for the model's process: what they change where glibc runs, and that
nothing changes (and nothing raises) where it does not."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import sys
from typing import Any

import pytest

from cadence.executor import malloc_tuning
from cadence.executor.malloc_tuning import keep_freed_memory

ON_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not ON_GLIBC, reason="the settings are glibc's mallopt(3)")


class FakeLibc:
    """Records mallopt calls; answers 1 (accepted) unless told otherwise."""

    def __init__(self, answer: int = 1) -> None:
        self.answer = answer
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture
def fake_libc(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(libc: Any) -> None:
        monkeypatch.setattr(sys, "platform", "linux")
        monkeypatch.setattr(malloc_tuning.ctypes, "CDLL", lambda name: libc)

    return install


def test_the_settings_asked_of_mallopt(fake_libc: Any) -> None:
    libc = FakeLibc()
    fake_libc(libc)
    assert keep_freed_memory() is True
    # M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB, M_TOP_PAD 64 MiB
    assert libc.calls == [(-3, 32 << 20), (-1, 1 << 30), (-2, 64 << 20)]


def test_a_refusal_is_reported_and_logged(fake_libc: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake_libc(FakeLibc(answer=0))
    with caplog.at_level(logging.WARNING, logger="cadence.executor.malloc_tuning"):
        assert keep_freed_memory() is False
    assert "mallopt refused" in caplog.text


def test_a_c_library_without_mallopt_changes_nothing(fake_libc: Any) -> None:
    fake_libc(object())  # musl and others: no mallopt symbol
    assert keep_freed_memory() is False


def test_an_unloadable_c_library_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(malloc_tuning.ctypes, "CDLL", refuse)
    assert keep_freed_memory() is False


def test_other_platforms_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(name: str) -> Any:
        raise AssertionError("the C library was loaded off Linux")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(malloc_tuning.ctypes, "CDLL", never)
    assert keep_freed_memory() is False


@needs_glibc
def test_on_glibc_the_settings_are_accepted_and_idempotent() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@needs_glibc
def test_on_glibc_activation_sized_blocks_come_from_the_heap_not_fresh_mappings() -> None:
    """Below the 32 MiB threshold a block is no longer mmap'ed (mallinfo2's hblks counts mappings)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("mallinfo2 needs glibc 2.33")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert keep_freed_memory()

    def mapped_after_malloc(size: int) -> int:
        before = libc.mallinfo2().hblks
        block = libc.malloc(size)
        assert block
        try:
            return libc.mallinfo2().hblks - before
        finally:
            libc.free(block)

    # 8 MiB: glibc's default threshold (128 KiB, raised only as mapped blocks are freed) would map it.
    # (Above the threshold nothing is certain: a block the heap's free top can hold is not mapped.)
    assert [mapped_after_malloc(8 << 20) for _ in range(3)] == [0, 0, 0]
