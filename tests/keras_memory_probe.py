"""A user's Keras model pipelined by tfpipe.keras: predicted or measured host peak, in MiB.

Run in a process of its own per figure, whose TensorFlow runtime starts here (a fresh
interpreter, or one forked before the runtime starts, as tests/test_memory_prediction.py
does): the BFC allocator, which keeps the statistics, must be on before it starts, and a
prediction's own tensors would otherwise count in the measured peak.
Usage: python -m tests.keras_memory_probe predict|fit
Prints one number: keras_memory.predict_fit's peak, or the allocator's peak since
the process started after `fit` of STEPS steps.
"""
import os
import sys

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')  # as the trainer and the test session

import tfpipe  # noqa: E402

tfpipe.configure_logical_cpus(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpipe.keras  # noqa: E402
from tfpipe.tuning import keras_memory  # noqa: E402

BATCH, EXAMPLES, STEPS = 64, 256, 24


def pipelined() -> keras.Model:
    """Convolutions, then a wide dense layer: activations and weights both count."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation='relu', padding='same'),
        keras.layers.Conv2D(64, 3, activation='relu'),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation='relu'),
        keras.layers.Dense(10)])
    pipe = tfpipe.keras.pipeline(model, balance=[3, 3], num_micro_batches=2,
                                 recompute='always')
    pipe.compile(optimizer='adam',
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return pipe


def data() -> tf.data.Dataset:
    """Numpy arrays in a Dataset with explicit buffers: `fit` on the arrays themselves
    prefetches with AUTOTUNE, whose buffers grow when the CPUs are contended (docs/memory.md)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (EXAMPLES, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, EXAMPLES)
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=0).batch(
        BATCH).prefetch(2)


def main(mode: str) -> None:
    pipe = pipelined()
    if mode == 'predict':
        host = keras_memory.predict_fit(pipe, data())
        print(f'{host.peak / 2 ** 20:.3f}')
    else:
        pipe.fit(data(), epochs=STEPS * BATCH // EXAMPLES, verbose=0)
        print(f'{tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2 ** 20:.3f}')


if __name__ == '__main__':
    main(sys.argv[1])
