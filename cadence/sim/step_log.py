"""Simulated steps kept as typed columns: a fleet simulation of a million requests runs tens of millions
of steps, which as objects (about 250 bytes each) would not fit in memory; as columns they take 60."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated step: when it ran, what it computed, and the engine's state after scheduling."""

    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int  # cumulative
    engine: int = 0


# Each field's array type code: doubles for times and usage, 32-bit ints for the counts (a step's KV
# tokens are at most its engine's pool).
_CODES = {name: "d" if name in ("start", "duration", "kv_usage") else "i" for name in StepRecord.__slots__}


class StepLog(Sequence[StepRecord]):
    """Steps in the order they were added, each read back as a :class:`StepRecord`."""

    def __init__(self) -> None:
        self._columns: dict[str, array[Any]] = {name: array(code) for name, code in _CODES.items()}

    def append(self, record: StepRecord) -> None:
        for name, column in self._columns.items():
            column.append(getattr(record, name))

    def extend_columns(self, columns: Mapping[str, np.ndarray | float], num: int) -> None:
        """Add ``num`` steps given field by field (every field): an array of ``num`` values, or one
        value they all share."""
        if columns.keys() != self._columns.keys():
            raise ValueError(f"need every step field, got {sorted(columns)}")
        for name, column in self._columns.items():
            values = columns[name]
            if isinstance(values, np.ndarray):
                if len(values) != num:
                    raise ValueError(f"{name}: {len(values)} values for {num} steps")
                column.frombytes(np.ascontiguousarray(values, dtype=column.typecode).data.cast("B"))
            else:
                column.extend(array(column.typecode, (values,)) * num)

    def column(self, name: str) -> np.ndarray:
        """One field of every step (a read-only view, no copy)."""
        view = np.frombuffer(self._columns[name], dtype=self._columns[name].typecode)
        view.flags.writeable = False
        return view

    @classmethod
    def merged(cls, logs: Sequence[StepLog]) -> StepLog:
        """Several engines' steps as one log, by start (then engine)."""
        if len(logs) == 1:
            return logs[0]
        columns = {name: np.concatenate([log.column(name) for log in logs]) for name in _CODES}
        order = np.lexsort((columns["engine"], columns["start"]))
        log = cls()
        log.extend_columns({name: values[order] for name, values in columns.items()}, len(order))
        return log

    def __len__(self) -> int:
        return len(self._columns["start"])

    @overload
    def __getitem__(self, index: int) -> StepRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepRecord]: ...

    def __getitem__(self, index: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return StepRecord(*(column[index] for column in self._columns.values()))

    def __iter__(self) -> Iterator[StepRecord]:
        return map(StepRecord, *self._columns.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepLog):
            return self._columns == other._columns
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable
