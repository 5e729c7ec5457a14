"""Predicted bytes per device of a pipelined training step, by what holds them.

A device holds, for the cells placed on it:
  weights         the cells' parameters (resident);
  gradient sums   one set of the same size: the running sums over micro-batches,
                  which the update reads at the end of the step (the executors keep
                  one set, not one per micro-batch: docs/memory.md);
  optimizer slots the optimizer's state per weight (Adam's two moments: twice the
                  weights), divided by R when the slots are sharded over R replicas;
  held            the micro-batches in flight between their forward and backward:
                  a recomputing cell keeps only its input per micro-batch, a cell
                  that does not recompute what its backward needs (measured, else
                  every layer's output), the last cell also the loss's gradient. fill_drain
                  has all M micro-batches in flight on every cell; the other
                  schedules at most K - k on cell k (1F1B's bound);
  working set     what one backward task holds while it runs: the recomputed
                  forward's saved tensors and the gradients in flight. It is
                  measured per cell (tfpipe/tuning/working_memory.py) when the
                  allocator keeps statistics; without them it is estimated as one
                  micro-batch's layer outputs, which misses every tensor inside a
                  layer (AmoebaNet's cells hold 5-10x their outputs).

`predict` gives each device's peak as if the device had its own allocator (a GPU):
its state plus its fullest moment, the first backward. Logical CPUs share the
host's allocator and its cores, so `host_peak` adds every device's state, the input
pipeline's buffers and the held micro-batches, but the working sets of only as many
backward tasks as run at once on the host's cores; and it compares that with the
moment before the first step, when the input fills its buffers (a long document
packed into LM rows can make that the larger of the two).
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, Sequence

from tfpipe.tuning.profile import LayerProfile


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Where a cell's layers are and how it trains: body layers [start, stop)."""

    device: str
    start: int
    stop: int
    recompute: bool


