"""The host memory a trainer's first step still needs, predicted from params alone,
before it traces: so that a model too big for the host says so in one line, with the
prediction, instead of after minutes of tracing (or by the kernel's OOM killer).

When the trainer gets here its variables and optimizer slots already exist, so the
host's available memory already excludes them. What the first step adds is what the
pipeline allocates as it runs: one gradient sum per trainable weight of every replica,
the micro-batches each cell holds between its forward and backward, and the backward
working sets of the tasks that run at once. The last two come from the layers'
`FPropMeta` output shapes (nothing is built or traced) through the same memory model
`--mode=inspect_model` uses (memory_model.cell_memory, in_flight, host_peak), with the
working sets estimated from layer outputs: that misses the tensors inside a layer
(AmoebaNet's cells hold 5-10x their outputs), the input pipeline's buffers and the
update's temporaries. So the figure is a lower bound: a warning is never a false alarm,
and `--mode=inspect_model` measures what it misses.

Only for cells on this host's CPU allocator (logical CPUs): a GPU's or a remote
worker's memory is not the host's, and inspect_model predicts it per device.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import tensorflow as tf

from tfpipe import memory_stats
from tfpipe.base_layer import body_metas
from tfpipe.hyperparams import Params
from tfpipe.pipeline.partition import cell_ranges
from tfpipe.tuning import memory_model, planner
from tfpipe.tuning.profile import Affine, LayerProfile



def size(num_bytes: float) -> str:
    """'359.6 MiB', '22.31 GiB': the trainer's log reads in MiB up to a GiB."""
    if num_bytes >= 2 ** 30:
        return f'{num_bytes / 2 ** 30:.4g} GiB'
    return f'{num_bytes / 2 ** 20:.4g} MiB'


@dataclasses.dataclass(frozen=True)
class FirstStepNeed:
    """Bytes the first step adds to the host beyond what the process holds now."""

    gradient_sums: float
    gathered_weights: float  # stage 3: the whole weights a step gathers beside their parts
    held: float  # micro-batches between forward and backward, every replica's cells
    working: float  # backward working sets of the tasks that run at once
    held_now: float  # this process's resident bytes (variables and slots included)
    available: Optional[float]  # the host's (or its cgroup's) available bytes

    @property
    def total(self) -> float:
        return self.gradient_sums + self.gathered_weights + self.held + self.working

    @property
    def exceeds(self) -> bool:
        return self.available is not None and self.total > self.available

    def line(self) -> str:
        """One log line; with the fix when the need exceeds what is available."""
        available = (f'{size(self.available)} available' if self.available is not None
                     else 'available memory unknown')
        gathered = (f', gathered weights {size(self.gathered_weights)}'
                    if self.gathered_weights else '')
        need = (f'the first step needs at least {size(self.total)} more host memory (gradient '
                f'sums {size(self.gradient_sums)}{gathered}, held micro-batches '
                f'{size(self.held)}, backward working sets {size(self.working)}; predicted from '
                f'the params, before tracing) beside the {size(self.held_now)} this process '
                f'holds; {available}')
        if not self.exceeds:
            return f'host memory: {need}'
        return (f'host memory: {need}: it will not fit; recompute more cells '
                f'(task.pipeline.recompute=always), use more micro-batches or a smaller batch, '
                f'or spread the cells over more hosts; --mode=inspect_model measures the '
                f'working sets this lower bound leaves out')


def static_profiles(body: Sequence[Params], input_shapes: Any) -> list[LayerProfile]:
    """Each layer's input and output bytes per example, from `FPropMeta` (no weights,
    no times: the state is already allocated, the times are not needed here)."""
    batch = tf.nest.flatten(input_shapes)[0][0]
    out = []
    shapes = input_shapes
    for p, meta in zip(body, body_metas(body, input_shapes)):
        size = tf.as_dtype(p.fprop_dtype).size if p.fprop_dtype is not None else 4
        def per_example(struct):
            return sum(s.num_elements() for s in tf.nest.flatten(struct)) * size / batch
        out.append(LayerProfile(p.name, Affine(0.0, 0.0), Affine(0.0, 0.0), 0.0, 0.0,
                                per_example(shapes), per_example(meta.out_shapes)))
        shapes = meta.out_shapes
    return out


def predict(pipe, body: Sequence[Params], inputs: Any,
            trainable: Sequence[tf.Variable]) -> Optional[FirstStepNeed]:
    """What `pipe`'s first step on `inputs` (this process's batch, as the pipeline
    takes it) adds to the host, `trainable` being every replica's trainable variables
    in this process; None when the cells are not this host's logical CPUs or a layer
    has no `FPropMeta` (a user's layer need not: then inspect_model is the way)."""
    cells = [cell for replica in pipe.replica_cells for cell in replica]
    if memory_stats.allocator_devices([c.device for c in cells]) != ['CPU:0']:
        return None
    shapes = tf.nest.map_structure(lambda t: tf.TensorShape(t.shape), inputs)
    try:
        profiles = static_profiles(body, shapes)
    except NotImplementedError:
        return None
    m = pipe.params.num_micro_batches
    micro_batch = tf.nest.flatten(shapes)[0][0] / (pipe.num_replicas * m)
    ranges = cell_ranges(pipe.balance)
    memory, held = [], []
    for replica in pipe.replica_cells:
        layouts = [memory_model.CellLayout(c.device, start, stop, c.recompute)
                   for c, (start, stop) in zip(replica, ranges)]
        for k, mem in enumerate(memory_model.cell_memory(profiles, layouts, micro_batch)):
            memory.append(mem)
            held.append(memory_model.in_flight(pipe.params.schedule, len(layouts), k, m)
                        * mem.stash)
    parallelism = min(m, planner.local_parallelism(
        tf.config.threading.get_intra_op_parallelism_threads()))
    activations = memory_model.host_peak(memory, held, parallelism).activations
    gradient_sums = float(sum(v.shape.num_elements() * v.dtype.size for v in trainable))
    gathered = 0.0
    if pipe.weight_shards is not None:  # stage 3: `trainable` are the parts; a step holds
        parts, whole = pipe.weight_shards.Bytes()  # each weight and its gradient sum whole
        gradient_sums = float(whole * pipe.num_replicas)
        gathered = float((whole - parts) * pipe.num_replicas)
    return FirstStepNeed(
        gradient_sums=gradient_sums, gathered_weights=gathered, held=float(sum(held)), working=activations - float(sum(held)),
        held_now=float(_resident_bytes()), available=available_bytes())


def _resident_bytes() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def available_bytes() -> Optional[float]:
    """MemAvailable of /proc/meminfo, or less when this process's cgroup (v2 or v1)
    caps it lower: under Slurm or a container the cap, not the host, is what OOMs."""
    try:
        with open('/proc/meminfo') as f:
            fields = dict(line.split(':', 1) for line in f)
        host = float(fields['MemAvailable'].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    for limit_file, usage_file in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                                   ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                                    '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 2 ** 62:  # 'max' or the v1 no-limit sentinel
            return min(host, float(int(limit) - int(usage)))
    return host
