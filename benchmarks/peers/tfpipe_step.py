"""tfpipe's training step on the peers' model, as a library user writes it.

One definition for the benchmarks that time it: peers_benchmark.py's tfpipe worker
(tfpipe_pipe.py) and matmul_floor_benchmark.py. library_defaults_benchmark.py keeps its
own copy inside its child's code, because its --baseline runs another checkout's tfpipe.
Import this module after `tfpipe.configure_logical_cpus` (it imports TensorFlow).
"""
from __future__ import annotations

import tensorflow as tf

import steps
import tfpipe
from tfpipe import fprop_context, layers


def loss_fn(outputs, targets):
    return tf.reduce_mean(tf.square(outputs), axis=-1)


def build_step(cells: int, micro: int, schedule: str = 'fill_drain'):
    """A tf.function: one ForwardBackward over K=`cells`, M=`micro`, recompute on, then SGD."""
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=steps.WIDTH,
                                      output_dim=steps.WIDTH, activation='relu')
            for i in range(steps.LAYERS)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name=f'pipe{cells}x{micro}_{schedule}', body=body, num_cells=cells,
        num_micro_batches=micro, recompute='always', schedule=schedule).Instantiate()

    @tf.function
    def step(x):
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, x)
        for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(steps.LEARNING_RATE * grad)
        return loss

    return step
