"""Measured memory of what a training step holds beyond the model's state.

Two things the model's sizes cannot tell, measured with the allocator's own
statistics (`tf.config.experimental.get_memory_info`: the BFC allocator on CPUs,
which the trainer turns on, and every GPU):

- a cell's working set: the bytes its forward + backward on one micro-batch holds
  at its fullest. With recompute, a cell's backward replays the forward and keeps
  every tensor the gradients need, inside the layers too (a separable convolution's
  intermediates, attention's probabilities), which the layers' outputs understate
  several times over;
- what a cell that does not recompute keeps per micro-batch between its forward and
  its backward: the same tensors the gradients need, for every micro-batch in flight
  (a tiny LM: 3.5 times its layers' outputs);
- the optimizer update's temporaries: Adam's update of a weight computes its moments,
  their bias corrections, the square root and the quotient, several of them of the
  weight's size alive at once, and the updates of different weights run side by side on
  the inter-op threads (a 10.5M-weight MLP: 2.8-3.6 times its 40 MiB of weights above
  the state, SGD's 1-1.2 times);
- the input pipeline's bytes: what it keeps once its buffers are full (its shuffle
  buffer and prefetched batches, a user's in-memory arrays), and what it holds at
  its fullest while filling them: packing a long document into LM rows holds the
  document's tokens several times over for a moment (tfpipe/lm_inputs.py), 5 MB of
  text about 190 MiB.

Each returns None when the allocator keeps no statistics, so callers can fall back
to an estimate and say so.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tfpipe import fprop_context, optimizers
from tfpipe.hyperparams import Params
from tfpipe.memory_stats import allocator_devices
from tfpipe.pipeline.executor import float_leaves
from tfpipe.tuning.profile import forward_backward

SETTLE_SECONDS = 0.05  # between looks at the allocator while prefetch threads fill
SETTLE_LOOKS = 40
TRACES_FOR_SAVED = 2  # per function, when a cell's saved bytes are measured
UPDATE_TRACES = 8  # the most traces of the update measured (measure_update)
UPDATE_BUDGET_SECONDS = 2.0  # a further trace only while the measurement took less


def _allocator(device: str) -> Optional[str]:
    names = allocator_devices([device])
    if not names:
        return None
    try:
        info = tf.config.experimental.get_memory_info(names[0])
    except (ValueError, tf.errors.InvalidArgumentError):
        return None
    return names[0] if info['peak'] > 0 or info['current'] > 0 else None


def _current(allocator: str) -> int:
    return int(tf.config.experimental.get_memory_info(allocator)['current'])


@dataclasses.dataclass(frozen=True)
class CellMeasurement:
    """One cell on one micro-batch: `working` bytes of its forward + backward at their
    fullest, and `input_bytes`, what a recomputing cell keeps per micro-batch in flight
    (in the compute dtype: bfloat16 halves it, which layer profiles in float32 miss).

    `saved`: for a cell that does not recompute (when measured), the bytes one
    micro-batch's forward keeps for its backward, which every micro-batch in flight
    holds; None for a recomputing cell. `loss_gradients`: the last cell's output bytes
    (float leaves), 0 for the others: the pipeline differentiates the loss at each
    micro-batch's forward and keeps that gradient until the micro-batch's backward.
    """

    working: float
    input_bytes: float
    saved: Optional[float] = None
    loss_gradients: float = 0.0


def measure_cells(cells: Sequence[Any], theta: dict, inputs: Any, num_micro_batches: int,
                  repeats: int = 3, measure_saved: bool = False
                  ) -> Optional[list[CellMeasurement]]:
    """Per cell: the peak bytes of its forward + backward on one micro-batch of
    `inputs` above what was allocated before the call (the fewest of `repeats` calls
    after a warm-up: other threads only add), and the bytes of that cell's input.
    With `measure_saved` and more than one micro-batch, a cell that does not recompute
    is also measured on two (`two_forwards_then_backwards`): their peak above one's is
    what a micro-batch in flight keeps (with one micro-batch the working set holds it).

    Training mode with batch statistics discarded, as the profiler runs, so
    measuring changes nothing. Each cell gets the previous cell's output.
    """
    allocator = _allocator(cells[0].device)
    if allocator is None:
        return None
    size = tf.nest.flatten(inputs)[0].shape[0] // num_micro_batches
    x = tf.nest.map_structure(lambda t: t[:size], inputs)
    # A second micro-batch of other examples: grappler would compute equal inputs once.
    x2 = tf.nest.map_structure(lambda t: t[size:2 * size], inputs)
    measure_saved = (measure_saved and num_micro_batches > 1
                     and any(not cell.recompute for cell in cells))
    working = []
    sink = fprop_context.BatchStatsSink(discard=True)
    with fprop_context.scope(training=True, step=tf.constant(0, tf.int64), batch_stats=sink):
        for k, cell in enumerate(cells):
            def apply(th, v, cell=cell):
                return cell.forward(th, v)
            cell_theta = cell.read_theta(theta)
            kept = None
            with tf.device(cell.device):
                if measure_saved and not cell.recompute:
                    # The difference of two peaks, each set by how one trace's threads
                    # order the backward (one micro-batch's: 0.87-1.08 MiB over six
                    # traces of a tiny LM's cell): the fewest of two traces each.
                    one, (_, y) = _fewest_peak(allocator, lambda: forward_backward(apply),
                                               (cell_theta, x), repeats, TRACES_FOR_SAVED)
                    both, (_, y2) = _fewest_peak(
                        allocator, lambda: two_forwards_then_backwards(apply),
                        (cell_theta, x, x2), repeats, TRACES_FOR_SAVED)
                    # What a micro-batch keeps is alive when its backward starts, so
                    # within the one micro-batch's peak.
                    kept = min(max(0.0, both - one), one)
                else:
                    step = forward_backward(apply)
                    one, (_, y) = _fewest_peak(allocator, lambda: step, (cell_theta, x),
                                               repeats)
                    if measure_saved:  # the next cell's second micro-batch
                        y2 = step(cell_theta, x2)[1]
            last = k == len(cells) - 1
            working.append(CellMeasurement(one, _num_bytes(x), kept,
                                           _num_bytes(float_leaves(y)) if last else 0.0))
            x = y
            if measure_saved:
                x2 = y2
    return working


def _fewest_peak(allocator: str, make: Callable[[], Callable[..., Any]], args: tuple,
                 repeats: int, traces: int = 1) -> tuple[float, Any]:
    """The fewest peak bytes (`call_peaks`) of `traces` functions `make()`, each traced
    and warmed up on `args`, then called `repeats` times; and the first's warm-up
    output."""
    fewest, first = None, None
    for _ in range(traces):
        fn = make()
        out = fn(*args)
        first = out if first is None else first
        peak = float(min(call_peaks(allocator, lambda fn=fn: fn(*args), repeats)))
        fewest = peak if fewest is None else min(fewest, peak)
    return fewest, first


def two_forwards_then_backwards(apply: Callable[[Any, Any], Any]
                                ) -> Callable[[Any, Any, Any], tuple]:
    """A tf.function (theta, x1, x2) -> (summed gradients, second output) running as a
    pipeline's executor runs a cell that keeps its activations over two micro-batches:
    both forwards under tapes, the second after the first, then the second's backward
    and after it the first's (every output's gradient one). Its peak above one
    micro-batch's forward + backward is what the first keeps while it waits.

    Without the ordering the executor's threads may run the first forward after the
    second backward, and hold nothing across.
    """
    @tf.function
    def run(theta, v1, v2):
        tapes, after = [], []
        for v in (v1, v2):
            with tf.control_dependencies(after):
                v = tf.nest.map_structure(tf.identity, v)
            leaves = float_leaves(v) + tf.nest.flatten(theta)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(leaves)
                y = apply(theta, v)
            after = float_leaves(y)
            tapes.append((tape, leaves, after))
        total = None
        for tape, leaves, outs in reversed(tapes):
            with tf.control_dependencies(after):
                seeds = [tf.ones_like(o) for o in outs]
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(
                outs, leaves, output_gradients=seeds,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)]
            after = grads
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        return total, y
    return run


def call_peaks(allocator: str, call: Callable[[], Any], repeats: int) -> list[int]:
    """The peak bytes of each of `repeats` calls of `call` (traced and warmed up before)
    above what was allocated before that call; its outputs are dropped after each."""
    peaks = []
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats(allocator)
        before = _current(allocator)
        outputs = call()
        peaks.append(int(tf.config.experimental.get_memory_info(allocator)['peak']) - before)
        del outputs
    return peaks


def measure_update(optimizer: Params, variables: dict[str, tf.Variable],
                   clip_norm: Optional[float], update_fn: Callable[..., tf.Tensor],
                   repeats: int = 8, traces: int = UPDATE_TRACES,
                   budget_seconds: float = UPDATE_BUDGET_SECONDS,
                   threads: int = 1) -> Optional[float]:
    """Peak bytes of the trainer's update of `variables` above its inputs and the
    gradients: `update_fn` (the trainer's trainer.guarded_update: global-norm clipping at
    `clip_norm`, then `optimizer`'s Apply under its finite-loss tf.cond) in a
    tf.function, the most of `repeats` updates after a warm-up, since how many
    temporaries are alive at once depends on how the threads order the update's ops, and
    a run meets the worst of its steps. None without allocator statistics for the
    variables' host.

    The order differs from trace to trace of the same function as well as from call to
    call (tests.memory_models.WideMLP: the most of 8 calls was 96 to 168 MiB over 8
    traces in one process), so the function is traced again, up to `traces` times,
    while the measurement has taken less than `budget_seconds`: a small model's update
    (a trace and 8 calls in 0.3-0.5 s) gets them all, GPT2SmallShapedLM's (5-7 s) one.
    Even the most of 64 calls was 120 to 160 MiB from process to process, so with
    `threads` > 1 (the inter-op threads) the result is never below the updates of the
    `threads` largest weights, each measured alone, added up: the order in which every
    thread is at a different weight's fullest moment (WideMLP's two wide weights: 104
    and 72 MiB alone, 176 together; the trainer's update held up to 184 MiB).

    The gradients are made inside the function, as the trainer's step makes its sums:
    an op may then reuse a gradient's buffer once nothing else reads it. Captured
    gradients (constants of the function, never reusable) with the update outside the
    cond held 726 MiB above the state for GPT2SmallShapedLM, this form 249-310 MiB, and
    the trainer's measured peak allows at most 360 (docs/memory.md). Their bytes are
    part of the predicted state (gradient sums), so they are taken off the peak.

    Copies of the weights and a fresh optimizer stand in, so measuring changes neither
    the model nor its slots.
    """
    allocator = _allocator(next(iter(variables.values())).device) if variables else None
    if allocator is None:
        return None
    copies = {}
    for path, var in variables.items():
        with tf.device(var.device):
            copies[path] = tf.Variable(var.read_value(), trainable=False)
    rule = optimizer.Instantiate()
    rule.CreateSlots(copies)
    step = tf.Variable(0, dtype=tf.int64)
    gradient_bytes = _num_bytes(list(copies.values()))

    def traced() -> Callable[[], tf.Tensor]:
        @tf.function(autograph=False)
        def update() -> tf.Tensor:
            grads = {}
            for path, var in copies.items():
                with tf.device(var.device):  # a product, not a constant: see above
                    grads[path] = var.read_value() * tf.constant(1e-3, var.dtype)
            return update_fn(tf.constant(0.0), [grads], clip_norm, [rule], [copies],
                             tf.constant(1e-3), step)
        update()  # traces
        return update

    start, worst = time.monotonic(), 0
    for trace in range(traces):
        if trace and time.monotonic() - start >= budget_seconds:
            break
        worst = max(worst, max(call_peaks(allocator, traced(), repeats)))
    measured = max(0.0, float(worst) - gradient_bytes)
    if threads <= 1 or len(variables) <= 1:
        return measured
    largest = sorted(variables, key=lambda path: -variables[path].shape.num_elements())
    alone = [measure_update(optimizer, {path: variables[path]}, clip_norm, update_fn,
                            repeats, traces, budget_seconds) for path in largest[:threads]]
    return max(measured, sum(a for a in alone if a is not None))


def _num_bytes(struct: Any) -> float:
    return float(sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(struct)))


@dataclasses.dataclass(frozen=True)
class InputMeasurement:
    """The training input's bytes: `resident` once its buffers are full (held while
    every step runs), `peak` at its fullest while it filled them (never below
    `resident`)."""

    resident: float
    peak: float


def measure_input_pipeline(input_params: Params, device: str = 'CPU:0',
                           batches: int = 3) -> Optional[InputMeasurement]:
    """The training input's bytes as the trainer's first `next()` meets them: its
    iterator after `batches` batches (shuffle buffer full, prefetch buffer refilled),
    holding the last batch as the trainer does. None without allocator statistics
    for `device`'s host.

    Call it before other tf.data iterators of this process are dropped: an
    iterator's buffers are freed by its threads after it goes, and a free during
    the measurement would be taken off it.
    """
    allocator = _allocator(device)
    if allocator is None:
        return None
    gc.collect()  # tensors the caller dropped would be freed during, and taken off
    tf.config.experimental.reset_memory_stats(allocator)
    before = _current(allocator)
    iterator = input_params.Instantiate().Iterator()
    for _ in range(batches):
        batch = next(iterator)
    now, looks = _current(allocator), 0
    while looks < SETTLE_LOOKS:  # prefetch threads fill their buffer after next() returns
        time.sleep(SETTLE_SECONDS)
        later = _current(allocator)
        if later == now:
            break
        now, looks = later, looks + 1
    peak = int(tf.config.experimental.get_memory_info(allocator)['peak'])
    del batch, iterator
    return InputMeasurement(float(now - before), float(max(peak, now) - before))
