"""The simulator's step log: steps kept as typed columns, added one by one or many at once."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.sim.step_log import StepLog, StepRecord


def _record(start: float, engine: int = 0) -> StepRecord:
    return StepRecord(start, 0.25, 3, 3, 0, 3, 96, 3, 0, 0.5, 1, engine)


def test_steps_added_as_columns_read_back_as_the_same_records() -> None:
    one_by_one, in_bulk = StepLog(), StepLog()
    for start in (0.0, 0.25, 0.5):
        one_by_one.append(_record(start))
    in_bulk.extend_columns({"start": np.array([0.0, 0.25, 0.5]), "duration": 0.25, "num_seqs": 3, "num_tokens": 3,
                            "prefill_tokens": 0, "decode_seqs": 3, "kv_tokens": np.full(3, 96), "num_running": 3,
                            "num_waiting": 0, "kv_usage": np.full(3, 0.5), "num_preemptions": 1, "engine": 0}, 3)
    assert in_bulk == one_by_one and len(in_bulk) == 3
    assert in_bulk[1] == _record(0.25) and in_bulk[1:] == [_record(0.25), _record(0.5)]
    assert in_bulk[-1] == _record(0.5) and list(in_bulk) == list(one_by_one)
    with pytest.raises(IndexError):
        in_bulk[3]
    assert in_bulk.column("num_preemptions").tolist() == [1, 1, 1] and in_bulk.column("kv_tokens").tolist() == [96] * 3
    mixed = StepLog()  # a field given as an array among those a run's steps share
    mixed.extend_columns({name: np.array([getattr(_record(0.0), name), getattr(_record(0.25, 2), name)])
                          for name in StepRecord.__slots__}, 2)
    assert list(mixed) == [_record(0.0), _record(0.25, 2)] and mixed.column("engine").tolist() == [0, 2]


def test_a_run_of_decodes_reads_back_as_the_same_records_as_its_steps_one_by_one() -> None:
    one_by_one, run = StepLog(), StepLog()
    one_by_one.append(_record(0.0))
    run.append(_record(0.0))
    records = [StepRecord(0.25 * k, 0.25, 3, 3, 0, 3, 96 + 3 * k, 3, 0, 0.5 - k / 64, 1, 7) for k in range(1, 4)]
    for record in records:
        one_by_one.append(record)
    run.extend_decodes(np.array([0.25, 0.5, 0.75]), np.full(3, 0.25), np.array([99, 102, 105]),
                       0.5 - np.arange(1, 4) / 64, num_seqs=3, num_preemptions=1, engine=7)
    assert run == one_by_one and list(run)[1:] == records
    assert run.column("kv_tokens").tolist() == [96, 99, 102, 105] and run.column("engine").tolist() == [0, 7, 7, 7]
    with pytest.raises(ValueError, match="a run's columns differ in length: 3, 2, 3, 3"):
        run.extend_decodes(np.zeros(3), np.zeros(2), np.zeros(3, dtype=np.int64), np.zeros(3), 3, 1, 7)
    assert len(run) == 4  # nothing added


def test_a_merged_log_orders_steps_by_start_then_engine() -> None:
    first, second = StepLog(), StepLog()
    for start in (0.0, 1.0):
        first.append(_record(start, engine=0))
    second.append(_record(0.0, engine=1))
    assert [(r.start, r.engine) for r in StepLog.merged([second, first])] == [(0.0, 0), (0.0, 1), (1.0, 0)]


def test_columns_must_name_every_field_and_match_the_count() -> None:
    fields = dict.fromkeys(StepRecord.__slots__, 0)
    with pytest.raises(ValueError, match="need every step field"):
        StepLog().extend_columns({name: v for name, v in fields.items() if name != "engine"}, 1)
    with pytest.raises(ValueError, match="start: 2 values for 3 steps"):
        StepLog().extend_columns(fields | {"start": np.zeros(2)}, 3)