@dataclasses.dataclass(frozen=True)
class CellMemory:
    """One cell's bytes: `static` all step, `stash` per micro-batch in flight, `working`
    while one of its backward tasks runs."""

    device: str
    static: float
    stash: float
    working: float


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Predicted bytes on one device."""

    device: str
    weights: float
    gradient_sums: float
    slots: float
    held: float
    working: float

    @property
    def activations(self) -> float:
        return self.held + self.working

    @property
    def total(self) -> float:
        return self.weights + self.gradient_sums + self.slots + self.activations

    def describe(self) -> str:
        def mib(num_bytes: float) -> str:
            return f'{num_bytes / 2 ** 20:.4g}'
        return (f'{self.device}: weights {mib(self.weights)} MiB  gradient sums '
                f'{mib(self.gradient_sums)} MiB  optimizer slots {mib(self.slots)} MiB  '
                f'activations {mib(self.activations)} MiB (held micro-batches '
                f'{mib(self.held)}, backward working set {mib(self.working)})  total '
                f'{mib(self.total)} MiB')


def in_flight(schedule: str, num_cells: int, cell: int, num_micro_batches: int) -> int:
    """Micro-batches cell `cell` holds between forward and backward at most."""
    if schedule == 'fill_drain':
        return num_micro_batches
    return min(num_micro_batches, num_cells - cell)


def cell_memory(profiles: Sequence[LayerProfile], cells: Sequence[CellLayout],
                micro_batch_size: float, slot_shards: int = 1,
                working_bytes: Optional[Sequence[float]] = None,
                input_bytes: Optional[Sequence[float]] = None,
                saved_bytes: Optional[Sequence[Optional[float]]] = None,
                loss_gradient_bytes: Optional[Sequence[float]] = None) -> list[CellMemory]:
    """Each cell's static, stash and working bytes.

    `working_bytes[k]`: cell k's measured forward + backward peak on one micro-batch
    (working_memory.measure_cells). It includes the saved activations that a cell
    without recompute already stashes, so those are taken out of it once: its
    measured `saved_bytes[k]` (what one micro-batch's forward keeps for its backward,
    inside the layers too: attention's probabilities, a feed-forward's hidden
    activations) when given and not None, never less than its layers' outputs. Without
    measurements, the layers' profiled saved tensors (`LayerProfile.saved_bytes_per_example`,
    else their outputs) stand for both.
    `input_bytes[k]`: cell k's measured input per micro-batch, in the compute dtype;
    else the profiled layer's (float32). `loss_gradient_bytes[k]`: what cell k keeps per
    micro-batch for the loss (the last cell's output gradient, taken at its forward),
    which its measured working set held as the output gradient it started from.
    """
    out = []
    for k, cell in enumerate(cells):
        layers = profiles[cell.start:cell.stop]
        weights = sum(p.param_bytes for p in layers)
        static = 2 * weights + sum(p.slot_bytes for p in layers) / slot_shards
        outputs = micro_batch_size * sum(p.output_bytes_per_example for p in layers)
        kept = micro_batch_size * sum(p.output_bytes_per_example
                                      if p.saved_bytes_per_example is None
                                      else p.saved_bytes_per_example for p in layers)
        if cell.recompute:
            if input_bytes is not None:
                stash = input_bytes[k]
            else:
                stash = micro_batch_size * layers[0].input_bytes_per_example if layers else 0.0
            working = kept if working_bytes is None else working_bytes[k]
        else:
            if saved_bytes is not None and saved_bytes[k] is not None:
                stash = max(saved_bytes[k], outputs)
            else:
                stash = kept
            working = 0.0 if working_bytes is None else max(working_bytes[k] - stash, 0.0)
        if loss_gradient_bytes is not None:  # the measured working set's output gradient
            stash += loss_gradient_bytes[k]
            working = max(working - loss_gradient_bytes[k], 0.0)
        out.append(CellMemory(cell.device, static, stash, working))
    return out


def predict(profiles: Sequence[LayerProfile], cells: Sequence[CellLayout],
            micro_batch_size: float, num_micro_batches: int, schedule: str,
            slot_shards: int = 1, working_bytes: Optional[Sequence[float]] = None,
            input_bytes: Optional[Sequence[float]] = None,
            saved_bytes: Optional[Sequence[Optional[float]]] = None,
            loss_gradient_bytes: Optional[Sequence[float]] = None) -> list[DeviceMemory]:
    """Bytes per device (in the order devices first appear among `cells`) of one
    replica's training step. `slot_shards` = R when the optimizer slots are sharded
    over R replicas (each keeps 1/R), else 1. `working_bytes`, `input_bytes`,
    `saved_bytes`, `loss_gradient_bytes`: measured per cell, see `cell_memory`."""
    totals: dict[str, list[float]] = {}
    memory = cell_memory(profiles, cells, micro_batch_size, slot_shards, working_bytes,
                         input_bytes, saved_bytes, loss_gradient_bytes)
    for k, (cell, mem) in enumerate(zip(cells, memory)):
        layers = profiles[cell.start:cell.stop]
        weights = sum(p.param_bytes for p in layers)
        held = in_flight(schedule, len(cells), k, num_micro_batches) * mem.stash
        parts = totals.setdefault(cell.device, [0.0] * 5)
        for i, value in enumerate((weights, weights,
                                   sum(p.slot_bytes for p in layers) / slot_shards,
                                   held, mem.working)):
            parts[i] += value
    return [DeviceMemory(device, *parts) for device, parts in totals.items()]


@dataclasses.dataclass(frozen=True)
class HostPeak:
    """The predicted peak of one allocator shared by logical CPUs, by phase.

    state           every cell's static bytes (weights, gradient sums, slots);
    input_resident  what the input pipeline keeps once its buffers are full;
    input_peak      what it holds at its fullest while it fills them;
    activations     every cell's held micro-batches and the working sets of the
                    backward tasks that run at once;
    update          the optimizer update's temporaries above the state, once every
                    gradient is summed (measured: working_memory.measure_update for
                    tfpipe's optimizers, keras_memory for Keras'; Adam's hold about
                    three times the weights at once, more than a wide MLP's backward).
    """

    state: float
    input_resident: float
    input_peak: float
    activations: float
    update: float = 0.0

    @property
    def training(self) -> float:
        """A step at its fullest, beside the input's full buffers."""
        return self.state + self.input_resident + self.activations

    @property
    def filling(self) -> float:
        """The trainer's first `next()`: the input fills its buffers before any step
        runs (the gradient sums, counted in `state`, do not exist yet: an overstatement
        of one set of weights)."""
        return self.state + self.input_peak

    @property
    def updating(self) -> float:
        """The update, after the pipeline's last backward, beside the input's buffers."""
        return self.state + self.input_resident + self.update

    @property
    def peak(self) -> float:
        """What the trainer's progress line measures on a run whose input fills its
        buffers once, before the first step."""
        return max(self.training, self.filling, self.updating)

    @property
    def refill_bound(self) -> float:
        """The peak if the input fills its buffers again while a step runs: its next
        epoch (the shuffle buffer refills) or a long document read later in the stream
        (tf.data's threads read ahead during steps), or the update."""
        return (self.state + max(self.input_peak, self.input_resident)
                + max(self.activations, self.update))


def host_peak(memory: Sequence[CellMemory], held: Sequence[float], parallelism: float,
              input_bytes: float = 0.0, input_peak: float = 0.0) -> HostPeak:
    """Peak bytes of one allocator shared by the cells `memory` (logical CPUs of one
    host, every replica's cells): their static bytes, the input pipeline's
    `input_bytes` (`input_peak` while it fills), every cell's `held` bytes at their
    fullest, and the working sets of the `parallelism` largest cells at once: as many
    backward tasks as run side by side (no more than the host's cores, nor than the
    micro-batches, since cell k's backward on a micro-batch waits for cell k+1's on
    the same one: the caller's bound).

    Playing the schedule's ticks instead would be exact only if tasks took equal
    time; a backward that recomputes takes about three forwards, so the backwards of
    neighbouring cells overlap in 1F1B as much as in fill-drain (measured: 0.71x of
    the peak predicted by ticks for the Transformer's 1F1B, 0.92x by this bound).
    """
    slots = max(1, int(parallelism))
    return HostPeak(state=sum(m.static for m in memory), input_resident=input_bytes,
                    input_peak=max(input_peak, input_bytes),
                    activations=sum(held) + sum(heapq.nlargest(slots,
                                                               (m.working for m in memory))))
