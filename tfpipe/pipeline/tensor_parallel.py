"""Tensor parallelism: one cell across T devices (Megatron-style layers), in one graph.

With `tensor_parallel=T` every cell of a PipeliningLayer spans T devices: its
*home* device (shard 0, where the cell's input arrives, its output leaves and
the executor orders its tasks) and T-1 more. Replica r, cell k, shard t uses
device slot (r*K + k)*T + t of the R*K*T slots (`layout`).

A tensor-parallel layer (tfpipe/layers/tensor_parallel_dense.py) holds 1/T of
each split weight on each of the group's devices (`BaseLayer.CreateVariableShards`)
and computes its part there; the parts meet through TensorFlow's collectives
(`collective_ops.all_reduce` / `all_gather`, v1: the v2 ops hung in one process,
see the shared notes). Every other layer runs on the home device alone, on one
variable: the activations that enter and leave a split layer are the only things
that travel. Why shard 0 rather than replicated on all T devices (Megatron's
SPMD): a composite layer is Python calling its children on one tensor, so
replicated compute would need every activation between split layers as T
per-device tensors through every layer's code (each cell built as T programs);
a non-split weight keeps one variable and one set of optimizer slots; and the
executor, the cell functions and the schedules do not change. Exactness does not
decide it: both layouts are exact under autodiff when every collective has its
true gradient. What it costs: the activation goes out to T devices and comes
back at each split layer (`scatter`/`reduce_to_home`, the same two collectives
per pair Megatron's f and g are), and the non-split layers' compute and
activations stay on the home device.

Gradients are the true derivatives of the single graph, so any composition is
exact: all_reduce's gradient is an all-reduce of the output gradients, an
all-gather's is each device's slice of the summed output gradients, the
scatter's (copies of the home tensor) is the sum of the copies' gradients. Every
collective is launched on all T devices whenever any of its outputs is used
(each output waits for all T), and an unused output's gradient is zeros, so no
member is ever left waiting.

Collective keys: one group key per device tuple and a fresh instance key per
collective built (replicas.new_instance_key): a cell function traced once and
called per micro-batch reuses its keys only sequentially (the executor chains a
device's calls), which TensorFlow allows, as tf.distribute does across steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # the public tf.distribute wraps these

from tfpipe import devices as devices_lib
from tfpipe.build_scope import BuildScope
from tfpipe.pipeline import replicas


def check_tensor_parallel(value: Any) -> int:
    """T as an int >= 1, else a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'tensor_parallel={value!r} must be an int >= 1 (1: each cell on one '
                         'device)')
    return value


def layout(slots: Sequence[str], num_replicas: int, num_devices: int,
           tensor_parallel: int) -> list[list[tuple[str, ...]]]:
    """[replica][cell] -> the cell's T devices: slot (r*K + k)*T + t, shard 0 first."""
    t = tensor_parallel
    return [[tuple(slots[(r * num_devices + k) * t:(r * num_devices + k + 1) * t])
             for k in range(num_devices)] for r in range(num_replicas)]


