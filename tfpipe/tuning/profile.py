"""Measured per-layer costs of a body: forward and backward time, parameter and activation bytes.

The planner needs, for every layer, what one micro-batch costs at any
micro-batch size. Each layer is built once on one device and timed at two
batch sizes; time is then modelled as `fixed + per_example * b`, which keeps
the per-call overhead that makes small micro-batches relatively expensive on
CPUs (a pure per-example cost would predict that more micro-batches are free).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import apply_layer
from tfpipe.hyperparams import Params
from tfpipe.pipeline import microbatch
from tfpipe.pipeline.executor import float_leaves
from tfpipe.tuning import tensor_split


@dataclasses.dataclass
class Affine:
    """`fixed + per_example * b` seconds for a batch of b examples."""

    fixed: float
    per_example: float

    def __call__(self, batch: float) -> float:
        return self.fixed + self.per_example * batch

    @classmethod
    def fit(cls, sizes: Sequence[int], times: Sequence[float]) -> 'Affine':
        """Least squares through the measurements, both terms kept >= 0."""
        if len(sizes) == 1 or len(set(sizes)) == 1:
            return cls(0.0, float(np.mean(times)) / sizes[0])
        slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
        slope = max(float(slope), 0.0)
        if intercept < 0:
            return cls(0.0, float(np.dot(sizes, times) / np.dot(sizes, sizes)))
        return cls(float(intercept), slope)


@dataclasses.dataclass
class LayerProfile:
    """One layer's measured costs. Bytes per example scale with the micro-batch size.

    Under tensor parallelism (`tensor_split.layer_split`) `split_fraction` of its
    weights, slots and compute is divided over a cell's T devices, and it runs
    `all_reduces` all-reduces of its output per micro-batch forward (as many backward).
    """

    name: str
    # None when profiled for memory alone (`profile_body(timed=False)`, inspect_model).
    forward: Optional[Affine]
    backward: Optional[Affine]  # the gradient computation alone (a recompute adds one forward)
    param_bytes: float
    slot_bytes: float
    input_bytes_per_example: float
    output_bytes_per_example: float
    split_fraction: float = 0.0
    all_reduces: int = 0
    # What one example's forward keeps for the backward (saved_bytes); None: not measured.
    saved_bytes_per_example: Optional[float] = None

    def per_device(self, tensor_parallel: int) -> float:
        """The share of the layer's weights and compute on a cell's home device at T."""
        return 1.0 - self.split_fraction + self.split_fraction / tensor_parallel

    def kept_per_example(self) -> float:
        """Bytes per example held from the forward to the backward without recompute: the
        measured saved tensors, else the layer's input and output."""
        if self.saved_bytes_per_example is not None:
            return self.saved_bytes_per_example
        return self.input_bytes_per_example + self.output_bytes_per_example

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _bytes_per_example(struct: Any) -> float:
    leaves = tf.nest.flatten(struct)
    batch = leaves[0].shape[0]
    return sum(t.shape.num_elements() * t.dtype.size for t in leaves) / batch


# Timed calls of one function stop early once they have taken this long together: the
# minimum of many calls steadies a millisecond's measurement against other processes'
# load, but a call of seconds (a GPT-2-sized body) is steady in itself, and 7 of them
# made planning such a model take many minutes.
TIMING_BUDGET_SECONDS = 2.0


def _fastest_seconds(fn, *args, repeats: int) -> float:
    """The fastest of up to `repeats` calls (fewer once they take TIMING_BUDGET_SECONDS):
    other processes' load only slows a call down, so on a shared machine the minimum is
    the steadiest estimate of the call's own cost. The call after the one that traces
    warms up; when it alone took the budget (a GPT-2-sized body's backward, seconds) it
    is the measurement: another would cost as much and say the same."""
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))  # traces
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
    warm = time.perf_counter() - start
    if warm >= TIMING_BUDGET_SECONDS:
        return warm
    times: list[float] = []
    while len(times) < repeats and sum(times) < TIMING_BUDGET_SECONDS:
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def _call_overhead(x: Any, repeats: int) -> float:
    """Seconds of calling a tf.function that does nothing with `x`.

    Inside the pipeline all layers run in one graph, so the Python-side cost of
    one call per layer is not part of a layer's cost and is subtracted.
    """
    noop = tf.function(lambda v: tf.nest.map_structure(tf.identity, v))
    return _fastest_seconds(noop, x, repeats=repeats)


