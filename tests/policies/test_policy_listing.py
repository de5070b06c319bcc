"""``cadence policies list``: every installed policy with its options and what each does; a broken
plugin is shown as broken, not a crash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.policies.loader import describe_policies
from cadence.policies.waiting_queue import WaitingQueue

BUILTIN_OPTIONS = {
    "fcfs": ["chunked"], "chunked-prefill": ["chunked"], "priority": ["chunked"], "sjf": ["chunked", "aging"],
    "fair": ["chunked", "input_weight", "output_weight"],
}


@pytest.fixture
def broken_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    info = tmp_path / "broken_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-policy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cadence.policies]\nbroken = no_such_module:Policy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield


def test_the_listing_shows_every_builtin_with_its_documented_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "list", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    for name, options in BUILTIN_OPTIONS.items():
        assert list(listed[name]["options"]) == options
        assert all(listed[name]["options"].values()), f"{name} has an option without a description"
        assert listed[name]["summary"] and listed[name]["target"].startswith("cadence.policies.")
    assert main(["policies", "list"]) == 0
    text = capsys.readouterr().out
    assert "sjf  (cadence.policies.sjf:ShortestJobFirstPolicy)" in text
    assert "    aging    score taken off a waiting request per admission" in text  # aligned with "chunked"


def test_a_plugin_that_fails_to_import_is_listed_as_broken(broken_plugin: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    broken = next(info for info in describe_policies() if info.name == "broken")
    assert broken.error is not None and "no_such_module" in broken.error and not broken.options
    assert main(["policies", "list"]) == 0
    assert "broken  (broken: scheduling policy 'broken' (no_such_module:Policy) failed to import" in \
        capsys.readouterr().out


class _Job:
    def __init__(self, request_id: str, length: int) -> None:
        self.request_id = request_id
        self.length = length


def test_the_waiting_queue_keeps_its_order_as_requests_come_and_go() -> None:
    queue = WaitingQueue(lambda r: r.length)  # type: ignore[attr-defined]
    jobs = {name: _Job(name, length) for name, length in [("a", 5), ("b", 2), ("c", 5), ("d", 1)]}
    for job in jobs.values():
        queue.add(job)  # type: ignore[arg-type]
    queue.add(jobs["a"])  # type: ignore[arg-type]  # already in: keeps its place
    assert [j.request_id for j in queue] == ["d", "b", "a", "c"]  # equal keys in the order added
    assert queue.discard("b") and not queue.discard("b") and "b" not in queue and len(queue) == 3
    queue.add(jobs["b"])  # type: ignore[arg-type]
    assert queue.discard("a")
    queue.add(jobs["a"])  # type: ignore[arg-type]  # back after "c", added before it
    assert [j.request_id for j in queue] == ["d", "b", "c", "a"]
