"""Trains a pipelined MLP on 4 logical CPUs with data generated in-process.

The smallest end-to-end use of tfpipe: a body of layer params, cut into K=4
cells on 4 logical CPU devices, M=4 micro-batches, recompute on, the trainer's
step (`ForwardBackward`) inside a tf.function. The task (classify which of 4
Gaussian blobs a point came from) is learnable, so the printed accuracy shows
the pipelined step trains.
"""
import time

import numpy as np

import tfpipe

tfpipe.configure_logical_cpus(4)

import tensorflow as tf  # noqa: E402  (after configuring devices)

from tfpipe import fprop_context, layers  # noqa: E402

NUM_CLASSES, DIM, BATCH, STEPS = 4, 16, 64, 300


def make_data(n, rng):
    centers = np.random.default_rng(0).normal(scale=2.0, size=[NUM_CLASSES, DIM])
    labels = rng.integers(0, NUM_CLASSES, size=n)
    points = centers[labels] + rng.normal(size=[n, DIM])
    return points.astype(np.float32), labels.astype(np.int32)


def main():
    body = [layers.Dense.Params().Set(name='fc0', input_dim=DIM, output_dim=64,
                                      activation='relu')]
    body += [layers.Dense.Params().Set(name=f'fc{i}', input_dim=64, output_dim=64,
                                       activation='relu') for i in range(1, 6)]
    body += [layers.Dropout.Params().Set(name='drop', keep_prob=0.9),
             layers.Dense.Params().Set(name='logits', input_dim=64, output_dim=NUM_CLASSES)]
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, num_cells=4, num_micro_batches=4,
        recompute='always').Instantiate()
    print(f'balance {list(pipe.balance)} on {list(pipe.devices)}')
    optimizer_lr = 0.1

    def loss_fn(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    @tf.function
    def train_step(step, x, y):
        with fprop_context.training(step=step):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
        for var, grad in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            var.assign_sub(optimizer_lr * grad)
        return loss

    @tf.function
    def accuracy(x, y):
        with fprop_context.evaluation():
            predictions = tf.argmax(pipe(x), -1, output_type=tf.int32)
        return tf.reduce_mean(tf.cast(predictions == y, tf.float32))

    rng = np.random.default_rng(1)
    test_x, test_y = make_data(1024, rng)
    start = time.time()
    for step in range(STEPS):
        x, y = make_data(BATCH, rng)
        loss = train_step(tf.constant(step, tf.int64), x, y)
        if step % 50 == 0 or step == STEPS - 1:
            acc = accuracy(test_x, test_y)
            print(f'step {step:4d}  loss {float(loss):.4f}  test accuracy {float(acc):.3f}  '
                  f'({time.time() - start:.1f}s)')
    final = float(accuracy(test_x, test_y))
    print(f'final test accuracy {final:.3f}')
    if final < 0.9:
        raise SystemExit(f'accuracy {final:.3f} < 0.9: training did not converge')


if __name__ == '__main__':
    main()
