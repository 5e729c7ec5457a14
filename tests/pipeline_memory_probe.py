"""Peak memory of one pipelined training step per schedule, printed as JSON.

Run in a fresh process (tests/test_pipeline_memory.py does): the BFC allocator,
which keeps the peak statistics, must be switched on before TensorFlow loads,
and the test process has TensorFlow loaded already.
Usage: python -m tests.pipeline_memory_probe SCHEDULE [SCHEDULE ...]
Prints {recompute policy: {schedule: bytes}} for recompute 'never' and 'always'.
"""
import os
import sys

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

import gc  # noqa: E402
import json  # noqa: E402

import tensorflow as tf  # noqa: E402

import tfpipe  # noqa: E402
from tfpipe import fprop_context, layers  # noqa: E402
from tfpipe.pipeline import partition  # noqa: E402

# Activation-dominated: a micro-batch's activations (256 x 256 floats per layer)
# are as big as a layer's weights, and M=8 micro-batches are in flight.
K, M, BATCH, WIDTH, LAYERS = 4, 8, 2048, 256, 8


def step_transient(recompute: str, schedule: str) -> int:
    """Bytes allocated above the resident weights at the peak of one step, after warm-up."""
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=WIDTH, output_dim=WIDTH,
                                      activation='relu') for i in range(LAYERS)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(LAYERS, K), num_micro_batches=M,
        recompute=recompute, schedule=schedule,
        devices=[f'/CPU:{i}' for i in range(K)]).Instantiate()
    x = tf.random.stateless_normal([BATCH, WIDTH], seed=[1, 2])
    t = tf.random.stateless_normal([BATCH, WIDTH], seed=[3, 4])

    @tf.function
    def step():
        with fprop_context.training(step=0):
            loss, grads = pipe.ForwardBackward(
                pipe.theta, x, lambda out, y: tf.reduce_mean(tf.square(out - y), -1), t)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(1e-4 * g)
        return loss

    step()  # traces
    tf.config.experimental.reset_memory_stats('CPU:0')
    base = tf.config.experimental.get_memory_info('CPU:0')['current']
    step().numpy()
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
    del pipe, step
    gc.collect()
    return peak - base


def main(argv: list[str]) -> None:
    tfpipe.configure_logical_cpus(K)
    print(json.dumps({rc: {s: step_transient(rc, s) for s in argv}
                      for rc in ('never', 'always')}))


if __name__ == '__main__':
    main(sys.argv[1:])
