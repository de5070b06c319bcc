"""The engine-core process's socket addresses (the process itself runs in the end-to-end tests)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import zmq.asyncio

from cadence.core.core_process import EngineAddresses
from cadence.messages import EngineCoreEvent, EngineCoreInput
from cadence.runtime.zmq_channel import ZmqReceiveChannel, ZmqSendChannel


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point ``tempfile.gettempdir()`` at this test's folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def path_of(address: str) -> Path:
    assert address.startswith("ipc://")
    return Path(address.removeprefix("ipc://"))


def test_fresh_addresses_are_distinct_ipc_paths_in_the_temp_dir(temp_dir: Path) -> None:
    first, second = EngineAddresses.fresh(), EngineAddresses.fresh()
    paths = [path_of(a) for a in (first.input, first.output, second.input, second.output)]
    assert len(set(paths)) == 4
    assert all(p.parent == temp_dir for p in paths)
    assert all(p.name.startswith(f"cadence-{os.getpid()}-") for p in paths)
    assert path_of(first.input).name.endswith("-in") and path_of(first.output).name.endswith("-out")
    # One stem per engine core: its two sockets are told apart by the suffix only.
    assert path_of(first.input).name.removesuffix("-in") == path_of(first.output).name.removesuffix("-out")
    assert not any(p.exists() for p in paths)  # nothing is created until a socket binds


def test_remove_files_deletes_what_exists_and_tolerates_what_does_not(temp_dir: Path) -> None:
    addresses = EngineAddresses.fresh()
    for address in (addresses.input, addresses.output):
        path_of(address).write_bytes(b"")
    addresses.remove_files()
    assert list(temp_dir.iterdir()) == []
    addresses.remove_files()  # both gone: no error
    path_of(addresses.output).write_bytes(b"")
    addresses.remove_files()  # only one left
    assert list(temp_dir.iterdir()) == []


def test_remove_files_leaves_other_files_alone(temp_dir: Path) -> None:
    addresses, other = EngineAddresses.fresh(), EngineAddresses.fresh()
    for address in (addresses.input, other.input, other.output):
        path_of(address).write_bytes(b"")
    addresses.remove_files()
    assert sorted(p.name for p in temp_dir.iterdir()) == sorted(
        path_of(a).name for a in (other.input, other.output))


def test_addresses_are_frozen() -> None:
    addresses = EngineAddresses("ipc:///tmp/x-in", "ipc:///tmp/x-out")
    with pytest.raises(AttributeError):
        addresses.input = "ipc:///tmp/y"  # type: ignore[misc]
    assert addresses == EngineAddresses("ipc:///tmp/x-in", "ipc:///tmp/x-out")


def test_bound_sockets_are_owner_only(temp_dir: Path) -> None:
    """As the engine core binds them; remove_files then leaves nothing behind."""
    addresses = EngineAddresses.fresh()
    context = zmq.asyncio.Context()
    umask = os.umask(0o002)  # a group-writable default, which would let the group connect
    try:
        inputs = ZmqReceiveChannel[object](context, addresses.input, EngineCoreInput, bind=True)
        outputs = ZmqSendChannel[object](context, addresses.output, EngineCoreEvent, bind=True)
    finally:
        os.umask(umask)
    assert [stat.S_IMODE(path_of(a).stat().st_mode) for a in (addresses.input, addresses.output)] == [0o600] * 2
    inputs.close()
    outputs.close()
    context.term()
    addresses.remove_files()
    assert list(temp_dir.iterdir()) == []
