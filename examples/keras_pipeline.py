"""Pipelines a plain keras.Sequential with one call and trains it with fit().

`tfpipe.keras.pipeline` cuts the model into K=4 cells on 4 logical CPUs with
M=4 micro-batches and recompute on; compile / fit / evaluate / predict /
save_weights work as for any Keras model. The task (which of 4 Gaussian blobs
a point came from) is learnable, so the printed accuracy shows it trains; the
weights file also loads back into the plain Keras model.
"""
import os
import tempfile

import numpy as np

import tfpipe

tfpipe.configure_logical_cpus(4)

import keras  # noqa: E402  (after configuring devices)

import tfpipe.keras  # noqa: E402

NUM_CLASSES, DIM = 4, 16


def make_data(n, rng):
    centers = np.random.default_rng(0).normal(scale=2.0, size=[NUM_CLASSES, DIM])
    labels = rng.integers(0, NUM_CLASSES, size=n)
    return (centers[labels] + rng.normal(size=[n, DIM])).astype(np.float32), labels


def main():
    model = keras.Sequential([keras.Input((DIM,))] + [
        keras.layers.Dense(64, activation='relu') for _ in range(6)] + [
        keras.layers.Dropout(0.1), keras.layers.Dense(NUM_CLASSES)])
    pipe = tfpipe.keras.pipeline(model, num_cells=4, num_micro_batches=4, recompute='always')
    for cell in pipe.cells:
        print(f'cell {cell.index} on {cell.device}: '
              f'{[adapter.layer.name for adapter in cell.layers]}')
    pipe.compile(optimizer=keras.optimizers.Adam(1e-3),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 metrics=['accuracy'])
    rng = np.random.default_rng(1)
    x, y = make_data(4096, rng)
    x_test, y_test = make_data(512, rng)
    pipe.fit(x, y, batch_size=64, epochs=3, verbose=2)
    loss, accuracy = pipe.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f'test loss {loss:.3f}  accuracy {accuracy:.3f}')
    path = os.path.join(tempfile.mkdtemp(), 'pipe.weights.h5')
    pipe.save_weights(path)
    model.load_weights(path)  # the plain model now holds the trained weights
    same = np.allclose(model.predict(x_test, verbose=0), pipe.predict(x_test, verbose=0),
                       atol=1e-5)
    print(f'plain model with the saved weights predicts the same: {same}')


if __name__ == '__main__':
    main()
