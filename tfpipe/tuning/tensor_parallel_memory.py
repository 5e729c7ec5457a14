"""Predicted bytes per device with tensor parallelism: each shard device's part of the state.

A layer profile (profile.py) is measured on one device at T=1, so its parameter and
slot bytes are the whole layer's. With `tensor_parallel=T` a split layer keeps 1/T
of its weights, gradient sums and optimizer slots on each of its cell's T devices,
and every other layer keeps all of them on the home device
(docs/tensor_parallel.md). `shares` reads which fraction of each body layer's
variable bytes lies on each shard from the built pipeline itself, `home_profiles`
scales the profiles to the home device's part (what memory_model.predict then
places on the home device), and `shard_memory` predicts the other T-1 devices:
their state exactly as the shares say, and as activations the split layers'
boundary tensors of one micro-batch (the input copy and the partial sum at full
width, an estimate: logical CPUs share one allocator, so a shard's working set
cannot be measured apart), held per micro-batch in flight only when the cell does
not recompute. `predict` puts these together for every replica's devices: what
`--mode=inspect_model` prints and benchmarks/table1_tensor_parallel.py searches.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from tfpipe.tuning import memory_model
from tfpipe.tuning.profile import LayerProfile


def shares(pipe: Any) -> list[list[float]]:
    """Per body layer (in order), the fraction of its variable bytes on each shard of its
    cell (shard 0: the home device), read from replica 0's variables."""
    out = []
    for cell in pipe.replica_cells[0]:
        for layer in cell.layers:
            per_shard = [0.0] * len(cell.shard_devices)
            for var in layer.VariablesByPath().values():
                size = var.shape.num_elements() * var.dtype.size
                where = var.device
                index = cell.shard_devices.index(where) if where in cell.shard_devices else 0
                per_shard[index] += size
            total = sum(per_shard)
            out.append([b / total if total else float(t == 0) for t, b in enumerate(per_shard)])
    return out


def home_profiles(profiles: Sequence[LayerProfile],
                  layer_shares: Sequence[Sequence[float]]) -> list[LayerProfile]:
    """The profiles with parameter and slot bytes cut to the home device's share."""
    return [dataclasses.replace(p, param_bytes=p.param_bytes * s[0],
                                slot_bytes=p.slot_bytes * s[0])
            for p, s in zip(profiles, layer_shares)]


def shard_memory(profiles: Sequence[LayerProfile], layer_shares: Sequence[Sequence[float]],
                 cells: Sequence[memory_model.CellLayout],
                 shard_devices: Sequence[Sequence[str]], micro_batch_size: float,
                 num_micro_batches: int, schedule: str, slot_shards: int = 1
                 ) -> list[memory_model.DeviceMemory]:
    """Bytes on the shard devices 1..T-1 of each cell (one replica's)."""
    out = []
    for k, (cell, devices) in enumerate(zip(cells, shard_devices)):
        layers = list(range(cell.start, cell.stop))
        for t, device in enumerate(devices[1:], start=1):
            weights = sum(profiles[i].param_bytes * layer_shares[i][t] for i in layers)
            slots = sum(profiles[i].slot_bytes * layer_shares[i][t] for i in layers)
            boundary = micro_batch_size * sum(
                profiles[i].input_bytes_per_example + profiles[i].output_bytes_per_example
                for i in layers if layer_shares[i][t] > 0)
            held = 0.0 if cell.recompute else memory_model.in_flight(
                schedule, len(cells), k, num_micro_batches) * boundary
            out.append(memory_model.DeviceMemory(device, weights, weights,
                                                 slots / slot_shards, held, boundary))
    return out


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted bytes of every device of a pipeline (tensor-parallel or not)."""

    devices: list[list[memory_model.DeviceMemory]]  # per replica: home, then shard devices
    shard_devices: list[memory_model.DeviceMemory]  # every replica's shard devices 1..T-1
    home_profiles: list[LayerProfile]  # the profiles cut to the home devices' state

    @property
    def largest(self) -> float:
        """The fullest device's bytes: what a per-device memory budget must hold."""
        return max(d.total for replica in self.devices for d in replica)


def predict(pipe: Any, profiles: Sequence[LayerProfile],
            replicas: Sequence[Sequence[memory_model.CellLayout]], micro_batch_size: float,
            slot_shards: int = 1, working_bytes: Optional[Sequence[float]] = None,
            input_bytes: Optional[Sequence[float]] = None) -> Prediction:
    """Every device's bytes of one training step of the built `pipe`, from the T=1 layer
    `profiles`; `replicas` are the cells' layouts of each replica (memory_model.predict
    has the other arguments)."""
    params = pipe.params
    m, schedule = params.num_micro_batches, params.schedule
    home = list(profiles)
    if params.tensor_parallel > 1:
        layer_shares = shares(pipe)
        home = home_profiles(profiles, layer_shares)
    devices = [memory_model.predict(home, cells, micro_batch_size, m, schedule, slot_shards,
                                    working_bytes, input_bytes) for cells in replicas]
    shard_devices: list[memory_model.DeviceMemory] = []
    if params.tensor_parallel > 1:
        for r, cells in enumerate(replicas):
            ours = shard_memory(profiles, layer_shares, cells,
                                [cell.shard_devices for cell in pipe.replica_cells[r]],
                                micro_batch_size, m, schedule, slot_shards)
            devices[r] += ours
            shard_devices += ours
    return Prediction(devices, shard_devices, home)
