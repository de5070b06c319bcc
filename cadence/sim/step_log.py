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


# The fields that differ between the steps of a run of decode-only steps, each in its own typed column:
# doubles for times and usage, 32-bit ints for KV tokens (at most the engine's pool).
_OWN_CODES = {"start": "d", "duration": "d", "kv_tokens": "i", "kv_usage": "d"}
# The other fields, counts that a run's steps share, as 32-bit ints packed step by step in one array:
# a run adds them in one call, not eight (as twelve columns the log cost a tenth of a fleet simulation).
_PACKED = tuple(name for name in StepRecord.__slots__ if name not in _OWN_CODES)
_FIELDS = dict.fromkeys(StepRecord.__slots__)  # every field, in order (a dict: its keys compare as a set)


class StepLog(Sequence[StepRecord]):
    """Steps in the order they were added, each read back as a :class:`StepRecord`."""

    def __init__(self) -> None:
        self._columns: dict[str, array[Any]] = {name: array(code) for name, code in _OWN_CODES.items()}
        self._packed: array[int] = array("i")  # len(_PACKED) values a step

    def append(self, record: StepRecord) -> None:
        for name, column in self._columns.items():
            column.append(getattr(record, name))
        self._packed.extend([getattr(record, name) for name in _PACKED])

    def extend_columns(self, columns: Mapping[str, np.ndarray | float], num: int) -> None:
        """Add ``num`` steps given field by field (every field): an array of ``num`` values, or one
        value they all share."""
        if columns.keys() != _FIELDS.keys():
            raise ValueError(f"need every step field, got {sorted(columns)}")
        for name, values in columns.items():
            if isinstance(values, np.ndarray) and len(values) != num:
                raise ValueError(f"{name}: {len(values)} values for {num} steps")
        for name, column in self._columns.items():
            values = columns[name]
            if isinstance(values, np.ndarray):
                column.frombytes(np.ascontiguousarray(values, dtype=column.typecode).data.cast("B"))
            else:
                column.extend(array(column.typecode, (values,)) * num)
        shared = [columns[name] for name in _PACKED]
        if any(isinstance(values, np.ndarray) for values in shared):
            rows = np.empty((num, len(_PACKED)), dtype=self._packed.typecode)
            for k, values in enumerate(shared):
                rows[:, k] = values
            self._packed.frombytes(rows.data.cast("B"))
        else:
            self._packed.extend(array(self._packed.typecode, shared) * num)  # type: ignore[arg-type]

    def extend_decodes(self, starts: np.ndarray, durations: np.ndarray, kv_tokens: np.ndarray, kv_usage: np.ndarray,
                       num_seqs: int, num_preemptions: int, engine: int) -> None:
        """Add a run of decode-only steps (``sim/decode_run.py``): each step's start, duration, KV tokens
        and usage, and what they share: ``num_seqs`` requests, all running and decoding, none waiting.
        :meth:`extend_columns` without its checks of every field, in a fifth of its time (a fleet
        simulation adds two runs a request)."""
        if not len(starts) == len(durations) == len(kv_tokens) == len(kv_usage):
            raise ValueError(f"a run's columns differ in length: {len(starts)}, {len(durations)}, "
                             f"{len(kv_tokens)}, {len(kv_usage)}")
        columns = self._columns
        for name, values in (("start", starts), ("duration", durations), ("kv_tokens", kv_tokens),
                             ("kv_usage", kv_usage)):
            column = columns[name]
            column.frombytes(values.astype(column.typecode, copy=False).tobytes())
        # _PACKED's order (checked below the class): a tuple, not a dict by name, a third of the call's time.
        row = (num_seqs, num_seqs, 0, num_seqs, num_seqs, 0, num_preemptions, engine)
        self._packed.extend(array(self._packed.typecode, row) * len(starts))

    def column(self, name: str) -> np.ndarray:
        """One field of every step (a read-only view, no copy)."""
        if name in self._columns:
            view = np.frombuffer(self._columns[name], dtype=self._columns[name].typecode)
        else:
            packed = np.frombuffer(self._packed, dtype=self._packed.typecode)
            view = packed.reshape(-1, len(_PACKED))[:, _PACKED.index(name)]
        view.flags.writeable = False
        return view

    @classmethod
    def merged(cls, logs: Sequence[StepLog]) -> StepLog:
        """Several engines' steps as one log, by start (then engine)."""
        if len(logs) == 1:
            return logs[0]
        columns = {name: np.concatenate([log.column(name) for log in logs]) for name in _FIELDS}
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
        if not -len(self) <= index < len(self):
            raise IndexError("step index out of range")
        index %= len(self)
        row = self._packed[index * len(_PACKED):(index + 1) * len(_PACKED)]
        fields = {name: column[index] for name, column in self._columns.items()} | dict(zip(_PACKED, row, strict=True))
        return StepRecord(**fields)

    def __iter__(self) -> Iterator[StepRecord]:
        fields = self._columns | {name: self._packed[k::len(_PACKED)] for k, name in enumerate(_PACKED)}
        return map(StepRecord, *(fields[name] for name in _FIELDS))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepLog):
            return self._columns == other._columns and self._packed == other._packed
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable


assert _PACKED == ("num_seqs", "num_tokens", "prefill_tokens", "decode_seqs", "num_running", "num_waiting",
                   "num_preemptions", "engine"), "StepLog.extend_decodes writes a run's packed row in this order"