def slot_bytes_of(optimizer: Optional[Params], variables: Sequence[tf.Variable]) -> float:
    """Bytes of the optimizer's slots for `variables` (Adam: 2x the weights, SGD: 0)."""
    if optimizer is None:
        return 0.0
    opt = optimizer.Instantiate()
    total = 0
    for var in variables:
        for shape in opt._slot_shapes(tf.TensorShape(var.shape)).values():  # noqa: SLF001
            total += int(np.prod(shape, dtype=np.int64)) * var.dtype.size
    return float(total)


def forward_backward(apply: Callable[[Any, Any], Any]) -> Callable[[Any, Any], tuple]:
    """A tf.function (theta, x) -> (gradients of theta and of x's float leaves, output):
    `apply`'s backward with every output's gradient one, as a cell's backward runs."""
    @tf.function
    def fwd_bwd(theta, v):
        leaves = float_leaves(v) + tf.nest.flatten(theta)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(leaves)
            y = apply(theta, v)
        outs = float_leaves(y)
        grads = tape.gradient(outs, leaves, output_gradients=[tf.ones_like(o) for o in outs],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # Embedding lookups give IndexedSlices; the pipeline densifies them too.
        return [tf.convert_to_tensor(g) for g in grads], y
    return fwd_bwd


# Ops whose output shares its input's buffer, and ops that read only their input's shape.
_ALIASING = frozenset({'Identity', 'Reshape', 'ExpandDims', 'Squeeze', 'StopGradient'})
_SHAPE_ONLY = frozenset({'Shape', 'ShapeN', 'Size', 'Rank'})


def saved_bytes(apply: Callable[[Any, Any], Any], theta: Any, x: Any) -> float:
    """Bytes the forward of `apply(theta, x)` keeps for its backward, read from the traced
    graph of both: the forward's tensors (and float inputs) that a gradient op consumes,
    each buffer once (a reshape shares its input's), weights excluded (they live all step).

    Why: a cell that does not recompute holds these for every micro-batch in flight, and a
    recomputing one holds them for the cell during its backward. A Transformer block keeps
    its attention probabilities and feed-forward activations, 10-40x its output, so
    counting only layer inputs and outputs let the planner accept layouts that do not fit.
    Read from the graph before grappler's rewrites, so it needs no allocator statistics."""
    found: list[float] = []

    @tf.function
    def trace(theta, v):
        graph = tf.compat.v1.get_default_graph()
        leaves = float_leaves(v) + tf.nest.flatten(theta)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(leaves)
            first = len(graph.get_operations())
            y = apply(theta, v)
            forward = set(graph.get_operations()[first:])
        outs = float_leaves(y)
        seeds = [tf.ones(o.shape, o.dtype) for o in outs]
        start = len(graph.get_operations())
        tape.gradient(outs, leaves, output_gradients=seeds,
                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
        kept: dict[Any, tf.Tensor] = {}
        for op in graph.get_operations()[start:]:
            if op.type in _SHAPE_ONLY:
                continue
            for t in op.inputs:
                while t.op.type in _ALIASING and t.op.inputs:
                    t = t.op.inputs[0]
                if (t.op in forward and t.op.type not in ('Const', 'ReadVariableOp')) or (
                        t.op.type == 'Placeholder' and t.dtype.is_floating):
                    kept[t.ref()] = t
        found.append(float(sum(t.shape.num_elements() * t.dtype.size for t in kept.values()
                               if t.shape.is_fully_defined())))
        return 0

    trace.get_concrete_function(theta, x)
    return found[-1]


def _timings(apply: Callable[[Any, Any], Any], theta: Any, x: Any, sizes: Sequence[int],
             repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of `apply(theta, x[:b])` for each b, call overhead removed."""
    fwd = tf.function(apply)
    fwd_bwd = forward_backward(apply)
    f_times, b_times = [], []
    for b in sizes:
        xb = tf.nest.map_structure(lambda t, b=b: t[:b], x)
        call = _call_overhead(xb, repeats)
        forward = max(_fastest_seconds(fwd, theta, xb, repeats=repeats) - call, 0.0)
        both = max(_fastest_seconds(fwd_bwd, theta, xb, repeats=repeats) - call, 0.0)
        f_times.append(forward)
        b_times.append(max(both - forward, 0.0))
    return f_times, b_times


def _same_cost_key(layer, x: Any) -> str:
    """What a layer's timing depends on: its definition without its name, and the
    shapes and dtypes of its input. Layers with equal keys (a Transformer's identical
    blocks) cost the same, so profile_body times the first and copies its figures."""
    definition = layer.params.Copy().Set(name='').ToText()
    inputs = [(tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(x)]
    return f'{definition}\n{tf.nest.map_structure(lambda t: 0, x)!r}\n{inputs!r}'


def _scaled(layer_times: list[list[float]], body_times: list[float]) -> list[list[float]]:
    """Scales the layers' times at each size so they add up to the whole body's time.

    A layer timed alone pays dispatch costs that vanish when all layers run in
    one graph, as they do in the pipeline; the body's own time is the truth,
    the single-layer times say how to share it out.
    """
    out = [list(t) for t in layer_times]
    for i, total in enumerate(body_times):
        parts = sum(t[i] for t in layer_times)
        if parts > 0:
            for t in out:
                t[i] *= total / parts
    return out


def profile_body(body: Sequence[Params], sample: Any, device: str,
                 batch_sizes: Sequence[int], optimizer: Optional[Params] = None,
                 repeats: int = 5, timed: bool = True,
                 share_identical: bool = True) -> list[LayerProfile]:
    """Builds `body` on `device` once and measures every layer at each batch size.

    `sample` is a mini-batch of the body's input (nested structures allowed) at
    least `max(batch_sizes)` examples long; each layer gets the previous layer's
    output. The whole body is timed too, and the layers' times are scaled to add
    up to it. Training mode (BatchNorm batch statistics, dropout on) with
    statistics discarded, so profiling changes nothing.

    Not `timed`: bytes alone, forward and backward None. The memory prediction
    (inspect_model) reads no time, and timing is most of the profile's cost: three
    tf.functions traced and called 7 times per layer and batch size.

    `share_identical`: a layer defined like an earlier one (but for its name) and fed
    the same shapes is not timed again; it gets the earlier one's times. A GPT-2-shaped
    body of 12 blocks then times 5 layers, not 17 (benchmarks/profile_speed_benchmark.py
    measures both ways side by side).
    """
    from tfpipe.layers.composite import Sequential  # local: composite imports base_layer only

    sizes = sorted(set(int(b) for b in batch_sizes))
    timings, shapes = [], []
    with tf.device(device):
        seq = Sequential.Params().Set(name='profile', body=list(body)).Instantiate()
        x = tf.nest.map_structure(lambda t: t[:sizes[-1]], sample)
        sink = fprop_context.BatchStatsSink(discard=True)
        with fprop_context.scope(training=True, step=tf.constant(0, tf.int64),
                                 batch_stats=sink):
            timed_by_key: dict[str, tuple[list[float], list[float]]] = {}
            saved_by_key: dict[str, float] = {}
            for index, layer in enumerate(seq.layers):
                def apply(theta, v, layer=layer):
                    return apply_layer(layer, theta, v)
                key = _same_cost_key(layer, x) if share_identical else str(index)
                if timed:
                    if key not in timed_by_key:
                        timed_by_key[key] = _timings(apply, layer.theta, x, sizes, repeats)
                    timings.append(timed_by_key[key])
                if key not in saved_by_key:
                    saved_by_key[key] = saved_bytes(apply, layer.theta, x) / sizes[-1]
                y = apply(layer.theta, x)
                shapes.append((_bytes_per_example(x), _bytes_per_example(y), saved_by_key[key]))
                x = y

            if timed:
                def apply_body(thetas, v):
                    for layer, theta in zip(seq.layers, thetas):
                        v = apply_layer(layer, theta, v)
                    return v
                body_f, body_b = _timings(apply_body, [layer.theta for layer in seq.layers],
                                          tf.nest.map_structure(lambda t: t[:sizes[-1]],
                                                                sample), sizes, repeats)
    if timed:
        forwards = [Affine.fit(sizes, t) for t in _scaled([t[0] for t in timings], body_f)]
        backwards = [Affine.fit(sizes, t) for t in _scaled([t[1] for t in timings], body_b)]
    else:
        forwards = backwards = [None] * len(seq.layers)
    profiles = []
    for layer, forward, backward, (in_bytes, out_bytes, saved) in zip(
            seq.layers, forwards, backwards, shapes):
        variables = layer.trainable_variables
        split_fraction, all_reduces = tensor_split.layer_split(layer)
        profiles.append(LayerProfile(
            name=layer.params.name, forward=forward, backward=backward,
            param_bytes=float(sum(v.shape.num_elements() * v.dtype.size for v in variables)),
            slot_bytes=slot_bytes_of(optimizer, variables),
            input_bytes_per_example=in_bytes, output_bytes_per_example=out_bytes,
            split_fraction=split_fraction, all_reduces=all_reduces,
            saved_bytes_per_example=saved))
    return profiles


def profiling_batch_sizes(batch_size: int, max_micro_batches: int) -> list[int]:
    """The two sizes the affine fit uses: the whole batch and the smallest micro-batch."""
    small = max(1, microbatch.micro_batch_sizes(batch_size, max_micro_batches)[-1])
    return sorted({small, batch_size})