def resolve_layout(devices: Optional[Sequence[str]], num_replicas: int, num_devices: int,
                   tensor_parallel: int) -> list[list[tuple[str, ...]]]:
    """The devices of every (replica, cell slot) group: `devices` (R*K*T of them, or
    None for the defaults, see tfpipe.devices.resolve) laid out by `layout`.

    Asking for more than there are is one line naming the count R x K x T."""
    t = check_tensor_parallel(tensor_parallel)
    need = num_replicas * num_devices * t
    if t > 1:
        available = (len(devices) if devices is not None else
                     None if devices_lib.remote_devices_by_task() else
                     len(tf.config.list_logical_devices('GPU') or
                         tf.config.list_logical_devices('CPU')))
        if available is not None and need > available:
            raise ValueError(
                f'num_replicas x cells x tensor_parallel = {num_replicas} x {num_devices} x '
                f'{t} = {need} devices but {available} are available: lower one of them, or '
                'give more devices (the trainer: --num_logical_cpus with --run_locally=cpu)')
    slots = devices_lib.resolve(devices, need)
    return layout(slots, num_replicas, num_devices, t)


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """The T devices of one cell (shard t on devices[t]; devices[0] is the home device).

    Tensor-parallel layers build their shards and collectives through it. Lists
    of per-shard tensors ("shards") are in device order.
    """

    devices: tuple[Optional[str], ...]

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def home(self) -> Optional[str]:
        return self.devices[0]

    def device(self, t: int):
        """A device scope for shard t (nothing to set for the single-device group: the
        caller's scope holds, which tf.device(None) would clear)."""
        device = self.devices[t]
        return tf.device(device) if device is not None else contextlib.nullcontext()

    # -- Entering and leaving the split region -------------------------------------------

    def scatter(self, x: tf.Tensor) -> list[tf.Tensor]:
        """A copy of `x` (on the home device) on each device; its gradient is the
        sum of the copies' gradients (a collective all-reduce, kept on the home device)."""
        if self.size == 1:
            return [x]

        @tf.custom_gradient
        def scatter(x):
            copies = []
            for t in range(self.size):
                with self.device(t):
                    copies.append(tf.identity(x))

            def grad(*dys):
                return self._all_reduce(self._zeros_for(dys, copies), 'scatter_grad')[0]
            return copies, grad
        return list(scatter(x))

    def reduce_to_home(self, parts: Sequence[tf.Tensor]) -> tf.Tensor:
        """The sum of per-device partial results, on the home device (Megatron's g);
        its gradient is the output gradient copied to every device."""
        if self.size == 1:
            return parts[0]

        @tf.custom_gradient
        def reduce(*parts):
            total = self._all_reduce(list(parts), 'reduce')[0]

            def grad(dy):
                out = []
                for t in range(self.size):
                    with self.device(t):
                        out.append(tf.identity(dy))
                return out
            return total, grad
        return reduce(*parts)

    def gather_to_home(self, parts: Sequence[tf.Tensor], axis: int = -1) -> tf.Tensor:
        """The per-device parts concatenated along `axis`, on the home device; each
        part's gradient is its slice of the output gradient, on its own device."""
        if self.size == 1:
            return parts[0]
        return self.all_gather(parts, axis)[0]

    def local(self, t: int, fn: Callable[..., tf.Tensor], *args: tf.Tensor) -> tf.Tensor:
        """fn(*args) on device t, with its gradient computed on device t as well.

        A tape places gradient ops under the device scope of whoever asks for the
        gradient (the executor: the home device), which would compute every shard's
        weight gradient on shard 0; this records the shard's own tape and replays it
        on its device. fn returns one float tensor; args are float tensors.
        """
        if self.size == 1:
            return fn(*args)

        @tf.custom_gradient
        def local(*args):
            with self.device(t):
                # Persistent: a split backward (zb_*) asks for the input and the weight
                # gradients in two tasks.
                with tf.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
                    tape.watch(args)
                    y = fn(*args)

            def grad(dy):
                with self.device(t):
                    return tape.gradient(y, list(args), output_gradients=dy,
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return y, grad
        return local(*args)

    # -- Collectives with their true gradients ------------------------------------------

    def all_reduce(self, parts: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Every device gets the sum of the parts; the gradient is the same all-reduce
        of the output gradients (zeros for outputs nobody used)."""
        if self.size == 1:
            return list(parts)

        @tf.custom_gradient
        def all_reduce(*parts):
            outs = self._all_reduce(list(parts), 'all_reduce')

            def grad(*dys):
                return self._all_reduce(self._zeros_for(dys, outs), 'all_reduce_grad')
            return outs, grad
        return list(all_reduce(*parts))

    def all_gather(self, parts: Sequence[tf.Tensor], axis: int = -1) -> list[tf.Tensor]:
        """Every device gets the parts concatenated along `axis` (equal parts); part t's
        gradient is slice t of the all-reduced output gradients."""
        if self.size == 1:
            return list(parts)
        rank = parts[0].shape.rank
        axis = axis % rank

        @tf.custom_gradient
        def all_gather(*parts):
            outs = self._all_gather(list(parts), axis)

            def grad(*dys):
                summed = self._all_reduce(self._zeros_for(dys, outs), 'all_gather_grad')
                out = []
                for t, s in enumerate(summed):
                    with self.device(t):
                        out.append(tf.split(s, self.size, axis=axis)[t])
                return out
            return outs, grad
        return list(all_gather(*parts))

    def split(self, x: tf.Tensor, axis: int = -1) -> list[tf.Tensor]:
        """Slice t of a home tensor `x` along `axis` on device t (gradient: the slices'
        gradients concatenated on the home device)."""
        if self.size == 1:
            return [x]
        pieces = []
        for t in range(self.size):
            with self.device(t):
                pieces.append(tf.identity(tf.split(x, self.size, axis=axis)[t]))
        return pieces

    # -- Raw collectives ----------------------------------------------------------------

    def _zeros_for(self, dys: Sequence[Optional[tf.Tensor]],
                   outs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        out = []
        for t, (d, o) in enumerate(zip(dys, outs)):
            with self.device(t):
                out.append(tf.zeros_like(o) if d is None else tf.convert_to_tensor(d))
        return out

    def _launch(self, build: Callable[[int], tf.Tensor], name: str) -> list[tf.Tensor]:
        """One collective op per device; each output waits for every member, so
        whichever output is used, all T members run (none waits forever)."""
        raw = []
        for t in range(self.size):
            with self.device(t), tf.name_scope(f'tp_{name}_{t}'):
                raw.append(build(t))
        if tf.executing_eagerly():
            return raw
        outs = []
        for t, r in enumerate(raw):
            with self.device(t), tf.control_dependencies(raw):
                outs.append(tf.identity(r))
        return outs

    def _all_reduce(self, parts: list[tf.Tensor], name: str) -> list[tf.Tensor]:
        group, instance = replicas.group_key(self.devices), replicas.new_instance_key()
        return self._run(lambda ps: self._launch(
            lambda t: collective_ops.all_reduce(ps[t], self.size, group, instance, 'Add', 'Id',
                                                communication_hint='auto'), name), parts)

    def _all_gather(self, parts: list[tf.Tensor], axis: int) -> list[tf.Tensor]:
        """all_gather (v1) concatenates along axis 0: gather the parts moved to the
        front and move the axis back."""
        group, instance = replicas.group_key(self.devices), replicas.new_instance_key()
        rank = parts[0].shape.rank
        perm = [axis] + [i for i in range(rank) if i != axis]
        inverse = [perm.index(i) for i in range(rank)]

        def build(ps):
            def member(t):
                front = tf.transpose(ps[t], perm) if axis else ps[t]
                out = collective_ops.all_gather(front, self.size, group, instance,
                                                communication_hint='auto')
                return tf.transpose(out, inverse) if axis else out
            return self._launch(member, 'all_gather')
        return self._run(build, parts)

    @staticmethod
    def _run(build: Callable[[list[tf.Tensor]], list[tf.Tensor]],
             parts: list[tf.Tensor]) -> list[tf.Tensor]:
        """build(parts): the collectives, whose gradients the callers define. The raw ops
        have none, so no tape may see them: their inputs are gradient-stopped. Eagerly
        they run as one function call, because an eager op would wait for members that
        the single Python thread has not issued yet."""
        parts = [tf.stop_gradient(p) for p in parts]
        if tf.executing_eagerly():
            return tf.function(lambda *ps: build(list(ps)), autograph=False)(*parts)
        return build(parts)


SINGLE = TensorParallelGroup((None,))


def local_copy(weight: tf.Tensor, read_on: Sequence[str], devices: Sequence[str]) -> tf.Tensor:
    """A gradient-stopped copy of a cell's weight on the device that uses it: for a
    shard read on read_on[t], devices[t] (the same shard of another replica's cell);
    otherwise the current device scope's (the cell's home device)."""
    where = '' if tf.executing_eagerly() else weight.device
    if where and where in read_on[1:]:
        with tf.device(devices[list(read_on).index(where)]):
            return tf.stop_gradient(weight)
    return tf.stop_gradient(weight)


def building_on(devices: Sequence[str]) -> contextlib.AbstractContextManager:
    """`building` for the group of `devices`."""
    return building(TensorParallelGroup(tuple(devices)))


_building: BuildScope[TensorParallelGroup] = BuildScope(SINGLE)


def building(group: TensorParallelGroup) -> contextlib.AbstractContextManager:
    """Layers created inside split themselves over `group` (PipeliningLayer sets it
    around each cell's layers; outside, a layer builds for one device)."""
    return _building.setting(group)


def current_group() -> TensorParallelGroup:
    """The group being built for: the current cell's, else the single-device group."""
    return _building.current()
