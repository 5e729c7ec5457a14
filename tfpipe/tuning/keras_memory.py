"""The host peak that `fit` of a tfpipe.keras pipeline should reach, predicted.

The same model of memory as `--mode=inspect_model` (memory_model.HostPeak), fed
from what a Keras model has instead of layer profiles:

  state        every cell's weights, one set of gradient sums of the same size
               (the executor's running sums) and the optimizer's own variables,
               counted after `optimizer.build` (Adam: two per weight);
  held         what each cell keeps per micro-batch in flight (all M with
               fill-drain, at most K - k with 1F1B): its input when it recomputes,
               else its measured forward-and-backward bytes (which include the
               saved tensors: an overstatement by the backward's gradients);
  working set  each recomputing cell's forward + backward on one micro-batch,
               measured (working_memory.measure_cells), for as many cells as run
               their backward at once on the host's cores;
  input        what `fit` reads, as Keras' own data adapter serves it (arrays:
               it holds x and y whole, and shuffles and prefetches batches; a
               tf.data.Dataset as built), measured like the trainer's input
               (working_memory). Arrays are prefetched with AUTOTUNE, whose buffers
               grow when the CPUs are contended (7 and 13 MiB more in 2 fits of 9 at
               load 20): a Dataset with explicit buffers keeps the input at its measure;
  update       the optimizer's temporaries while it applies the summed gradients
               (tfpipe.keras starts the update only then), measured on copies of
               the weights with a fresh optimizer of the same config.

Needs allocator statistics (TF_CPU_ALLOCATOR_USE_BFC=true, set before TensorFlow
loads) and cells on logical CPUs of this process; else None.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow as tf

from tfpipe import keras as tfpipe_keras
from tfpipe import memory_stats
from tfpipe.tuning import memory_model, planner, working_memory


def _bytes(variables) -> float:
    return float(sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in variables))


class _FitInput:
    """Keras' data adapter over (x, y) as `fit` builds it, as an input params would
    instantiate (working_memory.measure_input_pipeline's interface)."""

    def __init__(self, x: Any, y: Any, batch_size: Optional[int]):
        self._args = (x, y, batch_size)

    def Instantiate(self) -> '_FitInput':
        return self

    def Iterator(self):
        from keras.src.trainers.data_adapters import get_data_adapter
        x, y, batch_size = self._args
        adapter = get_data_adapter(x, y, batch_size=batch_size, shuffle=True)
        return iter(adapter.get_tf_dataset())


def _update_bytes(optimizer: Any, weights: list, allocator: str, repeats: int = 4) -> float:
    """Peak bytes of `optimizer`'s update of `weights` above its inputs: the most of
    `repeats` updates after a warm-up, since how many temporaries are alive at once
    depends on how the threads order the update's ops (Keras' Adam on a 14 MiB
    weight: 28 MiB mostly, 50 MiB at times), and a fit meets the worst of its steps.

    Copies of the weights, zero gradients and a fresh optimizer of the same config
    stand in, so measuring changes neither the model nor its optimizer.
    """
    copies, grads = [], []
    for weight in weights:
        with tf.device(weight.device):
            copies.append(tf.Variable(tf.identity(weight), trainable=False))
            grads.append(tf.zeros_like(weight))
    stand_in = type(optimizer).from_config(optimizer.get_config())
    stand_in.build(copies)
    update = tf.function(lambda: stand_in.apply_gradients(zip(grads, copies)))
    update()  # traces
    return float(max(working_memory.call_peaks(allocator, update, repeats)))


def predict_fit(pipe: tfpipe_keras.PipelinedModel, x: Any, y: Any = None,
                batch_size: Optional[int] = None) -> Optional[memory_model.HostPeak]:
    """The predicted host peak of `pipe.fit(x, y, batch_size=batch_size)`: arrays `x`
    and `y`, or a tf.data.Dataset `x` of (features, targets) batches (then no `y` nor
    `batch_size`, as `fit` takes it); `pipe` must be compiled. None without allocator
    statistics for its cells' host."""
    devices = [cell.device for cell in pipe.cells]
    if memory_stats.allocator_devices(devices) != ['CPU:0']:
        return None
    if isinstance(x, tf.data.Dataset):
        sample = tf.nest.flatten(next(iter(x.take(1)))[0])[0]
    else:
        sample = tf.convert_to_tensor(x[:batch_size])
    if not pipe.built:
        pipe.build(tuple(sample.shape))
    # The input first, before other tf.data iterators of this process are torn down.
    input_measurement = working_memory.measure_input_pipeline(_FitInput(x, y, batch_size))
    if input_measurement is None:
        return None
    pipe.optimizer.build(pipe.trainable_variables)
    m, k_cells = pipe.num_micro_batches, len(pipe.cells)
    theta = {a.params.name: [v.value for v in a.layer.trainable_variables]
             for cell in pipe.cells for a in cell.layers}
    measured = working_memory.measure_cells(pipe.cells, theta, sample, m)
    if measured is None:
        return None
    slots_per_weight = _bytes(pipe.optimizer.variables) / max(_bytes(pipe.trainable_variables),
                                                              1.0)
    memory, held = [], []
    for k, (cell, cell_measured) in enumerate(zip(pipe.cells, measured)):
        weights = _bytes(v for a in cell.layers for v in a.layer.trainable_variables)
        static = (2 + slots_per_weight) * weights
        if cell.recompute:
            cell_memory = memory_model.CellMemory(cell.device, static, cell_measured.input_bytes,
                                                  cell_measured.working)
        else:
            cell_memory = memory_model.CellMemory(cell.device, static, cell_measured.working,
                                                  0.0)
        memory.append(cell_memory)
        held.append(memory_model.in_flight(pipe.schedule_name, k_cells, k, m)
                    * cell_memory.stash)
    parallelism = min(m, planner.local_parallelism(
        tf.config.threading.get_intra_op_parallelism_threads()))
    host = memory_model.host_peak(memory, held, parallelism, input_measurement.resident,
                                  input_measurement.peak)
    update = _update_bytes(pipe.optimizer, [v.value for v in pipe.trainable_variables],
                           'CPU:0')
    return dataclasses.replace(host, update=update)
