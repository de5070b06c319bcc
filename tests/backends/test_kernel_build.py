"""Where and when the CPU kernels are built: one folder of cadence's cache per hash of the kernel
sources, flags, torch version and Python ABI (shared by checkouts with the same sources, never
overwritten by other sources), and never a silent endless wait on a lock a killed build left.

No compiler runs here: ``torch.utils.cpp_extension.load`` is replaced by a fake that records what it
was asked for and writes the library, and the clock by one that advances only when slept on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from cadence.backends import build_lock, cpu_kernels
from cadence.startup_log import startup

fcntl = pytest.importorskip("fcntl")


@pytest.fixture
def csrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of ``csrc/`` that the build reads instead."""
    copy = tmp_path / "checkout-a" / "csrc"
    shutil.copytree(cpu_kernels._CSRC, copy)
    monkeypatch.setattr(cpu_kernels, "_CSRC", copy)
    return copy


def test_the_key_changes_with_a_source_byte_or_a_flag_and_nothing_else(csrc: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    key = cpu_kernels.build_key()
    assert len(key) == 16 and cpu_kernels.build_key() == key

    header = csrc / "vec.h"
    os.utime(header, (1, 1))  # times are not content
    (csrc / "NOTES.txt").write_text("not read by the build")
    assert cpu_kernels.build_key() == key

    original = header.read_bytes()
    header.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of one header
    changed = cpu_kernels.build_key()
    header.write_bytes(original)
    assert changed != key and cpu_kernels.build_key() == key

    (csrc / "extra.h").write_text("// a new header\n")
    assert cpu_kernels.build_key() != key
    (csrc / "extra.h").unlink()

    monkeypatch.setattr(cpu_kernels, "_FLAGS", [*cpu_kernels._FLAGS, "-DNDEBUG"])
    assert cpu_kernels.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_CSRC", csrc)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_kernels.build_key() != key


@dataclasses.dataclass
class Load:
    name: str
    build_directory: Path
    sources: list[str]
    lock_there: bool


@pytest.fixture
def loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Load]:
    """A fake compiler on an AVX-512 CPU, building into an empty cache; what it was asked for."""
    from torch.utils import cpp_extension

    calls: list[Load] = []

    def load(name: str, sources: list[str], build_directory: str, **kwargs: Any) -> None:
        out = Path(build_directory)
        calls.append(Load(name, out, sources, (out / "lock").exists()))
        (out / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(build_lock.LOCK_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_two_installs_with_the_same_sources_share_one_folder(loads: list[Load], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    checkouts = [tmp_path / name / "csrc" for name in ("checkout-a", "checkout-b", "checkout-c")]
    for copy in checkouts:
        shutil.copytree(cpu_kernels._CSRC, copy)
    (checkouts[2] / "greedy.cpp").write_text((checkouts[2] / "greedy.cpp").read_text() + "\n// changed\n")
    for copy in checkouts:
        monkeypatch.setattr(cpu_kernels, "_CSRC", copy)
        assert cpu_kernels.cpu_ops.__wrapped__() is not None

    a, b, c = loads
    assert a.build_directory == b.build_directory == cpu_kernels._build_directory(a.name.rpartition("_")[2])
    assert a.build_directory.parent == tmp_path / "cache" / "kernels"
    assert a.name == b.name and a.sources == b.sources  # the build file names the same paths
    assert all(Path(source).parent == a.build_directory / "src" for source in a.sources)
    assert c.build_directory != a.build_directory and c.name != a.name
    staged = a.build_directory / "src" / "greedy.cpp"
    assert staged.read_bytes() == (checkouts[0] / "greedy.cpp").read_bytes()  # c left a's folder alone


class FakeClock:
    """``time`` for cpu_kernels and build_lock: starts at the real time, and moves only when slept on, after which
    it runs ``on_sleep(now - start)``."""

    def __init__(self, on_sleep: Callable[[float], None] = lambda waited: None) -> None:
        self.start = self.now = time.time()
        self.on_sleep = on_sleep
        self.sleeps = 0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        assert self.sleeps < 100_000, "waited forever"
        self.now += seconds
        self.on_sleep(self.now - self.start)


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """``said()``: the start-up lines and warnings so far, but for the build's own two lines."""
    caplog.set_level(logging.INFO, logger=startup.name)
    return lambda: [f"{r.levelname}: {r.getMessage()}" for r in caplog.records
                    if (r.name == startup.name or r.levelno >= logging.WARNING) and "compil" not in r.getMessage()]


@pytest.fixture
def build_dir(loads: list[Load]) -> Path:
    folder = cpu_kernels._build_directory()
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def other_builder(build_dir: Path) -> Iterator[IO[str]]:
    """Another process building in ``build_dir`` (pid 4242): it holds cadence.lock and torch's lock."""
    with open(build_dir / "cadence.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write("4242\n")
        handle.flush()
        (build_dir / "lock").touch()
        yield handle


def _finish(handle: IO[str], build_dir: Path) -> None:
    """The other build is done (its sources staged, its library written): torch removes its lock, the
    OS frees cadence.lock."""
    cpu_kernels._stage_sources(build_dir, cpu_kernels._kernel_sources())
    (build_dir / f"{cpu_kernels._module_name(build_dir.name)}.so").write_bytes(b"")
    (build_dir / "lock").unlink()
    fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.mark.parametrize("age_s", [1000.0, 0.0])
def test_a_lock_no_process_holds_is_removed_with_a_warning(age_s: float, build_dir: Path, loads: list[Load],
                                                           said: Callable[[], list[str]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    lock = build_dir / "lock"  # left by a killed build: nobody holds cadence.lock
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    clock = FakeClock()
    monkeypatch.setattr(cpu_kernels, "time", clock)
    monkeypatch.setattr(build_lock, "time", clock)

    assert cpu_kernels.cpu_ops.__wrapped__() is not None
    assert [(load.build_directory, load.lock_there) for load in loads] == [(build_dir, False)]
    assert clock.sleeps == 0  # at once, whatever its age
    warnings = [line for line in said() if line.startswith("WARNING")]
    assert warnings == [f"WARNING: removed the stale kernel build lock {lock}: no process holds cadence.lock, "
                        "under which every build runs, so a killed build left it"]


def test_a_build_in_another_process_is_waited_for_and_then_used(build_dir: Path, other_builder: IO[str],
                                                                loads: list[Load], said: Callable[[], list[str]],
                                                                caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def on_sleep(waited: float) -> None:
        if waited >= 10 and (build_dir / "lock").exists():
            _finish(other_builder, build_dir)

    clock = FakeClock(on_sleep)
    monkeypatch.setattr(cpu_kernels, "time", clock)
    monkeypatch.setattr(build_lock, "time", clock)
    assert cpu_kernels.cpu_ops.__wrapped__() is not None
    assert [load.lock_there for load in loads] == [False] and 10 <= clock.now - clock.start < 11
    assert said() == [f"INFO: waiting for process 4242, which is building the CPU kernels in {build_dir} "
                      "(at most 300 s) ..."]  # no warning, nothing removed
    assert not any("compiling" in record.getMessage() for record in caplog.records)  # its library is used
    assert (build_dir / "cadence.lock").read_text() == f"{os.getpid()}\n"


def test_a_build_that_outlasts_the_bound_is_not_waited_for_longer(build_dir: Path, other_builder: IO[str],
                                                                  loads: list[Load], said: Callable[[], list[str]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_lock.LOCK_TIMEOUT_ENV, "30")
    clock = FakeClock()
    monkeypatch.setattr(cpu_kernels, "time", clock)
    monkeypatch.setattr(build_lock, "time", clock)
    assert cpu_kernels.cpu_ops.__wrapped__() is not None
    assert [load.lock_there for load in loads] == [False] and 30 <= clock.now - clock.start < 31
    lines = said()
    assert lines[0].startswith("INFO: waiting for process 4242")
    assert lines[1] == (f"WARNING: process 4242 has been building the CPU kernels in {build_dir} for over 30 s "
                        f"({build_lock.LOCK_TIMEOUT_ENV}=30); building alongside it")
    assert lines[2].startswith(f"WARNING: removed the stale kernel build lock {build_dir / 'lock'}: still there ")


def test_without_advisory_locks_a_lock_is_waited_for_until_it_goes(build_dir: Path, loads: list[Load],
                                                                   said: Callable[[], list[str]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    lock = build_dir / "lock"
    lock.touch()
    clock = FakeClock(lambda waited: lock.unlink() if waited >= 20 and lock.exists() else None)
    monkeypatch.setattr(cpu_kernels, "time", clock)
    monkeypatch.setattr(build_lock, "time", clock)
    monkeypatch.setattr(build_lock, "fcntl", None)
    assert cpu_kernels.cpu_ops.__wrapped__() is not None
    assert [load.lock_there for load in loads] == [False] and 20 <= clock.now - clock.start < 21
    lines = said()
    assert len(lines) == 1 and lines[0].startswith(f"INFO: waiting for the CPU kernel build that holds {lock}")


def test_without_advisory_locks_a_lock_older_than_the_bound_is_removed(build_dir: Path, loads: list[Load],
                                                                       said: Callable[[], list[str]],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    lock = build_dir / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 301, time.time() - 301))
    clock = FakeClock()
    monkeypatch.setattr(cpu_kernels, "time", clock)
    monkeypatch.setattr(build_lock, "time", clock)
    monkeypatch.setattr(build_lock, "fcntl", None)
    assert cpu_kernels.cpu_ops.__wrapped__() is not None
    assert [load.lock_there for load in loads] == [False] and clock.sleeps == 0
    assert said() == [f"WARNING: removed the stale kernel build lock {lock}: still there 301 s after it was "
                      f"made, longer than any build ({build_lock.LOCK_TIMEOUT_ENV}=300)"]


def test_the_bound_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                said: Callable[[], list[str]]) -> None:
    monkeypatch.setenv(build_lock.LOCK_TIMEOUT_ENV, "12.5")
    assert build_lock.lock_timeout_s() == 12.5
    monkeypatch.setenv(build_lock.LOCK_TIMEOUT_ENV, "soon")
    assert build_lock.lock_timeout_s() == build_lock.LOCK_TIMEOUT_S
    assert said() == [f"WARNING: {build_lock.LOCK_TIMEOUT_ENV}='soon' is not a number of seconds; "
                      "waiting at most 300 s for a kernel build lock"]


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_the_avx2_builds_go_in_folders_of_their_own(capability: str, loads: list[Load],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 quantized linear: its one file, on either CPU; the main kernels: the same sources
    for AVX-512 or over SIMDe for AVX2, in different folders."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.ops, "cadence_avx2", type("Ops", (), {"quant_linear_supported": lambda: True}))
    assert cpu_kernels.avx2_ops.__wrapped__() is torch.ops.cadence_avx2
    assert cpu_kernels.cpu_ops.__wrapped__() is torch.ops.cadence_cpu
    avx2, main = loads
    assert avx2.name.startswith("cadence_cpu_avx2_")
    assert [Path(source).name for source in avx2.sources] == ["quant_linear_avx2.cpp", "bf16_linear_avx2.cpp"]
    assert [Path(source).name for source in main.sources] == list(cpu_kernels._SOURCES)
    assert len({avx2.build_directory, main.build_directory}) == 2
    assert (main.build_directory == cpu_kernels._build_directory()) == (capability == "AVX512")


def test_no_avx2_library_on_other_cpus(loads: list[Load], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert cpu_kernels.avx2_ops.__wrapped__() is None and loads == []
