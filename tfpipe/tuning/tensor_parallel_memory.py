"""Predicted bytes per device with tensor parallelism: each shard device's part of the state.

A layer profile (profile.py) is measured on one device at T=1, so its parameter and
slot bytes are the whole layer's. With `tensor_parallel=T` a split layer keeps 1/T
of its weights, gradient sums and optimizer slots on each of its cell's T devices,
and every other layer keeps all of them on the home device
(docs/tensor_parallel.md). `shares` reads which fraction of each body layer's
variable bytes (or, given the optimizer, of its slot bytes: Adafactor keeps a
factored moment whole on every shard) lies on each shard from the built pipeline
itself, `home_profiles` scales the profiles to the home device's part (what
memory_model.predict then places on the home device), and `shard_memory`
predicts the other T-1 devices:
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

import tensorflow as tf

from tfpipe import variable_shards
from tfpipe.hyperparams import Params
from tfpipe.tuning import memory_model
from tfpipe.tuning.profile import LayerProfile


def shares(pipe: Any, optimizer: Optional[Params] = None) -> list[list[float]]:
    """Per body layer (in order), the fraction of its variable bytes on each shard of its
    cell (shard 0: the home device), read from replica 0's variables. With `optimizer`,
    the fraction of its T=1 slot bytes (the trainable variables' slots, as profiled) that
    each shard's slots hold: the variable shares for an element-wise rule, more for
    Adafactor, whose factored moment reduced along the split axis every shard holds whole
    (tfpipe/split_statistics.py), so the fractions may sum to more than 1."""
    rule = optimizer.Instantiate() if optimizer is not None else None
    out = []
    for cell in pipe.replica_cells[0]:
        for layer in cell.layers:
            per_shard = [0.0] * len(cell.shard_devices)
            total, wholes = 0.0, set()
            for var in layer.VariablesByPath().values():
                if rule is not None and not var.trainable:
                    continue
                where = var.device
                index = cell.shard_devices.index(where) if where in cell.shard_devices else 0
                per_shard[index] += variable_bytes(var.shape, var.dtype, rule)
                sharded = variable_shards.of(var)
                if sharded is None:
                    total += variable_bytes(var.shape, var.dtype, rule)
                elif id(sharded) not in wholes:
                    wholes.add(id(sharded))
                    total += variable_bytes(sharded.shape, var.dtype, rule)
            out.append([b / total if total else float(t == 0) for t, b in enumerate(per_shard)])
    return out


def variable_bytes(shape: Any, dtype: Any, rule: Any) -> float:
    """Bytes of a variable of `shape`, or with `rule` (an optimizer) of its slots."""
    shapes = rule.SlotShapes(shape).values() if rule is not None else [shape]
    return float(sum(tf.TensorShape(s).num_elements() for s in shapes) * dtype.size)


def home_profiles(profiles: Sequence[LayerProfile], layer_shares: Sequence[Sequence[float]],
                  slot_shares: Optional[Sequence[Sequence[float]]] = None
                  ) -> list[LayerProfile]:
    """The profiles with parameter and slot bytes cut to the home device's share
    (`slot_shares`: the slots', when not the variables' own, `shares(pipe, optimizer)`)."""
    slot_shares = layer_shares if slot_shares is None else slot_shares
    return [dataclasses.replace(p, param_bytes=p.param_bytes * s[0],
                                slot_bytes=p.slot_bytes * ss[0])
            for p, s, ss in zip(profiles, layer_shares, slot_shares)]


def shard_memory(profiles: Sequence[LayerProfile], layer_shares: Sequence[Sequence[float]],
                 cells: Sequence[memory_model.CellLayout],
                 shard_devices: Sequence[Sequence[str]], micro_batch_size: float,
                 num_micro_batches: int, schedule: str, slot_shards: int = 1,
                 slot_shares: Optional[Sequence[Sequence[float]]] = None
                 ) -> list[memory_model.DeviceMemory]:
    """Bytes on the shard devices 1..T-1 of each cell (one replica's); `slot_shares` as
    for home_profiles."""
    slot_shares = layer_shares if slot_shares is None else slot_shares
    out = []
    for k, (cell, devices) in enumerate(zip(cells, shard_devices)):
        layers = list(range(cell.start, cell.stop))
        for t, device in enumerate(devices[1:], start=1):
            weights = sum(profiles[i].param_bytes * layer_shares[i][t] for i in layers)
            slots = sum(profiles[i].slot_bytes * slot_shares[i][t] for i in layers)
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
            input_bytes: Optional[Sequence[float]] = None,
            optimizer: Optional[Params] = None,
            saved_bytes: Optional[Sequence[Optional[float]]] = None,
            loss_gradient_bytes: Optional[Sequence[float]] = None) -> Prediction:
    """Every device's bytes of one training step of the built `pipe`, from the T=1 layer
    `profiles` (their slots of `optimizer`, the trainer's: its slots of a split weight
    are placed as `shares(pipe, optimizer)` says); `replicas` are the cells' layouts of
    each replica (memory_model.predict has the other arguments)."""
    params = pipe.params
    m, schedule = params.num_micro_batches, params.schedule
    home = list(profiles)
    if params.tensor_parallel > 1:
        layer_shares = shares(pipe)
        slot_shares = shares(pipe, optimizer) if optimizer is not None else layer_shares
        home = home_profiles(profiles, layer_shares, slot_shares)
    devices = [memory_model.predict(home, cells, micro_batch_size, m, schedule, slot_shards,
                                    working_bytes, input_bytes, saved_bytes,
                                    loss_gradient_bytes) for cells in replicas]
    shard_devices: list[memory_model.DeviceMemory] = []
    if params.tensor_parallel > 1:
        for r, cells in enumerate(replicas):
            ours = shard_memory(profiles, layer_shares, cells,
                                [cell.shard_devices for cell in pipe.replica_cells[r]],
                                micro_batch_size, m, schedule, slot_shards, slot_shares)
            devices[r] += ours
            shard_devices += ours
    return Prediction(devices, shard_devices, home)
