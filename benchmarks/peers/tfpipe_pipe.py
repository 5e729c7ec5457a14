"""tfpipe's side of peers_benchmark.py: PipeliningLayer through the library, as a user runs it.

Run by the parent with the project's Python from the repository root (PYTHONPATH=.), one
process per kernel setting (TF_ENABLE_ONEDNN_OPTS in the environment) and thread setting:
`--threads=default` is tfpipe's own choice on logical CPUs, `intra/inter` passes both pools to
`configure_logical_cpus` (0 is TensorFlow's default). The README's library order: import
tfpipe, configure the logical CPUs, then build; the step is library_defaults_benchmark.py's.
"""
from __future__ import annotations

import steps

args = steps.parse_args(__doc__.split('\n\n')[0])

import tfpipe  # noqa: E402  (before TensorFlow, as the README shows)

threads = {} if args.threads == 'default' else dict(
    zip(('intra_op_threads', 'inter_op_threads'), (int(v) for v in args.threads.split('/'))))
tfpipe.configure_logical_cpus(8, **threads)

import tensorflow as tf  # noqa: E402
from tfpipe import fprop_context, layers, runtime_defaults  # noqa: E402


def loss_fn(outputs, targets):
    return tf.reduce_mean(tf.square(outputs), axis=-1)


def build_step(cells: int, micro: int):
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=steps.WIDTH,
                                      output_dim=steps.WIDTH, activation='relu')
            for i in range(steps.LAYERS)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name=f'pipe{cells}x{micro}', body=body, num_cells=cells, num_micro_batches=micro,
        recompute='always').Instantiate()

    @tf.function
    def step(x):
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, x)
        for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(steps.LEARNING_RATE * grad)
        return loss

    return step


x = tf.random.normal([steps.BATCH, steps.WIDTH])
for cells, micro in steps.configs(args.configs):
    step = build_step(cells, micro)
    ms = steps.median_step_ms(lambda: step(x).numpy(), args.warmup, args.steps)
    steps.report(cells, micro, ms, onednn=runtime_defaults.onednn_enabled(),
                 threads=[tf.config.threading.get_intra_op_parallelism_threads(),
                          tf.config.threading.get_inter_op_parallelism_threads()])
