"""Predicted bytes per device of a pipelined training step, by what holds them.

A device holds, for the cells placed on it:
  weights         the cells' parameters (resident);
  gradient sums   one set of the same size: the running sums over micro-batches,
                  which the update reads at the end of the step (the executors keep
                  one set, not one per micro-batch: docs/memory.md);
  optimizer slots the optimizer's state per weight (Adam's two moments: twice the
                  weights), divided by R when the slots are sharded over R replicas;
  activations     the micro-batches in flight between their forward and backward:
                  a recomputing cell keeps only its input per micro-batch, plus one
                  micro-batch's layer outputs while its backward recomputes them; a
                  cell that does not recompute keeps every layer's output per
                  micro-batch. fill_drain has all M micro-batches in flight on every
                  cell; the other schedules at most K - k on cell k (1F1B's bound).

The layer sizes come from `profile.LayerProfile` (measured on a real batch), so
this module only adds them up; it predicts the peak as if every part peaked at
once, which the measured peak (tfpipe/memory_stats.py) bounds from below.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tfpipe.tuning.profile import LayerProfile


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Where a cell's layers are and how it trains: body layers [start, stop)."""

    device: str
    start: int
    stop: int
    recompute: bool


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Predicted bytes on one device."""

    device: str
    weights: float
    gradient_sums: float
    slots: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradient_sums + self.slots + self.activations

    def describe(self) -> str:
        mib = 2 ** 20
        return (f'{self.device}: weights {self.weights / mib:.1f} MiB  gradient sums '
                f'{self.gradient_sums / mib:.1f} MiB  optimizer slots {self.slots / mib:.1f} '
                f'MiB  activations {self.activations / mib:.1f} MiB  total '
                f'{self.total / mib:.1f} MiB')


def in_flight(schedule: str, num_cells: int, cell: int, num_micro_batches: int) -> int:
    """Micro-batches cell `cell` holds between forward and backward at most."""
    if schedule == 'fill_drain':
        return num_micro_batches
    return min(num_micro_batches, num_cells - cell)


def predict(profiles: Sequence[LayerProfile], cells: Sequence[CellLayout],
            micro_batch_size: float, num_micro_batches: int, schedule: str,
            slot_shards: int = 1) -> list[DeviceMemory]:
    """Bytes per device (in the order devices first appear among `cells`) of one
    replica's training step. `slot_shards` = R when the optimizer slots are sharded
    over R replicas (each keeps 1/R), else 1."""
    totals: dict[str, list[float]] = {}
    for k, cell in enumerate(cells):
        layers = profiles[cell.start:cell.stop]
        weights = sum(p.param_bytes for p in layers)
        outputs = micro_batch_size * sum(p.output_bytes_per_example for p in layers)
        held = in_flight(schedule, len(cells), k, num_micro_batches)
        if cell.recompute:
            inputs = micro_batch_size * layers[0].input_bytes_per_example if layers else 0.0
            activations = held * inputs + outputs
        else:
            activations = held * outputs
        parts = totals.setdefault(cell.device, [0.0] * 4)
        for i, value in enumerate((weights, weights,
                                   sum(p.slot_bytes for p in layers) / slot_shards,
                                   activations)):
            parts[i] += value
    return [DeviceMemory(device, *parts) for device, parts in totals.items()]
