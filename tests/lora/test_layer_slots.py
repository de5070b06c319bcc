"""The adapted layers' two ways of running a step's rows (``cadence/lora/layer_slots.py``): masked
for a small step, segmented for a large one whose rows the runner grouped by adapter; both equal
each row's own ``x @ A.T @ B.T`` and leave base-model rows alone."""

from __future__ import annotations

import numpy as np
import torch

from cadence.lora.adapter import LoRAWeights
from cadence.lora.layer_slots import SEGMENTED_ROWS, LoRABatch, LoRASlots

OUT = [24, 8, 8]  # q/k/v-like: three parts
IN = 16


def _slots(max_rank: int = 4) -> tuple[LoRABatch, LoRASlots, dict[int, list[LoRAWeights]]]:
    torch.manual_seed(0)
    batch = LoRABatch(3, max_rank, torch.float32, torch.device("cpu"))
    layer = LoRASlots(batch, IN, OUT)
    adapters = {}
    for slot, rank in ((0, 4), (2, 2)):  # slot 1 stays empty; rank 2 leaves zero columns
        parts = [LoRAWeights(torch.randn(rank, IN), torch.randn(out, rank)) for out in OUT]
        layer.load(slot, parts)
        adapters[slot] = parts
    return batch, layer, adapters


def _reference(x: torch.Tensor, row_slots: np.ndarray, adapters: dict[int, list[LoRAWeights]]) -> torch.Tensor:
    rows = []
    for row, slot in zip(x, row_slots, strict=True):
        if slot < 0:
            rows.append(torch.zeros(sum(OUT)))
        else:
            rows.append(torch.cat([w.b @ (w.a @ row) for w in adapters[int(slot)]]))
    return torch.stack(rows)


def test_masked_rows_get_their_own_adapter_s_delta() -> None:
    batch, layer, adapters = _slots()
    row_slots = np.array([2, -1, 0, 0, 2, -1, 0])
    x = torch.randn(len(row_slots), IN)
    batch.set(row_slots)
    assert batch.segments is None
    got = layer(x, torch.zeros(len(row_slots), sum(OUT)))
    torch.testing.assert_close(got, _reference(x, row_slots, adapters))


def test_a_large_grouped_step_runs_segmented_and_equals_the_masked_way() -> None:
    batch, layer, adapters = _slots()
    row_slots = np.repeat([-1, 0, 2], [100, SEGMENTED_ROWS, 50])
    x = torch.randn(len(row_slots), IN)
    batch.set(row_slots)
    assert batch.segments == [(0, 100, 100 + SEGMENTED_ROWS), (2, 100 + SEGMENTED_ROWS, len(row_slots))]
    segmented = layer(x, torch.ones(len(row_slots), sum(OUT)))
    torch.testing.assert_close(segmented, 1 + _reference(x, row_slots, adapters))
    interleaved = row_slots.copy()
    interleaved[[0, 200]] = interleaved[[200, 0]]  # not grouped: masked after all
    batch.set(interleaved)
    assert batch.segments is None
    torch.testing.assert_close(layer(x, torch.zeros(len(row_slots), sum(OUT))), _reference(x, interleaved, adapters))


def test_a_small_step_all_on_one_adapter_runs_through_its_slot_alone() -> None:
    batch, layer, adapters = _slots()
    row_slots = np.array([2, 2, 2])
    x = torch.randn(3, IN)
    batch.set(row_slots)
    assert batch.only_slot == 2 and batch.mask(3) is None
    torch.testing.assert_close(layer(x, torch.zeros(3, sum(OUT))), _reference(x, row_slots, adapters))
    batch.set(np.array([2, 2, -1]))  # a base-model row among them: masked
    assert batch.only_slot == -1 and batch.mask(3) is not None


def test_no_adapter_row_leaves_the_output_as_it_is() -> None:
    batch, layer, _ = _slots()
    out = torch.randn(5, sum(OUT))
    batch.set(None)
    assert layer(torch.randn(5, IN), out.clone()).equal(out)
